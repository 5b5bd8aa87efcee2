//! `TokenspeedGrpcLoadSource`: `TokenSpeedScheduler/GetLoads` over gRPC.

use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::WorkerLoad;
use policy_core::{BackendError, LoadError, LoadSource, SourceOptions};
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::proto::GetLoadsRequest;
use crate::proto::token_speed_scheduler_client::TokenSpeedSchedulerClient;
use crate::worker_load_from_grpc;

/// TokenSpeed's load over gRPC: `GetLoads` with `include = ["core"]`.
///
/// The channel is made with `Endpoint::connect_lazy` on the first poll (so a
/// source can be built outside a Tokio runtime) and reconnects by itself. The
/// deadline of [`SourceOptions`] is the connect timeout and the request
/// timeout, and bounds the whole call; replies larger than the body cap are
/// refused; the API key goes out as `authorization: Bearer …`.
///
/// Outcomes:
/// - an empty `loads` list (encode-only worker) → `Ok(None)`;
/// - `DEADLINE_EXCEEDED` from the server → `Ok(None)`: no snapshot this time,
///   not an error that takes the worker out (wire-formats.md);
/// - no answer within our own deadline → [`LoadError::Timeout`]: a server
///   that does not answer at all is a failed poll, unlike one that reports
///   `DEADLINE_EXCEEDED`;
/// - `UNIMPLEMENTED` → [`LoadError::Unsupported`];
/// - `UNAVAILABLE` from a failed connection → [`LoadError::Connect`];
/// - a reply over the body cap → [`LoadError::BodyTooLarge`];
/// - any other status (a server's own `UNAVAILABLE` included) →
///   [`LoadError::Grpc`] with the [`Status`] as its source.
#[derive(Debug)]
pub struct TokenspeedGrpcLoadSource {
    url: String,
    endpoint: Endpoint,
    client: OnceLock<TokenSpeedSchedulerClient<Channel>>,
    deadline: Duration,
    body_limit_bytes: usize,
    authorization: Option<AsciiMetadataValue>,
}

impl TokenspeedGrpcLoadSource {
    /// A source calling the scheduler at `url` (`grpc://host:port`).
    ///
    /// Fails with [`BackendError::InvalidAddress`] for any other address and
    /// with [`BackendError::Client`] for an API key that cannot be metadata.
    /// No connection is made here.
    pub fn new(
        url: &str,
        options: &SourceOptions,
    ) -> Result<TokenspeedGrpcLoadSource, BackendError> {
        let authority = policy_core::grpc_authority(url)?;
        let endpoint = Endpoint::from_shared(format!("http://{authority}")).map_err(|_| {
            BackendError::InvalidAddress {
                url: url.to_owned(),
                reason: "not a valid host:port",
            }
        })?;
        let authorization = options
            .api_key
            .as_ref()
            .map(|key| {
                MetadataValue::try_from(format!("Bearer {key}")).map(|mut value| {
                    // Kept out of Debug output and logs.
                    value.set_sensitive(true);
                    value
                })
            })
            .transpose()
            .map_err(|source| BackendError::Client {
                url: url.to_owned(),
                source: source.into(),
            })?;
        Ok(TokenspeedGrpcLoadSource {
            endpoint: endpoint
                .connect_timeout(options.deadline)
                .timeout(options.deadline),
            url: url.to_owned(),
            client: OnceLock::new(),
            deadline: options.deadline,
            body_limit_bytes: options.body_limit_bytes,
            authorization,
        })
    }

    fn client(&self) -> TokenSpeedSchedulerClient<Channel> {
        self.client
            .get_or_init(|| {
                TokenSpeedSchedulerClient::new(self.endpoint.connect_lazy())
                    .max_decoding_message_size(self.body_limit_bytes)
            })
            .clone()
    }

    fn status_error(&self, status: Status) -> LoadError {
        let url = self.url.clone();
        match status.code() {
            Code::Unimplemented => LoadError::Unsupported {
                url,
                what: "GetLoads",
            },
            Code::OutOfRange if status.message().contains("message length too large") => {
                LoadError::BodyTooLarge {
                    url,
                    limit_bytes: self.body_limit_bytes,
                }
            }
            Code::Unavailable if is_connect_failure(&status) => LoadError::Connect {
                url,
                source: status.into(),
            },
            _ => LoadError::Grpc {
                url,
                source: status.into(),
            },
        }
    }
}

#[async_trait]
impl LoadSource for TokenspeedGrpcLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let mut request = tonic::Request::new(GetLoadsRequest {
            dp_rank: None,
            include: vec!["core".to_owned()],
        });
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        let mut client = self.client();
        let response = match tokio::time::timeout(self.deadline, client.get_loads(request)).await {
            Err(_elapsed) => {
                return Err(LoadError::Timeout {
                    url: self.url.clone(),
                    deadline: self.deadline,
                });
            }
            Ok(Err(status)) if status.code() == Code::DeadlineExceeded => return Ok(None),
            Ok(Err(status)) if is_own_timeout(&status) => {
                return Err(LoadError::Timeout {
                    url: self.url.clone(),
                    deadline: self.deadline,
                });
            }
            Ok(Err(status)) => return Err(self.status_error(status)),
            Ok(Ok(response)) => response.into_inner(),
        };
        worker_load_from_grpc(response).map_err(|source| LoadError::Invalid {
            url: self.url.clone(),
            source,
        })
    }

    fn kind(&self) -> &'static str {
        crate::BACKEND
    }

    fn load_url(&self) -> &str {
        &self.url
    }
}

/// Whether tonic made this status from a failed connection rather than
/// receiving it from a server.
fn is_connect_failure(status: &Status) -> bool {
    caused_by(status, |error| {
        error.is::<tonic::ConnectError>() || error.is::<std::io::Error>()
    })
}

/// Whether tonic made this (`CANCELLED`) status because the endpoint's own
/// request timeout expired.
fn is_own_timeout(status: &Status) -> bool {
    caused_by(status, |error| error.is::<tonic::TimeoutExpired>())
}

fn caused_by(status: &Status, test: impl Fn(&(dyn std::error::Error + 'static)) -> bool) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if test(error) {
            return true;
        }
        source = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_made_by_tonic_are_told_from_server_statuses() {
        let own = Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert_eq!(own.code(), Code::Cancelled);
        assert!(is_own_timeout(&own));
        assert!(!is_own_timeout(&Status::cancelled("Timeout expired")));

        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let connect = Status::from_error(Box::new(tonic::ConnectError(Box::new(refused))));
        assert_eq!(connect.code(), Code::Unavailable);
        assert!(is_connect_failure(&connect));
        assert!(!is_connect_failure(&Status::unavailable("draining")));
    }
}

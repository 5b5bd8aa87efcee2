//! What every gRPC (tonic) load source shares, behind the `grpc` feature:
//! the endpoint of a `grpc://` load address, the bearer token as metadata,
//! a failed call's status as a [`LoadError`], and [`GrpcLoadSource`], the
//! whole source for a backend that only says how to call its `GetLoads`
//! ([`GetLoads`]).

use std::future::Future;
use std::time::Duration;

use policy_core::{BackendError, LoadError};
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::Endpoint;
use tonic::{Code, Status};

mod source;

pub use source::{GetLoads, GrpcLoadSource};

/// The `host:port` of a gRPC load address, `grpc://host:port` with an
/// optional trailing `/`, checked the same way for every gRPC backend.
pub fn grpc_authority(url: &str) -> Result<&str, BackendError> {
    let invalid = |reason| BackendError::InvalidAddress {
        url: url.to_owned(),
        reason,
    };
    let authority = url
        .strip_prefix("grpc://")
        .ok_or_else(|| invalid("expected grpc://host:port"))?;
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
        return Err(invalid("expected grpc://host:port"));
    }
    // `[::1]` has colons but no port: the port follows the last `]`.
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, port),
        _ => return Err(invalid("missing port")),
    };
    if host.is_empty() || host == "[]" {
        return Err(invalid("missing host"));
    }
    if host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid("not a valid host:port"));
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(authority),
        _ => Err(invalid("invalid port")),
    }
}

/// The endpoint of a `grpc://host:port` load address; no connection is made.
pub fn grpc_endpoint(url: &str) -> Result<Endpoint, BackendError> {
    let authority = grpc_authority(url)?;
    Endpoint::from_shared(format!("http://{authority}")).map_err(|_| BackendError::InvalidAddress {
        url: url.to_owned(),
        reason: "not a valid host:port",
    })
}

/// `Bearer <api_key>` as metadata, marked sensitive so that it stays out of
/// Debug output and logs.
pub fn bearer_metadata(
    url: &str,
    api_key: Option<&str>,
) -> Result<Option<AsciiMetadataValue>, BackendError> {
    api_key
        .map(|key| {
            MetadataValue::try_from(format!("Bearer {key}")).map(|mut value| {
                value.set_sensitive(true);
                value
            })
        })
        .transpose()
        .map_err(|source| BackendError::Client {
            url: url.to_owned(),
            source: source.into(),
        })
}

/// A request for `message`, with the source's `Authorization` metadata
/// (from [`bearer_metadata`]) when it has a key.
pub fn authorized_request<T>(
    message: T,
    authorization: Option<&AsciiMetadataValue>,
) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(authorization) = authorization {
        request
            .metadata_mut()
            .insert("authorization", authorization.clone());
    }
    request
}

/// One load RPC's target, for [`LoadRpc::call`]'s failure handling.
#[derive(Debug, Clone, Copy)]
pub struct LoadRpc<'a> {
    pub url: &'a str,
    /// The RPC's name in [`LoadError::Unsupported`].
    pub what: &'static str,
    pub deadline: Duration,
    pub body_limit_bytes: usize,
    /// A server-sent `DEADLINE_EXCEEDED` means "no report this time"
    /// (TokenSpeed) rather than a timed-out poll.
    pub deadline_exceeded_is_no_report: bool,
}

impl LoadRpc<'_> {
    /// Awaits `call` for at most the deadline: its reply, `None` for a
    /// server-sent `DEADLINE_EXCEEDED` when that means no report, or the
    /// failure as a [`LoadError`] (our deadline, tonic's own timeout and a
    /// server's `DEADLINE_EXCEEDED` are [`LoadError::Timeout`]; the rest as
    /// [`status_load_error`]).
    pub async fn call<T>(
        &self,
        call: impl Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<Option<T>, LoadError> {
        let timeout = || LoadError::Timeout {
            url: self.url.to_owned(),
            deadline: self.deadline,
        };
        match tokio::time::timeout(self.deadline, call).await {
            Err(_elapsed) => Err(timeout()),
            Ok(Ok(response)) => Ok(Some(response.into_inner())),
            Ok(Err(status))
                if status.code() == Code::DeadlineExceeded
                    && self.deadline_exceeded_is_no_report =>
            {
                Ok(None)
            }
            Ok(Err(status))
                if status.code() == Code::DeadlineExceeded || is_own_timeout(&status) =>
            {
                Err(timeout())
            }
            Ok(Err(status)) => Err(status_load_error(
                self.url,
                self.what,
                self.body_limit_bytes,
                status,
            )),
        }
    }
}

/// A failed call as a [`LoadError`]: `UNIMPLEMENTED` is unsupported (`what`
/// names the RPC), the client's own size check is an oversized body, a
/// failed connection is a connect error, anything else a gRPC error.
/// Timeouts are [`LoadRpc::call`]'s to read.
pub fn status_load_error(
    url: &str,
    what: &'static str,
    body_limit_bytes: usize,
    status: Status,
) -> LoadError {
    let url = url.to_owned();
    match status.code() {
        Code::Unimplemented => LoadError::Unsupported { url, what },
        // tonic's `max_decoding_message_size` check, reported with this
        // message and no source.
        Code::OutOfRange if status.message().contains("message length too large") => {
            LoadError::BodyTooLarge {
                url,
                limit_bytes: body_limit_bytes,
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
        assert!(matches!(
            status_load_error("grpc://h:1", "GetLoads", 10, connect),
            LoadError::Connect { .. }
        ));
        assert!(matches!(
            status_load_error(
                "grpc://h:1",
                "GetLoads",
                10,
                Status::unavailable("draining")
            ),
            LoadError::Grpc { .. }
        ));
        assert!(matches!(
            status_load_error("grpc://h:1", "GetLoads", 10, Status::unimplemented("")),
            LoadError::Unsupported {
                what: "GetLoads",
                ..
            }
        ));
        let too_large = Status::out_of_range("Error, decoded message length too large: 99");
        assert!(matches!(
            status_load_error("grpc://h:1", "GetLoads", 10, too_large),
            LoadError::BodyTooLarge {
                limit_bytes: 10,
                ..
            }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_maps_deadlines_by_the_backend_s_reading() {
        let rpc = LoadRpc {
            url: "grpc://h:1",
            what: "GetLoads",
            deadline: Duration::from_millis(500),
            body_limit_bytes: 10,
            deadline_exceeded_is_no_report: false,
        };
        let reply = async { Ok(tonic::Response::new(7u8)) };
        assert_eq!(rpc.call(reply).await.unwrap(), Some(7));
        let never = std::future::pending::<Result<tonic::Response<u8>, Status>>();
        assert!(matches!(
            rpc.call(never).await,
            Err(LoadError::Timeout { .. })
        ));
        let exceeded = || async { Err::<tonic::Response<u8>, _>(Status::deadline_exceeded("")) };
        assert!(matches!(
            rpc.call(exceeded()).await,
            Err(LoadError::Timeout { .. })
        ));
        let no_report = LoadRpc {
            deadline_exceeded_is_no_report: true,
            ..rpc
        };
        assert_eq!(no_report.call(exceeded()).await.unwrap(), None);
        let unimplemented = async { Err::<tonic::Response<u8>, _>(Status::unimplemented("")) };
        assert!(matches!(
            rpc.call(unimplemented).await,
            Err(LoadError::Unsupported {
                what: "GetLoads",
                ..
            })
        ));
    }

    #[test]
    fn the_bearer_token_is_sensitive_metadata() {
        let value = bearer_metadata("grpc://h:1", Some("k")).unwrap().unwrap();
        assert!(value.is_sensitive());
        assert_eq!(value.to_str().unwrap(), "Bearer k");
        assert!(bearer_metadata("grpc://h:1", None).unwrap().is_none());
        assert!(matches!(
            bearer_metadata("grpc://h:1", Some("bad\nkey")),
            Err(BackendError::Client { .. })
        ));
    }

    #[test]
    fn grpc_addresses_are_checked() {
        assert_eq!(
            grpc_authority("grpc://10.0.0.1:30001").unwrap(),
            "10.0.0.1:30001"
        );
        assert_eq!(
            grpc_authority("grpc://engine-0:9000/").unwrap(),
            "engine-0:9000"
        );
        assert_eq!(grpc_authority("grpc://[::1]:50051").unwrap(), "[::1]:50051");
        for (bad, reason) in [
            ("http://host:1", "expected grpc://host:port"),
            ("127.0.0.1:50051", "expected grpc://host:port"),
            ("grpc://", "expected grpc://host:port"),
            ("grpc://host:1/v1/loads", "expected grpc://host:port"),
            ("grpc://host", "missing port"),
            ("grpc://[::1]", "missing port"),
            ("grpc://:50051", "missing host"),
            ("grpc://bad host:1", "not a valid host:port"),
            ("grpc://host:notaport", "invalid port"),
            ("grpc://host:0", "invalid port"),
            ("grpc://host:70000", "invalid port"),
        ] {
            match grpc_authority(bad) {
                Err(BackendError::InvalidAddress { url, reason: got }) => {
                    assert_eq!((url.as_str(), got), (bad, reason));
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn endpoints_come_from_grpc_addresses() {
        assert_eq!(
            grpc_endpoint("grpc://10.0.0.1:30001")
                .unwrap()
                .uri()
                .to_string(),
            "http://10.0.0.1:30001/"
        );
        assert!(grpc_endpoint("http://10.0.0.1:30001").is_err());
    }
}

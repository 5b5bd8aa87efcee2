//! `SglangGrpcLoadSource`: `SglangScheduler/GetLoads` over gRPC.

use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::WorkerLoad;
use load_transport::grpc;
use policy_core::{BackendError, LoadError, SourceOptions};
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

use crate::proto::GetLoadsRequest;
use crate::proto::sglang_scheduler_client::SglangSchedulerClient;
use crate::worker_load_from_grpc;

/// SGLang's load over gRPC: `GetLoads` with `include = ["core"]`.
///
/// The channel is made with `Endpoint::connect_lazy` on the first poll (so a
/// source can be built outside a Tokio runtime) and reconnects by itself. The
/// deadline of [`SourceOptions`] is the connect timeout and the request
/// timeout, and bounds the whole call; replies larger than the body cap are
/// refused; the API key goes out as `authorization: Bearer …`.
///
/// Outcomes:
/// - an empty `loads` list → `Ok(None)`;
/// - `UNIMPLEMENTED` → [`LoadError::Unsupported`];
/// - `DEADLINE_EXCEEDED`, or no answer within our own deadline →
///   [`LoadError::Timeout`];
/// - `UNAVAILABLE` from a failed connection → [`LoadError::Connect`];
/// - a reply over the body cap → [`LoadError::BodyTooLarge`];
/// - any other status (a server's own `UNAVAILABLE` included) →
///   [`LoadError::Grpc`] with the [`Status`] as its source.
#[derive(Debug)]
pub struct SglangGrpcLoadSource {
    url: String,
    endpoint: Endpoint,
    client: OnceLock<SglangSchedulerClient<Channel>>,
    deadline: Duration,
    body_limit_bytes: usize,
    authorization: Option<AsciiMetadataValue>,
}

impl SglangGrpcLoadSource {
    /// A source calling the scheduler at `url` (`grpc://host:port`).
    ///
    /// Fails with [`BackendError::InvalidAddress`] for any other address and
    /// with [`BackendError::Client`] for an API key that cannot be metadata.
    /// No connection is made here.
    pub fn new(url: &str, options: &SourceOptions) -> Result<SglangGrpcLoadSource, BackendError> {
        let endpoint = grpc::grpc_endpoint(url)?;
        let authorization = grpc::bearer_metadata(url, options.api_key.as_deref())?;
        Ok(SglangGrpcLoadSource {
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

    fn client(&self) -> SglangSchedulerClient<Channel> {
        self.client
            .get_or_init(|| {
                SglangSchedulerClient::new(self.endpoint.connect_lazy())
                    .max_decoding_message_size(self.body_limit_bytes)
            })
            .clone()
    }
}

#[async_trait]
impl policy_core::LoadSource for SglangGrpcLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let request = grpc::authorized_request(
            GetLoadsRequest {
                dp_rank: None,
                include: vec!["core".to_owned()],
            },
            self.authorization.as_ref(),
        );
        let mut client = self.client();
        let rpc = grpc::LoadRpc {
            url: &self.url,
            what: "GetLoads",
            deadline: self.deadline,
            body_limit_bytes: self.body_limit_bytes,
            deadline_exceeded_is_no_report: false,
        };
        let Some(response) = rpc.call(client.get_loads(request)).await? else {
            return Ok(None);
        };
        worker_load_from_grpc(response).map_err(|source| LoadError::Invalid {
            url: self.url.clone(),
            source,
        })
    }

    fn kind(&self) -> &'static str {
        "sglang-grpc"
    }

    fn load_url(&self) -> &str {
        &self.url
    }
}

//! vLLM gRPC `GetLoads` → [`WorkerLoad`]: the pure conversion and the
//! [`LoadSource`] that calls it.

use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::{
    LoadValidationError, SchedulerLoadSnapshot, WorkerLoad, throughput_from_proto3,
};
use load_transport::grpc;
use policy_core::{BackendError, BackendSpec, LoadError, LoadSource};
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

use crate::proto::vllm_engine_client::VllmEngineClient;
use crate::proto::{GetLoadsRequest, GetLoadsResponse, SchedulerLoad};

/// The backend name of [`VllmGrpcLoadSource`].
pub const GRPC_KIND: &str = "vllm-grpc";

/// Converts a `GetLoadsResponse` into a validated [`WorkerLoad`].
///
/// - An empty `loads` list is `Ok(None)`: no report this time.
/// - Queued tokens are not reported (vLLM has no such field).
/// - `gen_throughput` 0 is "not reported" (proto3 gives doubles no presence,
///   and vLLM servers leave it 0).
/// - Everything else goes through [`WorkerLoad::from_ranks`]: negative counts
///   and NaN, infinite or negative `token_usage` are rejected, a usage above 1
///   is clamped.
pub fn worker_load_from_grpc(
    response: GetLoadsResponse,
) -> Result<Option<WorkerLoad>, LoadValidationError> {
    if response.loads.is_empty() {
        return Ok(None);
    }
    let ranks = response.loads.into_iter().map(snapshot_from_grpc).collect();
    WorkerLoad::from_ranks(ranks).map(Some)
}

/// One rank of a `GetLoadsResponse` as a [`SchedulerLoadSnapshot`], before
/// validation.
pub fn snapshot_from_grpc(load: SchedulerLoad) -> SchedulerLoadSnapshot {
    SchedulerLoadSnapshot {
        dp_rank: i64::from(load.dp_rank),
        num_running_reqs: i64::from(load.num_running_reqs),
        num_waiting_reqs: i64::from(load.num_waiting_reqs),
        num_waiting_uncached_tokens: None,
        num_total_reqs: i64::from(load.num_total_reqs),
        num_used_tokens: i64::from(load.num_used_tokens),
        max_total_num_tokens: i64::from(load.max_total_num_tokens),
        token_usage: load.token_usage,
        gen_throughput: throughput_from_proto3(load.gen_throughput),
        cache_hit_rate: load.cache_hit_rate,
        utilization: load.utilization,
        max_running_requests: i64::from(load.max_running_requests),
    }
}

/// Polls vLLM's `vllm.grpc.engine.VllmEngine/GetLoads`.
///
/// The channel connects lazily on the first poll and reconnects by itself.
/// The API key, when set, is sent as `authorization: Bearer <key>` metadata.
/// Each poll is bounded by the deadline (connection included) and carries it
/// as `grpc-timeout`. Errors:
///
/// - no answer within the deadline, or `DEADLINE_EXCEEDED` →
///   [`LoadError::Timeout`];
/// - connection refused (tonic's `UNAVAILABLE` caused by a
///   [`tonic::ConnectError`]) → [`LoadError::Connect`];
/// - `UNIMPLEMENTED` → [`LoadError::Unsupported`];
/// - a response larger than `body_limit_bytes` → [`LoadError::BodyTooLarge`];
/// - any other status, a server-sent `UNAVAILABLE` included →
///   [`LoadError::Grpc`], whose source is the [`tonic::Status`];
/// - impossible values → [`LoadError::Invalid`].
#[derive(Debug)]
pub struct VllmGrpcLoadSource {
    url: String,
    endpoint: Endpoint,
    channel: OnceLock<Channel>,
    deadline: Duration,
    body_limit_bytes: usize,
    authorization: Option<tonic::metadata::AsciiMetadataValue>,
}

impl VllmGrpcLoadSource {
    /// Builds the source for a `grpc://host:port` load address. Nothing is
    /// connected until the first poll.
    pub fn new(spec: &BackendSpec) -> Result<VllmGrpcLoadSource, BackendError> {
        let url = spec.required_load_url(GRPC_KIND)?.to_owned();
        let endpoint = grpc::grpc_endpoint(&url)?.connect_timeout(spec.options.deadline);
        let authorization = grpc::bearer_metadata(&url, spec.options.api_key.as_deref())?;
        Ok(VllmGrpcLoadSource {
            url,
            endpoint,
            channel: OnceLock::new(),
            deadline: spec.options.deadline,
            body_limit_bytes: spec.options.body_limit_bytes,
            authorization,
        })
    }

    async fn get_loads(&self) -> Result<tonic::Response<GetLoadsResponse>, Status> {
        // `connect_lazy` spawns onto the runtime, so it waits for the first
        // poll rather than running in the (synchronous) factory.
        let channel = self
            .channel
            .get_or_init(|| self.endpoint.connect_lazy())
            .clone();
        let mut client =
            VllmEngineClient::new(channel).max_decoding_message_size(self.body_limit_bytes);
        let mut request = grpc::authorized_request(
            GetLoadsRequest {
                dp_rank: None,
                include: vec!["core".to_owned()],
            },
            self.authorization.as_ref(),
        );
        request.set_timeout(self.deadline);
        client.get_loads(request).await
    }
}

#[async_trait]
impl LoadSource for VllmGrpcLoadSource {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let rpc = grpc::LoadRpc {
            url: &self.url,
            what: "vllm.grpc.engine.VllmEngine/GetLoads",
            deadline: self.deadline,
            body_limit_bytes: self.body_limit_bytes,
            deadline_exceeded_is_no_report: false,
        };
        let Some(response) = rpc.call(self.get_loads()).await? else {
            return Ok(None);
        };
        worker_load_from_grpc(response).map_err(|source| LoadError::Invalid {
            url: self.url.clone(),
            source,
        })
    }

    fn kind(&self) -> &'static str {
        GRPC_KIND
    }

    fn load_url(&self) -> &str {
        &self.url
    }
}

//! vLLM gRPC `GetLoads` → [`WorkerLoad`]: the pure conversion and the
//! load source that calls it.

use load_protocols::{
    LoadValidationError, SchedulerLoadSnapshot, WorkerLoad, throughput_from_proto3,
};
use load_transport::grpc::{GetLoads, GrpcLoadSource};
use tonic::transport::Channel;

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
    WorkerLoad::from_report(response.loads.into_iter().map(snapshot_from_grpc).collect())
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

/// Polls vLLM's `vllm.grpc.engine.VllmEngine/GetLoads` with
/// `include = ["core"]`, on [`GrpcLoadSource`] (connection, deadline, key,
/// body cap and outcomes are its). Each poll also carries its deadline to
/// the server as `grpc-timeout`; a server-sent `DEADLINE_EXCEEDED` is a
/// timed-out poll.
///
/// Build one with `VllmGrpcLoadSource::from_spec(&spec)` (the spec's load
/// address is required) or `VllmGrpcLoadSource::new(url, &options)`.
pub type VllmGrpcLoadSource = GrpcLoadSource<VllmGetLoads>;

/// vLLM's `GetLoads`, as [`GrpcLoadSource`] calls it.
#[derive(Debug)]
pub struct VllmGetLoads;

impl GetLoads for VllmGetLoads {
    type Reply = GetLoadsResponse;

    const KIND: &'static str = GRPC_KIND;
    const WHAT: &'static str = "vllm.grpc.engine.VllmEngine/GetLoads";
    const SENDS_DEADLINE: bool = true;

    async fn call(
        channel: Channel,
        body_limit_bytes: usize,
        request: tonic::Request<()>,
    ) -> Result<tonic::Response<GetLoadsResponse>, tonic::Status> {
        let request = request.map(|()| GetLoadsRequest {
            dp_rank: None,
            include: vec!["core".to_owned()],
        });
        VllmEngineClient::new(channel)
            .max_decoding_message_size(body_limit_bytes)
            .get_loads(request)
            .await
    }

    fn worker_load(reply: GetLoadsResponse) -> Result<Option<WorkerLoad>, LoadValidationError> {
        worker_load_from_grpc(reply)
    }
}

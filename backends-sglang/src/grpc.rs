//! `SglangGrpcLoadSource`: `SglangScheduler/GetLoads` over gRPC.

use load_protocols::{LoadValidationError, WorkerLoad};
use load_transport::grpc::{GetLoads, GrpcLoadSource};
use tonic::transport::Channel;

use crate::proto::sglang_scheduler_client::SglangSchedulerClient;
use crate::proto::{GetLoadsRequest, GetLoadsResponse};
use crate::worker_load_from_grpc;

/// SGLang's load over gRPC: `GetLoads` with `include = ["core"]`, on
/// [`GrpcLoadSource`] (connection, deadline, key, body cap and outcomes are
/// its). A server-sent `DEADLINE_EXCEEDED` is a timed-out poll.
///
/// Build one with `SglangGrpcLoadSource::new(url, &options)`.
pub type SglangGrpcLoadSource = GrpcLoadSource<SglangGetLoads>;

/// SGLang's `GetLoads`, as [`GrpcLoadSource`] calls it.
#[derive(Debug)]
pub struct SglangGetLoads;

impl GetLoads for SglangGetLoads {
    type Reply = GetLoadsResponse;

    const KIND: &'static str = crate::GRPC_BACKEND;

    async fn call(
        channel: Channel,
        body_limit_bytes: usize,
        request: tonic::Request<()>,
    ) -> Result<tonic::Response<GetLoadsResponse>, tonic::Status> {
        let request = request.map(|()| GetLoadsRequest {
            dp_rank: None,
            include: vec!["core".to_owned()],
        });
        SglangSchedulerClient::new(channel)
            .max_decoding_message_size(body_limit_bytes)
            .get_loads(request)
            .await
    }

    fn worker_load(reply: GetLoadsResponse) -> Result<Option<WorkerLoad>, LoadValidationError> {
        worker_load_from_grpc(reply)
    }
}

//! `TokenspeedGrpcLoadSource`: `TokenSpeedScheduler/GetLoads` over gRPC.

use load_protocols::{LoadValidationError, WorkerLoad};
use load_transport::grpc::{GetLoads, GrpcLoadSource};
use tonic::transport::Channel;

use crate::proto::token_speed_scheduler_client::TokenSpeedSchedulerClient;
use crate::proto::{GetLoadsRequest, GetLoadsResponse};
use crate::worker_load_from_grpc;

/// TokenSpeed's load over gRPC: `GetLoads` with `include = ["core"]`, on
/// [`GrpcLoadSource`] (connection, deadline, key, body cap and outcomes are
/// its).
///
/// An empty `loads` list (an encode-only worker) and a server-sent
/// `DEADLINE_EXCEEDED` are both `Ok(None)`: no snapshot this time, not an
/// error that takes the worker out (wire-formats.md). A server that does not
/// answer within our own deadline is still a failed poll
/// ([`LoadError::Timeout`](policy_core::LoadError::Timeout)).
///
/// Build one with `TokenspeedGrpcLoadSource::new(url, &options)`.
pub type TokenspeedGrpcLoadSource = GrpcLoadSource<TokenspeedGetLoads>;

/// TokenSpeed's `GetLoads`, as [`GrpcLoadSource`] calls it.
#[derive(Debug)]
pub struct TokenspeedGetLoads;

impl GetLoads for TokenspeedGetLoads {
    type Reply = GetLoadsResponse;

    const KIND: &'static str = crate::BACKEND;
    const DEADLINE_EXCEEDED_IS_NO_REPORT: bool = true;

    async fn call(
        channel: Channel,
        body_limit_bytes: usize,
        request: tonic::Request<()>,
    ) -> Result<tonic::Response<GetLoadsResponse>, tonic::Status> {
        let request = request.map(|()| GetLoadsRequest {
            dp_rank: None,
            include: vec!["core".to_owned()],
        });
        TokenSpeedSchedulerClient::new(channel)
            .max_decoding_message_size(body_limit_bytes)
            .get_loads(request)
            .await
    }

    fn worker_load(reply: GetLoadsResponse) -> Result<Option<WorkerLoad>, LoadValidationError> {
        worker_load_from_grpc(reply)
    }
}

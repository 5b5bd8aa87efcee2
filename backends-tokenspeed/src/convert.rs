//! Pure conversions from TokenSpeed's `GetLoadsResponse` into [`WorkerLoad`].

use load_protocols::{
    LoadValidationError, SchedulerLoadSnapshot, WorkerLoad, proto3_count as saturate,
    queued_tokens_from_proto3, throughput_from_proto3,
};

use crate::proto;

/// One TokenSpeed `SchedulerLoad` as a snapshot.
///
/// Released TokenSpeed servers fill running, waiting, total, used tokens, max
/// tokens and `token_usage` only. The proto3 rules of `docs/wire-formats.md` decide
/// what was reported: `num_waiting_uncached_tokens` (field 14) counts when it
/// is positive or nothing is waiting, so a released server's 0 next to waiting
/// requests is "not reported" (kept as `None`; the policy then estimates the
/// queue from the waiting requests); a zero `gen_throughput` is "not reported".
pub fn snapshot_from_grpc(load: &proto::SchedulerLoad) -> SchedulerLoadSnapshot {
    SchedulerLoadSnapshot {
        dp_rank: load.dp_rank.into(),
        num_running_reqs: load.num_running_reqs.into(),
        num_waiting_reqs: load.num_waiting_reqs.into(),
        num_waiting_uncached_tokens: queued_tokens_from_proto3(
            load.num_waiting_uncached_tokens.into(),
            load.num_waiting_reqs.into(),
        ),
        num_total_reqs: load.num_total_reqs.into(),
        num_used_tokens: load.num_used_tokens.into(),
        max_total_num_tokens: load.max_total_num_tokens.into(),
        token_usage: load.token_usage,
        gen_throughput: throughput_from_proto3(load.gen_throughput),
        cache_hit_rate: load.cache_hit_rate,
        utilization: load.utilization,
        max_running_requests: load.max_running_requests.into(),
    }
}

/// A TokenSpeed `GetLoadsResponse` as a validated [`WorkerLoad`].
///
/// An empty `loads` list (an encode-only worker) is `Ok(None)`: no report this
/// time. Impossible values (negative counts, a NaN or infinite `token_usage`)
/// reject the report; `token_usage` above 1 is clamped to 1 (see
/// [`WorkerLoad::from_ranks`]).
pub fn worker_load_from_grpc(
    response: proto::GetLoadsResponse,
) -> Result<Option<WorkerLoad>, LoadValidationError> {
    WorkerLoad::from_report(response.loads.iter().map(snapshot_from_grpc).collect())
}

/// A snapshot as the message a TokenSpeed server would send, for servers that
/// speak TokenSpeed's protocol (the engine simulator).
///
/// Counts beyond `i32` saturate. A signal that is not reported is sent as 0,
/// which the presence rules read back as "not reported" (queued tokens: when
/// requests are waiting).
pub fn grpc_from_snapshot(snapshot: &SchedulerLoadSnapshot) -> proto::SchedulerLoad {
    proto::SchedulerLoad {
        dp_rank: saturate(snapshot.dp_rank),
        num_running_reqs: saturate(snapshot.num_running_reqs),
        num_waiting_reqs: saturate(snapshot.num_waiting_reqs),
        num_total_reqs: saturate(snapshot.num_total_reqs),
        num_used_tokens: saturate(snapshot.num_used_tokens),
        max_total_num_tokens: saturate(snapshot.max_total_num_tokens),
        max_running_requests: saturate(snapshot.max_running_requests),
        token_usage: snapshot.token_usage,
        gen_throughput: snapshot.gen_throughput.unwrap_or(0.0),
        cache_hit_rate: snapshot.cache_hit_rate,
        utilization: snapshot.utilization,
        num_waiting_uncached_tokens: saturate(snapshot.num_waiting_uncached_tokens.unwrap_or(0)),
    }
}

impl TryFrom<proto::GetLoadsResponse> for WorkerLoad {
    type Error = LoadValidationError;

    /// Like [`worker_load_from_grpc`], with an empty report an error
    /// ([`LoadValidationError::NoRanks`]).
    fn try_from(response: proto::GetLoadsResponse) -> Result<WorkerLoad, LoadValidationError> {
        worker_load_from_grpc(response)?.ok_or(LoadValidationError::NoRanks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_server_shape_reports_no_queue_or_rate() {
        let released = proto::SchedulerLoad {
            num_running_reqs: 8,
            num_waiting_reqs: 2,
            num_total_reqs: 10,
            num_used_tokens: 5000,
            max_total_num_tokens: 20000,
            token_usage: 0.25,
            ..Default::default()
        };
        let snapshot = snapshot_from_grpc(&released);
        assert_eq!(snapshot.num_waiting_uncached_tokens, None);
        assert_eq!(snapshot.gen_throughput, None);
        let idle = proto::SchedulerLoad::default();
        assert_eq!(
            snapshot_from_grpc(&idle).num_waiting_uncached_tokens,
            Some(0)
        );
    }

    #[test]
    fn snapshot_round_trips_through_grpc() {
        let snapshot = SchedulerLoadSnapshot {
            dp_rank: 2,
            num_running_reqs: 7,
            num_waiting_reqs: 2,
            num_waiting_uncached_tokens: Some(900),
            num_total_reqs: 9,
            num_used_tokens: 1000,
            max_total_num_tokens: 4000,
            token_usage: 0.25,
            gen_throughput: Some(1500.0),
            cache_hit_rate: 0.5,
            utilization: 0.3,
            max_running_requests: 64,
        };
        assert_eq!(snapshot_from_grpc(&grpc_from_snapshot(&snapshot)), snapshot);
        let huge = SchedulerLoadSnapshot {
            num_used_tokens: i64::MAX,
            ..SchedulerLoadSnapshot::default()
        };
        assert_eq!(grpc_from_snapshot(&huge).num_used_tokens, i32::MAX);
    }

    #[test]
    fn empty_reports_are_no_report() {
        assert_eq!(
            worker_load_from_grpc(proto::GetLoadsResponse::default()),
            Ok(None)
        );
        assert_eq!(
            WorkerLoad::try_from(proto::GetLoadsResponse::default()),
            Err(LoadValidationError::NoRanks)
        );
    }
}

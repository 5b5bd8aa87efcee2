//! What the admission room costs a request.
//!
//! - `room/pass_through`: `arrive` and `dispatched` with nothing waiting
//!   and the fleet below the threshold: the cost every request pays while
//!   the fleet is not saturated.
//! - `room/queue_and_release/<order>/<depth>`: one `arrive` that queues and
//!   one `pop` at a standing depth of `depth` waiting requests (16 classes
//!   and tenants among them): the cost per request at saturation.
//! - `room/shed/<depth>`: one deadline check of every waiting request, as
//!   the router runs it every 10 ms.
//! - `room/release_order/<order>/<tenants>`: the turns of one release (the
//!   next 32 requests, whether each passes, whether each is at its last
//!   moment) with 1024 waiting among `tenants` tenants, as the router
//!   reads them at every completion while requests wait.
//! - `room/queue_and_take/<order>/<tenants>`: one `arrive` that queues,
//!   then the turns of a release and the first one taken, as the router
//!   does it at saturation.

// A bench's setup fails loudly on purpose.
#![allow(clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use admission::{AdmissionRoom, Arrival, Decision, FAIR_SHARE, FIFO, PRIORITY, RoomConfig};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use policy_core::ExpectedWait;

fn room(order: &str, depth: usize) -> AdmissionRoom {
    let order = admission::registry()
        .build(order, &serde_json::Value::Null)
        .unwrap_or_else(|error| panic!("{error}"));
    AdmissionRoom::new(
        order,
        RoomConfig {
            max_queue_requests: depth * 2 + 16,
            ..RoomConfig::default()
        },
    )
}

fn arrival(index: usize, tenants: &[Arc<str>]) -> Arrival {
    Arrival {
        priority: Some((index % 4) as i32),
        tenant: tenants[index % tenants.len()].clone(),
        ttft_deadline: index.is_multiple_of(3).then(|| Duration::from_secs(30)),
        work_tokens: 200 + (index as u64 * 37) % 4000,
    }
}

const BUSY: Option<ExpectedWait> = Some(ExpectedWait {
    queue_secs: 5.0,
    prefill_secs: 0.05,
    queue_less_progress_secs: None,
    cached_prefill_secs: 0.0,
});
const IDLE: Option<ExpectedWait> = Some(ExpectedWait {
    queue_secs: 0.0,
    prefill_secs: 0.05,
    queue_less_progress_secs: None,
    cached_prefill_secs: 0.0,
});

fn benches(c: &mut Criterion) {
    let tenants: Vec<Arc<str>> = (0..4).map(|t| Arc::from(format!("tenant-{t}"))).collect();
    let now = Instant::now();
    let mut group = c.benchmark_group("room");
    let mut pass = room(PRIORITY, 0);
    let mut index = 0;
    group.bench_function("pass_through", |b| {
        b.iter(|| {
            index += 1;
            let request = arrival(index, &tenants);
            let decision = pass.arrive(black_box(&request), IDLE, now);
            if decision == Decision::DispatchNow {
                pass.dispatched(&request, now);
            }
            black_box(decision)
        })
    });
    for order in [FIFO, PRIORITY, FAIR_SHARE] {
        for depth in [16, 1024] {
            let mut standing = room(order, depth);
            for index in 0..depth {
                standing.arrive(&arrival(index, &tenants), BUSY, now);
            }
            let mut index = depth;
            group.bench_with_input(
                BenchmarkId::new(format!("queue_and_release/{order}"), depth),
                &depth,
                |b, _| {
                    b.iter(|| {
                        index += 1;
                        black_box(standing.arrive(&arrival(index, &tenants), BUSY, now));
                        black_box(standing.pop(now))
                    })
                },
            );
        }
    }
    for depth in [16, 1024] {
        let mut standing = room(PRIORITY, depth);
        for index in 0..depth {
            standing.arrive(&arrival(index, &tenants), BUSY, now);
        }
        group.bench_with_input(BenchmarkId::new("shed", depth), &depth, |b, _| {
            b.iter(|| black_box(standing.shed(IDLE, now)))
        });
    }
    for order in [PRIORITY, FAIR_SHARE] {
        for tenant_count in [4, 1000] {
            let many: Vec<Arc<str>> = (0..tenant_count)
                .map(|t| Arc::from(format!("tenant-{t}")))
                .collect();
            let mut standing = room(order, 1024);
            for index in 0..1024 {
                standing.arrive(&arrival(index, &many), BUSY, now);
            }
            group.bench_with_input(
                BenchmarkId::new(format!("release_order/{order}"), tenant_count),
                &tenant_count,
                |b, _| b.iter(|| black_box(standing.release_order())),
            );
            let mut index = 1024;
            group.bench_with_input(
                BenchmarkId::new(format!("queue_and_take/{order}"), tenant_count),
                &tenant_count,
                |b, _| {
                    b.iter(|| {
                        index += 1;
                        black_box(standing.arrive(&arrival(index, &many), BUSY, now));
                        let turns = standing.release_order();
                        black_box(
                            turns
                                .first()
                                .and_then(|turn| standing.take(turn.ticket, now)),
                        )
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(room_benches, benches);
criterion_main!(room_benches);

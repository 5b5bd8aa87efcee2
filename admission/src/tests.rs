use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use policy_core::{Admission, Dispatch, ExpectedWait, Waiting, WorkerId};
use proptest::prelude::*;

use crate::order::{FlowOrder, Grouping};
use crate::{
    AdmissionRoom, Arrival, ClassConfig, DEFAULT_QUEUE_ABOVE_WAIT_MS,
    DEFAULT_REORDER_ABOVE_WAIT_MS, Decision, Expected, FAIR_SHARE, FIFO, PASS_WITHIN_THRESHOLDS,
    PREFILL_BOUND_THRESHOLD_FACTOR, PRIORITY, RELEASE_LOOKAHEAD, REORDER_WINDOW, RejectReason,
    ReleaseTurn, RoomConfig, RoomConfigError, RoomReport, Route, WORKER_WAIT_BEHIND_REPLICAS,
    default_class_weight, registry,
};

fn order(name: &str) -> Box<dyn Admission> {
    registry()
        .build(name, &serde_json::Value::Null)
        .expect("a built-in order")
}

fn waiting(ticket: u64, priority: i32, tenant: &str, work_tokens: u64, at: Instant) -> Waiting {
    Waiting {
        ticket,
        class: Arc::from(priority.to_string()),
        priority,
        class_weight: default_class_weight(priority),
        tenant: Arc::from(tenant),
        tenant_weight: 1.0,
        work_tokens,
        arrived: at,
    }
}

fn pop_all(order: &mut dyn Admission) -> Vec<u64> {
    std::iter::from_fn(|| {
        let peeked = order.peek().map(|w| w.ticket);
        let popped = order.pop().map(|w| w.ticket);
        assert_eq!(peeked, popped, "pop takes what peek showed");
        popped
    })
    .collect()
}

#[test]
fn fifo_serves_in_arrival_order_whatever_the_priority_or_tenant() {
    let now = Instant::now();
    let mut fifo = order(FIFO);
    fifo.push(waiting(1, 5, "a", 100, now));
    fifo.push(waiting(2, 0, "b", 100, now + Duration::from_millis(1)));
    fifo.push(waiting(3, -3, "a", 100, now + Duration::from_millis(2)));
    assert_eq!(fifo.work_ahead(&waiting(4, -9, "c", 1, now)), 300);
    assert_eq!(pop_all(fifo.as_mut()), vec![1, 2, 3]);
}

#[test]
fn priority_serves_the_lower_value_first_and_does_not_starve_the_higher() {
    let now = Instant::now();
    let mut priority = order(PRIORITY);
    for ticket in 0..90 {
        priority.push(waiting(ticket, 1, "", 100, now));
    }
    // An urgent request behind 90 batch ones has less than one of them
    // ahead of it (the fluid share its weight leaves the batch class).
    let urgent = waiting(1000, 0, "", 100, now);
    assert!(priority.work_ahead(&urgent) < 100);
    for ticket in 1000..1090 {
        priority.push(waiting(ticket, 0, "", 100, now));
    }
    let served = pop_all(priority.as_mut());
    assert_eq!(served.len(), 180);
    assert_eq!(served[0], 1000, "the lower value goes first");
    // Both waiting, value 0 takes 8 of every 9 dispatches: the batch class
    // progresses, and has been served about 10 by the time class 0 is done.
    let last_urgent = served.iter().position(|t| *t == 1089).expect("served");
    let batch_before = served[..last_urgent].iter().filter(|t| **t < 1000).count();
    assert!((9..=12).contains(&batch_before), "{batch_before}");
}

#[test]
fn fair_share_gives_a_light_tenant_its_turn_ahead_of_a_flood() {
    let now = Instant::now();
    let mut fair = order(FAIR_SHARE);
    for ticket in 0..100 {
        fair.push(waiting(ticket, 0, "flood", 200, now));
    }
    let light = waiting(500, 0, "light", 200, now + Duration::from_secs(1));
    // Only the flood's head, which would finish together with it and
    // came first.
    assert_eq!(fair.work_ahead(&light), 200);
    fair.push(light);
    assert_eq!(
        fair.pop().map(|w| w.ticket),
        Some(0),
        "the flood's head was ahead"
    );
    assert_eq!(fair.pop().map(|w| w.ticket), Some(500));
    // With both backlogged, equal weights alternate.
    for ticket in 501..510 {
        fair.push(waiting(
            ticket,
            0,
            "light",
            200,
            now + Duration::from_secs(2),
        ));
    }
    let next: Vec<u64> = (0..6)
        .filter_map(|_| fair.pop().map(|w| w.ticket))
        .collect();
    assert_eq!(next.iter().filter(|t| **t >= 500).count(), 3, "{next:?}");
}

#[test]
fn a_light_tenant_passes_a_flood_s_backlog_until_it_sends_more_than_its_share() {
    let now = Instant::now();
    let mut fair = order(FAIR_SHARE);
    for ticket in 0..100 {
        fair.push(waiting(ticket, 0, "flood", 200, now));
    }
    let flood_head = waiting(0, 0, "flood", 200, now);
    assert!(!fair.passes(&flood_head), "a flow with a backlog waits");
    // Its one request passes, however long: it is next to start.
    let light = waiting(500, 0, "light", 6000, now);
    fair.push(light.clone());
    assert!(fair.passes(&light));
    assert_eq!(fair.take(500).map(|w| w.ticket), Some(500));
    // Sent at once, the light tenant is 6000 tokens ahead on its count:
    // its next request waits until the flood has caught up.
    let again = waiting(501, 0, "light", 200, now);
    fair.push(again.clone());
    assert!(!fair.passes(&again));
    let mut flood_served = 0;
    while !fair.passes(&again) {
        let served = fair.pop().expect("the flood still waits");
        assert_eq!(
            served.tenant.as_ref(),
            "flood",
            "the light one waits its turn"
        );
        flood_served += served.work_tokens;
    }
    assert!((5800..=6000).contains(&flood_served), "{flood_served}");
    // Two of its own waiting: it is a backlog too.
    let third = waiting(502, 0, "light", 200, now);
    fair.push(third.clone());
    assert!(!fair.passes(&again) && !fair.passes(&third));
}

#[test]
fn no_request_passes_a_fifo_or_an_empty_room() {
    let now = Instant::now();
    let mut fifo = order(FIFO);
    let alone = waiting(1, 0, "a", 100, now);
    fifo.push(alone.clone());
    assert!(!fifo.passes(&alone), "nothing to pass");
    let other = waiting(2, 5, "b", 100, now);
    fifo.push(other.clone());
    assert!(!fifo.passes(&alone) && !fifo.passes(&other), "one flow");
    // By priority: the urgent class's one request passes the batch.
    let mut priority = order(PRIORITY);
    for ticket in 0..10 {
        priority.push(waiting(ticket, 1, "", 100, now));
    }
    let urgent = waiting(100, 0, "", 100, now);
    priority.push(urgent.clone());
    assert!(priority.passes(&urgent));
    assert!(!priority.passes(&waiting(0, 1, "", 100, now)));
}

#[test]
fn fair_share_weighs_tenants_and_counts_output_tokens() {
    let now = Instant::now();
    let mut fair = order(FAIR_SHARE);
    let heavy = |ticket, tenant: &str, weight| Waiting {
        tenant_weight: weight,
        ..waiting(ticket, 0, tenant, 100, now)
    };
    for ticket in 0..30 {
        fair.push(heavy(ticket, "gold", 2.0));
        fair.push(heavy(100 + ticket, "bronze", 1.0));
    }
    let first: Vec<u64> = (0..30)
        .filter_map(|_| fair.pop().map(|w| w.ticket))
        .collect();
    let gold = first.iter().filter(|t| **t < 100).count();
    assert!((19..=21).contains(&gold), "gold's share of 30: {gold}");
    // Gold's answers were long: its output counts, and bronze catches up.
    fair.served("0", "gold", 10_000);
    let next: Vec<u64> = (0..10)
        .filter_map(|_| fair.pop().map(|w| w.ticket))
        .collect();
    assert!(next.iter().all(|t| *t >= 100), "{next:?}");
}

#[test]
fn an_idle_tenant_banks_no_credit() {
    let now = Instant::now();
    let mut fair = order(FAIR_SHARE);
    for ticket in 0..50 {
        fair.push(waiting(ticket, 0, "busy", 100, now));
    }
    for _ in 0..40 {
        fair.pop();
    }
    // "late" arrives after "busy" has been served 4000 tokens: it is lifted
    // to busy's count, so the two alternate rather than late taking 40 turns.
    for ticket in 100..120 {
        fair.push(waiting(ticket, 0, "late", 100, now));
    }
    let next: Vec<u64> = (0..10)
        .filter_map(|_| fair.pop().map(|w| w.ticket))
        .collect();
    let late = next.iter().filter(|t| **t >= 100).count();
    assert!((4..=6).contains(&late), "{next:?}");
}

#[test]
fn predictions_of_work_ahead_match_the_order_served() {
    let now = Instant::now();
    for name in [FIFO, PRIORITY, FAIR_SHARE] {
        let mut queue = order(name);
        let mut work = BTreeMap::new();
        for ticket in 0..40u64 {
            let tokens = 50 + (ticket * 37) % 400;
            let priority = if name == FIFO { 0 } else { (ticket % 2) as i32 };
            let tenant = ["a", "b", "c"][(ticket % 3) as usize];
            let tenant = if name == FAIR_SHARE { tenant } else { "" };
            queue.push(waiting(ticket, priority, tenant, tokens, now));
            work.insert(ticket, tokens);
        }
        let predicted: BTreeMap<u64, u64> = queue.queued_work_ahead().into_iter().collect();
        let mut served_before = 0u64;
        let mut worst_error = 0f64;
        for ticket in pop_all(queue.as_mut()) {
            let error = (predicted[&ticket] as f64 - served_before as f64).abs();
            worst_error = worst_error.max(error);
            served_before += work[&ticket];
        }
        // Exact for one flow; within a few requests' work (about 250
        // tokens each) where flows interleave, and two levels of them.
        let allowed = match name {
            FIFO => 0.0,
            PRIORITY => 900.0,
            _ => 2500.0,
        };
        assert!(
            worst_error <= allowed,
            "{name}: off by {worst_error} tokens"
        );
    }
}

#[test]
fn the_registry_names_the_orders_and_refuses_parameters() {
    assert_eq!(registry().names(), vec![FAIR_SHARE, FIFO, PRIORITY]);
    let unknown = registry().build("lifo", &serde_json::Value::Null);
    assert!(
        unknown
            .err()
            .is_some_and(|e| e.to_string().contains("fifo"))
    );
    let with_params = registry().build(FIFO, &serde_json::json!({"depth": 3}));
    assert!(with_params.is_err());
}

fn room(config: RoomConfig) -> AdmissionRoom {
    AdmissionRoom::new(order(PRIORITY), config.validated().expect("valid config"))
}

fn arrival(priority: i32, deadline_ms: Option<u64>) -> Arrival {
    Arrival {
        priority: Some(priority),
        tenant: Arc::from("t"),
        ttft_deadline: deadline_ms.map(Duration::from_millis),
        work_tokens: 1000,
    }
}

/// A wait at the chosen worker, as `route` takes it.
fn at_worker(wait: Option<ExpectedWait>) -> Option<(WorkerId, ExpectedWait)> {
    wait.map(|wait| (WorkerId::new(0, 0), wait))
}

fn wait(queue_secs: f64) -> Option<ExpectedWait> {
    Some(ExpectedWait {
        queue_secs,
        prefill_secs: 0.1,
        queue_less_progress_secs: None,
        ..ExpectedWait::default()
    })
}

#[test]
fn a_room_dispatches_at_once_below_the_threshold_and_queues_above_it() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    assert_eq!(
        room.arrive(&arrival(0, None), wait(0.1), now),
        Decision::DispatchNow
    );
    assert!(matches!(
        room.arrive(&arrival(0, None), wait(2.0), now),
        Decision::Queued(_)
    ));
    // Once one waits, later arrivals wait behind it even if the fleet has room.
    assert!(matches!(
        room.arrive(&arrival(0, None), wait(0.0), now),
        Decision::Queued(_)
    ));
    // A policy with no model of wait never queues by the threshold.
    let mut baseline = AdmissionRoom::new(order(FIFO), RoomConfig::default());
    assert_eq!(
        baseline.arrive(&arrival(0, None), None, now),
        Decision::DispatchNow
    );
    assert!(matches!(
        baseline.enqueue(&arrival(0, None), None, now),
        Decision::Queued(_)
    ));
}

#[test]
fn a_wait_at_most_the_lowest_threshold_has_room_whichever_is_in_force() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let lowest = room.lowest_threshold();
    assert_eq!(lowest, Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS));
    let at_lowest = wait(lowest.as_secs_f64());
    assert!(room.has_room(at_lowest));
    // Two classes arrive: the room reorders, and the lower threshold is in force.
    let _ = room.arrive(&arrival(0, None), wait(0.1), now);
    let _ = room.arrive(&arrival(1, None), wait(0.1), now);
    assert_eq!(room.threshold(), lowest);
    assert!(room.has_room(at_lowest));
    assert!(!room.has_room(wait(lowest.as_secs_f64() + 0.01)));
    // A queue threshold set below the reorder one is the lowest.
    let low_queue = self::room(RoomConfig {
        queue_above_wait: Duration::from_millis(100),
        reorder_above_wait: Duration::from_millis(100),
        ..RoomConfig::default()
    });
    assert_eq!(low_queue.lowest_threshold(), Duration::from_millis(100));
}

#[test]
fn a_full_queue_turns_requests_away() {
    let now = Instant::now();
    let mut room = room(RoomConfig {
        max_queue_requests: 2,
        ..RoomConfig::default()
    });
    for _ in 0..2 {
        assert!(matches!(
            room.arrive(&arrival(0, None), wait(5.0), now),
            Decision::Queued(_)
        ));
    }
    let Decision::Rejected(rejection) = room.arrive(&arrival(0, None), wait(5.0), now) else {
        panic!("a third request does not fit");
    };
    assert_eq!(rejection.reason, RejectReason::QueueFull);
    assert!(rejection.retry_after_s >= 1);
}

#[test]
fn the_bound_counts_the_requests_queued_at_other_replicas() {
    let now = Instant::now();
    let mut room = room(RoomConfig {
        max_queue_requests: 3,
        ..RoomConfig::default()
    });
    queue(&mut room, now);
    let peers_queue = |queued_requests| {
        Some(RoomReport {
            queued_requests,
            ..RoomReport::default()
        })
    };
    // One here and two at the other replicas: the fleet's queue is full.
    room.set_peers(peers_queue(2));
    let Decision::Rejected(rejection) = room.arrive(&arrival(0, None), wait(5.0), now) else {
        panic!("the fleet's queue holds three");
    };
    assert_eq!(rejection.reason, RejectReason::QueueFull);
    let view = room.view(now);
    assert_eq!(
        (view.queued_requests, view.peers_queued_requests),
        (1, Some(2))
    );
    // A peer's queue drained: there is a place again.
    room.set_peers(peers_queue(1));
    assert!(matches!(
        room.arrive(&arrival(0, None), wait(5.0), now),
        Decision::Queued(_)
    ));
    // What this room tells the others: its own two, not theirs.
    assert_eq!(room.report(now).queued_requests, 2);
    // Behind one router nothing else counts.
    room.set_peers(None);
    assert_eq!(room.view(now).peers_queued_requests, None);
    assert!(matches!(
        room.arrive(&arrival(0, None), wait(5.0), now),
        Decision::Queued(_)
    ));
}

#[test]
fn a_deadline_the_prediction_cannot_meet_is_refused_at_arrival_with_retry_after() {
    let start = Instant::now();
    let one_second = RoomConfig {
        queue_above_wait: Duration::from_secs(1),
        ..RoomConfig::default()
    };
    let mut room = room(one_second);
    // Two seconds of history at 10 000 prompt tokens a second.
    for step in 0..200u64 {
        room.dispatched(
            &Arrival {
                work_tokens: 100,
                ..arrival(0, None)
            },
            start + Duration::from_millis(10 * step),
        );
    }
    let now = start + Duration::from_secs(2);
    // Every worker 1.2 s deep (above the 1 s threshold), and 30 000
    // tokens queued: about 3 s at the drain rate.
    for _ in 0..30 {
        assert!(matches!(
            room.arrive(&arrival(0, None), wait(1.2), now),
            Decision::Queued(_)
        ));
    }
    let Decision::Rejected(rejection) = room.arrive(&arrival(0, Some(2000)), wait(1.2), now) else {
        panic!("4.3 s predicted against a 2 s deadline");
    };
    assert_eq!(rejection.reason, RejectReason::DeadlineUnmeetable);
    let predicted = rejection.predicted_wait.expect("predicted").as_secs_f64();
    assert!((3.8..5.0).contains(&predicted), "{predicted}");
    // Admitted only below 3/4 of the deadline: in about 3 s.
    assert_eq!(rejection.retry_after_s, 3);
    // A higher class jumps the queue, so the same deadline is kept.
    assert!(matches!(
        room.arrive(&arrival(-1, Some(2000)), wait(1.2), now),
        Decision::Queued(_)
    ));
    // No history: no queue-based prediction, only the policy's.
    let mut fresh = self::room(RoomConfig::default());
    assert!(matches!(
        fresh.arrive(&arrival(0, Some(50)), wait(0.0), now),
        Decision::Rejected(_)
    ));
    assert_eq!(
        fresh.arrive(&arrival(0, Some(200)), wait(0.0), now),
        Decision::DispatchNow
    );
}

#[test]
fn explain_says_what_arrive_then_does_and_changes_nothing() {
    let start = Instant::now();
    let mut room = room(RoomConfig {
        max_queue_requests: 3,
        ..RoomConfig::default()
    });
    for step in 0..100u64 {
        room.dispatched(
            &Arrival {
                work_tokens: 100,
                ..arrival(0, None)
            },
            start + Duration::from_millis(10 * step),
        );
    }
    let now = start + Duration::from_secs(1);
    let cases = [
        (arrival(0, None), wait(0.1), "dispatch_now"),
        (arrival(0, Some(50)), wait(0.1), "deadline_unmeetable"),
        (arrival(0, None), wait(3.0), "queue"),
        (arrival(1, None), wait(0.0), "queue"),
        (arrival(0, Some(60_000)), wait(0.0), "queue"),
        // Full: a newcomer of class 0 takes the place of the class 1 one,
        // which the order would serve after it; one of class 1 takes none.
        (arrival(0, None), wait(0.0), "queue"),
        (arrival(1, None), wait(0.0), "queue_full"),
    ];
    for (request, expected, decision) in cases {
        let explained = room.explain(&request, expected, now);
        assert_eq!(explained.decision, decision, "{explained:?}");
        let queued = room.len();
        let arrived = room.arrive(&request, expected, now);
        let agrees = match arrived {
            Decision::DispatchNow => decision == "dispatch_now",
            // Queued: one more waits, or (a full queue) as many as before.
            Decision::Queued(_) => decision == "queue" && room.len() >= queued,
            Decision::Rejected(rejection) => rejection.reason.as_str() == decision,
        };
        assert!(agrees, "{decision}: {arrived:?}");
    }
    let evicted = room.shed(wait(0.0), now);
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    assert_eq!(&*evicted[0].class, "1");
    assert_eq!(evicted[0].rejection.reason, RejectReason::QueueFull);
    room.pop(now);
    let behind = room.explain(&arrival(1, Some(60_000)), wait(0.0), now);
    assert!(behind.work_ahead_tokens >= 1000, "{behind:?}");
    assert_eq!(behind.class, "1");
    assert!(behind.predicted_ttft_s.is_some_and(|s| s > 0.0));
}

#[test]
fn the_threshold_drops_while_there_is_something_to_reorder() {
    let now = Instant::now();
    let one_second = RoomConfig {
        queue_above_wait: Duration::from_secs(1),
        ..RoomConfig::default()
    };
    let mut room = room(one_second.clone());
    let alike = |tenant: &str| Arrival {
        tenant: Arc::from(tenant),
        ..arrival(0, None)
    };
    // Alike arrivals: engines may hold up to a second of work.
    assert_eq!(
        room.arrive(&alike("t"), wait(0.6), now),
        Decision::DispatchNow
    );
    assert_eq!(
        room.arrive(&alike("t"), wait(0.6), now),
        Decision::DispatchNow
    );
    assert_eq!(room.threshold(), Duration::from_secs(1));
    // Another class arrives: the reorder threshold, for the window.
    assert!(matches!(
        room.arrive(&arrival(1, None), wait(0.6), now),
        Decision::Queued(_)
    ));
    assert_eq!(
        room.threshold(),
        Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS)
    );
    let later = now + REORDER_WINDOW + Duration::from_millis(1);
    room.pop(later);
    assert_eq!(room.threshold(), Duration::from_secs(1));
    // Tenants differ only for an order that separates them.
    let mut priority = self::room(one_second.clone());
    priority.arrive(&alike("t"), wait(0.0), now);
    priority.arrive(&alike("u"), wait(0.0), now);
    assert_eq!(
        priority.threshold(),
        Duration::from_secs(1),
        "priority keeps tenants in one flow"
    );
    let mut fair = AdmissionRoom::new(order(FAIR_SHARE), one_second);
    fair.arrive(&alike("t"), wait(0.0), now);
    fair.arrive(&alike("u"), wait(0.0), now);
    assert_eq!(
        fair.threshold(),
        Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS)
    );
}

/// A dispatch of `tokens` uncached prompt tokens.
fn dispatch_of(tokens: u64) -> Dispatch {
    Dispatch {
        worker: WorkerId::new(0, 0),
        tokens,
        seq: 0,
        score: 0.0,
        cached_tokens: 0,
    }
}

/// Sends `room` a prompt of `tokens` every 10 ms, `count` times, among
/// `workers`, each predicted to take `prefill_secs` (`None`: no model of
/// wait); returns the time after.
fn send_every_10ms(
    room: &mut AdmissionRoom,
    count: usize,
    workers: usize,
    tokens: u64,
    prefill_secs: Option<f64>,
    from: Instant,
) -> Instant {
    let expected = prefill_secs.map(|prefill_secs| ExpectedWait {
        queue_secs: 0.0,
        prefill_secs,
        queue_less_progress_secs: None,
        cached_prefill_secs: 0.0,
    });
    let dispatch = dispatch_of(tokens);
    let mut now = from;
    for _ in 0..count {
        room.sent(expected, &dispatch, workers, now);
        now += Duration::from_millis(10);
    }
    now
}

/// Sends `room` a prompt of `tokens` every 10 ms for 11 s (longer than
/// the history a judgement needs), among `workers`, each predicted to take
/// `prefill_ms`; returns the time after.
fn send_prompts(
    room: &mut AdmissionRoom,
    workers: usize,
    tokens: u64,
    prefill_ms: u64,
    from: Instant,
) -> Instant {
    let prefill_secs = Some(prefill_ms as f64 / 1000.0);
    send_every_10ms(room, 1100, workers, tokens, prefill_secs, from)
}

/// Arrivals of two classes: the room reorders.
fn reorder_now(room: &mut AdmissionRoom, now: Instant) {
    room.arrive(&arrival(0, None), wait(0.0), now);
    room.arrive(&arrival(1, None), wait(0.0), now);
}

#[test]
fn a_prefill_bound_fleet_keeps_deeper_queues_while_reordering() {
    let reorder = Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS);
    let raised = Duration::from_secs_f64(reorder.as_secs_f64() * PREFILL_BOUND_THRESHOLD_FACTOR);
    // 40 ms of prompt work every 10 ms keeps four workers computing.
    let mut room = room(RoomConfig::default());
    let now = send_prompts(&mut room, 4, 320, 40, Instant::now());
    assert!(room.view(now).prefill_bound);
    // Nothing to reorder: the queue threshold, unchanged.
    assert_eq!(
        room.threshold(),
        Duration::from_millis(DEFAULT_QUEUE_ABOVE_WAIT_MS)
    );
    reorder_now(&mut room, now);
    assert_eq!(room.threshold(), raised);
    // Once the prompts stop, it is no longer prefill-bound.
    let quiet = now + Duration::from_secs(10);
    reorder_now(&mut room, quiet);
    assert!(!room.view(quiet).prefill_bound);
    assert_eq!(room.threshold(), reorder);
    // Eight workers kept half busy are not.
    let mut half = self::room(RoomConfig::default());
    let now = send_prompts(&mut half, 8, 320, 40, Instant::now());
    reorder_now(&mut half, now);
    assert!(!half.view(now).prefill_bound);
    assert_eq!(half.threshold(), reorder);
}

#[test]
fn prompt_work_is_judged_at_the_fastest_speed_seen() {
    // Prompts keeping four of eight workers busy, then the same prompts
    // predicted at half the speed (the engines' steps are long with
    // decoding): judged at the first speed, still four of eight.
    let mut room = room(RoomConfig::default());
    let start = Instant::now();
    let now = send_prompts(&mut room, 8, 320, 40, start);
    let now = send_prompts(&mut room, 8, 320, 80, now);
    assert!(!room.view(now).prefill_bound);
    // At the slower speed alone they would be eight of eight.
    let mut slow = self::room(RoomConfig::default());
    let now = send_prompts(&mut slow, 8, 320, 80, start);
    assert!(slow.view(now).prefill_bound);
    // Without a model of wait nothing is learned.
    let mut blind = self::room(RoomConfig::default());
    let at = send_every_10ms(&mut blind, 1100, 1, 1000, None, start);
    assert!(!blind.view(at).prefill_bound);
    // Nor from a prediction that is not a number.
    let mut nan = self::room(RoomConfig::default());
    let at = send_every_10ms(&mut nan, 1100, 1, 1000, Some(f64::NAN), start);
    assert!(!nan.view(at).prefill_bound);
}

/// A wait of `queue_secs`, `less_progress_secs` of it once the workers'
/// progress on their prompts under way is counted.
fn wait_with_progress(queue_secs: f64, less_progress_secs: f64) -> Option<ExpectedWait> {
    Some(ExpectedWait {
        queue_secs,
        prefill_secs: 0.1,
        queue_less_progress_secs: Some(less_progress_secs),
        ..ExpectedWait::default()
    })
}

#[test]
fn a_prefill_bound_fleet_counts_the_progress_on_prompts_under_way() {
    let finishing = wait_with_progress(2.0, 0.05);
    let mut room = room(RoomConfig::default());
    let now = send_prompts(&mut room, 4, 320, 40, Instant::now());
    // Not reordering: the policy's wait, as it is.
    room.arrive(&arrival(0, None), wait(0.0), now);
    assert!(!room.counts_progress());
    assert!(!room.has_room(finishing));
    // Reordering on a prefill-bound fleet: the worker finishing its
    // prompt has room, and a request without a deadline whose chosen
    // worker is busy goes to the best with room rather than wait.
    reorder_now(&mut room, now);
    assert!(room.counts_progress());
    assert!(room.view(now).counts_progress);
    assert!(room.has_room(finishing));
    assert!(!room.has_room(wait_with_progress(2.0, 0.5)));
    assert!(room.has_room(wait(0.0)), "a policy that does not tell");
    let turn = ReleaseTurn {
        ticket: 1,
        due: None,
        passes: false,
        last_moment: false,
    };
    assert_eq!(
        room.route(&turn, at_worker(wait_with_progress(2.0, 0.5)), now),
        Route::WithRoom
    );
    // Not one whose prefix that worker holds: elsewhere it would compute
    // it again, and push others' out of that cache.
    let cached_there = wait_with_progress(2.0, 0.5).map(|wait| ExpectedWait {
        cached_prefill_secs: 0.08,
        ..wait
    });
    assert_eq!(room.route(&turn, at_worker(cached_there), now), Route::Wait);
    // A request with a deadline turns it off for the reorder window: its
    // margins are sized for the policy's own prediction.
    let later = now + Duration::from_millis(10);
    room.arrive(&arrival(1, Some(2000)), wait(5.0), later);
    assert!(!room.counts_progress());
    assert!(!room.has_room(finishing));
    assert_eq!(
        room.route(&turn, at_worker(wait_with_progress(2.0, 0.5)), later),
        Route::Wait
    );
}

#[test]
fn a_fleet_is_not_judged_prefill_bound_on_its_first_seconds() {
    // The policy's first predictions are at its prior rate, and a fleet's
    // start is a burst: a second of prompts keeping every worker busy is
    // not enough history.
    let mut room = room(RoomConfig::default());
    let now = send_every_10ms(&mut room, 100, 4, 320, Some(0.04), Instant::now());
    reorder_now(&mut room, now);
    assert!(!room.view(now).prefill_bound);
    assert_eq!(
        room.threshold(),
        Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS)
    );
}

#[test]
fn a_prefill_bound_threshold_stays_within_the_queue_threshold() {
    let mut room = room(RoomConfig {
        queue_above_wait: Duration::from_millis(120),
        ..RoomConfig::default()
    });
    let now = send_prompts(&mut room, 1, 320, 40, Instant::now());
    reorder_now(&mut room, now);
    assert_eq!(room.threshold(), Duration::from_millis(120));
}

#[test]
fn a_full_fair_share_queue_drops_the_heaviest_tenant_s_newest_for_a_light_one() {
    let now = Instant::now();
    let mut fair = AdmissionRoom::new(
        order(FAIR_SHARE),
        RoomConfig {
            max_queue_requests: 4,
            ..RoomConfig::default()
        },
    );
    let from = |tenant: &str| Arrival {
        tenant: Arc::from(tenant),
        ..arrival(0, None)
    };
    let mut heavy = Vec::new();
    for _ in 0..4 {
        let Decision::Queued(ticket) = fair.arrive(&from("heavy"), wait(5.0), now) else {
            panic!("room for four");
        };
        heavy.push(ticket);
    }
    assert!(matches!(
        fair.arrive(&from("heavy"), wait(5.0), now),
        Decision::Rejected(_)
    ));
    assert!(matches!(
        fair.arrive(&from("light"), wait(5.0), now),
        Decision::Queued(_)
    ));
    let evicted = fair.shed(wait(5.0), now);
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0].ticket, heavy[3], "the heavy tenant's newest");
    assert_eq!(evicted[0].rejection.reason, RejectReason::QueueFull);
    // Light's two still finish before heavy's tail: heavy loses another.
    assert!(matches!(
        fair.arrive(&from("light"), wait(5.0), now),
        Decision::Queued(_)
    ));
    assert_eq!(fair.shed(wait(5.0), now)[0].ticket, heavy[2]);
    assert_eq!(fair.len(), 4);
}

#[test]
fn a_request_that_passes_straight_through_counts_toward_its_tenant_s_share() {
    let now = Instant::now();
    let mut fair = AdmissionRoom::new(order(FAIR_SHARE), RoomConfig::default());
    let from = |tenant: &str| Arrival {
        tenant: Arc::from(tenant),
        ..arrival(0, None)
    };
    let Decision::Queued(a) = fair.arrive(&from("a"), wait(5.0), now) else {
        panic!("queued");
    };
    let Decision::Queued(b) = fair.arrive(&from("b"), wait(5.0), now) else {
        panic!("queued");
    };
    // Tied, a came first; but a's requests that went straight to a worker
    // were served too.
    fair.dispatched(&from("a"), now);
    assert_eq!(fair.head().map(|w| w.ticket), Some(b));
    assert_eq!(fair.pop(now).map(|r| r.ticket), Some(b));
    assert_eq!(fair.pop(now).map(|r| r.ticket), Some(a));
}

#[test]
fn shedding_turns_away_requests_past_or_certain_to_miss_their_deadline() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let Decision::Queued(soon) = room.arrive(&arrival(0, Some(1000)), wait(0.5), now) else {
        panic!("queued");
    };
    let Decision::Queued(later) = room.arrive(&arrival(0, Some(5000)), wait(0.5), now) else {
        panic!("queued");
    };
    let Decision::Queued(never) = room.arrive(&arrival(0, None), wait(0.5), now) else {
        panic!("queued");
    };
    assert!(room.shed(wait(0.5), now).is_empty());
    // 0.95 s later a dispatch now would take 0.5 + 0.1 s: past 1 s.
    let shed = room.shed(wait(0.5), now + Duration::from_millis(950));
    assert_eq!(shed.len(), 1);
    assert_eq!(shed[0].ticket, soon);
    assert_eq!(shed[0].rejection.reason, RejectReason::DeadlineUnmeetable);
    let shed = room.shed(wait(0.0), now + Duration::from_secs(6));
    assert_eq!(shed.len(), 1);
    assert_eq!(shed[0].ticket, later);
    assert_eq!(shed[0].rejection.reason, RejectReason::DeadlinePassed);
    assert_eq!(room.len(), 1);
    assert!(room.remove(never));
    assert!(!room.remove(never), "removed once");
    assert!(room.is_empty());
}

#[test]
fn a_request_near_its_deadline_goes_at_its_last_moment_unless_a_higher_class_waits() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let Decision::Queued(batch) = room.arrive(&arrival(1, Some(2000)), wait(0.5), now) else {
        panic!("queued");
    };
    // Dispatched at 1.05 s it would meet its 2 s deadline (0.5 + 0.1 s),
    // with more to spare than twice the threshold (0.2 s) and its own
    // prefill (0.1 s), its class being the most urgent: not yet.
    assert!(
        room.shed(wait(0.5), now + Duration::from_millis(1050))
            .is_empty()
    );
    assert_eq!(last_moments(&room), vec![false]);
    // At 1.15 s it would still meet it, but not after 0.3 s more: it goes
    // now, to its chosen worker if that meets it, else to another.
    let at = now + Duration::from_millis(1150);
    assert!(room.shed(wait(0.5), at).is_empty());
    let turns = room.release_order();
    assert_eq!(turns[0].ticket, batch);
    assert!(turns[0].last_moment);
    assert_eq!(
        room.route(&turns[0], at_worker(wait(0.5)), at),
        Route::Chosen
    );
    assert_eq!(
        room.route(&turns[0], at_worker(wait(3.0)), at),
        Route::WithRoom
    );
    // A request of a lower priority value waiting: the class order stands.
    assert!(matches!(
        room.arrive(&arrival(0, None), wait(0.5), at),
        Decision::Queued(_)
    ));
    assert_eq!(last_moments(&room), vec![false, false]);
}

#[test]
fn a_request_of_a_less_urgent_class_keeps_twice_the_threshold_as_margin() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let Decision::Queued(urgent) = room.arrive(&arrival(0, None), wait(2.0), now) else {
        panic!("queued");
    };
    assert!(matches!(
        room.arrive(&arrival(1, Some(2000)), wait(0.5), now),
        Decision::Queued(_)
    ));
    assert!(room.take(urgent, now).is_some());
    // Priority 0 arrived lately: going early would take its engine time,
    // so the margin is twice the threshold (0.2 s), without the prefill.
    assert!(
        room.shed(wait(0.5), now + Duration::from_millis(1150))
            .is_empty()
    );
    assert_eq!(last_moments(&room), vec![false]);
    assert!(
        room.shed(wait(0.5), now + Duration::from_millis(1250))
            .is_empty()
    );
    assert_eq!(last_moments(&room), vec![true]);
}

#[test]
fn a_request_of_the_most_urgent_class_keeps_the_largest_waiting_prefill_as_margin() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let Decision::Queued(short) = room.arrive(&arrival(1, Some(2000)), wait(0.5), now) else {
        panic!("queued");
    };
    let long_prompt = Some(ExpectedWait {
        queue_secs: 0.5,
        prefill_secs: 0.6,
        queue_less_progress_secs: None,
        cached_prefill_secs: 0.0,
    });
    assert!(matches!(
        room.arrive(&arrival(1, Some(10_000)), long_prompt, now),
        Decision::Queued(_)
    ));
    // At 0.65 s the short one would meet its 2 s deadline sent now (0.5 +
    // 0.1 s), but a 0.6 s prompt sent to the least busy worker first would
    // take 0.8 s of its 0.85 s of spare with twice the threshold: it goes.
    assert!(
        room.shed(wait(0.5), now + Duration::from_millis(650))
            .is_empty()
    );
    let turns = room.release_order();
    assert_eq!(turns[0].ticket, short);
    assert_eq!(last_moments(&room), vec![true, false]);
}

fn last_moments(room: &AdmissionRoom) -> Vec<bool> {
    room.release_order()
        .iter()
        .map(|turn| turn.last_moment)
        .collect()
}

#[test]
fn configured_classes_take_ranges_of_priority_values_and_their_deadlines() {
    let room = room(RoomConfig {
        classes: vec![
            ClassConfig {
                name: "batch".into(),
                priority: 10,
                weight: 1.0,
                ttft_deadline: None,
            },
            ClassConfig {
                name: "chat".into(),
                priority: 0,
                weight: 4.0,
                ttft_deadline: Some(Duration::from_secs(2)),
            },
        ],
        ..RoomConfig::default()
    });
    let chat = room.classify(&arrival(-5, None));
    assert_eq!(&*chat.class, "chat");
    assert_eq!(chat.ttft_deadline, Some(Duration::from_secs(2)));
    assert_eq!(&*room.classify(&arrival(3, None)).class, "batch");
    assert_eq!(&*room.classify(&arrival(99, None)).class, "batch");
    let own = room.classify(&arrival(0, Some(500)));
    assert_eq!(own.ttft_deadline, Some(Duration::from_millis(500)));
}

#[test]
fn invalid_room_configs_are_refused_with_their_reason() {
    let class = |name: &str, priority, weight| ClassConfig {
        name: name.into(),
        priority,
        weight,
        ttft_deadline: None,
    };
    let cases = [
        (
            RoomConfig {
                max_queue_requests: 0,
                ..RoomConfig::default()
            },
            RoomConfigError::EmptyQueue,
        ),
        (
            RoomConfig {
                classes: vec![class("a", 0, f64::NAN)],
                ..RoomConfig::default()
            },
            RoomConfigError::ClassWeight {
                name: "a".into(),
                weight: f64::NAN,
            },
        ),
        (
            RoomConfig {
                classes: vec![class("a", 0, 1.0), class("b", 0, 1.0)],
                ..RoomConfig::default()
            },
            RoomConfigError::SamePriority {
                first: "a".into(),
                second: "b".into(),
                priority: 0,
            },
        ),
        (
            RoomConfig {
                classes: vec![class("a", 0, 1.0), class("a", 1, 1.0)],
                ..RoomConfig::default()
            },
            RoomConfigError::SameName { name: "a".into() },
        ),
        (
            RoomConfig {
                tenant_weights: [("x".to_owned(), -1.0)].into(),
                ..RoomConfig::default()
            },
            RoomConfigError::TenantWeight {
                tenant: "x".into(),
                weight: -1.0,
            },
        ),
    ];
    for (config, expected) in cases {
        let error = config.validated().expect_err("invalid");
        // NaN is not equal to itself: compare the messages.
        assert_eq!(error.to_string(), expected.to_string());
    }
}

#[test]
fn a_live_swap_keeps_every_queued_request() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let mut tickets = BTreeSet::new();
    for priority in [3, 1, 2, 0] {
        if let Decision::Queued(ticket) = room.arrive(&arrival(priority, None), wait(9.0), now) {
            tickets.insert(ticket);
        }
    }
    room.swap_order(order(FIFO));
    assert_eq!(room.order_name(), FIFO);
    let released: BTreeSet<u64> = std::iter::from_fn(|| room.pop(now).map(|r| r.ticket)).collect();
    assert_eq!(released, tickets);
}

#[derive(Debug, Clone)]
enum Op {
    Push {
        priority: i32,
        tenant: u8,
        tokens: u64,
    },
    Pop,
    Remove(u64),
    /// Takes the n-th request of `in_order` (modulo its length).
    Take(usize),
    Served {
        tenant: u8,
        tokens: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (-2i32..3, 0u8..4, 0u64..5000).prop_map(|(priority, tenant, tokens)| Op::Push {
            priority,
            tenant,
            tokens
        }),
        Just(Op::Pop),
        (0u64..40).prop_map(Op::Remove),
        (0usize..8).prop_map(Op::Take),
        (0u8..4, 0u64..5000).prop_map(|(tenant, tokens)| Op::Served { tenant, tokens }),
    ]
}

proptest! {
    /// Whatever happens, every pushed request leaves exactly once, by pop,
    /// remove or the final drain, and the length agrees.
    #[test]
    fn no_request_is_lost_or_served_twice(ops in prop::collection::vec(op(), 0..120)) {
        let now = Instant::now();
        for name in [FIFO, PRIORITY, FAIR_SHARE] {
            let mut queue = order(name);
            let mut inside = BTreeSet::new();
            let mut next = 0u64;
            for op in &ops {
                match op {
                    Op::Push { priority, tenant, tokens } => {
                        queue.push(waiting(next, *priority, &tenant.to_string(), *tokens, now));
                        inside.insert(next);
                        next += 1;
                    }
                    Op::Pop => {
                        let popped = queue.pop().map(|w| w.ticket);
                        if let Some(ticket) = popped {
                            prop_assert!(inside.remove(&ticket));
                        } else {
                            prop_assert!(inside.is_empty());
                        }
                    }
                    Op::Remove(ticket) => {
                        let removed = queue.remove(*ticket).is_some();
                        prop_assert_eq!(removed, inside.remove(ticket));
                    }
                    Op::Take(index) => {
                        let turns = queue.in_order(8);
                        if let Some(ticket) = turns.get(index % turns.len().max(1)) {
                            prop_assert_eq!(queue.take(*ticket).map(|w| w.ticket), Some(*ticket));
                            prop_assert!(inside.remove(ticket));
                        }
                    }
                    Op::Served { tenant, tokens } => {
                        queue.served("0", &tenant.to_string(), *tokens);
                    }
                }
                prop_assert_eq!(queue.len(), inside.len());
                prop_assert_eq!(queue.in_order(usize::MAX).len(), inside.len());
                prop_assert_eq!(queue.queued_work_ahead().len(), inside.len());
            }
            let drained: BTreeSet<u64> = queue.drain().into_iter().map(|w| w.ticket).collect();
            prop_assert_eq!(drained, inside);
            prop_assert!(queue.is_empty());
        }
    }
}

proptest! {
    /// Whatever happens, whether each waiting request passes, judged on
    /// the least count `fair_share` keeps among a class's waiting
    /// tenants, agrees with a scan of every waiting flow.
    #[test]
    fn passing_on_the_kept_least_count_agrees_with_a_scan(
        ops in prop::collection::vec(op(), 0..150),
    ) {
        let now = Instant::now();
        let mut queue = FlowOrder::new(Grouping::ClassesAndTenants);
        let mut next = 0u64;
        for op in &ops {
            match op {
                Op::Push { priority, tenant, tokens } => {
                    let mut request = waiting(next, *priority, &tenant.to_string(), *tokens, now);
                    request.tenant_weight = 1.0 + f64::from(*tenant);
                    queue.push(request);
                    next += 1;
                }
                Op::Pop => {
                    queue.pop();
                }
                Op::Remove(ticket) => {
                    queue.remove(*ticket);
                }
                Op::Take(index) => {
                    let turns = queue.in_order(8);
                    if let Some(ticket) = turns.get(index % turns.len().max(1)) {
                        queue.take(*ticket);
                    }
                }
                Op::Served { tenant, tokens } => {
                    queue.served("0", &tenant.to_string(), *tokens);
                }
            }
            for request in queue.waiting() {
                prop_assert_eq!(queue.passes(&request), queue.passes_by_scan(&request));
            }
        }
    }
}

proptest! {
    /// `in_order` shows what successive pops would take, and changes
    /// nothing: the same pushes and services, then pops, agree with it.
    #[test]
    fn in_order_is_the_order_pops_take(
        ops in prop::collection::vec(op(), 0..120),
        limit in 0usize..40,
    ) {
        let now = Instant::now();
        for name in [FIFO, PRIORITY, FAIR_SHARE] {
            let mut queue = order(name);
            let mut next = 0u64;
            for op in &ops {
                match op {
                    Op::Push { priority, tenant, tokens } => {
                        queue.push(waiting(next, *priority, &tenant.to_string(), *tokens, now));
                        next += 1;
                    }
                    Op::Pop => {
                        queue.pop();
                    }
                    Op::Remove(ticket) => {
                        queue.remove(*ticket);
                    }
                    Op::Take(_) => {}
                    Op::Served { tenant, tokens } => {
                        queue.served("0", &tenant.to_string(), *tokens);
                    }
                }
            }
            let shown = queue.in_order(limit);
            prop_assert_eq!(shown.len(), limit.min(queue.len()));
            let popped: Vec<u64> = (0..shown.len())
                .filter_map(|_| queue.pop().map(|w| w.ticket))
                .collect();
            prop_assert_eq!(shown, popped, "{}", name);
        }
    }
}

#[test]
fn a_request_waits_for_its_busy_worker_unless_that_would_miss_its_deadline() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let busy = wait(3.0);
    let patient = match room.arrive(&arrival(0, None), busy, now) {
        Decision::Queued(ticket) => ticket,
        other => panic!("queued, not {other:?}"),
    };
    let hurried = match room.arrive(&arrival(0, Some(10_000)), busy, now) {
        Decision::Queued(ticket) => ticket,
        other => panic!("queued, not {other:?}"),
    };
    let turns = room.release_order();
    assert_eq!(
        turns.iter().map(|turn| turn.ticket).collect::<Vec<_>>(),
        vec![patient, hurried]
    );
    let later = now + Duration::from_secs(5);
    // A chosen worker with room (or a policy that cannot tell): released.
    assert_eq!(
        room.route(&turns[0], at_worker(wait(0.1)), later),
        Route::Chosen
    );
    assert_eq!(room.route(&turns[1], at_worker(None), later), Route::Chosen);
    // A busy one: waited for, without a deadline, while it still meets
    // the deadline, or while a worker with room would meet it later.
    assert_eq!(
        room.route(&turns[0], at_worker(wait(30.0)), later),
        Route::Wait
    );
    assert_eq!(
        room.route(&turns[1], at_worker(wait(3.0)), later),
        Route::Wait
    );
    assert_eq!(
        room.route(&turns[1], at_worker(wait(6.0)), later),
        Route::Wait
    );
    // At the last moment (the deadline less twice the threshold and the
    // prefill), the best worker with room, unless its own still meets it.
    let threshold = Duration::from_millis(DEFAULT_REORDER_ABOVE_WAIT_MS);
    let last = now + Duration::from_secs(10) - 2 * threshold - Duration::from_millis(100);
    assert_eq!(
        room.route(&turns[1], at_worker(wait(6.0)), last),
        Route::WithRoom
    );
    let busy_but_in_time = wait(1.5 * threshold.as_secs_f64());
    assert_eq!(
        room.route(&turns[1], at_worker(busy_but_in_time), last),
        Route::Wait
    );
    assert_eq!(
        room.route(&turns[0], at_worker(wait(30.0)), last),
        Route::Wait
    );
    // The one behind is released first; the other keeps its place.
    let released = room.take(hurried, later).expect("queued");
    assert_eq!(released.waited, Duration::from_secs(5));
    assert_eq!(room.take(hurried, later), None);
    assert_eq!(room.head().map(|head| head.ticket), Some(patient));
}

#[test]
fn a_request_that_passes_goes_to_its_busy_worker_at_once() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    let busy = wait(3.0);
    for _ in 0..3 {
        assert!(matches!(
            room.arrive(&arrival(1, None), busy, now),
            Decision::Queued(_)
        ));
    }
    let urgent = match room.arrive(&arrival(0, None), busy, now) {
        Decision::Queued(ticket) => ticket,
        other => panic!("queued, not {other:?}"),
    };
    let turns = room.release_order();
    let passing: Vec<u64> = turns
        .iter()
        .filter(|turn| turn.passes)
        .map(|turn| turn.ticket)
        .collect();
    assert_eq!(passing, vec![urgent]);
    assert_eq!(turns[0].ticket, urgent);
    let threshold = DEFAULT_REORDER_ABOVE_WAIT_MS as f64 / 1000.0;
    let busy_within_reach = wait(0.9 * PASS_WITHIN_THRESHOLDS * threshold);
    assert_eq!(
        room.route(&turns[0], at_worker(busy_within_reach), now),
        Route::Chosen
    );
    assert_eq!(
        room.route(&turns[1], at_worker(busy_within_reach), now),
        Route::Wait
    );
    // Further, it waits for its worker as the rest do.
    assert_eq!(
        room.route(&turns[0], at_worker(wait(30.0)), now),
        Route::Wait
    );
}

#[test]
fn release_order_looks_a_bounded_way_ahead() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    for _ in 0..RELEASE_LOOKAHEAD + 5 {
        room.arrive(&arrival(1, None), wait(3.0), now);
    }
    assert_eq!(room.release_order().len(), RELEASE_LOOKAHEAD);
}

#[test]
fn a_deadline_is_judged_at_the_chosen_worker_and_the_fleet_decides_room() {
    let now = Instant::now();
    let mut room = room(RoomConfig::default());
    // The fleet has room, but the worker the policy would choose (its
    // prefix's) is 3 s away: a 2 s deadline is refused at once.
    let expected = Expected {
        fleet: wait(0.1),
        chosen: wait(3.0),
    };
    assert!(matches!(
        room.arrive(&arrival(0, Some(2000)), expected, now),
        Decision::Rejected(rejection) if rejection.reason == RejectReason::DeadlineUnmeetable
    ));
    // Without a deadline it goes at once, as without a room.
    assert_eq!(
        room.arrive(&arrival(0, None), expected, now),
        Decision::DispatchNow
    );
    assert!(room.has_deadline(&arrival(0, Some(2000))));
    assert!(!room.has_deadline(&arrival(0, None)));
}

/// Queues a request (every worker busy) and returns its ticket.
fn queue(room: &mut AdmissionRoom, at: Instant) -> u64 {
    match room.arrive(&arrival(0, None), wait(3.0), at) {
        Decision::Queued(ticket) => ticket,
        other => panic!("queued, not {other:?}"),
    }
}

fn peers_oldest(oldest_arrived: Instant) -> Option<RoomReport> {
    Some(RoomReport {
        oldest_arrived: Some(oldest_arrived),
        ..RoomReport::default()
    })
}

#[test]
fn a_replica_leaves_the_room_to_one_whose_oldest_request_waited_longer() {
    let start = Instant::now();
    let lag = RoomConfig::default().peer_lag;
    let mut room = room(RoomConfig::default());
    let own = queue(&mut room, start + 4 * lag);
    let now = start + 5 * lag;
    // Behind one router (or while no other is heard) it never yields.
    assert!(!room.yields_to_peers(now));
    // A peer's oldest request arrived within the lag of this room's: no turn.
    room.set_peers(peers_oldest(start + 3 * lag + lag / 2));
    assert!(!room.yields_to_peers(now));
    // More than the lag before: this replica leaves the room to it ...
    room.set_peers(peers_oldest(start));
    assert!(room.yields_to_peers(now));
    assert!(room.yields_to_peers(now + lag / 2));
    // ... for at most the lag: by then the peer could not use it.
    assert!(!room.yields_to_peers(now + lag));
    // A newer report (the peer sent its oldest) is yielded to afresh.
    room.set_peers(peers_oldest(start + lag));
    assert!(room.yields_to_peers(now + lag));
    // The room shows the peers' oldest wait.
    let view = room.view(now);
    assert_eq!(
        view.peers_oldest_wait_s,
        Some((now - start - lag).as_secs_f64())
    );
    assert_eq!(room.oldest_arrived(), Some(start + 4 * lag));
    assert_eq!(room.pop(now).map(|released| released.ticket), Some(own));
}

#[test]
fn an_arrival_waits_while_a_peer_s_request_has_waited_longer() {
    let start = Instant::now();
    let lag = RoomConfig::default().peer_lag;
    let mut room = room(RoomConfig::default());
    let idle = wait(0.0);
    room.set_peers(peers_oldest(start));
    // The fleet has room and this room is empty, but another replica's
    // request has waited longer: it goes first.
    assert!(matches!(
        room.arrive(&arrival(0, None), idle, start + 3 * lag),
        Decision::Queued(_)
    ));
    // Once the peer's oldest is within the lag of a new arrival, it goes.
    room.set_peers(peers_oldest(start + 3 * lag));
    room.remove(1);
    assert_eq!(
        room.arrive(&arrival(0, None), idle, start + 3 * lag),
        Decision::DispatchNow
    );
}

#[test]
fn a_worker_a_peer_s_head_waits_for_is_left_to_it() {
    let start = Instant::now();
    let lag = RoomConfig::default().peer_lag;
    let worker = WorkerId::new(3, 0);
    let other = WorkerId::new(4, 0);
    let mut room = room(RoomConfig::default());
    let head = queue(&mut room, start);
    let second = queue(&mut room, start);
    let turns = room.release_order();
    assert_eq!(turns[0].ticket, head);
    let now = start + 4 * lag;
    let with_room = wait(0.0).map(|wait| (worker, wait));
    room.set_peers(Some(RoomReport {
        waiting_for: BTreeMap::from([(worker, start + lag)]),
        ..RoomReport::default()
    }));
    assert!(room.peer_waits_for(worker, now));
    assert!(!room.peer_waits_for(other, now));
    // Not this room's head: leaves the worker to the peer's head.
    assert_eq!(room.route(&turns[1], with_room, now), Route::Wait);
    // This room's head, waiting for it only from now: leaves it too ...
    assert_eq!(room.route(&turns[0], with_room, now), Route::Wait);
    // ... for at most the lag, after which the peer is taken to be unable
    // to use it.
    let later = now + lag;
    assert!(!room.peer_waits_for(worker, later));
    assert_eq!(room.route(&turns[0], with_room, later), Route::Chosen);
    // What this room tells the others: its head waits for that worker.
    let report = room.report(now);
    assert_eq!(report.oldest_arrived, Some(start));
    assert_eq!(report.waiting_for, BTreeMap::from([(worker, now)]));
    assert_eq!(room.take(second, later).map(|r| r.ticket), Some(second));
}

#[test]
fn a_head_that_waited_for_its_worker_first_keeps_it() {
    let start = Instant::now();
    let lag = RoomConfig::default().peer_lag;
    let worker = WorkerId::new(3, 0);
    let mut room = room(RoomConfig::default());
    queue(&mut room, start);
    let turns = room.release_order();
    // The head waits for its busy worker from `start`.
    assert_eq!(
        room.route(&turns[0], wait(3.0).map(|wait| (worker, wait)), start),
        Route::Wait
    );
    room.set_peers(Some(RoomReport {
        waiting_for: BTreeMap::from([(worker, start + lag / 2)]),
        ..RoomReport::default()
    }));
    // The worker has room: the head that has waited longer takes it.
    assert_eq!(
        room.route(&turns[0], wait(0.0).map(|wait| (worker, wait)), start + lag),
        Route::Chosen
    );
}

#[test]
fn behind_replicas_a_request_waits_for_its_busy_worker_for_a_bounded_time() {
    let start = Instant::now();
    let worker = WorkerId::new(1, 0);
    let busy = wait(30.0).map(|wait| (worker, wait));
    for peers in [None, Some(RoomReport::default())] {
        let mut room = room(RoomConfig::default());
        queue(&mut room, start);
        room.set_peers(peers.clone());
        let turns = room.release_order();
        assert_eq!(room.route(&turns[0], busy, start), Route::Wait);
        let after = start + WORKER_WAIT_BEHIND_REPLICAS;
        // One router keeps the worker's room for it; behind several, it
        // joins that worker's queue.
        let expected = if peers.is_some() {
            Route::Chosen
        } else {
            Route::Wait
        };
        assert_eq!(room.route(&turns[0], busy, after), expected);
    }
}

#[test]
fn reports_combine_the_oldest_wait_the_busy_workers_the_first_waits_and_the_queues() {
    let start = Instant::now();
    let second = Duration::from_secs(1);
    let (a, b) = (WorkerId::new(1, 0), WorkerId::new(2, 0));
    let combined = RoomReport::combine([
        RoomReport {
            oldest_arrived: Some(start + second),
            prefill_busy_workers: 2.0,
            waiting_for: BTreeMap::from([(a, start + second)]),
            queued_requests: 3,
        },
        RoomReport {
            oldest_arrived: Some(start),
            prefill_busy_workers: f64::NAN,
            waiting_for: BTreeMap::from([(a, start), (b, start + second)]),
            queued_requests: usize::MAX,
        },
        RoomReport::default(),
    ]);
    assert_eq!(combined.oldest_arrived, Some(start));
    // A report's count that is not a number counts as none.
    assert_eq!(combined.prefill_busy_workers, 2.0);
    assert_eq!(
        combined.waiting_for,
        BTreeMap::from([(a, start), (b, start + second)])
    );
    assert_eq!(combined.queued_requests, usize::MAX);
    assert_eq!(RoomReport::combine([]), RoomReport::default());
}

#[test]
fn the_prompts_other_replicas_send_count_toward_a_prefill_bound_fleet() {
    // This replica's prompts keep four of eight workers busy: not bound
    // alone; with another replica's report of two more, it is.
    let mut room = room(RoomConfig::default());
    let now = send_prompts(&mut room, 8, 320, 40, Instant::now());
    reorder_now(&mut room, now);
    assert!(!room.view(now).prefill_bound);
    let report = room.report(now);
    assert!(
        (report.prefill_busy_workers - 4.0).abs() < 0.2,
        "{report:?}"
    );
    room.set_peers(Some(RoomReport {
        prefill_busy_workers: 2.0,
        ..RoomReport::default()
    }));
    reorder_now(&mut room, now);
    assert!(room.view(now).prefill_bound);
}

#[test]
fn having_sent_a_request_a_room_yields_afresh() {
    let start = Instant::now();
    let lag = RoomConfig::default().peer_lag;
    let mut room = room(RoomConfig::default());
    let first = queue(&mut room, start + 4 * lag);
    queue(&mut room, start + 4 * lag);
    room.set_peers(peers_oldest(start));
    let now = start + 5 * lag;
    assert!(room.yields_to_peers(now));
    // The peer did not take the room within the lag: this room sends one.
    assert!(!room.yields_to_peers(now + lag));
    assert!(room.take(first, now + lag).is_some());
    // The same peer request still waits longer: yielded to again.
    assert!(room.yields_to_peers(now + lag));
}

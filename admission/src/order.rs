//! The three built-in orders, one structure: flows of waiting requests,
//! grouped by class and, for `fair_share`, by tenant within a class.
//!
//! Between flows the order is weighted fair queuing on a virtual token
//! counter (after "Fairness in Serving Large Language Models", Sheng et
//! al., 2024): each flow counts the token work it has been served over its
//! weight, and the waiting flow whose head would finish first on that count
//! (its count plus the head's work over the weight) goes next, so a flow of
//! weight 8 takes eight requests' worth of work for each one of a flow of
//! weight one. A flow that starts waiting is lifted to the least count among those
//! already waiting, so time spent idle banks no credit. Because every
//! waiting flow's count is passed in turn, no class or tenant starves: a
//! request's standing rises as the others are served, which is the order's
//! aging. Within a flow, requests go oldest first.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use policy_core::{Admission, FlowView, Waiting};

pub const FIFO: &str = "fifo";
pub const PRIORITY: &str = "priority";
pub const FAIR_SHARE: &str = "fair_share";

/// What the order separates into flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grouping {
    /// One flow: arrival order, whatever the class or tenant.
    Fifo,
    /// A flow per class.
    Classes,
    /// A flow per class, and per tenant within it.
    ClassesAndTenants,
}

#[derive(Debug, Default)]
struct TenantFlow {
    weight: f64,
    /// Work served over weight.
    served: f64,
    queue: VecDeque<Waiting>,
    queued_work: u64,
}

#[derive(Debug, Default)]
struct ClassFlow {
    priority: i32,
    weight: f64,
    served: f64,
    queued: usize,
    queued_work: u64,
    tenants: BTreeMap<Arc<str>, TenantFlow>,
    /// The least count among the tenants waiting (`None`: none waits),
    /// kept as they change: a push lifts to it and a request passes at
    /// it, without a scan of the tenants.
    least_waiting_served: Option<f64>,
    /// Where an idle tenant of this class is lifted to when none waits.
    tenant_floor: f64,
}

impl ClassFlow {
    /// Recounts [`least_waiting_served`](Self::least_waiting_served) after
    /// a tenant whose count was the least changed or stopped waiting.
    fn recount_least(&mut self, changed_served: f64) {
        if self
            .least_waiting_served
            .is_some_and(|least| changed_served <= least)
        {
            self.least_waiting_served = self
                .tenants
                .values()
                .filter(|tenant| !tenant.queue.is_empty())
                .map(|tenant| tenant.served)
                .min_by(f64::total_cmp);
        }
    }
}

/// Flows of waiting requests under a virtual token counter.
#[derive(Debug)]
pub(crate) struct FlowOrder {
    grouping: Grouping,
    classes: BTreeMap<Arc<str>, ClassFlow>,
    len: usize,
    /// Where an idle class is lifted to when none waits.
    class_floor: f64,
    /// Pops since idle flows were last swept.
    pops_since_sweep: u32,
}

/// A tenant's place among its class's in [`FlowOrder::in_order`]: the
/// least finish first, then the older head, then the tenant first in the
/// class's map (as a scan for the least would choose).
#[derive(Debug, Clone, Copy)]
struct TenantTurn {
    finish: f64,
    arrived: Instant,
    tenant: usize,
}

impl TenantTurn {
    fn new(tenant: usize, (finish, arrived): (f64, Instant)) -> TenantTurn {
        TenantTurn {
            finish,
            arrived,
            tenant,
        }
    }
}

impl Ord for TenantTurn {
    /// Reversed: the max-heap's top is the turn that goes first.
    fn cmp(&self, other: &TenantTurn) -> Ordering {
        other
            .finish
            .total_cmp(&self.finish)
            .then(other.arrived.cmp(&self.arrived))
            .then(other.tenant.cmp(&self.tenant))
    }
}

impl PartialOrd for TenantTurn {
    fn partial_cmp(&self, other: &TenantTurn) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for TenantTurn {
    fn eq(&self, other: &TenantTurn) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for TenantTurn {}

/// Every this many pops, every flow that waits for nothing and that a push
/// would lift anyway is dropped, so tenants seen once (a name is the
/// client's to choose) are not kept for ever.
const SWEEP_EVERY_POPS: u32 = 1024;

fn key(separate: bool, name: &Arc<str>) -> Arc<str> {
    if separate {
        name.clone()
    } else {
        Arc::from("")
    }
}

impl FlowOrder {
    pub(crate) fn new(grouping: Grouping) -> FlowOrder {
        FlowOrder {
            grouping,
            classes: BTreeMap::new(),
            len: 0,
            class_floor: 0.0,
            pops_since_sweep: 0,
        }
    }

    fn class_key(&self, request: &Waiting) -> Arc<str> {
        key(self.grouping != Grouping::Fifo, &request.class)
    }

    fn tenant_key(&self, request: &Waiting) -> Arc<str> {
        key(
            self.grouping == Grouping::ClassesAndTenants,
            &request.tenant,
        )
    }

    /// The waiting class served next: the least finish of its next
    /// request, the lower priority value on a tie.
    fn next_class(&self) -> Option<(&Arc<str>, &ClassFlow)> {
        self.classes
            .iter()
            .filter_map(|(key, class)| {
                let (_, tenant) = FlowOrder::next_tenant(class)?;
                let head_work = tenant.queue.front()?.work_tokens;
                Some((key, class, class.served + head_work as f64 / class.weight))
            })
            .min_by(|(_, a, a_finish), (_, b, b_finish)| {
                a_finish
                    .total_cmp(b_finish)
                    .then(a.priority.cmp(&b.priority))
            })
            .map(|(key, class, _)| (key, class))
    }

    /// The waiting tenant of `class` served next: the least finish of its
    /// head, the older head on a tie.
    fn next_tenant(class: &ClassFlow) -> Option<(&Arc<str>, &TenantFlow)> {
        let finish = |tenant: &TenantFlow| {
            let head = tenant.queue.front()?;
            Some((
                tenant.served + head.work_tokens as f64 / tenant.weight,
                head.arrived,
            ))
        };
        class
            .tenants
            .iter()
            .filter_map(|(key, tenant)| Some((key, tenant, finish(tenant)?)))
            .min_by(|(_, _, (a, a_head)), (_, _, (b, b_head))| {
                a.total_cmp(b).then(a_head.cmp(b_head))
            })
            .map(|(key, tenant, _)| (key, tenant))
    }

    /// The count a flow starting to wait is lifted to: the least among
    /// those waiting, or the floor when none waits.
    fn lift(counts: impl Iterator<Item = f64>, floor: f64) -> f64 {
        counts.min_by(f64::total_cmp).unwrap_or(floor)
    }

    /// Work served before a request of `own_work` that waits behind
    /// `own_ahead` work in its own flow (count `own_served`, weight
    /// `own_weight`), given the other waiting flows as (count, weight,
    /// queued work): theirs that would finish before it does.
    fn ahead_among(
        own_ahead: u64,
        own_work: u64,
        own_served: f64,
        own_weight: f64,
        others: impl Iterator<Item = (f64, f64, u64)>,
    ) -> u64 {
        let reached = own_served + own_ahead.saturating_add(own_work) as f64 / own_weight;
        let mut ahead = own_ahead;
        for (served, weight, queued_work) in others {
            let share = ((reached - served).max(0.0) * weight).min(queued_work as f64);
            ahead = ahead.saturating_add(share as u64);
        }
        ahead
    }

    /// Work ahead of a request waiting behind `tenant_ahead` work of its
    /// own tenant flow, in flows `class_key` / `tenant_key`. Counts of
    /// flows not waiting are lifted as a push would lift them.
    fn ahead_of(
        &self,
        class_key: &Arc<str>,
        tenant_key: &Arc<str>,
        tenant_ahead: u64,
        own_work: u64,
        class_weight: f64,
        tenant_weight: f64,
    ) -> u64 {
        let class = self.classes.get(class_key);
        let waiting_classes = || {
            self.classes
                .iter()
                .filter(|(key, class)| class.queued > 0 && *key != class_key)
        };
        let (class_served, in_class) = match class {
            Some(class) => {
                let waiting_tenants = || {
                    class
                        .tenants
                        .iter()
                        .filter(|(key, t)| !t.queue.is_empty() && *key != tenant_key)
                };
                let tenant = class.tenants.get(tenant_key);
                let tenant_served = match tenant {
                    Some(t) if !t.queue.is_empty() => t.served,
                    // Not waiting: lifted as a push would lift it.
                    _ => tenant
                        .map_or(0.0, |t| t.served)
                        .max(class.least_waiting_served.unwrap_or(class.tenant_floor)),
                };
                let in_class = FlowOrder::ahead_among(
                    tenant_ahead,
                    own_work,
                    tenant_served,
                    tenant_weight,
                    waiting_tenants().map(|(_, t)| (t.served, t.weight, t.queued_work)),
                );
                let class_served = if class.queued > 0 {
                    class.served
                } else {
                    class.served.max(FlowOrder::lift(
                        waiting_classes().map(|(_, c)| c.served),
                        self.class_floor,
                    ))
                };
                (class_served, in_class)
            }
            None => (
                FlowOrder::lift(waiting_classes().map(|(_, c)| c.served), self.class_floor),
                tenant_ahead,
            ),
        };
        FlowOrder::ahead_among(
            in_class,
            own_work,
            class_served,
            class_weight,
            waiting_classes().map(|(_, c)| (c.served, c.weight, c.queued_work)),
        )
    }

    pub(crate) fn push(&mut self, request: Waiting) {
        let class_key = self.class_key(&request);
        let tenant_key = self.tenant_key(&request);
        let class_lift = FlowOrder::lift(
            self.classes
                .values()
                .filter(|c| c.queued > 0)
                .map(|c| c.served),
            self.class_floor,
        );
        let grouping = self.grouping;
        let class = self.classes.entry(class_key).or_default();
        if class.queued == 0 {
            class.served = class.served.max(class_lift);
        }
        // A FIFO's single flow has no class of its own.
        (class.priority, class.weight) = match grouping {
            Grouping::Fifo => (0, 1.0),
            _ => (request.priority, request.class_weight),
        };
        let tenant_lift = class.least_waiting_served.unwrap_or(class.tenant_floor);
        let tenant = class.tenants.entry(tenant_key).or_default();
        if tenant.queue.is_empty() {
            tenant.served = tenant.served.max(tenant_lift);
        }
        class.least_waiting_served = Some(
            class
                .least_waiting_served
                .map_or(tenant.served, |least| least.min(tenant.served)),
        );
        tenant.weight = match grouping {
            Grouping::ClassesAndTenants => request.tenant_weight,
            _ => 1.0,
        };
        class.queued += 1;
        class.queued_work = class.queued_work.saturating_add(request.work_tokens);
        tenant.queued_work = tenant.queued_work.saturating_add(request.work_tokens);
        tenant.queue.push_back(request);
        self.len += 1;
    }

    pub(crate) fn peek(&self) -> Option<&Waiting> {
        let (_, class) = self.next_class()?;
        let (_, tenant) = FlowOrder::next_tenant(class)?;
        tenant.queue.front()
    }

    pub(crate) fn pop(&mut self) -> Option<Waiting> {
        let class_key = self.next_class()?.0.clone();
        let class = self.classes.get(&class_key)?;
        let tenant_key = FlowOrder::next_tenant(class)?.0.clone();
        self.take_at(&class_key, &tenant_key, 0)
    }

    /// The tickets of the first `limit` requests in the order `pop` would
    /// take them: the same choice between flows, on copies of their counts.
    pub(crate) fn in_order(&self, limit: usize) -> Vec<u64> {
        struct Tenant<'a> {
            served: f64,
            weight: f64,
            queue: &'a VecDeque<Waiting>,
            next: usize,
        }
        impl Tenant<'_> {
            fn head(&self) -> Option<&Waiting> {
                self.queue.get(self.next)
            }
            fn finish(&self) -> Option<(f64, Instant)> {
                let head = self.head()?;
                Some((
                    self.served + head.work_tokens as f64 / self.weight,
                    head.arrived,
                ))
            }
        }
        struct Class<'a> {
            served: f64,
            weight: f64,
            priority: i32,
            tenants: Vec<Tenant<'a>>,
            /// The tenants with a request left, next first: a turn costs
            /// a logarithm of the tenants, not a scan of them.
            turns: BinaryHeap<TenantTurn>,
        }
        impl Class<'_> {
            fn next_tenant(&self) -> Option<usize> {
                self.turns.peek().map(|turn| turn.tenant)
            }
        }
        let mut classes: Vec<Class<'_>> = self
            .classes
            .values()
            .filter(|class| class.queued > 0)
            .map(|class| {
                let tenants: Vec<Tenant<'_>> = class
                    .tenants
                    .values()
                    .filter(|tenant| !tenant.queue.is_empty())
                    .map(|tenant| Tenant {
                        served: tenant.served,
                        weight: tenant.weight,
                        queue: &tenant.queue,
                        next: 0,
                    })
                    .collect();
                let turns = tenants
                    .iter()
                    .enumerate()
                    .filter_map(|(tenant, state)| Some(TenantTurn::new(tenant, state.finish()?)))
                    .collect();
                Class {
                    served: class.served,
                    weight: class.weight,
                    priority: class.priority,
                    tenants,
                    turns,
                }
            })
            .collect();
        let mut tickets = Vec::with_capacity(limit.min(self.len));
        while tickets.len() < limit {
            let next = classes
                .iter()
                .enumerate()
                .filter_map(|(index, class)| {
                    let tenant = &class.tenants[class.next_tenant()?];
                    let work = tenant.head()?.work_tokens;
                    Some((index, class, class.served + work as f64 / class.weight))
                })
                .min_by(|(_, a, a_finish), (_, b, b_finish)| {
                    a_finish
                        .total_cmp(b_finish)
                        .then(a.priority.cmp(&b.priority))
                })
                .map(|(index, _, _)| index);
            let Some(class) = next.and_then(|index| classes.get_mut(index)) else {
                break;
            };
            let Some(turn) = class.turns.pop() else {
                break;
            };
            let Some(tenant) = class.tenants.get_mut(turn.tenant) else {
                break;
            };
            let Some(head) = tenant.head() else {
                break;
            };
            let work = head.work_tokens as f64;
            tickets.push(head.ticket);
            tenant.next += 1;
            tenant.served += work / tenant.weight;
            class.served += work / class.weight;
            if let Some(turn) = tenant
                .finish()
                .map(|finish| TenantTurn::new(turn.tenant, finish))
            {
                class.turns.push(turn);
            }
        }
        tickets
    }

    /// Removes the request `ticket` and counts its prompt as served, as
    /// `pop` does for the head.
    pub(crate) fn take(&mut self, ticket: u64) -> Option<Waiting> {
        let (class_key, tenant_key, index) =
            self.classes.iter().find_map(|(class_key, class)| {
                class.tenants.iter().find_map(|(tenant_key, tenant)| {
                    let index = tenant.queue.iter().position(|w| w.ticket == ticket)?;
                    Some((class_key.clone(), tenant_key.clone(), index))
                })
            })?;
        self.take_at(&class_key, &tenant_key, index)
    }

    fn take_at(
        &mut self,
        class_key: &Arc<str>,
        tenant_key: &Arc<str>,
        index: usize,
    ) -> Option<Waiting> {
        let class = self.classes.get_mut(class_key)?;
        let tenant = class.tenants.get_mut(tenant_key)?;
        let request = tenant.queue.remove(index)?;
        let work = request.work_tokens;
        self.class_floor = class.served;
        class.tenant_floor = tenant.served;
        let before = tenant.served;
        tenant.served += work as f64 / tenant.weight;
        tenant.queued_work = tenant.queued_work.saturating_sub(work);
        class.served += work as f64 / class.weight;
        class.queued -= 1;
        class.queued_work = class.queued_work.saturating_sub(work);
        class.recount_least(before);
        self.len -= 1;
        self.forget_idle(class_key, tenant_key);
        self.pops_since_sweep += 1;
        if self.pops_since_sweep >= SWEEP_EVERY_POPS {
            self.sweep_idle();
        }
        Some(request)
    }

    /// Drops every flow that waits for nothing and whose count a push
    /// would lift anyway.
    fn sweep_idle(&mut self) {
        self.pops_since_sweep = 0;
        let class_floor = self.class_floor;
        self.classes.retain(|_, class| {
            let tenant_floor = class.tenant_floor;
            class
                .tenants
                .retain(|_, tenant| !tenant.queue.is_empty() || tenant.served > tenant_floor);
            class.queued > 0 || !class.tenants.is_empty() || class.served > class_floor
        });
    }

    pub(crate) fn remove(&mut self, ticket: u64) -> Option<Waiting> {
        let mut found = None;
        for (class_key, class) in &mut self.classes {
            for (tenant_key, tenant) in &mut class.tenants {
                if let Some(index) = tenant.queue.iter().position(|w| w.ticket == ticket) {
                    let request = tenant.queue.remove(index)?;
                    tenant.queued_work = tenant.queued_work.saturating_sub(request.work_tokens);
                    found = Some((
                        class_key.clone(),
                        tenant_key.clone(),
                        request,
                        tenant.served,
                    ));
                    break;
                }
            }
            if let Some((_, _, request, served)) = &found {
                class.queued -= 1;
                class.queued_work = class.queued_work.saturating_sub(request.work_tokens);
                class.recount_least(*served);
                break;
            }
        }
        let (class_key, tenant_key, request, _) = found?;
        self.len -= 1;
        self.forget_idle(&class_key, &tenant_key);
        Some(request)
    }

    /// Drops a flow that waits for nothing and whose count a push would
    /// lift anyway, so tenants seen once are not kept for ever.
    fn forget_idle(&mut self, class_key: &Arc<str>, tenant_key: &Arc<str>) {
        let Some(class) = self.classes.get_mut(class_key) else {
            return;
        };
        if let Some(tenant) = class.tenants.get(tenant_key)
            && tenant.queue.is_empty()
            && tenant.served <= class.tenant_floor
        {
            class.tenants.remove(tenant_key);
        }
        if class.queued == 0 && class.tenants.is_empty() && class.served <= self.class_floor {
            self.classes.remove(class_key);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `request`, queued, is its flow's one waiting request while
    /// others wait, and its flow's count (lifted as it started to wait) is
    /// at most every other waiting flow's, among classes and among its
    /// class's tenants: it would start first under start-time fair
    /// queuing. A flow sending more than its share runs ahead on its count
    /// and stops passing.
    pub(crate) fn passes(&self, request: &Waiting) -> bool {
        // It waits, so the least count among the waiting is at most its
        // own: at most every other's is at most the least.
        self.lone_and_class_first(request)
            .is_some_and(|(class, tenant)| {
                class
                    .least_waiting_served
                    .is_some_and(|least| tenant.served <= least)
            })
    }

    /// The class and tenant flows of `request` if it is its flow's one
    /// waiting request while others wait, and its class's count is at most
    /// every other waiting class's.
    fn lone_and_class_first(&self, request: &Waiting) -> Option<(&ClassFlow, &TenantFlow)> {
        let class_key = self.class_key(request);
        let class = self.classes.get(&class_key)?;
        let tenant = class.tenants.get(&self.tenant_key(request))?;
        let class_first = self
            .classes
            .iter()
            .filter(|(key, other)| **key != class_key && other.queued > 0)
            .all(|(_, other)| class.served <= other.served);
        (tenant.queue.len() == 1 && self.len > 1 && class_first).then_some((class, tenant))
    }

    pub(crate) fn same_flow(&self, a: &Waiting, b: &Waiting) -> bool {
        self.class_key(a) == self.class_key(b) && self.tenant_key(a) == self.tenant_key(b)
    }

    /// The newest request of the flow that would finish last, if it would
    /// finish after `request` would: first among classes, then among the
    /// tenants of the newcomer's class. A flow's tail finishes at its count
    /// plus its queued work over its weight.
    pub(crate) fn eviction_for(&self, request: &Waiting) -> Option<u64> {
        let class_key = self.class_key(request);
        let tenant_key = self.tenant_key(request);
        let (class_weight, tenant_weight) = match self.grouping {
            Grouping::Fifo => return None,
            Grouping::Classes => (request.class_weight, 1.0),
            Grouping::ClassesAndTenants => (request.class_weight, request.tenant_weight),
        };
        let work = request.work_tokens as f64;
        let own_class = self.classes.get(&class_key);
        let own_class_finish = own_class
            .map_or(0.0, |c| c.served + c.queued_work as f64 / c.weight)
            + work / class_weight;
        let last_class = self
            .classes
            .iter()
            .filter(|(_, class)| class.queued > 0)
            .map(|(key, class)| {
                (
                    key,
                    class,
                    class.served + class.queued_work as f64 / class.weight,
                )
            })
            .max_by(|(_, _, a), (_, _, b)| a.total_cmp(b));
        match last_class {
            Some((key, class, finish)) if *key != class_key && finish > own_class_finish => {
                let (_, tenant, _) = last_tenant(class, None)?;
                return tenant.queue.back().map(|w| w.ticket);
            }
            _ => {}
        }
        let class = own_class?;
        let own_tenant_finish = class
            .tenants
            .get(&tenant_key)
            .map_or(0.0, |t| t.served + t.queued_work as f64 / t.weight)
            + work / tenant_weight;
        let (_, tenant, finish) = last_tenant(class, Some(&tenant_key))?;
        (finish > own_tenant_finish)
            .then(|| tenant.queue.back().map(|w| w.ticket))
            .flatten()
    }

    pub(crate) fn work_ahead(&self, request: &Waiting) -> u64 {
        let class_key = self.class_key(request);
        let tenant_key = self.tenant_key(request);
        let (class_weight, tenant_weight) = match self.grouping {
            Grouping::Fifo => (1.0, 1.0),
            Grouping::Classes => (request.class_weight, 1.0),
            Grouping::ClassesAndTenants => (request.class_weight, request.tenant_weight),
        };
        let tenant_ahead = self
            .classes
            .get(&class_key)
            .and_then(|class| class.tenants.get(&tenant_key))
            .map_or(0, |tenant| tenant.queued_work);
        self.ahead_of(
            &class_key,
            &tenant_key,
            tenant_ahead,
            request.work_tokens,
            class_weight,
            tenant_weight,
        )
    }

    pub(crate) fn queued_work_ahead(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(self.len);
        for (class_key, class) in &self.classes {
            for (tenant_key, tenant) in &class.tenants {
                let mut before = 0u64;
                for request in &tenant.queue {
                    let ahead = self.ahead_of(
                        class_key,
                        tenant_key,
                        before,
                        request.work_tokens,
                        class.weight,
                        tenant.weight,
                    );
                    out.push((request.ticket, ahead));
                    before = before.saturating_add(request.work_tokens);
                }
            }
        }
        out
    }

    pub(crate) fn served(&mut self, class: &str, tenant: &str, tokens: u64) {
        let class_key = match self.grouping {
            Grouping::Fifo => return,
            _ => class,
        };
        let tenant_key = match self.grouping {
            Grouping::ClassesAndTenants => tenant,
            _ => "",
        };
        if let Some(class) = self.classes.get_mut(class_key) {
            class.served += tokens as f64 / class.weight;
            let waiting_before = class.tenants.get_mut(tenant_key).and_then(|tenant| {
                let before = tenant.served;
                tenant.served += tokens as f64 / tenant.weight;
                (!tenant.queue.is_empty()).then_some(before)
            });
            if let Some(before) = waiting_before {
                class.recount_least(before);
            }
        }
    }

    pub(crate) fn drain(&mut self) -> Vec<Waiting> {
        let mut all: Vec<Waiting> = std::mem::take(&mut self.classes)
            .into_values()
            .flat_map(|class| class.tenants.into_values())
            .flat_map(|tenant| tenant.queue)
            .collect();
        self.len = 0;
        all.sort_by_key(|w| (w.arrived, w.ticket));
        all
    }

    pub(crate) fn flows(&self) -> Vec<FlowView> {
        let mut flows = Vec::new();
        for (class_key, class) in &self.classes {
            for (tenant_key, tenant) in &class.tenants {
                if tenant.queue.is_empty() {
                    continue;
                }
                flows.push(FlowView {
                    class: class_key.to_string(),
                    tenant: tenant_key.to_string(),
                    queued_requests: tenant.queue.len(),
                    queued_work_tokens: tenant.queued_work,
                    served_work_per_weight: match self.grouping {
                        Grouping::ClassesAndTenants => tenant.served,
                        _ => class.served,
                    },
                });
            }
        }
        flows
    }
}

/// The tenant of `class` (other than `skip`) whose queued requests would
/// finish last, and when.
fn last_tenant<'a>(
    class: &'a ClassFlow,
    skip: Option<&Arc<str>>,
) -> Option<(&'a Arc<str>, &'a TenantFlow, f64)> {
    class
        .tenants
        .iter()
        .filter(|(key, tenant)| !tenant.queue.is_empty() && Some(*key) != skip)
        .map(|(key, tenant)| {
            let finish = tenant.served + tenant.queued_work as f64 / tenant.weight;
            (key, tenant, finish)
        })
        .max_by(|(_, _, a), (_, _, b)| a.total_cmp(b))
}

/// A built-in order: its name and its flows.
pub(crate) struct BuiltinOrder {
    name: &'static str,
    flows: FlowOrder,
}

impl BuiltinOrder {
    pub(crate) fn new(name: &'static str, grouping: Grouping) -> BuiltinOrder {
        BuiltinOrder {
            name,
            flows: FlowOrder::new(grouping),
        }
    }
}

impl Admission for BuiltinOrder {
    fn name(&self) -> &'static str {
        self.name
    }

    fn params(&self) -> serde_json::Value {
        serde_json::json!({})
    }

    fn push(&mut self, request: Waiting) {
        self.flows.push(request);
    }

    fn peek(&self) -> Option<&Waiting> {
        self.flows.peek()
    }

    fn pop(&mut self) -> Option<Waiting> {
        self.flows.pop()
    }

    fn remove(&mut self, ticket: u64) -> Option<Waiting> {
        self.flows.remove(ticket)
    }

    fn in_order(&self, limit: usize) -> Vec<u64> {
        self.flows.in_order(limit)
    }

    fn take(&mut self, ticket: u64) -> Option<Waiting> {
        self.flows.take(ticket)
    }

    fn len(&self) -> usize {
        self.flows.len()
    }

    fn eviction_for(&self, request: &Waiting) -> Option<u64> {
        self.flows.eviction_for(request)
    }

    fn same_flow(&self, a: &Waiting, b: &Waiting) -> bool {
        self.flows.same_flow(a, b)
    }

    fn passes(&self, request: &Waiting) -> bool {
        self.flows.passes(request)
    }

    fn work_ahead(&self, request: &Waiting) -> u64 {
        self.flows.work_ahead(request)
    }

    fn queued_work_ahead(&self) -> Vec<(u64, u64)> {
        self.flows.queued_work_ahead()
    }

    fn served(&mut self, class: &str, tenant: &str, tokens: u64) {
        self.flows.served(class, tenant, tokens);
    }

    fn drain(&mut self) -> Vec<Waiting> {
        self.flows.drain()
    }

    fn flows(&self) -> Vec<FlowView> {
        self.flows.flows()
    }
}

#[cfg(test)]
impl FlowOrder {
    /// Whether `request` passes, by a scan of every waiting flow: what the
    /// kept least count stands for.
    pub(crate) fn passes_by_scan(&self, request: &Waiting) -> bool {
        self.lone_and_class_first(request)
            .is_some_and(|(class, tenant)| {
                class
                    .tenants
                    .values()
                    .filter(|other| !other.queue.is_empty())
                    .all(|other| tenant.served <= other.served)
            })
    }

    /// Every waiting request.
    pub(crate) fn waiting(&self) -> Vec<Waiting> {
        self.classes
            .values()
            .flat_map(|class| class.tenants.values())
            .flat_map(|tenant| tenant.queue.iter().cloned())
            .collect()
    }
}

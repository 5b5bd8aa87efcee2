//! The admission room on cache-heavy traffic (`docs/admission.md`): the
//! shipped `admission-rag-tenants.toml`, unchanged. RAG prompts whose
//! shared documents are cached on a few workers each, three tenants at
//! 1.3× capacity, behind one router and behind 8 replicas.
//!
//! - Behind one router, `fair_share` serves at least 0.75 of capacity and
//!   turns none of the smallest tenant's requests away. A request whose
//!   document is cached at its busy worker waits for that worker; sent to
//!   another with room, it computed the document again and pushed others'
//!   out of that cache, and the fleet served 0.19 to 0.64 of capacity.
//! - Behind 8 replicas, `fifo` serves at least 0.9 of what it serves
//!   behind one router. Each replica counts the worker's finishes as its
//!   own times the replicas sharing it; counting its own alone, it saw
//!   each worker's wait for a batch slot 8 times too long, and 8 replicas
//!   served 0.78 of what one router serves.

// Helpers outside #[test] functions unwrap too: a panic here is a failed test.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::Path;

use fleet_sim::{
    AdmissionOrder, GroupStats, Report, ResultRow, RunOptions, Scenario, run_scenarios,
};

const LOAD: f64 = 1.3;

fn report() -> Report {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join("admission-rag-tenants.toml");
    let scenario = Scenario::from_path(&path).unwrap();
    let options = RunOptions {
        threads: 2,
        progress: false,
    };
    run_scenarios(&[scenario], &options)
        .unwrap()
        .pop()
        .unwrap()
        .report
}

fn row(report: &Report, replicas: u32, admission: AdmissionOrder) -> &ResultRow {
    report
        .results
        .iter()
        .find(|row| {
            row.traffic == "rag"
                && (row.utilization - LOAD).abs() < 1e-9
                && row.router_replicas.unwrap_or(1) == replicas
                && row.admission == Some(admission.as_str())
        })
        .unwrap_or_else(|| panic!("no row for {replicas} replicas, {}", admission.as_str()))
}

fn served(row: &ResultRow) -> f64 {
    row.outcomes.as_ref().unwrap().throughput_vs_capacity
}

fn tenant<'a>(row: &'a ResultRow, name: &str) -> &'a GroupStats {
    row.by_tenant
        .iter()
        .find(|group| group.group == format!("tenant {name}"))
        .unwrap_or_else(|| panic!("no tenant {name}"))
}

#[test]
fn the_room_keeps_cached_prompts_with_their_workers_and_replicas_serve_as_one_router() {
    let report = report();
    let fifo = row(&report, 1, AdmissionOrder::Fifo);
    let fair_share = row(&report, 1, AdmissionOrder::FairShare);
    let fifo_replicas = row(&report, 8, AdmissionOrder::Fifo);
    println!(
        "served ÷ capacity: 1 router fifo {:.3}, fair_share {:.3}; 8 replicas fifo {:.3}",
        served(fifo),
        served(fair_share),
        served(fifo_replicas)
    );
    assert!(
        served(fair_share) >= 0.75,
        "fair_share served {:.3} of capacity",
        served(fair_share)
    );
    let smallest = tenant(fair_share, "C");
    assert_eq!(
        smallest.rejected_requests, 0,
        "the smallest tenant turned away: {smallest:?}"
    );
    assert!(
        served(fifo_replicas) >= 0.9 * served(fifo),
        "8 replicas served {:.3} of capacity, one router {:.3}",
        served(fifo_replicas),
        served(fifo)
    );
}

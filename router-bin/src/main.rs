//! `router`: a load-aware router for LLM inference fleets.
//!
//! Everything it does is [`router_bin::main`] with the built-in policies
//! and backends ([`router::RouterBuilder::with_builtins`]); a crate of your
//! own can add more the same way.

use std::process::ExitCode;

/// mimalloc: per-thread free lists, far cheaper than glibc's malloc for the
/// proxy's many small, short-lived allocations (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    router_bin::main(router::RouterBuilder::with_builtins())
}

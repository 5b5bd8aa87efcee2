//! `router`: a load-aware router for LLM inference fleets.
//!
//! Everything it does is [`router_bin::RouterBuilder`] with the built-in
//! policies and backends; a crate of your own can add more the same way.

use std::process::ExitCode;

fn main() -> ExitCode {
    router_bin::RouterBuilder::with_builtins().main()
}

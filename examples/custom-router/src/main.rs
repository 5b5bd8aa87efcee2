//! `custom-router`: the router with the `jsonstats` backend and the
//! `least_kv` policy added. Same command line, config layers, admin API and
//! metrics as `router`:
//!
//! ```sh
//! cargo run -p custom-router -- --config examples/custom-router/router.toml
//! ```

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut router = router::RouterBuilder::with_builtins();
    custom_router::register(&mut router);
    router_bin::main(router)
}

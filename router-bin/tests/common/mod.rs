//! What the `router` binary's tests share.

use std::future::Future;
use std::time::Duration;

/// Waits until `condition` holds, checking every 20 ms, for at most 20 s
/// (generous: a loaded 2-core machine). Panics with `what` on timeout.
pub async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if condition().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

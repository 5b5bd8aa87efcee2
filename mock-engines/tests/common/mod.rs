//! What the mock-engines integration tests share: one deadline, generous for
//! a loaded 2-core machine, and one way to wait for a condition under it.

#![allow(clippy::expect_used)]
// Each test binary compiles this module and uses only some of it.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

pub const DEADLINE: Duration = Duration::from_secs(20);

/// Calls `poll` until `accept` takes its value, checking every 10 ms, and
/// returns that value; panics if the deadline passes first.
pub async fn poll_until<T, F, Fut>(mut poll: F, accept: impl Fn(&T) -> bool) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    tokio::time::timeout(DEADLINE, async {
        loop {
            let value = poll().await;
            if accept(&value) {
                return value;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("condition not met before the deadline")
}

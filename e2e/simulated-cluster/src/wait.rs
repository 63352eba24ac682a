//! Waiting on observable conditions instead of sleeping: every test and
//! harness polls through these.

use std::time::Duration;

/// Polls `probe` every 50 ms until it gives a value, and returns that value;
/// panics naming `what` when `timeout` passes first. For tests waiting on an
/// observable state (an object written, a condition set) instead of a sleep.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `condition` every 20 ms until it holds or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    condition()
}

/// Polls `check` every 50 ms until it gives a value, and returns that
/// value; when `timeout` passes first, an error naming `what` with the
/// last reason `check` gave (for the caller to add its logs to).
pub async fn until_ok<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match check().await {
            Ok(value) => return Ok(value),
            Err(last) if tokio::time::Instant::now() >= deadline => {
                return Err(format!("{what}: not within {timeout:?}; last: {last}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

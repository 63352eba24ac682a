//! Network faults for tests: paths that go silent without closing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Copies `from` to `to` until either ends, counting each read it passes
/// on in `reads`. Once `silent` is set it swallows everything but keeps
/// both ends open, as a partitioned network path does (no FIN, no RST).
pub async fn pump_unless_silent(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    silent: Arc<AtomicBool>,
    reads: Arc<AtomicUsize>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if silent.load(Ordering::SeqCst) {
            continue;
        }
        reads.fetch_add(1, Ordering::SeqCst);
        if to.write_all(&buf[..n]).await.is_err() || to.flush().await.is_err() {
            return;
        }
    }
}

//! What an accept loop does when `accept()` fails.
//!
//! At its open-file limit a process cannot accept: `accept()` fails with
//! `EMFILE` (or `ENFILE` at the system's limit) and leaves the connection
//! in the kernel's queue, where its client waits without an answer until
//! its own timeout. Retried at once, the failing `accept()` is a busy loop
//! (the listener stays readable); retried after a pause, every queued
//! client still waits in silence.
//!
//! [`AcceptGuard`] turns that into a clear refusal: it holds one spare
//! descriptor (`/dev/null`), and on `EMFILE`/`ENFILE` closes it, accepts
//! one waiting connection, closes that at once (its client sees the
//! connection end during its TLS handshake or request and can try another
//! replica), and opens the spare again. That is work per refused
//! connection, not per loop turn: with no connection waiting, the listener
//! is not readable and the loop sleeps. Where it cannot refuse (the spare
//! could not be reopened, another error), it backs off, from 10 ms
//! doubling to 1 s. Errors that concern one connection only (it was reset
//! while queued) are retried at once.
//!
//! An episode (the first failure after a successful accept until the next
//! successful accept) is logged once when it starts, with the open-file
//! limit, and once when it ends, with what it refused; every failure is
//! counted through [`AcceptGuard::counting`].

use std::future::Future;
use std::io;
use std::task::Poll;
use std::time::{Duration, Instant};

use rustix::io::Errno;

/// First pause after an error that refusing does not cure.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A listener whose waiting connections can be refused one at a time.
pub trait PendingConnections {
    /// Accepts one connection already waiting, if there is one, and closes
    /// it; `Ok(false)` when none was waiting.
    fn refuse_one(&self) -> impl Future<Output = io::Result<bool>> + Send;
}

impl PendingConnections for tokio::net::TcpListener {
    async fn refuse_one(&self) -> io::Result<bool> {
        std::future::poll_fn(|cx| match self.poll_accept(cx) {
            Poll::Ready(Ok(_closed_when_dropped)) => Poll::Ready(Ok(true)),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Ready(Ok(false)),
        })
        .await
    }
}

impl PendingConnections for tokio::net::UnixListener {
    async fn refuse_one(&self) -> io::Result<bool> {
        std::future::poll_fn(|cx| match self.poll_accept(cx) {
            Poll::Ready(Ok(_closed_when_dropped)) => Poll::Ready(Ok(true)),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Ready(Ok(false)),
        })
        .await
    }
}

/// Why `accept()` failed, as a metric label.
pub fn reason(error: &io::Error) -> &'static str {
    match Errno::from_io_error(error) {
        Some(Errno::MFILE) => "process_open_file_limit",
        Some(Errno::NFILE) => "system_open_file_limit",
        Some(Errno::NOBUFS) | Some(Errno::NOMEM) => "no_memory",
        Some(Errno::CONNABORTED) | Some(Errno::CONNRESET) | Some(Errno::PROTO) => {
            "connection_aborted"
        }
        _ => "other",
    }
}

/// This process's open-file limits, soft and hard (`None`: unlimited);
/// reading them takes no descriptor.
pub fn open_file_limits() -> (Option<u64>, Option<u64>) {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (limit.current, limit.maximum)
}

/// Raises this process's soft open-file limit to its hard limit, as Go's
/// runtime does at start (so upstream's proxy-server and agent run with the
/// hard limit too). Returns the limits in force after.
pub fn raise_open_file_limit() -> (Option<u64>, Option<u64>) {
    let mut limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit) {
            tracing::debug!(error = %e, "the open-file limit stays as it was");
        }
    }
    open_file_limits()
}

fn describe(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_owned(), |n| n.to_string())
}

type Count = dyn Fn(&'static str, &'static str, Outcome) + Send + Sync;

/// What became of a failed `accept()`, for a counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The call failed (every failure counts once).
    Failed,
    /// A waiting connection was accepted and closed unserved.
    Refused,
}

/// The state of one accept loop's error handling; see the [module](self).
pub struct AcceptGuard {
    port: &'static str,
    spare: Option<std::fs::File>,
    episode: Option<Episode>,
    backoff: Duration,
    count: Option<Box<Count>>,
}

struct Episode {
    since: Instant,
    reason: &'static str,
    failures: u64,
    refused: u64,
}

impl AcceptGuard {
    /// The guard of the accept loop of `port` (a name for logs and labels).
    pub fn new(port: &'static str) -> Self {
        AcceptGuard {
            port,
            spare: open_spare(),
            episode: None,
            backoff: FIRST_BACKOFF,
            count: None,
        }
    }

    /// Reports every failure and refusal to `count(port, reason, outcome)`.
    pub fn counting(
        mut self,
        count: impl Fn(&'static str, &'static str, Outcome) + Send + Sync + 'static,
    ) -> Self {
        self.count = Some(Box::new(count));
        self
    }

    /// A connection was accepted: ends an episode.
    pub fn accepted(&mut self) {
        if let Some(episode) = self.episode.take() {
            tracing::warn!(
                port = self.port,
                reason = episode.reason,
                refused = episode.refused,
                failed_accepts = episode.failures,
                lasted = ?episode.since.elapsed(),
                "accepting connections again"
            );
            self.backoff = FIRST_BACKOFF;
        }
        if self.spare.is_none() {
            self.spare = open_spare();
        }
    }

    /// `accept()` on `listener` failed with `error`: counts it, logs the
    /// start of an episode, refuses a waiting connection if descriptors ran
    /// out, or waits before the next `accept()`.
    pub async fn failed(&mut self, error: &io::Error, listener: &impl PendingConnections) {
        let reason = reason(error);
        self.count(reason, Outcome::Failed);
        if reason == "connection_aborted" {
            // That connection is gone; the next one may be fine.
            tracing::debug!(port = self.port, error = %error, "a connection ended before it was accepted");
            return;
        }
        let port = self.port;
        let episode = self.episode.get_or_insert_with(|| {
            let (soft, hard) = open_file_limits();
            tracing::warn!(
                port,
                error = %error,
                open_file_limit = %describe(soft),
                hard_limit = %describe(hard),
                "cannot accept connections: refusing them until descriptors free up (logged once until accepting again)"
            );
            Episode {
                since: Instant::now(),
                reason,
                failures: 0,
                refused: 0,
            }
        });
        episode.failures += 1;
        let out_of_descriptors =
            matches!(reason, "process_open_file_limit" | "system_open_file_limit");
        if out_of_descriptors && let Some(spare) = self.spare.take() {
            drop(spare);
            let refused = listener.refuse_one().await;
            self.spare = open_spare();
            if let Ok(true) = refused {
                if let Some(episode) = self.episode.as_mut() {
                    episode.refused += 1;
                }
                self.count(reason, Outcome::Refused);
            }
            // Work per refused connection (or none was waiting: another
            // thread took it): let other tasks run, then accept again.
            if self.spare.is_some() {
                tokio::task::yield_now().await;
                return;
            }
        }
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    fn count(&self, reason: &'static str, outcome: Outcome) {
        if let Some(count) = &self.count {
            count(self.port, reason, outcome);
        }
    }
}

fn open_spare() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_name_the_limit() {
        let of = |errno: Errno| reason(&io::Error::from_raw_os_error(errno.raw_os_error()));
        assert_eq!(of(Errno::MFILE), "process_open_file_limit");
        assert_eq!(of(Errno::NFILE), "system_open_file_limit");
        assert_eq!(of(Errno::NOBUFS), "no_memory");
        assert_eq!(of(Errno::CONNABORTED), "connection_aborted");
        assert_eq!(of(Errno::INVAL), "other");
    }

    #[tokio::test]
    async fn a_waiting_connection_is_refused_and_counted() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let counted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = counted.clone();
        let mut guard = AcceptGuard::new("test").counting(move |port, reason, outcome| {
            seen.lock().unwrap().push((port, reason, outcome));
        });
        let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
        let emfile = io::Error::from_raw_os_error(Errno::MFILE.raw_os_error());
        // The connection may not be in the queue yet: fail until it is refused.
        while !counted.lock().unwrap().contains(&(
            "test",
            "process_open_file_limit",
            Outcome::Refused,
        )) {
            guard.failed(&emfile, &listener).await;
        }
        use tokio::io::AsyncReadExt;
        let mut byte = [0u8; 1];
        let read = client.read(&mut byte).await;
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the refused connection ends: {read:?}"
        );
        assert!(guard.spare.is_some(), "the spare descriptor is back");
        guard.accepted();
        assert!(guard.episode.is_none());
    }
}

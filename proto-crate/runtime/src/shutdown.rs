//! Graceful shutdown: SIGTERM (what Kubernetes sends) and SIGINT (Ctrl-C)
//! both start it; services stop accepting, drain, then close. A second
//! signal lets a binary give up on draining.

use tokio::signal::unix::{Signal, SignalKind, signal};

/// The termination signals, installed once at start-up so that none is
/// missed between two waits.
#[derive(Debug)]
pub struct Signals {
    term: Signal,
    interrupt: Signal,
}

impl Signals {
    /// Installs the handlers; fails only if the runtime cannot register them.
    pub fn install() -> std::io::Result<Self> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the next SIGTERM or SIGINT and names it.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signal_to_this_process_is_seen() {
        let mut signals = Signals::install().unwrap();
        // Raising SIGINT at ourselves is harmless once the handler is installed.
        let pid = std::process::id().to_string();
        let status = std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap();
        assert!(status.success());
        let seen = tokio::time::timeout(std::time::Duration::from_secs(10), signals.recv())
            .await
            .expect("SIGINT not delivered");
        assert_eq!(seen, "SIGINT");
    }
}

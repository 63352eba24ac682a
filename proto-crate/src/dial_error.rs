//! Why a dial through the tunnel failed: [`DialError`], what the tunnel
//! client reports, and [`ConnectError`], what the connector and a lazily
//! dialed stream report (with the target's address). Both the client and the
//! connector build them, so they live apart from either
//! (`crate::client` and `crate::connector` re-export them).

use std::time::Duration;

/// Why a dial through the tunnel failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DialError {
    #[error("open proxy stream: {0}")]
    Stream(#[from] tonic::Status),
    #[error("dial failed: {0}")]
    Refused(String),
    #[error("dial closed by the server")]
    DialClosed,
    #[error("tunnel closed before the dial completed")]
    TunnelClosed,
    #[error("dial timeout after {0:?}")]
    Timeout(Duration),
    /// A lazy stream's dial task did not finish (its runtime shut down).
    #[error("the dial task ended: {0}")]
    TaskEnded(String),
}

/// What the proxy-server answers when no agent serves the host (upstream's wording).
pub(crate) const NO_AGENT: &str = "No agent available";

/// Why a connection through the tunnel could not be opened.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectError {
    #[error("invalid target {uri:?}: {reason}")]
    InvalidTarget { uri: String, reason: &'static str },
    #[error("no agent serves {address} (is the cluster's proxy-agent connected?)")]
    NoAgent { address: String },
    #[error("the agent could not connect to {address}: {reason}")]
    Refused { address: String, reason: String },
    #[error("connecting to {address} through the tunnel timed out after {after:?}")]
    Timeout { address: String, after: Duration },
    #[error("tunnel to {address} failed: {source}")]
    Tunnel {
        address: String,
        #[source]
        source: DialError,
    },
}

impl ConnectError {
    /// The `io::ErrorKind` of a lazy stream's read or write that fails with
    /// this ([`crate::client::TunnelClient::dial_lazily`]).
    pub fn io_kind(&self) -> std::io::ErrorKind {
        match self {
            ConnectError::InvalidTarget { .. } => std::io::ErrorKind::InvalidInput,
            ConnectError::NoAgent { .. } | ConnectError::Refused { .. } => {
                std::io::ErrorKind::ConnectionRefused
            }
            ConnectError::Timeout { .. } => std::io::ErrorKind::TimedOut,
            ConnectError::Tunnel { .. } => std::io::ErrorKind::ConnectionAborted,
        }
    }

    /// The `ConnectError` somewhere in `error`'s chain of sources: a
    /// connector's error as hyper wraps it, or the inner error of the
    /// `io::Error` a lazily dialed stream failed with (which hyper, TLS
    /// and kube wrap in turn). `None` when the failure was not the tunnel's.
    pub fn find_in<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a ConnectError> {
        std::iter::successors(Some(error), |e| e.source()).find_map(|e| {
            e.downcast_ref::<ConnectError>().or_else(|| {
                // `io::Error::source` skips its inner error and returns
                // that error's source, so the inner error is looked at here.
                e.downcast_ref::<std::io::Error>()
                    .and_then(|io| io.get_ref())
                    .and_then(|inner| inner.downcast_ref::<ConnectError>())
            })
        })
    }

    pub(crate) fn from_dial(address: String, error: DialError) -> Self {
        match error {
            DialError::Refused(reason) if reason == NO_AGENT => ConnectError::NoAgent { address },
            DialError::Refused(reason) => ConnectError::Refused { address, reason },
            DialError::DialClosed => ConnectError::Refused {
                address,
                reason: "the agent closed the dial".into(),
            },
            DialError::Timeout(after) => ConnectError::Timeout { address, after },
            source => ConnectError::Tunnel { address, source },
        }
    }
}

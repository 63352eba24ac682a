//! `cluster-proxy port-forward`: a local TCP listener whose every accepted
//! connection is dialed through the tunnel to a target in a managed cluster.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cluster_proxy_proto::client::MAX_EARLY_DATA;
use cluster_proxy_proto::connector::{ConnectError, TunnelConnector};
use cluster_proxy_proto::flow::READ_CHUNK;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::address::ForwardTarget;

/// Bytes buffered per direction of one forwarded connection: one allocation
/// per direction for the connection's life, and large enough that one read
/// fills the largest DATA packet the tunnel client sends.
pub const COPY_BUFFER: usize = 4 * READ_CHUNK;

/// How long a new local connection's first bytes are waited for by default,
/// so that they ride in the dial request (`--early-data-wait`).
pub const DEFAULT_EARLY_DATA_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// Pause after a failed accept.
const ACCEPT_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid target {0}")]
    Target(String),
}

/// Per-connection results, for logs and tests.
#[derive(Debug, Default)]
pub struct ForwardStats {
    pub accepted: AtomicU64,
    pub failed: AtomicU64,
    pub completed: AtomicU64,
    /// Connections whose first bytes rode in the dial request.
    pub early_data: AtomicU64,
}

/// A bound listener forwarding to one target.
pub struct PortForward {
    listener: TcpListener,
    connector: TunnelConnector,
    target: ForwardTarget,
    uri: http::Uri,
    stats: Arc<ForwardStats>,
    early_data_wait: std::time::Duration,
}

impl PortForward {
    /// Binds `local` (port 0: any free port).
    pub async fn bind(
        local: SocketAddr,
        connector: TunnelConnector,
        target: ForwardTarget,
    ) -> Result<Self, ForwardError> {
        // The connector takes the dial address from a URI's authority.
        let uri = format!("tcp://{}", target.dial_address())
            .parse()
            .map_err(|_| ForwardError::Target(target.to_string()))?;
        let listener = TcpListener::bind(local)
            .await
            .map_err(|source| ForwardError::Listen {
                address: local,
                source,
            })?;
        Ok(PortForward {
            listener,
            connector,
            target,
            uri,
            stats: Arc::default(),
            early_data_wait: DEFAULT_EARLY_DATA_WAIT,
        })
    }

    /// Waits up to `wait` for a new local connection's first bytes and
    /// sends what came with the dial request, one tunneled round trip
    /// sooner for protocols whose client speaks first (TLS, HTTP). A protocol
    /// whose server speaks first waits that long once per connection; zero
    /// dials at once.
    pub fn with_early_data_wait(mut self, wait: std::time::Duration) -> Self {
        self.early_data_wait = wait;
        self
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn stats(&self) -> Arc<ForwardStats> {
        self.stats.clone()
    }

    /// Accepts until `stop` completes, then drops the connections still
    /// open. A failed accept or connection is logged; the listener goes on.
    pub async fn run(self, stop: impl Future<Output = ()>) {
        let mut connections = JoinSet::new();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((socket, peer)) => {
                        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                        let connector = self.connector.clone();
                        let uri = self.uri.clone();
                        let target = self.target.clone();
                        let stats = self.stats.clone();
                        let wait = self.early_data_wait;
                        connections.spawn(async move {
                            match forward(socket, &connector, &uri, wait, &stats).await {
                                Ok((up, down)) => {
                                    stats.completed.fetch_add(1, Ordering::Relaxed);
                                    tracing::debug!(%peer, %target, bytes_sent = up, bytes_received = down, "connection closed");
                                }
                                Err(error) => {
                                    stats.failed.fetch_add(1, Ordering::Relaxed);
                                    tracing::warn!(%peer, %target, %error, "forwarded connection failed");
                                }
                            }
                        });
                    }
                    // Out of descriptors and the like: the next accept may
                    // work once connections close; a pause keeps the loop
                    // from spinning meanwhile.
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(ACCEPT_RETRY).await;
                    }
                },
                // Reaps finished connections so the set does not grow.
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        connections.shutdown().await;
    }
}

/// Why one forwarded connection ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error(transparent)]
    Dial(#[from] ConnectError),
    #[error("copying: {0}")]
    Copy(#[from] std::io::Error),
}

/// Dials the target and copies both ways until both sides are done.
///
/// Half-close: end of input from one side shuts down the other side's write
/// half and the other direction keeps flowing. Towards the tunnel that is a
/// CLOSE_REQ (konnectivity has no half-close of its own); the agent first
/// flushes everything written before it, then closes the target connection.
async fn forward(
    mut local: TcpStream,
    connector: &TunnelConnector,
    uri: &http::Uri,
    early_data_wait: std::time::Duration,
    stats: &ForwardStats,
) -> Result<(u64, u64), ConnectionError> {
    let _ = local.set_nodelay(true);
    let first = first_bytes(&local, early_data_wait).await?;
    let Some(first) = first else {
        // The client closed before sending anything: nothing to dial for.
        return Ok((0, 0));
    };
    if !first.is_empty() {
        stats.early_data.fetch_add(1, Ordering::Relaxed);
    }
    let mut tunnel = connector.connect_with_early_data(uri, first).await?;
    let copied =
        tokio::io::copy_bidirectional_with_sizes(&mut local, &mut tunnel, COPY_BUFFER, COPY_BUFFER)
            .await?;
    Ok(copied)
}

/// What the local client sent within `wait` of being accepted (empty when
/// nothing came, `None` when it closed without sending).
async fn first_bytes(
    local: &TcpStream,
    wait: std::time::Duration,
) -> std::io::Result<Option<bytes::Bytes>> {
    if wait.is_zero() || tokio::time::timeout(wait, local.readable()).await.is_err() {
        return Ok(Some(bytes::Bytes::new()));
    }
    let mut first = vec![0u8; MAX_EARLY_DATA];
    match local.try_read(&mut first) {
        Ok(0) => Ok(None),
        Ok(n) => {
            first.truncate(n);
            Ok(Some(first.into()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(Some(bytes::Bytes::new())),
        Err(e) => Err(e),
    }
}

//! `cluster-proxy port-forward`: a local TCP listener whose every accepted
//! connection is dialed through the tunnel to a target in a managed cluster.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cluster_proxy_proto::connector::{ConnectError, TunnelConnector};
use cluster_proxy_proto::flow::READ_CHUNK;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::address::ForwardTarget;

/// Bytes buffered per direction of one forwarded connection: one allocation
/// per direction for the connection's life, and large enough that one read
/// fills the largest DATA packet the tunnel client sends.
pub const COPY_BUFFER: usize = 4 * READ_CHUNK;

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
}

/// A bound listener forwarding to one target.
pub struct PortForward {
    listener: TcpListener,
    connector: TunnelConnector,
    target: ForwardTarget,
    uri: http::Uri,
    stats: Arc<ForwardStats>,
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
        })
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
                        connections.spawn(async move {
                            match forward(socket, &connector, &uri).await {
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
) -> Result<(u64, u64), ConnectionError> {
    let _ = local.set_nodelay(true);
    let mut tunnel = connector.connect(uri).await?;
    let copied =
        tokio::io::copy_bidirectional_with_sizes(&mut local, &mut tunnel, COPY_BUFFER, COPY_BUFFER)
            .await?;
    Ok(copied)
}

//! A TCP load balancer standing in for the Kubernetes Service in front of the
//! proxy-server replicas' agent ports. Each new connection goes to the next
//! backend in turn ([`Selection::RoundRobin`], like IPVS and many cloud
//! balancers) or to a random one ([`Selection::Random`], like kube-proxy's
//! iptables mode), skipping backends that refuse. Agents learn how many
//! replicas exist from the `servercount` header and must reach each through
//! this one address; round-robin is the harder case for them, since agents
//! that retry in alternation keep drawing the replica they already hold.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How the balancer picks the backend of a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Selection {
    /// The next backend in turn.
    #[default]
    RoundRobin,
    /// A uniformly random backend.
    Random,
}

impl Selection {
    pub fn name(self) -> &'static str {
        match self {
            Selection::RoundRobin => "round-robin",
            Selection::Random => "random",
        }
    }
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Accepts on `listener` forever and splices each connection to a backend
/// chosen by `selection`.
pub async fn serve(
    listener: TcpListener,
    backends: Vec<SocketAddr>,
    selection: Selection,
) -> std::io::Result<()> {
    serve_backends(listener, Backends::new(backends), selection).await
}

/// The backends of a balancer, changeable while it runs: a Service's
/// endpoints as pods come and go.
#[derive(Debug, Clone, Default)]
pub struct Backends(Arc<Mutex<Vec<SocketAddr>>>);

impl Backends {
    pub fn new(backends: Vec<SocketAddr>) -> Self {
        Backends(Arc::new(Mutex::new(backends)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<SocketAddr>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `backend` (once) for new connections.
    pub fn add(&self, backend: SocketAddr) {
        let mut backends = self.lock();
        if !backends.contains(&backend) {
            backends.push(backend);
        }
    }

    /// Takes `backend` out of the rotation; its open connections stay.
    pub fn remove(&self, backend: SocketAddr) {
        self.lock().retain(|b| *b != backend);
    }

    pub fn list(&self) -> Vec<SocketAddr> {
        self.lock().clone()
    }
}

/// [`serve`] over backends that may change while it runs.
pub async fn serve_backends(
    listener: TcpListener,
    backends: Backends,
    selection: Selection,
) -> std::io::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let (inbound, peer) = listener.accept().await?;
        let backends = backends.list();
        let start = match selection {
            Selection::RoundRobin => next.fetch_add(1, Ordering::Relaxed),
            Selection::Random => rand::random_range(0..backends.len().max(1)),
        };
        tokio::spawn(async move {
            let Some(mut outbound) = connect_any(&backends, start).await else {
                tracing::warn!(%peer, "no backend accepts connections; closing");
                return;
            };
            let mut inbound = inbound;
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
    }
}

async fn connect_any(backends: &[SocketAddr], start: usize) -> Option<TcpStream> {
    for offset in 0..backends.len() {
        let backend = backends[(start + offset) % backends.len()];
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend)).await {
            Ok(Ok(stream)) => return Some(stream),
            Ok(Err(err)) => tracing::debug!(%backend, %err, "backend refused"),
            Err(_) => tracing::debug!(%backend, "backend connect timed out"),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn tagged_backend(tag: u8) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let _ = socket.write_all(&[tag]).await;
            }
        });
        addr
    }

    async fn first_byte(addr: SocketAddr) -> u8 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        byte[0]
    }

    #[tokio::test]
    async fn alternates_and_skips_dead_backends() {
        let a = tagged_backend(1).await;
        let b = tagged_backend(2).await;
        let dead = crate::targets::closed_port().await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, vec![a, dead, b], Selection::RoundRobin));
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(first_byte(front).await);
        }
        // In turn: a, (dead, so) b, b, a, b, b — never the dead one.
        assert_eq!(seen, [1, 2, 2, 1, 2, 2]);
    }

    #[tokio::test]
    async fn random_selection_reaches_every_live_backend() {
        let a = tagged_backend(1).await;
        let b = tagged_backend(2).await;
        let dead = crate::targets::closed_port().await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, vec![a, dead, b], Selection::Random));
        let mut seen = Vec::new();
        // b also takes the dead one's share: (2/3)^64 < 1e-11 to miss a.
        for _ in 0..64 {
            seen.push(first_byte(front).await);
        }
        assert!(seen.contains(&1) && seen.contains(&2), "{seen:?}");
    }

    #[test]
    fn selection_names_are_the_command_line_values() {
        use clap::ValueEnum;
        for selection in [Selection::RoundRobin, Selection::Random] {
            assert_eq!(Selection::from_str(selection.name(), false), Ok(selection));
        }
        assert!(Selection::from_str("sticky", false).is_err());
    }
}

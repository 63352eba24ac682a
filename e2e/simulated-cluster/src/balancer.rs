//! A TCP load balancer standing in for the Kubernetes Service in front of the
//! proxy-server replicas' agent ports. Each new connection goes to the next
//! backend in turn ([`Selection::RoundRobin`], like IPVS and many cloud
//! balancers) or to a random one ([`Selection::Random`], like kube-proxy's
//! iptables mode), skipping backends that refuse. Agents learn how many
//! replicas exist from the `servercount` header and must reach each through
//! this one address; round-robin is the harder case for them, since agents
//! that retry in alternation keep drawing the replica they already hold.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// The length of one bucket of [`Gate::attempts`].
pub const ATTEMPT_BUCKET: Duration = Duration::from_millis(100);

/// A switch in front of a balancer, standing in for the network between
/// agents and the hub: shut, it cuts every open connection and closes new
/// ones as soon as they arrive (the hub unreachable); it counts the
/// connections that arrive, open or shut, per [`ATTEMPT_BUCKET`].
#[derive(Debug, Clone)]
pub struct Gate(Arc<GateState>);

#[derive(Debug)]
struct GateState {
    shut: AtomicBool,
    /// Bumped by every [`Gate::shut`]; open connections watch it.
    cuts: tokio::sync::watch::Sender<u64>,
    /// Arrivals per bucket, keyed by the bucket's start in
    /// [`ATTEMPT_BUCKET`]s since the Unix epoch, so that counts of several
    /// processes add up.
    attempts: Mutex<BTreeMap<u64, u32>>,
}

impl Default for Gate {
    fn default() -> Self {
        Gate(Arc::new(GateState {
            shut: AtomicBool::new(false),
            cuts: tokio::sync::watch::Sender::new(0),
            attempts: Mutex::new(BTreeMap::new()),
        }))
    }
}

impl Gate {
    /// Cuts every open connection and closes new ones until [`Gate::open`].
    pub fn shut(&self) {
        self.0.shut.store(true, Ordering::SeqCst);
        self.0.cuts.send_modify(|cuts| *cuts += 1);
    }

    pub fn open(&self) {
        self.0.shut.store(false, Ordering::SeqCst);
    }

    fn is_shut(&self) -> bool {
        self.0.shut.load(Ordering::SeqCst)
    }

    fn count_arrival(&self) {
        let bucket = bucket_of(SystemTime::now());
        let mut attempts = self
            .0
            .attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *attempts.entry(bucket).or_default() += 1;
    }

    /// Connections that arrived, per bucket (see [`bucket_of`]).
    pub fn attempts(&self) -> BTreeMap<u64, u32> {
        self.0
            .attempts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The [`ATTEMPT_BUCKET`] `at` falls in, counted from the Unix epoch.
pub fn bucket_of(at: SystemTime) -> u64 {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    (since.as_millis() / ATTEMPT_BUCKET.as_millis()) as u64
}

/// [`serve`] over backends that may change while it runs.
pub async fn serve_backends(
    listener: TcpListener,
    backends: Backends,
    selection: Selection,
) -> std::io::Result<()> {
    serve_gated(listener, backends, selection, Gate::default()).await
}

/// [`serve_backends`] behind `gate`.
pub async fn serve_gated(
    listener: TcpListener,
    backends: Backends,
    selection: Selection,
    gate: Gate,
) -> std::io::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let (inbound, peer) = listener.accept().await?;
        gate.count_arrival();
        if gate.is_shut() {
            drop(inbound);
            continue;
        }
        let backends = backends.list();
        let start = match selection {
            Selection::RoundRobin => next.fetch_add(1, Ordering::Relaxed),
            Selection::Random => rand::random_range(0..backends.len().max(1)),
        };
        let mut cuts = gate.0.cuts.subscribe();
        tokio::spawn(async move {
            let Some(mut outbound) = connect_any(&backends, start).await else {
                tracing::warn!(%peer, "no backend accepts connections; closing");
                return;
            };
            let mut inbound = inbound;
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                // Both ends dropped: the agent and the server see the
                // connection end, as when the network between them fails.
                _ = cuts.changed() => {}
            }
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

    #[tokio::test]
    async fn a_shut_gate_cuts_open_connections_and_counts_refused_arrivals() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap();
        let echo = crate::targets::EchoServer::start().await.unwrap();
        let gate = Gate::default();
        tokio::spawn(serve_gated(
            listener,
            Backends::new(vec![echo.addr]),
            Selection::Random,
            gate.clone(),
        ));
        let mut open = TcpStream::connect(front).await.unwrap();
        open.write_all(b"x").await.unwrap();
        let mut byte = [0u8; 1];
        open.read_exact(&mut byte).await.unwrap();

        gate.shut();
        // The open connection ends, and a new one is closed unserved.
        assert_eq!(open.read(&mut byte).await.unwrap_or(0), 0);
        let mut refused = TcpStream::connect(front).await.unwrap();
        let _ = refused.write_all(b"x").await;
        assert_eq!(refused.read(&mut byte).await.unwrap_or(0), 0);

        gate.open();
        let mut again = TcpStream::connect(front).await.unwrap();
        again.write_all(b"y").await.unwrap();
        again.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"y");
        assert_eq!(gate.attempts().values().sum::<u32>(), 3);
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

//! Several proxy-server replicas in one process behind the environment's
//! load balancer ([`simulated_cluster::balancer`]), and agents that reach them only
//! through it: the HA tests (`tests/ha.rs`, `tests/ha_scaling.rs`) and the
//! `ha_convergence` example.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use proxy_agent::{ProxyAgentConfig, RunningAgent, TlsSource};
use proxy_server::RunningServer;
use proxy_server::peers::{LookupFuture, PeerLookup, PeerLookupError};
use proxy_server::settings::ProxyServerSettings;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::in_process::test_server_config;
use crate::pki::{TestPki, TestPkiError};
use simulated_cluster::balancer::{self, Backends, Selection};

#[derive(Debug, thiserror::Error)]
pub enum ReplicasError {
    #[error(transparent)]
    Pki(#[from] TestPkiError),
    #[error("starting proxy-server replica {index}: {source}")]
    Server {
        index: usize,
        #[source]
        source: proxy_server::ServerError,
    },
    #[error("starting the proxy-agent of {cluster}: {source}")]
    Agent {
        cluster: String,
        #[source]
        source: proxy_agent::AgentError,
    },
    #[error("load balancer: {0}")]
    Balancer(#[from] std::io::Error),
}

/// The peer set of scalable replicas ([`Replicas::start_scalable`]) as a
/// headless Service's DNS answer would give it: every replica looks it up
/// (as `--server-count-source=dns:<name>` does), the test changes it.
/// Lookups answer the replicas' health endpoints.
#[derive(Debug, Clone)]
pub struct PeerSet(Arc<Mutex<Result<Vec<SocketAddr>, String>>>);

impl PeerSet {
    /// `count` replicas that nothing answers for (see [`PeerSet::stand_ins`]).
    pub fn new(count: usize) -> Self {
        PeerSet(Arc::new(Mutex::new(Ok(Self::stand_ins(count)))))
    }

    /// `count` distinct health endpoints where nothing listens, for
    /// replicas a test counts but does not run (127.0.0.2 …, port 1).
    pub fn stand_ins(count: usize) -> Vec<SocketAddr> {
        (0..count)
            .map(|i| {
                let [a, b] = u16::try_from(i + 2).unwrap_or(u16::MAX).to_be_bytes();
                SocketAddr::from(([127, 0, a, b], 1))
            })
            .collect()
    }

    /// What lookups answer from now on: the replicas' health endpoints
    /// (none included), or a resolution failure with this text.
    pub fn set(&self, answer: Result<Vec<SocketAddr>, String>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = answer;
    }

    /// Lookups answer `count` stand-in replicas from now on.
    pub fn set_count(&self, count: usize) {
        self.set(Ok(Self::stand_ins(count)));
    }
}

impl PeerLookup for PeerSet {
    fn describe(&self) -> String {
        "test peer set".into()
    }

    fn lookup(&self) -> LookupFuture<'_> {
        let answer = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Box::pin(async move {
            answer.map_err(|e| PeerLookupError::Resolve {
                name: "proxy-server-peers".into(),
                source: std::io::Error::other(e),
            })
        })
    }
}

/// How often scalable replicas look their peers up: the `dns:` source's
/// default is 5 s; the tests need not wait that long.
pub const PEER_REFRESH: Duration = Duration::from_millis(100);

/// `count` replicas (`server-0` …, each told `--server-count=count`), every
/// agent port behind one balancer on 127.0.0.1.
pub struct Replicas {
    pub servers: Vec<RunningServer>,
    /// The agent Service: the only address agents are given.
    pub agent_service: SocketAddr,
    /// The agent Service's endpoints.
    pub agent_backends: Backends,
    /// `Some` for [`Replicas::start_scalable`].
    pub peers: Option<PeerSet>,
    balancer: JoinHandle<std::io::Result<()>>,
}

impl Replicas {
    /// Starts the replicas with `configure` applied to each one's
    /// configuration, then the balancer in front of their agent ports.
    pub async fn start(
        pki: &TestPki,
        count: usize,
        selection: Selection,
        configure: impl Fn(&mut ProxyServerSettings),
    ) -> Result<Self, ReplicasError> {
        Self::start_with(pki, count, selection, None, configure).await
    }

    /// [`Replicas::start`] with replicas that count their peers from a
    /// [`PeerSet`] (every [`PEER_REFRESH`]) instead of a fixed
    /// `--server-count`, so [`Replicas::scale_up`] and
    /// [`Replicas::scale_down`] need no restart.
    pub async fn start_scalable(
        pki: &TestPki,
        count: usize,
        selection: Selection,
        configure: impl Fn(&mut ProxyServerSettings),
    ) -> Result<Self, ReplicasError> {
        Self::start_with(pki, count, selection, Some(PeerSet::new(count)), configure).await
    }

    async fn start_with(
        pki: &TestPki,
        count: usize,
        selection: Selection,
        peers: Option<PeerSet>,
        configure: impl Fn(&mut ProxyServerSettings),
    ) -> Result<Self, ReplicasError> {
        let mut servers = Vec::with_capacity(count);
        for index in 0..count {
            servers.push(start_replica(pki, index, count, peers.as_ref(), &configure).await?);
        }
        if let Some(peers) = &peers {
            peers.set(Ok(health_endpoints(&servers)));
        }
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let agent_service = listener.local_addr()?;
        let agent_backends = Backends::new(servers.iter().map(|s| s.agent_addr).collect());
        let balancer = tokio::spawn(balancer::serve_backends(
            listener,
            agent_backends.clone(),
            selection,
        ));
        Ok(Replicas {
            servers,
            agent_service,
            agent_backends,
            peers,
            balancer,
        })
    }

    /// Adds a replica as scaling the Deployment up does: it starts, joins
    /// the agent Service, then the peer set (the headless Service) counts it.
    /// Returns its index in `servers`.
    pub async fn scale_up(
        &mut self,
        pki: &TestPki,
        configure: impl Fn(&mut ProxyServerSettings),
    ) -> Result<usize, ReplicasError> {
        let index = self.servers.len();
        let count = index + 1;
        let server = start_replica(pki, index, count, self.peers.as_ref(), &configure).await?;
        self.agent_backends.add(server.agent_addr);
        self.servers.push(server);
        if let Some(peers) = &self.peers {
            peers.set(Ok(health_endpoints(&self.servers)));
        }
        debug_assert_eq!(self.servers.len(), count);
        Ok(index)
    }

    /// Removes the last replica as scaling the Deployment down does: it
    /// leaves the agent Service and drains (SIGTERM), and only then does the
    /// peer set stop counting it (a terminating pod leaves DNS late). The
    /// drain runs on; await the handle for it to end.
    pub fn scale_down(&mut self) -> Option<JoinHandle<()>> {
        let server = self.servers.pop()?;
        self.agent_backends.remove(server.agent_addr);
        let drained = tokio::spawn(server.shutdown());
        if let Some(peers) = &self.peers {
            peers.set(Ok(health_endpoints(&self.servers)));
        }
        Some(drained)
    }

    /// An agent configuration for `cluster` (identifiers `host=<cluster>`)
    /// dialing the agent Service.
    pub fn agent_config(
        &self,
        pki: &TestPki,
        cluster: &str,
    ) -> Result<ProxyAgentConfig, ReplicasError> {
        let mut config = ProxyAgentConfig::new(TlsSource::Config(pki.agent_tls(cluster)?))
            .with_ephemeral_ports();
        config.proxy_server_host = "localhost".into();
        config.proxy_server_port = self.agent_service.port();
        config.agent_id = format!("{cluster}-agent");
        config.agent_identifiers = format!("host={cluster}");
        Ok(config)
    }

    /// Starts a replacement for the replica taken out of `servers` at
    /// `index` (and draining or gone), back at `index`: the same client and
    /// agent ports, so balancers in front of them reach it, `server_id` as
    /// given, `configure` applied. Binding is retried until the old replica
    /// has let go of the ports (at most 10 s).
    pub async fn replace(
        &mut self,
        pki: &TestPki,
        index: usize,
        client_addr: SocketAddr,
        agent_addr: SocketAddr,
        server_id: &str,
        configure: impl Fn(&mut ProxyServerSettings),
    ) -> Result<(), ReplicasError> {
        let mut config = test_server_config();
        config.server_id = server_id.to_owned();
        config.server_count = u32::try_from(self.servers.len() + 1).unwrap_or(u32::MAX);
        config.server_port = client_addr.port();
        config.agent_port = agent_addr.port();
        configure(&mut config);
        let started = Instant::now();
        let lookup = self
            .peers
            .as_ref()
            .map(|p| Arc::new(p.clone()) as Arc<dyn PeerLookup>);
        let server = loop {
            match proxy_server::start_with_peers(config.clone(), pki.server_tls()?, lookup.clone())
                .await
            {
                Ok(server) => break server,
                Err(proxy_server::ServerError::Bind { .. })
                    if started.elapsed() < Duration::from_secs(10) =>
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(source) => return Err(ReplicasError::Server { index, source }),
            }
        };
        self.servers.insert(index.min(self.servers.len()), server);
        if let Some(peers) = &self.peers {
            peers.set(Ok(health_endpoints(&self.servers)));
        }
        Ok(())
    }

    /// Stops every replica and the balancer.
    pub async fn shutdown(self) {
        self.balancer.abort();
        for server in self.servers {
            server.shutdown().await;
        }
    }
}

/// Every replica's health endpoint, as the headless Service lists them.
pub fn health_endpoints(servers: &[RunningServer]) -> Vec<SocketAddr> {
    servers.iter().map(|s| s.health_addr).collect()
}

async fn start_replica(
    pki: &TestPki,
    index: usize,
    count: usize,
    peers: Option<&PeerSet>,
    configure: &impl Fn(&mut ProxyServerSettings),
) -> Result<RunningServer, ReplicasError> {
    let mut config = test_server_config();
    config.server_id = format!("server-{index}");
    config.server_count = u32::try_from(count).unwrap_or(u32::MAX);
    config.server_count_refresh_interval = PEER_REFRESH;
    configure(&mut config);
    let lookup = peers.map(|p| Arc::new(p.clone()) as Arc<dyn PeerLookup>);
    proxy_server::start_with_peers(config, pki.server_tls()?, lookup)
        .await
        .map_err(|source| ReplicasError::Server { index, source })
}

/// Starts one agent per configuration, all at once (the "in step" case).
pub async fn start_agents(
    configs: Vec<ProxyAgentConfig>,
) -> Result<Vec<RunningAgent>, ReplicasError> {
    let starts = configs.into_iter().map(|config| async move {
        let cluster = config.agent_identifiers.clone();
        proxy_agent::start(config)
            .await
            .map_err(|source| ReplicasError::Agent { cluster, source })
    });
    futures_util::future::try_join_all(starts).await
}

/// Waits until every agent holds a tunnel to `replicas` distinct servers;
/// how long each agent took from `since` (in agent order), or `None` on
/// timeout. Polls every 5 ms.
pub async fn wait_full_mesh(
    agents: &[RunningAgent],
    replicas: usize,
    since: Instant,
    timeout: Duration,
) -> Option<Vec<Duration>> {
    let mut done: Vec<Option<Duration>> = vec![None; agents.len()];
    let deadline = since + timeout;
    loop {
        for (agent, slot) in agents.iter().zip(done.iter_mut()) {
            if slot.is_none() && agent.server_ids().len() >= replicas {
                *slot = Some(since.elapsed());
            }
        }
        if done.iter().all(Option::is_some) {
            return Some(done.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Why one echo round trip through the tunnel failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct EchoError(String);

/// One echo round trip (1 byte) through a fresh tunneled connection to
/// `target` via `via` (a replica's client port or a balancer in front of
/// them), HTTP CONNECT for even `n` and the gRPC client for odd `n`.
pub async fn echo_once(
    pki: &TestPki,
    via: SocketAddr,
    target: &str,
    n: usize,
) -> Result<(), EchoError> {
    use cluster_proxy_proto::transport::ALPN_HTTP11;

    let fail = |what: &str, e: &dyn std::fmt::Display| EchoError(format!("{what}: {e}"));
    let byte = [(n % 251) as u8];
    let back = if n.is_multiple_of(2) {
        let tls = pki
            .client_tls_alpn(&[ALPN_HTTP11])
            .map_err(|e| fail("client TLS", &e))?;
        let mut stream = crate::in_process::http_connect(tls, via, target)
            .await
            .map_err(|e| fail("CONNECT", &e))?;
        echo_byte(&mut stream, byte).await
    } else {
        let tls = pki.client_tls().map_err(|e| fail("client TLS", &e))?;
        let client = crate::in_process::tunnel_client(tls, via)
            .await
            .map_err(|e| fail("gRPC connect", &e))?;
        let mut stream = client
            .dial(target)
            .await
            .map_err(|e| fail("gRPC dial", &e))?;
        echo_byte(&mut stream, byte).await
    }
    .map_err(|e| fail("echo", &e))?;
    if back != byte {
        return Err(EchoError(format!("echo answered {back:?} for {byte:?}")));
    }
    Ok(())
}

/// Writes `byte` and reads one byte back.
async fn echo_byte<S>(stream: &mut S, byte: [u8; 1]) -> std::io::Result<[u8; 1]>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    stream.write_all(&byte).await?;
    let mut back = [0u8; 1];
    stream.read_exact(&mut back).await?;
    Ok(back)
}

/// Dials back to back through one address until finished, an
/// [`echo_once`] each (alternating the frontend, cycling through
/// `targets`); counts the dials and keeps every failure.
pub struct DialLoop {
    done: Arc<std::sync::atomic::AtomicUsize>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: JoinHandle<()>,
}

impl DialLoop {
    pub fn start(pki: Arc<TestPki>, via: SocketAddr, targets: Vec<String>) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

        let done = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (done, failures, stop) = (done.clone(), failures.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) && !targets.is_empty() {
                    let target = &targets[n % targets.len()];
                    if let Err(e) = echo_once(&pki, via, target, n).await {
                        failures
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(format!("dial {n} to {target}: {e}"));
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                    n += 1;
                }
            })
        };
        DialLoop {
            done,
            failures,
            stop,
            task,
        }
    }

    /// Dials made so far, failed ones included.
    pub fn done(&self) -> usize {
        self.done.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until `more` further dials were made; panics (a test helper)
    /// if the loop stalls for `timeout`.
    pub async fn wait_for(&self, more: usize, timeout: Duration) {
        let target = self.done() + more;
        assert!(
            simulated_cluster::wait::wait_until(timeout, || self.done() >= target).await,
            "dial loop stalled at {} dials",
            self.done()
        );
    }

    /// Stops the loop: the number of dials and every failure.
    pub async fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let ended = self.task.await;
        let done = self.done.load(std::sync::atomic::Ordering::SeqCst);
        if let Err(e) = ended {
            return (done, vec![format!("the dial loop panicked: {e}")]);
        }
        let failures = self
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        (done, failures)
    }
}

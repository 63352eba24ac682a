//! cluster-proxy's tunnel server.
//!
//! * agent port — `AgentService.Connect` over mTLS; each agent's certificate
//!   must name the cluster whose identifiers it registers ([`agent_service`]);
//!   each connection is driven by one task ([`grpc_port`]): gRPC on HTTP/2,
//!   the lean framing, or the lean framing in a WebSocket ([`websocket_upgrade`]).
//! * client port — `ProxyService.Proxy` (gRPC, HTTP/2) and HTTP CONNECT
//!   (HTTP/1.1) on the same mTLS port, told apart per connection
//!   ([`client_port`]).
//! * health port — `/healthz`, `/readyz`, `/metrics`; admin port — `/metrics`.
#![forbid(unsafe_code)]

pub mod agent_service;
pub mod client_port;
pub mod conn_trace;
pub mod dial;
pub mod dial_failure;
mod first_bytes;
pub mod grpc_frontend;
pub mod grpc_port;
pub mod http_connect;
pub mod listener;
pub mod metrics;
pub mod peers;
pub mod policy;
pub mod readiness;
pub mod registry;
pub mod settings;
pub mod tunnel;
pub mod websocket_upgrade;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cluster_proxy_proto::framed::ALPN_FRAMED;
use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11};
use cluster_proxy_runtime::admin;
use cluster_proxy_runtime::net::{BindError, bind};
use cluster_proxy_runtime::reload::{self, Watched};
use cluster_proxy_runtime::telemetry::relay::{self, SpanForwarder};
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use std::path::{Path, PathBuf};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::agent_service::{AgentEndpoint, AgentEndpointSettings};
use crate::client_port::ClientConnections;
use crate::dial::Dialer;
use crate::grpc_frontend::GrpcFrontend;
use crate::grpc_port::GrpcConnections;
use crate::http_connect::ConnectFrontend;
use crate::listener::{Acks, Http2Settings, Listener};
use crate::metrics::Metrics;
use crate::peers::{DnsPeers, PeerLookup, ServerCountSource};
use crate::registry::Registry;
use crate::settings::{Mode, ProxyServerSettings};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] settings::ConfigError),
    #[error("missing required flag --{0}")]
    MissingFlag(&'static str),
    #[error("{what}: {source}")]
    Tls {
        what: &'static str,
        #[source]
        source: TlsError,
    },
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    /// The OTLP settings the span relay forwards with.
    #[error(transparent)]
    Telemetry(#[from] cluster_proxy_runtime::telemetry::TelemetryError),
    #[error("listening on the Unix socket {path} (--uds-name): {source}")]
    UnixSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A `--max-…` flag's value as a count or size.
fn limit(value: u32) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

/// A keepalive flag's interval; `0` turns the pings off.
fn keepalive(interval: Duration) -> Option<Duration> {
    (!interval.is_zero()).then_some(interval)
}

/// Listens on the Unix socket `path` (`--uds-name`). An existing file is
/// removed first when `delete_existing` (upstream's
/// `--delete-existing-uds-file`, default true); else it is an error.
fn bind_unix(path: &Path, delete_existing: bool) -> Result<UnixListener, ServerError> {
    let failed = |source| ServerError::UnixSocket {
        path: path.to_owned(),
        source,
    };
    if delete_existing {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed(e)),
        }
    }
    UnixListener::bind(path).map_err(failed)
}

/// Ready-made TLS configurations for both mTLS ports.
pub struct ServerTls {
    /// Client port; must require client certificates. `None` when the
    /// frontend is a Unix socket (`--uds-name`), which has no TLS.
    pub frontend: Option<Watched<rustls::ServerConfig>>,
    /// Agent port; must require client certificates.
    pub agent: Watched<rustls::ServerConfig>,
}

fn required(value: &Option<PathBuf>, flag: &'static str) -> Result<PathBuf, ServerError> {
    value.clone().ok_or(ServerError::MissingFlag(flag))
}

/// The certificate, key and client-CA files of one mTLS port.
struct PortFiles {
    what: &'static str,
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl PortFiles {
    fn new(
        what: &'static str,
        (cert, key, ca): (&Option<PathBuf>, &Option<PathBuf>, &Option<PathBuf>),
        flags: [&'static str; 3],
    ) -> Result<Self, ServerError> {
        Ok(PortFiles {
            what,
            cert: required(cert, flags[0])?,
            key: required(key, flags[1])?,
            ca: required(ca, flags[2])?,
        })
    }

    fn build(
        &self,
        alpn: &[&[u8]],
        policy: &tls::ServerTlsPolicy,
    ) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let identity = Identity::from_files(&self.cert, &self.key)?;
        let roots = tls::roots(&Pem::file("CA bundle", &self.ca)?)?;
        // Agents reconnecting after a restart of their own or an outage
        // resume their sessions; listener::serve_tls checks a resumed
        // session's certificates for expiry.
        tls::with_session_tickets(tls::server_config_with_policy(
            identity,
            Some(roots),
            alpn,
            policy,
        )?)
    }

    /// Loads now, then reloads whenever a file changes.
    fn watch(
        self,
        alpn: &'static [&'static [u8]],
        policy: tls::ServerTlsPolicy,
        interval: Duration,
    ) -> Result<Watched<rustls::ServerConfig>, ServerError> {
        let what = self.what;
        let paths = vec![self.cert.clone(), self.key.clone(), self.ca.clone()];
        reload::watch_files(what, paths, interval, move || self.build(alpn, &policy))
            .map_err(|source| ServerError::Tls { what, source })
    }
}

/// What the client and agent ports accept: `--tls-min-version`, and
/// `--cipher-suites` for TLS 1.2 (names this build does not implement are
/// never offered, with a warning; TLS 1.3 suites are always on, as in Go).
pub fn tls_policy(config: &ProxyServerSettings) -> Result<tls::ServerTlsPolicy, ServerError> {
    let min_version = if config.tls_min_version == "VersionTLS13" {
        tls::MinTlsVersion::Tls13
    } else {
        tls::MinTlsVersion::Tls12
    };
    if config.cipher_suites.is_empty() {
        return Ok(tls::ServerTlsPolicy {
            min_version,
            tls12_suites: None,
        });
    }
    let selection =
        tls::select_cipher_suites(&config.cipher_suites).map_err(|source| ServerError::Tls {
            what: "--cipher-suites",
            source,
        })?;
    if !selection.unavailable.is_empty() {
        tracing::warn!(
            suites = %selection.unavailable.join(","),
            "--cipher-suites names suites this build does not implement (no forward secrecy or not AEAD); they are never offered"
        );
    }
    if !selection.tls13_fixed.is_empty() {
        tracing::info!(
            suites = %selection.tls13_fixed.join(","),
            "--cipher-suites names TLS 1.3 suites; every TLS 1.3 suite stays on, as in Go"
        );
    }
    if selection.tls12.is_empty() && min_version == tls::MinTlsVersion::Tls12 {
        tracing::warn!(
            "none of the --cipher-suites is a TLS 1.2 suite this build implements: only TLS 1.3 is accepted"
        );
    }
    Ok(tls::ServerTlsPolicy {
        min_version,
        tls12_suites: Some(selection.tls12),
    })
}

impl ServerTls {
    /// Fixed configurations (in-memory credentials, tests).
    pub fn fixed(frontend: Arc<rustls::ServerConfig>, agent: Arc<rustls::ServerConfig>) -> Self {
        ServerTls {
            frontend: Some(reload::fixed(frontend)),
            agent: reload::fixed(agent),
        }
    }

    /// Loads `--server-cert/--server-key/--server-ca-cert` and
    /// `--cluster-cert/--cluster-key/--cluster-ca-cert`, and reloads them when
    /// the files change (new handshakes use the new credentials; established
    /// tunnels stay up). Must run inside a tokio runtime.
    pub fn from_config(config: &ProxyServerSettings) -> Result<Self, ServerError> {
        let frontend_alpn: &'static [&'static [u8]] = match config.mode {
            Mode::Both => &[ALPN_H2, ALPN_HTTP11],
            Mode::Grpc => &[ALPN_H2],
            Mode::HttpConnect => &[ALPN_HTTP11],
        };
        let policy = tls_policy(config)?;
        // A Unix-socket frontend has no TLS (upstream ignores the files then).
        let frontend = if config.uds_name.is_empty() {
            Some(PortFiles::new(
                "client port TLS",
                (
                    &config.server_cert,
                    &config.server_key,
                    &config.server_ca_cert,
                ),
                ["server-cert", "server-key", "server-ca-cert"],
            )?)
        } else {
            None
        };
        let agent = PortFiles::new(
            "agent port TLS",
            (
                &config.cluster_cert,
                &config.cluster_key,
                &config.cluster_ca_cert,
            ),
            ["cluster-cert", "cluster-key", "cluster-ca-cert"],
        )?;
        let interval = config.credential_reload_interval;
        Ok(ServerTls {
            frontend: frontend
                .map(|files| files.watch(frontend_alpn, policy.clone(), interval))
                .transpose()?,
            agent: agent.watch(AGENT_PORT_ALPN, policy, interval)?,
        })
    }
}

/// The ALPN protocols the agent port chooses from, in its order of
/// preference: the lean framing our agents offer first, then gRPC's `h2`,
/// then HTTP/1.1 for the WebSocket upgrade (`--transport websocket`), so
/// an agent offering only that is not refused in the handshake.
pub const AGENT_PORT_ALPN: &[&[u8]] = &[ALPN_FRAMED, ALPN_H2, ALPN_HTTP11];

/// A running server. Dropping it does not stop it; call [`RunningServer::shutdown`].
pub struct RunningServer {
    pub server_id: String,
    /// The TCP client port; `0.0.0.0:0` when the frontend is the Unix
    /// socket `client_socket` (`--uds-name`) instead.
    pub client_addr: SocketAddr,
    pub client_socket: Option<PathBuf>,
    pub agent_addr: SocketAddr,
    pub health_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    server_count: tokio::sync::watch::Receiver<u32>,
    shutdown: CancellationToken,
    draining: Arc<AtomicBool>,
    /// Ends once every accepted client connection is done with its requests.
    client_listener: tokio::task::JoinHandle<()>,
    tasks: TaskTracker,
    grace: Duration,
}

impl RunningServer {
    /// Connected agent tunnels.
    pub fn tunnel_count(&self) -> usize {
        self.registry.tunnel_count()
    }

    /// Open tunneled connections across all agents.
    pub fn connection_count(&self) -> usize {
        self.registry
            .all()
            .iter()
            .map(|t| t.connection_count())
            .sum()
    }

    /// The replica count this replica tells agents now.
    pub fn server_count(&self) -> u32 {
        *self.server_count.borrow()
    }

    pub fn metrics_text(&self) -> String {
        self.metrics.encode()
    }

    /// Whether [`RunningServer::shutdown`] has started draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Drains, then stops: `/readyz` fails, both ports stop accepting (new
    /// connections are refused, so a load balancer sends clients and agents
    /// to the other replicas), every agent is sent DRAIN, and dials on
    /// connections already accepted are still served. Once no tunneled
    /// connection or dial is left, or `--graceful-shutdown-timeout` has
    /// passed, the tunnels close.
    pub async fn shutdown(mut self) {
        self.draining.store(true, Ordering::SeqCst);
        self.shutdown.cancel();
        let tunnels = self.registry.all();
        for tunnel in &tunnels {
            tunnel.announce_drain();
        }
        info!(
            server_id = self.server_id,
            agents = tunnels.len(),
            grace = ?self.grace,
            "draining: sent DRAIN to every agent, no longer accepting connections"
        );
        let deadline = tokio::time::Instant::now() + self.grace;
        // A client connection accepted just before the stop may not have
        // sent its dial yet; the tunnels must outlive it.
        let _ = tokio::time::timeout_at(deadline, &mut self.client_listener).await;
        let mut busy = self.busy_count();
        while busy > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            busy = self.busy_count();
        }
        if busy > 0 {
            warn!(
                connections = busy,
                "graceful shutdown timeout passed; closing the remaining connections"
            );
        }
        for tunnel in self.registry.all() {
            tunnel.close("server shutting down");
        }
        self.tasks.close();
        let _ = tokio::time::timeout(self.grace + Duration::from_secs(1), self.tasks.wait()).await;
    }

    /// Tunneled connections and unanswered dials across all agents.
    fn busy_count(&self) -> usize {
        self.registry.all().iter().map(|t| t.busy_count()).sum()
    }
}

/// Starts the server with TLS from the configured files.
pub async fn start(config: ProxyServerSettings) -> Result<RunningServer, ServerError> {
    let tls = ServerTls::from_config(&config)?;
    start_with_tls(config, tls).await
}

/// Starts the server with the given TLS configurations (tests build them in memory).
pub async fn start_with_tls(
    config: ProxyServerSettings,
    tls: ServerTls,
) -> Result<RunningServer, ServerError> {
    let peers: Option<Arc<dyn PeerLookup>> = match config.server_count_source()? {
        ServerCountSource::Static => None,
        ServerCountSource::Dns(name) => Some(Arc::new(DnsPeers {
            name,
            health_port: config.health_port,
        })),
    };
    start_with_peers(config, tls, peers).await
}

/// [`start_with_tls`] with the replica count taken from `peers` (starting
/// from `--server-count`) instead of `--server-count-source`; `None` keeps
/// `--server-count`. Tests drive the peer set this way without DNS.
pub async fn start_with_peers(
    config: ProxyServerSettings,
    tls: ServerTls,
    peers: Option<Arc<dyn PeerLookup>>,
) -> Result<RunningServer, ServerError> {
    check_config(&config)?;
    let server_id = config.resolved_server_id();
    let registry = Arc::new(Registry::new(config.strategies()?));
    let metrics = Arc::new(Metrics::new());
    let dialer = dialer(&config, &registry, &metrics, &server_id)?;
    let ports = bind_ports(&config, tls.frontend, &metrics).await?;
    let span_forwarder = span_forwarder(&config, &metrics)?;

    let shutdown = CancellationToken::new();
    let draining = Arc::new(AtomicBool::new(false));
    let tasks = TaskTracker::new();
    let grace = config.graceful_shutdown_timeout;
    let running = Running {
        registry: &registry,
        metrics: &metrics,
        shutdown: &shutdown,
        tasks: &tasks,
        grace,
        span_forwarder,
    };

    let (server_count, server_count_rx) = tokio::sync::watch::channel(config.server_count);
    metrics.server_count.set(i64::from(config.server_count));
    let readiness = follow_peers(&config, peers, server_count, &draining, &running);
    serve_agent_port(
        &config,
        ports.agent,
        tls.agent,
        &server_id,
        server_count_rx.clone(),
        &draining,
        &running,
    );
    let client_listener = serve_client_port(&config, ports.client, dialer, &running);
    serve_health_and_admin(ports.health, ports.admin, readiness, &running);

    info!(
        server_id,
        client_addr = %ports.client_addr,
        client_socket = ports.client_socket.as_ref().map(|p| p.display().to_string()),
        agent_addr = %ports.agent_addr,
        health_addr = %ports.health_addr,
        admin_addr = %ports.admin_addr,
        mode = ?config.mode,
        strategies = config.proxy_strategies,
        "proxy-server started"
    );
    Ok(RunningServer {
        server_id,
        client_addr: ports.client_addr,
        client_socket: ports.client_socket,
        agent_addr: ports.agent_addr,
        health_addr: ports.health_addr,
        admin_addr: ports.admin_addr,
        registry,
        metrics,
        server_count: server_count_rx,
        shutdown,
        draining,
        client_listener,
        tasks,
        grace,
    })
}

/// Refuses a configuration that cannot work or would route unsafely, and
/// warns about the flags accepted only for compatibility.
fn check_config(config: &ProxyServerSettings) -> Result<(), ServerError> {
    config.validate()?;
    config.check_routing_safety()?;
    for flag in config.ignored_settings() {
        warn!(flag, "flag accepted for compatibility and ignored");
    }
    Ok(())
}

/// The frontends' dialer, with the server-side dial timeout and the client
/// policy (read here, so a bad policy file fails the start).
fn dialer(
    config: &ProxyServerSettings,
    registry: &Arc<Registry>,
    metrics: &Arc<Metrics>,
    server_id: &str,
) -> Result<Arc<Dialer>, ServerError> {
    let timeout = if config.backend_dial_timeout.is_zero() {
        // "0" means no server-side limit upstream; a day is as good as never
        // while still guaranteeing pending dials cannot pile up forever.
        Duration::from_secs(24 * 3600)
    } else {
        config.backend_dial_timeout
    };
    Ok(Arc::new(Dialer {
        registry: registry.clone(),
        metrics: metrics.clone(),
        timeout,
        server_id: server_id.to_owned(),
        policy: config
            .client_policy
            .as_deref()
            .map(policy::ClientPolicy::load)
            .transpose()?
            .map(Arc::new),
    }))
}

/// The four ports, bound before anything is served so a taken port fails
/// the start.
struct Ports {
    client: Listener,
    client_addr: SocketAddr,
    client_socket: Option<PathBuf>,
    agent: tokio::net::TcpListener,
    agent_addr: SocketAddr,
    health: tokio::net::TcpListener,
    health_addr: SocketAddr,
    admin: tokio::net::TcpListener,
    admin_addr: SocketAddr,
}

/// Binds the client port (TCP with TLS, or the Unix socket of
/// `--uds-name`), then the agent, health and admin ports.
async fn bind_ports(
    config: &ProxyServerSettings,
    frontend_tls: Option<Watched<rustls::ServerConfig>>,
    metrics: &Arc<Metrics>,
) -> Result<Ports, ServerError> {
    let (client, client_addr, client_socket) = if config.uds_name.is_empty() {
        let tls = frontend_tls.ok_or(ServerError::MissingFlag("server-cert"))?;
        let (listener, addr) = bind(
            "client port",
            &config.server_bind_address,
            config.server_port,
        )
        .await?;
        (
            Listener::Tcp(listener, tls, metrics.clone(), Acks::Delayed),
            addr,
            None,
        )
    } else {
        let path = PathBuf::from(&config.uds_name);
        let listener = bind_unix(&path, config.delete_existing_uds_file)?;
        (
            Listener::Unix(listener),
            SocketAddr::from(([0, 0, 0, 0], 0)),
            Some(path),
        )
    };
    let (agent, agent_addr) =
        bind("agent port", &config.agent_bind_address, config.agent_port).await?;
    let (health, health_addr) = bind(
        "health port",
        &config.health_bind_address,
        config.health_port,
    )
    .await?;
    let (admin, admin_addr) =
        bind("admin port", &config.admin_bind_address, config.admin_port).await?;
    Ok(Ports {
        client,
        client_addr,
        client_socket,
        agent,
        agent_addr,
        health,
        health_addr,
        admin,
        admin_addr,
    })
}

/// What every served part of a starting server shares.
struct Running<'a> {
    registry: &'a Arc<Registry>,
    metrics: &'a Arc<Metrics>,
    shutdown: &'a CancellationToken,
    tasks: &'a TaskTracker,
    grace: Duration,
    span_forwarder: Option<Arc<SpanForwarder>>,
}

/// The forwarder of the spans agents relay through their tunnels, when
/// the server exports traces itself (`relay_collector`) and its packets may
/// be as large as a span batch.
fn span_forwarder(
    config: &ProxyServerSettings,
    metrics: &Metrics,
) -> Result<Option<Arc<SpanForwarder>>, ServerError> {
    let Some(collector) = &config.relay_collector else {
        return Ok(None);
    };
    let needed = relay::MAX_SPAN_BATCH + 1024;
    if limit(config.max_packet_size) < needed {
        warn!(
            max_packet_size = config.max_packet_size,
            needed, "the span relay is off: --max-packet-size is smaller than a span batch"
        );
        return Ok(None);
    }
    let forwarder = cluster_proxy_runtime::telemetry::span_forwarder(
        collector,
        relay::FORWARD_QUEUE_BATCHES,
        metrics.relayed_spans(),
    )?;
    if forwarder.is_some() {
        info!(
            queue_batches = relay::FORWARD_QUEUE_BATCHES,
            "agents without a trace collector may relay their spans through their tunnels"
        );
    }
    Ok(forwarder.map(Arc::new))
}

/// Starts counting the replicas when there is a way to (`peers`), and
/// returns the readiness check that goes with it: caught up with the
/// agents the other replicas hold, or, alone, any agent at all.
fn follow_peers(
    config: &ProxyServerSettings,
    peers: Option<Arc<dyn PeerLookup>>,
    server_count: tokio::sync::watch::Sender<u32>,
    draining: &Arc<AtomicBool>,
    running: &Running<'_>,
) -> readiness::Readiness {
    let Running {
        registry,
        metrics,
        shutdown,
        tasks,
        ..
    } = *running;
    match peers {
        Some(lookup) => {
            info!(source = lookup.describe(), every = ?config.server_count_refresh_interval, "counting the proxy-server replicas");
            let (found, peer_addresses) = tokio::sync::watch::channel(Vec::new());
            tasks.spawn(peers::follow(
                lookup,
                config.server_count_refresh_interval,
                server_count,
                found,
                registry.clone(),
                metrics.clone(),
                shutdown.clone(),
            ));
            let catch_up = Arc::new(readiness::CatchUp::default());
            tasks.spawn(readiness::catch_up(
                catch_up.clone(),
                registry.clone(),
                peer_addresses,
                std::time::Instant::now(),
                config.readiness_agent_wait,
                shutdown.clone(),
            ));
            readiness::Readiness::caught_up(draining.clone(), registry.clone(), catch_up)
        }
        None => readiness::Readiness::any_agent(draining.clone(), registry.clone()),
    }
}

/// Serves `AgentService.Connect` on the agent port.
fn serve_agent_port(
    config: &ProxyServerSettings,
    listener: tokio::net::TcpListener,
    tls: Watched<rustls::ServerConfig>,
    server_id: &str,
    server_count: tokio::sync::watch::Receiver<u32>,
    draining: &Arc<AtomicBool>,
    running: &Running<'_>,
) {
    let agent_endpoint = AgentEndpoint {
        settings: AgentEndpointSettings {
            server_id: server_id.to_owned(),
            server_count,
            allow_unbound_agents: config.allow_unbound_agents,
            flow_control_window: config.flow_control_window,
            plain_peer_buffer: config.plain_peer_buffer,
            plain_peer_stall_timeout: config.plain_peer_stall_timeout,
            ordered_capacity: 256,
            max_tunnels_per_agent: limit(config.max_tunnels_per_agent),
            max_pending_dials_per_tunnel: limit(config.max_pending_dials_per_tunnel),
            max_stray_closes_per_tunnel: limit(config.max_stray_closes_per_tunnel),
            span_forwarder: running.span_forwarder.clone(),
        },
        registry: running.registry.clone(),
        metrics: running.metrics.clone(),
        draining: draining.clone(),
    };
    running.tasks.spawn(listener::serve(
        "agent",
        Listener::Tcp(listener, tls, running.metrics.clone(), Acks::Immediate),
        GrpcConnections {
            method: agent_endpoint,
            max_packet_size: limit(config.max_packet_size),
            http2: Http2Settings {
                keepalive: keepalive(config.keepalive_time),
                max_concurrent_streams: config.max_concurrent_streams,
                windows: cluster_proxy_proto::transport::TUNNEL_WINDOWS,
            },
            shutdown: running.shutdown.clone(),
        },
        running.shutdown.clone(),
        running.grace,
        running.metrics.accept_guard("agent"),
    ));
}

/// Serves the client port: gRPC and HTTP CONNECT, as `--mode` says. The
/// returned task ends when the port has stopped accepting.
fn serve_client_port(
    config: &ProxyServerSettings,
    listener: Listener,
    dialer: Arc<Dialer>,
    running: &Running<'_>,
) -> tokio::task::JoinHandle<()> {
    let client_http2 = Http2Settings {
        keepalive: keepalive(config.frontend_keepalive_time),
        max_concurrent_streams: config.max_concurrent_streams,
        windows: cluster_proxy_proto::transport::CLIENT_WINDOWS,
    };
    let grpc = matches!(config.mode, Mode::Both | Mode::Grpc).then(|| GrpcConnections {
        method: GrpcFrontend {
            dialer: dialer.clone(),
            metrics: running.metrics.clone(),
            first_packet_timeout: config.first_packet_timeout,
        },
        max_packet_size: limit(config.max_packet_size),
        http2: client_http2,
        shutdown: running.shutdown.clone(),
    });
    let connect = matches!(config.mode, Mode::Both | Mode::HttpConnect).then(|| {
        Arc::new(ConnectFrontend {
            dialer: dialer.clone(),
            metrics: running.metrics.clone(),
        })
    });
    let client_connections =
        ClientConnections::new(grpc, connect, client_http2, running.shutdown.clone());
    running.tasks.spawn(listener::serve(
        "client",
        listener,
        client_connections,
        running.shutdown.clone(),
        running.grace,
        running.metrics.accept_guard("client"),
    ))
}

/// Serves the health port (probes, metrics, the agent count) and the admin
/// port (metrics).
fn serve_health_and_admin(
    health_listener: tokio::net::TcpListener,
    admin_listener: tokio::net::TcpListener,
    readiness: readiness::Readiness,
    running: &Running<'_>,
) {
    let health_metrics = running.metrics.clone();
    let counted = running.registry.clone();
    let health = admin::Routes::probes(move || readiness.check())
        .with_metrics(move || health_metrics.encode())
        .with_text(readiness::AGENT_COUNT_PATH, move || {
            format!("{}\n", counted.agent_count())
        });
    running.tasks.spawn(admin::serve_guarded(
        health_listener,
        health,
        running.shutdown.clone(),
        running.metrics.accept_guard("health"),
    ));
    let admin_metrics = running.metrics.clone();
    let admin_routes = admin::Routes::metrics_only(move || admin_metrics.encode());
    running.tasks.spawn(admin::serve_guarded(
        admin_listener,
        admin_routes,
        running.shutdown.clone(),
        running.metrics.accept_guard("admin"),
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_certificate_files_are_named() {
        let mut config = ProxyServerSettings::default();
        let err = ServerTls::from_config(&config)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("--server-cert"), "{err}");
        config.server_cert = Some("/nonexistent/proxy-server.crt".into());
        config.server_key = Some("/nonexistent/proxy-server.key".into());
        config.server_ca_cert = Some("/nonexistent/ca.crt".into());
        let err = ServerTls::from_config(&config)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("--cluster-cert"), "{err}");
        config.cluster_cert = Some("/nonexistent/agent-server.crt".into());
        config.cluster_key = Some("/nonexistent/agent-server.key".into());
        config.cluster_ca_cert = Some("/nonexistent/ca.crt".into());
        let err = ServerTls::from_config(&config)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("/nonexistent/proxy-server.crt"), "{err}");
    }
}

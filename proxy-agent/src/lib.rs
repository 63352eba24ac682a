//! cluster-proxy agent: a Rust reimplementation of the konnectivity
//! (apiserver-network-proxy) agent.
//!
//! The agent dials out to the proxy-servers (`AgentService.Connect`), holds one
//! tunnel per server replica, and opens the TCP connections the servers ask
//! for inside the managed cluster.
//!
//! Start one in-process with [`start`]; the returned [`RunningAgent`] reports
//! its bound addresses and tunnels and shuts down with DRAIN.
#![forbid(unsafe_code)]

pub mod config;
mod connection;
pub mod dial;
mod manager;
pub mod metrics;
pub mod tunnel;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::flow::DEFAULT_WINDOW;
use cluster_proxy_proto::framed::ALPN_FRAMED;
use cluster_proxy_proto::identifiers::AgentIdentifiers;
use cluster_proxy_proto::transport::ALPN_H2;
use cluster_proxy_runtime::admin::{self, NotReady};
use cluster_proxy_runtime::net::{BindError, bind};
use cluster_proxy_runtime::reload;
use cluster_proxy_runtime::tls::{self, Identity, Pem, TlsError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::{AgentSettings, Cli, ConfigError};
pub use manager::ConnectError;
pub use metrics::Metrics;

use crate::manager::Shared;

/// Where the TLS client configuration for the proxy-server comes from.
#[derive(Debug, Clone)]
pub enum TlsSource {
    /// PEM files, read and checked at [`start`].
    Files {
        ca_cert: PathBuf,
        agent_cert: Option<PathBuf>,
        agent_key: Option<PathBuf>,
        /// ALPN protocols offered in addition to `h2`, which gRPC always
        /// offers (upstream's `--alpn-proto`).
        alpn: Vec<String>,
    },
    /// A ready configuration; it must offer ALPN `h2`.
    Config(Arc<rustls::ClientConfig>),
}

impl TlsSource {
    /// The files to watch for credential rotation.
    pub fn paths(&self) -> Vec<PathBuf> {
        match self {
            TlsSource::Config(_) => Vec::new(),
            TlsSource::Files {
                ca_cert,
                agent_cert,
                agent_key,
                ..
            } => std::iter::once(ca_cert.clone())
                .chain(agent_cert.clone())
                .chain(agent_key.clone())
                .collect(),
        }
    }

    /// Builds the client configuration; errors name the offending file.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, AgentError> {
        match self {
            TlsSource::Config(config) => Ok(config.clone()),
            TlsSource::Files {
                ca_cert,
                agent_cert,
                agent_key,
                alpn,
            } => {
                let roots = tls::roots(&Pem::file("CA certificate (--ca-cert)", ca_cert)?)?;
                let identity = match (agent_cert, agent_key) {
                    (Some(cert), Some(key)) => Some(Identity::new(
                        &Pem::file("agent certificate (--agent-cert)", cert)?,
                        &Pem::file("agent key (--agent-key)", key)?,
                    )?),
                    (None, None) => None,
                    _ => {
                        return Err(AgentError::Invalid {
                            field: "agent-cert",
                            reason: "--agent-cert and --agent-key must be given together".into(),
                        });
                    }
                };
                Ok(tls::client_config(roots, identity, &offered_alpn(alpn))?)
            }
        }
    }
}

/// The ALPN protocols an agent offers for `--alpn-proto` values `extra`:
/// those, then `h2` unless already listed, as grpc-go appends it.
pub fn offered_alpn(extra: &[String]) -> Vec<&[u8]> {
    let mut offered: Vec<&[u8]> = extra.iter().map(|p| p.as_bytes()).collect();
    if !offered.contains(&ALPN_H2) {
        offered.push(ALPN_H2);
    }
    offered
}

/// `config` offering the lean framing first when `lean` (ALPN is the
/// client's offer in its order; our servers choose the framing, others `h2`),
/// or offering it not at all.
pub fn offering_framing(
    config: Arc<rustls::ClientConfig>,
    lean: bool,
) -> Arc<rustls::ClientConfig> {
    let offered = config.alpn_protocols.first().map(Vec::as_slice) == Some(ALPN_FRAMED);
    let anywhere = config.alpn_protocols.iter().any(|p| p == ALPN_FRAMED);
    if lean == offered && (lean || !anywhere) {
        return config;
    }
    let mut config = (*config).clone();
    config.alpn_protocols.retain(|p| p != ALPN_FRAMED);
    if lean {
        config.alpn_protocols.insert(0, ALPN_FRAMED.to_vec());
    }
    Arc::new(config)
}

/// Runtime configuration of an agent. [`AgentConfig::new`] gives upstream's
/// defaults; [`AgentSettings::to_agent_config`] builds one from flags.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub tls: TlsSource,
    pub proxy_server_host: String,
    pub proxy_server_port: u16,
    pub agent_id: String,
    /// `agentidentifiers` value (URL query form), validated at [`start`].
    pub agent_identifiers: String,
    /// Empty: all interfaces. Port 0: an ephemeral port.
    pub health_server_host: String,
    pub health_server_port: u16,
    pub admin_bind_address: String,
    pub admin_server_port: u16,
    /// Pause between successful syncs, and the first backoff step.
    pub sync_interval: Duration,
    /// Longest backoff between failed connects.
    pub sync_interval_cap: Duration,
    /// Keep dialing every interval even when every known server is connected.
    pub sync_forever: bool,
    /// Timeout for one TCP+TLS+Connect attempt to the proxy-server.
    pub connect_timeout: Duration,
    /// Token file sent as `authorization: Bearer` (re-read at every connect).
    pub service_account_token_path: Option<PathBuf>,
    /// Our per-connection receive window; 0 disables flow control.
    pub flow_control_window: u32,
    /// Per-connection receive buffer when the server is plain konnectivity.
    pub plain_peer_buffer: u32,
    /// SO_RCVBUF of each connection to a target (`None`: kernel autotuning).
    pub target_receive_buffer: Option<u32>,
    pub dial_timeout: Duration,
    /// How often credential files are checked for rotation.
    pub credential_reload_interval: Duration,
    /// Ping interval on tunnels (`--keepalive-time`); 0 disables pings.
    pub keepalive_time: Duration,
    /// Offer the lean framing ahead of `h2` (`--lean-framing`).
    pub lean_framing: bool,
    /// Names resolved to fixed addresses before DNS, like a pod's `hostAliases`.
    pub host_aliases: dial::HostAliases,
    /// How long [`RunningAgent::shutdown`] waits for open endpoint
    /// connections after sending DRAIN.
    pub shutdown_grace: Duration,
}

impl AgentConfig {
    pub fn new(tls: TlsSource) -> Self {
        AgentConfig {
            tls,
            proxy_server_host: "127.0.0.1".into(),
            proxy_server_port: 8091,
            agent_id: uuid::Uuid::new_v4().to_string(),
            agent_identifiers: String::new(),
            health_server_host: String::new(),
            health_server_port: 8093,
            admin_bind_address: "127.0.0.1".into(),
            admin_server_port: 8094,
            sync_interval: Duration::from_secs(1),
            sync_interval_cap: Duration::from_secs(10),
            sync_forever: false,
            connect_timeout: Duration::from_secs(10),
            service_account_token_path: None,
            flow_control_window: DEFAULT_WINDOW,
            plain_peer_buffer: 4 * 1024 * 1024,
            target_receive_buffer: None,
            dial_timeout: Duration::from_secs(5),
            host_aliases: dial::HostAliases::new(),
            credential_reload_interval: cluster_proxy_runtime::reload::DEFAULT_INTERVAL,
            keepalive_time: Duration::from_secs(3600),
            lean_framing: true,
            shutdown_grace: Duration::from_secs(5),
        }
    }

    /// Health and admin servers on 127.0.0.1 ephemeral ports, so several
    /// agents can run in one process (tests).
    pub fn with_ephemeral_ports(mut self) -> Self {
        self.health_server_host = "127.0.0.1".into();
        self.health_server_port = 0;
        self.admin_bind_address = "127.0.0.1".into();
        self.admin_server_port = 0;
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Names the offending file.
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("invalid --{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error(transparent)]
    Bind(#[from] BindError),
}

/// Upstream's readiness failure body, which probes and runbooks match on.
pub const NOT_READY_BODY: &str = "[+]ping ok\n[-]server-connected failed: no servers connected\n";

fn validate(config: &AgentConfig) -> Result<(), AgentError> {
    AgentIdentifiers::parse_like_upstream(&config.agent_identifiers).map_err(|e| {
        AgentError::Invalid {
            field: "agent-identifiers",
            reason: e.to_string(),
        }
    })?;
    if config.agent_id.is_empty() || config.agent_id.contains(|c: char| !c.is_ascii_graphic()) {
        return Err(AgentError::Invalid {
            field: "agent-id",
            reason: format!(
                "{:?} must be non-empty printable ASCII without spaces",
                config.agent_id
            ),
        });
    }
    if config.sync_interval.is_zero() || config.sync_interval_cap < config.sync_interval {
        return Err(AgentError::Invalid {
            field: "sync-interval-cap",
            reason: "must be greater than or equal to a non-zero --sync-interval".into(),
        });
    }
    Ok(())
}

/// A started agent.
pub struct RunningAgent {
    shared: Arc<Shared>,
    health_addr: SocketAddr,
    admin_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RunningAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningAgent")
            .field("agent_id", &self.shared.agent_id())
            .field("health_addr", &self.health_addr)
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

/// Loads credentials, binds the health and admin ports and starts connecting
/// to the proxy-server. Returns once the listeners are bound; tunnels come up
/// in the background (see [`RunningAgent::wait_for_tunnels`]).
pub async fn start(config: AgentConfig) -> Result<RunningAgent, AgentError> {
    validate(&config)?;
    let lean = config.lean_framing;
    let tls = match &config.tls {
        TlsSource::Config(fixed) => reload::fixed(offering_framing(fixed.clone(), lean)),
        files @ TlsSource::Files { .. } => {
            let paths = files.paths();
            let source = files.clone();
            reload::watch_files(
                "agent credentials",
                paths,
                config.credential_reload_interval,
                move || {
                    source
                        .client_config()
                        .map(|config| offering_framing(config, lean))
                        .map_err(|e| match e {
                            AgentError::Tls(t) => t,
                            other => TlsError::Config(other.to_string()),
                        })
                },
            )?
        }
    };
    let (health, health_addr) = bind(
        "health server",
        &config.health_server_host,
        config.health_server_port,
    )
    .await?;
    let (admin, admin_addr) = bind(
        "admin server",
        &config.admin_bind_address,
        config.admin_server_port,
    )
    .await?;
    let root = CancellationToken::new();
    let shared = Arc::new(Shared::new(config, tls, root.clone()));
    tracing::info!(
        agent_id = %shared.agent_id(),
        server = %shared.server_address(),
        %health_addr,
        %admin_addr,
        "proxy-agent started"
    );
    let probed = shared.clone();
    let exposed = shared.clone();
    let health_routes = admin::Routes::probes(move || {
        if probed.tunnel_count() > 0 {
            Ok(())
        } else {
            Err(NotReady {
                status: http::StatusCode::SERVICE_UNAVAILABLE,
                body: NOT_READY_BODY.into(),
            })
        }
    })
    .with_metrics(move || exposed.metrics().encode());
    let exposed = shared.clone();
    let admin_routes = admin::Routes::metrics_only(move || exposed.metrics().encode());
    let tasks = vec![
        tokio::spawn(admin::serve(health, health_routes, root.clone())),
        tokio::spawn(admin::serve(admin, admin_routes, root.clone())),
        tokio::spawn(manager::run(shared.clone())),
    ];
    Ok(RunningAgent {
        shared,
        health_addr,
        admin_addr,
        tasks,
    })
}

impl RunningAgent {
    pub fn agent_id(&self) -> &str {
        self.shared.agent_id()
    }

    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Tunnels open now (one per distinct proxy-server).
    pub fn tunnel_count(&self) -> usize {
        self.shared.tunnel_count()
    }

    /// Tunnels to servers that have not announced a drain: those count
    /// towards holding every replica.
    pub fn active_tunnel_count(&self) -> usize {
        self.shared.active_tunnel_count()
    }

    /// How many proxy-server replicas the agent works towards holding: the
    /// newest `servercount` header or SERVER_COUNT packet (0 before any).
    pub fn known_server_count(&self) -> usize {
        self.shared.known_server_count()
    }

    /// Ids of the proxy-servers this agent holds tunnels to, sorted.
    pub fn server_ids(&self) -> Vec<String> {
        self.shared.server_ids()
    }

    /// Endpoint connections open now.
    pub fn open_endpoint_connections(&self) -> i64 {
        self.shared.metrics().open_endpoint_connections.get()
    }

    pub fn metrics(&self) -> &Metrics {
        self.shared.metrics()
    }

    /// Waits until at least `n` tunnels are up; false on timeout.
    pub async fn wait_for_tunnels(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.tunnel_count() >= n {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends DRAIN on every tunnel and stops opening new ones; existing
    /// tunnels keep serving. Idempotent.
    pub fn drain(&self) {
        self.shared.drain();
    }

    /// Drains, waits up to the configured grace for endpoint connections to
    /// finish, then closes every tunnel and the health/admin servers.
    pub async fn shutdown(self) {
        self.drain();
        let deadline = tokio::time::Instant::now() + self.shared.shutdown_grace();
        // Let the DRAIN packets reach the servers before the streams close.
        tokio::time::sleep(Duration::from_millis(100)).await;
        while self.open_endpoint_connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.shared.cancel();
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        self.shared
            .wait_tunnels_closed(Duration::from_secs(5))
            .await;
        tracing::info!(agent_id = %self.shared.agent_id(), "proxy-agent stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offering(alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    fn offered(config: &rustls::ClientConfig) -> Vec<&[u8]> {
        config.alpn_protocols.iter().map(Vec::as_slice).collect()
    }

    /// The lean framing goes first, once, ahead of what was offered
    /// (`--alpn-proto` values, `h2`); turned off, it is not offered at all.
    #[test]
    fn the_lean_framing_is_offered_first_unless_turned_off() {
        let extra: &[u8] = b"konnectivity";
        let lean = offering_framing(offering(&[extra, ALPN_H2]), true);
        assert_eq!(offered(&lean), [ALPN_FRAMED, extra, ALPN_H2]);
        let again = offering_framing(lean.clone(), true);
        assert!(
            Arc::ptr_eq(&again, &lean),
            "already offered first: unchanged"
        );
        let moved = offering_framing(offering(&[ALPN_H2, ALPN_FRAMED]), true);
        assert_eq!(offered(&moved), [ALPN_FRAMED, ALPN_H2]);
        let off = offering_framing(lean, false);
        assert_eq!(offered(&off), [extra, ALPN_H2]);
    }

    #[test]
    fn lean_framing_is_on_unless_the_flag_turns_it_off() {
        use clap::Parser;
        let load = |args: &[&str]| {
            let argv = std::iter::once("proxy-agent").chain(args.iter().copied());
            AgentSettings::load_with_env(&Cli::parse_from(argv), Vec::new()).unwrap()
        };
        assert!(load(&[]).lean_framing);
        assert!(!load(&["--lean-framing=false"]).lean_framing);
        assert!(load(&["--lean-framing"]).lean_framing);
    }
}

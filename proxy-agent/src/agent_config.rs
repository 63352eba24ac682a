//! What an agent runs with ([`ProxyAgentConfig`]) and where its TLS client
//! configuration comes from: built by the flags (`crate::settings`), read
//! by the tunnel manager, started by [`crate::start`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_egress::EgressSettings;
use cluster_proxy_proto::flow::DEFAULT_WINDOW;
use cluster_proxy_proto::framed::ALPN_FRAMED;
use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11};
use cluster_proxy_runtime::telemetry::relay::RelayQueue;
use serde::{Deserialize, Serialize};

use crate::dial;

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

/// Whether an agent with no trace collector of its own sends its spans
/// home through its tunnels (`--trace-relay`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TraceRelay {
    /// Without `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT`, spans go
    /// to the proxy-servers that offer to forward them to their collector.
    #[default]
    Auto,
    /// Without a collector of its own, the agent exports no spans.
    Off,
}

/// What carries a tunnel to the proxy-server (`--transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// TLS, then what ALPN chooses: the lean framing with our servers,
    /// gRPC over HTTP/2 with any other.
    #[default]
    Auto,
    /// TLS offering only HTTP/1.1, then a WebSocket upgrade carrying the
    /// lean framing: for middleboxes that break HTTP/2 or strip ALPN.
    Websocket,
}

impl Transport {
    /// The value as the flag spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Websocket => "websocket",
        }
    }
}

/// `config` offering only `http/1.1`, for the WebSocket upgrade: a
/// middlebox that speaks only HTTP/1.1 refuses or mangles anything else.
pub fn offering_websocket(config: Arc<rustls::ClientConfig>) -> Arc<rustls::ClientConfig> {
    if config.alpn_protocols == [ALPN_HTTP11] {
        return config;
    }
    let mut config = (*config).clone();
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Arc::new(config)
}

/// Runtime configuration of an agent. [`ProxyAgentConfig::new`] gives upstream's
/// defaults; [`ProxyAgentSettings::to_agent_config`] builds one from flags.
#[derive(Debug, Clone)]
pub struct ProxyAgentConfig {
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
    /// What carries the tunnels (`--transport`).
    pub transport: Transport,
    /// WebSocket ping interval (`--websocket-heartbeat`).
    pub websocket_heartbeat: Duration,
    /// Names resolved to fixed addresses before DNS, like a pod's `hostAliases`.
    pub host_aliases: dial::HostAliases,
    /// The forward proxy to the proxy-server, beside the `*_PROXY`
    /// variables read at [`start`].
    pub egress: EgressSettings,
    /// How long [`RunningAgent::shutdown`] waits for open endpoint
    /// connections after sending DRAIN.
    pub shutdown_grace: Duration,
    /// Where the process's spans wait to be sent home through the tunnels
    /// (`--trace-relay=auto` with no collector of the agent's own); `None`:
    /// the agent asks no server for the span relay.
    pub span_relay: Option<Arc<RelayQueue>>,
}

impl ProxyAgentConfig {
    pub fn new(tls: TlsSource) -> Self {
        ProxyAgentConfig {
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
            egress: EgressSettings::default(),
            credential_reload_interval: cluster_proxy_runtime::reload::DEFAULT_INTERVAL,
            keepalive_time: Duration::from_secs(3600),
            lean_framing: true,
            transport: Transport::Auto,
            websocket_heartbeat: cluster_proxy_proto::websocket::DEFAULT_HEARTBEAT,
            shutdown_grace: Duration::from_secs(5),
            span_relay: None,
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

//! proxy-server's command line and settings: defaults < TOML file (`--config`) < environment
//! (`PROXY_SERVER_*`) < command-line flags. Every upstream proxy-server flag is
//! accepted so existing manifests keep working.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_proto::flow::{DEFAULT_WINDOW, MIN_WINDOW};
use cluster_proxy_runtime::cli::{
    GoList, HealthFlags, parse_go_bool, parse_go_list, parse_path, serialize_go_lists,
};
pub use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::config::{self, EnvSpec, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use cluster_proxy_runtime::telemetry::TelemetryFlags;
use serde::{Deserialize, Serialize};

use crate::peers::{ServerCountSource, SourceParseError};
use crate::registry::Strategy;

/// Which frontends the client port serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// gRPC (HTTP/2) and HTTP CONNECT (HTTP/1.1) on the same port.
    #[serde(rename = "both")]
    Both,
    #[serde(rename = "grpc")]
    Grpc,
    #[serde(rename = "http-connect")]
    HttpConnect,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyServerSettings {
    pub mode: Mode,
    pub uds_name: String,
    pub delete_existing_uds_file: bool,
    pub server_port: u16,
    pub server_bind_address: String,
    pub server_cert: Option<PathBuf>,
    pub server_key: Option<PathBuf>,
    pub server_ca_cert: Option<PathBuf>,
    pub agent_port: u16,
    pub agent_bind_address: String,
    pub cluster_cert: Option<PathBuf>,
    pub cluster_key: Option<PathBuf>,
    pub cluster_ca_cert: Option<PathBuf>,
    pub admin_port: u16,
    pub admin_bind_address: String,
    pub health_port: u16,
    pub health_bind_address: String,
    #[serde(with = "serde_go")]
    pub keepalive_time: Duration,
    #[serde(with = "serde_go")]
    pub frontend_keepalive_time: Duration,
    pub enable_profiling: bool,
    pub enable_contention_profiling: bool,
    /// Empty: `PROXY_SERVER_ID` or a random UUID.
    pub server_id: String,
    pub server_count: u32,
    /// `static` (`server_count`) or `dns:<headless service>` (see [`crate::peers`]).
    pub server_count_source: String,
    /// How often `dns:` sources are resolved.
    #[serde(with = "serde_go")]
    pub server_count_refresh_interval: Duration,
    /// With a `dns:` count source: how long `/readyz` waits to hold as many
    /// agents as the other replicas (see [`crate::readiness`]).
    #[serde(with = "serde_go")]
    pub readiness_agent_wait: Duration,
    pub agent_namespace: String,
    pub agent_service_account: String,
    pub authentication_audience: String,
    pub kubeconfig: String,
    pub kubeconfig_qps: f32,
    pub kubeconfig_burst: u32,
    pub kube_api_content_type: String,
    /// Comma-separated, tried in order: destHost, default, defaultRoute.
    pub proxy_strategies: String,
    pub cipher_suites: Vec<String>,
    pub tls_min_version: String,
    pub xfr_channel_size: u32,
    pub enable_lease_controller: bool,
    pub lease_namespace: String,
    pub lease_label: String,
    #[serde(with = "serde_go")]
    pub graceful_shutdown_timeout: Duration,
    /// Pending dials fail after this long (upstream default: never).
    #[serde(with = "serde_go")]
    pub backend_dial_timeout: Duration,
    /// Accept agents whose certificate names no cluster (upstream-issued certs).
    pub allow_unbound_agents: bool,
    /// With identity binding on, still allow the `default` and
    /// `defaultRoute` strategies, which send a dial to an agent whatever
    /// cluster the dial names.
    pub allow_cross_cluster_routing: bool,
    /// Which hub client may reach which clusters (see [`crate::policy`]);
    /// `None`: every hub client may reach every cluster.
    pub client_policy: Option<PathBuf>,
    /// Per-connection flow-control window granted to agents that negotiate it.
    pub flow_control_window: u32,
    /// Per-connection buffer for plain konnectivity agents.
    pub plain_peer_buffer: u32,
    /// How long a plain agent's data may wait on a full connection buffer
    /// before that one connection is closed to keep its tunnel moving.
    #[serde(with = "serde_go")]
    pub plain_peer_stall_timeout: Duration,
    /// How often certificate files are checked for rotation.
    #[serde(with = "serde_go")]
    pub credential_reload_interval: Duration,
    /// Concurrent HTTP/2 streams one peer connection may open, on the agent
    /// port and the client port alike.
    pub max_concurrent_streams: u32,
    /// Largest gRPC message (packet) accepted from agents and clients, in bytes.
    pub max_packet_size: u32,
    /// Tunnels one agent identity (its cluster, else its agent id) may hold to this replica.
    pub max_tunnels_per_agent: u32,
    /// Dials one tunnel may have waiting for the agent's answer.
    pub max_pending_dials_per_tunnel: u32,
    /// Connection ids for which a tunnel may await the agent's CLOSE_RSP
    /// after DATA or DIAL_RSP named a connection the server does not know.
    pub max_stray_closes_per_tunnel: u32,
    /// How long a new `Proxy` stream may go without its DIAL_REQ.
    #[serde(with = "serde_go")]
    pub first_packet_timeout: Duration,
    /// Threads running the service's tasks; 0 is one per CPU the process
    /// may use (its cgroup's CPU limit counts). One means Tokio's
    /// single-threaded scheduler (see `cluster_proxy_runtime::workers`).
    pub worker_threads: u32,
    /// klog-style verbosity (`-v`); `RUST_LOG` overrides it.
    pub v: u8,
    pub log_format: LogFormat,
    /// Where spans that agents relay through their tunnels go: the
    /// collector of the server's own OTLP settings (`--otlp-endpoint` and
    /// the `OTEL_*` variables), set by [`BinarySettings::load`] from the
    /// command line. `None`: the server offers agents no span relay.
    #[serde(skip)]
    pub relay_collector: Option<cluster_proxy_runtime::telemetry::TelemetryConfig>,
}

/// The environment layer: `PROXY_SERVER_<FLAG>`, and upstream's `PROXY_SERVER_ID`.
pub const ENV: EnvSpec = EnvSpec {
    prefix: "PROXY_SERVER_",
    aliases: &[("ID", "server_id")],
};

impl Default for ProxyServerSettings {
    fn default() -> Self {
        ProxyServerSettings {
            mode: Mode::Both,
            uds_name: String::new(),
            delete_existing_uds_file: true,
            server_port: 8090,
            server_bind_address: String::new(),
            server_cert: None,
            server_key: None,
            server_ca_cert: None,
            agent_port: 8091,
            agent_bind_address: String::new(),
            cluster_cert: None,
            cluster_key: None,
            cluster_ca_cert: None,
            admin_port: 8095,
            admin_bind_address: "127.0.0.1".into(),
            health_port: 8092,
            health_bind_address: String::new(),
            // Upstream: 1h. A tunnel to an agent that vanished without a
            // FIN must be noticed in under a minute, not an hour.
            keepalive_time: Duration::from_secs(30),
            frontend_keepalive_time: Duration::from_secs(30),
            enable_profiling: false,
            enable_contention_profiling: false,
            server_id: String::new(),
            server_count: 1,
            server_count_source: "static".into(),
            server_count_refresh_interval: Duration::from_secs(5),
            readiness_agent_wait: Duration::from_secs(30),
            agent_namespace: String::new(),
            agent_service_account: String::new(),
            authentication_audience: String::new(),
            kubeconfig: String::new(),
            kubeconfig_qps: 0.0,
            kubeconfig_burst: 0,
            kube_api_content_type: "application/vnd.kubernetes.protobuf".into(),
            proxy_strategies: "default".into(),
            cipher_suites: Vec::new(),
            tls_min_version: String::new(),
            xfr_channel_size: 10,
            enable_lease_controller: false,
            lease_namespace: "kube-system".into(),
            lease_label: "k8s-app=konnectivity-server".into(),
            graceful_shutdown_timeout: Duration::ZERO,
            backend_dial_timeout: Duration::from_secs(10),
            allow_unbound_agents: false,
            allow_cross_cluster_routing: false,
            client_policy: None,
            flow_control_window: DEFAULT_WINDOW,
            plain_peer_buffer: 4 * 1024 * 1024,
            plain_peer_stall_timeout: cluster_proxy_proto::flow::DEFAULT_STALL_TIMEOUT,
            credential_reload_interval: cluster_proxy_runtime::reload::DEFAULT_INTERVAL,
            max_concurrent_streams: 1000,
            max_packet_size: 16 * 1024 * 1024,
            max_tunnels_per_agent: 64,
            max_pending_dials_per_tunnel: 1024,
            max_stray_closes_per_tunnel: 1024,
            first_packet_timeout: Duration::from_secs(30),
            worker_threads: cluster_proxy_runtime::workers::PER_CPU,
            v: 0,
            log_format: LogFormat::Auto,
            relay_collector: None,
        }
    }
}

/// Command-line flags. Every field is optional so that only flags actually
/// given override the lower layers. As with upstream's pflag, a flag given
/// twice keeps its last value (`args_override_self`; upstream's own e2e
/// passes `--mode` twice), list flags append, booleans take Go's spellings.
#[derive(Debug, Default, Parser, Serialize)]
#[command(
    name = "proxy-server",
    version,
    about = "cluster-proxy tunnel server (konnectivity compatible)",
    args_override_self = true
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Frontends on the client port: both (default), grpc or http-connect.
    #[arg(long)]
    pub mode: Option<String>,
    /// Serve the client frontend (gRPC and/or HTTP CONNECT, per --mode) on this Unix socket, without TLS, instead of the client port.
    #[arg(long)]
    pub uds_name: Option<String>,
    /// Remove an existing --uds-name file before listening (else an existing file is an error).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub delete_existing_uds_file: Option<bool>,
    /// Client port: gRPC ProxyService and HTTP CONNECT over mTLS.
    #[arg(long)]
    pub server_port: Option<u16>,
    /// Address the client port listens on (empty: every address).
    #[arg(long)]
    pub server_bind_address: Option<String>,
    /// Certificate the client port presents (PEM).
    #[arg(long, value_parser = parse_path)]
    pub server_cert: Option<PathBuf>,
    /// Private key of --server-cert (PEM).
    #[arg(long, value_parser = parse_path)]
    pub server_key: Option<PathBuf>,
    /// CA bundle that hub clients' certificates must chain to.
    #[arg(long, value_parser = parse_path)]
    pub server_ca_cert: Option<PathBuf>,
    /// Agent port: AgentService.Connect tunnels from proxy-agents over mTLS.
    #[arg(long)]
    pub agent_port: Option<u16>,
    /// Address the agent port listens on (empty: every address).
    #[arg(long)]
    pub agent_bind_address: Option<String>,
    /// Certificate the agent port presents (PEM).
    #[arg(long, value_parser = parse_path)]
    pub cluster_cert: Option<PathBuf>,
    /// Private key of --cluster-cert (PEM).
    #[arg(long, value_parser = parse_path)]
    pub cluster_key: Option<PathBuf>,
    /// CA bundle that agents' certificates must chain to.
    #[arg(long, value_parser = parse_path)]
    pub cluster_ca_cert: Option<PathBuf>,
    /// Admin port serving /metrics.
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// Address the admin port listens on.
    #[arg(long)]
    pub admin_bind_address: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub health: HealthFlags,
    /// Idle time after which agent tunnels are pinged (HTTP/2 PING, 20 s to answer); 0 turns pings off (Go duration).
    #[arg(long)]
    pub keepalive_time: Option<String>,
    /// Idle time after which client connections are pinged (HTTP/2 PING, 20 s to answer); 0 turns pings off (Go duration).
    #[arg(long)]
    pub frontend_keepalive_time: Option<String>,
    /// Go pprof endpoints (upstream); accepted, no effect here.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_profiling: Option<bool>,
    /// Go contention profiling (upstream); accepted, no effect here.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_contention_profiling: Option<bool>,
    /// This replica's id sent to agents (empty: $PROXY_SERVER_ID, else a random UUID).
    #[arg(long)]
    pub server_id: Option<String>,
    /// Number of proxy-server replicas agents should connect to.
    #[arg(long)]
    pub server_count: Option<u32>,
    /// Where the replica count comes from: static (--server-count) or
    /// dns:<name>, a headless Service over every replica, resolved every
    /// --server-count-refresh-interval (--server-count until it resolves).
    #[arg(long)]
    pub server_count_source: Option<String>,
    /// How often a dns: --server-count-source is resolved (Go duration).
    #[arg(long)]
    pub server_count_refresh_interval: Option<String>,
    /// With a dns: --server-count-source, how long /readyz waits until this
    /// replica holds as many agents as the other replicas (Go duration; 0: ready at once).
    #[arg(long)]
    pub readiness_agent_wait: Option<String>,
    /// Service-account token authentication of agents (upstream); not supported: agents present certificates.
    #[arg(long)]
    pub agent_namespace: Option<String>,
    /// See --agent-namespace; not supported.
    #[arg(long)]
    pub agent_service_account: Option<String>,
    /// See --agent-namespace; not supported.
    #[arg(long)]
    pub authentication_audience: Option<String>,
    /// Kubeconfig for the lease controller (upstream); accepted, no effect here.
    #[arg(long)]
    pub kubeconfig: Option<String>,
    /// Kubernetes client QPS (upstream); accepted, no effect here.
    #[arg(long)]
    pub kubeconfig_qps: Option<f32>,
    /// Kubernetes client burst (upstream); accepted, no effect here.
    #[arg(long)]
    pub kubeconfig_burst: Option<u32>,
    /// Kubernetes API content type (upstream); accepted, no effect here.
    #[arg(long)]
    pub kube_api_content_type: Option<String>,
    /// Routing strategies in order: destHost, default, defaultRoute.
    #[arg(long)]
    pub proxy_strategies: Option<String>,
    /// TLS 1.2 cipher suites to offer (IANA names, comma-separated, as upstream); empty: all of the ring provider's (ECDHE with AES-GCM or ChaCha20-Poly1305). Named suites without forward secrecy or AEAD are never offered; TLS 1.3 suites are always on.
    #[arg(long, value_name = "SUITES", value_parser = parse_go_list)]
    #[serde(serialize_with = "serialize_go_lists")]
    pub cipher_suites: Option<Vec<GoList>>,
    /// Oldest TLS version accepted: VersionTLS12 or VersionTLS13 (empty: TLS 1.2).
    #[arg(long)]
    pub tls_min_version: Option<String>,
    /// Upstream's per-stream channel size; accepted, flow control replaces it.
    #[arg(long)]
    pub xfr_channel_size: Option<u32>,
    /// Publish a Lease per replica (upstream); accepted, no effect yet.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_lease_controller: Option<bool>,
    /// Namespace of the replica Leases (with --enable-lease-controller).
    #[arg(long)]
    pub lease_namespace: Option<String>,
    /// Label of the replica Leases (with --enable-lease-controller).
    #[arg(long)]
    pub lease_label: Option<String>,
    /// How long established connections may finish after SIGTERM (Go duration).
    #[arg(long)]
    pub graceful_shutdown_timeout: Option<String>,
    /// Fail a pending dial after this long (Go duration, e.g. 10s; 0 disables).
    #[arg(long)]
    pub backend_dial_timeout: Option<String>,
    /// Accept agents whose certificate names no cluster, trusting the
    /// identifiers they claim (upstream behaviour, for upstream-issued certs).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub allow_unbound_agents: Option<bool>,
    /// With identity binding on (no --allow-unbound-agents), accept --proxy-strategies default/defaultRoute, which route a dial to an agent whatever cluster it names.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub allow_cross_cluster_routing: Option<bool>,
    /// TOML file saying which hub client certificate subject may reach which clusters (unset: every hub client reaches every cluster).
    #[arg(long, value_parser = parse_path)]
    pub client_policy: Option<PathBuf>,
    /// Per-connection flow-control window in bytes.
    #[arg(long)]
    pub flow_control_window: Option<u32>,
    /// Per-connection buffer in bytes for plain konnectivity agents.
    #[arg(long)]
    pub plain_peer_buffer: Option<u32>,
    /// Close a plain agent's connection whose buffer stayed full this long (Go duration).
    #[arg(long)]
    pub plain_peer_stall_timeout: Option<String>,
    /// How often certificate files are checked for rotation (Go duration).
    #[arg(long)]
    pub credential_reload_interval: Option<String>,
    /// Concurrent HTTP/2 streams per connection on the agent and client ports.
    #[arg(long)]
    pub max_concurrent_streams: Option<u32>,
    /// Largest packet (gRPC message) accepted from agents and clients, in bytes.
    #[arg(long)]
    pub max_packet_size: Option<u32>,
    /// Tunnels one agent identity (cluster, else agent id) may hold to this replica.
    #[arg(long)]
    pub max_tunnels_per_agent: Option<u32>,
    /// Dials one agent tunnel may have waiting for the agent's answer.
    #[arg(long)]
    pub max_pending_dials_per_tunnel: Option<u32>,
    /// Unknown connection ids per tunnel the server may be waiting to see closed; beyond it, stray DATA is dropped unanswered.
    #[arg(long)]
    pub max_stray_closes_per_tunnel: Option<u32>,
    /// Close a Proxy stream that sent no DIAL_REQ within this long (Go duration).
    #[arg(long)]
    pub first_packet_timeout: Option<String>,
    /// Threads running the tunnel's tasks (0: one per CPU this process may use, the cgroup CPU limit included; 1: a single-threaded scheduler, the least CPU per byte when one core is all the process gets).
    #[arg(long)]
    pub worker_threads: Option<u32>,
    #[command(flatten)]
    #[serde(flatten)]
    pub logging: LogFlags,
    /// OpenTelemetry trace export (flags default to the OTEL_* variables).
    #[command(flatten)]
    #[serde(skip)]
    pub telemetry: TelemetryFlags,
    /// Hidden, deprecated upstream flag; accepted and ignored.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    #[serde(skip)]
    pub warn_on_channel_limit: Option<bool>,
}

impl CommandLine for Cli {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }

    fn telemetry(&self) -> Option<&TelemetryFlags> {
        Some(&self.telemetry)
    }
}

impl BinarySettings for ProxyServerSettings {
    type Flags = Cli;
    const SERVICE: &'static str = "proxy-server";

    /// Layers defaults, the TOML file, the environment and the flags.
    fn load(cli: &Cli) -> Result<Self, ConfigError> {
        let mut settings = Self::load_with_env(cli, std::env::vars())?;
        // A configuration that does not check out is refused, with the
        // reason, by the shell's telemetry setup right after this.
        settings.relay_collector = cli
            .telemetry
            .to_config(Self::SERVICE)
            .ok()
            .filter(|config| config.endpoint.is_some());
        Ok(settings)
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }

    fn worker_threads(&self) -> Option<u32> {
        Some(self.worker_threads)
    }

    fn ignored_settings(&self) -> Vec<&'static str> {
        self.ignored_settings()
    }
}

impl ProxyServerSettings {
    /// [`ProxyServerSettings::load`] with an explicit environment (tests).
    pub fn load_with_env(
        cli: &Cli,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut config: ProxyServerSettings =
            config::load_with_env(ENV, cli.config.as_deref(), cli, vars)?;
        // Upstream's empty `--server-cert=` (as its tooling renders an unset
        // path) means "not given".
        for path in [
            &mut config.server_cert,
            &mut config.server_key,
            &mut config.server_ca_cert,
            &mut config.cluster_cert,
            &mut config.cluster_key,
            &mut config.cluster_ca_cert,
            &mut config.client_policy,
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                *path = None;
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks values that deserialize fine but cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.strategies()?;
        if self.uds_name.contains('\0') {
            return Err(invalid("uds-name", "a socket path cannot contain NUL"));
        }
        if !self.agent_namespace.is_empty()
            || !self.agent_service_account.is_empty()
            || !self.authentication_audience.is_empty()
        {
            return Err(invalid(
                "agent-namespace",
                "service-account token authentication of agents is not supported; agents authenticate with client certificates (--cluster-ca-cert)",
            ));
        }
        if self.credential_reload_interval.is_zero() {
            return Err(invalid(
                "credential-reload-interval",
                "must be greater than zero",
            ));
        }
        if self.server_count == 0 {
            return Err(invalid("server-count", "must be at least 1"));
        }
        cluster_proxy_runtime::workers::check(self.worker_threads)
            .map_err(|reason| invalid("worker-threads", reason))?;
        self.server_count_source()?;
        if self.server_count_refresh_interval.is_zero() {
            return Err(invalid(
                "server-count-refresh-interval",
                "must be greater than zero",
            ));
        }
        if self.flow_control_window < MIN_WINDOW {
            return Err(invalid(
                "flow-control-window",
                format!("must be at least {MIN_WINDOW} bytes"),
            ));
        }
        if self.plain_peer_buffer < MIN_WINDOW {
            return Err(invalid(
                "plain-peer-buffer",
                format!("must be at least {MIN_WINDOW} bytes"),
            ));
        }
        for (flag, value) in [
            ("max-concurrent-streams", self.max_concurrent_streams),
            ("max-tunnels-per-agent", self.max_tunnels_per_agent),
            (
                "max-pending-dials-per-tunnel",
                self.max_pending_dials_per_tunnel,
            ),
            (
                "max-stray-closes-per-tunnel",
                self.max_stray_closes_per_tunnel,
            ),
        ] {
            if value == 0 {
                return Err(invalid(flag, "must be at least 1"));
            }
        }
        // A packet must at least carry one flow-control chunk of DATA.
        let min_packet = u32::try_from(cluster_proxy_proto::flow::READ_CHUNK)
            .unwrap_or(u32::MAX)
            .saturating_add(1024);
        if self.max_packet_size < min_packet {
            return Err(invalid(
                "max-packet-size",
                format!("must be at least {min_packet} bytes"),
            ));
        }
        if self.first_packet_timeout.is_zero() {
            return Err(invalid("first-packet-timeout", "must be greater than zero"));
        }
        cluster_proxy_runtime::tls::select_cipher_suites(&self.cipher_suites)
            .map_err(|error| invalid("cipher-suites", error.to_string()))?;
        match self.tls_min_version.as_str() {
            "" | "VersionTLS12" | "VersionTLS13" => {}
            other => {
                return Err(invalid(
                    "tls-min-version",
                    format!("{other:?} is not supported: use VersionTLS12 or VersionTLS13"),
                ));
            }
        }
        Ok(())
    }

    /// The parsed `--proxy-strategies` list.
    pub fn strategies(&self) -> Result<Vec<Strategy>, ConfigError> {
        let list: Vec<Strategy> = self
            .proxy_strategies
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                Strategy::parse(s).ok_or_else(|| {
                    invalid(
                        "proxy-strategies",
                        format!("unknown strategy {s:?}; valid: destHost, default, defaultRoute"),
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        if list.is_empty() {
            return Err(invalid(
                "proxy-strategies",
                "at least one strategy is required",
            ));
        }
        Ok(list)
    }

    /// Refuses routing that undoes identity binding: with agents bound to
    /// their clusters, `default` (any agent) and `defaultRoute` would send a
    /// dial for one cluster through another cluster's agent. Checked when
    /// the server starts, not when the flags are read, so that upstream's
    /// argument lists still load.
    pub fn check_routing_safety(&self) -> Result<(), ConfigError> {
        if self.allow_unbound_agents || self.allow_cross_cluster_routing {
            return Ok(());
        }
        let unsafe_strategies: Vec<&str> = self
            .strategies()?
            .into_iter()
            .filter(|s| matches!(s, Strategy::Default | Strategy::DefaultRoute))
            .map(Strategy::name)
            .collect();
        if unsafe_strategies.is_empty() {
            return Ok(());
        }
        Err(invalid(
            "proxy-strategies",
            format!(
                "{} would route a dial for one cluster through any other cluster's agent, undoing identity binding; \
                 use --proxy-strategies=destHost, or accept that with --allow-cross-cluster-routing",
                unsafe_strategies.join(" and ")
            ),
        ))
    }

    /// The parsed `--server-count-source`.
    pub fn server_count_source(&self) -> Result<ServerCountSource, ConfigError> {
        self.server_count_source
            .parse()
            .map_err(|e: SourceParseError| invalid("server-count-source", e.to_string()))
    }

    /// The server id: configured, else `PROXY_SERVER_ID`, else a random UUID.
    pub fn resolved_server_id(&self) -> String {
        if self.server_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            self.server_id.clone()
        }
    }

    /// Upstream flags this implementation accepts but does not act on.
    pub fn ignored_settings(&self) -> Vec<&'static str> {
        let defaults = ProxyServerSettings::default();
        let mut ignored = Vec::new();
        if self.enable_profiling {
            ignored.push("enable-profiling");
        }
        if self.enable_contention_profiling {
            ignored.push("enable-contention-profiling");
        }
        if !self.kubeconfig.is_empty() {
            ignored.push("kubeconfig");
        }
        if self.enable_lease_controller {
            ignored.push("enable-lease-controller");
        }
        if self.xfr_channel_size != defaults.xfr_channel_size {
            ignored.push("xfr-channel-size");
        }
        if self.lease_namespace != defaults.lease_namespace {
            ignored.push("lease-namespace");
        }
        if self.lease_label != defaults.lease_label {
            ignored.push("lease-label");
        }
        if self.kubeconfig_qps != defaults.kubeconfig_qps {
            ignored.push("kubeconfig-qps");
        }
        if self.kubeconfig_burst != defaults.kubeconfig_burst {
            ignored.push("kubeconfig-burst");
        }
        if self.kube_api_content_type != defaults.kube_api_content_type {
            ignored.push("kube-api-content-type");
        }
        ignored
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<ProxyServerSettings, ConfigError> {
        let mut argv = vec!["proxy-server"];
        argv.extend_from_slice(args);
        ProxyServerSettings::load(&Cli::parse_from(argv))
    }

    #[test]
    fn every_flag_is_described_and_shows_its_default() {
        let problems = cluster_proxy_runtime::cli::help_problems::<Cli>(
            &ProxyServerSettings::default(),
            &["[default: 8090]", "[default: 10s]", "[default: default]"],
        );
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn kubernetes_service_variables_do_not_break_startup() {
        figment::Jail::expect_with(|jail| {
            // What a Service named `proxy-server` injects into every pod.
            jail.set_env("PROXY_SERVER_SERVICE_HOST", "10.96.0.10");
            jail.set_env("PROXY_SERVER_SERVICE_PORT", "8090");
            jail.set_env("PROXY_SERVER_PORT", "tcp://10.96.0.10:8090");
            jail.set_env("PROXY_SERVER_PORT_8090_TCP_ADDR", "10.96.0.10");
            jail.set_env("PROXY_SERVER_ENABLE_PROFILING", "True");
            let c = parse(&[]).map_err(|e| e.to_string())?;
            assert_eq!(c.server_port, 8090);
            assert!(c.enable_profiling, "Go's boolean spelling");
            Ok(())
        });
    }

    #[test]
    fn worker_threads_default_to_one_per_cpu_and_follow_env_and_flag() {
        figment::Jail::expect_with(|jail| {
            assert_eq!(
                parse(&[]).map_err(|e| e.to_string())?.worker_threads,
                cluster_proxy_runtime::workers::PER_CPU
            );
            jail.set_env("PROXY_SERVER_WORKER_THREADS", "3");
            assert_eq!(parse(&[]).map_err(|e| e.to_string())?.worker_threads, 3);
            let flag = parse(&["--worker-threads=1"]).map_err(|e| e.to_string())?;
            assert_eq!(flag.worker_threads, 1, "the flag wins over the variable");
            let refused = parse(&["--worker-threads=100000"]).expect_err("too many threads");
            assert!(refused.to_string().contains("worker-threads"), "{refused}");
            Ok(())
        });
        assert!(Cli::try_parse_from(["proxy-server", "--worker-threads=many"]).is_err());
    }

    #[test]
    fn defaults_match_upstream() {
        let c = ProxyServerSettings::default();
        assert_eq!(
            (c.server_port, c.agent_port, c.health_port, c.admin_port),
            (8090, 8091, 8092, 8095)
        );
        assert_eq!(c.strategies().unwrap(), [Strategy::Default]);
    }

    #[test]
    fn strategies_that_ignore_the_cluster_need_an_opt_in_under_identity_binding() {
        let mut c = ProxyServerSettings::default();
        let err = c.check_routing_safety().unwrap_err().to_string();
        assert!(
            err.contains("proxy-strategies") && err.contains("--allow-cross-cluster-routing"),
            "{err}"
        );
        c.proxy_strategies = "destHost,defaultRoute".into();
        let err = c.check_routing_safety().unwrap_err().to_string();
        assert!(
            err.contains("defaultRoute") && !err.contains("default and"),
            "{err}"
        );
        c.proxy_strategies = "destHost".into();
        c.check_routing_safety().unwrap();
        c.proxy_strategies = "default".into();
        c.allow_cross_cluster_routing = true;
        c.check_routing_safety().unwrap();
        c.allow_cross_cluster_routing = false;
        c.allow_unbound_agents = true;
        c.check_routing_safety().unwrap();
    }

    #[test]
    fn layers_file_then_env_then_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "server.toml",
                "agent_port = 1001\nserver_port = 1002\nhealth_port = 1003\n",
            )?;
            jail.set_env("PROXY_SERVER_SERVER_PORT", "2002");
            jail.set_env("PROXY_SERVER_HEALTH_PORT", "2003");
            jail.set_env("PROXY_SERVER_ID", "from-env");
            let c = parse(&[
                "--config",
                "server.toml",
                "--health-port",
                "3003",
                "--backend-dial-timeout=1m30s",
            ])
            .map_err(|e| e.to_string())?;
            assert_eq!(c.agent_port, 1001);
            assert_eq!(c.server_port, 2002);
            assert_eq!(c.health_port, 3003);
            assert_eq!(c.server_id, "from-env");
            assert_eq!(c.backend_dial_timeout, Duration::from_secs(90));
            Ok(())
        });
    }

    #[test]
    fn invalid_values_name_the_field() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("bad.toml", "agent_port = \"many\"\n")?;
            let err = parse(&["--config", "bad.toml"]).unwrap_err().to_string();
            assert!(err.contains("agent_port"), "{err}");
            let err = parse(&["--proxy-strategies", "destHost,nearest"])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("proxy-strategies") && err.contains("nearest"),
                "{err}"
            );
            let err = parse(&["--backend-dial-timeout", "soon"])
                .unwrap_err()
                .to_string();
            assert!(err.contains("--backend-dial-timeout"), "{err}");
            jail.create_file("typo.toml", "agent_prot = 1\n")?;
            let err = parse(&["--config", "typo.toml"]).unwrap_err().to_string();
            assert!(err.contains("agent_prot"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn upstream_flag_spellings_are_accepted() {
        figment::Jail::expect_with(|_| {
            let c = parse(&[
                "--mode=http-connect",
                "--proxy-strategies=destHost,defaultRoute",
                "--keepalive-time=1h0m0s",
                "--enable-profiling",
                "--xfr-channel-size=150",
                "--server-count=3",
                "--v=2",
                "--warn-on-channel-limit",
            ])
            .map_err(|e| e.to_string())?;
            assert_eq!(c.mode, Mode::HttpConnect);
            assert_eq!(
                c.strategies().unwrap(),
                [Strategy::DestHost, Strategy::DefaultRoute]
            );
            assert_eq!(c.server_count, 3);
            assert_eq!(
                c.ignored_settings(),
                ["enable-profiling", "xfr-channel-size"]
            );
            Ok(())
        });
    }
}

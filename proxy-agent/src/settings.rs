//! proxy-agent's command line and settings: defaults < TOML file (`--config`) < environment
//! (`PROXY_AGENT_*`) < command-line flags. Every upstream proxy-agent flag is
//! accepted so existing manifests keep working; the ones that mean nothing
//! here are reported by [`ProxyAgentSettings::ignored_settings`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_proto::flow::{DEFAULT_WINDOW, MIN_WINDOW};
use cluster_proxy_proto::identifiers::AgentIdentifiers;
use cluster_proxy_runtime::cli::{
    GoList, parse_go_bool, parse_go_list, parse_path, serialize_go_lists,
};
pub use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::config::{self, EnvSpec, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use cluster_proxy_runtime::telemetry::TelemetryFlags;
use serde::{Deserialize, Serialize};

use crate::agent_config::{ProxyAgentConfig, TlsSource, TraceRelay, Transport};
use cluster_proxy_egress::EgressSettings;

const DEFAULT_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";
const DEFAULT_LEASE_SELECTOR: &str = "k8s-app=konnectivity-server";

/// The layered settings, named as the upstream flags (with underscores).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyAgentSettings {
    pub agent_cert: Option<PathBuf>,
    pub agent_key: Option<PathBuf>,
    pub ca_cert: Option<PathBuf>,
    pub proxy_server_host: String,
    pub proxy_server_port: u16,
    /// ALPN protocols offered in addition to `h2` (upstream's meaning).
    pub alpn_proto: Vec<String>,
    /// Offer the lean framing (`cluster_proxy_proto::framed`) ahead of
    /// gRPC over HTTP/2; servers that do not speak it choose `h2`.
    pub lean_framing: bool,
    /// Empty: all interfaces.
    pub health_server_host: String,
    pub health_server_port: u16,
    pub admin_server_port: u16,
    pub admin_bind_address: String,
    pub enable_profiling: bool,
    pub enable_contention_profiling: bool,
    /// Empty: `PROXY_AGENT_ID` (via the environment layer) or a random UUID.
    pub agent_id: String,
    pub agent_identifiers: String,
    #[serde(with = "serde_go")]
    pub sync_interval: Duration,
    #[serde(with = "serde_go")]
    pub probe_interval: Duration,
    #[serde(with = "serde_go")]
    pub sync_interval_cap: Duration,
    #[serde(with = "serde_go")]
    pub keepalive_time: Duration,
    pub service_account_token_path: String,
    pub warn_on_channel_limit: bool,
    pub sync_forever: bool,
    pub xfr_channel_size: u32,
    pub count_server_leases: bool,
    pub lease_namespace: String,
    pub lease_label_selector: String,
    pub server_count_source: String,
    pub kubeconfig: String,
    pub kube_api_content_type: String,
    /// Per-connection receive window offered to servers that negotiate flow
    /// control; 0 turns the extension off.
    pub flow_control_window: u32,
    /// Per-connection receive buffer towards plain konnectivity servers.
    pub plain_peer_buffer: u32,
    /// Kernel receive buffer (SO_RCVBUF) of each connection to a target, in
    /// bytes; 0 leaves it to the kernel's autotuning.
    pub target_receive_buffer: u32,
    /// Timeout for dials to endpoints in the cluster.
    #[serde(with = "serde_go")]
    pub dial_timeout: Duration,
    /// `NAME=IP` pairs resolved before DNS, like a pod's `hostAliases`.
    pub host_alias: Vec<String>,
    /// Forward proxy to the proxy-server; empty: `HTTPS_PROXY` and the
    /// other `*_PROXY` variables (`NO_PROXY` applies either way).
    pub proxy_url: String,
    /// CA bundle that verifies an `https://` proxy (never the hub).
    pub proxy_ca_cert: Option<PathBuf>,
    /// Basic credentials for the proxy: `user:password`, or a mounted
    /// `kubernetes.io/basic-auth` Secret's directory.
    pub proxy_credentials_file: Option<PathBuf>,
    /// What carries the tunnels: `auto` (ALPN) or `websocket`.
    pub transport: Transport,
    /// WebSocket ping interval; the tunnel fails after three silent ones.
    #[serde(with = "serde_go")]
    pub websocket_heartbeat: Duration,
    /// Without a collector of its own: send spans home through the
    /// tunnels (`auto`) or not at all (`off`).
    pub trace_relay: TraceRelay,
    /// How often certificate files are checked for rotation.
    #[serde(with = "serde_go")]
    pub credential_reload_interval: Duration,
    /// Threads running the service's tasks; 0 is one per CPU the process
    /// may use (its cgroup's CPU limit counts). One means Tokio's
    /// single-threaded scheduler (see `cluster_proxy_runtime::workers`).
    pub worker_threads: u32,
    /// klog-style verbosity (`-v`); `RUST_LOG` overrides it.
    pub v: u8,
    pub log_format: LogFormat,
}

/// The environment layer: `PROXY_AGENT_<FLAG>`, and upstream's `PROXY_AGENT_ID`.
pub const ENV: EnvSpec = EnvSpec {
    prefix: "PROXY_AGENT_",
    aliases: &[("ID", "agent_id")],
};

impl Default for ProxyAgentSettings {
    fn default() -> Self {
        ProxyAgentSettings {
            agent_cert: None,
            agent_key: None,
            ca_cert: None,
            proxy_server_host: "127.0.0.1".into(),
            proxy_server_port: 8091,
            alpn_proto: Vec::new(),
            lean_framing: true,
            health_server_host: String::new(),
            health_server_port: 8093,
            admin_server_port: 8094,
            admin_bind_address: "127.0.0.1".into(),
            enable_profiling: false,
            enable_contention_profiling: false,
            agent_id: String::new(),
            agent_identifiers: String::new(),
            sync_interval: Duration::from_secs(1),
            probe_interval: Duration::from_secs(1),
            sync_interval_cap: Duration::from_secs(10),
            keepalive_time: Duration::from_secs(3600),
            service_account_token_path: String::new(),
            warn_on_channel_limit: false,
            sync_forever: false,
            xfr_channel_size: 150,
            count_server_leases: false,
            lease_namespace: "kube-system".into(),
            lease_label_selector: DEFAULT_LEASE_SELECTOR.into(),
            server_count_source: "default".into(),
            kubeconfig: String::new(),
            kube_api_content_type: DEFAULT_CONTENT_TYPE.into(),
            flow_control_window: DEFAULT_WINDOW,
            plain_peer_buffer: 4 * 1024 * 1024,
            target_receive_buffer: 0,
            dial_timeout: Duration::from_secs(5),
            host_alias: Vec::new(),
            proxy_url: String::new(),
            proxy_ca_cert: None,
            proxy_credentials_file: None,
            transport: Transport::Auto,
            websocket_heartbeat: cluster_proxy_proto::websocket::DEFAULT_HEARTBEAT,
            trace_relay: TraceRelay::Auto,
            credential_reload_interval: cluster_proxy_runtime::reload::DEFAULT_INTERVAL,
            worker_threads: cluster_proxy_runtime::workers::PER_CPU,
            v: 0,
            log_format: LogFormat::Auto,
        }
    }
}

/// Command-line flags. Every field is optional so that only flags actually
/// given override the lower layers. As with upstream's pflag, a flag given
/// twice keeps its last value (`args_override_self`), list flags append, and
/// the deprecated `--lease-label` and `--lease-label-selector` set the same
/// setting, the later one winning.
#[derive(Debug, Default, Clone, Parser, Serialize)]
#[command(
    name = "proxy-agent",
    version,
    about = "cluster-proxy agent (konnectivity compatible)",
    args_override_self = true
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Client certificate presented to the proxy-server.
    #[arg(long, value_parser = parse_path)]
    pub agent_cert: Option<PathBuf>,
    /// Private key of --agent-cert.
    #[arg(long, value_parser = parse_path)]
    pub agent_key: Option<PathBuf>,
    /// CA bundle the proxy-server's certificate must chain to.
    #[arg(long, value_parser = parse_path)]
    pub ca_cert: Option<PathBuf>,
    /// Host of the proxy-server agent endpoint (a Service or load balancer in front of every replica).
    #[arg(long)]
    pub proxy_server_host: Option<String>,
    /// Port of the proxy-server agent endpoint.
    #[arg(long)]
    pub proxy_server_port: Option<u16>,
    /// ALPN protocols offered in addition to h2, which is always offered (comma-separated; [] is none).
    #[arg(long, value_name = "PROTOS", value_parser = parse_go_list)]
    #[serde(serialize_with = "serialize_go_lists")]
    pub alpn_proto: Option<Vec<GoList>>,
    /// Offer our lean tunnel framing (ALPN cluster-proxy-tunnel/1) ahead of gRPC over HTTP/2; servers that do not speak it get gRPC.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub lean_framing: Option<bool>,
    /// Address the health port listens on (empty: every address).
    #[arg(long)]
    pub health_server_host: Option<String>,
    /// Health port serving /healthz, /readyz and /metrics.
    #[arg(long)]
    pub health_server_port: Option<u16>,
    /// Admin port serving /metrics.
    #[arg(long)]
    pub admin_server_port: Option<u16>,
    /// Address the admin port listens on.
    #[arg(long)]
    pub admin_bind_address: Option<String>,
    /// Go pprof endpoints (upstream); accepted, no effect here.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_profiling: Option<bool>,
    /// Go contention profiling (upstream); accepted, no effect here.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_contention_profiling: Option<bool>,
    /// Agent id (default: $PROXY_AGENT_ID, else a random UUID).
    #[arg(long)]
    pub agent_id: Option<String>,
    /// Identifiers served, URL query form: host=a&ipv4=10.0.0.1&default-route=true.
    #[arg(long)]
    pub agent_identifiers: Option<String>,
    /// First delay before reconnecting to a lost or missing replica (Go duration).
    #[arg(long)]
    pub sync_interval: Option<String>,
    /// Upstream's tunnel probe period; accepted, a lost tunnel is noticed when its stream ends.
    #[arg(long)]
    pub probe_interval: Option<String>,
    /// Longest delay between reconnection attempts (Go duration).
    #[arg(long)]
    pub sync_interval_cap: Option<String>,
    /// Interval of HTTP/2 keepalive pings on tunnels, so a silently dead server is noticed (Go duration).
    #[arg(long)]
    pub keepalive_time: Option<String>,
    /// File holding a token sent as `authorization: Bearer` (re-read per connect).
    #[arg(long)]
    pub service_account_token_path: Option<String>,
    /// Upstream channel-limit warnings; accepted, no effect here.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub warn_on_channel_limit: Option<bool>,
    /// Keep dialing every --sync-interval to discover new servers.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub sync_forever: Option<bool>,
    /// Upstream's per-stream channel size; accepted, flow control replaces it.
    #[arg(long)]
    pub xfr_channel_size: Option<u32>,
    /// Count replicas from Leases (upstream); accepted, no effect yet: the servercount header is used.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub count_server_leases: Option<bool>,
    /// Namespace of the replica Leases (with --count-server-leases).
    #[arg(long)]
    pub lease_namespace: Option<String>,
    /// Label selector of the replica Leases (with --count-server-leases).
    #[arg(long, overrides_with = "lease_label")]
    pub lease_label_selector: Option<String>,
    /// Deprecated upstream spelling of --lease-label-selector.
    #[arg(long, hide = true, overrides_with = "lease_label_selector")]
    #[serde(skip)]
    pub lease_label: Option<String>,
    /// default or max.
    #[arg(long)]
    pub server_count_source: Option<String>,
    /// Kubeconfig for counting Leases (upstream); accepted, no effect here.
    #[arg(long)]
    pub kubeconfig: Option<String>,
    /// Kubernetes API content type (upstream); accepted, no effect here.
    #[arg(long)]
    pub kube_api_content_type: Option<String>,
    /// Per-connection flow-control window in bytes (0 disables the extension).
    #[arg(long)]
    pub flow_control_window: Option<u32>,
    /// Per-connection buffer in bytes towards plain konnectivity servers.
    #[arg(long)]
    pub plain_peer_buffer: Option<u32>,
    /// Kernel receive buffer (SO_RCVBUF) in bytes of each connection to a
    /// target; bounds the kernel memory of thousands of busy connections (0: autotuning).
    #[arg(long)]
    pub target_receive_buffer: Option<u32>,
    /// Timeout for dials to endpoints (Go duration).
    #[arg(long)]
    pub dial_timeout: Option<String>,
    /// Resolve NAME to IP before DNS when dialing (repeatable), like a pod's hostAliases.
    #[arg(long = "host-alias", value_name = "NAME=IP")]
    pub host_alias: Option<Vec<String>>,
    /// Forward proxy to reach the proxy-server through: http://, https://, socks5:// or socks5h://, with optional user:password@ (wins over HTTPS_PROXY; NO_PROXY still applies).
    #[arg(long, value_name = "URL")]
    pub proxy_url: Option<String>,
    /// CA bundle (PEM) that verifies an https:// proxy; it never verifies the proxy-server.
    #[arg(long, value_parser = parse_path)]
    pub proxy_ca_cert: Option<PathBuf>,
    /// Basic credentials for the proxy: a file holding user:password, or the directory of a mounted kubernetes.io/basic-auth Secret (wins over the URL's user:password; re-read at every connection).
    #[arg(long, value_parser = parse_path)]
    pub proxy_credentials_file: Option<PathBuf>,
    /// What carries the tunnels: auto (TLS, then ALPN chooses our lean framing or gRPC over HTTP/2) or websocket (an HTTP/1.1 WebSocket upgrade, for middleboxes that break HTTP/2 or strip ALPN; needs a proxy-server of this project).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<Transport>,
    /// With --transport websocket: a WebSocket ping this often keeps idle-timeout middleboxes from closing a quiet tunnel; after three intervals without a word from the server the tunnel is reconnected (Go duration).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub websocket_heartbeat: Option<String>,
    /// With no trace collector of its own (no --otlp-endpoint / OTEL_EXPORTER_OTLP_ENDPOINT): auto sends the agent's spans through its tunnels to proxy-servers that forward them to their collector (bounded; dropped and counted when no tunnel takes them); off exports none.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_relay: Option<TraceRelay>,
    /// How often certificate files are checked for rotation (Go duration).
    #[arg(long)]
    pub credential_reload_interval: Option<String>,
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
}

impl CommandLine for Cli {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }

    fn telemetry(&self) -> Option<&TelemetryFlags> {
        Some(&self.telemetry)
    }
}

impl BinarySettings for ProxyAgentSettings {
    type Flags = Cli;
    const SERVICE: &'static str = "proxy-agent";

    /// Layers defaults, the TOML file, the process environment and the flags.
    fn load(cli: &Cli) -> Result<Self, ConfigError> {
        Self::load_with_env(cli, std::env::vars())
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }

    fn worker_threads(&self) -> Option<u32> {
        Some(self.worker_threads)
    }

    fn relays_spans(&self) -> bool {
        self.trace_relay == TraceRelay::Auto
    }

    fn ignored_settings(&self) -> Vec<&'static str> {
        self.ignored_settings()
    }

    fn warnings(&self, cli: &Cli) -> Vec<String> {
        let deprecated = cli
            .lease_label
            .is_some()
            .then(|| "--lease-label is deprecated: use --lease-label-selector".to_owned());
        deprecated.into_iter().chain(self.warnings()).collect()
    }
}

impl ProxyAgentSettings {
    /// [`ProxyAgentSettings::load`] with an explicit environment (tests).
    pub fn load_with_env(
        cli: &Cli,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut flags = cli.clone();
        if let Some(label) = flags.lease_label.take() {
            // Of the two spellings, clap keeps only the one given last.
            flags.lease_label_selector.get_or_insert(label);
        }
        let mut settings: ProxyAgentSettings =
            config::load_with_env(ENV, cli.config.as_deref(), &flags, vars)?;
        // Upstream's empty `--agent-cert=` (as its tooling renders an unset
        // path) means "not given".
        for path in [
            &mut settings.agent_cert,
            &mut settings.agent_key,
            &mut settings.ca_cert,
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                *path = None;
            }
        }
        settings.validate()?;
        Ok(settings)
    }

    /// Checks values that deserialize fine but cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.proxy_server_host.trim().is_empty() {
            return Err(invalid("proxy-server-host", "must not be empty"));
        }
        if self.proxy_server_port == 0 {
            return Err(invalid("proxy-server-port", "must not be 0"));
        }
        if self.sync_interval.is_zero() {
            return Err(invalid("sync-interval", "must be greater than 0"));
        }
        if self.sync_interval_cap < self.sync_interval {
            return Err(invalid(
                "sync-interval-cap",
                format!(
                    "{:?} must be greater than or equal to --sync-interval ({:?})",
                    self.sync_interval_cap, self.sync_interval
                ),
            ));
        }
        if self.dial_timeout.is_zero() {
            return Err(invalid("dial-timeout", "must be greater than 0"));
        }
        if self.websocket_heartbeat.is_zero() {
            return Err(invalid("websocket-heartbeat", "must be greater than 0"));
        }
        cluster_proxy_runtime::workers::check(self.worker_threads)
            .map_err(|reason| invalid("worker-threads", reason))?;
        AgentIdentifiers::parse_like_upstream(&self.agent_identifiers)
            .map_err(|e| invalid("agent-identifiers", e.to_string()))?;
        if self.agent_id.contains(|c: char| !c.is_ascii_graphic()) {
            return Err(invalid(
                "agent-id",
                format!("{:?} must be printable ASCII without spaces", self.agent_id),
            ));
        }
        match self.server_count_source.as_str() {
            "default" | "max" => {}
            other => {
                return Err(invalid(
                    "server-count-source",
                    format!("{other:?} is not one of default, max"),
                ));
            }
        }
        if self.flow_control_window != 0
            && !(MIN_WINDOW..=1 << 30).contains(&self.flow_control_window)
        {
            return Err(invalid(
                "flow-control-window",
                format!("must be 0 (off) or between {MIN_WINDOW} and 1073741824 bytes"),
            ));
        }
        if self.plain_peer_buffer < MIN_WINDOW {
            return Err(invalid(
                "plain-peer-buffer",
                format!("must be at least {MIN_WINDOW} bytes"),
            ));
        }
        if self.agent_cert.is_some() != self.agent_key.is_some() {
            return Err(invalid(
                "agent-cert",
                "--agent-cert and --agent-key must be given together",
            ));
        }
        Ok(())
    }

    /// Settings that are accepted, as upstream accepts them, but are
    /// probably mistakes: each is a sentence for a warning.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if let Err(e) = AgentIdentifiers::parse_strict(&self.agent_identifiers) {
            warnings.push(format!(
                "--agent-identifiers: {e}; it can only match a dial to that literal host"
            ));
        }
        warnings
    }

    /// Upstream flags this implementation accepts but does not act on.
    pub fn ignored_settings(&self) -> Vec<&'static str> {
        let d = ProxyAgentSettings::default();
        let mut ignored = Vec::new();
        let mut check = |set: bool, name: &'static str| {
            if set {
                ignored.push(name);
            }
        };
        check(self.enable_profiling, "enable-profiling");
        check(
            self.enable_contention_profiling,
            "enable-contention-profiling",
        );
        check(self.warn_on_channel_limit, "warn-on-channel-limit");
        check(self.count_server_leases, "count-server-leases");
        check(self.lease_namespace != d.lease_namespace, "lease-namespace");
        check(
            self.lease_label_selector != d.lease_label_selector,
            "lease-label-selector",
        );
        check(
            self.server_count_source != d.server_count_source,
            "server-count-source",
        );
        check(!self.kubeconfig.is_empty(), "kubeconfig");
        check(
            self.kube_api_content_type != d.kube_api_content_type,
            "kube-api-content-type",
        );
        check(
            self.xfr_channel_size != d.xfr_channel_size,
            "xfr-channel-size",
        );
        check(self.probe_interval != d.probe_interval, "probe-interval");
        ignored
    }

    /// The runtime configuration. Certificates are read by [`crate::start`].
    pub fn to_agent_config(&self) -> Result<ProxyAgentConfig, ConfigError> {
        let Some(ca_cert) = self.ca_cert.clone() else {
            return Err(invalid(
                "ca-cert",
                "is required (the CA bundle that issued the proxy-server's certificate)",
            ));
        };
        let tls = TlsSource::Files {
            ca_cert,
            agent_cert: self.agent_cert.clone(),
            agent_key: self.agent_key.clone(),
            alpn: self.alpn_proto.clone(),
        };
        let mut config = ProxyAgentConfig::new(tls);
        config.proxy_server_host = self.proxy_server_host.clone();
        config.proxy_server_port = self.proxy_server_port;
        if !self.agent_id.is_empty() {
            config.agent_id = self.agent_id.clone();
        }
        config.agent_identifiers = self.agent_identifiers.clone();
        config.health_server_host = self.health_server_host.clone();
        config.health_server_port = self.health_server_port;
        config.admin_bind_address = self.admin_bind_address.clone();
        config.admin_server_port = self.admin_server_port;
        config.sync_interval = self.sync_interval;
        config.sync_interval_cap = self.sync_interval_cap;
        config.sync_forever = self.sync_forever;
        config.service_account_token_path = (!self.service_account_token_path.is_empty())
            .then(|| PathBuf::from(&self.service_account_token_path));
        config.flow_control_window = self.flow_control_window;
        config.plain_peer_buffer = self.plain_peer_buffer;
        config.target_receive_buffer =
            (self.target_receive_buffer > 0).then_some(self.target_receive_buffer);
        config.dial_timeout = self.dial_timeout;
        if self.credential_reload_interval.is_zero() {
            return Err(ConfigError::Invalid {
                field: "credential-reload-interval",
                reason: "must be greater than zero".into(),
            });
        }
        config.credential_reload_interval = self.credential_reload_interval;
        config.keepalive_time = self.keepalive_time;
        config.lean_framing = self.lean_framing;
        config.transport = self.transport;
        config.websocket_heartbeat = self.websocket_heartbeat;
        // Set up by the shell's telemetry only when relaying applies (no
        // collector of our own, `--trace-relay=auto`).
        config.span_relay = match self.trace_relay {
            TraceRelay::Auto => cluster_proxy_runtime::telemetry::relay::installed(),
            TraceRelay::Off => None,
        };
        config.host_aliases = cluster_proxy_runtime::config::host_aliases(&self.host_alias)?;
        config.egress = EgressSettings {
            proxy_url: (!self.proxy_url.is_empty()).then(|| self.proxy_url.clone()),
            proxy_ca_file: self.proxy_ca_cert.clone(),
            proxy_credentials_file: self.proxy_credentials_file.clone(),
        };
        Ok(config)
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<ProxyAgentSettings, ConfigError> {
        let mut argv = vec!["proxy-agent"];
        argv.extend_from_slice(args);
        ProxyAgentSettings::load_with_env(&Cli::parse_from(argv), Vec::new())
    }

    #[test]
    fn every_flag_is_described_and_shows_its_default() {
        let problems = cluster_proxy_runtime::cli::help_problems::<Cli>(
            &ProxyAgentSettings::default(),
            &["[default: 8091]", "[default: 1s]", "[default: 127.0.0.1]"],
        );
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn defaults_match_upstream() {
        let c = parse(&[]).unwrap();
        assert_eq!(c, ProxyAgentSettings::default());
        assert_eq!(
            (c.proxy_server_host.as_str(), c.proxy_server_port),
            ("127.0.0.1", 8091)
        );
        assert_eq!((c.health_server_port, c.admin_server_port), (8093, 8094));
        assert_eq!(c.admin_bind_address, "127.0.0.1");
        assert_eq!(c.sync_interval, Duration::from_secs(1));
        assert_eq!(c.sync_interval_cap, Duration::from_secs(10));
        assert_eq!(c.keepalive_time, Duration::from_secs(3600));
        assert_eq!(c.xfr_channel_size, 150);
        assert_eq!(c.dial_timeout, Duration::from_secs(5));
        assert!(!c.sync_forever);
        assert!(c.ignored_settings().is_empty());
    }

    #[test]
    fn layers_file_then_env_then_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "agent.toml",
                "proxy_server_host = \"file\"\nproxy_server_port = 1001\nhealth_server_port = 1002\nsync_interval = \"2s\"\n",
            )?;
            jail.set_env("PROXY_AGENT_PROXY_SERVER_PORT", "2001");
            jail.set_env("PROXY_AGENT_HEALTH_SERVER_PORT", "2002");
            jail.set_env("PROXY_AGENT_ID", "from-env");
            // Kubernetes service links must not break startup.
            jail.set_env("PROXY_AGENT_SERVICE_HOST", "10.0.0.1");
            let cli = Cli::parse_from([
                "proxy-agent",
                "--config",
                "agent.toml",
                "--health-server-port",
                "3002",
                "--sync-interval-cap=1m30s",
                "--sync-forever",
            ]);
            let c = ProxyAgentSettings::load(&cli).map_err(|e| e.to_string())?;
            assert_eq!(c.proxy_server_host, "file");
            assert_eq!(c.proxy_server_port, 2001);
            assert_eq!(c.health_server_port, 3002);
            assert_eq!(c.agent_id, "from-env");
            assert_eq!(c.sync_interval, Duration::from_secs(2));
            assert_eq!(c.sync_interval_cap, Duration::from_secs(90));
            assert!(c.sync_forever);
            Ok(())
        });
    }

    #[test]
    fn worker_threads_default_to_one_per_cpu_and_follow_env_and_flag() {
        assert_eq!(
            parse(&[]).unwrap().worker_threads,
            cluster_proxy_runtime::workers::PER_CPU
        );
        assert_eq!(parse(&["--worker-threads=1"]).unwrap().worker_threads, 1);
        figment::Jail::expect_with(|jail| {
            jail.set_env("PROXY_AGENT_WORKER_THREADS", "3");
            let c = ProxyAgentSettings::load(&Cli::parse_from(["proxy-agent"]))
                .map_err(|e| e.to_string())?;
            assert_eq!(c.worker_threads, 3);
            Ok(())
        });
        assert!(Cli::try_parse_from(["proxy-agent", "--worker-threads=-1"]).is_err());
        let refused = parse(&["--worker-threads=100000"]).expect_err("too many threads");
        assert!(refused.to_string().contains("worker-threads"), "{refused}");
    }

    #[test]
    fn transport_comes_from_the_flag_the_environment_or_the_file() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.transport, Transport::Auto);
        assert_eq!(
            c.websocket_heartbeat,
            cluster_proxy_proto::websocket::DEFAULT_HEARTBEAT
        );
        let c = parse(&["--transport=websocket", "--websocket-heartbeat=45s"]).unwrap();
        assert_eq!(c.transport, Transport::Websocket);
        assert_eq!(c.websocket_heartbeat, Duration::from_secs(45));
        let config = parse(&["--ca-cert=/ca.crt", "--transport", "websocket"])
            .unwrap()
            .to_agent_config()
            .unwrap();
        assert_eq!(config.transport, Transport::Websocket);
        figment::Jail::expect_with(|jail| {
            jail.create_file("agent.toml", "transport = \"websocket\"\n")?;
            let c =
                ProxyAgentSettings::load(&Cli::parse_from(["proxy-agent", "--config=agent.toml"]))
                    .map_err(|e| e.to_string())?;
            assert_eq!(c.transport, Transport::Websocket);
            Ok(())
        });
        figment::Jail::expect_with(|jail| {
            jail.set_env("PROXY_AGENT_TRANSPORT", "websocket");
            let c = ProxyAgentSettings::load(&Cli::parse_from(["proxy-agent"]))
                .map_err(|e| e.to_string())?;
            assert_eq!(c.transport, Transport::Websocket);
            let c = ProxyAgentSettings::load(&Cli::parse_from(["proxy-agent", "--transport=auto"]))
                .map_err(|e| e.to_string())?;
            assert_eq!(c.transport, Transport::Auto, "the flag wins");
            Ok(())
        });
        let err = Cli::try_parse_from(["proxy-agent", "--transport=h3"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("websocket"), "{err}");
        let err = parse(&["--websocket-heartbeat=0s"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("websocket-heartbeat"), "{err}");
    }

    #[test]
    fn bool_flags_take_optional_values() {
        assert!(parse(&["--sync-forever"]).unwrap().sync_forever);
        assert!(parse(&["--sync-forever=true"]).unwrap().sync_forever);
        assert!(!parse(&["--sync-forever=false"]).unwrap().sync_forever);
        assert!(!parse(&["--sync-forever=0"]).unwrap().sync_forever);
        assert!(Cli::try_parse_from(["proxy-agent", "--sync-forever=maybe"]).is_err());
    }

    #[test]
    fn host_aliases_are_parsed_and_validated() {
        let settings = parse(&[
            "--ca-cert=/ca.crt",
            "--host-alias=cluster-a=127.0.0.1",
            "--host-alias",
            "api.local=::1",
        ])
        .unwrap();
        let config = settings.to_agent_config().unwrap();
        assert_eq!(
            config.host_aliases.get("cluster-a"),
            Some(&"127.0.0.1".parse().unwrap())
        );
        assert_eq!(
            config.host_aliases.get("api.local"),
            Some(&"::1".parse().unwrap())
        );
        for bad in [
            "--host-alias=cluster-a",
            "--host-alias=cluster-a=not-an-ip",
            "--host-alias==1.2.3.4",
        ] {
            let err = parse(&["--ca-cert=/ca.crt", bad])
                .and_then(|s| s.to_agent_config().map(|_| s))
                .unwrap_err()
                .to_string();
            assert!(err.contains("host-alias"), "{bad}: {err}");
        }
    }

    #[test]
    fn invalid_values_name_the_field() {
        let err = Cli::try_parse_from(["proxy-agent", "--proxy-server-port=abc"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--proxy-server-port"), "{err}");
        let err = parse(&["--sync-interval=5s", "--sync-interval-cap=2s"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sync-interval-cap"), "{err}");
        let err = parse(&["--agent-identifiers=host=a&zone=eu"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("agent-identifiers") && err.contains("zone"),
            "{err}"
        );
        let err = parse(&["--sync-interval=soon"]).unwrap_err().to_string();
        assert!(err.contains("--sync-interval"), "{err}");
        let err = parse(&["--server-count-source=min"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("server-count-source"), "{err}");
        let err = parse(&["--flow-control-window=10"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("flow-control-window"), "{err}");
        let err = parse(&["--agent-cert=/x.crt"]).unwrap_err().to_string();
        assert!(err.contains("agent-key"), "{err}");
        figment::Jail::expect_with(|jail| {
            jail.create_file("typo.toml", "proxy_server_prot = 1\n")?;
            let err = parse(&["--config", "typo.toml"]).unwrap_err().to_string();
            assert!(err.contains("proxy_server_prot"), "{err}");
            jail.create_file("bad.toml", "proxy_server_port = \"many\"\n")?;
            let err = parse(&["--config", "bad.toml"]).unwrap_err().to_string();
            assert!(err.contains("proxy_server_port"), "{err}");
            Ok(())
        });
        let err = parse(&[])
            .unwrap()
            .to_agent_config()
            .unwrap_err()
            .to_string();
        assert!(err.contains("ca-cert"), "{err}");
    }

    #[test]
    fn every_upstream_flag_is_accepted() {
        let c = parse(&[
            "--agent-cert=/a.crt",
            "--agent-key=/a.key",
            "--ca-cert=/ca.crt",
            "--proxy-server-host=proxy.example",
            "--proxy-server-port=8091",
            "--alpn-proto=h2,http/1.1",
            "--health-server-host=0.0.0.0",
            "--health-server-port=8093",
            "--admin-server-port=8094",
            "--admin-bind-address=127.0.0.1",
            "--enable-profiling",
            "--enable-contention-profiling=false",
            "--agent-id=agent-1",
            "--agent-identifiers=host=cluster-a&default-route=true",
            "--sync-interval=1s",
            "--probe-interval=1s",
            "--sync-interval-cap=10s",
            "--keepalive-time=1h0m0s",
            "--service-account-token-path=/var/run/token",
            "--warn-on-channel-limit",
            "--sync-forever=true",
            "--xfr-channel-size=150",
            "--count-server-leases",
            "--lease-namespace=kube-system",
            "--lease-label=k8s-app=other",
            "--server-count-source=max",
            "--kubeconfig=/kube/config",
            "--kube-api-content-type=application/json",
            "--v=3",
        ])
        .unwrap();
        assert_eq!(c.alpn_proto, ["h2", "http/1.1"]);
        assert_eq!(c.lease_label_selector, "k8s-app=other");
        assert_eq!(c.v, 3);
        assert_eq!(
            c.ignored_settings(),
            [
                "enable-profiling",
                "warn-on-channel-limit",
                "count-server-leases",
                "lease-label-selector",
                "server-count-source",
                "kubeconfig",
                "kube-api-content-type",
            ]
        );
        let config = c.to_agent_config().unwrap();
        assert_eq!(config.agent_id, "agent-1");
        assert_eq!(
            config.service_account_token_path,
            Some(PathBuf::from("/var/run/token"))
        );
    }
}

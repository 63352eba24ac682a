//! `health-prober`'s command line and settings, layered like every other
//! binary's: defaults < TOML file (`--config`) < environment
//! (`HEALTH_PROBER_<FLAG>`) < flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_runtime::cli::HealthFlags;
pub use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::config::{self, EnvSpec, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use cluster_proxy_runtime::telemetry::TelemetryFlags;
use serde::{Deserialize, Serialize};

/// The environment layer.
pub const ENV: EnvSpec = EnvSpec {
    prefix: "HEALTH_PROBER_",
    aliases: &[],
};

/// Port of `/healthz`, `/readyz` and `/metrics`.
pub const DEFAULT_HEALTH_PORT: u16 = 58082;

/// The hub namespace when neither `--namespace` nor `POD_NAMESPACE` says.
pub const DEFAULT_NAMESPACE: &str = "open-cluster-management-addon";

/// The client Service in front of every proxy-server replica (upstream's name).
pub const ENTRYPOINT_SERVICE: &str = "proxy-entrypoint";

/// The proxy-server's gRPC client port behind [`ENTRYPOINT_SERVICE`].
pub const ENTRYPOINT_PORT: u16 = 8090;

#[derive(Parser, Debug, Default, Serialize)]
#[command(
    name = "health-prober",
    version,
    about = "Probes every managed cluster's kube-apiserver through each proxy-server replica \
             and records reachability and latency in the cluster-proxy ManagedClusterAddOn status"
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The hub namespace of the probers' member Leases and the
    /// proxy-entrypoint Service; the pod's namespace (`POD_NAMESPACE`) by default.
    #[arg(long)]
    pub namespace: Option<String>,
    /// Comma-separated `host:port` client addresses, one per proxy-server
    /// replica; empty: the one address `proxy-entrypoint.<namespace>:8090`.
    #[arg(long)]
    pub proxy_server_addresses: Option<String>,
    /// CA bundle that signed the proxy-servers' certificates.
    #[arg(long)]
    pub proxy_ca_cert: Option<PathBuf>,
    /// Client certificate (Secret `proxy-client`'s `tls.crt`).
    #[arg(long)]
    pub proxy_cert: Option<PathBuf>,
    /// Client key (Secret `proxy-client`'s `tls.key`).
    #[arg(long)]
    pub proxy_key: Option<PathBuf>,
    /// Time between probe rounds (each round is jittered by ±10%).
    #[arg(long)]
    pub interval: Option<String>,
    /// Least time between two writes of a cluster's condition when only its latency moved (state changes are written at once).
    #[arg(long)]
    pub latency_write_interval: Option<String>,
    /// Limit of one probe (dial, TLS handshake and `GET /healthz` together).
    #[arg(long)]
    pub timeout: Option<String>,
    /// Port of each cluster's kube-apiserver, dialed as `<cluster>:<port>`.
    #[arg(long)]
    pub target_port: Option<u16>,
    /// Skip verifying the managed kube-apiservers' certificates (the hub has
    /// no CA for them; clusteradm skips it too). `false` needs --target-ca.
    #[arg(long, value_parser = cluster_proxy_runtime::cli::parse_go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub insecure_target: Option<bool>,
    /// CA bundle to verify the managed kube-apiservers with (implies
    /// --insecure-target=false).
    #[arg(long)]
    pub target_ca: Option<PathBuf>,
    /// How many probes run at once.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Share the clusters among the running replicas: each holds a member
    /// Lease in --namespace and probes the clusters rendezvous hashing gives
    /// it. `false`: this replica probes every cluster and uses no Lease (one
    /// replica only).
    #[arg(long, value_parser = cluster_proxy_runtime::cli::parse_go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub leader_elect: Option<bool>,
    #[command(flatten)]
    #[serde(flatten)]
    pub health: HealthFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub logging: LogFlags,
    /// OpenTelemetry trace export (flags default to the OTEL_* variables).
    #[command(flatten)]
    #[serde(skip)]
    pub telemetry: TelemetryFlags,
}

/// The effective settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthProberSettings {
    pub namespace: String,
    pub proxy_server_addresses: String,
    pub proxy_ca_cert: PathBuf,
    pub proxy_cert: PathBuf,
    pub proxy_key: PathBuf,
    #[serde(with = "serde_go")]
    pub interval: Duration,
    #[serde(with = "serde_go")]
    pub latency_write_interval: Duration,
    #[serde(with = "serde_go")]
    pub timeout: Duration,
    pub target_port: u16,
    pub insecure_target: bool,
    pub target_ca: Option<PathBuf>,
    pub concurrency: usize,
    pub leader_elect: bool,
    pub health_port: u16,
    pub health_bind_address: String,
    pub v: u8,
    pub log_format: LogFormat,
}

impl Default for HealthProberSettings {
    fn default() -> Self {
        HealthProberSettings {
            namespace: std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|ns| !ns.is_empty())
                .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string()),
            proxy_server_addresses: String::new(),
            proxy_ca_cert: "/etc/cluster-proxy/ca/ca.crt".into(),
            proxy_cert: "/etc/cluster-proxy/client/tls.crt".into(),
            proxy_key: "/etc/cluster-proxy/client/tls.key".into(),
            interval: Duration::from_secs(30),
            latency_write_interval: crate::prober::LATENCY_WRITE_INTERVAL,
            timeout: Duration::from_secs(10),
            target_port: 443,
            insecure_target: true,
            target_ca: None,
            concurrency: 64,
            leader_elect: true,
            health_port: DEFAULT_HEALTH_PORT,
            health_bind_address: String::new(),
            v: 0,
            log_format: LogFormat::Auto,
        }
    }
}

impl CommandLine for Cli {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }

    fn telemetry(&self) -> Option<&TelemetryFlags> {
        Some(&self.telemetry)
    }
}

impl BinarySettings for HealthProberSettings {
    type Flags = Cli;
    const SERVICE: &'static str = "health-prober";

    fn load(flags: &Cli) -> Result<Self, ConfigError> {
        Self::load_with_env(flags, std::env::vars())
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }
}

impl HealthProberSettings {
    pub fn load_with_env(
        flags: &Cli,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut settings: HealthProberSettings =
            config::load_with_env(ENV, flags.config.as_deref(), flags, vars)?;
        if settings.target_ca.is_some() && flags.insecure_target.is_none() {
            // A CA given means verify, unless the flag says otherwise explicitly.
            settings.insecure_target = false;
        }
        settings.validate()?;
        Ok(settings)
    }

    /// The replicas' client addresses (`host:port`), in the order given.
    pub fn replica_addresses(&self) -> Vec<String> {
        let listed: Vec<String> = self
            .proxy_server_addresses
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_owned)
            .collect();
        if listed.is_empty() {
            vec![format!(
                "{ENTRYPOINT_SERVICE}.{}:{ENTRYPOINT_PORT}",
                self.namespace
            )]
        } else {
            listed
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !cluster_proxy_proto::identity::is_dns1123_label(&self.namespace) {
            return Err(invalid("namespace", "must be a DNS-1123 label"));
        }
        for address in self.replica_addresses() {
            crate::replicas::split_address(&address)
                .map_err(|e| invalid("proxy_server_addresses", e.to_string()))?;
        }
        if self.interval < Duration::from_secs(1) {
            return Err(invalid("interval", "must be at least 1s"));
        }
        if self.timeout.is_zero() || self.timeout > self.interval {
            return Err(invalid(
                "timeout",
                "must be positive and no longer than the interval",
            ));
        }
        if self.target_port == 0 {
            return Err(invalid("target_port", "must not be 0"));
        }
        if !self.insecure_target && self.target_ca.is_none() {
            return Err(invalid(
                "insecure_target",
                "false needs --target-ca: the hub holds no CA for managed kube-apiservers",
            ));
        }
        if self.concurrency == 0 {
            return Err(invalid("concurrency", "must be at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn load(args: &[&str], vars: &[(&str, &str)]) -> Result<HealthProberSettings, ConfigError> {
        let mut argv = vec!["health-prober"];
        argv.extend(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| invalid("flags", e.to_string()))?;
        HealthProberSettings::load_with_env(
            &cli,
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn flags_beat_the_environment_which_beats_defaults() {
        let settings = load(
            &["--interval=1m", "--namespace=hub"],
            &[
                ("HEALTH_PROBER_INTERVAL", "5s"),
                ("HEALTH_PROBER_TARGET_PORT", "6443"),
            ],
        )
        .unwrap();
        assert_eq!(settings.interval, Duration::from_secs(60));
        assert_eq!(settings.target_port, 6443);
        assert!(settings.insecure_target);
        assert_eq!(
            settings.replica_addresses(),
            vec!["proxy-entrypoint.hub:8090".to_string()]
        );
    }

    #[test]
    fn a_list_of_replicas_is_split_and_checked() {
        let settings = load(
            &["--proxy-server-addresses=127.0.0.1:1, [::1]:2 ,proxy-0.hub:8090"],
            &[],
        )
        .unwrap();
        assert_eq!(
            settings.replica_addresses(),
            vec!["127.0.0.1:1", "[::1]:2", "proxy-0.hub:8090"]
        );
        let err = load(&["--proxy-server-addresses=nowhere"], &[]).unwrap_err();
        assert!(err.to_string().contains("proxy_server_addresses"), "{err}");
    }

    #[test]
    fn a_target_ca_turns_verification_on() {
        let settings = load(&["--target-ca=/ca.crt"], &[]).unwrap();
        assert!(!settings.insecure_target);
        let err = load(&["--insecure-target=false"], &[]).unwrap_err();
        assert!(err.to_string().contains("target-ca"), "{err}");
    }

    #[test]
    fn bad_settings_are_refused_with_the_flag_named() {
        let err = load(&["--timeout=1m", "--interval=30s"], &[]).unwrap_err();
        assert!(err.to_string().contains("timeout"), "{err}");
        let err = load(&[], &[("HEALTH_PROBER_TARGET_PORT", "many")]).unwrap_err();
        assert!(
            err.to_string().contains("HEALTH_PROBER_TARGET_PORT"),
            "{err}"
        );
        let err = load(&["--namespace=Not_A_Label"], &[]).unwrap_err();
        assert!(err.to_string().contains("namespace"), "{err}");
    }

    #[test]
    fn every_flag_is_described_with_its_default() {
        let problems =
            cluster_proxy_runtime::cli::help_problems::<Cli>(&HealthProberSettings::default(), &[]);
        assert!(problems.is_empty(), "{problems:?}");
        let _ = Cli::command();
    }
}

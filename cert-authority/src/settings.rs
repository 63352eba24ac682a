//! `cert-authority`'s command line and settings, layered like every other
//! binary's: defaults < TOML file (`--config`) < environment
//! (`CERT_AUTHORITY_<FLAG>`) < flags. Each subcommand has its own settings.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_proto::identity::ClusterName;
pub use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::config::{self, EnvSpec, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use cluster_proxy_runtime::telemetry::TelemetryFlags;
use serde::{Deserialize, Serialize};

use crate::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};
use crate::rotation::RolloverPolicy;

/// The environment layer of both subcommands.
pub const ENV: EnvSpec = EnvSpec {
    prefix: "CERT_AUTHORITY_",
    aliases: &[],
};

#[derive(Parser, Debug)]
#[command(
    name = "cert-authority",
    version,
    about = "cluster-proxy PKI: issues every mTLS credential"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Write a complete PKI into a directory: CA and trust bundle, both
    /// proxy-server certificates, the proxy-client certificate and one agent
    /// certificate per cluster.
    Init(InitFlags),
    /// Keep a PKI current: renew leaves between 2/3 and 13/15 of their life
    /// or when their SANs change, and roll the CA over ahead of its expiry
    /// without an outage.
    Run(Box<RunFlags>),
}

/// Where the PKI lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A directory made by `init`.
    Files,
    /// Secrets in the hub, and agent certificates through CSRs.
    Kubernetes,
}

/// `init`'s settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InitSettings {
    pub dir: Option<PathBuf>,
    pub clusters: Vec<String>,
    pub additional_san: Vec<String>,
    #[serde(with = "serde_go")]
    pub leaf_validity: Duration,
    #[serde(with = "serde_go")]
    pub ca_validity: Duration,
}

impl Default for InitSettings {
    fn default() -> Self {
        InitSettings {
            dir: None,
            clusters: Vec::new(),
            additional_san: Vec::new(),
            leaf_validity: DEFAULT_LEAF_VALIDITY,
            ca_validity: DEFAULT_CA_VALIDITY,
        }
    }
}

/// The flags `init` and `run` share.
#[derive(Args, Debug, Default, Serialize)]
pub struct PkiFlags {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Extra SAN for both server certificates (repeatable), as upstream's additionalSANs.
    #[arg(long = "additional-san")]
    pub additional_san: Option<Vec<String>>,
    /// Validity of leaf certificates (Go duration).
    #[arg(long)]
    pub leaf_validity: Option<String>,
    /// Validity of a new CA (Go duration).
    #[arg(long)]
    pub ca_validity: Option<String>,
}

#[derive(Args, Debug, Default, Serialize)]
pub struct InitFlags {
    /// Directory to create the PKI in (must not hold a CA yet).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Managed clusters to issue agent certificates for (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub clusters: Option<Vec<String>>,
    #[command(flatten)]
    #[serde(flatten)]
    pub pki: PkiFlags,
}

/// The ManagedProxyConfiguration followed unless told otherwise: the one
/// the addon reads.
pub const DEFAULT_MANAGED_PROXY_CONFIGURATION: &str = "cluster-proxy";

/// `/healthz`, `/readyz` and `/metrics` of `run --backend kubernetes` (next
/// to the proxy-server's 8090–8095 and the agent's 8093–8094).
pub const DEFAULT_HEALTH_PORT: u16 = 8096;

/// `run`'s settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSettings {
    pub backend: Backend,
    pub dir: Option<PathBuf>,
    pub namespace: String,
    /// kubernetes: the cluster-scoped ManagedProxyConfiguration to follow;
    /// empty: none (Secrets in `namespace`, SANs from the flags only).
    pub managed_proxy_configuration: String,
    pub signer_secret_name: String,
    /// Empty: `namespace`.
    pub signer_secret_namespace: String,
    pub clusters: Vec<String>,
    pub additional_san: Vec<String>,
    #[serde(with = "serde_go")]
    pub interval: Duration,
    #[serde(with = "serde_go")]
    pub leaf_validity: Duration,
    #[serde(with = "serde_go")]
    pub ca_validity: Duration,
    #[serde(with = "serde_go")]
    pub ca_prepare_before_expiry: Duration,
    #[serde(with = "serde_go")]
    pub bundle_propagation: Duration,
    pub once: bool,
    pub health_port: u16,
    pub health_bind_address: String,
    pub v: u8,
    pub log_format: LogFormat,
}

impl Default for RunSettings {
    fn default() -> Self {
        let rollover = RolloverPolicy::default();
        RunSettings {
            backend: Backend::Files,
            dir: None,
            namespace: "open-cluster-management-addon".into(),
            managed_proxy_configuration: DEFAULT_MANAGED_PROXY_CONFIGURATION.into(),
            signer_secret_name: "cluster-proxy-signer".into(),
            signer_secret_namespace: String::new(),
            clusters: Vec::new(),
            additional_san: Vec::new(),
            interval: Duration::from_secs(60),
            leaf_validity: DEFAULT_LEAF_VALIDITY,
            ca_validity: rollover.ca_validity,
            ca_prepare_before_expiry: rollover.prepare_before_expiry,
            bundle_propagation: rollover.bundle_propagation,
            once: false,
            health_port: DEFAULT_HEALTH_PORT,
            health_bind_address: String::new(),
            v: 0,
            log_format: LogFormat::Auto,
        }
    }
}

#[derive(Args, Debug, Default, Serialize)]
pub struct RunFlags {
    /// Where the PKI lives: files (a directory made by `init`) or kubernetes
    /// (Secrets, and agent certificates through CSRs).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// files: the PKI directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// kubernetes: namespace of the leader Lease and the signer Secret, and of the hub Secrets unless a ManagedProxyConfiguration names theirs.
    #[arg(long)]
    pub namespace: Option<String>,
    /// kubernetes: the ManagedProxyConfiguration whose namespace, Secret names and SANs the hub certificates follow and whose status gets their conditions (empty: none).
    #[arg(long)]
    pub managed_proxy_configuration: Option<String>,
    /// kubernetes: the Secret holding the CA.
    #[arg(long)]
    pub signer_secret_name: Option<String>,
    /// kubernetes: its namespace (empty: --namespace).
    #[arg(long)]
    pub signer_secret_namespace: Option<String>,
    /// files: managed clusters whose agent certificates to keep current (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub clusters: Option<Vec<String>>,
    /// How often to check (Go duration).
    #[arg(long)]
    pub interval: Option<String>,
    /// Create the next CA this long before the current one expires.
    #[arg(long)]
    pub ca_prepare_before_expiry: Option<String>,
    /// Publish the next CA in the bundle this long before signing with it.
    #[arg(long)]
    pub bundle_propagation: Option<String>,
    /// One pass, then exit.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub once: Option<bool>,
    /// kubernetes: port of /healthz, /readyz and /metrics (0 picks a free one).
    #[arg(long)]
    pub health_port: Option<u16>,
    /// kubernetes: address the health port listens on (empty: every address).
    #[arg(long)]
    pub health_bind_address: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub pki: PkiFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub logging: LogFlags,
    /// OpenTelemetry trace export (flags default to the OTEL_* variables).
    #[command(flatten)]
    #[serde(skip)]
    pub telemetry: TelemetryFlags,
}

/// Parses the process's arguments; `--help` shows each subcommand's own
/// defaults, and `--help`, `--version` or bad flags exit as clap does.
pub fn parse() -> Cli {
    use clap::CommandFactory;
    let command = cluster_proxy_runtime::cli::with_subcommand_defaults(
        Cli::command(),
        "init",
        &InitSettings::default(),
    );
    let command = cluster_proxy_runtime::cli::with_subcommand_defaults(
        command,
        "run",
        &RunSettings::default(),
    );
    cluster_proxy_runtime::cli::parse_command(command)
}

/// Parses `--clusters` names.
pub fn cluster_names(names: &[String]) -> Result<Vec<ClusterName>, ConfigError> {
    names
        .iter()
        .map(|c| ClusterName::new(c.trim()).map_err(|e| invalid("clusters", e.to_string())))
        .collect()
}

impl InitSettings {
    pub fn load(flags: &InitFlags) -> Result<Self, ConfigError> {
        Self::load_with_env(flags, std::env::vars())
    }

    pub fn load_with_env(
        flags: &InitFlags,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let settings: InitSettings =
            config::load_with_env(ENV, flags.pki.config.as_deref(), flags, vars)?;
        if settings.dir.is_none() {
            return Err(invalid("dir", "is required"));
        }
        cluster_names(&settings.clusters)?;
        Ok(settings)
    }
}

impl CommandLine for RunFlags {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }

    fn telemetry(&self) -> Option<&TelemetryFlags> {
        Some(&self.telemetry)
    }
}

impl BinarySettings for RunSettings {
    type Flags = RunFlags;
    const SERVICE: &'static str = "cert-authority";

    fn load(flags: &RunFlags) -> Result<Self, ConfigError> {
        Self::load_with_env(flags, std::env::vars())
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }
}

impl RunSettings {
    pub fn load_with_env(
        flags: &RunFlags,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let settings: RunSettings =
            config::load_with_env(ENV, flags.pki.config.as_deref(), flags, vars)?;
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        cluster_names(&self.clusters)?;
        match self.backend {
            Backend::Files if self.dir.is_none() => {
                Err(invalid("dir", "is required with --backend files"))
            }
            Backend::Kubernetes if !self.clusters.is_empty() => Err(invalid(
                "clusters",
                "is for the files backend: with --backend kubernetes agents get their certificates through CSRs",
            )),
            _ if self.interval.is_zero() => Err(invalid("interval", "must be greater than zero")),
            _ if !self.managed_proxy_configuration.is_empty()
                && !crate::kubernetes::secrets::is_dns_subdomain(
                    &self.managed_proxy_configuration,
                ) =>
            {
                Err(invalid(
                    "managed-proxy-configuration",
                    "is not a valid object name (lower-case DNS subdomain)",
                ))
            }
            _ => Ok(()),
        }
    }

    /// The namespace of the signer Secret.
    pub fn signer_namespace(&self) -> &str {
        if self.signer_secret_namespace.is_empty() {
            &self.namespace
        } else {
            &self.signer_secret_namespace
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn run(args: &[&str], env: &[(&str, &str)]) -> Result<RunSettings, ConfigError> {
        let mut argv = vec!["cert-authority", "run"];
        argv.extend_from_slice(args);
        let Command::Run(flags) = Cli::parse_from(argv).command else {
            unreachable!("parsed `run`");
        };
        let vars = env.iter().map(|(k, v)| ((*k).into(), (*v).into()));
        RunSettings::load_with_env(&flags, vars)
    }

    #[test]
    fn every_flag_is_described() {
        let missing = cluster_proxy_runtime::cli::undocumented_flags(&Cli::command());
        assert!(
            missing.is_empty(),
            "flags without a description: {missing:?}"
        );
    }

    #[test]
    fn layers_environment_under_flags() {
        let s = run(
            &["--dir=/pki", "--interval=30s"],
            &[
                ("CERT_AUTHORITY_INTERVAL", "10s"),
                ("CERT_AUTHORITY_LEAF_VALIDITY", "24h"),
                ("CERT_AUTHORITY_ONCE", "True"),
                // A Service named `cert-authority` must not break startup.
                ("CERT_AUTHORITY_SERVICE_HOST", "10.0.0.1"),
            ],
        )
        .unwrap();
        assert_eq!(s.interval, Duration::from_secs(30));
        assert_eq!(s.leaf_validity, Duration::from_secs(24 * 3600));
        assert!(s.once);
        assert_eq!(s.backend, Backend::Files);
    }

    #[test]
    fn bad_combinations_name_the_flag() {
        let err = run(&[], &[]).unwrap_err().to_string();
        assert!(err.contains("--dir"), "{err}");
        let err = run(&["--backend=kubernetes", "--clusters=a"], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--clusters"), "{err}");
        let err = run(&["--dir=/p", "--clusters=Not_A_Name"], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--clusters"), "{err}");
        let err = run(&["--dir=/p", "--interval=soon"], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("interval"), "{err}");
        let s = run(&["--backend=kubernetes", "--namespace=hub"], &[]).unwrap();
        assert_eq!(s.signer_namespace(), "hub");
        assert_eq!(s.managed_proxy_configuration, "cluster-proxy");
        let err = run(
            &[
                "--backend=kubernetes",
                "--managed-proxy-configuration=Not A Name",
            ],
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--managed-proxy-configuration"), "{err}");
        let off = run(
            &["--backend=kubernetes", "--managed-proxy-configuration="],
            &[],
        )
        .unwrap();
        assert_eq!(off.managed_proxy_configuration, "");
    }
}

//! `addon-manager`'s command line and settings, layered like every other
//! binary's: defaults < TOML file (`--config`) < environment
//! (`ADDON_MANAGER_<FLAG>`) < flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_runtime::cli::{HealthFlags, LeaderElectionFlags};
pub use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::config::{self, EnvSpec, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use cluster_proxy_runtime::telemetry::TelemetryFlags;
use serde::{Deserialize, Serialize};

/// The environment layer.
pub const ENV: EnvSpec = EnvSpec {
    prefix: "ADDON_MANAGER_",
    aliases: &[],
};

/// Upstream's probe port (`--health-probe-bind-address=:58081`); here the
/// same port also serves `/metrics`.
pub const DEFAULT_HEALTH_PORT: u16 = 58081;

/// The longest `--placement-removal-grace` accepted.
pub const MAX_REMOVAL_GRACE: Duration = Duration::from_secs(3600);

/// The hub namespace when neither `--namespace` nor `POD_NAMESPACE` says.
pub const DEFAULT_NAMESPACE: &str = "open-cluster-management-addon";

#[derive(Parser, Debug, Default, Serialize)]
#[command(
    name = "addon-manager",
    version,
    about = "Installs cluster-proxy as an OCM addon: proxy-servers on the hub from the \
             ManagedProxyConfiguration, an agent on every selected managed cluster"
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The hub namespace of the addon's own objects (the Placement, the
    /// leader-election Lease); the pod's namespace (`POD_NAMESPACE`) by default.
    #[arg(long)]
    pub namespace: Option<String>,
    /// The cluster-scoped ManagedProxyConfiguration to follow.
    #[arg(long)]
    pub managed_proxy_configuration: Option<String>,
    /// Where agents are installed on managed clusters unless an
    /// AddOnDeploymentConfig's agentInstallNamespace says otherwise.
    #[arg(long)]
    pub agent_install_namespace: Option<String>,
    /// The agent image; empty: the ManagedProxyConfiguration's
    /// proxyAgent.image.
    #[arg(long)]
    pub agent_image_name: Option<String>,
    /// Make each cluster's kube-apiserver reachable by the cluster's name
    /// (agent identifiers `host=<cluster>`, `host=<cluster>.<namespace>`, and
    /// the ExternalName Service).
    #[arg(long, value_parser = cluster_proxy_runtime::cli::parse_go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub enable_kube_api_proxy: Option<bool>,
    /// Ship a NetworkPolicy with every agent: in, only its health port; out,
    /// DNS, the kube-apiserver (443, 6443) and the hub entrypoint's port.
    #[arg(long, value_parser = cluster_proxy_runtime::cli::parse_go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub enable_network_policies: Option<bool>,
    /// Put a service-proxy beside every agent (kubectl through the hub's
    /// user-server), once cert-authority has issued its certificate (the
    /// ManagedProxyConfiguration's spec.userServer). Upstream's binary
    /// defaults to true and its chart passes false; here both say false.
    #[arg(long, value_parser = cluster_proxy_runtime::cli::parse_go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub enable_service_proxy: Option<bool>,
    /// The ports of the managed clusters' kube-apiservers that policy lets
    /// the agents reach, comma-separated (the endpoints' ports: policies
    /// apply after the Service's translation).
    #[arg(long)]
    pub agent_kube_apiserver_ports: Option<String>,
    /// imagePullPolicy of the proxy-server and agent containers: Always,
    /// IfNotPresent or Never; empty: Kubernetes' default.
    #[arg(long)]
    pub image_pull_policy: Option<String>,
    /// The Placement (in --namespace) whose clusters get the addon.
    #[arg(long)]
    pub placement_name: Option<String>,
    /// How long a cluster must stay out of every decision of the placement
    /// before its addon is removed (a Go duration; 0s: at once). OCM's
    /// placement controller rewrites a placement's PlacementDecisions one at
    /// a time, so a cluster moving from one decision to another is briefly
    /// in none.
    #[arg(long)]
    pub placement_removal_grace: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub leader_election: LeaderElectionFlags,
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
pub struct AddonManagerSettings {
    pub namespace: String,
    pub managed_proxy_configuration: String,
    pub agent_install_namespace: String,
    pub agent_image_name: String,
    pub enable_kube_api_proxy: bool,
    pub enable_network_policies: bool,
    pub enable_service_proxy: bool,
    pub agent_kube_apiserver_ports: String,
    pub image_pull_policy: String,
    pub placement_name: String,
    #[serde(with = "serde_go")]
    pub placement_removal_grace: Duration,
    pub leader_elect: bool,
    pub health_port: u16,
    pub health_bind_address: String,
    pub v: u8,
    pub log_format: LogFormat,
}

impl Default for AddonManagerSettings {
    fn default() -> Self {
        AddonManagerSettings {
            namespace: std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|ns| !ns.is_empty())
                .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string()),
            managed_proxy_configuration: "cluster-proxy".into(),
            agent_install_namespace: "open-cluster-management-cluster-proxy".into(),
            agent_image_name: String::new(),
            enable_kube_api_proxy: true,
            enable_network_policies: false,
            enable_service_proxy: false,
            agent_kube_apiserver_ports: "443,6443".into(),
            image_pull_policy: String::new(),
            placement_name: "cluster-proxy-placement".into(),
            placement_removal_grace: crate::addon::DEFAULT_REMOVAL_GRACE,
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

impl BinarySettings for AddonManagerSettings {
    type Flags = Cli;
    const SERVICE: &'static str = "addon-manager";

    fn load(flags: &Cli) -> Result<Self, ConfigError> {
        Self::load_with_env(flags, std::env::vars())
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }
}

impl AddonManagerSettings {
    pub fn load_with_env(
        flags: &Cli,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let settings: AddonManagerSettings =
            config::load_with_env(ENV, flags.config.as_deref(), flags, vars)?;
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let label = cluster_proxy_proto::identity::is_dns1123_label;
        if !label(&self.namespace) {
            return Err(invalid("namespace", "must be a DNS-1123 label"));
        }
        if !label(&self.agent_install_namespace) {
            return Err(invalid(
                "agent_install_namespace",
                "must be a DNS-1123 label",
            ));
        }
        if self.managed_proxy_configuration.is_empty() {
            return Err(invalid("managed_proxy_configuration", "must not be empty"));
        }
        if self.placement_name.is_empty() {
            return Err(invalid("placement_name", "must not be empty"));
        }
        if !matches!(
            self.image_pull_policy.as_str(),
            "" | "Always" | "IfNotPresent" | "Never"
        ) {
            return Err(invalid(
                "image_pull_policy",
                format!(
                    "{:?} is not one of Always, IfNotPresent, Never",
                    self.image_pull_policy
                ),
            ));
        }
        self.kube_apiserver_ports()?;
        if self.placement_removal_grace > MAX_REMOVAL_GRACE {
            return Err(invalid(
                "placement_removal_grace",
                "must be at most 1h: an addon outlives its cluster's removal by that long",
            ));
        }
        Ok(())
    }
}

impl AddonManagerSettings {
    /// `agent_kube_apiserver_ports` as ports: at least one, each 1–65535.
    pub fn kube_apiserver_ports(&self) -> Result<Vec<i32>, ConfigError> {
        let ports = self
            .agent_kube_apiserver_ports
            .split(',')
            .map(str::trim)
            .map(|port| match port.parse::<u16>() {
                Ok(port) if port > 0 => Ok(i32::from(port)),
                _ => Err(invalid(
                    "agent_kube_apiserver_ports",
                    format!("{port:?} is not a port (1-65535)"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ports)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn load(args: &[&str], vars: &[(&str, &str)]) -> Result<AddonManagerSettings, ConfigError> {
        let mut argv = vec!["addon-manager"];
        argv.extend(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| invalid("flags", e.to_string()))?;
        AddonManagerSettings::load_with_env(
            &cli,
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn flags_beat_the_environment_which_beats_defaults() {
        let settings = load(
            &["--agent-install-namespace=agents"],
            &[
                ("ADDON_MANAGER_AGENT_INSTALL_NAMESPACE", "ignored"),
                ("ADDON_MANAGER_LEADER_ELECT", "false"),
            ],
        )
        .unwrap();
        assert_eq!(settings.agent_install_namespace, "agents");
        assert!(!settings.leader_elect);
        assert_eq!(settings.health_port, DEFAULT_HEALTH_PORT);
        assert!(settings.enable_kube_api_proxy);
        assert_eq!(
            settings.placement_removal_grace,
            crate::addon::DEFAULT_REMOVAL_GRACE
        );
        let settings = load(&[], &[("ADDON_MANAGER_PLACEMENT_REMOVAL_GRACE", "1m30s")]).unwrap();
        assert_eq!(settings.placement_removal_grace, Duration::from_secs(90));
        let settings = load(&["--placement-removal-grace=0s"], &[]).unwrap();
        assert_eq!(settings.placement_removal_grace, Duration::ZERO);
    }

    #[test]
    fn bad_settings_are_refused_with_the_flag_named() {
        let err = load(&["--namespace=Not_A_Label"], &[]).unwrap_err();
        assert!(err.to_string().contains("namespace"), "{err}");
        let err = load(&[], &[("ADDON_MANAGER_HEALTH_PORT", "many")]).unwrap_err();
        assert!(
            err.to_string().contains("ADDON_MANAGER_HEALTH_PORT"),
            "{err}"
        );
        let err = load(&["--image-pull-policy=always"], &[]).unwrap_err();
        assert!(err.to_string().contains("image_pull_policy"), "{err}");
        for ports in ["", "443,", "0", "443,70000", "https"] {
            let err = load(&[&format!("--agent-kube-apiserver-ports={ports}")], &[]).unwrap_err();
            assert!(
                err.to_string().contains("agent_kube_apiserver_ports"),
                "{ports}: {err}"
            );
        }
        let settings = load(
            &[],
            &[("ADDON_MANAGER_AGENT_KUBE_APISERVER_PORTS", "6443, 8443")],
        )
        .unwrap();
        assert_eq!(settings.kube_apiserver_ports().unwrap(), vec![6443, 8443]);
        assert_eq!(
            load(&[], &[]).unwrap().kube_apiserver_ports().unwrap(),
            vec![443, 6443]
        );
        for grace in ["ten", "-1s", "2h"] {
            let err = load(&[&format!("--placement-removal-grace={grace}")], &[]).unwrap_err();
            let err = err.to_string();
            assert!(
                err.contains("--placement-removal-grace")
                    || err.contains("placement_removal_grace"),
                "{grace}: {err}"
            );
        }
    }

    #[test]
    fn every_flag_is_described_with_its_default() {
        let problems =
            cluster_proxy_runtime::cli::help_problems::<Cli>(&AddonManagerSettings::default(), &[]);
        assert!(problems.is_empty(), "{problems:?}");
        let _ = Cli::command();
    }
}

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

use crate::hub::telemetry::{DEFAULT_CA_KEY, DEFAULT_HEADERS_KEY, KeyRef, ProxyServerTelemetry};

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
    /// OTLP/gRPC collector the proxy-servers export traces to (their
    /// OTEL_EXPORTER_OTLP_ENDPOINT); empty: none. Unset: addon-manager's own
    /// endpoint (--otlp-endpoint).
    #[arg(long)]
    pub proxy_server_otlp_endpoint: Option<String>,
    /// The proxy-servers' OTEL_TRACES_SAMPLER; unset: addon-manager's own.
    #[arg(long)]
    pub proxy_server_otel_traces_sampler: Option<String>,
    /// The proxy-servers' OTEL_TRACES_SAMPLER_ARG; unset: addon-manager's own.
    #[arg(long)]
    pub proxy_server_otel_traces_sampler_arg: Option<String>,
    /// Resource attributes (key=value,...) of the proxy-servers' spans,
    /// after their pod's namespace and name; unset: addon-manager's own.
    #[arg(long)]
    pub proxy_server_otel_resource_attributes: Option<String>,
    /// The proxy-servers' OTEL_EXPORTER_OTLP_COMPRESSION (none or gzip);
    /// unset: addon-manager's own.
    #[arg(long)]
    pub proxy_server_otlp_compression: Option<String>,
    /// A Secret in the proxy-server namespace whose key holds the
    /// proxy-servers' OTEL_EXPORTER_OTLP_HEADERS (referenced, never copied:
    /// addon-manager's own headers are not passed on); empty: none.
    #[arg(long)]
    pub proxy_server_otlp_headers_secret: Option<String>,
    /// The key of --proxy-server-otlp-headers-secret.
    #[arg(long)]
    pub proxy_server_otlp_headers_secret_key: Option<String>,
    /// A ConfigMap in the proxy-server namespace whose key holds the CA
    /// bundle (PEM) of an https collector, mounted into the proxy-servers
    /// (which trust only that CA for the collector); empty: none, and only
    /// an http collector is accepted.
    #[arg(long)]
    pub proxy_server_otlp_ca_configmap: Option<String>,
    /// The key of --proxy-server-otlp-ca-configmap.
    #[arg(long)]
    pub proxy_server_otlp_ca_configmap_key: Option<String>,
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
    /// `None` here and in the four below: addon-manager's own setting (see
    /// [`AddonManagerSettings::load_with_env`]).
    pub proxy_server_otlp_endpoint: Option<String>,
    pub proxy_server_otel_traces_sampler: Option<String>,
    pub proxy_server_otel_traces_sampler_arg: Option<String>,
    pub proxy_server_otel_resource_attributes: Option<String>,
    pub proxy_server_otlp_compression: Option<String>,
    pub proxy_server_otlp_headers_secret: String,
    pub proxy_server_otlp_headers_secret_key: String,
    pub proxy_server_otlp_ca_configmap: String,
    pub proxy_server_otlp_ca_configmap_key: String,
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
            proxy_server_otlp_endpoint: None,
            proxy_server_otel_traces_sampler: None,
            proxy_server_otel_traces_sampler_arg: None,
            proxy_server_otel_resource_attributes: None,
            proxy_server_otlp_compression: None,
            proxy_server_otlp_headers_secret: String::new(),
            proxy_server_otlp_headers_secret_key: DEFAULT_HEADERS_KEY.into(),
            proxy_server_otlp_ca_configmap: String::new(),
            proxy_server_otlp_ca_configmap_key: DEFAULT_CA_KEY.into(),
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
        let mut settings: AddonManagerSettings =
            config::load_with_env(ENV, flags.config.as_deref(), flags, vars)?;
        settings.inherit_telemetry(&flags.telemetry);
        settings.validate()?;
        Ok(settings)
    }

    /// The proxy-servers' OTLP settings not given default to addon-manager's
    /// own, as its runtime reads them (a traces-only variable over the
    /// general one; `OTEL_SDK_DISABLED=true` turns its endpoint off). Only
    /// what means the same in another pod is passed on: its headers (a
    /// credential, held here as a value) and its CA (a path in this pod)
    /// are not.
    fn inherit_telemetry(&mut self, own: &TelemetryFlags) {
        let given = |value: &Option<String>| {
            value
                .as_deref()
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        let disabled = own
            .otel_sdk_disabled
            .as_deref()
            .is_some_and(|value| value.trim().eq_ignore_ascii_case("true"));
        let own_endpoint = given(&own.otlp_traces_endpoint)
            .or_else(|| given(&own.otlp_endpoint))
            .filter(|_| !disabled);
        let own_compression =
            given(&own.otlp_traces_compression).or_else(|| given(&own.otlp_compression));
        for (setting, own) in [
            (&mut self.proxy_server_otlp_endpoint, own_endpoint),
            (
                &mut self.proxy_server_otel_traces_sampler,
                given(&own.otel_traces_sampler),
            ),
            (
                &mut self.proxy_server_otel_traces_sampler_arg,
                given(&own.otel_traces_sampler_arg),
            ),
            (
                &mut self.proxy_server_otel_resource_attributes,
                given(&own.otel_resource_attributes),
            ),
            (&mut self.proxy_server_otlp_compression, own_compression),
        ] {
            if setting.is_none() {
                *setting = own;
            }
        }
    }

    /// What the proxy-servers' Deployment gets ([`ProxyServerTelemetry`]).
    pub fn proxy_server_telemetry(&self) -> ProxyServerTelemetry {
        let reference = |name: &str, key: &str| {
            (!name.trim().is_empty()).then(|| KeyRef {
                name: name.trim().to_owned(),
                key: key.trim().to_owned(),
            })
        };
        ProxyServerTelemetry {
            endpoint: self.proxy_server_otlp_endpoint.clone(),
            sampler: self.proxy_server_otel_traces_sampler.clone(),
            sampler_arg: self.proxy_server_otel_traces_sampler_arg.clone(),
            resource_attributes: self.proxy_server_otel_resource_attributes.clone(),
            compression: self.proxy_server_otlp_compression.clone(),
            headers_secret: reference(
                &self.proxy_server_otlp_headers_secret,
                &self.proxy_server_otlp_headers_secret_key,
            ),
            ca_config_map: reference(
                &self.proxy_server_otlp_ca_configmap,
                &self.proxy_server_otlp_ca_configmap_key,
            ),
        }
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
        self.proxy_server_telemetry()
            .validate()
            .map_err(|problem| invalid(problem.setting, problem.reason))?;
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

    /// The proxy-servers' OTLP settings default to addon-manager's own,
    /// its headers and CA excepted; an empty endpoint turns theirs off.
    #[test]
    fn proxy_server_otlp_settings_default_to_addon_managers_own() {
        let own = [
            "--otlp-endpoint=http://general:4317",
            "--otlp-traces-endpoint=http://traces:4317",
            "--otel-traces-sampler=traceidratio",
            "--otel-traces-sampler-arg=0.25",
            "--otel-resource-attributes=deployment.environment=prod",
            "--otlp-compression=gzip",
            "--otlp-headers=api-key=s3cr3t-value",
            "--otlp-certificate=/etc/addon-manager/otlp-ca.pem",
        ];
        let telemetry = load(&own, &[]).unwrap().proxy_server_telemetry();
        assert_eq!(
            telemetry,
            ProxyServerTelemetry {
                endpoint: Some("http://traces:4317".into()),
                sampler: Some("traceidratio".into()),
                sampler_arg: Some("0.25".into()),
                resource_attributes: Some("deployment.environment=prod".into()),
                compression: Some("gzip".into()),
                headers_secret: None,
                ca_config_map: None,
            }
        );
        // The credential addon-manager holds never reaches the Deployment.
        let mpc: cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "cluster-proxy", "uid": "u"},
                "spec": {"authentication": {}, "proxyServer": {"image": "i"}, "proxyAgent": {"image": "i"}}
            }))
            .unwrap();
        let options = crate::hub::HubRenderOptions {
            telemetry,
            ..Default::default()
        };
        let rendered =
            serde_json::to_string(&crate::hub::render_with(&mpc, &options).unwrap().deployment)
                .unwrap();
        assert!(rendered.contains("http://traces:4317"), "{rendered}");
        assert!(!rendered.contains("s3cr3t-value"), "{rendered}");
        assert!(!rendered.contains("/etc/addon-manager"), "{rendered}");

        // Given flags win; an empty endpoint is off even while addon-manager exports.
        let mut args = own.to_vec();
        args.extend([
            "--proxy-server-otlp-endpoint=",
            "--proxy-server-otel-traces-sampler=always_on",
            "--proxy-server-otlp-headers-secret=otlp-headers",
            "--proxy-server-otlp-ca-configmap=otlp-ca",
            "--proxy-server-otlp-ca-configmap-key=bundle.pem",
        ]);
        let telemetry = load(&args, &[]).unwrap().proxy_server_telemetry();
        assert!(!telemetry.is_enabled());
        assert_eq!(telemetry.sampler.as_deref(), Some("always_on"));
        assert_eq!(
            telemetry.headers_secret,
            Some(KeyRef {
                name: "otlp-headers".into(),
                key: "headers".into()
            })
        );
        assert_eq!(
            telemetry.ca_config_map,
            Some(KeyRef {
                name: "otlp-ca".into(),
                key: "bundle.pem".into()
            })
        );
        let from_env = load(
            &["--otlp-endpoint=http://own:4317"],
            &[(
                "ADDON_MANAGER_PROXY_SERVER_OTLP_ENDPOINT",
                "http://hub-collector:4317",
            )],
        )
        .unwrap();
        assert_eq!(
            from_env.proxy_server_otlp_endpoint.as_deref(),
            Some("http://hub-collector:4317")
        );
        // OTEL_SDK_DISABLED turns addon-manager's endpoint off, and so the one passed on.
        let disabled = load(
            &[
                "--otlp-endpoint=http://own:4317",
                "--otel-sdk-disabled=true",
            ],
            &[],
        )
        .unwrap();
        assert!(!disabled.proxy_server_telemetry().is_enabled());
        assert!(
            !load(&[], &[])
                .unwrap()
                .proxy_server_telemetry()
                .is_enabled()
        );
    }

    #[test]
    fn bad_proxy_server_otlp_settings_are_refused_with_the_flag_named() {
        for (args, setting) in [
            (
                &["--proxy-server-otlp-endpoint=collector:4317"][..],
                "proxy_server_otlp_endpoint",
            ),
            (
                // It would not start without the collector's CA.
                &["--proxy-server-otlp-endpoint=https://c:4317"][..],
                "proxy_server_otlp_ca_configmap",
            ),
            (
                &[
                    "--proxy-server-otlp-endpoint=http://c:4317",
                    "--proxy-server-otel-traces-sampler=sometimes",
                ][..],
                "proxy_server_otel_traces_sampler",
            ),
            (
                // Inherited values are checked as well.
                &["--otlp-endpoint=http://c:4317", "--otlp-compression=zstd"][..],
                "proxy_server_otlp_compression",
            ),
            (
                &[
                    "--proxy-server-otlp-endpoint=http://c:4317",
                    "--proxy-server-otlp-headers-secret=Not_A_Name",
                ][..],
                "proxy_server_otlp_headers_secret",
            ),
        ] {
            let err = load(args, &[]).unwrap_err().to_string();
            assert!(err.contains(setting), "{args:?}: {err}");
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

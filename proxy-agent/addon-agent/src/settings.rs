//! addon-agent configuration: defaults < TOML file (`--config`) <
//! environment (`ADDON_AGENT_*`) < command-line flags, like every binary of
//! the project. Upstream's `/agent` flags that a ManifestWork may still pass
//! are accepted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_egress::EgressSettings;
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_runtime::cli::{HealthFlags, parse_go_bool, parse_path};
pub use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::config::{self, EnvSpec, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use serde::{Deserialize, Serialize};

use crate::portforward::PortForwardConfig;

/// The layered settings, named as the flags (with underscores).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AddonAgentSettings {
    /// Kubeconfig of the hub (the klusterlet's addon hub kubeconfig).
    pub hub_kubeconfig: Option<PathBuf>,
    /// The managed cluster's name: the hub namespace of the fallback Lease.
    pub cluster_name: String,
    pub lease_name: String,
    /// Empty: `POD_NAMESPACE`.
    pub lease_namespace: String,
    /// Empty: the in-cluster configuration when running in a pod, else none.
    pub managed_kubeconfig: Option<PathBuf>,
    /// The Lease's `holderIdentity`; empty: `POD_NAME`, else `HOSTNAME`.
    pub holder_identity: String,
    pub proxy_agent_health_url: String,
    pub enable_proxy_agent_health_check: bool,
    #[serde(with = "serde_go")]
    pub lease_duration: Duration,
    /// Empty: every address.
    pub health_bind_address: String,
    pub health_port: u16,
    /// The hub namespace of the proxy-server pods the port-forward proxy
    /// forwards to.
    pub proxy_server_namespace: String,
    /// Listen for the proxy-agent and forward each connection to a
    /// proxy-server pod through the hub API (the `PortForward` entrypoint).
    pub enable_port_forward_proxy: bool,
    /// Where the port-forward proxy listens (not an upstream flag: upstream
    /// always listens on 127.0.0.1:8091).
    pub port_forward_proxy_address: String,
    /// Forward proxy to the hub API; empty: `HTTPS_PROXY` and the other
    /// `*_PROXY` variables (`NO_PROXY` applies either way).
    pub proxy_url: String,
    /// CA bundle that verifies an `https://` proxy (never the hub).
    pub proxy_ca_cert: Option<PathBuf>,
    /// Basic credentials for the proxy: `user:password`, or a mounted
    /// `kubernetes.io/basic-auth` Secret's directory.
    pub proxy_credentials_file: Option<PathBuf>,
    /// klog-style verbosity (`-v`); `RUST_LOG` overrides it.
    pub v: u8,
    pub log_format: LogFormat,
}

/// The environment layer: `ADDON_AGENT_<FLAG>`.
pub const ENV: EnvSpec = EnvSpec {
    prefix: "ADDON_AGENT_",
    aliases: &[],
};

pub const DEFAULT_LEASE_NAME: &str = "cluster-proxy";
pub const DEFAULT_HEALTH_URL: &str = "http://127.0.0.1:8093/readyz";

impl Default for AddonAgentSettings {
    fn default() -> Self {
        AddonAgentSettings {
            hub_kubeconfig: None,
            cluster_name: String::new(),
            lease_name: DEFAULT_LEASE_NAME.into(),
            lease_namespace: String::new(),
            managed_kubeconfig: None,
            holder_identity: String::new(),
            proxy_agent_health_url: DEFAULT_HEALTH_URL.into(),
            enable_proxy_agent_health_check: true,
            lease_duration: Duration::from_secs(60),
            health_bind_address: String::new(),
            health_port: 8888,
            proxy_server_namespace: "open-cluster-management-addon".into(),
            enable_port_forward_proxy: false,
            port_forward_proxy_address: crate::portforward::DEFAULT_LISTEN.into(),
            proxy_url: String::new(),
            proxy_ca_cert: None,
            proxy_credentials_file: None,
            v: 0,
            log_format: LogFormat::Auto,
        }
    }
}

/// Command-line flags; only flags given override the lower layers.
#[derive(Debug, Default, Clone, Parser, Serialize)]
#[command(
    name = "addon-agent",
    version,
    about = "cluster-proxy addon-agent: renews the addon Lease while the proxy-agent holds a tunnel",
    args_override_self = true
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Kubeconfig of the hub, re-read when it changes (the fallback Lease lives there).
    #[arg(long, value_parser = parse_path)]
    pub hub_kubeconfig: Option<PathBuf>,
    /// Name of this managed cluster: the hub namespace of the fallback Lease.
    #[arg(long)]
    pub cluster_name: Option<String>,
    /// Name of the addon Lease.
    #[arg(long)]
    pub lease_name: Option<String>,
    /// Namespace of the Lease on the managed cluster (default: $POD_NAMESPACE).
    #[arg(long)]
    pub lease_namespace: Option<String>,
    /// Kubeconfig of the managed cluster (default: the in-cluster configuration when running in a pod, else none: only the hub Lease is renewed).
    #[arg(long, value_parser = parse_path)]
    pub managed_kubeconfig: Option<PathBuf>,
    /// holderIdentity of a Lease this agent creates (default: $POD_NAME, else $HOSTNAME).
    #[arg(long)]
    pub holder_identity: Option<String>,
    /// The proxy-agent's readiness URL; 200 means a tunnel to at least one proxy-server.
    #[arg(long)]
    pub proxy_agent_health_url: Option<String>,
    /// Renew the Lease only while the proxy-agent is ready.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_proxy_agent_health_check: Option<bool>,
    /// leaseDurationSeconds of the Lease and the renewal period, plus up to 25% jitter (Go duration, whole seconds).
    #[arg(long)]
    pub lease_duration: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub health: HealthFlags,
    /// Hub namespace of the proxy-server pods the port-forward proxy forwards to.
    #[arg(long)]
    pub proxy_server_namespace: Option<String>,
    /// Forward connections to --port-forward-proxy-address to a Running proxy-server pod's port 8091 through the hub API's pods/portforward (the PortForward entrypoint; needs --hub-kubeconfig).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_port_forward_proxy: Option<bool>,
    /// Address (IP:port) the port-forward proxy listens on, where the proxy-agent's --proxy-server-host/--proxy-server-port point.
    #[arg(long)]
    pub port_forward_proxy_address: Option<String>,
    /// Forward proxy to reach the hub API through: http://, https://, socks5:// or socks5h://, with optional user:password@ (wins over the hub kubeconfig's proxy-url and HTTPS_PROXY; NO_PROXY still applies).
    #[arg(long, value_name = "URL")]
    pub proxy_url: Option<String>,
    /// CA bundle (PEM) that verifies an https:// proxy; it never verifies the hub.
    #[arg(long, value_parser = parse_path)]
    pub proxy_ca_cert: Option<PathBuf>,
    /// Basic credentials for the proxy: a file holding user:password, or the directory of a mounted kubernetes.io/basic-auth Secret (wins over the URL's user:password; re-read at every connection).
    #[arg(long, value_parser = parse_path)]
    pub proxy_credentials_file: Option<PathBuf>,
    #[command(flatten)]
    #[serde(flatten)]
    pub logging: LogFlags,
}

/// Where the managed cluster's API is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagedApi {
    /// Not configured: only the hub Lease is renewed.
    None,
    /// The pod's service account.
    InCluster,
    Kubeconfig(PathBuf),
}

/// What the agent reads from the pod's environment (downward API and the
/// variables Kubernetes sets in every pod).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodEnvironment {
    pub pod_namespace: Option<String>,
    pub pod_name: Option<String>,
    pub hostname: Option<String>,
    /// `KUBERNETES_SERVICE_HOST` is set: running in a pod.
    pub in_cluster: bool,
}

impl PodEnvironment {
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Self {
        let mut env = PodEnvironment::default();
        for (name, value) in vars {
            let value = Some(value).filter(|v| !v.is_empty());
            match name.as_str() {
                "POD_NAMESPACE" => env.pod_namespace = value,
                "POD_NAME" => env.pod_name = value,
                "HOSTNAME" => env.hostname = value,
                "KUBERNETES_SERVICE_HOST" => env.in_cluster = value.is_some(),
                _ => {}
            }
        }
        env
    }
}

/// The settings, resolved against the pod's environment and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct AddonAgentConfig {
    pub hub_kubeconfig: Option<PathBuf>,
    pub cluster_name: String,
    pub lease_name: String,
    pub lease_namespace: String,
    pub managed: ManagedApi,
    pub holder_identity: String,
    /// `None`: renew without asking the proxy-agent.
    pub proxy_agent_health_url: Option<http::Uri>,
    pub lease_duration: Duration,
    /// Where /healthz, /readyz and /metrics are served.
    pub health_addr: SocketAddr,
    /// The port-forward proxy, when enabled.
    pub port_forward: Option<PortForwardConfig>,
    /// How the hub API is reached besides the `*_PROXY` variables.
    pub hub_egress: EgressSettings,
}

impl AddonAgentConfig {
    /// `leaseDurationSeconds` of a Lease this agent creates.
    pub fn lease_duration_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

impl CommandLine for Cli {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }
}

impl BinarySettings for AddonAgentSettings {
    type Flags = Cli;
    const SERVICE: &'static str = "addon-agent";

    /// Layers defaults, the TOML file, the process environment and the flags.
    fn load(cli: &Cli) -> Result<Self, ConfigError> {
        Self::load_with_env(cli, std::env::vars())
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }

    fn ignored_settings(&self) -> Vec<&'static str> {
        self.ignored_settings()
    }
}

impl AddonAgentSettings {
    /// [`AddonAgentSettings::load`] with an explicit environment (tests).
    pub fn load_with_env(
        cli: &Cli,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut settings: AddonAgentSettings =
            config::load_with_env(ENV, cli.config.as_deref(), cli, vars)?;
        // An empty `--hub-kubeconfig=` (as templates render an unset path)
        // means "not given".
        for path in [
            &mut settings.hub_kubeconfig,
            &mut settings.managed_kubeconfig,
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                *path = None;
            }
        }
        Ok(settings)
    }

    /// Resolves the defaults that come from the pod's environment and checks
    /// that the result can work.
    pub fn resolve(&self, env: &PodEnvironment) -> Result<AddonAgentConfig, ConfigError> {
        let managed = match &self.managed_kubeconfig {
            Some(path) => ManagedApi::Kubeconfig(path.clone()),
            None if env.in_cluster => ManagedApi::InCluster,
            None => ManagedApi::None,
        };
        let lease_namespace = if self.lease_namespace.is_empty() {
            env.pod_namespace.clone().unwrap_or_default()
        } else {
            self.lease_namespace.clone()
        };
        let holder_identity = [
            Some(self.holder_identity.clone()).filter(|h| !h.is_empty()),
            env.pod_name.clone(),
            env.hostname.clone(),
        ]
        .into_iter()
        .flatten()
        .next()
        .unwrap_or_else(|| "addon-agent".into());

        if self.hub_kubeconfig.is_none() && managed == ManagedApi::None {
            return Err(invalid(
                "hub-kubeconfig",
                "required when there is no managed cluster API (--managed-kubeconfig, or running in a pod)",
            ));
        }
        if self.hub_kubeconfig.is_some() {
            check_dns_label("cluster-name", &self.cluster_name)?;
        }
        if managed != ManagedApi::None {
            check_dns_label("lease-namespace", &lease_namespace).map_err(|e| match e {
                ConfigError::Invalid { field, reason } => ConfigError::Invalid {
                    field,
                    reason: format!("{reason} (set it or $POD_NAMESPACE)"),
                },
                other => other,
            })?;
        }
        check_dns_subdomain("lease-name", &self.lease_name)?;
        if self.lease_duration < Duration::from_secs(1) || self.lease_duration.subsec_nanos() != 0 {
            return Err(invalid(
                "lease-duration",
                format!(
                    "{:?} must be a whole number of seconds, at least 1s",
                    self.lease_duration
                ),
            ));
        }
        if i32::try_from(self.lease_duration.as_secs()).is_err() {
            return Err(invalid("lease-duration", "is too long"));
        }
        let health_ip = config::bind_ip("health-bind-address", &self.health_bind_address)?;
        let health_addr = SocketAddr::new(health_ip, self.health_port);
        let proxy_agent_health_url = if self.enable_proxy_agent_health_check {
            Some(parse_health_url(&self.proxy_agent_health_url)?)
        } else {
            None
        };
        let port_forward = if self.enable_port_forward_proxy {
            if self.hub_kubeconfig.is_none() {
                return Err(invalid(
                    "enable-port-forward-proxy",
                    "needs --hub-kubeconfig: the proxy-server pods are forwarded to through the hub API",
                ));
            }
            check_dns_label("proxy-server-namespace", &self.proxy_server_namespace)?;
            let listen: SocketAddr = self.port_forward_proxy_address.parse().map_err(|_| {
                invalid(
                    "port-forward-proxy-address",
                    format!("{:?} is not IP:port", self.port_forward_proxy_address),
                )
            })?;
            Some(PortForwardConfig::new(
                listen,
                self.proxy_server_namespace.clone(),
            ))
        } else {
            None
        };
        Ok(AddonAgentConfig {
            hub_kubeconfig: self.hub_kubeconfig.clone(),
            cluster_name: self.cluster_name.clone(),
            lease_name: self.lease_name.clone(),
            lease_namespace,
            managed,
            holder_identity,
            proxy_agent_health_url,
            lease_duration: self.lease_duration,
            health_addr,
            port_forward,
            hub_egress: EgressSettings {
                proxy_url: (!self.proxy_url.is_empty()).then(|| self.proxy_url.clone()),
                proxy_ca_file: self.proxy_ca_cert.clone(),
                proxy_credentials_file: self.proxy_credentials_file.clone(),
            },
        })
    }

    /// Flags given that have no effect with the others: the port-forward
    /// proxy's, while it is off.
    pub fn ignored_settings(&self) -> Vec<&'static str> {
        let mut ignored = Vec::new();
        let defaults = AddonAgentSettings::default();
        if !self.enable_port_forward_proxy {
            if self.proxy_server_namespace != defaults.proxy_server_namespace {
                ignored.push("proxy-server-namespace");
            }
            if self.port_forward_proxy_address != defaults.port_forward_proxy_address {
                ignored.push("port-forward-proxy-address");
            }
        }
        ignored
    }
}

fn parse_health_url(text: &str) -> Result<http::Uri, ConfigError> {
    let url: http::Uri = text
        .parse()
        .map_err(|e| invalid("proxy-agent-health-url", format!("{text:?}: {e}")))?;
    if url.scheme_str() != Some("http") || url.authority().is_none() {
        return Err(invalid(
            "proxy-agent-health-url",
            format!("{text:?} must be an http:// URL with a host"),
        ));
    }
    Ok(url)
}

/// RFC 1123 label, as Kubernetes requires of namespace names.
fn check_dns_label(field: &'static str, value: &str) -> Result<(), ConfigError> {
    let valid = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if valid {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!(
                "{value:?} is not a DNS label (lower-case letters, digits and '-', at most 63)"
            ),
        ))
    }
}

/// RFC 1123 subdomain, as Kubernetes requires of Lease names.
fn check_dns_subdomain(field: &'static str, value: &str) -> Result<(), ConfigError> {
    let valid = cluster_proxy_proto::identity::is_dns1123_subdomain(value);
    if valid {
        Ok(())
    } else {
        Err(invalid(field, format!("{value:?} is not a DNS subdomain")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str], vars: &[(&str, &str)]) -> Result<AddonAgentConfig, ConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("addon-agent").chain(args.iter().copied()))
            .map_err(|e| invalid("cli", e.to_string()))?;
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let settings = AddonAgentSettings::load_with_env(&cli, vars.clone())?;
        settings.resolve(&PodEnvironment::from_vars(vars))
    }

    #[test]
    fn every_flag_is_documented_and_shows_its_default() {
        let problems = cluster_proxy_runtime::cli::help_problems::<Cli>(
            &AddonAgentSettings::default(),
            &[
                "[default: cluster-proxy]",
                "[default: 1m0s]",
                "[default: 8888]",
                "[default: http://127.0.0.1:8093/readyz]",
                "[default: 127.0.0.1:8091]",
                "[default: open-cluster-management-addon]",
                "[default: true]",
            ],
        );
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn defaults_as_upstream_and_the_pod_environment() {
        let config = parse(
            &[
                "--hub-kubeconfig=/etc/kubeconfig/kubeconfig",
                "--cluster-name=c1",
            ],
            &[
                ("POD_NAMESPACE", "open-cluster-management-cluster-proxy"),
                ("POD_NAME", "agent-7d9"),
                ("HOSTNAME", "host"),
                ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ],
        )
        .unwrap();
        assert_eq!(config.lease_name, "cluster-proxy");
        assert_eq!(
            config.lease_namespace,
            "open-cluster-management-cluster-proxy"
        );
        assert_eq!(config.holder_identity, "agent-7d9");
        assert_eq!(config.managed, ManagedApi::InCluster);
        assert_eq!(config.lease_duration, Duration::from_secs(60));
        assert_eq!(config.lease_duration_seconds(), 60);
        assert_eq!(config.health_addr, "0.0.0.0:8888".parse().unwrap());
        assert_eq!(
            config.proxy_agent_health_url.map(|u| u.to_string()),
            Some(DEFAULT_HEALTH_URL.to_string())
        );

        let outside_a_pod = parse(
            &[
                "--hub-kubeconfig=/k",
                "--cluster-name=c1",
                "--enable-proxy-agent-health-check=false",
            ],
            &[("HOSTNAME", "laptop")],
        )
        .unwrap();
        assert_eq!(outside_a_pod.managed, ManagedApi::None);
        assert_eq!(outside_a_pod.holder_identity, "laptop");
        assert_eq!(outside_a_pod.proxy_agent_health_url, None);

        let from_env = parse(
            &["--hub-kubeconfig=/k"],
            &[
                ("ADDON_AGENT_CLUSTER_NAME", "c2"),
                ("ADDON_AGENT_LEASE_DURATION", "2s"),
            ],
        )
        .unwrap();
        assert_eq!(from_env.cluster_name, "c2");
        assert_eq!(from_env.lease_duration, Duration::from_secs(2));
    }

    #[test]
    fn bad_settings_name_the_flag() {
        let hub = "--hub-kubeconfig=/k";
        for (args, vars, flag) in [
            (vec![], vec![], "--hub-kubeconfig"),
            (vec![hub], vec![], "--cluster-name"),
            (
                vec![hub, "--cluster-name=Bad_Name"],
                vec![],
                "--cluster-name",
            ),
            (
                vec![hub, "--cluster-name=c", "--lease-duration=0s"],
                vec![],
                "--lease-duration",
            ),
            (
                vec![hub, "--cluster-name=c", "--lease-duration=1500ms"],
                vec![],
                "--lease-duration",
            ),
            (
                vec![hub, "--cluster-name=c", "--lease-duration=soon"],
                vec![],
                "--lease-duration",
            ),
            (
                vec![hub, "--cluster-name=c", "--lease-name=a..b"],
                vec![],
                "--lease-name",
            ),
            (
                vec![hub, "--cluster-name=c", "--health-bind-address=localhost"],
                vec![],
                "--health-bind-address",
            ),
            (
                vec![
                    hub,
                    "--cluster-name=c",
                    "--proxy-agent-health-url=https://x/readyz",
                ],
                vec![],
                "--proxy-agent-health-url",
            ),
            (
                vec![hub, "--cluster-name=c", "--proxy-agent-health-url=::"],
                vec![],
                "--proxy-agent-health-url",
            ),
            (
                vec![hub, "--cluster-name=c", "--managed-kubeconfig=/m"],
                vec![],
                "--lease-namespace",
            ),
            (
                vec![hub, "--cluster-name=c"],
                vec![("ADDON_AGENT_LEASE_NAMES", "x")],
                "lease_names",
            ),
        ] {
            let err = parse(&args, &vars)
                .expect_err(&format!("{args:?} {vars:?}"))
                .to_string();
            assert!(err.contains(flag), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_port_forward_proxy_as_upstream_passes_it() {
        let config = parse(
            &[
                "--hub-kubeconfig=/k",
                "--cluster-name=c",
                "--proxy-server-namespace=elsewhere",
                "--enable-port-forward-proxy=true",
                "--v=2",
            ],
            &[],
        )
        .unwrap();
        let port_forward = config.port_forward.expect("the proxy is on");
        assert_eq!(port_forward.listen, "127.0.0.1:8091".parse().unwrap());
        assert_eq!(port_forward.namespace, "elsewhere");
        assert_eq!(port_forward.pod_port, 8091);
        assert_eq!(
            port_forward.selector,
            "proxy.open-cluster-management.io/component-name=proxy-server"
        );
        let off = parse(&["--hub-kubeconfig=/k", "--cluster-name=c"], &[]).unwrap();
        assert_eq!(off.port_forward, None);

        for (args, flag) in [
            (
                vec![
                    "--managed-kubeconfig=/m",
                    "--lease-namespace=ns",
                    "--enable-port-forward-proxy",
                ],
                "--enable-port-forward-proxy",
            ),
            (
                vec![
                    "--hub-kubeconfig=/k",
                    "--cluster-name=c",
                    "--enable-port-forward-proxy",
                    "--port-forward-proxy-address=localhost:8091",
                ],
                "--port-forward-proxy-address",
            ),
            (
                vec![
                    "--hub-kubeconfig=/k",
                    "--cluster-name=c",
                    "--enable-port-forward-proxy",
                    "--proxy-server-namespace=Not_A_Namespace",
                ],
                "--proxy-server-namespace",
            ),
        ] {
            let err = parse(&args, &[])
                .expect_err(&format!("{args:?}"))
                .to_string();
            assert!(err.contains(flag), "{args:?}: {err}");
        }
    }

    #[test]
    fn port_forward_flags_without_the_proxy_are_reported() {
        let cli = Cli::try_parse_from([
            "addon-agent",
            "--hub-kubeconfig=/k",
            "--cluster-name=c",
            "--proxy-server-namespace=elsewhere",
            "--port-forward-proxy-address=127.0.0.1:9000",
        ])
        .unwrap();
        let settings = AddonAgentSettings::load_with_env(&cli, Vec::new()).unwrap();
        assert_eq!(
            settings.ignored_settings(),
            ["proxy-server-namespace", "port-forward-proxy-address"]
        );
        let on = Cli::try_parse_from([
            "addon-agent",
            "--hub-kubeconfig=/k",
            "--cluster-name=c",
            "--proxy-server-namespace=elsewhere",
            "--enable-port-forward-proxy",
        ])
        .unwrap();
        let settings = AddonAgentSettings::load_with_env(&on, Vec::new()).unwrap();
        assert!(settings.ignored_settings().is_empty());
    }
}

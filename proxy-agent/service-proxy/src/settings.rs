//! Flags, environment and TOML file (`SERVICE_PROXY_<KEY>`), resolved into a
//! [`ServiceProxyConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access::{SERVICE_PROXY_PORT, USER_SERVER_IDENTITY};
use cluster_proxy_runtime::cli::{HealthFlags, parse_go_bool, parse_path};
use cluster_proxy_runtime::config::{self, ConfigError, EnvSpec, bind_ip, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use serde::{Deserialize, Serialize};

pub const ENV: EnvSpec = EnvSpec {
    prefix: "SERVICE_PROXY_",
    aliases: &[],
};

/// Where a pod's ServiceAccount credentials are mounted.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Every setting, with its default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServiceProxySettings {
    pub cluster_name: String,
    pub bind_address: String,
    pub port: u16,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub user_server_ca: PathBuf,
    pub user_server_name: String,
    pub kube_api: String,
    pub kube_ca: PathBuf,
    pub token_file: PathBuf,
    pub enable_impersonation: bool,
    pub additional_service_ca: PathBuf,
    pub host_alias: Vec<String>,
    pub health_bind_address: String,
    pub health_port: u16,
    pub v: u8,
    pub log_format: LogFormat,
}

impl Default for ServiceProxySettings {
    fn default() -> Self {
        ServiceProxySettings {
            cluster_name: String::new(),
            // The proxy-agent beside it reaches it on the pod's loopback
            // (upstream: hostAliases name the hashed host 127.0.0.1).
            bind_address: "127.0.0.1".into(),
            port: SERVICE_PROXY_PORT,
            cert: PathBuf::new(),
            key: PathBuf::new(),
            user_server_ca: PathBuf::new(),
            user_server_name: USER_SERVER_IDENTITY.into(),
            kube_api: String::new(),
            kube_ca: PathBuf::from(SERVICE_ACCOUNT_DIR).join("ca.crt"),
            token_file: PathBuf::from(SERVICE_ACCOUNT_DIR).join("token"),
            enable_impersonation: true,
            additional_service_ca: PathBuf::new(),
            host_alias: Vec::new(),
            health_bind_address: String::new(),
            health_port: 8000,
            v: 0,
            log_format: LogFormat::Auto,
        }
    }
}

#[derive(Debug, Parser, Serialize)]
#[command(
    name = "service-proxy",
    version,
    about = "cluster-proxy service-proxy: serves the hub user-server's requests on this cluster's kube-apiserver, as the hub user",
    args_override_self = true
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Name of this managed cluster: requests routed for any other are refused.
    #[arg(long)]
    pub cluster_name: Option<String>,
    /// Address the HTTPS port listens on (the proxy-agent dials it on the pod's loopback).
    #[arg(long)]
    pub bind_address: Option<String>,
    /// HTTPS port the user-server's requests arrive on through the tunnel.
    #[arg(long)]
    pub port: Option<u16>,
    /// Serving certificate (PEM), re-read when it changes.
    #[arg(long, value_parser = parse_path)]
    pub cert: Option<PathBuf>,
    /// Key of the serving certificate.
    #[arg(long, value_parser = parse_path)]
    pub key: Option<PathBuf>,
    /// CA bundle (PEM) that signs the user-server's client certificate: the only client trusted to name a hub user.
    #[arg(long, value_parser = parse_path)]
    pub user_server_ca: Option<PathBuf>,
    /// Common name the user-server's client certificate must carry.
    #[arg(long)]
    pub user_server_name: Option<String>,
    /// URL of this cluster's kube-apiserver (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, else https://kubernetes.default.svc).
    #[arg(long)]
    pub kube_api: Option<String>,
    /// CA bundle of the kube-apiserver.
    #[arg(long, value_parser = parse_path)]
    pub kube_ca: Option<PathBuf>,
    /// This pod's ServiceAccount token, re-read when it changes (projected tokens rotate).
    #[arg(long, value_parser = parse_path)]
    pub token_file: Option<PathBuf>,
    /// Serve hub users by impersonating them (cluster:hub:<user>); off: every request is refused.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_impersonation: Option<bool>,
    /// More CAs (PEM) to trust for https Services, beside the kube-apiserver CA (upstream's, from proxyAgent.additionalServiceCAConfigMap).
    #[arg(long, value_parser = parse_path)]
    pub additional_service_ca: Option<PathBuf>,
    /// Resolve NAME to IP before DNS when sending to a Service (repeatable), like a pod's hostAliases.
    #[arg(long = "host-alias", value_name = "NAME=IP")]
    pub host_alias: Option<Vec<String>>,
    #[command(flatten)]
    #[serde(flatten)]
    pub health: HealthFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub logging: LogFlags,
}

/// The settings, checked.
#[derive(Debug, Clone)]
pub struct ServiceProxyConfig {
    pub cluster: ClusterName,
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub user_server_ca: PathBuf,
    pub user_server_name: String,
    pub kube_api: http::Uri,
    pub kube_ca: PathBuf,
    pub token_file: PathBuf,
    pub impersonation: bool,
    /// CAs trusted for https Services besides `kube_ca`.
    pub additional_service_ca: Option<PathBuf>,
    /// Names resolved before DNS (Services in tests, pods' hostAliases).
    pub host_aliases: std::collections::HashMap<String, std::net::IpAddr>,
    pub health: SocketAddr,
    /// How often credential files are checked for changes.
    pub reload_interval: Duration,
}

impl CommandLine for Cli {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }
}

impl BinarySettings for ServiceProxySettings {
    type Flags = Cli;
    const SERVICE: &'static str = "service-proxy";

    fn load(cli: &Cli) -> Result<Self, ConfigError> {
        config::load(ENV, cli.config.as_deref(), cli)
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }
}

impl ServiceProxySettings {
    /// Checks the settings; `kubernetes_service` is the pod's
    /// `KUBERNETES_SERVICE_HOST` and `_PORT`, when set.
    pub fn resolve(
        &self,
        kubernetes_service: Option<(String, String)>,
    ) -> Result<ServiceProxyConfig, ConfigError> {
        let cluster = ClusterName::new(self.cluster_name.clone())
            .map_err(|e| invalid("cluster-name", e.to_string()))?;
        for (field, path) in [
            ("cert", &self.cert),
            ("key", &self.key),
            ("user-server-ca", &self.user_server_ca),
        ] {
            if path.as_os_str().is_empty() {
                return Err(invalid(field, "is required"));
            }
        }
        if self.user_server_name.is_empty() {
            return Err(invalid("user-server-name", "may not be empty"));
        }
        let kube_api = match (self.kube_api.as_str(), kubernetes_service) {
            ("", Some((host, port))) if !host.is_empty() => {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                format!("https://{host}:{port}")
            }
            ("", _) => "https://kubernetes.default.svc".to_owned(),
            (url, _) => url.to_owned(),
        };
        let kube_api: http::Uri = kube_api
            .parse()
            .map_err(|e| invalid("kube-api", format!("{kube_api:?}: {e}")))?;
        if kube_api.scheme_str() != Some("https") || kube_api.host().is_none() {
            return Err(invalid(
                "kube-api",
                format!("{kube_api} is not an https:// URL"),
            ));
        }
        Ok(ServiceProxyConfig {
            cluster,
            listen: SocketAddr::new(bind_ip("bind-address", &self.bind_address)?, self.port),
            cert: self.cert.clone(),
            key: self.key.clone(),
            user_server_ca: self.user_server_ca.clone(),
            user_server_name: self.user_server_name.clone(),
            kube_api,
            kube_ca: self.kube_ca.clone(),
            token_file: self.token_file.clone(),
            impersonation: self.enable_impersonation,
            additional_service_ca: (!self.additional_service_ca.as_os_str().is_empty())
                .then(|| self.additional_service_ca.clone()),
            host_aliases: config::host_aliases(&self.host_alias)?,
            health: SocketAddr::new(
                bind_ip("health-bind-address", &self.health_bind_address)?,
                self.health_port,
            ),
            reload_interval: cluster_proxy_runtime::reload::DEFAULT_INTERVAL,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> ServiceProxySettings {
        ServiceProxySettings {
            cluster_name: "cluster-a".into(),
            cert: "/tls/tls.crt".into(),
            key: "/tls/tls.key".into(),
            user_server_ca: "/hub/ca.crt".into(),
            ..ServiceProxySettings::default()
        }
    }

    #[test]
    fn the_kube_api_defaults_to_the_pods_kubernetes_service() {
        let config = settings()
            .resolve(Some(("10.96.0.1".into(), "443".into())))
            .unwrap();
        assert_eq!(config.kube_api, "https://10.96.0.1:443/");
        assert_eq!(config.listen, "127.0.0.1:7443".parse().unwrap());
        let config = settings()
            .resolve(Some(("fd00::1".into(), "6443".into())))
            .unwrap();
        assert_eq!(config.kube_api.host(), Some("[fd00::1]"));
        let config = settings().resolve(None).unwrap();
        assert_eq!(config.kube_api.host(), Some("kubernetes.default.svc"));
    }

    #[test]
    fn bad_settings_name_their_flag() {
        let cases: Vec<(ServiceProxySettings, &str)> = vec![
            (
                ServiceProxySettings {
                    cluster_name: "Not_A_Name".into(),
                    ..settings()
                },
                "cluster-name",
            ),
            (
                ServiceProxySettings {
                    cert: PathBuf::new(),
                    ..settings()
                },
                "cert",
            ),
            (
                ServiceProxySettings {
                    kube_api: "http://plain:80".into(),
                    ..settings()
                },
                "kube-api",
            ),
            (
                ServiceProxySettings {
                    bind_address: "localhost".into(),
                    ..settings()
                },
                "bind-address",
            ),
            (
                ServiceProxySettings {
                    host_alias: vec!["hello.apps.svc".into()],
                    ..settings()
                },
                "host-alias",
            ),
        ];
        for (settings, flag) in cases {
            let error = settings.resolve(None).unwrap_err().to_string();
            assert!(error.contains(flag), "{flag}: {error}");
        }
    }

    #[test]
    fn every_flag_is_described_and_shows_its_default() {
        let problems = cluster_proxy_runtime::cli::help_problems::<Cli>(
            &ServiceProxySettings::default(),
            &["[default: 7443]"],
        );
        assert!(problems.is_empty(), "{problems:?}");
    }
}

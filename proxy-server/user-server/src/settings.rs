//! Flags (upstream's names where it has them), environment
//! (`USER_SERVER_<KEY>`) and TOML file, resolved into a [`UserServerConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use cluster_proxy_proto::duration::serde_go;
use cluster_proxy_proto::service_access::SERVICE_PROXY_PORT;
use cluster_proxy_runtime::cli::{HealthFlags, parse_go_bool, parse_path};
use cluster_proxy_runtime::config::{self, ConfigError, EnvSpec, bind_ip, invalid};
use cluster_proxy_runtime::logging::{LogFlags, LogFormat};
use cluster_proxy_runtime::shell::{BinarySettings, CommandLine};
use serde::{Deserialize, Serialize};

pub const ENV: EnvSpec = EnvSpec {
    prefix: "USER_SERVER_",
    aliases: &[],
};

/// Every setting, with its default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct UserServerSettings {
    pub host: String,
    pub port: u16,
    pub proxy_ca_cert: PathBuf,
    pub proxy_cert: PathBuf,
    pub proxy_key: PathBuf,
    pub bind_address: String,
    pub server_port: u16,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub service_proxy_ca_cert: PathBuf,
    pub service_proxy_port: u16,
    pub identity_cert: PathBuf,
    pub identity_key: PathBuf,
    pub hub_kubeconfig: Option<PathBuf>,
    #[serde(with = "serde_go")]
    pub token_review_cache_ttl: Duration,
    #[serde(with = "serde_go")]
    pub authorization_cache_ttl: Duration,
    pub cache_size: usize,
    pub max_idle_connections_per_cluster: usize,
    #[serde(with = "serde_go")]
    pub idle_connection_timeout: Duration,
    #[serde(with = "serde_go")]
    pub dial_timeout: Duration,
    #[serde(with = "serde_go")]
    pub response_header_timeout: Duration,
    pub exposed_services_configmap: String,
    pub exposed_services_namespace: String,
    pub managed_token_passthrough: bool,
    pub oidc_issuer_url: String,
    pub oidc_client_id: String,
    pub oidc_username_claim: String,
    pub oidc_username_prefix: String,
    pub oidc_groups_claim: String,
    pub oidc_groups_prefix: String,
    pub oidc_ca_file: Option<PathBuf>,
    pub oidc_signing_algs: Vec<String>,
    pub oidc_required_claim: Vec<String>,
    pub health_bind_address: String,
    pub health_port: u16,
    pub v: u8,
    pub log_format: LogFormat,
}

impl Default for UserServerSettings {
    fn default() -> Self {
        UserServerSettings {
            host: String::new(),
            port: 8090,
            proxy_ca_cert: PathBuf::new(),
            proxy_cert: PathBuf::new(),
            proxy_key: PathBuf::new(),
            bind_address: String::new(),
            server_port: 9092,
            server_cert: PathBuf::new(),
            server_key: PathBuf::new(),
            client_ca: None,
            service_proxy_ca_cert: PathBuf::new(),
            service_proxy_port: SERVICE_PROXY_PORT,
            identity_cert: PathBuf::new(),
            identity_key: PathBuf::new(),
            hub_kubeconfig: None,
            token_review_cache_ttl: Duration::from_secs(120),
            authorization_cache_ttl: Duration::from_secs(10),
            cache_size: 10_000,
            max_idle_connections_per_cluster: 32,
            idle_connection_timeout: Duration::from_secs(90),
            dial_timeout: Duration::from_secs(10),
            response_header_timeout: Duration::from_secs(60),
            exposed_services_configmap: crate::exposed::DEFAULT_CONFIGMAP.into(),
            exposed_services_namespace: String::new(),
            managed_token_passthrough: false,
            oidc_issuer_url: String::new(),
            oidc_client_id: String::new(),
            oidc_username_claim: "sub".into(),
            oidc_username_prefix: String::new(),
            oidc_groups_claim: String::new(),
            oidc_groups_prefix: String::new(),
            oidc_ca_file: None,
            oidc_signing_algs: vec!["RS256".into()],
            oidc_required_claim: Vec::new(),
            health_bind_address: String::new(),
            health_port: 8000,
            v: 0,
            log_format: LogFormat::Auto,
        }
    }
}

#[derive(Debug, Parser, Serialize)]
#[command(
    name = "user-server",
    version,
    about = "cluster-proxy user-server: kubectl to every managed cluster through the hub, as the hub user",
    args_override_self = true
)]
pub struct Cli {
    /// TOML configuration file (keys as the flags, with underscores).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Host of the proxy-server's client port (its Service).
    #[arg(long)]
    pub host: Option<String>,
    /// The proxy-server's client port.
    #[arg(long)]
    pub port: Option<u16>,
    /// CA bundle of the proxy-server's serving certificate.
    #[arg(long, value_parser = parse_path)]
    pub proxy_ca_cert: Option<PathBuf>,
    /// Proxy-client certificate presented to the proxy-server, re-read when it changes.
    #[arg(long, value_parser = parse_path)]
    pub proxy_cert: Option<PathBuf>,
    /// Key of the proxy-client certificate.
    #[arg(long, value_parser = parse_path)]
    pub proxy_key: Option<PathBuf>,
    /// Address the HTTPS port listens on (empty: every address).
    #[arg(long)]
    pub bind_address: Option<String>,
    /// HTTPS port users connect to.
    #[arg(long)]
    pub server_port: Option<u16>,
    /// Serving certificate for users, re-read when it changes.
    #[arg(long, value_parser = parse_path)]
    pub server_cert: Option<PathBuf>,
    /// Key of the serving certificate.
    #[arg(long, value_parser = parse_path)]
    pub server_key: Option<PathBuf>,
    /// CA bundle of hub client certificates to accept as users (CN the user, O the groups); none: tokens only.
    #[arg(long, value_parser = parse_path)]
    pub client_ca: Option<PathBuf>,
    /// CA bundle of the service-proxies' serving certificates.
    #[arg(long, value_parser = parse_path)]
    pub service_proxy_ca_cert: Option<PathBuf>,
    /// Port of the service-proxy beside each cluster's proxy-agent.
    #[arg(long)]
    pub service_proxy_port: Option<u16>,
    /// Client certificate presented to the service-proxies: the identity they require before believing the user this server names.
    #[arg(long, value_parser = parse_path)]
    pub identity_cert: Option<PathBuf>,
    /// Key of the identity certificate.
    #[arg(long, value_parser = parse_path)]
    pub identity_key: Option<PathBuf>,
    /// Kubeconfig of the hub (default: $KUBECONFIG, ~/.kube/config, or the pod's ServiceAccount).
    #[arg(long, value_parser = parse_path)]
    pub hub_kubeconfig: Option<PathBuf>,
    /// How long a token the hub's TokenReview accepted stays accepted without asking again (Go duration).
    #[arg(long)]
    pub token_review_cache_ttl: Option<String>,
    /// How long a SubjectAccessReview decision is reused (Go duration): a revoked grant takes effect within it.
    #[arg(long)]
    pub authorization_cache_ttl: Option<String>,
    /// Most tokens and decisions each cache holds.
    #[arg(long)]
    pub cache_size: Option<usize>,
    /// Idle connections kept open to each cluster's service-proxy.
    #[arg(long)]
    pub max_idle_connections_per_cluster: Option<usize>,
    /// How long an idle connection to a service-proxy is kept (Go duration).
    #[arg(long)]
    pub idle_connection_timeout: Option<String>,
    /// Limit on connecting to the proxy-server and dialing a cluster through it (Go duration).
    #[arg(long)]
    pub dial_timeout: Option<String>,
    /// Limit on waiting for a cluster's response headers (Go duration); a watch's body may then stream for as long as it lasts.
    #[arg(long)]
    pub response_header_timeout: Option<String>,
    /// ConfigMap of the exposed-services allowlist: the Services users may reach through /<cluster>/api/v1/namespaces/<ns>/services/<svc>/proxy-service/ (default deny; empty: no Service is reachable).
    #[arg(long)]
    pub exposed_services_configmap: Option<String>,
    /// Namespace of that ConfigMap (empty: the hub client's namespace, in a pod its own).
    #[arg(long)]
    pub exposed_services_namespace: Option<String>,
    /// Send a bearer token the hub's TokenReview does not accept on to the cluster's kube-apiserver, which authenticates it itself (upstream's managed-token passthrough; the hub's RBAC is not asked for such requests).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = parse_go_bool)]
    pub managed_token_passthrough: Option<bool>,
    /// Accept ID tokens of this OIDC issuer (https URL, as its tokens' iss) as hub credentials, verified here against its published keys; empty: off.
    #[arg(long)]
    pub oidc_issuer_url: Option<String>,
    /// The audience (client ID) ID tokens must carry.
    #[arg(long)]
    pub oidc_client_id: Option<String>,
    /// The claim that names the user.
    #[arg(long)]
    pub oidc_username_claim: Option<String>,
    /// Prefix of user names (empty: the issuer URL and '#', except for the email claim; '-': none).
    #[arg(long)]
    pub oidc_username_prefix: Option<String>,
    /// The claim that holds the user's groups (a string or a list); empty: no groups.
    #[arg(long)]
    pub oidc_groups_claim: Option<String>,
    /// Prefix of group names.
    #[arg(long)]
    pub oidc_groups_prefix: Option<String>,
    /// CA bundle of the issuer's serving certificate (default: the system's, which a FROM-scratch image does not have).
    #[arg(long, value_parser = parse_path)]
    pub oidc_ca_file: Option<PathBuf>,
    /// Signature algorithms accepted (comma-separated: RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA).
    #[arg(long, value_delimiter = ',')]
    pub oidc_signing_algs: Option<Vec<String>>,
    /// A claim ID tokens must carry with this value (repeatable).
    #[arg(long, value_name = "CLAIM=VALUE")]
    pub oidc_required_claim: Option<Vec<String>>,
    #[command(flatten)]
    #[serde(flatten)]
    pub health: HealthFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub logging: LogFlags,
}

/// Where the exposed-services allowlist is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExposedServicesSource {
    /// None: the hub client's default namespace.
    pub namespace: Option<String>,
    pub name: String,
}

/// The settings, checked.
#[derive(Debug, Clone)]
pub struct UserServerConfig {
    pub proxy_server: (String, u16),
    pub proxy_ca_cert: PathBuf,
    pub proxy_cert: PathBuf,
    pub proxy_key: PathBuf,
    pub listen: SocketAddr,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub service_proxy_ca_cert: PathBuf,
    pub service_proxy_port: u16,
    pub identity_cert: PathBuf,
    pub identity_key: PathBuf,
    pub hub_kubeconfig: Option<PathBuf>,
    pub token_review_cache_ttl: Duration,
    pub authorization_cache_ttl: Duration,
    pub cache_size: usize,
    pub max_idle_connections_per_cluster: usize,
    pub idle_connection_timeout: Duration,
    pub dial_timeout: Duration,
    pub response_header_timeout: Duration,
    /// The exposed-services ConfigMap; none: every Service is refused.
    pub exposed_services: Option<ExposedServicesSource>,
    /// Whether tokens the hub does not know go on to the cluster.
    pub managed_token_passthrough: bool,
    /// ID tokens of an OIDC issuer, when configured.
    pub oidc: Option<crate::oidc::OidcConfig>,
    pub health: SocketAddr,
    pub reload_interval: Duration,
}

impl CommandLine for Cli {
    fn logging(&self) -> &LogFlags {
        &self.logging
    }
}

impl BinarySettings for UserServerSettings {
    type Flags = Cli;
    const SERVICE: &'static str = "user-server";

    fn load(cli: &Cli) -> Result<Self, ConfigError> {
        let mut settings: UserServerSettings = config::load(ENV, cli.config.as_deref(), cli)?;
        // An empty path (a template rendering an unset value) is "not given".
        for path in [
            &mut settings.client_ca,
            &mut settings.hub_kubeconfig,
            &mut settings.oidc_ca_file,
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                *path = None;
            }
        }
        Ok(settings)
    }

    fn log_settings(&self) -> (u8, LogFormat) {
        (self.v, self.log_format)
    }
}

impl UserServerSettings {
    /// The OIDC settings, checked; none without an issuer.
    fn oidc(&self) -> Result<Option<crate::oidc::OidcConfig>, ConfigError> {
        use jsonwebtoken::Algorithm;
        if self.oidc_issuer_url.is_empty() {
            if !self.oidc_client_id.is_empty() {
                return Err(invalid("oidc-client-id", "needs --oidc-issuer-url"));
            }
            return Ok(None);
        }
        let issuer = self.oidc_issuer_url.clone();
        let parsed: http::Uri = issuer
            .parse()
            .map_err(|e| invalid("oidc-issuer-url", format!("{issuer:?}: {e}")))?;
        if parsed.scheme_str() != Some("https")
            || parsed.host().is_none()
            || parsed.query().is_some()
        {
            return Err(invalid(
                "oidc-issuer-url",
                format!("{issuer:?} is not an https:// URL without a query"),
            ));
        }
        if self.oidc_client_id.is_empty() {
            return Err(invalid(
                "oidc-client-id",
                "is required with --oidc-issuer-url",
            ));
        }
        if self.oidc_username_claim.is_empty() {
            return Err(invalid("oidc-username-claim", "may not be empty"));
        }
        let mut signing_algs = Vec::new();
        for name in &self.oidc_signing_algs {
            let algorithm: Algorithm = name.parse().map_err(|_| {
                invalid(
                    "oidc-signing-algs",
                    format!("{name:?} is not a JWS algorithm"),
                )
            })?;
            if matches!(
                algorithm,
                Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512
            ) {
                return Err(invalid(
                    "oidc-signing-algs",
                    format!(
                        "{name} is a shared-secret algorithm: an issuer's public keys cannot verify it"
                    ),
                ));
            }
            signing_algs.push(algorithm);
        }
        if signing_algs.is_empty() {
            return Err(invalid("oidc-signing-algs", "names no algorithm"));
        }
        let mut required_claims = Vec::new();
        for pair in &self.oidc_required_claim {
            let Some((claim, value)) = pair.split_once('=').filter(|(c, _)| !c.is_empty()) else {
                return Err(invalid(
                    "oidc-required-claim",
                    format!("{pair:?} is not CLAIM=VALUE"),
                ));
            };
            required_claims.push((claim.to_owned(), value.to_owned()));
        }
        let username_prefix = match self.oidc_username_prefix.as_str() {
            "" => {
                crate::oidc::OidcConfig::default_username_prefix(&issuer, &self.oidc_username_claim)
            }
            "-" => String::new(),
            prefix => prefix.to_owned(),
        };
        Ok(Some(crate::oidc::OidcConfig {
            issuer,
            client_id: self.oidc_client_id.clone(),
            username_claim: self.oidc_username_claim.clone(),
            username_prefix,
            groups_claim: (!self.oidc_groups_claim.is_empty())
                .then(|| self.oidc_groups_claim.clone()),
            groups_prefix: self.oidc_groups_prefix.clone(),
            ca_file: self.oidc_ca_file.clone(),
            signing_algs,
            required_claims,
            keys_refresh_interval: crate::oidc::REFRESH_AT_MOST_EVERY,
        }))
    }

    pub fn resolve(&self) -> Result<UserServerConfig, ConfigError> {
        if self.host.is_empty() {
            return Err(invalid(
                "host",
                "is required: the proxy-server's client Service",
            ));
        }
        for (field, path) in [
            ("proxy-ca-cert", &self.proxy_ca_cert),
            ("proxy-cert", &self.proxy_cert),
            ("proxy-key", &self.proxy_key),
            ("server-cert", &self.server_cert),
            ("server-key", &self.server_key),
            ("service-proxy-ca-cert", &self.service_proxy_ca_cert),
            ("identity-cert", &self.identity_cert),
            ("identity-key", &self.identity_key),
        ] {
            if path.as_os_str().is_empty() {
                return Err(invalid(field, "is required"));
            }
        }
        for (field, value) in [
            ("token-review-cache-ttl", self.token_review_cache_ttl),
            ("authorization-cache-ttl", self.authorization_cache_ttl),
        ] {
            if value > Duration::from_secs(3600) {
                return Err(invalid(
                    field,
                    "may be at most 1h: a revoked credential would stay valid that long",
                ));
            }
        }
        for (field, value) in [
            ("dial-timeout", self.dial_timeout),
            ("response-header-timeout", self.response_header_timeout),
        ] {
            if value.is_zero() {
                return Err(invalid(field, "must be positive"));
            }
        }
        if self.cache_size == 0 {
            return Err(invalid("cache-size", "must be at least 1"));
        }
        for (field, name) in [
            (
                "exposed-services-configmap",
                &self.exposed_services_configmap,
            ),
            (
                "exposed-services-namespace",
                &self.exposed_services_namespace,
            ),
        ] {
            if !name.is_empty() && !cluster_proxy_proto::identity::is_dns1123_subdomain(name) {
                return Err(invalid(
                    field,
                    format!("{name:?} is not a Kubernetes object name"),
                ));
            }
        }
        let exposed_services =
            (!self.exposed_services_configmap.is_empty()).then(|| ExposedServicesSource {
                namespace: (!self.exposed_services_namespace.is_empty())
                    .then(|| self.exposed_services_namespace.clone()),
                name: self.exposed_services_configmap.clone(),
            });
        Ok(UserServerConfig {
            proxy_server: (self.host.clone(), self.port),
            proxy_ca_cert: self.proxy_ca_cert.clone(),
            proxy_cert: self.proxy_cert.clone(),
            proxy_key: self.proxy_key.clone(),
            listen: SocketAddr::new(
                bind_ip("bind-address", &self.bind_address)?,
                self.server_port,
            ),
            server_cert: self.server_cert.clone(),
            server_key: self.server_key.clone(),
            client_ca: self.client_ca.clone(),
            service_proxy_ca_cert: self.service_proxy_ca_cert.clone(),
            service_proxy_port: self.service_proxy_port,
            identity_cert: self.identity_cert.clone(),
            identity_key: self.identity_key.clone(),
            hub_kubeconfig: self.hub_kubeconfig.clone(),
            token_review_cache_ttl: self.token_review_cache_ttl,
            authorization_cache_ttl: self.authorization_cache_ttl,
            cache_size: self.cache_size,
            max_idle_connections_per_cluster: self.max_idle_connections_per_cluster,
            idle_connection_timeout: self.idle_connection_timeout,
            dial_timeout: self.dial_timeout,
            response_header_timeout: self.response_header_timeout,
            exposed_services,
            managed_token_passthrough: self.managed_token_passthrough,
            oidc: self.oidc()?,
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

    fn settings() -> UserServerSettings {
        let path = |p: &str| PathBuf::from(p);
        UserServerSettings {
            host: "cluster-proxy-addon-entrypoint".into(),
            proxy_ca_cert: path("/p/ca.crt"),
            proxy_cert: path("/p/tls.crt"),
            proxy_key: path("/p/tls.key"),
            server_cert: path("/s/tls.crt"),
            server_key: path("/s/tls.key"),
            service_proxy_ca_cert: path("/sp/ca.crt"),
            identity_cert: path("/i/tls.crt"),
            identity_key: path("/i/tls.key"),
            ..UserServerSettings::default()
        }
    }

    #[test]
    fn complete_settings_resolve_and_bad_ones_name_their_flag() {
        let config = settings().resolve().unwrap();
        assert_eq!(config.listen, "0.0.0.0:9092".parse().unwrap());
        assert_eq!(
            config.proxy_server,
            ("cluster-proxy-addon-entrypoint".into(), 8090)
        );
        assert_eq!(
            config.exposed_services,
            Some(ExposedServicesSource {
                namespace: None,
                name: "cluster-proxy-exposed-services".into()
            })
        );
        let none = UserServerSettings {
            exposed_services_configmap: String::new(),
            ..settings()
        };
        assert_eq!(none.resolve().unwrap().exposed_services, None);
        assert_eq!(config.oidc, None);
        let oidc = |claim: &str, prefix: &str| {
            UserServerSettings {
                oidc_issuer_url: "https://idp.example.com".into(),
                oidc_client_id: "cluster-proxy".into(),
                oidc_username_claim: claim.into(),
                oidc_username_prefix: prefix.into(),
                oidc_signing_algs: vec!["RS256".into(), "ES256".into()],
                oidc_required_claim: vec!["hd=example.com".into()],
                ..settings()
            }
            .resolve()
            .unwrap()
            .oidc
            .unwrap()
        };
        // kube-apiserver's prefix rules.
        assert_eq!(oidc("sub", "").username_prefix, "https://idp.example.com#");
        assert_eq!(oidc("email", "").username_prefix, "");
        assert_eq!(oidc("sub", "-").username_prefix, "");
        assert_eq!(oidc("sub", "oidc:").username_prefix, "oidc:");
        let config = oidc("sub", "");
        assert_eq!(config.signing_algs.len(), 2);
        assert_eq!(
            config.required_claims,
            [("hd".to_owned(), "example.com".to_owned())]
        );
        let cases: Vec<(UserServerSettings, &str)> = vec![
            (
                UserServerSettings {
                    host: String::new(),
                    ..settings()
                },
                "host",
            ),
            (
                UserServerSettings {
                    identity_cert: PathBuf::new(),
                    ..settings()
                },
                "identity-cert",
            ),
            (
                UserServerSettings {
                    token_review_cache_ttl: Duration::from_secs(7200),
                    ..settings()
                },
                "token-review-cache-ttl",
            ),
            (
                UserServerSettings {
                    dial_timeout: Duration::ZERO,
                    ..settings()
                },
                "dial-timeout",
            ),
            (
                UserServerSettings {
                    cache_size: 0,
                    ..settings()
                },
                "cache-size",
            ),
            (
                UserServerSettings {
                    exposed_services_configmap: "Not A Name".into(),
                    ..settings()
                },
                "exposed-services-configmap",
            ),
            (
                UserServerSettings {
                    oidc_client_id: "cluster-proxy".into(),
                    ..settings()
                },
                "oidc-client-id",
            ),
            (
                UserServerSettings {
                    oidc_issuer_url: "http://idp.example.com".into(),
                    oidc_client_id: "cluster-proxy".into(),
                    ..settings()
                },
                "oidc-issuer-url",
            ),
            (
                UserServerSettings {
                    oidc_issuer_url: "https://idp.example.com".into(),
                    ..settings()
                },
                "oidc-client-id",
            ),
            (
                UserServerSettings {
                    oidc_issuer_url: "https://idp.example.com".into(),
                    oidc_client_id: "cluster-proxy".into(),
                    oidc_signing_algs: vec!["HS256".into()],
                    ..settings()
                },
                "shared-secret",
            ),
            (
                UserServerSettings {
                    oidc_issuer_url: "https://idp.example.com".into(),
                    oidc_client_id: "cluster-proxy".into(),
                    oidc_required_claim: vec!["hd".into()],
                    ..settings()
                },
                "oidc-required-claim",
            ),
            (
                UserServerSettings {
                    bind_address: "example.com".into(),
                    ..settings()
                },
                "bind-address",
            ),
        ];
        for (settings, flag) in cases {
            let error = settings.resolve().unwrap_err().to_string();
            assert!(error.contains(flag), "{flag}: {error}");
        }
    }

    #[test]
    fn every_flag_is_described_and_shows_its_default() {
        let problems = cluster_proxy_runtime::cli::help_problems::<Cli>(
            &UserServerSettings::default(),
            &["[default: 9092]"],
        );
        assert!(problems.is_empty(), "{problems:?}");
    }
}

//! How a cluster-proxy process opens an outbound connection: straight to
//! its target, or through the network's forward proxy.
//!
//! Managed clusters in enterprises often reach the hub only through an
//! HTTP(S) proxy. [`Egress`] follows the same rules as upstream's Go agent
//! and client-go (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`; see [`rules`]),
//! plus an explicit proxy URL that wins over the environment, and speaks
//! to the proxy by its URL's scheme:
//!
//! - `http://`: HTTP CONNECT (hyper's HTTP/1.1 client, so the answer is
//!   parsed by a real HTTP parser and the status reported as it came);
//! - `https://`: the same inside TLS to the proxy, verified against the
//!   proxy's CA bundle. That bundle only ever verifies the proxy: the
//!   target's certificate is checked by the caller's own TLS, so a proxy CA
//!   never widens trust in the hub;
//! - `socks5://` (names resolved here) and `socks5h://` (by the proxy), by
//!   hyper-util's SOCKS5 client.
//!
//! Basic credentials come from the URL's userinfo or a mounted file, read
//! at every connection so a rotated Secret is used without a restart.
//! Errors say which proxy failed and how, never with the credentials.
#![forbid(unsafe_code)]

mod connect;
pub mod connector;
pub mod rules;
mod stream;
pub mod tcp;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use connect::read_credentials;
pub use connector::EgressConnector;
pub use rules::{Credentials, NoProxy, ProxyRules, ProxyScheme, ProxyUrl, Route, RuleError};
pub use stream::EgressStream;

/// What a process is told about its proxy besides the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressSettings {
    /// Wins over `HTTPS_PROXY`, `HTTP_PROXY` and `ALL_PROXY`.
    pub proxy_url: Option<String>,
    /// PEM bundle that verifies an `https://` proxy (otherwise the system's
    /// roots, which a `FROM scratch` image does not have).
    pub proxy_ca_file: Option<PathBuf>,
    /// Basic credentials: a file `user:password`, or a directory with the
    /// files `username` and `password` (a mounted `kubernetes.io/basic-auth`
    /// Secret). Wins over the URL's userinfo.
    pub proxy_credentials_file: Option<PathBuf>,
}

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("connect to {target}: {source}")]
    Direct {
        target: String,
        #[source]
        source: std::io::Error,
    },
    #[error("resolve {target} (for the SOCKS5 proxy {proxy}): {source}")]
    Resolve {
        proxy: String,
        target: String,
        #[source]
        source: std::io::Error,
    },
    #[error("proxy {proxy} is unreachable: {source}")]
    ProxyUnreachable {
        proxy: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS with proxy {proxy}: {source} (is --proxy-ca-cert the proxy's CA?)")]
    ProxyTls {
        proxy: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "proxy {proxy} refused CONNECT to {target}: {status}{}{}",
        if *.sent_credentials { " (the credentials given were not accepted)" } else { " (no credentials were given: set them in the proxy URL or --proxy-credentials-file)" },
        .challenge.as_deref().map(|c| format!("; it asks for {c}")).unwrap_or_default()
    )]
    ProxyAuthentication {
        proxy: String,
        target: String,
        /// 407, or 401: what tinyproxy answers credentials it rejects
        /// (it says 407 only when none were sent).
        status: http::StatusCode,
        sent_credentials: bool,
        /// The scheme of `Proxy-Authenticate` (e.g. `Basic`, `Negotiate`).
        challenge: Option<String>,
    },
    #[error("proxy {proxy} refused CONNECT to {target}: {status}")]
    ProxyRefused {
        proxy: String,
        target: String,
        status: http::StatusCode,
    },
    #[error("proxy {proxy} did not answer CONNECT as an HTTP proxy: {detail}")]
    ProxyProtocol { proxy: String, detail: String },
    #[error("proxy {proxy} closed the connection before answering CONNECT to {target}")]
    ProxyClosed { proxy: String, target: String },
    #[error("SOCKS5 proxy {proxy} for {target}: {detail}")]
    Socks {
        proxy: String,
        target: String,
        detail: String,
    },
    #[error("proxy credentials {}: {reason}", .path.display())]
    Credentials { path: PathBuf, reason: String },
    #[error("CA bundle for the https proxy {proxy}: {reason}")]
    ProxyCa { proxy: String, reason: String },
    #[error(transparent)]
    Rule(#[from] RuleError),
}

impl EgressError {
    /// A short, fixed label for metrics (`reason="proxy_auth"`).
    pub fn reason(&self) -> &'static str {
        match self {
            EgressError::Direct { .. } => "dial",
            EgressError::Resolve { .. } => "resolve",
            EgressError::ProxyUnreachable { .. } => "proxy_unreachable",
            EgressError::ProxyTls { .. } => "proxy_tls",
            EgressError::ProxyAuthentication { .. } => "proxy_auth",
            EgressError::ProxyRefused { .. } => "proxy_refused",
            EgressError::ProxyProtocol { .. } => "proxy_protocol",
            EgressError::ProxyClosed { .. } => "proxy_closed",
            EgressError::Socks { .. } => "proxy_socks",
            EgressError::Credentials { .. } | EgressError::ProxyCa { .. } => "proxy_config",
            EgressError::Rule(_) => "proxy_config",
        }
    }

    /// Whether the proxy, rather than the target, is what failed.
    pub fn is_proxy(&self) -> bool {
        !matches!(self, EgressError::Direct { .. })
    }
}

/// The proxy rules of one process, and how to reach its proxies.
#[derive(Debug, Clone)]
pub struct Egress {
    rules: Arc<ProxyRules>,
    proxy_ca_file: Option<PathBuf>,
    proxy_credentials_file: Option<PathBuf>,
    user_agent: http::HeaderValue,
}

impl Default for Egress {
    fn default() -> Self {
        Egress::direct()
    }
}

impl Egress {
    /// Every connection goes straight to its target.
    pub fn direct() -> Egress {
        Egress {
            rules: Arc::new(ProxyRules::direct()),
            proxy_ca_file: None,
            proxy_credentials_file: None,
            user_agent: http::HeaderValue::from_static("cluster-proxy"),
        }
    }

    /// The rules from the environment and `settings`; `user_agent` goes into
    /// every CONNECT so the proxy's log names us.
    pub fn from_env(settings: &EgressSettings, user_agent: &str) -> Result<Egress, EgressError> {
        let rules = ProxyRules::from_env(settings.proxy_url.as_deref())?;
        Egress::with_rules(rules, settings, user_agent)
    }

    /// Like [`Self::from_env`] with the rules given. The credentials and CA
    /// files are read once here, so a missing mount fails at start-up rather
    /// than at the first connection.
    pub fn with_rules(
        rules: ProxyRules,
        settings: &EgressSettings,
        user_agent: &str,
    ) -> Result<Egress, EgressError> {
        let user_agent = http::HeaderValue::from_str(user_agent)
            .unwrap_or_else(|_| http::HeaderValue::from_static("cluster-proxy"));
        let egress = Egress {
            rules: Arc::new(rules),
            proxy_ca_file: settings.proxy_ca_file.clone(),
            proxy_credentials_file: settings.proxy_credentials_file.clone(),
            user_agent,
        };
        if let Some(path) = &egress.proxy_credentials_file {
            read_credentials(path)?;
        }
        for proxy in [&egress.rules.https, &egress.rules.http]
            .into_iter()
            .flatten()
        {
            if proxy.scheme == ProxyScheme::Https {
                connect::proxy_tls_config(proxy, egress.proxy_ca_file.as_deref())?;
            }
        }
        Ok(egress)
    }

    pub fn rules(&self) -> &ProxyRules {
        &self.rules
    }

    pub fn proxy_ca_file(&self) -> Option<&Path> {
        self.proxy_ca_file.as_deref()
    }

    /// The route to `host:port` (`tls`: the target speaks TLS).
    pub fn route(&self, host: &str, port: u16, tls: bool) -> Route<'_> {
        self.rules.route(host, port, tls)
    }

    /// One line for the start-up log: where connections go.
    pub fn describe(&self) -> String {
        match (&self.rules.https, &self.rules.http) {
            (None, None) => "direct (no proxy configured)".to_owned(),
            (https, http) => {
                let https = https
                    .as_ref()
                    .map_or("direct".to_owned(), |p| p.to_string());
                let http = http.as_ref().map_or("direct".to_owned(), |p| p.to_string());
                let skipped = self.rules.no_proxy.skipped();
                let skipped = if skipped.is_empty() {
                    String::new()
                } else {
                    format!("; NO_PROXY entries not understood: {}", skipped.join(","))
                };
                format!("TLS targets via {https}, plain-HTTP targets via {http}{skipped}")
            }
        }
    }

    /// Opens a connection to `host:port` (TCP_NODELAY and keepalive on the
    /// socket), through the proxy the rules name for it. `tls` says whether
    /// the target speaks TLS (`HTTPS_PROXY`) or plain HTTP (`HTTP_PROXY`).
    /// The caller bounds the time it may take.
    pub async fn connect(
        &self,
        host: &str,
        port: u16,
        tls: bool,
    ) -> Result<EgressStream, EgressError> {
        match self.rules.route(host, port, tls) {
            Route::Direct => connect::direct(host, port).await,
            Route::Proxy(proxy) => connect::through(self, proxy, host, port).await,
        }
    }
}

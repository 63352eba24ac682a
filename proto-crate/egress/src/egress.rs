//! The proxy rules of one process and the way out they choose.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::connect::{self, ProxyDial, read_credentials};
use crate::error::EgressError;
use crate::rules::{ProxyRules, ProxyScheme, Route};
use crate::stream::EgressStream;

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
            Route::Proxy(proxy) => {
                let dial = ProxyDial {
                    proxy_ca_file: self.proxy_ca_file.as_deref(),
                    credentials_file: self.proxy_credentials_file.as_deref(),
                    user_agent: &self.user_agent,
                };
                connect::through(&dial, proxy, host, port).await
            }
        }
    }
}

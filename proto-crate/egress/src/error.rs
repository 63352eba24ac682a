//! What goes wrong on the way out, with a fixed label per kind for metrics.

use std::path::PathBuf;

use crate::rules::RuleError;

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

//! Asks the proxy-agent whether it holds a tunnel: its `/readyz` answers 200
//! once it is connected to at least one proxy-server.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The proxy-agent's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// It answered with another status.
    NotReady(http::StatusCode),
    /// It did not answer (not started, crashed, too slow).
    Unreachable(String),
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        *self == Readiness::Ready
    }
}

impl std::fmt::Display for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Readiness::Ready => f.write_str("ready"),
            Readiness::NotReady(status) => write!(f, "not ready (HTTP {status})"),
            Readiness::Unreachable(error) => write!(f, "unreachable: {error}"),
        }
    }
}

/// Probes one readiness URL over plain HTTP.
#[derive(Clone)]
pub struct Probe {
    client: Client<HttpConnector, Empty<Bytes>>,
    url: http::Uri,
    timeout: Duration,
}

impl Probe {
    pub fn new(url: http::Uri, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        Probe {
            client: Client::builder(TokioExecutor::new()).build(connector),
            url,
            timeout,
        }
    }

    pub async fn check(&self) -> Readiness {
        match tokio::time::timeout(self.timeout, self.client.get(self.url.clone())).await {
            Ok(Ok(response)) if response.status() == http::StatusCode::OK => Readiness::Ready,
            Ok(Ok(response)) => Readiness::NotReady(response.status()),
            Ok(Err(error)) => Readiness::Unreachable(error.to_string()),
            Err(_) => Readiness::Unreachable(format!("no answer within {:?}", self.timeout)),
        }
    }
}

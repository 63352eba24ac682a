//! The user-server's side of the tunnel: one HTTP/2 connection to the
//! proxy-server carries every tunneled connection, and a pooled HTTP/1.1
//! client keeps connections to each cluster's service-proxy open between
//! requests (bounded per cluster, closed when idle): a request costs a tunnel
//! dial only when no idle connection to its cluster is left (upstream's
//! user-server dialed the tunnel for every request).
//!
//! HTTP/1.1 on purpose: SPDY and WebSocket upgrades (exec, attach,
//! port-forward) need it, and each pooled connection is one tunnel stream
//! with its own flow control.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use cluster_proxy_proto::client::{TunnelClient, TunnelStream};
use cluster_proxy_proto::connector::{ConnectError, TunnelConnector};
use cluster_proxy_proto::h2_channel::H2Channel;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_runtime::reload::Watched;
use hyper::body::Incoming;

use crate::audit::CountedBody;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioIo;

/// Why a tunneled connection could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DialerError {
    #[error("the proxy-server {address} cannot be reached: {reason}")]
    ProxyServer { address: String, reason: String },
    #[error(transparent)]
    Dial(#[from] ConnectError),
}

/// Dials through the proxy-server at `host:port`, connecting to it on first
/// use and again when its client credentials change on disk (the channel
/// itself reconnects after the server closed it).
#[derive(Clone)]
pub struct TunnelDialer {
    inner: Arc<DialerInner>,
}

struct DialerInner {
    host: String,
    port: u16,
    tls: Watched<rustls::ClientConfig>,
    timeout: Duration,
    current: tokio::sync::Mutex<Option<(Arc<rustls::ClientConfig>, TunnelConnector)>>,
}

impl TunnelDialer {
    pub fn new(
        host: &str,
        port: u16,
        tls: Watched<rustls::ClientConfig>,
        timeout: Duration,
    ) -> Self {
        TunnelDialer {
            inner: Arc::new(DialerInner {
                host: host.to_owned(),
                port,
                tls,
                timeout,
                current: tokio::sync::Mutex::new(None),
            }),
        }
    }

    async fn connector(&self) -> Result<TunnelConnector, DialerError> {
        let inner = &self.inner;
        let tls = inner.tls.borrow().clone();
        let mut current = inner.current.lock().await;
        if let Some((used, connector)) = &*current
            && Arc::ptr_eq(used, &tls)
        {
            return Ok(connector.clone());
        }
        let channel = H2Channel::connect(&inner.host, inner.port, tls.clone(), inner.timeout)
            .await
            .map_err(|e| DialerError::ProxyServer {
                address: format!("{}:{}", inner.host, inner.port),
                reason: e.to_string(),
            })?;
        let connector = TunnelConnector::new(
            TunnelClient::over_h2(channel).with_dial_timeout(inner.timeout),
            inner.timeout,
        );
        *current = Some((tls, connector.clone()));
        Ok(connector)
    }
}

impl tower::Service<http::Uri> for TunnelDialer {
    type Response = TokioIo<TunnelStream>;
    type Error = DialerError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, DialerError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let dialer = self.clone();
        Box::pin(async move {
            let connector = dialer.connector().await?;
            Ok(TokioIo::new(connector.connect(&uri).await?))
        })
    }
}

pub type ServiceProxyClient =
    Client<hyper_rustls::HttpsConnector<TunnelDialer>, CountedBody<Incoming>>;

/// The pooled HTTPS client to the service-proxies: TLS with the
/// user-server's identity certificate, verifying each service-proxy's
/// serving certificate for its cluster's host against `roots`.
pub fn service_proxy_client(
    dialer: TunnelDialer,
    tls: Arc<rustls::ClientConfig>,
    max_idle_per_cluster: usize,
    idle_timeout: Duration,
) -> ServiceProxyClient {
    cluster_proxy_runtime::http_proxy::pooled_client(
        &tls,
        dialer,
        cluster_proxy_runtime::http_proxy::Schemes::HttpsOnly,
        max_idle_per_cluster,
        idle_timeout,
    )
}

/// The base URL of `cluster`'s service-proxy: its hashed host, which the
/// agent resolves to the service-proxy beside it.
pub fn service_proxy_authority(cluster: &ClusterName, port: u16) -> String {
    format!("{}:{port}", cluster.service_proxy_host())
}

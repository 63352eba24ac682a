//! A hub client of the environment: reaches a managed cluster's services by
//! cluster name through a proxy-server, over the gRPC frontend or HTTP
//! CONNECT, and speaks HTTP (or HTTPS with the cluster's own CA) on top.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cert_authority::tls::{self, Identity, Pem};
use cluster_proxy_proto::client::TunnelClient;
use cluster_proxy_proto::transport::{ALPN_H2, ALPN_HTTP11, connect_channel};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};

/// How a hub client reaches the proxy-server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frontend {
    Grpc,
    HttpConnect,
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Frontend::Grpc => "gRPC",
            Frontend::HttpConnect => "HTTP CONNECT",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("TLS: {0}")]
    Tls(String),
    #[error("connecting to proxy-server {server}: {detail}")]
    Server { server: SocketAddr, detail: String },
    #[error("dialing {target} through {server}: {detail}")]
    Dial {
        server: SocketAddr,
        target: String,
        detail: String,
    },
    #[error("HTTP to {target}: {detail}")]
    Http { target: String, detail: String },
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

/// The hub client's credentials: the proxy-client certificate and the
/// hub trust bundle.
#[derive(Clone)]
pub struct HubClient {
    grpc_tls: Arc<rustls::ClientConfig>,
    connect_tls: Arc<rustls::ClientConfig>,
    timeout: Duration,
}

impl HubClient {
    /// From a `cert-authority init` directory.
    pub fn from_pki_dir(dir: &Path) -> Result<Self, ClientError> {
        let err = |e: tls::TlsError| ClientError::Tls(e.to_string());
        let roots = tls::roots(&Pem::file("CA bundle", &dir.join("ca-bundle.crt")).map_err(err)?)
            .map_err(err)?;
        let identity = || {
            Identity::from_files(
                &dir.join("proxy-client/tls.crt"),
                &dir.join("proxy-client/tls.key"),
            )
            .map_err(err)
        };
        Ok(HubClient {
            grpc_tls: tls::client_config(roots.clone(), Some(identity()?), &[ALPN_H2])
                .map_err(err)?,
            connect_tls: tls::client_config(roots, Some(identity()?), &[ALPN_HTTP11])
                .map_err(err)?,
            timeout: Duration::from_secs(10),
        })
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// A byte stream to `target` (`cluster:port`) through `server`.
    pub async fn dial(
        &self,
        frontend: Frontend,
        server: SocketAddr,
        target: &str,
    ) -> Result<Box<dyn Stream>, ClientError> {
        tokio::time::timeout(self.timeout, self.dial_inner(frontend, server, target))
            .await
            .map_err(|_| ClientError::Timeout(self.timeout))?
    }

    async fn dial_inner(
        &self,
        frontend: Frontend,
        server: SocketAddr,
        target: &str,
    ) -> Result<Box<dyn Stream>, ClientError> {
        match frontend {
            Frontend::Grpc => {
                let channel = connect_channel(
                    &server.ip().to_string(),
                    server.port(),
                    self.grpc_tls.clone(),
                    self.timeout,
                )
                .await
                .map_err(|e| ClientError::Server {
                    server,
                    detail: e.to_string(),
                })?;
                let stream = TunnelClient::new(channel).dial(target).await.map_err(|e| {
                    ClientError::Dial {
                        server,
                        target: target.to_string(),
                        detail: e.to_string(),
                    }
                })?;
                Ok(Box::new(stream))
            }
            Frontend::HttpConnect => {
                let stream = tunnel_harness::in_process::http_connect_to(
                    self.connect_tls.clone(),
                    server,
                    &server.ip().to_string(),
                    target,
                )
                .await
                .map_err(|e| ClientError::Dial {
                    server,
                    target: target.to_string(),
                    detail: e.to_string(),
                })?;
                Ok(Box::new(stream))
            }
        }
    }

    /// `GET http://<target><path>` through the tunnel; the response body.
    pub async fn http_get(
        &self,
        frontend: Frontend,
        server: SocketAddr,
        target: &str,
        path: &str,
    ) -> Result<String, ClientError> {
        let stream = self.dial(frontend, server, target).await?;
        tokio::time::timeout(self.timeout, get(stream, target, path))
            .await
            .map_err(|_| ClientError::Timeout(self.timeout))?
    }

    /// `GET https://<target><path>` through the tunnel, verifying the
    /// endpoint's certificate against `ca_pem` (the cluster's own CA).
    pub async fn https_get(
        &self,
        frontend: Frontend,
        server: SocketAddr,
        target: &str,
        path: &str,
        ca_pem: &str,
    ) -> Result<String, ClientError> {
        let stream = self.dial(frontend, server, target).await?;
        let err = |e: tls::TlsError| ClientError::Tls(e.to_string());
        let roots = tls::roots(&Pem::text("cluster CA", ca_pem)).map_err(err)?;
        let config = tls::client_config(roots, None, &[ALPN_HTTP11]).map_err(err)?;
        let host = target.rsplit_once(':').map_or(target, |(host, _)| host);
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| ClientError::Tls(format!("server name {host:?}: {e}")))?;
        let fetch = async {
            let tls_stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, stream)
                .await
                .map_err(|e| ClientError::Tls(format!("handshake with {target}: {e}")))?;
            get(Box::new(tls_stream), target, path).await
        };
        tokio::time::timeout(self.timeout, fetch)
            .await
            .map_err(|_| ClientError::Timeout(self.timeout))?
    }
}

/// What a tunneled connection is.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

async fn get(stream: Box<dyn Stream>, target: &str, path: &str) -> Result<String, ClientError> {
    let http_err = |detail: String| ClientError::Http {
        target: target.to_string(),
        detail,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http_err(e.to_string()))?;
    tokio::spawn(connection);
    let request = http::Request::get(path)
        .header(http::header::HOST, target)
        .body(Empty::<Bytes>::new())
        .map_err(|e| http_err(e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| http_err(e.to_string()))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| http_err(e.to_string()))?
        .to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    if !status.is_success() {
        return Err(http_err(format!("status {status}: {body}")));
    }
    Ok(body)
}

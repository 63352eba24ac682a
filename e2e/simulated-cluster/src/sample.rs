//! The sample services of one managed cluster, run as their own process
//! inside the cluster's network: an HTTP service that names its cluster, a
//! TCP echo service for long-lived traffic, and, where the environment
//! runs no API for the cluster, a TLS endpoint answering `/healthz` with
//! `ok` (standing in for the cluster's kube-apiserver).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use cert_authority::tls;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// Ports of the sample services (the same in every cluster).
pub const HTTP_PORT: u16 = 8080;
pub const APISERVER_PORT: u16 = 6443;
pub const ECHO_PORT: u16 = 7000;

#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS credentials: {0}")]
    Tls(String),
}

/// What the HTTP service answers, so a client can tell which cluster it
/// reached.
pub fn greeting(cluster: &str) -> String {
    format!("hello from {cluster}\n")
}

fn respond(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    response
}

/// A TLS acceptor for a PEM certificate and key offering `alpn`, with no
/// client authentication (a kube-apiserver accepts anonymous `/healthz`).
pub fn tls_acceptor(
    cert_pem: &str,
    key_pem: &str,
    alpn: &[&[u8]],
) -> Result<TlsAcceptor, SampleError> {
    let identity = tls::Identity::new(
        &tls::Pem::text("certificate", cert_pem),
        &tls::Pem::text("private key", key_pem),
    )
    .map_err(|e| SampleError::Tls(e.to_string()))?;
    let config =
        tls::server_config(identity, None, alpn).map_err(|e| SampleError::Tls(e.to_string()))?;
    Ok(TlsAcceptor::from(config))
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, SampleError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| SampleError::Bind { addr, source })
}

/// Serves the services on `ip` until the process ends: the stand-in
/// kube-apiserver only with `tls`.
pub async fn serve(
    cluster: String,
    ip: std::net::IpAddr,
    tls: Option<TlsAcceptor>,
) -> Result<(), SampleError> {
    let http = bind(SocketAddr::new(ip, HTTP_PORT)).await?;
    let apiserver = match tls {
        Some(tls) => Some((bind(SocketAddr::new(ip, APISERVER_PORT)).await?, tls)),
        None => None,
    };
    let echo = bind(SocketAddr::new(ip, ECHO_PORT)).await?;
    let stand_in = if apiserver.is_some() {
        format!(", https :{APISERVER_PORT} (/healthz)")
    } else {
        String::new()
    };
    tracing::info!(%cluster, %ip, "sample services listening: http :{HTTP_PORT}{stand_in}, echo :{ECHO_PORT}");

    let greeting = Arc::new(greeting(&cluster));
    let http_task = tokio::spawn(async move {
        while let Ok((socket, _)) = http.accept().await {
            let greeting = greeting.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let body = if request.uri().path() == "/healthz" {
                        "ok".to_string()
                    } else {
                        greeting.to_string()
                    };
                    async move { Ok::<_, Infallible>(respond(StatusCode::OK, body)) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });

    let apiserver_task = tokio::spawn(async move {
        let Some((apiserver, tls)) = apiserver else {
            return;
        };
        while let Ok((socket, _)) = apiserver.accept().await {
            let tls = tls.clone();
            tokio::spawn(async move {
                let Ok(stream) = tls.accept(socket).await else {
                    return;
                };
                let service = service_fn(|request: Request<Incoming>| async move {
                    Ok::<_, Infallible>(match request.uri().path() {
                        "/healthz" | "/livez" | "/readyz" => respond(StatusCode::OK, "ok".into()),
                        _ => respond(StatusCode::NOT_FOUND, "not found\n".into()),
                    })
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });

    let echo_task = tokio::spawn(async move {
        while let Ok((socket, _)) = echo.accept().await {
            tokio::spawn(echo_connection(socket));
        }
    });

    let _ = tokio::join!(http_task, apiserver_task, echo_task);
    Ok(())
}

async fn echo_connection(mut socket: TcpStream) {
    let _ = socket.set_nodelay(true);
    let (mut reader, mut writer) = socket.split();
    let _ = tokio::io::copy(&mut reader, &mut writer).await;
    let _ = writer.shutdown().await;
}

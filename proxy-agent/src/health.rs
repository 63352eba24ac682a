//! Plain-HTTP health, readiness and metrics endpoints (upstream paths and bodies).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

const TEXT: &str = "text/plain; charset=utf-8";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Upstream's agent readiness failure body.
pub const NOT_READY_BODY: &str = "[+]ping ok\n[-]server-connected failed: no servers connected\n";

/// Which endpoints a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `/healthz`, `/readyz`, `/ready`, `/metrics`.
    Health,
    /// `/metrics` only.
    Admin,
}

/// What the endpoints report on.
pub trait Status: Send + Sync + 'static {
    fn ready(&self) -> bool;
    fn metrics(&self) -> &Metrics;
}

fn answer(role: Role, path: &str, status: &dyn Status) -> (StatusCode, &'static str, String) {
    match (role, path) {
        (Role::Health, "/healthz") => (StatusCode::OK, TEXT, "ok".into()),
        (Role::Health, "/readyz" | "/ready") => {
            if status.ready() {
                (StatusCode::OK, TEXT, "ok".into())
            } else {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    NOT_READY_BODY.to_owned(),
                )
            }
        }
        (_, "/metrics") => (StatusCode::OK, OPENMETRICS, status.metrics().encode()),
        _ => (StatusCode::NOT_FOUND, TEXT, "404 page not found\n".into()),
    }
}

pub async fn serve(
    listener: TcpListener,
    role: Role,
    status: Arc<dyn Status>,
    shutdown: CancellationToken,
) {
    loop {
        let (tcp, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Usually fd exhaustion; back off instead of spinning.
                    tracing::warn!(error = %e, "health listener accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let status = status.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (code, content_type, body) = answer(role, req.uri().path(), status.as_ref());
                let mut response = Response::new(Full::new(Bytes::from(body)));
                *response.status_mut() = code;
                response
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
                async move { Ok::<_, Infallible>(response) }
            });
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(60))
                .serve_connection(TokioIo::new(tcp), service);
            tokio::select! {
                _ = conn => {}
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

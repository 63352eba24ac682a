//! The plain-HTTP health, readiness and metrics endpoints every service serves
//! (upstream paths: `/healthz`, `/readyz` and its alias `/ready`, `/livez`,
//! `/metrics`).
//!
//! The port is reachable by anything in the pod network, so a connection
//! gets [`HEADER_READ_TIMEOUT`] to send its request headers and is closed
//! when the service shuts down: a slow or idle client cannot pin a task.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::accept::AcceptGuard;
use crate::metrics::{OPENMETRICS, PROMETHEUS_TEXT, to_prometheus_text, wants_openmetrics};

pub const TEXT: &str = "text/plain; charset=utf-8";
/// Go's `http.NotFound` body, as upstream answers unknown paths.
pub const NOT_FOUND_BODY: &str = "404 page not found\n";
/// How long a connection may take to send its request headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a service is not ready: the status code and body upstream answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReady {
    pub status: StatusCode,
    pub body: String,
}

type Readiness = dyn Fn() -> Result<(), NotReady> + Send + Sync;
type Exposition = dyn Fn() -> String + Send + Sync;

/// What one listener answers.
#[derive(Clone, Default)]
pub struct Routes {
    probes: Option<Arc<Readiness>>,
    metrics: Option<Arc<Exposition>>,
    texts: Vec<(&'static str, Arc<Exposition>)>,
}

impl Routes {
    /// `/healthz` and `/livez` (always ok while the process serves) and
    /// `/readyz`, `/ready` (from `ready`).
    pub fn probes(ready: impl Fn() -> Result<(), NotReady> + Send + Sync + 'static) -> Self {
        Routes {
            probes: Some(Arc::new(ready)),
            ..Routes::default()
        }
    }

    /// Only `/metrics`.
    pub fn metrics_only(exposition: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Routes::default().with_metrics(exposition)
    }

    /// Adds `/metrics`, answered by `exposition` (OpenMetrics text).
    pub fn with_metrics(mut self, exposition: impl Fn() -> String + Send + Sync + 'static) -> Self {
        self.metrics = Some(Arc::new(exposition));
        self
    }

    /// Adds `path`, answered with the plain text `text` returns (a
    /// service's own facts for its peers, such as a count).
    pub fn with_text(
        mut self,
        path: &'static str,
        text: impl Fn() -> String + Send + Sync + 'static,
    ) -> Self {
        self.texts.push((path, Arc::new(text)));
        self
    }

    /// The answer to a GET of `path` without an `Accept` header: status,
    /// content type, body.
    pub fn answer(&self, path: &str) -> (StatusCode, &'static str, String) {
        self.answer_to(path, None)
    }

    /// The answer to a GET of `path` with `accept`: `/metrics` is the
    /// Prometheus text format unless `accept` asks for OpenMetrics.
    pub fn answer_to(
        &self,
        path: &str,
        accept: Option<&str>,
    ) -> (StatusCode, &'static str, String) {
        match (path, &self.probes, &self.metrics) {
            ("/healthz" | "/livez", Some(_), _) => (StatusCode::OK, TEXT, "ok".into()),
            ("/readyz" | "/ready", Some(ready), _) => match ready() {
                Ok(()) => (StatusCode::OK, TEXT, "ok".into()),
                Err(not_ready) => (not_ready.status, TEXT, not_ready.body),
            },
            ("/metrics", _, Some(exposition)) if wants_openmetrics(accept) => {
                (StatusCode::OK, OPENMETRICS, exposition())
            }
            ("/metrics", _, Some(exposition)) => (
                StatusCode::OK,
                PROMETHEUS_TEXT,
                to_prometheus_text(&exposition()),
            ),
            _ => match self.texts.iter().find(|(known, _)| *known == path) {
                Some((_, text)) => (StatusCode::OK, TEXT, text()),
                None => (StatusCode::NOT_FOUND, TEXT, NOT_FOUND_BODY.into()),
            },
        }
    }
}

/// The health port of a controller that elects a leader: binds
/// `host:port` and serves `/healthz` and `/readyz` (always OK: a replica on
/// standby is ready too, so a rollout does not wait on leadership) and
/// `registry` at `/metrics` until `shutdown` is cancelled. Returns the
/// bound address.
pub async fn serve_controller_health(
    host: &str,
    port: u16,
    registry: prometheus_client::registry::Registry,
    shutdown: CancellationToken,
) -> Result<std::net::SocketAddr, crate::net::BindError> {
    let (listener, address) = crate::net::bind("health port", host, port).await?;
    let registry = Arc::new(registry);
    let routes =
        Routes::probes(|| Ok(())).with_metrics(move || crate::metrics::encode_registry(&registry));
    tokio::spawn(serve(listener, routes, shutdown));
    tracing::info!(%address, "serving /healthz, /readyz and /metrics");
    Ok(address)
}

/// Serves `routes` on `listener` until `shutdown` is cancelled; open
/// connections are closed then too.
pub async fn serve(listener: TcpListener, routes: Routes, shutdown: CancellationToken) {
    serve_guarded(listener, routes, shutdown, AcceptGuard::new("health")).await
}

/// [`serve`], with `accept` handling failed accepts (descriptors run out:
/// a waiting connection is refused, see [`crate::accept`]), counted where
/// the caller counts them.
pub async fn serve_guarded(
    listener: TcpListener,
    routes: Routes,
    shutdown: CancellationToken,
    mut accept: AcceptGuard,
) {
    let routes = Arc::new(routes);
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => {
                accept.accepted();
                tcp
            }
            Err(e) => {
                accept.failed(&e, &listener).await;
                continue;
            }
        };
        let routes = routes.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let accept = request
                    .headers()
                    .get(header::ACCEPT)
                    .and_then(|v| v.to_str().ok());
                let (status, content_type, body) = routes.answer_to(request.uri().path(), accept);
                let mut response = Response::new(Full::new(Bytes::from(body)));
                *response.status_mut() = status;
                response
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(tcp), service);
            tokio::select! {
                _ = connection => {}
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn routes(ready: Arc<AtomicBool>) -> Routes {
        Routes::probes(move || {
            if ready.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err(NotReady {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    body: "not yet".into(),
                })
            }
        })
        .with_metrics(|| "# EOF\n".into())
    }

    #[test]
    fn answers_probes_and_metrics() {
        let ready = Arc::new(AtomicBool::new(false));
        let r = routes(ready.clone());
        assert_eq!(r.answer("/healthz").0, StatusCode::OK);
        assert_eq!(r.answer("/livez").0, StatusCode::OK);
        assert_eq!(
            r.answer("/readyz"),
            (StatusCode::SERVICE_UNAVAILABLE, TEXT, "not yet".into())
        );
        ready.store(true, Ordering::SeqCst);
        assert_eq!(r.answer("/ready").0, StatusCode::OK);
        assert_eq!(
            r.answer("/metrics"),
            (StatusCode::OK, PROMETHEUS_TEXT, String::new())
        );
        assert_eq!(
            r.answer_to(
                "/metrics",
                Some("application/openmetrics-text; version=1.0.0")
            ),
            (StatusCode::OK, OPENMETRICS, "# EOF\n".into())
        );
        assert_eq!(r.answer("/nope").2, NOT_FOUND_BODY);
        let counted = routes(ready).with_text("/count", || "3\n".into());
        assert_eq!(
            counted.answer("/count"),
            (StatusCode::OK, TEXT, "3\n".into())
        );
        assert_eq!(counted.answer("/counts").0, StatusCode::NOT_FOUND);
        let admin = Routes::metrics_only(|| "# EOF\n".into());
        assert_eq!(admin.answer("/healthz").0, StatusCode::NOT_FOUND);
        assert_eq!(admin.answer("/metrics").0, StatusCode::OK);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_sends_headers_is_cut_off() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            routes(Arc::new(AtomicBool::new(true))),
            shutdown.clone(),
        ));
        let mut slow = tokio::net::TcpStream::connect(address).await.unwrap();
        slow.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
        // With the clock paused, time jumps to the header-read deadline as
        // soon as every task is idle; the server must then close.
        let mut rest = Vec::new();
        let read = tokio::time::timeout(HEADER_READ_TIMEOUT * 3, slow.read_to_end(&mut rest))
            .await
            .expect("the server kept a header-less connection open");
        assert!(read.is_ok());
        let mut good = tokio::net::TcpStream::connect(address).await.unwrap();
        good.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        good.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.ends_with("ok"), "{response}");
        shutdown.cancel();
    }
}

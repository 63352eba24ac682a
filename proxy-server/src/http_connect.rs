//! The HTTP CONNECT frontend (HTTP/1.1), as upstream's `--mode=http-connect`:
//! `CONNECT host:port` → dial through the agent → `200` and raw bytes both ways.
//! Failures map to status codes by the agent's error text, as upstream does.
//!
//! Status lines and bodies are upstream's, byte for byte, because clients
//! parse them: success is exactly `HTTP/1.1 200 Connection Established\r\n\r\n`
//! (Go's `http.ReadResponse` in kube-apiserver's egress dialer refuses any
//! byte buffered after it), and error bodies are the texts upstream writes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cluster_proxy_proto::duplex::{self, AfterUp, ChunkSource, ReadChunks, WriteChunks};
use cluster_proxy_proto::flow::Delivery;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tonic::body::Body;
use tracing::debug;

use crate::dial::{DialFailure, DialOrigin, Dialer};
use crate::listener::PeerInfo;
use crate::metrics::{GaugeGuard, Metrics};
use crate::tunnel::{ConnReceiver, Established, FrontendEvent};
use cluster_proxy_proto::trace::TraceHeaders;

/// How long to wait for the agent's CLOSE_RSP after the client hung up.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

pub struct ConnectFrontend {
    pub dialer: Arc<Dialer>,
    pub metrics: Arc<Metrics>,
}

/// The success response, whose bytes on the wire are exactly [`ESTABLISHED`].
pub const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// Upstream's body when the dial stays unanswered past `--backend-dial-timeout`.
pub const DIAL_TIMEOUT_BODY: &str = "Backend dial timeout: timed out waiting for backend dial\r\n";

/// Upstream's body when the agent's tunnel ends before the dial is answered.
pub const TUNNEL_CLOSED_BODY: &str = "Backend context error: context canceled\r\n";

fn text_response(status: StatusCode, body: String) -> Response<Body> {
    typed_response(status, "text/plain; charset=utf-8", body)
}

fn typed_response(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(Body::new(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

fn established_response() -> Response<Body> {
    let mut response = Response::new(Body::empty());
    response
        .extensions_mut()
        .insert(hyper::ext::ReasonPhrase::from_static(
            b"Connection Established",
        ));
    response
}

/// Why a request on the CONNECT frontend is refused before any dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnectRequestError {
    #[error("this proxy only supports CONNECT passthrough")]
    NotConnect,
    #[error("CONNECT target must be host:port")]
    NoAuthority,
}

impl ConnectRequestError {
    fn status(self) -> StatusCode {
        match self {
            ConnectRequestError::NotConnect => StatusCode::METHOD_NOT_ALLOWED,
            ConnectRequestError::NoAuthority => StatusCode::BAD_REQUEST,
        }
    }
}

/// The address a request parsed by hyper asks to dial (`host:port`, as the
/// client wrote it), or why it asks for none. Public so the fuzz targets
/// (`fuzz/fuzz_targets/http_connect.rs`) drive the same check the frontend runs.
pub fn connect_target<B>(request: &Request<B>) -> Result<String, ConnectRequestError> {
    if request.method() != Method::CONNECT {
        return Err(ConnectRequestError::NotConnect);
    }
    request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .ok_or(ConnectRequestError::NoAuthority)
}

impl ConnectFrontend {
    pub async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<Body> {
        let address = match connect_target(&request) {
            Ok(address) => address,
            Err(refusal) => return text_response(refusal.status(), format!("{refusal}\n")),
        };
        let random = (rand::random::<i64>() & i64::MAX).max(1);
        let origin = DialOrigin {
            frontend: "http-connect",
            client: request.extensions().get::<Arc<PeerInfo>>().cloned(),
            trace: TraceHeaders::from_http(request.headers()),
        };
        let established = match self
            .dialer
            .dial(&address, random, origin, Bytes::new())
            .await
        {
            Ok(established) => established,
            Err(failure) => {
                debug!(address, error = %failure.message(), "CONNECT dial failed");
                return failure_response(&failure);
            }
        };
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            match hyper::upgrade::on(request).await {
                Ok(upgraded) => relay(TokioIo::new(upgraded), established, metrics).await,
                Err(e) => debug!(address, error = %e, "CONNECT upgrade failed"),
            }
        });
        established_response()
    }
}

/// The response to a failed dial, as upstream writes it.
fn failure_response(failure: &DialFailure) -> Response<Body> {
    let status = failure.http_status();
    match failure {
        // Upstream writes this one with a bare `text/plain`.
        DialFailure::NoAgent => typed_response(
            status,
            "text/plain",
            format!("currently no tunnels available: {}", failure.message()),
        ),
        DialFailure::Timeout(_) => text_response(status, DIAL_TIMEOUT_BODY.into()),
        DialFailure::TunnelClosed(_) => text_response(status, TUNNEL_CLOSED_BODY.into()),
        // The agent's dial error, verbatim (upstream: the DIAL_RSP error).
        other => text_response(status, other.message()),
    }
}

async fn relay<IO>(io: IO, established: Established, metrics: Arc<Metrics>)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let _gauge = GaugeGuard::new(metrics.http_connections.clone());
    let (sender, receiver) = established.split();
    let (from_client, to_client) = tokio::io::split(io);
    // The client's EOF asks the agent to close (CLOSE_REQ, the sender's
    // finish); what the agent still sends, up to its CLOSE_RSP, reaches the
    // client for at most CLOSE_WAIT. The agent's close shuts the client's
    // write side down and ends both.
    let up = duplex::copy(ReadChunks::new(from_client), sender);
    let down = duplex::copy(
        ToClient {
            receiver,
            metrics: &metrics,
            written_from: Instant::now(),
        },
        WriteChunks::new(to_client),
    );
    duplex::relay(up, down, AfterUp::Drain(CLOSE_WAIT), std::future::pending()).await;
}

/// The agent's bytes for the client, until the agent closes.
struct ToClient<'a> {
    receiver: ConnReceiver,
    metrics: &'a Metrics,
    /// When the last chunk was handed to the writer.
    written_from: Instant,
}

impl ChunkSource for ToClient<'_> {
    type Chunk = Delivery<FrontendEvent>;
    type End = ();

    async fn recv(&mut self) -> Result<Delivery<FrontendEvent>, ()> {
        match self.receiver.recv().await {
            Some(delivery) if matches!(delivery.event, FrontendEvent::Data(_)) => {
                self.written_from = Instant::now();
                Ok(delivery)
            }
            _ => Err(()),
        }
    }

    fn delivered(&mut self, n: usize) {
        self.metrics
            .frontend_write_duration
            .observe(self.written_from.elapsed().as_secs_f64());
        self.receiver.consumed(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, uri: &str) -> Request<()> {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .expect("a valid test request")
    }

    #[test]
    fn connect_names_its_target_as_written() {
        assert_eq!(
            connect_target(&request(Method::CONNECT, "cluster-a:8080")),
            Ok("cluster-a:8080".to_owned())
        );
        assert_eq!(
            connect_target(&request(Method::CONNECT, "[::1]:443")),
            Ok("[::1]:443".to_owned())
        );
    }

    #[test]
    fn other_methods_and_targets_without_authority_are_refused() {
        assert_eq!(
            connect_target(&request(Method::GET, "http://cluster-a:8080/")),
            Err(ConnectRequestError::NotConnect)
        );
        assert_eq!(
            connect_target(&request(Method::CONNECT, "/just/a/path")),
            Err(ConnectRequestError::NoAuthority)
        );
        assert_eq!(
            ConnectRequestError::NotConnect.status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            ConnectRequestError::NoAuthority.status(),
            StatusCode::BAD_REQUEST
        );
    }
}

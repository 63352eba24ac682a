//! The agent port's HTTP/1.1 side: the WebSocket upgrade that carries a
//! tunnel through middleboxes that pass only HTTP/1.1
//! ([`cluster_proxy_proto::websocket`]). One request per connection: the
//! upgrade on the tunnel's path is answered `101` and the connection
//! becomes the call; anything else gets a 404 or 400 and is closed.
//!
//! The agent's identity is its TLS client certificate, read from the
//! handshake as for the other transports; the upgrade request carries the
//! call's metadata and nothing that authenticates.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use cluster_proxy_proto::websocket::{self, SUBPROTOCOL, WebSocketIo, lists_token};
use http::header::{CONNECTION, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_VERSION, UPGRADE};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::{TokioIo, TokioTimer};
use tracing::{debug, info};

use crate::listener::{HEADER_READ_TIMEOUT, Remote};

/// The connection after a `101`, as a byte stream.
pub type UpgradedIo = WebSocketIo<TokioIo<Upgraded>>;

/// An accepted upgrade: the call's metadata and the connection.
pub struct Accepted {
    pub metadata: HeaderMap,
    pub io: UpgradedIo,
}

/// What the request handler hands back to the connection's task.
type Taken = Arc<Mutex<Option<(HeaderMap, OnUpgrade)>>>;

/// Serves the one HTTP/1.1 request of `io`: the WebSocket upgrade on
/// `path` comes back accepted; anything else is answered, logged and
/// `None`.
pub async fn upgrade<IO>(io: IO, path: &'static str, remote: Remote) -> Option<Accepted>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let taken: Taken = Arc::default();
    let handler = taken.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let response = answer(request, path, remote, &handler);
        async move { Ok::<_, Infallible>(response) }
    });
    // Not `keep_alive(false)`: hyper would answer the upgrade with
    // `Connection: close`, which clients take for a refusal; every refusal
    // says `Connection: close` itself, which ends the connection.
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await;
    if let Err(e) = served {
        debug!(listener = "agent", %remote, error = %e, "HTTP/1.1 connection ended with an error");
    }
    let (metadata, on_upgrade) = taken
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()?;
    match on_upgrade.await {
        Ok(upgraded) => Some(Accepted {
            metadata,
            io: websocket::accept(TokioIo::new(upgraded)).await,
        }),
        Err(e) => {
            debug!(listener = "agent", %remote, error = %e, "the WebSocket upgrade did not complete");
            None
        }
    }
}

fn refusal(status: StatusCode, why: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("{why}\n"))));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONNECTION, HeaderValue::from_static("close"));
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Why `request` is not the tunnel's upgrade, if it is not.
fn not_an_upgrade(request: &Request<Incoming>, path: &str) -> Option<(StatusCode, String)> {
    if request.uri().path() != path {
        return Some((
            StatusCode::NOT_FOUND,
            format!(
                "no such path {:?}: the agent port serves the tunnel's WebSocket at {path}",
                request.uri().path()
            ),
        ));
    }
    let headers = request.headers();
    let why = if request.method() != Method::GET {
        "a WebSocket upgrade is a GET"
    } else if !lists_token(headers, UPGRADE, "websocket")
        || !lists_token(headers, CONNECTION, "upgrade")
    {
        "expected a WebSocket upgrade (Connection: Upgrade, Upgrade: websocket)"
    } else if headers
        .get(SEC_WEBSOCKET_VERSION)
        .map(HeaderValue::as_bytes)
        != Some(b"13")
    {
        "expected Sec-WebSocket-Version: 13"
    } else if headers.get(SEC_WEBSOCKET_KEY).is_none() {
        "missing Sec-WebSocket-Key"
    } else if !lists_token(headers, http::header::SEC_WEBSOCKET_PROTOCOL, SUBPROTOCOL) {
        "expected Sec-WebSocket-Protocol: cluster-proxy-tunnel.v1"
    } else {
        return None;
    };
    Some((StatusCode::BAD_REQUEST, why.to_owned()))
}

fn answer(
    mut request: Request<Incoming>,
    path: &str,
    remote: Remote,
    taken: &Taken,
) -> Response<Full<Bytes>> {
    if let Some((status, why)) = not_an_upgrade(&request, path) {
        info!(listener = "agent", %remote, method = %request.method(), path = request.uri().path(), %status, reason = why, "refused an HTTP/1.1 request on the agent port");
        return refusal(status, &why);
    }
    let accept = request
        .headers()
        .get(SEC_WEBSOCKET_KEY)
        .map(|key| websocket::accept_key(key.as_bytes()))
        .and_then(|accept| HeaderValue::from_str(&accept).ok());
    let Some(accept) = accept else {
        return refusal(StatusCode::BAD_REQUEST, "invalid Sec-WebSocket-Key");
    };
    let on_upgrade = hyper::upgrade::on(&mut request);
    let metadata = websocket::call_metadata(request.headers());
    *taken.lock().unwrap_or_else(PoisonError::into_inner) = Some((metadata, on_upgrade));
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(http::header::SEC_WEBSOCKET_ACCEPT, accept);
    headers.insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(SUBPROTOCOL),
    );
    response
}

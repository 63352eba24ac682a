//! What both HTTP proxies of service access (the hub's user-server, the
//! managed side's service-proxy) do alike: serve HTTPS with bounded
//! handshakes and headers, drop hop-by-hop headers, carry upgraded streams
//! (SPDY and WebSocket: `exec`, `attach`, `port-forward`) through, and
//! answer errors as Kubernetes `Status` objects, which kubectl prints as it
//! prints the API server's own.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::duplex::{self, ChunkSource, Copied, ReadChunks, ReadEnd, WriteChunks};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::reload::Watched;

/// The body both proxies answer with: the backend's, streamed, or their own.
pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1),
/// besides those the `Connection` header itself names.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether a request or response asks to switch protocols (`Connection:
/// Upgrade` with an `Upgrade` header).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Removes the hop-by-hop headers; an upgrade keeps `Connection: Upgrade`
/// and its `Upgrade` header, which the next hop needs to switch too.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let upgrade = is_upgrade(headers).then(|| headers.get(header::UPGRADE).cloned());
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP) {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
    if let Some(Some(protocol)) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        headers.insert(header::UPGRADE, protocol);
    }
}

/// A Kubernetes `meta/v1 Status` error response.
pub fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    let mut response = Response::new(full(Bytes::from(body.to_string())));
    *response.status_mut() = code;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A body of `bytes`, as a [`ProxyBody`].
pub fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// Once both sides have switched protocols, copies bytes between the
/// client's upgraded connection and the backend's until either ends, then
/// calls `ended` with the bytes sent up (client to backend) and down.
/// `client` is the request the proxy received (its upgrade future is taken
/// before the request is sent on), `backend` the backend's 101 response.
pub fn relay_upgrade<B>(
    client: hyper::upgrade::OnUpgrade,
    backend: &mut Response<B>,
    ended: impl FnOnce(u64, u64) + Send + 'static,
) {
    let backend = hyper::upgrade::on(backend);
    tokio::spawn(async move {
        let (client, backend) = match tokio::try_join!(client, backend) {
            Ok(both) => both,
            Err(error) => {
                tracing::debug!(%error, "an upgrade did not complete");
                ended(0, 0);
                return;
            }
        };
        let (up, down) = relay_streams(TokioIo::new(client), TokioIo::new(backend)).await;
        ended(up, down);
    });
}

/// A byte stream's chunks, counting the bytes delivered.
struct Counted<S> {
    source: S,
    delivered: u64,
}

impl<S: ChunkSource> ChunkSource for &mut Counted<S> {
    type Chunk = S::Chunk;
    type End = S::End;

    fn recv(&mut self) -> impl std::future::Future<Output = Result<S::Chunk, S::End>> + Send {
        self.source.recv()
    }

    fn delivered(&mut self, n: usize) {
        self.delivered += n as u64;
        self.source.delivered(n);
    }
}

/// Copies an upgraded connection both ways until both directions ended;
/// the bytes client → backend and backend → client.
///
/// Each direction flushes what it writes and, when its source ends (EOF,
/// or an error such as a TLS peer that closed without `close_notify`),
/// shuts its destination's write side down, which flushes the rest and
/// sends `close_notify`. `tokio::io::copy_bidirectional` instead returns
/// at the first error of either direction and drops what a TLS layer
/// still holds: the last frames of a stream (a WebSocket close, an exec's
/// exit status) were lost that way.
pub async fn relay_streams<C, B>(client: C, backend: B) -> (u64, u64)
where
    C: AsyncRead + AsyncWrite + Send,
    B: AsyncRead + AsyncWrite + Send,
{
    let (client_read, client_write) = tokio::io::split(client);
    let (backend_read, backend_write) = tokio::io::split(backend);
    let mut up = Counted {
        source: ReadChunks::new(client_read),
        delivered: 0,
    };
    let mut down = Counted {
        source: ReadChunks::new(backend_read),
        delivered: 0,
    };
    let (up_ended, down_ended) = tokio::join!(
        duplex::copy(&mut up, WriteChunks::new(backend_write)),
        duplex::copy(&mut down, WriteChunks::new(client_write)),
    );
    for (direction, ended) in [("up", up_ended), ("down", down_ended)] {
        if let Copied::SourceEnded(ReadEnd::Failed(error)) = ended {
            tracing::debug!(direction, %error, "an upgraded stream's read ended with an error");
        }
    }
    (up.delivered, down.delivered)
}

/// The upgrade future of a request that asks for one (taken before the
/// request is forwarded, as hyper requires), else `None`.
pub fn take_upgrade<B>(request: &mut Request<B>) -> Option<hyper::upgrade::OnUpgrade> {
    is_upgrade(request.headers()).then(|| hyper::upgrade::on(request))
}

/// Which URIs a [`pooled_client`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schemes {
    /// `https://` only: a plain `http://` URI is an error.
    HttpsOnly,
    /// `https://`, and `http://` in plain text (a Service that serves plain HTTP).
    HttpAndHttps,
}

/// A pooled HTTP/1.1 client (HTTP/1.1: upgrades need it) that speaks TLS
/// with `tls` over the connections `connector` opens, verifying each
/// server for its URI's host; at most `max_idle_per_host` idle connections
/// are kept per host, each for `idle_timeout`.
pub fn pooled_client<C, B>(
    tls: &rustls::ClientConfig,
    connector: C,
    schemes: Schemes,
    max_idle_per_host: usize,
    idle_timeout: Duration,
) -> hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<C>, B>
where
    hyper_rustls::HttpsConnector<C>: hyper_util::client::legacy::connect::Connect + Clone,
    B: http_body::Body + Send,
    B::Data: Send,
{
    // hyper-rustls sets the ALPN itself (and insists on it being unset).
    let mut tls = tls.clone();
    tls.alpn_protocols.clear();
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
    let builder = match schemes {
        Schemes::HttpsOnly => builder.https_only(),
        Schemes::HttpAndHttps => builder.https_or_http(),
    };
    let connector = builder.enable_http1().wrap_connector(connector);
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_idle_per_host)
        .pool_idle_timeout(idle_timeout)
        .pool_timer(TokioTimer::new())
        .build(connector)
}

/// How [`serve_https`] serves its connections.
#[derive(Debug, Clone)]
pub struct HttpsOptions {
    /// Only HTTP/1.1 (a hop whose every request may be an upgrade);
    /// otherwise HTTP/2 too, as ALPN decides.
    pub http1_only: bool,
    /// How long a client has for its TLS handshake.
    pub handshake_timeout: Duration,
    /// How long a client has to send a request's headers, and how many
    /// bytes they may take.
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    /// How long open requests may finish after the stop.
    pub drain_timeout: Duration,
}

/// Serves HTTPS on `listener` with the newest `tls` for each handshake,
/// until `stop`, then lets open requests finish for the drain timeout.
/// `connection` sees each connection's TLS state (its client certificate)
/// once and gives the handler of that connection's requests.
pub async fn serve_https<C, H, F>(
    listener: TcpListener,
    tls: Watched<rustls::ServerConfig>,
    stop: CancellationToken,
    options: HttpsOptions,
    connection: C,
) where
    C: Fn(&rustls::ServerConnection, SocketAddr) -> H + Send + Sync + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let connection = Arc::new(connection);
    let options = Arc::new(options);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (tcp, peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!(%error, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.borrow().clone());
        let (connection, options) = (connection.clone(), options.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(options.handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::info!(%peer, %error, "TLS handshake refused");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let handler = connection(stream.get_ref().1, peer);
            let service = hyper::service::service_fn(move |request| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler(request).await) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            if options.http1_only {
                builder = builder.http1_only();
            }
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(options.header_read_timeout)
                // hyper's floor (it panics below 8 KiB).
                .max_buf_size(options.max_header_bytes.max(8192));
            builder
                .http2()
                .max_header_list_size(u32::try_from(options.max_header_bytes).unwrap_or(u32::MAX));
            let served = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(error) = watcher.watch(served.into_owned()).await {
                tracing::debug!(%peer, %error, "connection ended");
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(options.drain_timeout, graceful.shutdown()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend that sends `data`, then fails its next read, as a TLS
    /// peer that closed without `close_notify` does; it takes any write.
    struct SendsThenFails {
        data: Option<Vec<u8>>,
    }

    impl AsyncRead for SendsThenFails {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(match self.data.take() {
                Some(data) => {
                    buf.put_slice(&data);
                    Ok(())
                }
                None => Err(std::io::ErrorKind::UnexpectedEof.into()),
            })
        }
    }

    impl AsyncWrite for SendsThenFails {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// Regression: with `copy_bidirectional` the backend's read error
    /// ended the relay at once and what the client's TLS layer still
    /// buffered (here a `BufWriter`, which holds bytes until a flush) was
    /// lost: kubectl saw "close 1006 (abnormal closure)" instead of an
    /// exec's exit status.
    #[tokio::test]
    async fn an_upgraded_stream_delivers_what_came_before_the_backend_failed() {
        use tokio::io::AsyncReadExt;
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let backend = SendsThenFails {
            data: Some(data.clone()),
        };
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let client = tokio::io::BufWriter::new(near);
        let relay = tokio::spawn(relay_streams(client, backend));
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), far.read_to_end(&mut got))
            .await
            .expect("the client's side ends")
            .unwrap();
        assert!(got == data, "{} of {} bytes arrived", got.len(), data.len());
        drop(far);
        let (up, down) = tokio::time::timeout(Duration::from_secs(10), relay)
            .await
            .expect("the relay ends once both directions did")
            .unwrap();
        assert_eq!((up, down), (0, data.len() as u64));
    }

    #[test]
    fn hop_by_hop_headers_go_and_upgrades_keep_their_two() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert!(headers.contains_key(header::ACCEPT));

        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        assert!(is_upgrade(&headers));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.get(header::UPGRADE).unwrap(), "SPDY/3.1");
        assert_eq!(headers.get(header::CONNECTION).unwrap(), "Upgrade");
    }

    #[test]
    fn an_upgrade_header_without_connection_upgrade_is_no_upgrade() {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!is_upgrade(&headers));
        strip_hop_by_hop(&mut headers);
        assert!(headers.is_empty());
    }

    #[test]
    fn errors_are_kubernetes_status_objects() {
        let response = status_response(StatusCode::NOT_FOUND, "NotFound", "no cluster \"x\"");
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            response.headers().get(header::CONTENT_TYPE).unwrap(),
            "application/json"
        );
    }
}

//! Accepting mTLS connections and serving them: gRPC with our own HTTP/2
//! driver ([`crate::grpc_port`]), HTTP CONNECT with hyper (see
//! [`crate::client_port`]), each connection with the verified peer
//! certificate's identity.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use cluster_proxy_proto::h2_driver::PING_TIMEOUT;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::transport::{HttpWindows, MAX_FRAME_SIZE, QuickAck};
use cluster_proxy_runtime::accept::{AcceptGuard, PendingConnections};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info};

use crate::metrics::Metrics;

/// Time a client gets to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time an HTTP/1.1 client gets to send its request head (upstream: 60 s).
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// On shutdown, a connection accepted this recently may still send its first
/// request before it is asked to finish: an HTTP/1.1 connection asked to
/// finish before its request arrived would be closed unanswered, and its
/// client would see a failed dial.
pub(crate) const FIRST_REQUEST_WINDOW: Duration = Duration::from_secs(2);
/// Time a refused peer gets to take our close_notify.
const REFUSAL_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a connection came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remote {
    Tcp(SocketAddr),
    /// A Unix-socket peer (`--uds-name`): local, trusted by the socket's
    /// file permissions, as upstream trusts it.
    Unix,
}

impl Remote {
    pub fn ip(&self) -> Option<std::net::IpAddr> {
        match self {
            Remote::Tcp(addr) => Some(addr.ip()),
            Remote::Unix => None,
        }
    }
}

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remote::Tcp(addr) => addr.fmt(f),
            Remote::Unix => f.write_str("unix-socket"),
        }
    }
}

/// The verified client certificate behind a request.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: Remote,
    pub subject: String,
    /// The cluster the certificate names, if any.
    pub cluster: Option<ClusterName>,
    /// Why the certificate's cluster identity could not be read, if it could not.
    pub identity_error: Option<String>,
    /// What ALPN chose; on the agent port it tells the tunnel's transport.
    pub alpn: Alpn,
}

/// The protocol the TLS handshake's ALPN chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// No ALPN (or no TLS): the first bytes tell.
    None,
    /// gRPC on HTTP/2.
    H2,
    /// The lean framing ([`cluster_proxy_proto::framed`]).
    Framed,
    /// HTTP/1.1: HTTP CONNECT on the client port, the WebSocket upgrade
    /// ([`cluster_proxy_proto::websocket`]) on the agent port.
    Http11,
    /// A protocol of a port's own `--alpn` list that none of these is.
    Other,
}

impl Alpn {
    fn of(chosen: Option<&[u8]>) -> Self {
        match chosen {
            None => Alpn::None,
            Some(cluster_proxy_proto::transport::ALPN_H2) => Alpn::H2,
            Some(cluster_proxy_proto::framed::ALPN_FRAMED) => Alpn::Framed,
            Some(cluster_proxy_proto::transport::ALPN_HTTP11) => Alpn::Http11,
            Some(_) => Alpn::Other,
        }
    }
}

impl PeerInfo {
    /// A Unix-socket peer: no certificate, trusted as local.
    pub fn unix() -> Self {
        PeerInfo {
            remote: Remote::Unix,
            subject: String::new(),
            cluster: None,
            identity_error: None,
            alpn: Alpn::None,
        }
    }
}

/// Serves one in-memory connection of `server` as a Unix-socket peer's;
/// returns the client's end.
#[cfg(test)]
pub(crate) fn serve_in_memory(server: impl ServeConnection) -> tokio::io::DuplexStream {
    let (client, io) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        server
            .serve(io, PeerInfo::unix(), tokio::time::Instant::now())
            .await
    });
    client
}

/// A full handshake has just verified the peer's chain; a resumed session
/// brought back an old one, which may have expired since (see
/// [`cluster_proxy_runtime::peer::check_not_expired`]).
fn resumed_chain_still_valid(
    conn: &rustls::ServerConnection,
) -> Result<(), cluster_proxy_runtime::peer::PeerError> {
    if conn.handshake_kind() != Some(rustls::HandshakeKind::Resumed) {
        return Ok(());
    }
    let chain = conn.peer_certificates().unwrap_or_default();
    cluster_proxy_runtime::peer::check_not_expired(chain, SystemTime::now())
}

fn peer_info(remote: Remote, conn: &rustls::ServerConnection) -> PeerInfo {
    let alpn = Alpn::of(conn.alpn_protocol());
    let Some(cert) = conn.peer_certificates().and_then(|c| c.first()) else {
        return PeerInfo {
            remote,
            subject: String::new(),
            cluster: None,
            identity_error: Some("no client certificate".into()),
            alpn,
        };
    };
    let subject = cluster_proxy_runtime::peer::subject_of(cert);
    match cluster_proxy_runtime::peer::cluster_of(cert) {
        Ok(cluster) => PeerInfo {
            remote,
            subject,
            cluster,
            identity_error: None,
            alpn,
        },
        Err(e) => PeerInfo {
            remote,
            subject,
            cluster: None,
            identity_error: Some(e.to_string()),
            alpn,
        },
    }
}

/// A listening socket: TCP (with TLS; its failed handshakes counted in the
/// metrics) or Unix (plain, `--uds-name`).
pub enum Listener {
    Tcp(
        TcpListener,
        cluster_proxy_runtime::reload::Watched<rustls::ServerConfig>,
        Arc<Metrics>,
        Acks,
    ),
    Unix(UnixListener),
}

/// When a TCP port acknowledges what it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acks {
    /// The kernel's delayed ACKs.
    Delayed,
    /// At once, after every read ([`QuickAck`]): the agent port, whose
    /// tunnels may come through a forward proxy that relays with Nagle's
    /// algorithm on and would otherwise wait up to a delayed-ACK period
    /// before each small write of a tunnel's exchanges.
    Immediate,
}

enum Accepted {
    Tcp(TcpStream, SocketAddr, TlsAcceptor, Arc<Metrics>, Acks),
    Unix(UnixStream),
}

impl Listener {
    async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Listener::Tcp(listener, tls, metrics, acks) => {
                let (tcp, remote) = listener.accept().await?;
                let _ = tcp.set_nodelay(true);
                // Agents and clients hold these connections for hours; one
                // whose host vanished is reset by the kernel's probes.
                if let Err(e) = cluster_proxy_runtime::net::set_tcp_keepalive(&tcp) {
                    tracing::debug!(%remote, error = %e, "TCP keepalive not set");
                }
                // The newest credentials for each handshake: rotation needs no restart.
                let acceptor = TlsAcceptor::from(tls.borrow().clone());
                Ok(Accepted::Tcp(tcp, remote, acceptor, metrics.clone(), *acks))
            }
            Listener::Unix(listener) => Ok(Accepted::Unix(listener.accept().await?.0)),
        }
    }
}

impl PendingConnections for Listener {
    async fn refuse_one(&self) -> std::io::Result<bool> {
        match self {
            Listener::Tcp(listener, ..) => listener.refuse_one().await,
            Listener::Unix(listener) => listener.refuse_one().await,
        }
    }
}

/// The HTTP/2 settings a port's flags choose.
#[derive(Debug, Clone, Copy)]
pub struct Http2Settings {
    /// Idle time before a PING (`--keepalive-time`, `--frontend-keepalive-time`); `None`: no pings.
    pub keepalive: Option<Duration>,
    /// Streams one connection may have open (`--max-concurrent-streams`).
    pub max_concurrent_streams: u32,
    /// Receive windows: the agent port's tunnels or the client port's streams.
    pub windows: HttpWindows,
}

/// Serves one accepted connection (after its TLS handshake, if any) until
/// it ends; asked to finish once the listener's shutdown fires.
pub trait ServeConnection: Send + Sync + 'static {
    fn serve<IO>(
        &self,
        io: IO,
        peer: PeerInfo,
        accepted_at: tokio::time::Instant,
    ) -> impl Future<Output = ()> + Send
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static;
}

/// hyper serving each connection with `make_service`'s tower service,
/// HTTP/1.1 or HTTP/2 (with the `http2` settings) as the client speaks.
pub fn http<F>(
    name: &'static str,
    make_service: F,
    shutdown: CancellationToken,
    http2: Http2Settings,
) -> HttpConnections<F> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .timer(TokioTimer::new())
        .initial_stream_window_size(http2.windows.stream)
        .initial_connection_window_size(http2.windows.connection)
        .max_frame_size(MAX_FRAME_SIZE)
        // Beyond it the peer's new streams are refused (REFUSED_STREAM),
        // which a client retries: `--max-concurrent-streams`.
        .max_concurrent_streams(http2.max_concurrent_streams)
        // HTTP/2 pings after `keepalive` without traffic (upstream's
        // --keepalive-time / --frontend-keepalive-time); a peer that does not
        // answer within 20 s (gRPC's default timeout) is dropped.
        .keep_alive_interval(http2.keepalive)
        .keep_alive_timeout(PING_TIMEOUT);
    // HTTP/1.1 serves only CONNECT: responses as upstream writes them, with
    // no `date` header (a `200 Connection Established` is the status line
    // alone) and header names in Go's canonical case.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true)
        .auto_date_header(false)
        .title_case_headers(true);
    HttpConnections {
        name,
        builder,
        make_service,
        shutdown,
    }
}

/// Serves `listener` until `shutdown` fires, then stops accepting (closing
/// the socket, so new connections are refused and a load balancer moves them
/// to another replica) and lets open connections finish within `grace`
/// before dropping them. A failed accept goes to `accept`: at the open-file
/// limit a waiting connection is refused ([`cluster_proxy_runtime::accept`]).
pub async fn serve<C: ServeConnection>(
    name: &'static str,
    listener: Listener,
    server: C,
    shutdown: CancellationToken,
    grace: Duration,
    mut accept: AcceptGuard,
) {
    let server = Arc::new(server);
    let connections = TaskTracker::new();
    let mut stopping = false;
    loop {
        let accepted = if stopping {
            // Connections the kernel completed before we stopped are
            // served, not reset with the socket; polled without waiting.
            match tokio::time::timeout(Duration::ZERO, listener.accept()).await {
                Ok(Ok(a)) => a,
                Ok(Err(_)) | Err(_) => break,
            }
        } else {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    stopping = true;
                    continue;
                }
                accepted = listener.accept() => match accepted {
                    Ok(a) => {
                        accept.accepted();
                        a
                    }
                    Err(e) => {
                        // Out of descriptors: refuse a waiting connection
                        // (or back off), never spin.
                        accept.failed(&e, &listener).await;
                        continue;
                    }
                },
            }
        };
        let accepted_at = tokio::time::Instant::now();
        let server = server.clone();
        match accepted {
            Accepted::Tcp(tcp, remote, acceptor, metrics, Acks::Delayed) => {
                connections.spawn(async move {
                    serve_tls(name, &*server, tcp, remote, acceptor, &metrics, accepted_at).await;
                });
            }
            Accepted::Tcp(tcp, remote, acceptor, metrics, Acks::Immediate) => {
                connections.spawn(async move {
                    let tcp = QuickAck(tcp);
                    serve_tls(name, &*server, tcp, remote, acceptor, &metrics, accepted_at).await;
                });
            }
            Accepted::Unix(stream) => {
                connections.spawn(async move {
                    server.serve(stream, PeerInfo::unix(), accepted_at).await
                });
            }
        }
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(grace, connections.wait())
        .await
        .is_err()
    {
        debug!(
            listener = name,
            "connections still open after the grace period; dropping them"
        );
    }
}

/// The TLS handshake of one accepted connection, then `server` serving it.
async fn serve_tls<C: ServeConnection, IO>(
    name: &'static str,
    server: &C,
    tcp: IO,
    remote: SocketAddr,
    acceptor: TlsAcceptor,
    metrics: &Metrics,
    accepted_at: tokio::time::Instant,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let remote = Remote::Tcp(remote);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            metrics.tls_handshake_failed(name, "error");
            info!(listener = name, %remote, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            metrics.tls_handshake_failed(name, "timeout");
            info!(listener = name, %remote, "TLS handshake timed out");
            return;
        }
    };
    let resumed = tls.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    metrics.tls_handshake_completed(name, resumed);
    if let Err(refusal) = resumed_chain_still_valid(tls.get_ref().1) {
        metrics.tls_handshake_failed(name, "expired_resumed_session");
        info!(listener = name, %remote, error = %refusal, "resumed TLS session refused");
        // close_notify, bounded: a peer that stopped reading cannot hold us.
        let mut tls = tls;
        let _ = tokio::time::timeout(REFUSAL_CLOSE_TIMEOUT, tls.shutdown()).await;
        return;
    }
    let peer = peer_info(remote, tls.get_ref().1);
    server.serve(tls, peer, accepted_at).await;
}

/// hyper serving a listener's connections ([`http`]); a [`ServeConnection`]
/// when `F` makes tower services of HTTP requests.
pub struct HttpConnections<F> {
    name: &'static str,
    builder: auto::Builder<TokioExecutor>,
    make_service: F,
    shutdown: CancellationToken,
}

impl<F, S, B> ServeConnection for HttpConnections<F>
where
    F: Fn(Arc<PeerInfo>) -> S + Send + Sync + 'static,
    S: tower::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    async fn serve<IO>(&self, io: IO, peer: PeerInfo, accepted_at: tokio::time::Instant)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let remote = peer.remote;
        let peer = Arc::new(peer);
        let tagged = peer.clone();
        let service = tower::ServiceBuilder::new()
            .map_request(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(tagged.clone());
                req
            })
            .service((self.make_service)(peer));
        let io = TokioIo::new(io);
        let service = TowerToHyperService::new(service);
        let shutdown = self.shutdown.clone();
        drive(
            self.name,
            remote,
            self.builder.serve_connection_with_upgrades(io, service),
            shutdown,
            accepted_at,
        )
        .await;
    }
}

/// Runs one connection; on shutdown asks it to finish gracefully (GOAWAY /
/// close after the current response), once it had [`FIRST_REQUEST_WINDOW`]
/// to send its first request, and waits for that.
async fn drive<C>(
    name: &'static str,
    remote: Remote,
    conn: C,
    shutdown: CancellationToken,
    accepted_at: tokio::time::Instant,
) where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    tokio::pin!(conn);
    let finish_from = async {
        shutdown.cancelled().await;
        tokio::time::sleep_until(accepted_at + FIRST_REQUEST_WINDOW).await;
    };
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                debug!(listener = name, %remote, error = %e, "connection ended with an error");
            }
        }
        _ = finish_from => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

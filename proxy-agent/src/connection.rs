//! A tunnel's HTTP/2 connection, driven by the tunnel's own task.
//!
//! Through tonic's `Channel` every packet crossed two more tasks in the
//! agent: hyper drives the connection in a task of its own and pipes the
//! request body in another, so a packet from the server went connection
//! task → tunnel task, and one to the server went the target connection's
//! task → body task → connection task, each hand-off a wake (on a
//! multi-threaded runtime often another thread's). Here the tunnel's task
//! polls the HTTP/2 connection, the stream's packets and the packets to
//! send, one hand-off less each way.
//!
//! A server that speaks the lean framing ([`cluster_proxy_proto::framed`],
//! chosen by ALPN: ours, unless `--lean-framing=false`) gets the same call
//! without HTTP/2: the hello, the packets, pings and the end straight over
//! TLS. Any other server gets gRPC over HTTP/2.
//!
//! With `--transport websocket` the call goes in the lean framing too,
//! inside a WebSocket ([`cluster_proxy_proto::websocket`]): TLS offering
//! only HTTP/1.1, an upgrade whose headers are the hello, then the same
//! frames in binary messages, with a WebSocket ping every heartbeat.
//!
//! On HTTP/2 the call is what tonic sent (the agent's metadata, `te` and
//! `content-type`; our own `user-agent`), with the same HTTP/2 settings,
//! messages framed by [`cluster_proxy_proto::grpc_framing`], and pings
//! after `--keepalive-time` without a packet from the server, answered
//! within 20 s or the tunnel fails, as hyper's keepalive did.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_egress::{Egress, EgressError, EgressStream};
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::framed::{
    self, ALPN_FRAMED, Control, FrameWriter, FramedBody, Hello, InboundBody,
};
use cluster_proxy_proto::grpc_framing::{
    AGENT_CONNECT_PATH, Direction, PacketBody, PacketStream, Role, check_response_head,
};
use cluster_proxy_proto::h2_driver::{
    KeepAlive, Parts, Passes, RecvBody, Sent, grpc_request, h2_status, poll_send_body,
};
use cluster_proxy_proto::transport::{
    HttpWindows, MAX_FRAME_SIZE, MAX_MESSAGE_SIZE, TransportError, host_port, tls_over,
};
use cluster_proxy_proto::websocket::{self, UpgradeError, WebSocketIo};
use futures_util::{Stream, StreamExt};
use tokio::io::{ReadHalf, WriteHalf};
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::agent_config::Transport;

/// The agent's user-agent, in its requests to the proxy-server and in the
/// CONNECT requests to a forward proxy. Here, not at the crate's root, so
/// that the tunnel's modules do not import the root that imports them.
pub(crate) const USER_AGENT: &str = concat!("cluster-proxy-agent/", env!("CARGO_PKG_VERSION"));

/// Bytes the stream may have queued beyond what the server's window lets
/// out (hyper's default for its clients).
const MAX_SEND_BUFFER: usize = 1024 * 1024;

/// The parts a pass polls ([`Passes`]): our packets into the stream, the
/// server's packets out of it, the keepalive and the connection itself.
const SEND: usize = 0;
const RECEIVE: usize = 1;
const KEEPALIVE: usize = 2;
const CONNECTION: usize = 3;
const PARTS: usize = 4;

/// The packets the agent sends, as the tunnel produces them.
pub type Outbound = Pin<Box<dyn Stream<Item = Packet> + Send>>;

type OutboundBody =
    PacketBody<futures_util::stream::Map<Outbound, fn(Packet) -> Result<Packet, Status>>>;

type Tls = TlsStream<EgressStream>;

/// What the lean framing runs on: TLS, or a WebSocket over TLS.
type Carrier = Either<Tls, WebSocketIo<Tls>>;

/// Why an attempt to open a tunnel's connection failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The way out: the forward proxy, or the TCP connection itself.
    #[error(transparent)]
    Egress(#[from] EgressError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("connect to {address} timed out after {timeout:?}")]
    TimedOut { address: String, timeout: Duration },
    #[error("HTTP/2 with {address}: {source}")]
    Http2 {
        address: String,
        #[source]
        source: h2::Error,
    },
    #[error("the connection to {address} ended before the server answered")]
    Closed { address: String },
    #[error("WebSocket transport to {address}: {source}")]
    WebSocket {
        address: String,
        #[source]
        source: UpgradeError,
    },
    #[error("tunnel framing with {address}: {}", .source.message())]
    Framed {
        address: String,
        #[source]
        source: Status,
    },
    #[error("Connect request: {0}")]
    Request(#[from] http::Error),
    /// The server answered with an error (a refusal).
    #[error("Connect rejected: {} {}", .0.code(), .0.message())]
    Rejected(Status),
}

impl OpenError {
    /// A short, fixed label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            OpenError::Egress(e) => e.reason(),
            OpenError::Transport(TransportError::Tls { .. }) => "tls",
            OpenError::Transport(_) => "dial",
            OpenError::TimedOut { .. } => "timeout",
            OpenError::WebSocket {
                source: UpgradeError::Refused { .. },
                ..
            } => "upgrade_refused",
            OpenError::Http2 { .. }
            | OpenError::Closed { .. }
            | OpenError::Framed { .. }
            | OpenError::WebSocket { .. }
            | OpenError::Request(_) => "protocol",
            OpenError::Rejected(_) => "rejected",
        }
    }
}

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub tls: Arc<rustls::ClientConfig>,
    /// Straight to the server, or through the network's forward proxy.
    pub egress: Egress,
    pub connect_timeout: Duration,
    pub windows: HttpWindows,
    /// Ping after this long without a packet from the server; `None` or
    /// zero: no pings.
    pub keepalive: Option<Duration>,
    pub transport: Transport,
    /// With the WebSocket transport: the ping interval.
    pub websocket_heartbeat: Duration,
}

/// One `AgentService.Connect` call on a connection of its own.
pub struct TunnelConnection {
    link: Link,
    outbound: OutboundBody,
    send_done: bool,
    inbound: PacketStream<InboundBody<ReadHalf<Carrier>>>,
    /// Chunks read, so the keepalive knows whether the server was heard.
    heard: Arc<AtomicU64>,
    passes: Passes,
}

impl std::fmt::Debug for TunnelConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelConnection")
            .field("transport", &self.transport_name())
            .field("send_done", &self.send_done)
            .finish_non_exhaustive()
    }
}

/// What carries the call: an HTTP/2 connection and its stream, or the
/// lean framing's writing half (the reading half is the inbound body's).
// One per tunnel, moved once into its task: the size does not matter, an
// indirection on every poll of the HTTP/2 connection would.
#[allow(clippy::large_enum_variant)]
enum Link {
    Http2 {
        conn: h2::client::Connection<Tls, Bytes>,
        conn_done: bool,
        send: h2::SendStream<Bytes>,
        keepalive: Option<KeepAlive>,
    },
    Framed {
        writer: FrameWriter<WriteHalf<Carrier>>,
        keepalive: Option<framed::KeepAlive>,
        websocket: bool,
    },
}

/// What [`TunnelConnection::next_packet`] and [`TunnelConnection::drive`] end with.
#[derive(Debug)]
pub enum Driven {
    /// The server's next packet; `Ok(None)` when it ended the stream cleanly.
    Packet(Result<Option<Packet>, Status>),
    /// The connection failed (or a ping went unanswered).
    Failed(Status),
}

impl TunnelConnection {
    /// Connects, sends the `Connect` request with `metadata` and waits for
    /// the response's headers (their metadata is returned); `outbound`
    /// becomes the request body. All within `endpoint.connect_timeout` as
    /// far as the TCP and TLS part goes; the caller bounds the whole.
    pub async fn open(
        endpoint: &Endpoint,
        metadata: MetadataMap,
        outbound: Outbound,
    ) -> Result<(TunnelConnection, MetadataMap), OpenError> {
        let address = host_port(&endpoint.host, endpoint.port);
        let tls = tokio::time::timeout(endpoint.connect_timeout, async {
            let stream = endpoint
                .egress
                .connect(&endpoint.host, endpoint.port, true)
                .await?;
            Ok::<_, OpenError>(
                tls_over(stream, &endpoint.host, endpoint.port, endpoint.tls.clone()).await?,
            )
        })
        .await
        .map_err(|_| OpenError::TimedOut {
            address: address.clone(),
            timeout: endpoint.connect_timeout,
        })??;
        let heard = Arc::new(AtomicU64::new(0));
        let keepalive = endpoint.keepalive.filter(|k| !k.is_zero());
        let framed = tls.get_ref().1.alpn_protocol() == Some(ALPN_FRAMED);
        let (link, inbound, head) = if endpoint.transport == Transport::Websocket {
            let heartbeat = Some(endpoint.websocket_heartbeat);
            let mut headers = metadata.into_headers();
            headers.insert(
                http::header::USER_AGENT,
                http::HeaderValue::from_static(USER_AGENT),
            );
            let (io, _) = websocket::connect(tls, &address, headers, heartbeat)
                .await
                .map_err(|source| OpenError::WebSocket {
                    address: address.clone(),
                    source,
                })?;
            Self::open_framed(Either::Right(io), &address, None, keepalive, &heard).await?
        } else if framed {
            let hello = Self::hello(metadata);
            Self::open_framed(Either::Left(tls), &address, Some(hello), keepalive, &heard).await?
        } else {
            Self::open_http2(tls, &address, endpoint, metadata, keepalive, &heard).await?
        };
        let outbound: OutboundBody = PacketBody::new(
            outbound.map(Ok as fn(Packet) -> Result<Packet, Status>),
            Role::Client,
            MAX_MESSAGE_SIZE,
        );
        let connection = TunnelConnection {
            link,
            outbound,
            send_done: false,
            inbound: PacketStream::new(inbound, Direction::Response, MAX_MESSAGE_SIZE),
            heard,
            passes: Passes::new(PARTS),
        };
        Ok((connection, MetadataMap::from_headers(head)))
    }

    /// The call on HTTP/2: the request, and the response's head.
    async fn open_http2(
        tls: Tls,
        address: &str,
        endpoint: &Endpoint,
        metadata: MetadataMap,
        keepalive: Option<Duration>,
        heard: &Arc<AtomicU64>,
    ) -> Result<(Link, InboundBody<ReadHalf<Carrier>>, http::HeaderMap), OpenError> {
        let http2 = |source| OpenError::Http2 {
            address: address.to_owned(),
            source,
        };
        let (mut requests, mut conn) = h2::client::Builder::new()
            .initial_window_size(endpoint.windows.stream)
            .initial_connection_window_size(endpoint.windows.connection)
            .max_frame_size(MAX_FRAME_SIZE)
            // hyper's default, which the tunnels had before.
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .enable_push(false)
            .handshake::<_, Bytes>(tls)
            .await
            .map_err(http2)?;
        let request = grpc_request(
            &format!("https://{address}{AGENT_CONNECT_PATH}"),
            metadata.into_headers(),
            USER_AGENT,
        )?;
        let ping_pong = conn.ping_pong();
        // The request goes out and the answer comes in only while the
        // connection is polled.
        let (response, send) = {
            let opened = async {
                std::future::poll_fn(|cx| requests.poll_ready(cx))
                    .await
                    .map_err(http2)?;
                let (response, send) = requests.send_request(request, false).map_err(http2)?;
                Ok::<_, OpenError>((response.await.map_err(http2)?, send))
            };
            tokio::pin!(opened);
            tokio::select! {
                biased;
                opened = &mut opened => opened?,
                ended = &mut conn => {
                    ended.map_err(http2)?;
                    return Err(OpenError::Closed { address: address.to_owned() });
                }
            }
        };
        let (head, recv) = response.into_parts();
        check_response_head(head.status, &head.headers).map_err(OpenError::Rejected)?;
        let keepalive = keepalive
            .zip(ping_pong)
            .map(|(interval, ping_pong)| KeepAlive::new(interval, ping_pong));
        let link = Link::Http2 {
            conn,
            conn_done: false,
            send,
            keepalive,
        };
        let inbound = InboundBody::Http2(RecvBody::counted(recv, heard.clone()));
        Ok((link, inbound, head.headers))
    }

    /// The lean framing's hello for the call with `metadata`.
    fn hello(metadata: MetadataMap) -> Hello {
        let mut headers = metadata.into_headers();
        headers.insert(
            http::header::USER_AGENT,
            http::HeaderValue::from_static(USER_AGENT),
        );
        Hello {
            path: AGENT_CONNECT_PATH.to_owned(),
            headers,
        }
    }

    /// The call in the lean framing: the hello (unless the WebSocket
    /// upgrade was it), and the server's head.
    async fn open_framed(
        carrier: Carrier,
        address: &str,
        hello: Option<Hello>,
        keepalive: Option<Duration>,
        heard: &Arc<AtomicU64>,
    ) -> Result<(Link, InboundBody<ReadHalf<Carrier>>, http::HeaderMap), OpenError> {
        let failed = |source| OpenError::Framed {
            address: address.to_owned(),
            source,
        };
        let websocket = matches!(carrier, Either::Right(_));
        let (read, write) = tokio::io::split(carrier);
        let control = Arc::new(Control::default());
        let mut body = FramedBody::new(read, control.clone(), heard.clone(), MAX_MESSAGE_SIZE);
        let mut writer = FrameWriter::new(write, control.clone());
        if let Some(hello) = hello {
            writer.queue(hello.encode().map_err(failed)?);
            std::future::poll_fn(|cx| writer.poll_write_queued(cx))
                .await
                .map_err(failed)?;
        }
        let head = body.head().await.map_err(failed)?;
        check_response_head(http::StatusCode::OK, &head).map_err(OpenError::Rejected)?;
        let link = Link::Framed {
            writer,
            keepalive: keepalive.map(|interval| framed::KeepAlive::new(interval, control)),
            websocket,
        };
        Ok((link, InboundBody::Framed(body), head))
    }

    /// Whether the call runs in the lean framing rather than on HTTP/2.
    pub fn is_framed(&self) -> bool {
        matches!(self.link, Link::Framed { .. })
    }

    /// What carries the call, for logs: `grpc` (HTTP/2), `lean` (the lean
    /// framing on TLS) or `websocket`.
    pub fn transport_name(&self) -> &'static str {
        match self.link {
            Link::Http2 { .. } => "grpc",
            Link::Framed {
                websocket: false, ..
            } => "lean",
            Link::Framed {
                websocket: true, ..
            } => "websocket",
        }
    }

    /// The server's next packet, while sending ours and keeping the
    /// connection alive.
    pub async fn next_packet(&mut self) -> Driven {
        std::future::poll_fn(|cx| self.poll_drive(cx, true)).await
    }

    /// Sends our packets and keeps the connection alive without reading the
    /// server's: resolves only when the connection fails.
    pub async fn drive(&mut self) -> Status {
        loop {
            if let Driven::Failed(status) =
                std::future::poll_fn(|cx| self.poll_drive(cx, false)).await
            {
                return status;
            }
        }
    }

    /// Sends what is still queued, ends our side of the stream once the
    /// packets to send ended (they follow the tunnel's cancellation) and
    /// waits, within `grace`, for the server to end its side: closing the
    /// connection while the server's side is open would break the stream
    /// there, though we ended it.
    pub async fn finish(&mut self, grace: Duration) {
        let finished = async {
            // The tunnel is gone: what the server still sends has no reader.
            while let Driven::Packet(Ok(Some(_))) = self.next_packet().await {}
            // A pass that reports a packet returns before writing; this one
            // writes what is left (our END_STREAM, if the server ended first).
            std::future::poll_fn(|cx| {
                let _ = self.poll_drive(cx, false);
                Poll::Ready(())
            })
            .await;
        };
        let _ = tokio::time::timeout(grace, finished).await;
    }

    fn poll_drive(&mut self, cx: &mut Context<'_>, read: bool) -> Poll<Driven> {
        let passes = self.passes.clone();
        passes.poll(cx, |parts| self.pass(parts, read))
    }

    /// One poll of every part woken since its last; `Some` when there is
    /// something to report.
    fn pass(&mut self, parts: &Parts<'_>, read: bool) -> Option<Driven> {
        if let Some(mut cx) = parts.take(SEND)
            && let Err(status) = self.poll_send(&mut cx)
        {
            return Some(Driven::Failed(status));
        }
        if read
            && let Some(mut cx) = parts.take(RECEIVE)
            && let Poll::Ready(next) = Pin::new(&mut self.inbound).poll_next(&mut cx)
        {
            // More may be buffered already, with nothing to wake us.
            parts.wake(RECEIVE);
            return Some(Driven::Packet(next.transpose()));
        }
        let heard = self.heard.load(Ordering::Relaxed);
        match &mut self.link {
            Link::Http2 {
                conn,
                conn_done,
                keepalive,
                ..
            } => {
                if let Some(keepalive) = keepalive.as_mut()
                    && let Some(mut cx) = parts.take(KEEPALIVE)
                    && let Err(status) = keepalive.poll(&mut cx, heard)
                {
                    return Some(Driven::Failed(status));
                }
                // Last, so what the sends above queued (waking this part) is
                // written in this pass.
                if !*conn_done
                    && let Some(mut cx) = parts.take(CONNECTION)
                    && let Poll::Ready(ended) = Pin::new(conn).poll(&mut cx)
                {
                    *conn_done = true;
                    if let Err(e) = ended {
                        return Some(Driven::Failed(h2_status(e)));
                    }
                }
            }
            Link::Framed {
                writer, keepalive, ..
            } => {
                if let Some(keepalive) = keepalive.as_mut()
                    && let Some(mut cx) = parts.take(KEEPALIVE)
                {
                    match keepalive.poll(&mut cx, heard) {
                        Ok(true) => {
                            writer.queue_ping();
                            parts.wake(SEND);
                        }
                        Ok(false) => {}
                        Err(status) => return Some(Driven::Failed(status)),
                    }
                }
            }
        }
        None
    }

    /// Moves our packets onto the connection as far as it takes them (on
    /// HTTP/2, as far as the stream's window allows).
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Result<(), Status> {
        let sent = match &mut self.link {
            Link::Http2 { .. } if self.send_done => return Ok(()),
            Link::Http2 { send, .. } => poll_send_body(send, Pin::new(&mut self.outbound), cx),
            // Pings and pongs still go out after our end.
            Link::Framed { writer, .. } if self.send_done => {
                return match writer.poll_write_queued(cx) {
                    Poll::Ready(Err(status)) => Err(status),
                    _ => Ok(()),
                };
            }
            Link::Framed { writer, .. } => writer.poll_send_body(Pin::new(&mut self.outbound), cx),
        };
        if !matches!(sent, Ok(Sent::Pending)) {
            self.send_done = true;
        }
        sent.map(|_| ())
    }
}

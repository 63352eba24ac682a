//! Serving a streaming gRPC method of packets on HTTP/2 connections, each
//! driven by one task: the agent port's `AgentService.Connect` and the
//! client port's `ProxyService.Proxy`.
//!
//! Under hyper a packet crossed two task hand-offs in the server on each
//! port: hyper runs the connection in one task and each stream's response
//! body in another, and the stream's packets were read in a third. Here one
//! task polls the HTTP/2 connection, the packets its streams receive and
//! the packets to send them. The two directions of a stream stay
//! independent (a stream is read whether or not it has send window, as
//! hyper reads it), and a stream is polled only when something it waits on
//! woke it, so a connection with many streams costs per packet what one
//! with a single stream does.
//!
//! What a peer sees is what hyper served, but for hyper's `date` response
//! header (gRPC peers ignore it; grpc-go's server sends none): the same
//! HTTP/2 settings (windows, frame size, `--max-concurrent-streams`,
//! hyper's header-list and send-buffer limits), pings after the port's
//! keepalive time without a frame from the peer, answered within 20 s,
//! GOAWAY on shutdown once the connection had its first-request window,
//! trailers-only answers for unknown methods, compressed messages and
//! refusals (Go agents get theirs in the form they log, see
//! [`crate::agent_service`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::framed::{self, Control, FrameWriter, FramedBody, Hello, InboundBody};
use cluster_proxy_proto::grpc_framing::{Direction, PacketBody, PacketStream, Role};
use cluster_proxy_proto::h2_driver::{KeepAlive, Parts, Passes, RecvBody, Sent, poll_send_body};
use cluster_proxy_proto::transport::{MAX_FRAME_SIZE, MAX_MESSAGE_SIZE};
use futures_util::Stream;
use futures_util::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::metadata::MetadataMap;
use tracing::{debug, info};

use crate::first_bytes::{Rewind, read_version};
use crate::listener::{
    Alpn, FIRST_REQUEST_WINDOW, HEADER_READ_TIMEOUT, Http2Settings, PeerInfo, ServeConnection,
};
use crate::websocket_upgrade;

/// hyper's limits for what it serves, kept for our ports.
const MAX_HEADER_LIST_SIZE: u32 = 16 * 1024;
const MAX_SEND_BUFFER: usize = 400 * 1024;
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// The parts a connection's pass polls ([`Passes`]): its calls, the
/// keepalive and the connection itself (which also accepts new calls).
const STREAMS: usize = 0;
const KEEPALIVE: usize = 1;
const CONNECTION: usize = 2;
const PARTS: usize = 3;

/// The reading half of a connection in the lean framing.
pub type FramedRead = Pin<Box<dyn tokio::io::AsyncRead + Send>>;

/// The packets a peer sends on its stream (HTTP/2) or connection (the lean
/// framing).
pub type InboundPackets = PacketStream<InboundBody<FramedRead>>;

/// A call's stream loop: reads the peer's packets until its stream ends.
pub type Reader = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One bidirectional streaming method of packets.
pub trait PacketMethod: Send + Sync + 'static {
    /// The method's path (`/package.Service/Method`).
    const PATH: &'static str;
    /// The port serving it, in logs.
    const PORT: &'static str;
    /// Where the port takes the call as a WebSocket upgrade over HTTP/1.1
    /// ([`crate::websocket_upgrade`]); `None`: it does not.
    const WEBSOCKET_PATH: Option<&'static str> = None;
    type Outbound: Stream<Item = Result<Packet, Status>> + Send + Unpin + 'static;

    /// Admits the call whose request metadata is `metadata`, from `peer`,
    /// reading its packets from `inbound`. An `Err` is answered as a
    /// trailers-only response.
    fn open(
        &self,
        metadata: &MetadataMap,
        peer: &Arc<PeerInfo>,
        inbound: InboundPackets,
    ) -> Result<Opened<Self::Outbound>, Status>;
}

/// An admitted call: the response's metadata, the packets to send and the
/// loop reading the peer's packets, if the call reads them.
pub struct Opened<O> {
    pub metadata: MetadataMap,
    pub outbound: O,
    pub reader: Option<Reader>,
}

/// What tonic answers for a message encoding it was not built with; our
/// peers and upstream's never compress.
pub(crate) fn unsupported_encoding(headers: &http::HeaderMap) -> Option<Status> {
    let encoding = headers.get("grpc-encoding")?;
    if encoding.as_bytes() == b"identity" {
        return None;
    }
    let mut status = Status::unimplemented(format!(
        "Content is compressed with `{}` which isn't supported",
        String::from_utf8_lossy(encoding.as_bytes())
    ));
    status.metadata_mut().insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Some(status)
}

/// Serves `M` on every HTTP/2 connection it is given.
pub struct GrpcConnections<M> {
    pub method: M,
    /// `--max-packet-size`: the largest message a peer may send.
    pub max_packet_size: usize,
    pub http2: Http2Settings,
    pub shutdown: CancellationToken,
}

impl<M: PacketMethod> ServeConnection for GrpcConnections<M> {
    async fn serve<IO>(&self, io: IO, peer: PeerInfo, accepted_at: tokio::time::Instant)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        match (peer.alpn, M::WEBSOCKET_PATH) {
            (Alpn::Framed, _) => self.serve_framed(io, peer, None).await,
            (Alpn::Http11, Some(path)) => self.serve_websocket(io, peer, path).await,
            // A middlebox that re-originates TLS may offer no ALPN at all:
            // HTTP/2's preface tells gRPC from the WebSocket upgrade.
            (Alpn::None, Some(path)) => {
                let remote = peer.remote;
                let mut io = io;
                match tokio::time::timeout(HEADER_READ_TIMEOUT, read_version(&mut io)).await {
                    Ok(Ok((http::Version::HTTP_2, read))) => {
                        self.serve_http2(Rewind::new(io, read), peer, accepted_at)
                            .await
                    }
                    Ok(Ok((_, read))) => {
                        self.serve_websocket(Rewind::new(io, read), peer, path)
                            .await
                    }
                    Ok(Err(e)) => {
                        debug!(listener = M::PORT, %remote, error = %e, "connection ended before its first request")
                    }
                    Err(_) => {
                        debug!(listener = M::PORT, %remote, timeout = ?HEADER_READ_TIMEOUT, "no request in time; closing the connection")
                    }
                }
            }
            _ => self.serve_http2(io, peer, accepted_at).await,
        }
    }
}

impl<M: PacketMethod> GrpcConnections<M> {
    /// Serves a connection's calls on HTTP/2.
    async fn serve_http2<IO>(&self, io: IO, peer: PeerInfo, accepted_at: tokio::time::Instant)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let remote = peer.remote;
        let finish_from = async {
            self.shutdown.cancelled().await;
            tokio::time::sleep_until(accepted_at + FIRST_REQUEST_WINDOW).await;
        };
        tokio::pin!(finish_from);
        let mut builder = h2::server::Builder::new();
        builder
            .initial_window_size(self.http2.windows.stream)
            .initial_connection_window_size(self.http2.windows.connection)
            .max_frame_size(MAX_FRAME_SIZE)
            .max_concurrent_streams(self.http2.max_concurrent_streams)
            .max_header_list_size(MAX_HEADER_LIST_SIZE)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS));
        let conn = tokio::select! {
            handshake = builder.handshake::<_, Bytes>(io) => match handshake {
                Ok(conn) => conn,
                Err(e) => {
                    debug!(listener = M::PORT, %remote, error = %e, "HTTP/2 handshake failed");
                    return;
                }
            },
            // As hyper: a connection still in its handshake is dropped.
            _ = &mut finish_from => return,
        };
        let mut connection = Connection::new(self, conn, Arc::new(peer));
        let ended = tokio::select! {
            ended = connection.run() => ended,
            _ = &mut finish_from => {
                connection.conn.graceful_shutdown();
                // The GOAWAY goes out when the connection is polled, and an
                // idle one is polled only when woken.
                connection.passes.wake(CONNECTION);
                connection.run().await
            }
        };
        if let Err(status) = ended {
            debug!(listener = M::PORT, %remote, error = %status, "connection ended with an error");
        }
        connection.finish().await;
    }
}

/// The parts of a framed connection's pass: its packets to send (and
/// pings and pongs), the loop reading the peer's, the keepalive.
const FRAMED_SEND: usize = 0;
const FRAMED_READ: usize = 1;
const FRAMED_KEEPALIVE: usize = 2;
const FRAMED_PARTS: usize = 3;

/// How long a peer that ends its connection gets to take our close.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

impl<M: PacketMethod> GrpcConnections<M> {
    /// Serves the call of a WebSocket upgrade on `path`: its request's
    /// headers are the call's metadata, the lean framing's hello.
    async fn serve_websocket<IO>(&self, io: IO, peer: PeerInfo, path: &'static str)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let remote = peer.remote;
        let Some(accepted) = websocket_upgrade::upgrade(io, path, remote).await else {
            return;
        };
        // The agent's "connected" line follows with the same remote.
        info!(listener = M::PORT, %remote, transport = "websocket", "call upgraded to a WebSocket");
        let hello = Hello {
            path: M::PATH.to_owned(),
            headers: accepted.metadata,
        };
        self.serve_framed(accepted.io, peer, Some(hello)).await
    }

    /// Serves the one call of a connection in the lean framing
    /// ([`cluster_proxy_proto::framed`]): the hello (unless the WebSocket
    /// upgrade was it), then our head (or a refusal), then both directions
    /// until each has ended. On shutdown the call runs on as an HTTP/2
    /// stream does after GOAWAY: the tunnel ends it.
    async fn serve_framed<IO>(&self, io: IO, peer: PeerInfo, hello: Option<Hello>)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let remote = peer.remote;
        let (read, write) = tokio::io::split(io);
        let control = Arc::new(Control::default());
        let heard = Arc::new(AtomicU64::new(0));
        let mut body = FramedBody::new(
            Box::pin(read) as FramedRead,
            control.clone(),
            heard.clone(),
            self.max_packet_size,
        );
        let mut writer = FrameWriter::new(write, control.clone());
        let hello = match hello {
            Some(hello) => Ok(Ok(hello)),
            None => tokio::time::timeout(HEADER_READ_TIMEOUT, body.hello()).await,
        };
        let hello = match hello {
            Ok(Ok(hello)) => hello,
            Ok(Err(status)) => {
                debug!(listener = M::PORT, %remote, error = %status, "no call on a framed connection");
                return;
            }
            Err(_) => {
                debug!(listener = M::PORT, %remote, "no hello within {HEADER_READ_TIMEOUT:?}");
                return;
            }
        };
        let ended = match self.open_framed(hello, body, &Arc::new(peer)) {
            Ok((metadata, outbound, reader)) => {
                let mut head = metadata.into_headers();
                head.insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/grpc"),
                );
                match framed::head_frame(&head) {
                    Ok(frame) => {
                        writer.queue(frame);
                        let mut body = PacketBody::new(outbound, Role::Server, MAX_MESSAGE_SIZE);
                        let keepalive = self
                            .http2
                            .keepalive
                            .filter(|k| !k.is_zero())
                            .map(|interval| framed::KeepAlive::new(interval, control));
                        drive_framed(&mut writer, &mut body, reader, keepalive, &heard).await
                    }
                    Err(status) => Err(status),
                }
            }
            Err(status) => {
                let mut trailers = http::HeaderMap::new();
                match status
                    .add_header(&mut trailers)
                    .and_then(|()| framed::head_frame(&trailers))
                {
                    Ok(frame) => {
                        writer.queue(frame);
                        std::future::poll_fn(|cx| writer.poll_write_queued(cx)).await
                    }
                    Err(status) => Err(status),
                }
            }
        };
        if let Err(status) = ended {
            debug!(listener = M::PORT, %remote, error = %status, "framed connection ended with an error");
        }
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, writer.shutdown()).await;
    }

    /// Admits the call a hello opens, as [`Connection::answer`] admits one
    /// on HTTP/2.
    #[allow(clippy::type_complexity)]
    fn open_framed(
        &self,
        hello: Hello,
        body: FramedBody<FramedRead>,
        peer: &Arc<PeerInfo>,
    ) -> Result<(MetadataMap, M::Outbound, Option<Reader>), Status> {
        if hello.path != M::PATH {
            return Err(Status::unimplemented(""));
        }
        if let Some(status) = unsupported_encoding(&hello.headers) {
            return Err(status);
        }
        let inbound = PacketStream::new(
            InboundBody::Framed(body),
            Direction::Request,
            self.max_packet_size,
        );
        let metadata = MetadataMap::from_headers(hello.headers);
        let Opened {
            metadata,
            outbound,
            reader,
        } = self.method.open(&metadata, peer, inbound)?;
        Ok((metadata, outbound, reader))
    }
}

/// Drives a framed call until both directions ended (or the connection
/// failed): our packets out, the reader's loop, the keepalive.
async fn drive_framed<W, O>(
    writer: &mut FrameWriter<W>,
    body: &mut PacketBody<O>,
    mut reader: Option<Reader>,
    mut keepalive: Option<framed::KeepAlive>,
    heard: &AtomicU64,
) -> Result<(), Status>
where
    W: tokio::io::AsyncWrite + Unpin,
    O: Stream<Item = Result<Packet, Status>> + Unpin,
{
    let passes = Passes::new(FRAMED_PARTS);
    let mut send_done = false;
    std::future::poll_fn(|cx| {
        passes.poll(cx, |parts| {
            if let Some(mut cx) = parts.take(FRAMED_SEND) {
                if send_done {
                    // Pings and pongs still go out after our end.
                    if let Poll::Ready(Err(status)) = writer.poll_write_queued(&mut cx) {
                        return Some(Err(status));
                    }
                } else {
                    match writer.poll_send_body(Pin::new(&mut *body), &mut cx) {
                        Ok(Sent::Pending) => {}
                        Ok(Sent::Ended) => send_done = true,
                        Err(status) => return Some(Err(status)),
                    }
                }
            }
            if let Some(reading) = reader.as_mut()
                && let Some(mut cx) = parts.take(FRAMED_READ)
                && reading.as_mut().poll(&mut cx).is_ready()
            {
                reader = None;
            }
            if let Some(keepalive) = keepalive.as_mut()
                && let Some(mut cx) = parts.take(FRAMED_KEEPALIVE)
            {
                match keepalive.poll(&mut cx, heard.load(Ordering::Relaxed)) {
                    Ok(true) => {
                        writer.queue_ping();
                        parts.wake(FRAMED_SEND);
                    }
                    Ok(false) => {}
                    Err(status) => return Some(Err(status)),
                }
            }
            (send_done && reader.is_none()).then_some(Ok(()))
        })
    })
    .await
}

/// One connection: the HTTP/2 connection and its streams.
struct Connection<'a, M: PacketMethod, IO> {
    port: &'a GrpcConnections<M>,
    conn: h2::server::Connection<IO, Bytes>,
    peer: Arc<PeerInfo>,
    /// Each stream is polled when something it waits on woke it.
    streams: FuturesUnordered<CallStream<M::Outbound>>,
    keepalive: Option<KeepAlive>,
    /// Frames heard from the peer, so the keepalive pings only a silent one.
    heard: Arc<AtomicU64>,
    passes: Passes,
}

/// A call's stream: our packets to send and the loop reading the peer's.
struct CallStream<O> {
    send: Option<(h2::SendStream<Bytes>, PacketBody<O>)>,
    reader: Option<Reader>,
    /// Each direction is polled only when something it waits on woke it.
    passes: Passes,
}

/// A call's parts (its [`Passes`]).
const CALL_SEND: usize = 0;
const CALL_READ: usize = 1;
const CALL_PARTS: usize = 2;

impl<O> CallStream<O> {
    fn new(send: Option<(h2::SendStream<Bytes>, PacketBody<O>)>, reader: Option<Reader>) -> Self {
        CallStream {
            send,
            reader,
            passes: Passes::new(CALL_PARTS),
        }
    }
}

impl<O> Future for CallStream<O>
where
    O: Stream<Item = Result<Packet, Status>> + Unpin,
{
    type Output = ();

    /// Polls both directions; ready once both are done.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let CallStream {
            send,
            reader,
            passes,
        } = self.get_mut();
        passes.poll(cx, |parts| {
            if let Some((stream, body)) = send
                && let Some(mut cx) = parts.take(CALL_SEND)
            {
                match poll_send_body(stream, Pin::new(body), &mut cx) {
                    Ok(Sent::Pending) => {}
                    Ok(Sent::Ended) => *send = None,
                    Err(status) => {
                        debug!(error = %status, "sending to the peer failed");
                        *send = None;
                    }
                }
            }
            if let Some(reading) = reader
                && let Some(mut cx) = parts.take(CALL_READ)
                && reading.as_mut().poll(&mut cx).is_ready()
            {
                *reader = None;
            }
            (send.is_none() && reader.is_none()).then_some(())
        })
    }
}

impl<'a, M, IO> Connection<'a, M, IO>
where
    M: PacketMethod,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    fn new(
        port: &'a GrpcConnections<M>,
        mut conn: h2::server::Connection<IO, Bytes>,
        peer: Arc<PeerInfo>,
    ) -> Self {
        let keepalive = port
            .http2
            .keepalive
            .filter(|k| !k.is_zero())
            .zip(conn.ping_pong())
            .map(|(interval, ping_pong)| KeepAlive::new(interval, ping_pong));
        Connection {
            port,
            conn,
            peer,
            streams: FuturesUnordered::new(),
            keepalive,
            heard: Arc::new(AtomicU64::new(0)),
            passes: Passes::new(PARTS),
        }
    }

    /// Drives the connection until it ends: `Ok` once the peer closed it
    /// or it finished after a GOAWAY.
    async fn run(&mut self) -> Result<(), Status> {
        let passes = self.passes.clone();
        std::future::poll_fn(|cx| passes.poll(cx, |parts| self.pass(parts))).await
    }

    /// One poll of every part woken since its last; `Some` once the
    /// connection ended.
    fn pass(&mut self, parts: &Parts<'_>) -> Option<Result<(), Status>> {
        // Finished streams are dropped; an empty set is not an end.
        if let Some(mut cx) = parts.take(STREAMS) {
            while let Poll::Ready(Some(())) = Pin::new(&mut self.streams).poll_next(&mut cx) {}
        }
        if let Some(keepalive) = self.keepalive.as_mut()
            && let Some(mut cx) = parts.take(KEEPALIVE)
            && let Err(status) = keepalive.poll(&mut cx, self.heard.load(Ordering::Relaxed))
        {
            return Some(Err(status));
        }
        // Last, so what the streams queued above (waking this part) is
        // written in this pass.
        let mut cx = parts.take(CONNECTION)?;
        loop {
            match self.conn.poll_accept(&mut cx) {
                Poll::Ready(Some(Ok((request, respond)))) => {
                    self.heard.fetch_add(1, Ordering::Relaxed);
                    if let Some(stream) = self.answer(request, respond) {
                        self.streams.push(stream);
                        // Another pass polls it first, registering its wakers.
                        parts.wake(STREAMS);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    return Some(Err(cluster_proxy_proto::h2_driver::h2_status(e)));
                }
                Poll::Ready(None) => return Some(Ok(())),
                Poll::Pending => return None,
            }
        }
    }

    /// Answers a new stream: a call, or a refusal.
    fn answer(
        &self,
        request: http::Request<h2::RecvStream>,
        mut respond: h2::server::SendResponse<Bytes>,
    ) -> Option<CallStream<M::Outbound>> {
        let refuse = |mut respond: h2::server::SendResponse<Bytes>, status: Status| {
            let (head, ()) = status.into_http::<()>().into_parts();
            let _ = respond.send_response(http::Response::from_parts(head, ()), true);
            None
        };
        if request.uri().path() != M::PATH {
            return refuse(respond, Status::unimplemented(""));
        }
        if let Some(status) = unsupported_encoding(request.headers()) {
            return refuse(respond, status);
        }
        let (head, recv) = request.into_parts();
        let inbound = PacketStream::new(
            InboundBody::Http2(RecvBody::counted(recv, self.heard.clone())),
            Direction::Request,
            self.port.max_packet_size,
        );
        let metadata = MetadataMap::from_headers(head.headers);
        let Opened {
            metadata,
            outbound,
            reader,
        } = match self.port.method.open(&metadata, &self.peer, inbound) {
            Ok(opened) => opened,
            Err(status) => return refuse(respond, status),
        };
        let mut response = http::Response::new(());
        *response.headers_mut() = metadata.into_headers();
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        let send = match respond.send_response(response, false) {
            Ok(send) => send,
            Err(e) => {
                debug!(error = %e, "the peer's stream closed before its answer");
                // The reader sees the same and ends its call.
                return Some(CallStream::new(None, reader));
            }
        };
        let body = PacketBody::new(outbound, Role::Server, MAX_MESSAGE_SIZE);
        Some(CallStream::new(Some((send, body)), reader))
    }

    /// After the connection ended: its streams' readers see that and end
    /// their calls.
    async fn finish(self) {
        let Connection {
            conn, mut streams, ..
        } = self;
        drop(conn);
        for stream in streams.iter_mut() {
            stream.send = None;
        }
        while futures_util::StreamExt::next(&mut streams).await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use cluster_proxy_proto::grpc_framing::encode;
    use cluster_proxy_proto::packet;
    use futures_util::StreamExt;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;

    use super::*;
    use crate::listener::serve_in_memory;

    /// Answers every packet with itself, after a `seen` header naming the
    /// caller's `who` metadata; refuses callers without it.
    struct Echo;

    impl PacketMethod for Echo {
        const PATH: &'static str = "/Echo/Stream";
        const PORT: &'static str = "test";
        type Outbound = ReceiverStream<Result<Packet, Status>>;

        fn open(
            &self,
            metadata: &MetadataMap,
            _peer: &Arc<PeerInfo>,
            mut inbound: InboundPackets,
        ) -> Result<Opened<Self::Outbound>, Status> {
            let who = metadata
                .get("who")
                .cloned()
                .ok_or_else(|| Status::unauthenticated("who are you"))?;
            let (tx, rx) = mpsc::channel(4);
            let reader = async move {
                while let Some(p) = inbound.next().await {
                    let failed = p.is_err();
                    if tx.send(p).await.is_err() || failed {
                        return;
                    }
                }
            };
            let mut response = MetadataMap::new();
            response.insert("seen", who);
            Ok(Opened {
                metadata: response,
                outbound: ReceiverStream::new(rx),
                reader: Some(Box::pin(reader)),
            })
        }
    }

    /// A client connection to a connection served with `Echo` (packets up to
    /// `max_packet_size`).
    async fn connect(max_packet_size: usize) -> h2::client::SendRequest<Bytes> {
        let port = GrpcConnections {
            method: Echo,
            max_packet_size,
            http2: Http2Settings {
                keepalive: None,
                max_concurrent_streams: 1000,
                windows: cluster_proxy_proto::transport::CLIENT_WINDOWS,
            },
            shutdown: CancellationToken::new(),
        };
        let client = serve_in_memory(port);
        // A Rust client's windows (`connect_channel`): with h2's default
        // 64 KiB connection window, 200 streams would get their bytes in
        // fragments small enough for h2's framing-overhead guard to end
        // the connection.
        let windows = cluster_proxy_proto::transport::CLIENT_WINDOWS;
        let (send, conn) = h2::client::Builder::new()
            .initial_window_size(windows.stream)
            .initial_connection_window_size(windows.connection)
            .handshake(client)
            .await
            .unwrap();
        tokio::spawn(conn);
        send
    }

    fn request(path: &str, who: bool) -> http::Request<()> {
        let mut request = http::Request::builder()
            .method("POST")
            .uri(format!("http://server{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if who {
            request = request.header("who", "tester");
        }
        request.body(()).unwrap()
    }

    fn wire(packets: &[Packet]) -> Bytes {
        let mut wire = Vec::new();
        for p in packets {
            let e = encode(p, usize::MAX).unwrap();
            wire.extend_from_slice(&e.head);
            wire.extend_from_slice(e.payload.as_deref().unwrap_or_default());
        }
        Bytes::from(wire)
    }

    /// Sends `packets` on a new stream and ends it; returns the response.
    async fn call(
        client: &mut h2::client::SendRequest<Bytes>,
        request: http::Request<()>,
        packets: &[Packet],
    ) -> http::Response<h2::RecvStream> {
        let mut client = client.clone().ready().await.unwrap();
        let (response, mut send) = client.send_request(request, false).unwrap();
        send.send_data(wire(packets), true).unwrap();
        response.await.unwrap()
    }

    /// The packets of a response and the status in its trailers.
    async fn collect(response: http::Response<h2::RecvStream>) -> (Vec<Packet>, Status) {
        let recv = RecvBody::new(response.into_body());
        let mut body = PacketStream::new(recv, Direction::Response, 1 << 20);
        let mut got = Vec::new();
        while let Some(p) = body.next().await {
            match p {
                Ok(p) => got.push(p),
                Err(status) => return (got, status),
            }
        }
        (got, Status::ok(""))
    }

    /// Shutdown ends an idle connection: GOAWAY once its first-request
    /// window passed, then the close. Nothing on the wire wakes an idle
    /// connection's driver, so the shutdown itself must.
    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_an_idle_connection_with_goaway() {
        let shutdown = CancellationToken::new();
        let port = GrpcConnections {
            method: Echo,
            max_packet_size: 1024,
            http2: Http2Settings {
                keepalive: None,
                max_concurrent_streams: 1000,
                windows: cluster_proxy_proto::transport::CLIENT_WINDOWS,
            },
            shutdown: shutdown.clone(),
        };
        let (mut send, conn) = h2::client::handshake(serve_in_memory(port)).await.unwrap();
        let conn = tokio::spawn(conn);
        // A call answered, so the connection ran and went idle.
        let packets = vec![packet::close_request(1)];
        let (echoed, status) =
            collect(call(&mut send, request("/Echo/Stream", true), &packets).await).await;
        assert_eq!((echoed, status.code()), (packets, tonic::Code::Ok));

        shutdown.cancel();
        let ended = tokio::time::timeout(FIRST_REQUEST_WINDOW * 10, conn)
            .await
            .expect("the server ends the idle connection")
            .unwrap();
        assert!(ended.is_ok(), "ended gracefully: {ended:?}");
    }

    #[tokio::test]
    async fn packets_come_back_with_metadata_and_an_ok_status() {
        let mut client = connect(1 << 20).await;
        let sent = vec![
            packet::data(1, Bytes::from(vec![5u8; 10_000])),
            packet::close_request(1),
        ];
        let response = call(&mut client, request("/Echo/Stream", true), &sent).await;
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert_eq!(response.headers()["seen"], "tester");
        let (got, status) = collect(response).await;
        assert_eq!(got, sent);
        assert_eq!(status.code(), tonic::Code::Ok);
    }

    /// Streams are polled when woken, not all at once: each of many
    /// concurrent streams on one connection still gets its own packets.
    #[tokio::test]
    async fn many_streams_on_one_connection_each_get_their_own_packets() {
        let client = connect(1 << 20).await;
        let calls = (0..200u8).map(|i| {
            let mut client = client.clone();
            async move {
                let sent = vec![packet::data(i64::from(i), Bytes::from(vec![i; 3000]))];
                let response = call(&mut client, request("/Echo/Stream", true), &sent).await;
                let (got, status) = collect(response).await;
                assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
                assert_eq!(got, sent);
            }
        });
        futures_util::future::join_all(calls).await;
    }

    #[tokio::test]
    async fn a_refused_call_is_a_trailers_only_response() {
        let mut client = connect(1 << 20).await;
        let response = call(&mut client, request("/Echo/Stream", false), &[]).await;
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::Unauthenticated, "who are you")
        );
        assert!(response.body().is_end_stream());
    }

    #[tokio::test]
    async fn unknown_methods_and_compressed_messages_are_unimplemented() {
        let mut client = connect(1 << 20).await;
        let response = call(&mut client, request("/Echo/Other", true), &[]).await;
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unimplemented);

        let mut gzip = request("/Echo/Stream", true);
        gzip.headers_mut()
            .insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
        let response = call(&mut client, gzip, &[]).await;
        assert_eq!(response.headers()["grpc-accept-encoding"], "identity");
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unimplemented);
        assert!(status.message().contains("gzip"), "{status:?}");
    }

    #[tokio::test]
    async fn an_oversized_message_fails_the_call_with_out_of_range() {
        let mut client = connect(100).await;
        let big = packet::data(1, Bytes::from(vec![0u8; 1000]));
        let response = call(&mut client, request("/Echo/Stream", true), &[big]).await;
        let (got, status) = collect(response).await;
        assert!(got.is_empty(), "{got:?}");
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert!(status.message().contains("too large"), "{status:?}");
    }
}

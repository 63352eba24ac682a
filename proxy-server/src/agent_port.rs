//! The agent port's connections, each driven by one task.
//!
//! Under hyper a packet crossed two task hand-offs in the server on its
//! way to or from an agent: hyper runs the connection in one task and each
//! stream's response body in another, and the agent's packets were read in
//! a third. Here one task polls the HTTP/2 connection, the agent's packets
//! and the packets to send it; the two directions stay independent (a
//! stream is read whether or not it has send window, as hyper reads it).
//!
//! What an agent sees is what hyper served, but for hyper's `date` response
//! header (gRPC peers ignore it; grpc-go's server sends none): the same HTTP/2 settings
//! (windows, frame size, `--max-concurrent-streams`, hyper's header-list
//! and send-buffer limits), pings after `--keepalive-time` without a frame
//! from the agent answered within 20 s, GOAWAY on shutdown once the
//! connection had its first-request window, trailers-only answers for
//! unknown methods, compressed messages and refusals (Go agents get theirs
//! in the form they log, see [`crate::agent_service`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use cluster_proxy_proto::grpc_framing::{
    AGENT_CONNECT_PATH, Direction, PacketBody, PacketStream, Role,
};
use cluster_proxy_proto::h2_driver::{KeepAlive, Passes, RecvBody, Sent, poll_send_body};
use cluster_proxy_proto::transport::{MAX_FRAME_SIZE, MAX_MESSAGE_SIZE};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::metadata::MetadataMap;
use tracing::debug;

use crate::agent_service::{AgentEndpoint, Opened};
use crate::grpc_service::unsupported_encoding;
use crate::listener::{FIRST_REQUEST_WINDOW, Http2Settings, PeerInfo, ServeConnection};
use crate::tunnel::OutboundStream;

/// hyper's limits for what it serves, kept for the agent port.
const MAX_HEADER_LIST_SIZE: u32 = 16 * 1024;
const MAX_SEND_BUFFER: usize = 400 * 1024;
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// Serves `AgentService.Connect` on every connection of the agent port.
pub struct AgentConnections {
    pub endpoint: AgentEndpoint,
    /// `--max-packet-size`: the largest message an agent may send.
    pub max_packet_size: usize,
    pub http2: Http2Settings,
    pub shutdown: CancellationToken,
}

impl ServeConnection for AgentConnections {
    async fn serve<IO>(&self, io: IO, peer: PeerInfo, accepted_at: tokio::time::Instant)
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
                    debug!(listener = "agent", %remote, error = %e, "HTTP/2 handshake failed");
                    return;
                }
            },
            // As hyper: a connection still in its handshake is dropped.
            _ = &mut finish_from => return,
        };
        let mut connection = AgentConnection::new(self, conn, Arc::new(peer));
        let ended = tokio::select! {
            ended = connection.run() => ended,
            _ = &mut finish_from => {
                connection.conn.graceful_shutdown();
                connection.run().await
            }
        };
        if let Err(status) = ended {
            debug!(listener = "agent", %remote, error = %status, "connection ended with an error");
        }
        connection.finish().await;
    }
}

/// One agent connection: the HTTP/2 connection and its streams.
struct AgentConnection<'a, IO> {
    port: &'a AgentConnections,
    conn: h2::server::Connection<IO, Bytes>,
    peer: Arc<PeerInfo>,
    streams: Vec<TunnelStream>,
    keepalive: Option<KeepAlive>,
    /// Frames heard from the agent, so the keepalive pings only a silent one.
    heard: Arc<AtomicU64>,
    passes: Passes,
}

/// A `Connect` stream: our packets to send and the loop reading the agent's.
struct TunnelStream {
    send: Option<(h2::SendStream<Bytes>, PacketBody<OutboundStream>)>,
    reader: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl TunnelStream {
    /// Polls both directions; true once both are done.
    fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some((send, body)) = &mut self.send {
            match poll_send_body(send, Pin::new(body), cx) {
                Ok(Sent::Pending) => {}
                Ok(Sent::Ended) => self.send = None,
                Err(status) => {
                    debug!(error = %status, "sending to the agent failed");
                    self.send = None;
                }
            }
        }
        if let Some(reader) = &mut self.reader
            && reader.as_mut().poll(cx).is_ready()
        {
            self.reader = None;
        }
        self.send.is_none() && self.reader.is_none()
    }
}

impl<'a, IO> AgentConnection<'a, IO>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    fn new(
        port: &'a AgentConnections,
        mut conn: h2::server::Connection<IO, Bytes>,
        peer: Arc<PeerInfo>,
    ) -> Self {
        let keepalive = port
            .http2
            .keepalive
            .filter(|k| !k.is_zero())
            .zip(conn.ping_pong())
            .map(|(interval, ping_pong)| KeepAlive::new(interval, ping_pong));
        AgentConnection {
            port,
            conn,
            peer,
            streams: Vec::new(),
            keepalive,
            heard: Arc::new(AtomicU64::new(0)),
            passes: Passes::default(),
        }
    }

    /// Drives the connection until it ends: `Ok` once the agent closed it
    /// or it finished after a GOAWAY.
    async fn run(&mut self) -> Result<(), Status> {
        let passes = self.passes.clone();
        std::future::poll_fn(|cx| passes.poll(cx, |parts| self.pass(parts))).await
    }

    /// One poll of every part; `Some` once the connection ended.
    fn pass(&mut self, cx: &mut Context<'_>) -> Option<Result<(), Status>> {
        self.streams.retain_mut(|stream| !stream.poll(cx));
        if let Some(keepalive) = self.keepalive.as_mut()
            && let Err(status) = keepalive.poll(cx, self.heard.load(Ordering::Relaxed))
        {
            return Some(Err(status));
        }
        // Last, so what the streams queued above is written in this pass.
        loop {
            match self.conn.poll_accept(cx) {
                Poll::Ready(Some(Ok((request, respond)))) => {
                    self.heard.fetch_add(1, Ordering::Relaxed);
                    if let Some(mut stream) = self.answer(request, respond) {
                        // Its first poll registers its wakers.
                        if !stream.poll(cx) {
                            self.streams.push(stream);
                        }
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

    /// Answers a new stream: a tunnel, or a refusal.
    fn answer(
        &self,
        request: http::Request<h2::RecvStream>,
        mut respond: h2::server::SendResponse<Bytes>,
    ) -> Option<TunnelStream> {
        let refuse = |mut respond: h2::server::SendResponse<Bytes>, status: Status| {
            let (head, ()) = status.into_http::<()>().into_parts();
            let _ = respond.send_response(http::Response::from_parts(head, ()), true);
            None
        };
        if request.uri().path() != AGENT_CONNECT_PATH {
            return refuse(respond, Status::unimplemented(""));
        }
        if let Some(status) = unsupported_encoding(request.headers()) {
            return refuse(respond, status);
        }
        let (head, recv) = request.into_parts();
        let inbound = PacketStream::new(
            RecvBody::counted(recv, self.heard.clone()),
            Direction::Request,
            self.port.max_packet_size,
        );
        let metadata = MetadataMap::from_headers(head.headers);
        let Opened {
            metadata,
            outbound,
            reader,
        } = match self.port.endpoint.open(&metadata, &self.peer, inbound) {
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
                debug!(error = %e, "the agent's stream closed before its answer");
                // The reader sees the same and ends the tunnel.
                return Some(TunnelStream { send: None, reader });
            }
        };
        let body = PacketBody::new(outbound, Role::Server, MAX_MESSAGE_SIZE);
        Some(TunnelStream {
            send: Some((send, body)),
            reader,
        })
    }

    /// After the connection ended: its streams' readers see that and end
    /// their tunnels.
    async fn finish(self) {
        let AgentConnection { conn, streams, .. } = self;
        drop(conn);
        let readers = streams.into_iter().filter_map(|s| s.reader);
        futures_util::future::join_all(readers).await;
    }
}

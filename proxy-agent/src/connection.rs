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
//! On the wire the call is what tonic sent (the agent's metadata, `te` and
//! `content-type`; our own `user-agent`), with the same HTTP/2 settings,
//! messages framed by [`cluster_proxy_proto::grpc_framing`], and pings
//! after `--keepalive-time` without a packet from the server, answered
//! within 20 s or the tunnel fails, as hyper's keepalive did.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::grpc_framing::{
    AGENT_CONNECT_PATH, Direction, PacketBody, PacketStream, Role, check_response_head,
};
use cluster_proxy_proto::transport::{
    HttpWindows, MAX_FRAME_SIZE, MAX_MESSAGE_SIZE, TransportError, connect_tls, host_port,
};
use futures_util::task::AtomicWaker;
use futures_util::{Stream, StreamExt};
use http_body::{Body, Frame};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tonic::Status;
use tonic::metadata::MetadataMap;

/// Time a keepalive PING has to be answered (gRPC's default, as before).
const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Passes over the connection's parts in one poll before the task lets
/// others run: a peer that keeps the connection busy cannot hold a worker.
const MAX_PASSES: usize = 32;

/// Bytes the stream may have queued beyond what the server's window lets
/// out (hyper's default for its clients).
const MAX_SEND_BUFFER: usize = 1024 * 1024;

/// The packets the agent sends, as the tunnel produces them.
pub type Outbound = Pin<Box<dyn Stream<Item = Packet> + Send>>;

type OutboundBody =
    PacketBody<futures_util::stream::Map<Outbound, fn(Packet) -> Result<Packet, Status>>>;

/// Why an attempt to open a tunnel's connection failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("HTTP/2 with {address}: {source}")]
    Http2 {
        address: String,
        #[source]
        source: h2::Error,
    },
    #[error("the connection to {address} ended before the server answered")]
    Closed { address: String },
    #[error("Connect request: {0}")]
    Request(#[from] http::Error),
    /// The server answered with an error (a refusal).
    #[error("Connect rejected: {} {}", .0.code(), .0.message())]
    Rejected(Status),
}

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub tls: Arc<rustls::ClientConfig>,
    pub connect_timeout: Duration,
    pub windows: HttpWindows,
    /// Ping after this long without a packet from the server; `None` or
    /// zero: no pings.
    pub keepalive: Option<Duration>,
}

/// One `AgentService.Connect` call on a connection of its own.
pub struct TunnelConnection {
    conn: h2::client::Connection<TlsStream<TcpStream>, Bytes>,
    conn_done: bool,
    send: h2::SendStream<Bytes>,
    outbound: OutboundBody,
    send_done: bool,
    inbound: PacketStream<RecvBody>,
    keepalive: Option<KeepAlive>,
    /// Packets read, so the keepalive knows whether the server was heard.
    packets_read: u64,
    pass: Arc<PassWaker>,
    pass_waker: Waker,
}

impl std::fmt::Debug for TunnelConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelConnection")
            .field("conn_done", &self.conn_done)
            .field("send_done", &self.send_done)
            .finish_non_exhaustive()
    }
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
        let tls = connect_tls(
            &endpoint.host,
            endpoint.port,
            endpoint.tls.clone(),
            endpoint.connect_timeout,
        )
        .await?;
        let http2 = |source| OpenError::Http2 {
            address: address.clone(),
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
        let mut request = http::Request::builder()
            .method(http::Method::POST)
            .uri(format!("https://{address}{AGENT_CONNECT_PATH}"))
            .body(())?;
        *request.headers_mut() = metadata.into_headers();
        let headers = request.headers_mut();
        headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        headers.insert(
            http::header::USER_AGENT,
            http::HeaderValue::from_static(concat!(
                "cluster-proxy-agent/",
                env!("CARGO_PKG_VERSION")
            )),
        );
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
                    return Err(OpenError::Closed { address: address.clone() });
                }
            }
        };
        let (head, recv) = response.into_parts();
        check_response_head(head.status, &head.headers).map_err(OpenError::Rejected)?;
        let keepalive = endpoint
            .keepalive
            .filter(|k| !k.is_zero())
            .zip(ping_pong)
            .map(|(interval, ping_pong)| KeepAlive::new(interval, ping_pong));
        let pass = Arc::new(PassWaker::default());
        let outbound: OutboundBody = PacketBody::new(
            outbound.map(Ok as fn(Packet) -> Result<Packet, Status>),
            Role::Client,
            MAX_MESSAGE_SIZE,
        );
        let connection = TunnelConnection {
            conn,
            conn_done: false,
            send,
            outbound,
            send_done: false,
            inbound: PacketStream::new(RecvBody(recv), Direction::Response, MAX_MESSAGE_SIZE),
            keepalive,
            packets_read: 0,
            pass_waker: Waker::from(pass.clone()),
            pass,
        };
        Ok((connection, MetadataMap::from_headers(head.headers)))
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
        self.pass.task.register(cx.waker());
        let waker = self.pass_waker.clone();
        let mut parts = Context::from_waker(&waker);
        for _ in 0..MAX_PASSES {
            self.pass.polling.store(true, Ordering::SeqCst);
            self.pass.woken.store(false, Ordering::SeqCst);
            let outcome = self.pass(&mut parts, read);
            self.pass.polling.store(false, Ordering::SeqCst);
            if let Some(driven) = outcome {
                // A wake seen during this pass is served by the next one,
                // which the caller starts right after handling this.
                return Poll::Ready(driven);
            }
            if !self.pass.woken.swap(false, Ordering::SeqCst) {
                return Poll::Pending;
            }
            // Tokio's cooperative budget spent: every resource now answers
            // Pending and wakes us, so another pass would only spin. The
            // scheduler refills the budget when the task runs again.
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// One poll of every part; `Some` when there is something to report.
    fn pass(&mut self, cx: &mut Context<'_>, read: bool) -> Option<Driven> {
        if let Err(status) = self.poll_send(cx) {
            return Some(Driven::Failed(status));
        }
        if read && let Poll::Ready(next) = Pin::new(&mut self.inbound).poll_next(cx) {
            self.packets_read = self.packets_read.wrapping_add(1);
            return Some(Driven::Packet(next.transpose()));
        }
        if let Some(keepalive) = self.keepalive.as_mut()
            && let Err(status) = keepalive.poll(cx, self.packets_read)
        {
            return Some(Driven::Failed(status));
        }
        // Last, so what the sends above queued is written in this pass.
        if !self.conn_done
            && let Poll::Ready(ended) = Pin::new(&mut self.conn).poll(cx)
        {
            self.conn_done = true;
            if let Err(e) = ended {
                return Some(Driven::Failed(h2_status(e)));
            }
        }
        None
    }

    /// Moves our packets into the stream as far as its window allows (as
    /// hyper does: a body is polled only with send capacity).
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Result<(), Status> {
        while !self.send_done {
            self.send.reserve_capacity(1);
            if self.send.capacity() == 0 {
                match self.send.poll_capacity(cx) {
                    Poll::Ready(Some(Ok(0))) => continue,
                    Poll::Ready(Some(Ok(_))) => {}
                    Poll::Ready(Some(Err(e))) => return Err(h2_status(e)),
                    Poll::Ready(None) => {
                        return Err(Status::unavailable("the tunnel's HTTP/2 stream closed"));
                    }
                    Poll::Pending => return Ok(()),
                }
            }
            match Pin::new(&mut self.outbound).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    // A client's body has no trailers.
                    if let Ok(data) = frame.into_data() {
                        self.send.send_data(data, false).map_err(h2_status)?;
                    }
                }
                Poll::Ready(Some(Err(status))) => {
                    self.send.send_reset(h2::Reason::INTERNAL_ERROR);
                    self.send_done = true;
                    return Err(status);
                }
                Poll::Ready(None) => {
                    self.send_done = true;
                    self.send.send_data(Bytes::new(), true).map_err(h2_status)?;
                }
                Poll::Pending => return Ok(()),
            }
        }
        Ok(())
    }
}

fn h2_status(e: h2::Error) -> Status {
    Status::from_error(Box::new(e))
}

/// The waker every part of the connection is polled with. A wake while the
/// tunnel's task is inside [`TunnelConnection::poll_drive`] (h2 waking the
/// connection after a send, or the stream's reader after the connection
/// read a frame) only asks for another pass; one from elsewhere wakes the
/// task. A task woken while it runs is rescheduled after its poll, and on a
/// multi-threaded runtime another worker is woken to take it.
#[derive(Debug, Default)]
struct PassWaker {
    task: AtomicWaker,
    polling: AtomicBool,
    woken: AtomicBool,
}

impl Wake for PassWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

/// HTTP/2 keepalive: a PING once the server was silent for `interval`,
/// which must be answered within [`PING_TIMEOUT`].
struct KeepAlive {
    interval: Duration,
    ping_pong: h2::PingPong,
    timer: Pin<Box<tokio::time::Sleep>>,
    awaiting_pong: bool,
    /// Packets read when the timer was set.
    packets_at_arm: u64,
}

impl KeepAlive {
    fn new(interval: Duration, ping_pong: h2::PingPong) -> Self {
        KeepAlive {
            interval,
            ping_pong,
            timer: Box::pin(tokio::time::sleep(interval)),
            awaiting_pong: false,
            packets_at_arm: 0,
        }
    }

    fn arm(&mut self, after: Duration, packets_read: u64) {
        self.packets_at_arm = packets_read;
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + after);
    }

    fn poll(&mut self, cx: &mut Context<'_>, packets_read: u64) -> Result<(), Status> {
        loop {
            if self.awaiting_pong {
                match self.ping_pong.poll_pong(cx) {
                    Poll::Ready(Ok(_)) => {
                        self.awaiting_pong = false;
                        self.arm(self.interval, packets_read);
                        continue;
                    }
                    Poll::Ready(Err(e)) => return Err(h2_status(e)),
                    Poll::Pending => {}
                }
                if self.timer.as_mut().poll(cx).is_ready() {
                    return Err(Status::unavailable(format!(
                        "keepalive ping not answered within {PING_TIMEOUT:?}"
                    )));
                }
                return Ok(());
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
            if packets_read != self.packets_at_arm {
                // The server was heard from meanwhile.
                self.arm(self.interval, packets_read);
                continue;
            }
            self.ping_pong
                .send_ping(h2::Ping::opaque())
                .map_err(h2_status)?;
            self.awaiting_pong = true;
            self.arm(PING_TIMEOUT, packets_read);
        }
    }
}

/// The response's stream as an HTTP body, giving its window back as soon as
/// a chunk is taken (the tunnel's own flow control bounds what the server
/// may send per connection; see `cluster_proxy_proto::flow`), as hyper does.
struct RecvBody(h2::RecvStream);

impl Body for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let recv = &mut self.get_mut().0;
        match recv.poll_data(cx) {
            Poll::Ready(Some(Ok(data))) => {
                // Fails only once the stream is gone, which the next poll reports.
                let _ = recv.flow_control().release_capacity(data.len());
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => match recv.poll_trailers(cx) {
                Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                Poll::Ready(Ok(None)) => Poll::Ready(None),
                Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
                Poll::Pending => Poll::Pending,
            },
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wake from outside the poll reaches the task; one during the poll
    /// only marks another pass.
    #[test]
    fn a_wake_during_the_poll_asks_for_a_pass_and_one_after_it_wakes_the_task() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count(Default::default()));
        let task = Waker::from(count.clone());
        let pass = Arc::new(PassWaker::default());
        pass.task.register(&task);
        let waker = Waker::from(pass.clone());

        pass.polling.store(true, Ordering::SeqCst);
        waker.wake_by_ref();
        assert!(
            pass.woken.load(Ordering::SeqCst),
            "the pass loop must see it"
        );
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "the running task is not woken"
        );

        pass.polling.store(false, Ordering::SeqCst);
        pass.woken.store(false, Ordering::SeqCst);
        waker.wake_by_ref();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "an idle task is woken");
    }
}

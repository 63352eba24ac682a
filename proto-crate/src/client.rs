//! A tunnel dialer for Rust users: open a TCP connection to `host:port` inside
//! a managed cluster through a proxy-server's gRPC client port.
//!
//! Each dial is one `ProxyService.Proxy` stream (konnectivity's contract), and
//! many dials share one HTTP/2 connection. The returned [`TunnelStream`] is an
//! ordinary `AsyncRead + AsyncWrite`. Konnectivity has no half-close: shutting
//! down the write side sends CLOSE_REQ, which closes the tunneled connection
//! once the agent has flushed what was written.
//!
//! A connection's first bytes can ride in its dial request (the early-data
//! extension: [`TunnelClient::dial_with_early_data`], and
//! [`TunnelClient::dial_lazily`] for TLS and hyper, whose first write is
//! the early data), which saves a round trip through the tunnel for every
//! protocol whose client speaks first.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::PollSender;
use tonic::transport::Channel;

use crate::Packet;
use crate::dial_error::ConnectError;
pub use crate::dial_error::DialError;
use crate::flow::READ_CHUNK;
use crate::grpc_framing::{PROXY_PATH, PacketStream, streaming_call};
use crate::h2_channel::{H2Channel, StreamSender};
use crate::packet::{self, Frame};
use crate::trace::{DirectSpan, TraceHeaders};
use crate::transport::MAX_MESSAGE_SIZE;
use opentelemetry::KeyValue;
use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::SpanKind;

/// Default time to wait for the agent's dial response (upstream's backstop).
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(30);

/// The most first bytes one dial request carries
/// ([`TunnelClient::dial_with_early_data`]); the rest follows as DATA. A TLS
/// ClientHello or an HTTP request head fits.
pub const MAX_EARLY_DATA: usize = 16 * 1024;

/// Dials through one proxy-server.
#[derive(Clone, Debug)]
pub struct TunnelClient {
    transport: Transport,
    dial_timeout: Duration,
    /// The tracer of this client's dial spans, when not the process's
    /// ([`crate::trace::install_tracer`]).
    tracer: Option<Arc<BoxedTracer>>,
}

/// The HTTP/2 connection dials are opened on.
#[derive(Clone, Debug)]
enum Transport {
    /// Any tonic channel (a Unix socket, a channel of the caller's): each
    /// stream's packets pass through a request-body task.
    Channel(Channel),
    /// Ours: each stream's packets are framed by the writer's task.
    H2(H2Channel),
}

impl TunnelClient {
    /// Dials over a tonic `Channel` (e.g. [`crate::transport::connect_channel`]).
    pub fn new(channel: Channel) -> Self {
        Self::on(Transport::Channel(channel))
    }

    /// Dials over an [`H2Channel`], where a write to a tunneled connection
    /// takes one hand-off between tasks fewer than over a `Channel`.
    pub fn over_h2(channel: H2Channel) -> Self {
        Self::on(Transport::H2(channel))
    }

    fn on(transport: Transport) -> Self {
        TunnelClient {
            transport,
            dial_timeout: DEFAULT_DIAL_TIMEOUT,
            tracer: None,
        }
    }

    /// Makes this client's dial spans with `tracer` instead of the
    /// process's tracer (`cluster_proxy_runtime::telemetry::init` installs
    /// that one; without either, the dial spans come from OpenTelemetry's
    /// global tracer provider, a no-op unless the program set one).
    pub fn with_tracer(mut self, tracer: BoxedTracer) -> Self {
        self.tracer = Some(Arc::new(tracer));
        self
    }

    pub fn with_dial_timeout(mut self, timeout: Duration) -> Self {
        self.dial_timeout = timeout;
        self
    }

    /// Opens a connection to `address` (`host:port`, the host naming the
    /// cluster or a service the agent serves).
    ///
    /// The dial is a client span (`tunnel.dial`, a child of the caller's
    /// current `tracing` span when an OpenTelemetry layer records it); its
    /// W3C trace context goes to the server in the stream's metadata, so the
    /// server's and the agent's spans join the same trace. It is made with
    /// the OpenTelemetry API directly ([`DirectSpan`]): the dial is on the
    /// connection's path, and a `tracing` span costs a pass through every
    /// layer per creation, record, poll and close.
    pub async fn dial(&self, address: &str) -> Result<TunnelStream, DialError> {
        self.dial_with_early_data(address, Bytes::new()).await
    }

    /// [`TunnelClient::dial`], sending the connection's first bytes with the
    /// dial request: the agent writes them to the target as soon as it has
    /// connected, so a protocol whose client speaks first (HTTP, a TLS
    /// ClientHello) has its answer one round trip through the tunnel sooner,
    /// on a WAN link between hub and cluster that round trip's length. The
    /// returned stream has already sent `first`.
    ///
    /// Up to [`MAX_EARLY_DATA`] bytes ride in the dial request, the rest
    /// follow as DATA. When the server does not confirm that it delivered
    /// them (an upstream proxy-server drops the extension field), the client
    /// sends them as DATA after the dial, so the bytes arrive in every case.
    /// A failed dial drops them: the target was never reached.
    pub async fn dial_with_early_data(
        &self,
        address: &str,
        first: Bytes,
    ) -> Result<TunnelStream, DialError> {
        let span = self.dial_span(address);
        self.dial_traced(span, address, first)
            .await
            .map(|open| TunnelStream {
                state: StreamState::Open(open),
            })
    }

    /// A stream to `address` that dials on first use, without waiting:
    /// the first write (up to [`MAX_EARLY_DATA`] bytes of it) rides in the
    /// dial request as with [`TunnelClient::dial_with_early_data`], and a
    /// read before any write dials without data (for protocols whose server
    /// speaks first). Until the agent has answered, further writes wait; a
    /// failed dial is the error of the next read or write
    /// ([`std::io::ErrorKind::ConnectionRefused`] for the agent's refusal,
    /// `TimedOut` for the dial timeout) whose inner error is the
    /// [`ConnectError`] a plain dial would have returned: through hyper or
    /// kube, [`ConnectError::find_in`] finds it in the request's error.
    ///
    /// This is what lets a TLS client (whose ClientHello is its first write)
    /// or hyper save a tunneled round trip per connection without knowing
    /// about the tunnel. The dial runs as a task of its own, so it proceeds
    /// whether or not the stream is polled.
    pub fn dial_lazily(&self, address: &str) -> TunnelStream {
        TunnelStream {
            state: StreamState::Unsent(Box::new(LazyDial {
                client: self.clone(),
                address: address.to_owned(),
                span: self.dial_span(address),
            })),
        }
    }

    async fn dial_traced(
        &self,
        mut span: DirectSpan,
        address: &str,
        first: Bytes,
    ) -> Result<OpenStream, DialError> {
        if !first.is_empty() {
            span.set_attributes(|| {
                [KeyValue::new(
                    "cluster_proxy.early_data_bytes",
                    i64::try_from(first.len()).unwrap_or(i64::MAX),
                )]
            });
        }
        let result = self.dial_in(address, span.headers(), first).await;
        if let Err(e) = &result {
            span.fail(&e.to_string());
        }
        result
    }

    fn dial_span(&self, address: &str) -> DirectSpan {
        let global;
        let tracer = match self
            .tracer
            .as_deref()
            .or_else(|| DirectSpan::installed_tracer())
        {
            Some(tracer) => tracer,
            // A program that set OpenTelemetry up itself, with a global
            // tracer provider, gets the dial spans without telling this
            // client, as from any instrumented library. Without one this is
            // the API's no-op tracer, which still passes a parent's context
            // on to the server.
            None => {
                global = opentelemetry::global::tracer("cluster-proxy");
                &global
            }
        };
        let parent = {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let of_tracing_span = tracing::Span::current().context();
            if of_tracing_span.has_active_span() {
                of_tracing_span
            } else {
                // The OpenTelemetry API's own current context (`attach`).
                opentelemetry::Context::current()
            }
        };
        // The address, the early data's size and an error.
        let mut span = DirectSpan::start_with(tracer, "tunnel.dial", SpanKind::Client, &parent, 3);
        span.set_attributes(|| [KeyValue::new("server.address", address.to_owned())]);
        span
    }

    async fn dial_in(
        &self,
        address: &str,
        trace: Option<TraceHeaders>,
        mut early: Bytes,
    ) -> Result<OpenStream, DialError> {
        // Non-negative and non-zero, like the Go client's rand.Int63().
        let random = (rand::random::<i64>() & i64::MAX).max(1);
        let rest = early.split_off(early.len().min(MAX_EARLY_DATA));
        let dial = packet::dial_request_with_early_data(address, random, None, early.clone());
        let mut metadata = tonic::metadata::MetadataMap::new();
        if let Some(trace) = trace {
            trace.insert_into_metadata(&mut metadata);
        }
        let (mut requests, mut responses) = match &self.transport {
            Transport::Channel(channel) => {
                let (requests, request_rx) = mpsc::channel::<Packet>(16);
                // The channel has room: this cannot fail before the stream starts.
                let _ = requests.try_send(dial);
                let request = tonic::Request::from_parts(
                    metadata,
                    Default::default(),
                    ReceiverStream::new(request_rx),
                );
                let responses = streaming_call(
                    &mut channel.clone(),
                    http::uri::PathAndQuery::from_static(PROXY_PATH),
                    request,
                    MAX_MESSAGE_SIZE,
                    MAX_MESSAGE_SIZE,
                )
                .await?
                .into_inner();
                (Requests::Queued(PollSender::new(requests)), responses)
            }
            Transport::H2(channel) => {
                let (sender, responses) = channel
                    .open_stream(PROXY_PATH, metadata.into_headers(), &dial)
                    .await?;
                (Requests::Framed(sender), responses)
            }
        };
        let (connect_id, early_written) = match tokio::time::timeout(
            self.dial_timeout,
            wait_dial_response(&mut responses, random),
        )
        .await
        {
            Ok(result) => result?,
            Err(_) => {
                requests.try_send(packet::close_dial(random));
                return Err(DialError::Timeout(self.dial_timeout));
            }
        };
        // What no peer confirmed delivering, then what did not fit, in order.
        let unsent = if early_written { Bytes::new() } else { early };
        for mut chunk in [unsent, rest] {
            while !chunk.is_empty() {
                let piece = chunk.split_to(chunk.len().min(MAX_WRITE));
                requests
                    .send(packet::data(connect_id, piece))
                    .await
                    .map_err(|()| DialError::TunnelClosed)?;
            }
        }
        Ok(OpenStream {
            connect_id,
            requests,
            responses,
            pending: Bytes::new(),
            read_closed: false,
            close_sent: false,
        })
    }
}

/// The connection id and whether the request's early data was delivered.
async fn wait_dial_response(
    responses: &mut Responses,
    random: i64,
) -> Result<(i64, bool), DialError> {
    loop {
        let Some(p) = responses.message().await? else {
            return Err(DialError::TunnelClosed);
        };
        match Frame::from_packet(p) {
            Frame::DialResponse {
                error,
                connect_id,
                random: r,
                early_data_written,
            } if r == random => {
                return if error.is_empty() && connect_id != 0 {
                    Ok((connect_id, early_data_written))
                } else if error.is_empty() {
                    Err(DialError::Refused(
                        "dial response without a connection id".into(),
                    ))
                } else {
                    Err(DialError::Refused(error))
                };
            }
            Frame::CloseDial { random: r } if r == random => return Err(DialError::DialClosed),
            _ => {}
        }
    }
}

/// The server's packets on one `Proxy` stream.
type Responses = PacketStream<tonic::body::Body>;

/// Largest DATA payload one write produces.
const MAX_WRITE: usize = 4 * READ_CHUNK;

/// A TCP connection tunneled through the proxy-server. Reads and writes go
/// straight to the gRPC stream, with no relay task in between.
pub struct TunnelStream {
    state: StreamState,
}

enum StreamState {
    Open(OpenStream),
    /// [`TunnelClient::dial_lazily`], before the first read or write.
    Unsent(Box<LazyDial>),
    /// The dial task of a lazy stream is running.
    Dialing {
        task: tokio::task::JoinHandle<Result<OpenStream, DialError>>,
        wakers: Arc<DialWakers>,
        address: String,
    },
    /// The dial failed: every read and write fails with an `io::Error`
    /// whose inner error is this ([`ConnectError::find_in`]).
    Failed(ConnectError),
    /// Shut down before it was ever used: nothing was dialed.
    Closed,
}

struct LazyDial {
    client: TunnelClient,
    address: String,
    span: DirectSpan,
}

/// The tasks waiting on a lazy stream's dial: a reader and a writer may be
/// different tasks (`tokio::io::split`), and a join handle remembers only the
/// last waker it was polled with, so the handle is polled with one that wakes
/// both.
#[derive(Default)]
struct DialWakers {
    reader: std::sync::Mutex<Option<std::task::Waker>>,
    writer: std::sync::Mutex<Option<std::task::Waker>>,
}

impl std::task::Wake for DialWakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        for slot in [&self.reader, &self.writer] {
            let waker = slot.lock().ok().and_then(|mut w| w.take());
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Side {
    Reader,
    Writer,
}

impl TunnelStream {
    /// Starts a lazy stream's dial with `first` as its early data.
    fn start_dial(&mut self, first: Bytes) {
        let StreamState::Unsent(lazy) = std::mem::replace(&mut self.state, StreamState::Closed)
        else {
            return;
        };
        let LazyDial {
            client,
            address,
            span,
        } = *lazy;
        let task = {
            let address = address.clone();
            tokio::spawn(async move { client.dial_traced(span, &address, first).await })
        };
        self.state = StreamState::Dialing {
            task,
            wakers: Arc::default(),
            address,
        };
    }

    /// Waits for a lazy stream's dial; `Ready(Ok)` once the stream is open.
    fn poll_dialed(&mut self, cx: &mut Context<'_>, side: Side) -> Poll<std::io::Result<()>> {
        match &mut self.state {
            StreamState::Open(_) => Poll::Ready(Ok(())),
            StreamState::Unsent(_) => {
                self.start_dial(Bytes::new());
                self.poll_dialed(cx, side)
            }
            StreamState::Dialing {
                task,
                wakers,
                address,
            } => {
                let slot = match side {
                    Side::Reader => &wakers.reader,
                    Side::Writer => &wakers.writer,
                };
                if let Ok(mut slot) = slot.lock() {
                    *slot = Some(cx.waker().clone());
                }
                let wakers = wakers.clone();
                let both = std::task::Waker::from(wakers.clone());
                let joined =
                    std::task::ready!(Pin::new(task).poll(&mut Context::from_waker(&both)));
                let address = std::mem::take(address);
                self.state = match joined {
                    Ok(Ok(open)) => StreamState::Open(open),
                    Ok(Err(error)) => StreamState::Failed(ConnectError::from_dial(address, error)),
                    Err(join) => StreamState::Failed(ConnectError::from_dial(
                        address,
                        DialError::TaskEnded(join.to_string()),
                    )),
                };
                // The other side may be waiting on the same dial.
                std::task::Wake::wake_by_ref(&wakers);
                self.poll_dialed(cx, side)
            }
            StreamState::Failed(error) => {
                Poll::Ready(Err(std::io::Error::new(error.io_kind(), error.clone())))
            }
            StreamState::Closed => Poll::Ready(Err(broken_pipe())),
        }
    }
}

/// Where a stream's packets to the server go.
enum Requests {
    /// A `Channel`'s request body reads them from this queue.
    Queued(PollSender<Packet>),
    /// Framed into the HTTP/2 stream at once.
    Framed(StreamSender),
}

impl Requests {
    /// Ready once the next packet can be sent; `Err` once the stream is gone.
    fn poll_reserve(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        match self {
            Requests::Queued(sender) => sender.poll_reserve(cx).map_err(|_| ()),
            Requests::Framed(sender) => sender.poll_ready(cx).map_err(|_| ()),
        }
    }

    /// Sends `p`, after [`Requests::poll_reserve`] was ready.
    fn send_item(&mut self, p: Packet) -> Result<(), ()> {
        match self {
            Requests::Queued(sender) => sender.send_item(p).map_err(|_| ()),
            Requests::Framed(sender) => sender.send(&p).map_err(|_| ()),
        }
    }

    async fn send(&mut self, p: Packet) -> Result<(), ()> {
        std::future::poll_fn(|cx| self.poll_reserve(cx)).await?;
        self.send_item(p)
    }

    /// Sends `p` if there is room, without waiting (a last word).
    fn try_send(&mut self, p: Packet) {
        match self {
            Requests::Queued(sender) => {
                if let Some(sender) = sender.get_ref() {
                    let _ = sender.try_send(p);
                }
            }
            Requests::Framed(sender) => {
                let _ = sender.send(&p);
            }
        }
    }
}

/// An open tunneled connection.
struct OpenStream {
    connect_id: i64,
    requests: Requests,
    responses: Responses,
    /// The unread rest of the last DATA payload.
    pending: Bytes,
    read_closed: bool,
    close_sent: bool,
}

impl std::fmt::Debug for TunnelStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut f = f.debug_struct("TunnelStream");
        match &self.state {
            StreamState::Open(open) => f
                .field("connect_id", &open.connect_id)
                .field("read_closed", &open.read_closed)
                .field("close_sent", &open.close_sent),
            StreamState::Unsent(lazy) => f
                .field("dial", &"not started")
                .field("address", &lazy.address),
            StreamState::Dialing { .. } => f.field("dial", &"in flight"),
            StreamState::Failed(error) => f.field("dial_failed", error),
            StreamState::Closed => f.field("closed", &true),
        }
        .finish_non_exhaustive()
    }
}

impl TunnelStream {
    /// The agent-assigned connection id; 0 while a lazy stream's dial has
    /// not completed (or failed).
    pub fn connect_id(&self) -> i64 {
        match &self.state {
            StreamState::Open(open) => open.connect_id,
            _ => 0,
        }
    }
}

fn broken_pipe() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "tunneled connection is closed",
    )
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let StreamState::Open(open) = &mut this.state {
            return open.poll_read(cx, buf);
        }
        std::task::ready!(this.poll_dialed(cx, Side::Reader))?;
        match &mut this.state {
            StreamState::Open(open) => open.poll_read(cx, buf),
            _ => Poll::Ready(Err(broken_pipe())),
        }
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match &mut this.state {
            StreamState::Open(open) => return open.poll_write(cx, buf),
            StreamState::Unsent(_) if !buf.is_empty() => {
                // The first write rides with the dial and is done at once.
                let n = buf.len().min(MAX_EARLY_DATA);
                this.start_dial(Bytes::copy_from_slice(&buf[..n]));
                return Poll::Ready(Ok(n));
            }
            _ => {}
        }
        std::task::ready!(this.poll_dialed(cx, Side::Writer))?;
        match &mut this.state {
            StreamState::Open(open) => open.poll_write(cx, buf),
            _ => Poll::Ready(Err(broken_pipe())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // Packets are handed to the gRPC stream as they are written; a lazy
        // stream's first write is in its dial request.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match &mut this.state {
            StreamState::Open(open) => open.poll_shutdown(cx),
            StreamState::Unsent(_) => {
                // Never used: there is nothing to dial, nor to close.
                this.state = StreamState::Closed;
                Poll::Ready(Ok(()))
            }
            StreamState::Closed => Poll::Ready(Ok(())),
            _ => {
                std::task::ready!(this.poll_dialed(cx, Side::Writer))?;
                match &mut this.state {
                    StreamState::Open(open) => open.poll_shutdown(cx),
                    _ => Poll::Ready(Err(broken_pipe())),
                }
            }
        }
    }
}

impl OpenStream {
    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self;
        loop {
            if !this.pending.is_empty() {
                let n = buf.remaining().min(this.pending.len());
                buf.put_slice(&this.pending.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            match std::task::ready!(Pin::new(&mut this.responses).poll_next(cx)) {
                Some(Ok(p)) => match Frame::from_packet(p) {
                    Frame::Data { connect_id, data } if connect_id == this.connect_id => {
                        this.pending = data
                    }
                    Frame::CloseResponse { .. } => this.read_closed = true,
                    _ => {}
                },
                Some(Err(status)) => {
                    this.read_closed = true;
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        format!("tunnel stream failed: {}", status.message()),
                    )));
                }
                None => this.read_closed = true,
            }
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self;
        if this.close_sent {
            return Poll::Ready(Err(broken_pipe()));
        }
        std::task::ready!(this.requests.poll_reserve(cx)).map_err(|_| broken_pipe())?;
        let n = buf.len().min(MAX_WRITE);
        this.requests
            .send_item(packet::data(
                this.connect_id,
                Bytes::copy_from_slice(&buf[..n]),
            ))
            .map_err(|_| broken_pipe())?;
        Poll::Ready(Ok(n))
    }

    fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self;
        if !this.close_sent {
            std::task::ready!(this.requests.poll_reserve(cx)).map_err(|_| broken_pipe())?;
            this.requests
                .send_item(packet::close_request(this.connect_id))
                .map_err(|_| broken_pipe())?;
            this.close_sent = true;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{Span as _, TraceContextExt as _, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;
    use crate::trace::direct::tests::Ended;

    /// A program with an OpenTelemetry set-up of its own (a global tracer
    /// provider, the parent attached as the API's current context) gets
    /// the dial span without handing this client a tracer.
    #[tokio::test]
    async fn without_a_tracer_of_its_own_the_dial_span_comes_from_the_global_provider() {
        let ended = Ended::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(ended.clone())
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let client = TunnelClient::new(channel);
        let parent = provider
            .tracer("caller")
            .start_with_context("request", &opentelemetry::Context::new());
        let parent_context = parent.span_context().clone();
        let attached = opentelemetry::Context::current_with_span(parent).attach();
        let span = client.dial_span("cluster-a:443");
        drop(attached);
        let headers = span.headers().expect("the dial span has ids to send");
        assert!(
            headers
                .traceparent
                .contains(&parent_context.trace_id().to_string()),
            "{headers:?}"
        );
        drop(span);
        let ended = ended.0.lock().expect("ended spans");
        let dial = ended
            .iter()
            .find(|s| s.name == "tunnel.dial")
            .expect("a tunnel.dial span from the global provider");
        assert_eq!(dial.parent_span_id, parent_context.span_id());
        assert!(
            dial.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "server.address")
        );
    }
}

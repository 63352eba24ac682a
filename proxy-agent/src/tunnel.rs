//! One tunnel: an `AgentService.Connect` stream to one proxy-server, carrying
//! every connection the server asks this agent to open.
//!
//! Outgoing packets flow through two channels merged into the request stream:
//! an unbounded *control* channel (WINDOW_UPDATE, replies to unknown ids,
//! DRAIN) that always goes first, and a bounded *ordered* channel that each
//! connection's own task writes DIAL_RSP, DATA and CLOSE_RSP into, so their
//! relative order per connection is the order they were produced in.
//!
//! The reader never waits on one connection when flow control is on: it only
//! pushes into per-connection [`ReceiveQueue`]s, which the peer's credit keeps
//! from filling. Without flow control it waits when a connection's buffer is
//! full (upstream behaviour, only much later).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::duplex::{
    self, AfterUp, ChunkSink, ChunkSource, Copied, Payload, ReadChunks, ReadEnd, WriteChunks,
};
use cluster_proxy_proto::flow::{
    Delivery, FlowError, ReceiveQueue, ReceiveQueueRx, SendCredit, Stray, StrayIds, WindowTracker,
};
use cluster_proxy_proto::packet::{self, Frame, PROTOCOL_TCP};
use cluster_proxy_proto::trace::direct::tcp_server_attributes;
use cluster_proxy_proto::trace::{DirectSpan, TraceHeaders};
use cluster_proxy_runtime::telemetry::relay::RelayQueue;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::field;

use crate::connection::{Driven, TunnelConnection};
use crate::dial::{dial_tcp, write_early_data};
use crate::metrics::{Metrics, Segment};

/// Unknown connection ids answered at most per [`STRAY_HOLD`]: a server
/// that floods packets for made-up ids cannot grow the control lane.
pub const STRAY_CAPACITY: usize = 1024;
/// How long an answered unknown id is remembered.
pub const STRAY_HOLD: Duration = Duration::from_secs(30);

/// Capacity (packets) of the ordered channel; a full channel makes the
/// connection tasks wait, never the reader.
pub const ORDERED_CAPACITY: usize = 64;

/// The most attributes `agent.dial` gets: 5 at the start, the early data's
/// size, 2 after the dial (3 when it fails), 2 at the end.
const DIAL_SPAN_ATTRIBUTES: usize = 10;

/// The sending side of a tunnel (see [`cluster_proxy_proto::flow::Outbound`]).
pub type Outgoing = cluster_proxy_proto::flow::Outbound;

/// The request stream of a tunnel: control packets first, and it ends when
/// `cancel` fires so the HTTP/2 stream closes with the tunnel.
pub type RequestStream = cluster_proxy_proto::flow::OutboundPackets;

pub fn outgoing(cancel: CancellationToken) -> (Outgoing, RequestStream) {
    cluster_proxy_proto::flow::outbound(ORDERED_CAPACITY, cancel)
}

/// Per-tunnel settings.
#[derive(Debug, Clone)]
pub struct TunnelParams {
    pub server_id: String,
    /// Our per-connection receive window (advertised when flow control is on).
    pub our_window: u32,
    /// The server's window: `Some` ⇒ flow control is on for this tunnel.
    pub server_window: Option<u32>,
    pub plain_peer_buffer: u32,
    pub target_receive_buffer: Option<u32>,
    pub dial_timeout: Duration,
    pub host_aliases: std::sync::Arc<crate::dial::HostAliases>,
    /// Set when the server announces with DRAIN that it is stopping, so the
    /// manager stops counting this tunnel and looks for a replacement.
    pub server_draining: Arc<AtomicBool>,
    /// Woken when `server_draining` gets set or `server_count` changes.
    pub changed: Arc<Notify>,
    /// The replica count the agent works towards, shared by every tunnel;
    /// a SERVER_COUNT packet (negotiated extension) updates it.
    pub server_count: Arc<AtomicUsize>,
    /// `Some` for a duplicate tunnel (a second one to a server we already
    /// hold): it has told the server DRAIN and only serves the dials that
    /// crossed that, so it ends at the first check, this often, that finds
    /// it without connections.
    pub retire_when_idle: Option<Duration>,
}

enum Event {
    Data(Bytes),
    Close,
}

impl From<Bytes> for Event {
    fn from(payload: Bytes) -> Self {
        Event::Data(payload)
    }
}

/// Lets the reader stop a connection with an error that the connection's
/// own task reports in its CLOSE_RSP (keeping DATA before CLOSE_RSP).
#[derive(Debug, Default)]
struct Abort {
    token: CancellationToken,
    reason: Mutex<Option<String>>,
}

impl Abort {
    fn abort(&self, reason: String) {
        *self.reason.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason);
        self.token.cancel();
    }

    fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

struct ConnEntry {
    queue: ReceiveQueue<Event>,
    credit: SendCredit,
    abort: Arc<Abort>,
}

struct Tables {
    conns: HashMap<i64, ConnEntry>,
    /// Dials in progress by `random`, so DIAL_CLS can cancel them.
    pending: HashMap<i64, CancellationToken>,
    /// Unknown ids the server's packets named and were answered.
    stray: StrayIds,
}

struct Tunnel {
    params: TunnelParams,
    out: Outgoing,
    tables: Mutex<Tables>,
    next_connect_id: AtomicI64,
    cancel: CancellationToken,
    metrics: Arc<Metrics>,
}

/// Why a tunnel ended.
#[derive(Debug)]
pub enum TunnelEnd {
    /// The server closed the stream.
    ServerClosed,
    /// The stream failed.
    Error(tonic::Status),
    /// We closed it (shutdown or duplicate).
    Cancelled,
    /// A duplicate tunnel finished serving the dials that raced its DRAIN.
    Retired,
}

impl std::fmt::Display for TunnelEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TunnelEnd::ServerClosed => f.write_str("server closed the stream"),
            TunnelEnd::Error(s) => write!(f, "stream error: {} {}", s.code(), s.message()),
            TunnelEnd::Cancelled => f.write_str("closed by the agent"),
            TunnelEnd::Retired => f.write_str("duplicate retired once idle"),
        }
    }
}

impl Tunnel {
    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn flow_on(&self) -> bool {
        self.params.server_window.is_some()
    }

    fn reply(&self, packet: Packet) {
        // Fails only once the tunnel is gone, when replies no longer matter.
        let _ = self.out.control.send(packet);
    }

    /// Answers a packet for an unknown connection with `packet`, once per
    /// id and within [`STRAY_CAPACITY`] ids per [`STRAY_HOLD`].
    fn reply_to_stray(&self, connect_id: i64, packet: Packet) {
        let verdict = self.tables().stray.admit(connect_id, Instant::now());
        match verdict {
            Stray::Answer => self.reply(packet),
            Stray::AlreadyAnswered => {}
            Stray::Full => self.metrics.stray_reply_dropped(),
        }
    }

    async fn handle(self: &Arc<Self>, frame: Frame) {
        match frame {
            Frame::DialRequest {
                protocol,
                address,
                random,
                trace,
                early_data,
            } => self.dial(protocol, address, random, trace, early_data),
            Frame::Data { connect_id, data } => self.data(connect_id, data).await,
            Frame::CloseRequest { connect_id } => {
                let queue = self
                    .tables()
                    .conns
                    .get(&connect_id)
                    .map(|c| c.queue.clone());
                match queue {
                    // The connection task flushes queued DATA first, then
                    // answers with CLOSE_RSP itself.
                    Some(q) => {
                        let _ = q.push(Event::Close);
                    }
                    None => {
                        tracing::debug!(server_id = %self.params.server_id, connect_id, "CLOSE_REQ for unknown connection");
                        self.reply_to_stray(
                            connect_id,
                            packet::close_response(connect_id, "Unknown connectID"),
                        );
                    }
                }
            }
            Frame::WindowUpdate { connect_id, bytes } => {
                let found = self
                    .tables()
                    .conns
                    .get(&connect_id)
                    .map(|c| (c.credit.clone(), c.abort.clone()));
                match found {
                    Some((credit, abort)) => {
                        if let Err(e) = credit.grant(bytes) {
                            tracing::warn!(server_id = %self.params.server_id, connect_id, error = %e, "protocol violation; closing connection");
                            abort.abort(e.to_string());
                        }
                    }
                    // Normal right after a close crossed the update.
                    None => {
                        tracing::debug!(server_id = %self.params.server_id, connect_id, "WINDOW_UPDATE for unknown connection")
                    }
                }
            }
            Frame::Drain => {
                // Upstream servers never send it; ours do when stopping.
                if !self.params.server_draining.swap(true, Ordering::SeqCst) {
                    tracing::info!(server_id = %self.params.server_id, "proxy-server is draining; looking for its replacement");
                    self.params.changed.notify_one();
                }
            }
            Frame::ServerCount { count } => self.server_count(count),
            Frame::CloseDial { random } => {
                // Upstream ignores DIAL_CLS and finishes the dial; cancelling
                // saves a connection the server would close right away.
                if let Some(token) = self.tables().pending.remove(&random) {
                    tracing::debug!(server_id = %self.params.server_id, random, "dial cancelled by the server");
                    token.cancel();
                }
            }
            other => {
                tracing::debug!(server_id = %self.params.server_id, packet = other.type_name(), "ignoring packet");
            }
        }
    }

    /// A replica was added or removed: look for the new one at once, or
    /// stop looking for the one that is gone.
    fn server_count(&self, count: i64) {
        let Some(count) = usize::try_from(count).ok().filter(|n| *n >= 1) else {
            tracing::debug!(server_id = %self.params.server_id, count, "ignoring a server count below 1");
            return;
        };
        let previous = self.params.server_count.swap(count, Ordering::SeqCst);
        if previous != count {
            tracing::info!(server_id = %self.params.server_id, server_count = count, previous, "proxy-server replica count changed");
            self.metrics
                .known_server_count
                .set(i64::try_from(count).unwrap_or(i64::MAX));
            self.params.changed.notify_one();
        }
    }

    fn dial(
        self: &Arc<Self>,
        protocol: String,
        address: String,
        random: i64,
        trace: Option<TraceHeaders>,
        early_data: Bytes,
    ) {
        if protocol != PROTOCOL_TCP {
            tracing::warn!(server_id = %self.params.server_id, random, %protocol, "refusing dial with unsupported protocol");
            self.reply(packet::dial_response_error(
                random,
                format!("unsupported protocol \"{protocol}\""),
            ));
            return;
        }
        let connect_id = self.next_connect_id.fetch_add(1, Ordering::Relaxed);
        let token = self.cancel.child_token();
        self.tables().pending.insert(random, token.clone());
        let tunnel = self.clone();
        let mut span = self.dial_span(&address, connect_id, trace.as_ref());
        if !early_data.is_empty() {
            span.set_attributes(|| {
                [KeyValue::new(
                    "cluster_proxy.early_data_bytes",
                    i64::try_from(early_data.len()).unwrap_or(i64::MAX),
                )]
            });
        }
        // The span ends with the connection, or with the task if the dial
        // is abandoned.
        tokio::spawn(async move {
            tunnel
                .dial_task(address, random, connect_id, early_data, token, span)
                .await;
        });
    }

    /// The span of one dial and the connection it opens: a child of the
    /// server's connection span when the server sent its trace context.
    fn dial_span(
        &self,
        address: &str,
        connect_id: i64,
        trace: Option<&TraceHeaders>,
    ) -> DirectSpan {
        let mut span =
            DirectSpan::start("agent.dial", SpanKind::Client, trace, DIAL_SPAN_ATTRIBUTES);
        span.set_attributes(|| {
            tcp_server_attributes(address).into_iter().chain([
                KeyValue::new("cluster_proxy.server_id", self.params.server_id.clone()),
                KeyValue::new("cluster_proxy.connect_id", connect_id),
            ])
        });
        span
    }

    async fn dial_task(
        self: Arc<Self>,
        address: String,
        random: i64,
        connect_id: i64,
        early_data: Bytes,
        token: CancellationToken,
        mut span: DirectSpan,
    ) {
        let server_id = &self.params.server_id;
        let started = Instant::now();
        let result = tokio::select! {
            _ = token.cancelled() => {
                tracing::debug!(%server_id, random, %address, trace_id = span.trace_id().map(field::display), "dial abandoned");
                return;
            }
            r = dial_tcp(
                &address,
                self.params.dial_timeout,
                &self.params.host_aliases,
                self.params.target_receive_buffer,
            ) => r,
        };
        self.metrics
            .dial_duration
            .observe(started.elapsed().as_secs_f64());
        let latency_ms = started.elapsed().as_secs_f64() * 1e3;
        // The connection's first bytes go out before the dial is answered:
        // that is the round trip the client saves.
        let result = match result {
            Ok(tcp) if !early_data.is_empty() => {
                write_early_data(tcp, &early_data, self.params.dial_timeout, &address).await
            }
            other => other,
        };
        let tcp = match result {
            Ok(tcp) => {
                span.set_attributes(|| {
                    [KeyValue::new("cluster_proxy.dial_latency_ms", latency_ms)]
                        .into_iter()
                        .chain(tcp.peer_addr().ok().map(|peer| {
                            KeyValue::new("network.peer.address", peer.ip().to_string())
                        }))
                });
                tcp
            }
            Err(e) => {
                span.set_attributes(|| {
                    [
                        KeyValue::new("cluster_proxy.dial_latency_ms", latency_ms),
                        KeyValue::new("cluster_proxy.end_reason", e.reason.label()),
                    ]
                });
                // The log line is an event of the span too.
                span.add_event("endpoint dial failed", || {
                    vec![KeyValue::new("error.message", e.message.clone())]
                });
                span.fail(&e.message);
                self.tables().pending.remove(&random);
                self.metrics.dial_failed(e.reason);
                tracing::info!(%server_id, random, %address, error = %e, trace_id = span.trace_id().map(field::display), "endpoint dial failed");
                let _ = self
                    .out
                    .ordered
                    .send(packet::dial_response_error(random, e.message))
                    .await;
                return;
            }
        };
        let flow_on = self.flow_on();
        let capacity = if flow_on {
            self.params.our_window
        } else {
            self.params.plain_peer_buffer
        };
        let (queue, rx) = ReceiveQueue::new(capacity, flow_on);
        let credit = match self.params.server_window {
            Some(window) => SendCredit::with_window(window),
            None => SendCredit::unlimited(),
        };
        let abort = Arc::new(Abort {
            token,
            reason: Mutex::new(None),
        });
        {
            let mut tables = self.tables();
            // Whoever takes the pending entry first wins: DIAL_CLS or us.
            if tables.pending.remove(&random).is_none() || abort.token.is_cancelled() {
                tracing::debug!(%server_id, random, %address, "dial cancelled after connecting");
                return;
            }
            tables.conns.insert(
                connect_id,
                ConnEntry {
                    queue,
                    credit: credit.clone(),
                    abort: abort.clone(),
                },
            );
        }
        self.metrics.open_endpoint_connections.inc();
        tracing::debug!(%server_id, random, connect_id, %address, "endpoint connected");
        if self
            .out
            .ordered
            .send(packet::dial_response_connected(
                random,
                connect_id,
                !early_data.is_empty(),
            ))
            .await
            .is_ok()
        {
            self.clone()
                .run_connection(connect_id, tcp, rx, credit.clone(), abort, &mut span)
                .await;
        } else {
            self.tables().conns.remove(&connect_id);
        }
        credit.close();
        self.metrics.open_endpoint_connections.dec();
    }

    async fn run_connection(
        self: Arc<Self>,
        connect_id: i64,
        tcp: TcpStream,
        rx: ReceiveQueueRx<Event>,
        credit: SendCredit,
        abort: Arc<Abort>,
        span: &mut DirectSpan,
    ) {
        #[derive(Debug)]
        enum End {
            TargetEof,
            TargetError(String),
            CloseRequested,
            Aborted,
            TunnelGone,
        }
        let (rd, wr) = tcp.into_split();
        // The connection ends with its first direction to end (upstream's
        // agent has no half-close either), or when the reader aborts it.
        let up = duplex::copy(
            ReadChunks::new(rd),
            ToServer {
                credit: &credit,
                out: &self.out,
                connect_id,
            },
        );
        let down = duplex::copy(
            FromServer {
                rx,
                tracker: WindowTracker::new(self.params.our_window),
                flow_on: self.flow_on(),
                out: &self.out,
                connect_id,
            },
            WriteChunks::new(wr),
        );
        let relayed = duplex::relay(up, down, AfterUp::Stop, abort.token.cancelled()).await;
        let end = match (relayed.up, relayed.down) {
            (Some(Copied::SourceEnded(ReadEnd::Eof)), _) => End::TargetEof,
            (Some(Copied::SourceEnded(ReadEnd::Failed(e))), _)
            | (_, Some(Copied::SinkFailed(e))) => End::TargetError(e.to_string()),
            (Some(Copied::SinkFailed(ToServerError::NoCredit)), _) => End::Aborted,
            (Some(Copied::SinkFailed(ToServerError::TunnelGone)), _) => End::TunnelGone,
            (_, Some(Copied::SourceEnded(ServerEnd::CloseRequested))) => End::CloseRequested,
            (_, Some(Copied::SourceEnded(ServerEnd::TunnelGone))) => End::TunnelGone,
            (None, None) => End::Aborted,
        };
        self.tables().conns.remove(&connect_id);
        credit.close();
        let server_id = &self.params.server_id;
        let (reason, error) = match &end {
            End::TargetEof => ("target_close", None),
            End::TargetError(e) => ("target_error", Some(e.as_str())),
            End::CloseRequested => ("server_close", None),
            End::Aborted => ("aborted", None),
            End::TunnelGone => ("tunnel_closed", None),
        };
        span.set_attributes(|| {
            [KeyValue::new("cluster_proxy.end_reason", reason)]
                .into_iter()
                .chain(error.map(|error| KeyValue::new("error.message", error.to_owned())))
        });
        span.end();
        let trace_id = span.trace_id().map(field::display);
        match &end {
            End::TargetError(e) => tracing::debug!(
                %server_id,
                connect_id,
                error = %e,
                trace_id,
                "endpoint connection failed"
            ),
            other => tracing::debug!(
                %server_id,
                connect_id,
                reason = ?other,
                trace_id,
                "endpoint connection closed"
            ),
        }
        if self.cancel.is_cancelled() {
            // The tunnel is gone; the server cleans up on its side.
            return;
        }
        let error = match end {
            End::Aborted => abort.reason().unwrap_or_default(),
            End::TunnelGone => return,
            _ => String::new(),
        };
        let _ = self
            .out
            .ordered
            .send(packet::close_response(connect_id, error))
            .await;
    }

    async fn data(&self, connect_id: i64, data: Bytes) {
        if connect_id == 0 {
            tracing::warn!(server_id = %self.params.server_id, "dropping DATA with connectID 0");
            return;
        }
        let found = self
            .tables()
            .conns
            .get(&connect_id)
            .map(|c| (c.queue.clone(), c.abort.clone()));
        let Some((queue, abort)) = found else {
            tracing::debug!(server_id = %self.params.server_id, connect_id, "DATA for unknown connection");
            self.reply_to_stray(
                connect_id,
                packet::close_response(connect_id, "unrecognized connectID"),
            );
            return;
        };
        match queue.push_data(data, connect_id).await {
            Ok(()) => {}
            Err(e @ (FlowError::WindowExceeded { .. } | FlowError::Stalled { .. })) => {
                tracing::warn!(server_id = %self.params.server_id, connect_id, error = %e, "closing connection");
                abort.abort(e.to_string());
            }
            // The connection is closing; its CLOSE_RSP is on the way.
            Err(_) => {}
        }
    }

    fn idle(&self) -> bool {
        let tables = self.tables();
        tables.conns.is_empty() && tables.pending.is_empty()
    }

    fn teardown(&self) {
        self.cancel.cancel();
        let (conns, _pending) = {
            let mut tables = self.tables();
            (
                std::mem::take(&mut tables.conns),
                std::mem::take(&mut tables.pending),
            )
        };
        for conn in conns.values() {
            conn.credit.close();
        }
    }
}

impl Payload for Event {
    /// A close carries none (the relay ends on it, never writes it).
    fn payload(&self) -> &[u8] {
        match self {
            Event::Data(bytes) => bytes,
            Event::Close => &[],
        }
    }
}

/// Why the target's bytes could not go to the server.
enum ToServerError {
    /// The connection's credit was closed (aborted, or the tunnel went away).
    NoCredit,
    TunnelGone,
}

/// The target's bytes as DATA on the ordered lane, each within the
/// server's credit.
struct ToServer<'a> {
    credit: &'a SendCredit,
    out: &'a Outgoing,
    connect_id: i64,
}

impl ChunkSink<Bytes> for ToServer<'_> {
    type Error = ToServerError;

    async fn send(&mut self, chunk: Bytes) -> Result<(), ToServerError> {
        if self.credit.acquire(chunk.len()).await.is_err() {
            return Err(ToServerError::NoCredit);
        }
        self.out
            .ordered
            .send(packet::data(self.connect_id, chunk))
            .await
            .map_err(|_| ToServerError::TunnelGone)
    }
}

/// Why the server sends no more bytes for the target.
enum ServerEnd {
    CloseRequested,
    TunnelGone,
}

/// The server's bytes for the target; each written chunk frees its buffer
/// space, and with flow control its credit goes back to the server.
struct FromServer<'a> {
    rx: ReceiveQueueRx<Event>,
    tracker: WindowTracker,
    flow_on: bool,
    out: &'a Outgoing,
    connect_id: i64,
}

impl ChunkSource for FromServer<'_> {
    type Chunk = Delivery<Event>;
    type End = ServerEnd;

    async fn recv(&mut self) -> Result<Delivery<Event>, ServerEnd> {
        match self.rx.recv().await {
            Some(delivery) if matches!(delivery.event, Event::Data(_)) => Ok(delivery),
            Some(_) => Err(ServerEnd::CloseRequested),
            None => Err(ServerEnd::TunnelGone),
        }
    }

    fn delivered(&mut self, n: usize) {
        if self.flow_on
            && let Some(grant) = self.tracker.consumed(n)
        {
            let _ = self
                .out
                .control
                .send(packet::window_update(self.connect_id, grant));
        }
    }
}

/// Serves one tunnel until the server ends it or `cancel` fires. Every
/// connection of the tunnel is closed when this returns.
pub async fn serve(
    params: TunnelParams,
    out: Outgoing,
    mut connection: TunnelConnection,
    cancel: CancellationToken,
    metrics: Arc<Metrics>,
) -> TunnelEnd {
    let tunnel = Arc::new(Tunnel {
        params,
        out,
        tables: Mutex::new(Tables {
            conns: HashMap::new(),
            pending: HashMap::new(),
            stray: StrayIds::new(STRAY_CAPACITY, STRAY_HOLD),
        }),
        next_connect_id: AtomicI64::new(1),
        cancel,
        metrics,
    });
    // Owned, not borrowed: a borrowed cancellation future held across awaits
    // trips rustc's higher-ranked Send check when this is spawned.
    let cancelled = tunnel.cancel.clone().cancelled_owned();
    tokio::pin!(cancelled);
    let mut retire_ticks = tunnel
        .params
        .retire_when_idle
        .map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
    let end = loop {
        let retire_tick = async {
            match retire_ticks.as_mut() {
                Some(ticks) => {
                    ticks.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let driven = tokio::select! {
            _ = &mut cancelled => break TunnelEnd::Cancelled,
            _ = retire_tick => {
                if tunnel.idle() {
                    break TunnelEnd::Retired;
                }
                continue;
            }
            driven = connection.next_packet() => driven,
        };
        match driven {
            Driven::Packet(Ok(Some(p))) => {
                let frame = Frame::from_packet(p);
                tunnel.metrics.packet(Segment::ToAgent, frame.type_name());
                // Handling waits only on a full connection buffer of a
                // server without flow control; our packets keep flowing.
                tokio::select! {
                    biased;
                    _ = &mut cancelled => break TunnelEnd::Cancelled,
                    _ = tunnel.handle(frame) => {}
                    status = connection.drive() => {
                        tunnel.metrics.receive_failed(&status);
                        break TunnelEnd::Error(status);
                    }
                }
            }
            Driven::Packet(Ok(None)) => break TunnelEnd::ServerClosed,
            Driven::Packet(Err(status)) | Driven::Failed(status) => {
                tunnel.metrics.receive_failed(&status);
                break TunnelEnd::Error(status);
            }
        }
    };
    // Ends the stream of packets to the server (it follows `cancel`).
    tunnel.teardown();
    if !matches!(end, TunnelEnd::Error(_)) {
        connection.finish(FINISH_GRACE).await;
    }
    end
}

/// Sends batches of the agent's spans from `queue` down this tunnel (the
/// span relay it negotiated) until `cancel` fires. A task of its own: it
/// waits for room in the ordered lane as a connection's task does, and
/// neither the reader nor a dial ever waits for it. Each batch goes down
/// one tunnel; a batch taken when the tunnel closes is counted as lost.
pub async fn relay_spans(
    queue: Arc<RelayQueue>,
    ordered: tokio::sync::mpsc::Sender<Packet>,
    cancel: CancellationToken,
) {
    let _drainer = queue.drainer();
    loop {
        let batch = tokio::select! {
            _ = cancel.cancelled() => return,
            batch = queue.next() => batch,
        };
        let permit = tokio::select! {
            _ = cancel.cancelled() => None,
            permit = ordered.reserve() => permit.ok(),
        };
        let Some(permit) = permit else {
            queue.lost(&batch);
            return;
        };
        queue.sent(&batch);
        permit.send(packet::span_batch(batch.otlp));
    }
}

/// How long a tunnel that ends cleanly may take to tell the server so
/// (END_STREAM after the packets still queued) before its connection closes.
const FINISH_GRACE: Duration = Duration::from_secs(1);

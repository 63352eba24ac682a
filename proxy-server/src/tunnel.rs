//! One connected agent: the server side of an `AgentService.Connect` stream.
//!
//! Every tunneled connection of this agent is multiplexed over the stream. The
//! reader ([`AgentTunnel::handle`]) only dispatches into per-connection
//! receive queues, so a frontend that reads slowly holds back its own
//! connection, not the tunnel (see `cluster_proxy_proto::flow`).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::duplex::{ChunkSink, Payload};
use cluster_proxy_proto::flow::{
    Delivery, FlowError, Outbound, READ_CHUNK, ReceiveQueue, ReceiveQueueRx, SendCredit,
    WindowTracker, outbound,
};
use cluster_proxy_proto::identifiers::AgentIdentifiers;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::packet::{self, Frame};
use cluster_proxy_runtime::telemetry::relay::{self, SpanForwarder};
use futures_util::stream::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::conn_trace::{ConnTrace, EndReason};
use crate::dial_failure::DialFailure;
use crate::metrics::{Metrics, Segment};

static NEXT_TUNNEL_ID: AtomicU64 = AtomicU64::new(1);

/// Flow-control and buffering settings of one tunnel.
#[derive(Debug, Clone, Copy)]
pub struct TunnelSettings {
    /// Per-connection window we grant the agent (when flow control is on).
    pub our_window: u32,
    /// The agent's window for us; `Some` means flow control was negotiated.
    pub peer_window: Option<u32>,
    /// Per-connection buffer for a plain konnectivity agent.
    pub plain_buffer: u32,
    /// How long a plain agent's data may wait on a full connection buffer
    /// before that connection is closed.
    pub plain_stall_timeout: std::time::Duration,
    /// Capacity, in packets, of the ordered queue towards the agent.
    pub ordered_capacity: usize,
    /// The agent advertised the trace-context extension: dial requests may
    /// carry the connection's trace context.
    pub trace_context: bool,
    /// The agent advertised the early-data extension: dial requests may
    /// carry the connection's first bytes.
    pub early_data: bool,
    /// The agent advertised the server-count extension: it is sent
    /// SERVER_COUNT packets when the replica count changes.
    pub server_count_updates: bool,
    /// Dials that may wait for the agent's answer at once (`--max-pending-dials-per-tunnel`).
    pub max_pending_dials: usize,
    /// Unknown connection ids whose CLOSE_RSP may be awaited at once
    /// (`--max-stray-closes-per-tunnel`): the bound on the control lane's
    /// replies to an agent's stray packets.
    pub max_stray_closes: usize,
}

/// How long an unanswered CLOSE_REQ for an unknown id holds its place in the
/// stray-close set before it may be evicted; an agent answers in a round trip.
const STRAY_CLOSE_HOLD: std::time::Duration = std::time::Duration::from_secs(30);

/// What a frontend receives for its connection.
#[derive(Debug)]
pub enum FrontendEvent {
    Data(Bytes),
    /// The connection ended (CLOSE_RSP); the text is the agent's error, if any.
    Closed(String),
}

impl From<Bytes> for FrontendEvent {
    fn from(payload: Bytes) -> Self {
        FrontendEvent::Data(payload)
    }
}

/// The outcome of a dial, delivered by the tunnel's reader.
#[derive(Debug)]
pub enum DialReply {
    Connected(Established),
    Failed(String),
    /// The tunnel ended before the agent answered.
    TunnelClosed(String),
    /// The agent sent DIAL_CLS for this dial.
    ClosedByAgent,
}

struct ConnEntry {
    queue: ReceiveQueue<FrontendEvent>,
    credit: SendCredit,
    /// When DIAL_RSP established it, for `connection_duration_seconds`.
    established_at: std::time::Instant,
    trace: Arc<ConnTrace>,
}

struct PendingDial {
    reply: oneshot::Sender<DialReply>,
    trace: Arc<ConnTrace>,
}

#[derive(Default)]
struct State {
    pending: HashMap<i64, PendingDial>,
    conns: HashMap<i64, ConnEntry>,
    /// Unknown connection ids the agent was asked to close (CLOSE_REQ sent,
    /// CLOSE_RSP not yet seen), with when: one reply per id, however many
    /// stray packets name it.
    stray_closes: HashMap<i64, std::time::Instant>,
}

/// The packets the server sends to the agent, as a gRPC response stream.
pub type OutboundStream = Pin<Box<dyn Stream<Item = Result<Packet, tonic::Status>> + Send>>;

/// Where a tunnel that negotiated the span relay hands its agent's spans.
#[derive(Debug, Clone)]
pub struct SpanRelay {
    pub forwarder: Arc<SpanForwarder>,
    /// The cluster the agent's certificate names, stamped on its spans.
    pub cluster: Arc<str>,
}

pub struct AgentTunnel {
    id: u64,
    agent_id: String,
    cluster: Option<ClusterName>,
    identifiers: AgentIdentifiers,
    settings: TunnelSettings,
    draining: AtomicBool,
    closed: CancellationToken,
    /// DIAL_REQ, DATA, CLOSE_REQ: per-connection order matters.
    ordered: mpsc::Sender<Packet>,
    /// WINDOW_UPDATE, DIAL_CLS and replies to stray packets: sent ahead of data.
    control: mpsc::UnboundedSender<Packet>,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
    /// `Some` when the span relay was negotiated.
    span_relay: Option<SpanRelay>,
    /// Whether a refused span batch was logged already (once per tunnel).
    span_batch_refusal_logged: AtomicBool,
}

impl std::fmt::Debug for AgentTunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentTunnel")
            .field("id", &self.id)
            .field("agent_id", &self.agent_id)
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

impl AgentTunnel {
    pub fn new(
        agent_id: String,
        cluster: Option<ClusterName>,
        identifiers: AgentIdentifiers,
        settings: TunnelSettings,
        span_relay: Option<SpanRelay>,
        metrics: Arc<Metrics>,
    ) -> (Arc<Self>, OutboundStream) {
        let closed = CancellationToken::new();
        let (Outbound { control, ordered }, packets) =
            outbound(settings.ordered_capacity, closed.clone());
        let tunnel = Arc::new(AgentTunnel {
            id: NEXT_TUNNEL_ID.fetch_add(1, Ordering::Relaxed),
            agent_id,
            cluster,
            identifiers,
            settings,
            draining: AtomicBool::new(false),
            closed,
            ordered,
            control,
            state: Mutex::new(State::default()),
            metrics: metrics.clone(),
            span_relay,
            span_batch_refusal_logged: AtomicBool::new(false),
        });
        let merged = packets.map(move |p| {
            metrics.packet(Segment::ToAgent, packet::type_name(&p));
            Ok(p)
        });
        (tunnel, Box::pin(merged))
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    pub fn cluster(&self) -> Option<&ClusterName> {
        self.cluster.as_ref()
    }

    pub fn identifiers(&self) -> &AgentIdentifiers {
        &self.identifiers
    }

    pub fn flow_controlled(&self) -> bool {
        self.settings.peer_window.is_some()
    }

    /// Whether the agent reads trace context in dial requests.
    pub fn accepts_trace_context(&self) -> bool {
        self.settings.trace_context
    }

    /// Dial requests to this agent may carry early data (the connection's
    /// first bytes).
    pub fn accepts_early_data(&self) -> bool {
        self.settings.early_data
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Resolves when the tunnel has closed.
    pub async fn closed(&self) {
        self.closed.cancelled().await;
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn connection_count(&self) -> usize {
        self.state().conns.len()
    }

    /// Connections plus dials still waiting for the agent's answer.
    pub fn busy_count(&self) -> usize {
        let state = self.state();
        state.conns.len() + state.pending.len()
    }

    /// Tells the agent this server is stopping (DRAIN, server to agent): our
    /// agents look for the replacement replica at once; upstream agents
    /// ignore the packet.
    pub fn announce_drain(&self) {
        self.send_control(packet::drain());
    }

    /// Tells the agent how many replicas exist now, if it negotiated the
    /// extension; upstream agents learn it only from their next Connect.
    pub fn announce_server_count(&self, count: u32) {
        if self.settings.server_count_updates {
            self.send_control(packet::server_count(count));
        }
    }

    /// Registers a dial id; the reader delivers the agent's answer to the receiver.
    pub(crate) fn register_pending(
        &self,
        random: i64,
        trace: Arc<ConnTrace>,
    ) -> Result<oneshot::Receiver<DialReply>, DialFailure> {
        let (tx, rx) = oneshot::channel();
        let mut state = self.state();
        if self.is_closed() {
            return Err(DialFailure::TunnelClosed("agent tunnel is closed".into()));
        }
        if state.pending.contains_key(&random) {
            return Err(DialFailure::BadRequest(format!(
                "dial id {random} is already in use"
            )));
        }
        if state.pending.len() >= self.settings.max_pending_dials {
            self.metrics.limited("pending_dials_per_tunnel");
            return Err(DialFailure::Overloaded(format!(
                "the agent tunnel already has {} dials waiting for the agent (--max-pending-dials-per-tunnel)",
                state.pending.len()
            )));
        }
        state
            .pending
            .insert(random, PendingDial { reply: tx, trace });
        self.metrics.pending_dials.inc();
        Ok(rx)
    }

    /// Abandons a dial that has not been answered; tells the agent to stop it.
    pub(crate) fn cancel_pending(&self, random: i64) {
        if self.state().pending.remove(&random).is_some() {
            self.metrics.pending_dials.dec();
            let _ = self.control.send(packet::close_dial(random));
        }
    }

    pub(crate) async fn send_ordered(&self, p: Packet) -> Result<(), FlowError> {
        self.ordered.send(p).await.map_err(|_| FlowError::Closed)
    }

    fn send_control(&self, p: Packet) {
        // A closed channel means the tunnel is gone, and with it the need to tell the agent.
        let _ = self.control.send(p);
    }

    /// Sends DRAIN-independent shutdown: closes the stream to the agent.
    pub fn close(&self, reason: &str) {
        let state = {
            let mut state = self.state();
            if self.closed.is_cancelled() {
                return;
            }
            self.closed.cancel();
            std::mem::take(&mut *state)
        };
        self.metrics
            .stray_close_backlog
            .dec_by(i64::try_from(state.stray_closes.len()).unwrap_or(0));
        debug!(tunnel = self.id, agent_id = %self.agent_id, reason, "agent tunnel closed");
        for (_, waiter) in state.pending {
            self.metrics.pending_dials.dec();
            let _ = waiter.reply.send(DialReply::TunnelClosed(format!(
                "agent tunnel closed before the dial completed: {reason}"
            )));
        }
        for (_, conn) in state.conns {
            conn.trace.ended(EndReason::TunnelClosed, reason);
            self.metrics
                .connection_closed(conn.established_at.elapsed());
            conn.credit.close();
            let _ = conn.queue.push(FrontendEvent::Closed(String::new()));
        }
    }

    fn remove_conn(&self, connect_id: i64) -> Option<ConnEntry> {
        let entry = self.state().conns.remove(&connect_id);
        if let Some(entry) = &entry {
            self.metrics
                .connection_closed(entry.established_at.elapsed());
        }
        entry
    }

    /// Ends one connection because the agent broke the protocol on it.
    fn fail_conn(&self, connect_id: i64, error: String) {
        warn!(tunnel = self.id, agent_id = %self.agent_id, connect_id, %error, "closing connection");
        if let Some(conn) = self.remove_conn(connect_id) {
            conn.trace.ended(EndReason::ProtocolError, &error);
            conn.credit.close();
            let _ = conn.queue.push(FrontendEvent::Closed(error));
        }
        self.send_control(packet::close_request(connect_id));
    }

    /// Asks the agent to close a connection the server does not know, once
    /// per id until its CLOSE_RSP, and at most `max_stray_closes` ids at a
    /// time: an agent sending DATA for made-up ids cannot grow the control
    /// lane, it only loses the answers (counted as `stray_closes_per_tunnel`).
    fn close_stray(&self, connect_id: i64) {
        let mut state = self.state();
        if self.is_closed() || state.stray_closes.contains_key(&connect_id) {
            return;
        }
        if state.stray_closes.len() >= self.settings.max_stray_closes {
            let before = state.stray_closes.len();
            state
                .stray_closes
                .retain(|_, asked| asked.elapsed() < STRAY_CLOSE_HOLD);
            let evicted = before - state.stray_closes.len();
            self.metrics
                .stray_close_backlog
                .dec_by(i64::try_from(evicted).unwrap_or(0));
            if evicted == 0 {
                drop(state);
                self.metrics.limited("stray_closes_per_tunnel");
                return;
            }
        }
        state
            .stray_closes
            .insert(connect_id, std::time::Instant::now());
        self.metrics.stray_close_backlog.inc();
        drop(state);
        self.send_control(packet::close_request(connect_id));
    }

    /// Unknown connection ids awaiting the agent's CLOSE_RSP.
    pub fn stray_close_backlog(&self) -> usize {
        self.state().stray_closes.len()
    }

    /// Handles one packet from the agent.
    pub async fn handle(self: &Arc<Self>, frame: Frame) {
        self.metrics.packet(Segment::FromAgent, frame.type_name());
        match frame {
            Frame::DialResponse {
                error,
                connect_id,
                random,
                early_data_written,
            } => self.on_dial_response(error, connect_id, random, early_data_written),
            Frame::Data { connect_id, data } => {
                if connect_id == 0 {
                    warn!(tunnel = self.id, agent_id = %self.agent_id, "dropping DATA with connection id 0");
                    return;
                }
                if data.is_empty() {
                    // It carries nothing, yet would cost a queue slot and no
                    // flow-control credit: a flood of them is unbounded.
                    self.metrics.limited("empty_data");
                    return;
                }
                let queue = self.state().conns.get(&connect_id).map(|c| c.queue.clone());
                let Some(queue) = queue else {
                    debug!(
                        tunnel = self.id,
                        connect_id, "DATA for unknown connection; asking the agent to close it"
                    );
                    self.close_stray(connect_id);
                    return;
                };
                match queue.push_data(data, connect_id).await {
                    Ok(()) | Err(FlowError::Closed) => {}
                    Err(e) => self.fail_conn(connect_id, e.to_string()),
                }
            }
            Frame::CloseResponse { error, connect_id } => match self.remove_conn(connect_id) {
                Some(conn) => {
                    conn.trace.ended(EndReason::AgentClose, &error);
                    conn.credit.close();
                    let _ = conn.queue.push(FrontendEvent::Closed(error));
                }
                None => {
                    if self.state().stray_closes.remove(&connect_id).is_some() {
                        self.metrics.stray_close_backlog.dec();
                    } else {
                        debug!(
                            tunnel = self.id,
                            connect_id, "CLOSE_RSP for unknown connection"
                        );
                    }
                }
            },
            Frame::CloseDial { random } => {
                let waiter = self.state().pending.remove(&random);
                if let Some(waiter) = waiter {
                    self.metrics.pending_dials.dec();
                    let _ = waiter.reply.send(DialReply::ClosedByAgent);
                }
            }
            Frame::Drain => {
                if !self.draining.swap(true, Ordering::Relaxed) {
                    tracing::info!(tunnel = self.id, agent_id = %self.agent_id, "agent is draining");
                }
            }
            Frame::WindowUpdate { connect_id, bytes } => {
                if !self.flow_controlled() {
                    return;
                }
                let credit = self
                    .state()
                    .conns
                    .get(&connect_id)
                    .map(|c| c.credit.clone());
                if let Some(credit) = credit
                    && let Err(e) = credit.grant(bytes)
                {
                    self.fail_conn(connect_id, e.to_string());
                }
            }
            Frame::SpanBatch { otlp } => self.on_span_batch(otlp),
            other @ (Frame::DialRequest { .. }
            | Frame::CloseRequest { .. }
            | Frame::ServerCount { .. }
            | Frame::Unknown(_)) => {
                debug!(
                    tunnel = self.id,
                    packet = other.type_name(),
                    "ignoring packet an agent should not send"
                );
            }
        }
    }

    /// Hands the agent's spans to the forwarder, which never waits. A batch
    /// refused (malformed, too large, or on a tunnel that did not negotiate
    /// the relay) is counted and dropped, and the tunnel carries on: its
    /// connections are worth more than the agent's spans, and a refused
    /// batch costs nothing beyond the bytes already read. Logged once per
    /// tunnel.
    fn on_span_batch(&self, otlp: Bytes) {
        let refused = match &self.span_relay {
            Some(relay) => match relay.forwarder.forward(&relay.cluster, otlp) {
                Ok(_) => return,
                Err(rejected) => {
                    self.metrics.relayed_batch_rejected(rejected.reason());
                    rejected.to_string()
                }
            },
            None => {
                self.metrics
                    .relayed_batch_rejected(relay::rejection::NOT_NEGOTIATED);
                "SPAN_BATCH on a tunnel that did not negotiate the span relay".to_owned()
            }
        };
        if !self.span_batch_refusal_logged.swap(true, Ordering::Relaxed) {
            warn!(
                tunnel = self.id,
                agent_id = %self.agent_id,
                error = refused,
                "dropping the agent's relayed spans (logged once per tunnel; counted in cluster_proxy_server_relayed_span_batches_rejected_total)"
            );
        }
    }

    fn on_dial_response(
        self: &Arc<Self>,
        error: String,
        connect_id: i64,
        random: i64,
        early_data_written: bool,
    ) {
        let mut state = self.state();
        let Some(waiter) = state.pending.remove(&random) else {
            drop(state);
            self.metrics.dial_failed("unrecognized_response");
            if connect_id != 0 {
                // The frontend gave up; don't leave the agent's connection open.
                self.close_stray(connect_id);
            }
            return;
        };
        self.metrics.pending_dials.dec();
        if !error.is_empty() || connect_id == 0 {
            drop(state);
            let error = if error.is_empty() {
                "agent answered the dial without a connection id".to_owned()
            } else {
                error
            };
            let _ = waiter.reply.send(DialReply::Failed(error));
            return;
        }
        if state.conns.contains_key(&connect_id) {
            drop(state);
            let _ = waiter.reply.send(DialReply::Failed(format!(
                "agent reused connection id {connect_id}"
            )));
            return;
        }
        let flow_on = self.settings.peer_window.is_some();
        let capacity = if flow_on {
            self.settings.our_window
        } else {
            self.settings.plain_buffer
        };
        let (queue, rx) = ReceiveQueue::new(capacity, flow_on);
        let queue = queue.with_stall_timeout(self.settings.plain_stall_timeout);
        let credit = self
            .settings
            .peer_window
            .map_or_else(SendCredit::unlimited, SendCredit::with_window);
        state.conns.insert(
            connect_id,
            ConnEntry {
                queue,
                credit: credit.clone(),
                established_at: std::time::Instant::now(),
                trace: waiter.trace.clone(),
            },
        );
        waiter.trace.mark_established();
        drop(state);
        self.metrics.established.inc();
        let established = Established::new(
            self.clone(),
            connect_id,
            credit,
            rx,
            flow_on.then(|| WindowTracker::new(self.settings.our_window)),
            waiter.trace,
            early_data_written,
        );
        // If the frontend is gone, dropping the reply closes the connection.
        let _ = waiter.reply.send(DialReply::Connected(established));
    }
}

/// State both halves of an established connection share. When the last half
/// is dropped without the connection having ended, the agent is told to close it.
#[derive(Debug)]
struct ConnShared {
    tunnel: Arc<AgentTunnel>,
    connect_id: i64,
    close_requested: AtomicBool,
    finished: AtomicBool,
    trace: Arc<ConnTrace>,
}

impl ConnShared {
    fn request_close(&self) {
        if self.finished.load(Ordering::Acquire)
            || self.close_requested.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.trace.ended(EndReason::ClientClose, "");
        let p = packet::close_request(self.connect_id);
        if let Err(mpsc::error::TrySendError::Full(p)) = self.tunnel.ordered.try_send(p) {
            // Outside a runtime (process teardown) the tunnel is going away anyway.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let ordered = self.tunnel.ordered.clone();
                runtime.spawn(async move {
                    let _ = ordered.send(p).await;
                });
            }
        }
    }
}

impl Drop for ConnShared {
    fn drop(&mut self) {
        self.request_close();
    }
}

/// A frontend's handle on an established tunneled connection.
#[derive(Debug)]
pub struct Established {
    shared: Arc<ConnShared>,
    credit: SendCredit,
    rx: ReceiveQueueRx<FrontendEvent>,
    tracker: Option<WindowTracker>,
    /// The agent wrote the dial request's early data to the target.
    early_data_written: bool,
}

impl Established {
    fn new(
        tunnel: Arc<AgentTunnel>,
        connect_id: i64,
        credit: SendCredit,
        rx: ReceiveQueueRx<FrontendEvent>,
        tracker: Option<WindowTracker>,
        trace: Arc<ConnTrace>,
        early_data_written: bool,
    ) -> Self {
        Established {
            shared: Arc::new(ConnShared {
                tunnel,
                connect_id,
                close_requested: AtomicBool::new(false),
                finished: AtomicBool::new(false),
                trace,
            }),
            credit,
            rx,
            tracker,
            early_data_written,
        }
    }

    pub fn connect_id(&self) -> i64 {
        self.shared.connect_id
    }

    /// The agent confirmed writing the dial request's early data.
    pub fn early_data_written(&self) -> bool {
        self.early_data_written
    }

    pub fn tunnel(&self) -> &Arc<AgentTunnel> {
        &self.shared.tunnel
    }

    /// Splits into a sending and a receiving half that can live in different tasks.
    pub fn split(self) -> (ConnSender, ConnReceiver) {
        (
            ConnSender {
                shared: self.shared.clone(),
                credit: self.credit,
            },
            ConnReceiver {
                shared: self.shared,
                rx: self.rx,
                tracker: self.tracker,
            },
        )
    }
}

/// Sends a connection's client-to-agent bytes.
#[derive(Debug)]
pub struct ConnSender {
    shared: Arc<ConnShared>,
    credit: SendCredit,
}

impl ConnSender {
    pub fn connect_id(&self) -> i64 {
        self.shared.connect_id
    }

    /// Sends payload to the agent, waiting for flow-control credit.
    pub async fn send(&self, mut data: Bytes) -> Result<(), FlowError> {
        // Clients may write megabytes in one DATA packet; the agent's window
        // may be smaller, so forward in chunks it can always accept.
        while !data.is_empty() {
            if self.shared.finished.load(Ordering::Acquire) {
                return Err(FlowError::Closed);
            }
            let chunk = data.split_to(data.len().min(READ_CHUNK));
            self.credit.acquire(chunk.len()).await?;
            self.shared.trace.sent_to_agent(chunk.len());
            self.shared
                .tunnel
                .send_ordered(packet::data(self.shared.connect_id, chunk))
                .await?;
        }
        Ok(())
    }

    /// Asks the agent to close the connection (CLOSE_REQ) after the data
    /// already sent; the agent's CLOSE_RSP arrives at the [`ConnReceiver`].
    pub fn request_close(&self) {
        self.shared.request_close();
    }
}

impl ChunkSink<Bytes> for ConnSender {
    type Error = FlowError;

    async fn send(&mut self, chunk: Bytes) -> Result<(), FlowError> {
        ConnSender::send(self, chunk).await
    }

    /// The client is done sending: ask the agent to close.
    async fn finish(&mut self) {
        self.request_close();
    }
}

impl Payload for FrontendEvent {
    /// A close carries none (the relays end on it, never write it).
    fn payload(&self) -> &[u8] {
        match self {
            FrontendEvent::Data(data) => data,
            FrontendEvent::Closed(_) => &[],
        }
    }
}

/// Receives a connection's agent-to-client events.
#[derive(Debug)]
pub struct ConnReceiver {
    shared: Arc<ConnShared>,
    rx: ReceiveQueueRx<FrontendEvent>,
    tracker: Option<WindowTracker>,
}

impl ConnReceiver {
    pub fn connect_id(&self) -> i64 {
        self.shared.connect_id
    }

    /// The next event. Hold the delivery until its payload has been written
    /// to the client, then report it with [`Self::consumed`].
    pub async fn recv(&mut self) -> Option<Delivery<FrontendEvent>> {
        let delivery = self.rx.recv().await;
        if matches!(
            delivery,
            None | Some(Delivery {
                event: FrontendEvent::Closed(_),
                ..
            })
        ) {
            self.shared.finished.store(true, Ordering::Release);
        }
        delivery
    }

    /// Polling form of [`Self::recv`].
    pub fn poll_recv(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Delivery<FrontendEvent>>> {
        let delivery = std::task::ready!(self.rx.poll_recv(cx));
        if matches!(
            delivery,
            None | Some(Delivery {
                event: FrontendEvent::Closed(_),
                ..
            })
        ) {
            self.shared.finished.store(true, Ordering::Release);
        }
        std::task::Poll::Ready(delivery)
    }

    /// Reports `n` payload bytes written to the client; returns credit to the agent.
    pub fn consumed(&mut self, n: usize) {
        self.shared.trace.received_from_agent(n);
        if let Some(grant) = self.tracker.as_mut().and_then(|t| t.consumed(n)) {
            self.shared
                .tunnel
                .send_control(packet::window_update(self.shared.connect_id, grant));
        }
    }
}

//! `ProxyService.Proxy`: the konnectivity gRPC frontend. One dial per stream,
//! many streams per HTTP/2 connection.
//!
//! A session reads the client's packets (dial, then DATA towards the
//! agent). The response stream reads the connection's receive queue itself.
//! Both are polled by the HTTP/2 connection's task ([`crate::grpc_port`]),
//! so bytes reach the HTTP/2 stream, or leave it, without a task hand-off.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use cluster_proxy_proto::Packet;
use cluster_proxy_proto::duplex::{self, ChunkSink, ChunkSource};
use cluster_proxy_proto::flow::FlowError;
use cluster_proxy_proto::packet::{self, Frame, PROTOCOL_TCP};
use futures_util::Stream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::Status;
use tonic::metadata::MetadataMap;
use tracing::debug;

use crate::dial::{DialFailure, DialOrigin, Dialer};
use crate::grpc_port::{InboundPackets, Opened, PacketMethod};
use crate::listener::PeerInfo;
use crate::metrics::{GaugeGuard, Metrics, Segment};
use crate::tunnel::{ConnReceiver, ConnSender, FrontendEvent};
use cluster_proxy_proto::trace::TraceHeaders;

pub struct GrpcFrontend {
    pub dialer: Arc<Dialer>,
    pub metrics: Arc<Metrics>,
    /// How long a new stream may take to send its DIAL_REQ (`--first-packet-timeout`).
    pub first_packet_timeout: std::time::Duration,
}

/// Replies the session itself may have queued for a client that does not
/// read them; a client that lets them pile up loses its stream.
const REPLY_QUEUE: usize = 16;

impl PacketMethod for GrpcFrontend {
    const PATH: &'static str = cluster_proxy_proto::grpc_framing::PROXY_PATH;
    const PORT: &'static str = "client";
    type Outbound = ProxyResponse;

    /// Starts the stream's session, which the connection's task polls
    /// beside the response.
    fn open(
        &self,
        metadata: &MetadataMap,
        peer: &Arc<PeerInfo>,
        inbound: InboundPackets,
    ) -> Result<Opened<ProxyResponse>, Status> {
        if let Some(reason) = crate::policy::refusal(peer) {
            return Err(Status::permission_denied(reason));
        }
        let origin = DialOrigin {
            frontend: "grpc",
            client: Some(peer.clone()),
            trace: TraceHeaders::from_metadata(metadata),
        };
        let (replies, replies_rx) = mpsc::channel(REPLY_QUEUE);
        let (relay, relay_rx) = oneshot::channel();
        let session = Session {
            dialer: self.dialer.clone(),
            metrics: self.metrics.clone(),
            replies,
            origin,
            first_packet_timeout: self.first_packet_timeout,
        };
        Ok(Opened {
            metadata: MetadataMap::new(),
            outbound: ProxyResponse {
                replies: Some(replies_rx),
                relay_rx: Some(relay_rx),
                relay: None,
                unreported: 0,
                emitted_at: None,
                metrics: self.metrics.clone(),
                _gauge: self.metrics.grpc_stream("Proxy"),
            },
            reader: Some(Box::pin(session.run(inbound, relay))),
        })
    }
}

struct Session {
    dialer: Arc<Dialer>,
    metrics: Arc<Metrics>,
    /// Packets the session itself answers with (DIAL_RSP, errors); they reach
    /// the client ahead of relayed data.
    replies: mpsc::Sender<Packet>,
    origin: DialOrigin,
    first_packet_timeout: std::time::Duration,
}

impl Session {
    /// Queues a reply; false when the client left [`REPLY_QUEUE`] replies
    /// unread, and the stream should end.
    fn reply(&self, p: Packet) -> bool {
        match self.replies.try_send(p) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics.limited("reply_queue");
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Sends the client's bytes towards the agent, counting the stream in
    /// `full_receive_channels` while it waits for the agent's window or the
    /// tunnel's lane (upstream: a full receive channel).
    async fn forward(&self, sender: &ConnSender, data: Bytes) -> Result<(), FlowError> {
        let mut send = std::pin::pin!(sender.send(data));
        let first = std::future::poll_fn(|cx| Poll::Ready(send.as_mut().poll(cx))).await;
        match first {
            Poll::Ready(result) => result,
            Poll::Pending => {
                let _blocked = self.metrics.full_receive_channel("Proxy");
                send.await
            }
        }
    }

    async fn next(&self, inbound: &mut InboundPackets) -> Option<Frame> {
        match inbound.message().await {
            Ok(Some(p)) => {
                let frame = Frame::from_packet(p);
                self.metrics.packet(Segment::FromClient, frame.type_name());
                Some(frame)
            }
            Ok(None) => None,
            Err(status) => {
                debug!(error = %status.message(), "client stream failed");
                if crate::agent_service::is_oversized(&status) {
                    self.metrics.limited("packet_size");
                }
                self.metrics
                    .stream_error_no_packet(Segment::FromClient, status.code());
                None
            }
        }
    }

    async fn run(self, mut inbound: InboundPackets, relay: oneshot::Sender<ConnReceiver>) {
        // 1. Wait for the dial request, for a bounded time: an idle stream
        //    holds a task and HTTP/2 stream slot.
        let first = tokio::time::timeout(self.first_packet_timeout, self.first_dial(&mut inbound));
        let (address, random, early_data) = match first.await {
            Ok(Some(dial)) => dial,
            Ok(None) => return,
            Err(_) => {
                self.metrics.limited("first_packet_timeout");
                debug!(timeout = ?self.first_packet_timeout, "no DIAL_REQ in time; ending the stream");
                return;
            }
        };
        self.relay(inbound, relay, address, random, early_data)
            .await
    }

    /// The stream's DIAL_REQ (address, dial id and early data); `None` when
    /// the stream ended or broke the protocol first (already answered).
    async fn first_dial(&self, inbound: &mut InboundPackets) -> Option<(String, i64, Bytes)> {
        loop {
            match self.next(inbound).await {
                None => return None,
                Some(Frame::DialRequest {
                    protocol,
                    address,
                    random,
                    early_data,
                    ..
                }) => {
                    if protocol != PROTOCOL_TCP {
                        let error =
                            format!("unsupported protocol {protocol:?}: only \"tcp\" is supported");
                        self.reply(packet::dial_response_error(random, error));
                        return None;
                    }
                    return Some((address, random, early_data));
                }
                Some(Frame::Data { connect_id, .. }) => {
                    self.reply(packet::close_response(
                        connect_id,
                        "backend not initialized",
                    ));
                    return None;
                }
                Some(Frame::CloseRequest { connect_id }) => {
                    self.reply(packet::close_response(connect_id, "backend uninitialized"));
                    return None;
                }
                Some(_) => {}
            }
        }
    }

    async fn relay(
        self,
        mut inbound: InboundPackets,
        relay: oneshot::Sender<ConnReceiver>,
        address: String,
        random: i64,
        early_data: Bytes,
    ) {
        // 2. Dial, while watching the client for DIAL_CLS or disconnect.
        //    Dropping the dial future cancels it (and tells the agent).
        let dial = self
            .dialer
            .dial(&address, random, self.origin.clone(), early_data.clone());
        tokio::pin!(dial);
        let established = loop {
            tokio::select! {
                result = &mut dial => match result {
                    Ok(established) => break established,
                    Err(failure) => {
                        debug!(address, error = %failure.message(), "dial failed");
                        self.reply(match failure {
                            DialFailure::ClosedByAgent => packet::close_dial(random),
                            other => packet::dial_response_error(random, other.message()),
                        });
                        return;
                    }
                },
                frame = self.next(&mut inbound) => match frame {
                    None => return,
                    Some(Frame::CloseDial { random: r }) if r == random => return,
                    Some(_) => {}
                },
            }
        };
        let connect_id = established.connect_id();
        let agent_wrote_early_data = established.early_data_written();
        // Early data is delivered either way: by the agent, or below as the
        // connection's first DATA (an agent without the extension). A client
        // that does not see the confirmation (an upstream server) sends it
        // again itself.
        self.reply(packet::dial_response_connected(
            random,
            connect_id,
            !early_data.is_empty(),
        ));
        if !early_data.is_empty() {
            self.metrics.early_data_dial(agent_wrote_early_data);
        }
        let (sender, receiver) = established.split();
        if relay.send(receiver).is_err() {
            return;
        }
        if !agent_wrote_early_data
            && !early_data.is_empty()
            && self.forward(&sender, early_data).await.is_err()
        {
            sender.request_close();
            return;
        }

        // 3. Relay the client's bytes until it closes or breaks the contract;
        //    then ask the agent to close (the sink's finish). The agent's
        //    CLOSE_RSP still reaches the client through the response stream.
        let data = ClientData {
            session: &self,
            inbound: &mut inbound,
            sender: &sender,
            connect_id,
        };
        let to_agent = ToAgent {
            session: &self,
            sender: &sender,
        };
        duplex::copy(data, to_agent).await;
    }
}

/// The DATA a client sends on its stream once the dial is established, as
/// chunks; the other packets it may send meanwhile are handled here.
struct ClientData<'a> {
    session: &'a Session,
    inbound: &'a mut InboundPackets,
    sender: &'a ConnSender,
    connect_id: i64,
}

impl ChunkSource for ClientData<'_> {
    type Chunk = Bytes;
    /// The stream ended or broke the contract (already answered).
    type End = ();

    async fn recv(&mut self) -> Result<Bytes, ()> {
        loop {
            match self.session.next(self.inbound).await {
                None => return Err(()),
                Some(Frame::Data { connect_id: 0, .. }) => {}
                Some(Frame::Data {
                    connect_id: id,
                    data,
                }) if id == self.connect_id => return Ok(data),
                Some(Frame::CloseRequest { connect_id: id }) if id == self.connect_id => {
                    self.sender.request_close()
                }
                Some(Frame::Data { connect_id: id, .. })
                | Some(Frame::CloseRequest { connect_id: id }) => {
                    self.session
                        .reply(packet::close_response(id, "mismatched connection IDs"));
                    return Err(());
                }
                Some(Frame::DialRequest { random: r, .. }) => {
                    if !self.session.reply(packet::dial_response_error(
                        r,
                        "only one dial per stream is supported",
                    )) {
                        return Err(());
                    }
                }
                Some(_) => {}
            }
        }
    }
}

/// Sends a client's bytes towards the agent ([`Session::forward`]).
struct ToAgent<'a> {
    session: &'a Session,
    sender: &'a ConnSender,
}

impl ChunkSink<Bytes> for ToAgent<'_> {
    type Error = FlowError;

    async fn send(&mut self, chunk: Bytes) -> Result<(), FlowError> {
        self.session.forward(self.sender, chunk).await
    }

    async fn finish(&mut self) {
        self.sender.request_close();
    }
}

/// The response half of a `Proxy` stream: the session's replies first, then
/// the agent's bytes straight from the connection's receive queue, ending
/// with the agent's CLOSE_RSP.
pub struct ProxyResponse {
    replies: Option<mpsc::Receiver<Packet>>,
    relay_rx: Option<oneshot::Receiver<ConnReceiver>>,
    relay: Option<ConnReceiver>,
    /// Payload bytes handed to tonic but not yet credited back to the agent.
    unreported: usize,
    /// When the last packet went to tonic: it asks for the next one once it
    /// has encoded and buffered that one (`frontend_write_duration_seconds`).
    emitted_at: Option<Instant>,
    metrics: Arc<Metrics>,
    _gauge: GaugeGuard,
}

impl ProxyResponse {
    fn emit(&mut self, p: Packet) -> Poll<Option<Result<Packet, Status>>> {
        self.metrics
            .packet(Segment::ToClient, packet::type_name(&p));
        self.emitted_at = Some(Instant::now());
        Poll::Ready(Some(Ok(p)))
    }
}

impl Stream for ProxyResponse {
    type Item = Result<Packet, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(emitted) = this.emitted_at.take() {
            this.metrics
                .frontend_write_duration
                .observe(emitted.elapsed().as_secs_f64());
        }
        // tonic asks for the next item only once it took the previous one.
        if this.unreported > 0
            && let Some(relay) = this.relay.as_mut()
        {
            relay.consumed(std::mem::take(&mut this.unreported));
        }
        if let Some(replies) = this.replies.as_mut() {
            match replies.poll_recv(cx) {
                Poll::Ready(Some(p)) => return this.emit(p),
                Poll::Ready(None) => this.replies = None,
                Poll::Pending => {}
            }
        }
        if let Some(rx) = this.relay_rx.as_mut() {
            match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(relay)) => {
                    this.relay = Some(relay);
                    this.relay_rx = None;
                    // The session queued DIAL_RSP before handing over the
                    // relay; it must reach the client before any data.
                    if let Some(Ok(p)) = this.replies.as_mut().map(|r| r.try_recv()) {
                        return this.emit(p);
                    }
                }
                Poll::Ready(Err(_)) => this.relay_rx = None,
                Poll::Pending => {}
            }
        }
        if let Some(relay) = this.relay.as_mut() {
            let connect_id = relay.connect_id();
            match relay.poll_recv(cx) {
                Poll::Ready(Some(delivery)) => {
                    return match delivery.event {
                        FrontendEvent::Data(data) => {
                            this.unreported = data.len();
                            this.emit(packet::data(connect_id, data))
                        }
                        FrontendEvent::Closed(error) => {
                            this.relay = None;
                            this.replies = None;
                            this.emit(packet::close_response(connect_id, error))
                        }
                    };
                }
                Poll::Ready(None) => {
                    this.relay = None;
                    this.replies = None;
                }
                Poll::Pending => {}
            }
        }
        if this.replies.is_none() && this.relay_rx.is_none() && this.relay.is_none() {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

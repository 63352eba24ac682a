//! `AgentService.Connect`: admitting an agent and running its tunnel.
//!
//! Identity binding: the agent's client certificate names its cluster (see
//! `cluster_proxy_proto::identity`), and the agent may only register
//! identifiers that belong to that cluster. Upstream trusts the
//! `agentidentifiers` header blindly; here that is an explicit opt-out.
//!
//! A refused agent is told why in the gRPC status. A Go agent never reads
//! that status: it calls `stream.Header()`, which for a trailers-only error
//! answers no metadata, and logs only `expected one server ID in the
//! context, got []`. So a peer whose `user-agent` is grpc-go's gets the
//! response headers first, with the reason as a second `serverid` value:
//! it logs `expected one server ID in the context, got [refused: <why>]`,
//! closes, and retries as after any failed connect; the status follows as
//! usual. Other peers (ours, tonic, grpcio) get the plain status.

use std::sync::Arc;

use cluster_proxy_proto::flow::parse_window;
use cluster_proxy_proto::grpc_framing::AGENT_CONNECT_PATH;
use cluster_proxy_proto::identifiers::AgentIdentifiers;
use cluster_proxy_proto::metadata;
use cluster_proxy_proto::packet::Frame;
use tonic::Status;
use tonic::metadata::{MetadataMap, MetadataValue};
use tracing::{info, warn};

use crate::grpc_port::{InboundPackets, Opened, PacketMethod};
use crate::listener::PeerInfo;
use crate::metrics::{GaugeGuard, Metrics};
use crate::registry::{Registry, Strategy};
use crate::tunnel::{AgentTunnel, OutboundStream, SpanRelay, TunnelSettings};
use cluster_proxy_runtime::telemetry::relay::SpanForwarder;

/// Settings the agent endpoint needs.
#[derive(Debug, Clone)]
pub struct AgentEndpointSettings {
    pub server_id: String,
    /// The current replica count (see [`crate::peers`]).
    pub server_count: tokio::sync::watch::Receiver<u32>,
    /// Accept agents whose certificate names no cluster, trusting their
    /// claimed identifiers (upstream behaviour; for upstream-issued certs).
    pub allow_unbound_agents: bool,
    pub flow_control_window: u32,
    pub plain_peer_buffer: u32,
    pub plain_peer_stall_timeout: std::time::Duration,
    pub ordered_capacity: usize,
    pub max_tunnels_per_agent: usize,
    pub max_pending_dials_per_tunnel: usize,
    pub max_stray_closes_per_tunnel: usize,
    /// Forwards the spans agents relay to the server's collector; `None`
    /// (no collector, or packets too small for a span batch): the relay is
    /// offered to no agent.
    pub span_forwarder: Option<Arc<SpanForwarder>>,
}

pub struct AgentEndpoint {
    pub settings: AgentEndpointSettings,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// Set once the server drains; an agent connection accepted just before
    /// is told DRAIN as soon as it registers.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
}

fn single_value<'a>(md: &'a MetadataMap, key: &str) -> Result<Option<&'a str>, Status> {
    let mut values = md.get_all(key).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(Status::invalid_argument(format!(
            "expected at most one {key} value"
        )));
    }
    first
        .map(|v| {
            v.to_str()
                .map_err(|_| Status::invalid_argument(format!("{key} is not valid ASCII")))
        })
        .transpose()
}

impl AgentEndpoint {
    fn admit(
        &self,
        md: &MetadataMap,
        peer: &Arc<PeerInfo>,
    ) -> Result<(String, AgentIdentifiers, Arc<PeerInfo>), Status> {
        let agent_id = single_value(md, metadata::AGENT_ID)?
            .filter(|id| !id.is_empty())
            .ok_or_else(|| Status::invalid_argument("expected one agent ID in the context"))?
            .to_owned();
        let identifiers = match single_value(md, metadata::AGENT_IDENTIFIERS)? {
            Some(raw) => AgentIdentifiers::parse(raw).map_err(|e| {
                Status::invalid_argument(format!("fail to parse url encoded string: {e}"))
            })?,
            None => AgentIdentifiers::default(),
        };
        let peer = peer.clone();
        if let Some(e) = &peer.identity_error {
            warn!(agent_id, remote = %peer.remote, subject = %peer.subject, error = %e, "agent refused: bad identity");
            return Err(Status::permission_denied(format!(
                "agent certificate identity: {e}"
            )));
        }
        match &peer.cluster {
            Some(cluster) => {
                if let Err(e) = cluster.check_identifiers(&identifiers) {
                    warn!(agent_id, %cluster, remote = %peer.remote, error = %e, "agent refused: identifiers do not belong to its cluster");
                    return Err(Status::permission_denied(e.to_string()));
                }
            }
            None if self.settings.allow_unbound_agents => {
                warn!(agent_id, subject = %peer.subject, "accepting agent whose certificate names no cluster (--allow-unbound-agents)");
            }
            None => {
                warn!(agent_id, remote = %peer.remote, subject = %peer.subject, "agent refused: certificate names no cluster");
                return Err(Status::permission_denied(
                    "agent certificate names no cluster; issue agent certificates with cert-authority \
                     or start the server with --allow-unbound-agents to accept upstream-issued ones",
                ));
            }
        }
        Ok((agent_id, identifiers, peer))
    }
}

/// An agent's `Connect` call, admitted (or refused in the form a Go agent
/// logs): for a tunnel, the reader dispatches the agent's packets until its
/// stream ends.
impl PacketMethod for AgentEndpoint {
    const PATH: &'static str = AGENT_CONNECT_PATH;
    const PORT: &'static str = "agent";
    const WEBSOCKET_PATH: Option<&'static str> = Some(cluster_proxy_proto::websocket::TUNNEL_PATH);
    type Outbound = OutboundStream;

    /// Admits the agent and registers its tunnel.
    fn open(
        &self,
        md: &MetadataMap,
        peer: &Arc<PeerInfo>,
        inbound: InboundPackets,
    ) -> Result<Opened<OutboundStream>, Status> {
        let (agent_id, identifiers, peer) = match self.admit(md, peer) {
            Ok(admitted) => admitted,
            Err(status) if is_go_grpc(md) => return Ok(refusal_for_go(status)),
            Err(status) => return Err(status),
        };
        // Everything that can refuse the call comes before its tunnel is
        // registered: once it is, only its reader unregisters it.
        let server_id = MetadataValue::try_from(self.settings.server_id.as_str())
            .map_err(|_| Status::internal("server id is not valid metadata"))?;
        let peer_window = single_value(md, metadata::FLOW_CONTROL_WINDOW)?
            .map(parse_window)
            .transpose()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        // Only an agent that asked for it is sent trace context (field 100
        // of DialRequest); upstream agents get plain konnectivity bytes.
        let trace_context = md
            .get(metadata::TRACE_CONTEXT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(',')
                    .any(|f| f.trim() == metadata::TRACE_CONTEXT_W3C)
            });
        let server_count_updates = md
            .get(metadata::SERVER_COUNT_UPDATES)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(',')
                    .any(|f| f.trim() == metadata::SERVER_COUNT_UPDATES_V1)
            });
        let early_data = md
            .get(metadata::EARLY_DATA)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|f| f.trim() == metadata::EARLY_DATA_V1));
        // Only an agent that asked and whose certificate names its cluster
        // (the name its spans are stamped with) may relay spans, and only
        // when there is a collector to forward them to.
        let asked_for_span_relay = md
            .get(metadata::SPAN_RELAY)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(',')
                    .any(|f| f.trim() == metadata::SPAN_RELAY_OTLP_V1)
            });
        let span_relay = match (&self.settings.span_forwarder, &peer.cluster) {
            (Some(forwarder), Some(cluster)) if asked_for_span_relay => Some(SpanRelay {
                forwarder: forwarder.clone(),
                cluster: Arc::from(cluster.as_str()),
            }),
            _ => None,
        };
        let relays_spans = span_relay.is_some();
        let settings = TunnelSettings {
            our_window: self.settings.flow_control_window,
            peer_window,
            plain_buffer: self.settings.plain_peer_buffer,
            plain_stall_timeout: self.settings.plain_peer_stall_timeout,
            ordered_capacity: self.settings.ordered_capacity,
            trace_context,
            early_data,
            server_count_updates,
            max_pending_dials: self.settings.max_pending_dials_per_tunnel,
            max_stray_closes: self.settings.max_stray_closes_per_tunnel,
        };
        let (tunnel, outbound) = AgentTunnel::new(
            agent_id.clone(),
            peer.cluster.clone(),
            identifiers,
            settings,
            span_relay,
            self.metrics.clone(),
        );
        info!(
            tunnel = tunnel.id(),
            agent_id,
            cluster = peer.cluster.as_ref().map(|c| c.as_str()).unwrap_or("<unbound>"),
            remote = %peer.remote,
            flow_control = peer_window.is_some(),
            trace_context,
            span_relay = relays_spans,
            "agent connected"
        );
        if let Err(held) = self
            .registry
            .register_bounded(tunnel.clone(), self.settings.max_tunnels_per_agent)
        {
            self.metrics.limited("tunnels_per_agent");
            warn!(tunnel = tunnel.id(), agent_id, held, remote = %peer.remote, "agent refused: too many tunnels for its identity");
            tunnel.close("refused: too many tunnels");
            return Err(Status::resource_exhausted(format!(
                "this agent identity already holds {held} tunnels to this proxy-server (--max-tunnels-per-agent)"
            )));
        }
        if self.draining.load(std::sync::atomic::Ordering::SeqCst) {
            tunnel.announce_drain();
        }
        self.update_backend_gauges();
        let metrics = self.metrics.clone();
        let mut registered = Registered {
            tunnel: tunnel.clone(),
            registry: self.registry.clone(),
            metrics: self.metrics.clone(),
            reason: None,
        };
        // Polled by the connection's task, beside the connection itself.
        let reader = Box::pin(async move {
            let _stream_gauge = metrics.grpc_stream("Connect");
            let _tunnel_gauge = GaugeGuard::new(metrics.agent_tunnels.clone());
            let reason = read_agent(&registered.tunnel, inbound, &metrics).await;
            registered.ended(reason);
        });

        let mut answer = MetadataMap::new();
        let md = &mut answer;
        md.insert(metadata::SERVER_ID, server_id);
        // Read after registering: a count that changes from here on is
        // announced on this tunnel too, so the agent never misses one.
        let server_count = *self.settings.server_count.borrow();
        md.insert(metadata::SERVER_COUNT, MetadataValue::from(server_count));
        if peer_window.is_some() {
            md.insert(
                metadata::FLOW_CONTROL_WINDOW,
                MetadataValue::from(self.settings.flow_control_window),
            );
        }
        if relays_spans {
            md.insert(
                metadata::SPAN_RELAY,
                MetadataValue::from_static(metadata::SPAN_RELAY_OTLP_V1),
            );
        }
        Ok(Opened {
            metadata: answer,
            outbound,
            reader: Some(reader),
        })
    }
}

/// A registered tunnel, unregistered and closed when its reader ends (or
/// is dropped with its connection's task).
struct Registered {
    tunnel: Arc<AgentTunnel>,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    /// Why the reader ended.
    reason: Option<String>,
}

impl Registered {
    fn ended(&mut self, reason: String) {
        self.reason = Some(reason);
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let reason = self
            .reason
            .take()
            .unwrap_or_else(|| "the agent's connection was dropped".into());
        self.registry.unregister(&self.tunnel);
        self.tunnel.close(&reason);
        update_backend_gauges(&self.registry, &self.metrics);
        info!(
            tunnel = self.tunnel.id(),
            agent_id = self.tunnel.agent_id(),
            reason,
            "agent disconnected"
        );
    }
}

/// The first `serverid` value of a refusal sent to a Go agent.
pub const REFUSED_SERVER_ID: &str = "refused:";

/// Whether the peer is grpc-go (its `user-agent` starts `grpc-go/`).
fn is_go_grpc(md: &MetadataMap) -> bool {
    md.get("user-agent")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| ua.starts_with("grpc-go/"))
}

/// A refusal a Go agent logs (see the module docs): headers whose two
/// `serverid` values are [`REFUSED_SERVER_ID`] and the reason, then `status`.
fn refusal_for_go(status: Status) -> Opened<OutboundStream> {
    let reason: String = status
        .message()
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .collect();
    let outbound: OutboundStream = Box::pin(futures_util::stream::once(async move { Err(status) }));
    let mut md = MetadataMap::new();
    md.append(
        metadata::SERVER_ID,
        MetadataValue::from_static(REFUSED_SERVER_ID),
    );
    if let Ok(value) = MetadataValue::try_from(reason.as_str()) {
        md.append(metadata::SERVER_ID, value);
    }
    Opened {
        metadata: md,
        outbound,
        reader: None,
    }
}

impl AgentEndpoint {
    fn update_backend_gauges(&self) {
        update_backend_gauges(&self.registry, &self.metrics);
    }
}

fn update_backend_gauges(registry: &Registry, metrics: &Metrics) {
    for s in registry.strategies() {
        metrics.set_ready_backends(s.name(), registry.ready_backends(*s));
    }
    metrics
        .ready_backend_connections
        .set(i64::try_from(registry.ready_backends(Strategy::Default)).unwrap_or(i64::MAX));
}

/// Whether tonic refused a message above `--max-packet-size`.
pub(crate) fn is_oversized(status: &Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().contains("too large")
}

/// Dispatches the agent's packets until its stream ends; returns why it ended.
async fn read_agent(
    tunnel: &Arc<AgentTunnel>,
    mut inbound: InboundPackets,
    metrics: &Metrics,
) -> String {
    loop {
        tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(p)) => tunnel.handle(Frame::from_packet(p)).await,
                Ok(None) => return "agent closed the stream".into(),
                Err(status) => {
                    if is_oversized(&status) {
                        metrics.limited("packet_size");
                    }
                    metrics.stream_error_no_packet(crate::metrics::Segment::FromAgent, status.code());
                    return format!("agent stream failed: {}", status.message());
                }
            },
            _ = tunnel.closed() => return "server closed the tunnel".into(),
        }
    }
}

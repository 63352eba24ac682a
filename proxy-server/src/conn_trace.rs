//! The span of one tunneled connection: opened when the dial starts, ended
//! when the connection is gone, with bytes each way and how it ended.
//!
//! Counting costs one relaxed atomic add per DATA packet; the span is made
//! with the OpenTelemetry API directly ([`DirectSpan`]), its attributes
//! added in four steps (start, routing, dial result, end) and only when the
//! span is sampled. With no exporter the span is disabled and only the
//! counters remain.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cluster_proxy_proto::trace::direct::tcp_server_attributes;
use cluster_proxy_proto::trace::{DirectSpan, TraceHeaders};
use opentelemetry::KeyValue;
use opentelemetry::trace::{SpanKind, TraceId};

use crate::listener::PeerInfo;

/// Who asks for a dial, for the connection's span.
#[derive(Debug, Clone, Default)]
pub struct DialOrigin {
    /// `grpc` or `http-connect`.
    pub frontend: &'static str,
    /// The client's verified certificate.
    pub client: Option<Arc<PeerInfo>>,
    /// The client's trace context (gRPC metadata or CONNECT headers).
    pub trace: Option<TraceHeaders>,
}

/// How a connection ended, as the span's `cluster_proxy.end_reason` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The client closed (CLOSE_REQ, or its stream or socket ended).
    ClientClose,
    /// The agent closed (CLOSE_RSP).
    AgentClose,
    /// The agent's tunnel ended under the connection.
    TunnelClosed,
    /// The agent broke the protocol or its buffer limits on this connection.
    ProtocolError,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::ClientClose => "client_close",
            EndReason::AgentClose => "agent_close",
            EndReason::TunnelClosed => "tunnel_closed",
            EndReason::ProtocolError => "protocol_error",
        }
    }
}

/// The most attributes `tunnel.connection` gets: 7 at the start, 4 when
/// routed, 2 when dialed (or 2 and the error when the dial fails), 3 and
/// an error at the end.
const ATTRIBUTES: usize = 17;

/// Shared by the tunnel's entry for the connection and the frontend's halves;
/// the span ends when the last of them lets go.
#[derive(Debug)]
pub struct ConnTrace {
    span: Mutex<DirectSpan>,
    bytes_to_agent: AtomicU64,
    bytes_from_agent: AtomicU64,
    /// Set once the agent accepted the dial; a failed dial's span is
    /// completed by the dialer instead.
    established: AtomicBool,
    /// The first reason reported wins; the error text goes with it.
    end: Mutex<Option<(EndReason, String)>>,
}

impl ConnTrace {
    /// Starts the proxy-server's span for one tunneled connection
    /// (`tunnel.connection`, see the README's "Tracing"), a child of the
    /// client's trace context when it sent one, with what is known before
    /// routing: the client and the address it asks for.
    pub fn start(server_id: &str, address: &str, origin: &DialOrigin) -> Self {
        let mut span = DirectSpan::start(
            "tunnel.connection",
            SpanKind::Server,
            origin.trace.as_ref(),
            ATTRIBUTES,
        );
        span.set_attributes(|| {
            let client = origin.client.as_deref();
            tcp_server_attributes(address)
                .into_iter()
                .chain([
                    KeyValue::new("cluster_proxy.frontend", origin.frontend),
                    KeyValue::new("cluster_proxy.server_id", server_id.to_owned()),
                ])
                .chain(
                    client
                        .and_then(|client| client.remote.ip())
                        .map(|ip| KeyValue::new("client.address", ip.to_string())),
                )
                .chain(client.map(|client| {
                    KeyValue::new("cluster_proxy.client_identity", client.subject.clone())
                }))
        });
        ConnTrace {
            span: Mutex::new(span),
            bytes_to_agent: AtomicU64::new(0),
            bytes_from_agent: AtomicU64::new(0),
            established: AtomicBool::new(false),
            end: Mutex::new(None),
        }
    }

    fn span(&self) -> MutexGuard<'_, DirectSpan> {
        self.span.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the tunnel the dial was routed to.
    pub fn routed(
        &self,
        strategy: &'static str,
        agent_id: &str,
        tunnel: u64,
        cluster: Option<&str>,
    ) {
        self.span().set_attributes(|| {
            [
                KeyValue::new("cluster_proxy.strategy", strategy),
                KeyValue::new("cluster_proxy.agent_id", agent_id.to_owned()),
                KeyValue::new("cluster_proxy.tunnel", saturating_i64(tunnel)),
            ]
            .into_iter()
            .chain(
                cluster.map(|cluster| KeyValue::new("cluster_proxy.cluster", cluster.to_owned())),
            )
        });
    }

    /// The trace context for the agent's span.
    pub fn headers(&self) -> Option<TraceHeaders> {
        self.span().headers()
    }

    /// The trace id, for log lines about this connection.
    pub fn trace_id(&self) -> Option<TraceId> {
        self.span().trace_id()
    }

    /// Records a dial the agent accepted.
    pub fn dialed(&self, latency_ms: f64, connect_id: i64) {
        self.span().set_attributes(|| {
            [
                KeyValue::new("cluster_proxy.dial_latency_ms", latency_ms),
                KeyValue::new("cluster_proxy.connect_id", connect_id),
            ]
        });
    }

    /// Records a failed dial, with an event named `event`, and ends the span.
    pub fn dial_failed(
        &self,
        latency_ms: f64,
        reason: &'static str,
        message: &str,
        event: &'static str,
    ) {
        let mut span = self.span();
        span.set_attributes(|| {
            [
                KeyValue::new("cluster_proxy.dial_latency_ms", latency_ms),
                KeyValue::new("cluster_proxy.end_reason", reason),
            ]
        });
        span.add_event(event, || {
            vec![
                KeyValue::new("cluster_proxy.end_reason", reason),
                KeyValue::new("error.message", message.to_owned()),
            ]
        });
        span.fail(message);
        span.end();
    }

    pub fn mark_established(&self) {
        self.established.store(true, Ordering::Relaxed);
    }

    pub fn sent_to_agent(&self, n: usize) {
        self.bytes_to_agent.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn received_from_agent(&self, n: usize) {
        self.bytes_from_agent.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Notes why the connection ends, unless an earlier reason was noted.
    pub fn ended(&self, reason: EndReason, error: &str) {
        let mut end = self.end.lock().unwrap_or_else(|p| p.into_inner());
        if end.is_none() {
            *end = Some((reason, error.to_owned()));
        }
    }
}

impl Drop for ConnTrace {
    fn drop(&mut self) {
        let span = self.span.get_mut().unwrap_or_else(|p| p.into_inner());
        if !span.is_recording() || !self.established.load(Ordering::Relaxed) {
            return;
        }
        let end = self.end.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        let (reason, error) = end.unwrap_or((EndReason::ClientClose, String::new()));
        let to_agent = saturating_i64(self.bytes_to_agent.load(Ordering::Relaxed));
        let from_agent = saturating_i64(self.bytes_from_agent.load(Ordering::Relaxed));
        span.set_attributes(|| {
            [
                KeyValue::new("cluster_proxy.bytes_to_agent", to_agent),
                KeyValue::new("cluster_proxy.bytes_from_agent", from_agent),
                KeyValue::new("cluster_proxy.end_reason", reason.as_str()),
            ]
        });
        let failed = matches!(reason, EndReason::TunnelClosed | EndReason::ProtocolError);
        if failed {
            span.fail(&error);
        } else if !error.is_empty() {
            span.set_attributes(|| [KeyValue::new("error.message", error)]);
        }
        span.end();
    }
}

/// A counter as a span attribute: OpenTelemetry's integers are signed.
pub(crate) fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_saturate_into_signed_attributes() {
        assert_eq!(saturating_i64(u64::MAX), i64::MAX);
        assert_eq!(saturating_i64(5), 5);
    }
}

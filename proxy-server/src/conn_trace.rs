//! The span of one tunneled connection: opened when the dial starts, ended
//! when the connection is gone, with bytes each way and how it ended.
//!
//! Counting costs one relaxed atomic add per DATA packet; the span itself is
//! created and recorded once per connection. With no exporter installed the
//! span is disabled (see `cluster_proxy_proto::trace::SPAN_TARGET`) and only
//! the counters remain.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tracing::Span;

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

/// Shared by the tunnel's entry for the connection and the frontend's halves;
/// the span ends when the last of them lets go.
#[derive(Debug)]
pub struct ConnTrace {
    span: Span,
    bytes_to_agent: AtomicU64,
    bytes_from_agent: AtomicU64,
    /// Set once the agent accepted the dial; a failed dial's span is
    /// completed by the dialer instead.
    established: AtomicBool,
    /// The first reason reported wins; the error text goes with it.
    end: Mutex<Option<(EndReason, String)>>,
}

impl ConnTrace {
    pub fn new(span: Span) -> Self {
        ConnTrace {
            span,
            bytes_to_agent: AtomicU64::new(0),
            bytes_from_agent: AtomicU64::new(0),
            established: AtomicBool::new(false),
            end: Mutex::new(None),
        }
    }

    pub fn span(&self) -> &Span {
        &self.span
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
        let span = &self.span;
        if span.is_disabled() || !self.established.load(Ordering::Relaxed) {
            return;
        }
        span.record(
            "cluster_proxy.bytes_to_agent",
            self.bytes_to_agent.load(Ordering::Relaxed),
        );
        span.record(
            "cluster_proxy.bytes_from_agent",
            self.bytes_from_agent.load(Ordering::Relaxed),
        );
        let end = self.end.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        let (reason, error) = end.unwrap_or((EndReason::ClientClose, String::new()));
        span.record("cluster_proxy.end_reason", reason.as_str());
        if !error.is_empty() {
            span.record("error.message", error.as_str());
        }
        if matches!(reason, EndReason::TunnelClosed | EndReason::ProtocolError) {
            span.record("otel.status_code", "ERROR");
        }
    }
}

//! The span of one tunneled connection: opened when the dial starts, ended
//! when the connection is gone, with bytes each way and how it ended.
//!
//! Counting costs one relaxed atomic add per DATA packet; the span itself is
//! created and recorded once per connection. With no exporter installed the
//! span is disabled (see `cluster_proxy_proto::trace::SPAN_TARGET`) and only
//! the counters remain.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cluster_proxy_proto::trace::record_fields;
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
        let end = self.end.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        let (reason, error) = end.unwrap_or((EndReason::ClientClose, String::new()));
        let failed = matches!(reason, EndReason::TunnelClosed | EndReason::ProtocolError);
        // As i64: OpenTelemetry's integers are signed (see saturating_i64).
        let to_agent = saturating_i64(self.bytes_to_agent.load(Ordering::Relaxed));
        let from_agent = saturating_i64(self.bytes_from_agent.load(Ordering::Relaxed));
        let error = error.as_str();
        record_fields(
            span,
            [
                ("cluster_proxy.bytes_to_agent", Some(&to_agent)),
                ("cluster_proxy.bytes_from_agent", Some(&from_agent)),
                ("cluster_proxy.end_reason", Some(&reason.as_str())),
                ("error.message", (!error.is_empty()).then_some(&error as _)),
                ("otel.status_code", failed.then_some(&"ERROR" as _)),
            ],
        );
    }
}

/// A counter as a span attribute: OpenTelemetry's integers are signed, and
/// the OpenTelemetry layer records a `u64` as its decimal string (an
/// allocation, and a string attribute where an integer belongs).
pub(crate) fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::registry::Registry;

    use super::*;

    /// How each recorded field arrived: `i64` or `other`.
    #[derive(Clone, Default)]
    struct FieldKinds(Arc<Mutex<Vec<(String, &'static str)>>>);

    impl Visit for FieldKinds {
        fn record_i64(&mut self, field: &Field, _: i64) {
            self.push(field, "i64");
        }
        fn record_debug(&mut self, field: &Field, _: &dyn std::fmt::Debug) {
            self.push(field, "other");
        }
    }

    impl FieldKinds {
        fn push(&self, field: &Field, kind: &'static str) {
            if let Ok(mut kinds) = self.0.lock() {
                kinds.push((field.name().to_owned(), kind));
            }
        }
        fn kind_of(&self, name: &str) -> Option<&'static str> {
            let kinds = self.0.lock().ok()?;
            kinds.iter().find(|(n, _)| n == name).map(|(_, k)| *k)
        }
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for FieldKinds {
        fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
            attrs.record(&mut self.clone());
        }
        fn on_record(&self, _: &Id, values: &Record<'_>, _: Context<'_, S>) {
            values.record(&mut self.clone());
        }
    }

    /// The OpenTelemetry layer turns every non-`i64` integer into its
    /// decimal string: the byte counts must reach it as `i64`.
    #[test]
    fn byte_counts_are_recorded_as_signed_integers() {
        let kinds = FieldKinds::default();
        let subscriber = Registry::default().with(kinds.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "tunnel.connection",
                cluster_proxy.bytes_to_agent = tracing::field::Empty,
                cluster_proxy.bytes_from_agent = tracing::field::Empty,
                cluster_proxy.end_reason = tracing::field::Empty,
            );
            let trace = ConnTrace::new(span);
            trace.mark_established();
            trace.sent_to_agent(5);
            trace.received_from_agent(7);
        });
        assert_eq!(kinds.kind_of("cluster_proxy.bytes_to_agent"), Some("i64"));
        assert_eq!(kinds.kind_of("cluster_proxy.bytes_from_agent"), Some("i64"));
        assert_eq!(saturating_i64(u64::MAX), i64::MAX);
    }
}

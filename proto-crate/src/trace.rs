//! W3C Trace Context propagation for tunneled connections.
//!
//! A tunneled connection is one trace. The client sends `traceparent` and
//! `tracestate` in the metadata of its `Proxy` stream (gRPC) or as headers of
//! its CONNECT request (HTTP); the proxy-server continues that trace and
//! forwards its own span's context to the agent inside the dial request
//! ([`crate::konnectivity::TraceContext`], sent only to agents that
//! advertised [`crate::metadata::TRACE_CONTEXT`]).
//!
//! The parser follows <https://www.w3.org/TR/trace-context/>: a malformed or
//! all-zero `traceparent` is ignored (the receiver starts a new trace), never
//! an error for the connection.

use std::str::FromStr;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

pub mod direct;

pub use direct::{DirectSpan, install_tracer};
pub use opentelemetry::global::BoxedTracer;

/// The `tracing` target of the spans exported but never logged (the
/// controllers' reconciles, the health-prober's rounds and probes). Log
/// filters leave it off, so with no exporter these spans are disabled and
/// cost nothing; the OpenTelemetry layer enables it
/// (`cluster_proxy_runtime::telemetry`). The connection spans themselves
/// are [`DirectSpan`]s.
pub const SPAN_TARGET: &str = "cluster_proxy_trace";

/// The W3C header / gRPC metadata key of the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header / gRPC metadata key of vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// A `traceparent` (and optional `tracestate`) as found on the wire.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: String,
    pub tracestate: String,
}

/// Why a `traceparent` value was not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    #[error("traceparent {0:?} does not have the form version-traceid-parentid-flags")]
    Shape(String),
    #[error("traceparent {0:?} has an invalid version")]
    Version(String),
    #[error("traceparent {0:?} has an invalid or all-zero trace id")]
    TraceId(String),
    #[error("traceparent {0:?} has an invalid or all-zero parent id")]
    ParentId(String),
    #[error("traceparent {0:?} has invalid flags")]
    Flags(String),
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Parses a `traceparent` value into a remote span context (without trace state).
pub fn parse_traceparent(value: &str) -> Result<SpanContext, TraceParentError> {
    let value = value.trim();
    let shape = || TraceParentError::Shape(value.to_owned());
    let mut parts = value.splitn(5, '-');
    let version = parts.next().ok_or_else(shape)?;
    let trace_id = parts.next().ok_or_else(shape)?;
    let parent_id = parts.next().ok_or_else(shape)?;
    let flags = parts.next().ok_or_else(shape)?;
    let rest = parts.next();
    if !is_lower_hex(version, 2) || version == "ff" {
        return Err(TraceParentError::Version(value.to_owned()));
    }
    // Version 00 has exactly four fields; later versions may append more.
    if version == "00" && rest.is_some() {
        return Err(shape());
    }
    if !is_lower_hex(flags, 2) {
        return Err(TraceParentError::Flags(value.to_owned()));
    }
    let trace_id = is_lower_hex(trace_id, 32)
        .then(|| TraceId::from_hex(trace_id).ok())
        .flatten()
        .filter(|id| *id != TraceId::INVALID)
        .ok_or_else(|| TraceParentError::TraceId(value.to_owned()))?;
    let span_id = is_lower_hex(parent_id, 16)
        .then(|| SpanId::from_hex(parent_id).ok())
        .flatten()
        .filter(|id| *id != SpanId::INVALID)
        .ok_or_else(|| TraceParentError::ParentId(value.to_owned()))?;
    let flags =
        u8::from_str_radix(flags, 16).map_err(|_| TraceParentError::Flags(value.to_owned()))?;
    // Only the sampled bit is defined; unknown bits must not be propagated.
    let flags = TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8());
    Ok(SpanContext::new(
        trace_id,
        span_id,
        flags,
        true,
        TraceState::NONE,
    ))
}

impl TraceHeaders {
    /// The headers that make a receiver's span a child of `context`'s span;
    /// `None` when it has no valid span (tracing off, or not sampled in).
    pub fn from_context(context: &opentelemetry::Context) -> Option<Self> {
        Self::from_span_context(context.span().span_context())
    }

    /// The headers that make a receiver's span a child of the span with
    /// `span_context`; `None` when it is not valid.
    pub fn from_span_context(span_context: &SpanContext) -> Option<Self> {
        if !span_context.is_valid() {
            return None;
        }
        Some(TraceHeaders {
            traceparent: format!(
                "00-{}-{}-{:02x}",
                span_context.trace_id(),
                span_context.span_id(),
                span_context.trace_flags().to_u8()
            ),
            tracestate: span_context.trace_state().header(),
        })
    }

    /// The remote parent these headers name, or `None` when `traceparent` is
    /// malformed. A malformed `tracestate` is dropped, as the spec says.
    pub fn to_context(&self) -> Option<opentelemetry::Context> {
        let parent = parse_traceparent(&self.traceparent).ok()?;
        let state = TraceState::from_str(&self.tracestate).unwrap_or_default();
        let parent = SpanContext::new(
            parent.trace_id(),
            parent.span_id(),
            parent.trace_flags(),
            true,
            state,
        );
        Some(opentelemetry::Context::new().with_remote_span_context(parent))
    }

    /// Reads the headers from gRPC request metadata; `None` without `traceparent`.
    pub fn from_metadata(metadata: &tonic::metadata::MetadataMap) -> Option<Self> {
        let text = |key: &str| {
            metadata
                .get(key)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Some(TraceHeaders {
            traceparent: text(TRACEPARENT)?,
            tracestate: text(TRACESTATE).unwrap_or_default(),
        })
    }

    /// Reads the headers from an HTTP request; `None` without `traceparent`.
    pub fn from_http(headers: &http::HeaderMap) -> Option<Self> {
        let text = |key: &str| {
            headers
                .get(key)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Some(TraceHeaders {
            traceparent: text(TRACEPARENT)?,
            tracestate: text(TRACESTATE).unwrap_or_default(),
        })
    }

    /// Writes the headers into gRPC request metadata (values that are not
    /// valid metadata are skipped).
    pub fn insert_into_metadata(&self, metadata: &mut tonic::metadata::MetadataMap) {
        if let Ok(value) = self.traceparent.parse() {
            metadata.insert(TRACEPARENT, value);
        }
        if !self.tracestate.is_empty()
            && let Ok(value) = self.tracestate.parse()
        {
            metadata.insert(TRACESTATE, value);
        }
    }

    /// Writes the headers into an HTTP request's headers.
    pub fn insert_into_http(&self, headers: &mut http::HeaderMap) {
        if let Ok(value) = http::HeaderValue::from_str(&self.traceparent) {
            headers.insert(TRACEPARENT, value);
        }
        if !self.tracestate.is_empty()
            && let Ok(value) = http::HeaderValue::from_str(&self.tracestate)
        {
            headers.insert(TRACESTATE, value);
        }
    }
}

impl From<crate::konnectivity::TraceContext> for TraceHeaders {
    fn from(wire: crate::konnectivity::TraceContext) -> Self {
        TraceHeaders {
            traceparent: wire.traceparent,
            tracestate: wire.tracestate,
        }
    }
}

impl From<TraceHeaders> for crate::konnectivity::TraceContext {
    fn from(headers: TraceHeaders) -> Self {
        crate::konnectivity::TraceContext {
            traceparent: headers.traceparent,
            tracestate: headers.tracestate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_spec_example() {
        let parent = parse_traceparent(VALID).unwrap();
        assert_eq!(
            parent.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(parent.span_id().to_string(), "00f067aa0ba902b7");
        assert!(parent.is_sampled());
        assert!(parent.is_remote());
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_err(), "{bad:?}");
        }
        // A later version may carry more fields.
        let future = format!("01-{}-extra", &VALID[3..]);
        assert!(parse_traceparent(&future).is_ok());
    }

    #[test]
    fn headers_round_trip_through_a_context() {
        let headers = TraceHeaders {
            traceparent: VALID.into(),
            tracestate: "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".into(),
        };
        let context = headers.to_context().unwrap();
        assert_eq!(TraceHeaders::from_context(&context), Some(headers));
        let unusable = TraceHeaders {
            traceparent: "garbage".into(),
            tracestate: String::new(),
        };
        assert!(unusable.to_context().is_none());
        assert!(TraceHeaders::from_context(&opentelemetry::Context::new()).is_none());
    }

    #[test]
    fn metadata_and_http_headers_carry_them() {
        let headers = TraceHeaders {
            traceparent: VALID.into(),
            tracestate: "a=b".into(),
        };
        let mut metadata = tonic::metadata::MetadataMap::new();
        headers.insert_into_metadata(&mut metadata);
        assert_eq!(
            TraceHeaders::from_metadata(&metadata),
            Some(headers.clone())
        );
        let mut http_headers = http::HeaderMap::new();
        headers.insert_into_http(&mut http_headers);
        assert_eq!(TraceHeaders::from_http(&http_headers), Some(headers));
        assert_eq!(
            TraceHeaders::from_http(&http::HeaderMap::new()),
            None,
            "no traceparent, no trace context"
        );
    }
}

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

pub mod direct;
// The wire format lives apart from the spans (`direct`) that take it, so
// `direct` depends on it without depending on this module.
mod w3c;

pub use direct::{DirectSpan, install_tracer};
pub use opentelemetry::global::BoxedTracer;
pub use w3c::{TRACEPARENT, TRACESTATE, TraceHeaders, TraceParentError, parse_traceparent};

/// The `tracing` target of the spans exported but never logged (the
/// controllers' reconciles, the health-prober's rounds and probes). Log
/// filters leave it off, so with no exporter these spans are disabled and
/// cost nothing; the OpenTelemetry layer enables it
/// (`cluster_proxy_runtime::telemetry`). The connection spans themselves
/// are [`DirectSpan`]s.
pub const SPAN_TARGET: &str = "cluster_proxy_trace";

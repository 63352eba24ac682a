//! The proxy-server's connection span as the span benchmarks make it
//! (`examples/span_cost.rs`, `examples/span_paths.rs`): the server's own
//! [`connection_span`], for a gRPC client with a remote parent, recorded in
//! the same passes as `proxy_server::dial` and `conn_trace` record it.

use std::sync::Arc;

use cluster_proxy_proto::trace::{TraceHeaders, record_fields};
use proxy_server::dial::{DialOrigin, connection_span};
use proxy_server::listener::{PeerInfo, Remote};

/// A sampled remote parent, as a client's `traceparent` brings it.
pub fn sampled_parent() -> TraceHeaders {
    TraceHeaders {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        tracestate: String::new(),
    }
}

/// A gRPC client with a verified certificate and trace context `parent`.
pub fn grpc_origin(parent: &TraceHeaders) -> DialOrigin {
    DialOrigin {
        frontend: "grpc",
        client: Some(Arc::new(PeerInfo {
            remote: Remote::Tcp(([127, 0, 0, 1], 40000).into()),
            subject: "CN=client".to_owned(),
            cluster: None,
            identity_error: None,
        })),
        trace: Some(parent.clone()),
    }
}

/// One whole connection span: made, routed, its context taken for the
/// agent, dialed, ended. Returns the context the agent would get.
pub fn server_connection_span(origin: &DialOrigin) -> Option<TraceHeaders> {
    let span = connection_span("server-1", "bench:8080", origin);
    record_fields(
        &span,
        [
            ("cluster_proxy.strategy", Some(&"destHost")),
            ("cluster_proxy.agent_id", Some(&"bench-agent")),
            ("cluster_proxy.tunnel", Some(&7i64)),
            ("cluster_proxy.cluster", Some(&"bench")),
        ],
    );
    let headers = TraceHeaders::from_span(&span);
    {
        let _entered = span.enter();
    }
    record_fields(
        &span,
        [
            ("cluster_proxy.dial_latency_ms", Some(&0.4f64)),
            ("cluster_proxy.connect_id", Some(&42i64)),
        ],
    );
    record_fields(
        &span,
        [
            ("cluster_proxy.bytes_to_agent", Some(&1i64)),
            ("cluster_proxy.bytes_from_agent", Some(&1i64)),
            ("cluster_proxy.end_reason", Some(&"client_close")),
        ],
    );
    headers
}

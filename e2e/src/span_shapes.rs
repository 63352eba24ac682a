//! The proxy-server's connection span as the span benchmark
//! (`examples/span_cost.rs`) makes it: the server's own [`ConnTrace`], for
//! a gRPC client with a remote parent, taken through the same steps as
//! `proxy_server::dial` takes it (start, routing, the context for the
//! agent, the dial result, the end).

use std::sync::Arc;

use cluster_proxy_proto::trace::TraceHeaders;
use proxy_server::conn_trace::ConnTrace;
use proxy_server::dial::DialOrigin;
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
            alpn: proxy_server::listener::Alpn::None,
        })),
        trace: Some(parent.clone()),
    }
}

/// One whole connection span: started, routed, its context taken for the
/// agent, dialed, one byte each way, ended. Returns the context the agent
/// would get.
pub fn server_connection_span(origin: &DialOrigin) -> Option<TraceHeaders> {
    let trace = ConnTrace::start("server-1", "bench:8080", origin);
    trace.routed("destHost", "bench-agent", 7, Some("bench"));
    let headers = trace.headers();
    trace.mark_established();
    trace.dialed(0.4, 42);
    trace.sent_to_agent(1);
    trace.received_from_agent(1);
    headers
}

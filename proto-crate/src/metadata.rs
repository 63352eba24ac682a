//! gRPC metadata keys. grpc-go lowercases keys on the wire, so these are lowercase.

/// Agent → server (Connect request): the agent's id. Exactly one value.
pub const AGENT_ID: &str = "agentid";
/// Agent → server (Connect request): the identifiers the agent serves (URL query format).
pub const AGENT_IDENTIFIERS: &str = "agentidentifiers";
/// Agent → server: `Bearer <token>` when service-account token auth is used.
pub const AUTHORIZATION: &str = "authorization";
/// Server → agent (Connect response headers): the server replica's id.
pub const SERVER_ID: &str = "serverid";
/// Server → agent (Connect response headers): how many server replicas exist.
pub const SERVER_COUNT: &str = "servercount";
/// Frontend → server.
pub const USER_AGENT: &str = "user-agent";

/// cluster-proxy extension negotiation on the agent tunnel. Each side that
/// supports per-connection credit flow control sends its receive window (in
/// bytes, decimal) under this key: the agent in its Connect request, the server
/// in its Connect response headers. Flow control is on only when both sent it;
/// otherwise both speak plain konnectivity.
pub const FLOW_CONTROL_WINDOW: &str = "cluster-proxy-flow-control-window";

/// cluster-proxy extension negotiation on the agent tunnel: an agent that
/// sends this key (value `w3c`) in its Connect request reads the trace
/// context in dial requests (`DialRequest.traceContext`, field 100), and only
/// such an agent is sent one. Upstream agents never send it and so never see
/// the field.
pub const TRACE_CONTEXT: &str = "cluster-proxy-trace-context";
/// The value of [`TRACE_CONTEXT`]: W3C Trace Context.
pub const TRACE_CONTEXT_W3C: &str = "w3c";

/// cluster-proxy extension negotiation on the agent tunnel: an agent that
/// sends this key (value [`SERVER_COUNT_UPDATES_V1`]) in its Connect request
/// is sent a `SERVER_COUNT` packet (type 101, payload field 101) whenever the
/// replica's count of proxy-server replicas changes, so it looks for a new
/// replica at once instead of never (it holds every replica it knew of) and
/// stops looking for a vanished one. Upstream agents never send the key and
/// so never see the packet; they still read each Connect's `servercount`.
pub const SERVER_COUNT_UPDATES: &str = "cluster-proxy-server-count-updates";
/// The value of [`SERVER_COUNT_UPDATES`].
pub const SERVER_COUNT_UPDATES_V1: &str = "v1";

/// cluster-proxy extension negotiation on the agent tunnel: an agent that
/// sends this key (value [`EARLY_DATA_V1`]) in its Connect request writes a
/// dial request's `earlyData` (field 101) to the target as soon as it has
/// connected, and says so in its dial response (`earlyDataWritten`, field
/// 100). Only such an agent is sent the field; for any other agent the server
/// sends the bytes as the connection's first DATA once the dial succeeded.
pub const EARLY_DATA: &str = "cluster-proxy-early-data";
/// The value of [`EARLY_DATA`].
pub const EARLY_DATA_V1: &str = "v1";

/// cluster-proxy extension negotiation on the agent tunnel: an agent that
/// has no trace collector of its own sends this key (value
/// [`SPAN_RELAY_OTLP_V1`]) in its Connect request; a server that has a
/// collector to forward to answers with the same key and value in its
/// Connect response headers, and only on such a tunnel does the agent send
/// its spans (`SPAN_BATCH` packets, type 102, payload field 102). Upstream
/// agents never send the key; an upstream server never answers it, so our
/// agent sends it no spans.
pub const SPAN_RELAY: &str = "cluster-proxy-span-relay";
/// The value of [`SPAN_RELAY`]: SPAN_BATCH packets carrying encoded OTLP
/// `ExportTraceServiceRequest`s of at most
/// [`crate::packet::MAX_SPAN_BATCH`] bytes.
pub const SPAN_RELAY_OTLP_V1: &str = "otlp-v1";

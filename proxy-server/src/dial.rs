//! Dialing through an agent: pick a tunnel, send DIAL_REQ, wait for the answer
//! with a deadline, and never leave a pending dial behind.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_proxy_proto::packet;
use cluster_proxy_proto::trace::{SPAN_TARGET, TraceHeaders, record_fields};
use http::StatusCode;
use tokio::sync::oneshot;
use tracing::{Instrument, Span, field};

use crate::conn_trace::ConnTrace;
use crate::listener::PeerInfo;
use crate::metrics::Metrics;
use crate::policy::ClientPolicy;
use crate::registry::Registry;
use crate::tunnel::{AgentTunnel, DialReply, Established};

/// Why a dial failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DialFailure {
    /// No connected agent serves the requested host.
    NoAgent,
    /// The agent could not dial (its error text, e.g. `dial tcp …: connect: connection refused`).
    Agent(String),
    /// The agent sent DIAL_CLS.
    ClosedByAgent,
    /// The agent's tunnel ended before it answered.
    TunnelClosed(String),
    /// No answer within the dial timeout.
    Timeout(Duration),
    /// The request itself is unusable (bad protocol, duplicate dial id).
    BadRequest(String),
    /// A configured bound refused the dial (e.g. `--max-pending-dials-per-tunnel`).
    Overloaded(String),
    /// `--client-policy` does not let this client reach the agent's cluster.
    Forbidden(String),
}

impl DialFailure {
    /// The text clients see (DIAL_RSP error or HTTP body); upstream's wording where it has one.
    pub fn message(&self) -> String {
        match self {
            DialFailure::NoAgent => "No agent available".into(),
            DialFailure::Agent(e) => e.clone(),
            DialFailure::ClosedByAgent => "dial closed".into(),
            DialFailure::TunnelClosed(e) => e.clone(),
            DialFailure::Timeout(d) => format!("timed out waiting for backend dial after {d:?}"),
            DialFailure::BadRequest(e) => e.clone(),
            DialFailure::Overloaded(e) => e.clone(),
            DialFailure::Forbidden(e) => e.clone(),
        }
    }

    /// Upstream's `dial_failure_count` reason label.
    pub fn reason(&self) -> &'static str {
        match self {
            DialFailure::NoAgent => "no_agent",
            DialFailure::Agent(_) => "error_response",
            DialFailure::ClosedByAgent => "backend_close",
            DialFailure::TunnelClosed(_) => "backend_close",
            DialFailure::Timeout(_) => "backend_dial_timeout",
            DialFailure::BadRequest(_) => "send_rsp",
            DialFailure::Overloaded(_) => "overloaded",
            DialFailure::Forbidden(_) => "forbidden",
        }
    }

    /// HTTP CONNECT status, mapped as upstream does.
    pub fn http_status(&self) -> StatusCode {
        match self {
            DialFailure::NoAgent => StatusCode::INTERNAL_SERVER_ERROR,
            DialFailure::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            DialFailure::BadRequest(_) => StatusCode::BAD_REQUEST,
            DialFailure::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            DialFailure::Forbidden(_) => StatusCode::FORBIDDEN,
            DialFailure::Agent(e) => {
                let e = e.to_ascii_lowercase();
                if e.contains("timeout") || e.contains("timed out") || e.contains("deadline") {
                    StatusCode::GATEWAY_TIMEOUT
                } else if e.contains("too many open files") {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::BAD_GATEWAY
                }
            }
            DialFailure::ClosedByAgent | DialFailure::TunnelClosed(_) => StatusCode::BAD_GATEWAY,
        }
    }
}

/// Everything a frontend needs to dial.
pub struct Dialer {
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub timeout: Duration,
    /// This replica's id, on every connection span.
    pub server_id: String,
    /// `--client-policy`; `None` lets every hub client reach every cluster.
    pub policy: Option<Arc<ClientPolicy>>,
}

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

/// The proxy-server's span for one tunneled connection (`tunnel.connection`,
/// see the README's "Tracing"): its fields, the client's identity and its
/// parent from the client's trace context. The dialer records the rest as
/// the dial proceeds. Public so the span-cost benchmark measures this span
/// and not a copy of it.
pub fn connection_span(server_id: &str, address: &str, origin: &DialOrigin) -> Span {
    let (host, port) = packet::split_host_port(address).unwrap_or((address, ""));
    // Known values go in at creation: each later `record` is one more pass
    // through the subscriber's layers on the connection's path.
    let client_ip = origin
        .client
        .as_ref()
        .and_then(|client| client.remote.ip())
        .map(field::display);
    let client_identity = origin.client.as_ref().map(|client| client.subject.as_str());
    let span = tracing::info_span!(
        target: SPAN_TARGET,
        "tunnel.connection",
        otel.kind = "server",
        otel.status_code = field::Empty,
        network.transport = "tcp",
        server.address = host,
        server.port = port,
        client.address = client_ip,
        cluster_proxy.frontend = origin.frontend,
        cluster_proxy.client_identity = client_identity,
        cluster_proxy.server_id = server_id,
        cluster_proxy.strategy = field::Empty,
        cluster_proxy.cluster = field::Empty,
        cluster_proxy.agent_id = field::Empty,
        cluster_proxy.tunnel = field::Empty,
        cluster_proxy.connect_id = field::Empty,
        cluster_proxy.dial_latency_ms = field::Empty,
        cluster_proxy.bytes_to_agent = field::Empty,
        cluster_proxy.bytes_from_agent = field::Empty,
        cluster_proxy.end_reason = field::Empty,
        error.message = field::Empty,
    );
    if span.is_disabled() {
        return span;
    }
    if let Some(trace) = &origin.trace {
        trace.make_parent_of(&span);
    }
    span
}

/// Cancels a pending dial when the dialing future is dropped or times out.
struct PendingGuard<'a> {
    tunnel: &'a AgentTunnel,
    random: i64,
    armed: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.tunnel.cancel_pending(self.random);
        }
    }
}

impl Dialer {
    /// Dials `address` through the agent that serves its host. The
    /// connection's span (a child of the client's trace context, if it sent
    /// one) lives until the connection is gone.
    pub async fn dial(
        &self,
        address: &str,
        random: i64,
        origin: DialOrigin,
    ) -> Result<Established, DialFailure> {
        let started = Instant::now();
        let span = connection_span(&self.server_id, address, &origin);
        let result = self
            .dial_inner(address, random, &origin, &span)
            .instrument(span.clone())
            .await;
        let latency = started.elapsed();
        let latency_ms = latency.as_secs_f64() * 1e3;
        match &result {
            Ok(established) => {
                record_fields(
                    &span,
                    [
                        ("cluster_proxy.dial_latency_ms", Some(&latency_ms)),
                        ("cluster_proxy.connect_id", Some(&established.connect_id())),
                    ],
                );
                self.metrics.dial_duration.observe(latency.as_secs_f64())
            }
            Err(f) => {
                record_fields(
                    &span,
                    [
                        ("cluster_proxy.dial_latency_ms", Some(&latency_ms)),
                        ("cluster_proxy.end_reason", Some(&f.reason())),
                        ("error.message", Some(&f.message().as_str())),
                        ("otel.status_code", Some(&"ERROR")),
                    ],
                );
                // A span event only: SPAN_TARGET is never logged.
                let event = match f {
                    DialFailure::Timeout(_) => "dial timeout",
                    _ => "dial failed",
                };
                tracing::event!(
                    target: SPAN_TARGET,
                    parent: &span,
                    tracing::Level::INFO,
                    cluster_proxy.end_reason = f.reason(),
                    error.message = f.message().as_str(),
                    "{event}"
                );
                self.metrics.dial_failed(f.reason())
            }
        }
        result
    }

    async fn dial_inner(
        &self,
        address: &str,
        random: i64,
        origin: &DialOrigin,
        span: &Span,
    ) -> Result<Established, DialFailure> {
        if address.is_empty() {
            return Err(DialFailure::BadRequest(
                "dial request without an address".into(),
            ));
        }
        let (tunnel, strategy) = self
            .registry
            .pick_with_strategy(address)
            .ok_or(DialFailure::NoAgent)?;
        if let (Some(policy), Some(client)) = (&self.policy, &origin.client)
            && !policy.allows(&client.subject, tunnel.cluster())
        {
            let cluster = tunnel.cluster().map_or("<unbound>", |c| c.as_str());
            tracing::warn!(
                client = client.subject,
                cluster,
                address,
                "dial refused by --client-policy"
            );
            return Err(DialFailure::Forbidden(format!(
                "client {:?} may not reach cluster {cluster} (--client-policy)",
                client.subject
            )));
        }
        let cluster = tunnel.cluster().map(|cluster| cluster.as_str());
        record_fields(
            span,
            [
                ("cluster_proxy.strategy", Some(&strategy.name())),
                ("cluster_proxy.agent_id", Some(&tunnel.agent_id())),
                // As i64: OpenTelemetry has no unsigned integers, and the
                // layer would format a u64 into a string.
                (
                    "cluster_proxy.tunnel",
                    Some(&crate::conn_trace::saturating_i64(tunnel.id())),
                ),
                (
                    "cluster_proxy.cluster",
                    cluster.as_ref().map(|c| c as &dyn tracing::Value),
                ),
            ],
        );
        let trace = tunnel
            .accepts_trace_context()
            .then(|| TraceHeaders::from_span(span))
            .flatten();
        let reply = tunnel.register_pending(random, Arc::new(ConnTrace::new(span.clone())))?;
        let mut guard = PendingGuard {
            tunnel: &tunnel,
            random,
            armed: true,
        };
        // One deadline for queueing DIAL_REQ and for the answer: a tunnel
        // whose ordered lane stays full must not hold the dial forever.
        let exchange = async {
            tunnel
                .send_ordered(packet::dial_request_traced(address, random, trace))
                .await
                .map_err(|_| DialFailure::TunnelClosed("agent tunnel closed".into()))?;
            wait(reply).await
        };
        let outcome = tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or(Err(DialFailure::Timeout(self.timeout)));
        if outcome.is_ok() {
            guard.armed = false;
        }
        outcome
    }
}

async fn wait(reply: oneshot::Receiver<DialReply>) -> Result<Established, DialFailure> {
    match reply.await {
        Ok(DialReply::Connected(established)) => Ok(established),
        Ok(DialReply::Failed(error)) => Err(DialFailure::Agent(error)),
        Ok(DialReply::TunnelClosed(error)) => Err(DialFailure::TunnelClosed(error)),
        Ok(DialReply::ClosedByAgent) => Err(DialFailure::ClosedByAgent),
        Err(_) => Err(DialFailure::TunnelClosed(
            "agent tunnel closed before the dial completed".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_status_follows_upstreams_mapping() {
        let agent = |e: &str| DialFailure::Agent(e.into()).http_status();
        assert_eq!(
            agent("dial tcp 10.0.0.1:443: connect: connection refused"),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            agent("dial tcp 10.0.0.1:443: i/o timeout"),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            agent("context deadline exceeded"),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            agent("dial tcp: lookup x: no such host"),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            agent("socket: too many open files"),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            DialFailure::NoAgent.http_status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            DialFailure::Timeout(Duration::from_secs(1)).http_status(),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            DialFailure::TunnelClosed("x".into()).http_status(),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(DialFailure::NoAgent.message(), "No agent available");
    }
}

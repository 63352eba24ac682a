//! Dialing through an agent: pick a tunnel, send DIAL_REQ, wait for the answer
//! with a deadline, and never leave a pending dial behind.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cluster_proxy_proto::client::MAX_EARLY_DATA;
use cluster_proxy_proto::packet;
use tokio::sync::oneshot;
use tracing::field;

use crate::conn_trace::ConnTrace;
// Re-exported: the frontends name a dial's origin and failure with the dial.
pub use crate::conn_trace::DialOrigin;
pub use crate::dial_failure::DialFailure;
use crate::metrics::Metrics;
use crate::policy::ClientPolicy;
use crate::registry::Registry;
use crate::tunnel::{AgentTunnel, DialReply, Established};

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
    ///
    /// `early_data` (the connection's first bytes) rides in the dial request
    /// to an agent that advertised the extension, which writes it before
    /// answering ([`Established::early_data_written`]); for any other agent
    /// the caller sends it as the connection's first DATA.
    pub async fn dial(
        &self,
        address: &str,
        random: i64,
        origin: DialOrigin,
        early_data: Bytes,
    ) -> Result<Established, DialFailure> {
        let started = Instant::now();
        let trace = Arc::new(ConnTrace::start(&self.server_id, address, &origin));
        let result = self
            .dial_inner(address, random, &origin, &trace, early_data)
            .await;
        let latency = started.elapsed();
        let latency_ms = latency.as_secs_f64() * 1e3;
        match &result {
            Ok(established) => {
                trace.dialed(latency_ms, established.connect_id());
                self.metrics.dial_duration.observe(latency.as_secs_f64())
            }
            Err(f) => {
                let event = match f {
                    DialFailure::Timeout(_) => "dial timeout",
                    _ => "dial failed",
                };
                trace.dial_failed(latency_ms, f.reason(), &f.message(), event);
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
        trace: &Arc<ConnTrace>,
        early_data: Bytes,
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
                trace_id = trace.trace_id().map(field::display),
                "dial refused by --client-policy"
            );
            return Err(DialFailure::Forbidden(format!(
                "client {:?} may not reach cluster {cluster} (--client-policy)",
                client.subject
            )));
        }
        trace.routed(
            strategy.name(),
            tunnel.agent_id(),
            tunnel.id(),
            tunnel.cluster().map(|cluster| cluster.as_str()),
        );
        let context = tunnel
            .accepts_trace_context()
            .then(|| trace.headers())
            .flatten();
        // Bounded like a client's: the dial request bypasses the agent's
        // flow-control window, so more is sent as DATA after the dial.
        let early_data = if tunnel.accepts_early_data() && early_data.len() <= MAX_EARLY_DATA {
            early_data
        } else {
            Bytes::new()
        };
        let early_bytes = early_data.len();
        let reply = tunnel.register_pending(random, trace.clone())?;
        let mut guard = PendingGuard {
            tunnel: &tunnel,
            random,
            armed: true,
        };
        // One deadline for queueing DIAL_REQ and for the answer: a tunnel
        // whose ordered lane stays full must not hold the dial forever.
        let exchange = async {
            tunnel
                .send_ordered(packet::dial_request_with_early_data(
                    address, random, context, early_data,
                ))
                .await
                .map_err(|_| DialFailure::TunnelClosed("agent tunnel closed".into()))?;
            wait(reply).await
        };
        let outcome = tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or(Err(DialFailure::Timeout(self.timeout)));
        if let Ok(established) = &outcome {
            guard.armed = false;
            if established.early_data_written() {
                trace.sent_to_agent(early_bytes);
            }
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

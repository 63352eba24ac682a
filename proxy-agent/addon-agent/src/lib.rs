//! The cluster-proxy addon-agent (upstream's `/agent` container, reference
//! F18 and §6): renews the addon Lease `cluster-proxy` so that OCM's
//! registration agent reports the addon `Available`, but only while the
//! proxy-agent next to it holds a tunnel to at least one proxy-server.
//!
//! The Lease lives in the agent's namespace on the managed cluster; when no
//! managed API is configured, or its namespace does not exist there, the
//! hub Lease `<cluster-name>/cluster-proxy` is renewed instead through the
//! addon's hub kubeconfig, which is re-read whenever the klusterlet rotates
//! it. An unreachable API is retried with backoff and never ends the
//! process.

#![forbid(unsafe_code)]

pub mod metrics;
pub mod readiness;
pub mod renewer;
pub mod settings;

use std::net::SocketAddr;

use cluster_proxy_runtime::admin::{self, Routes};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use metrics::Metrics;
pub use settings::{AgentConfig, AgentSettings, Cli, ManagedApi, PodEnvironment};

/// Sent on every Kubernetes request, so audit logs name the component.
pub const USER_AGENT: &str = concat!("addon-agent/", env!("CARGO_PKG_VERSION"));

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("health port {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A started agent: the health server and the renewal loop.
pub struct RunningAgent {
    health_addr: SocketAddr,
    metrics: Metrics,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// Binds the health port and starts renewing. `/healthz` and `/readyz`
/// answer ok while the process serves: neither the proxy-agent's state nor
/// an unreachable API makes this container unhealthy.
pub async fn start(config: AgentConfig) -> Result<RunningAgent, AgentError> {
    let listener = TcpListener::bind(config.health_addr)
        .await
        .map_err(|source| AgentError::Bind {
            addr: config.health_addr,
            source,
        })?;
    let health_addr = listener.local_addr().map_err(|source| AgentError::Bind {
        addr: config.health_addr,
        source,
    })?;
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let exposition = metrics.clone();
    let routes = Routes::probes(|| Ok(())).with_metrics(move || exposition.encode());
    tracing::info!(%health_addr, lease = %config.lease_name, "addon-agent started");
    let tasks = vec![
        tokio::spawn(admin::serve(listener, routes, shutdown.clone())),
        tokio::spawn(renewer::run(config, metrics.clone(), shutdown.clone())),
    ];
    Ok(RunningAgent {
        health_addr,
        metrics,
        shutdown,
        tasks,
    })
}

impl RunningAgent {
    /// Where /healthz, /readyz and /metrics are served.
    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Stops renewing and serving; an attempt in flight is abandoned.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

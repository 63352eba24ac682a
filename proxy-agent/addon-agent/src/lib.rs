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
//!
//! With `--enable-port-forward-proxy` it also serves the `PortForward`
//! entrypoint ([`portforward`]): the proxy-agent's connections to
//! 127.0.0.1:8091 are forwarded to the proxy-server pods through the hub
//! API.

#![forbid(unsafe_code)]

pub mod metrics;
pub mod portforward;
pub mod readiness;
pub mod renewer;
pub mod settings;
pub mod user_agent;

use std::net::SocketAddr;

use cluster_proxy_runtime::admin::{self, Routes};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use metrics::Metrics;
pub use settings::{AddonAgentConfig, AddonAgentSettings, Cli, ManagedApi, PodEnvironment};

pub use user_agent::USER_AGENT;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("health port {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("port-forward proxy {addr}: {source}")]
    BindPortForward {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A started agent: the health server, the renewal loop and the
/// port-forward proxy.
pub struct RunningAgent {
    health_addr: SocketAddr,
    port_forward_addr: Option<SocketAddr>,
    metrics: Metrics,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// Binds the health port (and the port-forward proxy's) and starts
/// renewing. `/healthz` answers ok while the process serves, and so does
/// `/readyz` unless the port-forward proxy is on: then it says whether
/// there is a ready proxy-server pod to forward to. Neither the
/// proxy-agent's state nor an unreachable API makes this container
/// unhealthy.
pub async fn start(config: AddonAgentConfig) -> Result<RunningAgent, AgentError> {
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
    let mut tasks = Vec::new();
    let mut port_forward_addr = None;
    let mut forwarder = None;
    if let (Some(pf), Some(hub)) = (&config.port_forward, &config.hub_kubeconfig) {
        let bind_err = |source| AgentError::BindPortForward {
            addr: pf.listen,
            source,
        };
        let pf_listener = portforward::bind(pf).await.map_err(bind_err)?;
        port_forward_addr = Some(pf_listener.local_addr().map_err(bind_err)?);
        let running = portforward::Forwarder::new(
            pf.clone(),
            hub.clone(),
            config.hub_egress.clone(),
            metrics.clone(),
        );
        forwarder = Some(running.clone());
        tracing::info!(addr = ?port_forward_addr, namespace = %pf.namespace, "port-forward proxy listening");
        tasks.push(tokio::spawn(portforward::run(
            running,
            pf_listener,
            shutdown.clone(),
        )));
    }
    let exposition = metrics.clone();
    let routes = Routes::probes(move || match &forwarder {
        None => Ok(()),
        Some(forwarder) => forwarder.readiness().map_err(|body| admin::NotReady {
            status: http::StatusCode::SERVICE_UNAVAILABLE,
            body,
        }),
    })
    .with_metrics(move || exposition.encode());
    tracing::info!(%health_addr, lease = %config.lease_name, "addon-agent started");
    tasks.push(tokio::spawn(admin::serve(
        listener,
        routes,
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(renewer::run(
        config,
        metrics.clone(),
        shutdown.clone(),
    )));
    Ok(RunningAgent {
        health_addr,
        port_forward_addr,
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

    /// Where the port-forward proxy listens, when it is on.
    pub fn port_forward_addr(&self) -> Option<SocketAddr> {
        self.port_forward_addr
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

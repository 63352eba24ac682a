//! The health-prober service: serve health and metrics, elect a leader, and
//! while leading probe every cluster each interval.

use std::sync::Arc;

use cluster_proxy_control::leader::{LeaderError, Leadership, lead_in_turns};
use cluster_proxy_runtime::metrics::register_leader_gauge;
use cluster_proxy_runtime::reload::DEFAULT_INTERVAL;
use cluster_proxy_runtime::shutdown::Signals;
use cluster_proxy_runtime::tls::TlsError;
use k8s_openapi::api::coordination::v1::Lease;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::metrics::ProberMetrics;
use crate::probe::ProbeTarget;
use crate::prober::Prober;
use crate::replicas::{AddressError, Replica};
use crate::settings::HealthProberSettings;

/// The Lease replicas elect a leader on: exactly one replica probes.
const LEASE_NAME: &str = "cluster-proxy-health-prober";
const USER_AGENT: &str = "cluster-proxy-health-prober";

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("no Kubernetes API to talk to (set KUBECONFIG, or run in a cluster): {0}")]
    Client(#[from] cluster_proxy_control::ClientError),
    #[error("loading the proxy-server client credentials: {0}")]
    ProxyTls(TlsError),
    #[error("building TLS for the managed kube-apiservers: {0}")]
    TargetTls(TlsError),
    #[error(transparent)]
    Replica(#[from] AddressError),
    #[error(transparent)]
    Health(#[from] cluster_proxy_runtime::net::BindError),
    #[error(transparent)]
    Leader(#[from] LeaderError),
}

/// Runs health-prober until SIGTERM or SIGINT.
pub async fn serve(
    settings: HealthProberSettings,
    mut signals: Signals,
) -> Result<(), ServiceError> {
    let client = cluster_proxy_control::client::client(USER_AGENT).await?;
    let proxy_tls = crate::tls::watch_proxy_client(
        &settings.proxy_ca_cert,
        &settings.proxy_cert,
        &settings.proxy_key,
        DEFAULT_INTERVAL,
    )
    .map_err(ServiceError::ProxyTls)?;
    let target_ca = if settings.insecure_target {
        None
    } else {
        settings.target_ca.as_deref()
    };
    let target_tls = crate::tls::target_client(target_ca).map_err(ServiceError::TargetTls)?;
    let replicas = settings
        .replica_addresses()
        .iter()
        .map(|address| Replica::new(address, proxy_tls.clone()))
        .collect::<Result<Vec<_>, _>>()?;

    let mut registry = Registry::default();
    let metrics = ProberMetrics::default();
    metrics.register(&mut registry);
    let leader = register_leader_gauge(
        &mut registry,
        "health_prober_leader",
        "1 while this replica leads and probes, 0 otherwise",
    );
    let stop = CancellationToken::new();
    cluster_proxy_runtime::admin::serve_controller_health(
        &settings.health_bind_address,
        settings.health_port,
        registry,
        stop.clone(),
    )
    .await?;

    let prober = Arc::new(
        Prober::new(
            client.clone(),
            replicas,
            ProbeTarget {
                port: settings.target_port,
                tls: target_tls,
                timeout: settings.timeout,
            },
            settings.concurrency,
            metrics,
        )
        .with_latency_write_interval(settings.latency_write_interval),
    );
    let leadership = Leadership {
        api: kube::Api::<Lease>::namespaced(client, &settings.namespace),
        lease: LEASE_NAME,
        fallback_identity: "health-prober",
        enabled: settings.leader_elect,
    };
    let interval = settings.interval;
    let signal = lead_in_turns(
        leadership,
        signals.recv(),
        |leading| {
            leader.set(i64::from(leading));
        },
        |term| {
            tracing::info!(replicas = ?settings.replica_addresses(), ?interval, "leading: probing");
            let prober = prober.clone();
            let rounds =
                tokio::spawn(async move { prober.run(interval, term.cancelled_owned()).await });
            async move {
                // A round in flight is abandoned: another leader probes from scratch.
                rounds.abort();
                let _ = rounds.await;
            }
        },
    )
    .await?;
    tracing::info!(signal, "stopping");
    stop.cancel();
    Ok(())
}

//! The health-prober service: serve health and metrics, join the other
//! prober replicas ([`crate::shards`]) and probe this replica's share of
//! the clusters each interval.

use std::sync::Arc;

use cluster_proxy_control::leader::{LEASE_DURATION, RENEW_EVERY, replica_identity};
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
use crate::shards::{Membership, MembershipError};

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
    Membership(#[from] MembershipError),
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
    let stop = CancellationToken::new();
    cluster_proxy_runtime::admin::serve_controller_health(
        &settings.health_bind_address,
        settings.health_port,
        registry,
        stop.clone(),
    )
    .await?;

    let mut prober = Prober::new(
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
    .with_latency_write_interval(settings.latency_write_interval);

    // Without --leader-elect this replica probes every cluster and touches
    // no Lease: one-replica installs and tests.
    let leaving = CancellationToken::new();
    let mut membership = None;
    if settings.leader_elect {
        let member = Membership::new(
            kube::Api::<Lease>::namespaced(client, &settings.namespace),
            replica_identity("health-prober"),
            LEASE_DURATION,
            RENEW_EVERY,
        )?;
        tracing::info!(
            lease = member.name(),
            identity = member.identity(),
            "sharing the clusters with the other probers"
        );
        let (publish, mut members) = tokio::sync::watch::channel(None);
        prober = prober.with_members(members.clone());
        membership = Some(tokio::spawn(
            member.run(publish, leaving.clone().cancelled_owned()),
        ));
        // The first round waits for the first view of the members, or a
        // starting replica would probe every cluster once by itself.
        tokio::select! {
            signal = signals.recv() => {
                tracing::info!(signal, "stopping before joining");
                return leave(stop, leaving, membership).await;
            }
            _ = members.wait_for(Option::is_some) => {}
        }
    }

    let interval = settings.interval;
    tracing::info!(replicas = ?settings.replica_addresses(), ?interval, "probing");
    let prober = Arc::new(prober);
    let rounds = {
        let prober = prober.clone();
        tokio::spawn(async move { prober.run(interval, std::future::pending()).await })
    };
    let signal = signals.recv().await;
    tracing::info!(signal, "stopping");
    // A round in flight is abandoned before the member Lease goes: the
    // others may take its clusters as soon as it is gone.
    rounds.abort();
    let _ = rounds.await;
    leave(stop, leaving, membership).await
}

async fn leave(
    stop: CancellationToken,
    leaving: CancellationToken,
    membership: Option<tokio::task::JoinHandle<()>>,
) -> Result<(), ServiceError> {
    leaving.cancel();
    if let Some(membership) = membership {
        let _ = membership.await;
    }
    stop.cancel();
    Ok(())
}

//! `health-prober`: parse the settings, serve health and metrics, elect a
//! leader, and while leading probe every cluster each interval.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cluster_proxy_control::leader::{Election, spawn_election};
use cluster_proxy_runtime::metrics::register_leader_gauge;
use cluster_proxy_runtime::reload::DEFAULT_INTERVAL;
use cluster_proxy_runtime::{admin, cli, shutdown::Signals, telemetry};
use health_prober::metrics::ProberMetrics;
use health_prober::probe::ProbeTarget;
use health_prober::prober::Prober;
use health_prober::replicas::Replica;
use health_prober::settings::{Cli, Settings};
use health_prober::tls;
use k8s_openapi::api::coordination::v1::Lease;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// The Lease replicas elect a leader on: exactly one replica probes.
const LEASE_NAME: &str = "cluster-proxy-health-prober";
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RENEW_EVERY: Duration = Duration::from_secs(5);
const USER_AGENT: &str = "cluster-proxy-health-prober";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&Settings::default());
    let settings = Settings::load(&cli)?;
    let telemetry = telemetry::init(
        settings.v,
        settings.log_format,
        &cli.telemetry.to_config("health-prober")?,
    )?;
    let result = run(settings).await;
    telemetry.shutdown().await;
    result
}

async fn run(settings: Settings) -> anyhow::Result<()> {
    let client = cluster_proxy_control::client::client(USER_AGENT)
        .await
        .context("no Kubernetes API to talk to (set KUBECONFIG, or run in a cluster)")?;
    let mut signals = Signals::install().context("installing signal handlers")?;

    let proxy_tls = tls::watch_proxy_client(
        &settings.proxy_ca_cert,
        &settings.proxy_cert,
        &settings.proxy_key,
        DEFAULT_INTERVAL,
    )
    .context("loading the proxy-server client credentials")?;
    let target_tls = if settings.insecure_target {
        tls::target_client(None)
    } else {
        tls::target_client(settings.target_ca.as_deref())
    }
    .context("building TLS for the managed kube-apiservers")?;
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
    admin::serve_controller_health(
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

    let stopped = stop.clone();
    let Election {
        mut leading,
        task: election,
    } = spawn_election(
        kube::Api::<Lease>::namespaced(client.clone(), &settings.namespace),
        LEASE_NAME,
        "health-prober",
        settings.leader_elect,
        LEASE_DURATION,
        RENEW_EVERY,
        async move { stopped.cancelled().await },
    )?;

    let signal = loop {
        tokio::select! {
            signal = signals.recv() => break signal,
            changed = leading.wait_for(|lead| *lead) => {
                if changed.is_err() && settings.leader_elect {
                    anyhow::bail!("leader election stopped");
                }
            }
        }
        tracing::info!(replicas = ?settings.replica_addresses(), interval = ?settings.interval, "leading: probing");
        leader.set(1);
        let lost = CancellationToken::new();
        let rounds = {
            let prober = prober.clone();
            let lost = lost.clone();
            let interval = settings.interval;
            tokio::spawn(async move { prober.run(interval, lost.cancelled_owned()).await })
        };
        let outcome = tokio::select! {
            signal = signals.recv() => Some(signal),
            _ = leading.wait_for(|lead| !*lead), if settings.leader_elect => None,
        };
        lost.cancel();
        // A round in flight is abandoned: another leader probes from scratch.
        rounds.abort();
        let _ = rounds.await;
        leader.set(0);
        match outcome {
            Some(signal) => break signal,
            None => tracing::warn!("lost leadership: probing stopped; following again"),
        }
    };
    tracing::info!(signal, "stopping");
    stop.cancel();
    if let Some(election) = election
        && let Ok(Err(err)) = election.await
    {
        tracing::warn!(error = %err, "releasing the leader Lease");
    }
    Ok(())
}

//! `addon-manager`: parse the settings, serve health and metrics, elect a
//! leader, and while leading run the hub and addon controllers.
#![forbid(unsafe_code)]

use std::time::Duration;

use addon_manager::addon::{self, AddonMetrics, AddonSettings};
use addon_manager::apply::USER_AGENT;
use addon_manager::hub::{self, HubMetrics, HubSettings};
use addon_manager::settings::{Cli, Settings};
use anyhow::Context;
use cluster_proxy_control::leader::{Election, spawn_election};
use cluster_proxy_runtime::metrics::register_leader_gauge;
use cluster_proxy_runtime::{admin, cli, shutdown::Signals, telemetry};
use k8s_openapi::api::coordination::v1::Lease;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// The Lease replicas elect a leader on (upstream's name).
const LEASE_NAME: &str = "cluster-proxy-addon-manager";
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RENEW_EVERY: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&Settings::default());
    let settings = Settings::load(&cli)?;
    let telemetry = telemetry::init(
        settings.v,
        settings.log_format,
        &cli.telemetry.to_config("addon-manager")?,
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

    let mut registry = Registry::default();
    let hub_metrics = HubMetrics::register(&mut registry);
    let addon_metrics = AddonMetrics::default();
    addon_metrics.register(&mut registry);
    let leader = register_leader_gauge(
        &mut registry,
        "addon_manager_leader",
        "1 while this replica leads and runs the controllers, 0 otherwise",
    );
    let stop = CancellationToken::new();
    admin::serve_controller_health(
        &settings.health_bind_address,
        settings.health_port,
        registry,
        stop.clone(),
    )
    .await?;

    let stopped = stop.clone();
    let Election {
        mut leading,
        task: election,
    } = spawn_election(
        kube::Api::<Lease>::namespaced(client.clone(), &settings.namespace),
        LEASE_NAME,
        "addon-manager",
        settings.leader_elect,
        LEASE_DURATION,
        RENEW_EVERY,
        async move { stopped.cancelled().await },
    )?;

    let mut addon_settings = AddonSettings::new(&settings.namespace);
    addon_settings.agent_install_namespace = settings.agent_install_namespace.clone();
    addon_settings.removal_grace = settings.placement_removal_grace;
    addon_settings.enable_kube_api_proxy = settings.enable_kube_api_proxy;
    addon_settings.enable_network_policies = settings.enable_network_policies;
    addon_settings.enable_service_proxy = settings.enable_service_proxy;
    addon_settings.agent_kube_apiserver_ports = settings.kube_apiserver_ports()?;
    let image_pull_policy =
        (!settings.image_pull_policy.is_empty()).then(|| settings.image_pull_policy.clone());
    addon_settings.image_pull_policy = image_pull_policy.clone();
    addon_settings
        .managed_proxy_configuration
        .clone_from(&settings.managed_proxy_configuration);
    addon_settings.agent_image =
        (!settings.agent_image_name.is_empty()).then(|| settings.agent_image_name.clone());
    addon_settings.install_strategy =
        addon::InstallStrategy::Placements(vec![addon::PlacementRef {
            namespace: settings.namespace.clone(),
            name: settings.placement_name.clone(),
        }]);

    let signal = loop {
        // Follow until this replica leads (always, without election).
        tokio::select! {
            signal = signals.recv() => break signal,
            changed = leading.wait_for(|lead| *lead) => {
                if changed.is_err() && settings.leader_elect {
                    anyhow::bail!("leader election stopped");
                }
            }
        }
        tracing::info!("leading: running the hub and addon controllers");
        leader.set(1);
        let lost = CancellationToken::new();
        let hub = tokio::spawn(hub::run(
            client.clone(),
            HubSettings {
                tls_profile_namespace: Some(settings.namespace.clone()),
                image_pull_policy: image_pull_policy.clone(),
                ..HubSettings::default()
            },
            hub_metrics.clone(),
            lost.clone().cancelled_owned(),
        ));
        let addons = tokio::spawn(addon::run(
            client.clone(),
            addon_settings.clone(),
            addon_metrics.clone(),
            lost.clone().cancelled_owned(),
        ));
        let outcome = tokio::select! {
            signal = signals.recv() => Some(signal),
            _ = leading.wait_for(|lead| !*lead), if settings.leader_elect => None,
        };
        lost.cancel();
        let _ = tokio::join!(hub, addons);
        leader.set(0);
        match outcome {
            Some(signal) => break signal,
            None => tracing::warn!("lost leadership: controllers stopped; following again"),
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

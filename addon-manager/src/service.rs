//! The addon-manager service: serve health and metrics, elect a leader, and
//! while leading run the hub and addon controllers.

use cluster_proxy_control::leader::{LeaderError, Leadership, lead_in_turns};
use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::metrics::register_leader_gauge;
use cluster_proxy_runtime::shutdown::Signals;
use k8s_openapi::api::coordination::v1::Lease;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::addon::{self, AddonMetrics, AddonSettings};
use crate::apply::USER_AGENT;
use crate::hub::{self, HubMetrics, HubSettings};
use crate::settings::AddonManagerSettings;

/// The Lease replicas elect a leader on (upstream's name).
const LEASE_NAME: &str = "cluster-proxy-addon-manager";

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("no Kubernetes API to talk to (set KUBECONFIG, or run in a cluster): {0}")]
    Client(#[from] cluster_proxy_control::ClientError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Health(#[from] cluster_proxy_runtime::net::BindError),
    #[error(transparent)]
    Leader(#[from] LeaderError),
}

/// Runs addon-manager until SIGTERM or SIGINT.
pub async fn serve(
    settings: AddonManagerSettings,
    mut signals: Signals,
) -> Result<(), ServiceError> {
    let client = cluster_proxy_control::client::client(USER_AGENT).await?;
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
    cluster_proxy_runtime::admin::serve_controller_health(
        &settings.health_bind_address,
        settings.health_port,
        registry,
        stop.clone(),
    )
    .await?;

    let addon_settings = addon_settings(&settings)?;
    let hub_settings = HubSettings {
        tls_profile_namespace: Some(settings.namespace.clone()),
        image_pull_policy: addon_settings.image_pull_policy.clone(),
        proxy_server_telemetry: settings.proxy_server_telemetry(),
        ..HubSettings::default()
    };
    let leadership = Leadership {
        api: kube::Api::<Lease>::namespaced(client.clone(), &settings.namespace),
        lease: LEASE_NAME,
        fallback_identity: "addon-manager",
        enabled: settings.leader_elect,
    };
    let signal = lead_in_turns(
        leadership,
        signals.recv(),
        |leading| {
            leader.set(i64::from(leading));
        },
        |term| {
            tracing::info!("leading: running the hub and addon controllers");
            let hub = tokio::spawn(hub::run(
                client.clone(),
                hub_settings.clone(),
                hub_metrics.clone(),
                term.clone().cancelled_owned(),
            ));
            let addons = tokio::spawn(addon::run(
                client.clone(),
                addon_settings.clone(),
                addon_metrics.clone(),
                term.cancelled_owned(),
            ));
            async move {
                let _ = tokio::join!(hub, addons);
            }
        },
    )
    .await?;
    tracing::info!(signal, "stopping");
    stop.cancel();
    Ok(())
}

/// The addon controller's settings from the binary's.
fn addon_settings(settings: &AddonManagerSettings) -> Result<AddonSettings, ConfigError> {
    let given = |value: &String| (!value.is_empty()).then(|| value.clone());
    let mut addon_settings = AddonSettings::new(&settings.namespace);
    addon_settings.agent_install_namespace = settings.agent_install_namespace.clone();
    addon_settings.removal_grace = settings.placement_removal_grace;
    addon_settings.enable_kube_api_proxy = settings.enable_kube_api_proxy;
    addon_settings.enable_network_policies = settings.enable_network_policies;
    addon_settings.enable_service_proxy = settings.enable_service_proxy;
    addon_settings.agent_kube_apiserver_ports = settings.kube_apiserver_ports()?;
    addon_settings.image_pull_policy = given(&settings.image_pull_policy);
    addon_settings
        .managed_proxy_configuration
        .clone_from(&settings.managed_proxy_configuration);
    addon_settings.agent_image = given(&settings.agent_image_name);
    addon_settings.install_strategy =
        addon::InstallStrategy::Placements(vec![addon::PlacementRef {
            namespace: settings.namespace.clone(),
            name: settings.placement_name.clone(),
        }]);
    Ok(addon_settings)
}

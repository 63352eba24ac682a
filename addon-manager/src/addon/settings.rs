//! What the addon controllers are told about their hub (addon-manager's
//! flags, as the controllers take them).

use std::time::Duration;

use super::names::{DEFAULT_AGENT_INSTALL_NAMESPACE, DEFAULT_PLACEMENT, DEFAULT_REMOVAL_GRACE};
use super::render;

/// A Placement by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementRef {
    pub namespace: String,
    pub name: String,
}

/// How ManagedClusterAddOns come to exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstallStrategy {
    /// Users create them; the controller only serves them.
    Manual,
    /// One per cluster the placements' decisions select.
    Placements(Vec<PlacementRef>),
}

/// What the addon controller needs to know about its hub.
#[derive(Debug, Clone)]
pub struct AddonSettings {
    /// The namespace addon-manager runs in; holds the CA bundle Secret
    /// [`CA_BUNDLE_SECRET`].
    pub hub_namespace: String,
    /// Agent namespace when neither an AddOnDeploymentConfig nor the
    /// ManagedClusterAddOn names one.
    pub agent_install_namespace: String,
    /// The ClusterManagementAddOn's install strategy.
    pub install_strategy: InstallStrategy,
    /// The AddOnDeploymentConfig (namespace, name) every addon uses unless
    /// its `spec.configs` names one; declared as the ClusterManagementAddOn's
    /// default.
    pub default_deployment_config: Option<(String, String)>,
    /// How long a cluster must stay out of every decision of the placements
    /// before the installer removes its addon. OCM's placement controller
    /// writes a placement's PlacementDecisions (100 clusters each) one after
    /// another, so when the sorted list shifts, a cluster moving from one
    /// object to the next is in none of them between the two writes; without
    /// a grace its agent would be uninstalled and installed again.
    pub removal_grace: Duration,
    /// Make every cluster's kube-apiserver reachable through the tunnel by
    /// the cluster's name (upstream's `--enable-kube-api-proxy`, default
    /// true); see [`render::AgentInputs::kube_api_proxy`].
    pub enable_kube_api_proxy: bool,
    /// Ship a NetworkPolicy for the agent pods with every agent
    /// (upstream's `--enable-network-policies`, default false); see
    /// [`render::agent_network_policy`].
    pub enable_network_policies: bool,
    /// Put a service-proxy beside every agent (upstream's
    /// `--enable-service-proxy`; its chart's default, false): once
    /// cert-authority has issued its certificate (the MPC's
    /// `spec.userServer`), every agent's work carries it.
    pub enable_service_proxy: bool,
    /// The kube-apiserver ports that policy lets the agents reach
    /// (`--agent-kube-apiserver-ports`, default 443 and 6443).
    pub agent_kube_apiserver_ports: Vec<i32>,
    /// The ManagedProxyConfiguration the agents are rendered from and the
    /// ClusterManagementAddOn names as its default configuration
    /// (`--managed-proxy-configuration`, default `cluster-proxy`).
    pub managed_proxy_configuration: String,
    /// The agent image (`--agent-image-name`); `None`: the MPC's
    /// `spec.proxyAgent.image`. Image mirrors apply to it either way.
    pub agent_image: Option<String>,
    /// The agent containers' `imagePullPolicy` (`--image-pull-policy`);
    /// `None`: Kubernetes' default.
    pub image_pull_policy: Option<String>,
}

impl AddonSettings {
    /// Upstream's defaults: placement `cluster-proxy-placement` in
    /// `hub_namespace`, agents in `open-cluster-management-cluster-proxy`.
    pub fn new(hub_namespace: &str) -> Self {
        Self {
            hub_namespace: hub_namespace.to_owned(),
            agent_install_namespace: DEFAULT_AGENT_INSTALL_NAMESPACE.to_owned(),
            install_strategy: InstallStrategy::Placements(vec![PlacementRef {
                namespace: hub_namespace.to_owned(),
                name: DEFAULT_PLACEMENT.to_owned(),
            }]),
            default_deployment_config: None,
            removal_grace: DEFAULT_REMOVAL_GRACE,
            enable_kube_api_proxy: true,
            enable_network_policies: false,
            enable_service_proxy: false,
            agent_kube_apiserver_ports: render::KUBE_API_SERVER_PORTS.to_vec(),
            managed_proxy_configuration:
                cluster_proxy_proto::api::proxy::v1alpha1::MANAGED_PROXY_CONFIGURATION_NAME
                    .to_owned(),
            agent_image: None,
            image_pull_policy: None,
        }
    }
}

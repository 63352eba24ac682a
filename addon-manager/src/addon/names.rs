//! The names the addon controllers and the agents they render agree on:
//! OCM's object names, the agent's Secrets and RBAC, the defaults. A leaf:
//! it imports nothing of the controllers.

use std::time::Duration;

/// The addon's name: ClusterManagementAddOn, ManagedClusterAddOns, Lease.
pub const ADDON_NAME: &str = "cluster-proxy";
/// The ManifestWork that deploys the agent.
pub const MANIFEST_WORK_NAME: &str = "addon-cluster-proxy-deploy-0";
/// The agent Deployment on the managed cluster.
pub const AGENT_DEPLOYMENT: &str = "cluster-proxy-proxy-agent";
/// The agent's ServiceAccount.
pub const AGENT_SERVICE_ACCOUNT: &str = "cluster-proxy";
/// The agent's CA bundle Secret.
pub const AGENT_CA_SECRET: &str = "cluster-proxy-ca";
/// The proxy-agent's client certificate Secret (written by the klusterlet).
pub const AGENT_CLIENT_CERT_SECRET: &str =
    "cluster-proxy-open-cluster-management.io-proxy-agent-signer-client-cert";
/// The addon-agent's hub kubeconfig Secret (written by the klusterlet).
pub const HUB_KUBECONFIG_SECRET: &str = "cluster-proxy-hub-kubeconfig";
/// Role and RoleBinding of the agent, on the hub and on the managed cluster.
pub const AGENT_RBAC_NAME: &str = "cluster-proxy-addon-agent";
/// The placement of the default install strategy.
pub const DEFAULT_PLACEMENT: &str = "cluster-proxy-placement";
/// Where the agent is installed unless configured otherwise (upstream's
/// `--agent-install-namespace` default).
pub const DEFAULT_AGENT_INSTALL_NAMESPACE: &str = "open-cluster-management-cluster-proxy";
/// The hub CA bundle Secret (written by cert-authority) and its key.
pub const CA_BUNDLE_SECRET: &str = "proxy-server-ca";
pub const CA_BUNDLE_KEY: &str = "ca.crt";

/// How long a cluster must be out of every decision before its addon is
/// removed, unless the settings' `removal_grace` says otherwise.
pub const DEFAULT_REMOVAL_GRACE: Duration = Duration::from_secs(10);

//! `ClusterManagementAddOn`, `ManagedClusterAddOn` and `AddOnDeploymentConfig`
//! (`addon.open-cluster-management.io/v1alpha1`), as OCM publishes them.
//!
//! OCM also serves these kinds as `v1beta1` (upstream cluster-proxy moved to it
//! in 2026, where `supportedConfigs` became `defaultConfigs`); the hub converts
//! between the versions, so `v1alpha1` clients keep working. Every field of
//! OCM's `v1alpha1` types is modelled, deprecated ones included; fields a later
//! OCM adds are kept by server-side apply (see [`crate::api`]).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration};
use serde::{Deserialize, Serialize};

use crate::api::Condition;
use crate::api::cluster::v1alpha1::RolloutStrategy;

/// Label naming the add-on on objects created for it (CSRs, ManifestWorks, ...).
pub const LABEL_ADDON_NAME: &str = "open-cluster-management.io/addon-name";
/// Label naming the add-on's install namespace on the ManifestWork.
pub const LABEL_ADDON_NAMESPACE: &str = "open-cluster-management.io/addon-namespace";
/// Annotation on a ClusterManagementAddOn: who manages the add-on's lifecycle.
pub const ANNOTATION_LIFECYCLE: &str = "addon.open-cluster-management.io/lifecycle";
/// [`ANNOTATION_LIFECYCLE`] value: OCM's general addon-manager installs it.
pub const LIFECYCLE_ADDON_MANAGER: &str = "addon-manager";
/// [`ANNOTATION_LIFECYCLE`] value: the add-on's own manager installs it.
pub const LIFECYCLE_SELF: &str = "self";
/// Annotation on a manifest: keep the object when the add-on is removed.
pub const ANNOTATION_DELETION_ORPHAN: &str = "addon.open-cluster-management.io/deletion-orphan";
/// Annotation on a ManagedClusterAddOn: the hosting cluster in hosted mode.
pub const ANNOTATION_HOSTING_CLUSTER_NAME: &str =
    "addon.open-cluster-management.io/hosting-cluster-name";
/// Annotation disabling automatic installation on a cluster.
pub const ANNOTATION_DISABLE_AUTOMATIC_INSTALLATION: &str =
    "addon.open-cluster-management.io/disable-automatic-installation";

/// Install strategy: ManagedClusterAddOns are created by hand.
pub const INSTALL_STRATEGY_MANUAL: &str = "Manual";
/// Install strategy: on every cluster the listed placements select.
pub const INSTALL_STRATEGY_PLACEMENTS: &str = "Placements";

/// Health check mode: the agent's Lease decides `Available`.
pub const HEALTH_CHECK_LEASE: &str = "Lease";
/// Health check mode: the add-on manager decides `Available`.
pub const HEALTH_CHECK_CUSTOMIZED: &str = "Customized";

/// ManagedClusterAddOn condition type: the add-on is available.
pub const CONDITION_AVAILABLE: &str = "Available";
/// ManagedClusterAddOn condition type: the add-on is degraded.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// ManagedClusterAddOn condition type: configurations are applied.
pub const CONDITION_CONFIGURED: &str = "Configured";
/// ManagedClusterAddOn condition type: a rollout is in progress.
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// ManagedClusterAddOn condition type: the agent's manifests are applied.
pub const CONDITION_MANIFEST_APPLIED: &str = "ManifestApplied";
/// ManagedClusterAddOn condition type: registration RBAC is in place.
pub const CONDITION_REGISTRATION_APPLIED: &str = "RegistrationApplied";

/// `Available` reason: the agent renews its Lease.
pub const REASON_LEASE_UPDATED: &str = "ManagedClusterAddOnLeaseUpdated";
/// `Available` reason: the agent's Lease expired.
pub const REASON_LEASE_UPDATE_STOPPED: &str = "ManagedClusterAddOnLeaseUpdateStopped";
/// `Available` reason: the agent has no Lease.
pub const REASON_LEASE_NOT_FOUND: &str = "ManagedClusterAddOnLeaseNotFound";
/// `ManifestApplied` reason: the ManifestWork is applied.
pub const REASON_MANIFESTS_APPLIED: &str = "AddonManifestApplied";
/// `ManifestApplied` reason: applying the ManifestWork failed on the cluster.
pub const REASON_MANIFESTS_APPLY_FAILED: &str = "AddonManifestAppliedFailed";
/// `ManifestApplied` reason: creating the ManifestWork failed on the hub.
pub const REASON_WORK_APPLY_FAILED: &str = "ManifestWorkApplyFailed";
/// `RegistrationApplied` reason: registration permissions are set.
pub const REASON_SET_PERMISSION_APPLIED: &str = "SetPermissionApplied";
/// `RegistrationApplied` reason: setting registration permissions failed.
pub const REASON_SET_PERMISSION_FAILED: &str = "SetPermissionFailed";
/// `Progressing` reason: a configuration is rolling out.
pub const REASON_PROGRESSING: &str = "Progressing";
/// `Progressing` reason: the rollout completed.
pub const REASON_COMPLETED: &str = "Completed";
/// `Progressing` reason: the rollout failed.
pub const REASON_FAILED: &str = "Failed";

/// The ManagedClusterAddOn default install namespace of OCM (deprecated field).
pub const DEFAULT_INSTALL_NAMESPACE: &str = "open-cluster-management-agent-addon";

ocm_kind! {
    /// An add-on known to the hub, with its install strategy and configuration types.
    ClusterManagementAddOn {
        group: "addon.open-cluster-management.io",
        version: "v1alpha1",
        plural: "clustermanagementaddons",
        scope: ClusterResourceScope,
        spec: ClusterManagementAddOnSpec,
        status: ClusterManagementAddOnStatus,
    }
}

/// The `spec` of a [`ClusterManagementAddOn`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterManagementAddOnSpec {
    /// Display name and description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_on_meta: Option<AddOnMeta>,
    /// Deprecated single configuration reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_on_configuration: Option<ConfigCoordinates>,
    /// Configuration types the add-on accepts, with optional defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supported_configs: Option<Vec<ConfigMeta>>,
    /// Where the add-on is installed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_strategy: Option<InstallStrategy>,
}

/// `addOnMeta`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnMeta {
    /// Display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// `addOnConfiguration` (deprecated).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigCoordinates {
    /// CRD name of the configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crd_name: Option<String>,
    /// Name of the configuration object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cr_name: Option<String>,
    /// Generation last observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_observed_generation: Option<i64>,
}

/// `spec.supportedConfigs[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMeta {
    /// API group of the configuration resource (empty for the core group).
    #[serde(default)]
    pub group: String,
    /// Resource (plural) of the configuration.
    pub resource: String,
    /// Configuration used when a cluster names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_config: Option<ConfigReferent>,
}

/// A configuration object by namespace and name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ConfigReferent {
    /// Namespace (empty for cluster-scoped configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

/// A configuration and the hash of the spec it had.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigSpecHash {
    /// Namespace (empty for cluster-scoped configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
    /// Hash of the configuration's spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_hash: Option<String>,
}

/// `spec.installStrategy`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct InstallStrategy {
    /// [`INSTALL_STRATEGY_MANUAL`] (OCM's default) or [`INSTALL_STRATEGY_PLACEMENTS`].
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// Placements whose clusters get the add-on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placements: Option<Vec<PlacementStrategy>>,
}

/// `spec.installStrategy.placements[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlacementStrategy {
    /// Namespace of the Placement.
    pub namespace: String,
    /// Name of the Placement.
    pub name: String,
    /// Configurations for the clusters of this placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configs: Option<Vec<AddOnConfig>>,
    /// How configuration changes roll out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_strategy: Option<RolloutStrategy>,
}

/// A configuration object of a given type (`configs[]`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct AddOnConfig {
    /// API group (empty for the core group).
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Namespace (empty for cluster-scoped configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

/// `status` of a ClusterManagementAddOn (written by OCM).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterManagementAddOnStatus {
    /// Resolved default configurations. The lower-case `c` is OCM's.
    #[serde(
        rename = "defaultconfigReferences",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub default_config_references: Option<Vec<DefaultConfigReference>>,
    /// Rollout progress per placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_progressions: Option<Vec<InstallProgression>>,
}

/// `status.defaultconfigReferences[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DefaultConfigReference {
    /// API group.
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// The configuration to use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_config: Option<ConfigSpecHash>,
}

/// `status.installProgressions[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstallProgression {
    /// Namespace of the Placement.
    pub namespace: String,
    /// Name of the Placement.
    pub name: String,
    /// Configurations and their rollout state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_references: Option<Vec<InstallConfigReference>>,
    /// Rollout conditions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// `status.installProgressions[].configReferences[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstallConfigReference {
    /// API group.
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// The configuration to roll out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_config: Option<ConfigSpecHash>,
    /// The last configuration that rolled out successfully.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_known_good_config: Option<ConfigSpecHash>,
    /// The configuration applied last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_applied_config: Option<ConfigSpecHash>,
}

ocm_kind! {
    /// The add-on on one managed cluster; lives in the cluster's namespace.
    ManagedClusterAddOn {
        group: "addon.open-cluster-management.io",
        version: "v1alpha1",
        plural: "managedclusteraddons",
        scope: NamespaceResourceScope,
        spec: ManagedClusterAddOnSpec,
        status: ManagedClusterAddOnStatus,
    }
}

/// The `spec` of a [`ManagedClusterAddOn`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterAddOnSpec {
    /// Deprecated agent namespace; use an AddOnDeploymentConfig's
    /// `agentInstallNamespace` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_namespace: Option<String>,
    /// Configurations for this cluster, overriding the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configs: Option<Vec<AddOnConfig>>,
}

/// `status` of a ManagedClusterAddOn.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterAddOnStatus {
    /// Conditions (`Available`, `ManifestApplied`, ...), keyed by type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Objects related to the add-on (e.g. its ClusterManagementAddOn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub related_objects: Option<Vec<ObjectReference>>,
    /// Display name and description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_on_meta: Option<AddOnMeta>,
    /// Deprecated single configuration reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_on_configuration: Option<ConfigCoordinates>,
    /// Configuration types the add-on supports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supported_configs: Option<Vec<ConfigGroupResource>>,
    /// Configurations in effect for this cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_references: Option<Vec<ConfigReference>>,
    /// Namespace the agent runs in on the managed cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Credentials the agent asks the hub for (CSRs the klusterlet files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registrations: Option<Vec<RegistrationConfig>>,
    /// How `Available` is decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// How the agent's hub kube client authenticates (`csr` or `token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kube_client_driver: Option<String>,
}

/// `status.relatedObjects[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ObjectReference {
    /// API group.
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Namespace, for namespaced objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

/// A configuration type by group and resource.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ConfigGroupResource {
    /// API group (empty for the core group).
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
}

/// `status.configReferences[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigReference {
    /// API group.
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Deprecated: namespace of the configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Deprecated: name of the configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Deprecated: generation observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_observed_generation: Option<i64>,
    /// The configuration that should be in effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_config: Option<ConfigSpecHash>,
    /// The configuration last applied on the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_applied_config: Option<ConfigSpecHash>,
}

/// `status.registrations[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RegistrationConfig {
    /// Signer of the certificate (`kubernetes.io/kube-apiserver-client` for
    /// the hub kubeconfig, or a custom signer).
    pub signer_name: String,
    /// Subject the CSR must carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Subject>,
}

/// `status.registrations[].subject`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Subject {
    /// User (certificate common name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Groups (certificate organizations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<Vec<String>>,
    /// Organizational units. The singular JSON name is OCM's.
    #[serde(
        rename = "organizationUnit",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub organization_units: Option<Vec<String>>,
}

/// `status.healthCheck`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct HealthCheck {
    /// [`HEALTH_CHECK_LEASE`] (OCM's default) or [`HEALTH_CHECK_CUSTOMIZED`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

impl ManagedClusterAddOn {
    /// The add-on's conditions (empty when it has no status yet).
    pub fn conditions(&self) -> &[Condition] {
        self.status
            .as_ref()
            .and_then(|status| status.conditions.as_deref())
            .unwrap_or_default()
    }
}

ocm_kind! {
    /// Deployment options of an add-on's agent; referenced from `configs`.
    AddOnDeploymentConfig {
        group: "addon.open-cluster-management.io",
        version: "v1alpha1",
        plural: "addondeploymentconfigs",
        scope: NamespaceResourceScope,
        spec: AddOnDeploymentConfigSpec,
    }
}

/// The `spec` of a [`AddOnDeploymentConfig`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddOnDeploymentConfigSpec {
    /// Add-on specific variables (cluster-proxy reads `serviceDomain`,
    /// `enableImpersonation` and the `oidc*` ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customized_variables: Option<Vec<CustomizedVariable>>,
    /// Node selector and tolerations of the agent pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_placement: Option<NodePlacement>,
    /// Image mirrors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registries: Option<Vec<ImageMirror>>,
    /// HTTP(S) proxy the agent uses to reach the hub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_config: Option<ProxyConfig>,
    /// Namespace of the agent on the managed cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_install_namespace: Option<String>,
    /// Resource requests and limits per container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_requirements: Option<Vec<ContainerResourceRequirements>>,
}

/// `spec.customizedVariables[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct CustomizedVariable {
    /// Variable name.
    pub name: String,
    /// Variable value.
    #[serde(default)]
    pub value: String,
}

/// `spec.nodePlacement`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodePlacement {
    /// Node labels the pods require.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints the pods tolerate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
}

/// `spec.registries[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ImageMirror {
    /// Registry that replaces `source`.
    pub mirror: String,
    /// Registry (prefix) being replaced.
    #[serde(default)]
    pub source: String,
}

/// `spec.proxyConfig`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProxyConfig {
    /// `HTTP_PROXY` of the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_proxy: Option<String>,
    /// `HTTPS_PROXY` of the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub https_proxy: Option<String>,
    /// CA bundle of an HTTPS proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<ByteString>,
    /// `NO_PROXY` of the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_proxy: Option<String>,
}

/// `spec.resourceRequirements[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ContainerResourceRequirements {
    /// `<kind>:<name>:<container>`, each part a regex
    /// (e.g. `deployments:cluster-proxy-proxy-agent:proxy-agent`).
    #[serde(rename = "containerID")]
    pub container_id: String,
    /// Requests and limits.
    #[serde(default)]
    pub resources: ResourceRequirements,
}

impl AddOnDeploymentConfig {
    /// The value of customized variable `name`, if set.
    pub fn variable(&self, name: &str) -> Option<&str> {
        self.spec
            .customized_variables
            .iter()
            .flatten()
            .find(|variable| variable.name == name)
            .map(|variable| variable.value.as_str())
    }
}

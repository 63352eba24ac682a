//! `ManagedCluster` (`cluster.open-cluster-management.io/v1`), as OCM
//! publishes it. Cluster-scoped; the name is the cluster's name and also the
//! name of its namespace on the hub. Every field of OCM's type is modelled;
//! fields a later OCM adds are kept by server-side apply (see [`crate::api`]).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use crate::api::Condition;

/// Condition type: the klusterlet has joined the hub.
pub const CONDITION_JOINED: &str = "ManagedClusterJoined";
/// Condition type: a hub admin accepted the cluster (`hubAcceptsClient`).
pub const CONDITION_HUB_ACCEPTED: &str = "HubAcceptedManagedCluster";
/// Condition type: a hub admin denied the cluster.
pub const CONDITION_HUB_DENIED: &str = "HubDeniedManagedCluster";
/// Condition type: the cluster's API server and klusterlet are healthy.
pub const CONDITION_AVAILABLE: &str = "ManagedClusterConditionAvailable";
/// Condition type: the cluster is being deleted.
pub const CONDITION_DELETING: &str = "Deleting";

/// Label carrying a ManagedCluster's name on objects related to it (CSRs,
/// ManagedClusterAddOn leases, ...).
pub const LABEL_CLUSTER_NAME: &str = "open-cluster-management.io/cluster-name";
/// Annotation with image registry mirrors for add-ons on this cluster (JSON
/// `{"registries":[{"source":..,"mirror":..}]}`); cluster-proxy also redeploys
/// its agent when it changes.
pub const ANNOTATION_IMAGE_REGISTRIES: &str = "open-cluster-management.io/image-registries";
/// Label `local-cluster=true` marks the hub registered as its own managed cluster.
pub const LABEL_LOCAL_CLUSTER: &str = "local-cluster";
/// Annotation on a local cluster with a JSON node selector for add-on agents.
pub const ANNOTATION_NODE_SELECTOR: &str = "open-cluster-management/nodeSelector";
/// Taint key added while the cluster is unavailable.
pub const TAINT_UNAVAILABLE: &str = "cluster.open-cluster-management.io/unavailable";
/// Taint key added while the cluster is unreachable.
pub const TAINT_UNREACHABLE: &str = "cluster.open-cluster-management.io/unreachable";
/// Taint effect: placements must tolerate the taint to select the cluster.
pub const TAINT_EFFECT_NO_SELECT: &str = "NoSelect";
/// Taint effect: placements avoid the cluster when they can.
pub const TAINT_EFFECT_PREFER_NO_SELECT: &str = "PreferNoSelect";
/// Taint effect: only placements that already selected the cluster keep it.
pub const TAINT_EFFECT_NO_SELECT_IF_NEW: &str = "NoSelectIfNew";

ocm_kind! {
    /// A cluster registered with the hub.
    ManagedCluster {
        group: "cluster.open-cluster-management.io",
        version: "v1",
        plural: "managedclusters",
        scope: ClusterResourceScope,
        spec: ManagedClusterSpec,
        status: ManagedClusterStatus,
    }
}

/// The `spec` of a [`ManagedCluster`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterSpec {
    /// API server addresses of the managed cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed_cluster_client_configs: Option<Vec<ClientConfig>>,
    /// The hub accepts the cluster; add-on agent CSRs are approved only then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_accepts_client: Option<bool>,
    /// Lease period of the klusterlet (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_duration_seconds: Option<i32>,
    /// Taints placements must tolerate to select the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taints: Option<Vec<Taint>>,
}

/// `spec.managedClusterClientConfigs[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientConfig {
    /// API server URL.
    pub url: String,
    /// CA bundle of the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<ByteString>,
}

/// `spec.taints[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    /// Taint key.
    pub key: String,
    /// Taint value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `NoSelect`, `PreferNoSelect` or `NoSelectIfNew`.
    pub effect: String,
    /// When the taint was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_added: Option<Time>,
}

/// `status`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterStatus {
    /// Conditions (joined, accepted, available, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Total resources of the cluster's nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<BTreeMap<String, Quantity>>,
    /// Allocatable resources of the cluster's nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocatable: Option<BTreeMap<String, Quantity>>,
    /// Kubernetes version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<ManagedClusterVersion>,
    /// ClusterClaims reported by the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_claims: Option<Vec<ManagedClusterClaim>>,
    /// Namespaces managed by the cluster sets the cluster belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed_namespaces: Option<Vec<ClusterSetManagedNamespace>>,
}

/// `status.version`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManagedClusterVersion {
    /// Kubernetes version of the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<String>,
}

/// `status.clusterClaims[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManagedClusterClaim {
    /// Claim name, e.g. `id.k8s.io`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Claim value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// `status.managedNamespaces[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSetManagedNamespace {
    /// Namespace name.
    pub name: String,
    /// Cluster set that manages it.
    pub cluster_set: String,
    /// Conditions of the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

impl ManagedCluster {
    /// Whether a hub admin accepted the cluster (`spec.hubAcceptsClient`).
    pub fn hub_accepts_client(&self) -> bool {
        self.spec.hub_accepts_client.unwrap_or(false)
    }

    /// The cluster's conditions (empty when it has no status yet).
    pub fn conditions(&self) -> &[Condition] {
        self.status
            .as_ref()
            .and_then(|status| status.conditions.as_deref())
            .unwrap_or_default()
    }
}

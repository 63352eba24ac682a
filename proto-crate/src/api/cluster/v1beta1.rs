//! `Placement` and `PlacementDecision`
//! (`cluster.open-cluster-management.io/v1beta1`), as OCM publishes them.
//! Both are namespaced.
//!
//! The add-on installs on the clusters a placement's decisions list, so the
//! decisions are modelled fully. Of the Placement spec only what selects
//! clusters is modelled (`clusterSets`, `numberOfClusters`, `predicates`,
//! `tolerations`); `prioritizerPolicy`, `spreadPolicy`, `decisionStrategy`,
//! `sortBy` and `scoreRateLimit` are not, and server-side apply keeps them.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta, Time,
};
use serde::{Deserialize, Serialize};

use crate::api::Condition;

/// Label on a PlacementDecision naming its Placement.
pub const LABEL_PLACEMENT: &str = "cluster.open-cluster-management.io/placement";
/// Label on a PlacementDecision with its decision group index.
pub const LABEL_DECISION_GROUP_INDEX: &str =
    "cluster.open-cluster-management.io/decision-group-index";
/// Label on a PlacementDecision with its decision group name.
pub const LABEL_DECISION_GROUP_NAME: &str =
    "cluster.open-cluster-management.io/decision-group-name";
/// Condition type: the placement selected as many clusters as it asked for.
pub const CONDITION_PLACEMENT_SATISFIED: &str = "PlacementSatisfied";
/// Condition type: the placement is misconfigured.
pub const CONDITION_PLACEMENT_MISCONFIGURED: &str = "PlacementMisconfigured";

ocm_kind! {
    /// A rule selecting managed clusters from the cluster sets bound to its namespace.
    Placement {
        group: "cluster.open-cluster-management.io",
        version: "v1beta1",
        plural: "placements",
        scope: NamespaceResourceScope,
        spec: PlacementSpec,
        status: PlacementStatus,
    }
}

/// The `spec` of a [`Placement`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSpec {
    /// Cluster sets to select from (all bound sets when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_sets: Option<Vec<String>>,
    /// How many clusters to select (all matching when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_clusters: Option<i32>,
    /// Cluster selectors; a cluster matching any of them is eligible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicates: Option<Vec<ClusterPredicate>>,
    /// Cluster taints this placement tolerates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
}

/// `spec.predicates[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPredicate {
    /// The selector a cluster must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_cluster_selector: Option<ClusterSelector>,
}

/// `spec.predicates[].requiredClusterSelector`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSelector {
    /// Selector over ManagedCluster labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_selector: Option<LabelSelector>,
    /// Selector over cluster claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_selector: Option<ClusterClaimSelector>,
    /// CEL expressions over the ManagedCluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cel_selector: Option<ClusterCelSelector>,
}

/// `requiredClusterSelector.claimSelector`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterClaimSelector {
    /// Requirements over claim names and values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_expressions: Option<Vec<LabelSelectorRequirement>>,
}

/// `requiredClusterSelector.celSelector`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterCelSelector {
    /// CEL expressions that must all hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cel_expressions: Option<Vec<String>>,
}

/// `spec.tolerations[]`: tolerates a ManagedCluster taint (not a core toleration).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Toleration {
    /// Taint key; empty with `Exists` tolerates everything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `Exists` or `Equal` (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    /// Taint value for `Equal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Taint effect to match; empty matches all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
    /// How long a `NoSelect` taint is tolerated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toleration_seconds: Option<i64>,
}

/// `status` of a Placement.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlacementStatus {
    /// Number of clusters selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_selected_clusters: Option<i32>,
    /// Decision groups and their clusters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_groups: Option<Vec<DecisionGroupStatus>>,
    /// Conditions (satisfied, misconfigured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// When scores were last updated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_score_update_time: Option<Time>,
}

/// `status.decisionGroups[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DecisionGroupStatus {
    /// Group index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_group_index: Option<i32>,
    /// Group name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_group_name: Option<String>,
    /// Names of the PlacementDecisions of this group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions: Option<Vec<String>>,
    /// Number of clusters in the group.
    #[serde(
        rename = "clusterCount",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub clusters_count: Option<i32>,
}

/// The clusters a Placement selected, in pages of up to 100. It has no spec;
/// the placement controller writes only its status.
#[derive(Deserialize, Clone, Debug, Default, PartialEq)]
pub struct PlacementDecision {
    /// Standard object metadata; label [`LABEL_PLACEMENT`] names the Placement.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The decisions.
    #[serde(default)]
    pub status: Option<PlacementDecisionStatus>,
}

impl kube::Resource for PlacementDecision {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "PlacementDecision".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        super::GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1beta1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "placementdecisions".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl Serialize for PlacementDecision {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let fields = 3 + usize::from(self.status.is_some());
        let mut object = serializer.serialize_struct("PlacementDecision", fields)?;
        object.serialize_field("apiVersion", &<Self as kube::Resource>::api_version(&()))?;
        object.serialize_field("kind", "PlacementDecision")?;
        object.serialize_field("metadata", &self.metadata)?;
        if let Some(status) = &self.status {
            object.serialize_field("status", status)?;
        }
        object.end()
    }
}

/// `status` of a PlacementDecision.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct PlacementDecisionStatus {
    /// The selected clusters (at most 100 per PlacementDecision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions: Option<Vec<ClusterDecision>>,
}

/// `status.decisions[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDecision {
    /// The selected ManagedCluster.
    pub cluster_name: String,
    /// Why it was selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Its score, when scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<i64>,
}

impl PlacementDecision {
    /// The names of the clusters this decision selects, in order.
    pub fn cluster_names(&self) -> impl Iterator<Item = &str> {
        self.status
            .iter()
            .flat_map(|status| status.decisions.iter().flatten())
            .map(|decision| decision.cluster_name.as_str())
    }

    /// The Placement this decision belongs to (label [`LABEL_PLACEMENT`]).
    pub fn placement_name(&self) -> Option<&str> {
        self.metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(LABEL_PLACEMENT))
            .map(String::as_str)
    }
}

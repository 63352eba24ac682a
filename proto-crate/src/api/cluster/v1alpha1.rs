//! `cluster.open-cluster-management.io/v1alpha1`: the rollout strategy that
//! add-on install strategies embed (OCM declares it in this group).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Serialize};

/// Rollout type: every selected cluster at once.
pub const ROLLOUT_ALL: &str = "All";
/// Rollout type: clusters one batch at a time.
pub const ROLLOUT_PROGRESSIVE: &str = "Progressive";
/// Rollout type: one decision group at a time.
pub const ROLLOUT_PROGRESSIVE_PER_GROUP: &str = "ProgressivePerGroup";

/// How a change rolls out over the clusters a placement selects.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStrategy {
    /// `All`, `Progressive` or `ProgressivePerGroup` (OCM default `All`).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// Options of `All`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all: Option<RolloutAll>,
    /// Options of `Progressive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progressive: Option<RolloutProgressive>,
    /// Options of `ProgressivePerGroup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progressive_per_group: Option<RolloutProgressivePerGroup>,
}

/// `rolloutStrategy.all`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutAll {
    /// Time a cluster must stay successful (a Go duration, e.g. `5m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_success_time: Option<String>,
    /// Deadline for a cluster to succeed (`None` or a Go duration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline: Option<String>,
    /// Failures tolerated before the rollout stops (count or percentage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failures: Option<IntOrString>,
}

/// `rolloutStrategy.progressive`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutProgressive {
    /// See [`RolloutAll::min_success_time`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_success_time: Option<String>,
    /// See [`RolloutAll::progress_deadline`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline: Option<String>,
    /// See [`RolloutAll::max_failures`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failures: Option<IntOrString>,
    /// Groups rolled out first, all at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mandatory_decision_groups: Option<Vec<MandatoryDecisionGroup>>,
    /// Clusters updated at a time (count or percentage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<IntOrString>,
}

/// `rolloutStrategy.progressivePerGroup`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutProgressivePerGroup {
    /// See [`RolloutAll::min_success_time`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_success_time: Option<String>,
    /// See [`RolloutAll::progress_deadline`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline: Option<String>,
    /// See [`RolloutAll::max_failures`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failures: Option<IntOrString>,
    /// Groups rolled out first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mandatory_decision_groups: Option<Vec<MandatoryDecisionGroup>>,
}

/// A decision group named or indexed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MandatoryDecisionGroup {
    /// Group name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_name: Option<String>,
    /// Group index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_index: Option<i32>,
}

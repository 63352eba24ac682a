//! `ManifestWork` (`work.open-cluster-management.io/v1`), as OCM publishes it.
//! Namespaced: a ManifestWork lives in the namespace of the cluster it
//! deploys to. Every field is modelled; manifests are kept as raw JSON.

use serde::{Deserialize, Serialize};

use crate::api::Condition;

/// Finalizer OCM puts on a ManifestWork until its resources are removed.
pub const FINALIZER: &str = "cluster.open-cluster-management.io/manifest-work-cleanup";

/// Work condition type: the resources are being applied.
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// Work (and manifest) condition type: every resource is applied.
pub const CONDITION_APPLIED: &str = "Applied";
/// Work (and manifest) condition type: every resource exists on the cluster.
pub const CONDITION_AVAILABLE: &str = "Available";
/// Work (and manifest) condition type: a resource is degraded.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// Work (and manifest) condition type: the work is complete.
pub const CONDITION_COMPLETE: &str = "Complete";
/// Work condition type: the work is being deleted.
pub const CONDITION_DELETING: &str = "Deleting";

/// Feedback rule type: well-known status fields of well-known kinds.
pub const FEEDBACK_WELL_KNOWN_STATUS: &str = "WellKnownStatus";
/// Feedback rule type: the listed JSON paths.
pub const FEEDBACK_JSON_PATHS: &str = "JSONPaths";

/// Feedback value type: the value is in `integer`.
pub const VALUE_INTEGER: &str = "Integer";
/// Feedback value type: the value is in `string`.
pub const VALUE_STRING: &str = "String";
/// Feedback value type: the value is in `boolean`.
pub const VALUE_BOOLEAN: &str = "Boolean";
/// Feedback value type: the value is in `jsonRaw` (a JSON document as text).
pub const VALUE_JSON_RAW: &str = "JsonRaw";

/// Update strategy: update the resource (OCM's default).
pub const UPDATE_STRATEGY_UPDATE: &str = "Update";
/// Update strategy: create it once, never update.
pub const UPDATE_STRATEGY_CREATE_ONLY: &str = "CreateOnly";
/// Update strategy: server-side apply.
pub const UPDATE_STRATEGY_SERVER_SIDE_APPLY: &str = "ServerSideApply";
/// Update strategy: only read the resource's status.
pub const UPDATE_STRATEGY_READ_ONLY: &str = "ReadOnly";

/// Delete propagation: delete the resources with the work (default).
pub const PROPAGATION_FOREGROUND: &str = "Foreground";
/// Delete propagation: keep every resource.
pub const PROPAGATION_ORPHAN: &str = "Orphan";
/// Delete propagation: keep the listed resources.
pub const PROPAGATION_SELECTIVELY_ORPHAN: &str = "SelectivelyOrphan";

ocm_kind! {
    /// Resources for the work agent of one managed cluster to apply.
    ManifestWork {
        group: "work.open-cluster-management.io",
        version: "v1",
        plural: "manifestworks",
        scope: NamespaceResourceScope,
        spec: ManifestWorkSpec,
        status: ManifestWorkStatus,
    }
}

/// The `spec` of a [`ManifestWork`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkSpec {
    /// The resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<ManifestsTemplate>,
    /// What happens to the resources when the work is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_option: Option<DeleteOption>,
    /// Per-resource options: status feedback, update strategy, condition rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_configs: Option<Vec<ManifestConfigOption>>,
    /// The identity the work agent applies the resources as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<ManifestWorkExecutor>,
}

/// `spec.workload`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManifestsTemplate {
    /// Whole Kubernetes objects, each with `apiVersion` and `kind`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifests: Option<Vec<Manifest>>,
}

/// One whole Kubernetes object inside a ManifestWork.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(transparent)]
pub struct Manifest(pub serde_json::Value);

/// Why a value cannot be a [`Manifest`].
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The value does not serialise to JSON.
    #[error("manifest does not serialise to JSON: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The value is not a JSON object.
    #[error("manifest is not a JSON object")]
    NotAnObject,
    /// `apiVersion` or `kind` is missing or empty; the work agent cannot apply it.
    #[error("manifest has no {0}")]
    MissingField(&'static str),
}

impl Manifest {
    /// Wraps a Kubernetes object. k8s-openapi and kube custom resource types
    /// serialise their `apiVersion` and `kind`; anything lacking them is refused.
    pub fn new<T: Serialize>(object: &T) -> Result<Self, ManifestError> {
        let value = serde_json::to_value(object)?;
        let fields = value.as_object().ok_or(ManifestError::NotAnObject)?;
        for field in ["apiVersion", "kind"] {
            let present = fields
                .get(field)
                .and_then(serde_json::Value::as_str)
                .is_some_and(|text| !text.is_empty());
            if !present {
                return Err(ManifestError::MissingField(field));
            }
        }
        Ok(Self(value))
    }

    /// The object's `apiVersion`, when it has one.
    pub fn api_version(&self) -> Option<&str> {
        self.0.get("apiVersion").and_then(serde_json::Value::as_str)
    }

    /// The work agent's identifier of this object: group, resource,
    /// namespace and name, the resource guessed from the kind as OCM's addon
    /// framework guesses it (`meta.UnsafeGuessKindToResource`).
    pub fn identifier(&self) -> Option<ResourceIdentifier> {
        let group = match self.api_version()?.split_once('/') {
            Some((group, _)) => group,
            None => "",
        };
        let kind = self.kind()?.to_ascii_lowercase();
        let resource = if kind.ends_with('s') {
            format!("{kind}es")
        } else if let Some(stem) = kind.strip_suffix('y') {
            format!("{stem}ies")
        } else {
            format!("{kind}s")
        };
        Some(ResourceIdentifier {
            group: group.to_owned(),
            resource,
            name: self.name()?.to_owned(),
            namespace: self.namespace().unwrap_or_default().to_owned(),
        })
    }

    /// The object's `kind`, when it has one.
    pub fn kind(&self) -> Option<&str> {
        self.0.get("kind").and_then(serde_json::Value::as_str)
    }

    /// The object's `metadata.name`, when it has one.
    pub fn name(&self) -> Option<&str> {
        self.0
            .pointer("/metadata/name")
            .and_then(serde_json::Value::as_str)
    }

    /// The object's `metadata.namespace`, when it has one.
    pub fn namespace(&self) -> Option<&str> {
        self.0
            .pointer("/metadata/namespace")
            .and_then(serde_json::Value::as_str)
    }
}

/// `spec.deleteOption`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeleteOption {
    /// `Foreground` (default), `Orphan` or `SelectivelyOrphan`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub propagation_policy: Option<String>,
    /// Resources kept with `SelectivelyOrphan`. The plural JSON name is OCM's.
    #[serde(
        rename = "selectivelyOrphans",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub selectively_orphan: Option<SelectivelyOrphan>,
    /// Delete the work this long after it completes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds_after_finished: Option<i64>,
}

impl DeleteOption {
    /// Whether the work agent deletes `resource` with the work, as OCM's
    /// `OwnedByTheWork` decides at apply time: always without options, with
    /// `Foreground` or a `SelectivelyOrphan` without rules; never with
    /// `Orphan`; with `SelectivelyOrphan`, unless a rule names it exactly.
    pub fn deletes(option: Option<&DeleteOption>, resource: &ResourceIdentifier) -> bool {
        let Some(option) = option else {
            return true;
        };
        match option.propagation_policy.as_deref() {
            Some(PROPAGATION_ORPHAN) => false,
            Some(PROPAGATION_SELECTIVELY_ORPHAN) => match &option.selectively_orphan {
                None => true,
                Some(orphan) => !orphan
                    .orphaning_rules
                    .iter()
                    .flatten()
                    .any(|rule| rule == resource),
            },
            _ => true,
        }
    }
}

/// `spec.deleteOption.selectivelyOrphans`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SelectivelyOrphan {
    /// Resources to keep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orphaning_rules: Option<Vec<ResourceIdentifier>>,
}

/// A resource on the managed cluster by group, resource, namespace and name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ResourceIdentifier {
    /// API group (empty for the core group).
    #[serde(default)]
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Name.
    pub name: String,
    /// Namespace (empty for cluster-scoped resources).
    #[serde(default)]
    pub namespace: String,
}

/// `spec.manifestConfigs[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManifestConfigOption {
    /// The resource these options apply to.
    pub resource_identifier: ResourceIdentifier,
    /// Status fields reported back in `status.resourceStatus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback_rules: Option<Vec<FeedbackRule>>,
    /// How the resource is updated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_strategy: Option<UpdateStrategy>,
    /// Rules deriving conditions from the resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition_rules: Option<Vec<ConditionRule>>,
    /// `Poll` or `Watch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback_scrape_type: Option<String>,
}

/// `spec.manifestConfigs[].feedbackRules[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FeedbackRule {
    /// [`FEEDBACK_WELL_KNOWN_STATUS`] or [`FEEDBACK_JSON_PATHS`].
    #[serde(rename = "type")]
    pub type_: String,
    /// Paths for [`FEEDBACK_JSON_PATHS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_paths: Option<Vec<JsonPath>>,
}

/// `feedbackRules[].jsonPaths[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct JsonPath {
    /// Name of the reported value.
    pub name: String,
    /// API version to read the resource as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// JSON path into the resource's status, e.g. `.readyReplicas`.
    pub path: String,
}

/// `spec.manifestConfigs[].updateStrategy`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UpdateStrategy {
    /// One of the `UPDATE_STRATEGY_*` values.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// Options of [`UPDATE_STRATEGY_SERVER_SIDE_APPLY`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_side_apply: Option<ServerSideApplyConfig>,
}

/// `updateStrategy.serverSideApply`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServerSideApplyConfig {
    /// Force ownership of conflicting fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force: Option<bool>,
    /// Field manager (OCM's default `work-agent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_manager: Option<String>,
    /// Fields the work agent leaves alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_fields: Option<Vec<IgnoreField>>,
}

/// `serverSideApply.ignoreFields[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IgnoreField {
    /// `OnSpokeChange` or `OnSpokePresent`.
    pub condition: String,
    /// JSON paths of the ignored fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_paths: Option<Vec<String>>,
    /// JSON pointers of the ignored fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_pointers: Option<Vec<String>>,
    /// jq path expressions of the ignored fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jq_path_expressions: Option<Vec<String>>,
}

/// `spec.manifestConfigs[].conditionRules[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConditionRule {
    /// Condition type the rule sets.
    pub condition: String,
    /// `WellKnownConditions` or `CEL`.
    #[serde(rename = "type")]
    pub type_: String,
    /// CEL expressions that must all hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cel_expressions: Option<Vec<String>>,
    /// Message of the condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// CEL expression producing the message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_expression: Option<String>,
}

/// `spec.executor`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManifestWorkExecutor {
    /// The identity.
    pub subject: ManifestWorkExecutorSubject,
}

/// `spec.executor.subject`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkExecutorSubject {
    /// `ServiceAccount`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The ServiceAccount on the managed cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ManifestWorkSubjectServiceAccount>,
}

/// `spec.executor.subject.serviceAccount`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManifestWorkSubjectServiceAccount {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// `status` (written by the work agent on the managed cluster).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkStatus {
    /// Work conditions (`Applied`, `Available`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Per-resource status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_status: Option<ManifestResourceStatus>,
}

/// `status.resourceStatus`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManifestResourceStatus {
    /// One entry per manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifests: Option<Vec<ManifestCondition>>,
}

/// `status.resourceStatus.manifests[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ManifestCondition {
    /// Which manifest.
    #[serde(default)]
    pub resource_meta: ManifestResourceMeta,
    /// Values the feedback rules collected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_feedback: Option<StatusFeedbackResult>,
    /// Conditions of this resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// `manifests[].resourceMeta`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ManifestResourceMeta {
    /// Index of the manifest in `spec.workload.manifests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordinal: Option<i32>,
    /// API group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// API version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Resource (plural).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// `manifests[].statusFeedback`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct StatusFeedbackResult {
    /// The values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<FeedbackValue>>,
}

/// `statusFeedback.values[]`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FeedbackValue {
    /// Name from the feedback rule (e.g. `ReadyReplicas`).
    pub name: String,
    /// The value.
    #[serde(default)]
    pub field_value: FieldValue,
}

/// A typed feedback value; exactly one of the value fields is set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FieldValue {
    /// One of the `VALUE_*` types.
    #[serde(rename = "type", default)]
    pub type_: String,
    /// Value of type [`VALUE_INTEGER`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integer: Option<i64>,
    /// Value of type [`VALUE_STRING`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub string: Option<String>,
    /// Value of type [`VALUE_BOOLEAN`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boolean: Option<bool>,
    /// Value of type [`VALUE_JSON_RAW`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_raw: Option<String>,
}

impl ManifestWork {
    /// The work's conditions (empty when it has no status yet).
    pub fn conditions(&self) -> &[Condition] {
        self.status
            .as_ref()
            .and_then(|status| status.conditions.as_deref())
            .unwrap_or_default()
    }

    /// The feedback value `name` reported for the manifest matching
    /// `resource` (group, resource, namespace and name).
    pub fn feedback(&self, resource: &ResourceIdentifier, name: &str) -> Option<&FieldValue> {
        let manifests = self
            .status
            .as_ref()?
            .resource_status
            .as_ref()?
            .manifests
            .as_ref()?;
        manifests
            .iter()
            .find(|manifest| manifest.resource_meta.matches(resource))?
            .status_feedback
            .as_ref()?
            .values
            .iter()
            .flatten()
            .find(|value| value.name == name)
            .map(|value| &value.field_value)
    }
}

impl ManifestResourceMeta {
    fn matches(&self, resource: &ResourceIdentifier) -> bool {
        fn text(value: &Option<String>) -> &str {
            value.as_deref().unwrap_or_default()
        }
        text(&self.group) == resource.group
            && text(&self.resource) == resource.resource
            && text(&self.namespace) == resource.namespace
            && text(&self.name) == resource.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespace(name: &str) -> ResourceIdentifier {
        ResourceIdentifier {
            group: String::new(),
            resource: "namespaces".into(),
            name: name.into(),
            namespace: String::new(),
        }
    }

    #[test]
    fn the_work_agent_deletes_what_the_delete_options_own() {
        let agent_ns = namespace("open-cluster-management-agent-addon");
        let other = namespace("other");
        let policy = |p: &str| DeleteOption {
            propagation_policy: Some(p.into()),
            ..DeleteOption::default()
        };
        assert!(DeleteOption::deletes(None, &agent_ns));
        assert!(DeleteOption::deletes(
            Some(&policy(PROPAGATION_FOREGROUND)),
            &agent_ns
        ));
        assert!(!DeleteOption::deletes(
            Some(&policy(PROPAGATION_ORPHAN)),
            &agent_ns
        ));
        // SelectivelyOrphan without rules owns everything.
        assert!(DeleteOption::deletes(
            Some(&policy(PROPAGATION_SELECTIVELY_ORPHAN)),
            &agent_ns
        ));
        let selective = DeleteOption {
            selectively_orphan: Some(SelectivelyOrphan {
                orphaning_rules: Some(vec![agent_ns.clone()]),
            }),
            ..policy(PROPAGATION_SELECTIVELY_ORPHAN)
        };
        assert!(!DeleteOption::deletes(Some(&selective), &agent_ns));
        assert!(DeleteOption::deletes(Some(&selective), &other));
    }

    #[test]
    fn identifiers_guess_the_resource_as_the_addon_framework() {
        let manifest = |api: &str, kind: &str, ns: Option<&str>| {
            let mut object = serde_json::json!({"apiVersion": api, "kind": kind,
                "metadata": {"name": "x"}});
            if let Some(ns) = ns {
                object["metadata"]["namespace"] = ns.into();
            }
            Manifest(object).identifier().unwrap()
        };
        assert_eq!(manifest("v1", "Namespace", None), namespace("x"));
        let deployment = manifest("apps/v1", "Deployment", Some("ns"));
        assert_eq!(
            (
                deployment.group.as_str(),
                deployment.resource.as_str(),
                deployment.namespace.as_str()
            ),
            ("apps", "deployments", "ns")
        );
        assert_eq!(
            manifest("networking.k8s.io/v1", "NetworkPolicy", Some("ns")).resource,
            "networkpolicies"
        );
        assert_eq!(manifest("v1", "Ingress", None).resource, "ingresses");
    }
}

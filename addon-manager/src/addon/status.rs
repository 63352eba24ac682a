//! The part of a ManagedClusterAddOn's status the addon manager owns, built
//! from what the object already says so that a reconcile that stops early
//! (a missing configuration, say) keeps the fields it did not decide:
//! under server-side apply, a field left out of an apply is given up.

use cluster_proxy_proto::api::Condition;
use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnMeta, CONDITION_CONFIGURED, CONDITION_MANIFEST_APPLIED, CONDITION_PROGRESSING,
    CONDITION_REGISTRATION_APPLIED, ConfigGroupResource, ConfigReference, HEALTH_CHECK_LEASE,
    HealthCheck, ManagedClusterAddOn, ManagedClusterAddOnStatus, RegistrationConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::config::{ADC_GROUP, ADC_RESOURCE, MPC_GROUP, MPC_RESOURCE};

/// The condition types this controller writes.
pub const OWNED_CONDITIONS: [&str; 4] = [
    CONDITION_CONFIGURED,
    CONDITION_MANIFEST_APPLIED,
    CONDITION_PROGRESSING,
    CONDITION_REGISTRATION_APPLIED,
];

/// `Configured` reason: every configuration was found.
pub const REASON_CONFIGURED: &str = "ConfigurationsConfigured";
/// `Configured` reason: a referenced configuration does not exist.
pub const REASON_CONFIGURATION_NOT_FOUND: &str = "ConfigurationNotFound";
/// Reason: the cluster's name cannot name the agent's Service.
pub const REASON_INVALID_CLUSTER_NAME: &str = "InvalidClusterName";
/// Reason: the ManagedCluster of the addon does not exist.
pub const REASON_CLUSTER_NOT_FOUND: &str = "ManagedClusterNotFound";
/// Reason: the hub CA bundle is not published yet.
pub const REASON_CA_NOT_FOUND: &str = "CABundleNotFound";
/// Reason: the ManagedProxyConfiguration cannot be deployed.
pub const REASON_INVALID_CONFIGURATION: &str = "InvalidManagedProxyConfiguration";
/// Reason: the install namespace is not a namespace name.
pub const REASON_INVALID_INSTALL_NAMESPACE: &str = "InvalidInstallNamespace";
/// Reason: the agents' entrypoint is not known yet.
pub const REASON_ENTRYPOINT_NOT_READY: &str = "EntrypointNotReady";
/// Reason: the AddOnDeploymentConfig's `resourceRequirements` name a
/// container ID that is not `kind:name:container` regular expressions.
pub const REASON_INVALID_RESOURCE_REQUIREMENTS: &str = "InvalidResourceRequirements";
/// Reason: the ManagedCluster's image registries annotation is not valid JSON.
pub const REASON_INVALID_IMAGE_REGISTRIES: &str = "InvalidImageRegistries";
/// Reason: a local cluster's node selector annotation is not a JSON object.
pub const REASON_INVALID_NODE_SELECTOR: &str = "InvalidNodeSelector";
/// `ManifestApplied` reason: the work exists, its agent has not reported.
pub const REASON_MANIFEST_APPLYING: &str = "AddonManifestApplying";

/// One condition as decided by a reconcile (the transition time is filled
/// in against the current object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    pub type_: &'static str,
    pub status: &'static str,
    pub reason: String,
    pub message: String,
}

impl Decided {
    pub fn new(
        type_: &'static str,
        status: &'static str,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// The owned status fields, starting from the object's current values.
#[derive(Debug, Clone)]
pub struct OwnedStatus {
    pub namespace: Option<String>,
    pub registrations: Option<Vec<RegistrationConfig>>,
    pub config_references: Option<Vec<ConfigReference>>,
    conditions: Vec<Condition>,
    current: Vec<Condition>,
}

impl OwnedStatus {
    /// What `addon`'s status says now about the owned fields.
    pub fn from_current(addon: &ManagedClusterAddOn) -> Self {
        let status = addon.status.clone().unwrap_or_default();
        let current = status.conditions.clone().unwrap_or_default();
        let conditions = current
            .iter()
            .filter(|condition| OWNED_CONDITIONS.contains(&condition.type_.as_str()))
            .cloned()
            .collect();
        Self {
            namespace: status.namespace,
            registrations: status.registrations,
            config_references: status.config_references,
            conditions,
            current,
        }
    }

    /// Sets a condition; its transition time moves only when its status does.
    pub fn set(&mut self, decided: Decided, now: &Time) {
        let previous = self
            .current
            .iter()
            .find(|condition| condition.type_ == decided.type_);
        let last_transition_time = match previous {
            Some(previous) if previous.status == decided.status => {
                previous.last_transition_time.clone()
            }
            _ => now.clone(),
        };
        let condition = Condition {
            type_: decided.type_.to_owned(),
            status: decided.status.to_owned(),
            reason: decided.reason,
            message: decided.message,
            last_transition_time,
            observed_generation: None,
        };
        match self
            .conditions
            .iter_mut()
            .find(|existing| existing.type_ == condition.type_)
        {
            Some(existing) => *existing = condition,
            None => self.conditions.push(condition),
        }
    }

    /// The condition of `type_` as it will be written.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions
            .iter()
            .find(|condition| condition.type_ == type_)
    }

    /// The status to apply.
    pub fn to_status(&self) -> ManagedClusterAddOnStatus {
        let mut conditions = self.conditions.clone();
        conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
        ManagedClusterAddOnStatus {
            conditions: Some(conditions),
            add_on_meta: Some(addon_meta()),
            supported_configs: Some(vec![
                ConfigGroupResource {
                    group: MPC_GROUP.into(),
                    resource: MPC_RESOURCE.into(),
                },
                ConfigGroupResource {
                    group: ADC_GROUP.into(),
                    resource: ADC_RESOURCE.into(),
                },
            ]),
            config_references: self.config_references.clone(),
            namespace: self.namespace.clone(),
            registrations: self.registrations.clone(),
            health_check: Some(HealthCheck {
                mode: Some(HEALTH_CHECK_LEASE.into()),
            }),
            ..ManagedClusterAddOnStatus::default()
        }
    }

    /// Whether `addon`'s status already holds everything [`Self::to_status`]
    /// would write (fields and conditions others own are not compared).
    pub fn is_current(&self, addon: &ManagedClusterAddOn) -> bool {
        let Some(current) = addon.status.as_ref() else {
            return false;
        };
        let desired = self.to_status();
        let conditions_current = desired.conditions.iter().flatten().all(|wanted| {
            current
                .conditions
                .iter()
                .flatten()
                .any(|have| have == wanted)
        });
        conditions_current
            && current.add_on_meta == desired.add_on_meta
            && current.supported_configs == desired.supported_configs
            && current.config_references == desired.config_references
            && current.namespace == desired.namespace
            && current.registrations == desired.registrations
            && current.health_check == desired.health_check
    }
}

/// The addon's display name and description (upstream §8).
pub fn addon_meta() -> AddOnMeta {
    AddOnMeta {
        display_name: Some(super::names::ADDON_NAME.into()),
        description: Some(super::names::ADDON_NAME.into()),
    }
}

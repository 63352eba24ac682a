//! Which configurations apply to one ManagedClusterAddOn, and the
//! `configReferences` that record them (with OCM's spec hash).

use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnConfig, ClusterManagementAddOn, ConfigReference, ConfigReferent, ConfigSpecHash,
    ManagedClusterAddOn,
};

use super::settings::PlacementRef;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// Group of AddOnDeploymentConfig.
pub const ADC_GROUP: &str = "addon.open-cluster-management.io";
/// Resource of AddOnDeploymentConfig.
pub const ADC_RESOURCE: &str = "addondeploymentconfigs";
/// Group of ManagedProxyConfiguration.
pub const MPC_GROUP: &str = "proxy.open-cluster-management.io";
/// Resource of ManagedProxyConfiguration.
pub const MPC_RESOURCE: &str = "managedproxyconfigurations";

/// An AddOnDeploymentConfig by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeploymentConfigRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for DeploymentConfigRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn is_deployment_config(group: &str, resource: &str) -> bool {
    group == ADC_GROUP && resource == ADC_RESOURCE
}

/// Where a cluster stands with the install strategy's placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection<'a> {
    /// No placements: users create the addons (the `Manual` strategy).
    NoPlacements,
    /// This placement's decisions select the cluster (the first that does).
    By(&'a PlacementRef),
    /// The strategy has placements and none selects the cluster now: its
    /// addon waits out the removal grace (a placement's decisions being
    /// rewritten, or the cluster leaving).
    Unselected,
}

/// The AddOnDeploymentConfig for `addon`, in OCM's order of precedence: the
/// one its `spec.configs` names, else the one the ClusterManagementAddOn's
/// install strategy gives the placement that selects the cluster, else the
/// ClusterManagementAddOn's default, else none. A cluster no placement
/// selects keeps the one its status records, so the agents of a cluster
/// briefly out of every decision are not re-rendered with the default
/// and back. A reference without a namespace means the cluster's namespace.
pub fn deployment_config_ref(
    addon: &ManagedClusterAddOn,
    management: Option<&ClusterManagementAddOn>,
    selection: Selection<'_>,
) -> Option<DeploymentConfigRef> {
    let own_namespace = addon.metadata.namespace.clone().unwrap_or_default();
    let resolve = |namespace: Option<&String>, name: &str| DeploymentConfigRef {
        namespace: namespace
            .filter(|namespace| !namespace.is_empty())
            .cloned()
            .unwrap_or_else(|| own_namespace.clone()),
        name: name.to_owned(),
    };
    let from_addon = addon
        .spec
        .configs
        .iter()
        .flatten()
        .find(|config: &&AddOnConfig| is_deployment_config(&config.group, &config.resource));
    if let Some(config) = from_addon {
        return Some(resolve(config.namespace.as_ref(), &config.name));
    }
    match selection {
        Selection::By(placement) => {
            if let Some(config) =
                management.and_then(|management| placement_deployment_config(management, placement))
            {
                return Some(resolve(config.namespace.as_ref(), &config.name));
            }
        }
        Selection::Unselected => {
            let recorded = addon
                .status
                .iter()
                .flat_map(|status| status.config_references.iter().flatten())
                .find(|reference| is_deployment_config(&reference.group, &reference.resource))
                .and_then(|reference| {
                    Some(resolve(
                        reference.namespace.as_ref(),
                        reference.name.as_deref()?,
                    ))
                });
            if recorded.is_some() {
                return recorded;
            }
        }
        Selection::NoPlacements => {}
    }
    default_deployment_config(management?)
        .map(|default| resolve(default.namespace.as_ref(), &default.name))
}

/// The AddOnDeploymentConfig the install strategy's `configs` give
/// `placement`'s clusters, if any.
pub fn placement_deployment_config<'a>(
    management: &'a ClusterManagementAddOn,
    placement: &PlacementRef,
) -> Option<&'a AddOnConfig> {
    management
        .spec
        .install_strategy
        .as_ref()?
        .placements
        .iter()
        .flatten()
        .filter(|strategy| {
            strategy.namespace == placement.namespace && strategy.name == placement.name
        })
        .flat_map(|strategy| strategy.configs.iter().flatten())
        .find(|config| is_deployment_config(&config.group, &config.resource))
}

/// The ClusterManagementAddOn's default AddOnDeploymentConfig, if any.
pub fn default_deployment_config(management: &ClusterManagementAddOn) -> Option<&ConfigReferent> {
    management
        .spec
        .supported_configs
        .iter()
        .flatten()
        .filter(|config| is_deployment_config(&config.group, &config.resource))
        .find_map(|config| config.default_config.as_ref())
}

/// Writes `value` as JSON with object keys sorted at every level, as Go's
/// encoder writes maps, so the hash matches OCM's for the same spec.
fn canonical_json(value: &serde_json::Value, out: &mut String) {
    match value {
        serde_json::Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (index, key) in keys.into_iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(key.clone()).to_string());
                out.push(':');
                if let Some(inner) = map.get(key) {
                    canonical_json(inner, out);
                }
            }
            out.push('}');
        }
        serde_json::Value::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// OCM's spec hash: hex sha256 of the spec's JSON.
pub fn spec_hash<T: Serialize>(spec: &T) -> Result<String, serde_json::Error> {
    let value = serde_json::to_value(spec)?;
    let mut text = String::new();
    canonical_json(&value, &mut text);
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
}

/// The reference to the cluster-scoped ManagedProxyConfiguration `name`.
pub fn mpc_reference(name: &str, hash: String) -> ConfigReference {
    ConfigReference {
        group: MPC_GROUP.into(),
        resource: MPC_RESOURCE.into(),
        name: Some(name.into()),
        desired_config: Some(ConfigSpecHash {
            namespace: None,
            name: name.into(),
            spec_hash: Some(hash),
        }),
        ..ConfigReference::default()
    }
}

/// The reference to an AddOnDeploymentConfig.
pub fn adc_reference(config: &DeploymentConfigRef, hash: String) -> ConfigReference {
    ConfigReference {
        group: ADC_GROUP.into(),
        resource: ADC_RESOURCE.into(),
        namespace: Some(config.namespace.clone()),
        name: Some(config.name.clone()),
        desired_config: Some(ConfigSpecHash {
            namespace: Some(config.namespace.clone()),
            name: config.name.clone(),
            spec_hash: Some(hash),
        }),
        ..ConfigReference::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_hash_ignores_key_order_and_changes_with_content() {
        let a = serde_json::json!({"b": 1, "a": {"y": [1, 2], "x": "s"}});
        let b = serde_json::json!({"a": {"x": "s", "y": [1, 2]}, "b": 1});
        let c = serde_json::json!({"a": {"x": "s", "y": [2, 1]}, "b": 1});
        assert_eq!(spec_hash(&a).unwrap(), spec_hash(&b).unwrap());
        assert_ne!(spec_hash(&a).unwrap(), spec_hash(&c).unwrap());
        let mut text = String::new();
        canonical_json(&a, &mut text);
        assert_eq!(text, r#"{"a":{"x":"s","y":[1,2]},"b":1}"#);
    }
}

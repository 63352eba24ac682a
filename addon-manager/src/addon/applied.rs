//! The configurations an agent's ManifestWork was rendered from, kept on the
//! work itself. A cluster whose configuration change waits for its turn in a
//! rollout is rendered again from them, so it still gets every change that
//! is not a configuration change (a CA bundle rollover, an image mirror on
//! its ManagedCluster, the addon-manager's own flags) while it waits.
//!
//! The work is the one place that always holds them: a ManagedProxyConfiguration
//! or AddOnDeploymentConfig keeps only its current spec, and an addon-manager
//! restarted mid-rollout has nothing else to go by.

use cluster_proxy_proto::api::addon::v1alpha1::{AddOnDeploymentConfig, AddOnDeploymentConfigSpec};
use cluster_proxy_proto::api::proxy::v1alpha1::{
    ManagedProxyConfiguration, ManagedProxyConfigurationSpec,
};
use cluster_proxy_proto::api::work::v1::ManifestWork;
use kube::ResourceExt;
use serde::{Deserialize, Serialize};

use super::config::DeploymentConfigRef;

/// Work annotation: the [`AppliedConfigurations`] the work was rendered
/// from, as JSON.
pub const ANNOTATION_APPLIED_CONFIGURATIONS: &str =
    "proxy.open-cluster-management.io/applied-configurations";

/// Why a work's [`ANNOTATION_APPLIED_CONFIGURATIONS`] cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("annotation {ANNOTATION_APPLIED_CONFIGURATIONS} of the work is not valid: {0}")]
pub struct AppliedConfigurationsError(#[source] serde_json::Error);

/// The configuration specs one rendering of the agent used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppliedConfigurations {
    pub managed_proxy_configuration: AppliedProxyConfiguration,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_config: Option<AppliedDeploymentConfig>,
}

/// The ManagedProxyConfiguration's spec, and its generation, which the
/// agent's pod template carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppliedProxyConfiguration {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    pub spec: ManagedProxyConfigurationSpec,
}

/// An AddOnDeploymentConfig's name and spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppliedDeploymentConfig {
    pub namespace: String,
    pub name: String,
    pub spec: AddOnDeploymentConfigSpec,
}

impl AppliedConfigurations {
    /// What a rendering from `mpc` and `adc` (found by `adc_ref`) uses.
    pub fn of(
        mpc: &ManagedProxyConfiguration,
        adc_ref: Option<&DeploymentConfigRef>,
        adc: Option<&AddOnDeploymentConfig>,
    ) -> Self {
        Self {
            managed_proxy_configuration: AppliedProxyConfiguration {
                generation: mpc.metadata.generation,
                spec: mpc.spec.clone(),
            },
            deployment_config: adc_ref
                .zip(adc)
                .map(|(reference, adc)| AppliedDeploymentConfig {
                    namespace: reference.namespace.clone(),
                    name: reference.name.clone(),
                    spec: adc.spec.clone(),
                }),
        }
    }

    /// The annotation's value.
    pub fn to_annotation(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(self)
    }

    /// What `work` was rendered from; `None` for a work written before the
    /// annotation existed.
    pub fn of_work(work: &ManifestWork) -> Result<Option<Self>, AppliedConfigurationsError> {
        work.annotations()
            .get(ANNOTATION_APPLIED_CONFIGURATIONS)
            .map(|text| serde_json::from_str(text).map_err(AppliedConfigurationsError))
            .transpose()
    }

    /// The ManagedProxyConfiguration to render from: `current`'s name with
    /// the applied spec and generation.
    pub fn proxy_configuration(
        &self,
        current: &ManagedProxyConfiguration,
    ) -> ManagedProxyConfiguration {
        let mut metadata = current.metadata.clone();
        metadata.generation = self.managed_proxy_configuration.generation;
        ManagedProxyConfiguration {
            metadata,
            spec: self.managed_proxy_configuration.spec.clone(),
            status: None,
        }
    }

    /// The AddOnDeploymentConfig to render from, if one was used.
    pub fn deployment_config(&self) -> Option<AddOnDeploymentConfig> {
        self.deployment_config.as_ref().map(|applied| {
            let mut adc = AddOnDeploymentConfig::new(&applied.name, applied.spec.clone());
            adc.metadata.namespace = Some(applied.namespace.clone());
            adc
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cluster_proxy_proto::api::work::v1::ManifestWorkSpec;

    fn mpc(generation: i64, replicas: i32) -> ManagedProxyConfiguration {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy", "generation": generation},
            "spec": {
                "authentication": {},
                "proxyServer": {
                    "image": "registry.local/cluster-proxy:1",
                    "entrypoint": {"type": "Hostname", "hostname": {"value": "proxy.hub.example"}},
                },
                "proxyAgent": {"image": "registry.local/cluster-proxy:1", "replicas": replicas}
            }
        }))
        .expect("MPC fixture parses")
    }

    fn work_annotated(value: &str) -> ManifestWork {
        let mut work =
            ManifestWork::new("addon-cluster-proxy-deploy-0", ManifestWorkSpec::default());
        work.annotations_mut().insert(
            ANNOTATION_APPLIED_CONFIGURATIONS.to_owned(),
            value.to_owned(),
        );
        work
    }

    #[test]
    fn a_rendering_is_recovered_from_its_work() {
        let applied_mpc = mpc(3, 2);
        let reference = DeploymentConfigRef {
            namespace: "open-cluster-management-addon".into(),
            name: "sizing".into(),
        };
        let adc = AddOnDeploymentConfig::new(
            "sizing",
            AddOnDeploymentConfigSpec {
                agent_install_namespace: Some("agents".into()),
                ..AddOnDeploymentConfigSpec::default()
            },
        );
        let applied = AppliedConfigurations::of(&applied_mpc, Some(&reference), Some(&adc));
        let work = work_annotated(&applied.to_annotation().unwrap());
        let recovered = AppliedConfigurations::of_work(&work).unwrap().unwrap();
        assert_eq!(recovered, applied);

        // Rendered from later: the current object's name, the applied spec
        // and generation.
        let current = mpc(4, 5);
        let previous = recovered.proxy_configuration(&current);
        assert_eq!(previous.metadata.generation, Some(3));
        assert_eq!(previous.spec.proxy_agent.replicas, 2);
        assert_eq!(previous.name_any(), "cluster-proxy");
        let previous_adc = recovered.deployment_config().unwrap();
        assert_eq!(previous_adc.name_any(), "sizing");
        assert_eq!(
            previous_adc.namespace().as_deref(),
            Some("open-cluster-management-addon")
        );
        assert_eq!(
            previous_adc.spec.agent_install_namespace.as_deref(),
            Some("agents")
        );
    }

    #[test]
    fn no_deployment_config_is_none_and_a_missing_annotation_is_none() {
        let applied = AppliedConfigurations::of(&mpc(1, 1), None, None);
        assert!(applied.deployment_config().is_none());
        let text = applied.to_annotation().unwrap();
        assert!(!text.contains("deploymentConfig"), "{text}");
        let bare = ManifestWork::new("addon-cluster-proxy-deploy-0", ManifestWorkSpec::default());
        assert!(AppliedConfigurations::of_work(&bare).unwrap().is_none());
    }

    #[test]
    fn a_damaged_annotation_is_an_error_naming_it() {
        for value in ["", "{", r#"{"managedProxyConfiguration": {"spec": 7}}"#] {
            let error = AppliedConfigurations::of_work(&work_annotated(value)).unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains(ANNOTATION_APPLIED_CONFIGURATIONS),
                "{error}"
            );
        }
    }
}

//! What one cluster's configuration changes in the agent's pod: the image
//! (registry mirrors from the AddOnDeploymentConfig or the ManagedCluster's
//! `open-cluster-management.io/image-registries` annotation), the resource
//! requests and limits of each container (the AddOnDeploymentConfig's
//! `resourceRequirements`) and the node selector (the ADC's, else a local
//! cluster's `open-cluster-management/nodeSelector` annotation), with the
//! addon framework's rules so an ADC written for another addon means the
//! same here.

use std::collections::BTreeMap;

use cluster_proxy_proto::api::addon::v1alpha1::{AddOnDeploymentConfig, ImageMirror};
use cluster_proxy_proto::api::cluster::v1::{
    ANNOTATION_IMAGE_REGISTRIES, ANNOTATION_NODE_SELECTOR, LABEL_LOCAL_CLUSTER, ManagedCluster,
};
use k8s_openapi::api::core::v1::ResourceRequirements;
use regex::Regex;
use serde::Deserialize;

/// The kind part of a container ID for a Deployment's containers.
pub const DEPLOYMENTS: &str = "deployments";

/// Bounds the compiled size of one `containerID` pattern: an ADC is
/// written by hub administrators, but a pattern must not make the manager
/// spend unbounded memory.
const PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// A configuration the agent cannot be rendered from.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CustomizationError {
    #[error(
        "AddOnDeploymentConfig resourceRequirements[{index}].containerID {id:?} is not <kind>:<name>:<container> (each a regular expression or *)"
    )]
    ContainerIdShape { index: usize, id: String },
    #[error(
        "AddOnDeploymentConfig resourceRequirements[{index}].containerID {id:?} is not a valid regular expression: {reason}"
    )]
    ContainerIdPattern {
        index: usize,
        id: String,
        reason: String,
    },
    #[error(
        "ManagedCluster annotation {ANNOTATION_IMAGE_REGISTRIES} is not JSON of the form {{\"registries\":[{{\"source\":…,\"mirror\":…}}]}}: {reason}"
    )]
    ImageRegistries { reason: String },
    #[error(
        "ManagedCluster annotation {ANNOTATION_NODE_SELECTOR} is not a JSON object of label names to values: {reason}"
    )]
    NodeSelector { reason: String },
}

/// One `resourceRequirements` entry, its container ID compiled.
#[derive(Debug, Clone)]
struct ResourceRule {
    container_id: Regex,
    resources: ResourceRequirements,
}

/// The per-cluster changes to the agent's containers.
#[derive(Debug, Clone)]
pub struct AgentCustomization {
    image: String,
    resource_rules: Vec<ResourceRule>,
    node_selector: Option<BTreeMap<String, String>>,
}

/// The annotation's value; `pullSecret` and unknown fields are ignored.
#[derive(Deserialize)]
struct ImageRegistriesAnnotation {
    #[serde(default)]
    registries: Vec<AnnotationMirror>,
}

#[derive(Deserialize)]
struct AnnotationMirror {
    #[serde(default)]
    mirror: String,
    #[serde(default)]
    source: String,
}

impl AgentCustomization {
    /// The customization of `image` (the MPC's `spec.proxyAgent.image`) for
    /// a cluster: `deployment_config` is the addon's ADC, `cluster` its
    /// ManagedCluster.
    pub fn new(
        image: &str,
        deployment_config: Option<&AddOnDeploymentConfig>,
        cluster: Option<&ManagedCluster>,
    ) -> Result<Self, CustomizationError> {
        Ok(Self {
            image: agent_image(image, deployment_config, cluster)?,
            resource_rules: resource_rules(deployment_config)?,
            node_selector: node_selector(deployment_config, cluster)?,
        })
    }

    /// The agent pod's node selector, if any.
    pub fn node_selector(&self) -> Option<&BTreeMap<String, String>> {
        self.node_selector.as_ref()
    }

    /// The image both agent containers run.
    pub fn image(&self) -> &str {
        &self.image
    }

    /// The requests and limits of `container` in the Deployment `deployment`:
    /// those of the last rule whose container ID matches
    /// `deployments:<deployment>:<container>`, none when no rule does.
    pub fn resources(&self, deployment: &str, container: &str) -> Option<ResourceRequirements> {
        let id = format!("{DEPLOYMENTS}:{deployment}:{container}");
        self.resource_rules
            .iter()
            .rev()
            .find(|rule| rule.container_id.is_match(&id))
            .map(|rule| rule.resources.clone())
    }
}

/// The node selector: the ADC's `nodePlacement.nodeSelector` when it names
/// labels, else, for the hub's own cluster (label `local-cluster=true`),
/// the JSON object in its `open-cluster-management/nodeSelector`
/// annotation.
fn node_selector(
    deployment_config: Option<&AddOnDeploymentConfig>,
    cluster: Option<&ManagedCluster>,
) -> Result<Option<BTreeMap<String, String>>, CustomizationError> {
    let from_config = deployment_config
        .and_then(|config| config.spec.node_placement.as_ref())
        .and_then(|placement| placement.node_selector.clone())
        .filter(|selector| !selector.is_empty());
    if from_config.is_some() {
        return Ok(from_config);
    }
    let Some(cluster) = cluster else {
        return Ok(None);
    };
    let local = cluster
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(LABEL_LOCAL_CLUSTER))
        .is_some_and(|value| value == "true");
    let annotation = cluster
        .metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(ANNOTATION_NODE_SELECTOR))
        .filter(|value| !value.trim().is_empty());
    let (true, Some(annotation)) = (local, annotation) else {
        return Ok(None);
    };
    let selector: BTreeMap<String, String> =
        serde_json::from_str(annotation).map_err(|error| CustomizationError::NodeSelector {
            reason: error.to_string(),
        })?;
    Ok(Some(selector).filter(|selector| !selector.is_empty()))
}

/// The image after the registry mirrors: the ADC's `registries` when one of
/// them changes it, else the ManagedCluster annotation's (the addon
/// framework's precedence). Within one list the last mirror that changes
/// the image wins.
fn agent_image(
    image: &str,
    deployment_config: Option<&AddOnDeploymentConfig>,
    cluster: Option<&ManagedCluster>,
) -> Result<String, CustomizationError> {
    let from_config = deployment_config
        .and_then(|config| config.spec.registries.as_deref())
        .map(|mirrors| {
            mirrored(
                image,
                mirrors
                    .iter()
                    .map(|ImageMirror { mirror, source }| (source.as_str(), mirror.as_str())),
            )
        })
        .filter(|overridden| overridden != image);
    if let Some(overridden) = from_config {
        return Ok(overridden);
    }
    let annotation = cluster
        .and_then(|cluster| cluster.metadata.annotations.as_ref())
        .and_then(|annotations| annotations.get(ANNOTATION_IMAGE_REGISTRIES))
        .filter(|value| !value.trim().is_empty());
    let Some(annotation) = annotation else {
        return Ok(image.to_owned());
    };
    let parsed: ImageRegistriesAnnotation =
        serde_json::from_str(annotation).map_err(|error| CustomizationError::ImageRegistries {
            reason: error.to_string(),
        })?;
    Ok(mirrored(
        image,
        parsed
            .registries
            .iter()
            .map(|entry| (entry.source.as_str(), entry.mirror.as_str())),
    ))
}

/// `image` after the last `(source, mirror)` pair that changes it.
fn mirrored<'a>(image: &str, mirrors: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    mirrors
        .map(|(source, mirror)| mirror_one(source, mirror, image))
        .filter(|candidate| candidate != image)
        .last()
        .unwrap_or_else(|| image.to_owned())
}

/// One mirror: an empty source moves every image, keeping only its last
/// path segment (`name:tag`); otherwise an image starting with the source
/// gets the mirror in its place.
fn mirror_one(source: &str, mirror: &str, image: &str) -> String {
    let source = source.strip_suffix('/').unwrap_or(source);
    let mirror = mirror.strip_suffix('/').unwrap_or(mirror);
    if source.is_empty() {
        let name_and_tag = image.rsplit('/').next().unwrap_or(image);
        return if mirror.is_empty() {
            name_and_tag.to_owned()
        } else {
            format!("{mirror}/{name_and_tag}")
        };
    }
    match image.strip_prefix(source) {
        Some(rest) => format!("{mirror}{rest}"),
        None => image.to_owned(),
    }
}

/// Compiles the ADC's `resourceRequirements`: `kind:name:container`, each
/// part a regular expression or `*` (any non-empty value), the whole ID
/// anchored. Each part is grouped on its own, so an alternation (`a|b`)
/// stays within its part.
fn resource_rules(
    deployment_config: Option<&AddOnDeploymentConfig>,
) -> Result<Vec<ResourceRule>, CustomizationError> {
    let Some(requirements) =
        deployment_config.and_then(|config| config.spec.resource_requirements.as_deref())
    else {
        return Ok(Vec::new());
    };
    requirements
        .iter()
        .enumerate()
        .map(|(index, requirement)| {
            let id = &requirement.container_id;
            let parts: Vec<&str> = id.split(':').collect();
            if parts.len() != 3 || parts.iter().any(|part| part.is_empty()) {
                return Err(CustomizationError::ContainerIdShape {
                    index,
                    id: id.clone(),
                });
            }
            let pattern = parts
                .iter()
                .map(|part| match *part {
                    "*" => "(?:.+)".to_owned(),
                    part => format!("(?:{part})"),
                })
                .collect::<Vec<_>>()
                .join(":");
            let container_id = regex::RegexBuilder::new(&format!("^{pattern}$"))
                .size_limit(PATTERN_SIZE_LIMIT)
                .build()
                .map_err(|error| CustomizationError::ContainerIdPattern {
                    index,
                    id: id.clone(),
                    reason: error.to_string(),
                })?;
            Ok(ResourceRule {
                container_id,
                resources: requirement.resources.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_mirror_follows_the_addon_framework() {
        let image = "quay.io/open-cluster-management/cluster-proxy:v0.9";
        assert_eq!(
            mirror_one("quay.io/open-cluster-management", "mirror.corp/ocm", image),
            "mirror.corp/ocm/cluster-proxy:v0.9"
        );
        assert_eq!(
            mirror_one(
                "quay.io/open-cluster-management/",
                "mirror.corp/ocm/",
                image
            ),
            "mirror.corp/ocm/cluster-proxy:v0.9"
        );
        assert_eq!(mirror_one("docker.io", "mirror.corp", image), image);
        assert_eq!(
            mirror_one("", "mirror.corp/all", image),
            "mirror.corp/all/cluster-proxy:v0.9"
        );
        assert_eq!(mirror_one("", "", image), "cluster-proxy:v0.9");
    }

    #[test]
    fn the_last_mirror_that_changes_the_image_wins() {
        let image = "quay.io/ocm/cluster-proxy:v1";
        let mirrors = [
            ("quay.io/ocm", "first.corp"),
            ("quay.io/ocm", "second.corp"),
            ("docker.io", "unrelated.corp"),
        ];
        assert_eq!(
            mirrored(image, mirrors.iter().copied()),
            "second.corp/cluster-proxy:v1"
        );
        assert_eq!(mirrored(image, std::iter::empty()), image);
    }
}

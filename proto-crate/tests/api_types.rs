//! Behaviour of the API types that controllers rely on: what an apply body
//! contains, what parses, and what is refused.
#![cfg(feature = "kube-api")]

use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnConfig, ManagedClusterAddOn, ManagedClusterAddOnSpec, ManagedClusterAddOnStatus,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::PlacementDecision;
use cluster_proxy_proto::api::work::v1::{Manifest, ManifestError, ManifestWork};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Resource;
use serde_json::{Value, json};

/// Server-side apply claims every field present in the body, so an apply
/// body built from a typed object must hold only the fields that were set:
/// no `null`, no empty list standing in for "unset".
#[test]
fn unset_fields_are_absent_from_an_apply_body() {
    let mut addon = ManagedClusterAddOn::new(
        "cluster-proxy",
        ManagedClusterAddOnSpec {
            install_namespace: None,
            configs: Some(vec![AddOnConfig {
                group: "addon.open-cluster-management.io".into(),
                resource: "addondeploymentconfigs".into(),
                namespace: Some("cluster1".into()),
                name: "cluster-proxy".into(),
            }]),
        },
    );
    addon.metadata.namespace = Some("cluster1".into());
    let body = serde_json::to_value(&addon).expect("serialises");
    assert_eq!(
        body,
        json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": "cluster-proxy", "namespace": "cluster1"},
            "spec": {"configs": [{
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "namespace": "cluster1",
                "name": "cluster-proxy"
            }]}
        })
    );

    let status = ManagedClusterAddOnStatus {
        namespace: Some("open-cluster-management-cluster-proxy".into()),
        ..Default::default()
    };
    assert_eq!(
        serde_json::to_value(&status).expect("serialises"),
        json!({"namespace": "open-cluster-management-cluster-proxy"})
    );
}

/// Objects created from a minimal manifest may have no `spec` at all; the
/// types read that as an empty spec instead of failing the whole watch.
#[test]
fn objects_without_spec_or_status_parse() {
    let addon: ManagedClusterAddOn = serde_json::from_value(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "ManagedClusterAddOn",
        "metadata": {"name": "cluster-proxy", "namespace": "cluster1"}
    }))
    .expect("parses");
    assert_eq!(addon.spec, ManagedClusterAddOnSpec::default());
    assert!(addon.status.is_none());
    assert!(addon.conditions().is_empty());

    let cluster: ManagedCluster = serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1",
        "kind": "ManagedCluster",
        "metadata": {"name": "cluster1"},
        "spec": {}
    }))
    .expect("parses");
    assert!(
        !cluster.hub_accepts_client(),
        "an unset hubAcceptsClient is not acceptance"
    );

    let decision: PlacementDecision = serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1beta1",
        "kind": "PlacementDecision",
        "metadata": {"name": "p-decision-1", "namespace": "ns"}
    }))
    .expect("parses");
    assert_eq!(decision.cluster_names().count(), 0);
    assert_eq!(decision.placement_name(), None);
}

#[test]
fn a_field_of_the_wrong_type_is_an_error_not_a_panic() {
    let error = serde_json::from_value::<ManagedCluster>(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1",
        "kind": "ManagedCluster",
        "metadata": {"name": "cluster1"},
        "spec": {"hubAcceptsClient": "yes"}
    }))
    .expect_err("a string is not a bool");
    assert!(error.to_string().contains("invalid type"), "{error}");
}

#[test]
fn resource_identities_match_the_ocm_crds() {
    fn identity<K: Resource<DynamicType = ()>>() -> (String, String, String) {
        (
            K::api_version(&()).into_owned(),
            K::kind(&()).into_owned(),
            K::plural(&()).into_owned(),
        )
    }
    use cluster_proxy_proto::api::addon::v1alpha1::{
        AddOnDeploymentConfig, ClusterManagementAddOn,
    };
    use cluster_proxy_proto::api::cluster::v1beta1::Placement;
    use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
    let expected = [
        (
            identity::<ManagedProxyConfiguration>(),
            "proxy.open-cluster-management.io/v1alpha1",
            "ManagedProxyConfiguration",
            "managedproxyconfigurations",
        ),
        (
            identity::<ManagedCluster>(),
            "cluster.open-cluster-management.io/v1",
            "ManagedCluster",
            "managedclusters",
        ),
        (
            identity::<Placement>(),
            "cluster.open-cluster-management.io/v1beta1",
            "Placement",
            "placements",
        ),
        (
            identity::<PlacementDecision>(),
            "cluster.open-cluster-management.io/v1beta1",
            "PlacementDecision",
            "placementdecisions",
        ),
        (
            identity::<ClusterManagementAddOn>(),
            "addon.open-cluster-management.io/v1alpha1",
            "ClusterManagementAddOn",
            "clustermanagementaddons",
        ),
        (
            identity::<ManagedClusterAddOn>(),
            "addon.open-cluster-management.io/v1alpha1",
            "ManagedClusterAddOn",
            "managedclusteraddons",
        ),
        (
            identity::<AddOnDeploymentConfig>(),
            "addon.open-cluster-management.io/v1alpha1",
            "AddOnDeploymentConfig",
            "addondeploymentconfigs",
        ),
        (
            identity::<ManifestWork>(),
            "work.open-cluster-management.io/v1",
            "ManifestWork",
            "manifestworks",
        ),
    ];
    for ((api_version, kind, plural), want_version, want_kind, want_plural) in expected {
        assert_eq!(
            (api_version.as_str(), kind.as_str(), plural.as_str()),
            (want_version, want_kind, want_plural)
        );
    }
}

/// Cluster-scoped kinds must not send a namespace; the scope type decides
/// which `kube::Api` constructors compile, so it is checked here.
#[test]
fn resource_scopes_match_the_ocm_crds() {
    fn cluster_scoped<K: Resource<Scope = kube::core::ClusterResourceScope>>() {}
    fn namespaced<K: Resource<Scope = kube::core::NamespaceResourceScope>>() {}
    use cluster_proxy_proto::api::addon::v1alpha1::{
        AddOnDeploymentConfig, ClusterManagementAddOn,
    };
    use cluster_proxy_proto::api::cluster::v1beta1::Placement;
    use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
    cluster_scoped::<ManagedProxyConfiguration>();
    cluster_scoped::<ManagedCluster>();
    cluster_scoped::<ClusterManagementAddOn>();
    namespaced::<ManagedClusterAddOn>();
    namespaced::<AddOnDeploymentConfig>();
    namespaced::<ManifestWork>();
    namespaced::<Placement>();
    namespaced::<PlacementDecision>();
}

#[test]
fn manifests_wrap_whole_objects_only() {
    let mut config_map = ConfigMap::default();
    config_map.metadata.name = Some("cluster-proxy-ca".into());
    config_map.metadata.namespace = Some("open-cluster-management-cluster-proxy".into());
    let manifest =
        Manifest::new(&config_map).expect("a k8s-openapi object carries apiVersion and kind");
    assert_eq!(manifest.api_version(), Some("v1"));
    assert_eq!(manifest.kind(), Some("ConfigMap"));
    assert_eq!(manifest.name(), Some("cluster-proxy-ca"));
    assert_eq!(
        manifest.namespace(),
        Some("open-cluster-management-cluster-proxy")
    );

    let bare =
        Manifest::new(&config_map.metadata).expect_err("metadata alone is not an object to apply");
    assert!(
        matches!(bare, ManifestError::MissingField("apiVersion")),
        "{bare}"
    );
    let no_kind = Manifest::new(&json!({"apiVersion": "v1", "kind": ""})).expect_err("empty kind");
    assert!(
        matches!(no_kind, ManifestError::MissingField("kind")),
        "{no_kind}"
    );
    let not_object = Manifest::new(&Value::from(7)).expect_err("a number is not an object");
    assert!(
        matches!(not_object, ManifestError::NotAnObject),
        "{not_object}"
    );
}

//! The OCM CustomResourceDefinitions the environment loads (`e2e/simulated-cluster/crds/ocm.yaml`)
//! into the in-memory API: every kind the control plane uses is served with
//! the real group, version, scope and status subresource, parses into the
//! shared API types, and keeps each field manager's conditions when two
//! managers write the same status — as the real CRDs' list-map conditions do.
//! Also the environment's placement controller, which writes those objects.

use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnDeploymentConfig, ClusterManagementAddOn, ManagedClusterAddOn,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::{Placement, PlacementDecision};
use cluster_proxy_proto::api::work::v1::ManifestWork;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;

async fn api() -> (tempfile::TempDir, KubeApi, kube::Client) {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(KubeApiOptions::new(dir.path()))
        .await
        .unwrap();
    assert_eq!(
        api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)
            .unwrap(),
        9
    );
    let client = api.client().await.unwrap();
    (dir, api, client)
}

#[tokio::test]
async fn every_ocm_kind_the_control_plane_uses_is_served() {
    let (_dir, _api, client) = api().await;
    // Cluster-scoped kinds list across the cluster, namespaced ones in a
    // namespace: a wrong scope in the CRD would make one of these fail.
    Api::<ManagedCluster>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<ClusterManagementAddOn>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<ManagedClusterAddOn>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<AddOnDeploymentConfig>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<ManifestWork>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<Placement>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<PlacementDecision>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn two_managers_conditions_on_one_addon_both_survive() {
    let (_dir, _api, client) = api().await;
    let addons: Api<ManagedClusterAddOn> = Api::namespaced(client, "default");
    let object = |conditions: serde_json::Value| {
        json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": "cluster-proxy", "namespace": "default"},
            "status": {"conditions": conditions},
        })
    };
    addons
        .patch(
            "cluster-proxy",
            &PatchParams::apply("addon-manager"),
            &Patch::Apply(json!({
                "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                "kind": "ManagedClusterAddOn",
                "metadata": {"name": "cluster-proxy", "namespace": "default"},
                "spec": {"installNamespace": "open-cluster-management-cluster-proxy"},
            })),
        )
        .await
        .unwrap();
    let condition = |type_: &str, status: &str| {
        json!({"type": type_, "status": status, "reason": "R", "message": "m",
            "lastTransitionTime": "2026-11-23T00:00:00Z"})
    };
    addons
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("addon-manager"),
            &Patch::Apply(object(json!([condition("ManifestApplied", "True")]))),
        )
        .await
        .unwrap();
    addons
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("registration-agent"),
            &Patch::Apply(object(json!([condition("Available", "True")]))),
        )
        .await
        .unwrap();
    // The first manager writes its condition again, without the other's.
    let addon = addons
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("addon-manager"),
            &Patch::Apply(object(json!([condition("ManifestApplied", "False")]))),
        )
        .await
        .unwrap();
    let conditions = addon.status.unwrap().conditions.unwrap_or_default();
    let find = |t: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == t)
            .map(|c| c.status.clone())
    };
    assert_eq!(find("ManifestApplied").as_deref(), Some("False"));
    assert_eq!(
        find("Available").as_deref(),
        Some("True"),
        "another manager's condition was dropped: {conditions:?}"
    );
    // A condition with a status outside True/False/Unknown is refused.
    let err = addons
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("addon-manager"),
            &Patch::Apply(object(json!([condition("ManifestApplied", "Maybe")]))),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );
}

/// The environment's placement controller writes decisions as OCM's does:
/// sorted, 100 clusters to an object, objects past the last deleted; so the
/// control plane meets the same split decisions (and the same moves between
/// objects) as on a real hub.
#[tokio::test]
async fn the_placement_controller_splits_decisions_as_ocm_does() {
    use cluster_proxy_proto::api::cluster::v1beta1::LABEL_PLACEMENT;
    use kube::api::{DeleteParams, PostParams};
    use simulated_cluster::ocm::{MAX_CLUSTERS_PER_DECISION, sync_placements};

    let (_dir, _api, client) = api().await;
    let clusters = Api::<ManagedCluster>::all(client.clone());
    for index in 1..=250 {
        let cluster: ManagedCluster = serde_json::from_value(json!({
            "metadata": {"name": format!("cluster-{index:03}")},
            "spec": {"hubAcceptsClient": true},
        }))
        .unwrap();
        clusters
            .create(&PostParams::default(), &cluster)
            .await
            .unwrap();
    }
    let placement: Placement = serde_json::from_value(json!({
        "metadata": {"name": "spread", "namespace": "default"},
        "spec": {},
    }))
    .unwrap();
    Api::<Placement>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &placement)
        .await
        .unwrap();
    let decisions = Api::<PlacementDecision>::namespaced(client.clone(), "default");
    let split = || async {
        let mut objects = decisions
            .list(&ListParams::default().labels(&format!("{LABEL_PLACEMENT}=spread")))
            .await
            .unwrap()
            .items;
        objects.sort_by_key(|d| d.metadata.name.clone());
        objects
            .iter()
            .map(|d| {
                let names: Vec<String> = d.cluster_names().map(str::to_owned).collect();
                (d.metadata.name.clone().unwrap(), names)
            })
            .collect::<Vec<_>>()
    };

    sync_placements(&client).await.unwrap();
    let first = split().await;
    let sizes: Vec<(&str, usize)> = first.iter().map(|(n, c)| (n.as_str(), c.len())).collect();
    assert_eq!(
        sizes,
        [
            ("spread-decision-1", MAX_CLUSTERS_PER_DECISION),
            ("spread-decision-2", MAX_CLUSTERS_PER_DECISION),
            ("spread-decision-3", 50)
        ]
    );
    assert_eq!(first[1].1.first().map(String::as_str), Some("cluster-101"));

    // A cluster sorting first shifts every boundary by one.
    let early: ManagedCluster = serde_json::from_value(json!({
        "metadata": {"name": "cluster-000"}, "spec": {"hubAcceptsClient": true},
    }))
    .unwrap();
    clusters
        .create(&PostParams::default(), &early)
        .await
        .unwrap();
    sync_placements(&client).await.unwrap();
    let shifted = split().await;
    assert_eq!(
        shifted[0].1.first().map(String::as_str),
        Some("cluster-000")
    );
    assert_eq!(
        shifted[1].1.first().map(String::as_str),
        Some("cluster-100")
    );
    assert_eq!(shifted[2].1.len(), 51);

    // Down to 40 clusters: one object left.
    for index in 40..=250 {
        clusters
            .delete(&format!("cluster-{index:03}"), &DeleteParams::default())
            .await
            .unwrap();
    }
    sync_placements(&client).await.unwrap();
    let shrunk = split().await;
    assert_eq!(shrunk.len(), 1, "{shrunk:?}");
    assert_eq!(shrunk[0].1.len(), 40);
}

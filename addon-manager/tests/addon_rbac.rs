//! The hub RBAC the addon controller renders for each cluster's addon-agent,
//! enforced by the in-memory API with RBAC on: a cluster's addon-agent, with
//! the identity its registration asks for, may renew its own cluster's Lease
//! and no other cluster's (so it cannot fake another cluster's `Available`).

use addon_manager::addon::render::{hub_agent_rbac, registrations};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Api;
use kube::api::PostParams;
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;

/// The user and groups of `cluster`'s kube-apiserver-client registration.
fn hub_identity(cluster: &str) -> (String, Vec<String>) {
    let registrations = serde_json::to_value(registrations(b"ca", cluster)).unwrap();
    let registration = registrations
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["signerName"] == "kubernetes.io/kube-apiserver-client")
        .unwrap()
        .clone();
    let subject = &registration["subject"];
    (
        subject["user"].as_str().unwrap().to_string(),
        subject["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g.as_str().unwrap().to_string())
            .collect(),
    )
}

fn lease(namespace: &str) -> Lease {
    serde_json::from_value(json!({
        "metadata": {"name": "cluster-proxy", "namespace": namespace},
        "spec": {"holderIdentity": "agent", "leaseDurationSeconds": 60},
    }))
    .unwrap()
}

#[tokio::test]
async fn an_addon_agent_may_renew_only_its_own_clusters_lease() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = KubeApiOptions::new(dir.path());
    options.rbac = true;
    let api = KubeApi::start(options).await.unwrap();
    let admin = api.client().await.unwrap();
    for cluster in ["cluster-a", "cluster-b"] {
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": cluster}})).unwrap();
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap();
        let (role, binding) = hub_agent_rbac(cluster, None);
        Api::<Role>::namespaced(admin.clone(), cluster)
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        Api::<RoleBinding>::namespaced(admin.clone(), cluster)
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }

    let (user, groups) = hub_identity("cluster-a");
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let as_a = KubeApi::client_from(&api.kubeconfig_for(&user, &groups).unwrap())
        .await
        .unwrap();
    Api::<Lease>::namespaced(as_a.clone(), "cluster-a")
        .create(&PostParams::default(), &lease("cluster-a"))
        .await
        .expect("cluster-a's addon-agent creates its own Lease");
    let refused = Api::<Lease>::namespaced(as_a, "cluster-b")
        .create(&PostParams::default(), &lease("cluster-b"))
        .await
        .expect_err("cluster-a's addon-agent must not write cluster-b's Lease");
    assert!(
        matches!(&refused, kube::Error::Api(s) if s.code == 403),
        "{refused}"
    );
}

//! Service access against a real kube-apiserver: the hub's TokenReview and
//! SubjectAccessReview, the managed cluster's impersonation and RBAC are the
//! real API server's, not the in-memory stand-in's (which
//! `service_access.rs` uses).
//!
//! Runs only with `CP_REAL_HUB_KUBECONFIG` set to the administrator's
//! kubeconfig of a real kube-apiserver that serves the OCM ManagedCluster
//! API and has a ManagedCluster `cluster-a` (OCM's self-managed pattern:
//! the same API server is the hub and cluster-a's kube API). Without it the
//! test prints `SKIPPED: …` and passes, also under CI (no kube-apiserver can
//! be installed there):
//!
//! ```text
//! CP_REAL_HUB_KUBECONFIG=/path/to/admin.kubeconfig \
//!   cargo test -p e2e --test real_service_access -- --nocapture
//! ```
//!
//! The tunnel (proxy-server, cluster-a's proxy-agent), the service-proxy
//! and the user-server run in this process on 127.0.0.1. Everything it
//! creates lives in Namespace `cp-service-access` and in ClusterRoles and
//! ClusterRoleBindings named `cp-service-access-*`; a previous run's are
//! removed first, this run's at the end.
//!
//! Identities, all ServiceAccounts of that Namespace with TokenRequest
//! tokens: `user-server` (bound to the real `system:auth-delegator` and to
//! list/watch ManagedClusters), `service-proxy` (may impersonate users and
//! groups), `alice` (granted `get managedclusters/proxy` for cluster-a on
//! the hub; as `cluster:hub:system:serviceaccount:cp-service-access:alice`
//! may read ConfigMaps in the Namespace), `bob` (no hub grant).

use std::time::Duration;

use e2e::service_access::{
    AccessPath, CLUSTER_A, ManagedApi, cluster_binding, cluster_role, create,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

const KUBECONFIG_VARIABLE: &str = "CP_REAL_HUB_KUBECONFIG";
const NAMESPACE: &str = "cp-service-access";
const STEP: Duration = Duration::from_secs(60);

fn log(text: impl AsRef<str>) {
    eprintln!("[real_service_access] {}", text.as_ref());
}

async fn token_of(admin: &Client, account: &str) -> String {
    Api::<ServiceAccount>::namespaced(admin.clone(), NAMESPACE)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": account}})).unwrap(),
        )
        .await
        .unwrap_or_else(|e| panic!("creating ServiceAccount {account}: {e}"));
    e2e::service_access::service_account_token(admin, NAMESPACE, account, 3600)
        .await
        .unwrap()
}

/// Removes what a run creates; waits until the Namespace is gone.
async fn clean(admin: &Client) {
    let prefix = format!("{NAMESPACE}-");
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for binding in bindings.list(&ListParams::default()).await.unwrap() {
        if binding.name_any().starts_with(&prefix) {
            let _ = bindings
                .delete(&binding.name_any(), &DeleteParams::default())
                .await;
        }
    }
    let roles: Api<ClusterRole> = Api::all(admin.clone());
    for role in roles.list(&ListParams::default()).await.unwrap() {
        if role.name_any().starts_with(&prefix) {
            let _ = roles
                .delete(&role.name_any(), &DeleteParams::default())
                .await;
        }
    }
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let _ = namespaces.delete(NAMESPACE, &DeleteParams::default()).await;
    simulated_cluster::wait::eventually(
        "the previous run's Namespace is gone",
        Duration::from_secs(120),
        || async {
            namespaces
                .get_opt(NAMESPACE)
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
}

fn name(suffix: &str) -> String {
    format!("{NAMESPACE}-{suffix}")
}

fn user(account: &str) -> String {
    format!("system:serviceaccount:{NAMESPACE}:{account}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_access_on_a_real_api_server() {
    let Ok(path) = std::env::var(KUBECONFIG_VARIABLE) else {
        eprintln!(
            "SKIPPED: {KUBECONFIG_VARIABLE} is not set (service access against a real \
             kube-apiserver is run by hand; see this file's header)"
        );
        return;
    };
    let kubeconfig = Kubeconfig::read_from(&path).expect("reading the administrator's kubeconfig");
    let (url, ca_pem) = e2e::service_access::server_and_ca(&kubeconfig).unwrap();
    let admin = Client::try_from(
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("a client configuration"),
    )
    .expect("a client");
    let clusters = Api::<kube::api::DynamicObject>::all_with(
        admin.clone(),
        &e2e::service_access::resource(
            "cluster.open-cluster-management.io",
            "ManagedCluster",
            "managedclusters",
        ),
    );
    assert!(
        clusters
            .get_opt(CLUSTER_A)
            .await
            .expect("listing ManagedClusters")
            .is_some(),
        "the hub has no ManagedCluster {CLUSTER_A}"
    );

    log("removing a previous run's objects");
    clean(&admin).await;
    create(
        &admin,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}),
    )
    .await
    .unwrap();
    let hub_identity = token_of(&admin, "user-server").await;
    let service_proxy = token_of(&admin, "service-proxy").await;
    let alice = token_of(&admin, "alice").await;
    let bob = token_of(&admin, "bob").await;

    // The hub side: the user-server reviews and lists clusters; alice may
    // reach cluster-a.
    let grants = [
        (
            "user-server-auth",
            None,
            "system:auth-delegator",
            user("user-server"),
        ),
        (
            "user-server-clusters",
            Some(json!([{"apiGroups": ["cluster.open-cluster-management.io"],
                         "resources": ["managedclusters"], "verbs": ["get", "list", "watch"]}])),
            "",
            user("user-server"),
        ),
        // The exposed-services allowlist: one ConfigMap, watched by name.
        (
            "user-server-exposed-services",
            Some(json!([{"apiGroups": [""], "resources": ["configmaps"],
                         "resourceNames": [user_server::exposed::DEFAULT_CONFIGMAP],
                         "verbs": ["list", "watch"]}])),
            "",
            user("user-server"),
        ),
        (
            "alice-proxy",
            Some(json!([{"apiGroups": ["cluster.open-cluster-management.io"],
                         "resources": ["managedclusters/proxy"], "resourceNames": [CLUSTER_A],
                         "verbs": ["get"]}])),
            "",
            user("alice"),
        ),
        // The managed side (the same API server).
        (
            "impersonator",
            Some(json!([{"apiGroups": [""], "resources": ["users", "groups"],
                         "verbs": ["impersonate"]}])),
            "",
            user("service-proxy"),
        ),
        (
            "hub-alice-reads",
            Some(json!([{"apiGroups": [""], "resources": ["configmaps"],
                         "verbs": ["get", "list", "watch"]}])),
            "",
            format!("cluster:hub:{}", user("alice")),
        ),
    ];
    for (suffix, rules, existing_role, subject) in grants {
        let role = match rules {
            Some(rules) => {
                create(&admin, cluster_role(&name(suffix), rules))
                    .await
                    .unwrap();
                name(suffix)
            }
            None => existing_role.to_owned(),
        };
        create(
            &admin,
            cluster_binding(&name(suffix), &role, "User", &subject),
        )
        .await
        .unwrap();
    }
    let greeting: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "greeting"}, "data": {"hello": "from a real API server"}}),
    )
    .unwrap();
    Api::<ConfigMap>::namespaced(admin.clone(), NAMESPACE)
        .create(&PostParams::default(), &greeting)
        .await
        .unwrap();

    let mut hub_config = kube::Config::new(url.parse().unwrap());
    hub_config.root_cert = Some(vec![
        rustls_pki_types::pem::PemObject::from_pem_slice(ca_pem.as_bytes())
            .map(|der: rustls_pki_types::CertificateDer<'_>| der.to_vec())
            .expect("the CA is a PEM certificate"),
    ]);
    hub_config.auth_info.token = Some(hub_identity.into());
    let dir = tempfile::tempdir().unwrap();
    let access = AccessPath::start(
        dir.path(),
        Client::try_from(hub_config).unwrap(),
        ManagedApi {
            url,
            ca_pem,
            token: service_proxy,
        },
    )
    .await
    .expect("the service-access path starts");

    log("alice reads a ConfigMap of cluster-a through the user-server");
    let through = access.client(CLUSTER_A, &alice).await.unwrap();
    let remote = Api::<ConfigMap>::namespaced(through.clone(), NAMESPACE);
    let got = tokio::time::timeout(STEP, remote.get("greeting"))
        .await
        .expect("an answer")
        .expect("alice may read the ConfigMap");
    assert_eq!(got.data.unwrap()["hello"], "from a real API server");

    log("who the real API server takes alice for");
    let review = access
        .request_as(
            CLUSTER_A,
            &alice,
            http::Method::POST,
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            &[
                ("impersonate-user", "system:admin"),
                ("impersonate-group", "system:masters"),
            ],
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}),
        )
        .await
        .unwrap();
    assert_eq!(review.0, http::StatusCode::CREATED, "{}", review.1);
    let info = &review.1["status"]["userInfo"];
    assert_eq!(
        info["username"],
        json!(format!("cluster:hub:{}", user("alice"))),
        "{info}"
    );
    let groups: Vec<&str> = info["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        groups.contains(&"cluster:hub:system:serviceaccounts")
            && groups.contains(&format!("cluster:hub:system:serviceaccounts:{NAMESPACE}").as_str())
            && !groups.contains(&"system:masters"),
        "{groups:?}"
    );
    log(format!("userInfo: {info}"));

    log("the managed RBAC: alice may not read Secrets");
    match Api::<Secret>::namespaced(through.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{status:?}");
            assert!(
                status
                    .message
                    .contains(&format!("cluster:hub:{}", user("alice"))),
                "{}",
                status.message
            );
        }
        other => panic!("listing Secrets must be forbidden: {other:?}"),
    }

    log("the hub RBAC: bob has no grant; a forged token is refused");
    let (code, body) = access
        .request_as(
            CLUSTER_A,
            &bob,
            http::Method::GET,
            &format!("/api/v1/namespaces/{NAMESPACE}/configmaps"),
            &[],
            Value::Null,
        )
        .await
        .unwrap();
    assert_eq!(code, http::StatusCode::FORBIDDEN, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains(CLUSTER_A),
        "{body}"
    );
    let (code, body) = access
        .request_as(
            CLUSTER_A,
            "not-a-token",
            http::Method::GET,
            "/api",
            &[],
            Value::Null,
        )
        .await
        .unwrap();
    assert_eq!(code, http::StatusCode::UNAUTHORIZED, "{body}");

    log("revoked on the hub: refused once the authorization cache expires");
    Api::<ClusterRoleBinding>::all(admin.clone())
        .delete(&name("alice-proxy"), &DeleteParams::default())
        .await
        .unwrap();
    simulated_cluster::wait::eventually(
        "a revoked hub grant refused",
        Duration::from_secs(10),
        || async {
            matches!(remote.get("greeting").await, Err(kube::Error::Api(ref s)) if s.code == 403)
                .then_some(())
        },
    )
    .await;

    drop(access);
    clean(&admin).await;
    log("passed");
}

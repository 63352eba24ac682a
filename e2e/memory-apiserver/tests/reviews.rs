//! The review APIs as a delegating authenticator and authorizer (the
//! user-server, an aggregated API) uses them: TokenReview and
//! SubjectAccessReview need `create` on themselves (`system:auth-delegator`),
//! and answer from the API's own credentials and RBAC.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;

async fn start() -> (KubeApi, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut options = KubeApiOptions::new(dir.path());
    options.rbac = true;
    (KubeApi::start(options).await.unwrap(), dir)
}

fn token_review(token: &str) -> TokenReview {
    TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_owned()),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn access_review(user: &str, groups: &[&str], verb: &str, name: &str) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_owned()),
            groups: Some(groups.iter().map(|g| g.to_string()).collect()),
            resource_attributes: Some(ResourceAttributes {
                group: Some("cluster.open-cluster-management.io".into()),
                resource: Some("managedclusters".into()),
                subresource: Some("proxy".into()),
                verb: Some(verb.into()),
                name: Some(name.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn delegate_client(api: &KubeApi, admin: &Client) -> Client {
    let path = api.kubeconfig_for("delegate", &[]).unwrap();
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some("delegate-auth".into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: "system:auth-delegator".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: "delegate".into(),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    KubeApi::client_from(&path).await.unwrap()
}

#[tokio::test]
async fn token_reviews_need_auth_delegator_and_name_the_tokens_user() {
    let (api, _dir) = start().await;
    let admin = api.client().await.unwrap();
    let alice = api.kubeconfigs(None).token("alice", &["team-a"]);

    // Without system:auth-delegator the review itself is forbidden.
    let stranger = KubeApi::client_from(&api.kubeconfig_for("stranger", &[]).unwrap())
        .await
        .unwrap();
    let err = Api::<TokenReview>::all(stranger)
        .create(&PostParams::default(), &token_review(&alice))
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 403),
        "{err}"
    );

    let delegate = delegate_client(&api, &admin).await;
    let reviews = Api::<TokenReview>::all(delegate);
    let answer = reviews
        .create(&PostParams::default(), &token_review(&alice))
        .await
        .unwrap();
    let status = answer.status.unwrap();
    assert_eq!(status.authenticated, Some(true));
    let user = status.user.unwrap();
    assert_eq!(user.username.as_deref(), Some("alice"));
    assert_eq!(user.groups.unwrap(), vec!["team-a".to_string()]);

    // An unknown token: answered, not authenticated, with the real text.
    let answer = reviews
        .create(&PostParams::default(), &token_review("no-such-token"))
        .await
        .unwrap();
    let status = answer.status.unwrap();
    assert_ne!(status.authenticated, Some(true));
    assert!(status.error.unwrap().contains("invalid bearer token"));

    // A revoked token, and a bound token whose ServiceAccount is gone.
    api.kubeconfigs(None).revoke(&alice);
    let status = reviews
        .create(&PostParams::default(), &token_review(&alice))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_ne!(status.authenticated, Some(true));
    let accounts = Api::<ServiceAccount>::namespaced(admin.clone(), "default");
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "robot"}})).unwrap();
    accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
    let path = api
        .kubeconfigs(None)
        .write_service_account("default", "robot")
        .unwrap();
    let robot_token = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .find_map(|l| l.trim().strip_prefix("token: ").map(str::to_owned))
        .unwrap();
    let user = reviews
        .create(&PostParams::default(), &token_review(&robot_token))
        .await
        .unwrap()
        .status
        .unwrap()
        .user
        .unwrap();
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:default:robot")
    );
    accounts
        .delete("robot", &DeleteParams::default())
        .await
        .unwrap();
    let status = reviews
        .create(&PostParams::default(), &token_review(&robot_token))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_ne!(status.authenticated, Some(true));
    assert_eq!(api.token_reviews(), 5, "the refused review is not counted");
}

#[tokio::test]
async fn subject_access_reviews_answer_from_rbac_for_the_named_subject() {
    let (api, _dir) = start().await;
    let admin = api.client().await.unwrap();
    let delegate = delegate_client(&api, &admin).await;
    let reviews = Api::<SubjectAccessReview>::all(delegate);
    let allowed = |review: SubjectAccessReview| review.status.unwrap().allowed;

    let asked = access_review("alice", &["team-a"], "get", "cluster-a");
    assert!(!allowed(
        reviews
            .create(&PostParams::default(), &asked)
            .await
            .unwrap()
    ));

    let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "proxy-cluster-a"},
        "rules": [{"apiGroups": ["cluster.open-cluster-management.io"],
                   "resources": ["managedclusters/proxy"], "resourceNames": ["cluster-a"],
                   "verbs": ["get"]}]});
    let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "team-a-proxy-cluster-a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "proxy-cluster-a"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "team-a"}]});
    let dynamic = |kind: &str, plural: &str| {
        Api::<kube::api::DynamicObject>::all_with(
            admin.clone(),
            &kube::discovery::ApiResource {
                group: "rbac.authorization.k8s.io".into(),
                version: "v1".into(),
                api_version: "rbac.authorization.k8s.io/v1".into(),
                kind: kind.into(),
                plural: plural.into(),
            },
        )
    };
    dynamic("ClusterRole", "clusterroles")
        .create(
            &PostParams::default(),
            &serde_json::from_value(role).unwrap(),
        )
        .await
        .unwrap();
    dynamic("ClusterRoleBinding", "clusterrolebindings")
        .create(
            &PostParams::default(),
            &serde_json::from_value(binding).unwrap(),
        )
        .await
        .unwrap();

    // Granted through the group, for that cluster only and that verb only.
    assert!(allowed(
        reviews
            .create(&PostParams::default(), &asked)
            .await
            .unwrap()
    ));
    let other = access_review("alice", &["team-a"], "get", "cluster-b");
    assert!(!allowed(
        reviews
            .create(&PostParams::default(), &other)
            .await
            .unwrap()
    ));
    let write = access_review("alice", &["team-a"], "create", "cluster-a");
    assert!(!allowed(
        reviews
            .create(&PostParams::default(), &write)
            .await
            .unwrap()
    ));
    let outsider = access_review("bob", &["team-b"], "get", "cluster-a");
    assert!(!allowed(
        reviews
            .create(&PostParams::default(), &outsider)
            .await
            .unwrap()
    ));

    // A review that names nobody is invalid, not allowed.
    let nobody = access_review("", &[], "get", "cluster-a");
    let err = reviews
        .create(&PostParams::default(), &nobody)
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 422),
        "{err}"
    );
}

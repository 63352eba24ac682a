//! Service access end to end, in one process ([`e2e::service_access`]'s
//! fleet): users come as hub users (bearer tokens the hub's TokenReview
//! knows) and reach cluster-a with kube-rs and the real kubectl.

use std::io::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access;
use e2e::service_access::{
    CLUSTER_A, CLUSTER_B, EXPOSED_SERVICES_NAMESPACE, Fleet, OidcIssuer, cluster_binding,
    cluster_role, create, reflecting_service, resource,
};
use http_body_util::{BodyExt, Empty};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

fn kubectl_available() -> bool {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").is_err(),
            "under CI kubectl must be installed (.ci/run installs it)"
        );
        eprintln!("SKIPPED the kubectl part: kubectl is not installed");
    }
    found
}

fn stdout(output: &std::process::Output) -> String {
    assert!(
        output.status.success(),
        "kubectl failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr_of_failure(output: &std::process::Output) -> String {
    assert!(
        !output.status.success(),
        "kubectl succeeded: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn a_hub_user_reaches_a_cluster_as_itself_and_both_rbacs_decide() {
    let fleet = Fleet::start().await.unwrap();
    let managed = fleet.managed.client().await.unwrap();
    let configmaps = Api::<ConfigMap>::namespaced(managed.clone(), "default");
    let greeting: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "greeting"}, "data": {"hello": "from cluster-a"}}),
    )
    .unwrap();
    configmaps
        .create(&PostParams::default(), &greeting)
        .await
        .unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);

    // kube-rs through the user-server: get, and a watch that sees a change.
    let through = fleet.path.client(CLUSTER_A, &alice).await.unwrap();
    let remote = Api::<ConfigMap>::namespaced(through.clone(), "default");
    let got = remote.get("greeting").await.unwrap();
    assert_eq!(got.data.unwrap()["hello"], "from cluster-a");
    let mut watch = std::pin::pin!(kube::runtime::watcher(
        remote.clone(),
        kube::runtime::watcher::Config::default()
    ));
    use futures_util::StreamExt;
    let mut seen_init = false;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("watch events")
    {
        if matches!(event.unwrap(), kube::runtime::watcher::Event::InitDone) {
            seen_init = true;
            break;
        }
    }
    assert!(seen_init);
    let later: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "later"}})).unwrap();
    configmaps
        .create(&PostParams::default(), &later)
        .await
        .unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(event) = watch.next().await {
            if let Ok(kube::runtime::watcher::Event::Apply(cm)) = event {
                return cm.metadata.name;
            }
        }
        None
    })
    .await
    .expect("the watch delivers the new ConfigMap");
    assert_eq!(applied.as_deref(), Some("later"));

    // The managed cluster's RBAC: alice (as cluster:hub:alice) may not read Secrets.
    let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(through.clone(), "default");
    match secrets.list(&Default::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403);
            assert!(
                status.message.contains("cluster:hub:alice"),
                "{}",
                status.message
            );
        }
        other => panic!("listing Secrets must be forbidden: {other:?}"),
    }

    if kubectl_available() {
        let listed = stdout(
            &fleet
                .path
                .kubectl(
                    CLUSTER_A,
                    &alice,
                    &["get", "configmaps", "-n", "default", "-o", "name"],
                )
                .await
                .unwrap(),
        );
        assert!(
            listed.contains("configmap/greeting") && listed.contains("configmap/later"),
            "{listed}"
        );
        // Who the managed cluster takes alice for; an injected
        // impersonation (kubectl --as) is removed, not honoured.
        for args in [
            &["auth", "whoami", "-o", "json"][..],
            &[
                "--as=system:admin",
                "--as-group=system:masters",
                "auth",
                "whoami",
                "-o",
                "json",
            ],
        ] {
            let whoami: Value = serde_json::from_str(&stdout(
                &fleet.path.kubectl(CLUSTER_A, &alice, args).await.unwrap(),
            ))
            .unwrap();
            assert_eq!(
                whoami.pointer("/status/userInfo/username"),
                Some(&json!("cluster:hub:alice")),
                "{args:?}: {whoami}"
            );
            let groups = whoami
                .pointer("/status/userInfo/groups")
                .unwrap()
                .to_string();
            assert!(
                groups.contains("cluster:hub:team-a") && !groups.contains("system:masters"),
                "{groups}"
            );
        }
        // `cluster-proxy kubeconfig`: a context per cluster, alice's own
        // hub credential, the user-server's CA; kubectl just works.
        let alice_hub = fleet.hub.kubeconfig_for("alice", &["team-a"]).unwrap();
        let hub_config = kube::config::Kubeconfig::read_from(&alice_hub).unwrap();
        let written = cluster_proxy_cli::kubeconfig::for_clusters(
            &hub_config,
            None,
            &format!("https://127.0.0.1:{}", fleet.path.user_server.addr.port()),
            &fleet.path.pki_ca_pem,
            &[CLUSTER_A.to_owned(), CLUSTER_B.to_owned()],
        )
        .unwrap();
        let path = fleet.dir.path().join("clusters.kubeconfig");
        cluster_proxy_cli::kubeconfig::write(&written, &path).unwrap();
        let mut command = tokio::process::Command::new("kubectl");
        command
            .arg(format!("--kubeconfig={}", path.display()))
            .args([
                "--context",
                CLUSTER_A,
                "get",
                "configmap",
                "greeting",
                "-n",
                "default",
                "-o",
                "jsonpath={.data.hello}",
            ])
            .kill_on_drop(true);
        let output = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stdout(&output), "from cluster-a");

        let denied = stderr_of_failure(
            &fleet
                .path
                .kubectl(CLUSTER_A, &alice, &["get", "secrets", "-n", "default"])
                .await
                .unwrap(),
        );
        assert!(
            denied.contains("Forbidden") && denied.contains("cluster:hub:alice"),
            "{denied}"
        );
    }

    // Revoked on the hub: refused (403 naming the cluster) once the
    // authorization cache's 300 ms have passed.
    let hub = fleet.hub.client().await.unwrap();
    Api::<DynamicObject>::all_with(
        hub,
        &resource(
            "rbac.authorization.k8s.io",
            "ClusterRoleBinding",
            "clusterrolebindings",
        ),
    )
    .delete("team-a-cluster-a", &DeleteParams::default())
    .await
    .unwrap();
    simulated_cluster::wait::eventually("a revoked hub grant refused", Duration::from_secs(5), || async {
        matches!(remote.get("greeting").await, Err(kube::Error::Api(ref s)) if s.code == 403 && s.message.contains("cluster-a"))
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn bad_requests_get_kubernetes_status_answers() {
    let fleet = Fleet::start().await.unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);
    let bob = fleet.hub_user("bob", &["team-b"]);
    let bearer = |token: &str| format!("Bearer {token}");
    let cases: Vec<(&str, Option<String>, u16, &str)> = vec![
        (
            "/cluster-a/api/v1/namespaces/default/configmaps",
            None,
            401,
            "no credentials",
        ),
        (
            "/cluster-a/api/v1/namespaces/default/configmaps",
            Some(bearer("not-a-token")),
            401,
            "not valid on the hub",
        ),
        ("/", Some(bearer(&alice)), 400, "names no cluster"),
        (
            "/Not_A_Cluster/api",
            Some(bearer(&alice)),
            400,
            "not a cluster name",
        ),
        (
            "/cluster-z/api/v1/namespaces",
            Some(bearer(&alice)),
            404,
            r#""cluster-z" not found"#,
        ),
        (
            "/cluster-b/api/v1/namespaces",
            Some(bearer(&alice)),
            503,
            "no live agent",
        ),
        (
            "/cluster-a/api/v1/namespaces",
            Some(bearer(&bob)),
            403,
            r#"may not reach cluster "cluster-a""#,
        ),
    ];
    for (path, authorization, code, message) in cases {
        let headers: Vec<(&str, &str)> = authorization
            .as_deref()
            .map(|a| vec![("authorization", a)])
            .unwrap_or_default();
        let (status, body) = fleet.path.request(path, &headers).await.unwrap();
        assert_eq!(status.as_u16(), code, "{path}: {body}");
        assert_eq!(body["kind"], "Status", "{path}: {body}");
        assert_eq!(body["code"], code, "{path}: {body}");
        let text = body["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{path}: {text:?} should say {message:?}"
        );
    }

    // Identity headers a client sends are removed: the request runs as
    // cluster:hub:alice (who may not list Secrets), not as the admin it
    // names (who could: the service-proxy may impersonate anyone).
    let (status, body) = fleet
        .path
        .request(
            "/cluster-a/api/v1/namespaces/default/secrets",
            &[
                ("authorization", &bearer(&alice)),
                ("impersonate-user", "system:admin"),
                ("impersonate-group", "system:masters"),
                ("x-remote-user", "system:admin"),
                (service_access::USER, "system:admin"),
                (service_access::GROUP, "system:masters"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("cluster:hub:alice"),
        "{body}"
    );

    // Straight to the service-proxy with a hub certificate that is not the
    // user-server's: its claims are not believed.
    let direct = |cluster: &str| {
        http::Request::get(format!(
            "https://127.0.0.1:{}/api/v1/namespaces/default/configmaps",
            fleet.path.service_proxy.addr.port()
        ))
        .header(service_access::CLUSTER, cluster)
        .header(service_access::USER, "alice")
        .header(
            http::header::HOST,
            ClusterName::new(CLUSTER_A).unwrap().service_proxy_host(),
        )
        .body(Empty::<Bytes>::new())
        .unwrap()
    };
    let service_proxy_ca = fleet.path.pki_ca_pem.clone();
    let (cert, key) = &fleet.path.proxy_client;
    // rustls verifies the serving certificate for the hashed host; connect
    // by that name.
    let (status, body) = https_request_to(
        &service_proxy_ca,
        Some((cert, key)),
        direct(CLUSTER_A),
        &fleet,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("only the hub's user-server"),
        "{body}"
    );
    // With the user-server's identity but for another cluster: misdirected.
    let (cert, key) = &fleet.path.identity;
    let (status, body) = https_request_to(
        &service_proxy_ca,
        Some((cert, key)),
        direct(CLUSTER_B),
        &fleet,
    )
    .await;
    assert_eq!(status, 421, "{body}");

    // Every request above is audited: counted per cluster and code.
    let (code, metrics) =
        tunnel_harness::in_process::health_get(fleet.path.user_server.health_addr, "/metrics")
            .await
            .unwrap();
    assert_eq!(code, 200);
    for line in [
        r#"user_server_requests_total{cluster="cluster-z",code="404"} 1"#,
        r#"user_server_requests_total{cluster="cluster-b",code="503"} 1"#,
        r#"user_server_requests_total{cluster="cluster-a",code="403"} 2"#,
        r#"user_server_requests_total{cluster="cluster-a",code="401"} 2"#,
        r#"user_server_requests_total{cluster="",code="400"} 2"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    let received = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"user_server_response_bytes_total{cluster="cluster-a"} "#))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(received > 0, "the 200's body is counted:\n{metrics}");
}

/// The `proxy-service` path reaches a Service of the cluster only while the
/// exposed-services allowlist on the hub admits it (default deny, followed
/// by a watch), and the Service gets no credential or identity header: not
/// the hub token, not the service-proxy's token, not what the client sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_are_reachable_only_while_the_exposed_services_allowlist_admits_them() {
    let fleet = Fleet::start().await.unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);
    let bob = fleet.hub_user("bob", &["team-b"]);
    let hello = reflecting_service(None).await.unwrap().port();
    let secure_tls = fleet.path.service_tls("secure.apps.svc").unwrap();
    let secure = reflecting_service(Some(secure_tls)).await.unwrap().port();
    let service_path = |reference: &str, tail: &str| {
        format!("/api/v1/namespaces/apps/services/{reference}/proxy-service/{tail}")
    };
    let hello_path = service_path(&format!("http:hello:{hello}"), "some/path?x=1&y=2");
    let secure_path = service_path(&format!("https:secure:{secure}"), "");
    let get = |token: String, path: String| {
        let path_ref = &fleet.path;
        async move {
            path_ref
                .request_as(
                    CLUSTER_A,
                    &token,
                    http::Method::GET,
                    &path,
                    &[
                        ("impersonate-user", "system:admin"),
                        ("x-remote-user", "system:admin"),
                        (service_access::USER, "system:admin"),
                    ],
                    Value::Null,
                )
                .await
                .unwrap()
        }
    };
    let message = |body: &Value| body["message"].as_str().unwrap_or_default().to_owned();

    // No ConfigMap yet: every Service is refused, saying why.
    let (status, body) = get(alice.clone(), hello_path.clone()).await;
    assert_eq!(status, 403, "{body}");
    assert!(message(&body).contains("is not exposed"), "{body}");

    let maps: Api<ConfigMap> = Api::namespaced(
        fleet.hub.client().await.unwrap(),
        EXPOSED_SERVICES_NAMESPACE,
    );
    let allowlist = |text: String| -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": user_server::exposed::DEFAULT_CONFIGMAP},
            "data": {"services": text},
        }))
        .unwrap()
    };
    maps.create(
        &PostParams::default(),
        &allowlist(format!(
            "- {{namespace: apps, service: hello, port: \"{hello}\", protocol: http}}\n\
             - {{namespace: apps, service: secure, protocol: https, clusters: [cluster-a]}}\n"
        )),
    )
    .await
    .unwrap();

    // The new list applies without a restart.
    let body = simulated_cluster::wait::eventually(
        "the allowlist to admit hello",
        Duration::from_secs(10),
        || {
            let request = get(alice.clone(), hello_path.clone());
            async move {
                let (status, body) = request.await;
                (status == 200).then_some(body)
            }
        },
    )
    .await;
    assert_eq!(body["method"], "GET");
    assert_eq!(body["path"], "/some/path?x=1&y=2");
    let headers = body["headers"].as_object().unwrap();
    for name in headers.keys() {
        assert!(
            name != "authorization"
                && !name.starts_with("impersonate-")
                && !name.starts_with("x-remote-")
                && !name.starts_with("cluster-proxy-"),
            "{name} reached the Service: {body}"
        );
    }
    assert_eq!(headers["host"], format!("hello.apps.svc:{hello}"), "{body}");

    // https, verified against the service-proxy's additional Service CA.
    let (status, body) = get(alice.clone(), secure_path.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["path"], "/");

    // What no entry names stays refused: another port, another scheme,
    // another Service, another namespace.
    for refused in [
        service_path("http:hello:1", ""),
        service_path(&format!("https:hello:{hello}"), ""),
        service_path("http:other:80", ""),
        format!("/api/v1/namespaces/default/services/http:hello:{hello}/proxy-service/"),
    ] {
        let (status, body) = get(alice.clone(), refused.clone()).await;
        assert_eq!(status, 403, "{refused}: {body}");
        assert!(
            message(&body).contains("is not exposed"),
            "{refused}: {body}"
        );
    }
    // The hub's RBAC comes first: bob may not reach cluster-a at all.
    let (status, body) = get(bob.clone(), hello_path.clone()).await;
    assert_eq!(status, 403, "{body}");
    assert!(message(&body).contains("may not reach cluster"), "{body}");

    // A version that does not parse is refused and the last good list stays.
    let health = fleet.path.user_server.health_addr;
    maps.replace(
        user_server::exposed::DEFAULT_CONFIGMAP,
        &PostParams::default(),
        &allowlist("- {namespace: apps}\n".into()),
    )
    .await
    .unwrap();
    simulated_cluster::wait::eventually(
        "the bad version to be counted",
        Duration::from_secs(10),
        || async {
            let (_, metrics) = tunnel_harness::in_process::health_get(health, "/metrics")
                .await
                .ok()?;
            metrics
                .contains("user_server_exposed_services_errors_total 1")
                .then_some(())
        },
    )
    .await;
    let (status, body) = get(alice.clone(), hello_path.clone()).await;
    assert_eq!(status, 200, "the last good list stays: {body}");

    // Deleting the ConfigMap denies every Service again.
    maps.delete(
        user_server::exposed::DEFAULT_CONFIGMAP,
        &DeleteParams::default(),
    )
    .await
    .unwrap();
    simulated_cluster::wait::eventually(
        "the deletion to deny hello",
        Duration::from_secs(10),
        || {
            let request = get(alice.clone(), hello_path.clone());
            async move { (request.await.0 == 403).then_some(()) }
        },
    )
    .await;
    let (status, body) = get(alice.clone(), secure_path).await;
    assert_eq!(status, 403, "{body}");
}

/// With `--managed-token-passthrough`, a token the hub does not know goes on
/// to the cluster's kube-apiserver, which authenticates it as its own user
/// (upstream's behaviour); hub users are still impersonated, and without
/// the flag such a token is refused on the hub.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn managed_tokens_pass_through_only_when_enabled() {
    let message = |body: &Value| body["message"].as_str().unwrap_or_default().to_owned();
    let configmaps = "/api/v1/namespaces/default/configmaps";
    let secrets = "/api/v1/namespaces/default/secrets";
    // carol is cluster-a's own user, unknown to the hub, who may read
    // ConfigMaps there.
    async fn grant_carol(fleet: &Fleet) -> String {
        let admin = fleet.managed.client().await.unwrap();
        create(
            &admin,
            cluster_binding("carol-reads", "configmap-reader", "User", "carol"),
        )
        .await
        .unwrap();
        fleet.managed.kubeconfigs(None).token("carol", &[])
    }

    let off = Fleet::start().await.unwrap();
    let carol = grant_carol(&off).await;
    let (status, body) = off
        .path
        .request_as(
            CLUSTER_A,
            &carol,
            http::Method::GET,
            configmaps,
            &[],
            Value::Null,
        )
        .await
        .unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(message(&body).contains("not valid on the hub"), "{body}");
    drop(off);

    let on = Fleet::start_with(|config| config.managed_token_passthrough = true)
        .await
        .unwrap();
    let carol = grant_carol(&on).await;
    let get = |token: String, path: &'static str| {
        let path_ref = &on.path;
        async move {
            path_ref
                .request_as(CLUSTER_A, &token, http::Method::GET, path, &[], Value::Null)
                .await
                .unwrap()
        }
    };
    // The cluster's own user, as the cluster's RBAC sees it.
    let (status, body) = get(carol.clone(), configmaps).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = get(carol.clone(), secrets).await;
    assert_eq!(status, 403, "{body}");
    assert!(message(&body).contains(r#"User "carol""#), "{body}");
    // A token neither side knows: the cluster refuses it.
    let (status, body) = get("not-a-token".into(), configmaps).await;
    assert_eq!(status, 401, "{body}");
    // Hub users are impersonated as before.
    let alice = on.hub_user("alice", &["team-a"]);
    let (status, body) = get(alice.clone(), configmaps).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = get(alice, secrets).await;
    assert_eq!(status, 403, "{body}");
    assert!(message(&body).contains("cluster:hub:alice"), "{body}");
    // Services never take a token the hub does not know.
    let (status, body) = get(
        carol,
        "/api/v1/namespaces/apps/services/http:hello:80/proxy-service/",
    )
    .await;
    assert_eq!(status, 401, "{body}");
    assert!(message(&body).contains("not valid on the hub"), "{body}");
}

/// With `--oidc-issuer-url`, an ID token of that issuer authenticates a hub
/// user (verified against the issuer's published keys, which rotate), the
/// hub's RBAC decides per cluster as for any user, and every malformed,
/// expired, forged or misaddressed token is a 401; other tokens still go to
/// the hub's TokenReview.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_id_tokens_authenticate_hub_users_whom_the_hubs_rbac_authorizes() {
    let issuer = OidcIssuer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("issuer-ca.crt");
    std::fs::write(&ca, &issuer.ca_pem).unwrap();
    let oidc = user_server::oidc::OidcConfig {
        issuer: issuer.url.clone(),
        client_id: "cluster-proxy".into(),
        username_claim: "sub".into(),
        username_prefix: "oidc:".into(),
        groups_claim: Some("groups".into()),
        groups_prefix: String::new(),
        ca_file: Some(ca),
        signing_algs: vec![jsonwebtoken::Algorithm::ES256],
        required_claims: vec![("hd".into(), "example.com".into())],
        keys_refresh_interval: Duration::from_millis(100),
    };
    let fleet = Fleet::start_with(|config| config.oidc = Some(oidc))
        .await
        .unwrap();
    // On cluster-a, dave (as the hub names him) may read ConfigMaps.
    create(
        &fleet.managed.client().await.unwrap(),
        cluster_binding(
            "hub-dave-reads",
            "configmap-reader",
            "User",
            "cluster:hub:oidc:dave",
        ),
    )
    .await
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = |changes: Value| {
        let mut claims = json!({"aud": "cluster-proxy", "sub": "dave", "groups": ["team-a"],
                                "hd": "example.com", "iat": now, "exp": now + 300});
        for (name, value) in changes.as_object().unwrap() {
            match value {
                Value::Null => {
                    claims.as_object_mut().unwrap().remove(name);
                }
                value => claims[name] = value.clone(),
            }
        }
        claims
    };
    let get = |token: String| {
        let path = &fleet.path;
        async move {
            path.request_as(
                CLUSTER_A,
                &token,
                http::Method::GET,
                "/api/v1/namespaces/default/configmaps",
                &[],
                Value::Null,
            )
            .await
            .unwrap()
        }
    };
    let message = |body: &Value| body["message"].as_str().unwrap_or_default().to_owned();

    // team-a may reach cluster-a on the hub; on cluster-a dave reads.
    let (status, body) = get(issuer.token(claims(json!({}))).unwrap()).await;
    assert_eq!(status, 200, "{body}");
    // A group without the hub's grant: 403 naming the user the hub saw.
    let (status, body) = get(issuer.token(claims(json!({"groups": ["team-b"]}))).unwrap()).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        message(&body).contains(r#""oidc:dave" may not reach cluster "cluster-a""#),
        "{body}"
    );

    for (what, token) in [
        (
            "expired",
            issuer.token(claims(json!({"exp": now - 3600}))).unwrap(),
        ),
        (
            "not yet valid",
            issuer.token(claims(json!({"nbf": now + 3600}))).unwrap(),
        ),
        (
            "another audience",
            issuer
                .token(claims(json!({"aud": "someone-else"})))
                .unwrap(),
        ),
        (
            "without the required claim",
            issuer.token(claims(json!({"hd": null}))).unwrap(),
        ),
        (
            "a reserved group",
            issuer
                .token(claims(json!({"groups": ["system:masters"]})))
                .unwrap(),
        ),
        (
            "no subject",
            issuer.token(claims(json!({"sub": null}))).unwrap(),
        ),
        ("forged", issuer.forged_token(claims(json!({}))).unwrap()),
    ] {
        let (status, body) = get(token).await;
        assert_eq!(status, 401, "{what}: {body}");
        assert!(message(&body).contains("OIDC"), "{what}: {body}");
    }

    // A rotated key is fetched when a token names it, without a restart.
    issuer.rotate().unwrap();
    let rotated = issuer.token(claims(json!({}))).unwrap();
    let body = simulated_cluster::wait::eventually(
        "a token of the rotated key to be accepted",
        Duration::from_secs(10),
        || {
            let request = get(rotated.clone());
            async move {
                let (status, body) = request.await;
                (status == 200).then_some(body)
            }
        },
    )
    .await;
    assert_eq!(body["kind"], "ConfigMapList", "{body}");

    // Tokens that are not the issuer's still go to the hub's TokenReview.
    let alice = fleet.hub_user("alice", &["team-a"]);
    let (status, body) = get(alice).await;
    assert_eq!(status, 200, "{body}");
}

/// [`https_request`] to the service-proxy's loopback port, verifying its
/// certificate for cluster-a's hashed host.
async fn https_request_to(
    ca_pem: &str,
    client_cert: Option<(&str, &str)>,
    request: http::Request<Empty<Bytes>>,
    fleet: &Fleet,
) -> (http::StatusCode, Value) {
    use cluster_proxy_runtime::tls::{self, Identity, Pem};
    let roots = tls::roots(&Pem::text("ca", ca_pem)).unwrap();
    let identity = client_cert.map(|(cert, key)| {
        Identity::new(&Pem::text("cert", cert), &Pem::text("key", key)).unwrap()
    });
    let config = tls::client_config(roots, identity, &[b"http/1.1"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(fleet.path.service_proxy.addr)
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from(
        ClusterName::new(CLUSTER_A).unwrap().service_proxy_host(),
    )
    .unwrap();
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(connection);
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_hub_client_certificate_authenticates_and_oversized_headers_are_cut_off() {
    let fleet = Fleet::start().await.unwrap();
    // carol has no token, only a certificate of the hub's client CA; her
    // group team-a is granted cluster-a on the hub, and alice's rights on
    // cluster-a are granted to cluster:hub:alice only: carol may list
    // nothing there, and says so as herself.
    let (cert, key) = fleet.path.client_certificate("carol", "team-a").unwrap();
    let request = |path: &str| {
        http::Request::get(format!(
            "https://127.0.0.1:{}{path}",
            fleet.path.user_server.addr.port()
        ))
        .body(Empty::<Bytes>::new())
        .unwrap()
    };
    let (status, body) = e2e::service_access::https_request(
        &fleet.path.pki_ca_pem,
        Some((&cert, &key)),
        request("/cluster-a/api/v1/namespaces/default/configmaps"),
    )
    .await
    .unwrap();
    assert_eq!(status, 403, "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains("cluster:hub:carol"), "{message}");
    // Her group has no grant for a cluster it was not given.
    let (status, _) = e2e::service_access::https_request(
        &fleet.path.pki_ca_pem,
        Some((&cert, &key)),
        request("/cluster-z/api"),
    )
    .await
    .unwrap();
    assert_eq!(status, 404);

    // A certificate of another CA is refused in the handshake.
    let (cert, key) = &fleet.path.identity;
    let stranger = e2e::service_access::https_request(
        &fleet.path.pki_ca_pem,
        Some((cert, key)),
        request("/cluster-a/api"),
    )
    .await;
    assert!(
        stranger.is_err(),
        "a certificate of another CA: {stranger:?}"
    );

    // Headers beyond 256 KiB: 431, the connection is not held.
    let alice = fleet.hub_user("alice", &["team-a"]);
    let big = "x".repeat(300 * 1024);
    let (status, _) = fleet
        .path
        .request(
            "/cluster-a/api",
            &[
                ("authorization", &format!("Bearer {alice}")),
                ("x-padding", &big),
            ],
        )
        .await
        .unwrap();
    assert_eq!(status, 431);
}

#[tokio::test]
async fn a_users_requests_cost_the_hub_one_token_review() {
    let fleet = Fleet::start().await.unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);
    let before = fleet.hub.token_reviews();
    let through = fleet.path.client(CLUSTER_A, &alice).await.unwrap();
    let remote = Api::<ConfigMap>::namespaced(through, "default");
    // Concurrent first requests share one review, later ones hit the cache.
    let params = kube::api::ListParams::default();
    let first: Vec<_> = futures_util::future::join_all((0..10).map(|_| remote.list(&params))).await;
    assert!(first.iter().all(Result::is_ok), "{first:?}");
    for _ in 0..40 {
        remote.list(&Default::default()).await.unwrap();
    }
    assert_eq!(
        fleet.hub.token_reviews() - before,
        1,
        "50 requests, one review"
    );
    assert_eq!(fleet.path.user_server.cached_tokens(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_streams_through_the_user_server_and_the_service_proxy() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fleet = Fleet::start().await.unwrap();
    let _echo = fleet.echo_pod().await.unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);

    // kube-rs's WebSocket port-forward: the upgrade crosses both proxies.
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(
        fleet.path.client(CLUSTER_A, &alice).await.unwrap(),
        "default",
    );
    let mut forward = pods.portforward("echo-0", &[7000]).await.unwrap();
    let mut stream = forward.take_stream(7000).unwrap();
    let payload: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let (mut read, mut write) = tokio::io::split(&mut stream);
    let sent = payload.clone();
    let (written, back) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(write.write_all(&sent), async {
            let mut back = vec![0u8; payload.len()];
            read.read_exact(&mut back).await.map(|_| back)
        })
    })
    .await
    .expect("4 MiB echoed through the port-forward within 30 s");
    written.unwrap();
    assert!(back.unwrap() == payload, "the echo differs");
    drop(stream);
    forward.abort();

    // kubectl's own port-forward, SPDY tunneled in WebSocket (1.31+) and
    // plain SPDY: both upgrades cross the user-server and the
    // service-proxy.
    if !kubectl_available() {
        return;
    }
    for websockets in [true, false] {
        let (mut kubectl, port) = fleet
            .path
            .kubectl_port_forward(
                CLUSTER_A,
                &alice,
                &["port-forward", "-n", "default", "pod/echo-0", ":7000"],
                websockets,
            )
            .await
            .unwrap();
        for size in [1024 * 1024, 10] {
            let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let sent: Vec<u8> = (0..size).map(|i| (i % 241) as u8).collect();
            let (mut read, mut write) = tcp.split();
            let (written, back) = tokio::time::timeout(Duration::from_secs(30), async {
                tokio::join!(write.write_all(&sent), async {
                    let mut back = vec![0u8; size];
                    read.read_exact(&mut back).await.map(|_| back)
                })
            })
            .await
            .expect("echoed through kubectl port-forward within 30 s");
            written.unwrap();
            assert!(
                back.unwrap() == sent,
                "websockets={websockets}: the echo differs"
            );
        }
        kubectl.start_kill().unwrap();
        kubectl.wait().await.unwrap();
    }
}

/// kubectl exec (WebSocket v5), exec with stdin, cp both ways and logs
/// (tail and follow) through the user-server and the service-proxy, as
/// hub alice, decided by cluster-a's RBAC for `cluster:hub:alice`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_exec_cp_and_logs_through_the_user_server() {
    use std::process::Stdio;
    use tokio::io::AsyncWriteExt;
    if !kubectl_available() {
        return;
    }
    let fleet = Fleet::start().await.unwrap();
    let alice = fleet.hub_user("alice", &["team-a"]);
    let managed = fleet.managed.client().await.unwrap();
    create(
        &managed,
        cluster_role(
            "pod-operator",
            json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                   {"apiGroups": [""], "resources": ["pods/exec", "pods/attach"], "verbs": ["get", "create"]},
                   {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]),
        ),
    )
    .await
    .unwrap();
    create(
        &managed,
        cluster_binding(
            "hub-alice-operates",
            "pod-operator",
            "User",
            "cluster:hub:alice",
        ),
    )
    .await
    .unwrap();
    let pod_dir = fleet.dir.path().join("shell-0");
    std::fs::create_dir_all(&pod_dir).unwrap();
    let log = pod_dir.join("main.log");
    std::fs::write(&log, "starting\nready\n").unwrap();
    let pod = memory_apiserver::pods::RunningPod {
        namespace: "default".into(),
        name: "shell-0".into(),
        ready: true,
        containers: std::collections::BTreeMap::from([(
            "main".to_owned(),
            memory_apiserver::pods::ContainerRuntime {
                log: Some(log.clone()),
                exec: Some(memory_apiserver::pods::ExecContext {
                    dir: pod_dir.clone(),
                    ..Default::default()
                }),
            },
        )]),
        ..Default::default()
    };
    fleet.managed.kubelet().run(&pod).unwrap();
    let kubectl = async |args: &[&str]| fleet.path.kubectl(CLUSTER_A, &alice, args).await;

    let output = kubectl(&[
        "exec",
        "-n",
        "default",
        "shell-0",
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 7",
    ])
    .await
    .unwrap();
    assert_eq!(output.status.code(), Some(7), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "out\n");
    assert!(String::from_utf8_lossy(&output.stderr).contains("err"));
    // The same over SPDY (kubectl's other executor, and its fallback).
    let mut spdy = fleet.path.kubectl_command(
        CLUSTER_A,
        &alice,
        &[
            "exec",
            "-n",
            "default",
            "shell-0",
            "--",
            "sh",
            "-c",
            "echo spdy; exit 6",
        ],
    );
    spdy.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
    let output = tokio::time::timeout(Duration::from_secs(60), spdy.output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(output.status.code(), Some(6), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "spdy\n");

    let mut cat = fleet.path.kubectl_command(
        CLUSTER_A,
        &alice,
        &["exec", "-i", "-n", "default", "shell-0", "--", "wc", "-c"],
    );
    cat.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut cat = cat.spawn().unwrap();
    let mut stdin = cat.stdin.take().unwrap();
    stdin.write_all(&vec![b'x'; 100_000]).await.unwrap();
    drop(stdin);
    let output = tokio::time::timeout(Duration::from_secs(60), cat.wait_with_output())
        .await
        .expect("exec -i ends once its stdin does")
        .unwrap();
    assert_eq!(stdout(&output).trim(), "100000");

    // 4 MiB each way through kubectl cp.
    let payload: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let local = fleet.dir.path().join("payload.bin");
    std::fs::write(&local, &payload).unwrap();
    let inside = pod_dir.join("copied.bin");
    stdout(
        &kubectl(&[
            "cp",
            &local.to_string_lossy(),
            &format!("default/shell-0:{}", inside.display()),
        ])
        .await
        .unwrap(),
    );
    assert!(
        std::fs::read(&inside).unwrap() == payload,
        "copied in differs"
    );
    let back = fleet.dir.path().join("back.bin");
    stdout(
        &kubectl(&[
            "cp",
            &format!("default/shell-0:{}", inside.display()),
            &back.to_string_lossy(),
        ])
        .await
        .unwrap(),
    );
    assert!(
        std::fs::read(&back).unwrap() == payload,
        "copied out differs"
    );

    assert_eq!(
        stdout(
            &kubectl(&["logs", "-n", "default", "shell-0", "--tail=1"])
                .await
                .unwrap()
        ),
        "ready\n"
    );
    // kubectl logs -f and kubectl attach: what the container writes from
    // now on, until the pod goes (then kubectl exits successfully).
    let follows = [
        &["logs", "-f", "-n", "default", "shell-0", "--tail=0"][..],
        &["attach", "-n", "default", "shell-0"],
    ];
    for args in follows {
        fleet.managed.kubelet().run(&pod).unwrap();
        let mut follow = fleet.path.kubectl_command(CLUSTER_A, &alice, args);
        follow.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut follow = follow.spawn().unwrap();
        let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
        let line = format!("seen by kubectl {}", args[0]);
        let seen = append_until_seen(&log, &line, &mut lines).await;
        assert_eq!(seen.as_deref(), Some(line.as_str()));
        fleet
            .managed
            .kubelet()
            .remove("default", "shell-0")
            .unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), follow.wait())
            .await
            .unwrap_or_else(|_| panic!("{args:?} ends when the pod goes"))
            .unwrap();
        assert!(status.success(), "{args:?}: {status:?}");
    }

    // Revoked on the managed cluster: exec is refused, naming the hub user.
    fleet.managed.kubelet().run(&pod).unwrap();
    Api::<DynamicObject>::all_with(
        managed,
        &resource(
            "rbac.authorization.k8s.io",
            "ClusterRoleBinding",
            "clusterrolebindings",
        ),
    )
    .delete("hub-alice-operates", &DeleteParams::default())
    .await
    .unwrap();
    let denied = stderr_of_failure(
        &kubectl(&["exec", "-n", "default", "shell-0", "--", "true"])
            .await
            .unwrap(),
    );
    assert!(denied.contains("cluster:hub:alice"), "{denied}");
}

/// Appends `line` to `log` until `follower` (kubectl following it) shows
/// it, for at most 30 s: it may start following after a write. The line
/// it showed.
async fn append_until_seen(
    log: &Path,
    line: &str,
    follower: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) -> Option<String> {
    let mut appended = std::fs::OpenOptions::new().append(true).open(log).unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            writeln!(appended, "{line}").unwrap();
            tokio::select! {
                shown = follower.next_line() => break shown.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{line:?} not shown within 30 s"))
}

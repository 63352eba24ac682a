//! `e2e up`'s service access, as a newcomer uses it: the chart's
//! user-server on the hub, a service-proxy beside every agent, each managed
//! cluster's own kube-apiserver (RBAC on). The real kubectl reaches every
//! cluster through the user-server with a kubeconfig from
//! `cluster-proxy kubeconfig`, and the hub's RBAC and each cluster's decide.

use std::path::Path;
use std::time::Duration;

use e2e::env::{EnvOptions, Environment, IsolationChoice};
use e2e::service_access::{cluster_binding, cluster_role, create};
use serde_json::json;

const READY: Duration = Duration::from_secs(120);

fn kubectl_available() -> bool {
    let found = std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").is_err(),
            "under CI kubectl must be installed (.ci/run installs it)"
        );
        eprintln!("SKIPPED: kubectl is not installed");
    }
    found
}

/// kubectl with `kubeconfig` in `context`: its exit status and output.
async fn kubectl(kubeconfig: &Path, context: &str, args: &[&str]) -> (bool, String) {
    let mut command = tokio::process::Command::new("kubectl");
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(["--context", context, "--request-timeout=20s"])
        .args(args)
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("kubectl ended within 60 s")
        .expect("running kubectl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// Whether a line containing `name` comes from `lines` within 30 s.
async fn printed_line(
    lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    name: &str,
) -> bool {
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.recv().await {
            if line.contains(name) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}

/// Runs kubectl until `check` accepts what it said (the grants take effect
/// within the user-server's authorization cache TTL).
async fn until(
    kubeconfig: &Path,
    context: &str,
    args: &[&str],
    check: impl Fn(bool, &str) -> bool,
) {
    let mut last = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        let (ok, text) = kubectl(kubeconfig, context, args).await;
        if check(ok, &text) {
            return;
        }
        last = text;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!("kubectl {args:?} in {context}: not as expected within 60 s; last: {last}");
}

/// A kubeconfig through the user-server for `clusters`, as the user of the
/// hub kubeconfig `hub`.
fn cluster_kubeconfig(env: &Environment, hub: &Path, clusters: &[String], out: &Path) {
    let user_server = env
        .summary
        .user_server
        .expect("e2e up runs the user-server");
    let ca = std::fs::read_to_string(env.summary.pki_dir.join("ca-bundle.crt")).unwrap();
    let config = cluster_proxy_cli::kubeconfig::for_clusters(
        &kube::config::Kubeconfig::read_from(hub).unwrap(),
        None,
        &format!("https://{user_server}"),
        &ca,
        clusters,
    )
    .unwrap();
    cluster_proxy_cli::kubeconfig::write(&config, out).unwrap();
}

#[tokio::test]
async fn kubectl_reaches_every_cluster_of_the_environment_through_the_user_server() {
    if !kubectl_available() {
        return;
    }
    let mut options = EnvOptions::new(2);
    options.control_plane = true;
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        options.isolation = IsolationChoice::Netns;
    }
    let names = options.clusters.clone();
    let env = Environment::start(options).await.unwrap();
    env.wait_clusters_ready(&names, 2, READY).await.unwrap();
    let api = env.kube_api.as_ref().unwrap();
    let dir = env.summary.state_dir.clone();

    // The hub administrator: every cluster grants it cluster-admin.
    let admin = dir.join("admin-clusters.kubeconfig");
    cluster_kubeconfig(&env, api.kubeconfig_path(), &names, &admin);
    let agent_ns = "open-cluster-management-cluster-proxy";
    let pod = "cluster-proxy-proxy-agent-0";
    for cluster in &names {
        // Each cluster's own API: its agent pod, written by its kubelet.
        until(
            &admin,
            cluster,
            &["get", "pods", "-n", agent_ns, "-o", "name"],
            |ok, text| ok && text.contains(pod),
        )
        .await;
        let (ok, text) = kubectl(
            &admin,
            cluster,
            &[
                "exec",
                "-n",
                agent_ns,
                pod,
                "-c",
                "proxy-agent",
                "--",
                "printf",
                "exec-ok",
            ],
        )
        .await;
        assert!(ok && text.contains("exec-ok"), "{cluster}: {text}");
        let (ok, text) = kubectl(
            &admin,
            cluster,
            &["logs", "-n", agent_ns, pod, "-c", "proxy-agent"],
        )
        .await;
        assert!(
            ok && text.contains("connected to proxy-server"),
            "{cluster}: {text}"
        );
    }
    // apply, a watch that sees it, cp out of the agent pod and delete, on
    // every cluster.
    for cluster in &names {
        // The watch's first list holds a marker: once it is printed, the
        // watch is open, and the applied ConfigMap can only come as an event.
        let (ok, text) = kubectl(
            &admin,
            cluster,
            &["create", "configmap", "watch-marker", "-n", "default"],
        )
        .await;
        assert!(ok, "{cluster}: {text}");
        let mut watch = tokio::process::Command::new("kubectl")
            .arg(format!("--kubeconfig={}", admin.display()))
            .args(["--context", cluster, "get", "configmaps", "-n", "default"])
            .args(["-w", "-o", "name"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("kubectl get -w");
        let stdout = watch.stdout.take().expect("the watch's stdout");
        let (lines_tx, mut lines_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if lines_tx.send(line).is_err() {
                    return;
                }
            }
        });
        assert!(
            printed_line(&mut lines_rx, "watch-marker").await,
            "{cluster}: the watch listed no marker"
        );
        let manifest = dir.join(format!("{cluster}-configmap.yaml"));
        std::fs::write(
            &manifest,
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: applied-here, namespace: default}\ndata: {k: v}\n",
        )
        .unwrap();
        let path = manifest.display().to_string();
        let (ok, text) = kubectl(&admin, cluster, &["apply", "-f", &path]).await;
        assert!(
            ok && text.contains("configmap/applied-here"),
            "{cluster}: {text}"
        );
        assert!(
            printed_line(&mut lines_rx, "applied-here").await,
            "{cluster}: the watch printed no event for the applied ConfigMap within 30 s"
        );
        drop(watch);
        let copied = dir.join(format!("{cluster}-copied"));
        std::fs::write(dir.join("source.txt"), "copied through the hub").unwrap();
        let source = format!("{agent_ns}/{pod}:{}", dir.join("source.txt").display());
        let (ok, text) = kubectl(
            &admin,
            cluster,
            &[
                "cp",
                "-c",
                "proxy-agent",
                &source,
                &copied.display().to_string(),
            ],
        )
        .await;
        assert!(ok, "{cluster}: kubectl cp: {text}");
        assert_eq!(
            std::fs::read_to_string(&copied).unwrap_or_default(),
            "copied through the hub",
            "{cluster}"
        );
        let (ok, text) = kubectl(
            &admin,
            cluster,
            &["delete", "configmap", "applied-here", "-n", "default"],
        )
        .await;
        assert!(ok && text.contains("deleted"), "{cluster}: {text}");
    }

    // A request for one cluster reaches that cluster only.
    let (ok, text) = kubectl(
        &admin,
        &names[0],
        &["create", "configmap", "only-here", "-n", "default"],
    )
    .await;
    assert!(ok, "{text}");
    let (ok, text) = kubectl(
        &admin,
        &names[1],
        &["get", "configmap", "only-here", "-n", "default"],
    )
    .await;
    assert!(!ok && text.contains("NotFound"), "{text}");

    // Hub user bob: the hub decides first, then the cluster.
    let bob_hub = api.kubeconfig_for("bob", &["team-b"]).unwrap();
    let bob = dir.join("bob-clusters.kubeconfig");
    cluster_kubeconfig(&env, &bob_hub, &names, &bob);
    let cluster = names[0].as_str();
    let get = [
        "get",
        "configmap",
        "only-here",
        "-n",
        "default",
        "-o",
        "name",
    ];
    let (ok, text) = kubectl(&bob, cluster, &get).await;
    assert!(
        !ok && text.contains("Forbidden") && text.contains(cluster),
        "{text}"
    );
    let hub = api.client().await.unwrap();
    create(&hub, cluster_role("bob-proxy", json!([{"apiGroups": ["cluster.open-cluster-management.io"], "resources": ["managedclusters/proxy"], "resourceNames": [cluster], "verbs": ["get"]}]))).await.unwrap();
    create(
        &hub,
        cluster_binding("bob-proxy", "bob-proxy", "User", "bob"),
    )
    .await
    .unwrap();
    // Now the cluster refuses cluster:hub:bob, until its admin grants him.
    until(&bob, cluster, &get, |ok, text| {
        !ok && text.contains("cluster:hub:bob")
    })
    .await;
    let (ok, text) = kubectl(
        &admin,
        cluster,
        &[
            "create",
            "role",
            "configmap-reader",
            "-n",
            "default",
            "--verb=get",
            "--resource=configmaps",
        ],
    )
    .await;
    assert!(ok, "{text}");
    let (ok, text) = kubectl(
        &admin,
        cluster,
        &[
            "create",
            "rolebinding",
            "bob-views",
            "-n",
            "default",
            "--role=configmap-reader",
            "--user=cluster:hub:bob",
        ],
    )
    .await;
    assert!(ok, "{text}");
    until(&bob, cluster, &get, |ok, text| {
        ok && text.contains("configmap/only-here")
    })
    .await;
    // Revoked on the hub: refused again.
    let (ok, text) = kubectl(
        &admin,
        cluster,
        &["get", "rolebinding", "bob-views", "-n", "default"],
    )
    .await;
    assert!(ok, "{text}");
    let bindings: kube::Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = kube::Api::all(hub);
    bindings
        .delete("bob-proxy", &Default::default())
        .await
        .unwrap();
    until(&bob, cluster, &get, |ok, text| {
        !ok && text.contains("Forbidden")
    })
    .await;
    env.shutdown().await;
}

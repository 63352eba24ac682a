//! The `cert-authority` binary: `init` writes a usable PKI once and refuses to
//! overwrite it; `run --once` keeps it current; bad input is a clear error.

use std::process::{Command, Output};

fn cert_authority(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cert-authority"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("run cert-authority")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn init_then_run_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let pki_str = pki.to_str().unwrap();

    let out = cert_authority(&[
        "init",
        "--dir",
        pki_str,
        "--clusters",
        "cluster-a,cluster-b",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    for file in [
        "ca/tls.crt",
        "ca/tls.key",
        "ca-bundle.crt",
        "proxy-server/tls.crt",
        "agent-server/tls.key",
        "proxy-client/tls.crt",
        "agents/cluster-a/tls.crt",
        "agents/cluster-b/tls.key",
    ] {
        assert!(pki.join(file).is_file(), "{file} missing");
    }

    let again = cert_authority(&["init", "--dir", pki_str, "--clusters", "cluster-a"]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("refusing to overwrite"),
        "{}",
        stderr(&again)
    );

    // A fresh PKI needs nothing; a new cluster gets its certificate.
    let out = cert_authority(&[
        "run",
        "--dir",
        pki_str,
        "--clusters",
        "cluster-a,cluster-b,cluster-c",
        "--once",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(pki.join("agents/cluster-c/tls.crt").is_file());

    let bad_name = cert_authority(&[
        "init",
        "--dir",
        dir.path().join("x").to_str().unwrap(),
        "--clusters",
        "Bad_Name",
    ]);
    assert!(!bad_name.status.success());
    assert!(
        stderr(&bad_name).contains("DNS-1123"),
        "{}",
        stderr(&bad_name)
    );

    let bad_duration = cert_authority(&[
        "init",
        "--dir",
        dir.path().join("y").to_str().unwrap(),
        "--leaf-validity",
        "soon",
    ]);
    assert!(!bad_duration.status.success());
    assert!(
        stderr(&bad_duration).contains("--leaf-validity"),
        "{}",
        stderr(&bad_duration)
    );

    // No cluster to talk to: a clear error, not a hang.
    let k8s = Command::new(env!("CARGO_BIN_EXE_cert-authority"))
        .args(["run", "--backend", "kubernetes", "--once"])
        .env("KUBECONFIG", dir.path().join("no-such-kubeconfig"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert!(!k8s.status.success());
    assert!(
        stderr(&k8s).contains("no Kubernetes API"),
        "{}",
        stderr(&k8s)
    );
    let clusters = cert_authority(&[
        "run",
        "--backend",
        "kubernetes",
        "--clusters",
        "a",
        "--once",
    ]);
    assert!(!clusters.status.success());
    assert!(
        stderr(&clusters).contains("through CSRs"),
        "{}",
        stderr(&clusters)
    );
    let unknown = cert_authority(&["run", "--backend", "vault", "--dir", pki_str, "--once"]);
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("possible values: files, kubernetes"),
        "{}",
        stderr(&unknown)
    );

    let uninitialized = cert_authority(&[
        "run",
        "--dir",
        dir.path().join("empty").to_str().unwrap(),
        "--once",
    ]);
    assert!(!uninitialized.status.success());
    assert!(
        stderr(&uninitialized).contains("cert-authority init"),
        "{}",
        stderr(&uninitialized)
    );
}

/// `run --backend kubernetes --once` against the in-memory API, as a process.
async fn run_once_against(kubeconfig: &std::path::Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "run".to_string(),
        "--backend=kubernetes".into(),
        "--namespace=ca-home".into(),
        "--once".into(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_string()));
    let kubeconfig = kubeconfig.to_path_buf();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_cert-authority"))
            .args(&args)
            .env("KUBECONFIG", kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("RUST_BACKTRACE")
            .output()
            .expect("run cert-authority")
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_backend_follows_the_named_managed_proxy_configuration() {
    use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
    use k8s_openapi::api::core::v1::{Namespace, Secret};
    use kube::Api;
    use kube::api::{Patch, PatchParams, PostParams};
    use memory_apiserver::{KubeApi, KubeApiOptions};
    use serde_json::json;

    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(KubeApiOptions::new(dir.path()))
        .await
        .unwrap();
    let admin = api.client().await.unwrap();
    for name in ["ca-home", "proxy-home"] {
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap();
    }
    let secrets = |namespace: &str| Api::<Secret>::namespaced(admin.clone(), namespace);

    // The default, `cluster-proxy`, does not exist (nor its CRD): a clear
    // error, and nothing written.
    let missing = run_once_against(api.kubeconfig_path(), &[]).await;
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("ManagedProxyConfiguration cluster-proxy does not exist"),
        "{}",
        stderr(&missing)
    );
    assert!(
        secrets("ca-home")
            .get_opt("proxy-server")
            .await
            .unwrap()
            .is_none()
    );

    // Following none: the flags alone, as before.
    let off = run_once_against(api.kubeconfig_path(), &["--managed-proxy-configuration="]).await;
    assert!(off.status.success(), "{}", stderr(&off));
    assert!(
        secrets("ca-home")
            .get_opt("proxy-server")
            .await
            .unwrap()
            .is_some()
    );

    // A named one: its namespace, and the conditions on its status.
    api.register_crds_from_yaml(include_str!(
        "../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml"
    ))
    .unwrap();
    let mpc = json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "other"},
        "spec": {
            "authentication": {},
            "proxyServer": {"image": "proxy-server:dev", "namespace": "proxy-home"},
            "proxyAgent": {"image": "proxy-agent:dev"},
        },
    });
    let mpcs: Api<ManagedProxyConfiguration> = Api::all(admin.clone());
    mpcs.patch("other", &PatchParams::apply("helm"), &Patch::Apply(&mpc))
        .await
        .unwrap();
    let named = run_once_against(
        api.kubeconfig_path(),
        &["--managed-proxy-configuration=other"],
    )
    .await;
    assert!(named.status.success(), "{}", stderr(&named));
    assert!(
        secrets("proxy-home")
            .get_opt("agent-server")
            .await
            .unwrap()
            .is_some()
    );
    let conditions = mpcs.get("other").await.unwrap().status.unwrap().conditions;
    assert_eq!(conditions.len(), 3, "{conditions:?}");
    assert!(
        conditions.iter().all(|c| c.status == "True"),
        "{conditions:?}"
    );
}

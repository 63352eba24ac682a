//! Scenario tests of the control plane in the local environment: the real
//! addon-manager and cert-authority (kubernetes backend) against the
//! in-memory API, with OCM's placement, registration and work agents played
//! by the environment (`simulated_cluster::ocm`). Every server and agent runs from
//! the objects the control plane wrote: the proxy-server Deployment, the
//! ManifestWork, the Secrets and the CSR-issued agent certificates.

use std::time::{Duration, Instant};

use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::ManifestWork;
use e2e::env::control_plane::{self, replica_client_addr};
use e2e::env::{ADDON_NAMESPACE, EnvOptions, Environment, Isolation, IsolationChoice};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use simulated_cluster::ocm::{ADDON_NAME, AGENT_DEPLOYMENT, AGENT_WORK_NAME};

const READY: Duration = Duration::from_secs(120);

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn options(clusters: usize) -> EnvOptions {
    let mut options = EnvOptions::new(clusters);
    options.control_plane = true;
    options.isolation = if under_ci() {
        IsolationChoice::Netns
    } else {
        IsolationChoice::Auto
    };
    options
}

fn dump_logs(env: &Environment) {
    let mut names: Vec<String> = ["addon-manager", "cert-authority-kube", "agent-lb"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if let Ok(entries) = std::fs::read_dir(env.logs.dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.contains("proxy-agent") || name.contains("addon-agent") || name.contains("hub")
            {
                names.push(name.trim_end_matches(".log").replace('_', "/"));
            }
        }
    }
    for name in names {
        eprintln!("----- {name} -----\n{}", env.logs.tail(&name, 40));
    }
}

async fn start(options: EnvOptions) -> Environment {
    let names = options.clusters.clone();
    let replicas = options.replicas;
    let env = Environment::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting the environment: {e}"));
    if let Isolation::Loopback(reason) = &env.summary.isolation {
        eprintln!("NOTE: running on loopback without network isolation: {reason}");
    }
    if let Err(err) = env.wait_clusters_ready(&names, replicas, READY).await {
        dump_logs(&env);
        panic!("{err}");
    }
    env
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(()) => return,
            Err(err) if started.elapsed() > timeout => {
                panic!("{what}: not after {timeout:?}: {err}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Clusters join and leave through OCM's flow: a new ManagedCluster gets an
/// agent, a tunnel and `Available=True`; one taken out of the placement, or
/// deleted, loses its agent and its addon objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clusters_join_and_leave_through_the_control_plane() {
    let env = start(options(1)).await;
    let admin = env.admin_client().await.unwrap();

    // A newcomer.
    let joined_at = Instant::now();
    control_plane::join(&admin, "cluster-new").await.unwrap();
    if let Err(err) = env
        .wait_clusters_ready(&["cluster-new".to_string()], 2, READY)
        .await
    {
        dump_logs(&env);
        panic!("{err}");
    }
    eprintln!(
        "cluster-new: Available and reachable through both replicas {:.1}s after its ManagedCluster was created",
        joined_at.elapsed().as_secs_f64()
    );
    // health-prober finds it reachable through both replicas and says so
    // on the addon (what `up` and `e2e status` print).
    wait_for("health-prober's verdict on cluster-new", READY, || async {
        let rows = control_plane::addon_status(&admin)
            .await
            .map_err(|e| e.to_string())?;
        let row = rows
            .iter()
            .find(|r| r.name == "cluster-new")
            .ok_or("no row for cluster-new")?;
        if row.probe.starts_with("Reachable 2/2 ") && row.probe.ends_with("ms") {
            Ok(())
        } else {
            Err(format!("probe: {}", row.probe))
        }
    })
    .await;
    // Its agent certificate came from a CSR the addon-manager approved and
    // cert-authority signed, and its addon-agent's hub kubeconfig from one
    // the addon-manager approved and the hub's kube-apiserver-client signer
    // signed: one CSR each, every one issued (a subject the registration
    // agent rejects would make it ask again, issue 56).
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let mut signers: Vec<(String, bool)> = csrs
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|c| {
            c.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("open-cluster-management.io/cluster-name"))
                .is_some_and(|n| n == "cluster-new")
        })
        .map(|c| {
            let issued = c
                .status
                .as_ref()
                .and_then(|s| s.certificate.as_ref())
                .is_some();
            (c.spec.signer_name, issued)
        })
        .collect();
    signers.sort();
    assert_eq!(
        signers,
        [
            ("kubernetes.io/kube-apiserver-client".to_string(), true),
            (
                "open-cluster-management.io/proxy-agent-signer".to_string(),
                true
            ),
        ],
        "the CSRs of cluster-new"
    );

    // Out of the placement: the addon and its work go, and so does the agent.
    let placements: Api<cluster_proxy_proto::api::cluster::v1beta1::Placement> =
        Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    placements
        .patch(
            "cluster-proxy-placement",
            &PatchParams::apply("test"),
            &Patch::Apply(json!({
                "apiVersion": "cluster.open-cluster-management.io/v1beta1",
                "kind": "Placement",
                "metadata": {"name": "cluster-proxy-placement", "namespace": ADDON_NAMESPACE},
                "spec": {"predicates": [{"requiredClusterSelector": {"labelSelector": {
                    "matchExpressions": [{"key": "name", "operator": "NotIn", "values": ["cluster-new"]}]
                }}}]},
            })),
        )
        .await
        .unwrap();
    let addons: Api<ManagedClusterAddOn> = Api::namespaced(admin.clone(), "cluster-new");
    let works: Api<ManifestWork> = Api::namespaced(admin.clone(), "cluster-new");
    wait_for("cluster-new's addon and work removed", READY, || async {
        let addon = addons
            .get_opt(ADDON_NAME)
            .await
            .map_err(|e| e.to_string())?;
        let work = works
            .get_opt(AGENT_WORK_NAME)
            .await
            .map_err(|e| e.to_string())?;
        match (addon, work) {
            (None, None) => Ok(()),
            (a, w) => Err(format!("addon {:?}, work {:?}", a.is_some(), w.is_some())),
        }
    })
    .await;
    let client = env
        .hub_client()
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    let replica = replica_client_addr(env.summary.hub_addr, 0);
    wait_for(
        "cluster-new unreachable once its agent is gone",
        READY,
        || async {
            match control_plane::reachable(&client, replica, "cluster-new").await {
                Ok(()) => Err("still reachable".into()),
                Err(_) => Ok(()),
            }
        },
    )
    .await;
    // The cluster that stays is untouched.
    control_plane::reachable(&client, replica, "cluster-a")
        .await
        .unwrap();

    // Deleted: its namespace and everything in it goes.
    control_plane::leave(&admin, "cluster-new").await.unwrap();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
    wait_for("cluster-new's namespace removed", READY, || async {
        match namespaces
            .get_opt("cluster-new")
            .await
            .map_err(|e| e.to_string())?
        {
            None => Ok(()),
            Some(_) => Err("still there".into()),
        }
    })
    .await;
    env.shutdown().await;
}

/// The hub follows the MPC: replicas 2 → 3 changes the Deployment but not
/// its pod template (the replicas count each other through the headless
/// Service `proxy-server-peers`), and every agent reaches the new replica; a deleted
/// owned Service comes back; an AddOnDeploymentConfig's node placement
/// and proxy settings reach the agent's Deployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_hub_follows_the_managed_proxy_configuration() {
    let env = start(options(2)).await;
    let admin = env.admin_client().await.unwrap();
    let names: Vec<String> = env
        .summary
        .clusters
        .iter()
        .map(|c| c.name.clone())
        .collect();
    let names = if names.is_empty() {
        vec!["cluster-a".to_string(), "cluster-b".to_string()]
    } else {
        names
    };

    let mpcs: Api<ManagedProxyConfiguration> = Api::all(admin.clone());
    // With a network namespace per cluster the agents came up through the
    // chart's default entrypoint: each proxy-agent dialed its own
    // 127.0.0.1:8091, which only its addon-agent's port-forward serves.
    let entrypoint = serde_json::to_value(mpcs.get("cluster-proxy").await.unwrap()).unwrap()
        ["spec"]["proxyServer"]["entrypoint"]["type"]
        .clone();
    let expected = match env.summary.isolation {
        Isolation::Netns => "PortForward",
        Isolation::Loopback(_) => "Hostname",
    };
    assert_eq!(entrypoint, expected);
    mpcs.patch(
        "cluster-proxy",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"proxyServer": {"replicas": 3}}})),
    )
    .await
    .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    wait_for(
        "Deployment cluster-proxy at 3 replicas counting its peers by DNS",
        READY,
        || async {
            let d = deployments
                .get("cluster-proxy")
                .await
                .map_err(|e| e.to_string())?;
            let spec = d.spec.as_ref().ok_or("no spec")?;
            let args = spec
                .template
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.args.clone())
                .unwrap_or_default();
            let counts_peers = args
                .iter()
                .any(|a| a.starts_with("--server-count-source=dns:proxy-server-peers."));
            if spec.replicas == Some(3) && counts_peers {
                Ok(())
            } else {
                Err(format!("replicas {:?}, args {args:?}", spec.replicas))
            }
        },
    )
    .await;
    if let Err(err) = env.wait_clusters_ready(&names, 3, READY).await {
        dump_logs(&env);
        panic!("{err}");
    }

    // The hub kubelet's Pods: one per replica, found by the component
    // label, Running and Ready (the proxy-servers' /readyz passes once
    // agents hold tunnels).
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    wait_for("three Ready proxy-server Pods", READY, || async {
        let list = pods
            .list(
                &kube::api::ListParams::default()
                    .labels("proxy.open-cluster-management.io/component-name=proxy-server"),
            )
            .await
            .map_err(|e| e.to_string())?;
        let mut ready: Vec<String> = list
            .items
            .iter()
            .filter(|p| {
                let status = p.status.as_ref();
                status.and_then(|s| s.phase.as_deref()) == Some("Running")
                    && status
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        ready.sort();
        if ready == ["cluster-proxy-0", "cluster-proxy-1", "cluster-proxy-2"] {
            Ok(())
        } else {
            Err(format!("ready pods {ready:?} of {}", list.items.len()))
        }
    })
    .await;

    // The kubelet's `pods/log` and `pods/exec` reach the replica's
    // process: its log begins with its command line, and a command runs
    // beside it with the container's environment (the downward API's
    // pod name).
    let log = pods
        .logs("cluster-proxy-0", &kube::api::LogParams::default())
        .await
        .unwrap();
    assert!(
        log.lines()
            .next()
            .is_some_and(|l| l.contains("proxy-server")),
        "{log}"
    );
    let mut attached = pods
        .exec(
            "cluster-proxy-0",
            ["sh", "-c", "echo $PROXY_SERVER_ID"],
            &kube::api::AttachParams::default().stderr(false),
        )
        .await
        .unwrap();
    let mut echoed = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut attached.stdout().unwrap(), &mut echoed)
        .await
        .unwrap();
    assert_eq!(echoed.trim(), "cluster-proxy-0");

    // Drift: the in-cluster Service is deleted; the controller's watch
    // brings it back.
    let services: Api<Service> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    let before = services.get("proxy-entrypoint").await.unwrap();
    services
        .delete("proxy-entrypoint", &Default::default())
        .await
        .unwrap();
    wait_for(
        "Service proxy-entrypoint re-created",
        Duration::from_secs(30),
        || async {
            match services
                .get_opt("proxy-entrypoint")
                .await
                .map_err(|e| e.to_string())?
            {
                Some(s) if s.metadata.uid != before.metadata.uid => Ok(()),
                _ => Err("not (re-)created".into()),
            }
        },
    )
    .await;

    // OCM's TLS profile: TLS 1.3 only. The proxy-servers roll with the
    // flags, refuse a TLS 1.2 client, and still carry every cluster.
    let replica = replica_client_addr(env.summary.hub_addr, 0);
    let before = tokio::task::spawn_blocking(move || tls12_handshake(replica))
        .await
        .unwrap();
    assert!(
        !before.contains("ProtocolVersion") && before.contains("certificate"),
        "without a profile TLS 1.2 is spoken (this client trusts no CA): {before}"
    );
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    configmaps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "ocm-tls-profile", "namespace": ADDON_NAMESPACE},
                "data": {"minTLSVersion": "VersionTLS13",
                    "cipherSuites": "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    wait_for(
        "a TLS 1.2 client refused by the rolled proxy-server",
        READY,
        || async {
            let refusal = tokio::task::spawn_blocking(move || tls12_handshake(replica))
                .await
                .map_err(|e| e.to_string())?;
            if refusal.contains("ProtocolVersion") {
                Ok(())
            } else {
                Err(refusal)
            }
        },
    )
    .await;
    if let Err(err) = env.wait_clusters_ready(&names, 3, READY).await {
        dump_logs(&env);
        panic!("{err}");
    }
    let client = env.hub_client().unwrap();
    wait_for("a cluster reached over TLS 1.3", READY, || async {
        control_plane::reachable(&client, replica, &names[0]).await
    })
    .await;

    // An AddOnDeploymentConfig for cluster-a.
    let cluster = names[0].clone();
    let adcs: Api<cluster_proxy_proto::api::addon::v1alpha1::AddOnDeploymentConfig> =
        Api::namespaced(admin.clone(), &cluster);
    adcs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "AddOnDeploymentConfig",
            "metadata": {"name": "proxy-placement", "namespace": cluster},
            "spec": {
                "nodePlacement": {
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "tolerations": [{"key": "node-role.kubernetes.io/infra", "operator": "Exists", "effect": "NoSchedule"}],
                },
                "proxyConfig": {"httpsProxy": "https://proxy.example:3128", "noProxy": "10.0.0.0/8"},
            },
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let addons: Api<ManagedClusterAddOn> = Api::namespaced(admin.clone(), &cluster);
    addons
        .patch(
            ADDON_NAME,
            &PatchParams::apply("cluster-admin"),
            &Patch::Apply(json!({
                "apiVersion": "addon.open-cluster-management.io/v1alpha1",
                "kind": "ManagedClusterAddOn",
                "metadata": {"name": ADDON_NAME, "namespace": cluster},
                "spec": {"configs": [{"group": "addon.open-cluster-management.io",
                    "resource": "addondeploymentconfigs", "name": "proxy-placement",
                    "namespace": cluster}]},
            })),
        )
        .await
        .unwrap();
    let works: Api<ManifestWork> = Api::namespaced(admin.clone(), &cluster);
    wait_for(
        "ADC placement and proxy in the agent Deployment",
        READY,
        || async {
            let work = works
                .get(AGENT_WORK_NAME)
                .await
                .map_err(|e| e.to_string())?;
            let deployment = work
                .spec
                .workload
                .iter()
                .flat_map(|w| w.manifests.iter().flatten())
                .find(|m| m.kind() == Some("Deployment") && m.name() == Some(AGENT_DEPLOYMENT))
                .ok_or("no agent Deployment in the work")?
                .0
                .clone();
            let pod = &deployment["spec"]["template"]["spec"];
            let selector_ok = pod["nodeSelector"]["kubernetes.io/os"] == "linux";
            let toleration_ok = pod["tolerations"].as_array().is_some_and(|t| {
                t.iter()
                    .any(|t| t["key"] == "node-role.kubernetes.io/infra")
            });
            let env_ok = pod["containers"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| {
                    c["name"] == "proxy-agent"
                        && c["env"].as_array().is_some_and(|e| {
                            e.iter().any(|v| {
                                v["name"] == "HTTPS_PROXY"
                                    && v["value"] == "https://proxy.example:3128"
                            }) && e.iter().any(|v| v["name"] == "NO_PROXY")
                        })
                })
            });
            if selector_ok && toleration_ok && env_ok {
                Ok(())
            } else {
                Err(format!("pod spec: {pod}"))
            }
        },
    )
    .await;
    env.shutdown().await;
}

/// A managed cluster cannot get an agent certificate for another cluster:
/// a CSR for cluster-a's addon made with cluster-b's registration identity
/// is never approved (nor signed), while cluster-a's own was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_csr_from_another_clusters_identity_is_never_approved() {
    let env = start(options(2)).await;
    let api = env.kube_api.as_ref().unwrap();
    let kubeconfig = api
        .kubeconfig_for(
            "system:open-cluster-management:cluster-b:registration-agent",
            &[
                "system:open-cluster-management:cluster-b",
                "system:open-cluster-management:managed-clusters",
            ],
        )
        .unwrap();
    let as_b = memory_apiserver::KubeApi::client_from(&kubeconfig)
        .await
        .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        "open-cluster-management:cluster-proxy:proxy-agent",
    );
    params.distinguished_name.push(
        rcgen::DnType::OrganizationName,
        "open-cluster-management:cluster-proxy",
    );
    let request = params.serialize_request(&key).unwrap().pem().unwrap();
    use base64::Engine;
    let csrs: Api<CertificateSigningRequest> = Api::all(as_b);
    let spoof = csrs
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "spoofed-cluster-a", "labels": {
                    "open-cluster-management.io/cluster-name": "cluster-a",
                    "open-cluster-management.io/addon-name": ADDON_NAME,
                }},
                "spec": {
                    "signerName": "open-cluster-management.io/proxy-agent-signer",
                    "request": base64::engine::general_purpose::STANDARD.encode(request),
                    "usages": ["digital signature", "key encipherment", "client auth"],
                },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(spoof.metadata.name.as_deref(), Some("spoofed-cluster-a"));
    // A legitimate CSR made after the spoofed one is approved and signed:
    // when a new cluster is fully Available, the controllers have looked at
    // the spoofed CSR too.
    let admin = env.admin_client().await.unwrap();
    control_plane::join(&admin, "cluster-late").await.unwrap();
    env.wait_clusters_ready(&["cluster-late".to_string()], 2, READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let spoof = csrs.get("spoofed-cluster-a").await.unwrap();
    let conditions = spoof
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    assert!(
        !conditions.iter().any(|c| c.type_ == "Approved"),
        "the spoofed CSR was approved: {conditions:?}"
    );
    assert!(
        spoof
            .status
            .as_ref()
            .and_then(|s| s.certificate.as_ref())
            .is_none(),
        "the spoofed CSR was signed"
    );
    env.shutdown().await;
}

/// How a TLS 1.2-only client's handshake with `addr` ends: the error text,
/// which names the alert (`ProtocolVersion` from a TLS 1.3-only server; a
/// certificate error from one that speaks 1.2, as this client trusts no CA).
fn tls12_handshake(addr: std::net::SocketAddr) -> String {
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS12])
    .expect("TLS 1.2 is a valid version")
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("a valid name");
    let mut connection = match rustls::ClientConnection::new(std::sync::Arc::new(config), name) {
        Ok(connection) => connection,
        Err(error) => return error.to_string(),
    };
    let mut tcp = match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(tcp) => tcp,
        Err(error) => return format!("connect: {error}"),
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
    while connection.is_handshaking() {
        if let Err(error) = connection.complete_io(&mut tcp) {
            return error.to_string();
        }
    }
    "the handshake completed".to_owned()
}

/// Regression (found on a real hub, 2026-12-01): the chart ran addon-manager
/// as ServiceAccount `cluster-proxy`, the name of the proxy-server
/// ServiceAccount addon-manager itself applies (owned by the MPC) in the same
/// namespace. Deleting the MPC garbage-collected addon-manager's own account,
/// its token stopped authenticating (401), and a new MPC was never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn addon_manager_serves_a_new_mpc_after_the_old_one_is_deleted() {
    let env = start(options(1)).await;
    let admin = env.admin_client().await.unwrap();
    let mpcs: Api<ManagedProxyConfiguration> = Api::all(admin.clone());
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    let mut mpc = serde_json::to_value(mpcs.get("cluster-proxy").await.unwrap()).unwrap();
    mpcs.delete("cluster-proxy", &Default::default())
        .await
        .unwrap();
    wait_for("the proxy-servers go with their MPC", READY, || async {
        match deployments.get_opt("cluster-proxy").await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let metadata = mpc["metadata"].take();
    mpc["metadata"] = json!({"name": metadata["name"]});
    mpc.as_object_mut().unwrap().remove("status");
    mpcs.create(
        &PostParams::default(),
        &serde_json::from_value(mpc).unwrap(),
    )
    .await
    .unwrap();
    wait_for("addon-manager serves the new MPC", READY, || async {
        match deployments.get_opt("cluster-proxy").await {
            Ok(Some(_)) => Ok(()),
            other => Err(format!("{other:?}\n{}", env.logs.tail("addon-manager", 5))),
        }
    })
    .await;
}

//! cert-authority's `kubernetes` backend for real: two replicas against the
//! in-memory Kubernetes API — one leads, the Secrets appear, an agent's
//! approved CSR is signed with its cluster's identity, a CSR claiming
//! another cluster fails, and the other replica takes over when the leader
//! stops.

use std::time::Duration;

use cert_authority::kubernetes::{self, KubeOptions, LEASE_NAME, csr::SIGNER_NAME};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Api;
use kube::api::PostParams;
use memory_apiserver::{KubeApi, KubeApiOptions};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::json;
use simulated_cluster::wait::eventually;
use tokio::sync::oneshot;

/// How long a test waits for an observable state.
const WAIT: Duration = Duration::from_secs(20);

const NS: &str = "open-cluster-management-addon";

fn replica(
    client: kube::Client,
    name: &str,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>, String) {
    let mut options = KubeOptions::new(NS);
    options.identity = name.to_string();
    options.renew_every = Duration::from_millis(200);
    options.lease_duration = Duration::from_secs(2);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        kubernetes::run(client, options, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    (stop, task, name.to_string())
}

fn request(common_name: &str, uri: Option<&str>) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    if let Some(uri) = uri {
        params
            .subject_alt_names
            .push(rcgen::SanType::URI(uri.to_string().try_into().unwrap()));
    }
    params.serialize_request(&key).unwrap().pem().unwrap()
}

async fn submit_and_approve(api: &KubeApi, name: &str, pem: &str) {
    let agent_config = api
        .kubeconfig_for(
            "system:open-cluster-management:cluster-a:addon-agent",
            &[
                "system:open-cluster-management:cluster-a",
                "system:authenticated",
            ],
        )
        .unwrap();
    let agent = KubeApi::client_from(&agent_config).await.unwrap();
    let csrs: Api<CertificateSigningRequest> = Api::all(agent);
    let csr: CertificateSigningRequest = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"open-cluster-management.io/cluster-name": "cluster-a"}},
        "spec": {"request": base64(pem), "signerName": SIGNER_NAME, "usages": ["client auth"]}
    }))
    .unwrap();
    csrs.create(&PostParams::default(), &csr).await.unwrap();
    let admin: Api<CertificateSigningRequest> = Api::all(api.client().await.unwrap());
    let approval = json!({"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Approved", "status": "True", "reason": "AutoApproved", "message": "hub accepts cluster-a"}]}});
    admin
        .replace_subresource("approval", name, &PostParams::default(), &approval)
        .await
        .unwrap();
}

/// The in-memory API with the addon namespace, and an admin client.
async fn api_with_addon_namespace() -> (KubeApi, kube::Client, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(KubeApiOptions::new(dir.path()))
        .await
        .unwrap();
    let admin = api.client().await.unwrap();
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap();
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    (api, admin, dir)
}

fn base64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

async fn certificate_of(csrs: &Api<CertificateSigningRequest>, name: &str) -> Option<Vec<u8>> {
    csrs.get(name)
        .await
        .ok()?
        .status?
        .certificate
        .map(|c| c.0)
        .filter(|c| !c.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_one_leader_secrets_and_signed_agent_certificates() {
    let (api, admin, _dir) = api_with_addon_namespace().await;

    let (stop_a, task_a, a) = replica(api.client().await.unwrap(), "replica-a");
    let (stop_b, task_b, b) = replica(api.client().await.unwrap(), "replica-b");

    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    for name in [
        "cluster-proxy-signer",
        "proxy-server-ca",
        "proxy-server",
        "agent-server",
        "proxy-client",
    ] {
        eventually(name, WAIT, || async {
            secrets.get_opt(name).await.unwrap()
        })
        .await;
    }
    let leaf = secrets.get("proxy-server").await.unwrap();
    assert_eq!(leaf.type_.as_deref(), Some("kubernetes.io/tls"));
    let managers = leaf.metadata.managed_fields.unwrap_or_default();
    assert!(
        managers
            .iter()
            .any(|m| m.manager.as_deref() == Some(kubernetes::FIELD_MANAGER))
    );

    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    let holder = eventually("a leader", WAIT, || async {
        leases
            .get_opt(LEASE_NAME)
            .await
            .unwrap()?
            .spec?
            .holder_identity
    })
    .await;
    assert!(holder == a || holder == b, "{holder}");

    // An agent's approved CSR gets a certificate naming its cluster,
    // trusted by the published bundle.
    submit_and_approve(&api, "agent-1", &request("anything", None)).await;
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let pem = eventually("a signed certificate", WAIT, || {
        certificate_of(&csrs, "agent-1")
    })
    .await;
    let der = CertificateDer::from_pem_slice(&pem).unwrap();
    let cluster = cert_authority::peer::cluster_of(&der).unwrap().unwrap();
    assert_eq!(cluster.as_str(), "cluster-a");
    let bundle = secrets.get("proxy-server-ca").await.unwrap().data.unwrap()["ca.crt"]
        .0
        .clone();
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    let (_, ca) = x509_parser::pem::parse_x509_pem(&bundle).unwrap();
    cert.verify_signature(Some(ca.parse_x509().unwrap().public_key()))
        .unwrap();

    // One from cluster-a claiming cluster-b fails, with the reason.
    let uri = "spiffe://cluster-proxy.open-cluster-management.io/cluster/cluster-b";
    submit_and_approve(&api, "agent-spoof", &request("x", Some(uri))).await;
    let reason = eventually("a Failed condition", WAIT, || async {
        let conditions = csrs.get("agent-spoof").await.ok()?.status?.conditions?;
        conditions
            .into_iter()
            .find(|c| c.type_ == "Failed")
            .and_then(|c| c.reason)
    })
    .await;
    assert_eq!(reason, "ClusterMismatch");
    assert!(certificate_of(&csrs, "agent-spoof").await.is_none());

    // The leader stops (releasing its lease); the other one takes over and
    // signs from then on.
    let (stop_leader, leader_task, survivor) = if holder == a {
        (stop_a, task_a, b.clone())
    } else {
        (stop_b, task_b, a.clone())
    };
    let _ = stop_leader.send(());
    leader_task.await.unwrap();
    eventually("a new leader", WAIT, || async {
        let now = leases
            .get_opt(LEASE_NAME)
            .await
            .unwrap()?
            .spec?
            .holder_identity?;
        (now == survivor).then_some(())
    })
    .await;
    submit_and_approve(&api, "agent-2", &request("anything", None)).await;
    eventually("a certificate from the new leader", WAIT, || {
        certificate_of(&csrs, "agent-2")
    })
    .await;
}

fn bundle_size(secret: &Secret) -> usize {
    let bundle = &secret.data.as_ref().unwrap()["ca.crt"].0;
    String::from_utf8_lossy(bundle)
        .matches("BEGIN CERTIFICATE")
        .count()
}

/// A CA rollover keeps the old CA in the bundle while an agent certificate
/// it signed through a CSR is still valid — the authority does not hold
/// those certificates, so it asks the API which exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_ca_stays_trusted_while_csr_signed_agent_certificates_need_it() {
    use cert_authority::kubernetes::{csr, secrets};
    use std::sync::Arc;
    let day = time::Duration::days(1);
    let (api, admin, _dir) = api_with_addon_namespace().await;
    let mut options = KubeOptions::new(NS);
    options.rollover_policy.ca_validity = Duration::from_secs(10 * 86400);
    options.rollover_policy.prepare_before_expiry = Duration::from_secs(6 * 86400);
    options.rollover_policy.bundle_propagation = Duration::from_secs(86400);
    options.leaf_policy.validity = Duration::from_secs(8 * 86400);
    let desired = options.desired();
    let secrets_api: Api<Secret> = Api::namespaced(admin.clone(), NS);
    let t0 = time::OffsetDateTime::now_utc();
    secrets::reconcile_secrets(&admin, &options, &desired, t0)
        .await
        .unwrap();

    // An agent certificate from the first CA, valid for 8 days.
    submit_and_approve(&api, "agent-old-ca", &request("x", None)).await;
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let signer_secret = secrets_api.get("cluster-proxy-signer").await.unwrap();
    let data = signer_secret.data.unwrap();
    let text = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
    let first_ca =
        cert_authority::pki::Authority::from_pem(&text("ca.crt"), &text("ca.key")).unwrap();
    let pending = csrs.get("agent-old-ca").await.unwrap();
    let decision = csr::reconcile_csr(
        &csrs,
        Arc::new(pending),
        &first_ca,
        options.leaf_policy.validity,
        t0,
    )
    .await
    .unwrap();
    assert!(
        matches!(decision, csr::Decision::Sign { .. }),
        "{decision:?}"
    );

    // Day 4: the next CA is published; day 5: signing switches; day 6 the
    // old CA would normally go, but the agent certificate lives to day 8.
    for (at, expected) in [(4, 2), (5, 2), (6, 2), (7, 2)] {
        secrets::reconcile_secrets(
            &admin,
            &options,
            &desired,
            t0 + day * at + time::Duration::minutes(1),
        )
        .await
        .unwrap();
        let bundle = secrets_api.get("proxy-server-ca").await.unwrap();
        assert_eq!(bundle_size(&bundle), expected, "day {at}");
    }
    // Day 8.1: that certificate has expired; the old CA is retired.
    secrets::reconcile_secrets(
        &admin,
        &options,
        &desired,
        t0 + day * 8 + time::Duration::hours(3),
    )
    .await
    .unwrap();
    let bundle = secrets_api.get("proxy-server-ca").await.unwrap();
    assert_eq!(bundle_size(&bundle), 1);
}

/// Every request a client made, as `(method, path?query)`.
type RequestLog = std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>;

/// A client of `api` as the administrator, identified as cert-authority,
/// recording every request it makes.
async fn recording_client(api: &KubeApi) -> (kube::Client, RequestLog) {
    let kubeconfig = kube::config::Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    kubernetes::identify(&mut config);
    let log = RequestLog::default();
    let recorder = log.clone();
    let record =
        tower::util::MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
            recorder
                .lock()
                .unwrap()
                .push((request.method().to_string(), request.uri().to_string()));
            request
        });
    let client = kube::client::ClientBuilder::try_from(config)
        .unwrap()
        .with_layer(&record)
        .build();
    (client, log)
}

fn signer_reads(log: &RequestLog) -> usize {
    log.lock()
        .unwrap()
        .iter()
        .filter(|(method, uri)| {
            method == "GET"
                && uri
                    .split('?')
                    .next()
                    .unwrap()
                    .ends_with("/cluster-proxy-signer")
        })
        .count()
}

fn data_of(secret: &Secret, key: &str) -> Vec<u8> {
    secret.data.as_ref().unwrap()[key].0.clone()
}

/// The authority repairs what it keeps at once (the interval here is an
/// hour, so only its watch can do it), never replaces a damaged CA, reads
/// the CA once per pass rather than per CSR, and makes only the requests
/// the documented RBAC rules allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_repaired_at_once_a_damaged_ca_is_kept_and_csrs_cost_no_ca_reads() {
    use kube::api::{DeleteParams, Patch, PatchParams};
    let (api, admin, _dir) = api_with_addon_namespace().await;
    let (client, log) = recording_client(&api).await;
    let mut options = KubeOptions::new(NS);
    options.identity = "replica-a".into();
    options.renew_every = Duration::from_millis(200);
    options.lease_duration = Duration::from_secs(2);
    options.interval = Duration::from_secs(3600);
    let (stop, stopped) = oneshot::channel::<()>();
    let run_options = options.clone();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = kubernetes::metrics::Metrics::register(&mut registry);
    let task = tokio::spawn(async move {
        kubernetes::run_with_metrics(client, run_options, metrics, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });

    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    for name in [
        "cluster-proxy-signer",
        "proxy-server-ca",
        "proxy-server",
        "agent-server",
        "proxy-client",
    ] {
        eventually(name, WAIT, || async {
            secrets.get_opt(name).await.unwrap()
        })
        .await;
    }
    let signer = secrets.get("cluster-proxy-signer").await.unwrap();
    let bundle = data_of(&secrets.get("proxy-server-ca").await.unwrap(), "ca.crt");

    // A deleted Secret is back within seconds.
    let deleted_uid = secrets.get("proxy-server").await.unwrap().metadata.uid;
    secrets
        .delete("proxy-server", &DeleteParams::default())
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    eventually("proxy-server re-created", WAIT, || async {
        let found = secrets.get_opt("proxy-server").await.unwrap()?;
        (found.metadata.uid != deleted_uid).then_some(())
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));

    // ca.crt removed: the CA is not replaced, neither by a pass nor by the
    // running authority while a deleted leaf waits to be re-issued.
    secrets
        .patch(
            "cluster-proxy-signer",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"ca.crt": null}})),
        )
        .await
        .unwrap();
    let error = cert_authority::kubernetes::secrets::reconcile_secrets(
        &admin,
        &options,
        &options.desired(),
        time::OffsetDateTime::now_utc(),
    )
    .await
    .unwrap_err();
    assert!(error.is_damaged_signer(), "{error}");
    // The running authority says so on the Secret, and writes nothing.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), NS);
    let note = eventually("a SignerDamaged Event", WAIT, || async {
        events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("SignerDamaged")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                        == Some("cluster-proxy-signer")
            })?
            .note
    })
    .await;
    assert!(note.contains("ca.crt"), "{note}");
    secrets
        .delete("agent-server", &DeleteParams::default())
        .await
        .unwrap();
    // Restored by hand: the authority carries on with the very same CA.
    let ca_crt = base64(&String::from_utf8(data_of(&signer, "ca.crt")).unwrap());
    secrets
        .patch(
            "cluster-proxy-signer",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"ca.crt": ca_crt}})),
        )
        .await
        .unwrap();
    let agent_server = eventually("agent-server re-created", WAIT, || async {
        secrets.get_opt("agent-server").await.unwrap()
    })
    .await;
    let now_signer = secrets.get("cluster-proxy-signer").await.unwrap();
    for key in ["ca.crt", "ca.key"] {
        assert_eq!(data_of(&now_signer, key), data_of(&signer, key), "{key}");
    }
    assert_eq!(
        data_of(&secrets.get("proxy-server-ca").await.unwrap(), "ca.crt"),
        bundle
    );
    let leaf = CertificateDer::from_pem_slice(&data_of(&agent_server, "tls.crt")).unwrap();
    let (_, leaf) = x509_parser::parse_x509_certificate(&leaf).unwrap();
    let (_, ca) = x509_parser::pem::parse_x509_pem(&bundle).unwrap();
    leaf.verify_signature(Some(ca.parse_x509().unwrap().public_key()))
        .unwrap();

    // 1,000 CSRs for other signers, then one of ours: signed, and the CA
    // was not read per CSR (at most a pass still settling from the writes
    // above reads it).
    let reads_before = signer_reads(&log);
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let pem = request("x", None);
    for i in 0..1000 {
        let other: CertificateSigningRequest = serde_json::from_value(json!({
            "metadata": {"name": format!("other-{i}")},
            "spec": {"request": base64(&pem), "signerName": "example.com/other", "usages": ["client auth"]}
        }))
        .unwrap();
        csrs.create(&PostParams::default(), &other).await.unwrap();
    }
    submit_and_approve(&api, "agent-after-others", &request("anything", None)).await;
    eventually("a signed certificate", WAIT, || {
        certificate_of(&csrs, "agent-after-others")
    })
    .await;
    let reads = signer_reads(&log) - reads_before;
    assert!(reads <= 2, "{reads} reads of the signer Secret");

    let mut exported = String::new();
    prometheus_client::encoding::text::encode(&mut exported, &registry).unwrap();
    for line in [
        "cert_authority_leader 1",
        r#"cert_authority_csr_decisions_total{decision="signed",reason=""} 1"#,
        r#"cert_authority_renewals_total{what="CA",reason="created"} 1"#,
        r#"cert_authority_renewals_total{what="proxy-server",reason="missing"} 2"#,
    ] {
        assert!(
            exported.lines().any(|l| l.starts_with(line)),
            "{line} missing from\n{exported}"
        );
    }

    let _ = stop.send(());
    task.await.unwrap();

    let log = log.lock().unwrap();
    for (method, uri) in log.iter() {
        cert_authority::kubernetes::rbac::check(method, uri).unwrap();
        if uri.contains("certificatesigningrequests") && method == "GET" {
            assert!(
                uri.contains("fieldSelector=spec.signerName"),
                "unfiltered CSR request {uri}"
            );
        }
    }
}

/// Regression (a real hub, 2026-12-01): `helm uninstall` deletes
/// cert-authority's ServiceAccount and RBAC with its Deployment, so the
/// leader Lease can no longer be released when SIGTERM comes; cert-authority
/// then exited with an error (addon-manager and health-prober only warn).
/// The Lease expires on its own: shutting down is still a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_it_can_no_longer_release_does_not_fail_the_shutdown() {
    use k8s_openapi::api::core::v1::ServiceAccount;
    let (api, admin, _dir) = api_with_addon_namespace().await;
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    accounts
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "cert-authority"}})).unwrap(),
        )
        .await
        .unwrap();
    let kubeconfig = api
        .kubeconfigs(None)
        .write_service_account(NS, "cert-authority")
        .unwrap();
    let client = KubeApi::client_from(&kubeconfig).await.unwrap();
    let mut options = KubeOptions::new(NS);
    options.identity = "only".to_string();
    options.renew_every = Duration::from_millis(200);
    options.lease_duration = Duration::from_secs(2);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(kubernetes::run(client, options, async {
        let _ = stopped.await;
    }));
    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    eventually("cert-authority leads", WAIT, || async {
        leases
            .get_opt(LEASE_NAME)
            .await
            .unwrap()
            .and_then(|lease| lease.spec?.holder_identity)
            .filter(|holder| holder == "only")
    })
    .await;
    // Its account goes (uninstall): its token no longer authenticates.
    accounts
        .delete("cert-authority", &Default::default())
        .await
        .unwrap();
    stop.send(()).unwrap();
    let result = tokio::time::timeout(WAIT, task)
        .await
        .expect("cert-authority stops")
        .expect("cert-authority does not panic");
    assert!(result.is_ok(), "shutdown failed: {result:?}");
}

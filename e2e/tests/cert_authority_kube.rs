//! cert-authority's `kubernetes` backend for real: two replicas against the
//! in-memory Kubernetes API — one leads, the Secrets appear, an agent's
//! approved CSR is signed with its cluster's identity, a CSR claiming
//! another cluster fails, and the other replica takes over when the leader
//! stops.

use std::time::Duration;

use cert_authority::kubernetes::{self, KubeOptions, LEASE_NAME, csr::SIGNER_NAME};
use e2e::kubeapi::{KubeApi, KubeApiOptions};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Api;
use kube::api::PostParams;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::json;
use tokio::sync::oneshot;

const NS: &str = "open-cluster-management-addon";

async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

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
        eventually(name, || async { secrets.get_opt(name).await.unwrap() }).await;
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
    let holder = eventually("a leader", || async {
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
    let pem = eventually("a signed certificate", || certificate_of(&csrs, "agent-1")).await;
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
    let reason = eventually("a Failed condition", || async {
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
    eventually("a new leader", || async {
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
    eventually("a certificate from the new leader", || {
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

//! The `kubernetes` backend against a scripted API (kube's tower-test mock,
//! as kube-rs controller-rs does it) and the CSR rules on their own.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cert_authority::kubernetes::csr::{self, CLUSTER_LABEL, Decision, SIGNER_NAME};
use cert_authority::kubernetes::{KubeOptions, secrets};
use cert_authority::peer::cluster_of;
use cert_authority::pki::Authority;
use http::{Request, Response};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::Client;
use kube::client::Body;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use time::OffsetDateTime;

const CLUSTER_A_USER: &str = "system:open-cluster-management:cluster-a:agent-7xq2";
const CLUSTER_A_GROUP: &str = "system:open-cluster-management:cluster-a";

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

fn ec_request(common_name: &str, uri_san: Option<&str>) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    if let Some(uri) = uri_san {
        params
            .subject_alt_names
            .push(rcgen::SanType::URI(uri.to_string().try_into().unwrap()));
    }
    params.serialize_request(&key).unwrap().pem().unwrap()
}

fn csr(
    request_pem: &str,
    signer: &str,
    user: &str,
    groups: &[&str],
    conditions: &[&str],
) -> CertificateSigningRequest {
    let conditions: Vec<Value> = conditions
        .iter()
        .map(|t| json!({"type": t, "status": "True", "reason": "Test", "message": "test"}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": "addon-cluster-a-proxy", "labels": {CLUSTER_LABEL: "cluster-a"}},
        "spec": {
            "request": base64_text(request_pem),
            "signerName": signer,
            "usages": ["client auth", "digital signature"],
            "username": user,
            "groups": groups,
        },
        "status": {"conditions": conditions},
    }))
    .unwrap()
}

fn base64_text(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

fn ca() -> Authority {
    Authority::generate("test-ca", Duration::from_secs(86400)).unwrap()
}

fn approved(request_pem: &str) -> CertificateSigningRequest {
    csr(
        request_pem,
        SIGNER_NAME,
        CLUSTER_A_USER,
        &[CLUSTER_A_GROUP, "system:authenticated"],
        &["Approved"],
    )
}

fn refusal(decision: Decision) -> &'static str {
    match decision {
        Decision::Refuse { reason, .. } => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_good_request_gets_a_certificate_naming_the_requesters_cluster() {
    let ca = ca();
    let validity = Duration::from_secs(3600);
    let at = now();
    // The CSR asks for nothing in particular; the identity comes from the requester.
    let decision = csr::decide(&approved(&ec_request("whatever", None)), &ca, validity, at);
    let Decision::Sign {
        cluster,
        certificate_pem,
    } = decision
    else {
        panic!("not signed: {decision:?}");
    };
    assert_eq!(cluster.as_str(), "cluster-a");
    let der = CertificateDer::from_pem_slice(certificate_pem.as_bytes()).unwrap();
    assert_eq!(cluster_of(&der).unwrap().unwrap().as_str(), "cluster-a");
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    let (_, ca_cert) = x509_parser::pem::parse_x509_pem(ca.cert_pem().as_bytes()).unwrap();
    let ca_cert = ca_cert.parse_x509().unwrap();
    assert_eq!(cert.issuer(), ca_cert.subject());
    cert.verify_signature(Some(ca_cert.public_key())).unwrap();
    let not_after = cert.validity().not_after.timestamp();
    assert!(
        (not_after - (at.unix_timestamp() + 3600)).abs() <= 2,
        "validity"
    );
    assert!(!cert.is_ca());
    // RSA 2048 is fine too, with an OCM user name as CN.
    let rsa = std::fs::read_to_string("tests/fixtures/rsa2048.csr").unwrap();
    assert!(matches!(
        csr::decide(&approved(&rsa), &ca, validity, at),
        Decision::Sign { .. }
    ));
}

#[test]
fn requests_that_are_not_ours_or_not_ready_are_left_alone() {
    let ca = ca();
    let pem = ec_request("x", None);
    let v = Duration::from_secs(3600);
    let other = csr(
        &pem,
        "kubernetes.io/kube-apiserver-client",
        CLUSTER_A_USER,
        &[CLUSTER_A_GROUP],
        &["Approved"],
    );
    assert_eq!(
        csr::decide(&other, &ca, v, now()),
        Decision::Ignore("another signer")
    );
    let pending = csr(&pem, SIGNER_NAME, CLUSTER_A_USER, &[CLUSTER_A_GROUP], &[]);
    assert_eq!(
        csr::decide(&pending, &ca, v, now()),
        Decision::Ignore("not approved yet")
    );
    let denied = csr(
        &pem,
        SIGNER_NAME,
        CLUSTER_A_USER,
        &[CLUSTER_A_GROUP],
        &["Approved", "Denied"],
    );
    assert_eq!(
        csr::decide(&denied, &ca, v, now()),
        Decision::Ignore("denied or failed")
    );
    let mut signed = approved(&pem);
    signed.status.as_mut().unwrap().certificate = Some(k8s_openapi::ByteString(b"x".to_vec()));
    assert_eq!(
        csr::decide(&signed, &ca, v, now()),
        Decision::Ignore("already signed")
    );
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let ca = ca();
    let v = Duration::from_secs(3600);
    // Not PEM at all.
    assert_eq!(
        refusal(csr::decide(&approved("garbage"), &ca, v, now())),
        "InvalidRequest"
    );
    // A signature that does not verify.
    let pem = ec_request("x", None);
    let mut der = rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec();
    let last = der.len() - 3;
    der[last] ^= 0xff;
    use base64::Engine;
    let tampered = format!(
        "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
        base64::engine::general_purpose::STANDARD.encode(&der)
    );
    assert_eq!(
        refusal(csr::decide(&approved(&tampered), &ca, v, now())),
        "InvalidRequest"
    );
    // A weak key.
    let weak = std::fs::read_to_string("tests/fixtures/rsa1024.csr").unwrap();
    assert_eq!(
        refusal(csr::decide(&approved(&weak), &ca, v, now())),
        "WeakKey"
    );
    // A CSR claiming another cluster than its requester's.
    let uri = "spiffe://cluster-proxy.open-cluster-management.io/cluster/cluster-b";
    assert_eq!(
        refusal(csr::decide(
            &approved(&ec_request("x", Some(uri))),
            &ca,
            v,
            now()
        )),
        "ClusterMismatch"
    );
    let cn = ec_request("cluster-proxy-agent:cluster-b", None);
    assert_eq!(
        refusal(csr::decide(&approved(&cn), &ca, v, now())),
        "ClusterMismatch"
    );
    // A label naming another cluster.
    let mut labelled = approved(&pem);
    labelled.metadata.labels = Some([(CLUSTER_LABEL.to_string(), "cluster-b".to_string())].into());
    assert_eq!(
        refusal(csr::decide(&labelled, &ca, v, now())),
        "ClusterMismatch"
    );
    // A requester that is no managed cluster, or not in its cluster's group.
    let stranger = csr(
        &pem,
        SIGNER_NAME,
        "alice",
        &["system:authenticated"],
        &["Approved"],
    );
    assert_eq!(
        refusal(csr::decide(&stranger, &ca, v, now())),
        "RequesterNotAManagedCluster"
    );
    let no_group = csr(
        &pem,
        SIGNER_NAME,
        CLUSTER_A_USER,
        &["system:open-cluster-management:cluster-b"],
        &["Approved"],
    );
    assert_eq!(
        refusal(csr::decide(&no_group, &ca, v, now())),
        "RequesterNotAManagedCluster"
    );
}

/// A scripted API server: answers GETs from its object map (404 when
/// absent), stores what is server-side applied, and records every request.
#[derive(Clone, Default)]
struct ScriptedApi {
    objects: Arc<Mutex<BTreeMap<String, Value>>>,
    log: Arc<Mutex<Vec<(String, String, String)>>>,
}

impl ScriptedApi {
    fn client(&self) -> Client {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let api = self.clone();
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let method = request.method().to_string();
                let uri = request.uri().to_string();
                let path = request.uri().path().to_string();
                let content_type = request
                    .headers()
                    .get("content-type")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let body = request.into_body().collect_bytes().await.unwrap();
                api.log
                    .lock()
                    .unwrap()
                    .push((method.clone(), uri.clone(), content_type.clone()));
                let (status, reply) = match method.as_str() {
                    "GET" => match api.objects.lock().unwrap().get(&path) {
                        Some(object) => (200, object.clone()),
                        None => (
                            404,
                            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                             "reason": "NotFound", "code": 404, "message": "not found"}),
                        ),
                    },
                    "PATCH" => {
                        assert_eq!(content_type, "application/apply-patch+yaml", "{uri}");
                        assert!(
                            uri.contains("fieldManager=cluster-proxy-cert-authority"),
                            "{uri}"
                        );
                        assert!(uri.contains("force=true"), "{uri}");
                        let mut object: Value = serde_json::from_slice(&body).unwrap();
                        object["metadata"]["resourceVersion"] = json!("1");
                        let key = path.trim_end_matches("/status").to_string();
                        api.objects.lock().unwrap().insert(key, object.clone());
                        (200, object)
                    }
                    other => panic!("unexpected {other} {uri}"),
                };
                send.send_response(
                    Response::builder()
                        .status(status)
                        .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                        .unwrap(),
                );
            }
        });
        Client::new(service, "default")
    }

    fn applied(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, _, _)| m == "PATCH")
            .map(|(_, uri, _)| uri.split('?').next().unwrap().to_string())
            .collect()
    }

    fn clear_log(&self) {
        self.log.lock().unwrap().clear();
    }
}

const NS: &str = "/api/v1/namespaces/open-cluster-management-addon/secrets";

#[tokio::test]
async fn secrets_are_created_kept_and_renewed() {
    let api = ScriptedApi::default();
    let client = api.client();
    let options = KubeOptions::new("open-cluster-management-addon");
    let desired = options.desired();
    let start = now();

    // An empty cluster: the CA, the bundle and the three leaves appear.
    let report = secrets::reconcile_secrets(&client, &options, &desired, start)
        .await
        .unwrap();
    let mut applied = api.applied();
    applied.sort();
    let expected: Vec<String> = [
        "agent-server",
        "cluster-proxy-signer",
        "proxy-client",
        "proxy-server",
        "proxy-server-ca",
    ]
    .iter()
    .map(|n| format!("{NS}/{n}"))
    .collect();
    assert_eq!(applied, expected);
    assert!(report.renewed.iter().any(|r| r.contains("CA")));
    let objects = api.objects.lock().unwrap().clone();
    let leaf = &objects[&format!("{NS}/proxy-server")];
    assert_eq!(leaf["type"], "kubernetes.io/tls");
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(leaf["data"][key].is_string(), "{key} missing");
    }
    assert!(objects[&format!("{NS}/cluster-proxy-signer")]["data"]["ca.key"].is_string());

    // Everything current: reads only.
    api.clear_log();
    secrets::reconcile_secrets(
        &client,
        &options,
        &desired,
        start + time::Duration::hours(1),
    )
    .await
    .unwrap();
    assert_eq!(api.applied(), Vec::<String>::new());

    // Past 2/3 of the leaves' 90 days: the three leaves (not the CA) again.
    api.clear_log();
    let later = start + time::Duration::days(61);
    let report = secrets::reconcile_secrets(&client, &options, &desired, later)
        .await
        .unwrap();
    let mut applied = api.applied();
    applied.sort();
    let leaves: Vec<String> = ["agent-server", "proxy-client", "proxy-server"]
        .iter()
        .map(|n| format!("{NS}/{n}"))
        .collect();
    assert_eq!(applied, leaves, "{report:?}");
}

#[tokio::test]
async fn csrs_are_signed_or_refused_through_the_status_subresource() {
    let api = ScriptedApi::default();
    let client = api.client();
    let csrs: kube::Api<CertificateSigningRequest> = kube::Api::all(client);
    let ca = ca();
    let v = Duration::from_secs(3600);

    let good = Arc::new(approved(&ec_request("x", None)));
    let decision = csr::reconcile_csr(&csrs, good, &ca, v, now())
        .await
        .unwrap();
    assert!(matches!(decision, Decision::Sign { .. }));
    let path = "/apis/certificates.k8s.io/v1/certificatesigningrequests/addon-cluster-a-proxy";
    assert_eq!(api.applied(), [format!("{path}/status")]);
    let stored = api.objects.lock().unwrap()[path].clone();
    assert!(stored["status"]["certificate"].is_string());

    // Another signer: not a single request.
    api.clear_log();
    let other = Arc::new(csr(
        &ec_request("x", None),
        "example.com/other",
        CLUSTER_A_USER,
        &[CLUSTER_A_GROUP],
        &["Approved"],
    ));
    csr::reconcile_csr(&csrs, other, &ca, v, now())
        .await
        .unwrap();
    assert!(api.log.lock().unwrap().is_empty());

    // Claiming cluster-b from cluster-a: a Failed condition, Approved kept.
    api.clear_log();
    let uri = "spiffe://cluster-proxy.open-cluster-management.io/cluster/cluster-b";
    let spoof = Arc::new(approved(&ec_request("x", Some(uri))));
    csr::reconcile_csr(&csrs, spoof, &ca, v, now())
        .await
        .unwrap();
    assert_eq!(api.applied(), [format!("{path}/status")]);
    let stored = api.objects.lock().unwrap()[path].clone();
    let conditions = stored["status"]["conditions"].as_array().unwrap().clone();
    assert!(conditions.iter().any(|c| c["type"] == "Approved"));
    let failed = conditions.iter().find(|c| c["type"] == "Failed").unwrap();
    assert_eq!(failed["reason"], "ClusterMismatch");
    assert!(stored["status"].get("certificate").is_none());
}

#[tokio::test]
async fn an_upstream_rsa_ca_is_adopted_not_replaced() {
    use base64::Engine;
    let b64 =
        |path: &str| base64::engine::general_purpose::STANDARD.encode(std::fs::read(path).unwrap());
    let api = ScriptedApi::default();
    api.objects.lock().unwrap().insert(
        format!("{NS}/cluster-proxy-signer"),
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "cluster-proxy-signer", "namespace": "open-cluster-management-addon", "resourceVersion": "1"},
               "data": {"ca.crt": b64("tests/fixtures/upstream-ca.crt"), "ca.key": b64("tests/fixtures/upstream-ca.key")}}),
    );
    let client = api.client();
    let options = KubeOptions::new("open-cluster-management-addon");
    secrets::reconcile_secrets(&client, &options, &options.desired(), now())
        .await
        .unwrap();
    let applied = api.applied();
    assert!(
        !applied.contains(&format!("{NS}/cluster-proxy-signer")),
        "{applied:?}"
    );
    let leaf = api.objects.lock().unwrap()[&format!("{NS}/proxy-server")].clone();
    let pem = base64::engine::general_purpose::STANDARD
        .decode(leaf["data"]["tls.crt"].as_str().unwrap())
        .unwrap();
    let der = CertificateDer::from_pem_slice(&pem).unwrap();
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    assert_eq!(
        cert.issuer().to_string(),
        "CN=open-cluster-management:cluster-proxy"
    );
    let upstream = std::fs::read("tests/fixtures/upstream-ca.crt").unwrap();
    let (_, ca) = x509_parser::pem::parse_x509_pem(&upstream).unwrap();
    cert.verify_signature(Some(ca.parse_x509().unwrap().public_key()))
        .unwrap();
}

#[test]
fn a_shorter_requested_lifetime_is_honoured_within_limits() {
    let ca = ca();
    let validity = Duration::from_secs(90 * 86400);
    let at = now();
    let not_after = |seconds: Option<i32>| {
        let mut request = approved(&ec_request("x", None));
        request.spec.expiration_seconds = seconds;
        let Decision::Sign {
            certificate_pem, ..
        } = csr::decide(&request, &ca, validity, at)
        else {
            panic!("not signed");
        };
        let der = CertificateDer::from_pem_slice(certificate_pem.as_bytes()).unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        cert.validity().not_after.timestamp() - at.unix_timestamp()
    };
    assert!((not_after(Some(3600)) - 3600).abs() <= 2);
    assert!(
        (not_after(Some(60)) - 600).abs() <= 2,
        "10 minutes at least"
    );
    assert!(
        (not_after(Some(i32::MAX)) - 90 * 86400).abs() <= 2,
        "never longer than the policy"
    );
    assert!((not_after(None) - 90 * 86400).abs() <= 2);
}

//! kube-controller-manager's `csrsigning` controller for the
//! `kubernetes.io/kube-apiserver-client` signer: an approved CSR for it gets
//! a client certificate from the API's own CA, which the API accepts as a
//! client certificate (user = CN, groups = O). This is how OCM's
//! registration agent gets an addon's hub kubeconfig on a real hub; without
//! it, nothing here would sign such a CSR and a missing approver would go
//! unnoticed (issue 56: nobody approved the addon-agent's CSR).
//!
//! As the real signer: the CSR must be `Approved` (and neither `Denied` nor
//! `Failed`), its usages must include `client auth` and nothing beyond
//! `digital signature`, `key encipherment` and `client auth` (otherwise a
//! `Failed` condition, reason `SignerValidationFailure`); the subject is
//! kept as requested; the life is `spec.expirationSeconds` (at least 10
//! minutes) capped by the signing duration (a year by default).

use std::sync::Arc;
use std::time::Duration;

use cert_authority::pki::{Authority, LeafRequest, requested_subject};
use serde_json::{Value, json};
use time::OffsetDateTime;
use tokio::sync::{broadcast, watch};
use x509_parser::prelude::{FromDer, X509CertificationRequest};

use super::store::Store;

pub const KUBE_APISERVER_CLIENT: &str = "kubernetes.io/kube-apiserver-client";
const MANAGER: &str = "kube-controller-manager";
/// kube-controller-manager's `--cluster-signing-duration` default.
const SIGNING_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
const ALLOWED_USAGES: [&str; 3] = ["client auth", "digital signature", "key encipherment"];
const RESYNC: Duration = Duration::from_secs(2);

/// Signs until `shutdown`.
pub async fn run(store: Arc<Store>, ca: Arc<Authority>, mut shutdown: watch::Receiver<bool>) {
    let mut events = store.subscribe();
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        tokio::select! {
            received = events.recv() => match received {
                Ok(event) if event.storage_key == CSR_STORAGE && waiting(&event.object) => {
                    // This CSR alone: the others had their own events (a
                    // walk over every CSR per event made a fleet's worth of
                    // CSRs quadratic).
                    let name = event
                        .object
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    let current = store
                        .lookup(CSR_GROUP, CSR_PLURAL, None, name)
                        .filter(|csr| waiting(&csr.object));
                    sign_each(&store, &ca, current.into_iter().collect());
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => sign_pending(&store, &ca),
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = resync.tick() => sign_pending(&store, &ca),
            _ = shutdown.changed() => return,
        }
    }
}

fn condition(csr: &Value, type_: &str) -> bool {
    csr.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|c| {
            c.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some(type_)
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })
        })
}

fn waiting(csr: &Value) -> bool {
    csr.pointer("/spec/signerName").and_then(Value::as_str) == Some(KUBE_APISERVER_CLIENT)
        && condition(csr, "Approved")
        && !condition(csr, "Denied")
        && !condition(csr, "Failed")
        && csr
            .pointer("/status/certificate")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
}

const CSR_GROUP: &str = "certificates.k8s.io";
const CSR_PLURAL: &str = "certificatesigningrequests";
const CSR_STORAGE: &str = "certificates.k8s.io/certificatesigningrequests";

/// Every approved CSR still waiting for its certificate.
fn sign_pending(store: &Store, ca: &Authority) {
    let pending = store.find_in(
        |t| t.group == CSR_GROUP && t.plural == CSR_PLURAL,
        |_, object| waiting(object),
    );
    sign_each(store, ca, pending);
}

fn sign_each(store: &Store, ca: &Authority, pending: Vec<super::store::Located>) {
    for csr in pending {
        let outcome = sign(&csr.object, ca, OffsetDateTime::now_utc());
        let result = store.mutate(&csr.resource, None, &csr.name, MANAGER, |object| {
            let Some(map) = object.as_object_mut() else {
                return;
            };
            let status = map.entry("status").or_insert_with(|| json!({}));
            match &outcome {
                Ok(pem) => status["certificate"] = json!(base64_text(pem.as_bytes())),
                Err(message) => {
                    let now = OffsetDateTime::now_utc()
                        .replace_nanosecond(0)
                        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default();
                    let failed = json!({"type": "Failed", "status": "True",
                        "reason": "SignerValidationFailure", "message": message,
                        "lastUpdateTime": now, "lastTransitionTime": now});
                    match status.get_mut("conditions").and_then(Value::as_array_mut) {
                        Some(conditions) => conditions.push(failed),
                        None => status["conditions"] = json!([failed]),
                    }
                }
            }
        });
        if let Err(error) = result {
            tracing::warn!(csr = %csr.name, %error, "writing a signed CSR failed");
        }
    }
}

fn base64_text(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The certificate for one approved CSR, or why it cannot be signed.
pub fn sign(csr: &Value, ca: &Authority, now: OffsetDateTime) -> Result<String, String> {
    let usages: Vec<&str> = csr
        .pointer("/spec/usages")
        .and_then(Value::as_array)
        .map(|u| u.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if let Some(other) = usages.iter().find(|u| !ALLOWED_USAGES.contains(u)) {
        return Err(format!("invalid usage for client certificate: {other}"));
    }
    if !usages.contains(&"client auth") {
        return Err("missing required usages: client auth".into());
    }
    let request = csr
        .pointer("/spec/request")
        .and_then(Value::as_str)
        .ok_or("spec.request is missing")?;
    let pem = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(request)
            .map_err(|e| format!("spec.request is not base64: {e}"))?
    };
    let pem = String::from_utf8(pem).map_err(|_| "spec.request is not PEM text".to_string())?;
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|e| format!("spec.request is not PEM: {e}"))?;
    let (_, parsed) = X509CertificationRequest::from_der(&block.contents)
        .map_err(|e| format!("spec.request is not a PKCS#10 request: {e}"))?;
    let subject =
        requested_subject(&parsed.certification_request_info.subject).map_err(|e| e.to_string())?;
    let params = rcgen::CertificateSigningRequestParams::from_pem(&pem)
        .map_err(|e| format!("spec.request is not a correctly signed request: {e}"))?;
    let validity = match csr
        .pointer("/spec/expirationSeconds")
        .and_then(Value::as_u64)
    {
        Some(seconds) => SIGNING_DURATION.min(Duration::from_secs(seconds.max(600))),
        None => SIGNING_DURATION,
    };
    ca.sign_request_at(
        params,
        subject,
        &LeafRequest::client("").with_validity(validity),
        now,
    )
    .map_err(|e| e.to_string())
}

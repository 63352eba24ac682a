//! Signing proxy-agent CertificateSigningRequests.
//!
//! A CSR is signed only when its signerName is
//! `open-cluster-management.io/proxy-agent-signer`, it is `Approved` and
//! neither `Denied` nor `Failed`, and it has no certificate yet. The cluster
//! the certificate names comes from the requester the API server
//! authenticated (`spec.username` `system:open-cluster-management:<cluster>:<agent>`
//! with group `system:open-cluster-management:<cluster>`), never from the
//! CSR's own claims; a label or CSR subject naming another cluster is
//! refused. Refusals are final: a `Failed` condition says why, and the CSR
//! is not looked at again.

use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::identity::ClusterName;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509CertificationRequest};
use x509_parser::public_key::PublicKey;

use super::common::{FIELD_MANAGER, KubeError};
use crate::pki::{Authority, LeafRequest};

pub const SIGNER_NAME: &str = "open-cluster-management.io/proxy-agent-signer";
pub const CLUSTER_LABEL: &str = "open-cluster-management.io/cluster-name";
const OCM_USER_PREFIX: &str = "system:open-cluster-management:";

/// Lists and watches only CSRs for our signer: the API server filters, so
/// requests for other signers never reach us.
pub fn own_signer_only() -> ListParams {
    ListParams::default().fields(&own_signer_field_selector())
}

/// The field selector naming our signer (`spec.signerName` is a supported
/// CSR field selector on the API server).
pub fn own_signer_field_selector() -> String {
    format!("spec.signerName={SIGNER_NAME}")
}

/// What to do with a CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not ours to act on (yet): the reason, for logs.
    Ignore(&'static str),
    Sign {
        cluster: ClusterName,
        certificate_pem: String,
    },
    Refuse {
        reason: &'static str,
        message: String,
    },
}

fn refuse(reason: &'static str, message: impl Into<String>) -> Decision {
    Decision::Refuse {
        reason,
        message: message.into(),
    }
}

fn condition(csr: &CertificateSigningRequest, type_: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

/// The cluster of an OCM requester: `system:open-cluster-management:<cluster>:<agent>`
/// in group `system:open-cluster-management:<cluster>`.
pub fn requester_cluster(username: &str, groups: &[String]) -> Result<ClusterName, String> {
    let rest = username
        .strip_prefix(OCM_USER_PREFIX)
        .ok_or_else(|| format!("requester {username:?} is not an OCM managed-cluster identity"))?;
    let (cluster, agent) = rest
        .split_once(':')
        .ok_or_else(|| format!("requester {username:?} names no agent"))?;
    if agent.is_empty() {
        return Err(format!("requester {username:?} names no agent"));
    }
    let cluster = ClusterName::new(cluster).map_err(|e| format!("requester {username:?}: {e}"))?;
    let group = format!("{OCM_USER_PREFIX}{cluster}");
    if !groups.contains(&group) {
        return Err(format!("requester {username:?} is not in group {group:?}"));
    }
    Ok(cluster)
}

/// The cluster an OCM subject name claims, if any:
/// * registration: `system:open-cluster-management:<cluster>:<agent>`, and
///   its group `system:open-cluster-management:<cluster>`;
/// * addon-framework: `system:open-cluster-management:cluster:<cluster>:addon:<addon>[:agent:<agent>]`;
/// * `system:open-cluster-management:addon:<addon>` and
///   `system:open-cluster-management:managed-clusters` name no cluster.
fn ocm_subject_cluster(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(OCM_USER_PREFIX)?;
    let parts: Vec<&str> = rest.split(':').collect();
    match parts.as_slice() {
        ["cluster", cluster, "addon", _, ..] => Some(cluster),
        ["addon", _] | ["managed-clusters"] => None,
        [cluster] | [cluster, _] => Some(cluster),
        // Shapes OCM does not produce claim nothing: the certificate's
        // cluster comes from the requester alone in any case.
        _ => None,
    }
}

/// Clusters a CSR's own subject and SANs claim (our URI SAN, our agent CN,
/// or OCM subject names as CN or organization).
fn claimed_clusters(csr: &X509CertificationRequest<'_>) -> Vec<String> {
    let mut claims = Vec::new();
    let subject = &csr.certification_request_info.subject;
    for cn in subject.iter_common_name() {
        if let Ok(cn) = cn.as_str() {
            if let Some(c) = cn.strip_prefix("cluster-proxy-agent:") {
                claims.push(c.to_string());
            } else if let Some(c) = ocm_subject_cluster(cn) {
                claims.push(c.to_string());
            }
        }
    }
    for organization in subject.iter_organization() {
        if let Ok(organization) = organization.as_str()
            && let Some(c) = ocm_subject_cluster(organization)
        {
            claims.push(c.to_string());
        }
    }
    if let Some(extensions) = csr.requested_extensions() {
        for extension in extensions {
            if let ParsedExtension::SubjectAlternativeName(san) = extension {
                for name in &san.general_names {
                    if let GeneralName::URI(uri) = name {
                        match ClusterName::from_uri(uri) {
                            Ok(Some(c)) => claims.push(c.to_string()),
                            Ok(None) => {}
                            // Our identity scheme with an invalid name
                            // never matches a requester.
                            Err(_) => claims.push((*uri).to_string()),
                        }
                    }
                }
            }
        }
    }
    claims
}

fn key_strength(csr: &X509CertificationRequest<'_>) -> Result<(), String> {
    let spki = &csr.certification_request_info.subject_pki;
    match spki.parsed() {
        Ok(PublicKey::RSA(rsa)) => {
            let bits = rsa.key_size();
            if bits < 2048 {
                Err(format!(
                    "RSA key of {bits} bits; at least 2048 are required"
                ))
            } else {
                Ok(())
            }
        }
        Ok(PublicKey::EC(point)) => {
            let curve = spki
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .map(|oid| oid.to_id_string())
                .unwrap_or_default();
            match curve.as_str() {
                // P-256, P-384
                "1.2.840.10045.3.1.7" | "1.3.132.0.34" => Ok(()),
                other => Err(format!(
                    "EC key on curve {other:?} ({} bits); P-256 or P-384 is required",
                    point.key_size()
                )),
            }
        }
        Ok(PublicKey::Unknown(_)) if spki.algorithm.algorithm.to_id_string() == "1.3.101.112" => {
            Ok(()) // Ed25519
        }
        Ok(_) => Err(format!(
            "unsupported key algorithm {}",
            spki.algorithm.algorithm.to_id_string()
        )),
        Err(e) => Err(format!("unreadable public key: {e}")),
    }
}

/// Decides about one CSR at `now`, signing with `signer` for `validity`.
pub fn decide(
    csr: &CertificateSigningRequest,
    signer: &Authority,
    validity: Duration,
    now: OffsetDateTime,
) -> Decision {
    if csr.spec.signer_name != SIGNER_NAME {
        return Decision::Ignore("another signer");
    }
    if csr
        .status
        .as_ref()
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty())
    {
        return Decision::Ignore("already signed");
    }
    if condition(csr, "Denied") || condition(csr, "Failed") {
        return Decision::Ignore("denied or failed");
    }
    if !condition(csr, "Approved") {
        return Decision::Ignore("not approved yet");
    }
    let username = csr.spec.username.clone().unwrap_or_default();
    let groups = csr.spec.groups.clone().unwrap_or_default();
    let cluster = match requester_cluster(&username, &groups) {
        Ok(cluster) => cluster,
        Err(message) => return refuse("RequesterNotAManagedCluster", message),
    };
    if let Some(label) = csr.labels().get(CLUSTER_LABEL)
        && label != cluster.as_str()
    {
        return refuse(
            "ClusterMismatch",
            format!("label {CLUSTER_LABEL}={label} but the requester belongs to cluster {cluster}"),
        );
    }
    let pem = match std::str::from_utf8(&csr.spec.request.0) {
        Ok(pem) => pem,
        Err(_) => return refuse("InvalidRequest", "spec.request is not PEM text"),
    };
    let parsed_der = match x509_parser::pem::parse_x509_pem(pem.as_bytes()) {
        Ok((_, block)) => block.contents,
        Err(e) => return refuse("InvalidRequest", format!("spec.request: {e}")),
    };
    let parsed = match X509CertificationRequest::from_der(&parsed_der) {
        Ok((_, parsed)) => parsed,
        Err(e) => return refuse("InvalidRequest", format!("spec.request: {e}")),
    };
    if let Err(message) = key_strength(&parsed) {
        return refuse("WeakKey", message);
    }
    // Before rcgen reads the request: it cannot read every subject.
    let subject = match crate::pki::requested_subject(&parsed.certification_request_info.subject) {
        Ok(subject) => subject,
        Err(e) => return refuse("SubjectNotPreserved", e.to_string()),
    };
    // Verifies the request's signature (weak keys were refused above:
    // the verifier would not even accept them).
    let params = match rcgen::CertificateSigningRequestParams::from_pem(pem) {
        Ok(params) => params,
        Err(e) => {
            return refuse(
                "InvalidRequest",
                format!("spec.request is not a valid, correctly signed PKCS#10 request: {e}"),
            );
        }
    };
    if let Some(other) = claimed_clusters(&parsed)
        .into_iter()
        .find(|c| c != cluster.as_str())
    {
        return refuse(
            "ClusterMismatch",
            format!(
                "the request claims cluster {other:?} but the requester belongs to cluster {cluster}"
            ),
        );
    }
    // A requester may ask for a shorter life (spec.expirationSeconds, at
    // least 10 minutes as on the real API server), never a longer one.
    let validity = match csr.spec.expiration_seconds {
        Some(seconds) => validity.min(Duration::from_secs(
            u64::try_from(seconds.max(600)).unwrap_or(600),
        )),
        None => validity,
    };
    let request = LeafRequest::agent(&cluster).with_validity(validity);
    let certificate_pem = match signer.sign_request_at(params, subject, &request, now) {
        Ok(pem) => pem,
        Err(e) => return refuse("SigningFailed", e.to_string()),
    };
    let requested = parsed.certification_request_info.subject.as_raw();
    match issued_subject_is(&certificate_pem, requested) {
        Ok(()) => Decision::Sign {
            cluster,
            certificate_pem,
        },
        Err(message) => refuse("SubjectNotPreserved", message),
    }
}

/// Whether the issued certificate's subject is byte for byte the requested
/// one. OCM's registration agent asks again for a certificate whose subject
/// differs from its request, and again, until its CSR threshold stops it: a
/// subject we cannot reproduce is refused once, with the reason, instead.
fn issued_subject_is(certificate_pem: &str, requested: &[u8]) -> Result<(), String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(certificate_pem.as_bytes())
        .map_err(|e| format!("the issued certificate does not parse: {e}"))?;
    let certificate = block
        .parse_x509()
        .map_err(|e| format!("the issued certificate does not parse: {e}"))?;
    if certificate.subject().as_raw() == requested {
        return Ok(());
    }
    let requested_text = x509_parser::x509::X509Name::from_der(requested)
        .map(|(_, name)| name.to_string())
        .unwrap_or_else(|_| "<unparsable>".into());
    Err(format!(
        "the requested subject {requested_text:?} cannot be issued as requested (got {:?})",
        certificate.subject().to_string()
    ))
}

/// Acts on one CSR: writes the certificate or a `Failed` condition to its
/// status (server-side apply). Returns the decision.
pub async fn reconcile_csr(
    api: &Api<CertificateSigningRequest>,
    csr: Arc<CertificateSigningRequest>,
    signer: &Authority,
    validity: Duration,
    now: OffsetDateTime,
) -> Result<Decision, KubeError> {
    let decision = decide(&csr, signer, validity, now);
    let name = csr.name_any();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match &decision {
        Decision::Ignore(_) => {}
        Decision::Sign {
            cluster,
            certificate_pem,
        } => {
            let certificate = k8s_openapi::ByteString(certificate_pem.as_bytes().to_vec());
            let patch = json!({
                "apiVersion": "certificates.k8s.io/v1",
                "kind": "CertificateSigningRequest",
                "status": {"certificate": certificate},
            });
            api.patch_status(&name, &params, &Patch::Apply(&patch))
                .await?;
            tracing::info!(csr = %name, %cluster, "signed a proxy-agent certificate");
        }
        Decision::Refuse { reason, message } => {
            // Conditions are a map keyed by type on the real server; send
            // the existing ones too so no apply semantics can drop them.
            let mut conditions: Vec<serde_json::Value> = csr
                .status
                .as_ref()
                .and_then(|s| s.conditions.clone())
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect();
            let now_text = now
                .replace_nanosecond(0)
                .unwrap_or(now)
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            conditions.push(json!({
                "type": "Failed", "status": "True", "reason": reason, "message": message,
                "lastUpdateTime": now_text, "lastTransitionTime": now_text,
            }));
            let patch = json!({
                "apiVersion": "certificates.k8s.io/v1",
                "kind": "CertificateSigningRequest",
                "status": {"conditions": conditions},
            });
            api.patch_status(&name, &params, &Patch::Apply(&patch))
                .await?;
            tracing::warn!(csr = %name, %reason, %message, "refused a proxy-agent CSR");
        }
    }
    Ok(decision)
}

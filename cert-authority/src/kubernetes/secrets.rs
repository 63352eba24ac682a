//! The PKI kept in Kubernetes Secrets. One reconcile pass reads the Secrets
//! into a [`SecretSnapshot`], runs the same [`reconcile`] as the `files`
//! backend against it (policy lives in one place), and server-side-applies
//! the Secrets that changed.
//!
//! | Secret (type) | keys |
//! |---|---|
//! | `cluster-proxy-signer` (Opaque) | `ca.crt`, `ca.key` (signing CA, PKCS#8); during a rollover also `next-ca.crt`/`next-ca.key` or `previous-ca.crt`/`previous-ca.key`, and `rollover-phase` |
//! | `proxy-server-ca` (Opaque) | `ca.crt`: the trust bundle (every trusted CA) |
//! | `proxy-server`, `agent-server`, `proxy-client` (`kubernetes.io/tls`) | `tls.crt`, `tls.key`, `ca.crt` (the bundle) |

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use time::OffsetDateTime;

use super::{FIELD_MANAGER, KubeError, KubeOptions};
use crate::authority::{
    AuthorityError, CaSlot, Desired, Leaf, Report, Store, format_phase, parse_phase, reconcile,
};
use crate::files;
use crate::pki::{Authority, Credentials};
use crate::rotation::RolloverPhase;

pub const BUNDLE_SECRET: &str = "proxy-server-ca";
const PHASE_KEY: &str = "rollover-phase";
const LEAVES: [Leaf; 3] = [Leaf::ProxyServer, Leaf::AgentServer, Leaf::ProxyClient];

fn ca_keys(slot: CaSlot) -> (&'static str, &'static str) {
    match slot {
        CaSlot::Current => ("ca.crt", "ca.key"),
        CaSlot::Next => ("next-ca.crt", "next-ca.key"),
        CaSlot::Previous => ("previous-ca.crt", "previous-ca.key"),
    }
}

fn leaf_secret(leaf: &Leaf) -> Option<&'static str> {
    match leaf {
        Leaf::ProxyServer => Some(files::PROXY_SERVER),
        Leaf::AgentServer => Some(files::AGENT_SERVER),
        Leaf::ProxyClient => Some(files::PROXY_CLIENT),
        // Agents get their certificates through CSRs in this backend.
        Leaf::Agent(_) => None,
    }
}

/// A Secret's data as text (PEM); non-UTF-8 data is an error naming the key.
pub(crate) fn texts(secret: &Secret) -> Result<BTreeMap<String, String>, KubeError> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    secret
        .data
        .iter()
        .flatten()
        .map(|(key, value)| {
            String::from_utf8(value.0.clone())
                .map(|text| (key.clone(), text))
                .map_err(|_| KubeError::BadSecret {
                    name: name.clone(),
                    detail: format!("key {key} is not UTF-8 PEM"),
                })
        })
        .collect()
}

/// The Secrets as read, plus the writes a reconcile pass made to them.
#[derive(Debug, Default)]
pub struct SecretSnapshot {
    signer: RefCell<BTreeMap<String, String>>,
    bundle: RefCell<Option<String>>,
    leaves: RefCell<BTreeMap<&'static str, BTreeMap<String, String>>>,
    dirty: RefCell<BTreeSet<String>>,
}

impl SecretSnapshot {
    fn mark(&self, name: &str) {
        self.dirty.borrow_mut().insert(name.to_string());
    }

    /// Secrets that must be written.
    pub fn dirty(&self) -> BTreeSet<String> {
        self.dirty.borrow().clone()
    }
}

impl Store for SecretSnapshot {
    fn load_ca(&self, slot: CaSlot) -> Result<Option<Credentials>, AuthorityError> {
        let (cert, key) = ca_keys(slot);
        let signer = self.signer.borrow();
        Ok(match (signer.get(cert), signer.get(key)) {
            (Some(cert_pem), Some(key_pem)) => Some(Credentials {
                cert_pem: cert_pem.clone(),
                key_pem: key_pem.clone(),
            }),
            _ => None,
        })
    }

    fn save_ca(&self, slot: CaSlot, ca: &Credentials) -> Result<(), AuthorityError> {
        let (cert, key) = ca_keys(slot);
        let mut signer = self.signer.borrow_mut();
        signer.insert(cert.into(), ca.cert_pem.clone());
        signer.insert(key.into(), ca.key_pem.clone());
        self.mark("signer");
        Ok(())
    }

    fn remove_ca(&self, slot: CaSlot) -> Result<(), AuthorityError> {
        let (cert, key) = ca_keys(slot);
        let mut signer = self.signer.borrow_mut();
        if signer.remove(cert).is_some() | signer.remove(key).is_some() {
            self.mark("signer");
        }
        Ok(())
    }

    fn load_phase(&self) -> Result<RolloverPhase, AuthorityError> {
        match self.signer.borrow().get(PHASE_KEY) {
            None => Ok(RolloverPhase::Stable),
            Some(text) => parse_phase(text.trim())
                .ok_or_else(|| AuthorityError::State(text.trim().to_owned())),
        }
    }

    fn save_phase(&self, phase: &RolloverPhase) -> Result<(), AuthorityError> {
        self.signer
            .borrow_mut()
            .insert(PHASE_KEY.into(), format_phase(phase));
        self.mark("signer");
        Ok(())
    }

    fn save_bundle(&self, pems: &[String]) -> Result<(), AuthorityError> {
        let bundle = pems.concat();
        if self.bundle.borrow().as_deref() != Some(bundle.as_str()) {
            *self.bundle.borrow_mut() = Some(bundle.clone());
            self.mark(BUNDLE_SECRET);
        }
        // Every leaf Secret carries the bundle too.
        for leaf in LEAVES {
            let Some(name) = leaf_secret(&leaf) else {
                continue;
            };
            let mut leaves = self.leaves.borrow_mut();
            if let Some(data) = leaves.get_mut(name)
                && data.get("ca.crt") != Some(&bundle)
            {
                data.insert("ca.crt".into(), bundle.clone());
                self.mark(name);
            }
        }
        Ok(())
    }

    fn load_leaf(&self, leaf: &Leaf) -> Result<Option<Credentials>, AuthorityError> {
        let Some(name) = leaf_secret(leaf) else {
            return Ok(None);
        };
        let leaves = self.leaves.borrow();
        Ok(leaves.get(name).and_then(|data| {
            Some(Credentials {
                cert_pem: data.get("tls.crt")?.clone(),
                key_pem: data.get("tls.key")?.clone(),
            })
        }))
    }

    fn save_leaf(&self, leaf: &Leaf, credentials: &Credentials) -> Result<(), AuthorityError> {
        let Some(name) = leaf_secret(leaf) else {
            return Ok(());
        };
        let mut leaves = self.leaves.borrow_mut();
        let data = leaves.entry(name).or_default();
        data.insert("tls.crt".into(), credentials.cert_pem.clone());
        data.insert("tls.key".into(), credentials.key_pem.clone());
        self.mark(name);
        Ok(())
    }
}

fn secret(name: &str, namespace: &str, type_: &str, data: &BTreeMap<String, String>) -> Secret {
    let mut secret = Secret {
        type_: Some(type_.to_string()),
        data: Some(
            data.iter()
                .map(|(k, v)| (k.clone(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    };
    secret.metadata.name = Some(name.to_string());
    secret.metadata.namespace = Some(namespace.to_string());
    secret.metadata.labels = Some(
        [(
            "app.kubernetes.io/managed-by".to_string(),
            FIELD_MANAGER.to_string(),
        )]
        .into(),
    );
    secret
}

/// One pass over the Secrets at `now`; returns what changed.
pub async fn reconcile_secrets(
    client: &Client,
    options: &KubeOptions,
    desired: &Desired,
    now: OffsetDateTime,
) -> Result<Report, KubeError> {
    let hub: Api<Secret> = Api::namespaced(client.clone(), &options.namespace);
    let signer_api: Api<Secret> = Api::namespaced(client.clone(), &options.signer_secret_namespace);
    let snapshot = SecretSnapshot::default();
    if let Some(found) = signer_api.get_opt(&options.signer_secret_name).await? {
        *snapshot.signer.borrow_mut() = texts(&found)?;
    }
    if let Some(found) = hub.get_opt(BUNDLE_SECRET).await? {
        *snapshot.bundle.borrow_mut() = texts(&found)?.remove("ca.crt");
    }
    for leaf in LEAVES {
        if let Some(name) = leaf_secret(&leaf)
            && let Some(found) = hub.get_opt(name).await?
        {
            snapshot.leaves.borrow_mut().insert(name, texts(&found)?);
        }
    }

    let mut report = Report::default();
    if snapshot.load_ca(CaSlot::Current)?.is_none() {
        // First start: a new CA. An existing one (also upstream's RSA CA)
        // is adopted as it is.
        let ca =
            Authority::generate_at("cluster-proxy-ca", desired.rollover_policy.ca_validity, now)
                .map_err(AuthorityError::from)?;
        snapshot.save_ca(
            CaSlot::Current,
            &Credentials {
                cert_pem: ca.cert_pem().to_string(),
                key_pem: ca.key_pem(),
            },
        )?;
        report.renewed.push("CA: created".into());
    } else if let Some(current) = snapshot.load_ca(CaSlot::Current)? {
        // Refuse to run on a CA we cannot sign with, with the reason.
        Authority::from_pem(&current.cert_pem, &current.key_pem).map_err(|e| {
            KubeError::BadSecret {
                name: options.signer_secret_name.clone(),
                detail: e.to_string(),
            }
        })?;
    }
    let mut desired = desired.clone();
    if let Some(previous) = snapshot.load_ca(CaSlot::Previous)? {
        desired.outside_leaves_on_previous =
            agent_certificates_signed_by(client, &previous.cert_pem, now).await?;
    }
    let pass = reconcile(&snapshot, &desired, now)?;
    report.rollover = pass.rollover;
    report.renewed.extend(pass.renewed);

    let params = PatchParams::apply(FIELD_MANAGER).force();
    for name in snapshot.dirty() {
        let (api, object) = if name == "signer" {
            (
                &signer_api,
                secret(
                    &options.signer_secret_name,
                    &options.signer_secret_namespace,
                    "Opaque",
                    &snapshot.signer.borrow(),
                ),
            )
        } else if name == BUNDLE_SECRET {
            let bundle = snapshot.bundle.borrow().clone().unwrap_or_default();
            (
                &hub,
                secret(
                    BUNDLE_SECRET,
                    &options.namespace,
                    "Opaque",
                    &[("ca.crt".to_string(), bundle)].into(),
                ),
            )
        } else {
            let mut data = snapshot
                .leaves
                .borrow()
                .get(name.as_str())
                .cloned()
                .unwrap_or_default();
            if let Some(bundle) = snapshot.bundle.borrow().clone() {
                data.insert("ca.crt".into(), bundle);
            }
            (
                &hub,
                secret(&name, &options.namespace, "kubernetes.io/tls", &data),
            )
        };
        let object_name = object.metadata.name.clone().unwrap_or_default();
        api.patch(&object_name, &params, &Patch::Apply(&object))
            .await?;
        tracing::info!(secret = %object_name, "applied");
    }
    Ok(report)
}

/// How many proxy-agent certificates issued through CSRs are still valid at
/// `now` and signed by the CA `ca_pem`: agents using them need that CA in
/// the bundle until they renew.
async fn agent_certificates_signed_by(
    client: &Client,
    ca_pem: &str,
    now: OffsetDateTime,
) -> Result<usize, KubeError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let ca_der = x509_parser::pem::parse_x509_pem(ca_pem.as_bytes())
        .map_err(|e| KubeError::BadSecret {
            name: "previous CA".into(),
            detail: e.to_string(),
        })?
        .1
        .contents;
    let (_, ca) = X509Certificate::from_der(&ca_der).map_err(|e| KubeError::BadSecret {
        name: "previous CA".into(),
        detail: e.to_string(),
    })?;
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let mut count = 0;
    for csr in csrs.list(&Default::default()).await? {
        if csr.spec.signer_name != super::csr::SIGNER_NAME {
            continue;
        }
        let Some(pem) = csr.status.and_then(|s| s.certificate) else {
            continue;
        };
        let Ok((_, block)) = x509_parser::pem::parse_x509_pem(&pem.0) else {
            continue;
        };
        let Ok((_, cert)) = X509Certificate::from_der(&block.contents) else {
            continue;
        };
        let valid = cert.validity().not_after.timestamp() > now.unix_timestamp();
        if valid
            && cert.issuer() == ca.subject()
            && cert.verify_signature(Some(ca.public_key())).is_ok()
        {
            count += 1;
        }
    }
    Ok(count)
}

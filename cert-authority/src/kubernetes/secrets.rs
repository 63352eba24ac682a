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
//! | with `spec.userServer`: `cluster-proxy-user-serving-cert`, `cluster-proxy-user-server-identity`, `cluster-proxy-service-proxy-server-cert` (`kubernetes.io/tls`) | the same |

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use time::OffsetDateTime;

use super::common::{FIELD_MANAGER, KubeError};
use super::options::KubeOptions;
pub(crate) use super::options::is_dns_subdomain;
pub use super::options::{BUNDLE_SECRET, LeafSecretNames};
use crate::authority::{
    AuthorityError, CaParts, CaSlot, Desired, Leaf, Report, Store, format_phase, parse_phase,
    reconcile, stored_ca,
};
use crate::pki::{Authority, Credentials};
use crate::rotation::RolloverPhase;

/// The dirty-set entry of the signer Secret, whatever its configured name;
/// `#` keeps it apart from every valid Secret name.
const SIGNER: &str = "#signer";
const PHASE_KEY: &str = "rollover-phase";
const LEAVES: [Leaf; 3] = [Leaf::ProxyServer, Leaf::AgentServer, Leaf::ProxyClient];

/// The hub leaves kept in Secrets: the three always, service access's when
/// wanted (else a Secret of that name is the user's, never touched).
fn hub_leaves(service_access: bool) -> Vec<Leaf> {
    let mut leaves = LEAVES.to_vec();
    if service_access {
        leaves.extend(Leaf::SERVICE_ACCESS);
    }
    leaves
}

fn ca_keys(slot: CaSlot) -> (&'static str, &'static str) {
    match slot {
        CaSlot::Current => ("ca.crt", "ca.key"),
        CaSlot::Next => ("next-ca.crt", "next-ca.key"),
        CaSlot::Previous => ("previous-ca.crt", "previous-ca.key"),
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
    names: LeafSecretNames,
    service_access: bool,
    signer: RefCell<BTreeMap<String, String>>,
    bundle: RefCell<Option<String>>,
    leaves: RefCell<BTreeMap<String, BTreeMap<String, String>>>,
    dirty: RefCell<BTreeSet<String>>,
}

impl SecretSnapshot {
    /// An empty snapshot whose leaves live in the Secrets `names`, with
    /// service access's certificates when `service_access`.
    pub fn new(names: LeafSecretNames, service_access: bool) -> Self {
        SecretSnapshot {
            names,
            service_access,
            ..SecretSnapshot::default()
        }
    }

    /// The certificate (`tls.crt`) of `leaf` as the pass left it.
    pub fn certificate(&self, leaf: &Leaf) -> Option<String> {
        let name = self.names.of(leaf)?;
        self.leaves.borrow().get(name)?.get("tls.crt").cloned()
    }

    fn mark(&self, name: &str) {
        self.dirty.borrow_mut().insert(name.to_string());
    }

    /// Secrets that must be written.
    pub fn dirty(&self) -> BTreeSet<String> {
        self.dirty.borrow().clone()
    }
}

impl Store for SecretSnapshot {
    fn load_ca(&self, slot: CaSlot) -> Result<CaParts, AuthorityError> {
        let (cert, key) = ca_keys(slot);
        let signer = self.signer.borrow();
        Ok(CaParts {
            cert_pem: signer.get(cert).cloned(),
            key_pem: signer.get(key).cloned(),
        })
    }

    fn ca_part_names(&self, slot: CaSlot) -> (&'static str, &'static str) {
        ca_keys(slot)
    }

    fn save_ca(&self, slot: CaSlot, ca: &Credentials) -> Result<(), AuthorityError> {
        let (cert, key) = ca_keys(slot);
        let mut signer = self.signer.borrow_mut();
        signer.insert(cert.into(), ca.cert_pem.clone());
        signer.insert(key.into(), ca.key_pem.clone());
        self.mark(SIGNER);
        Ok(())
    }

    fn remove_ca(&self, slot: CaSlot) -> Result<(), AuthorityError> {
        let (cert, key) = ca_keys(slot);
        let mut signer = self.signer.borrow_mut();
        if signer.remove(cert).is_some() | signer.remove(key).is_some() {
            self.mark(SIGNER);
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
        self.mark(SIGNER);
        Ok(())
    }

    fn save_bundle(&self, pems: &[String]) -> Result<(), AuthorityError> {
        let bundle = pems.concat();
        if self.bundle.borrow().as_deref() != Some(bundle.as_str()) {
            *self.bundle.borrow_mut() = Some(bundle.clone());
            self.mark(BUNDLE_SECRET);
        }
        // Every leaf Secret carries the bundle too.
        for leaf in hub_leaves(self.service_access) {
            let Some(name) = self.names.of(&leaf) else {
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
        let Some(name) = self.names.of(leaf) else {
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
        let Some(name) = self.names.of(leaf) else {
            return Ok(());
        };
        let mut leaves = self.leaves.borrow_mut();
        let data = leaves.entry(name.to_owned()).or_default();
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
            super::common::MANAGED_BY_LABEL.to_string(),
            FIELD_MANAGER.to_string(),
        )]
        .into(),
    );
    secret
}

/// What one pass over the Secrets did, and the CA that signs after it.
#[derive(Debug)]
pub struct Pass {
    pub report: Report,
    /// The signing CA as stored when the pass ended (a rollover may have
    /// switched it): what CSRs are signed with until the next pass.
    pub signer: Arc<Authority>,
    /// The hub leaf certificates (PEM) as stored when the pass ended;
    /// `None`: the Secret has none.
    pub certificates: LeafCertificates,
}

/// The hub leaf certificates after a pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeafCertificates {
    pub proxy_server: Option<String>,
    pub agent_server: Option<String>,
    pub proxy_client: Option<String>,
    /// Only while service access is wanted.
    pub user_server: Option<String>,
}

/// One pass over the Secrets at `now`; returns what changed.
pub async fn reconcile_secrets(
    client: &Client,
    options: &KubeOptions,
    desired: &Desired,
    now: OffsetDateTime,
) -> Result<Report, KubeError> {
    Ok(pass(client, options, desired, now).await?.report)
}

fn signer_error(options: &KubeOptions, source: AuthorityError) -> KubeError {
    KubeError::DamagedSigner {
        namespace: options.signer_secret_namespace.clone(),
        name: options.signer_secret_name.clone(),
        source,
    }
}

/// Creates the signer Secret with a new CA and reads it back. A create,
/// not an apply: it fails instead of replacing a Secret that appeared
/// meanwhile. Nothing is issued from the CA before this returns.
async fn create_signer(
    signer_api: &Api<Secret>,
    options: &KubeOptions,
    desired: &Desired,
    now: OffsetDateTime,
) -> Result<BTreeMap<String, String>, KubeError> {
    let ca = Authority::generate_at("cluster-proxy-ca", desired.rollover_policy.ca_validity, now)
        .map_err(AuthorityError::from)?;
    let (cert_key, key_key) = ca_keys(CaSlot::Current);
    let data: BTreeMap<String, String> = [
        (cert_key.to_string(), ca.cert_pem().to_string()),
        (key_key.to_string(), ca.key_pem()),
    ]
    .into();
    let object = secret(
        &options.signer_secret_name,
        &options.signer_secret_namespace,
        "Opaque",
        &data,
    );
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    };
    signer_api.create(&params, &object).await?;
    let stored = signer_api
        .get_opt(&options.signer_secret_name)
        .await?
        .ok_or_else(|| KubeError::BadSecret {
            name: options.signer_secret_name.clone(),
            detail: "created, but not there when read back".into(),
        })?;
    let stored = texts(&stored)?;
    if stored.get(cert_key) != data.get(cert_key) || stored.get(key_key) != data.get(key_key) {
        return Err(KubeError::BadSecret {
            name: options.signer_secret_name.clone(),
            detail: "created, but read back with a different CA; not using either".into(),
        });
    }
    tracing::info!(
        namespace = %options.signer_secret_namespace,
        secret = %options.signer_secret_name,
        "no signer Secret existed: created a new CA and stored it"
    );
    Ok(stored)
}

/// One pass over the Secrets at `now`.
///
/// Order matters, so that nothing ever trusts or carries a CA whose key is
/// not stored: the signer Secret is created (or updated, during a
/// rollover) first, then the trust bundle, then the leaves. A failed write
/// ends the pass, and the next pass starts from what is stored.
pub async fn pass(
    client: &Client,
    options: &KubeOptions,
    desired: &Desired,
    now: OffsetDateTime,
) -> Result<Pass, KubeError> {
    let hub: Api<Secret> = Api::namespaced(client.clone(), &options.namespace);
    let signer_api: Api<Secret> = Api::namespaced(client.clone(), &options.signer_secret_namespace);
    let service_access = desired.user_server_sans.is_some();
    let snapshot = SecretSnapshot::new(options.secret_names.clone(), service_access);
    let mut report = Report::default();
    match signer_api.get_opt(&options.signer_secret_name).await? {
        Some(found) => {
            let data = texts(&found).map_err(|e| {
                signer_error(
                    options,
                    AuthorityError::UnusableCa {
                        slot: CaSlot::Current,
                        source: e.to_string().into(),
                    },
                )
            })?;
            let (cert_key, key_key) = ca_keys(CaSlot::Current);
            if !data.contains_key(cert_key) && !data.contains_key(key_key) {
                // Only a Secret that does not exist at all means "first
                // start": this one may have been emptied by mistake.
                return Err(signer_error(
                    options,
                    AuthorityError::EmptyCaStore(format!("{cert_key}, {key_key}")),
                ));
            }
            *snapshot.signer.borrow_mut() = data;
        }
        None => {
            *snapshot.signer.borrow_mut() =
                create_signer(&signer_api, options, desired, now).await?;
            report.renewed.push("CA: created".into());
        }
    }
    // Every CA the Secret holds must be whole and usable before anything
    // is issued or published.
    for slot in [CaSlot::Current, CaSlot::Next, CaSlot::Previous] {
        stored_ca(&snapshot, slot).map_err(|e| signer_error(options, e))?;
    }
    if let Some(found) = hub.get_opt(BUNDLE_SECRET).await? {
        *snapshot.bundle.borrow_mut() = texts(&found)?.remove("ca.crt");
    }
    for leaf in hub_leaves(service_access) {
        if let Some(name) = options.secret_names.of(&leaf)
            && let Some(found) = hub.get_opt(name).await?
        {
            snapshot
                .leaves
                .borrow_mut()
                .insert(name.to_owned(), texts(&found)?);
        }
    }

    let mut desired = desired.clone();
    if let Some(previous) =
        stored_ca(&snapshot, CaSlot::Previous).map_err(|e| signer_error(options, e))?
    {
        desired.outside_leaves_on_previous =
            agent_certificates_signed_by(client, &previous.cert_pem, now).await?;
    }
    let outcome = reconcile(&snapshot, &desired, now).map_err(|e| {
        if e.is_damaged_ca() {
            signer_error(options, e)
        } else {
            KubeError::Authority(e)
        }
    })?;
    report.rollover = outcome.rollover;
    report.renewed.extend(outcome.renewed);

    let params = PatchParams::apply(FIELD_MANAGER).force();
    let dirty = snapshot.dirty();
    if dirty.contains(SIGNER) {
        let object = secret(
            &options.signer_secret_name,
            &options.signer_secret_namespace,
            "Opaque",
            &snapshot.signer.borrow(),
        );
        signer_api
            .patch(&options.signer_secret_name, &params, &Patch::Apply(&object))
            .await?;
        tracing::info!(secret = %options.signer_secret_name, "applied the signer Secret");
    }
    if dirty.contains(BUNDLE_SECRET) {
        let bundle = snapshot.bundle.borrow().clone().unwrap_or_default();
        let object = secret(
            BUNDLE_SECRET,
            &options.namespace,
            "Opaque",
            &[("ca.crt".to_string(), bundle)].into(),
        );
        hub.patch(BUNDLE_SECRET, &params, &Patch::Apply(&object))
            .await?;
        tracing::info!(secret = BUNDLE_SECRET, "applied");
    }
    for name in dirty
        .iter()
        .filter(|name| name.as_str() != SIGNER && name.as_str() != BUNDLE_SECRET)
    {
        let mut data = snapshot
            .leaves
            .borrow()
            .get(name.as_str())
            .cloned()
            .unwrap_or_default();
        if let Some(bundle) = snapshot.bundle.borrow().clone() {
            data.insert("ca.crt".into(), bundle);
        }
        let object = secret(name, &options.namespace, "kubernetes.io/tls", &data);
        hub.patch(name, &params, &Patch::Apply(&object)).await?;
        tracing::info!(secret = %name, "applied");
    }
    let current = stored_ca(&snapshot, CaSlot::Current)
        .map_err(|e| signer_error(options, e))?
        .ok_or_else(|| signer_error(options, AuthorityError::NoCa))?;
    let signer = Authority::from_pem(&current.cert_pem, &current.key_pem)
        .map_err(|e| signer_error(options, AuthorityError::from(e)))?;
    Ok(Pass {
        report,
        signer: Arc::new(signer),
        certificates: LeafCertificates {
            proxy_server: snapshot.certificate(&Leaf::ProxyServer),
            agent_server: snapshot.certificate(&Leaf::AgentServer),
            proxy_client: snapshot.certificate(&Leaf::ProxyClient),
            user_server: service_access
                .then(|| snapshot.certificate(&Leaf::UserServer))
                .flatten(),
        },
    })
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
    for csr in csrs.list(&super::csr::own_signer_only()).await? {
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

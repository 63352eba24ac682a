//! The certificate authority's reconcile loop, independent of where the PKI is
//! kept: one pass loads the CA state and the leaves from a [`Store`], applies
//! the rollover state machine and the leaf renewal policy
//! ([`crate::rotation`]), and writes back what changed. The `files` backend is
//! [`FileStore`]; a Kubernetes Secret store implements the same trait.

use std::path::PathBuf;

use cluster_proxy_proto::api::proxy::v1alpha1::USER_SERVER_SERVICE_NAME;
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access::USER_SERVER_IDENTITY;
use time::OffsetDateTime;
use tracing::info;

use crate::files::{self, FilesError, Layout, Pair};
use crate::pki::{Authority, Credentials, LeafRequest, PkiError};
use crate::rotation::{
    self, CaState, LeafDecision, LeafPolicy, RolloverAction, RolloverPhase, RolloverPolicy,
    RotationError,
};

#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error(transparent)]
    Files(#[from] FilesError),
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error(transparent)]
    Rotation(#[from] RotationError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stored rollover state is unreadable: {0}")]
    State(String),
    #[error("no CA in the store; run `cert-authority init` first")]
    NoCa,
    #[error(
        "the {slot} CA is half present ({present} exists, {missing} is missing); refusing to replace it: restore the missing half, or remove both to start a new PKI"
    )]
    PartialCa {
        slot: CaSlot,
        present: &'static str,
        missing: &'static str,
    },
    #[error(
        "the stored {slot} CA cannot be used ({source}); refusing to replace it, since certificates it signed may still be in use: repair it, or remove it to start a new PKI"
    )]
    UnusableCa {
        slot: CaSlot,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("a different {0} CA is already stored; refusing to overwrite its key")]
    WouldOverwriteCa(CaSlot),
    #[error(
        "it exists but holds no CA ({0}); refusing to create a new CA over it: restore it, or remove it to start a new PKI"
    )]
    EmptyCaStore(String),
}

impl AuthorityError {
    /// Whether the stored CA material is the problem: nothing may be written
    /// until a person repairs it, and retrying cannot help.
    pub fn is_damaged_ca(&self) -> bool {
        matches!(
            self,
            AuthorityError::PartialCa { .. }
                | AuthorityError::UnusableCa { .. }
                | AuthorityError::WouldOverwriteCa(_)
                | AuthorityError::EmptyCaStore(_)
        )
    }
}

/// Which CA a stored key pair is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaSlot {
    /// The CA that signs now.
    Current,
    /// The CA being introduced (published in the bundle, not signing yet).
    Next,
    /// The CA being retired (still in the bundle until no leaf needs it).
    Previous,
}

impl std::fmt::Display for CaSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CaSlot::Current => "current",
            CaSlot::Next => "next",
            CaSlot::Previous => "previous",
        })
    }
}

/// The two halves of a stored CA as found, each possibly absent. Stores
/// report what is there; [`stored_ca`] alone decides what a missing half
/// means, so every backend follows the same rule.
#[derive(Debug, Clone, Default)]
pub struct CaParts {
    pub cert_pem: Option<String>,
    pub key_pem: Option<String>,
}

/// The CA in `slot`, checked: `None` only when neither half exists. A half
/// without the other, an unreadable half, or a key that is not the
/// certificate's is an error, never "no CA": treating it as absent would
/// replace a key that may have signed certificates still in use.
pub fn stored_ca(store: &dyn Store, slot: CaSlot) -> Result<Option<Credentials>, AuthorityError> {
    let parts = store.load_ca(slot)?;
    let (cert_name, key_name) = store.ca_part_names(slot);
    let credentials = match (parts.cert_pem, parts.key_pem) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(AuthorityError::PartialCa {
                slot,
                present: cert_name,
                missing: key_name,
            });
        }
        (None, Some(_)) => {
            return Err(AuthorityError::PartialCa {
                slot,
                present: key_name,
                missing: cert_name,
            });
        }
        (Some(cert_pem), Some(key_pem)) => Credentials { cert_pem, key_pem },
    };
    let unusable = |source: Box<dyn std::error::Error + Send + Sync>| AuthorityError::UnusableCa {
        slot,
        source,
    };
    rotation::ca_entry_from_pem(&credentials.cert_pem).map_err(|e| unusable(Box::new(e)))?;
    Authority::from_pem(&credentials.cert_pem, &credentials.key_pem)
        .map_err(|e| unusable(Box::new(e)))?;
    Ok(Some(credentials))
}

/// Stores `ca` in `slot` unless the slot holds a different CA. Writing the
/// same CA again is allowed, so an interrupted step can be retried.
fn save_ca_checked(
    store: &dyn Store,
    slot: CaSlot,
    ca: &Credentials,
) -> Result<(), AuthorityError> {
    if let Some(existing) = stored_ca(store, slot)?
        && (existing.cert_pem != ca.cert_pem || existing.key_pem != ca.key_pem)
    {
        return Err(AuthorityError::WouldOverwriteCa(slot));
    }
    store.save_ca(slot, ca)
}

/// Every leaf the authority keeps current.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leaf {
    ProxyServer,
    AgentServer,
    ProxyClient,
    Agent(ClusterName),
    /// The user-server's serving certificate (service access).
    UserServer,
    /// The user-server's client certificate toward service-proxies: the
    /// only certificate whose named hub users they believe.
    UserServerIdentity,
    /// The service-proxies' serving certificate, one for every cluster
    /// (upstream's): the user-server reaches each by its hashed host.
    ServiceProxy,
}

/// SANs of the service-proxy certificate: every cluster's hashed host
/// (`cluster-<hash>.open-cluster-management.proxy`) and the local names.
pub const SERVICE_PROXY_SANS: &[&str] =
    &["*.open-cluster-management.proxy", "localhost", "127.0.0.1"];

impl Leaf {
    fn request(&self, sans: &[String], policy: &LeafPolicy) -> LeafRequest {
        let sans: Vec<&str> = sans.iter().map(String::as_str).collect();
        let request = match self {
            Leaf::ProxyServer => LeafRequest::server(files::PROXY_SERVER, &sans),
            Leaf::AgentServer => LeafRequest::server(files::AGENT_SERVER, &sans),
            Leaf::ProxyClient => LeafRequest::client(files::PROXY_CLIENT),
            Leaf::Agent(cluster) => LeafRequest::agent(cluster),
            Leaf::UserServer => LeafRequest::server(USER_SERVER_SERVICE_NAME, &sans),
            Leaf::UserServerIdentity => LeafRequest::client(USER_SERVER_IDENTITY),
            Leaf::ServiceProxy => LeafRequest::server(files::SERVICE_PROXY, &sans),
        };
        request.with_validity(policy.validity)
    }

    /// The SANs this leaf should carry (client certificates carry none).
    fn desired_sans(&self, desired: &Desired) -> Vec<String> {
        match self {
            Leaf::ProxyServer | Leaf::AgentServer => desired.server_sans.clone(),
            Leaf::UserServer => desired.user_server_sans.clone().unwrap_or_default(),
            Leaf::ServiceProxy => SERVICE_PROXY_SANS.iter().map(|s| (*s).to_owned()).collect(),
            Leaf::ProxyClient | Leaf::Agent(_) | Leaf::UserServerIdentity => Vec::new(),
        }
    }

    /// The leaves of service access, kept only while it is wanted.
    pub const SERVICE_ACCESS: [Leaf; 3] = [
        Leaf::UserServer,
        Leaf::UserServerIdentity,
        Leaf::ServiceProxy,
    ];
}

impl std::fmt::Display for Leaf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leaf::ProxyServer => f.write_str(files::PROXY_SERVER),
            Leaf::AgentServer => f.write_str(files::AGENT_SERVER),
            Leaf::ProxyClient => f.write_str(files::PROXY_CLIENT),
            Leaf::Agent(cluster) => write!(f, "agent of {cluster}"),
            Leaf::UserServer => f.write_str(files::USER_SERVER),
            Leaf::UserServerIdentity => f.write_str(files::USER_SERVER_IDENTITY),
            Leaf::ServiceProxy => f.write_str(files::SERVICE_PROXY),
        }
    }
}

/// Where the PKI is kept.
pub trait Store {
    /// What is stored of the CA in `slot`; read it through [`stored_ca`].
    fn load_ca(&self, slot: CaSlot) -> Result<CaParts, AuthorityError>;
    /// Where the certificate and the key of `slot` live, for messages.
    fn ca_part_names(&self, slot: CaSlot) -> (&'static str, &'static str);
    fn save_ca(&self, slot: CaSlot, ca: &Credentials) -> Result<(), AuthorityError>;
    fn remove_ca(&self, slot: CaSlot) -> Result<(), AuthorityError>;
    fn load_phase(&self) -> Result<RolloverPhase, AuthorityError>;
    fn save_phase(&self, phase: &RolloverPhase) -> Result<(), AuthorityError>;
    fn save_bundle(&self, pems: &[String]) -> Result<(), AuthorityError>;
    fn load_leaf(&self, leaf: &Leaf) -> Result<Option<Credentials>, AuthorityError>;
    fn save_leaf(&self, leaf: &Leaf, credentials: &Credentials) -> Result<(), AuthorityError>;
}

/// What the authority should maintain.
#[derive(Debug, Clone)]
pub struct Desired {
    pub clusters: Vec<ClusterName>,
    /// SANs of both server certificates.
    pub server_sans: Vec<String>,
    pub leaf_policy: LeafPolicy,
    pub rollover_policy: RolloverPolicy,
    /// Valid leaves signed by the previous CA that the store does not hold
    /// (agent certificates signed through CSRs): the previous CA stays in
    /// the bundle while any remain.
    pub outside_leaves_on_previous: usize,
    /// Service access: `Some` (the user-server certificate's SANs) keeps
    /// [`Leaf::SERVICE_ACCESS`] too; `None` leaves them alone (a user may
    /// provide them, as upstream allows).
    pub user_server_sans: Option<Vec<String>>,
}

impl Desired {
    fn leaves(&self) -> Vec<Leaf> {
        let mut leaves = vec![Leaf::ProxyServer, Leaf::AgentServer, Leaf::ProxyClient];
        if self.user_server_sans.is_some() {
            leaves.extend(Leaf::SERVICE_ACCESS);
        }
        leaves.extend(self.clusters.iter().cloned().map(Leaf::Agent));
        leaves
    }
}

/// What one reconcile pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub rollover: Option<String>,
    pub renewed: Vec<String>,
}

fn entry(
    store: &dyn Store,
    slot: CaSlot,
) -> Result<Option<(Credentials, rotation::CaEntry)>, AuthorityError> {
    stored_ca(store, slot)?
        .map(|c| Ok((rotation::ca_entry_from_pem(&c.cert_pem)?, c)))
        .transpose()
        .map(|o| o.map(|(e, c)| (c, e)))
}

/// One reconcile pass at `now`.
pub fn reconcile(
    store: &dyn Store,
    desired: &Desired,
    now: OffsetDateTime,
) -> Result<Report, AuthorityError> {
    let mut report = Report::default();
    let (current_creds, current) = entry(store, CaSlot::Current)?.ok_or(AuthorityError::NoCa)?;
    let next = entry(store, CaSlot::Next)?;
    let previous = entry(store, CaSlot::Previous)?;
    let mut state = CaState {
        current,
        next: next.as_ref().map(|(_, e)| e.clone()),
        previous: previous.as_ref().map(|(_, e)| e.clone()),
        phase: store.load_phase()?,
    };
    let signer_creds = current_creds;

    // 1. Leaves: renew what the policy says, signed by the current signer.
    let bundle = rotation::trust_bundle(&state);
    let signer = Authority::from_pem(&signer_creds.cert_pem, &signer_creds.key_pem)?;
    for leaf in desired.leaves() {
        let sans = leaf.desired_sans(desired);
        let decision = match store.load_leaf(&leaf)? {
            None => None,
            Some(c) => Some(rotation::leaf_decision(
                &c.cert_pem,
                &sans,
                &bundle,
                &signer_creds.cert_pem,
                &desired.leaf_policy,
                now,
            )?),
        };
        if let Some(LeafDecision::Keep { .. }) = decision {
            continue;
        }
        let issued = signer.issue_at(&leaf.request(&sans, &desired.leaf_policy), now)?;
        store.save_leaf(&leaf, &issued)?;
        let reason = match decision {
            Some(LeafDecision::Renew(reason)) => format!("{reason:?}"),
            _ => "missing".to_owned(),
        };
        report.renewed.push(format!("{leaf}: {reason}"));
    }
    // 2. The CA rollover state machine. Step 1 just re-issued every leaf the
    //    previous CA had signed, so none depends on it any more.
    let action = rotation::next_action(
        &state,
        desired.outside_leaves_on_previous,
        &desired.rollover_policy,
        now,
    );
    match action {
        RolloverAction::None => {}
        RolloverAction::CreateNextCa => {
            let ca = Authority::generate_at(
                "cluster-proxy-ca",
                desired.rollover_policy.ca_validity,
                now,
            )?;
            let creds = Credentials {
                cert_pem: ca.cert_pem().to_owned(),
                key_pem: ca.key_pem(),
            };
            save_ca_checked(store, CaSlot::Next, &creds)?;
            let new_entry = rotation::ca_entry_from_pem(&creds.cert_pem)?;
            state = rotation::apply(state, action, Some(new_entry), now)?;
        }
        RolloverAction::SwitchSigning => {
            let (next_creds, _) = next.ok_or(AuthorityError::State("next CA missing".into()))?;
            save_ca_checked(store, CaSlot::Previous, &signer_creds)?;
            store.save_ca(CaSlot::Current, &next_creds)?;
            store.remove_ca(CaSlot::Next)?;
            state = rotation::apply(state, action, None, now)?;
        }
        RolloverAction::RetirePrevious => {
            store.remove_ca(CaSlot::Previous)?;
            state = rotation::apply(state, action, None, now)?;
        }
    }
    if action != RolloverAction::None {
        info!(?action, "CA rollover step");
        report.rollover = Some(format!("{action:?}"));
        store.save_phase(&state.phase)?;
    }
    store.save_bundle(&rotation::trust_bundle(&state))?;
    Ok(report)
}

/// The `files` backend: the layout of [`crate::files`], plus `ca-next/`,
/// `ca-previous/` and `rollover-state` for a rollover in progress.
#[derive(Debug, Clone)]
pub struct FileStore {
    pub layout: Layout,
}

impl FileStore {
    fn ca_pair(&self, slot: CaSlot) -> Pair {
        let dir = match slot {
            CaSlot::Current => files::CA_DIR,
            CaSlot::Next => "ca-next",
            CaSlot::Previous => "ca-previous",
        };
        let dir = self.layout.dir.join(dir);
        Pair {
            cert: dir.join(files::CERT_FILE),
            key: dir.join(files::KEY_FILE),
        }
    }

    fn leaf_pair(&self, leaf: &Leaf) -> Pair {
        match leaf {
            Leaf::ProxyServer => self.layout.proxy_server(),
            Leaf::AgentServer => self.layout.agent_server(),
            Leaf::ProxyClient => self.layout.proxy_client(),
            Leaf::Agent(cluster) => self.layout.agent(cluster),
            Leaf::UserServer => self.layout.user_server(),
            Leaf::UserServerIdentity => self.layout.user_server_identity(),
            Leaf::ServiceProxy => self.layout.service_proxy(),
        }
    }

    fn phase_file(&self) -> PathBuf {
        self.layout.dir.join("rollover-state")
    }
}

fn read_optional(path: &PathBuf) -> Result<Option<String>, AuthorityError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(AuthorityError::Io {
            path: path.clone(),
            source,
        }),
    }
}

fn read_pair(pair: &Pair) -> Result<Option<Credentials>, AuthorityError> {
    Ok(
        match (read_optional(&pair.cert)?, read_optional(&pair.key)?) {
            (Some(cert_pem), Some(key_pem)) => Some(Credentials { cert_pem, key_pem }),
            _ => None,
        },
    )
}

impl Store for FileStore {
    fn load_ca(&self, slot: CaSlot) -> Result<CaParts, AuthorityError> {
        let pair = self.ca_pair(slot);
        Ok(CaParts {
            cert_pem: read_optional(&pair.cert)?,
            key_pem: read_optional(&pair.key)?,
        })
    }

    fn ca_part_names(&self, slot: CaSlot) -> (&'static str, &'static str) {
        match slot {
            CaSlot::Current => ("ca/tls.crt", "ca/tls.key"),
            CaSlot::Next => ("ca-next/tls.crt", "ca-next/tls.key"),
            CaSlot::Previous => ("ca-previous/tls.crt", "ca-previous/tls.key"),
        }
    }

    fn save_ca(&self, slot: CaSlot, ca: &Credentials) -> Result<(), AuthorityError> {
        Ok(files::write_pair(&self.ca_pair(slot), ca)?)
    }

    fn remove_ca(&self, slot: CaSlot) -> Result<(), AuthorityError> {
        let pair = self.ca_pair(slot);
        for path in [&pair.cert, &pair.key] {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(AuthorityError::Io {
                        path: path.clone(),
                        source,
                    });
                }
            }
        }
        Ok(())
    }

    fn load_phase(&self) -> Result<RolloverPhase, AuthorityError> {
        let text = match std::fs::read_to_string(self.phase_file()) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(RolloverPhase::Stable),
            Err(source) => {
                return Err(AuthorityError::Io {
                    path: self.phase_file(),
                    source,
                });
            }
        };
        parse_phase(text.trim()).ok_or_else(|| AuthorityError::State(text.trim().to_owned()))
    }

    fn save_phase(&self, phase: &RolloverPhase) -> Result<(), AuthorityError> {
        Ok(files::write_atomically(
            &self.phase_file(),
            &format_phase(phase),
            false,
        )?)
    }

    fn save_bundle(&self, pems: &[String]) -> Result<(), AuthorityError> {
        let bundle = pems.concat();
        if std::fs::read_to_string(self.layout.bundle())
            .ok()
            .as_deref()
            == Some(bundle.as_str())
        {
            return Ok(());
        }
        Ok(files::write_atomically(
            &self.layout.bundle(),
            &bundle,
            false,
        )?)
    }

    fn load_leaf(&self, leaf: &Leaf) -> Result<Option<Credentials>, AuthorityError> {
        read_pair(&self.leaf_pair(leaf))
    }

    fn save_leaf(&self, leaf: &Leaf, credentials: &Credentials) -> Result<(), AuthorityError> {
        Ok(files::write_pair(&self.leaf_pair(leaf), credentials)?)
    }
}

pub(crate) fn format_phase(phase: &RolloverPhase) -> String {
    match phase {
        RolloverPhase::Stable => "stable\n".into(),
        RolloverPhase::NextPublished { since } => {
            format!("next-published {}\n", since.unix_timestamp())
        }
        RolloverPhase::SigningWithNext { since } => {
            format!("signing-with-next {}\n", since.unix_timestamp())
        }
    }
}

pub(crate) fn parse_phase(text: &str) -> Option<RolloverPhase> {
    let mut words = text.split_whitespace();
    let kind = words.next()?;
    let since = || {
        words
            .clone()
            .next()
            .and_then(|t| t.parse::<i64>().ok())
            .and_then(|t| OffsetDateTime::from_unix_timestamp(t).ok())
    };
    match kind {
        "stable" => Some(RolloverPhase::Stable),
        "next-published" => Some(RolloverPhase::NextPublished { since: since()? }),
        "signing-with-next" => Some(RolloverPhase::SigningWithNext { since: since()? }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::{InitOptions, LOCAL_SANS, init};
    use std::time::Duration;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn pems_in(path: &std::path::Path) -> usize {
        std::fs::read_to_string(path)
            .unwrap()
            .matches("BEGIN CERTIFICATE")
            .count()
    }

    #[test]
    fn renews_leaves_and_rolls_the_ca_over_across_simulated_time() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let cluster = ClusterName::new("cluster-a").unwrap();
        init(
            &layout,
            &InitOptions {
                clusters: vec![cluster.clone()],
                leaf_validity: 90 * DAY,
                ca_validity: 365 * DAY,
                ..InitOptions::default()
            },
        )
        .unwrap();
        let store = FileStore {
            layout: layout.clone(),
        };
        let desired = small_desired(&cluster);
        let t0 = OffsetDateTime::now_utc();
        let at = |days: u32| t0 + time::Duration::try_from(DAY * days).unwrap();

        // Fresh PKI: nothing to do.
        assert_eq!(
            reconcile(&store, &desired, at(0)).unwrap(),
            Report::default()
        );
        // Before 2/3 of the leaves' life nothing is due; past the renewal
        // window (2/3 to 13/15 of it, day 60 to 78) every leaf is renewed
        // once.
        assert!(
            reconcile(&store, &desired, at(59))
                .unwrap()
                .renewed
                .is_empty()
        );
        let report = reconcile(&store, &desired, at(79)).unwrap();
        assert_eq!(report.renewed.len(), 4, "{report:?}");
        assert!(
            reconcile(&store, &desired, at(80))
                .unwrap()
                .renewed
                .is_empty()
        );
        // A changed SAN renews only the server certificates.
        let mut more_sans = desired.clone();
        more_sans.server_sans.push("proxy.example.com".into());
        assert_eq!(
            reconcile(&store, &more_sans, at(81)).unwrap().renewed.len(),
            2
        );

        // 30 days before the CA expires: the next CA is published next to the old one.
        let report = reconcile(&store, &more_sans, at(336)).unwrap();
        assert_eq!(report.rollover.as_deref(), Some("CreateNextCa"));
        assert_eq!(pems_in(&layout.bundle()), 2);
        let old_ca = std::fs::read_to_string(layout.ca().cert).unwrap();
        // Signing switches only after the bundle had time to propagate.
        assert_eq!(
            reconcile(&store, &more_sans, at(340)).unwrap().rollover,
            None
        );
        assert_eq!(std::fs::read_to_string(layout.ca().cert).unwrap(), old_ca);
        let report = reconcile(&store, &more_sans, at(344)).unwrap();
        assert_eq!(report.rollover.as_deref(), Some("SwitchSigning"));
        assert_ne!(std::fs::read_to_string(layout.ca().cert).unwrap(), old_ca);
        assert_eq!(pems_in(&layout.bundle()), 2);
        // Leaves are re-issued by the new CA at once; the old CA stays trusted
        // until the switch has been out for the propagation period.
        let report = reconcile(&store, &more_sans, at(345)).unwrap();
        assert_eq!(report.renewed.len(), 4, "{report:?}");
        assert_eq!(report.rollover, None);
        assert_eq!(pems_in(&layout.bundle()), 2);
        let report = reconcile(&store, &more_sans, at(352)).unwrap();
        assert_eq!(report.rollover.as_deref(), Some("RetirePrevious"));
        assert!(report.renewed.is_empty(), "{report:?}");
        assert_eq!(pems_in(&layout.bundle()), 1);
        assert!(stored_ca(&store, CaSlot::Previous).unwrap().is_none());
        // Steady again.
        assert_eq!(
            reconcile(&store, &more_sans, at(353)).unwrap(),
            Report::default()
        );
    }

    /// Every file under `dir` with its content, to show nothing was written.
    fn tree(dir: &std::path::Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
        let mut files = std::collections::BTreeMap::new();
        let mut pending = vec![dir.to_path_buf()];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    pending.push(path);
                } else {
                    files.insert(path.clone(), std::fs::read(&path).unwrap());
                }
            }
        }
        files
    }

    fn small_desired(cluster: &ClusterName) -> Desired {
        Desired {
            outside_leaves_on_previous: 0,
            clusters: vec![cluster.clone()],
            server_sans: LOCAL_SANS.iter().map(|s| (*s).to_owned()).collect(),
            leaf_policy: LeafPolicy {
                validity: 90 * DAY,
                renew_fraction: 2.0 / 3.0,
                ..LeafPolicy::default()
            },
            rollover_policy: RolloverPolicy {
                ca_validity: 365 * DAY,
                prepare_before_expiry: 30 * DAY,
                bundle_propagation: 7 * DAY,
            },
            user_server_sans: None,
        }
    }

    #[test]
    fn damaged_ca_material_stops_the_pass_and_nothing_is_written() {
        let other_ca = Authority::generate("other", DAY).unwrap();
        type Damage = fn(&Layout, &Authority);
        let damages: [(&str, Damage); 5] = [
            ("certificate removed", |layout, _| {
                std::fs::remove_file(layout.ca().cert).unwrap()
            }),
            ("key removed", |layout, _| {
                std::fs::remove_file(layout.ca().key).unwrap()
            }),
            ("garbage certificate", |layout, _| {
                std::fs::write(layout.ca().cert, "garbage").unwrap()
            }),
            ("garbage key", |layout, _| {
                std::fs::write(layout.ca().key, "garbage").unwrap()
            }),
            ("another CA's key", |layout, other| {
                std::fs::write(layout.ca().key, other.key_pem()).unwrap()
            }),
        ];
        for (what, damage) in damages {
            let dir = tempfile::tempdir().unwrap();
            let layout = Layout::new(dir.path());
            let cluster = ClusterName::new("cluster-a").unwrap();
            init(
                &layout,
                &InitOptions {
                    clusters: vec![cluster.clone()],
                    ..InitOptions::default()
                },
            )
            .unwrap();
            damage(&layout, &other_ca);
            let before = tree(dir.path());
            let store = FileStore {
                layout: layout.clone(),
            };
            // Even a pass that would renew every leaf writes nothing.
            let later = OffsetDateTime::now_utc() + time::Duration::days(80);
            let error = reconcile(&store, &small_desired(&cluster), later).unwrap_err();
            assert!(error.is_damaged_ca(), "{what}: {error}");
            assert!(error.to_string().contains("refusing"), "{what}: {error}");
            assert_eq!(tree(dir.path()), before, "{what}: files changed");
        }
    }

    #[test]
    fn a_half_present_next_ca_is_not_overwritten_by_a_rollover() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let cluster = ClusterName::new("cluster-a").unwrap();
        let desired = small_desired(&cluster);
        init(
            &layout,
            &InitOptions {
                clusters: vec![cluster.clone()],
                ca_validity: 365 * DAY,
                ..InitOptions::default()
            },
        )
        .unwrap();
        let store = FileStore {
            layout: layout.clone(),
        };
        let leftover = Authority::generate("leftover", DAY).unwrap();
        files::write_atomically(
            &dir.path().join("ca-next/tls.key"),
            &leftover.key_pem(),
            true,
        )
        .unwrap();
        let before = tree(dir.path());
        let rollover_time = OffsetDateTime::now_utc() + time::Duration::days(340);
        let error = reconcile(&store, &desired, rollover_time).unwrap_err();
        assert!(
            matches!(
                error,
                AuthorityError::PartialCa {
                    slot: CaSlot::Next,
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(tree(dir.path()), before);
    }

    #[test]
    fn a_different_ca_is_never_overwritten_but_the_same_one_may_be_saved_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore {
            layout: Layout::new(dir.path()),
        };
        let credentials = |ca: &Authority| Credentials {
            cert_pem: ca.cert_pem().to_owned(),
            key_pem: ca.key_pem(),
        };
        let first = Authority::generate("first", DAY).unwrap();
        let second = Authority::generate("second", DAY).unwrap();
        save_ca_checked(&store, CaSlot::Previous, &credentials(&first)).unwrap();
        save_ca_checked(&store, CaSlot::Previous, &credentials(&first)).unwrap();
        assert!(matches!(
            save_ca_checked(&store, CaSlot::Previous, &credentials(&second)),
            Err(AuthorityError::WouldOverwriteCa(CaSlot::Previous))
        ));
        let kept = stored_ca(&store, CaSlot::Previous).unwrap().unwrap();
        assert_eq!(kept.cert_pem, first.cert_pem());
    }

    #[test]
    fn an_uninitialized_store_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore {
            layout: Layout::new(dir.path()),
        };
        let desired = Desired {
            outside_leaves_on_previous: 0,
            clusters: Vec::new(),
            server_sans: Vec::new(),
            leaf_policy: LeafPolicy {
                validity: DAY,
                renew_fraction: 2.0 / 3.0,
                ..LeafPolicy::default()
            },
            rollover_policy: RolloverPolicy {
                ca_validity: DAY,
                prepare_before_expiry: DAY,
                bundle_propagation: DAY,
            },
            user_server_sans: None,
        };
        assert!(matches!(
            reconcile(&store, &desired, OffsetDateTime::now_utc()),
            Err(AuthorityError::NoCa)
        ));
    }
}

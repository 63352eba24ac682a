//! When to renew leaf certificates and how to roll the CA over without an
//! outage.
//!
//! Everything here is pure decision logic over PEM text and an injected
//! instant: callers read files, issue certificates, write them and publish
//! trust bundles, then ask this module what to do next. Keeping I/O out makes
//! the multi-year CA lifecycle testable with simulated time.
//!
//! # Leaf renewal
//!
//! [`leaf_decision`] says whether a leaf must be re-issued: it is outside its
//! validity window, past the renewal point (a point between two fractions of
//! its lifetime, fixed per certificate, so that leaves issued together are
//! not all renewed together), its
//! DNS/IP names no longer match what the workload needs, no trusted CA signed
//! it, or a CA rollover has moved signing to a different CA.
//!
//! # CA rollover
//!
//! Replacing a CA in one step breaks every peer that has not yet picked up the
//! new trust bundle. The rollover therefore runs in phases:
//!
//! 1. [`RolloverPhase::Stable`] — one CA; bundle `[current]`.
//! 2. [`RolloverPhase::NextPublished`] — the next CA exists and is trusted
//!    (bundle `[current, next]`) but nothing is signed by it yet, so peers
//!    have [`RolloverPolicy::bundle_propagation`] to learn the new trust.
//! 3. [`RolloverPhase::SigningWithNext`] — signing moved to the new CA
//!    (bundle `[previous, current]`); leaves get re-issued by it
//!    ([`RenewReason::NotSignedByCurrentSigner`]) while the old CA stays
//!    trusted so not-yet-renewed leaves keep working.
//! 4. Back to `Stable` once no leaf depends on the previous CA.
//!
//! [`next_action`] decides, [`apply`] performs the state change, and
//! [`trust_bundle`] / [`signing_ca`] say what to publish and sign with.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use time::{OffsetDateTime, PrimitiveDateTime};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};

/// Default time the `{old, new}` bundle is published before signing switches.
pub const DEFAULT_BUNDLE_PROPAGATION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default lead time before CA expiry at which the next CA is created.
pub const DEFAULT_PREPARE_BEFORE_EXPIRY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Default fraction of a leaf's lifetime after which it is renewed at the
/// earliest.
pub const DEFAULT_RENEW_FRACTION: f64 = 2.0 / 3.0;
/// Default width of the window leaf renewals are spread over, as a fraction
/// of the lifetime: client-go's certificate manager (kubelet) renews at a
/// jittered point 70–90 % into the lifetime, a window 20 % wide; we keep our
/// 2/3 as the earliest point and spread over the same width, 2/3 to 13/15.
pub const DEFAULT_RENEW_JITTER: f64 = 0.2;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RotationError {
    #[error("{what} is not a PEM certificate: {reason}")]
    Pem { what: &'static str, reason: String },
    #[error("{what} cannot be parsed: {reason}")]
    Parse { what: &'static str, reason: String },
    #[error("{0} is not a CA certificate")]
    NotACa(&'static str),
    #[error("invalid rotation policy: {0}")]
    InvalidPolicy(String),
    #[error("{action:?} does not apply in rollover phase {phase}")]
    InvalidTransition {
        action: RolloverAction,
        phase: &'static str,
    },
    #[error("{0:?} needs the new CA")]
    MissingNewCa(RolloverAction),
    #[error("{0:?} takes no new CA")]
    UnexpectedNewCa(RolloverAction),
    #[error("the new CA expired at {0}")]
    NewCaExpired(OffsetDateTime),
    #[error("the new CA is the current CA")]
    NewCaIsCurrent,
    #[error("inconsistent CA rollover state: {0}")]
    InconsistentState(&'static str),
}

// ---------------------------------------------------------------------------
// Clocks
// ---------------------------------------------------------------------------

/// A source of the current instant, injected so rotation can run on
/// simulated time.
pub trait Clock {
    fn now(&self) -> OffsetDateTime;
}

/// The system's UTC wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> OffsetDateTime {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> OffsetDateTime {
        (**self).now()
    }
}

/// A clock that only moves when told to. Shareable across threads so one
/// test can drive several components.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<OffsetDateTime>,
}

impl ManualClock {
    pub fn new(start: OffsetDateTime) -> Self {
        ManualClock {
            now: Mutex::new(start),
        }
    }

    pub fn set(&self, instant: OffsetDateTime) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = instant;
    }

    /// Moves the clock forward, saturating at the latest representable
    /// instant rather than panicking.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        *now = now.checked_add(span(by)).unwrap_or_else(latest_instant);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> OffsetDateTime {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn latest_instant() -> OffsetDateTime {
    PrimitiveDateTime::MAX.assume_utc()
}

/// Policies use `std` durations (like [`crate::pki`]); arithmetic on
/// instants needs `time` durations. Saturating keeps absurdly long policy
/// values meaning "never" instead of failing.
fn span(d: Duration) -> time::Duration {
    time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}

// ---------------------------------------------------------------------------
// Certificate parsing helpers
// ---------------------------------------------------------------------------

fn first_der(pem: &str, what: &'static str) -> Result<CertificateDer<'static>, RotationError> {
    CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| RotationError::Pem {
        what,
        reason: e.to_string(),
    })
}

/// Every certificate in `pem`, since a trust-bundle entry may itself hold
/// several CAs.
fn all_ders(pem: &str, what: &'static str) -> Result<Vec<CertificateDer<'static>>, RotationError> {
    let ders = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RotationError::Pem {
            what,
            reason: e.to_string(),
        })?;
    if ders.is_empty() {
        return Err(RotationError::Pem {
            what,
            reason: "no certificate found".into(),
        });
    }
    Ok(ders)
}

fn parse<'a>(der: &'a [u8], what: &'static str) -> Result<X509Certificate<'a>, RotationError> {
    X509Certificate::from_der(der)
        .map(|(_, cert)| cert)
        .map_err(|e| RotationError::Parse {
            what,
            reason: e.to_string(),
        })
}

/// Whether `ca`'s key signed `leaf`. Only the signature is checked, not the
/// issuer name: successive CAs usually share a subject DN, so the name cannot
/// tell an old CA from its successor, while the signature can.
fn signed_by(leaf: &X509Certificate<'_>, ca: &X509Certificate<'_>) -> bool {
    leaf.verify_signature(Some(ca.public_key())).is_ok()
}

// ---------------------------------------------------------------------------
// Leaf renewal
// ---------------------------------------------------------------------------

/// When leaf certificates are renewed.
#[derive(Debug, Clone, PartialEq)]
pub struct LeafPolicy {
    /// Validity to issue renewed leaves with. Decisions use each
    /// certificate's own validity, so a policy change does not force
    /// re-issuing everything at once.
    pub validity: Duration,
    /// Fraction of a leaf's lifetime (from `not_before`) after which it is
    /// renewed at the earliest; in `(0, 1]`.
    pub renew_fraction: f64,
    /// Width of the renewal window, as a fraction of the lifetime: a leaf
    /// is renewed at `renew_fraction + renew_jitter × u` of its lifetime,
    /// `u` in `[0, 1)` drawn from the certificate itself
    /// ([`renewal_position`]). Leaves issued together (a fleet's agents, a
    /// restored backup) are so renewed over a window rather than in one
    /// pass, and one leaf's point is the same in every pass and every
    /// replica. At least 0, and `renew_fraction + renew_jitter` at most 1.
    pub renew_jitter: f64,
}

impl Default for LeafPolicy {
    fn default() -> Self {
        LeafPolicy {
            validity: DEFAULT_LEAF_VALIDITY,
            renew_fraction: DEFAULT_RENEW_FRACTION,
            renew_jitter: DEFAULT_RENEW_JITTER,
        }
    }
}

impl LeafPolicy {
    /// The instant at which a certificate valid over `[not_before,
    /// not_after]` should be renewed, `position` (in `[0, 1]`, see
    /// [`renewal_position`]) of the way through the renewal window.
    pub fn renew_at(
        &self,
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
        position: f64,
    ) -> Result<OffsetDateTime, RotationError> {
        let (fraction, jitter) = self.checked()?;
        let fraction = fraction + jitter * position.clamp(0.0, 1.0);
        let lifetime = (not_after - not_before).as_seconds_f64();
        // The renewal point never lies past expiry, so expiry is the safe
        // answer if the arithmetic cannot be represented.
        Ok(
            time::Duration::checked_seconds_f64(lifetime * fraction.min(1.0))
                .and_then(|offset| not_before.checked_add(offset))
                .unwrap_or(not_after),
        )
    }

    /// The renewal fraction and the jitter, once both are valid.
    fn checked(&self) -> Result<(f64, f64), RotationError> {
        let f = self.renew_fraction;
        if !(f.is_finite() && f > 0.0 && f <= 1.0) {
            return Err(RotationError::InvalidPolicy(format!(
                "renew_fraction must be in (0, 1], got {f}"
            )));
        }
        let j = self.renew_jitter;
        if !(j.is_finite() && j >= 0.0 && f + j <= 1.0) {
            return Err(RotationError::InvalidPolicy(format!(
                "renew_jitter must be at least 0 and renew_fraction + renew_jitter at most 1, \
                 got {f} + {j}"
            )));
        }
        Ok((f, j))
    }
}

/// Where in the renewal window a certificate falls, in `[0, 1)`: a hash
/// (64-bit FNV-1a) of its signature, which differs from one certificate to
/// the next (a fresh key, a random serial, randomized ECDSA) and so spreads
/// leaves issued at the same instant evenly over the window, while one
/// certificate always falls at the same point.
pub fn renewal_position(signature: &[u8]) -> f64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let hash = signature.iter().fold(OFFSET, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(PRIME)
    });
    // The top 53 bits, exactly representable as an f64 fraction.
    (hash >> 11) as f64 / (1_u64 << 53) as f64
}

/// Why a leaf must be re-issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewReason {
    /// There is no certificate (empty PEM text).
    Missing,
    /// Past `not_after`.
    Expired,
    /// Before `not_before` (e.g. issued by a host with a skewed clock).
    NotYetValid,
    /// Past the renewal point of [`LeafPolicy::renew_fraction`].
    PastRenewalPoint,
    /// The DNS/IP names differ from those wanted.
    SansChanged,
    /// No CA in the trust bundle signed it.
    IssuerNotTrusted,
    /// Trusted, but signed by a CA other than the one currently signing
    /// (during a CA rollover).
    NotSignedByCurrentSigner,
}

impl std::fmt::Display for RenewReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RenewReason::Missing => "certificate is missing",
            RenewReason::Expired => "certificate has expired",
            RenewReason::NotYetValid => "certificate is not yet valid",
            RenewReason::PastRenewalPoint => "certificate is past its renewal point",
            RenewReason::SansChanged => "subject alternative names changed",
            RenewReason::IssuerNotTrusted => "issuer is not in the trust bundle",
            RenewReason::NotSignedByCurrentSigner => "not signed by the current signing CA",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafDecision {
    /// The certificate is fine; look again at `renew_at`.
    Keep {
        renew_at: OffsetDateTime,
    },
    Renew(RenewReason),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum San {
    // DNS names are case-insensitive.
    Dns(String),
    Ip(IpAddr),
}

/// Mirrors [`crate::pki::Authority::issue`]: IP literals become IP SANs,
/// everything else a DNS SAN.
fn desired_san(text: &str) -> San {
    match text.parse::<IpAddr>() {
        Ok(ip) => San::Ip(ip),
        Err(_) => San::Dns(text.to_ascii_lowercase()),
    }
}

/// The DNS and IP SANs of `cert`. Other kinds (the agent's cluster URI) are
/// identity, not addressing, and are not part of the comparison.
fn cert_sans(cert: &X509Certificate<'_>) -> Result<BTreeSet<San>, RotationError> {
    let bad = |reason: String| RotationError::Parse {
        what: "certificate",
        reason,
    };
    let ext = cert
        .subject_alternative_name()
        .map_err(|e| bad(e.to_string()))?;
    let mut sans = BTreeSet::new();
    for name in ext.iter().flat_map(|ext| ext.value.general_names.iter()) {
        match name {
            GeneralName::DNSName(dns) => {
                sans.insert(San::Dns(dns.to_ascii_lowercase()));
            }
            GeneralName::IPAddress(bytes) => {
                let ip = if let Ok(v4) = <[u8; 4]>::try_from(*bytes) {
                    IpAddr::V4(Ipv4Addr::from(v4))
                } else if let Ok(v6) = <[u8; 16]>::try_from(*bytes) {
                    IpAddr::V6(Ipv6Addr::from(v6))
                } else {
                    return Err(bad(format!("IP address SAN of {} bytes", bytes.len())));
                };
                sans.insert(San::Ip(ip));
            }
            _ => {}
        }
    }
    Ok(sans)
}

/// Whether the leaf in `cert_pem` must be re-issued as of `now`.
///
/// * `desired_sans` — DNS names and IP literals the leaf should carry
///   (order and DNS case do not matter; IPs compare as addresses).
/// * `trusted_ca_pems` — the published trust bundle ([`trust_bundle`]).
/// * `signing_ca_pem` — the CA currently issuing ([`signing_ca`]).
///
/// Empty `cert_pem` is [`RenewReason::Missing`]; text that is not a
/// certificate, or CA PEMs that are not, are errors.
pub fn leaf_decision(
    cert_pem: &str,
    desired_sans: &[String],
    trusted_ca_pems: &[String],
    signing_ca_pem: &str,
    policy: &LeafPolicy,
    now: OffsetDateTime,
) -> Result<LeafDecision, RotationError> {
    policy.checked()?;
    // Parse the CAs before looking at the leaf so a broken bundle is reported
    // even when there is no leaf yet.
    let trusted_ders = trusted_ca_pems
        .iter()
        .map(|pem| all_ders(pem, "trusted CA"))
        .collect::<Result<Vec<_>, _>>()?;
    let trusted = trusted_ders
        .iter()
        .flatten()
        .map(|der| parse(der, "trusted CA"))
        .collect::<Result<Vec<_>, _>>()?;
    let signing_der = first_der(signing_ca_pem, "signing CA")?;
    let signing = parse(&signing_der, "signing CA")?;

    if cert_pem.trim().is_empty() {
        return Ok(LeafDecision::Renew(RenewReason::Missing));
    }
    let leaf_der = first_der(cert_pem, "certificate")?;
    let leaf = parse(&leaf_der, "certificate")?;
    let actual_sans = cert_sans(&leaf)?;

    let not_before = leaf.validity().not_before.to_datetime();
    let not_after = leaf.validity().not_after.to_datetime();
    let reason = if now < not_before {
        Some(RenewReason::NotYetValid)
    } else if now >= not_after {
        Some(RenewReason::Expired)
    } else if !trusted.iter().any(|ca| signed_by(&leaf, ca)) {
        Some(RenewReason::IssuerNotTrusted)
    } else if !signed_by(&leaf, &signing) {
        Some(RenewReason::NotSignedByCurrentSigner)
    } else if actual_sans
        != desired_sans
            .iter()
            .map(|s| desired_san(s))
            .collect::<BTreeSet<_>>()
    {
        Some(RenewReason::SansChanged)
    } else {
        None
    };
    if let Some(reason) = reason {
        return Ok(LeafDecision::Renew(reason));
    }
    let position = renewal_position(leaf.signature_value.data.as_ref());
    let renew_at = policy.renew_at(not_before, not_after, position)?;
    Ok(if now >= renew_at {
        LeafDecision::Renew(RenewReason::PastRenewalPoint)
    } else {
        LeafDecision::Keep { renew_at }
    })
}

// ---------------------------------------------------------------------------
// CA rollover
// ---------------------------------------------------------------------------

/// Timing of CA rollovers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloverPolicy {
    /// Validity to create new CAs with.
    pub ca_validity: Duration,
    /// Create the next CA this long before the current one expires.
    pub prepare_before_expiry: Duration,
    /// How long a bundle containing a new CA must be published before
    /// anything depends on that trust: before signing switches to the new
    /// CA, and again before the old CA leaves the bundle.
    pub bundle_propagation: Duration,
}

impl Default for RolloverPolicy {
    fn default() -> Self {
        RolloverPolicy {
            ca_validity: DEFAULT_CA_VALIDITY,
            prepare_before_expiry: DEFAULT_PREPARE_BEFORE_EXPIRY,
            bundle_propagation: DEFAULT_BUNDLE_PROPAGATION,
        }
    }
}

/// A CA certificate and its validity. The private key stays with the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaEntry {
    pub cert_pem: String,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

/// Reads a CA certificate's validity. Fails for anything that is not a CA
/// certificate.
pub fn ca_entry_from_pem(pem: &str) -> Result<CaEntry, RotationError> {
    let der = first_der(pem, "CA")?;
    let cert = parse(&der, "CA")?;
    if !cert.is_ca() {
        return Err(RotationError::NotACa("CA"));
    }
    Ok(CaEntry {
        cert_pem: pem.to_owned(),
        not_before: cert.validity().not_before.to_datetime(),
        not_after: cert.validity().not_after.to_datetime(),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloverPhase {
    /// One CA; bundle `[current]`.
    Stable,
    /// Next CA created; bundle `[current, next]`; signing still with current.
    NextPublished { since: OffsetDateTime },
    /// Signing switched to the new CA (now `current`); bundle still
    /// `[previous, current]` while leaves get re-issued.
    SigningWithNext { since: OffsetDateTime },
}

impl RolloverPhase {
    pub fn name(&self) -> &'static str {
        match self {
            RolloverPhase::Stable => "Stable",
            RolloverPhase::NextPublished { .. } => "NextPublished",
            RolloverPhase::SigningWithNext { .. } => "SigningWithNext",
        }
    }
}

/// The CAs and where the rollover stands. Plain fields so callers can
/// persist it however they like; [`CaState::validate`] checks a loaded one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaState {
    /// The signing CA.
    pub current: CaEntry,
    /// The CA being introduced (only in [`RolloverPhase::NextPublished`]).
    pub next: Option<CaEntry>,
    /// The CA being retired (only in [`RolloverPhase::SigningWithNext`]).
    pub previous: Option<CaEntry>,
    pub phase: RolloverPhase,
}

impl CaState {
    /// A single CA, no rollover in progress.
    pub fn new(current: CaEntry) -> Self {
        CaState {
            current,
            next: None,
            previous: None,
            phase: RolloverPhase::Stable,
        }
    }

    /// Checks that `next`/`previous` are present exactly in the phases that
    /// use them.
    pub fn validate(&self) -> Result<(), RotationError> {
        let (next, previous) = (self.next.is_some(), self.previous.is_some());
        match self.phase {
            RolloverPhase::Stable if next => {
                Err(RotationError::InconsistentState("Stable with a next CA"))
            }
            RolloverPhase::Stable if previous => Err(RotationError::InconsistentState(
                "Stable with a previous CA",
            )),
            RolloverPhase::NextPublished { .. } if !next => Err(RotationError::InconsistentState(
                "NextPublished without a next CA",
            )),
            RolloverPhase::NextPublished { .. } if previous => Err(
                RotationError::InconsistentState("NextPublished with a previous CA"),
            ),
            RolloverPhase::SigningWithNext { .. } if !previous => Err(
                RotationError::InconsistentState("SigningWithNext without a previous CA"),
            ),
            RolloverPhase::SigningWithNext { .. } if next => Err(RotationError::InconsistentState(
                "SigningWithNext with a next CA",
            )),
            _ => Ok(()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloverAction {
    None,
    /// Create a CA and pass it to [`apply`]; it joins the trust bundle.
    CreateNextCa,
    /// Sign with the new CA from now on.
    SwitchSigning,
    /// Drop the old CA from the trust bundle.
    RetirePrevious,
}

/// What the rollover should do next as of `now`.
///
/// `leaves_signed_by_previous` counts leaves still signed by the previous
/// CA (see [`RenewReason::NotSignedByCurrentSigner`]); the previous CA stays
/// trusted while any remain, unless it has expired and so validates nothing
/// anyway. An inconsistent state yields [`RolloverAction::None`] (and a
/// warning) because acting on it could drop live trust.
pub fn next_action(
    state: &CaState,
    leaves_signed_by_previous: usize,
    policy: &RolloverPolicy,
    now: OffsetDateTime,
) -> RolloverAction {
    if let Err(error) = state.validate() {
        tracing::warn!(%error, "not rolling the CA over");
        return RolloverAction::None;
    }
    let propagated = |since: OffsetDateTime| now - since >= span(policy.bundle_propagation);
    match state.phase {
        RolloverPhase::Stable => {
            // A lead time longer than representable means "prepare now".
            let due = state
                .current
                .not_after
                .checked_sub(span(policy.prepare_before_expiry))
                .is_none_or(|threshold| now >= threshold);
            if due {
                RolloverAction::CreateNextCa
            } else {
                RolloverAction::None
            }
        }
        RolloverPhase::NextPublished { since } => {
            let next_valid = state.next.as_ref().is_some_and(|n| now >= n.not_before);
            // Once the current CA has expired every leaf it signs is
            // already broken, so waiting out propagation only prolongs the
            // outage.
            let current_expired = now >= state.current.not_after;
            if next_valid && (propagated(since) || current_expired) {
                RolloverAction::SwitchSigning
            } else {
                RolloverAction::None
            }
        }
        RolloverPhase::SigningWithNext { since } => {
            let previous_expired = state.previous.as_ref().is_some_and(|p| now >= p.not_after);
            // The grace period after the switch lets re-issued leaves be
            // loaded everywhere before the old trust disappears.
            if previous_expired || (leaves_signed_by_previous == 0 && propagated(since)) {
                RolloverAction::RetirePrevious
            } else {
                RolloverAction::None
            }
        }
    }
}

/// Performs `action` on `state` as of `now`. Only [`RolloverAction::CreateNextCa`]
/// takes `new_ca`. Actions that do not fit the phase are rejected; timing is
/// [`next_action`]'s business, so an operator may act early deliberately.
pub fn apply(
    state: CaState,
    action: RolloverAction,
    new_ca: Option<CaEntry>,
    now: OffsetDateTime,
) -> Result<CaState, RotationError> {
    state.validate()?;
    let phase = state.phase.name();
    let wrong_phase = || RotationError::InvalidTransition { action, phase };
    if action != RolloverAction::CreateNextCa && new_ca.is_some() {
        return Err(RotationError::UnexpectedNewCa(action));
    }
    match action {
        RolloverAction::None => Ok(state),
        RolloverAction::CreateNextCa => {
            if state.phase != RolloverPhase::Stable {
                return Err(wrong_phase());
            }
            let next = new_ca.ok_or(RotationError::MissingNewCa(action))?;
            if next.cert_pem == state.current.cert_pem {
                return Err(RotationError::NewCaIsCurrent);
            }
            if now >= next.not_after {
                return Err(RotationError::NewCaExpired(next.not_after));
            }
            Ok(CaState {
                next: Some(next),
                phase: RolloverPhase::NextPublished { since: now },
                ..state
            })
        }
        RolloverAction::SwitchSigning => {
            if !matches!(state.phase, RolloverPhase::NextPublished { .. }) {
                return Err(wrong_phase());
            }
            let next = state.next.ok_or(RotationError::InconsistentState(
                "NextPublished without a next CA",
            ))?;
            Ok(CaState {
                previous: Some(state.current),
                current: next,
                next: None,
                phase: RolloverPhase::SigningWithNext { since: now },
            })
        }
        RolloverAction::RetirePrevious => {
            if !matches!(state.phase, RolloverPhase::SigningWithNext { .. }) {
                return Err(wrong_phase());
            }
            Ok(CaState {
                previous: None,
                phase: RolloverPhase::Stable,
                ..state
            })
        }
    }
}

/// Starts a rollover now, regardless of how long the current CA has left
/// (e.g. after a suspected key compromise or a policy change).
pub fn request_rollover(
    state: CaState,
    new_ca: CaEntry,
    now: OffsetDateTime,
) -> Result<CaState, RotationError> {
    apply(state, RolloverAction::CreateNextCa, Some(new_ca), now)
}

/// The CA PEMs to publish as trust: the previous CA until retired, the
/// current one, and the next one once published.
pub fn trust_bundle(state: &CaState) -> Vec<String> {
    state
        .previous
        .iter()
        .chain(std::iter::once(&state.current))
        .chain(state.next.iter())
        .map(|ca| ca.cert_pem.clone())
        .collect()
}

/// The CA that issues leaves.
pub fn signing_ca(state: &CaState) -> &CaEntry {
    &state.current
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Authority, LeafRequest};
    use cluster_proxy_proto::identity::ClusterName;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};

    const DAY: Duration = Duration::from_secs(24 * 3600);
    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

    fn t0() -> OffsetDateTime {
        // 2030-03-17, far from any real "now" so nothing depends on the
        // system clock.
        OffsetDateTime::from_unix_timestamp(1_900_000_000).unwrap()
    }

    fn ca(now: OffsetDateTime) -> Authority {
        // Same name for every CA, as a real rollover would have: only the
        // key tells them apart.
        Authority::generate_at("cluster-proxy-ca", 5 * YEAR, now).unwrap()
    }

    fn server_leaf(ca: &Authority, sans: &[&str], now: OffsetDateTime) -> String {
        ca.issue_at(&LeafRequest::server("proxy", sans), now)
            .unwrap()
            .cert_pem
    }

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    fn validity(pem: &str) -> (OffsetDateTime, OffsetDateTime) {
        let der = first_der(pem, "test").unwrap();
        let cert = parse(&der, "test").unwrap();
        (
            cert.validity().not_before.to_datetime(),
            cert.validity().not_after.to_datetime(),
        )
    }

    fn decide(
        cert: &str,
        sans: &[&str],
        trusted: &[&str],
        signing: &str,
        now: OffsetDateTime,
    ) -> Result<LeafDecision, RotationError> {
        leaf_decision(
            cert,
            &strings(sans),
            &strings(trusted),
            signing,
            &LeafPolicy::default(),
            now,
        )
    }

    fn entry(ca: &Authority) -> CaEntry {
        ca_entry_from_pem(ca.cert_pem()).unwrap()
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(t0());
        let shared: &dyn Clock = &clock;
        assert_eq!(shared.now(), t0());
        clock.advance(DAY);
        assert_eq!(shared.now(), t0() + time::Duration::days(1));
        clock.set(t0());
        assert_eq!(clock.now(), t0());
        clock.advance(Duration::MAX);
        assert_eq!(clock.now(), latest_instant());
        let arc = Arc::new(ManualClock::new(t0()));
        assert_eq!(arc.now(), t0());
        assert!(SystemClock.now() > OffsetDateTime::UNIX_EPOCH);
    }

    #[test]
    fn fresh_leaf_is_kept_until_its_point_in_the_renewal_window() {
        let ca = ca(t0());
        let leaf = server_leaf(&ca, &["proxy.example", "10.0.0.1"], t0());
        let (not_before, not_after) = validity(&leaf);
        let earliest: OffsetDateTime = not_before + (not_after - not_before) * (2.0_f64 / 3.0);
        let latest: OffsetDateTime = not_before + (not_after - not_before) * (13.0_f64 / 15.0);
        let clock = ManualClock::new(t0());
        let sans = ["10.0.0.1", "proxy.example"];
        let trusted = [ca.cert_pem()];

        let Ok(LeafDecision::Keep { renew_at }) =
            decide(&leaf, &sans, &trusted, ca.cert_pem(), clock.now())
        else {
            panic!("fresh leaf should be kept");
        };
        // 2/3 to 13/15 of 90 days (plus the 5-minute back-dating) is day 60
        // to day 78.
        assert!(
            earliest <= renew_at && renew_at <= latest,
            "{renew_at} not in [{earliest}, {latest}]"
        );
        // The same certificate, the same point, in every pass.
        assert_eq!(
            decide(&leaf, &sans, &trusted, ca.cert_pem(), t0() + DAY),
            Ok(LeafDecision::Keep { renew_at })
        );

        clock.set(renew_at - time::Duration::seconds(1));
        assert_eq!(
            decide(&leaf, &sans, &trusted, ca.cert_pem(), clock.now()),
            Ok(LeafDecision::Keep { renew_at })
        );
        clock.advance(Duration::from_secs(1));
        assert_eq!(
            decide(&leaf, &sans, &trusted, ca.cert_pem(), clock.now()),
            Ok(LeafDecision::Renew(RenewReason::PastRenewalPoint))
        );
    }

    #[test]
    fn renew_fraction_is_honoured_and_validated() {
        let ca = ca(t0());
        let leaf = ca
            .issue_at(&LeafRequest::client("c").with_validity(100 * DAY), t0())
            .unwrap()
            .cert_pem;
        let (not_before, not_after) = validity(&leaf);
        let half = LeafPolicy {
            renew_fraction: 0.5,
            renew_jitter: 0.0,
            ..LeafPolicy::default()
        };
        let decision = leaf_decision(
            &leaf,
            &[],
            &strings(&[ca.cert_pem()]),
            ca.cert_pem(),
            &half,
            t0(),
        );
        assert_eq!(
            decision,
            Ok(LeafDecision::Keep {
                renew_at: not_before + (not_after - not_before) / 2
            })
        );
        let refused = |policy: &LeafPolicy| {
            matches!(
                leaf_decision(
                    &leaf,
                    &[],
                    &strings(&[ca.cert_pem()]),
                    ca.cert_pem(),
                    policy,
                    t0()
                ),
                Err(RotationError::InvalidPolicy(_))
            )
        };
        for bad in [0.0, -0.1, 1.5, f64::NAN, f64::INFINITY] {
            let policy = LeafPolicy {
                renew_fraction: bad,
                ..LeafPolicy::default()
            };
            assert!(refused(&policy), "{bad}");
        }
        for (fraction, jitter) in [(0.5, -0.1), (0.5, f64::NAN), (0.9, 0.2), (1.0, 0.01)] {
            let policy = LeafPolicy {
                renew_fraction: fraction,
                renew_jitter: jitter,
                ..LeafPolicy::default()
            };
            assert!(refused(&policy), "{fraction} + {jitter}");
        }
    }

    /// A fleet's agent leaves issued in the same second (10,000 clusters
    /// joining a hub, a restored PKI) must not all come due in the same
    /// pass: their renewal points spread over the window, as client-go's
    /// jittered rotation deadline does for kubelets.
    #[test]
    fn leaves_issued_together_are_renewed_over_the_window_not_at_once() {
        let ca = ca(t0());
        let trusted = strings(&[ca.cert_pem()]);
        let policy = LeafPolicy::default();
        let leaves = 200;
        let mut points = Vec::with_capacity(leaves);
        let mut lifetime = time::Duration::ZERO;
        let mut earliest = None;
        for index in 0..leaves {
            let cluster = ClusterName::new(format!("cluster-{index}")).unwrap();
            let leaf = ca
                .issue_at(&LeafRequest::agent(&cluster), t0())
                .unwrap()
                .cert_pem;
            let (not_before, not_after) = validity(&leaf);
            lifetime = not_after - not_before;
            earliest = Some(not_before + lifetime * policy.renew_fraction);
            let Ok(LeafDecision::Keep { renew_at }) =
                leaf_decision(&leaf, &[], &trusted, ca.cert_pem(), &policy, t0())
            else {
                panic!("a fresh leaf is kept");
            };
            points.push(renew_at);
        }
        points.sort();
        let (first, last) = (points[0], points[leaves - 1]);
        let earliest = earliest.unwrap();
        let latest = earliest + lifetime * policy.renew_jitter;
        assert!(earliest <= first && last <= latest, "{first}..{last}");
        // Spread over most of the window (18 days of a 90-day leaf)...
        assert!(
            last - first > lifetime * (policy.renew_jitter * 0.8),
            "renewals only from {first} to {last}"
        );
        // ...evenly: no fifth of the window holds more than twice its share.
        let mut fifths = [0_usize; 5];
        for point in &points {
            let position = (*point - earliest) / (latest - earliest);
            fifths[((position * 5.0) as usize).min(4)] += 1;
        }
        assert!(
            fifths.iter().all(|count| *count <= 2 * leaves / 5),
            "{fifths:?}"
        );
    }

    #[test]
    fn renewal_positions_are_stable_and_in_range() {
        assert_eq!(renewal_position(b"abc"), renewal_position(b"abc"));
        assert_ne!(renewal_position(b"abc"), renewal_position(b"abd"));
        for bytes in [&b""[..], b"\x00", b"\xff\xff\xff\xff\xff\xff\xff\xff"] {
            let position = renewal_position(bytes);
            assert!((0.0..1.0).contains(&position), "{position}");
        }
    }

    #[test]
    fn leaves_outside_their_validity_are_renewed() {
        let ca = ca(t0());
        let leaf = server_leaf(&ca, &["proxy.example"], t0());
        let (not_before, not_after) = validity(&leaf);
        let check = |now| {
            decide(
                &leaf,
                &["proxy.example"],
                &[ca.cert_pem()],
                ca.cert_pem(),
                now,
            )
        };
        assert_eq!(
            check(not_after),
            Ok(LeafDecision::Renew(RenewReason::Expired))
        );
        assert_eq!(
            check(not_after + time::Duration::days(400)),
            Ok(LeafDecision::Renew(RenewReason::Expired))
        );
        assert_eq!(
            check(not_before - time::Duration::seconds(1)),
            Ok(LeafDecision::Renew(RenewReason::NotYetValid))
        );
    }

    #[test]
    fn san_changes_are_detected_regardless_of_order_and_case() {
        let ca = ca(t0());
        let trusted = [ca.cert_pem()];
        let leaf = server_leaf(&ca, &["proxy.example", "10.0.0.1", "::1"], t0());
        let check = |sans: &[&str]| decide(&leaf, sans, &trusted, ca.cert_pem(), t0());
        let keep =
            |d: Result<LeafDecision, RotationError>| matches!(d, Ok(LeafDecision::Keep { .. }));
        let changed = Ok(LeafDecision::Renew(RenewReason::SansChanged));

        assert!(keep(check(&["::1", "PROXY.example", "10.0.0.1"])));
        // IPs compare as addresses, not as text.
        assert!(keep(check(&[
            "0:0:0:0:0:0:0:1",
            "proxy.example",
            "10.0.0.1"
        ])));
        // Duplicates name the same SAN.
        assert!(keep(check(&[
            "proxy.example",
            "proxy.example",
            "10.0.0.1",
            "::1"
        ])));

        assert_eq!(
            check(&["proxy.example", "10.0.0.1", "::1", "extra.example"]),
            changed
        );
        assert_eq!(check(&["proxy.example", "10.0.0.1"]), changed);
        assert_eq!(check(&["proxy.example", "10.0.0.2", "::1"]), changed);
        assert_eq!(check(&[]), changed);
    }

    #[test]
    fn an_ip_text_in_a_dns_san_is_not_an_ip_san() {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).unwrap();

        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::DnsName("10.0.0.1".try_into().unwrap())];
        let leaf = params
            .signed_by(&KeyPair::generate().unwrap(), &issuer)
            .unwrap()
            .pem();
        let (not_before, _) = validity(&leaf);
        let now = not_before + time::Duration::hours(1);
        assert_eq!(
            decide(&leaf, &["10.0.0.1"], &[&ca_pem], &ca_pem, now),
            Ok(LeafDecision::Renew(RenewReason::SansChanged))
        );
    }

    #[test]
    fn uri_sans_do_not_count_as_addresses() {
        let ca = ca(t0());
        let cluster = ClusterName::new("cluster-a").unwrap();
        let leaf = ca
            .issue_at(&LeafRequest::agent(&cluster), t0())
            .unwrap()
            .cert_pem;
        assert!(matches!(
            decide(&leaf, &[], &[ca.cert_pem()], ca.cert_pem(), t0()),
            Ok(LeafDecision::Keep { .. })
        ));
    }

    #[test]
    fn leaves_from_an_untrusted_ca_are_renewed_even_with_the_same_issuer_name() {
        let ours = ca(t0());
        let theirs = ca(t0());
        let leaf = server_leaf(&theirs, &["proxy.example"], t0());
        assert_eq!(
            decide(
                &leaf,
                &["proxy.example"],
                &[ours.cert_pem()],
                ours.cert_pem(),
                t0()
            ),
            Ok(LeafDecision::Renew(RenewReason::IssuerNotTrusted))
        );
        // Trusted among several bundle entries, one of which holds two CAs.
        let bundle = format!("{}{}", ours.cert_pem(), theirs.cert_pem());
        assert!(matches!(
            decide(
                &leaf,
                &["proxy.example"],
                &[&bundle],
                theirs.cert_pem(),
                t0()
            ),
            Ok(LeafDecision::Keep { .. })
        ));
    }

    #[test]
    fn garbage_is_an_error_and_empty_is_missing() {
        let ca = ca(t0());
        let pem = ca.cert_pem();
        let junk_armor =
            "-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n-----END CERTIFICATE-----\n";
        let not_der = "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n";

        assert!(matches!(
            decide("garbage", &[], &[pem], pem, t0()),
            Err(RotationError::Pem {
                what: "certificate",
                ..
            })
        ));
        assert!(matches!(
            decide(junk_armor, &[], &[pem], pem, t0()),
            Err(RotationError::Pem { .. })
        ));
        assert!(matches!(
            decide(not_der, &[], &[pem], pem, t0()),
            Err(RotationError::Parse {
                what: "certificate",
                ..
            })
        ));
        let leaf = server_leaf(&ca, &[], t0());
        assert!(matches!(
            decide(&leaf, &[], &["garbage"], pem, t0()),
            Err(RotationError::Pem {
                what: "trusted CA",
                ..
            })
        ));
        assert!(matches!(
            decide(&leaf, &[], &[pem], not_der, t0()),
            Err(RotationError::Parse {
                what: "signing CA",
                ..
            })
        ));
        assert_eq!(
            decide("  \n", &[], &[pem], pem, t0()),
            Ok(LeafDecision::Renew(RenewReason::Missing))
        );
    }

    #[test]
    fn ca_entries_read_validity_and_reject_leaves() {
        let ca = ca(t0());
        let entry = entry(&ca);
        assert_eq!(entry.cert_pem, ca.cert_pem());
        assert_eq!(entry.not_before, t0() - time::Duration::minutes(5));
        assert_eq!(entry.not_after, t0() + span(5 * YEAR));
        let leaf = server_leaf(&ca, &[], t0());
        assert_eq!(ca_entry_from_pem(&leaf), Err(RotationError::NotACa("CA")));
        assert!(matches!(
            ca_entry_from_pem("garbage"),
            Err(RotationError::Pem { .. })
        ));
    }

    #[test]
    fn full_rollover_cycle_without_losing_trust() {
        let policy = RolloverPolicy::default();
        let clock = ManualClock::new(t0());
        let old_ca = ca(clock.now());
        let mut state = CaState::new(entry(&old_ca));
        assert_eq!(trust_bundle(&state), strings(&[old_ca.cert_pem()]));

        // Years of nothing to do.
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::None
        );
        clock.advance(3 * YEAR);
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::None
        );
        let threshold = state.current.not_after - span(policy.prepare_before_expiry);
        clock.set(threshold - time::Duration::seconds(1));
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::None
        );
        clock.set(threshold);
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::CreateNextCa
        );

        // Publish the next CA; signing stays with the old one.
        let new_ca = ca(clock.now());
        state = apply(
            state,
            RolloverAction::CreateNextCa,
            Some(entry(&new_ca)),
            clock.now(),
        )
        .unwrap();
        assert_eq!(
            state.phase,
            RolloverPhase::NextPublished { since: clock.now() }
        );
        assert_eq!(
            trust_bundle(&state),
            strings(&[old_ca.cert_pem(), new_ca.cert_pem()])
        );
        assert_eq!(signing_ca(&state).cert_pem, old_ca.cert_pem());
        let old_leaf = server_leaf(&old_ca, &["proxy.example"], clock.now());
        let check_old = |state: &CaState, now| {
            leaf_decision(
                &old_leaf,
                &strings(&["proxy.example"]),
                &trust_bundle(state),
                &signing_ca(state).cert_pem,
                &LeafPolicy::default(),
                now,
            )
        };
        assert!(matches!(
            check_old(&state, clock.now()),
            Ok(LeafDecision::Keep { .. })
        ));

        // Signing switches only after the bundle has propagated.
        clock.advance(6 * DAY);
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::None
        );
        clock.advance(DAY);
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::SwitchSigning
        );
        state = apply(state, RolloverAction::SwitchSigning, None, clock.now()).unwrap();
        assert_eq!(
            state.phase,
            RolloverPhase::SigningWithNext { since: clock.now() }
        );
        assert_eq!(signing_ca(&state).cert_pem, new_ca.cert_pem());
        assert_eq!(
            state.previous.as_ref().map(|p| p.cert_pem.as_str()),
            Some(old_ca.cert_pem())
        );
        assert_eq!(state.next, None);
        assert_eq!(
            trust_bundle(&state),
            strings(&[old_ca.cert_pem(), new_ca.cert_pem()])
        );

        // Old leaves are still trusted but must move to the new signer.
        assert_eq!(
            check_old(&state, clock.now()),
            Ok(LeafDecision::Renew(RenewReason::NotSignedByCurrentSigner))
        );
        let new_leaf = server_leaf(&new_ca, &["proxy.example"], clock.now());
        assert!(matches!(
            leaf_decision(
                &new_leaf,
                &strings(&["proxy.example"]),
                &trust_bundle(&state),
                &signing_ca(&state).cert_pem,
                &LeafPolicy::default(),
                clock.now(),
            ),
            Ok(LeafDecision::Keep { .. })
        ));

        // Retiring waits for both the grace period and the last old leaf.
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::None
        );
        clock.advance(7 * DAY);
        assert_eq!(
            next_action(&state, 3, &policy, clock.now()),
            RolloverAction::None
        );
        clock.advance(30 * DAY);
        assert_eq!(
            next_action(&state, 1, &policy, clock.now()),
            RolloverAction::None
        );
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::RetirePrevious
        );
        state = apply(state, RolloverAction::RetirePrevious, None, clock.now()).unwrap();
        assert_eq!(state, CaState::new(entry(&new_ca)));
        assert_eq!(trust_bundle(&state), strings(&[new_ca.cert_pem()]));

        // A straggler signed by the old CA is no longer trusted.
        assert_eq!(
            check_old(&state, clock.now()),
            Ok(LeafDecision::Renew(RenewReason::IssuerNotTrusted))
        );
        // And the cycle starts over for the new CA.
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::None
        );
        clock.set(state.current.not_after - span(policy.prepare_before_expiry));
        assert_eq!(
            next_action(&state, 0, &policy, clock.now()),
            RolloverAction::CreateNextCa
        );
    }

    #[test]
    fn an_expired_previous_ca_is_retired_despite_old_leaves() {
        let policy = RolloverPolicy::default();
        let old = entry(&ca(t0()));
        let new = entry(&ca(t0() + span(4 * YEAR)));
        let switched = old.not_after - time::Duration::days(1);
        let state = CaState {
            current: new,
            next: None,
            previous: Some(old.clone()),
            phase: RolloverPhase::SigningWithNext { since: switched },
        };
        assert_eq!(
            next_action(&state, 5, &policy, switched),
            RolloverAction::None
        );
        assert_eq!(
            next_action(&state, 5, &policy, old.not_after),
            RolloverAction::RetirePrevious
        );
    }

    #[test]
    fn an_expired_current_ca_switches_without_waiting_for_propagation() {
        let policy = RolloverPolicy::default();
        let old = entry(&ca(t0()));
        let published = old.not_after - time::Duration::days(1);
        let new = entry(&ca(published));
        let state = request_rollover(CaState::new(old.clone()), new, published).unwrap();
        assert_eq!(
            next_action(&state, 0, &policy, published),
            RolloverAction::None
        );
        assert_eq!(
            next_action(&state, 0, &policy, old.not_after),
            RolloverAction::SwitchSigning
        );
    }

    #[test]
    fn a_rollover_can_be_forced_early() {
        let policy = RolloverPolicy::default();
        let state = CaState::new(entry(&ca(t0())));
        assert_eq!(next_action(&state, 0, &policy, t0()), RolloverAction::None);
        let state = request_rollover(state, entry(&ca(t0())), t0()).unwrap();
        assert_eq!(state.phase, RolloverPhase::NextPublished { since: t0() });
        assert_eq!(trust_bundle(&state).len(), 2);
    }

    #[test]
    fn transitions_that_do_not_fit_the_phase_are_rejected() {
        let now = t0();
        let stable = CaState::new(entry(&ca(now)));
        let fresh = entry(&ca(now));
        let published = request_rollover(stable.clone(), fresh.clone(), now).unwrap();
        let switched = apply(published.clone(), RolloverAction::SwitchSigning, None, now).unwrap();

        let wrong = |state: &CaState, action| {
            let extra = (action == RolloverAction::CreateNextCa).then(|| entry(&ca(now)));
            apply(state.clone(), action, extra, now)
        };
        for (state, action) in [
            (&stable, RolloverAction::SwitchSigning),
            (&stable, RolloverAction::RetirePrevious),
            (&published, RolloverAction::CreateNextCa),
            (&published, RolloverAction::RetirePrevious),
            (&switched, RolloverAction::CreateNextCa),
            (&switched, RolloverAction::SwitchSigning),
        ] {
            assert_eq!(
                wrong(state, action),
                Err(RotationError::InvalidTransition {
                    action,
                    phase: state.phase.name()
                }),
                "{action:?} in {}",
                state.phase.name()
            );
        }

        assert_eq!(
            apply(stable.clone(), RolloverAction::CreateNextCa, None, now),
            Err(RotationError::MissingNewCa(RolloverAction::CreateNextCa))
        );
        assert_eq!(
            apply(
                published.clone(),
                RolloverAction::SwitchSigning,
                Some(fresh.clone()),
                now
            ),
            Err(RotationError::UnexpectedNewCa(
                RolloverAction::SwitchSigning
            ))
        );
        assert_eq!(
            request_rollover(stable.clone(), stable.current.clone(), now),
            Err(RotationError::NewCaIsCurrent)
        );
        assert_eq!(
            request_rollover(stable.clone(), fresh.clone(), fresh.not_after),
            Err(RotationError::NewCaExpired(fresh.not_after))
        );
        assert_eq!(
            apply(stable.clone(), RolloverAction::None, None, now),
            Ok(stable.clone())
        );

        let broken = CaState {
            next: None,
            ..published
        };
        assert!(matches!(
            apply(broken.clone(), RolloverAction::SwitchSigning, None, now),
            Err(RotationError::InconsistentState(_))
        ));
        assert_eq!(
            next_action(&broken, 0, &RolloverPolicy::default(), now + span(YEAR)),
            RolloverAction::None
        );
    }
}

//! Sharing the clusters among prober replicas.
//!
//! Each replica holds a member Lease of its own in the hub namespace
//! (labelled [`MEMBER_LABEL`]) and renews it every few seconds. Every
//! renewal also lists the member Leases, so each replica knows the live
//! members (Leases renewed within their `leaseDurationSeconds`, and always
//! itself) and probes only the clusters whose rendezvous owner
//! ([`Members::owner`]) it is.
//!
//! Rendezvous (highest-random-weight) hashing needs no coordination beyond
//! the member list: every replica computes the same owner from the same
//! list, and when a member joins or leaves only the clusters it gains or
//! held move. Replicas whose views differ for a moment (one renewal period
//! after a join, one lease duration after a crash) probe some clusters
//! twice or, after a crash, leave the dead member's clusters unprobed until
//! its Lease expires. Probing twice is harmless: a write happens only when
//! the stored condition differs from the verdict, so two replicas agreeing
//! write at most once more between them.

use std::time::Duration;

use cluster_proxy_control::leader::lease_seconds;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

/// The label every member Lease carries, with the value `true`.
pub const MEMBER_LABEL: &str = "cluster-proxy.open-cluster-management.io/health-prober-member";
/// Member Leases are named this and a hash of the member's identity.
pub const MEMBER_LEASE_PREFIX: &str = "cluster-proxy-health-prober-";
/// A member Lease expired this many lease durations ago is deleted by the
/// live members: a replica killed without SIGTERM (OOM, node loss) cannot
/// delete its own, and each restart makes a new one.
const COLLECT_AFTER_DURATIONS: u32 = 10;
/// Dead members' Leases deleted per renewal at most, so that a backlog
/// (a crash loop's worth) cannot make a renewal late.
const COLLECT_PER_RENEWAL: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("lease timing: renewing every {renew_every:?} cannot keep a {lease_duration:?} lease")]
    Timing {
        lease_duration: Duration,
        renew_every: Duration,
    },
    #[error("renewing the member Lease timed out after {0:?}")]
    Timeout(Duration),
}

/// The rendezvous weight of `cluster` at `member`: the first 8 bytes of a
/// SHA-256, so every replica, build and platform computes the same owner.
pub fn weight(cluster: &str, member: &str) -> u64 {
    let mut hash = Sha256::new();
    // The length keeps ("ab", "c") and ("a", "bc") apart.
    hash.update((member.len() as u64).to_be_bytes());
    hash.update(member.as_bytes());
    hash.update(cluster.as_bytes());
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The live members as one replica sees them, itself always among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Members {
    own: String,
    /// Sorted and without duplicates; holds `own`.
    all: Vec<String>,
}

impl Members {
    pub fn new(own: impl Into<String>, others: impl IntoIterator<Item = String>) -> Self {
        let own = own.into();
        let mut all: Vec<String> = others.into_iter().collect();
        all.push(own.clone());
        all.sort();
        all.dedup();
        Members { own, all }
    }

    /// This replica's member name.
    pub fn own(&self) -> &str {
        &self.own
    }

    /// Every live member, sorted.
    pub fn all(&self) -> &[String] {
        &self.all
    }

    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// Never true: a replica always counts itself.
    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// The member that probes `cluster`: the highest weight, ties (which
    /// SHA-256 makes practically impossible) to the greater name.
    pub fn owner(&self, cluster: &str) -> &str {
        self.all
            .iter()
            .map(|member| (weight(cluster, member), member))
            .max()
            .map(|(_, member)| member.as_str())
            .unwrap_or(&self.own)
    }

    /// Whether this replica probes `cluster`.
    pub fn owns(&self, cluster: &str) -> bool {
        self.owner(cluster) == self.own
    }
}

/// The name of the member Lease of `identity`: identities carry characters
/// a Lease name may not (`_`), so it is hashed.
pub fn member_lease_name(identity: &str) -> String {
    format!("{MEMBER_LEASE_PREFIX}{:016x}", weight(identity, ""))
}

/// Whether a member Lease read at `now` is still held: renewed (or
/// acquired) less than `leaseDurationSeconds` ago. As in leader election,
/// the renewal time is the holder's clock; skew between replicas shortens
/// or lengthens a dead member's grace by the same amount.
pub fn is_live(spec: Option<&LeaseSpec>, now: Timestamp) -> bool {
    expired_for(spec, now).is_none()
}

/// How long ago the Lease expired, `None` while it is live. A Lease
/// without a holder or a time has expired for good.
fn expired_for(spec: Option<&LeaseSpec>, now: Timestamp) -> Option<Duration> {
    let forever = Some(Duration::MAX);
    let Some(spec) = spec else {
        return forever;
    };
    if spec.holder_identity.as_deref().is_none_or(str::is_empty) {
        return forever;
    }
    let Some(renewed) = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()) else {
        return forever;
    };
    let duration_ms = i64::from(spec.lease_duration_seconds.unwrap_or(15)).saturating_mul(1000);
    let expires_ms = renewed.0.as_millisecond().saturating_add(duration_ms);
    let past_ms = now.as_millisecond().saturating_sub(expires_ms);
    (past_ms >= 0).then(|| Duration::from_millis(past_ms.unsigned_abs()))
}

/// One replica's membership: its Lease, renewed with the member list.
#[derive(Debug, Clone)]
pub struct Membership {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration_seconds: i32,
    lease_duration: Duration,
    renew_every: Duration,
}

impl Membership {
    /// `lease_duration` is rounded up to whole seconds (the Lease's unit);
    /// `renew_every` must be shorter than it, or the Lease lapses between
    /// renewals.
    pub fn new(
        api: Api<Lease>,
        identity: impl Into<String>,
        lease_duration: Duration,
        renew_every: Duration,
    ) -> Result<Self, MembershipError> {
        let lease_duration_seconds =
            lease_seconds(lease_duration, renew_every).ok_or(MembershipError::Timing {
                lease_duration,
                renew_every,
            })?;
        let identity = identity.into();
        Ok(Membership {
            api,
            name: member_lease_name(&identity),
            identity,
            lease_duration_seconds,
            lease_duration,
            renew_every,
        })
    }

    /// The member Lease's name, this replica's name among the members.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Lists the member Leases, creates or renews this replica's, deletes
    /// members long dead, and returns the live members.
    pub async fn heartbeat(&self) -> Result<Members, MembershipError> {
        let listed = self
            .api
            .list(&ListParams::default().labels(&format!("{MEMBER_LABEL}=true")))
            .await?;
        let now = Timestamp::now();
        let mut others = Vec::new();
        let mut own = None;
        let mut dead = Vec::new();
        let collect_after = self.lease_duration * COLLECT_AFTER_DURATIONS;
        for lease in listed.items {
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            if name == self.name {
                own = Some(lease);
                continue;
            }
            match expired_for(lease.spec.as_ref(), now) {
                None => others.push(name),
                Some(expired) if expired >= collect_after => dead.push(lease),
                Some(_) => {}
            }
        }
        self.renew(own, now).await?;
        for lease in dead.iter().take(COLLECT_PER_RENEWAL) {
            self.collect(lease).await;
        }
        Ok(Members::new(self.name.clone(), others))
    }

    async fn renew(&self, existing: Option<Lease>, now: Timestamp) -> Result<(), MembershipError> {
        let renewed = Some(MicroTime(now));
        let spec = LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease_duration_seconds),
            acquire_time: existing
                .as_ref()
                .and_then(|l| l.spec.as_ref())
                .filter(|s| s.holder_identity.as_deref() == Some(self.identity.as_str()))
                .and_then(|s| s.acquire_time.clone())
                .or_else(|| renewed.clone()),
            renew_time: renewed,
            ..LeaseSpec::default()
        };
        match existing {
            // Keeps the listed resourceVersion: a concurrent writer (a
            // member collecting it as dead) makes this a 409, retried on
            // the next renewal from a fresh list.
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await?;
            }
            None => {
                let mut lease = Lease {
                    spec: Some(spec),
                    ..Lease::default()
                };
                lease.metadata.name = Some(self.name.clone());
                lease.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
                self.api.create(&PostParams::default(), &lease).await?;
                tracing::info!(lease = %self.name, identity = %self.identity, "joined the probers");
            }
        }
        Ok(())
    }

    /// Deletes a member Lease long expired, unless it changed since it was
    /// listed (its member came back): every live member may try at once.
    async fn collect(&self, lease: &Lease) {
        let Some(name) = lease.metadata.name.as_deref() else {
            return;
        };
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: lease.metadata.resource_version.clone(),
                uid: lease.metadata.uid.clone(),
            }),
            ..DeleteParams::default()
        };
        match self.api.delete(name, &params).await {
            Ok(_) => tracing::info!(lease = name, "deleted the Lease of a member long gone"),
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
            Err(error) => tracing::warn!(lease = name, %error, "deleting a dead member's Lease"),
        }
    }

    /// Deletes this replica's Lease, so the others take its clusters on
    /// their next renewal instead of after it expires.
    pub async fn leave(&self) -> Result<(), MembershipError> {
        match self.api.delete(&self.name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// Renews every `renew_every` and publishes each change of the live
    /// members on `members` until `shutdown` completes; then leaves.
    ///
    /// The first view is published after the second successful renewal
    /// (`None` until then): replicas started together (a new Deployment, a
    /// scale-up) each list before the others have created their Leases, and
    /// would otherwise all probe every cluster in their first round; one
    /// renewal period later each sees the others.
    ///
    /// A failed renewal keeps the last view rather than dropping it or
    /// claiming every cluster: when the Lease API fails for every replica
    /// at once, their last views agreed and still cover every cluster once;
    /// when it fails for this one alone, the others see its Lease expire
    /// and take its clusters too, so at worst they are probed twice.
    pub async fn run(
        self,
        members: watch::Sender<Option<Members>>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut ticker = tokio::time::interval(self.renew_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut renewals = 0u32;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                _ = ticker.tick() => {}
            }
            let beat = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                beat = tokio::time::timeout(self.renew_every, self.heartbeat()) => beat,
            };
            match beat.unwrap_or(Err(MembershipError::Timeout(self.renew_every))) {
                Ok(live) => {
                    renewals = renewals.saturating_add(1);
                    if renewals < 2 {
                        continue;
                    }
                    members.send_if_modified(|current| {
                        if current.as_ref() == Some(&live) {
                            return false;
                        }
                        tracing::info!(members = ?live.all(), own = %live.own(), "probers changed");
                        *current = Some(live);
                        true
                    });
                }
                Err(error) => {
                    tracing::warn!(lease = %self.name, %error, "renewing the member Lease");
                }
            }
        }
        members.send_replace(None);
        match tokio::time::timeout(self.renew_every, self.leave()).await {
            Ok(Ok(())) => tracing::info!(lease = %self.name, "left the probers"),
            Ok(Err(error)) => {
                tracing::warn!(lease = %self.name, %error, "deleting the member Lease; it expires on its own")
            }
            Err(_) => {
                tracing::warn!(lease = %self.name, "deleting the member Lease timed out; it expires on its own")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn clusters(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("cluster-{i:05}")).collect()
    }

    fn members(own: &str, all: &[&str]) -> Members {
        Members::new(own, all.iter().map(|m| (*m).to_owned()))
    }

    #[test]
    fn the_weight_is_fixed_across_processes_and_builds() {
        // Pinned (computed with Python's hashlib): a change here makes
        // replicas of two versions disagree on owners during an upgrade.
        assert_eq!(weight("cluster-a", "prober-0"), 0xb360_874d_01be_91fc);
        assert_ne!(weight("ab", "c"), weight("a", "bc"));
        assert_eq!(
            member_lease_name("prober-0_1234abcd"),
            format!(
                "{MEMBER_LEASE_PREFIX}{:016x}",
                weight("prober-0_1234abcd", "")
            )
        );
    }

    #[test]
    fn every_member_agrees_on_one_owner_per_cluster() {
        let names = ["p-a", "p-b", "p-c"];
        let views: Vec<Members> = names.iter().map(|own| members(own, &names)).collect();
        for cluster in clusters(1000) {
            let owners: Vec<&str> = views.iter().map(|v| v.owner(&cluster)).collect();
            assert!(owners.windows(2).all(|w| w[0] == w[1]), "{owners:?}");
            assert_eq!(views.iter().filter(|v| v.owns(&cluster)).count(), 1);
        }
    }

    #[test]
    fn ten_thousand_clusters_spread_evenly_over_three_members() {
        let view = members("p-0", &["p-0", "p-1", "p-2"]);
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for cluster in clusters(10_000) {
            *counts.entry(view.owner(&cluster)).or_default() += 1;
        }
        assert_eq!(counts.len(), 3, "{counts:?}");
        assert_eq!(counts.values().sum::<usize>(), 10_000);
        // Binomial(10,000, 1/3): sd ≈ 47, so ±5% of the fair 3,333 is ±3.5 sd.
        for (member, count) in &counts {
            assert!(
                (3_166..=3_500).contains(count),
                "{member}: {count} ({counts:?})"
            );
        }
    }

    #[test]
    fn only_the_leavers_clusters_move_and_a_joiner_takes_only_its_share() {
        let before = members("p-0", &["p-0", "p-1", "p-2"]);
        let after = members("p-0", &["p-0", "p-2"]);
        let mut moved = 0;
        for cluster in clusters(10_000) {
            let (was, is) = (before.owner(&cluster), after.owner(&cluster));
            if was == "p-1" {
                moved += 1;
                assert_ne!(is, "p-1");
            } else {
                assert_eq!(was, is, "{cluster} moved though its owner stayed");
            }
        }
        assert!((3_166..=3_500).contains(&moved), "{moved}");

        let joined = members("p-0", &["p-0", "p-1", "p-2", "p-3"]);
        let mut taken = 0;
        for cluster in clusters(10_000) {
            let (was, is) = (before.owner(&cluster), joined.owner(&cluster));
            if is == "p-3" {
                taken += 1;
            } else {
                assert_eq!(was, is, "{cluster} moved between members that stayed");
            }
        }
        assert!((2_375..=2_625).contains(&taken), "{taken}");
    }

    #[test]
    fn a_replica_alone_owns_everything_and_counts_itself_once() {
        let alone = Members::new("p-0", Vec::new());
        assert!(clusters(100).iter().all(|c| alone.owns(c)));
        let view = members("p-0", &["p-1", "p-0", "p-1"]);
        assert_eq!(view.all(), ["p-0", "p-1"]);
        assert_eq!(view.len(), 2);
    }

    #[test]
    fn a_lease_lives_for_its_duration_after_the_last_renewal() {
        let t0 = Timestamp::from_second(1_800_000_000).unwrap();
        let spec = |holder: Option<&str>, renewed: Option<Timestamp>| LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            renew_time: renewed.map(MicroTime),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        };
        let at = |seconds: i64| t0 + k8s_openapi::jiff::SignedDuration::from_secs(seconds);
        let held = spec(Some("a"), Some(t0));
        assert!(is_live(Some(&held), at(14)));
        assert!(!is_live(Some(&held), at(15)));
        assert_eq!(
            expired_for(Some(&held), at(165)),
            Some(Duration::from_secs(150))
        );
        assert!(!is_live(Some(&spec(None, Some(t0))), t0));
        assert!(!is_live(Some(&spec(Some(""), Some(t0))), t0));
        assert!(!is_live(Some(&spec(Some("a"), None)), t0));
        assert!(!is_live(None, t0));
    }

    #[tokio::test]
    async fn timings_that_cannot_keep_the_lease_are_refused() {
        let client = kube::Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("static URL"),
        ))
        .unwrap();
        let api: Api<Lease> = Api::namespaced(client, "default");
        let s = Duration::from_secs;
        for (duration, renew) in [(s(10), s(10)), (s(10), s(0)), (s(5), s(10))] {
            let err = Membership::new(api.clone(), "a", duration, renew).unwrap_err();
            assert!(matches!(err, MembershipError::Timing { .. }), "{err}");
        }
        let ok = Membership::new(api, "a", Duration::from_millis(2500), s(1)).unwrap();
        assert_eq!(ok.lease_duration_seconds, 3);
        assert!(ok.name().starts_with(MEMBER_LEASE_PREFIX));
    }
}

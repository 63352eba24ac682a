//! Rolling a configuration change out over a placement's clusters, as the
//! install strategy's `rolloutStrategy` asks (OCM's `All`, `Progressive` and
//! `ProgressivePerGroup`).
//!
//! OCM's own addon-manager does this for addons in its lifecycle; ours says
//! `self` (see [`super::install`]), so the addon controller does it. Each
//! agent ManifestWork carries the spec hashes of the configurations it was
//! rendered from (annotation [`ANNOTATION_CONFIG_SPEC_HASH`], OCM's format).
//! A cluster whose configurations no longer match its work's is to be
//! updated; the strategy of its placement decides when
//! ([`Rollouts::decide`]). Until then its work is left exactly as it is,
//! like OCM's configuration check does. New clusters are installed at once:
//! there is nothing to keep.
//!
//! A cluster has rolled out ([`Phase::Succeeded`]) when its work is applied
//! and available at its current generation and its addon is `Available`;
//! it is [`Phase::Failed`] when the work agent cannot apply the work or the
//! `progressDeadline` passes first. Each cluster's reconcile records its
//! phase in the addon's `Progressing` condition (OCM's reasons `Progressing`,
//! `Completed`, `Failed`), whose transition times make the soak
//! (`minSuccessTime`) and the deadline survive a restart.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::{
    CONDITION_AVAILABLE, CONDITION_PROGRESSING, ClusterManagementAddOn, ConfigReference,
    ManagedClusterAddOn, REASON_COMPLETED, REASON_FAILED, REASON_PROGRESSING,
};
use cluster_proxy_proto::api::cluster::v1alpha1::{
    MandatoryDecisionGroup, ROLLOUT_ALL, ROLLOUT_PROGRESSIVE, ROLLOUT_PROGRESSIVE_PER_GROUP,
    RolloutStrategy,
};
use cluster_proxy_proto::api::cluster::v1beta1::{LABEL_PLACEMENT, PlacementDecision};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::{self as work, ManifestWork};
use cluster_proxy_proto::api::{CONDITION_FALSE, CONDITION_TRUE, Condition, find_condition};
use cluster_proxy_proto::duration::parse_go_duration;
use futures_util::Stream;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;

use super::cache::Caches;
use super::config;
use super::names::{ADDON_NAME, MANIFEST_WORK_NAME};
use super::settings::{AddonSettings, InstallStrategy, PlacementRef};

/// ManifestWork annotation: the spec hash of every configuration the work
/// was rendered from, as a JSON object keyed `<resource>.<group>/<namespace>/<name>`
/// (OCM's addon framework writes the same).
pub const ANNOTATION_CONFIG_SPEC_HASH: &str = "open-cluster-management.io/config-spec-hash";
/// PlacementDecision label: the index of the decision group it belongs to.
pub const LABEL_DECISION_GROUP_INDEX: &str =
    "cluster.open-cluster-management.io/decision-group-index";
/// PlacementDecision label: the name of the decision group it belongs to.
pub const LABEL_DECISION_GROUP_NAME: &str =
    "cluster.open-cluster-management.io/decision-group-name";

/// How often a cluster waiting for its turn looks again, in case no
/// trigger reaches it (a restart forgets who waits).
pub const WAITING_RECHECK: Duration = Duration::from_secs(30);
/// How long an admission is remembered before the work it led to shows up
/// in the cache; past it the cluster is counted by what the cache says.
const ADMISSION_MEMORY: Duration = Duration::from_secs(300);

/// The value of [`ANNOTATION_CONFIG_SPEC_HASH`] for these references.
pub fn config_spec_hash(references: &[ConfigReference]) -> String {
    let hashes: BTreeMap<String, String> = references
        .iter()
        .filter_map(|reference| {
            let desired = reference.desired_config.as_ref()?;
            let resource = if reference.group.is_empty() {
                reference.resource.clone()
            } else {
                format!("{}.{}", reference.resource, reference.group)
            };
            let key = format!(
                "{resource}/{}/{}",
                desired.namespace.as_deref().unwrap_or_default(),
                desired.name
            );
            Some((key, desired.spec_hash.clone().unwrap_or_default()))
        })
        .collect();
    // A map of strings always serializes.
    serde_json::to_string(&hashes).unwrap_or_default()
}

/// The configuration hashes `work` was rendered from, if it says.
pub fn work_config_spec_hash(work: &ManifestWork) -> Option<&str> {
    work.annotations()
        .get(ANNOTATION_CONFIG_SPEC_HASH)
        .map(String::as_str)
}

/// The type of a rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutKind {
    All,
    Progressive,
    ProgressivePerGroup,
}

/// A placement's `rolloutStrategy`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Strategy {
    pub kind: RolloutKind,
    /// How long a cluster must stay successful before the next ones start.
    pub min_success_time: Duration,
    /// How long a cluster may take; `None`: as long as it takes.
    pub progress_deadline: Option<Duration>,
    /// Failed clusters tolerated; one more stops the rollout.
    pub max_failures: IntOrString,
    /// Clusters updated at a time (`Progressive`); `None`: all.
    pub max_concurrency: Option<IntOrString>,
    /// Decision groups updated first, all at once.
    pub mandatory_groups: Vec<MandatoryDecisionGroup>,
}

/// Why a `rolloutStrategy` cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StrategyError {
    #[error("rolloutStrategy.type {0:?} is not All, Progressive or ProgressivePerGroup")]
    UnknownType(String),
    #[error("rolloutStrategy {field} {value:?}: {reason}")]
    Invalid {
        field: &'static str,
        value: String,
        reason: String,
    },
}

impl Strategy {
    /// Every cluster at once (OCM's default).
    pub fn all() -> Self {
        Self {
            kind: RolloutKind::All,
            min_success_time: Duration::ZERO,
            progress_deadline: None,
            max_failures: IntOrString::Int(0),
            max_concurrency: None,
            mandatory_groups: Vec::new(),
        }
    }

    /// Checks `strategy` (absent: [`Strategy::all`]).
    pub fn parse(strategy: Option<&RolloutStrategy>) -> Result<Self, StrategyError> {
        let Some(strategy) = strategy else {
            return Ok(Self::all());
        };
        let kind = match strategy.type_.as_deref().unwrap_or_default() {
            "" | ROLLOUT_ALL => RolloutKind::All,
            ROLLOUT_PROGRESSIVE => RolloutKind::Progressive,
            ROLLOUT_PROGRESSIVE_PER_GROUP => RolloutKind::ProgressivePerGroup,
            other => return Err(StrategyError::UnknownType(other.to_owned())),
        };
        let (min_success_time, progress_deadline, max_failures, max_concurrency, mandatory) =
            match kind {
                RolloutKind::All => {
                    let all = strategy.all.clone().unwrap_or_default();
                    (
                        all.min_success_time,
                        all.progress_deadline,
                        all.max_failures,
                        None,
                        None,
                    )
                }
                RolloutKind::Progressive => {
                    let progressive = strategy.progressive.clone().unwrap_or_default();
                    (
                        progressive.min_success_time,
                        progressive.progress_deadline,
                        progressive.max_failures,
                        progressive.max_concurrency,
                        progressive.mandatory_decision_groups,
                    )
                }
                RolloutKind::ProgressivePerGroup => {
                    let per_group = strategy.progressive_per_group.clone().unwrap_or_default();
                    (
                        per_group.min_success_time,
                        per_group.progress_deadline,
                        per_group.max_failures,
                        None,
                        per_group.mandatory_decision_groups,
                    )
                }
            };
        let duration = |field: &'static str, value: &str| {
            parse_go_duration(value).map_err(|error| StrategyError::Invalid {
                field,
                value: value.to_owned(),
                reason: error.to_string(),
            })
        };
        let min_success_time = match min_success_time.as_deref() {
            None | Some("") => Duration::ZERO,
            Some(value) => duration("minSuccessTime", value)?,
        };
        let progress_deadline = match progress_deadline.as_deref() {
            None | Some("") | Some("None") => None,
            Some(value) => Some(duration("progressDeadline", value)?),
        };
        let max_failures = max_failures.unwrap_or(IntOrString::Int(0));
        check_count("maxFailures", &max_failures, true)?;
        if let Some(max_concurrency) = &max_concurrency {
            check_count("maxConcurrency", max_concurrency, false)?;
        }
        Ok(Self {
            kind,
            min_success_time,
            progress_deadline,
            max_failures,
            max_concurrency,
            mandatory_groups: mandatory.unwrap_or_default(),
        })
    }
}

/// A count of clusters: a number, or a percentage `N%` of them.
fn check_count(
    field: &'static str,
    value: &IntOrString,
    zero_allowed: bool,
) -> Result<(), StrategyError> {
    let invalid = |reason: &str| StrategyError::Invalid {
        field,
        value: match value {
            IntOrString::Int(number) => number.to_string(),
            IntOrString::String(text) => text.clone(),
        },
        reason: reason.to_owned(),
    };
    let least = if zero_allowed { 0 } else { 1 };
    match value {
        IntOrString::Int(number) if *number >= least => Ok(()),
        IntOrString::Int(_) => Err(invalid(if zero_allowed {
            "must not be negative"
        } else {
            "must be at least 1"
        })),
        IntOrString::String(text) => match text
            .strip_suffix('%')
            .and_then(|number| number.parse::<u32>().ok())
        {
            Some(percent) if percent <= 100 && percent >= least as u32 => Ok(()),
            _ => Err(invalid("must be a number or a percentage such as 25%")),
        },
    }
}

/// `value` of `total` clusters; percentages round up when `round_up`.
fn scaled(value: &IntOrString, total: usize, round_up: bool) -> usize {
    match value {
        IntOrString::Int(number) => usize::try_from(*number).unwrap_or(0),
        IntOrString::String(text) => {
            let percent = text
                .strip_suffix('%')
                .and_then(|number| number.parse::<usize>().ok())
                .unwrap_or(0);
            let product = percent.saturating_mul(total);
            if round_up {
                product.div_ceil(100)
            } else {
                product / 100
            }
        }
    }
}

/// Where one cluster stands in the rollout of its current configurations.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Its work holds other configurations (or none yet).
    ToApply,
    /// Its work holds the configurations and is not yet applied and
    /// available; since when, if recorded.
    Progressing { since: Option<Timestamp> },
    /// Applied, available, the addon `Available`; since when (`None`: before
    /// any recorded rollout, long ago).
    Succeeded { since: Option<Timestamp> },
    /// The work could not be applied, or the deadline passed.
    Failed { message: String },
}

/// How the message of a cluster that failed by its `progressDeadline` starts.
const DEADLINE_PASSED: &str = "not applied and available within the progressDeadline";

impl Phase {
    /// Whether it failed because its `progressDeadline` passed (OCM counts
    /// those apart, as timeouts).
    pub fn timed_out(&self) -> bool {
        matches!(self, Phase::Failed { message } if message.starts_with(DEADLINE_PASSED))
    }

    /// Whether it still occupies a place in the rollout at `now`.
    fn in_flight(&self, strategy: &Strategy, now: Timestamp) -> bool {
        match self {
            Phase::Progressing { .. } => true,
            Phase::Succeeded { since: Some(since) } => {
                elapsed(now, *since) < strategy.min_success_time
            }
            Phase::Succeeded { since: None } | Phase::ToApply | Phase::Failed { .. } => false,
        }
    }

    /// When a cluster in this phase should be looked at again for the
    /// rollout's sake: the end of its soak, or its deadline.
    pub fn next_check(&self, strategy: &Strategy, now: Timestamp) -> Option<Duration> {
        match self {
            Phase::Succeeded { since: Some(since) } => strategy
                .min_success_time
                .checked_sub(elapsed(now, *since))
                .filter(|left| !left.is_zero()),
            Phase::Progressing { since: Some(since) } => strategy
                .progress_deadline?
                .checked_sub(elapsed(now, *since))
                .map(|left| left.max(Duration::from_secs(1))),
            _ => None,
        }
    }
}

impl Phase {
    /// Whether the reconcile that found its cluster in this phase may have
    /// freed a place, so that waiting clusters should be woken: the cluster
    /// has just finished or failed (its `Progressing` condition, `recorded`,
    /// does not say so yet), or its soak is over.
    pub fn frees_a_place(
        &self,
        recorded: Option<&Condition>,
        strategy: &Strategy,
        now: Timestamp,
    ) -> bool {
        let recorded_reason = recorded.map(|condition| condition.reason.as_str());
        match self {
            Phase::Failed { .. } => recorded_reason != Some(REASON_FAILED),
            Phase::Succeeded { since } => {
                recorded_reason != Some(REASON_COMPLETED)
                    || (!strategy.min_success_time.is_zero()
                        && since
                            .is_some_and(|since| elapsed(now, since) >= strategy.min_success_time))
            }
            Phase::ToApply | Phase::Progressing { .. } => false,
        }
    }
}

fn elapsed(now: Timestamp, since: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(since)).unwrap_or(Duration::ZERO)
}

/// The work's condition `type_`, if it speaks of the work's current
/// generation.
fn current_condition<'a>(work: &'a ManifestWork, type_: &str) -> Option<&'a Condition> {
    let condition = find_condition(work.status.as_ref()?.conditions.as_deref()?, type_)?;
    let current = match (condition.observed_generation, work.metadata.generation) {
        (Some(observed), Some(generation)) => observed == generation,
        _ => true,
    };
    current.then_some(condition)
}

/// Where the cluster of `addon` stands, its configurations hashing to
/// `target` and its agent's work being `work`.
pub fn phase(
    target: &str,
    work: Option<&ManifestWork>,
    addon: &ManagedClusterAddOn,
    strategy: &Strategy,
    now: Timestamp,
) -> Phase {
    let Some(work) = work.filter(|work| work_config_spec_hash(work) == Some(target)) else {
        return Phase::ToApply;
    };
    let progressing = find_condition(addon.conditions(), CONDITION_PROGRESSING);
    let applied = current_condition(work, work::CONDITION_APPLIED);
    if let Some(applied) = applied.filter(|applied| applied.status == CONDITION_FALSE) {
        return Phase::Failed {
            message: format!(
                "work {} is not applied: {}",
                work.name_any(),
                applied.message
            ),
        };
    }
    let work_ready = applied.is_some_and(|applied| applied.status == CONDITION_TRUE)
        && current_condition(work, work::CONDITION_AVAILABLE)
            .is_some_and(|available| available.status == CONDITION_TRUE);
    let addon_available = find_condition(addon.conditions(), CONDITION_AVAILABLE)
        .is_some_and(|available| available.status == CONDITION_TRUE);
    if work_ready && addon_available {
        let since = match progressing {
            Some(condition) if condition.reason == REASON_COMPLETED => {
                Some(condition.last_transition_time.0)
            }
            // Done just now; its reconcile has not recorded it yet.
            Some(condition) if condition.reason == REASON_PROGRESSING => Some(now),
            _ => None,
        };
        return Phase::Succeeded { since };
    }
    match progressing {
        Some(condition)
            if condition.status == CONDITION_FALSE && condition.reason == REASON_FAILED =>
        {
            Phase::Failed {
                message: condition.message.clone(),
            }
        }
        Some(condition)
            if condition.status == CONDITION_TRUE && condition.reason == REASON_PROGRESSING =>
        {
            let since = condition.last_transition_time.0;
            match strategy.progress_deadline {
                Some(deadline) if elapsed(now, since) >= deadline => Phase::Failed {
                    message: format!("{DEADLINE_PASSED} of {}", humanize(deadline)),
                },
                _ => Phase::Progressing { since: Some(since) },
            }
        }
        _ => Phase::Progressing { since: None },
    }
}

fn humanize(duration: Duration) -> String {
    format!("{}s", duration.as_secs())
}

/// One cluster of a placement, as the rollout sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub cluster: String,
    pub group_index: i32,
    pub group_name: String,
    pub phase: Phase,
}

impl Member {
    fn is_mandatory(&self, strategy: &Strategy) -> bool {
        strategy.mandatory_groups.iter().any(|group| {
            group
                .group_name
                .as_deref()
                .is_some_and(|name| !name.is_empty() && name == self.group_name)
                || group.group_index == Some(self.group_index)
        })
    }
}

/// Whether a cluster may take its new configurations now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    Admit,
    /// Not yet: why.
    Wait(String),
}

/// What one placement's rollout remembers between reconciles.
#[derive(Default)]
struct PlacementState {
    /// Clusters admitted whose new work the cache may not show yet: the
    /// configurations they were admitted for, and when.
    admitted: HashMap<String, (String, tokio::time::Instant)>,
    /// Clusters told to wait, by group and name (the order of admission).
    waiting: BTreeSet<(i32, String)>,
    /// Waiting clusters woken and not yet reconciled: each is woken once,
    /// however many clusters finish before it runs.
    woken: BTreeSet<String>,
}

impl PlacementState {
    /// Whether `member` takes one of the places of the rollout: it is
    /// updating or soaking, or admitted before the cache shows its work.
    fn holds_place(&self, member: &Member, strategy: &Strategy, now: Timestamp) -> bool {
        member.phase.in_flight(strategy, now)
            || (member.phase == Phase::ToApply && self.admitted.contains_key(&member.cluster))
    }
}

/// The rollouts of every placement: who may update now, and who to wake
/// when room frees up.
pub struct Rollouts {
    placements: Mutex<HashMap<(String, String), PlacementState>>,
    triggers: mpsc::UnboundedSender<ObjectRef<ManagedClusterAddOn>>,
    trigger_receiver: Mutex<Option<mpsc::UnboundedReceiver<ObjectRef<ManagedClusterAddOn>>>>,
    waiting_gauge: Gauge,
}

impl Rollouts {
    pub fn new(waiting_gauge: Gauge) -> Self {
        let (triggers, receiver) = mpsc::unbounded_channel();
        Self {
            placements: Mutex::new(HashMap::new()),
            triggers,
            trigger_receiver: Mutex::new(Some(receiver)),
            waiting_gauge,
        }
    }

    /// The addons to reconcile because their turn has come (taken once, by
    /// the addon controller).
    pub fn triggers(&self) -> Option<impl Stream<Item = ObjectRef<ManagedClusterAddOn>> + use<>> {
        let receiver = self
            .trigger_receiver
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()?;
        Some(futures_util::stream::unfold(
            receiver,
            |mut receiver| async move {
                let next = receiver.recv().await?;
                Some((next, receiver))
            },
        ))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), PlacementState>> {
        self.placements
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn key(placement: &PlacementRef) -> (String, String) {
        (placement.namespace.clone(), placement.name.clone())
    }

    /// Decides whether `cluster` of `placement`, whose configurations hash
    /// to `target`, may be updated now; `members` gives the placement's
    /// clusters as the caches show them. It is called under the lock, so
    /// that each decision sees the caches at least as new as the one
    /// before and no admission is counted twice or missed.
    pub fn decide(
        &self,
        placement: &PlacementRef,
        strategy: &Strategy,
        cluster: &str,
        target: &str,
        members: impl FnOnce() -> Vec<Member>,
        now: Timestamp,
    ) -> Admission {
        let mut placements = self.lock();
        let members = &members();
        let state = placements.entry(Self::key(placement)).or_default();
        let member = members.iter().find(|member| member.cluster == cluster);
        let order = (
            member.map_or(0, |member| member.group_index),
            cluster.to_owned(),
        );
        // Admitted already (its work not yet in the reconcile's cache, or
        // already holding the change): a second reconcile must not take
        // the admission back.
        let admitted = member.is_some_and(|member| member.phase != Phase::ToApply)
            || state
                .admitted
                .get(cluster)
                .is_some_and(|(admitted_for, _)| admitted_for == target);
        let admission = match admissible(state, strategy, members, now) {
            _ if admitted => Admission::Admit,
            Ok(admissible) if admissible.contains(cluster) || member.is_none() => Admission::Admit,
            Ok(_) => Admission::Wait(waiting_reason(state, strategy, members, now)),
            Err(stopped) => Admission::Wait(stopped),
        };
        state.woken.remove(cluster);
        match admission {
            Admission::Admit => {
                state.waiting.remove(&order);
                state.admitted.insert(
                    cluster.to_owned(),
                    (target.to_owned(), tokio::time::Instant::now()),
                );
            }
            Admission::Wait(_) => {
                state.waiting.insert(order);
            }
        }
        self.update_gauge(&placements);
        admission
    }

    /// Wakes the waiting clusters of `placement` whose turn has come (see
    /// [`Rollouts::decide`] for `members`).
    pub fn wake(
        &self,
        placement: &PlacementRef,
        strategy: &Strategy,
        members: impl FnOnce() -> Vec<Member>,
        now: Timestamp,
    ) {
        let mut placements = self.lock();
        let Some(state) = placements
            .get_mut(&Self::key(placement))
            .filter(|state| !state.waiting.is_empty())
        else {
            return;
        };
        let members = &members();
        // Clusters that left the placement, or whose work holds the change
        // already, wait no more.
        let present: BTreeSet<&str> = members
            .iter()
            .filter(|member| member.phase == Phase::ToApply)
            .map(|member| member.cluster.as_str())
            .collect();
        state
            .waiting
            .retain(|(_, cluster)| present.contains(cluster.as_str()));
        let waiting: BTreeSet<&String> = state.waiting.iter().map(|(_, cluster)| cluster).collect();
        state.woken.retain(|cluster| waiting.contains(cluster));
        if let Ok(admissible) = admissible(state, strategy, members, now) {
            for (_, cluster) in &state.waiting {
                if admissible.contains(cluster.as_str()) && state.woken.insert(cluster.clone()) {
                    let _ = self
                        .triggers
                        .send(ObjectRef::new(ADDON_NAME).within(cluster));
                }
            }
        }
        self.update_gauge(&placements);
    }

    fn update_gauge(&self, placements: &HashMap<(String, String), PlacementState>) {
        let waiting: usize = placements.values().map(|state| state.waiting.len()).sum();
        self.waiting_gauge
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
    }
}

/// Forgets admissions the cache now shows (or that are old), and says
/// whether `member` is still admitted but not yet visible.
fn prune_admitted(state: &mut PlacementState, members: &[Member]) {
    if state.admitted.is_empty() {
        return;
    }
    // Looked up once per admitted cluster: a scan per lookup made each
    // decision cost (admitted × members), most of a large rollout's CPU.
    let to_apply: HashSet<&str> = members
        .iter()
        .filter(|member| member.phase == Phase::ToApply)
        .map(|member| member.cluster.as_str())
        .collect();
    state.admitted.retain(|cluster, (_, at)| {
        at.elapsed() < ADMISSION_MEMORY && to_apply.contains(cluster.as_str())
    });
}

/// The clusters that may start now, or why none may.
fn admissible<'a>(
    state: &mut PlacementState,
    strategy: &Strategy,
    members: &'a [Member],
    now: Timestamp,
) -> Result<BTreeSet<&'a str>, String> {
    prune_admitted(state, members);
    let total = members.len();
    let failed = members
        .iter()
        .filter(|member| matches!(member.phase, Phase::Failed { .. }))
        .count();
    let max_failures = scaled(&strategy.max_failures, total, false);
    if strategy.kind != RolloutKind::All && failed > max_failures {
        return Err(format!(
            "the rollout stopped: {failed} of {total} clusters failed, more than maxFailures ({max_failures})"
        ));
    }
    let in_flight = |member: &Member| state.holds_place(member, strategy, now);
    let pending = |member: &&Member| {
        member.phase == Phase::ToApply && !state.admitted.contains_key(&member.cluster)
    };
    let finished = |member: &Member| !in_flight(member) && member.phase != Phase::ToApply;
    if strategy.kind == RolloutKind::All {
        return Ok(members
            .iter()
            .filter(pending)
            .map(|m| m.cluster.as_str())
            .collect());
    }
    // Mandatory groups first, all at once.
    let mandatory: Vec<&Member> = members
        .iter()
        .filter(|member| member.is_mandatory(strategy))
        .collect();
    if !mandatory.iter().all(|member| finished(member)) {
        return Ok(mandatory
            .into_iter()
            .filter(pending)
            .map(|member| member.cluster.as_str())
            .collect());
    }
    let mut candidates: Vec<&Member> = members
        .iter()
        .filter(|member| !member.is_mandatory(strategy))
        .filter(pending)
        .collect();
    candidates.sort_by(|a, b| (a.group_index, &a.cluster).cmp(&(b.group_index, &b.cluster)));
    match strategy.kind {
        RolloutKind::All | RolloutKind::Progressive => {
            let limit = strategy
                .max_concurrency
                .as_ref()
                .map_or(total, |value| scaled(value, total, true))
                .max(1);
            let busy = members.iter().filter(|member| in_flight(member)).count();
            Ok(candidates
                .into_iter()
                .take(limit.saturating_sub(busy))
                .map(|member| member.cluster.as_str())
                .collect())
        }
        RolloutKind::ProgressivePerGroup => {
            // The first group, in index order, not yet finished.
            let current = members
                .iter()
                .filter(|member| !member.is_mandatory(strategy) && !finished(member))
                .map(|member| member.group_index)
                .min();
            Ok(candidates
                .into_iter()
                .filter(|member| Some(member.group_index) == current)
                .map(|member| member.cluster.as_str())
                .collect())
        }
    }
}

/// Why a cluster waits, for its log line.
fn waiting_reason(
    state: &PlacementState,
    strategy: &Strategy,
    members: &[Member],
    now: Timestamp,
) -> String {
    let in_flight = members
        .iter()
        .filter(|member| state.holds_place(member, strategy, now))
        .count();
    match strategy.kind {
        RolloutKind::ProgressivePerGroup => {
            format!("an earlier decision group is rolling out ({in_flight} clusters in progress)")
        }
        _ => format!(
            "{in_flight} of {} clusters are rolling out or soaking, the most at a time",
            members.len()
        ),
    }
}

/// The placement whose rollout `cluster` follows: the first of the install
/// strategy whose decisions select it, with its decision group and the
/// `rolloutStrategy` the ClusterManagementAddOn gives it.
pub struct ClusterPlacement {
    pub placement: PlacementRef,
    pub strategy: Result<Strategy, StrategyError>,
}

/// See [`ClusterPlacement`]; `None` when no placement selects `cluster`
/// (the `Manual` strategy, or an addon users created).
pub fn placement_of(
    settings: &AddonSettings,
    caches: &Caches,
    management: Option<&ClusterManagementAddOn>,
    cluster: &str,
) -> Option<ClusterPlacement> {
    let InstallStrategy::Placements(placements) = &settings.install_strategy else {
        return None;
    };
    let decisions = caches.install.decisions.state();
    let placement = placements.iter().find(|placement| {
        decisions.iter().any(|decision| {
            of_placement(decision, placement)
                && decision.cluster_names().any(|name| name == cluster)
        })
    })?;
    Some(ClusterPlacement {
        placement: placement.clone(),
        strategy: placement_strategy(management, placement),
    })
}

/// Each selected cluster's placement as [`placement_of`] finds it: the first
/// of the install strategy's placements whose decisions select it.
fn owning_placements<'a>(
    settings: &'a AddonSettings,
    caches: &Caches,
) -> HashMap<String, &'a PlacementRef> {
    let InstallStrategy::Placements(placements) = &settings.install_strategy else {
        return HashMap::new();
    };
    let decisions = caches.install.decisions.state();
    let mut owners = HashMap::new();
    for placement in placements {
        for decision in decisions
            .iter()
            .filter(|decision| of_placement(decision, placement))
        {
            for cluster in decision.cluster_names() {
                owners.entry(cluster.to_owned()).or_insert(placement);
            }
        }
    }
    owners
}

/// The `rolloutStrategy` `management` gives `placement` (`All` when none).
pub fn placement_strategy(
    management: Option<&ClusterManagementAddOn>,
    placement: &PlacementRef,
) -> Result<Strategy, StrategyError> {
    let declared = management
        .and_then(|management| management.spec.install_strategy.as_ref())
        .and_then(|strategy| strategy.placements.as_ref())
        .and_then(|strategies| {
            strategies.iter().find(|strategy| {
                strategy.namespace == placement.namespace && strategy.name == placement.name
            })
        })
        .and_then(|strategy| strategy.rollout_strategy.as_ref());
    Strategy::parse(declared)
}

/// Whether `decision` is one of `placement`'s.
pub fn of_placement(decision: &PlacementDecision, placement: &PlacementRef) -> bool {
    decision.metadata.namespace.as_deref() == Some(placement.namespace.as_str())
        && decision.labels().get(LABEL_PLACEMENT) == Some(&placement.name)
}

/// The clusters of `placement` with an addon, as the caches show them, each
/// measured against its own configurations (the MPC `mpc`, and the
/// AddOnDeploymentConfig its addon or `management` names).
pub fn members(
    settings: &AddonSettings,
    caches: &Caches,
    placement: &PlacementRef,
    strategy: &Strategy,
    mpc: &ManagedProxyConfiguration,
    management: Option<&ClusterManagementAddOn>,
    now: Timestamp,
) -> Vec<Member> {
    let Ok(mpc_hash) = config::spec_hash(&mpc.spec) else {
        return Vec::new();
    };
    let mpc_reference = config::mpc_reference(&mpc.name_any(), mpc_hash);
    // Clusters differ only in their AddOnDeploymentConfig, and those are
    // few: each target is computed once.
    let mut targets: HashMap<Option<String>, Option<String>> = HashMap::new();
    let mut members = Vec::new();
    // A cluster some earlier placement selects too takes its configurations
    // from that one, as its reconcile does (`placement_of`).
    let owners = owning_placements(settings, caches);
    for decision in caches.install.decisions.state() {
        if !of_placement(&decision, placement) {
            continue;
        }
        let label = |key: &str| decision.labels().get(key).cloned().unwrap_or_default();
        let group_index = label(LABEL_DECISION_GROUP_INDEX).parse().unwrap_or(0);
        let group_name = label(LABEL_DECISION_GROUP_NAME);
        for cluster in decision.cluster_names() {
            let Some(addon) = caches
                .install
                .addons
                .get(&ObjectRef::new(ADDON_NAME).within(cluster))
            else {
                continue;
            };
            let owner = owners.get(cluster).copied().unwrap_or(placement);
            let adc_ref =
                config::deployment_config_ref(&addon, management, config::Selection::By(owner));
            let target = targets
                .entry(adc_ref.as_ref().map(ToString::to_string))
                .or_insert_with(|| {
                    let mut references = vec![mpc_reference.clone()];
                    if let Some(adc_ref) = &adc_ref {
                        let adc = caches
                            .addon
                            .deployment_configs
                            .get(&ObjectRef::new(&adc_ref.name).within(&adc_ref.namespace))?;
                        let hash = config::spec_hash(&adc.spec).ok()?;
                        references.push(config::adc_reference(adc_ref, hash));
                    }
                    Some(config_spec_hash(&references))
                });
            // Its configuration is missing: the cluster is not in the rollout
            // until it has one.
            let Some(target) = target else {
                continue;
            };
            let work = caches
                .addon
                .works
                .get(&ObjectRef::new(MANIFEST_WORK_NAME).within(cluster));
            members.push(Member {
                cluster: cluster.to_owned(),
                group_index,
                group_name: group_name.clone(),
                phase: phase(target, work.as_deref(), &addon, strategy, now),
            });
        }
    }
    members
}

#[cfg(test)]
mod tests {
    use super::*;
    use cluster_proxy_proto::api::cluster::v1alpha1::{RolloutAll, RolloutProgressive};

    fn member(cluster: &str, group: i32, phase: Phase) -> Member {
        Member {
            cluster: cluster.to_owned(),
            group_index: group,
            group_name: String::new(),
            phase,
        }
    }

    fn progressive(max_concurrency: IntOrString) -> Strategy {
        Strategy {
            kind: RolloutKind::Progressive,
            max_concurrency: Some(max_concurrency),
            ..Strategy::all()
        }
    }

    fn placement() -> PlacementRef {
        PlacementRef {
            namespace: "hub".into(),
            name: "p".into(),
        }
    }

    #[test]
    fn strategies_are_checked() {
        assert_eq!(Strategy::parse(None).unwrap(), Strategy::all());
        let strategy = RolloutStrategy {
            type_: Some("Progressive".into()),
            progressive: Some(RolloutProgressive {
                max_concurrency: Some(IntOrString::String("25%".into())),
                min_success_time: Some("1m".into()),
                progress_deadline: Some("None".into()),
                ..RolloutProgressive::default()
            }),
            ..RolloutStrategy::default()
        };
        let parsed = Strategy::parse(Some(&strategy)).unwrap();
        assert_eq!(parsed.kind, RolloutKind::Progressive);
        assert_eq!(parsed.min_success_time, Duration::from_secs(60));
        assert_eq!(parsed.progress_deadline, None);

        let unknown = RolloutStrategy {
            type_: Some("Canary".into()),
            ..RolloutStrategy::default()
        };
        assert_eq!(
            Strategy::parse(Some(&unknown)),
            Err(StrategyError::UnknownType("Canary".into()))
        );
        for (field, bad) in [
            ("maxConcurrency", IntOrString::Int(0)),
            ("maxConcurrency", IntOrString::String("150%".into())),
            ("maxConcurrency", IntOrString::String("ten".into())),
        ] {
            let strategy = RolloutStrategy {
                type_: Some("Progressive".into()),
                progressive: Some(RolloutProgressive {
                    max_concurrency: Some(bad),
                    ..RolloutProgressive::default()
                }),
                ..RolloutStrategy::default()
            };
            let error = Strategy::parse(Some(&strategy)).unwrap_err();
            assert!(error.to_string().contains(field), "{error}");
        }
        let bad_deadline = RolloutStrategy {
            type_: Some("All".into()),
            all: Some(RolloutAll {
                progress_deadline: Some("soon".into()),
                ..RolloutAll::default()
            }),
            ..RolloutStrategy::default()
        };
        let error = Strategy::parse(Some(&bad_deadline)).unwrap_err();
        assert!(error.to_string().contains("progressDeadline"), "{error}");
    }

    #[test]
    fn percentages_scale_with_the_placement() {
        let quarter = IntOrString::String("25%".into());
        assert_eq!(scaled(&quarter, 10, true), 3);
        assert_eq!(scaled(&quarter, 10, false), 2);
        assert_eq!(scaled(&IntOrString::Int(4), 10, true), 4);
    }

    #[test]
    fn progressive_admits_at_most_max_concurrency_in_name_order() {
        let waiting = Gauge::default();
        let rollouts = Rollouts::new(waiting.clone());
        let strategy = progressive(IntOrString::Int(2));
        let now = Timestamp::now();
        let members: Vec<Member> = ["c", "a", "d", "b"]
            .iter()
            .map(|cluster| member(cluster, 0, Phase::ToApply))
            .collect();
        // "b" is second in order: admitted; "c" and "d" are not.
        assert_eq!(
            rollouts.decide(&placement(), &strategy, "b", "t", || members.clone(), now),
            Admission::Admit
        );
        assert!(matches!(
            rollouts.decide(&placement(), &strategy, "c", "t", || members.clone(), now),
            Admission::Wait(_)
        ));
        // "a" is still in the first two (b was admitted, not yet visible).
        assert_eq!(
            rollouts.decide(&placement(), &strategy, "a", "t", || members.clone(), now),
            Admission::Admit
        );
        // A second reconcile of "b" before its work shows keeps its admission.
        assert_eq!(
            rollouts.decide(&placement(), &strategy, "b", "t", || members.clone(), now),
            Admission::Admit
        );
        assert!(matches!(
            rollouts.decide(&placement(), &strategy, "d", "t", || members.clone(), now),
            Admission::Wait(_)
        ));
        assert_eq!(waiting.get(), 2, "c and d wait");

        // "a" succeeded, "b" progresses: one place is free, and it is "c"'s.
        let members = vec![
            member("a", 0, Phase::Succeeded { since: Some(now) }),
            member("b", 0, Phase::Progressing { since: Some(now) }),
            member("c", 0, Phase::ToApply),
            member("d", 0, Phase::ToApply),
        ];
        let mut triggers = rollouts.trigger_receiver.lock().unwrap().take().unwrap();
        rollouts.wake(&placement(), &strategy, || members.clone(), now);
        assert_eq!(
            triggers.try_recv().unwrap(),
            ObjectRef::new(ADDON_NAME).within("c")
        );
        assert!(triggers.try_recv().is_err(), "only c's turn has come");
        assert_eq!(
            rollouts.decide(&placement(), &strategy, "c", "t", || members.clone(), now),
            Admission::Admit
        );
        assert!(matches!(
            rollouts.decide(&placement(), &strategy, "d", "t", || members.clone(), now),
            Admission::Wait(_)
        ));
    }

    #[test]
    fn a_soaking_cluster_holds_its_place() {
        let rollouts = Rollouts::new(Gauge::default());
        let strategy = Strategy {
            min_success_time: Duration::from_secs(60),
            ..progressive(IntOrString::Int(1))
        };
        let now = Timestamp::now();
        let just_now = now - k8s_openapi::jiff::SignedDuration::from_secs(10);
        let long_ago = now - k8s_openapi::jiff::SignedDuration::from_secs(120);
        let soaking = vec![
            member(
                "a",
                0,
                Phase::Succeeded {
                    since: Some(just_now),
                },
            ),
            member("b", 0, Phase::ToApply),
        ];
        assert!(matches!(
            rollouts.decide(&placement(), &strategy, "b", "t", || soaking.clone(), now),
            Admission::Wait(_)
        ));
        assert_eq!(
            soaking[0].phase.next_check(&strategy, now),
            Some(Duration::from_secs(50))
        );
        let soaked = vec![
            member(
                "a",
                0,
                Phase::Succeeded {
                    since: Some(long_ago),
                },
            ),
            member("b", 0, Phase::ToApply),
        ];
        assert_eq!(
            rollouts.decide(&placement(), &strategy, "b", "t", || soaked.clone(), now),
            Admission::Admit
        );
    }

    #[test]
    fn failures_beyond_max_failures_stop_the_rollout() {
        let rollouts = Rollouts::new(Gauge::default());
        let strategy = progressive(IntOrString::Int(5));
        let now = Timestamp::now();
        let failed = Phase::Failed {
            message: "broken".into(),
        };
        let members = vec![
            member("a", 0, failed.clone()),
            member("b", 0, Phase::ToApply),
        ];
        let Admission::Wait(why) =
            rollouts.decide(&placement(), &strategy, "b", "t", || members.clone(), now)
        else {
            panic!("one failure is more than maxFailures 0");
        };
        assert!(why.contains("stopped"), "{why}");
        let tolerant = Strategy {
            max_failures: IntOrString::Int(1),
            ..strategy
        };
        assert_eq!(
            rollouts.decide(&placement(), &tolerant, "b", "t", || members.clone(), now),
            Admission::Admit
        );
    }

    #[test]
    fn groups_roll_one_after_another_mandatory_first() {
        let rollouts = Rollouts::new(Gauge::default());
        let strategy = Strategy {
            kind: RolloutKind::ProgressivePerGroup,
            mandatory_groups: vec![MandatoryDecisionGroup {
                group_name: None,
                group_index: Some(2),
            }],
            ..Strategy::all()
        };
        let now = Timestamp::now();
        let members = vec![
            member("a", 0, Phase::ToApply),
            member("b", 1, Phase::ToApply),
            member("canary", 2, Phase::ToApply),
        ];
        assert!(matches!(
            rollouts.decide(&placement(), &strategy, "a", "t", || members.clone(), now),
            Admission::Wait(_)
        ));
        assert_eq!(
            rollouts.decide(
                &placement(),
                &strategy,
                "canary",
                "t",
                || members.clone(),
                now
            ),
            Admission::Admit
        );
        let members = vec![
            member("a", 0, Phase::ToApply),
            member("b", 1, Phase::ToApply),
            member("canary", 2, Phase::Succeeded { since: None }),
        ];
        assert_eq!(
            rollouts.decide(&placement(), &strategy, "a", "t", || members.clone(), now),
            Admission::Admit
        );
        assert!(matches!(
            rollouts.decide(&placement(), &strategy, "b", "t", || members.clone(), now),
            Admission::Wait(_)
        ));
    }

    #[test]
    fn the_annotation_is_ocms_format() {
        use cluster_proxy_proto::api::addon::v1alpha1::ConfigSpecHash;
        let references = vec![
            ConfigReference {
                group: "proxy.open-cluster-management.io".into(),
                resource: "managedproxyconfigurations".into(),
                desired_config: Some(ConfigSpecHash {
                    namespace: None,
                    name: "cluster-proxy".into(),
                    spec_hash: Some("abc".into()),
                }),
                ..ConfigReference::default()
            },
            ConfigReference {
                group: "addon.open-cluster-management.io".into(),
                resource: "addondeploymentconfigs".into(),
                desired_config: Some(ConfigSpecHash {
                    namespace: Some("ns".into()),
                    name: "sizing".into(),
                    spec_hash: Some("def".into()),
                }),
                ..ConfigReference::default()
            },
        ];
        assert_eq!(
            config_spec_hash(&references),
            r#"{"addondeploymentconfigs.addon.open-cluster-management.io/ns/sizing":"def","managedproxyconfigurations.proxy.open-cluster-management.io//cluster-proxy":"abc"}"#
        );
    }
}

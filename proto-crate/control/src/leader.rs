//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go does
//! it: the holder renews its Lease; another replica takes over only after
//! `leaseDurationSeconds` without a renewal. Writes carry the Lease's
//! resourceVersion, so two replicas racing for it cannot both win.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::PostParams;
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("lease timing: renewing every {renew_every:?} cannot keep a {lease_duration:?} lease")]
    Timing {
        lease_duration: Duration,
        renew_every: Duration,
    },
    #[error("leader election stopped")]
    Stopped,
}

/// What this replica should do with the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAction {
    /// Nobody holds it, or the holder stopped renewing: take it.
    Acquire,
    /// We hold it: renew.
    Renew,
    /// Someone else holds it and renews it.
    Follow(String),
}

fn seconds(time: &MicroTime) -> i64 {
    time.0.as_second()
}

fn micro_time(now: OffsetDateTime) -> MicroTime {
    let nanos = i32::try_from(now.nanosecond()).unwrap_or(0);
    MicroTime(
        k8s_openapi::jiff::Timestamp::new(now.unix_timestamp(), nanos)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    )
}

/// The decision for `identity` given the Lease as read at `now`.
pub fn lease_action(spec: Option<&LeaseSpec>, identity: &str, now: OffsetDateTime) -> LeaseAction {
    let Some(spec) = spec else {
        return LeaseAction::Acquire;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder.is_empty() {
        return LeaseAction::Acquire;
    }
    if holder == identity {
        return LeaseAction::Renew;
    }
    let last = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(seconds);
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    match last {
        Some(last) if last + duration > now.unix_timestamp() => LeaseAction::Follow(holder),
        _ => LeaseAction::Acquire,
    }
}

/// A participant in the election.
#[derive(Debug, Clone)]
pub struct Elector {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
    pub lease_duration_seconds: i32,
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409)
}

impl Elector {
    /// Acquires or renews the Lease at `now`; `true` when this replica leads.
    pub async fn try_lead(&self, now: OffsetDateTime) -> Result<bool, LeaderError> {
        let existing = self.api.get_opt(&self.name).await?;
        let action = lease_action(
            existing.as_ref().and_then(|l| l.spec.as_ref()),
            &self.identity,
            now,
        );
        let mut spec = existing
            .as_ref()
            .and_then(|l| l.spec.clone())
            .unwrap_or_default();
        match &action {
            LeaseAction::Follow(_) => return Ok(false),
            LeaseAction::Acquire => {
                spec.holder_identity = Some(self.identity.clone());
                spec.acquire_time = Some(micro_time(now));
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            LeaseAction::Renew => {}
        }
        spec.renew_time = Some(micro_time(now));
        spec.lease_duration_seconds = Some(self.lease_duration_seconds);
        let result = match existing {
            None => {
                let mut lease = Lease {
                    spec: Some(spec),
                    ..Lease::default()
                };
                lease.metadata.name = Some(self.name.clone());
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                // Keeps metadata.resourceVersion: a concurrent writer makes
                // this a 409, not a double leader.
                lease.spec = Some(spec);
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => {
                if action == LeaseAction::Acquire {
                    tracing::info!(lease = %self.name, identity = %self.identity, "became the leader");
                }
                Ok(true)
            }
            Err(err) if is_conflict(&err) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }

    /// Gives the Lease up so another replica need not wait for it to expire.
    pub async fn release(&self) -> Result<(), LeaderError> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            Err(err) if is_conflict(&err) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }
}

/// Keeps one replica leading for as long as it runs: tries to acquire or
/// renew the Lease every `renew_every`, reports every change of leadership
/// on a watch channel, and gives the Lease up on shutdown.
///
/// A failed renewal does not end leadership at once: the replica keeps
/// leading until `lease_duration - renew_every` after its last successful
/// renewal (client-go's renew deadline), so one slow request does not cause
/// a hand-over, yet it has stopped before any other replica may take over.
#[derive(Debug, Clone)]
pub struct LeaderElection {
    elector: Elector,
    lease_duration: Duration,
    renew_every: Duration,
}

impl LeaderElection {
    /// `lease_duration` is rounded up to whole seconds (the Lease's unit);
    /// `renew_every` must be shorter than it.
    pub fn new(
        api: Api<Lease>,
        name: impl Into<String>,
        identity: impl Into<String>,
        lease_duration: Duration,
        renew_every: Duration,
    ) -> Result<Self, LeaderError> {
        let lease_duration_seconds =
            lease_seconds(lease_duration, renew_every).ok_or(LeaderError::Timing {
                lease_duration,
                renew_every,
            })?;
        Ok(LeaderElection {
            elector: Elector {
                api,
                name: name.into(),
                identity: identity.into(),
                lease_duration_seconds,
            },
            lease_duration,
            renew_every,
        })
    }

    pub fn elector(&self) -> &Elector {
        &self.elector
    }

    /// Runs until `shutdown` completes, sending `true` on `on_change` when
    /// this replica starts leading and `false` when it stops; on shutdown
    /// sends `false`, then releases the Lease so that another replica need
    /// not wait for it to expire. Errors of single attempts are logged and
    /// retried; only a failed release is returned.
    pub async fn run(
        self,
        on_change: watch::Sender<bool>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), LeaderError> {
        let renew_deadline = self.lease_duration - self.renew_every;
        // When the last successful attempt started: the renewTime it wrote
        // is no later, and other replicas count the expiry from that.
        let mut last_renewed: Option<Instant> = None;
        let mut leading = false;
        let mut ticker = tokio::time::interval(self.renew_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            // While leading, the deadline ends leadership even when attempts
            // hang, so no tick's delay can make it late.
            let deadline = last_renewed
                .filter(|_| leading)
                .map(|at| at + renew_deadline);
            let expired = async move {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(expired);
            let outcome = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                _ = &mut expired => None,
                _ = ticker.tick() => {
                    let started = Instant::now();
                    let attempt = tokio::time::timeout(
                        self.renew_every,
                        self.elector.try_lead(OffsetDateTime::now_utc()),
                    );
                    tokio::select! {
                        biased;
                        _ = &mut shutdown => break,
                        _ = &mut expired => None,
                        outcome = attempt => Some((started, outcome)),
                    }
                }
            };
            let lead = match outcome {
                None => {
                    tracing::warn!(lease = %self.elector.name, deadline = ?renew_deadline, "no successful renewal within the deadline");
                    false
                }
                Some((started, Ok(Ok(true)))) => {
                    last_renewed = Some(started);
                    true
                }
                Some((_, Ok(Ok(false)))) => false,
                Some((_, Ok(Err(error)))) => {
                    tracing::warn!(lease = %self.elector.name, %error, "cannot renew the lease");
                    leading
                }
                Some((_, Err(_))) => {
                    tracing::warn!(lease = %self.elector.name, timeout = ?self.renew_every, "renewing the lease timed out");
                    leading
                }
            };
            if lead != leading {
                leading = lead;
                if !lead {
                    tracing::warn!(lease = %self.elector.name, identity = %self.elector.identity, "no longer leading");
                }
                on_change.send_replace(lead);
            }
        }
        on_change.send_replace(false);
        if !leading {
            return Ok(());
        }
        match tokio::time::timeout(self.renew_every, self.elector.release()).await {
            Ok(released) => released,
            Err(_) => {
                tracing::warn!(lease = %self.elector.name, "releasing the lease timed out; it expires on its own");
                Ok(())
            }
        }
    }
}

/// This replica's identity in a Lease: the pod name (else the host name,
/// else `fallback`) and a random suffix, so a restarted pod is a new holder.
pub fn replica_identity(fallback: &str) -> String {
    let host = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| fallback.to_owned());
    let suffix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ std::process::id().rotate_left(16))
        .unwrap_or_else(|_| std::process::id());
    format!("{host}_{suffix:08x}")
}

/// What [`spawn_election`] started: whether this replica leads, and the
/// election task (none when election is off), which ends after `shutdown`
/// once the Lease is released.
pub struct Election {
    pub leading: watch::Receiver<bool>,
    pub task: Option<tokio::task::JoinHandle<Result<(), LeaderError>>>,
}

/// Starts leader election on Lease `name` through `api` when `enabled`
/// (this replica's identity from [`replica_identity`] with `fallback`);
/// without election, `leading` is `true` for good. What every control-plane
/// binary that must run alone does before its controllers.
pub fn spawn_election(
    api: Api<Lease>,
    name: &str,
    fallback: &str,
    enabled: bool,
    lease_duration: Duration,
    renew_every: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Election, LeaderError> {
    let (on_change, leading) = watch::channel(!enabled);
    if !enabled {
        return Ok(Election {
            leading,
            task: None,
        });
    }
    let identity = replica_identity(fallback);
    let election = LeaderElection::new(api, name, identity.clone(), lease_duration, renew_every)?;
    tracing::info!(lease = name, %identity, "electing a leader");
    Ok(Election {
        leading,
        task: Some(tokio::spawn(election.run(on_change, shutdown))),
    })
}

/// A Lease's `leaseDurationSeconds` for `lease_duration` (rounded up to
/// whole seconds, the Lease's unit), or `None` when it does not fit or
/// `renew_every` is not shorter than it (the Lease would lapse between
/// renewals).
pub fn lease_seconds(lease_duration: Duration, renew_every: Duration) -> Option<i32> {
    let whole_seconds = lease_duration
        .as_secs()
        .saturating_add(u64::from(lease_duration.subsec_nanos() > 0));
    let seconds = i32::try_from(whole_seconds).ok()?;
    (!renew_every.is_zero() && renew_every < lease_duration).then_some(seconds)
}

/// How long a control-plane binary's Lease lasts unless renewed.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the leader renews it.
pub const RENEW_EVERY: Duration = Duration::from_secs(5);

/// The Lease a control-plane binary's replicas take turns on.
pub struct Leadership {
    /// Where the Lease lives.
    pub api: Api<Lease>,
    /// The Lease's name.
    pub lease: &'static str,
    /// This replica's identity when neither `POD_NAME` nor `HOSTNAME` is set.
    pub fallback_identity: &'static str,
    /// Whether to elect at all; without election this replica always leads.
    pub enabled: bool,
}

/// Runs one term of `work` each time this replica comes to lead, until
/// `stop` resolves; then releases the Lease and returns what `stop` gave.
///
/// `work` starts a term's tasks and returns what winds them down: a term
/// ends when leadership is lost or `stop` resolves, the token it was given
/// is cancelled, and the returned future runs to its end before this
/// replica follows again (another leader must not overlap with it).
/// `on_lead(true/false)` reports each change, for a leader gauge.
pub async fn lead_in_turns<Stop, Work, WindDown>(
    leadership: Leadership,
    stop: Stop,
    mut on_lead: impl FnMut(bool),
    mut work: Work,
) -> Result<Stop::Output, LeaderError>
where
    Stop: Future,
    Work: FnMut(tokio_util::sync::CancellationToken) -> WindDown,
    WindDown: Future<Output = ()>,
{
    let released = tokio_util::sync::CancellationToken::new();
    let Election {
        mut leading,
        task: election,
    } = spawn_election(
        leadership.api,
        leadership.lease,
        leadership.fallback_identity,
        leadership.enabled,
        LEASE_DURATION,
        RENEW_EVERY,
        released.clone().cancelled_owned(),
    )?;
    let electing = leadership.enabled;
    let mut stop = std::pin::pin!(stop);
    let outcome = loop {
        tokio::select! {
            stopped = &mut stop => break Ok(stopped),
            changed = leading.wait_for(|lead| *lead) => {
                if changed.is_err() && electing {
                    break Err(LeaderError::Stopped);
                }
            }
        }
        on_lead(true);
        let term = tokio_util::sync::CancellationToken::new();
        let wind_down = work(term.clone());
        let stopped = tokio::select! {
            stopped = &mut stop => Some(stopped),
            _ = leading.wait_for(|lead| !*lead), if electing => None,
        };
        term.cancel();
        wind_down.await;
        on_lead(false);
        match stopped {
            Some(stopped) => break Ok(stopped),
            None => tracing::warn!("lost leadership: this term's work stopped; following again"),
        }
    };
    released.cancel();
    if let Some(election) = election
        && let Ok(Err(err)) = election.await
    {
        tracing::warn!(error = %err, "releasing the leader Lease");
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: &str, renewed: OffsetDateTime) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(micro_time(renewed)),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn acquire_renew_follow_and_take_over_an_expired_lease() {
        let t0 = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        assert_eq!(lease_action(None, "a", t0), LeaseAction::Acquire);
        assert_eq!(
            lease_action(Some(&spec("a", t0)), "a", t0),
            LeaseAction::Renew
        );
        let held = spec("b", t0);
        assert_eq!(
            lease_action(Some(&held), "a", t0 + time::Duration::seconds(14)),
            LeaseAction::Follow("b".into())
        );
        assert_eq!(
            lease_action(Some(&held), "a", t0 + time::Duration::seconds(15)),
            LeaseAction::Acquire
        );
        let released = LeaseSpec {
            holder_identity: None,
            ..held
        };
        assert_eq!(lease_action(Some(&released), "a", t0), LeaseAction::Acquire);
    }

    /// Without election this replica leads at once; when `stop` resolves the
    /// term's work winds down before the leader gauge drops.
    #[tokio::test]
    async fn without_election_one_term_runs_until_stopped() {
        let client = kube::Client::try_from(kube::Config::new(
            "https://127.0.0.1:1".parse().expect("static URL"),
        ))
        .unwrap();
        let leadership = Leadership {
            api: Api::namespaced(client, "default"),
            lease: "l",
            fallback_identity: "test",
            enabled: false,
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<&'static str>();
        let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = |event: String| events.lock().unwrap().push(event);
        let mut stop = Some(stop);
        let outcome = lead_in_turns(
            leadership,
            async move { stopped.await.unwrap_or("dropped") },
            |leading| record(format!("leading {leading}")),
            |term| {
                record("term started".into());
                if let Some(stop) = stop.take() {
                    let _ = stop.send("SIGTERM");
                }
                let events = events.clone();
                async move {
                    assert!(term.is_cancelled(), "the term ends before winding down");
                    events.lock().unwrap().push("wound down".into());
                }
            },
        )
        .await
        .unwrap();
        assert_eq!(outcome, "SIGTERM");
        assert_eq!(
            *events.lock().unwrap(),
            [
                "leading true",
                "term started",
                "wound down",
                "leading false"
            ]
        );
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
            let err = LeaderElection::new(api.clone(), "l", "a", duration, renew).unwrap_err();
            assert!(matches!(err, LeaderError::Timing { .. }), "{err}");
        }
        let ok = LeaderElection::new(api, "l", "a", Duration::from_millis(2500), s(1)).unwrap();
        assert_eq!(ok.elector().lease_duration_seconds, 3);
    }
}

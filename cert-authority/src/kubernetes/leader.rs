//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go does
//! it: the holder renews its Lease; another replica takes over only after
//! `leaseDurationSeconds` without a renewal. Writes carry the Lease's
//! resourceVersion, so two replicas racing for it cannot both win.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::PostParams;
use time::OffsetDateTime;

use super::KubeError;

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
    pub async fn try_lead(&self, now: OffsetDateTime) -> Result<bool, KubeError> {
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
    pub async fn release(&self) -> Result<(), KubeError> {
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
}

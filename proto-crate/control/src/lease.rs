//! An addon's health Lease, renewed as addon-framework's `LeaseUpdater`
//! does: OCM's registration agent reports the addon `Available` while the
//! Lease's `renewTime` is recent (§6 of the upstream reference).

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::PostParams;

/// What [`renew_lease`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRenewal {
    /// The Lease did not exist and was created.
    Created,
    /// The existing Lease got a new `renewTime`.
    Renewed,
}

/// Whether `error` is the API answering NotFound: the Lease's namespace does
/// not exist (a create), or the Lease vanished between read and write.
pub fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.is_not_found())
}

fn is_race(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.is_conflict() || status.is_already_exists())
}

/// Sets the `renewTime` of Lease `name` to now, creating the Lease (held by
/// `holder_identity`, lasting `duration_seconds`) if it does not exist.
/// A write that races with another writer is retried once with a fresh read.
pub async fn renew_lease(
    api: &Api<Lease>,
    name: &str,
    holder_identity: &str,
    duration_seconds: i32,
) -> Result<LeaseRenewal, kube::Error> {
    match renew_once(api, name, holder_identity, duration_seconds).await {
        Err(error) if is_race(&error) => {
            renew_once(api, name, holder_identity, duration_seconds).await
        }
        other => other,
    }
}

async fn renew_once(
    api: &Api<Lease>,
    name: &str,
    holder_identity: &str,
    duration_seconds: i32,
) -> Result<LeaseRenewal, kube::Error> {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    match api.get_opt(name).await? {
        None => {
            let mut lease = Lease {
                spec: Some(LeaseSpec {
                    holder_identity: Some(holder_identity.to_string()),
                    lease_duration_seconds: Some(duration_seconds),
                    renew_time: Some(now),
                    ..LeaseSpec::default()
                }),
                ..Lease::default()
            };
            lease.metadata.name = Some(name.to_string());
            api.create(&PostParams::default(), &lease).await?;
            Ok(LeaseRenewal::Created)
        }
        Some(mut lease) => {
            // The read's resourceVersion stays: a concurrent write is a 409.
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            spec.holder_identity = Some(holder_identity.to_string());
            spec.lease_duration_seconds = Some(duration_seconds);
            spec.renew_time = Some(now);
            api.replace(name, &PostParams::default(), &lease).await?;
            Ok(LeaseRenewal::Renewed)
        }
    }
}

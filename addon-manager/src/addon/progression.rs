//! The ClusterManagementAddOn's `status.installProgressions`: for each
//! placement, where the rollout of the current configurations stands, in
//! OCM's format (`kubectl get clustermanagementaddon cluster-proxy -o yaml`,
//! and the consoles that read it). OCM's addon-manager writes it only for
//! the addons it manages; ours says `lifecycle: self`, so it is ours to
//! write.
//!
//! It is a summary of every addon's `Progressing` condition, so it is
//! written by one task after the addon reconciles that change them, at most
//! once per [`COALESCE`], from the caches; never once per addon.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::{
    CONDITION_PROGRESSING, ClusterManagementAddOn, ClusterManagementAddOnStatus, ConfigSpecHash,
    InstallConfigReference, InstallProgression, REASON_COMPLETED, REASON_PROGRESSING,
};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::{CONDITION_FALSE, CONDITION_TRUE, Condition, find_condition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::runtime::reflector::ObjectRef;

use super::config::{self, ADC_GROUP, ADC_RESOURCE, MPC_GROUP, MPC_RESOURCE};
use super::context::Context;
use super::error::AddonError;
use super::names::ADDON_NAME;
use super::rollout::{self, Phase, Strategy};
use super::settings::{InstallStrategy, PlacementRef};
use crate::apply;

/// How long changes are gathered before the summary is written: a rollout
/// over thousands of clusters changes some addon every few milliseconds.
pub const COALESCE: Duration = Duration::from_secs(1);
/// How often it is looked at without a change (a `progressDeadline`
/// passing changes nothing that signals).
const RECHECK: Duration = Duration::from_secs(30);

/// Counts of one placement's clusters by where they stand.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    selected: usize,
    configured: usize,
    progressing: usize,
    done: usize,
    failed: usize,
    timed_out: usize,
}

impl Counts {
    fn of(selected: usize, phases: impl IntoIterator<Item = Phase>) -> Self {
        let mut counts = Counts {
            selected,
            ..Counts::default()
        };
        for phase in phases {
            counts.configured += 1;
            match phase {
                Phase::Succeeded { .. } => counts.done += 1,
                Phase::Progressing { .. } => counts.progressing += 1,
                failed @ Phase::Failed { .. } => {
                    if failed.timed_out() {
                        counts.timed_out += 1;
                    } else {
                        counts.failed += 1;
                    }
                }
                Phase::ToApply => {}
            }
        }
        counts
    }

    /// OCM's condition: completed once every configured addon is done, and
    /// never with none done (that would read as a finished rollout before
    /// anything was applied).
    fn condition(&self) -> (bool, &'static str, String) {
        let Counts {
            selected,
            configured,
            progressing,
            done,
            failed,
            timed_out,
        } = *self;
        if (configured == 0 && done == 0) || done != configured {
            (
                false,
                REASON_PROGRESSING,
                format!(
                    "selected clusters {selected}. configured addons {}/{configured} progressing..., {failed} failed {timed_out} timeout.",
                    progressing + done
                ),
            )
        } else {
            (
                true,
                REASON_COMPLETED,
                format!(
                    "selected clusters {selected}. configured addons {done}/{configured} completed with no errors, {failed} failed {timed_out} timeout."
                ),
            )
        }
    }
}

/// The configurations a placement's clusters get unless their addons name
/// others: the MPC and, if the ClusterManagementAddOn names one, the
/// AddOnDeploymentConfig of the placement's `configs` or else the default,
/// each with the hash of its current spec.
fn desired_configs(
    context: &Context,
    management: &ClusterManagementAddOn,
    placement: &PlacementRef,
    mpc: Option<&ManagedProxyConfiguration>,
) -> Vec<InstallConfigReference> {
    let mpc_name = context.settings.managed_proxy_configuration.clone();
    let mut references = vec![InstallConfigReference {
        group: MPC_GROUP.into(),
        resource: MPC_RESOURCE.into(),
        desired_config: Some(ConfigSpecHash {
            namespace: None,
            name: mpc_name,
            spec_hash: mpc.and_then(|mpc| config::spec_hash(&mpc.spec).ok()),
        }),
        ..InstallConfigReference::default()
    }];
    let adc = match config::placement_deployment_config(management, placement) {
        Some(config) => Some((config.namespace.as_ref(), &config.name)),
        None => config::default_deployment_config(management)
            .map(|default| (default.namespace.as_ref(), &default.name)),
    };
    if let Some((namespace, name)) = adc {
        // Without a namespace, each cluster's own: no one spec to hash.
        let namespace = namespace.filter(|namespace| !namespace.is_empty()).cloned();
        let spec_hash = namespace.as_ref().and_then(|namespace| {
            let adc = context
                .caches
                .addon
                .deployment_configs
                .get(&ObjectRef::new(name).within(namespace))?;
            config::spec_hash(&adc.spec).ok()
        });
        references.push(InstallConfigReference {
            group: ADC_GROUP.into(),
            resource: ADC_RESOURCE.into(),
            desired_config: Some(ConfigSpecHash {
                namespace,
                name: name.clone(),
                spec_hash,
            }),
            ..InstallConfigReference::default()
        });
    }
    references
}

/// Keeps what `previous` knew of each configuration still desired (the
/// last applied and last known good), and records `desired` as both when
/// the rollout completed.
fn with_history(
    mut desired: Vec<InstallConfigReference>,
    previous: Option<&InstallProgression>,
    completed: bool,
) -> Vec<InstallConfigReference> {
    let same = |a: &InstallConfigReference, b: &InstallConfigReference| {
        a.group == b.group
            && a.resource == b.resource
            && a.desired_config.as_ref().map(|c| (&c.namespace, &c.name))
                == b.desired_config.as_ref().map(|c| (&c.namespace, &c.name))
    };
    for reference in &mut desired {
        if let Some(known) = previous
            .and_then(|previous| previous.config_references.as_ref())
            .and_then(|known| known.iter().find(|known| same(known, reference)))
        {
            reference.last_applied_config = known.last_applied_config.clone();
            reference.last_known_good_config = known.last_known_good_config.clone();
        }
        if completed
            && reference
                .desired_config
                .as_ref()
                .is_some_and(|c| c.spec_hash.is_some())
        {
            reference.last_applied_config = reference.desired_config.clone();
            reference.last_known_good_config = reference.desired_config.clone();
        }
    }
    desired
}

/// `conditions` with `Progressing` set as `meta.SetStatusCondition` does:
/// the transition time moves only when the status does.
fn with_progressing(
    previous: Option<&[Condition]>,
    completed: bool,
    reason: &str,
    message: String,
    now: &Time,
) -> Vec<Condition> {
    let status = if completed {
        CONDITION_FALSE
    } else {
        CONDITION_TRUE
    };
    let recorded =
        previous.and_then(|conditions| find_condition(conditions, CONDITION_PROGRESSING));
    let last_transition_time = match recorded {
        Some(recorded) if recorded.status == status => recorded.last_transition_time.clone(),
        _ => now.clone(),
    };
    let mut conditions: Vec<Condition> = previous
        .unwrap_or_default()
        .iter()
        .filter(|condition| condition.type_ != CONDITION_PROGRESSING)
        .cloned()
        .collect();
    conditions.push(Condition {
        type_: CONDITION_PROGRESSING.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time,
        observed_generation: None,
    });
    conditions
}

/// The summary for `management` from the caches at `now`.
pub fn install_progressions(
    context: &Context,
    management: &ClusterManagementAddOn,
    mpc: Option<&ManagedProxyConfiguration>,
    now: Timestamp,
) -> Vec<InstallProgression> {
    let InstallStrategy::Placements(placements) = &context.settings.install_strategy else {
        return Vec::new();
    };
    let previous = management
        .status
        .as_ref()
        .and_then(|status| status.install_progressions.as_deref())
        .unwrap_or_default();
    let now_time = Time(now);
    placements
        .iter()
        .map(|placement| {
            let desired = desired_configs(context, management, placement, mpc);
            let known = previous.iter().find(|known| {
                known.namespace == placement.namespace && known.name == placement.name
            });
            let counts = placement_counts(context, placement, management, mpc, now);
            let (completed, reason, message) = counts.condition();
            InstallProgression {
                namespace: placement.namespace.clone(),
                name: placement.name.clone(),
                config_references: Some(with_history(desired, known, completed)),
                conditions: Some(with_progressing(
                    known.and_then(|known| known.conditions.as_deref()),
                    completed,
                    reason,
                    message,
                    &now_time,
                )),
            }
        })
        .collect()
}

fn placement_counts(
    context: &Context,
    placement: &PlacementRef,
    management: &ClusterManagementAddOn,
    mpc: Option<&ManagedProxyConfiguration>,
    now: Timestamp,
) -> Counts {
    let selected: BTreeSet<String> = context
        .caches
        .install
        .decisions
        .state()
        .iter()
        .filter(|decision| rollout::of_placement(decision, placement))
        .flat_map(|decision| {
            decision
                .cluster_names()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    let Some(mpc) = mpc else {
        return Counts::of(selected.len(), []);
    };
    // Only the deadline matters to where a cluster stands.
    let strategy = rollout::placement_strategy(Some(management), placement)
        .unwrap_or_else(|_| Strategy::all());
    let members = rollout::members(
        &context.settings,
        &context.caches,
        placement,
        &strategy,
        mpc,
        Some(management),
        now,
    );
    Counts::of(
        selected.len(),
        members.into_iter().map(|member| member.phase),
    )
}

/// Writes the summary when it changed; the ClusterManagementAddOn and the
/// MPC come from the caches.
async fn write_once(context: &Context) -> Result<(), AddonError> {
    let cache = &context.caches.install;
    let key = ObjectRef::new(ADDON_NAME);
    let Some(management) = cache
        .own_managements
        .freshest(&key, cache.managements.get(&key))
    else {
        return Ok(());
    };
    let mpc = context.caches.addon.mpcs.get(&ObjectRef::new(
        &context.settings.managed_proxy_configuration,
    ));
    let progressions = install_progressions(context, &management, mpc.as_deref(), Timestamp::now());
    let current = management
        .status
        .as_ref()
        .and_then(|status| status.install_progressions.clone())
        .unwrap_or_default();
    if current == progressions {
        return Ok(());
    }
    let mut patch = ClusterManagementAddOn::new(ADDON_NAME, Default::default());
    patch.status = Some(ClusterManagementAddOnStatus {
        install_progressions: Some(progressions),
        ..ClusterManagementAddOnStatus::default()
    });
    let api = Api::<ClusterManagementAddOn>::all(context.client.clone());
    match apply::apply_status(&api, &patch).await {
        Ok(written) => {
            cache.own_managements.wrote(Some(&management), written);
            Ok(())
        }
        // Gone: the install controller puts it back, and signals again.
        Err(error) if error.api_error().is_some_and(apply::is_not_found) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Keeps the summary current until `shutdown` completes.
pub async fn run(context: Arc<Context>, shutdown: impl Future<Output = ()>) {
    let keep_current = async {
        if context.caches.install.ready().await.is_err()
            || context.caches.addon.ready().await.is_err()
        {
            return;
        }
        loop {
            if let Err(error) = write_once(&context).await {
                tracing::warn!(%error, management = ADDON_NAME, "writing the ClusterManagementAddOn's installProgressions failed; retrying");
            }
            tokio::select! {
                () = context.progressions.notified() => {}
                () = tokio::time::sleep(RECHECK) => {}
            }
            // Gather the changes of a burst into one write.
            tokio::time::sleep(COALESCE).await;
        }
    };
    tokio::select! {
        () = keep_current => {}
        () = shutdown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn succeeded() -> Phase {
        Phase::Succeeded { since: None }
    }

    #[test]
    fn the_condition_reads_as_ocms() {
        let rolling = Counts::of(
            3,
            [
                succeeded(),
                Phase::Progressing { since: None },
                Phase::ToApply,
            ],
        );
        assert_eq!(
            rolling.condition(),
            (
                false,
                REASON_PROGRESSING,
                "selected clusters 3. configured addons 2/3 progressing..., 0 failed 0 timeout."
                    .to_owned()
            )
        );
        let done = Counts::of(4, [succeeded(), succeeded()]);
        assert_eq!(
            done.condition(),
            (
                true,
                REASON_COMPLETED,
                "selected clusters 4. configured addons 2/2 completed with no errors, 0 failed 0 timeout."
                    .to_owned()
            )
        );
        // Nothing configured yet is not a finished rollout.
        assert!(!Counts::of(2, []).condition().0);
    }

    #[test]
    fn failures_and_timeouts_are_counted_apart() {
        let failed = Phase::Failed {
            message: "work addon-cluster-proxy-deploy-0 is not applied: bad".into(),
        };
        let timed_out = Phase::Failed {
            message: "not applied and available within the progressDeadline of 600s".into(),
        };
        assert!(timed_out.timed_out() && !failed.timed_out());
        let counts = Counts::of(3, [failed, timed_out, succeeded()]);
        assert_eq!((counts.failed, counts.timed_out, counts.done), (1, 1, 1));
        assert!(
            counts.condition().2.ends_with("1 failed 1 timeout."),
            "{:?}",
            counts.condition()
        );
    }

    #[test]
    fn history_is_kept_and_a_completed_rollout_records_its_configs() {
        let desired = |hash: &str| InstallConfigReference {
            group: MPC_GROUP.into(),
            resource: MPC_RESOURCE.into(),
            desired_config: Some(ConfigSpecHash {
                namespace: None,
                name: "cluster-proxy".into(),
                spec_hash: Some(hash.into()),
            }),
            ..InstallConfigReference::default()
        };
        let first = with_history(vec![desired("a")], None, true);
        assert_eq!(first[0].last_applied_config, first[0].desired_config);
        let previous = InstallProgression {
            namespace: "ns".into(),
            name: "p".into(),
            config_references: Some(first),
            conditions: None,
        };
        // A new hash rolling out: the last known good stays the old one.
        let rolling = with_history(vec![desired("b")], Some(&previous), false);
        assert_eq!(
            rolling[0]
                .last_known_good_config
                .as_ref()
                .and_then(|c| c.spec_hash.as_deref()),
            Some("a")
        );
        let done = with_history(vec![desired("b")], Some(&previous), true);
        assert_eq!(
            done[0]
                .last_known_good_config
                .as_ref()
                .and_then(|c| c.spec_hash.as_deref()),
            Some("b")
        );
    }

    #[test]
    fn the_transition_time_moves_only_with_the_status() {
        let then = Time(Timestamp::from_second(1_000).unwrap());
        let later = Time(Timestamp::from_second(2_000).unwrap());
        let first = with_progressing(None, false, REASON_PROGRESSING, "1/3".into(), &then);
        let same = with_progressing(
            Some(&first),
            false,
            REASON_PROGRESSING,
            "2/3".into(),
            &later,
        );
        assert_eq!(same[0].last_transition_time, then);
        assert_eq!(same[0].message, "2/3");
        let done = with_progressing(Some(&same), true, REASON_COMPLETED, "3/3".into(), &later);
        assert_eq!(done[0].last_transition_time, later);
        assert_eq!(done[0].status, CONDITION_FALSE);
    }
}

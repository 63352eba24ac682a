//! The renewal loop: addon-framework's `LeaseUpdater` as upstream's
//! addon-agent runs it (reference F18), with the hub fallback and the
//! proxy-agent readiness gate.

use std::time::Duration;

use cluster_proxy_control::client::{ClientError, KubeconfigClient, in_cluster};
use cluster_proxy_control::{LeaseRenewal, is_not_found, renew_lease};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::readiness::{Probe, Readiness};
use crate::settings::{AddonAgentConfig, ManagedApi};
use crate::user_agent::USER_AGENT;

/// Upstream's `wait.JitterUntil` factor: each wait is the period plus up to
/// a quarter of it.
pub const JITTER: f64 = 0.25;
/// How often readiness is asked while the proxy-agent is not ready, so the
/// Lease is renewed soon after the first tunnel comes up.
pub const NOT_READY_POLL: Duration = Duration::from_secs(1);
/// The first retry after a failed renewal; it doubles up to the period.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);

/// `period` stretched by `JITTER × random` (`random` in `[0, 1]`).
pub fn jittered(period: Duration, random: f64) -> Duration {
    period + period.mul_f64(JITTER * random.clamp(0.0, 1.0))
}

/// The wait before retry number `failures` (1 for the first): doubling from
/// [`FIRST_RETRY`], never longer than `period`.
pub fn retry_delay(failures: u32, period: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_RETRY
        .saturating_mul(1 << doublings)
        .min(period)
        .max(Duration::from_millis(1))
}

/// What renewing the managed cluster's Lease came to.
#[derive(Debug)]
pub enum ManagedOutcome {
    /// No managed cluster API is configured.
    NotConfigured,
    Renewed(LeaseRenewal),
    /// The API answered NotFound: the Lease's namespace does not exist.
    NotFound(kube::Error),
    /// Anything else: unreachable, forbidden, a broken kubeconfig.
    Failed(RenewError),
}

/// What follows a managed outcome.
#[derive(Debug)]
pub enum Decision {
    /// The managed outcome is the result.
    Done(Result<Renewed, RenewError>),
    /// Renew the hub Lease instead (with the NotFound that led there).
    FallBack(Option<kube::Error>),
}

/// Upstream's rule: the hub Lease is renewed when there is no managed Lease
/// to renew, never when the managed API merely failed (the registration
/// agent reads the managed Lease first, so a fresh hub Lease would not help
/// while a stale managed one exists).
pub fn decide(outcome: ManagedOutcome) -> Decision {
    match outcome {
        ManagedOutcome::NotConfigured => Decision::FallBack(None),
        ManagedOutcome::NotFound(error) => Decision::FallBack(Some(error)),
        ManagedOutcome::Renewed(renewal) => Decision::Done(Ok(Renewed::Managed(renewal))),
        ManagedOutcome::Failed(error) => Decision::Done(Err(error)),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    #[error("{target}: {source}")]
    Client {
        target: &'static str,
        #[source]
        source: ClientError,
    },
    #[error("{target} Lease {namespace}/{name}: {source}")]
    Api {
        target: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "the managed cluster has no Lease namespace ({source}) and no hub kubeconfig is configured to fall back on"
    )]
    NoFallback {
        #[source]
        source: kube::Error,
    },
    #[error("no managed cluster API and no hub kubeconfig: there is no Lease to renew")]
    NoLease,
    #[error("renewing took longer than {0:?}")]
    Timeout(Duration),
}

/// Which Lease a successful renewal wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    Managed(LeaseRenewal),
    Hub(LeaseRenewal),
}

enum ManagedClient {
    None,
    InCluster(Option<Client>),
    Kubeconfig(KubeconfigClient),
}

impl ManagedClient {
    async fn get(&mut self) -> Result<Option<Client>, ClientError> {
        match self {
            ManagedClient::None => Ok(None),
            ManagedClient::InCluster(cached) => {
                if let Some(client) = cached {
                    return Ok(Some(client.clone()));
                }
                let client = in_cluster(USER_AGENT)?;
                *cached = Some(client.clone());
                Ok(Some(client))
            }
            ManagedClient::Kubeconfig(reloading) => reloading.get().await.map(Some),
        }
    }
}

/// Renews the Lease once per call, on the managed cluster or the hub.
pub struct Renewer {
    managed: ManagedClient,
    hub: Option<KubeconfigClient>,
    lease_name: String,
    lease_namespace: String,
    cluster_name: String,
    holder_identity: String,
    duration_seconds: i32,
}

impl Renewer {
    pub fn new(config: &AddonAgentConfig) -> Self {
        let managed = match &config.managed {
            ManagedApi::None => ManagedClient::None,
            ManagedApi::InCluster => ManagedClient::InCluster(None),
            ManagedApi::Kubeconfig(path) => {
                ManagedClient::Kubeconfig(KubeconfigClient::new(path, USER_AGENT))
            }
        };
        Renewer {
            managed,
            hub: config.hub_kubeconfig.as_ref().map(|path| {
                KubeconfigClient::new(path, USER_AGENT).with_egress(config.hub_egress.clone())
            }),
            lease_name: config.lease_name.clone(),
            lease_namespace: config.lease_namespace.clone(),
            cluster_name: config.cluster_name.clone(),
            holder_identity: config.holder_identity.clone(),
            duration_seconds: config.lease_duration_seconds(),
        }
    }

    async fn renew_managed(&mut self) -> ManagedOutcome {
        let client = match self.managed.get().await {
            Ok(Some(client)) => client,
            Ok(None) => return ManagedOutcome::NotConfigured,
            Err(source) => {
                return ManagedOutcome::Failed(RenewError::Client {
                    target: "managed cluster",
                    source,
                });
            }
        };
        let api: Api<Lease> = Api::namespaced(client, &self.lease_namespace);
        match renew_lease(
            &api,
            &self.lease_name,
            &self.holder_identity,
            self.duration_seconds,
        )
        .await
        {
            Ok(renewal) => ManagedOutcome::Renewed(renewal),
            Err(error) if is_not_found(&error) => ManagedOutcome::NotFound(error),
            Err(source) => ManagedOutcome::Failed(RenewError::Api {
                target: "managed cluster",
                namespace: self.lease_namespace.clone(),
                name: self.lease_name.clone(),
                source,
            }),
        }
    }

    async fn renew_hub(&mut self, not_found: Option<kube::Error>) -> Result<Renewed, RenewError> {
        let Some(hub) = self.hub.as_mut() else {
            // Settings refuse this combination; named should that change.
            return Err(match not_found {
                Some(source) => RenewError::NoFallback { source },
                None => RenewError::NoLease,
            });
        };
        let client = hub.get().await.map_err(|source| RenewError::Client {
            target: "hub",
            source,
        })?;
        let api: Api<Lease> = Api::namespaced(client, &self.cluster_name);
        renew_lease(
            &api,
            &self.lease_name,
            &self.holder_identity,
            self.duration_seconds,
        )
        .await
        .map(Renewed::Hub)
        .map_err(|source| RenewError::Api {
            target: "hub",
            namespace: self.cluster_name.clone(),
            name: self.lease_name.clone(),
            source,
        })
    }

    /// One renewal: the managed Lease, or the hub Lease as [`decide`]s.
    pub async fn renew(&mut self) -> Result<Renewed, RenewError> {
        match decide(self.renew_managed().await) {
            Decision::Done(result) => result,
            Decision::FallBack(not_found) => {
                if let Some(error) = &not_found {
                    tracing::debug!(%error, "no Lease namespace on the managed cluster; renewing the hub Lease");
                }
                self.renew_hub(not_found).await
            }
        }
    }
}

/// Renews until `shutdown`: once as soon as the proxy-agent is ready, then
/// every lease duration with up to 25% jitter, only while it stays ready.
/// Failures are retried with a doubling delay; nothing here ends the loop
/// but `shutdown`.
pub async fn run(config: AddonAgentConfig, metrics: Metrics, shutdown: CancellationToken) {
    let period = config.lease_duration;
    // A hung API must not delay the next readiness check past the period.
    let attempt_timeout = period.clamp(Duration::from_secs(5), Duration::from_secs(30));
    let probe = config
        .proxy_agent_health_url
        .clone()
        .map(|url| Probe::new(url, period.min(Duration::from_secs(5))));
    let mut renewer = Renewer::new(&config);
    let mut was_ready: Option<bool> = None;
    let mut failures: u32 = 0;
    let mut wait = Duration::ZERO;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let readiness = match &probe {
            None => Readiness::Ready,
            Some(probe) => tokio::select! {
                _ = shutdown.cancelled() => return,
                readiness = probe.check() => readiness,
            },
        };
        let ready = readiness.is_ready();
        metrics.set_proxy_agent_ready(ready);
        if was_ready != Some(ready) {
            if ready {
                tracing::info!("proxy-agent is ready; renewing the Lease");
            } else {
                tracing::warn!(proxy_agent = %readiness, "proxy-agent is not ready; the Lease is not renewed until it is");
            }
        }
        was_ready = Some(ready);
        if !ready {
            wait = NOT_READY_POLL.min(period);
            continue;
        }
        let attempt = tokio::time::timeout(attempt_timeout, renewer.renew());
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            result = attempt => result.unwrap_or(Err(RenewError::Timeout(attempt_timeout))),
        };
        match result {
            Ok(renewed) => {
                let target = match renewed {
                    Renewed::Managed(_) => "managed",
                    Renewed::Hub(_) => "hub",
                };
                metrics.renewal(target);
                if failures > 0 {
                    tracing::info!(lease = target, failures, "renewing the Lease works again");
                } else {
                    tracing::debug!(lease = target, ?renewed, "renewed the Lease");
                }
                failures = 0;
                wait = jittered(period, rand::random::<f64>());
            }
            Err(error) => {
                metrics.renewal("error");
                failures = failures.saturating_add(1);
                wait = retry_delay(failures, period);
                // Logged at the 1st, 2nd, 4th, 8th… failure in a row.
                if failures.is_power_of_two() {
                    tracing::warn!(%error, failures, retry_in = ?wait, "cannot renew the Lease");
                } else {
                    tracing::debug!(%error, failures, retry_in = ?wait, "cannot renew the Lease");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_quarter_above_the_period() {
        let period = Duration::from_secs(60);
        assert_eq!(jittered(period, 0.0), period);
        assert_eq!(jittered(period, 1.0), Duration::from_secs(75));
        // Out-of-range randomness cannot stretch or shrink it further.
        assert_eq!(jittered(period, 7.0), Duration::from_secs(75));
        assert_eq!(jittered(period, -1.0), period);
        for _ in 0..1000 {
            let wait = jittered(period, rand::random::<f64>());
            assert!(
                (period..=Duration::from_secs(75)).contains(&wait),
                "{wait:?}"
            );
        }
    }

    #[test]
    fn retries_double_up_to_the_period() {
        let period = Duration::from_secs(60);
        let delays: Vec<u64> = (1..=8).map(|n| retry_delay(n, period).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(retry_delay(u32::MAX, period), period);
        assert_eq!(
            retry_delay(1, Duration::from_millis(300)),
            Duration::from_millis(300)
        );
    }

    fn api_error(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            reason: reason.into(),
            ..kube::core::Status::default()
        }))
    }

    #[test]
    fn the_hub_is_used_only_when_there_is_no_managed_lease_to_renew() {
        assert!(matches!(
            decide(ManagedOutcome::NotConfigured),
            Decision::FallBack(None)
        ));
        assert!(matches!(
            decide(ManagedOutcome::NotFound(api_error(404, "NotFound"))),
            Decision::FallBack(Some(_))
        ));
        assert!(matches!(
            decide(ManagedOutcome::Renewed(LeaseRenewal::Created)),
            Decision::Done(Ok(Renewed::Managed(LeaseRenewal::Created)))
        ));
        for failure in [
            RenewError::Api {
                target: "managed cluster",
                namespace: "ns".into(),
                name: "cluster-proxy".into(),
                source: api_error(403, "Forbidden"),
            },
            RenewError::Timeout(Duration::from_secs(5)),
            RenewError::Client {
                target: "managed cluster",
                source: ClientError::Config("unreachable".into()),
            },
        ] {
            assert!(matches!(
                decide(ManagedOutcome::Failed(failure)),
                Decision::Done(Err(_))
            ));
        }
    }
}

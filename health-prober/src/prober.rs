//! Probe rounds: every `cluster-proxy` ManagedClusterAddOn this prober
//! replica owns ([`crate::shards`]), through every proxy-server replica, and
//! a `ClusterProxyReachable` condition written only when it changes
//! meaningfully.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_proto::api::addon::v1alpha1::ManagedClusterAddOn;
use cluster_proxy_proto::api::{CONDITION_FALSE, CONDITION_TRUE, Condition, find_condition};
use cluster_proxy_proto::trace::SPAN_TARGET;
use cluster_proxy_runtime::telemetry;
use futures_util::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use tracing::Instrument;

use crate::metrics::{ClusterLabel, PhaseLabel, ProberMetrics, ResultLabel};
use crate::probe::{Phase, ProbeOutcome, ProbeTarget, probe};
use crate::replicas::Replica;
use crate::shards::Members;
use crate::verdict::{CONDITION_TYPE, Change, LATENCY_FLOOR_MS, Verdict, judge, key_of_condition};

/// Default of [`Prober::with_latency_write_interval`].
pub const LATENCY_WRITE_INTERVAL: Duration = Duration::from_secs(600);

/// The add-on whose ManagedClusterAddOns are probed.
pub const ADDON_NAME: &str = "cluster-proxy";
/// The field manager of the prober's status writes.
pub const FIELD_MANAGER: &str = "cluster-proxy-health-prober";

#[derive(Debug, thiserror::Error)]
pub enum ProberError {
    #[error("list ManagedClusterAddOns: {0}")]
    List(#[source] kube::Error),
    #[error("not a member of the probers yet: the member Lease was never renewed")]
    NotAMember,
}

/// What one round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RoundReport {
    /// Every cluster with the add-on.
    pub listed: usize,
    /// The live probers, this one included, that shared them.
    pub members: usize,
    /// This replica's share: the clusters it probed.
    pub clusters: usize,
    pub reachable: usize,
    pub writes: usize,
    pub write_errors: usize,
}

/// Probes clusters through a fixed list of replicas.
pub struct Prober {
    client: kube::Client,
    replicas: Vec<Arc<Replica>>,
    target: ProbeTarget,
    concurrency: usize,
    latency_floor_ms: u64,
    /// At most one latency-only write per cluster per this interval.
    latency_write_interval: Duration,
    /// When each cluster's condition was last written by this process.
    written_at: std::sync::Mutex<HashMap<String, tokio::time::Instant>>,
    metrics: ProberMetrics,
    /// The clusters of the last round, whose gauges are dropped when they
    /// leave (or move to another prober replica).
    probed: std::sync::Mutex<BTreeSet<String>>,
    /// The probers sharing the clusters; `None`: this one probes them all.
    members: Option<tokio::sync::watch::Receiver<Option<Members>>>,
}

impl Prober {
    /// `concurrency` bounds the probes in flight (clusters × replicas).
    pub fn new(
        client: kube::Client,
        replicas: Vec<Replica>,
        target: ProbeTarget,
        concurrency: usize,
        metrics: ProberMetrics,
    ) -> Self {
        Prober {
            client,
            replicas: replicas.into_iter().map(Arc::new).collect(),
            target,
            concurrency: concurrency.max(1),
            latency_floor_ms: LATENCY_FLOOR_MS,
            latency_write_interval: LATENCY_WRITE_INTERVAL,
            written_at: std::sync::Mutex::new(HashMap::new()),
            metrics,
            probed: std::sync::Mutex::new(BTreeSet::new()),
            members: None,
        }
    }

    /// Shares the clusters with the other probers in `members` (kept up
    /// to date by [`crate::shards::Membership::run`]): each round probes
    /// only the clusters this replica owns in the view at its start. Until
    /// the first view arrives rounds fail with [`ProberError::NotAMember`],
    /// so that a starting replica does not probe every cluster once.
    pub fn with_members(mut self, members: tokio::sync::watch::Receiver<Option<Members>>) -> Self {
        self.members = Some(members);
        self
    }

    /// The clusters the last round probed.
    pub fn probed(&self) -> BTreeSet<String> {
        self.probed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Latencies under `floor` never count as a change (default
    /// [`LATENCY_FLOOR_MS`]); only a doubling or halving above it does.
    pub fn with_latency_floor(mut self, floor: Duration) -> Self {
        self.latency_floor_ms = u64::try_from(floor.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// A latency that moved but a state that did not is written at most once
    /// per `interval` per cluster (default [`LATENCY_WRITE_INTERVAL`]): on a
    /// loaded hub, latencies through the tunnel double and halve from round
    /// to round, and 2,000 clusters must not turn that into a write storm.
    pub fn with_latency_write_interval(mut self, interval: Duration) -> Self {
        self.latency_write_interval = interval;
        self
    }

    /// One round over this replica's clusters with the add-on: a span
    /// (`health_prober.round`) with a child per probe.
    pub async fn round(&self) -> Result<RoundReport, ProberError> {
        let span = tracing::info_span!(
            target: SPAN_TARGET,
            "health_prober.round",
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            error.message = tracing::field::Empty,
            cluster_proxy.clusters = tracing::field::Empty,
            cluster_proxy.reachable = tracing::field::Empty,
            cluster_proxy.members = tracing::field::Empty,
        );
        let round = self.probe_every_cluster().instrument(span.clone()).await;
        telemetry::record_outcome(&span, &round);
        if let Ok(report) = &round {
            span.record("cluster_proxy.clusters", report.clusters);
            span.record("cluster_proxy.reachable", report.reachable);
            span.record("cluster_proxy.members", report.members);
        }
        round
    }

    async fn probe_every_cluster(&self) -> Result<RoundReport, ProberError> {
        let started = tokio::time::Instant::now();
        // The view at the round's start, for the whole round: a change
        // mid-round shows in the next one.
        let members = match &self.members {
            None => None,
            Some(members) => Some(members.borrow().clone().ok_or(ProberError::NotAMember)?),
        };
        let addons = Api::<ManagedClusterAddOn>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(ProberError::List)?;
        let addons: Vec<ManagedClusterAddOn> = addons
            .items
            .into_iter()
            .filter(|a| a.metadata.name.as_deref() == Some(ADDON_NAME))
            .filter(|a| a.metadata.deletion_timestamp.is_none())
            .filter(|a| a.metadata.namespace.is_some())
            .collect();
        let listed = addons.len();
        let addons: Vec<ManagedClusterAddOn> = match &members {
            None => addons,
            Some(members) => addons
                .into_iter()
                .filter(|a| {
                    a.metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|c| members.owns(c))
                })
                .collect(),
        };
        let member_count = members.as_ref().map_or(1, Members::len);
        self.metrics
            .members
            .set(i64::try_from(member_count).unwrap_or(i64::MAX));
        self.metrics
            .shard_clusters
            .set(i64::try_from(addons.len()).unwrap_or(i64::MAX));
        self.forget_departed(&addons);
        // Each cluster probes every replica at once.
        let clusters_at_once = (self.concurrency / self.replicas.len().max(1)).max(1);
        let mut report = RoundReport {
            listed,
            members: member_count,
            clusters: addons.len(),
            ..RoundReport::default()
        };
        let mut results = futures_util::stream::iter(addons)
            .map(|addon| async move {
                let verdict = self.probe_cluster(&addon).await;
                let written = self.record(&addon, &verdict).await;
                (verdict, written)
            })
            .buffer_unordered(clusters_at_once);
        while let Some((verdict, written)) = results.next().await {
            report.reachable += usize::from(verdict.reachable);
            match written {
                Ok(true) => report.writes += 1,
                Ok(false) => {}
                Err(()) => report.write_errors += 1,
            }
        }
        self.metrics
            .round_duration
            .observe(started.elapsed().as_secs_f64());
        Ok(report)
    }

    fn forget_departed(&self, addons: &[ManagedClusterAddOn]) {
        let current: BTreeSet<String> = addons
            .iter()
            .filter_map(|a| a.metadata.namespace.clone())
            .collect();
        let mut probed = self.probed.lock().unwrap_or_else(|p| p.into_inner());
        for cluster in probed.difference(&current) {
            self.metrics.cluster_reachable.remove(&ClusterLabel {
                cluster: cluster.clone(),
            });
        }
        self.written_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|cluster, _| current.contains(cluster));
        *probed = current;
    }

    async fn probe_cluster(&self, addon: &ManagedClusterAddOn) -> Verdict {
        let cluster = addon.metadata.namespace.as_deref().unwrap_or_default();
        let probes = self.replicas.iter().map(|replica| async move {
            let span = probe_span(cluster, replica.address());
            let outcome = async {
                match replica.connector(self.target.timeout).await {
                    Ok(connector) => probe(&connector, &self.target, cluster).await,
                    Err(error) => ProbeOutcome {
                        error: Some(error.to_string()),
                        replica_failed: true,
                        ..ProbeOutcome::default()
                    },
                }
            }
            .instrument(span.clone())
            .await;
            record_probe(&span, &outcome);
            if outcome.replica_failed
                && let Some(error) = &outcome.error
            {
                replica.mark_down(error.clone()).await;
            }
            (replica.address().to_owned(), outcome)
        });
        let outcomes = futures_util::future::join_all(probes).await;
        for (replica, outcome) in &outcomes {
            self.observe(outcome);
            if let Some(error) = &outcome.error {
                tracing::debug!(%cluster, %replica, %error, "probe failed");
            }
        }
        let verdict = judge(&outcomes);
        self.metrics
            .cluster_reachable
            .get_or_create(&ClusterLabel {
                cluster: cluster.to_owned(),
            })
            .set(i64::from(verdict.reachable));
        verdict
    }

    fn observe(&self, outcome: &ProbeOutcome) {
        for (phase, took) in [
            (Phase::Dial, outcome.dial),
            (Phase::Tls, outcome.tls),
            (Phase::FirstByte, outcome.first_byte),
        ] {
            if let Some(took) = took {
                self.metrics
                    .probe_duration
                    .get_or_create(&PhaseLabel {
                        phase: phase.as_str(),
                    })
                    .observe(took.as_secs_f64());
            }
        }
        let result = if outcome.healthy() {
            "success"
        } else {
            "failure"
        };
        self.metrics
            .probes
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Writes the condition when its key changed; whether it wrote.
    async fn record(&self, addon: &ManagedClusterAddOn, verdict: &Verdict) -> Result<bool, ()> {
        let (Some(namespace), Some(name)) = (&addon.metadata.namespace, &addon.metadata.name)
        else {
            return Ok(false);
        };
        let status = if verdict.reachable {
            CONDITION_TRUE
        } else {
            CONDITION_FALSE
        };
        let previous = find_condition(addon.conditions(), CONDITION_TYPE);
        if let Some(previous) = previous
            && previous.status == status
        {
            let change = key_of_condition(&previous.reason, &previous.message)
                .change_to(&verdict.key, self.latency_floor_ms);
            let recently_written = self
                .written_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(namespace)
                .is_some_and(|at| at.elapsed() < self.latency_write_interval);
            match change {
                Change::None => return Ok(false),
                Change::Latency if recently_written => return Ok(false),
                Change::Latency | Change::State => {}
            }
        }
        let last_transition_time = match previous {
            Some(previous) if previous.status == status => previous.last_transition_time.clone(),
            _ => Time(k8s_openapi::jiff::Timestamp::now()),
        };
        let condition = Condition {
            type_: CONDITION_TYPE.to_owned(),
            status: status.to_owned(),
            reason: verdict.reason.to_owned(),
            message: verdict.message.clone(),
            last_transition_time,
            observed_generation: addon.metadata.generation,
        };
        let patch = serde_json::json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ManagedClusterAddOn",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"conditions": [condition]},
        });
        let api = Api::<ManagedClusterAddOn>::namespaced(self.client.clone(), namespace);
        match api
            .patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {
                self.written_at
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(namespace.clone(), tokio::time::Instant::now());
                self.metrics.status_writes.inc();
                tracing::info!(cluster = %namespace, reason = verdict.reason, message = %verdict.message, "reachability changed");
                Ok(true)
            }
            Err(error) => {
                tracing::warn!(cluster = %namespace, %error, "writing the ClusterProxyReachable condition");
                Err(())
            }
        }
    }

    /// Rounds every `interval` ±10% until `stop` completes.
    pub async fn run(&self, interval: Duration, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            match self.round().await {
                Ok(report) => tracing::debug!(?report, "probe round done"),
                Err(error) => tracing::warn!(%error, "probe round failed"),
            }
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(jittered(interval)) => {}
            }
        }
    }
}

/// The span of one probe of `cluster` through `replica`: the parent of the
/// tunnel client's `tunnel.dial`, so the server's and the agent's spans of
/// the probe's connection join its trace.
fn probe_span(cluster: &str, replica: &str) -> tracing::Span {
    tracing::info_span!(
        target: SPAN_TARGET,
        "health_prober.probe",
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
        error.message = tracing::field::Empty,
        cluster_proxy.cluster = cluster,
        cluster_proxy.replica = replica,
        cluster_proxy.result = tracing::field::Empty,
        cluster_proxy.dial_latency_ms = tracing::field::Empty,
        cluster_proxy.tls_latency_ms = tracing::field::Empty,
        cluster_proxy.first_byte_latency_ms = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    )
}

fn record_probe(span: &tracing::Span, outcome: &ProbeOutcome) {
    for (field, took) in [
        ("cluster_proxy.dial_latency_ms", outcome.dial),
        ("cluster_proxy.tls_latency_ms", outcome.tls),
        ("cluster_proxy.first_byte_latency_ms", outcome.first_byte),
    ] {
        if let Some(took) = took {
            span.record(field, took.as_secs_f64() * 1000.0);
        }
    }
    if let Some(status) = outcome.status {
        span.record("http.response.status_code", status);
    }
    match &outcome.error {
        None => {
            span.record("cluster_proxy.result", "success");
        }
        Some(error) => {
            span.record("cluster_proxy.result", "failure");
            telemetry::record_error(span, error);
        }
    }
}

/// `interval` ±10%, so that replicas' and clusters' rhythms drift apart.
pub fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(0.9 + 0.2 * rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_ten_percent() {
        let interval = Duration::from_secs(30);
        for _ in 0..1000 {
            let d = jittered(interval);
            assert!(
                d >= Duration::from_secs(27) && d <= Duration::from_secs(33),
                "{d:?}"
            );
        }
    }
}

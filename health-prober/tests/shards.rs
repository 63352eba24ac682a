//! Prober replicas sharing the clusters through member Leases in the
//! in-memory Kubernetes API: disjoint shares that cover every cluster, and
//! a survivor that takes over when a member leaves or dies.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use cluster_proxy_runtime::reload;
use common::{Apiserver, Hub, Tunnel};
use health_prober::metrics::ProberMetrics;
use health_prober::probe::ProbeTarget;
use health_prober::prober::{Prober, ProberError};
use health_prober::replicas::Replica;
use health_prober::shards::{MEMBER_LABEL, Members, Membership, member_lease_name};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::ListParams;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAMESPACE: &str = "hub";
/// Short, so that a crashed member expires within the test's patience.
const LEASE_DURATION: Duration = Duration::from_secs(3);
const RENEW_EVERY: Duration = Duration::from_millis(500);
const INTERVAL: Duration = Duration::from_millis(300);
/// Lease expiry, a renewal to notice it and a round to act on it, with
/// room for a loaded machine.
const TAKE_OVER: Duration = Duration::from_secs(20);

fn cluster_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("cluster-{i:02}")).collect()
}

/// One prober replica: its membership task and, once started, its rounds.
struct Member {
    prober: Arc<Prober>,
    members: watch::Receiver<Option<Members>>,
    leave: CancellationToken,
    membership: tokio::task::JoinHandle<()>,
    rounds: Option<tokio::task::JoinHandle<()>>,
    stop_rounds: CancellationToken,
    lease: String,
}

impl Member {
    async fn start(hub: &Hub, tunnel: &Tunnel, apiserver: &Apiserver, identity: &str) -> Member {
        let tls = reload::fixed(tunnel.pki.client_tls().unwrap());
        let replicas = vec![Replica::new(&tunnel.client_address(0), tls).unwrap()];
        let membership = Membership::new(
            Api::<Lease>::namespaced(hub.client.clone(), NAMESPACE),
            identity,
            LEASE_DURATION,
            RENEW_EVERY,
        )
        .unwrap();
        let lease = membership.name().to_owned();
        assert_eq!(lease, member_lease_name(identity));
        let (publish, members) = watch::channel(None);
        let prober = Prober::new(
            hub.client.clone(),
            replicas,
            ProbeTarget {
                port: apiserver.port,
                tls: health_prober::tls::target_client(None).unwrap(),
                timeout: Duration::from_secs(3),
            },
            64,
            ProberMetrics::default(),
        )
        .with_latency_floor(Duration::from_secs(10))
        .with_members(members.clone());
        let leave = CancellationToken::new();
        let membership = tokio::spawn(membership.run(publish, leave.clone().cancelled_owned()));
        Member {
            prober: Arc::new(prober),
            members,
            leave,
            membership,
            rounds: None,
            stop_rounds: CancellationToken::new(),
            lease,
        }
    }

    fn start_rounds(&mut self) {
        let prober = self.prober.clone();
        let stop = self.stop_rounds.clone();
        self.rounds = Some(tokio::spawn(async move {
            prober.run(INTERVAL, stop.cancelled_owned()).await
        }));
    }

    async fn stop_rounds(&mut self) {
        self.stop_rounds.cancel();
        if let Some(rounds) = self.rounds.take() {
            rounds.await.unwrap();
        }
    }

    /// Waits until this member sees `n` live members.
    async fn sees(&mut self, n: usize) -> Members {
        let seen = tokio::time::timeout(
            TAKE_OVER,
            self.members
                .wait_for(|m| m.as_ref().is_some_and(|m| m.len() == n)),
        )
        .await
        .map(|seen| seen.map(|members| members.clone()));
        match seen {
            Ok(Ok(Some(members))) => members,
            Ok(_) => panic!("{}: the membership task stopped", self.lease),
            Err(_) => panic!(
                "{} never saw {n} members: {:?}",
                self.lease,
                *self.members.borrow()
            ),
        }
    }
}

async fn member_leases(hub: &Hub) -> BTreeSet<String> {
    Api::<Lease>::namespaced(hub.client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("{MEMBER_LABEL}=true")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|l| l.metadata.name)
        .collect()
}

/// Polls `probed` until it is `want`, or fails after [`TAKE_OVER`].
async fn until_probing(member: &Member, want: &BTreeSet<String>) {
    let deadline = tokio::time::Instant::now() + TAKE_OVER;
    while member.prober.probed() != *want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} probes {:?}, not {want:?}",
            member.lease,
            member.prober.probed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn hub_with(clusters: &[String]) -> (Hub, Tunnel, Apiserver) {
    let refs: Vec<&str> = clusters.iter().map(String::as_str).collect();
    let hub = Hub::start(&refs).await;
    hub.namespace(NAMESPACE).await;
    // No agents: every cluster is Unreachable, which is a condition to
    // write all the same; reachability itself is tests/prober.rs's.
    let tunnel = Tunnel::start(&refs, 1).await;
    let apiserver = Apiserver::start(&refs).await;
    (hub, tunnel, apiserver)
}

#[tokio::test]
async fn two_replicas_probe_disjoint_shares_that_cover_every_cluster() {
    let clusters = cluster_names(16);
    let all: BTreeSet<String> = clusters.iter().cloned().collect();
    let (hub, tunnel, apiserver) = hub_with(&clusters).await;
    let mut a = Member::start(&hub, &tunnel, &apiserver, "prober-a").await;
    let mut b = Member::start(&hub, &tunnel, &apiserver, "prober-b").await;

    let seen_by_a = a.sees(2).await;
    let seen_by_b = b.sees(2).await;
    assert_eq!(seen_by_a.all(), seen_by_b.all());
    assert_eq!(
        member_leases(&hub).await,
        BTreeSet::from([a.lease.clone(), b.lease.clone()])
    );

    let report_a = a.prober.round().await.unwrap();
    let report_b = b.prober.round().await.unwrap();
    for report in [&report_a, &report_b] {
        assert_eq!((report.listed, report.members), (16, 2), "{report:?}");
        assert_eq!(report.writes, report.clusters, "{report:?}");
    }
    let (share_a, share_b) = (a.prober.probed(), b.prober.probed());
    assert!(share_a.is_disjoint(&share_b), "{share_a:?} {share_b:?}");
    assert_eq!(&share_a | &share_b, all);
    // Neither idles: with these two names and 16 clusters the split is 7/9.
    assert!(
        !share_a.is_empty() && !share_b.is_empty(),
        "{share_a:?} {share_b:?}"
    );
    assert_eq!(report_a.clusters + report_b.clusters, 16);
    for cluster in &clusters {
        let (status, reason, _) = hub
            .reachability(cluster)
            .await
            .unwrap_or_else(|| panic!("{cluster} has no condition"));
        assert_eq!((status.as_str(), reason.as_str()), ("False", "Unreachable"));
    }

    // The next rounds write nothing: each share's conditions stand.
    assert_eq!(a.prober.round().await.unwrap().writes, 0);
    assert_eq!(b.prober.round().await.unwrap().writes, 0);
    a.leave.cancel();
    b.leave.cancel();
    a.membership.await.unwrap();
    b.membership.await.unwrap();
    assert!(member_leases(&hub).await.is_empty());
}

#[tokio::test]
async fn a_replica_probes_nothing_before_it_has_joined() {
    let clusters = cluster_names(2);
    let (hub, tunnel, apiserver) = hub_with(&clusters).await;
    let tls = reload::fixed(tunnel.pki.client_tls().unwrap());
    let (_publish, members) = watch::channel(None);
    let prober = Prober::new(
        hub.client.clone(),
        vec![Replica::new(&tunnel.client_address(0), tls).unwrap()],
        ProbeTarget {
            port: apiserver.port,
            tls: health_prober::tls::target_client(None).unwrap(),
            timeout: Duration::from_secs(3),
        },
        64,
        ProberMetrics::default(),
    )
    .with_members(members);
    assert!(matches!(prober.round().await, Err(ProberError::NotAMember)));
    assert!(hub.reachability("cluster-00").await.is_none());
}

#[tokio::test]
async fn the_survivor_takes_every_cluster_when_a_member_leaves() {
    let clusters = cluster_names(16);
    let all: BTreeSet<String> = clusters.iter().cloned().collect();
    let (hub, tunnel, apiserver) = hub_with(&clusters).await;
    let mut a = Member::start(&hub, &tunnel, &apiserver, "prober-a").await;
    let mut b = Member::start(&hub, &tunnel, &apiserver, "prober-b").await;
    let view = a.sees(2).await;
    b.sees(2).await;
    a.start_rounds();
    b.start_rounds();
    let share = |lease: &str| -> BTreeSet<String> {
        all.iter()
            .filter(|c| view.owner(c) == lease)
            .cloned()
            .collect()
    };
    until_probing(&a, &share(&a.lease)).await;
    until_probing(&b, &share(&b.lease)).await;

    // b stops as on SIGTERM: rounds first, then its Lease goes.
    b.stop_rounds().await;
    b.leave.cancel();
    b.membership.await.unwrap();
    assert_eq!(member_leases(&hub).await, BTreeSet::from([a.lease.clone()]));
    let alone = a.sees(1).await;
    assert_eq!(alone.all(), [a.lease.clone()]);
    until_probing(&a, &all).await;
    a.stop_rounds().await;
}

#[tokio::test]
async fn the_survivor_takes_every_cluster_once_a_dead_members_lease_expires() {
    let clusters = cluster_names(16);
    let all: BTreeSet<String> = clusters.iter().cloned().collect();
    let (hub, tunnel, apiserver) = hub_with(&clusters).await;
    let mut a = Member::start(&hub, &tunnel, &apiserver, "prober-a").await;
    let mut b = Member::start(&hub, &tunnel, &apiserver, "prober-b").await;
    let view = a.sees(2).await;
    b.sees(2).await;
    a.start_rounds();
    b.start_rounds();
    let share_a: BTreeSet<String> = all
        .iter()
        .filter(|c| view.owner(c) == a.lease)
        .cloned()
        .collect();
    assert!(share_a.len() < all.len());
    until_probing(&a, &share_a).await;

    // b dies without a word: its Lease stays until it expires.
    if let Some(rounds) = b.rounds.take() {
        rounds.abort();
    }
    b.membership.abort();
    let _ = b.membership.await;
    let died = tokio::time::Instant::now();
    assert!(member_leases(&hub).await.contains(&b.lease));
    a.sees(1).await;
    assert!(
        died.elapsed() >= LEASE_DURATION - RENEW_EVERY * 2,
        "a dropped b after {:?}, before its Lease could expire",
        died.elapsed()
    );
    until_probing(&a, &all).await;
    a.stop_rounds().await;
}

#[tokio::test]
async fn a_member_long_dead_is_not_counted_and_its_lease_is_deleted() {
    let clusters = cluster_names(1);
    let (hub, _tunnel, _apiserver) = hub_with(&clusters).await;
    let leases = Api::<Lease>::namespaced(hub.client.clone(), NAMESPACE);
    let lease = |name: &str, renewed_ago: Duration| -> Lease {
        let renewed = k8s_openapi::jiff::Timestamp::now()
            - k8s_openapi::jiff::SignedDuration::try_from(renewed_ago).unwrap();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {MEMBER_LABEL: "true"}},
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": 3,
                "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(renewed),
            },
        }))
        .unwrap()
    };
    let post = kube::api::PostParams::default();
    // Expired 10 lease durations ago: collected. Expired a moment ago: kept
    // (its member may only be slow), but not a member.
    leases
        .create(
            &post,
            &lease("cluster-proxy-health-prober-dead", LEASE_DURATION * 11),
        )
        .await
        .unwrap();
    leases
        .create(
            &post,
            &lease("cluster-proxy-health-prober-late", LEASE_DURATION * 2),
        )
        .await
        .unwrap();
    let membership =
        Membership::new(leases.clone(), "prober-a", LEASE_DURATION, RENEW_EVERY).unwrap();
    let members = membership.heartbeat().await.unwrap();
    assert_eq!(members.all(), [membership.name().to_owned()]);
    assert_eq!(
        member_leases(&hub).await,
        BTreeSet::from([
            membership.name().to_owned(),
            "cluster-proxy-health-prober-late".to_owned()
        ])
    );
    // A renewal keeps when the member joined.
    let joined = |l: Lease| l.spec.and_then(|s| s.acquire_time);
    let first = joined(leases.get(membership.name()).await.unwrap());
    membership.heartbeat().await.unwrap();
    let renewed = leases.get(membership.name()).await.unwrap();
    assert_eq!(joined(renewed.clone()), first);
    assert_ne!(renewed.spec.and_then(|s| s.renew_time), first);
}

#[tokio::test]
async fn replicas_started_together_see_each_other_in_their_first_view() {
    let clusters = cluster_names(4);
    let (hub, tunnel, apiserver) = hub_with(&clusters).await;
    let mut a = Member::start(&hub, &tunnel, &apiserver, "prober-a").await;
    let mut b = Member::start(&hub, &tunnel, &apiserver, "prober-b").await;
    for member in [&mut a, &mut b] {
        let first = tokio::time::timeout(TAKE_OVER, member.members.wait_for(Option::is_some))
            .await
            .map(|seen| seen.map(|m| m.clone()));
        let Ok(Ok(Some(first))) = first else {
            panic!("{}: no view within {TAKE_OVER:?}", member.lease);
        };
        // Else each would probe every cluster in its first round.
        assert_eq!(first.len(), 2, "{}: {first:?}", member.lease);
    }
}

//! Leader election and Lease renewal against the in-memory Kubernetes API.

use std::time::Duration;

use cluster_proxy_control::{LeaderElection, LeaseRenewal, is_not_found, renew_lease};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use memory_apiserver::{KubeApi, KubeApiOptions};
use tokio::sync::{oneshot, watch};

const WAIT: Duration = Duration::from_secs(20);

async fn api() -> (tempfile::TempDir, KubeApi, kube::Client) {
    let dir = tempfile::tempdir().expect("temp dir");
    let api = KubeApi::start(KubeApiOptions::new(dir.path()))
        .await
        .expect("start the API");
    let client = api.client().await.expect("client");
    (dir, api, client)
}

async fn wait_for(leading: &mut watch::Receiver<bool>, want: bool) {
    tokio::time::timeout(WAIT, leading.wait_for(|l| *l == want))
        .await
        .unwrap_or_else(|_| panic!("leadership did not become {want}"))
        .expect("the election ended");
}

struct Running {
    leading: watch::Receiver<bool>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), cluster_proxy_control::LeaderError>>,
}

fn start(client: &kube::Client, identity: &str, duration: Duration, renew: Duration) -> Running {
    let election = LeaderElection::new(
        Api::namespaced(client.clone(), "default"),
        "test-leader",
        identity,
        duration,
        renew,
    )
    .expect("valid timing");
    let (on_change, leading) = watch::channel(false);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(election.run(on_change, async move {
        let _ = stopped.await;
    }));
    Running {
        leading,
        stop,
        task,
    }
}

async fn renewal(client: &kube::Client) -> (Option<String>, String) {
    let spec = Api::<Lease>::namespaced(client.clone(), "default")
        .get("test-leader")
        .await
        .expect("read the Lease")
        .spec
        .unwrap_or_default();
    let at = spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default();
    (spec.holder_identity, at)
}

async fn holder(client: &kube::Client) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), "default")
        .get("test-leader")
        .await
        .expect("read the Lease")
        .spec
        .and_then(|s| s.holder_identity)
}

#[tokio::test]
async fn one_replica_leads_and_hands_over_at_once_on_shutdown() {
    let (_dir, _api, client) = api().await;
    let long = Duration::from_secs(30);
    let mut a = start(&client, "a", long, Duration::from_millis(200));
    wait_for(&mut a.leading, true).await;
    let mut b = start(&client, "b", long, Duration::from_millis(200));
    // a renews twice after b started: b's first attempt (at once) and at
    // least one more lie in between, and b still follows.
    let mut renewals = Vec::new();
    tokio::time::timeout(WAIT, async {
        while renewals.len() < 3 {
            let (who, at) = renewal(&client).await;
            assert_eq!(who.as_deref(), Some("a"));
            if renewals.last() != Some(&at) {
                renewals.push(at);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a keeps renewing");
    assert!(!*b.leading.borrow());

    a.stop.send(()).expect("a is running");
    a.task
        .await
        .expect("a's task")
        .expect("a released the Lease");
    assert!(!*a.leading.borrow(), "a reported that it stopped leading");
    // The 30 s lease has not expired: only the release lets b in this soon.
    wait_for(&mut b.leading, true).await;
    assert_eq!(holder(&client).await.as_deref(), Some("b"));
    b.stop.send(()).expect("b is running");
    b.task
        .await
        .expect("b's task")
        .expect("b released the Lease");
}

#[tokio::test]
async fn a_leader_that_cannot_renew_steps_down_before_the_lease_expires() {
    let (_dir, api, client) = api().await;
    let mut a = start(
        &client,
        "a",
        Duration::from_secs(2),
        Duration::from_millis(300),
    );
    wait_for(&mut a.leading, true).await;
    let lost_at = tokio::time::Instant::now();
    api.shutdown().await;
    wait_for(&mut a.leading, false).await;
    assert!(
        lost_at.elapsed() < Duration::from_secs(3),
        "stepped down after {:?}, when another replica may already lead",
        lost_at.elapsed()
    );
    a.stop.send(()).expect("a is running");
    // The release cannot reach the API; it is bounded, not a hang.
    let ended = tokio::time::timeout(WAIT, a.task).await.expect("run ends");
    assert!(ended.expect("a's task").is_ok());
}

#[tokio::test]
async fn a_lease_is_created_then_renewed_and_a_missing_namespace_is_not_found() {
    let (_dir, _api, client) = api().await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    assert_eq!(
        renew_lease(&leases, "cluster-proxy", "pod-1", 60)
            .await
            .expect("create"),
        LeaseRenewal::Created
    );
    let first = leases.get("cluster-proxy").await.expect("read");
    let spec = first.spec.clone().expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("pod-1"));
    assert_eq!(spec.lease_duration_seconds, Some(60));
    let first_renewal = spec.renew_time.expect("renewTime");

    assert_eq!(
        renew_lease(&leases, "cluster-proxy", "pod-2", 60)
            .await
            .expect("renew"),
        LeaseRenewal::Renewed
    );
    let spec = leases
        .get("cluster-proxy")
        .await
        .expect("read")
        .spec
        .expect("spec");
    assert!(spec.renew_time.expect("renewTime").0 > first_renewal.0);
    assert_eq!(spec.holder_identity.as_deref(), Some("pod-2"));

    let missing: Api<Lease> = Api::namespaced(client, "no-such-namespace");
    let err = renew_lease(&missing, "cluster-proxy", "pod-1", 60)
        .await
        .expect_err("no namespace");
    assert!(is_not_found(&err), "{err}");
}

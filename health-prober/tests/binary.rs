//! The `health-prober` binary: two processes share the clusters through
//! their member Leases; on SIGTERM one deletes its Lease and the other takes
//! every cluster.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{Apiserver, Hub, Tunnel, metrics, sample};
use health_prober::shards::MEMBER_LABEL;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::ListParams;

const NAMESPACE: &str = "hub";
const WAIT: Duration = Duration::from_secs(30);

struct Prober {
    child: Child,
    health_port: u16,
}

impl Drop for Prober {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn free_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

/// Polls `check` every 100 ms until it gives `Ok`, or fails with its last `Err`.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match check().await {
            Ok(()) => return,
            Err(last) => assert!(
                tokio::time::Instant::now() < deadline,
                "{what} not within {WAIT:?}: {last}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The holders of the member Leases.
async fn members(hub: &Hub) -> Vec<String> {
    let mut holders: Vec<String> = Api::<Lease>::namespaced(hub.client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("{MEMBER_LABEL}=true")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|l| l.spec?.holder_identity)
        .collect();
    holders.sort();
    holders
}

/// (members, shard clusters, probes) from a prober's `/metrics`.
async fn gauges(prober: &Prober) -> Result<(f64, f64, f64), String> {
    let text = metrics(prober.health_port)
        .await
        .ok_or("no /metrics answer")?;
    Ok((
        sample(&text, "health_prober_members"),
        sample(&text, "health_prober_shard_clusters"),
        sample(&text, "health_prober_probes_total"),
    ))
}

#[tokio::test]
async fn two_processes_share_the_clusters_and_one_takes_all_when_the_other_stops() {
    let clusters = [
        "cluster-a",
        "cluster-b",
        "cluster-c",
        "cluster-d",
        "cluster-e",
        "cluster-f",
    ];
    let hub = Hub::start(&clusters).await;
    hub.namespace(NAMESPACE).await;
    let tunnel = Tunnel::start(&clusters, 1).await;
    let apiserver = Apiserver::start(&clusters).await;
    // One cluster reachable, to see a True written through the binary; the
    // others are written Unreachable.
    let _agent = tunnel.agent("cluster-a", 0).await;
    let dir = tempfile::tempdir().unwrap();
    let layout = tunnel.pki.write(dir.path()).unwrap();
    let client = layout.proxy_client();

    let mut probers = Vec::new();
    for i in 0..2 {
        let health_port = free_port().await;
        let child = Command::new(env!("CARGO_BIN_EXE_health-prober"))
            .env("KUBECONFIG", hub.api.kubeconfig_path())
            .env("POD_NAME", format!("prober-{i}"))
            .args([
                format!("--namespace={NAMESPACE}"),
                format!("--proxy-server-addresses={}", tunnel.client_address(0)),
                format!("--proxy-ca-cert={}", layout.bundle().display()),
                format!("--proxy-cert={}", client.cert.display()),
                format!("--proxy-key={}", client.key.display()),
                "--interval=1s".into(),
                "--timeout=1s".into(),
                format!("--target-port={}", apiserver.port),
                format!("--health-port={health_port}"),
                "--health-bind-address=127.0.0.1".into(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        probers.push(Prober { child, health_port });
    }

    eventually("every cluster's condition written", || async {
        for cluster in clusters {
            match hub.reachability(cluster).await {
                Some((status, _, _)) if cluster != "cluster-a" || status == "True" => {}
                other => return Err(format!("{cluster}: {other:?}")),
            }
        }
        Ok(())
    })
    .await;
    let holders = members(&hub).await;
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(holders[0].starts_with("prober-0_"), "{holders:?}");
    assert!(holders[1].starts_with("prober-1_"), "{holders:?}");

    // Once both see each other, their last rounds split the six clusters.
    eventually("two members sharing six clusters", || async {
        let (first, second) = (gauges(&probers[0]).await?, gauges(&probers[1]).await?);
        if first.0 == 2.0 && second.0 == 2.0 && first.1 + second.1 == 6.0 {
            Ok(())
        } else {
            Err(format!("(members, share, probes): {first:?} {second:?}"))
        }
    })
    .await;

    let pid = nix::unistd::Pid::from_raw(i32::try_from(probers[1].child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = probers[1].child.try_wait().unwrap() {
            break status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "prober-1 ignored SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
    // Deleted on the way out, not left to expire.
    let holders = members(&hub).await;
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(holders[0].starts_with("prober-0_"), "{holders:?}");
    eventually("the survivor probing all six", || async {
        let (members, share, _) = gauges(&probers[0]).await?;
        if (members, share) == (1.0, 6.0) {
            Ok(())
        } else {
            Err(format!("members {members}, share {share}"))
        }
    })
    .await;
}

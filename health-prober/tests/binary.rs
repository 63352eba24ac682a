//! The `health-prober` binary: two processes elect one leader on the Lease
//! `cluster-proxy-health-prober`; only the leader probes and writes.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{Apiserver, Hub, Tunnel, metrics, sample};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

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

#[tokio::test]
async fn one_of_two_processes_leads_and_probes() {
    let hub = Hub::start(&["cluster-a"]).await;
    hub.namespace(NAMESPACE).await;
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let apiserver = Apiserver::start(&["cluster-a"]).await;
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

    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some((status, _, _)) = hub.reachability("cluster-a").await
            && status == "True"
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no ClusterProxyReachable=True"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lease = Api::<Lease>::namespaced(hub.client.clone(), NAMESPACE)
        .get("cluster-proxy-health-prober")
        .await
        .unwrap();
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(holder.starts_with("prober-"), "{holder:?}");

    let mut leaders = 0;
    for prober in &probers {
        let text = metrics(prober.health_port).await.unwrap();
        let leading = sample(&text, "health_prober_leader") == 1.0;
        let probes = sample(&text, "health_prober_probes_total");
        if leading {
            leaders += 1;
            assert!(probes >= 1.0, "the leader has not probed:\n{text}");
        } else {
            assert_eq!(probes, 0.0, "a follower probed:\n{text}");
        }
    }
    assert_eq!(leaders, 1);
}

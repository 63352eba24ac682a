//! `cluster_proxy_proto::connector` against in-process proxy-servers and agents.

mod common;

use std::time::Duration;

use bytes::Bytes;
use cluster_proxy_proto::connector::{ConnectError, TunnelConnector, kube_client};
use common::Tunnel;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use memory_apiserver::{KubeApi, KubeApiOptions};
use simulated_cluster::targets::{TcpTarget, closed_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tunnel_harness::in_process::{RawAgent, tunnel_client};

async fn connector(tunnel: &Tunnel, timeout: Duration) -> TunnelConnector {
    let client = tunnel_client(
        tunnel.pki.client_tls().unwrap(),
        tunnel.servers[0].client_addr,
    )
    .await
    .unwrap();
    TunnelConnector::new(client, timeout)
}

#[tokio::test]
async fn hyper_gets_through_the_tunnel_by_cluster_name() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    // Answers with the request line it got.
    let target = TcpTarget::serve(|mut socket| async move {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let line = String::from_utf8_lossy(&head)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned();
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{line}",
            line.len()
        );
        let _ = socket.write_all(response.as_bytes()).await;
    })
    .await
    .unwrap();
    let plain = connector(&tunnel, Duration::from_secs(5)).await;
    // With early data, each request's head rides in its dial request.
    for connector in [plain.clone(), plain.with_early_data()] {
        let http: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
        for _ in 0..3 {
            let uri = format!("http://cluster-a:{}/path?q=1", target.addr.port());
            let response = http.get(uri.parse().unwrap()).await.unwrap();
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            // Origin-form, as to the server itself, not absolute-form as to a proxy.
            assert_eq!(&body[..], b"GET /path?q=1 HTTP/1.1");
        }
    }
}

#[tokio::test]
async fn a_kube_client_lists_objects_behind_an_agent() {
    let tunnel = Tunnel::start(&["cluster-a"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    let dir = tempfile::tempdir().unwrap();
    let mut options = KubeApiOptions::new(dir.path());
    options.extra_sans = vec!["cluster-a".into()];
    let api = KubeApi::start(options).await.unwrap();

    let kubeconfig = kube::config::Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    // The API listens on 127.0.0.1; the client knows it only as cluster-a,
    // which only the agent resolves.
    config.cluster_url = format!("https://cluster-a:{}", api.addr().port())
        .parse()
        .unwrap();
    let plain = connector(&tunnel, Duration::from_secs(5)).await;
    // With early data, kube's TLS ClientHello rides in the dial request.
    for connector in [plain.clone(), plain.with_early_data()] {
        let client = kube_client(&config, connector).unwrap();
        let namespaces = Api::<Namespace>::all(client)
            .list(&Default::default())
            .await
            .unwrap();
        let names: Vec<_> = namespaces
            .items
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        assert!(names.iter().any(|n| n == "kube-system"), "{names:?}");
    }
    assert!(tunnel.servers[0].connection_count() >= 1);
}

#[tokio::test]
async fn dial_failures_say_what_went_wrong() {
    let tunnel = Tunnel::start(&["cluster-a", "cluster-z"], 1).await;
    let _agent = tunnel.agent("cluster-a", 0).await;
    let connector = connector(&tunnel, Duration::from_millis(500)).await;

    let error = connector
        .connect(&"https://cluster-b:443".parse().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(error, ConnectError::NoAgent { .. }), "{error}");
    assert!(error.to_string().contains("cluster-b:443"), "{error}");

    let closed = closed_port().await.unwrap();
    let error = connector
        .connect(
            &format!("https://cluster-a:{}", closed.port())
                .parse()
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert!(matches!(error, ConnectError::Refused { .. }), "{error}");
    assert!(
        error.to_string().to_lowercase().contains("refused"),
        "{error}"
    );

    let error = connector
        .connect(&"https://not_a_name:443".parse().unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(error, ConnectError::InvalidTarget { .. }),
        "{error}"
    );

    // An agent that never answers the dial.
    let _silent = RawAgent::connect(
        tunnel.pki.agent_tls("cluster-z").unwrap(),
        tunnel.servers[0].agent_addr,
        "cluster-z-agent",
        "host=cluster-z",
        None,
    )
    .await
    .unwrap();
    assert!(
        simulated_cluster::wait::wait_until(common::WAIT, || tunnel.servers[0].tunnel_count() == 2)
            .await
    );
    let error = connector
        .connect(&"https://cluster-z:443".parse().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(error, ConnectError::Timeout { .. }), "{error}");

    // With early data the connection comes back at once, and a failed dial
    // is the error of the request, the same ConnectError inside it.
    let lazy = connector.clone().with_early_data();
    let error = failed_get(lazy.clone(), "http://cluster-b:80/").await;
    assert!(
        matches!(
            ConnectError::find_in(&error),
            Some(ConnectError::NoAgent { address }) if address == "cluster-b:80"
        ),
        "{}",
        error_chain(&error)
    );
    let error = failed_get(lazy, &format!("http://cluster-a:{}/", closed.port())).await;
    assert!(
        matches!(
            ConnectError::find_in(&error),
            Some(ConnectError::Refused { reason, .. }) if reason.contains("connection refused")
        ),
        "{}",
        error_chain(&error)
    );
    assert!(
        error_chain(&error).contains("connection refused"),
        "{}",
        error_chain(&error)
    );
    // A plain connector's error, as hyper wraps it, is found the same way.
    let error = failed_get(connector, "http://cluster-b:80/").await;
    assert!(
        matches!(
            ConnectError::find_in(&error),
            Some(ConnectError::NoAgent { .. })
        ),
        "{}",
        error_chain(&error)
    );
}

/// The error of a GET of `uri` through `connector`, which must fail.
async fn failed_get(connector: TunnelConnector, uri: &str) -> hyper_util::client::legacy::Error {
    let http: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    http.get(uri.parse().unwrap()).await.unwrap_err()
}

/// An error and its sources, as one line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

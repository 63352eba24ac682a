//! Every reconcile of the hub controller is a `reconcile` span naming the
//! ManagedProxyConfiguration; a failed one carries the API's error. Spans
//! go to an in-process OTLP collector (one test: the exporting subscriber
//! is process-wide).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use addon_manager::hub::{self, HubMetrics, HubSettings};
use bytes::Bytes;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_runtime::logging::LogFormat;
use cluster_proxy_runtime::telemetry::{self, SamplerChoice, TelemetryConfig};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use kube::Api;
use kube::api::PostParams;
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;
use simulated_cluster::otlp::Collector;
use tokio::sync::oneshot;

const CRD: &str = include_str!("../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Responding = Pin<
    Box<
        dyn Future<Output = Result<http::Response<UnsyncBoxBody<Bytes, BoxError>>, BoxError>>
            + Send,
    >,
>;

/// Answers Deployment PATCHes with a 500 while `failing` is set.
struct FailDeployments<S> {
    inner: S,
    failing: Arc<AtomicBool>,
}

impl<S, B> tower::Service<http::Request<kube::client::Body>> for FailDeployments<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<UnsyncBoxBody<Bytes, BoxError>>;
    type Error = BoxError;
    type Future = Responding;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        if request.method() == http::Method::PATCH
            && request.uri().path().contains("/deployments/")
            && self.failing.load(Ordering::SeqCst)
        {
            let status = json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "injected failure", "reason": "Injected", "code": 500
            });
            let body = http_body_util::Full::new(Bytes::from(status.to_string()))
                .map_err(|never| match never {})
                .boxed_unsync();
            let response = http::Response::builder()
                .status(500)
                .header("content-type", "application/json")
                .body(body)
                .map_err(BoxError::from);
            return Box::pin(async move { response });
        }
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await.map_err(Into::into)?;
            Ok(response.map(|body| body.map_err(Into::into).boxed_unsync()))
        })
    }
}

fn mpc(name: &str) -> ManagedProxyConfiguration {
    serde_json::from_value(json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": name},
        "spec": {
            "authentication": {},
            "proxyServer": {
                "image": "quay.io/ocm/cluster-proxy:v1",
                "replicas": 1,
                "entrypoint": {"type": "Hostname", "hostname": {"value": "proxy.example.com"}}
            },
            "proxyAgent": {"image": "quay.io/ocm/cluster-proxy:v1"}
        }
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reconcile_is_a_span_and_a_failure_carries_its_error() {
    let (collector, collector_addr, _stop) = Collector::start().await.unwrap();
    let config = TelemetryConfig {
        endpoint: Some(format!("http://{collector_addr}")),
        sampler: SamplerChoice::AlwaysOn,
        ..TelemetryConfig::off("addon-manager")
    };
    let telemetry = telemetry::init(0, LogFormat::Text, &config).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(KubeApiOptions::new(dir.path()))
        .await
        .unwrap();
    api.register_crds_from_yaml(CRD).unwrap();
    let client = api.client().await.unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let failing = Arc::new(AtomicBool::new(false));
    let layer_failing = failing.clone();
    let controller_client = kube::client::ClientBuilder::try_from(config)
        .unwrap()
        .with_layer(&tower::layer::layer_fn(move |inner| FailDeployments {
            inner,
            failing: layer_failing.clone(),
        }))
        .build();
    let (stop, stopped) = oneshot::channel::<()>();
    let settings = HubSettings {
        resync: Duration::from_secs(3600),
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_millis(500),
        ..HubSettings::default()
    };
    let controller = tokio::spawn(hub::run(
        controller_client,
        settings,
        HubMetrics::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let mpcs = Api::<ManagedProxyConfiguration>::all(client.clone());

    mpcs.create(&PostParams::default(), &mpc("deployed"))
        .await
        .unwrap();
    let deployed = collector
        .wait_for("reconcile", |s| {
            s.attribute("k8s.object.name") == Some("deployed")
        })
        .await;
    assert_eq!(
        deployed.attribute("k8s.object.kind"),
        Some("ManagedProxyConfiguration")
    );
    assert_eq!(deployed.attribute("cluster_proxy.controller"), Some("hub"));
    assert_eq!(deployed.parent_span_id, "", "a reconcile starts a trace");
    assert_ne!(deployed.status, "ERROR", "{deployed:#?}");

    failing.store(true, Ordering::SeqCst);
    mpcs.create(&PostParams::default(), &mpc("refused"))
        .await
        .unwrap();
    let refused = collector
        .wait_for("reconcile", |s| {
            s.attribute("k8s.object.name") == Some("refused") && s.status == "ERROR"
        })
        .await;
    assert!(
        refused.status_message.contains("injected failure"),
        "{refused:#?}"
    );
    assert!(
        refused
            .attribute("error.message")
            .is_some_and(|m| m.contains("injected failure")),
        "{refused:#?}"
    );

    let _ = stop.send(());
    controller.await.unwrap();
    telemetry.shutdown().await;
    api.shutdown().await;
}

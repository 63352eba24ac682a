//! What `cert-authority init` and `cert-authority run` do once their
//! settings are loaded.

use std::sync::Arc;

use cluster_proxy_runtime::metrics::encode_registry;
use cluster_proxy_runtime::net::BindError;
use cluster_proxy_runtime::shutdown::Signals;
use cluster_proxy_runtime::{admin, net, telemetry};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::authority::{AuthorityError, Desired, FileStore, reconcile};
use crate::files::{FilesError, InitOptions, Layout, Pair, init};
use crate::kubernetes::{self, KubeError, KubeOptions};
use crate::rotation::{LeafPolicy, RolloverPolicy};
use crate::settings::{Backend, ConfigError, InitSettings, RunSettings, cluster_names};

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Files(#[from] FilesError),
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    #[error(transparent)]
    Kubernetes(#[from] KubeError),
    #[error("no Kubernetes API to talk to (set KUBECONFIG, or run in a cluster): {0}")]
    NoKubernetesApi(KubeError),
    #[error(transparent)]
    Health(#[from] BindError),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("{0} is required")]
    Required(&'static str),
}

/// `init`: writes a complete PKI into `--dir` and lists what it wrote.
pub fn init_pki(settings: InitSettings) -> Result<(), CommandError> {
    let dir = settings.dir.ok_or(CommandError::Required("--dir"))?;
    let options = InitOptions {
        clusters: cluster_names(&settings.clusters)?,
        additional_sans: settings.additional_san,
        leaf_validity: settings.leaf_validity,
        ca_validity: settings.ca_validity,
    };
    let layout = Layout::new(&dir);
    init(&layout, &options)?;
    println!("wrote a PKI to {}:", dir.display());
    let show = |what: &str, pair: Pair| {
        println!(
            "  {:<28} {} / {}",
            what,
            pair.cert.display(),
            pair.key.display()
        );
    };
    println!("  {:<28} {}", "trust bundle", layout.bundle().display());
    show("CA (keep the key private)", layout.ca());
    show("proxy-server client port", layout.proxy_server());
    show("proxy-server agent port", layout.agent_server());
    show("hub proxy client", layout.proxy_client());
    for cluster in &options.clusters {
        show(&format!("agent of {cluster}"), layout.agent(cluster));
    }
    Ok(())
}

/// `run`: keeps the PKI of the chosen backend current.
pub async fn run(settings: RunSettings) -> Result<(), CommandError> {
    match settings.backend {
        // Synchronous, and dies of SIGTERM as any process does: it blocks the
        // thread `block_on` drives, which runs no other task.
        Backend::Files => run_files(&settings),
        Backend::Kubernetes => run_kubernetes(&settings).await,
    }
}

fn leaf_policy(settings: &RunSettings) -> LeafPolicy {
    LeafPolicy {
        validity: settings.leaf_validity,
        renew_fraction: 2.0 / 3.0,
        ..LeafPolicy::default()
    }
}

fn rollover_policy(settings: &RunSettings) -> RolloverPolicy {
    RolloverPolicy {
        ca_validity: settings.ca_validity,
        prepare_before_expiry: settings.ca_prepare_before_expiry,
        bundle_propagation: settings.bundle_propagation,
    }
}

fn run_files(settings: &RunSettings) -> Result<(), CommandError> {
    let dir = settings
        .dir
        .clone()
        .ok_or(CommandError::Required("--dir (with --backend files)"))?;
    let desired = Desired {
        outside_leaves_on_previous: 0,
        clusters: cluster_names(&settings.clusters)?,
        server_sans: crate::files::server_sans(&settings.additional_san),
        leaf_policy: leaf_policy(settings),
        rollover_policy: rollover_policy(settings),
        // Service access's certificates come only from the kubernetes
        // backend (a ManagedProxyConfiguration's spec.userServer).
        user_server_sans: None,
    };
    let store = FileStore {
        layout: Layout::new(&dir),
    };
    loop {
        let pass = telemetry::reconcile_span(
            "cert-authority",
            "Directory",
            &dir.display().to_string(),
            None,
        );
        let in_pass = pass.enter();
        let result = reconcile(&store, &desired, time::OffsetDateTime::now_utc());
        telemetry::record_outcome(&pass, &result);
        match result {
            Ok(report) => {
                for renewed in &report.renewed {
                    tracing::info!(leaf = %renewed, "certificate issued");
                }
            }
            Err(e) if settings.once => return Err(e.into()),
            Err(e) => tracing::error!(error = %e, "reconcile failed; retrying next interval"),
        }
        if settings.once {
            return Ok(());
        }
        drop(in_pass);
        std::thread::sleep(settings.interval);
    }
}

async fn run_kubernetes(settings: &RunSettings) -> Result<(), CommandError> {
    let mut options = KubeOptions::new(&settings.namespace);
    options.signer_secret_name = settings.signer_secret_name.clone();
    options.signer_secret_namespace = settings.signer_namespace().to_owned();
    options.additional_sans = settings.additional_san.clone();
    options.managed_proxy_configuration =
        Some(settings.managed_proxy_configuration.clone()).filter(|name| !name.is_empty());
    options.leaf_policy = leaf_policy(settings);
    options.rollover_policy = rollover_policy(settings);
    options.interval = settings.interval;
    let client = kubernetes::client()
        .await
        .map_err(CommandError::NoKubernetesApi)?;
    tracing::info!(
        namespace = %options.namespace,
        identity = %options.identity,
        managed_proxy_configuration = options.managed_proxy_configuration.as_deref().unwrap_or("(none)"),
        "kubernetes backend starting"
    );
    if settings.once {
        let report = kubernetes::run_once(&client, &options).await?;
        for renewed in &report.renewed {
            tracing::info!(leaf = %renewed, "certificate issued");
        }
        return Ok(());
    }
    let mut signals = Signals::install().map_err(CommandError::Signals)?;
    let mut registry = Registry::default();
    let metrics = kubernetes::metrics::Metrics::register(&mut registry);
    let (listener, address) = net::bind(
        "health port",
        &settings.health_bind_address,
        settings.health_port,
    )
    .await?;
    let registry = Arc::new(registry);
    // Ready once the API answered; a standby replica (not the leader) is
    // ready too, so a rollout does not wait on leadership.
    let routes = admin::Routes::probes(|| Ok(())).with_metrics(move || encode_registry(&registry));
    let stop = CancellationToken::new();
    tokio::spawn(admin::serve(listener, routes, stop.clone()));
    tracing::info!(%address, "serving /healthz, /readyz and /metrics");
    let shutdown = async move {
        let signal = signals.recv().await;
        tracing::info!(signal, "stopping");
    };
    let result = kubernetes::run_with_metrics(client, options, metrics, shutdown).await;
    stop.cancel();
    Ok(result?)
}

#![forbid(unsafe_code)]
use anyhow::Context;
use cert_authority::authority::{Desired, FileStore, reconcile};
use cert_authority::files::{InitOptions, Layout, init};
use cert_authority::kubernetes::{self, KubeOptions};
use cert_authority::rotation::{LeafPolicy, RolloverPolicy};
use cert_authority::settings::{Backend, Cli, Command, InitSettings, RunSettings, cluster_names};
use clap::CommandFactory;
use std::sync::Arc;

use cluster_proxy_runtime::metrics::encode_registry;
use cluster_proxy_runtime::{admin, cli, net, shutdown::Signals, telemetry};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

fn main() -> anyhow::Result<()> {
    // Defaults differ per subcommand; `--help` shows each subcommand's own.
    let command = cli::with_subcommand_defaults(Cli::command(), "init", &InitSettings::default());
    let command = cli::with_subcommand_defaults(command, "run", &RunSettings::default());
    let cli: Cli = cli::parse_command(command);
    match cli.command {
        Command::Init(flags) => run_init(InitSettings::load(&flags)?),
        Command::Run(flags) => {
            let settings = RunSettings::load(&flags)?;
            let telemetry = flags.telemetry.to_config("cert-authority")?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            let telemetry = {
                // The exporter's channel to the collector lives on this runtime.
                let _entered = runtime.enter();
                telemetry::init(settings.v, settings.log_format, &telemetry)?
            };
            let result = match settings.backend {
                Backend::Files => run_files(&settings),
                Backend::Kubernetes => run_kubernetes(&settings, &runtime),
            };
            runtime.block_on(telemetry.shutdown());
            result
        }
    }
}

fn run_init(settings: InitSettings) -> anyhow::Result<()> {
    let dir = settings.dir.context("--dir is required")?;
    let options = InitOptions {
        clusters: cluster_names(&settings.clusters)?,
        additional_sans: settings.additional_san,
        leaf_validity: settings.leaf_validity,
        ca_validity: settings.ca_validity,
    };
    let layout = Layout::new(&dir);
    init(&layout, &options)?;
    println!("wrote a PKI to {}:", dir.display());
    let show = |what: &str, pair: cert_authority::files::Pair| {
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

fn leaf_policy(settings: &RunSettings) -> LeafPolicy {
    LeafPolicy {
        validity: settings.leaf_validity,
        renew_fraction: 2.0 / 3.0,
    }
}

fn rollover_policy(settings: &RunSettings) -> RolloverPolicy {
    RolloverPolicy {
        ca_validity: settings.ca_validity,
        prepare_before_expiry: settings.ca_prepare_before_expiry,
        bundle_propagation: settings.bundle_propagation,
    }
}

fn run_files(settings: &RunSettings) -> anyhow::Result<()> {
    let dir = settings
        .dir
        .clone()
        .context("--dir is required with --backend files")?;
    let desired = Desired {
        outside_leaves_on_previous: 0,
        clusters: cluster_names(&settings.clusters)?,
        server_sans: cert_authority::files::server_sans(&settings.additional_san),
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

fn run_kubernetes(settings: &RunSettings, runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let mut options = KubeOptions::new(&settings.namespace);
    options.signer_secret_name = settings.signer_secret_name.clone();
    options.signer_secret_namespace = settings.signer_namespace().to_owned();
    options.additional_sans = settings.additional_san.clone();
    options.managed_proxy_configuration =
        Some(settings.managed_proxy_configuration.clone()).filter(|name| !name.is_empty());
    options.leaf_policy = leaf_policy(settings);
    options.rollover_policy = rollover_policy(settings);
    options.interval = settings.interval;
    let once = settings.once;
    let health = (settings.health_bind_address.clone(), settings.health_port);
    runtime.block_on(async move {
        let client = kubernetes::client()
            .await
            .context("no Kubernetes API to talk to (set KUBECONFIG, or run in a cluster)")?;
        tracing::info!(
            namespace = %options.namespace,
            identity = %options.identity,
            managed_proxy_configuration = options.managed_proxy_configuration.as_deref().unwrap_or("(none)"),
            "kubernetes backend starting"
        );
        if once {
            let report = kubernetes::run_once(&client, &options).await?;
            for renewed in &report.renewed {
                tracing::info!(leaf = %renewed, "certificate issued");
            }
            return Ok(());
        }
        let mut signals = Signals::install().context("installing signal handlers")?;
        let mut registry = Registry::default();
        let metrics = kubernetes::metrics::Metrics::register(&mut registry);
        let (listener, address) = net::bind("health port", &health.0, health.1).await?;
        let registry = Arc::new(registry);
        // Ready once the API answered; a standby replica (not the leader) is
        // ready too, so a rollout does not wait on leadership.
        let routes =
            admin::Routes::probes(|| Ok(())).with_metrics(move || encode_registry(&registry));
        let stop = CancellationToken::new();
        tokio::spawn(admin::serve(listener, routes, stop.clone()));
        tracing::info!(%address, "serving /healthz, /readyz and /metrics");
        let shutdown = async move {
            let signal = signals.recv().await;
            tracing::info!(signal, "stopping");
        };
        let result = kubernetes::run_with_metrics(client, options, metrics, shutdown).await;
        stop.cancel();
        result?;
        Ok(())
    })
}

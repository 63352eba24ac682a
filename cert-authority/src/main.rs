use std::path::PathBuf;

use anyhow::Context;
use cert_authority::authority::{Desired, FileStore, reconcile};
use cert_authority::files::{InitOptions, Layout, init};
use cert_authority::kubernetes::{self, KubeOptions};
use cert_authority::rotation::{LeafPolicy, RolloverPolicy};
use clap::{Parser, Subcommand};
use cluster_proxy_proto::duration::parse_go_duration;
use cluster_proxy_proto::identity::ClusterName;

#[derive(Parser)]
#[command(
    name = "cert-authority",
    version,
    about = "cluster-proxy PKI: issues every mTLS credential"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a complete PKI into a directory: CA and trust bundle, both
    /// proxy-server certificates, the proxy-client certificate and one agent
    /// certificate per cluster.
    Init {
        /// Directory to create the PKI in (must not hold a CA yet).
        #[arg(long)]
        dir: PathBuf,
        /// Managed clusters to issue agent certificates for (comma-separated).
        #[arg(long, value_delimiter = ',')]
        clusters: Vec<String>,
        /// Extra SAN for both server certificates (repeatable), as upstream's additionalSANs.
        #[arg(long = "additional-san")]
        additional_sans: Vec<String>,
        /// Validity of leaf certificates (Go duration).
        #[arg(long, default_value = "2160h")]
        leaf_validity: String,
        /// Validity of the CA (Go duration).
        #[arg(long, default_value = "43800h")]
        ca_validity: String,
    },
    /// Keep a PKI current: renew leaves at 2/3 of their life or when their
    /// SANs change, and roll the CA over ahead of its expiry without an outage.
    Run {
        /// Where the PKI lives: `files` (a directory made by `init`) or
        /// `kubernetes` (Secrets, and agent certificates through CSRs).
        #[arg(long, default_value = "files")]
        backend: String,
        /// files: the PKI directory.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// kubernetes: namespace of the hub Secrets and the leader Lease.
        #[arg(long, default_value = "open-cluster-management-addon")]
        namespace: String,
        /// kubernetes: the Secret holding the CA.
        #[arg(long, default_value = "cluster-proxy-signer")]
        signer_secret_name: String,
        /// kubernetes: its namespace (default: --namespace).
        #[arg(long)]
        signer_secret_namespace: Option<String>,
        /// Managed clusters whose agent certificates to keep current.
        #[arg(long, value_delimiter = ',')]
        clusters: Vec<String>,
        /// Extra SAN for both server certificates (repeatable).
        #[arg(long = "additional-san")]
        additional_sans: Vec<String>,
        /// How often to check (Go duration).
        #[arg(long, default_value = "1m")]
        interval: String,
        #[arg(long, default_value = "2160h")]
        leaf_validity: String,
        #[arg(long, default_value = "43800h")]
        ca_validity: String,
        /// Create the next CA this long before the current one expires.
        #[arg(long, default_value = "8760h")]
        ca_prepare_before_expiry: String,
        /// Publish the next CA in the bundle this long before signing with it.
        #[arg(long, default_value = "168h")]
        bundle_propagation: String,
        /// One pass, then exit.
        #[arg(long)]
        once: bool,
    },
}

fn duration(flag: &str, value: &str) -> anyhow::Result<std::time::Duration> {
    parse_go_duration(value).with_context(|| format!("--{flag}"))
}

fn cluster_names(names: &[String]) -> anyhow::Result<Vec<ClusterName>> {
    names
        .iter()
        .map(|c| ClusterName::new(c.trim()))
        .collect::<Result<Vec<_>, _>>()
        .context("--clusters")
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Init {
            dir,
            clusters,
            additional_sans,
            leaf_validity,
            ca_validity,
        } => {
            let options = InitOptions {
                clusters: cluster_names(&clusters)?,
                additional_sans,
                leaf_validity: duration("leaf-validity", &leaf_validity)?,
                ca_validity: duration("ca-validity", &ca_validity)?,
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
        Command::Run {
            backend,
            dir,
            namespace,
            signer_secret_name,
            signer_secret_namespace,
            clusters: names,
            additional_sans,
            interval,
            leaf_validity,
            ca_validity,
            ca_prepare_before_expiry,
            bundle_propagation,
            once,
        } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .init();
            if backend != "files" && backend != "kubernetes" {
                anyhow::bail!("--backend {backend:?}: `files` or `kubernetes`");
            }
            let desired = Desired {
                outside_leaves_on_previous: 0,
                clusters: cluster_names(&names)?,
                server_sans: cert_authority::files::server_sans(&additional_sans),
                leaf_policy: LeafPolicy {
                    validity: duration("leaf-validity", &leaf_validity)?,
                    renew_fraction: 2.0 / 3.0,
                },
                rollover_policy: RolloverPolicy {
                    ca_validity: duration("ca-validity", &ca_validity)?,
                    prepare_before_expiry: duration(
                        "ca-prepare-before-expiry",
                        &ca_prepare_before_expiry,
                    )?,
                    bundle_propagation: duration("bundle-propagation", &bundle_propagation)?,
                },
            };
            let interval = duration("interval", &interval)?;
            if backend == "kubernetes" {
                if !desired.clusters.is_empty() {
                    anyhow::bail!(
                        "--clusters is for the files backend: with --backend kubernetes agents get their certificates through CSRs"
                    );
                }
                let mut options = KubeOptions::new(&namespace);
                options.signer_secret_name = signer_secret_name;
                options.signer_secret_namespace =
                    signer_secret_namespace.unwrap_or_else(|| namespace.clone());
                options.additional_sans = additional_sans;
                options.leaf_policy = desired.leaf_policy;
                options.rollover_policy = desired.rollover_policy;
                options.interval = interval;
                return run_kubernetes(options, once);
            }
            let dir = dir.context("--dir is required with --backend files")?;
            let store = FileStore {
                layout: Layout::new(&dir),
            };
            loop {
                match reconcile(&store, &desired, time::OffsetDateTime::now_utc()) {
                    Ok(report) => {
                        for renewed in &report.renewed {
                            tracing::info!(leaf = %renewed, "certificate issued");
                        }
                    }
                    Err(e) if once => return Err(e.into()),
                    Err(e) => {
                        tracing::error!(error = %e, "reconcile failed; retrying next interval")
                    }
                }
                if once {
                    return Ok(());
                }
                std::thread::sleep(interval);
            }
        }
    }
}

fn run_kubernetes(options: KubeOptions, once: bool) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let client = kube::Client::try_default()
            .await
            .context("no Kubernetes API to talk to (set KUBECONFIG, or run in a cluster)")?;
        tracing::info!(
            namespace = %options.namespace,
            identity = %options.identity,
            "kubernetes backend starting"
        );
        if once {
            let report = kubernetes::run_once(&client, &options).await?;
            for renewed in &report.renewed {
                tracing::info!(leaf = %renewed, "certificate issued");
            }
            return Ok(());
        }
        let shutdown = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(term) => term,
                    Err(_) => return std::future::pending().await,
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        kubernetes::run(client, options, shutdown).await?;
        Ok(())
    })
}

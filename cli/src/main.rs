//! `cluster-proxy`: which managed clusters the proxy reaches, and local
//! port-forwards through the tunnel.
#![forbid(unsafe_code)]

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use cluster_proxy_cli::address::{AddressError, ForwardTarget, parse_host_port, parse_local};
use cluster_proxy_cli::forward::PortForward;
use cluster_proxy_cli::health::{self, LiveProber, OutputFormat, Replica};
use cluster_proxy_cli::hub::{self, CredentialFiles, ProxyServerError};
use cluster_proxy_proto::duration::parse_go_duration;
use cluster_proxy_runtime::logging;
use cluster_proxy_runtime::shutdown::Signals;
use cluster_proxy_runtime::workers;
use health_prober::probe::ProbeTarget;
use k8s_openapi::jiff::Timestamp;
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "cluster-proxy",
    version,
    about = "Reachability of managed clusters through cluster-proxy, and port-forwards through its tunnel"
)]
struct Cli {
    /// Log verbosity on stderr (0: warnings and errors of connections; 3: debug).
    #[arg(short = 'v', long = "v", global = true, default_value_t = 0)]
    v: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Every ManagedCluster: addon installed and available, health-prober's
    /// stored result and its age, and optionally a live probe.
    Health(HealthArgs),
    /// Listen locally; every connection goes through the tunnel to
    /// CLUSTER:PORT (the cluster's kube-apiserver host) or CLUSTER:HOST:PORT.
    PortForward(PortForwardArgs),
    /// Write a kubeconfig with one context per managed cluster, reaching it
    /// through the user-server as the hub user of the current context.
    Kubeconfig(KubeconfigArgs),
}

#[derive(Debug, Args)]
struct KubeconfigArgs {
    #[command(flatten)]
    hub: HubArgs,
    /// The user-server's URL as this machine reaches it (https://HOST:PORT).
    #[arg(long)]
    user_server: String,
    /// CA bundle (PEM) of the user-server's serving certificate.
    #[arg(long)]
    certificate_authority: PathBuf,
    /// Only these clusters (repeatable) [default: every ManagedCluster].
    #[arg(long = "cluster", value_name = "NAME")]
    clusters: Vec<String>,
    /// Where to write it (mode 0600) [default: standard output].
    #[arg(short = 'o', long = "output")]
    output: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct HubArgs {
    /// Hub kubeconfig [default: $KUBECONFIG, then ~/.kube/config].
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context [default: the current context].
    #[arg(long)]
    context: Option<String>,
}

#[derive(Debug, Args)]
struct ProxyArgs {
    /// A proxy-server client address HOST:PORT (repeat for each replica);
    /// the host is also the TLS server name.
    #[arg(long = "proxy-server", value_name = "HOST:PORT", value_parser = proxy_server_address)]
    proxy_servers: Vec<String>,
    /// CA bundle of the proxy-servers [default: the hub Secret proxy-client, ca.crt].
    #[arg(long)]
    proxy_ca_cert: Option<PathBuf>,
    /// Client certificate [default: the hub Secret proxy-client, tls.crt].
    #[arg(long)]
    proxy_cert: Option<PathBuf>,
    /// Client key [default: the hub Secret proxy-client, tls.key].
    #[arg(long)]
    proxy_key: Option<PathBuf>,
    /// The ManagedProxyConfiguration naming the proxy-server namespace and Secret.
    #[arg(long, default_value = hub::DEFAULT_MPC)]
    mpc: String,
    /// Connecting to a proxy-server, and dialing through it (Go duration).
    #[arg(long, default_value = "10s", value_parser = parse_go_duration)]
    timeout: Duration,
}

#[derive(Debug, Args)]
struct HealthArgs {
    #[command(flatten)]
    hub: HubArgs,
    #[command(flatten)]
    proxy: ProxyArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: OutputFormat,
    /// Probe every cluster now through each --proxy-server: dial, TLS, GET /healthz.
    #[arg(long)]
    probe: bool,
    /// Port of the clusters' kube-apiserver host through the tunnel.
    #[arg(long, default_value_t = 443)]
    target_port: u16,
    /// Clusters probed at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// The time ages count to (RFC 3339), for reproducible output.
    #[arg(long, hide = true)]
    now: Option<Timestamp>,
}

#[derive(Debug, Args)]
struct PortForwardArgs {
    /// CLUSTER:PORT, or CLUSTER:HOST:PORT for a host the cluster's agent serves.
    #[arg(value_parser = ForwardTarget::parse)]
    target: ForwardTarget,
    /// [LOCAL_ADDR:]LOCAL_PORT to listen on (address: 127.0.0.1; port 0: any).
    #[arg(value_parser = parse_local)]
    local: SocketAddr,
    #[command(flatten)]
    hub: HubArgs,
    #[command(flatten)]
    proxy: ProxyArgs,
    /// Threads carrying the forwarded connections (0: one per CPU). 1 runs
    /// everything on one thread, which costs less CPU per byte where the
    /// forward shares its cores with other busy processes.
    #[arg(long, default_value_t = workers::PER_CPU, value_parser = worker_threads)]
    worker_threads: u32,
    /// How long a new connection's first bytes are waited for, so they ride
    /// in the dial request and save a round trip through the tunnel (TLS,
    /// HTTP: the client speaks first). A protocol whose server speaks first
    /// (SSH) waits this long once per connection; 0s dials at once (Go
    /// duration).
    #[arg(long, default_value = "10ms", value_parser = parse_go_duration)]
    early_data_wait: Duration,
}

fn worker_threads(text: &str) -> Result<u32, String> {
    let count = text
        .parse()
        .map_err(|_| format!("{text:?} is not a thread count"))?;
    workers::check(count)?;
    Ok(count)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.v);
    let worker_threads = match &cli.command {
        Command::PortForward(args) => args.worker_threads,
        Command::Health(_) | Command::Kubeconfig(_) => workers::PER_CPU,
    };
    let runtime = match workers::build(worker_threads) {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Health(args) => health(args).await,
            Command::PortForward(args) => port_forward(args).await,
            Command::Kubeconfig(args) => kubeconfig(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // The whole chain on one line, without a backtrace: this is
            // for the person at the terminal.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn kubeconfig(args: KubeconfigArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let ca = std::fs::read_to_string(&args.certificate_authority).with_context(|| {
        format!(
            "reading --certificate-authority {}",
            args.certificate_authority.display()
        )
    })?;
    let hub_config = match &args.hub.kubeconfig {
        Some(path) => kube::config::Kubeconfig::read_from(path)
            .with_context(|| format!("reading {}", path.display()))?,
        None => kube::config::Kubeconfig::read().context("reading the hub kubeconfig")?,
    };
    let clusters = if args.clusters.is_empty() {
        let (client, url) =
            hub::client(args.hub.kubeconfig.as_deref(), args.hub.context.as_deref()).await?;
        let listed =
            kube::Api::<cluster_proxy_proto::api::cluster::v1::ManagedCluster>::all(client)
                .list(&Default::default())
                .await
                .with_context(|| format!("listing ManagedClusters on {url}"))?;
        listed
            .items
            .iter()
            .filter_map(|c| c.metadata.name.clone())
            .collect()
    } else {
        args.clusters.clone()
    };
    let config = cluster_proxy_cli::kubeconfig::for_clusters(
        &hub_config,
        args.hub.context.as_deref(),
        &args.user_server,
        &ca,
        &clusters,
    )?;
    match &args.output {
        Some(path) => {
            cluster_proxy_cli::kubeconfig::write(&config, path)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "wrote {} contexts to {}; try: kubectl --kubeconfig {} --context {} get namespaces",
                config.contexts.len(),
                path.display(),
                path.display(),
                config.contexts[0].name
            );
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            serde_json::to_writer_pretty(&mut stdout, &config)?;
            stdout.write_all(b"\n")?;
        }
    }
    Ok(())
}

async fn health(args: HealthArgs) -> anyhow::Result<()> {
    // Checked before any network access: a bad flag fails at once.
    let files = credential_files(&args.proxy);
    let given = files.complete()?;
    let (client, url) =
        hub::client(args.hub.kubeconfig.as_deref(), args.hub.context.as_deref()).await?;
    let now = args.now.unwrap_or_else(Timestamp::now);
    let mut report = health::collect(&client, &url, now).await?;
    if args.probe {
        if args.proxy.proxy_servers.is_empty() {
            return Err(no_address(Some(&client), &args.proxy.mpc).await.into());
        }
        let tls = match given {
            Some((ca, cert, key)) => hub::tls_from_files(ca, cert, key)?,
            None => hub::tls_from_hub(&client, &args.proxy.mpc).await?,
        };
        let replicas = connect_all(&args.proxy, tls).await?;
        let prober = LiveProber {
            replicas,
            target: ProbeTarget {
                port: args.target_port,
                tls: health_prober::tls::target_client(None)?,
                timeout: args.proxy.timeout,
            },
            concurrency: args.concurrency,
        };
        prober.probe_all(&mut report).await;
    }
    let text = health::render(&report, args.output)?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

async fn port_forward(args: PortForwardArgs) -> anyhow::Result<()> {
    let files = credential_files(&args.proxy);
    let given = files.complete()?;
    let hub_client = if given.is_none() || args.proxy.proxy_servers.is_empty() {
        Some(hub::client(args.hub.kubeconfig.as_deref(), args.hub.context.as_deref()).await)
    } else {
        None
    };
    let reachable_hub = hub_client
        .as_ref()
        .and_then(|result| result.as_ref().ok())
        .map(|(client, _)| client);
    let Some(address) = args.proxy.proxy_servers.first() else {
        return Err(no_address(reachable_hub, &args.proxy.mpc).await.into());
    };
    if args.proxy.proxy_servers.len() > 1 {
        bail!("port-forward takes one --proxy-server (a connection goes through one replica)");
    }
    let tls = match given {
        Some((ca, cert, key)) => hub::tls_from_files(ca, cert, key)?,
        None => {
            let (client, _) = hub_client
                .context("the hub was not read")?
                .context("reading the proxy-client credentials from the hub")?;
            hub::tls_from_hub(&client, &args.proxy.mpc).await?
        }
    };
    if !args.target.host_is_the_clusters() {
        tracing::warn!(
            host = %args.target.host,
            cluster = %args.target.cluster,
            "the proxy-server routes a dial by its host, and this host is none of the names \
             the cluster's agent registers; it is reached only if the proxy-server routes with \
             default/defaultRoute or an agent registers it"
        );
    }
    let connector = hub::connect(address, tls, args.proxy.timeout).await?;
    let forward = PortForward::bind(args.local, connector, args.target.clone())
        .await?
        .with_early_data_wait(args.early_data_wait);
    let bound = forward.local_addr()?;
    let mut signals = Signals::install().context("installing signal handlers")?;
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "Forwarding from {bound} -> {}", args.target)?;
        stdout.flush()?;
    }
    forward
        .run(async move {
            let signal = signals.recv().await;
            tracing::info!(signal, "stopping");
        })
        .await;
    Ok(())
}

/// Plain-text logs on stderr: the runtime's filter (`-v` as klog's, for
/// the workspace's crates; `RUST_LOG` replaces it) plus this CLI's own
/// crates, which the runtime's list of crates does not name.
fn init_logging(verbosity: u8) {
    let level = logging::level_for_verbosity(verbosity);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(format!(
            "{},cluster_proxy_cli={level},cluster_proxy={level}",
            logging::filter_for_verbosity(verbosity)
        ))
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .try_init();
}

fn proxy_server_address(text: &str) -> Result<String, AddressError> {
    parse_host_port(text).map(|_| text.to_owned())
}

fn credential_files(proxy: &ProxyArgs) -> CredentialFiles {
    CredentialFiles {
        ca: proxy.proxy_ca_cert.clone(),
        cert: proxy.proxy_cert.clone(),
        key: proxy.proxy_key.clone(),
    }
}

async fn no_address(client: Option<&kube::Client>, mpc: &str) -> ProxyServerError {
    // Only a hint: a slow hub must not delay the error.
    let fallback = (
        "open-cluster-management-addon".to_owned(),
        "proxy-entrypoint".to_owned(),
    );
    let (namespace, service) =
        tokio::time::timeout(Duration::from_secs(3), hub::entrypoint_hint(client, mpc))
            .await
            .unwrap_or(fallback);
    ProxyServerError::NoAddress { namespace, service }
}

/// One connector per `--proxy-server`. One that cannot be connected is
/// probed through as failing (its clusters show degraded, naming it); when
/// none can be, the command fails with each one's reason.
async fn connect_all(
    proxy: &ProxyArgs,
    tls: Arc<rustls::ClientConfig>,
) -> anyhow::Result<Vec<Replica>> {
    let mut replicas = Vec::with_capacity(proxy.proxy_servers.len());
    for address in &proxy.proxy_servers {
        let connector = hub::connect(address, tls.clone(), proxy.timeout)
            .await
            .map_err(|error| error.to_string());
        if let Err(error) = &connector {
            tracing::warn!(%error, "probing through the other proxy-servers");
        }
        replicas.push((address.clone(), connector));
    }
    if replicas.iter().all(|(_, connector)| connector.is_err()) {
        let reasons: Vec<String> = replicas
            .into_iter()
            .filter_map(|(_, connector)| connector.err())
            .collect();
        bail!("{}", reasons.join("; "));
    }
    Ok(replicas)
}

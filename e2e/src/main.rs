//! `e2e`: the local multi-cluster environment on one machine.
//!
//! * `up` — builds the workspace binaries and starts a hub (cert-authority,
//!   proxy-server replicas behind a load balancer) and managed clusters
//!   (proxy-agent and sample services each), in network namespaces when run
//!   as root; prints how to reach every cluster; Ctrl-C stops it all.
//! * `down` — removes every environment, also after a crash.
//! * `fetch` — an HTTP(S) GET through the tunnel of a running environment.
//! * `traces` — the traces the running environment's own OTLP receiver got.
//!
//! `sample`, `balance` and `probe` are the environment's own helper
//! processes.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::{Parser, Subcommand, ValueEnum};
use e2e::env::client::{Frontend, HubClient};
use e2e::env::traces::TraceExport;
use e2e::env::{EnvOptions, Environment, Isolation, IsolationChoice, Summary, registry};
use simulated_cluster::binaries::Progress;
use simulated_cluster::process::ProcessState;
use simulated_cluster::sample;

/// The id of the environment `up` starts (one at a time).
const UP_ID: &str = "up";

#[derive(Parser)]
#[command(
    name = "e2e",
    about = "cluster-proxy's local multi-cluster environment"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum IsolationArg {
    Auto,
    Netns,
    Loopback,
}

#[derive(Clone, Copy, ValueEnum)]
enum Via {
    Grpc,
    Connect,
}

#[derive(Subcommand)]
enum Command {
    /// Start a hub and managed clusters; Ctrl-C stops everything.
    Up {
        /// Number of managed clusters (cluster-a, cluster-b, …).
        #[arg(long, default_value_t = 3)]
        clusters: usize,
        /// Number of proxy-server replicas.
        #[arg(long, default_value_t = 2)]
        replicas: usize,
        /// Keep the PKI, logs and env.json here (a temporary directory,
        /// removed on exit, otherwise).
        #[arg(long)]
        state: Option<PathBuf>,
        /// How clusters are separated from the hub.
        #[arg(long, value_enum, default_value = "auto")]
        isolation: IsolationArg,
        /// Do not print the services' log lines (they are in the state
        /// directory's logs/ either way).
        #[arg(long)]
        quiet: bool,
        /// (tests) Environment id, instead of the one `up` uses.
        #[arg(long, hide = true, default_value = UP_ID)]
        id: String,
        /// (tests) Third octet of the environment's addresses.
        #[arg(long, hide = true, default_value_t = 0)]
        slot: u8,
        /// Start servers and agents by hand with a files PKI, without the
        /// control plane (addon-manager, OCM objects).
        #[arg(long = "static")]
        static_mode: bool,
        /// Send every service's traces to this OTLP/gRPC collector (e.g. a
        /// Jaeger all-in-one's http://127.0.0.1:4317); without it the
        /// environment runs a receiver of its own and writes the spans to
        /// traces.jsonl in the state directory (see `e2e traces`).
        #[arg(long)]
        otlp_endpoint: Option<String>,
        /// Export no traces at all.
        #[arg(long, conflicts_with = "otlp_endpoint")]
        no_traces: bool,
    },
    /// Print a trace the running environment received as a tree; without
    /// TRACE_ID, list the latest traces.
    Traces {
        trace_id: Option<String>,
        /// The environment's state directory (default: the one `up` runs).
        #[arg(long)]
        state: Option<PathBuf>,
        /// How many traces to list.
        #[arg(long, default_value_t = 20)]
        last: usize,
    },
    /// Add a managed cluster to the running environment: creates its
    /// ManagedCluster (accepted); the control plane installs the agent.
    Join {
        name: String,
        /// The environment's state directory (default: the one `up` runs).
        #[arg(long)]
        state: Option<PathBuf>,
    },
    /// Remove a managed cluster from the running environment (deletes its
    /// ManagedCluster; its agent and hub objects go).
    Leave {
        name: String,
        #[arg(long)]
        state: Option<PathBuf>,
    },
    /// The cluster-proxy addon status of every managed cluster.
    Status {
        #[arg(long)]
        state: Option<PathBuf>,
    },
    /// Stop every environment and remove its processes, network namespaces
    /// and veths (also after a crash).
    Down {
        /// (tests) Only this environment.
        #[arg(long, hide = true)]
        id: Option<String>,
    },
    /// GET a URL inside a managed cluster through the tunnel of the running
    /// environment, e.g. `http://cluster-a:8080/`.
    Fetch {
        url: String,
        /// The environment's state directory (default: the one `up` runs).
        #[arg(long)]
        state: Option<PathBuf>,
        #[arg(long, value_enum, default_value = "grpc")]
        via: Via,
        /// Which proxy-server replica to go through.
        #[arg(long, default_value_t = 0)]
        server: usize,
        /// CA for an https URL (default: the cluster's stand-in apiserver CA).
        #[arg(long)]
        cacert: Option<PathBuf>,
    },
    /// (internal) A managed cluster's sample services.
    #[command(hide = true)]
    Sample {
        #[arg(long)]
        cluster: String,
        #[arg(long)]
        ip: IpAddr,
        /// The stand-in kube-apiserver's certificate and key; without them
        /// there is no stand-in (the environment runs the cluster's API).
        #[arg(long, requires = "key")]
        cert: Option<PathBuf>,
        #[arg(long, requires = "cert")]
        key: Option<PathBuf>,
    },
    /// (internal) The load balancer in front of the replicas' agent ports.
    #[command(hide = true)]
    Balance {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long = "backend", required = true)]
        backends: Vec<SocketAddr>,
        #[arg(long, value_enum, default_value_t)]
        selection: simulated_cluster::balancer::Selection,
    },
    /// (internal) Exit 0 if a TCP connection to ADDR succeeds.
    #[command(hide = true)]
    Probe {
        addr: SocketAddr,
        #[arg(long, default_value = "2s")]
        timeout: String,
    },
}

fn init_logging() {
    cluster_proxy_runtime::logging::init(0, cluster_proxy_runtime::logging::LogFormat::Auto);
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Up {
            clusters,
            replicas,
            state,
            isolation,
            quiet,
            id,
            slot,
            static_mode,
            otlp_endpoint,
            no_traces,
        } => {
            let traces = match (otlp_endpoint, no_traces) {
                (_, true) => TraceExport::Off,
                (Some(endpoint), false) => {
                    // The same check the services make, before starting anything.
                    cluster_proxy_runtime::telemetry::TelemetryFlags {
                        otlp_endpoint: Some(endpoint.clone()),
                        ..Default::default()
                    }
                    .to_config("e2e")?;
                    TraceExport::Collector(endpoint)
                }
                (None, false) => TraceExport::Receiver,
            };
            up(
                clusters,
                replicas,
                state,
                isolation,
                quiet,
                id,
                slot,
                static_mode,
                traces,
            )
            .await
        }
        Command::Traces {
            trace_id,
            state,
            last,
        } => print_traces(trace_id, state, last),
        Command::Join { name, state } => {
            cluster_proxy_proto::identity::ClusterName::new(name.as_str())
                .map_err(|e| anyhow!("{name:?} cannot be a managed cluster name: {e}"))?;
            let client = admin_client(state).await?;
            e2e::env::control_plane::join(&client, &name).await?;
            println!("ManagedCluster {name} created; `cargo run -p e2e -- status` shows it join");
            Ok(())
        }
        Command::Leave { name, state } => {
            let client = admin_client(state).await?;
            e2e::env::control_plane::leave(&client, &name).await?;
            println!("ManagedCluster {name} deleted; its agent and hub objects go");
            Ok(())
        }
        Command::Status { state } => {
            let client = admin_client(state).await?;
            print_addon_status(&e2e::env::control_plane::addon_status(&client).await?);
            Ok(())
        }
        Command::Down { id } => {
            let done = match id {
                Some(id) => registry::find(&id)
                    .map(|record| registry::clean(&record))
                    .unwrap_or_default(),
                None => registry::clean_all(Duration::from_secs(10)),
            };
            if done.is_empty() {
                println!("nothing to clean up");
            }
            for line in done {
                println!("{line}");
            }
            Ok(())
        }
        Command::Fetch {
            url,
            state,
            via,
            server,
            cacert,
        } => fetch(&url, state, via, server, cacert).await,
        Command::Sample {
            cluster,
            ip,
            cert,
            key,
        } => {
            init_logging();
            let read =
                |p: &PathBuf| std::fs::read_to_string(p).with_context(|| p.display().to_string());
            let tls = match (cert, key) {
                (Some(cert), Some(key)) => Some(sample::tls_acceptor(
                    &read(&cert)?,
                    &read(&key)?,
                    &[b"http/1.1"],
                )?),
                _ => None,
            };
            sample::serve(cluster, ip, tls).await?;
            Ok(())
        }
        Command::Balance {
            listen,
            backends,
            selection,
        } => {
            init_logging();
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding {listen}"))?;
            tracing::info!(%listen, ?backends, %selection, "balancing agent connections");
            simulated_cluster::balancer::serve(listener, backends, selection).await?;
            Ok(())
        }
        Command::Probe { addr, timeout } => {
            let timeout = cluster_proxy_proto::duration::parse_go_duration(&timeout)
                .map_err(|e| anyhow!("--timeout: {e}"))?;
            match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
                Ok(Ok(_)) => {
                    println!("connected to {addr}");
                    Ok(())
                }
                Ok(Err(err)) => {
                    println!("cannot connect to {addr}: {err}");
                    std::process::exit(1)
                }
                Err(_) => {
                    println!("cannot connect to {addr}: timed out after {timeout:?}");
                    std::process::exit(1)
                }
            }
        }
    }
}

/// The collector the environment's services export to, when it is not the
/// environment's own receiver.
fn options_traces_endpoint(env: &Environment) -> Option<String> {
    env.logs.trace_endpoint().map(str::to_owned)
}

/// `e2e traces`: reads the span file of the running environment's receiver.
fn print_traces(
    trace_id: Option<String>,
    state: Option<PathBuf>,
    last: usize,
) -> anyhow::Result<()> {
    let state = match state {
        Some(dir) => dir,
        None => registry::find(UP_ID).map(|r| r.state_dir).ok_or_else(|| {
            anyhow!("no environment is running (start one with `cargo run -p e2e -- up`)")
        })?,
    };
    let file = state.join(e2e::env::traces::SPAN_FILE);
    let spans = simulated_cluster::otlp::read_span_file(&file).with_context(|| {
        format!(
            "reading {} (does the environment run its own trace receiver?)",
            file.display()
        )
    })?;
    match trace_id {
        Some(id) => {
            let id = id.trim().to_ascii_lowercase();
            let tree = simulated_cluster::otlp::render_trace(&spans, &id);
            if tree.is_empty() {
                bail!("no span of trace {id} in {}", file.display());
            }
            print!("{tree}");
        }
        None => {
            println!("{:<34} {:>6}  ROOT SPAN", "TRACE ID", "SPANS");
            for (id, root, count) in simulated_cluster::otlp::list_traces(&spans)
                .into_iter()
                .take(last)
            {
                println!("{id:<34} {count:>6}  {root}");
            }
        }
    }
    Ok(())
}

/// The running environment's admin client, from its env.json.
async fn admin_client(state: Option<PathBuf>) -> anyhow::Result<kube::Client> {
    let state = match state {
        Some(dir) => dir,
        None => registry::find(UP_ID).map(|r| r.state_dir).ok_or_else(|| {
            anyhow!("no environment is running (start one with `cargo run -p e2e -- up`)")
        })?,
    };
    let summary = Summary::load(&state)?;
    let kubeconfig = summary
        .kubeconfig
        .ok_or_else(|| anyhow!("that environment runs no Kubernetes API"))?;
    Ok(memory_apiserver::KubeApi::client_from(&kubeconfig).await?)
}

fn print_addon_status(rows: &[e2e::env::control_plane::ClusterRow]) {
    println!(
        "{:<16} {:<44} {:<24} OTHER CONDITIONS",
        "CLUSTER", "ADDON AVAILABLE", "PROBE (health-prober)"
    );
    for row in rows {
        println!(
            "{:<16} {:<44} {:<24} {}",
            row.name,
            row.available,
            row.probe,
            row.conditions.join(" ")
        );
    }
}

#[allow(clippy::too_many_arguments)]
async fn up(
    clusters: usize,
    replicas: usize,
    state: Option<PathBuf>,
    isolation: IsolationArg,
    quiet: bool,
    id: String,
    slot: u8,
    static_mode: bool,
    traces: TraceExport,
) -> anyhow::Result<()> {
    if clusters == 0 || clusters > 200 {
        bail!("--clusters must be between 1 and 200");
    }
    if replicas == 0 || replicas > 9 {
        bail!("--replicas must be between 1 and 9");
    }
    // Listening from here on: Ctrl-C while `up` is busy (starting, or
    // between status refreshes) must still stop it.
    let mut shutdown = ShutdownSignal::new().context("listening for Ctrl-C and SIGTERM")?;
    for line in registry::clean_orphans() {
        println!("cleanup of a previous run: {line}");
    }
    let mut options = EnvOptions::new(clusters);
    options.replicas = replicas;
    options.state_dir = state;
    options.isolation = match isolation {
        IsolationArg::Auto => IsolationChoice::Auto,
        IsolationArg::Netns => IsolationChoice::Netns,
        IsolationArg::Loopback => IsolationChoice::Loopback,
    };
    options.echo_logs = !quiet;
    options.progress = Progress::Show;
    options.id = Some(id);
    options.slot = Some(slot);
    options.control_plane = !static_mode;
    options.traces = traces;
    let names = options.clusters.clone();
    println!("building the workspace binaries (cargo build)…");
    let mut env = Environment::start(options).await?;
    match &env.summary.isolation {
        Isolation::Netns => println!(
            "each managed cluster runs in its own network namespace; the hub reaches them only through the tunnel"
        ),
        Isolation::Loopback(reason) => println!(
            "NOTE: no network isolation ({reason}); every component runs on loopback addresses 127.18.0.x"
        ),
    }
    let ready = if static_mode {
        println!("waiting for every agent to connect to every proxy-server replica…");
        None
    } else {
        println!(
            "the control plane installs cluster-proxy: addon-manager deploys the proxy-servers, \
             each cluster's agent comes through its ManifestWork and reports Available…"
        );
        Some(())
    };
    let wait = async {
        match ready {
            None => env.wait_ready(Duration::from_secs(60)).await,
            Some(()) => {
                env.wait_clusters_ready(&names, replicas, Duration::from_secs(120))
                    .await
            }
        }
    };
    let ready = tokio::select! {
        ready = wait => ready,
        _ = shutdown.recv() => {
            env.shutdown().await;
            println!("stopped before it was ready; nothing left running");
            return Ok(());
        }
    };
    match ready {
        Ok(after) => println!("ready after {:.1}s", after.as_secs_f64()),
        Err(err) => {
            print_table(&mut env);
            env.shutdown().await;
            return Err(err.into());
        }
    }
    let admin = if static_mode {
        print_table(&mut env);
        None
    } else {
        env.refresh_cluster_summaries().await?;
        let admin = env.admin_client().await?;
        print_addon_status(&e2e::env::control_plane::addon_status(&admin).await?);
        Some(admin)
    };
    if admin.is_some() {
        println!(
            "\nAdd or remove a managed cluster while this runs: `cargo run -p e2e -- join cluster-x`, \
             `cargo run -p e2e -- leave cluster-x`, `cargo run -p e2e -- status`"
        );
    }
    match (&env.traces, &options_traces_endpoint(&env)) {
        (Some(receiver), _) => println!(
            "\nTraces: every service exports to this environment's receiver at {}; spans are \
             written to {} — `cargo run -p e2e -- traces` lists them, `… traces TRACE_ID` prints one",
            receiver.endpoint,
            receiver.file.display()
        ),
        (None, Some(endpoint)) => println!("\nTraces: every service exports to {endpoint}"),
        (None, None) => {}
    }
    print_commands(&env.summary);
    let mut last_rows = Vec::new();

    let mut interval = tokio::time::interval(Duration::from_secs(1));
    let mut reported = std::collections::HashSet::new();
    loop {
        tokio::select! {
            _ = shutdown.recv() => break,
            _ = interval.tick() => {
                if let Some(admin) = &admin
                    && let Ok(rows) = e2e::env::control_plane::addon_status(admin).await
                    && rows != last_rows
                {
                    for row in &rows {
                        if !last_rows.contains(row) {
                            println!(
                                "{}: addon Available {}; probe {}",
                                row.name, row.available, row.probe
                            );
                        }
                    }
                    for row in &last_rows {
                        if !rows.iter().any(|r| r.name == row.name) {
                            println!("{}: left", row.name);
                        }
                    }
                    last_rows = rows;
                    let _ = env.refresh_cluster_summaries().await;
                }
                // Clusters and replicas come and go with the control plane:
                // keep the record `e2e down` cleans up after a crash current.
                env.processes_changed();
                for (name, state) in states(&mut env) {
                    if let ProcessState::Exited(status) = state
                        && reported.insert(name.clone())
                    {
                        println!("!! {name} exited ({status}); its log: {}", env.logs.path_of(&name).display());
                    }
                }
            }
        }
    }
    println!("stopping…");
    let state_dir = env.summary.state_dir.clone();
    let temporary = env.summary.state_dir.starts_with(std::env::temp_dir());
    env.shutdown().await;
    if temporary {
        println!("stopped; every process, namespace and temporary file is gone");
    } else {
        println!(
            "stopped; every process and namespace is gone (PKI and logs kept in {})",
            state_dir.display()
        );
    }
    Ok(())
}

/// Ctrl-C (SIGINT) and SIGTERM, listened for from creation until dropped.
/// A listener created afresh for each wait would miss a signal that arrives
/// while the caller is busy between waits, and once any listener exists the
/// signal no longer ends the process: `up` would run on after Ctrl-C.
struct ShutdownSignal {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(ShutdownSignal {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Waits for the next signal; cancel-safe, so it can sit in a `select!`
    /// loop without losing one.
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

fn states(env: &mut Environment) -> Vec<(String, ProcessState)> {
    let mut states = vec![
        (
            env.cert_authority.name().to_string(),
            env.cert_authority.state(),
        ),
        (env.balancer.name().to_string(), env.balancer.state()),
    ];
    if let Some(ca) = env.control_plane_ca.as_mut() {
        states.push((ca.name().to_string(), ca.state()));
    }
    if let Some(manager) = env.addon_manager.as_mut() {
        states.push((manager.name().to_string(), manager.state()));
    }
    for replica in &mut env.replicas {
        states.push((replica.name.clone(), replica.process.state()));
    }
    for cluster in &mut env.clusters {
        states.push((cluster.agent.name().to_string(), cluster.agent.state()));
        states.push((
            cluster.services.name().to_string(),
            cluster.services.state(),
        ));
    }
    states
}

fn print_table(env: &mut Environment) {
    let hub = env.summary.hub_addr;
    let mut rows: Vec<(String, String, String)> = Vec::new();
    let pki = env.summary.pki_dir.display().to_string();
    rows.push((
        env.cert_authority.name().into(),
        format!("files backend: {pki}"),
        env.cert_authority.state().to_string(),
    ));
    if let Some(addr) = env.summary.kube_api {
        rows.push((
            "kube-api".into(),
            format!("https://{addr} (in-memory test double)"),
            "serving (in this process)".into(),
        ));
    }
    if let Some(ca) = env.control_plane_ca.as_mut() {
        rows.push((
            ca.name().into(),
            "Secrets + CSR signer in namespace open-cluster-management-addon".into(),
            ca.state().to_string(),
        ));
    }
    let backends: Vec<String> = env
        .replicas
        .iter()
        .map(|r| r.ports.agent.to_string())
        .collect();
    rows.push((
        env.balancer.name().into(),
        format!(
            "{} → {hub}:{}",
            env.summary.agent_service_addr,
            backends.join(", :")
        ),
        env.balancer.state().to_string(),
    ));
    for replica in &mut env.replicas {
        let p = replica.ports;
        rows.push((
            replica.name.clone(),
            format!(
                "client {hub}:{}  agent :{}  health :{}",
                p.client, p.agent, p.health
            ),
            replica.process.state().to_string(),
        ));
    }
    for cluster in &mut env.clusters {
        let network = cluster
            .netns
            .as_ref()
            .map(|ns| format!("netns {ns}, "))
            .unwrap_or_default();
        rows.push((
            cluster.agent.name().into(),
            format!("{network}→ {}", env.summary.agent_service_addr),
            cluster.agent.state().to_string(),
        ));
        rows.push((
            cluster.services.name().into(),
            format!(
                "{}: http :{} https :{} echo :{}",
                cluster.service_ip,
                sample::HTTP_PORT,
                sample::APISERVER_PORT,
                sample::ECHO_PORT
            ),
            cluster.services.state().to_string(),
        ));
    }
    let width = |f: fn(&(String, String, String)) -> usize| rows.iter().map(f).max().unwrap_or(0);
    let (w0, w1) = (width(|r| r.0.len()), width(|r| r.1.chars().count()));
    println!();
    println!("{:w0$}  {:w1$}  STATE", "COMPONENT", "ADDRESS");
    for (component, address, state) in &rows {
        println!("{component:w0$}  {address:w1$}  {state}");
    }
    println!();
    println!(
        "state directory: {}  (logs in logs/, PKI in pki/)",
        env.summary.state_dir.display()
    );
    if let Some(kubeconfig) = &env.summary.kubeconfig {
        println!(
            "Kubernetes API for the control plane: export KUBECONFIG={}",
            kubeconfig.display()
        );
    }
}

fn print_commands(summary: &Summary) {
    let Some(first) = summary.clusters.first() else {
        return;
    };
    let p = summary.pki_dir.display();
    let server = summary
        .client_addr(0)
        .map(|a| a.to_string())
        .unwrap_or_default();
    let name = &first.name;
    println!(
        "\nReach {name}'s services by cluster name through the tunnel (any other cluster works the same way):\n"
    );
    println!("  # HTTP CONNECT with curl");
    println!(
        "  curl -p -x https://{server} --proxy-cacert {p}/ca-bundle.crt \\\n    --proxy-cert {p}/proxy-client/tls.crt --proxy-key {p}/proxy-client/tls.key \\\n    http://{name}:{}/",
        sample::HTTP_PORT
    );
    println!("  # the cluster's kube-apiserver, TLS end to end with the cluster's own CA");
    println!(
        "  curl -p -x https://{server} --proxy-cacert {p}/ca-bundle.crt \\\n    --proxy-cert {p}/proxy-client/tls.crt --proxy-key {p}/proxy-client/tls.key \\\n    --cacert {} https://{name}:{}/healthz",
        first.apiserver_ca.display(),
        sample::APISERVER_PORT
    );
    println!("  # the gRPC route (konnectivity ProxyService), through replica 1");
    println!(
        "  cargo run -q -p e2e -- fetch --via grpc --server 1 http://{name}:{}/",
        sample::HTTP_PORT
    );
    if let (Some(hub_ns), Some(_)) = (&summary.hub_netns, &first.netns) {
        println!("  # and the same service is NOT reachable from the hub directly:");
        println!(
            "  ip netns exec {hub_ns} curl -sS --max-time 2 http://{}:{}/",
            first.service_ip,
            sample::HTTP_PORT
        );
    }
    if let (Some(user_server), Some(hub)) = (summary.user_server, &summary.kubeconfig) {
        let kubeconfig = summary.state_dir.join("clusters.kubeconfig");
        println!(
            "\nkubectl to every cluster through the hub's user-server, as the hub administrator \
             (the hub's RBAC and each cluster's decide; each cluster grants it cluster-admin):\n"
        );
        println!(
            "  cargo run -q -p cluster-proxy-cli -- kubeconfig --kubeconfig {} \\\n    --user-server https://{user_server} --certificate-authority {p}/ca-bundle.crt -o {}",
            hub.display(),
            kubeconfig.display()
        );
        println!(
            "  kubectl --kubeconfig {} --context {name} get pods -A",
            kubeconfig.display()
        );
    }
    println!("\nCtrl-C stops everything.\n");
}

async fn fetch(
    url: &str,
    state: Option<PathBuf>,
    via: Via,
    server: usize,
    cacert: Option<PathBuf>,
) -> anyhow::Result<()> {
    let state = match state {
        Some(dir) => dir,
        None => {
            registry::find(UP_ID)
                .context("no environment is running (start one with `cargo run -p e2e -- up`, or pass --state)")?
                .state_dir
        }
    };
    let summary = Summary::load(&state)?;
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| anyhow!("{url:?} is not a URL (http://cluster:port/path)"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let default_port = match scheme {
        "http" => 80,
        "https" => 443,
        other => bail!("unsupported scheme {other:?}: http or https"),
    };
    let target = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:{default_port}")
    };
    let host = target.rsplit_once(':').map_or(target.as_str(), |(h, _)| h);
    let server_addr = summary
        .client_addr(server)
        .ok_or_else(|| anyhow!("the environment has no proxy-server replica {server}"))?;
    let frontend = match via {
        Via::Grpc => Frontend::Grpc,
        Via::Connect => Frontend::HttpConnect,
    };
    let client = HubClient::from_pki_dir(&summary.pki_dir)?;
    let body = if scheme == "https" {
        let ca_path = match cacert {
            Some(path) => path,
            None => summary
                .clusters
                .iter()
                .find(|c| c.name == host)
                .map(|c| c.apiserver_ca.clone())
                .or_else(|| {
                    // With the control plane, clusters join at any time.
                    let ca = e2e::env::control_plane::cluster_dir(&summary.state_dir, host)
                        .join("ca.crt");
                    ca.is_file().then_some(ca)
                })
                .ok_or_else(|| {
                    anyhow!("no --cacert given and {host:?} is no cluster of the environment")
                })?,
        };
        let ca =
            std::fs::read_to_string(&ca_path).with_context(|| ca_path.display().to_string())?;
        client
            .https_get(frontend, server_addr, &target, path, &ca)
            .await?
    } else {
        client
            .http_get(frontend, server_addr, &target, path)
            .await?
    };
    print!("{body}");
    if !body.ends_with('\n') {
        println!();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::ShutdownSignal;
    use std::time::Duration;

    /// Regression: `up` used to create its Ctrl-C listener afresh for each
    /// wait, so a signal that arrived while it refreshed the status table
    /// was lost and `up` ran on (a flaky `up_command` test under load).
    #[tokio::test]
    async fn a_signal_that_arrives_while_nothing_waits_is_kept() {
        let mut shutdown = ShutdownSignal::new().expect("signal listeners");
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).expect("raise");
        tokio::time::timeout(Duration::from_secs(10), shutdown.recv())
            .await
            .expect("the signal raised before the wait is received");
    }
}

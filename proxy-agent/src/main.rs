#![forbid(unsafe_code)]
use anyhow::Context;
use cluster_proxy_runtime::{cli, shutdown::Signals, telemetry, workers};
use proxy_agent::{AgentSettings, Cli};

fn main() -> anyhow::Result<()> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if service_proxy::process::is_requested(&args) {
        // `proxy-agent service-proxy <flags>`: the service-proxy's own
        // flags, as if its binary were run.
        return Ok(service_proxy::process::run(args.into_iter().skip(1))?);
    }
    let cli: Cli = cli::parse(&AgentSettings::default());
    let settings = AgentSettings::load(&cli)?;
    workers::build(settings.worker_threads)
        .context("starting the runtime (--worker-threads)")?
        .block_on(run(cli, settings))
}

async fn run(cli: Cli, settings: AgentSettings) -> anyhow::Result<()> {
    let telemetry = telemetry::init(
        settings.v,
        settings.log_format,
        &cli.telemetry.to_config("proxy-agent")?,
    )?;
    for flag in settings
        .ignored_settings()
        .into_iter()
        .chain(cli.logging.ignored())
    {
        tracing::warn!(flag, "flag is accepted for compatibility but has no effect");
    }
    if cli.lease_label.is_some() {
        tracing::warn!("--lease-label is deprecated: use --lease-label-selector");
    }
    for warning in settings.warnings() {
        tracing::warn!("{warning}");
    }
    let config = settings.to_agent_config()?;
    let mut signals = Signals::install().context("installing signal handlers")?;
    let agent = proxy_agent::start(config)
        .await
        .context("starting proxy-agent")?;
    let signal = signals.recv().await;
    tracing::info!(signal, "draining");
    // Like upstream: the first signal drains, a second one stops at once.
    tokio::select! {
        _ = agent.shutdown() => {}
        signal = signals.recv() => tracing::warn!(signal, "second signal; exiting now"),
    }
    telemetry.shutdown().await;
    Ok(())
}

#![forbid(unsafe_code)]
use anyhow::Context;
use cluster_proxy_runtime::{cli, shutdown::Signals, telemetry, workers};
use proxy_server::config::{Cli, ServerConfig};

fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&ServerConfig::default());
    let config = ServerConfig::load(&cli)?;
    workers::build(config.worker_threads)
        .context("starting the runtime (--worker-threads)")?
        .block_on(run(cli, config))
}

async fn run(cli: Cli, config: ServerConfig) -> anyhow::Result<()> {
    let telemetry = telemetry::init(
        config.v,
        config.log_format,
        &cli.telemetry.to_config("proxy-server")?,
    )?;
    for flag in config
        .ignored_settings()
        .into_iter()
        .chain(cli.logging.ignored())
    {
        tracing::warn!(flag, "flag is accepted for compatibility but has no effect");
    }
    let mut signals = Signals::install().context("installing signal handlers")?;
    let server = proxy_server::start(config)
        .await
        .context("starting proxy-server")?;
    let signal = signals.recv().await;
    tracing::info!(signal, "shutting down");
    server.shutdown().await;
    telemetry.shutdown().await;
    Ok(())
}

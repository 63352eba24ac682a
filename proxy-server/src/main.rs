use anyhow::Context;
use cluster_proxy_runtime::{cli, logging, shutdown::Signals};
use proxy_server::config::{Cli, ServerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&ServerConfig::default());
    let config = ServerConfig::load(&cli)?;
    logging::init(config.v, config.log_format);
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
    Ok(())
}

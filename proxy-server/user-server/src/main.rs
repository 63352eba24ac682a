#![forbid(unsafe_code)]
use anyhow::Context;
use cluster_proxy_runtime::{cli, logging, shutdown::Signals};
use user_server::{Cli, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&Settings::default());
    let settings = Settings::load(&cli)?;
    logging::init(settings.v, settings.log_format);
    let config = settings.resolve()?;
    let hub = user_server::hub_client(config.hub_kubeconfig.as_deref())
        .await
        .context(
            "no hub API to talk to (set --hub-kubeconfig or KUBECONFIG, or run in a cluster)",
        )?;
    let mut signals = Signals::install().context("installing signal handlers")?;
    let running = user_server::start(config, hub)
        .await
        .context("starting user-server")?;
    let signal = signals.recv().await;
    tracing::info!(signal, "stopping");
    running.shutdown().await;
    Ok(())
}

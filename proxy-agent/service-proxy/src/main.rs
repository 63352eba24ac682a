#![forbid(unsafe_code)]
use anyhow::Context;
use cluster_proxy_runtime::{cli, logging, shutdown::Signals};
use service_proxy::{Cli, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&Settings::default());
    let settings = Settings::load(&cli)?;
    logging::init(settings.v, settings.log_format);
    let kubernetes_service = std::env::var("KUBERNETES_SERVICE_HOST")
        .ok()
        .zip(std::env::var("KUBERNETES_SERVICE_PORT").ok());
    let config = settings.resolve(kubernetes_service)?;
    let mut signals = Signals::install().context("installing signal handlers")?;
    let running = service_proxy::start(config)
        .await
        .context("starting service-proxy")?;
    let signal = signals.recv().await;
    tracing::info!(signal, "stopping");
    running.shutdown().await;
    Ok(())
}

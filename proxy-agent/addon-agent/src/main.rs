#![forbid(unsafe_code)]
use addon_agent::{AgentSettings, Cli, PodEnvironment};
use anyhow::Context;
use cluster_proxy_runtime::{cli, logging, shutdown::Signals};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&AgentSettings::default());
    let settings = AgentSettings::load(&cli)?;
    logging::init(settings.v, settings.log_format);
    for flag in settings
        .ignored_settings()
        .into_iter()
        .chain(cli.logging.ignored())
    {
        tracing::warn!(
            flag,
            "flag is accepted but has no effect with the others given"
        );
    }
    let config = settings.resolve(&PodEnvironment::from_vars(std::env::vars()))?;
    let mut signals = Signals::install().context("installing signal handlers")?;
    let agent = addon_agent::start(config)
        .await
        .context("starting addon-agent")?;
    let signal = signals.recv().await;
    tracing::info!(signal, "stopping");
    agent.shutdown().await;
    Ok(())
}

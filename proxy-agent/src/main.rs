use anyhow::Context;
use cluster_proxy_runtime::{cli, logging, shutdown::Signals};
use proxy_agent::{AgentSettings, Cli};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = cli::parse(&AgentSettings::default());
    let settings = AgentSettings::load(&cli)?;
    logging::init(settings.v, settings.log_format);
    for flag in settings.ignored_settings() {
        tracing::warn!(flag, "flag is accepted for compatibility but has no effect");
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
    Ok(())
}

use anyhow::Context;
use clap::Parser;
use proxy_agent::{AgentSettings, Cli};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

fn init_logging(verbosity: u8) {
    let default = match verbosity {
        0..=1 => "info",
        2..=3 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .init();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = AgentSettings::load(&cli)?;
    init_logging(settings.v);
    for flag in settings.ignored_settings() {
        tracing::warn!(flag, "flag is accepted for compatibility but has no effect");
    }
    let config = settings.to_agent_config()?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let agent = proxy_agent::start(config)
        .await
        .context("starting proxy-agent")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; draining"),
        _ = int.recv() => tracing::info!("interrupt received; draining"),
    }
    // Like upstream: the first signal drains, a second one stops at once.
    tokio::select! {
        _ = agent.shutdown() => {}
        _ = term.recv() => tracing::warn!("second signal; exiting now"),
        _ = int.recv() => tracing::warn!("second signal; exiting now"),
    }
    Ok(())
}

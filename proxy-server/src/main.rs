use anyhow::Context;
use clap::Parser;
use proxy_server::config::{Cli, ServerConfig};
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
    let config = ServerConfig::load(&cli)?;
    init_logging(config.v);
    let server = proxy_server::start(config)
        .await
        .context("starting proxy-server")?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt received; shutting down"),
    }
    server.shutdown().await;
    Ok(())
}

//! The service-proxy as a process: what its own binary runs, and what the
//! proxy-agent binary runs as `proxy-agent service-proxy …` (the agent
//! image ships one binary for both, as upstream's `/cluster-proxy
//! service-proxy`; a second copy of TLS and HTTP would cost the image
//! 7.5 MB).

use std::ffi::OsString;

use cluster_proxy_runtime::config::ConfigError;
use cluster_proxy_runtime::shell::{self, ShellError};

use crate::{ServiceProxySettings, StartError};

/// The subcommand under which the proxy-agent binary runs the service-proxy.
pub use cluster_proxy_proto::service_access::SERVICE_PROXY_SUBCOMMAND as SUBCOMMAND;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Shell(#[from] ShellError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("starting service-proxy: {0}")]
    Start(#[from] StartError),
}

/// Parses `args` (the first is the program name; `--help` and bad flags
/// exit as clap does), then serves until SIGTERM or SIGINT.
pub fn run<I, T>(args: I) -> Result<(), ProcessError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    shell::run_from(args, |settings: ServiceProxySettings, signals| async move {
        let kubernetes_service = std::env::var("KUBERNETES_SERVICE_HOST")
            .ok()
            .zip(std::env::var("KUBERNETES_SERVICE_PORT").ok());
        let running = crate::start(settings.resolve(kubernetes_service)?).await?;
        shell::stop_on_signal(signals, running.shutdown()).await;
        Ok(())
    })
}

/// Whether the proxy-agent binary was asked to be the service-proxy:
/// `args` is the process's, program name first.
pub fn is_requested(args: &[OsString]) -> bool {
    args.get(1).is_some_and(|arg| arg == SUBCOMMAND)
}

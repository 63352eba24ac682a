//! `proxy-server`: the konnectivity server ([`proxy_server::start`]).
#![forbid(unsafe_code)]

use anyhow::Context;
use cluster_proxy_runtime::shell;
use proxy_server::settings::ProxyServerSettings;

fn main() -> anyhow::Result<()> {
    shell::run(|settings: ProxyServerSettings, signals| async move {
        // Each agent tunnel and each HTTP CONNECT connection holds a
        // descriptor: the soft open-file limit goes up to the hard one, as
        // Go's runtime raises it for upstream's server.
        let (soft, hard) = cluster_proxy_runtime::accept::raise_open_file_limit();
        tracing::info!(
            open_file_limit = soft.map_or_else(|| "unlimited".into(), |n| n.to_string()),
            hard_limit = hard.map_or_else(|| "unlimited".into(), |n| n.to_string()),
            "descriptors: one per agent tunnel and per HTTP CONNECT connection"
        );
        let server = proxy_server::start(settings)
            .await
            .context("starting proxy-server")?;
        shell::stop_on_signal(signals, server.shutdown()).await;
        Ok(())
    })
}

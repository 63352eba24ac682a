//! `proxy-server`: the konnectivity server ([`proxy_server::start`]).
#![forbid(unsafe_code)]

use anyhow::Context;
use cluster_proxy_runtime::shell;
use proxy_server::settings::ProxyServerSettings;

fn main() -> anyhow::Result<()> {
    shell::run(|settings: ProxyServerSettings, signals| async move {
        let server = proxy_server::start(settings)
            .await
            .context("starting proxy-server")?;
        shell::stop_on_signal(signals, server.shutdown()).await;
        Ok(())
    })
}

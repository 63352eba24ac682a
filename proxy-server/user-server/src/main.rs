//! `user-server`: service access from the hub ([`user_server::start`]).
#![forbid(unsafe_code)]

use anyhow::Context;
use cluster_proxy_runtime::shell;
use user_server::UserServerSettings;

fn main() -> anyhow::Result<()> {
    shell::run(|settings: UserServerSettings, signals| async move {
        let config = settings.resolve()?;
        let hub = user_server::hub_client(config.hub_kubeconfig.as_deref())
            .await
            .context(
                "no hub API to talk to (set --hub-kubeconfig or KUBECONFIG, or run in a cluster)",
            )?;
        let running = user_server::start(config, hub)
            .await
            .context("starting user-server")?;
        shell::stop_on_signal(signals, running.shutdown()).await;
        Ok(())
    })
}

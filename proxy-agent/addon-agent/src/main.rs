//! `addon-agent`: renews the addon Lease while the proxy-agent holds a
//! tunnel ([`addon_agent::start`]).
#![forbid(unsafe_code)]

use addon_agent::{AddonAgentSettings, PodEnvironment};
use anyhow::Context;
use cluster_proxy_runtime::shell;

fn main() -> anyhow::Result<()> {
    shell::run(|settings: AddonAgentSettings, signals| async move {
        let config = settings.resolve(&PodEnvironment::from_vars(std::env::vars()))?;
        let agent = addon_agent::start(config)
            .await
            .context("starting addon-agent")?;
        shell::stop_on_signal(signals, agent.shutdown()).await;
        Ok(())
    })
}

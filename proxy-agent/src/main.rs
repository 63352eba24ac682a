//! `proxy-agent`: the konnectivity agent ([`proxy_agent::start`]), and the
//! service-proxy as `proxy-agent service-proxy`.
#![forbid(unsafe_code)]

use anyhow::Context;
use cluster_proxy_runtime::shell;
use proxy_agent::ProxyAgentSettings;

fn main() -> anyhow::Result<()> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if service_proxy::process::is_requested(&args) {
        // `proxy-agent service-proxy <flags>`: the service-proxy's own
        // flags, as if its binary were run.
        return Ok(service_proxy::process::run(args.into_iter().skip(1))?);
    }
    shell::run_from(args, |settings: ProxyAgentSettings, signals| async move {
        let agent = proxy_agent::start(settings.to_agent_config()?)
            .await
            .context("starting proxy-agent")?;
        // Like upstream: the first signal drains, a second one stops at once.
        shell::drain_on_signal(signals, agent.shutdown()).await;
        Ok(())
    })
}

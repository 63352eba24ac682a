//! `health-prober`: probes every managed cluster through each proxy-server
//! replica ([`health_prober::service`]).
#![forbid(unsafe_code)]

use cluster_proxy_runtime::shell;
use health_prober::settings::HealthProberSettings;

fn main() -> anyhow::Result<()> {
    shell::run(|settings: HealthProberSettings, signals| async move {
        Ok(health_prober::service::serve(settings, signals).await?)
    })
}

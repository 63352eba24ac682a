//! `addon-manager`: installs cluster-proxy as an OCM addon
//! ([`addon_manager::service`]).
#![forbid(unsafe_code)]

use addon_manager::settings::AddonManagerSettings;
use cluster_proxy_runtime::shell;

fn main() -> anyhow::Result<()> {
    shell::run(|settings: AddonManagerSettings, signals| async move {
        Ok(addon_manager::service::serve(settings, signals).await?)
    })
}

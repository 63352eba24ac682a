//! `cert-authority`: issues and renews every mTLS credential
//! ([`cert_authority::commands`]).
#![forbid(unsafe_code)]

use cert_authority::commands;
use cert_authority::settings::{self, Command, InitSettings, RunSettings};
use cluster_proxy_runtime::shell;

fn main() -> anyhow::Result<()> {
    match settings::parse().command {
        Command::Init(flags) => Ok(commands::init_pki(InitSettings::load(&flags)?)?),
        Command::Run(flags) => shell::launch(*flags, |settings: RunSettings| async move {
            Ok(commands::run(settings).await?)
        }),
    }
}

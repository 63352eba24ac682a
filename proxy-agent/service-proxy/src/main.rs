#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    Ok(service_proxy::process::run(std::env::args_os())?)
}

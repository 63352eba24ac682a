//! Writes a complete development PKI (CA, both server certificates, the hub
//! proxy-client certificate and one agent certificate per cluster) for local
//! runs, until `cert-authority init` takes over this job.
//!
//! usage: dev-pki --dir DIR --clusters cluster-a,cluster-b

use std::path::PathBuf;

use anyhow::{Context, bail};
use e2e::pki::TestPki;

fn main() -> anyhow::Result<()> {
    let mut dir: Option<PathBuf> = None;
    let mut clusters = String::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--dir" => dir = args.next().map(PathBuf::from),
            "--clusters" => clusters = args.next().unwrap_or_default(),
            "-h" | "--help" => {
                println!("usage: dev-pki --dir DIR --clusters cluster-a,cluster-b");
                return Ok(());
            }
            other => bail!(
                "unknown argument {other:?}; usage: dev-pki --dir DIR --clusters cluster-a,cluster-b"
            ),
        }
    }
    let dir = dir.context("--dir is required")?;
    let names: Vec<&str> = clusters
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let pki = TestPki::new(&names)?;
    pki.write(&dir)?;
    println!("wrote a development PKI to {}:", dir.display());
    println!("  ca.crt                         trust bundle for every hop");
    println!("  proxy-server.{{crt,key}}         client port (--server-cert/--server-key)");
    println!("  agent-server.{{crt,key}}         agent port (--cluster-cert/--cluster-key)");
    println!("  proxy-client.{{crt,key}}         hub clients (curl --proxy-cert, gRPC clients)");
    for name in names {
        println!("  agent-{name}.{{crt,key}}   agent of {name} (names the cluster in a URI SAN)");
    }
    Ok(())
}

//! Prints the CustomResourceDefinitions cluster-proxy owns, as YAML.
//!
//! The chart's copy is regenerated with
//! `cargo run -p addon-manager --bin crdgen > charts/cluster-proxy/crds/managedproxyconfigurations.yaml`;
//! `tests/crdgen.rs` fails when the checked-in file differs from this output.
#![forbid(unsafe_code)]

use std::io::Write;

use anyhow::Context;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use kube::CustomResourceExt;

const HEADER: &str = "# Generated from the Rust types in proto-crate/src/api/proxy/v1alpha1.rs; do not edit.\n\
# Regenerate: cargo run -p addon-manager --bin crdgen > charts/cluster-proxy/crds/managedproxyconfigurations.yaml\n";

fn main() -> anyhow::Result<()> {
    let yaml = serde_saphyr::to_string(&ManagedProxyConfiguration::crd())
        .context("rendering the ManagedProxyConfiguration CRD as YAML")?;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(HEADER.as_bytes())
        .and_then(|()| stdout.write_all(yaml.as_bytes()))
        .and_then(|()| stdout.flush())
        .context("writing the CRD to stdout")?;
    Ok(())
}

//! The checked-in CRD is exactly what `crdgen` prints from the Rust types.

use std::path::Path;
use std::process::Command;

const REGENERATE: &str = "cargo run -p addon-manager --bin crdgen > charts/cluster-proxy/crds/managedproxyconfigurations.yaml";

#[test]
fn checked_in_crd_matches_the_rust_types() {
    let output = Command::new(env!("CARGO_BIN_EXE_crdgen"))
        .output()
        .expect("crdgen runs");
    assert!(
        output.status.success(),
        "crdgen failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let generated = String::from_utf8(output.stdout).expect("crdgen prints UTF-8");

    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");
    let checked_in = std::fs::read_to_string(&path).unwrap_or_else(|error| {
        panic!("{}: {error}; create it with `{REGENERATE}`", path.display())
    });

    if generated != checked_in {
        let first_difference = generated
            .lines()
            .zip(checked_in.lines())
            .position(|(new, old)| new != old)
            .map_or_else(
                || "one file is a prefix of the other".to_owned(),
                |index| format!("first difference at line {}", index + 1),
            );
        panic!(
            "{} is stale ({first_difference}): the ManagedProxyConfiguration types changed. \
             Regenerate it from the workspace root with `{REGENERATE}` and commit the result.",
            path.display()
        );
    }
}

//! The data plane (proxy-server, proxy-agent) runs in every managed cluster
//! and on the hub's data path: it must not compile or link a Kubernetes
//! client or the PKI generator. `cargo tree` is the authority on that.

use std::path::Path;
use std::process::Command;

const FORBIDDEN: &[&str] = &["kube", "kube-client", "kube-core", "k8s-openapi", "rcgen"];

fn normal_dependencies(package: &str) -> Vec<String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lives inside the workspace");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(workspace)
        .args(["tree", "--locked", "-e", "normal", "--prefix", "none"])
        .args(["--format", "{p}", "-p", package])
        .output()
        .expect("run cargo tree");
    assert!(
        output.status.success(),
        "cargo tree -p {package} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_data_plane_links_no_kubernetes_client_and_no_certificate_generator() {
    for package in ["proxy-server", "proxy-agent"] {
        let dependencies = normal_dependencies(package);
        assert!(
            dependencies.iter().any(|d| d == "cluster-proxy-runtime"),
            "{package}: the dependency list looks wrong: {dependencies:?}"
        );
        let found: Vec<&String> = dependencies
            .iter()
            .filter(|d| FORBIDDEN.contains(&d.as_str()))
            .collect();
        assert!(
            found.is_empty(),
            "{package} depends on {found:?}; see `cargo tree -p {package} -e normal -i <crate>`"
        );
    }
}

#[test]
fn the_check_sees_a_kubernetes_client_where_there_is_one() {
    // Guards the test above against passing vacuously.
    let dependencies = normal_dependencies("cert-authority");
    assert!(dependencies.iter().any(|d| d == "kube"), "{dependencies:?}");
    assert!(
        dependencies.iter().any(|d| d == "rcgen"),
        "{dependencies:?}"
    );
}

//! The data plane (proxy-server, proxy-agent) runs in every managed cluster
//! and on the hub's data path: it must not compile or link a Kubernetes
//! client or the PKI generator. The other way round, the control plane's
//! test bed (the in-memory API, the simulated clusters) links no data plane,
//! so the control-plane services' tests build without it. `cargo tree` is
//! the authority on both.

use std::path::Path;
use std::process::Command;

const FORBIDDEN: &[&str] = &["kube", "kube-client", "kube-core", "k8s-openapi", "rcgen"];

/// Every package `package` depends on through `edges` (`normal`, or
/// `normal,dev` for what its tests build too).
fn dependencies(package: &str, edges: &str) -> Vec<String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lives inside the workspace");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(workspace)
        .args(["tree", "--locked", "-e", edges, "--prefix", "none"])
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
        assert_depends_on_none(package, "normal", "cluster-proxy-runtime", FORBIDDEN);
    }
}

/// Fails when `package` (through `edges`) depends on any of `forbidden`;
/// `expected` must be there, or the list itself is wrong.
fn assert_depends_on_none(package: &str, edges: &str, expected: &str, forbidden: &[&str]) {
    let dependencies = dependencies(package, edges);
    assert!(
        dependencies.iter().any(|d| d == expected),
        "{package}: the dependency list looks wrong: {dependencies:?}"
    );
    let found: Vec<&String> = dependencies
        .iter()
        .filter(|d| forbidden.contains(&d.as_str()))
        .collect();
    assert!(
        found.is_empty(),
        "{package} (-e {edges}) depends on {found:?}; see `cargo tree -p {package} -e {edges} -i <crate>`"
    );
}

#[test]
fn the_check_sees_a_kubernetes_client_where_there_is_one() {
    // Guards the test above against passing vacuously.
    let dependencies = dependencies("cert-authority", "normal");
    assert!(dependencies.iter().any(|d| d == "kube"), "{dependencies:?}");
    assert!(
        dependencies.iter().any(|d| d == "rcgen"),
        "{dependencies:?}"
    );
}

const DATA_PLANE: &[&str] = &["proxy-server", "proxy-agent", "tunnel-harness"];

#[test]
fn the_control_planes_test_bed_and_tests_build_no_data_plane() {
    let checks = [
        ("memory-apiserver", "normal"),
        ("simulated-cluster", "normal"),
        ("addon-manager", "normal,dev"),
        ("cert-authority", "normal,dev"),
        ("cluster-proxy-control", "normal,dev"),
    ];
    for (package, edges) in checks {
        assert_depends_on_none(package, edges, "kube", DATA_PLANE);
    }
    // Guards the check against passing vacuously: the data plane's own
    // protocol tests do build it.
    let server_tests = dependencies("proxy-server", "normal,dev");
    assert!(
        server_tests.iter().any(|d| d == "tunnel-harness"),
        "{server_tests:?}"
    );
}

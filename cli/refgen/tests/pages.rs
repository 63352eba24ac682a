//! The generated reference pages in `docs/src/reference/` match the code.

#[test]
fn the_reference_pages_match_the_code() {
    let root = cluster_proxy_refgen::repository_root();
    for page in cluster_proxy_refgen::pages() {
        let path = root.join(page.path);
        let current = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run: cargo run -p cluster-proxy-refgen)",
                page.path
            )
        });
        assert!(
            current == page.text,
            "{} differs from what the code renders: run `cargo run -p cluster-proxy-refgen` \
             and commit the page",
            page.path
        );
    }
}

#[test]
fn every_binary_lists_flags_with_their_defaults() {
    let flags = cluster_proxy_refgen::flags_page();
    for title in [
        "## proxy-server",
        "## proxy-agent",
        "## addon-agent",
        "## cert-authority init",
        "## cert-authority run",
        "## addon-manager",
        "## health-prober",
    ] {
        assert!(flags.contains(title), "{title} missing");
    }
    assert!(flags.contains("`PROXY_SERVER_SERVER_PORT`"), "{flags}");
    assert!(flags.contains("| `8090` |"), "the client port's default");
}

#[test]
fn metrics_carry_their_labels() {
    let metrics = cluster_proxy_refgen::metrics_page();
    assert!(
        metrics.contains(
            "| `konnectivity_network_proxy_server_dial_failure_count` | counter | `reason` |"
        ),
        "{metrics}"
    );
}

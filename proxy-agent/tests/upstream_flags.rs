//! The argument lists upstream's own tooling passes to its proxy-agent, fed
//! to ours: every one must be accepted, with upstream's meaning.
//!
//! Sources (kubernetes-sigs/apiserver-network-proxy):
//! - `tests/framework/agent.go`: `ExternalAgentRunner` renders every flag of
//!   the agent's flag set as `--name=value` (pflag's `VisitAll`, sorted by
//!   name, values as pflag prints them: `[]` for an empty list, `1h0m0s`,
//!   `100ms`, `false`, empty strings, the deprecated `--lease-label` next to
//!   `--lease-label-selector`), with the options `agentOptions` sets;
//! - `examples/kind/konnectivity-agent-ds.yaml`,
//!   `examples/kind-multinode/templates/k8s/konnectivity-agent-ds.yaml`,
//!   `examples/kubernetes/konnectivity-agent.yaml`;
//! - `e2e/static_count_test.go` and `e2e/lease_count_test.go` (rendered
//!   through `e2e/templates/agent/deployment.yaml`: a flag without a value
//!   is `--flag`, an empty one `--flag=`).

use std::time::Duration;

use clap::Parser;
use proxy_agent::{Cli, ProxyAgentSettings};

fn load(args: &[&str]) -> Result<ProxyAgentSettings, String> {
    let cli = Cli::try_parse_from(std::iter::once("proxy-agent").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    ProxyAgentSettings::load_with_env(&cli, Vec::new()).map_err(|e| e.to_string())
}

/// `agentOptions` of upstream's test harness, as `ExternalAgentRunner` passes it.
const HARNESS: &[&str] = &[
    "--admin-bind-address=127.0.0.1",
    "--admin-server-port=40112",
    "--agent-cert=/tmp/certs/anp-test-agent.crt",
    "--agent-id=0d5c1f8e-7a0b-4a43-9b55-1b7c6c1f4a21",
    "--agent-identifiers=",
    "--agent-key=/tmp/certs/anp-test-agent.key",
    "--alpn-proto=[]",
    "--ca-cert=/tmp/certs/anp-test-ca.crt",
    "--count-server-leases=false",
    "--enable-contention-profiling=false",
    "--enable-profiling=false",
    "--health-server-host=127.0.0.1",
    "--health-server-port=40111",
    "--keepalive-time=1h0m0s",
    "--kube-api-content-type=application/vnd.kubernetes.protobuf",
    "--kubeconfig=",
    "--lease-label=k8s-app=konnectivity-server",
    "--lease-label-selector=k8s-app=konnectivity-server",
    "--lease-namespace=kube-system",
    "--probe-interval=100ms",
    "--proxy-server-host=127.0.0.1",
    "--proxy-server-port=40110",
    "--server-count-source=default",
    "--service-account-token-path=",
    "--sync-forever=false",
    "--sync-interval=100ms",
    "--sync-interval-cap=1s",
    "--warn-on-channel-limit=false",
    "--xfr-channel-size=150",
];

const KIND: &[&str] = &[
    "--logtostderr=true",
    "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
    "--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local",
    "--proxy-server-port=8091",
    "--sync-interval=5s",
    "--sync-interval-cap=30s",
    "--probe-interval=5s",
    "--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
    // `$(HOST_IP)` as the kubelet expands it.
    "--agent-identifiers=ipv4=10.0.0.5",
];

const KIND_MULTINODE: &[&str] = &[
    "--logtostderr=true",
    "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
    "--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local",
    "--proxy-server-port=8091",
    "--sync-interval=5s",
    "--sync-interval-cap=30s",
    "--sync-forever",
    "--probe-interval=5s",
    "--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
    "--agent-identifiers=ipv4=10.0.0.5",
    "--count-server-leases",
];

const KUBERNETES: &[&str] = &[
    "--logtostderr=true",
    "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
    "--proxy-server-host=10.96.0.20",
    "--proxy-server-port=8091",
    "--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
];

/// upstream's e2e agent: `${HOST_IP}` reaches the agent unexpanded (the
/// kubelet expands only `$(VAR)`), and upstream's agent starts with it.
const E2E_STATIC_COUNT: &[&str] = &[
    "--logtostderr=true",
    "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
    "--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local",
    "--proxy-server-port=8091",
    "--sync-interval=1s",
    "--sync-interval-cap=10s",
    "--sync-forever",
    "--probe-interval=1s",
    "--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
    "--agent-identifiers=ipv4=${HOST_IP}",
    "--admin-bind-address=",
];

type Check = fn(&ProxyAgentSettings);

#[test]
fn upstream_argument_lists_are_accepted_with_upstream_meaning() {
    let table: &[(&str, &[&str], Check)] = &[
        ("tests/framework/agent.go", HARNESS, |s| {
            assert!(s.alpn_proto.is_empty(), "[] is an empty list");
            assert_eq!(proxy_agent::offered_alpn(&s.alpn_proto), [b"h2".as_slice()]);
            assert_eq!(s.lease_label_selector, "k8s-app=konnectivity-server");
            assert_eq!(s.sync_interval, Duration::from_millis(100));
            assert_eq!(s.probe_interval, Duration::from_millis(100));
            assert_eq!(s.sync_interval_cap, Duration::from_secs(1));
            assert_eq!(s.keepalive_time, Duration::from_secs(3600));
            assert_eq!((s.health_server_port, s.admin_server_port), (40111, 40112));
            assert_eq!(s.agent_id, "0d5c1f8e-7a0b-4a43-9b55-1b7c6c1f4a21");
            assert!(!s.sync_forever && !s.count_server_leases);
            // Ours notices a lost tunnel when its stream ends, not by probing.
            assert_eq!(s.ignored_settings(), ["probe-interval"]);
            assert!(s.warnings().is_empty(), "{:?}", s.warnings());
            let config = s.to_agent_config().unwrap();
            assert_eq!(config.service_account_token_path, None);
            assert_eq!(config.proxy_server_port, 40110);
        }),
        ("examples/kind", KIND, |s| {
            assert_eq!(s.sync_interval_cap, Duration::from_secs(30));
            assert_eq!(s.probe_interval, Duration::from_secs(5));
            assert_eq!(s.agent_identifiers, "ipv4=10.0.0.5");
            assert!(s.warnings().is_empty(), "{:?}", s.warnings());
            let config = s.to_agent_config().unwrap();
            assert!(config.service_account_token_path.is_some());
        }),
        ("examples/kind-multinode", KIND_MULTINODE, |s| {
            assert!(s.sync_forever);
            assert!(s.count_server_leases);
            assert_eq!(
                s.ignored_settings(),
                ["count-server-leases", "probe-interval"]
            );
        }),
        ("examples/kubernetes", KUBERNETES, |s| {
            assert_eq!(s.proxy_server_host, "10.96.0.20");
            s.to_agent_config().unwrap();
        }),
        ("e2e/static_count_test.go", E2E_STATIC_COUNT, |s| {
            assert_eq!(s.admin_bind_address, "", "empty: every interface");
            assert!(s.sync_forever);
            let warnings = s.warnings();
            assert!(
                warnings.len() == 1 && warnings[0].contains("${HOST_IP}"),
                "{warnings:?}"
            );
            s.to_agent_config().unwrap();
        }),
    ];
    for (source, args, check) in table {
        let settings = load(args).unwrap_or_else(|e| panic!("{source}: {e}"));
        check(&settings);
    }
}

#[test]
fn alpn_proto_adds_to_h2_in_every_rendered_form() {
    for (arg, offered) in [
        ("--alpn-proto=[]", vec!["h2"]),
        ("--alpn-proto=", vec!["h2"]),
        (
            "--alpn-proto=konnectivity-agent",
            vec!["konnectivity-agent", "h2"],
        ),
        (
            "--alpn-proto=[konnectivity-agent]",
            vec!["konnectivity-agent", "h2"],
        ),
        ("--alpn-proto=a,h2", vec!["a", "h2"]),
    ] {
        let s = load(&[arg]).unwrap_or_else(|e| panic!("{arg}: {e}"));
        let got: Vec<String> = proxy_agent::offered_alpn(&s.alpn_proto)
            .into_iter()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .collect();
        assert_eq!(got, offered, "{arg}");
    }
    // Occurrences append, as pflag's string slices do.
    let s = load(&["--alpn-proto=a", "--alpn-proto", "b"]).unwrap();
    assert_eq!(s.alpn_proto, ["a", "b"]);
    let err = load(&["--alpn-proto=[a"]).unwrap_err();
    assert!(err.contains("--alpn-proto") && err.contains("[a"), "{err}");
}

#[test]
fn repeated_flags_and_aliases_keep_the_last_value() {
    let s = load(&["--lease-label=a=1", "--lease-label-selector=b=2"]).unwrap();
    assert_eq!(s.lease_label_selector, "b=2");
    let s = load(&["--lease-label-selector=b=2", "--lease-label=a=1"]).unwrap();
    assert_eq!(s.lease_label_selector, "a=1");
    let s = load(&["--lease-label=a=1"]).unwrap();
    assert_eq!(s.lease_label_selector, "a=1");
    let s = load(&["--proxy-server-port=1", "--proxy-server-port=2"]).unwrap();
    assert_eq!(s.proxy_server_port, 2);
    let s = load(&["--sync-forever", "--sync-forever=false"]).unwrap();
    assert!(!s.sync_forever);
}

#[test]
fn bad_values_are_clear_errors() {
    let err = load(&["--sync-forever=maybe"]).unwrap_err();
    assert!(
        err.contains("--sync-forever") && err.contains("maybe"),
        "{err}"
    );
    let err = load(&["--sync-interval=5"]).unwrap_err();
    assert!(err.contains("--sync-interval"), "{err}");
    let err = load(&["--agent-identifiers=zone=eu"]).unwrap_err();
    assert!(
        err.contains("agent-identifiers") && err.contains("zone"),
        "{err}"
    );
}

#[test]
fn empty_paths_are_not_given() {
    let s = load(&["--ca-cert=/ca.crt", "--agent-cert=", "--agent-key="]).unwrap();
    assert_eq!((s.agent_cert.as_ref(), s.agent_key.as_ref()), (None, None));
    s.to_agent_config().unwrap();
}

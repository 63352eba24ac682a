//! The argument lists upstream's own tooling passes to its proxy-server, fed
//! to ours: every flag must be accepted with upstream's meaning; what this
//! server deliberately does not offer (the Unix-socket frontend, agent
//! service-account token authentication) must be refused with an error
//! naming the flag, never a panic or an "unexpected argument".
//!
//! Sources (kubernetes-sigs/apiserver-network-proxy):
//! - `tests/framework/proxy_server.go`: `serverOptions`, rendered as
//!   upstream's tooling renders a flag set (pflag's `VisitAll`, sorted,
//!   `--name=value` with pflag's printing: `[]`, `0s`, `1h0m0s`, empty strings);
//! - `examples/kind-multinode/templates/k8s/konnectivity-server.yaml`
//!   (and `examples/kind`, the same list without the lease controller);
//! - `e2e/static_count_test.go` through `e2e/templates/server/deployment.yaml`
//!   (`--mode` given twice, `--admin-bind-address=` empty).

use std::time::Duration;

use clap::Parser;
use proxy_server::settings::{Cli, Mode, ProxyServerSettings};

fn cli(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("proxy-server").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("every upstream flag must be accepted: {e}"))
}

fn load(args: &[&str]) -> Result<ProxyServerSettings, String> {
    ProxyServerSettings::load_with_env(&cli(args), Vec::new()).map_err(|e| e.to_string())
}

fn without<'a>(args: &[&'a str], unsupported: &[&str]) -> Vec<&'a str> {
    args.iter()
        .copied()
        .filter(|arg| {
            let name = arg.trim_start_matches('-');
            let name = name.split_once('=').map_or(name, |(name, _)| name);
            !unsupported.contains(&name)
        })
        .collect()
}

/// `serverOptions` of upstream's test harness.
const HARNESS: &[&str] = &[
    "--admin-bind-address=127.0.0.1",
    "--admin-port=40122",
    "--agent-bind-address=127.0.0.1",
    "--agent-namespace=",
    "--agent-port=40120",
    "--agent-service-account=",
    "--authentication-audience=",
    "--backend-dial-timeout=0s",
    "--cipher-suites=[]",
    "--cluster-ca-cert=/tmp/certs/anp-test-ca.crt",
    "--cluster-cert=/tmp/certs/anp-test-server.crt",
    "--cluster-key=/tmp/certs/anp-test-server.key",
    "--delete-existing-uds-file=true",
    "--enable-contention-profiling=false",
    "--enable-lease-controller=false",
    "--enable-profiling=false",
    "--frontend-keepalive-time=1h0m0s",
    "--graceful-shutdown-timeout=0s",
    "--health-bind-address=127.0.0.1",
    "--health-port=40121",
    "--keepalive-time=1h0m0s",
    "--kube-api-content-type=application/vnd.kubernetes.protobuf",
    "--kubeconfig=",
    "--kubeconfig-burst=0",
    "--kubeconfig-qps=0",
    "--lease-label=k8s-app=konnectivity-server",
    "--lease-namespace=kube-system",
    "--mode=grpc",
    "--proxy-strategies=default",
    "--server-bind-address=",
    "--server-ca-cert=",
    "--server-cert=",
    "--server-count=1",
    "--server-id=5b0e7d0c-2f8e-4f7a-8d4c-4a4c1c9f0e11",
    "--server-key=",
    "--server-port=0",
    "--tls-min-version=",
    "--uds-name=/tmp/certs/server-5b0e7d0c-2f8e-4f7a-8d4c-4a4c1c9f0e11.sock",
    "--warn-on-channel-limit=true",
    "--xfr-channel-size=10",
];

const KIND_MULTINODE: &[&str] = &[
    "--log-file=/var/log/konnectivity-server.log",
    "--logtostderr=true",
    "--log-file-max-size=0",
    "--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket",
    "--delete-existing-uds-file",
    "--cluster-cert=/etc/kubernetes/pki/apiserver.crt",
    "--cluster-key=/etc/kubernetes/pki/apiserver.key",
    "--server-port=0",
    "--agent-port=8091",
    "--health-port=8092",
    "--admin-port=8093",
    "--keepalive-time=1h",
    "--mode=grpc",
    "--agent-namespace=kube-system",
    "--agent-service-account=konnectivity-agent",
    "--kubeconfig=/etc/kubernetes/admin.conf",
    "--authentication-audience=system:konnectivity-server",
    "--enable-lease-controller",
];

const E2E_STATIC_COUNT: &[&str] = &[
    "--log-file=/var/log/konnectivity-server.log",
    "--logtostderr=true",
    "--log-file-max-size=0",
    "--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket",
    "--delete-existing-uds-file",
    "--cluster-cert=/etc/kubernetes/pki/apiserver.crt",
    "--cluster-key=/etc/kubernetes/pki/apiserver.key",
    "--server-port=0",
    "--kubeconfig=/etc/kubernetes/admin.conf",
    "--keepalive-time=1h",
    "--mode=grpc",
    "--agent-namespace=kube-system",
    "--agent-service-account=konnectivity-agent",
    "--authentication-audience=system:konnectivity-server",
    "--admin-bind-address=",
    "--server-count=2",
    "--mode=http-connect",
];

/// What this server does not offer, each refused by name when non-empty.
const UNSUPPORTED: &[&str] = &[
    "agent-namespace",
    "agent-service-account",
    "authentication-audience",
];

type Check = fn(&ProxyServerSettings);

#[test]
fn upstream_argument_lists_are_accepted_with_upstream_meaning() {
    let table: &[(&str, &[&str], Check)] = &[
        ("tests/framework/proxy_server.go", HARNESS, |c| {
            assert_eq!(c.mode, Mode::Grpc);
            assert!(c.cipher_suites.is_empty(), "[] is an empty list");
            assert_eq!(c.backend_dial_timeout, Duration::ZERO, "0s: never");
            assert_eq!(c.graceful_shutdown_timeout, Duration::ZERO);
            assert_eq!(c.frontend_keepalive_time, Duration::from_secs(3600));
            assert_eq!(
                (c.agent_port, c.health_port, c.admin_port),
                (40120, 40121, 40122)
            );
            assert_eq!(c.server_cert, None, "an empty path is no path");
            assert_eq!(c.server_count, 1);
            assert_eq!(c.server_id, "5b0e7d0c-2f8e-4f7a-8d4c-4a4c1c9f0e11");
            assert_eq!(
                c.uds_name,
                "/tmp/certs/server-5b0e7d0c-2f8e-4f7a-8d4c-4a4c1c9f0e11.sock"
            );
            assert!(
                c.ignored_settings().is_empty(),
                "{:?}",
                c.ignored_settings()
            );
        }),
        ("examples/kind-multinode", KIND_MULTINODE, |c| {
            assert_eq!(c.mode, Mode::Grpc);
            assert_eq!(c.keepalive_time, Duration::from_secs(3600));
            assert!(c.delete_existing_uds_file);
            assert_eq!(
                c.uds_name,
                "/etc/kubernetes/konnectivity-server/konnectivity-server.socket"
            );
            assert_eq!(
                c.ignored_settings(),
                ["kubeconfig", "enable-lease-controller"]
            );
        }),
        ("e2e/static_count_test.go", E2E_STATIC_COUNT, |c| {
            assert_eq!(c.mode, Mode::HttpConnect, "the last --mode wins");
            assert_eq!(c.server_count, 2);
            assert_eq!(c.admin_bind_address, "");
        }),
    ];
    for (source, args, check) in table {
        // As given: every flag parses; what is unsupported is named.
        let unsupported = args.iter().any(|a| {
            UNSUPPORTED.iter().any(|flag| {
                a.strip_prefix(&format!("--{flag}="))
                    .is_some_and(|value| !value.is_empty())
            })
        });
        match load(args) {
            Err(err) => assert!(
                unsupported && UNSUPPORTED.iter().any(|flag| err.contains(flag)),
                "{source}: {err}"
            ),
            Ok(_) => assert!(!unsupported, "{source}: an unsupported flag was accepted"),
        }
        // Without the unsupported flags: upstream's meaning.
        let config = load(&without(args, UNSUPPORTED)).unwrap_or_else(|e| panic!("{source}: {e}"));
        check(&config);
    }
}

#[test]
fn go_forms_of_booleans_lists_and_repeats() {
    let c = load(&["--enable-profiling=True", "--allow-unbound-agents=1"]).unwrap();
    assert!(c.enable_profiling && c.allow_unbound_agents);
    let c = load(&["--delete-existing-uds-file=F"]).unwrap();
    assert!(!c.delete_existing_uds_file);
    let c = load(&[
        "--cipher-suites=[TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]",
        "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    ])
    .unwrap();
    assert_eq!(
        c.cipher_suites,
        [
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"
        ]
    );
    // A name Go would not know either is refused; one Go knows that this
    // build does not implement (RSA key exchange) is accepted, never offered.
    let err = load(&["--cipher-suites=TLS_MADE_UP_WITH_NOTHING"]).unwrap_err();
    assert!(
        err.to_string().contains("cipher-suites") && err.to_string().contains("TLS_MADE_UP"),
        "{err}"
    );
    load(&["--cipher-suites=TLS_RSA_WITH_AES_128_GCM_SHA256,TLS_AES_128_GCM_SHA256"]).unwrap();
    let c = load(&["--server-count=2", "--server-count=3"]).unwrap();
    assert_eq!(c.server_count, 3);
    let err = Cli::try_parse_from(["proxy-server", "--enable-profiling=yes"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--enable-profiling") && err.contains("yes"),
        "{err}"
    );
    let err = load(&["--tls-min-version=VersionTLS10"]).unwrap_err();
    assert!(err.contains("tls-min-version"), "{err}");
}

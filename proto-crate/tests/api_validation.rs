//! `ManagedProxyConfigurationSpec::validate`: real configurations pass, each
//! kind of bad input is reported with the path of the field, all at once.
#![cfg(feature = "kube-api")]

use std::path::Path;

use cluster_proxy_proto::api::proxy::v1alpha1::validation::{
    is_dns1123_subdomain, is_qualified_name,
};
use cluster_proxy_proto::api::proxy::v1alpha1::{
    AnnotationVar, Entrypoint, EntrypointType, HostnameEntrypoint, InvalidSpec,
    LoadBalancerServiceEntrypoint, ManagedProxyConfiguration, ManagedProxyConfigurationSpec,
    SelfSigned, SignerType,
};
use cluster_proxy_proto::api::proxy::v1alpha1::{Deploy, DeployPorts, UserServer};

fn fixture(name: &str) -> ManagedProxyConfigurationSpec {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/proxy/v1alpha1")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("fixture is readable");
    serde_json::from_str::<ManagedProxyConfiguration>(&text)
        .expect("fixture parses")
        .spec
}

fn hub() -> ManagedProxyConfigurationSpec {
    fixture("managedproxyconfiguration-hub.json")
}

fn problem_fields(error: &InvalidSpec) -> Vec<&str> {
    error
        .problems
        .iter()
        .map(|problem| problem.field.as_str())
        .collect()
}

fn invalid(spec: &ManagedProxyConfigurationSpec) -> InvalidSpec {
    spec.validate().expect_err("the spec is invalid")
}

#[test]
fn real_configurations_are_valid() {
    for name in [
        "managedproxyconfiguration-hub.json",
        "managedproxyconfiguration-loadbalancer.json",
        "managedproxyconfiguration-upstream-sample.json",
    ] {
        assert_eq!(fixture(name).validate(), Ok(()), "{name}");
    }
    let mut port_forward = hub();
    port_forward.proxy_server.entrypoint = Some(Entrypoint {
        type_: EntrypointType::PortForward,
        load_balancer_service: None,
        hostname: None,
        port: 8091,
    });
    port_forward.proxy_server.replicas = 0;
    assert_eq!(port_forward.validate(), Ok(()), "scaled to zero is allowed");
}

#[test]
fn missing_images_and_negative_replicas_are_reported_together() {
    let mut spec = hub();
    spec.proxy_server.image = "  ".into();
    spec.proxy_server.replicas = -1;
    spec.proxy_agent.image = String::new();
    spec.proxy_agent.replicas = -3;
    let error = invalid(&spec);
    assert_eq!(
        problem_fields(&error),
        [
            "spec.proxyServer.image",
            "spec.proxyServer.replicas",
            "spec.proxyAgent.image",
            "spec.proxyAgent.replicas"
        ]
    );
    let message = error.to_string();
    assert!(
        message.contains("spec.proxyServer.replicas: -1 is negative"),
        "{message}"
    );
    assert!(
        message.contains("spec.proxyAgent.image: an image is required"),
        "{message}"
    );
}

#[test]
fn entrypoints_must_say_where_agents_dial() {
    let mut missing = hub();
    missing.proxy_server.entrypoint = None;
    assert_eq!(
        problem_fields(&invalid(&missing)),
        ["spec.proxyServer.entrypoint"]
    );

    let mut no_hostname = hub();
    if let Some(entrypoint) = no_hostname.proxy_server.entrypoint.as_mut() {
        entrypoint.hostname = None;
    }
    assert_eq!(
        problem_fields(&invalid(&no_hostname)),
        ["spec.proxyServer.entrypoint.hostname"]
    );

    for bad in [
        "",
        "proxy entrypoint",
        "-proxy.example.com",
        "proxy..example.com",
    ] {
        let mut spec = hub();
        if let Some(entrypoint) = spec.proxy_server.entrypoint.as_mut() {
            entrypoint.hostname = Some(HostnameEntrypoint { value: bad.into() });
        }
        assert_eq!(
            problem_fields(&invalid(&spec)),
            ["spec.proxyServer.entrypoint.hostname.value"],
            "{bad:?}"
        );
    }
    for good in ["10.0.0.7", "fd00::7", "Proxy.Example.com"] {
        let mut spec = hub();
        if let Some(entrypoint) = spec.proxy_server.entrypoint.as_mut() {
            entrypoint.hostname = Some(HostnameEntrypoint { value: good.into() });
        }
        assert_eq!(spec.validate(), Ok(()), "{good:?}");
    }

    for port in [0, -1, 65536] {
        let mut spec = hub();
        if let Some(entrypoint) = spec.proxy_server.entrypoint.as_mut() {
            entrypoint.port = port;
        }
        assert_eq!(
            problem_fields(&invalid(&spec)),
            ["spec.proxyServer.entrypoint.port"],
            "{port}"
        );
    }
}

/// Upstream drops valid annotation keys (its check is inverted); here valid
/// keys pass and invalid or repeated ones are reported.
#[test]
fn load_balancer_annotation_keys_are_checked_the_right_way_round() {
    let mut spec = fixture("managedproxyconfiguration-loadbalancer.json");
    let entrypoint = spec.proxy_server.entrypoint.as_mut().expect("entrypoint");
    entrypoint.load_balancer_service = Some(LoadBalancerServiceEntrypoint {
        name: "Proxy_Entry".into(),
        annotations: vec![
            AnnotationVar {
                key: "service.beta.kubernetes.io/aws-load-balancer-type".into(),
                value: "nlb".into(),
            },
            AnnotationVar {
                key: "bad key".into(),
                value: String::new(),
            },
            AnnotationVar {
                key: "service.beta.kubernetes.io/aws-load-balancer-type".into(),
                value: "elb".into(),
            },
        ],
    });
    let error = invalid(&spec);
    assert_eq!(
        problem_fields(&error),
        [
            "spec.proxyServer.entrypoint.loadBalancerService.name",
            "spec.proxyServer.entrypoint.loadBalancerService.annotations[1].key",
            "spec.proxyServer.entrypoint.loadBalancerService.annotations[2].key",
        ]
    );
    assert!(error.problems[2].message.contains("set twice"), "{error}");
}

#[test]
fn names_sans_ports_and_signer_are_checked() {
    let mut spec = hub();
    spec.authentication.signer.type_ = SignerType::CertManager;
    spec.authentication.signer.self_signed = Some(SelfSigned {
        additional_sans: vec![
            "proxy.example.com".into(),
            "*.apps.example.com".into(),
            "not a host".into(),
        ],
    });
    spec.authentication
        .dump
        .secrets
        .signing_proxy_client_secret_name = "proxy-server".into();
    spec.proxy_server.namespace = "Open-Cluster-Management".into();
    spec.proxy_server.in_cluster_service_name = "8090-entry".into();
    spec.proxy_agent.image_pull_secrets = vec!["quay_pull".into()];
    spec.deploy = Some(Deploy {
        ports: DeployPorts {
            proxy_server: 8090,
            agent_server: 8090,
            health_server: 0,
            admin_server: 8095,
        },
    });
    spec.user_server = Some(UserServer {
        additional_sans: vec!["".into()],
    });
    let error = invalid(&spec);
    assert_eq!(
        problem_fields(&error),
        [
            "spec.authentication.signer.type",
            "spec.authentication.signer.selfSigned.additionalSANs[2]",
            "spec.authentication.dump.secrets.signingProxyClientSecretName",
            "spec.proxyServer.namespace",
            "spec.proxyServer.inClusterServiceName",
            "spec.proxyAgent.imagePullSecrets[0]",
            "spec.deploy.ports.agentServer",
            "spec.deploy.ports.healthServer",
            "spec.userServer.additionalSANs[0]",
        ]
    );
}

#[test]
fn name_rules_follow_kubernetes() {
    for key in [
        "a",
        "example.com/key",
        "service.beta.kubernetes.io/azure-load-balancer-internal",
        "A_b.c-D",
    ] {
        assert!(is_qualified_name(key), "{key}");
    }
    for key in [
        "",
        "/x",
        "Example.com/key",
        "a/b/c",
        "-a",
        "a-",
        "bad key",
        &"k".repeat(64),
    ] {
        assert!(!is_qualified_name(key), "{key}");
    }
    assert!(is_dns1123_subdomain(
        "proxy-entrypoint.open-cluster-management-addon.svc"
    ));
    assert!(!is_dns1123_subdomain(""));
    assert!(!is_dns1123_subdomain(&format!("{}.com", "a".repeat(250))));
}

#[test]
fn enable_impersonation_is_refused_among_the_additional_service_proxy_args() {
    for arg in [
        "--enable-impersonation=false",
        "--enable-impersonation",
        "-enable-impersonation=true",
    ] {
        let mut spec = hub();
        spec.proxy_agent.additional_service_proxy_args = vec!["--v=4".into(), arg.into()];
        let error = invalid(&spec);
        assert_eq!(
            problem_fields(&error),
            ["spec.proxyAgent.additionalServiceProxyArgs[1]"],
            "{arg}"
        );
    }
    let mut spec = hub();
    spec.proxy_agent.additional_service_proxy_args = vec!["--enable-impersonation-audit".into()];
    assert!(
        spec.validate().is_ok(),
        "another flag of that prefix is fine"
    );
}

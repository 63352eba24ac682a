//! The hub objects rendered from a ManagedProxyConfiguration: upstream's
//! names and labels, the proxy-server arguments, honoured ports, node
//! placement, annotation keys, and the entrypoint address.

use addon_manager::hub::render::{
    ADDON_AGENT_GROUP, PORT_FORWARD_RBAC_NAME, SERVER_ID_ENV, proxy_server_args,
};
use addon_manager::hub::{EntrypointError, entrypoint_address, render};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use k8s_openapi::api::core::v1::{
    Container, LoadBalancerIngress, LoadBalancerStatus, Service, ServiceStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

fn mpc(spec_patch: Value) -> ManagedProxyConfiguration {
    let mut object = json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy", "uid": "uid-1", "generation": 4},
        "spec": {
            "authentication": {},
            "proxyServer": {
                "image": "quay.io/ocm/cluster-proxy:v1",
                "replicas": 2,
                "entrypoint": {"type": "Hostname", "hostname": {"value": "proxy.example.com"}}
            },
            "proxyAgent": {"image": "quay.io/ocm/cluster-proxy:v1"}
        }
    });
    merge(&mut object["spec"], spec_patch);
    serde_json::from_value(object).expect("a valid MPC")
}

fn merge(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                merge(target.entry(key).or_insert(Value::Null), value);
            }
        }
        (target, patch) => *target = patch,
    }
}

fn container(objects: &addon_manager::hub::HubObjects) -> &Container {
    &objects
        .deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .expect("a pod spec")
        .containers[0]
}

#[test]
fn objects_carry_upstream_names_labels_and_owner() {
    let objects = render(&mpc(json!({}))).unwrap();
    let ns = "open-cluster-management-cluster-proxy";
    assert_eq!(objects.namespace.metadata.name.as_deref(), Some(ns));
    assert_eq!(
        objects.namespace.metadata.owner_references, None,
        "the namespace outlives the MPC"
    );
    assert_eq!(
        objects.service_account.metadata.name.as_deref(),
        Some("cluster-proxy")
    );
    assert_eq!(
        objects.deployment.metadata.name.as_deref(),
        Some("cluster-proxy")
    );
    assert_eq!(
        objects.in_cluster_service.metadata.name.as_deref(),
        Some("proxy-entrypoint")
    );
    assert!(objects.load_balancer_service.is_none());
    assert!(objects.port_forward_role.is_none());
    assert!(objects.port_forward_role_binding.is_none());

    for meta in [
        &objects.service_account.metadata,
        &objects.deployment.metadata,
        &objects.in_cluster_service.metadata,
    ] {
        assert_eq!(meta.namespace.as_deref(), Some(ns));
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(labels["open-cluster-management.io/addon"], "cluster-proxy");
        let owners = meta.owner_references.as_ref().unwrap();
        assert_eq!(owners.len(), 1);
        assert_eq!(owners[0].kind, "ManagedProxyConfiguration");
        assert_eq!(
            owners[0].api_version,
            "proxy.open-cluster-management.io/v1alpha1"
        );
        assert_eq!(owners[0].uid, "uid-1");
        assert_eq!(owners[0].controller, Some(true));
    }

    let deployment = &objects.deployment;
    let generation_key = "proxy.open-cluster-management.io/configuration-generation";
    assert_eq!(
        deployment.metadata.annotations.as_ref().unwrap()[generation_key],
        "4"
    );
    let spec = deployment.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    let template = spec.template.metadata.as_ref().unwrap();
    assert_eq!(
        template.annotations, None,
        "an MPC change that leaves the pods alone (replicas) must not roll them"
    );
    assert_eq!(
        template.labels.as_ref().unwrap()["proxy.open-cluster-management.io/component-name"],
        "proxy-server"
    );
    assert_eq!(
        spec.selector.match_labels.as_ref().unwrap()["proxy.open-cluster-management.io/component-name"],
        "proxy-server"
    );
    let strategy = spec.strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("cluster-proxy"));
}

#[test]
fn proxy_server_container_has_the_fixed_args_mounts_and_hardening() {
    let objects = render(&mpc(json!({}))).unwrap();
    let container = container(&objects);
    assert_eq!(container.name, "proxy-server");
    assert_eq!(
        container.image.as_deref(),
        Some("quay.io/ocm/cluster-proxy:v1")
    );
    assert_eq!(
        container.command.as_deref(),
        Some(&["/proxy-server".to_owned()][..])
    );
    assert_eq!(
        container.args.as_ref().unwrap(),
        &[
            "--server-count-source=dns:proxy-server-peers.open-cluster-management-cluster-proxy.svc",
            "--proxy-strategies=destHost",
            "--server-ca-cert=/etc/server-ca-pki/ca.crt",
            "--server-cert=/etc/server-pki/tls.crt",
            "--server-key=/etc/server-pki/tls.key",
            "--cluster-ca-cert=/etc/server-ca-pki/ca.crt",
            "--cluster-cert=/etc/agent-pki/tls.crt",
            "--cluster-key=/etc/agent-pki/tls.key",
        ],
        "no port flags unless spec.deploy.ports is set"
    );
    let env = &container.env.as_ref().unwrap()[0];
    assert_eq!(env.name, SERVER_ID_ENV);
    assert_eq!(
        env.value_from
            .as_ref()
            .and_then(|source| source.field_ref.as_ref())
            .map(|field| field.field_path.as_str()),
        Some("metadata.name")
    );

    let pod = objects
        .deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let volumes: Vec<(&str, &str)> = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|volume| {
            (
                volume.name.as_str(),
                volume
                    .secret
                    .as_ref()
                    .unwrap()
                    .secret_name
                    .as_deref()
                    .unwrap(),
            )
        })
        .collect();
    assert_eq!(
        volumes,
        [
            ("server-ca-pki", "proxy-server-ca"),
            ("server-pki", "proxy-server"),
            ("agent-pki", "agent-server")
        ]
    );
    let mounts: Vec<(&str, &str, Option<bool>)> = container
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .map(|mount| {
            (
                mount.name.as_str(),
                mount.mount_path.as_str(),
                mount.read_only,
            )
        })
        .collect();
    assert_eq!(
        mounts,
        [
            ("server-ca-pki", "/etc/server-ca-pki", Some(true)),
            ("server-pki", "/etc/server-pki", Some(true)),
            ("agent-pki", "/etc/agent-pki", Some(true))
        ]
    );

    let security = container.security_context.as_ref().unwrap();
    assert_eq!(security.run_as_user, Some(65532));
    assert_eq!(security.run_as_non_root, Some(true));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(
        security.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_owned()][..])
    );

    let readiness = container.readiness_probe.as_ref().unwrap();
    let liveness = container.liveness_probe.as_ref().unwrap();
    assert_eq!(
        readiness.http_get.as_ref().unwrap().path.as_deref(),
        Some("/readyz"),
        "clients must reach a replica only once it holds the other replicas' agents"
    );
    assert_eq!(
        liveness.http_get.as_ref().unwrap().path.as_deref(),
        Some("/healthz")
    );
    let ports: Vec<(Option<&str>, i32)> = container
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|port| (port.name.as_deref(), port.container_port))
        .collect();
    assert_eq!(
        ports,
        [
            (Some("proxy-server"), 8090),
            (Some("agent-server"), 8091),
            (Some("health"), 8092),
            (Some("admin"), 8095)
        ]
    );
}

#[test]
fn secret_names_come_from_the_dump_spec() {
    let objects = render(&mpc(json!({"authentication": {"dump": {"secrets": {
        "signingProxyServerSecretName": "my-server",
        "signingAgentServerSecretName": "my-agent-server"
    }}}})))
    .unwrap();
    let pod = objects.deployment.spec.unwrap().template.spec.unwrap();
    let secrets: Vec<String> = pod
        .volumes
        .unwrap()
        .into_iter()
        .map(|volume| volume.secret.unwrap().secret_name.unwrap())
        .collect();
    assert_eq!(secrets, ["proxy-server-ca", "my-server", "my-agent-server"]);
}

/// The replicas count each other through a headless Service over every
/// proxy-server pod, ready or not, so scaling changes neither the pod
/// template nor any flag: no pod restarts.
#[test]
fn replicas_count_each_other_so_scaling_changes_no_pod() {
    let two = render(&mpc(json!({}))).unwrap();
    let mut five_spec = mpc(json!({"proxyServer": {"replicas": 5}}));
    five_spec.metadata.generation = Some(5);
    let five = render(&five_spec).unwrap();
    let spec = |objects: &addon_manager::hub::HubObjects| objects.deployment.spec.clone().unwrap();
    assert_eq!(spec(&five).replicas, Some(5));
    assert_eq!(
        spec(&two).template,
        spec(&five).template,
        "scaling changed the pod template"
    );

    let peers = &two.peer_service;
    assert_eq!(peers.metadata.name.as_deref(), Some("proxy-server-peers"));
    assert_eq!(
        peers.metadata.namespace.as_deref(),
        Some("open-cluster-management-cluster-proxy")
    );
    assert_eq!(
        peers.metadata.owner_references.as_ref().map(Vec::len),
        Some(1)
    );
    let peer_spec = peers.spec.as_ref().unwrap();
    assert_eq!(peer_spec.cluster_ip.as_deref(), Some("None"), "headless");
    assert_eq!(
        peer_spec.publish_not_ready_addresses,
        Some(true),
        "a new replica is ready only once agents reach it, and they look for it only once it is counted"
    );
    assert_eq!(
        peer_spec.selector.as_ref().unwrap()["proxy.open-cluster-management.io/component-name"],
        "proxy-server"
    );
    assert!(
        container(&two)
            .args
            .as_ref()
            .unwrap()
            .iter()
            .all(|arg| !arg.starts_with("--server-count=")),
        "a --server-count flag would roll the pods on every scale"
    );
}

#[test]
fn deploy_ports_are_honoured_everywhere_and_additional_args_come_last_in_order() {
    let configuration = mpc(json!({
        "deploy": {"ports": {"proxyServer": 9000, "agentServer": 9001, "healthServer": 9002, "adminServer": 9005}},
        "proxyServer": {
            "additionalArgs": ["--keepalive-time=1m", "--server-count=7", "-v=4"],
            "inClusterServiceName": "my-entry"
        }
    }));
    let args = proxy_server_args(&configuration, &addon_manager::hub::TlsProfile::default());
    let tail = &args[args.len() - 7..];
    assert_eq!(
        tail,
        [
            "--server-port=9000",
            "--agent-port=9001",
            "--health-port=9002",
            "--admin-port=9005",
            "--keepalive-time=1m",
            "--server-count=7",
            "-v=4"
        ]
    );
    let objects = render(&configuration).unwrap();
    let container = container(&objects);
    let ports: Vec<i32> = container
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|port| port.container_port)
        .collect();
    assert_eq!(ports, [9000, 9001, 9002, 9005]);
    assert_eq!(
        container
            .readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("health".into())
    );
    let service = &objects.in_cluster_service;
    assert_eq!(service.metadata.name.as_deref(), Some("my-entry"));
    let service_ports: Vec<(Option<&str>, i32)> = service
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|port| (port.name.as_deref(), port.port))
        .collect();
    assert_eq!(
        service_ports,
        [(Some("proxy-server"), 9000), (Some("agent-server"), 9001)]
    );
}

#[test]
fn node_placement_reaches_the_pods() {
    let objects = render(&mpc(json!({"proxyServer": {"nodePlacement": {
        "nodeSelector": {"node-role.kubernetes.io/infra": ""},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}]
    }}})))
    .unwrap();
    let pod = objects.deployment.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        pod.node_selector.unwrap()["node-role.kubernetes.io/infra"],
        ""
    );
    let tolerations = pod.tolerations.unwrap();
    assert_eq!(tolerations.len(), 1);
    assert_eq!(tolerations[0].key.as_deref(), Some("dedicated"));
    assert_eq!(tolerations[0].effect.as_deref(), Some("NoSchedule"));

    let bare = render(&mpc(json!({}))).unwrap();
    let bare_pod = bare.deployment.spec.unwrap().template.spec.unwrap();
    assert_eq!(bare_pod.node_selector, None);
    assert_eq!(bare_pod.tolerations, None);
}

/// Requests and limits are ours to add (upstream's MPC has none); a
/// namespace with a ResourceQuota admits only pods that set them.
#[test]
fn resources_reach_the_container_and_none_are_set_without_them() {
    let sized = mpc(json!({"proxyServer": {"resources": {
        "requests": {"cpu": "500m", "memory": "256Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"}
    }}}));
    let objects = render(&sized).unwrap();
    let resources = container(&objects)
        .resources
        .clone()
        .expect("resources set");
    let quantity = |map: Option<&std::collections::BTreeMap<String, Quantity>>, key: &str| {
        map.and_then(|map| map.get(key))
            .map(|quantity| quantity.0.clone())
    };
    assert_eq!(
        quantity(resources.requests.as_ref(), "cpu").as_deref(),
        Some("500m")
    );
    assert_eq!(
        quantity(resources.limits.as_ref(), "memory").as_deref(),
        Some("1Gi")
    );
    // An MPC without them hashes as before: no rollout on upgrade.
    let bare = mpc(json!({}));
    assert!(container(&render(&bare).unwrap()).resources.is_none());
    assert_eq!(
        serde_json::to_value(&bare.spec).unwrap()["proxyServer"].get("resources"),
        None
    );
}

#[test]
fn load_balancer_entrypoint_keeps_valid_annotation_keys_only() {
    let configuration = mpc(json!({"proxyServer": {"entrypoint": {
        "type": "LoadBalancerService",
        "hostname": null,
        "loadBalancerService": {"annotations": [
            {"key": "service.beta.kubernetes.io/aws-load-balancer-type", "value": "nlb"},
            {"key": "plain-key", "value": "1"},
            {"key": "not a key!", "value": "x"},
            {"key": "-leading-dash", "value": "y"}
        ]}
    }}}));
    let objects = render(&configuration).unwrap();
    let service = objects.load_balancer_service.expect("an LB Service");
    assert_eq!(
        service.metadata.name.as_deref(),
        Some("proxy-agent-entrypoint")
    );
    let annotations = service.metadata.annotations.unwrap();
    assert_eq!(
        annotations.keys().map(String::as_str).collect::<Vec<_>>(),
        [
            "plain-key",
            "service.beta.kubernetes.io/aws-load-balancer-type"
        ]
    );
    let spec = service.spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
    assert_eq!(
        spec.publish_not_ready_addresses,
        Some(true),
        "agents must reach a new replica before it is ready: it is ready only once they do"
    );
    let ports: Vec<i32> = spec.ports.unwrap().iter().map(|port| port.port).collect();
    assert_eq!(ports, [8090, 8091]);

    let problems = configuration.spec.validate().unwrap_err().problems;
    let fields: Vec<&str> = problems
        .iter()
        .map(|problem| problem.field.as_str())
        .collect();
    assert_eq!(
        fields,
        [
            "spec.proxyServer.entrypoint.loadBalancerService.annotations[2].key",
            "spec.proxyServer.entrypoint.loadBalancerService.annotations[3].key"
        ]
    );
}

#[test]
fn port_forward_entrypoint_renders_the_rbac() {
    let objects = render(&mpc(json!({"proxyServer": {"entrypoint": {
        "type": "PortForward", "hostname": null
    }}})))
    .unwrap();
    assert!(objects.load_balancer_service.is_none());
    let role = objects.port_forward_role.expect("a Role");
    assert_eq!(role.metadata.name.as_deref(), Some(PORT_FORWARD_RBAC_NAME));
    let rules = role.rules.unwrap();
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["pods".to_owned()][..])
    );
    assert_eq!(rules[0].verbs, ["get", "list"]);
    assert_eq!(
        rules[1].resources.as_deref(),
        Some(&["pods/portforward".to_owned()][..])
    );
    assert_eq!(rules[1].verbs, ["get", "create"]);
    let binding = objects.port_forward_role_binding.expect("a RoleBinding");
    assert_eq!(binding.role_ref.name, PORT_FORWARD_RBAC_NAME);
    let subjects = binding.subjects.unwrap();
    assert!(subjects.iter().all(|s| s.kind == "Group"));
    let groups: Vec<&str> = subjects.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        groups,
        [
            ADDON_AGENT_GROUP,
            "system:open-cluster-management:addon:cluster-proxy"
        ]
    );
}

#[test]
fn render_refuses_an_mpc_not_read_from_the_api() {
    let mut configuration = mpc(json!({}));
    configuration.metadata.uid = None;
    assert!(render(&configuration).is_err());
}

fn lb_service(ingress: Vec<LoadBalancerIngress>) -> Service {
    Service {
        status: Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(ingress),
            }),
            ..ServiceStatus::default()
        }),
        ..Service::default()
    }
}

#[test]
fn entrypoint_address_per_type() {
    assert_eq!(
        entrypoint_address(&mpc(json!({})), None),
        Ok(Some(("proxy.example.com".to_owned(), 8091)))
    );
    assert_eq!(
        entrypoint_address(
            &mpc(
                json!({"proxyServer": {"entrypoint": {"type": "PortForward", "hostname": null, "port": 8443}}})
            ),
            None
        ),
        Ok(Some(("127.0.0.1".to_owned(), 8443)))
    );

    let lb = mpc(
        json!({"proxyServer": {"entrypoint": {"type": "LoadBalancerService", "hostname": null}}}),
    );
    assert_eq!(entrypoint_address(&lb, None), Ok(None));
    assert_eq!(entrypoint_address(&lb, Some(&lb_service(vec![]))), Ok(None));
    let ip = LoadBalancerIngress {
        ip: Some("203.0.113.7".into()),
        ..LoadBalancerIngress::default()
    };
    let hostname = LoadBalancerIngress {
        hostname: Some("abc.elb.amazonaws.com".into()),
        ..LoadBalancerIngress::default()
    };
    assert_eq!(
        entrypoint_address(&lb, Some(&lb_service(vec![ip.clone(), hostname.clone()]))),
        Ok(Some(("203.0.113.7".to_owned(), 8091)))
    );
    assert_eq!(
        entrypoint_address(&lb, Some(&lb_service(vec![hostname]))),
        Ok(Some(("abc.elb.amazonaws.com".to_owned(), 8091))),
        "a load balancer that publishes only a hostname is an address"
    );
}

#[test]
fn entrypoint_address_errors() {
    let mut missing = mpc(json!({}));
    missing.spec.proxy_server.entrypoint = None;
    assert_eq!(
        entrypoint_address(&missing, None),
        Err(EntrypointError::NotSet)
    );
    assert_eq!(
        entrypoint_address(
            &mpc(json!({"proxyServer": {"entrypoint": {"hostname": null}}})),
            None
        ),
        Err(EntrypointError::NoHostname)
    );
    assert_eq!(
        entrypoint_address(
            &mpc(json!({"proxyServer": {"entrypoint": {"port": 70000}}})),
            None
        ),
        Err(EntrypointError::BadPort(70000))
    );
}

#[test]
fn a_tls_profile_adds_its_flags_before_additional_args_and_a_template_hash() {
    use addon_manager::hub::{HubRenderOptions, TlsProfile, render_with};
    let configuration = mpc(json!({"proxyServer": {"additionalArgs": ["-v=4"]}}));
    let profile = TlsProfile::from_data(
        &[
            ("minTLSVersion".to_owned(), "VersionTLS13".to_owned()),
            (
                "cipherSuites".to_owned(),
                "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384".to_owned(),
            ),
        ]
        .into(),
    )
    .unwrap();
    let options = HubRenderOptions {
        tls_profile: profile.clone(),
        image_pull_policy: Some("Always".to_owned()),
        ..HubRenderOptions::default()
    };
    let objects = render_with(&configuration, &options).unwrap();
    assert_eq!(
        container(&objects).image_pull_policy.as_deref(),
        Some("Always")
    );
    let args = container(&objects).args.clone().unwrap();
    assert_eq!(
        &args[args.len() - 3..],
        [
            "--tls-min-version=VersionTLS13",
            "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            "-v=4"
        ]
    );
    let template = objects.deployment.spec.as_ref().unwrap().template.clone();
    let annotations = template.metadata.unwrap().annotations.unwrap();
    assert_eq!(
        annotations["proxy.open-cluster-management.io/tls-config-hash"],
        profile.hash()
    );
    // No profile: the template is what it was before profiles existed.
    let plain = render(&configuration).unwrap();
    let template = plain.deployment.spec.unwrap().template;
    assert!(template.metadata.unwrap().annotations.is_none());
}

/// The proxy-servers' OTLP export: `OTEL_*` after the server id (whose
/// name the resource attributes expand), the headers from a Secret, the CA
/// from a ConfigMap volume, and a template hash that changes with them.
#[test]
fn otlp_settings_reach_the_proxy_server_as_variables_a_volume_and_a_hash() {
    use addon_manager::hub::telemetry::ANNOTATION_OTLP_CONFIG_HASH;
    use addon_manager::hub::{HubRenderOptions, KeyRef, ProxyServerTelemetry, render_with};
    let configuration = mpc(json!({}));
    let telemetry = ProxyServerTelemetry {
        endpoint: Some("https://collector.observability:4317".to_owned()),
        sampler: Some("parentbased_traceidratio".to_owned()),
        sampler_arg: Some("0.1".to_owned()),
        resource_attributes: Some("deployment.environment=prod".to_owned()),
        compression: Some("gzip".to_owned()),
        headers_secret: Some(KeyRef {
            name: "otlp-headers".to_owned(),
            key: "headers".to_owned(),
        }),
        ca_config_map: Some(KeyRef {
            name: "otlp-ca".to_owned(),
            key: "bundle.pem".to_owned(),
        }),
    };
    let options = HubRenderOptions {
        telemetry: telemetry.clone(),
        ..HubRenderOptions::default()
    };
    let objects = render_with(&configuration, &options).unwrap();
    let env = serde_json::to_value(container(&objects).env.clone().unwrap()).unwrap();
    assert_eq!(
        env,
        json!([
            {"name": SERVER_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "https://collector.observability:4317"},
            {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
            {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "0.1"},
            {"name": "OTEL_RESOURCE_ATTRIBUTES", "value":
                "k8s.namespace.name=open-cluster-management-cluster-proxy,k8s.pod.name=$(PROXY_SERVER_ID),deployment.environment=prod"},
            {"name": "OTEL_EXPORTER_OTLP_COMPRESSION", "value": "gzip"},
            {"name": "OTEL_EXPORTER_OTLP_HEADERS", "valueFrom": {"secretKeyRef":
                {"name": "otlp-headers", "key": "headers", "optional": true}}},
            {"name": "OTEL_EXPORTER_OTLP_CERTIFICATE", "value": "/etc/otlp-ca/ca.crt"},
        ])
    );
    let pod = objects
        .deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap();
    let volume = serde_json::to_value(pod.volumes.unwrap().last().unwrap()).unwrap();
    assert_eq!(
        volume,
        json!({"name": "otlp-ca", "configMap":
            {"name": "otlp-ca", "items": [{"key": "bundle.pem", "path": "ca.crt"}]}})
    );
    let mount = serde_json::to_value(container(&objects).volume_mounts.clone().unwrap()).unwrap();
    assert_eq!(
        mount[3],
        json!({"name": "otlp-ca", "mountPath": "/etc/otlp-ca", "readOnly": true})
    );

    let hash_of = |telemetry: &ProxyServerTelemetry| {
        let options = HubRenderOptions {
            telemetry: telemetry.clone(),
            ..HubRenderOptions::default()
        };
        let objects = render_with(&configuration, &options).unwrap();
        let template = objects.deployment.spec.unwrap().template;
        template
            .metadata
            .unwrap()
            .annotations
            .and_then(|annotations| annotations.get(ANNOTATION_OTLP_CONFIG_HASH).cloned())
    };
    let hash = hash_of(&telemetry).expect("a hash while exporting");
    assert_eq!(hash.len(), 16);
    assert_eq!(hash_of(&telemetry).as_ref(), Some(&hash), "stable");
    for changed in [
        ProxyServerTelemetry {
            endpoint: Some("https://other.observability:4317".to_owned()),
            ..telemetry.clone()
        },
        ProxyServerTelemetry {
            sampler_arg: Some("0.5".to_owned()),
            ..telemetry.clone()
        },
        ProxyServerTelemetry {
            headers_secret: Some(KeyRef {
                name: "otlp-headers".to_owned(),
                key: "other".to_owned(),
            }),
            ..telemetry.clone()
        },
        ProxyServerTelemetry {
            ca_config_map: None,
            ..telemetry.clone()
        },
    ] {
        let other = hash_of(&changed).expect("a hash");
        assert_ne!(other, hash, "{changed:?}");
    }
    // Off: the pod template is what it was before the proxy-servers exported.
    assert_eq!(hash_of(&ProxyServerTelemetry::default()), None);
    let off = render_with(&configuration, &HubRenderOptions::default()).unwrap();
    assert_eq!(off, render(&configuration).unwrap());
    assert_eq!(container(&off).env.as_ref().unwrap().len(), 1);
    assert_eq!(container(&off).volume_mounts.as_ref().unwrap().len(), 3);
}

/// With both, the TLS profile's and the OTLP hash sit side by side.
#[test]
fn the_tls_and_otlp_hashes_are_both_kept() {
    use addon_manager::hub::{HubRenderOptions, ProxyServerTelemetry, TlsProfile, render_with};
    let options = HubRenderOptions {
        tls_profile: TlsProfile {
            min_version: Some("VersionTLS13".to_owned()),
            cipher_suites: Vec::new(),
        },
        telemetry: ProxyServerTelemetry {
            endpoint: Some("http://collector:4317".to_owned()),
            ..ProxyServerTelemetry::default()
        },
        ..HubRenderOptions::default()
    };
    let objects = render_with(&mpc(json!({})), &options).unwrap();
    let annotations = objects
        .deployment
        .spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap();
    let keys: Vec<&str> = annotations.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "proxy.open-cluster-management.io/otlp-config-hash",
            "proxy.open-cluster-management.io/tls-config-hash"
        ]
    );
}

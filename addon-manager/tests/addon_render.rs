//! Rendering of the agent's objects: the contract with OCM's names and with
//! the local environment, which starts the agents from these exact fields.

use addon_manager::addon::customize::{AgentCustomization, CustomizationError};
use addon_manager::addon::install::cluster_management_addon;
use addon_manager::addon::render::{
    self, AgentInputs, Entrypoint, EntrypointError, ServiceProxyInputs, hub_agent_rbac,
    manifest_work, registrations, signer_organization_unit,
};
use addon_manager::addon::{AddonSettings, InstallStrategy};
use cluster_proxy_proto::api::addon::v1alpha1::{AddOnDeploymentConfig, ClusterManagementAddOn};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::identity::ClusterName;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, ResourceRequirements, Service};
use serde_json::{Value, json};

const CA: &[u8] = b"-----BEGIN CERTIFICATE-----\nMIIBhub\n-----END CERTIFICATE-----\n";

fn mpc(entrypoint: Value) -> ManagedProxyConfiguration {
    serde_json::from_value(json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": "cluster-proxy", "generation": 7, "uid": "mpc-uid"},
        "spec": {
            "authentication": {},
            "proxyServer": {
                "image": "registry.local/cluster-proxy:1",
                "namespace": "open-cluster-management-addon",
                "entrypoint": entrypoint,
            },
            "proxyAgent": {
                "image": "registry.local/cluster-proxy:1",
                "replicas": 2,
                "additionalArgs": ["--keepalive-time=30s"],
                "imagePullSecrets": ["pull-secret"],
            },
        },
    }))
    .expect("MPC fixture parses")
}

fn hostname_mpc() -> ManagedProxyConfiguration {
    mpc(json!({"type": "Hostname", "hostname": {"value": "proxy.hub.example"}, "port": 443}))
}

fn adc(spec: Value) -> AddOnDeploymentConfig {
    serde_json::from_value(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "AddOnDeploymentConfig",
        "metadata": {"name": "tuned", "namespace": "cluster-a"},
        "spec": spec,
    }))
    .expect("ADC fixture parses")
}

struct Rendered {
    work: Value,
}

impl Rendered {
    fn new(
        mpc: &ManagedProxyConfiguration,
        adc: Option<&AddOnDeploymentConfig>,
        ca: &[u8],
    ) -> Self {
        Self::for_cluster(mpc, adc, None, ca)
    }

    fn for_cluster(
        mpc: &ManagedProxyConfiguration,
        adc: Option<&AddOnDeploymentConfig>,
        managed_cluster: Option<&ManagedCluster>,
        ca: &[u8],
    ) -> Self {
        Self::with_kube_api_proxy(mpc, adc, managed_cluster, ca, true)
    }

    fn with_kube_api_proxy(
        mpc: &ManagedProxyConfiguration,
        adc: Option<&AddOnDeploymentConfig>,
        managed_cluster: Option<&ManagedCluster>,
        ca: &[u8],
        kube_api_proxy: bool,
    ) -> Self {
        Self::with_service_proxy(mpc, adc, managed_cluster, ca, kube_api_proxy, None)
    }

    /// With a service-proxy (certificate and key PEM) when given; its
    /// impersonation as the ADC says.
    fn with_service_proxy(
        mpc: &ManagedProxyConfiguration,
        adc: Option<&AddOnDeploymentConfig>,
        managed_cluster: Option<&ManagedCluster>,
        ca: &[u8],
        kube_api_proxy: bool,
        service_proxy: Option<(&[u8], &[u8])>,
    ) -> Self {
        let cluster = ClusterName::new("cluster-a").unwrap();
        let entrypoint = render::entrypoint(mpc, None).unwrap();
        let customization =
            AgentCustomization::new(&mpc.spec.proxy_agent.image, adc, managed_cluster).unwrap();
        let inputs = AgentInputs {
            cluster: &cluster,
            install_namespace: "open-cluster-management-cluster-proxy",
            mpc,
            deployment_config: adc,
            entrypoint: &entrypoint,
            ca_pem: ca,
            customization: &customization,
            kube_api_proxy,
            network_policy: None,
            image_pull_policy: None,
            service_proxy: service_proxy
                .map(|(cert_pem, key_pem)| ServiceProxyInputs { cert_pem, key_pem }),
            impersonation: render::impersonation(adc).unwrap(),
        };
        let work = manifest_work(&inputs, None).unwrap();
        Rendered {
            work: serde_json::to_value(&work).unwrap(),
        }
    }

    fn manifests(&self) -> &Vec<Value> {
        self.work["spec"]["workload"]["manifests"]
            .as_array()
            .unwrap()
    }

    fn manifest(&self, kind: &str, name: &str) -> &Value {
        self.manifests()
            .iter()
            .find(|m| m["kind"] == kind && m["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in the work"))
    }

    fn deployment(&self) -> Deployment {
        serde_json::from_value(
            self.manifest("Deployment", "cluster-proxy-proxy-agent")
                .clone(),
        )
        .unwrap()
    }

    fn container(&self, name: &str) -> Container {
        self.deployment()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .containers
            .into_iter()
            .find(|c| c.name == name)
            .unwrap()
    }
}

/// Regression (issue 56): the work said `Foreground` for everything, and the
/// work agent (which never reads the `deletion-orphan` annotation) deleted
/// the agent Namespace on uninstall. The addon framework turns that
/// annotation into `SelectivelyOrphan` rules; so do we.
#[test]
fn work_is_named_labelled_and_orphans_the_agent_namespace() {
    let rendered = Rendered::new(&hostname_mpc(), None, CA);
    let work = &rendered.work;
    assert_eq!(work["apiVersion"], "work.open-cluster-management.io/v1");
    assert_eq!(work["kind"], "ManifestWork");
    assert_eq!(work["metadata"]["name"], "addon-cluster-proxy-deploy-0");
    assert_eq!(work["metadata"]["namespace"], "cluster-a");
    assert_eq!(
        work["metadata"]["labels"]["open-cluster-management.io/addon-name"],
        "cluster-proxy"
    );
    let namespace = rendered
        .manifests()
        .iter()
        .find(|m| m["kind"] == "Namespace")
        .map(|m| m["metadata"]["name"].clone())
        .expect("a Namespace manifest");
    assert_eq!(
        work["spec"]["deleteOption"],
        json!({"propagationPolicy": "SelectivelyOrphan", "selectivelyOrphans": {"orphaningRules": [
            {"group": "", "resource": "namespaces", "name": namespace, "namespace": ""}
        ]}})
    );
    let kinds: Vec<(String, String)> = rendered
        .manifests()
        .iter()
        .map(|m| {
            (
                m["kind"].as_str().unwrap().to_owned(),
                m["metadata"]["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected = [
        ("Namespace", "open-cluster-management-cluster-proxy"),
        ("ServiceAccount", "cluster-proxy"),
        ("Secret", "cluster-proxy-ca"),
        ("Service", "cluster-a"),
        ("Role", "cluster-proxy-addon-agent"),
        ("RoleBinding", "cluster-proxy-addon-agent"),
        ("Deployment", "cluster-proxy-proxy-agent"),
    ];
    assert_eq!(
        kinds,
        expected
            .iter()
            .map(|(k, n)| ((*k).to_owned(), (*n).to_owned()))
            .collect::<Vec<_>>()
    );
    for manifest in rendered
        .manifests()
        .iter()
        .filter(|m| m["kind"] != "Namespace")
    {
        assert_eq!(
            manifest["metadata"]["namespace"],
            "open-cluster-management-cluster-proxy"
        );
    }
    let namespace = rendered.manifest("Namespace", "open-cluster-management-cluster-proxy");
    assert_eq!(
        namespace["metadata"]["annotations"]["addon.open-cluster-management.io/deletion-orphan"],
        ""
    );
}

#[test]
fn proxy_agent_container_follows_the_fixed_contract() {
    let rendered = Rendered::new(&hostname_mpc(), None, CA);
    let agent = rendered.container("proxy-agent");
    let hashed = ClusterName::new("cluster-a").unwrap().service_proxy_host();
    assert!(hashed.starts_with("cluster-") && hashed.ends_with(".open-cluster-management.proxy"));
    let identifiers = format!(
        "--agent-identifiers=host={hashed}&host=cluster-a&host=cluster-a.open-cluster-management-cluster-proxy"
    );
    assert_eq!(
        agent.image.as_deref(),
        Some("registry.local/cluster-proxy:1")
    );
    assert_eq!(agent.command, Some(vec!["/proxy-agent".to_owned()]));
    assert_eq!(
        agent.args.unwrap(),
        vec![
            "--proxy-server-host=proxy.hub.example",
            "--proxy-server-port=443",
            "--ca-cert=/etc/ca/ca.crt",
            "--agent-cert=/etc/tls/tls.crt",
            "--agent-key=/etc/tls/tls.key",
            identifiers.as_str(),
            "--keepalive-time=30s",
        ]
    );
    let mounts: Vec<(String, String)> = agent
        .volume_mounts
        .unwrap()
        .into_iter()
        .map(|m| (m.name, m.mount_path))
        .collect();
    assert_eq!(
        mounts,
        vec![
            ("ca".into(), "/etc/ca".into()),
            ("tls".into(), "/etc/tls".into())
        ]
    );
    let readiness = agent.readiness_probe.unwrap().http_get.unwrap();
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
    assert_eq!(
        readiness.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8093)
    );
    let liveness = agent.liveness_probe.unwrap().http_get.unwrap();
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));
    assert_eq!(
        liveness.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8093)
    );
    assert!(agent.env.is_none(), "no proxy env without an ADC");
}

#[test]
fn hashed_host_is_upstreams() {
    // Reference §5 example.
    assert_eq!(
        ClusterName::new("loopback").unwrap().service_proxy_host(),
        "cluster-64edaa3fb9310e98cdb183cddbf156d9964a05c017fa7f8e.open-cluster-management.proxy"
    );
}

#[test]
fn addon_agent_container_and_pod() {
    let rendered = Rendered::new(&hostname_mpc(), None, CA);
    let addon = rendered.container("addon-agent");
    assert_eq!(
        addon.image.as_deref(),
        Some("registry.local/cluster-proxy:1")
    );
    assert_eq!(addon.command, Some(vec!["/addon-agent".to_owned()]));
    assert_eq!(
        addon.args.unwrap(),
        vec![
            "--hub-kubeconfig=/etc/kubeconfig/kubeconfig",
            "--cluster-name=cluster-a",
            "--lease-name=cluster-proxy"
        ]
    );
    let env = addon.env.unwrap();
    assert_eq!(env[0].name, "POD_NAMESPACE");
    assert_eq!(
        env[0]
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "metadata.namespace"
    );
    let mounts = addon.volume_mounts.unwrap();
    assert_eq!(
        (mounts[0].name.as_str(), mounts[0].mount_path.as_str()),
        ("hub-kubeconfig", "/etc/kubeconfig")
    );

    let deployment = rendered.deployment();
    let labels = deployment.metadata.labels.clone().unwrap();
    assert_eq!(labels["open-cluster-management.io/addon"], "cluster-proxy");
    assert_eq!(
        labels["proxy.open-cluster-management.io/component-name"],
        "proxy-agent"
    );
    assert_eq!(
        deployment.metadata.annotations.clone().unwrap()["proxy.open-cluster-management.io/configuration-generation"],
        "7"
    );
    let spec = deployment.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    assert_eq!(spec.selector.match_labels, Some(labels.clone()));
    let template_meta = spec.template.metadata.unwrap();
    assert_eq!(template_meta.labels, Some(labels));
    assert_eq!(
        template_meta.annotations.unwrap()["proxy.open-cluster-management.io/configuration-generation"],
        "7"
    );
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("cluster-proxy"));
    assert_eq!(pod.image_pull_secrets.unwrap()[0].name, "pull-secret");
    let tolerations = pod.tolerations.unwrap();
    assert_eq!(tolerations, render::default_tolerations());
    assert!(pod.node_selector.is_none());
    let volumes: Vec<(String, String)> = pod
        .volumes
        .unwrap()
        .into_iter()
        .map(|v| (v.name, v.secret.unwrap().secret_name.unwrap()))
        .collect();
    assert_eq!(
        volumes,
        vec![
            ("ca".into(), "cluster-proxy-ca".into()),
            (
                "tls".into(),
                "cluster-proxy-open-cluster-management.io-proxy-agent-signer-client-cert".into()
            ),
            (
                "hub-kubeconfig".into(),
                "cluster-proxy-hub-kubeconfig".into()
            ),
        ]
    );
    for container in &pod.containers {
        let security = container.security_context.clone().unwrap();
        assert_eq!(security.run_as_non_root, Some(true));
        assert_eq!(security.run_as_user, Some(65532));
        assert_eq!(security.read_only_root_filesystem, Some(true));
        assert_eq!(
            security.capabilities.unwrap().drop,
            Some(vec!["ALL".to_owned()])
        );
    }
}

#[test]
fn ca_secret_service_and_rbac() {
    let rendered = Rendered::new(&hostname_mpc(), None, CA);
    let secret = rendered.manifest("Secret", "cluster-proxy-ca");
    let encoded = secret["data"]["ca.crt"].as_str().unwrap();
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .unwrap();
    assert_eq!(decoded, CA);

    let service: Service =
        serde_json::from_value(rendered.manifest("Service", "cluster-a").clone()).unwrap();
    let spec = service.spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ExternalName"));
    assert_eq!(
        spec.external_name.as_deref(),
        Some("kubernetes.default.svc.cluster.local")
    );

    let role = rendered.manifest("Role", "cluster-proxy-addon-agent");
    assert_eq!(
        role["rules"][0]["apiGroups"],
        json!(["coordination.k8s.io"])
    );
    assert_eq!(role["rules"][0]["resources"], json!(["leases"]));
    assert_eq!(role["rules"][0]["verbs"], json!(["*"]));
    let binding = rendered.manifest("RoleBinding", "cluster-proxy-addon-agent");
    assert_eq!(binding["roleRef"]["name"], "cluster-proxy-addon-agent");
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "cluster-proxy", "namespace": "open-cluster-management-cluster-proxy"}])
    );
}

#[test]
fn deployment_config_reaches_the_agent() {
    let proxy_ca = b"-----BEGIN CERTIFICATE-----\nMIIproxy\n-----END CERTIFICATE-----\n";
    use base64::Engine;
    let config = adc(json!({
        "nodePlacement": {
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "node-role.kubernetes.io/infra", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "proxyConfig": {
            "httpProxy": "http://proxy.corp:3128",
            "httpsProxy": "https://proxy.corp:3129",
            "noProxy": "10.0.0.0/8,.svc",
            "caBundle": base64::engine::general_purpose::STANDARD.encode(proxy_ca),
        },
        "customizedVariables": [{"name": "serviceDomain", "value": "svc.corp.local"}],
    }));
    let rendered = Rendered::new(&hostname_mpc(), Some(&config), CA);
    let pod = rendered.deployment().spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.node_selector.unwrap()["kubernetes.io/os"], "linux");
    let tolerations = pod.tolerations.unwrap();
    assert_eq!(
        tolerations.len(),
        1,
        "the ADC's tolerations replace the defaults"
    );
    assert_eq!(
        tolerations[0].key.as_deref(),
        Some("node-role.kubernetes.io/infra")
    );

    let env: Vec<(String, String)> = rendered
        .container("proxy-agent")
        .env
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap()))
        .collect();
    assert_eq!(
        env,
        vec![
            ("HTTP_PROXY".into(), "http://proxy.corp:3128".into()),
            ("HTTPS_PROXY".into(), "https://proxy.corp:3129".into()),
            ("NO_PROXY".into(), "10.0.0.0/8,.svc".into()),
        ]
    );
    // The addon-agent reaches the hub API through the same proxy.
    let addon_env: Vec<String> = rendered
        .container("addon-agent")
        .env
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(
        addon_env,
        ["POD_NAMESPACE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"]
    );
    for container in ["proxy-agent", "addon-agent"] {
        let container = rendered.container(container);
        assert!(
            container
                .args
                .unwrap()
                .contains(&"--proxy-ca-cert=/etc/ca/proxy-ca.crt".to_owned()),
            "{:?}",
            container.name
        );
        assert!(
            container
                .volume_mounts
                .unwrap()
                .iter()
                .any(|m| m.name == "ca" && m.mount_path == "/etc/ca"),
            "{:?}",
            container.name
        );
    }

    let service: Service =
        serde_json::from_value(rendered.manifest("Service", "cluster-a").clone()).unwrap();
    assert_eq!(
        service.spec.unwrap().external_name.as_deref(),
        Some("kubernetes.default.svc.corp.local")
    );
    let secret = rendered.manifest("Secret", "cluster-proxy-ca");
    let key = |key: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(secret["data"][key].as_str().unwrap())
            .unwrap()
    };
    assert_eq!(key("ca.crt"), CA, "the proxy's CA never verifies the hub");
    assert_eq!(key("proxy-ca.crt"), proxy_ca);
}

fn managed_cluster(annotations: Value) -> ManagedCluster {
    serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1",
        "kind": "ManagedCluster",
        "metadata": {"name": "cluster-a", "annotations": annotations},
        "spec": {"hubAcceptsClient": true},
    }))
    .expect("ManagedCluster fixture parses")
}

fn quantities(resources: &ResourceRequirements) -> Value {
    serde_json::to_value(resources).unwrap()
}

#[test]
fn resource_requirements_reach_the_containers_they_match() {
    // Upstream's example ID first, then rules that overlap: for each
    // container the last matching rule wins, as in the addon framework.
    let config = adc(json!({"resourceRequirements": [
        {"containerID": "*:*:*", "resources": {"requests": {"memory": "64Mi"}}},
        {"containerID": "deployments:cluster-proxy-proxy-agent:proxy-agent",
         "resources": {"requests": {"cpu": "150m", "memory": "250Mi"},
                       "limits": {"cpu": "1", "memory": "512Mi"}}},
        {"containerID": "deployments:some-other-addon:addon-agent",
         "resources": {"limits": {"cpu": "5"}}},
        {"containerID": "statefulsets:*:*", "resources": {"limits": {"cpu": "7"}}},
    ]}));
    let rendered = Rendered::new(&hostname_mpc(), Some(&config), CA);
    assert_eq!(
        quantities(&rendered.container("proxy-agent").resources.unwrap()),
        json!({"requests": {"cpu": "150m", "memory": "250Mi"},
               "limits": {"cpu": "1", "memory": "512Mi"}})
    );
    assert_eq!(
        quantities(&rendered.container("addon-agent").resources.unwrap()),
        json!({"requests": {"memory": "64Mi"}}),
        "only the wildcard rule matches the addon-agent"
    );

    // A part may be a regular expression; an alternation stays in its part.
    let config = adc(json!({"resourceRequirements": [
        {"containerID": "deployments:cluster-proxy-.*:proxy-agent|addon-agent",
         "resources": {"limits": {"memory": "300Mi"}}},
    ]}));
    let rendered = Rendered::new(&hostname_mpc(), Some(&config), CA);
    for container in ["proxy-agent", "addon-agent"] {
        assert_eq!(
            quantities(&rendered.container(container).resources.unwrap()),
            json!({"limits": {"memory": "300Mi"}}),
            "{container}"
        );
    }

    // Without a rule (or an ADC) the containers carry no resources, as upstream's chart.
    let rendered = Rendered::new(&hostname_mpc(), None, CA);
    assert!(rendered.container("proxy-agent").resources.is_none());
    assert!(rendered.container("addon-agent").resources.is_none());
    let untouched = Rendered::new(
        &hostname_mpc(),
        Some(&adc(json!({"resourceRequirements": [
            {"containerID": "deployments:cluster-proxy-proxy-agent:service-proxy",
             "resources": {"limits": {"cpu": "1"}}},
        ]}))),
        CA,
    );
    assert!(untouched.container("proxy-agent").resources.is_none());
}

#[test]
fn malformed_container_ids_are_refused_with_the_entry() {
    let image = "registry.local/cluster-proxy:1";
    let refused = |id: &str| {
        let config = adc(json!({"resourceRequirements": [
            {"containerID": "*:*:*", "resources": {}},
            {"containerID": id, "resources": {"limits": {"cpu": "1"}}},
        ]}));
        AgentCustomization::new(image, Some(&config), None).unwrap_err()
    };
    for id in [
        "proxy-agent",
        "deployments:cluster-proxy-proxy-agent",
        "a:b:c:d",
        "deployments::proxy-agent",
    ] {
        assert_eq!(
            refused(id),
            CustomizationError::ContainerIdShape {
                index: 1,
                id: id.to_owned()
            },
            "{id}"
        );
    }
    let error = refused("deployments:cluster-proxy-(:proxy-agent");
    assert!(
        matches!(
            &error,
            CustomizationError::ContainerIdPattern { index: 1, .. }
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains("resourceRequirements[1].containerID"),
        "{error}"
    );
}

#[test]
fn image_registries_mirror_the_agent_image() {
    let mirrors = |registries: Value| {
        json!({
            "open-cluster-management.io/image-registries": registries.to_string(),
        })
    };
    let images = |rendered: &Rendered| {
        ["proxy-agent", "addon-agent"].map(|name| rendered.container(name).image.unwrap())
    };

    // The ManagedCluster's annotation moves both containers to the mirror.
    let cluster = managed_cluster(mirrors(json!({
        "pullSecret": "open-cluster-management.pull-secret",
        "registries": [{"source": "registry.local", "mirror": "mirror.corp:5000/ocm"}],
    })));
    let rendered = Rendered::for_cluster(&hostname_mpc(), None, Some(&cluster), CA);
    assert_eq!(
        images(&rendered),
        ["mirror.corp:5000/ocm/cluster-proxy:1"; 2]
    );

    // An ADC's registries take precedence when they change the image...
    let config = adc(json!({"registries": [{"source": "registry.local", "mirror": "adc.corp"}]}));
    let rendered = Rendered::for_cluster(&hostname_mpc(), Some(&config), Some(&cluster), CA);
    assert_eq!(images(&rendered), ["adc.corp/cluster-proxy:1"; 2]);
    // ...and leave it to the annotation when none of them matches.
    let config = adc(json!({"registries": [{"source": "quay.io", "mirror": "adc.corp"}]}));
    let rendered = Rendered::for_cluster(&hostname_mpc(), Some(&config), Some(&cluster), CA);
    assert_eq!(
        images(&rendered),
        ["mirror.corp:5000/ocm/cluster-proxy:1"; 2]
    );

    // No matching source, no annotation, an empty annotation: the MPC's image.
    for annotations in [
        mirrors(json!({"registries": [{"source": "quay.io", "mirror": "elsewhere"}]})),
        json!({}),
        json!({"open-cluster-management.io/image-registries": ""}),
    ] {
        let cluster = managed_cluster(annotations.clone());
        let rendered = Rendered::for_cluster(&hostname_mpc(), None, Some(&cluster), CA);
        assert_eq!(
            images(&rendered),
            ["registry.local/cluster-proxy:1"; 2],
            "{annotations}"
        );
    }

    // An annotation that is not the expected JSON is an error, not ignored.
    for broken in ["{not json", r#"{"registries": "mirror.corp"}"#] {
        let cluster =
            managed_cluster(json!({"open-cluster-management.io/image-registries": broken}));
        let error = AgentCustomization::new("registry.local/cluster-proxy:1", None, Some(&cluster))
            .unwrap_err();
        assert!(
            matches!(error, CustomizationError::ImageRegistries { .. }),
            "{broken}: {error:?}"
        );
        assert!(
            error
                .to_string()
                .contains("open-cluster-management.io/image-registries")
        );
    }
}

#[test]
fn a_local_clusters_node_selector_annotation_places_its_agent() {
    let local = |annotation: &str| -> ManagedCluster {
        let mut cluster =
            managed_cluster(json!({"open-cluster-management/nodeSelector": annotation}));
        cluster.metadata.labels = Some([("local-cluster".to_owned(), "true".to_owned())].into());
        cluster
    };
    let selector = |rendered: &Rendered| {
        rendered
            .deployment()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .node_selector
    };
    let hub_itself = local(r#"{"node-role.kubernetes.io/infra": ""}"#);
    let rendered = Rendered::for_cluster(&hostname_mpc(), None, Some(&hub_itself), CA);
    assert_eq!(
        selector(&rendered),
        Some([("node-role.kubernetes.io/infra".to_owned(), String::new())].into())
    );

    // An ADC's own node selector takes precedence.
    let config = adc(json!({"nodePlacement": {"nodeSelector": {"kubernetes.io/os": "linux"}}}));
    let rendered = Rendered::for_cluster(&hostname_mpc(), Some(&config), Some(&hub_itself), CA);
    assert_eq!(
        selector(&rendered),
        Some([("kubernetes.io/os".to_owned(), "linux".to_owned())].into())
    );

    // Only the local cluster's annotation counts; an empty object is no selector.
    let remote = managed_cluster(json!({"open-cluster-management/nodeSelector": r#"{"a": "b"}"#}));
    let rendered = Rendered::for_cluster(&hostname_mpc(), None, Some(&remote), CA);
    assert_eq!(selector(&rendered), None);
    let rendered = Rendered::for_cluster(&hostname_mpc(), None, Some(&local("{}")), CA);
    assert_eq!(selector(&rendered), None);

    for broken in ["node-role=infra", r#"{"zone": 3}"#] {
        let error =
            AgentCustomization::new("registry.local/cluster-proxy:1", None, Some(&local(broken)))
                .unwrap_err();
        assert!(
            matches!(error, CustomizationError::NodeSelector { .. }),
            "{broken}: {error:?}"
        );
    }
}

#[test]
fn without_a_proxy_ca_the_agents_get_no_proxy_ca_flag_or_key() {
    let config = adc(json!({"proxyConfig": {"httpsProxy": "http://proxy.corp:3128"}}));
    let rendered = Rendered::new(&hostname_mpc(), Some(&config), CA);
    for container in ["proxy-agent", "addon-agent"] {
        let args = rendered.container(container).args.unwrap();
        assert!(
            !args.iter().any(|a| a.starts_with("--proxy-ca-cert")),
            "{args:?}"
        );
    }
    let secret = rendered.manifest("Secret", "cluster-proxy-ca");
    assert!(secret["data"].get("proxy-ca.crt").is_none(), "{secret}");
    assert_eq!(
        rendered
            .container("addon-agent")
            .volume_mounts
            .unwrap()
            .len(),
        1,
        "only the hub kubeconfig"
    );
}

#[test]
fn an_adc_variable_turns_on_the_websocket_transport_for_its_cluster() {
    let websocket =
        adc(json!({"customizedVariables": [{"name": "agentTransport", "value": "websocket"}]}));
    let mut mpc = hostname_mpc();
    mpc.spec.proxy_agent.additional_args = vec!["--transport=auto".into()];
    let rendered = Rendered::new(&mpc, Some(&websocket), CA);
    let args = rendered.container("proxy-agent").args.unwrap();
    assert_eq!(
        args.last().map(String::as_str),
        Some("--transport=websocket"),
        "the cluster's choice comes after the fleet's additionalArgs: {args:?}"
    );
    for value in ["auto", ""] {
        let default =
            adc(json!({"customizedVariables": [{"name": "agentTransport", "value": value}]}));
        assert_eq!(render::agent_transport(Some(&default)), Ok(None));
        let args = Rendered::new(&hostname_mpc(), Some(&default), CA)
            .container("proxy-agent")
            .args
            .unwrap();
        assert!(
            !args.iter().any(|a| a.starts_with("--transport")),
            "{args:?}"
        );
    }
    let wrong = adc(json!({"customizedVariables": [{"name": "agentTransport", "value": "grpc"}]}));
    let err = render::agent_transport(Some(&wrong)).unwrap_err();
    assert!(
        err.contains("agentTransport") && err.contains("\"grpc\""),
        "{err}"
    );
}

fn adc_variables(pairs: &[(&str, &str)]) -> AddOnDeploymentConfig {
    let variables: Vec<Value> = pairs
        .iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect();
    adc(json!({ "customizedVariables": variables }))
}

/// A cluster's tracing variables become proxy-agent flags after the
/// fleet's additionalArgs (an MPC-wide `--otlp-endpoint` or
/// `--trace-relay`), so the cluster's choice wins; only the proxy-agent,
/// the one agent container that exports, gets them.
#[test]
fn adc_tracing_variables_render_agent_flags_that_win_over_the_mpc() {
    let config = adc_variables(&[
        ("otlpEndpoint", "http://otel-collector.observability:4317"),
        ("otlpSampler", "parentbased_traceidratio"),
        ("otlpSamplerArg", "0.2"),
        ("traceRelay", "off"),
    ]);
    let mut mpc = hostname_mpc();
    mpc.spec.proxy_agent.additional_args = vec![
        "--otlp-endpoint=http://fleet-collector:4317".into(),
        "--trace-relay=auto".into(),
    ];
    let rendered = Rendered::new(&mpc, Some(&config), CA);
    let args = rendered.container("proxy-agent").args.unwrap();
    let fleet = args
        .iter()
        .position(|a| a == "--otlp-endpoint=http://fleet-collector:4317")
        .expect("the fleet's flag stays");
    assert_eq!(
        &args[fleet + 2..],
        [
            "--otlp-endpoint=http://otel-collector.observability:4317",
            "--otel-traces-sampler=parentbased_traceidratio",
            "--otel-traces-sampler-arg=0.2",
            "--trace-relay=off",
        ],
        "{args:?}"
    );
    let addon_agent = serde_json::to_string(&rendered.container("addon-agent")).unwrap();
    assert!(
        !addon_agent.contains("otlp") && !addon_agent.contains("trace-relay"),
        "{addon_agent}"
    );

    // Unset, empty or `auto`: nothing is rendered, the agent's defaults hold
    // (no collector: spans go home through the tunnel).
    for config in [
        None,
        Some(adc_variables(&[])),
        Some(adc_variables(&[
            ("otlpEndpoint", ""),
            ("otlpSampler", " "),
            ("traceRelay", "auto"),
        ])),
    ] {
        let args = Rendered::new(&hostname_mpc(), config.as_ref(), CA)
            .container("proxy-agent")
            .args
            .unwrap();
        assert!(
            !args.iter().any(|a| a.starts_with("--otlp")
                || a.starts_with("--otel")
                || a.starts_with("--trace-relay")),
            "{args:?}"
        );
    }
}

/// What the agent would refuse at start-up is refused before it reaches the
/// cluster, naming the variable and the value.
#[test]
fn invalid_adc_tracing_variables_are_refused_naming_them() {
    for (pairs, wanted) in [
        (
            &[("otlpEndpoint", "otel-collector:4317")][..],
            "otlpEndpoint=\"otel-collector:4317\"",
        ),
        (
            &[("otlpEndpoint", "ftp://collector:4317")][..],
            "otlpEndpoint",
        ),
        (
            &[("otlpSampler", "sometimes")][..],
            "otlpSampler=\"sometimes\"",
        ),
        (
            &[("otlpSampler", "traceidratio"), ("otlpSamplerArg", "1.5")][..],
            "otlpSamplerArg=\"1.5\"",
        ),
        (
            &[("traceRelay", "on")][..],
            "traceRelay=\"on\" is not auto or off",
        ),
        (
            &[("otlpEndpoint", "https://collector:4317")][..],
            "an https collector needs a CA",
        ),
    ] {
        let err = render::agent_telemetry(Some(&adc_variables(pairs))).expect_err(wanted);
        assert!(err.contains(wanted), "{pairs:?}: {err}");
    }
    assert_eq!(
        render::agent_telemetry(None),
        Ok(render::AgentTelemetry::default())
    );
}

/// With NetworkPolicies on, the cluster's collector is let out.
#[test]
fn the_network_policy_lets_the_clusters_collector_out() {
    let ports = |pairs: &[(&str, &str)]| render::egress_ports(Some(&adc_variables(pairs)));
    assert_eq!(ports(&[("otlpEndpoint", "http://collector:4317")]), [4317]);
    assert_eq!(ports(&[("otlpEndpoint", "http://collector.example")]), [80]);
    assert_eq!(
        ports(&[("otlpEndpoint", "http://[fd00::1]:14317")]),
        [14317]
    );
    assert!(ports(&[("otlpEndpoint", "not a url")]).is_empty());
    let both = adc(json!({
        "proxyConfig": {"httpsProxy": "http://proxy.corp:3128"},
        "customizedVariables": [{"name": "otlpEndpoint", "value": "http://collector:4317"}],
    }));
    assert_eq!(render::egress_ports(Some(&both)), [3128, 4317]);
}

#[test]
fn the_network_policy_lets_the_adc_proxies_out() {
    let config = adc(json!({"proxyConfig": {
        "httpProxy": "http://proxy.corp:3128",
        "httpsProxy": "https://user:pw@proxy.corp:3129",
        "noProxy": ".svc",
    }}));
    assert_eq!(render::proxy_ports(Some(&config)), [3128, 3129]);
    let socks = adc(json!({"proxyConfig": {"httpsProxy": "socks5h://proxy.corp"}}));
    assert_eq!(render::proxy_ports(Some(&socks)), [1080]);
    let broken = adc(json!({"proxyConfig": {"httpsProxy": "gopher://x"}}));
    assert!(render::proxy_ports(Some(&broken)).is_empty());
    assert!(render::proxy_ports(None).is_empty());
    let policy = render::agent_network_policy("ns", 8091, &[443, 6443], &[3128, 443]);
    let ports: Vec<String> = policy.spec.unwrap().egress.unwrap()[1]
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| format!("{:?}", p.port))
        .collect();
    assert_eq!(
        ports,
        [
            "Some(Int(443))",
            "Some(Int(6443))",
            "Some(Int(3128))",
            "Some(Int(8091))"
        ]
    );
}

#[test]
fn the_port_forward_entrypoint_turns_on_the_addon_agents_proxy() {
    let rendered = Rendered::new(&mpc(json!({"type": "PortForward"})), None, CA);
    let proxy_agent = rendered.container("proxy-agent").args.unwrap();
    assert!(proxy_agent.contains(&"--proxy-server-host=127.0.0.1".to_owned()));
    assert!(proxy_agent.contains(&"--proxy-server-port=8091".to_owned()));
    assert_eq!(
        rendered.container("addon-agent").args.unwrap(),
        vec![
            "--hub-kubeconfig=/etc/kubeconfig/kubeconfig",
            "--cluster-name=cluster-a",
            "--lease-name=cluster-proxy",
            "--proxy-server-namespace=open-cluster-management-addon",
            "--enable-port-forward-proxy=true",
            "--port-forward-proxy-address=127.0.0.1:8091",
        ]
    );
    // Another port: the proxy listens where the proxy-agent dials.
    let other_port = Rendered::new(&mpc(json!({"type": "PortForward", "port": 8443})), None, CA);
    assert!(
        other_port
            .container("addon-agent")
            .args
            .unwrap()
            .contains(&"--port-forward-proxy-address=127.0.0.1:8443".to_owned())
    );
}

#[test]
fn entrypoints() {
    let port_forward = mpc(json!({"type": "PortForward"}));
    assert_eq!(
        render::entrypoint(&port_forward, None).unwrap(),
        Entrypoint {
            host: "127.0.0.1".into(),
            port: 8091
        }
    );
    let zero_port = mpc(json!({"type": "Hostname", "hostname": {"value": "h.example"}, "port": 0}));
    assert_eq!(render::entrypoint(&zero_port, None).unwrap().port, 8091);

    let lb = mpc(json!({"type": "LoadBalancerService", "loadBalancerService": {"name": "lb"}}));
    assert_eq!(
        render::load_balancer_service(&lb),
        Some(("open-cluster-management-addon".into(), "lb".into()))
    );
    assert!(matches!(
        render::entrypoint(&lb, None),
        Err(EntrypointError::LoadBalancerMissing { .. })
    ));
    let pending: Service =
        serde_json::from_value(json!({"metadata": {"name": "lb"}, "status": {"loadBalancer": {}}}))
            .unwrap();
    assert!(matches!(
        render::entrypoint(&lb, Some(&pending)),
        Err(EntrypointError::LoadBalancerPending { .. })
    ));
    let by_ip: Service = serde_json::from_value(json!({"metadata": {"name": "lb"}, "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}})).unwrap();
    assert_eq!(
        render::entrypoint(&lb, Some(&by_ip)).unwrap().host,
        "203.0.113.9"
    );
    let by_hostname: Service = serde_json::from_value(json!({"metadata": {"name": "lb"}, "status": {"loadBalancer": {"ingress": [{"hostname": "a1.elb.example"}]}}})).unwrap();
    assert_eq!(
        render::entrypoint(&lb, Some(&by_hostname)).unwrap(),
        Entrypoint {
            host: "a1.elb.example".into(),
            port: 8091
        }
    );

    let mut unset = hostname_mpc();
    unset.spec.proxy_server.entrypoint = None;
    assert_eq!(
        render::entrypoint(&unset, None),
        Err(EntrypointError::NotSet)
    );
}

#[test]
fn organization_unit_is_stable_and_follows_the_ca() {
    let unit = signer_organization_unit(CA);
    assert_eq!(unit, signer_organization_unit(CA));
    assert_ne!(unit, signer_organization_unit(b"another CA"));
    // signer- + hex(ASCII of base64(sha256(""))): the double encoding of §11.6.
    assert_eq!(
        signer_organization_unit(b""),
        format!(
            "signer-{}",
            hex::encode("47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=")
        )
    );
    let registrations = serde_json::to_value(registrations(CA, "cluster-a")).unwrap();
    assert_eq!(
        registrations,
        json!([
            {
                "signerName": "open-cluster-management.io/proxy-agent-signer",
                "subject": {
                    "user": "open-cluster-management:cluster-proxy:proxy-agent",
                    "groups": ["open-cluster-management:cluster-proxy"],
                    "organizationUnit": [unit],
                },
            },
            {
                "signerName": "kubernetes.io/kube-apiserver-client",
                // Per cluster, so that one cluster's addon-agent cannot
                // write another cluster's Lease.
                "subject": {
                    "user": "system:open-cluster-management:cluster:cluster-a:addon:cluster-proxy:agent:cluster-proxy-agent",
                    "groups": [
                        "system:open-cluster-management:cluster:cluster-a:addon:cluster-proxy",
                        "system:open-cluster-management:addon:cluster-proxy",
                    ],
                },
            },
        ])
    );
}

#[test]
fn hub_rbac_binds_the_registration_subjects() {
    let (role, binding) = hub_agent_rbac("cluster-a", None);
    assert_eq!(
        role.metadata.name.as_deref(),
        Some("cluster-proxy-addon-agent")
    );
    assert_eq!(role.metadata.namespace.as_deref(), Some("cluster-a"));
    let rule = &role.rules.unwrap()[0];
    assert_eq!(rule.resources, Some(vec!["leases".to_owned()]));
    assert_eq!(rule.verbs, vec!["*".to_owned()]);
    let subjects: Vec<(String, String)> = binding
        .subjects
        .unwrap()
        .into_iter()
        .map(|s| (s.kind, s.name))
        .collect();
    assert_eq!(
        subjects,
        vec![
            (
                "User".into(),
                "system:open-cluster-management:cluster:cluster-a:addon:cluster-proxy:agent:cluster-proxy-agent".into()
            ),
            (
                "Group".into(),
                "system:open-cluster-management:cluster:cluster-a:addon:cluster-proxy".into()
            ),
        ]
    );
}

#[test]
fn cluster_names_must_be_service_names() {
    assert!(render::is_dns1035_label("cluster-a"));
    assert!(!render::is_dns1035_label("1cluster"));
    assert!(!render::is_dns1035_label("Cluster"));
    assert!(!render::is_dns1035_label("a.b"));
    assert!(!render::is_dns1035_label(&"a".repeat(64)));
}

#[test]
fn cluster_management_addon_declares_upstreams_shape() {
    let settings = AddonSettings::new("open-cluster-management-addon");
    let cma: ClusterManagementAddOn = cluster_management_addon(&settings);
    assert_eq!(
        serde_json::to_value(&cma).unwrap(),
        json!({
            "apiVersion": "addon.open-cluster-management.io/v1alpha1",
            "kind": "ClusterManagementAddOn",
            "metadata": {
                "name": "cluster-proxy",
                "annotations": {"addon.open-cluster-management.io/lifecycle": "self"},
            },
            "spec": {
                "addOnMeta": {"displayName": "cluster-proxy", "description": "cluster-proxy"},
                "supportedConfigs": [
                    {
                        "group": "proxy.open-cluster-management.io",
                        "resource": "managedproxyconfigurations",
                        "defaultConfig": {"name": "cluster-proxy"},
                    },
                    {"group": "addon.open-cluster-management.io", "resource": "addondeploymentconfigs"},
                ],
                "installStrategy": {
                    "type": "Placements",
                    "placements": [{"namespace": "open-cluster-management-addon", "name": "cluster-proxy-placement"}],
                },
            },
        })
    );
    let manual = AddonSettings {
        install_strategy: InstallStrategy::Manual,
        default_deployment_config: Some((
            "open-cluster-management-addon".into(),
            "defaults".into(),
        )),
        ..settings
    };
    let cma = serde_json::to_value(cluster_management_addon(&manual)).unwrap();
    assert_eq!(cma["spec"]["installStrategy"], json!({"type": "Manual"}));
    assert_eq!(
        cma["spec"]["supportedConfigs"][1]["defaultConfig"],
        json!({"namespace": "open-cluster-management-addon", "name": "defaults"})
    );
}

/// Regression: `--enable-kube-api-proxy=false` was parsed and ignored, so
/// every cluster's kube-apiserver stayed reachable by its name. Now the agent
/// answers only to its service-proxy host and the ExternalName Service is
/// not deployed.
#[test]
fn without_the_kube_api_proxy_the_cluster_name_routes_nowhere() {
    let rendered = Rendered::with_kube_api_proxy(&hostname_mpc(), None, None, CA, false);
    let hashed = ClusterName::new("cluster-a").unwrap().service_proxy_host();
    let args = rendered.container("proxy-agent").args.unwrap();
    assert!(
        args.contains(&format!("--agent-identifiers=host={hashed}")),
        "{args:?}"
    );
    assert!(
        !rendered
            .manifests()
            .iter()
            .any(|m| m["kind"] == "Service" && m["metadata"]["name"] == "cluster-a"),
        "no ExternalName Service for the cluster's name"
    );
    let with = Rendered::new(&hostname_mpc(), None, CA);
    assert_eq!(
        with.manifest("Service", "cluster-a")["spec"]["type"],
        "ExternalName"
    );
}

#[test]
fn with_network_policies_the_agent_ships_its_own() {
    let mpc =
        mpc(json!({"type": "Hostname", "hostname": {"value": "proxy.hub.example"}, "port": 8091}));
    let cluster = ClusterName::new("cluster-a").unwrap();
    let entrypoint = render::entrypoint(&mpc, None).unwrap();
    let customization = AgentCustomization::new(&mpc.spec.proxy_agent.image, None, None).unwrap();
    let inputs = AgentInputs {
        cluster: &cluster,
        install_namespace: "open-cluster-management-cluster-proxy",
        mpc: &mpc,
        deployment_config: None,
        entrypoint: &entrypoint,
        ca_pem: CA,
        customization: &customization,
        kube_api_proxy: true,
        network_policy: Some(&[6443, 8443]),
        image_pull_policy: Some("Always"),
        service_proxy: None,
        impersonation: false,
    };
    let work = serde_json::to_value(manifest_work(&inputs, None).unwrap()).unwrap();
    let manifests = work["spec"]["workload"]["manifests"].as_array().unwrap();
    let policy = manifests
        .iter()
        .find(|m| m["kind"] == "NetworkPolicy")
        .expect("the work carries the agent's NetworkPolicy");
    assert_eq!(
        policy["metadata"]["name"],
        "cluster-proxy-proxy-agent-network-policy"
    );
    assert_eq!(
        policy["metadata"]["namespace"],
        "open-cluster-management-cluster-proxy"
    );
    let deployment = manifests
        .iter()
        .find(|m| m["kind"] == "Deployment")
        .unwrap();
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"],
        "it selects the agent pods"
    );
    let egress_ports: Vec<i64> = policy["spec"]["egress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|rule| rule["ports"].as_array().unwrap().iter())
        .filter(|port| port["protocol"] == "TCP")
        .map(|port| port["port"].as_i64().unwrap())
        .collect();
    assert_eq!(entrypoint.port, 8091);
    for port in [53, 6443, 8443, 8091] {
        assert!(egress_ports.contains(&port), "{port} in {egress_ports:?}");
    }
    assert!(
        !egress_ports.contains(&443),
        "only the ports given: {egress_ports:?}"
    );
    assert_eq!(policy["spec"]["ingress"][0]["ports"][0]["port"], 8093);
    for container in deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
    {
        assert_eq!(container["imagePullPolicy"], "Always");
    }
    // Off by default.
    let plain = Rendered::new(&mpc, None, CA);
    assert!(
        !plain
            .manifests()
            .iter()
            .any(|m| m["kind"] == "NetworkPolicy")
    );
}

const SERVICE_PROXY_CERT: &[u8] =
    b"-----BEGIN CERTIFICATE-----\nMIIBsp\n-----END CERTIFICATE-----\n";
const SERVICE_PROXY_KEY: &[u8] =
    b"-----BEGIN PRIVATE KEY-----\nMIIBkey\n-----END PRIVATE KEY-----\n";

fn with_service_proxy(adc: Option<&AddOnDeploymentConfig>) -> Rendered {
    Rendered::with_service_proxy(
        &hostname_mpc(),
        adc,
        None,
        CA,
        true,
        Some((SERVICE_PROXY_CERT, SERVICE_PROXY_KEY)),
    )
}

#[test]
fn the_service_proxy_runs_beside_the_agent_from_the_agent_image() {
    let rendered = with_service_proxy(None);
    let container = rendered.container("service-proxy");
    assert_eq!(container.command, Some(vec!["/proxy-agent".to_owned()]));
    assert_eq!(
        container.args.unwrap(),
        [
            "service-proxy",
            "--cluster-name=cluster-a",
            "--cert=/etc/service-proxy/tls.crt",
            "--key=/etc/service-proxy/tls.key",
            "--user-server-ca=/etc/ca/ca.crt",
            "--enable-impersonation=true",
            "--health-port=8000",
        ]
    );
    assert_eq!(
        container.image,
        rendered.container("proxy-agent").image,
        "one image for the agent's containers"
    );
    let mounts: Vec<(String, String, Option<bool>)> = container
        .volume_mounts
        .unwrap()
        .into_iter()
        .map(|m| (m.name, m.mount_path, m.read_only))
        .collect();
    assert_eq!(
        mounts,
        [
            ("ca".to_owned(), "/etc/ca".to_owned(), Some(true)),
            (
                "service-proxy".to_owned(),
                "/etc/service-proxy".to_owned(),
                Some(true)
            ),
        ]
    );
    for probe in [container.readiness_probe, container.liveness_probe] {
        let port = probe.unwrap().http_get.unwrap().port;
        assert_eq!(
            port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8000)
        );
    }
    let security = container.security_context.unwrap();
    assert_eq!(security.run_as_non_root, Some(true));
    assert_eq!(security.read_only_root_filesystem, Some(true));

    let pod = rendered.deployment().spec.unwrap().template.spec.unwrap();
    // The proxy-agent's requests for the hashed host land on the
    // service-proxy's loopback port.
    let aliases = pod.host_aliases.unwrap();
    assert_eq!(aliases.len(), 1);
    assert_eq!(aliases[0].ip, "127.0.0.1");
    assert_eq!(
        aliases[0].hostnames,
        Some(vec![
            ClusterName::new("cluster-a").unwrap().service_proxy_host()
        ])
    );
    let volume = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "service-proxy")
        .unwrap();
    assert_eq!(
        volume.secret.unwrap().secret_name.as_deref(),
        Some("cluster-proxy-service-proxy-server-certificates")
    );
    // The proxy-agent still answers to the hashed host.
    let agent_args = rendered.container("proxy-agent").args.unwrap().join(" ");
    assert!(
        agent_args.contains(&ClusterName::new("cluster-a").unwrap().service_proxy_host()),
        "{agent_args}"
    );

    let secret = rendered.manifest("Secret", "cluster-proxy-service-proxy-server-certificates");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    assert_eq!(
        secret["metadata"]["namespace"],
        "open-cluster-management-cluster-proxy"
    );
    use base64::Engine as _;
    let decoded = |key: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(secret["data"][key].as_str().unwrap())
            .unwrap()
    };
    assert_eq!(decoded("tls.crt"), SERVICE_PROXY_CERT);
    assert_eq!(decoded("tls.key"), SERVICE_PROXY_KEY);

    let role = rendered.manifest("ClusterRole", "cluster-proxy-addon-agent-impersonator");
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]}]),
        "impersonation of users and groups, nothing more"
    );
    let binding = rendered.manifest(
        "ClusterRoleBinding",
        "cluster-proxy-addon-agent-impersonator:open-cluster-management-cluster-proxy",
    );
    assert_eq!(
        binding["roleRef"]["name"],
        "cluster-proxy-addon-agent-impersonator"
    );
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "cluster-proxy",
                "namespace": "open-cluster-management-cluster-proxy"}])
    );
    // The Deployment comes after what it mounts and is allowed.
    let kinds: Vec<&str> = rendered
        .manifests()
        .iter()
        .map(|m| m["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.last(), Some(&"Deployment"), "{kinds:?}");
}

#[test]
fn without_the_service_proxy_nothing_of_it_is_rendered() {
    let rendered = Rendered::new(&hostname_mpc(), None, CA);
    let pod = rendered.deployment().spec.unwrap().template.spec.unwrap();
    assert_eq!(
        pod.containers
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        ["proxy-agent", "addon-agent"]
    );
    assert!(pod.host_aliases.is_none());
    for manifest in rendered.manifests() {
        let name = manifest["metadata"]["name"].as_str().unwrap();
        assert!(
            !name.contains("service-proxy") && !name.contains("impersonator"),
            "{name}"
        );
    }
}

#[test]
fn enable_impersonation_false_drops_the_impersonator_role() {
    let adc =
        adc(json!({"customizedVariables": [{"name": "enableImpersonation", "value": "false"}]}));
    let rendered = with_service_proxy(Some(&adc));
    let args = rendered.container("service-proxy").args.unwrap();
    assert!(
        args.contains(&"--enable-impersonation=false".to_owned()),
        "{args:?}"
    );
    assert!(
        rendered
            .manifests()
            .iter()
            .all(|m| m["kind"] != "ClusterRole" && m["kind"] != "ClusterRoleBinding")
    );
    // Not a boolean: a clear error naming it.
    let bad = adc_with_impersonation("sometimes");
    let error = render::impersonation(Some(&bad)).unwrap_err();
    assert!(
        error.contains("enableImpersonation") && error.contains("sometimes"),
        "{error}"
    );
    assert_eq!(render::impersonation(None), Ok(true));
    assert_eq!(
        render::impersonation(Some(&adc_with_impersonation("1"))),
        Ok(true)
    );
}

fn adc_with_impersonation(value: &str) -> AddOnDeploymentConfig {
    adc(json!({"customizedVariables": [{"name": "enableImpersonation", "value": value}]}))
}

#[test]
fn additional_service_proxy_args_follow_ours_and_the_binding_name_is_upstreams() {
    let mut mpc = hostname_mpc();
    mpc.spec.proxy_agent.additional_service_proxy_args = vec!["--v=4".to_owned()];
    let rendered = Rendered::with_service_proxy(
        &mpc,
        None,
        None,
        CA,
        true,
        Some((SERVICE_PROXY_CERT, SERVICE_PROXY_KEY)),
    );
    let args = rendered.container("service-proxy").args.unwrap();
    assert_eq!(args.last().map(String::as_str), Some("--v=4"));
    assert_eq!(
        render::impersonator_binding_name("open-cluster-management-agent-addon"),
        "cluster-proxy-addon-agent-impersonator"
    );
}

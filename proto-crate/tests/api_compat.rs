//! The versioning rule, tested: objects written under an API version (the
//! checked-in fixtures) keep parsing, and a round trip keeps every field the
//! types model.
#![cfg(feature = "kube-api")]

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::path::{Path, PathBuf};

use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnDeploymentConfig, ClusterManagementAddOn, INSTALL_STRATEGY_PLACEMENTS, ManagedClusterAddOn,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::{Placement, PlacementDecision};
use cluster_proxy_proto::api::proxy::v1alpha1::{
    CONDITION_PROXY_SERVER_DEPLOYED, EntrypointType, ManagedProxyConfiguration, SignerType,
};
use cluster_proxy_proto::api::work::v1::{ManifestWork, ResourceIdentifier, VALUE_INTEGER};
use cluster_proxy_proto::api::{self, CONDITION_FALSE};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Every fixture and the JSON pointers of the fields in it that the types
/// deliberately do not model (kept by server-side apply, dropped by a round trip).
const FIXTURES: &[(&str, &[&str])] = &[
    ("proxy/v1alpha1/managedproxyconfiguration-hub.json", &[]),
    (
        "proxy/v1alpha1/managedproxyconfiguration-loadbalancer.json",
        &[],
    ),
    (
        "proxy/v1alpha1/managedproxyconfiguration-upstream-sample.json",
        // Field names of upstream's early sample that never reached a release.
        &[
            "/spec/authentication/certificateMounting",
            "/spec/authentication/certificateSigning",
        ],
    ),
    ("cluster/v1/managedcluster.json", &[]),
    (
        "cluster/v1beta1/placement.json",
        &[
            "/spec/decisionStrategy",
            "/spec/prioritizerPolicy",
            "/spec/spreadPolicy",
        ],
    ),
    ("cluster/v1beta1/placementdecision.json", &[]),
    ("addon/v1alpha1/clustermanagementaddon.json", &[]),
    ("addon/v1alpha1/managedclusteraddon.json", &[]),
    ("addon/v1alpha1/addondeploymentconfig.json", &[]),
    ("work/v1/manifestwork.json", &[]),
];

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn load(path: &str) -> Value {
    let full = fixtures_dir().join(path);
    let text = std::fs::read_to_string(&full)
        .unwrap_or_else(|error| panic!("{}: {error}", full.display()));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{path} is not JSON: {error}"))
}

fn unmodelled(path: &str) -> &'static [&'static str] {
    FIXTURES
        .iter()
        .find(|(fixture, _)| *fixture == path)
        .map(|(_, pointers)| *pointers)
        .unwrap_or_else(|| panic!("{path} is not listed in FIXTURES"))
}

/// Removes the field at `pointer`; false when there is none.
fn remove_pointer(value: &mut Value, pointer: &str) -> bool {
    let Some((parent, key)) = pointer.rsplit_once('/') else {
        return false;
    };
    value
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .is_some_and(|object| object.remove(key).is_some())
}

/// Parses a fixture as `K`, checks that serialising it gives back the fixture
/// minus its unmodelled fields and that parsing that again gives the same value.
fn round_trip<K>(path: &str) -> K
where
    K: DeserializeOwned + Serialize + PartialEq + Debug,
{
    let original = load(path);
    let parsed: K = serde_json::from_value(original.clone())
        .unwrap_or_else(|error| panic!("{path} no longer parses: {error}"));
    let written = serde_json::to_value(&parsed).expect("typed objects serialise");

    let mut expected = original;
    for pointer in unmodelled(path) {
        assert!(
            remove_pointer(&mut expected, pointer),
            "{path}: {pointer} is listed as unmodelled but is not in the fixture"
        );
    }
    assert_eq!(
        written, expected,
        "{path}: a round trip changed or lost modelled fields"
    );

    let reparsed: K = serde_json::from_value(written).expect("written objects parse");
    assert_eq!(reparsed, parsed, "{path}: parsing is not stable");
    parsed
}

#[test]
fn every_fixture_is_tested() {
    fn walk(dir: &Path, root: &Path, found: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).expect("fixtures directory is readable") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(&path, root, found);
            } else if path
                .extension()
                .is_some_and(|extension| extension == "json")
            {
                let relative = path.strip_prefix(root).expect("under root");
                found.insert(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let root = fixtures_dir();
    let mut found = BTreeSet::new();
    walk(&root, &root, &mut found);
    let listed: BTreeSet<String> = FIXTURES
        .iter()
        .map(|(path, _)| (*path).to_owned())
        .collect();
    assert_eq!(
        found, listed,
        "every fixture needs an entry in FIXTURES and a test"
    );
}

#[test]
fn managed_proxy_configuration_from_a_hub_round_trips() {
    let mpc: ManagedProxyConfiguration =
        round_trip("proxy/v1alpha1/managedproxyconfiguration-hub.json");
    let entrypoint = mpc
        .spec
        .proxy_server
        .entrypoint
        .as_ref()
        .expect("entrypoint");
    assert_eq!(entrypoint.type_, EntrypointType::Hostname);
    assert_eq!(
        entrypoint
            .hostname
            .as_ref()
            .map(|hostname| hostname.value.as_str()),
        Some("proxy-entrypoint.open-cluster-management-addon.svc")
    );
    assert_eq!(mpc.spec.proxy_server.replicas, 1);
    assert_eq!(mpc.spec.proxy_server.node_placement.tolerations.len(), 1);
    let sans = &mpc
        .spec
        .authentication
        .signer
        .self_signed
        .as_ref()
        .expect("selfSigned")
        .additional_sans;
    assert_eq!(sans, &["proxy.hub.example.com", "10.0.12.7"]);
    assert_eq!(
        mpc.spec
            .user_server
            .as_ref()
            .map(|user| user.additional_sans.len()),
        Some(1)
    );
    let status = mpc.status.as_ref().expect("status");
    assert_eq!(status.last_observed_generation, Some(3));
    assert!(api::is_condition_true(
        &status.conditions,
        CONDITION_PROXY_SERVER_DEPLOYED
    ));
}

#[test]
fn managed_proxy_configuration_with_load_balancer_round_trips() {
    let mpc: ManagedProxyConfiguration =
        round_trip("proxy/v1alpha1/managedproxyconfiguration-loadbalancer.json");
    let entrypoint = mpc
        .spec
        .proxy_server
        .entrypoint
        .as_ref()
        .expect("entrypoint");
    assert_eq!(entrypoint.type_, EntrypointType::LoadBalancerService);
    let annotations = &entrypoint
        .load_balancer_service
        .as_ref()
        .expect("loadBalancerService")
        .annotations;
    assert_eq!(annotations.len(), 2);
    assert_eq!(annotations[1].key, "example.com/flag");
    assert_eq!(
        annotations[1].value, "",
        "a missing annotation value reads as empty"
    );
    let status = mpc.status.as_ref().expect("status");
    let deployed = api::find_condition(&status.conditions, CONDITION_PROXY_SERVER_DEPLOYED)
        .expect("condition");
    assert_eq!(deployed.status, CONDITION_FALSE);
    assert!(!api::is_condition_true(
        &status.conditions,
        CONDITION_PROXY_SERVER_DEPLOYED
    ));
}

/// Upstream's sample carries only the required fields; the CRD defaults fill
/// the rest, and the types apply the same defaults when an API server has not
/// (an object read from a file, or from the in-memory API).
#[test]
fn upstream_sample_parses_with_the_crd_defaults() {
    let path = "proxy/v1alpha1/managedproxyconfiguration-upstream-sample.json";
    let mpc: ManagedProxyConfiguration = serde_json::from_value(load(path)).expect("sample parses");
    let spec = &mpc.spec;
    assert_eq!(spec.authentication.signer.type_, SignerType::SelfSigned);
    let secrets = &spec.authentication.dump.secrets;
    assert_eq!(secrets.signing_proxy_server_secret_name, "proxy-server");
    assert_eq!(secrets.signing_proxy_client_secret_name, "proxy-client");
    assert_eq!(secrets.signing_agent_server_secret_name, "agent-server");
    assert_eq!(
        spec.proxy_server.image,
        "yue9944882/proxy-server-amd64:v0.0.22"
    );
    assert_eq!(spec.proxy_server.replicas, 3);
    assert_eq!(
        spec.proxy_server.in_cluster_service_name,
        "proxy-entrypoint"
    );
    assert_eq!(
        spec.proxy_server.namespace,
        "open-cluster-management-cluster-proxy"
    );
    let entrypoint = spec.proxy_server.entrypoint.as_ref().expect("entrypoint");
    assert_eq!(entrypoint.type_, EntrypointType::LoadBalancerService);
    assert_eq!(entrypoint.port, 8091);
    assert_eq!(
        entrypoint
            .load_balancer_service
            .as_ref()
            .map(|lb| lb.name.as_str()),
        Some("proxy-agent-entrypoint")
    );
    assert_eq!(spec.proxy_agent.replicas, 3);
    assert!(spec.deploy.is_none());
    assert!(spec.user_server.is_none());
    assert!(mpc.status.is_none());

    // What the API server would store: the sample with every default filled in.
    let written = serde_json::to_value(&mpc).expect("serialises");
    assert_eq!(
        written.pointer("/spec/proxyServer/replicas"),
        Some(&Value::from(3))
    );
    assert_eq!(
        written.pointer("/spec/authentication/dump/secrets/signingAgentServerSecretName"),
        Some(&Value::from("agent-server"))
    );
    assert_eq!(
        written.pointer("/spec/authentication/certificateMounting"),
        None
    );
}

#[test]
fn managed_proxy_configuration_rejects_bad_input_with_an_error() {
    let mut sample = load("proxy/v1alpha1/managedproxyconfiguration-upstream-sample.json");
    sample["spec"]["proxyServer"]["entrypoint"]["type"] = Value::from("Ingress");
    let error = serde_json::from_value::<ManagedProxyConfiguration>(sample.clone())
        .expect_err("unknown entrypoint type");
    assert!(error.to_string().contains("Ingress"), "{error}");

    let mut no_image = load("proxy/v1alpha1/managedproxyconfiguration-upstream-sample.json");
    if let Some(agent) = no_image
        .pointer_mut("/spec/proxyAgent")
        .and_then(Value::as_object_mut)
    {
        agent.remove("image");
    }
    let error = serde_json::from_value::<ManagedProxyConfiguration>(no_image)
        .expect_err("image is required");
    assert!(error.to_string().contains("image"), "{error}");
}

#[test]
fn managed_cluster_round_trips() {
    let cluster: ManagedCluster = round_trip("cluster/v1/managedcluster.json");
    assert!(cluster.hub_accepts_client());
    assert!(api::is_condition_true(
        cluster.conditions(),
        cluster_proxy_proto::api::cluster::v1::CONDITION_AVAILABLE
    ));
    let taints = cluster.spec.taints.as_ref().expect("taints");
    assert!(taints[0].time_added.is_some());
}

#[test]
fn placement_round_trips_its_modelled_fields() {
    let placement: Placement = round_trip("cluster/v1beta1/placement.json");
    assert_eq!(
        placement.spec.cluster_sets.as_deref(),
        Some(&["global".to_owned()][..])
    );
    let status = placement.status.as_ref().expect("status");
    assert_eq!(status.number_of_selected_clusters, Some(2));
    let groups = status.decision_groups.as_ref().expect("decisionGroups");
    assert_eq!(groups[0].clusters_count, Some(2));
}

#[test]
fn placement_decision_round_trips() {
    let decision: PlacementDecision = round_trip("cluster/v1beta1/placementdecision.json");
    assert_eq!(decision.placement_name(), Some("cluster-proxy-placement"));
    assert_eq!(
        decision.cluster_names().collect::<Vec<_>>(),
        ["cluster1", "loopback"]
    );
}

#[test]
fn cluster_management_addon_round_trips() {
    let addon: ClusterManagementAddOn = round_trip("addon/v1alpha1/clustermanagementaddon.json");
    let strategy = addon
        .spec
        .install_strategy
        .as_ref()
        .expect("installStrategy");
    assert_eq!(strategy.type_.as_deref(), Some(INSTALL_STRATEGY_PLACEMENTS));
    let placements = strategy.placements.as_ref().expect("placements");
    assert_eq!(placements[0].name, "cluster-proxy-placement");
    let supported = addon
        .spec
        .supported_configs
        .as_ref()
        .expect("supportedConfigs");
    assert_eq!(
        supported[0]
            .default_config
            .as_ref()
            .map(|config| config.name.as_str()),
        Some("cluster-proxy")
    );
    let status = addon.status.as_ref().expect("status");
    assert_eq!(
        status.default_config_references.as_ref().map(Vec::len),
        Some(1)
    );
}

#[test]
fn managed_cluster_addon_round_trips() {
    let addon: ManagedClusterAddOn = round_trip("addon/v1alpha1/managedclusteraddon.json");
    let status = addon.status.as_ref().expect("status");
    assert_eq!(
        status.namespace.as_deref(),
        Some("open-cluster-management-cluster-proxy")
    );
    let registrations = status.registrations.as_ref().expect("registrations");
    assert_eq!(
        registrations[0].signer_name,
        "open-cluster-management.io/proxy-agent-signer"
    );
    let subject = registrations[0].subject.as_ref().expect("subject");
    assert_eq!(subject.organization_units.as_ref().map(Vec::len), Some(1));
    assert!(api::is_condition_true(
        addon.conditions(),
        cluster_proxy_proto::api::addon::v1alpha1::CONDITION_AVAILABLE
    ));
}

#[test]
fn addon_deployment_config_round_trips() {
    let config: AddOnDeploymentConfig = round_trip("addon/v1alpha1/addondeploymentconfig.json");
    assert_eq!(config.variable("serviceDomain"), Some("svc.cluster.local"));
    assert_eq!(config.variable("oidcIssuerURL"), None);
    let proxy = config.spec.proxy_config.as_ref().expect("proxyConfig");
    assert!(
        proxy
            .ca_bundle
            .as_ref()
            .is_some_and(|bundle| bundle.0.starts_with(b"-----BEGIN"))
    );
    let requirements = config
        .spec
        .resource_requirements
        .as_ref()
        .expect("resourceRequirements");
    assert_eq!(
        requirements[0].container_id,
        "deployments:cluster-proxy-proxy-agent:proxy-agent"
    );
}

#[test]
fn manifest_work_round_trips() {
    let work: ManifestWork = round_trip("work/v1/manifestwork.json");
    let manifests = work
        .spec
        .workload
        .as_ref()
        .and_then(|workload| workload.manifests.as_ref())
        .expect("manifests");
    assert_eq!(manifests[1].kind(), Some("Deployment"));
    assert_eq!(manifests[1].name(), Some("cluster-proxy-proxy-agent"));
    let deployment = ResourceIdentifier {
        group: "apps".into(),
        resource: "deployments".into(),
        name: "cluster-proxy-proxy-agent".into(),
        namespace: "open-cluster-management-cluster-proxy".into(),
    };
    let ready = work
        .feedback(&deployment, "ReadyReplicas")
        .expect("feedback");
    assert_eq!(ready.type_, VALUE_INTEGER);
    assert_eq!(ready.integer, Some(1));
    assert!(work.feedback(&deployment, "AvailableReplicas").is_none());
    let namespace = ResourceIdentifier {
        group: String::new(),
        resource: "namespaces".into(),
        name: "open-cluster-management-cluster-proxy".into(),
        namespace: String::new(),
    };
    assert!(work.feedback(&namespace, "ReadyReplicas").is_none());
}

//! The generated ManagedProxyConfiguration CRD against upstream's: same
//! names, scope, field paths, required fields, defaults and enums, plus the
//! documented improvements (see the `api::proxy::v1alpha1` module docs).
#![cfg(feature = "kube-api")]

use std::collections::BTreeSet;

use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use kube::CustomResourceExt;
use serde_json::{Value, json};

fn schema() -> Value {
    let crd = ManagedProxyConfiguration::crd();
    let version = &crd.spec.versions[0];
    let schema = version
        .schema
        .as_ref()
        .and_then(|validation| validation.open_api_v3_schema.as_ref())
        .expect("the CRD has a schema");
    serde_json::to_value(schema).expect("schema serialises")
}

/// Every property path in the schema, `[]` marking list items.
fn property_paths(schema: &Value, prefix: &str, paths: &mut BTreeSet<String>) {
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        for (name, child) in properties {
            let path = format!("{prefix}.{name}");
            paths.insert(path.clone());
            property_paths(child, &path, paths);
        }
    }
    if let Some(items) = schema.get("items") {
        property_paths(items, &format!("{prefix}[]"), paths);
    }
}

fn at<'a>(schema: &'a Value, path: &str) -> &'a Value {
    let mut node = schema;
    for segment in path.split('.').filter(|segment| !segment.is_empty()) {
        node = node
            .pointer(&format!("/properties/{segment}"))
            .unwrap_or_else(|| panic!("no property {segment} in {path}"));
    }
    node
}

#[test]
fn names_scope_and_subresources_match_upstream() {
    let crd = ManagedProxyConfiguration::crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("managedproxyconfigurations.proxy.open-cluster-management.io")
    );
    assert_eq!(crd.spec.group, "proxy.open-cluster-management.io");
    assert_eq!(crd.spec.scope, "Cluster");
    assert_eq!(crd.spec.names.kind, "ManagedProxyConfiguration");
    assert_eq!(crd.spec.names.plural, "managedproxyconfigurations");
    assert_eq!(
        crd.spec.names.singular.as_deref(),
        Some("managedproxyconfiguration")
    );
    assert_eq!(crd.spec.versions.len(), 1);
    let version = &crd.spec.versions[0];
    assert_eq!(version.name, "v1alpha1");
    assert!(version.served && version.storage);
    let subresources = version.subresources.as_ref().expect("subresources");
    assert!(subresources.status.is_some(), "status subresource");
    assert!(subresources.scale.is_none());
}

/// The spec and status field paths of upstream's CRD (reference §3.1), written
/// out by hand so a renamed or misspelt JSON name fails here.
#[test]
fn field_paths_match_upstream() {
    let expected: BTreeSet<String> = [
        ".spec",
        ".spec.authentication",
        ".spec.authentication.signer",
        ".spec.authentication.signer.type",
        ".spec.authentication.signer.selfSigned",
        ".spec.authentication.signer.selfSigned.additionalSANs",
        ".spec.authentication.dump",
        ".spec.authentication.dump.secrets",
        ".spec.authentication.dump.secrets.signingProxyServerSecretName",
        ".spec.authentication.dump.secrets.signingProxyClientSecretName",
        ".spec.authentication.dump.secrets.signingAgentServerSecretName",
        ".spec.proxyServer",
        ".spec.proxyServer.image",
        ".spec.proxyServer.replicas",
        ".spec.proxyServer.inClusterServiceName",
        ".spec.proxyServer.namespace",
        ".spec.proxyServer.entrypoint",
        ".spec.proxyServer.entrypoint.type",
        ".spec.proxyServer.entrypoint.loadBalancerService",
        ".spec.proxyServer.entrypoint.loadBalancerService.name",
        ".spec.proxyServer.entrypoint.loadBalancerService.annotations",
        ".spec.proxyServer.entrypoint.loadBalancerService.annotations[].key",
        ".spec.proxyServer.entrypoint.loadBalancerService.annotations[].value",
        ".spec.proxyServer.entrypoint.hostname",
        ".spec.proxyServer.entrypoint.hostname.value",
        ".spec.proxyServer.entrypoint.port",
        ".spec.proxyServer.additionalArgs",
        ".spec.proxyServer.nodePlacement",
        ".spec.proxyServer.nodePlacement.nodeSelector",
        ".spec.proxyServer.nodePlacement.tolerations",
        ".spec.proxyServer.nodePlacement.tolerations[].effect",
        ".spec.proxyServer.nodePlacement.tolerations[].key",
        ".spec.proxyServer.nodePlacement.tolerations[].operator",
        ".spec.proxyServer.nodePlacement.tolerations[].tolerationSeconds",
        ".spec.proxyServer.nodePlacement.tolerations[].value",
        ".spec.proxyAgent",
        ".spec.proxyAgent.image",
        ".spec.proxyAgent.replicas",
        ".spec.proxyAgent.additionalArgs",
        ".spec.proxyAgent.additionalServiceProxyArgs",
        ".spec.proxyAgent.imagePullSecrets",
        ".spec.proxyAgent.additionalServiceCAConfigMap",
        ".spec.deploy",
        ".spec.deploy.ports",
        ".spec.deploy.ports.proxyServer",
        ".spec.deploy.ports.agentServer",
        ".spec.deploy.ports.healthServer",
        ".spec.deploy.ports.adminServer",
        ".spec.userServer",
        ".spec.userServer.additionalSANs",
        ".status",
        ".status.lastObservedGeneration",
        ".status.conditions",
        ".status.conditions[].lastTransitionTime",
        ".status.conditions[].message",
        ".status.conditions[].observedGeneration",
        ".status.conditions[].reason",
        ".status.conditions[].status",
        ".status.conditions[].type",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    // Ours alone (documented in the module): the proxy-server container's
    // requests and limits, Kubernetes' own ResourceRequirements.
    let ours: BTreeSet<String> = [
        ".spec.proxyServer.resources",
        ".spec.proxyServer.resources.claims",
        ".spec.proxyServer.resources.claims[].name",
        ".spec.proxyServer.resources.claims[].request",
        ".spec.proxyServer.resources.limits",
        ".spec.proxyServer.resources.requests",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    let mut actual = BTreeSet::new();
    property_paths(&schema(), "", &mut actual);
    let upstream: BTreeSet<String> = actual.difference(&ours).cloned().collect();
    assert_eq!(upstream, expected);
    assert!(ours.is_subset(&actual), "our additions are in the schema");
}

#[test]
fn required_fields_match_upstream() {
    let schema = schema();
    let required = |path: &str| {
        at(&schema, path)
            .get("required")
            .cloned()
            .unwrap_or(json!([]))
    };
    // Upstream leaves `spec` itself optional; ours requires it (documented).
    assert_eq!(required(""), json!(["spec"]));
    assert_eq!(
        required(".spec"),
        json!(["authentication", "proxyAgent", "proxyServer"])
    );
    assert_eq!(required(".spec.proxyServer"), json!(["image"]));
    assert_eq!(required(".spec.proxyAgent"), json!(["image"]));
    assert_eq!(required(".spec.proxyServer.entrypoint"), json!(["type"]));
    assert_eq!(
        required(".spec.proxyServer.entrypoint.hostname"),
        json!(["value"])
    );
    assert_eq!(required(".spec.deploy"), json!(["ports"]));
    assert_eq!(required(".spec.authentication"), json!([]));
    assert_eq!(required(".spec.authentication.dump.secrets"), json!([]));
    assert_eq!(required(".spec.deploy.ports"), json!([]));
    let annotations = at(
        &schema,
        ".spec.proxyServer.entrypoint.loadBalancerService.annotations",
    );
    assert_eq!(
        annotations.pointer("/items/required"),
        Some(&json!(["key"]))
    );
}

#[test]
fn defaults_and_enums_match_upstream() {
    let schema = schema();
    let default = |path: &str| at(&schema, path).get("default").cloned();
    for (path, value) in [
        (".spec.authentication.signer.type", json!("SelfSigned")),
        (
            ".spec.authentication.dump.secrets.signingProxyServerSecretName",
            json!("proxy-server"),
        ),
        (
            ".spec.authentication.dump.secrets.signingProxyClientSecretName",
            json!("proxy-client"),
        ),
        (
            ".spec.authentication.dump.secrets.signingAgentServerSecretName",
            json!("agent-server"),
        ),
        (".spec.proxyServer.replicas", json!(3)),
        (
            ".spec.proxyServer.inClusterServiceName",
            json!("proxy-entrypoint"),
        ),
        (
            ".spec.proxyServer.namespace",
            json!("open-cluster-management-cluster-proxy"),
        ),
        (
            ".spec.proxyServer.entrypoint.loadBalancerService.name",
            json!("proxy-agent-entrypoint"),
        ),
        (".spec.proxyServer.entrypoint.port", json!(8091)),
        (".spec.proxyAgent.replicas", json!(3)),
        (".spec.deploy.ports.proxyServer", json!(8090)),
        (".spec.deploy.ports.agentServer", json!(8091)),
        (".spec.deploy.ports.healthServer", json!(8092)),
        (".spec.deploy.ports.adminServer", json!(8095)),
    ] {
        assert_eq!(default(path), Some(value), "default of {path}");
    }
    // Fields without a default upstream have none here either.
    for path in [
        ".spec.proxyServer.image",
        ".spec.proxyAgent.image",
        ".spec.proxyServer.entrypoint",
    ] {
        assert_eq!(default(path), None, "{path} has no default");
    }
    assert_eq!(
        at(&schema, ".spec.proxyServer.entrypoint.port")
            .get("minimum")
            .and_then(Value::as_f64),
        Some(1.0)
    );
    assert_eq!(
        at(&schema, ".spec.proxyServer.entrypoint.type").get("enum"),
        Some(&json!(["Hostname", "LoadBalancerService", "PortForward"]))
    );
    assert_eq!(
        at(&schema, ".spec.authentication.signer.type").get("enum"),
        Some(&json!(["SelfSigned", "Provided", "CertManager"]))
    );
}

/// Two writers (addon-manager and cert-authority) own different conditions;
/// only a list map lets server-side apply merge their entries by `type`.
#[test]
fn conditions_merge_by_type_under_server_side_apply() {
    let schema = schema();
    let conditions = at(&schema, ".status.conditions");
    assert_eq!(
        conditions.get("x-kubernetes-list-type"),
        Some(&json!("map"))
    );
    assert_eq!(
        conditions.get("x-kubernetes-list-map-keys"),
        Some(&json!(["type"]))
    );
    assert_eq!(
        conditions.pointer("/items/required"),
        Some(&json!([
            "lastTransitionTime",
            "message",
            "reason",
            "status",
            "type"
        ]))
    );
}

#[test]
fn printer_columns_show_entrypoint_replicas_and_deployment() {
    let crd = ManagedProxyConfiguration::crd();
    let columns: Vec<(String, String)> = crd.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|column| (column.name.clone(), column.json_path.clone()))
        .collect();
    assert_eq!(
        columns,
        [
            (
                "Entrypoint".to_owned(),
                ".spec.proxyServer.entrypoint.type".to_owned()
            ),
            (
                "Replicas".to_owned(),
                ".spec.proxyServer.replicas".to_owned()
            ),
            (
                "Deployed".to_owned(),
                ".status.conditions[?(@.type==\"ProxyServerDeployed\")].status".to_owned()
            ),
            ("Age".to_owned(), ".metadata.creationTimestamp".to_owned()),
        ]
    );
}

/// The item checks upstream's CRD has for `metav1.Condition`.
#[test]
fn conditions_are_validated_as_upstream() {
    let schema = schema();
    let item = |field: &str, key: &str| {
        at(&schema, ".status.conditions")
            .pointer(&format!("/items/properties/{field}/{key}"))
            .cloned()
    };
    assert_eq!(
        item("status", "enum"),
        Some(json!(["True", "False", "Unknown"]))
    );
    assert_eq!(
        item("lastTransitionTime", "format"),
        Some(json!("date-time"))
    );
    assert_eq!(item("reason", "minLength"), Some(json!(1)));
    assert_eq!(item("reason", "maxLength"), Some(json!(1024)));
    assert_eq!(item("message", "maxLength"), Some(json!(32768)));
    assert_eq!(item("type", "maxLength"), Some(json!(316)));
    assert_eq!(
        item("observedGeneration", "minimum").and_then(|value| value.as_f64()),
        Some(0.0)
    );
    assert_eq!(
        item("reason", "pattern"),
        Some(json!("^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"))
    );
    assert_eq!(
        item("type", "pattern"),
        Some(json!(
            r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
        ))
    );
}

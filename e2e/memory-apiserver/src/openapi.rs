//! `/openapi/v3`: one OpenAPI 3 document per served group/version, as
//! kubectl reads them for `explain` and to learn that the server checks
//! `fieldValidation` itself (so `kubectl apply` needs no client-side
//! schema download). Built-in types take their schemas from k8s-openapi,
//! custom types from their CRD's `openAPIV3Schema`.
//!
//! The same schemas answer `fieldValidation=Strict`: a field that no schema
//! declares is refused, as kube-apiserver does.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use k8s_openapi::api::{apps, certificates, coordination, core, events, rbac};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::resources::{Registry, ResourceType};

const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";
const REF_PREFIX: &str = "#/components/schemas/";
const GVK: &str = "x-kubernetes-group-version-kind";

/// The schemas of every built-in type (and of what they refer to), by
/// OpenAPI name, and each built-in kind's name among them.
struct Builtins {
    schemas: Map<String, Value>,
    by_kind: BTreeMap<(String, String, String), String>,
}

fn builtins() -> &'static Builtins {
    static BUILTINS: OnceLock<Builtins> = OnceLock::new();
    BUILTINS.get_or_init(|| {
        let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
        let mut by_kind = BTreeMap::new();
        macro_rules! kinds {
            ($($group:literal $version:literal $kind:literal => $type:ty),* $(,)?) => {$(
                generator.subschema_for::<$type>();
                by_kind.insert(
                    ($group.to_string(), $version.to_string(), $kind.to_string()),
                    <$type as schemars::JsonSchema>::schema_name().into_owned(),
                );
            )*};
        }
        kinds! {
            "" "v1" "Namespace" => core::v1::Namespace,
            "" "v1" "Secret" => core::v1::Secret,
            "" "v1" "ConfigMap" => core::v1::ConfigMap,
            "" "v1" "Service" => core::v1::Service,
            "" "v1" "ServiceAccount" => core::v1::ServiceAccount,
            "" "v1" "Pod" => core::v1::Pod,
            "" "v1" "Event" => core::v1::Event,
            "apps" "v1" "Deployment" => apps::v1::Deployment,
            "coordination.k8s.io" "v1" "Lease" => coordination::v1::Lease,
            "certificates.k8s.io" "v1" "CertificateSigningRequest" => certificates::v1::CertificateSigningRequest,
            "rbac.authorization.k8s.io" "v1" "Role" => rbac::v1::Role,
            "rbac.authorization.k8s.io" "v1" "ClusterRole" => rbac::v1::ClusterRole,
            "rbac.authorization.k8s.io" "v1" "RoleBinding" => rbac::v1::RoleBinding,
            "rbac.authorization.k8s.io" "v1" "ClusterRoleBinding" => rbac::v1::ClusterRoleBinding,
            "events.k8s.io" "v1" "Event" => events::v1::Event,
            "apiextensions.k8s.io" "v1" "CustomResourceDefinition" => apiextensions::v1::CustomResourceDefinition,
        }
        let mut schemas = generator.take_definitions(true);
        for ((group, version, kind), name) in &by_kind {
            if let Some(Value::Object(schema)) = schemas.get_mut(name) {
                schema.insert(
                    GVK.into(),
                    json!([{"group": group, "version": version, "kind": kind}]),
                );
            }
        }
        Builtins { schemas, by_kind }
    })
}

/// The OpenAPI name of a custom kind, as kube-apiserver builds it
/// (`io.open-cluster-management.proxy.v1alpha1.ManagedProxyConfiguration`).
fn custom_name(t: &ResourceType) -> String {
    let reversed: Vec<&str> = t.group.split('.').rev().collect();
    format!("{}.{}.{}", reversed.join("."), t.version, t.kind)
}

/// A custom kind's schema: its `openAPIV3Schema` with the fields every
/// object has.
fn custom_schema(t: &ResourceType) -> Value {
    let mut schema =
        t.schema.as_deref().cloned().unwrap_or_else(
            || json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
        );
    if let Value::Object(object) = &mut schema {
        let properties = object.entry("properties").or_insert_with(|| json!({}));
        if let Value::Object(properties) = properties {
            properties.insert(
                "apiVersion".into(),
                json!({"type": "string", "description": "APIVersion defines the versioned schema of this representation of an object."}),
            );
            properties.insert(
                "kind".into(),
                json!({"type": "string", "description": "Kind is a string value representing the REST resource this object represents."}),
            );
            properties.insert(
                "metadata".into(),
                json!({"allOf": [{"$ref": format!("{REF_PREFIX}{OBJECT_META}")}],
                       "description": "Standard object's metadata."}),
            );
        }
        object.insert(
            GVK.into(),
            json!([{"group": t.group, "version": t.version, "kind": t.kind}]),
        );
    }
    schema
}

/// The OpenAPI name and schema of a served type.
fn schema_of(t: &ResourceType) -> Option<(String, Value)> {
    if t.custom {
        return Some((custom_name(t), custom_schema(t)));
    }
    let builtins = builtins();
    let name = builtins
        .by_kind
        .get(&(t.group.clone(), t.version.clone(), t.kind.clone()))?;
    Some((name.clone(), builtins.schemas.get(name)?.clone()))
}

fn collect_refs(value: &Value, into: &mut Vec<String>) {
    match value {
        Value::Object(object) => {
            if let Some(Value::String(reference)) = object.get("$ref")
                && let Some(name) = reference.strip_prefix(REF_PREFIX)
            {
                into.push(name.to_string());
            }
            object.values().for_each(|v| collect_refs(v, into));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, into)),
        _ => {}
    }
}

/// The schemas `roots` refer to, transitively, with the roots.
fn closure(roots: Map<String, Value>) -> Map<String, Value> {
    let builtins = builtins();
    let mut schemas = roots;
    let mut pending = Vec::new();
    schemas.values().for_each(|v| collect_refs(v, &mut pending));
    let mut seen: BTreeSet<String> = schemas.keys().cloned().collect();
    while let Some(name) = pending.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if let Some(schema) = builtins.schemas.get(&name) {
            collect_refs(schema, &mut pending);
            schemas.insert(name, schema.clone());
        }
    }
    schemas
}

fn gvk_extension(t: &ResourceType) -> Value {
    json!({"group": t.group, "version": t.version, "kind": t.kind})
}

fn paths_of(t: &ResourceType, schema_name: &str) -> Vec<(String, Value)> {
    let prefix = if t.group.is_empty() {
        format!("/api/{}", t.version)
    } else {
        format!("/apis/{}/{}", t.group, t.version)
    };
    let collection = if t.namespaced {
        format!("{prefix}/namespaces/{{namespace}}/{}", t.plural)
    } else {
        format!("{prefix}/{}", t.plural)
    };
    let body = json!({"content": {"application/json": {"schema": {"$ref": format!("{REF_PREFIX}{schema_name}")}}}});
    let answer = json!({"200": body.clone()});
    let field_validation = json!({"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true},
        "description": "Ignore, Warn or Strict: what the server does with fields the schema does not declare."});
    let field_manager = json!({"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": true}});
    let operation = |id: &str, write: bool| {
        let mut operation = json!({"operationId": format!("{id}{}", t.kind), "responses": answer,
            GVK: gvk_extension(t), "x-kubernetes-action": id});
        if write {
            operation["parameters"] = json!([field_validation, field_manager]);
            operation["requestBody"] = body.clone();
        }
        operation
    };
    let mut patch = operation("patch", true);
    // Only the media types kubectl needs no schema extensions for:
    // strategic merge stays with its built-in knowledge of the types.
    patch["requestBody"] = json!({"content": {
        "application/json-patch+json": {"schema": {"type": "object"}},
        "application/merge-patch+json": {"schema": {"type": "object"}},
        "application/apply-patch+yaml": {"schema": {"type": "object"}}}});
    vec![
        (
            collection.clone(),
            json!({"get": operation("list", false), "post": operation("post", true)}),
        ),
        (
            format!("{collection}/{{name}}"),
            json!({"get": operation("get", false), "put": operation("put", true),
                   "patch": patch, "delete": operation("delete", false)}),
        ),
    ]
}

/// The document of one group/version (`/openapi/v3/apis/<group>/<version>`,
/// `/openapi/v3/api/v1`), or `None` when nothing is served there.
pub fn group_version(registry: &Registry, group: &str, version: &str) -> Option<Value> {
    let mut roots = Map::new();
    let mut paths = Map::new();
    for t in registry.in_group_version(group, version) {
        let Some((name, schema)) = schema_of(t) else {
            continue;
        };
        paths.extend(paths_of(t, &name));
        roots.insert(name, schema);
    }
    if roots.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": closure(roots)},
    }))
}

/// `/openapi/v3`: where each group/version's document is, with a hash of
/// its content (kubectl caches documents by that URL).
pub fn root(registry: &Registry) -> Value {
    let mut paths = Map::new();
    for (group, versions) in registry.groups() {
        for version in versions {
            let Some(document) = group_version(registry, &group, &version) else {
                continue;
            };
            let path = if group.is_empty() {
                format!("api/{version}")
            } else {
                format!("apis/{group}/{version}")
            };
            let hash = hex::encode_upper(Sha256::digest(document.to_string().as_bytes()));
            paths.insert(
                path.clone(),
                json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={hash}")}),
            );
        }
    }
    json!({"paths": paths})
}

/// The fields of `object` (dotted paths) that the schema of `t` does not
/// declare, for `fieldValidation=Strict`; empty where the type has no
/// schema here.
pub fn undeclared_fields(t: &ResourceType, object: &Value) -> Vec<String> {
    let Some((_, schema)) = schema_of(t) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    walk(&schema, object, "", &mut found);
    found
}

/// A built-in object as kube-apiserver decodes it into its Go type: fields
/// the schema does not declare are gone (custom types prune by their own
/// schema in the store).
pub fn without_undeclared(t: &ResourceType, mut object: Value) -> Value {
    if t.custom {
        return object;
    }
    for path in undeclared_fields(t, &object) {
        remove_path(&mut object, &path);
    }
    object
}

/// Removes the field at a dotted path (`a.b[2].c`) as `walk` spells it.
fn remove_path(object: &mut Value, path: &str) {
    let mut steps: Vec<&str> = Vec::new();
    for part in path.split('.') {
        let mut rest = part;
        if let Some(open) = rest.find('[') {
            steps.push(&rest[..open]);
            rest = &rest[open..];
            while let Some(end) = rest.find(']') {
                steps.push(&rest[..=end]);
                rest = &rest[end + 1..];
            }
        } else {
            steps.push(rest);
        }
    }
    let Some((last, parents)) = steps.split_last() else {
        return;
    };
    let mut current = object;
    for step in parents {
        let next = match step.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            Some(index) => index.parse::<usize>().ok().and_then(|i| current.get_mut(i)),
            None => current.get_mut(*step),
        };
        match next {
            Some(next) => current = next,
            None => return,
        }
    }
    if let Some(fields) = current.as_object_mut() {
        fields.remove(*last);
    }
}

/// What a schema that may be a `$ref` (or `allOf` of one) stands for.
fn resolve(schema: &Value) -> &Value {
    let mut current = schema;
    for _ in 0..16 {
        let reference = current
            .get("$ref")
            .or_else(|| current.pointer("/allOf/0/$ref"))
            .and_then(Value::as_str);
        match reference
            .and_then(|r| r.strip_prefix(REF_PREFIX))
            .and_then(|name| builtins().schemas.get(name))
        {
            Some(target) => current = target,
            None => break,
        }
    }
    current
}

fn walk(schema: &Value, value: &Value, path: &str, found: &mut Vec<String>) {
    let schema = resolve(schema);
    if schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return;
    }
    match value {
        Value::Object(fields) => {
            if let Some(Value::Object(properties)) = schema.get("properties") {
                // Strategic merge patches carry `$patch`, `$setElementOrder/…`
                // and other directives beside the fields.
                for (key, field) in fields.iter().filter(|(k, _)| !k.starts_with('$')) {
                    let here = if path.is_empty() {
                        key.clone()
                    } else {
                        format!("{path}.{key}")
                    };
                    match properties.get(key) {
                        Some(declared) => walk(declared, field, &here, found),
                        None => found.push(here),
                    }
                }
            } else if let Some(values) =
                schema.get("additionalProperties").filter(|s| s.is_object())
            {
                for (key, field) in fields {
                    walk(values, field, &format!("{path}.{key}"), found);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (index, item) in items.iter().enumerate() {
                    walk(item_schema, item, &format!("{path}[{index}]"), found);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_documents_carry_kinds_and_their_references() {
        let registry = Registry::with_builtins();
        let document = group_version(&registry, "apps", "v1").unwrap();
        let schemas = &document["components"]["schemas"];
        assert_eq!(
            schemas["io.k8s.api.apps.v1.Deployment"][GVK],
            json!([{"group": "apps", "version": "v1", "kind": "Deployment"}])
        );
        assert!(schemas.get(OBJECT_META).is_some());
        assert!(schemas.get("io.k8s.api.core.v1.Container").is_some());
        let patch =
            &document["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"];
        assert_eq!(patch[GVK]["kind"], "Deployment");
        assert_eq!(patch["parameters"][0]["name"], "fieldValidation");
        assert!(group_version(&registry, "apps", "v9").is_none());
        let root = root(&registry);
        assert!(
            root["paths"]["api/v1"]["serverRelativeURL"]
                .as_str()
                .unwrap()
                .starts_with("/openapi/v3/api/v1?hash=")
        );
    }

    #[test]
    fn strict_validation_names_undeclared_fields() {
        let registry = Registry::with_builtins();
        let t = registry.get("", "v1", "configmaps").unwrap();
        let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "x", "labels": {"a": "b"}, "colour": "red"},
            "data": {"k": "v"}, "extra": 1});
        let mut found = undeclared_fields(t, &object);
        found.sort();
        assert_eq!(found, vec!["extra", "metadata.colour"]);
        let strategic = json!({"metadata": {"$setElementOrder/finalizers": [], "labels": {"$patch": "replace"}}});
        assert!(undeclared_fields(t, &strategic).is_empty());
        let deployment = registry.get("apps", "v1", "deployments").unwrap();
        let object = json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "b", "imagePullPolicy": "Always", "colour": 1}]}}}});
        assert_eq!(
            undeclared_fields(deployment, &object),
            vec!["spec.template.spec.containers[0].colour"]
        );
        assert_eq!(
            without_undeclared(deployment, object),
            json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "b", "imagePullPolicy": "Always"}]}}}})
        );
    }
}

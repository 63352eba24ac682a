//! Request bodies in `application/vnd.kubernetes.protobuf`, as kubectl's
//! typed clients send them (`kubectl create namespace`, `create
//! configmap`, `auth can-i`, …), turned into the JSON objects the rest of
//! the API stores.
//!
//! Go's generated marshallers write every non-pointer field, so an empty
//! string or a zero timestamp means "not set", as `omitempty` does in JSON.
//! Every message is destructured without `..`: a field this decoder does
//! not carry into JSON is refused, never dropped silently.

use std::collections::BTreeMap;

use base64::Engine;
use k8s_pb::api::authorization::v1 as authorization;
use k8s_pb::api::core::v1 as core;
use k8s_pb::api::rbac::v1 as rbac;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_pb::apimachinery::pkg::runtime::Unknown;
use prost::Message;
use serde_json::{Map, Value, json};

/// The four bytes that open every Kubernetes protobuf object.
const MAGIC: &[u8] = b"k8s\0";

/// The seconds of Go's zero `time.Time`, which `metav1.Time` writes when unset.
const GO_ZERO_TIME_SECONDS: i64 = -62_135_596_800;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtobufError {
    #[error("the protobuf body does not start with the Kubernetes magic number")]
    NoMagic,
    #[error("the protobuf body is not a valid {message}: {reason}")]
    Malformed {
        message: &'static str,
        reason: String,
    },
    #[error(
        "protobuf bodies of {kind} ({api_version}) are not decoded by the in-memory API; send JSON"
    )]
    UnsupportedKind { api_version: String, kind: String },
    #[error("the protobuf body sets {field}, which the in-memory API does not decode; send JSON")]
    UnsupportedField { field: &'static str },
}

/// Decodes a `runtime.Unknown` envelope and the object it carries.
pub fn decode(bytes: &[u8]) -> Result<Value, ProtobufError> {
    let body = bytes.strip_prefix(MAGIC).ok_or(ProtobufError::NoMagic)?;
    let envelope = Unknown::decode(body).map_err(|e| malformed("runtime.Unknown", e))?;
    let type_meta = envelope.type_meta.unwrap_or_default();
    let api_version = type_meta.api_version.unwrap_or_default();
    let kind = type_meta.kind.unwrap_or_default();
    if envelope.content_encoding.is_some_and(|e| !e.is_empty()) {
        return Err(ProtobufError::UnsupportedField {
            field: "contentEncoding",
        });
    }
    let raw = envelope.raw.unwrap_or_default();
    let mut object = match (api_version.as_str(), kind.as_str()) {
        ("v1", "Namespace") => namespace(decode_message(&raw, "v1.Namespace")?)?,
        ("v1", "ConfigMap") => config_map(decode_message(&raw, "v1.ConfigMap")?)?,
        ("v1", "Secret") => secret(decode_message(&raw, "v1.Secret")?)?,
        ("v1", "ServiceAccount") => service_account(decode_message(&raw, "v1.ServiceAccount")?)?,
        ("authorization.k8s.io/v1", "SelfSubjectAccessReview") => {
            self_subject_access_review(decode_message(&raw, "v1.SelfSubjectAccessReview")?)?
        }
        ("rbac.authorization.k8s.io/v1", "Role") => {
            let rbac::Role { metadata, rules } = decode_message(&raw, "v1.Role")?;
            role(metadata, rules)?
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            let rbac::ClusterRole {
                metadata,
                rules,
                aggregation_rule,
            } = decode_message(&raw, "v1.ClusterRole")?;
            refuse_if(aggregation_rule.is_some(), "aggregationRule")?;
            role(metadata, rules)?
        }
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            let rbac::RoleBinding {
                metadata,
                subjects,
                role_ref,
            } = decode_message(&raw, "v1.RoleBinding")?;
            binding(metadata, subjects, role_ref)?
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            let rbac::ClusterRoleBinding {
                metadata,
                subjects,
                role_ref,
            } = decode_message(&raw, "v1.ClusterRoleBinding")?;
            binding(metadata, subjects, role_ref)?
        }
        _ => return Err(ProtobufError::UnsupportedKind { api_version, kind }),
    };
    object.insert("apiVersion".into(), json!(api_version));
    object.insert("kind".into(), json!(kind));
    Ok(Value::Object(object))
}

fn decode_message<M: Message + Default>(
    raw: &[u8],
    message: &'static str,
) -> Result<M, ProtobufError> {
    M::decode(raw).map_err(|e| malformed(message, e))
}

fn malformed(message: &'static str, error: prost::DecodeError) -> ProtobufError {
    ProtobufError::Malformed {
        message,
        reason: error.to_string(),
    }
}

fn refuse_if(set: bool, field: &'static str) -> Result<(), ProtobufError> {
    if set {
        Err(ProtobufError::UnsupportedField { field })
    } else {
        Ok(())
    }
}

/// Builds a JSON object the way Go's `omitempty` would.
#[derive(Default)]
struct Fields(Map<String, Value>);

impl Fields {
    fn text(&mut self, key: &str, value: Option<String>) -> &mut Self {
        if let Some(value) = value.filter(|v| !v.is_empty()) {
            self.0.insert(key.into(), json!(value));
        }
        self
    }

    /// A pointer field in Go: `false` is a value, only absence is unset.
    fn flag(&mut self, key: &str, value: Option<bool>) -> &mut Self {
        if let Some(value) = value {
            self.0.insert(key.into(), json!(value));
        }
        self
    }

    fn value(&mut self, key: &str, value: Option<Value>) -> &mut Self {
        if let Some(value) = value {
            self.0.insert(key.into(), value);
        }
        self
    }

    fn strings(&mut self, key: &str, map: BTreeMap<String, String>) -> &mut Self {
        if !map.is_empty() {
            self.0.insert(key.into(), json!(map));
        }
        self
    }

    fn bytes(&mut self, key: &str, map: BTreeMap<String, Vec<u8>>) -> &mut Self {
        if !map.is_empty() {
            let encoded: Map<String, Value> = map
                .into_iter()
                .map(|(k, v)| {
                    (
                        k,
                        json!(base64::engine::general_purpose::STANDARD.encode(v)),
                    )
                })
                .collect();
            self.0.insert(key.into(), Value::Object(encoded));
        }
        self
    }

    fn list(&mut self, key: &str, items: Vec<Value>) -> &mut Self {
        if !items.is_empty() {
            self.0.insert(key.into(), Value::Array(items));
        }
        self
    }

    fn object(&mut self, key: &str, fields: Fields) -> &mut Self {
        if !fields.0.is_empty() {
            self.0.insert(key.into(), Value::Object(fields.0));
        }
        self
    }

    fn done(&mut self) -> Fields {
        Fields(std::mem::take(&mut self.0))
    }
}

fn time(value: Option<meta::Time>) -> Option<Value> {
    // JSON carries whole seconds (RFC 3339), so the nanoseconds go.
    let meta::Time { seconds, nanos: _ } = value?;
    let seconds = seconds.unwrap_or_default();
    if seconds == GO_ZERO_TIME_SECONDS {
        return None;
    }
    let at = time::OffsetDateTime::from_unix_timestamp(seconds).ok()?;
    at.format(&time::format_description::well_known::Rfc3339)
        .ok()
        .map(Value::String)
}

fn object_meta(metadata: Option<meta::ObjectMeta>) -> Result<Fields, ProtobufError> {
    let meta::ObjectMeta {
        name,
        generate_name,
        namespace,
        self_link: _,
        uid,
        resource_version,
        generation,
        creation_timestamp,
        deletion_timestamp,
        deletion_grace_period_seconds,
        labels,
        annotations,
        owner_references,
        finalizers,
        managed_fields,
    } = metadata.unwrap_or_default();
    refuse_if(!managed_fields.is_empty(), "metadata.managedFields")?;
    let owners = owner_references
        .into_iter()
        .map(|o| {
            let meta::OwnerReference {
                api_version,
                kind,
                name,
                uid,
                controller,
                block_owner_deletion,
            } = o;
            Value::Object(
                Fields::default()
                    .text("apiVersion", api_version)
                    .text("kind", kind)
                    .text("name", name)
                    .text("uid", uid)
                    .flag("controller", controller)
                    .flag("blockOwnerDeletion", block_owner_deletion)
                    .done()
                    .0,
            )
        })
        .collect();
    Ok(Fields::default()
        .text("name", name)
        .text("generateName", generate_name)
        .text("namespace", namespace)
        .text("uid", uid)
        .text("resourceVersion", resource_version)
        .value(
            "generation",
            generation.filter(|g| *g != 0).map(Value::from),
        )
        .value("creationTimestamp", time(creation_timestamp))
        .value("deletionTimestamp", time(deletion_timestamp))
        .value(
            "deletionGracePeriodSeconds",
            deletion_grace_period_seconds.map(Value::from),
        )
        .strings("labels", labels)
        .strings("annotations", annotations)
        .list("ownerReferences", owners)
        .list(
            "finalizers",
            finalizers.into_iter().map(Value::String).collect(),
        )
        .done())
}

fn with_metadata(metadata: Option<meta::ObjectMeta>) -> Result<Fields, ProtobufError> {
    let mut fields = Fields::default();
    fields
        .0
        .insert("metadata".into(), Value::Object(object_meta(metadata)?.0));
    Ok(fields)
}

fn namespace(message: core::Namespace) -> Result<Map<String, Value>, ProtobufError> {
    let core::Namespace {
        metadata,
        spec,
        status,
    } = message;
    let core::NamespaceSpec { finalizers } = spec.unwrap_or_default();
    let core::NamespaceStatus { phase, conditions } = status.unwrap_or_default();
    refuse_if(!conditions.is_empty(), "status.conditions")?;
    let mut spec = Fields::default();
    spec.list(
        "finalizers",
        finalizers.into_iter().map(Value::String).collect(),
    );
    let mut status = Fields::default();
    status.text("phase", phase);
    Ok(with_metadata(metadata)?
        .object("spec", spec)
        .object("status", status)
        .done()
        .0)
}

fn config_map(message: core::ConfigMap) -> Result<Map<String, Value>, ProtobufError> {
    let core::ConfigMap {
        metadata,
        immutable,
        data,
        binary_data,
    } = message;
    Ok(with_metadata(metadata)?
        .flag("immutable", immutable)
        .strings("data", data)
        .bytes("binaryData", binary_data)
        .done()
        .0)
}

fn secret(message: core::Secret) -> Result<Map<String, Value>, ProtobufError> {
    let core::Secret {
        metadata,
        immutable,
        data,
        string_data,
        r#type,
    } = message;
    Ok(with_metadata(metadata)?
        .flag("immutable", immutable)
        .bytes("data", data)
        .strings("stringData", string_data)
        .text("type", r#type)
        .done()
        .0)
}

fn service_account(message: core::ServiceAccount) -> Result<Map<String, Value>, ProtobufError> {
    let core::ServiceAccount {
        metadata,
        secrets,
        image_pull_secrets,
        automount_service_account_token,
    } = message;
    let secrets = secrets
        .into_iter()
        .map(|s| {
            let core::ObjectReference {
                kind,
                namespace,
                name,
                uid,
                api_version,
                resource_version,
                field_path,
            } = s;
            Value::Object(
                Fields::default()
                    .text("kind", kind)
                    .text("namespace", namespace)
                    .text("name", name)
                    .text("uid", uid)
                    .text("apiVersion", api_version)
                    .text("resourceVersion", resource_version)
                    .text("fieldPath", field_path)
                    .done()
                    .0,
            )
        })
        .collect();
    let pull_secrets = image_pull_secrets
        .into_iter()
        .map(|s| Value::Object(Fields::default().text("name", s.name).done().0))
        .collect();
    Ok(with_metadata(metadata)?
        .list("secrets", secrets)
        .list("imagePullSecrets", pull_secrets)
        .flag(
            "automountServiceAccountToken",
            automount_service_account_token,
        )
        .done()
        .0)
}

/// A list whose empty strings are values (`apiGroups: [""]` is the core group).
fn texts(items: Vec<String>) -> Vec<Value> {
    items.into_iter().map(Value::String).collect()
}

fn role(
    metadata: Option<meta::ObjectMeta>,
    rules: Vec<rbac::PolicyRule>,
) -> Result<Map<String, Value>, ProtobufError> {
    let rules = rules
        .into_iter()
        .map(|rule| {
            let rbac::PolicyRule {
                verbs,
                api_groups,
                resources,
                resource_names,
                non_resource_ur_ls,
            } = rule;
            Value::Object(
                Fields::default()
                    .list("verbs", texts(verbs))
                    .list("apiGroups", texts(api_groups))
                    .list("resources", texts(resources))
                    .list("resourceNames", texts(resource_names))
                    .list("nonResourceURLs", texts(non_resource_ur_ls))
                    .done()
                    .0,
            )
        })
        .collect();
    Ok(with_metadata(metadata)?.list("rules", rules).done().0)
}

fn binding(
    metadata: Option<meta::ObjectMeta>,
    subjects: Vec<rbac::Subject>,
    role_ref: Option<rbac::RoleRef>,
) -> Result<Map<String, Value>, ProtobufError> {
    let subjects = subjects
        .into_iter()
        .map(|subject| {
            let rbac::Subject {
                kind,
                api_group,
                name,
                namespace,
            } = subject;
            Value::Object(
                Fields::default()
                    .text("kind", kind)
                    .text("apiGroup", api_group)
                    .text("name", name)
                    .text("namespace", namespace)
                    .done()
                    .0,
            )
        })
        .collect();
    let rbac::RoleRef {
        api_group,
        kind,
        name,
    } = role_ref.unwrap_or_default();
    let mut role_ref = Fields::default();
    role_ref
        .text("kind", kind)
        .text("name", name)
        .value("apiGroup", Some(json!(api_group.unwrap_or_default())));
    Ok(with_metadata(metadata)?
        .list("subjects", subjects)
        .object("roleRef", role_ref)
        .done()
        .0)
}

fn self_subject_access_review(
    message: authorization::SelfSubjectAccessReview,
) -> Result<Map<String, Value>, ProtobufError> {
    let authorization::SelfSubjectAccessReview {
        metadata,
        spec,
        status: _,
    } = message;
    let authorization::SelfSubjectAccessReviewSpec {
        resource_attributes,
        non_resource_attributes,
    } = spec.unwrap_or_default();
    let mut spec = Fields::default();
    if let Some(attributes) = resource_attributes {
        let authorization::ResourceAttributes {
            namespace,
            verb,
            group,
            version,
            resource,
            subresource,
            name,
            field_selector,
            label_selector,
        } = attributes;
        refuse_if(
            field_selector.is_some(),
            "spec.resourceAttributes.fieldSelector",
        )?;
        refuse_if(
            label_selector.is_some(),
            "spec.resourceAttributes.labelSelector",
        )?;
        let mut fields = Fields::default();
        fields
            .text("namespace", namespace)
            .text("verb", verb)
            .text("group", group)
            .text("version", version)
            .text("resource", resource)
            .text("subresource", subresource)
            .text("name", name);
        // An empty group is the core group: keep the attribute present.
        fields.0.entry("group").or_insert(json!(""));
        spec.object("resourceAttributes", fields);
    }
    if let Some(attributes) = non_resource_attributes {
        let authorization::NonResourceAttributes { path, verb } = attributes;
        let mut fields = Fields::default();
        fields.text("path", path).text("verb", verb);
        spec.object("nonResourceAttributes", fields);
    }
    Ok(with_metadata(metadata)?.object("spec", spec).done().0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
        let unknown = Unknown {
            type_meta: Some(k8s_pb::apimachinery::pkg::runtime::TypeMeta {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
            }),
            raw: Some(raw),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        let mut bytes = MAGIC.to_vec();
        bytes.extend(unknown.encode_to_vec());
        bytes
    }

    fn metadata(name: &str) -> Option<meta::ObjectMeta> {
        Some(meta::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(String::new()),
            creation_timestamp: Some(meta::Time {
                seconds: Some(GO_ZERO_TIME_SECONDS),
                nanos: Some(0),
            }),
            labels: [("app".to_string(), "x".to_string())].into(),
            ..Default::default()
        })
    }

    #[test]
    fn config_map_as_kubectl_create_sends_it() {
        let message = core::ConfigMap {
            metadata: metadata("settings"),
            immutable: None,
            data: [("a".to_string(), "b".to_string())].into(),
            binary_data: [("bin".to_string(), vec![0, 1])].into(),
        };
        let object = decode(&envelope("v1", "ConfigMap", message.encode_to_vec())).unwrap();
        assert_eq!(
            object,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "settings", "labels": {"app": "x"}},
                   "data": {"a": "b"}, "binaryData": {"bin": "AAE="}})
        );
    }

    #[test]
    fn access_review_keeps_the_core_group() {
        let message = authorization::SelfSubjectAccessReview {
            metadata: metadata("").map(|m| meta::ObjectMeta {
                labels: BTreeMap::new(),
                ..m
            }),
            spec: Some(authorization::SelfSubjectAccessReviewSpec {
                resource_attributes: Some(authorization::ResourceAttributes {
                    verb: Some("create".into()),
                    group: Some(String::new()),
                    resource: Some("pods".into()),
                    namespace: Some("default".into()),
                    ..Default::default()
                }),
                non_resource_attributes: None,
            }),
            status: None,
        };
        let object = decode(&envelope(
            "authorization.k8s.io/v1",
            "SelfSubjectAccessReview",
            message.encode_to_vec(),
        ))
        .unwrap();
        assert_eq!(
            object["spec"],
            json!({"resourceAttributes": {"verb": "create", "group": "", "resource": "pods", "namespace": "default"}})
        );
        assert_eq!(object["metadata"], json!({}));
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        assert_eq!(decode(b"{}"), Err(ProtobufError::NoMagic));
        assert!(matches!(
            decode(b"k8s\0\xff\xff"),
            Err(ProtobufError::Malformed { .. })
        ));
        assert!(matches!(
            decode(&envelope("apps/v1", "Deployment", Vec::new())),
            Err(ProtobufError::UnsupportedKind { .. })
        ));
        let with_managed_fields = core::Namespace {
            metadata: Some(meta::ObjectMeta {
                managed_fields: vec![meta::ManagedFieldsEntry::default()],
                ..Default::default()
            }),
            spec: None,
            status: None,
        };
        assert_eq!(
            decode(&envelope(
                "v1",
                "Namespace",
                with_managed_fields.encode_to_vec()
            )),
            Err(ProtobufError::UnsupportedField {
                field: "metadata.managedFields"
            })
        );
    }
}

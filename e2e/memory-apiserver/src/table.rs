//! The `Table` form of gets and lists (`Accept: application/json;as=Table;
//! v=v1;g=meta.k8s.io`), which `kubectl get` asks for: a Name column, a
//! CRD's `additionalPrinterColumns`, and Age, with each row's object as
//! `PartialObjectMetadata`.

use serde_json::{Value, json};

use super::resources::ResourceType;

/// Whether the request's `Accept` header asks for a Table.
pub fn wanted(accept: &str) -> bool {
    accept
        .split(',')
        .any(|media| media.split(';').map(str::trim).any(|p| p == "as=Table"))
}

/// Ages as kubectl prints them (`45s`, `7m`, `3h`, `12d`).
fn human_age(seconds: i64) -> String {
    match seconds.max(0) {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn age(object: &Value) -> String {
    let created = object
        .pointer("/metadata/creationTimestamp")
        .and_then(Value::as_str)
        .and_then(|t| {
            time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
        });
    match created {
        Some(created) => human_age((time::OffsetDateTime::now_utc() - created).whole_seconds()),
        None => "<unknown>".into(),
    }
}

/// A printer column's JSONPath, for the forms CRDs use: `.a.b`, `.a[0].b`
/// and `.a[?(@.type=="Ready")].b`.
pub fn json_path<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    let mut current = object;
    let mut rest = path.trim().trim_start_matches('{').trim_end_matches('}');
    rest = rest.strip_prefix('.').unwrap_or(rest);
    while !rest.is_empty() {
        if let Some(filter) = rest.strip_prefix("[?(@.") {
            let end = filter.find(")]")?;
            let (condition, after) = (&filter[..end], &filter[end + 2..]);
            let (field, wanted) = condition.split_once("==")?;
            let wanted = wanted.trim().trim_matches(|c| c == '"' || c == '\'');
            current = current
                .as_array()?
                .iter()
                .find(|item| item.get(field.trim()).and_then(Value::as_str) == Some(wanted))?;
            rest = after.strip_prefix('.').unwrap_or(after);
            continue;
        }
        if let Some(index) = rest.strip_prefix('[') {
            let end = index.find(']')?;
            let position: usize = index[..end].parse().ok()?;
            current = current.as_array()?.get(position)?;
            let after = &index[end + 1..];
            rest = after.strip_prefix('.').unwrap_or(after);
            continue;
        }
        let end = rest.find(['.', '[']).unwrap_or(rest.len());
        current = current.get(&rest[..end])?;
        rest = &rest[end..];
        rest = rest.strip_prefix('.').unwrap_or(rest);
    }
    Some(current)
}

fn cell(value: Option<&Value>, column_type: &str) -> Value {
    match value {
        None | Some(Value::Null) => Value::Null,
        Some(Value::String(s)) if column_type == "date" => {
            let parsed =
                time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339);
            match parsed {
                Ok(t) => json!(human_age(
                    (time::OffsetDateTime::now_utc() - t).whole_seconds()
                )),
                Err(_) => json!(s),
            }
        }
        Some(Value::Array(_) | Value::Object(_)) => {
            json!(value.map(Value::to_string).unwrap_or_default())
        }
        Some(other) => other.clone(),
    }
}

/// A column kube-apiserver's printers compute for a built-in type.
struct BuiltinColumn {
    name: &'static str,
    kind: &'static str,
    description: &'static str,
    cell: fn(&Value) -> Value,
}

fn count(object: &Value, fields: &[&str]) -> Value {
    let total: usize = fields
        .iter()
        .filter_map(|f| object.get(*f).and_then(Value::as_object))
        .map(|m| m.len())
        .sum();
    json!(total)
}

fn number(object: &Value, pointer: &str) -> i64 {
    object
        .pointer(pointer)
        .and_then(Value::as_i64)
        .unwrap_or_default()
}

fn text(object: &Value, pointer: &str) -> Value {
    json!(
        object
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
    )
}

/// The built-in columns where they are cheap to compute (the real server
/// prints more types this way).
fn builtin_columns(t: &ResourceType) -> Vec<BuiltinColumn> {
    if t.custom {
        return Vec::new();
    }
    match (t.group.as_str(), t.plural.as_str()) {
        ("", "namespaces") => vec![BuiltinColumn {
            name: "Status",
            kind: "string",
            description: "The status of the namespace",
            cell: |o| text(o, "/status/phase"),
        }],
        ("", "configmaps") => vec![BuiltinColumn {
            name: "Data",
            kind: "string",
            description: "Number of data in configmap",
            cell: |o| count(o, &["data", "binaryData"]),
        }],
        ("", "secrets") => vec![
            BuiltinColumn {
                name: "Type",
                kind: "string",
                description: "The type of the secret",
                cell: |o| text(o, "/type"),
            },
            BuiltinColumn {
                name: "Data",
                kind: "string",
                description: "The number of data in the secret",
                cell: |o| count(o, &["data"]),
            },
        ],
        ("apps", "deployments") => vec![
            BuiltinColumn {
                name: "Ready",
                kind: "string",
                description: "Number of the pod with ready state",
                cell: |o| {
                    json!(format!(
                        "{}/{}",
                        number(o, "/status/readyReplicas"),
                        number(o, "/spec/replicas")
                    ))
                },
            },
            BuiltinColumn {
                name: "Up-to-date",
                kind: "string",
                description: "Total number of non-terminated pods targeted by this deployment that have the desired template spec.",
                cell: |o| json!(number(o, "/status/updatedReplicas")),
            },
            BuiltinColumn {
                name: "Available",
                kind: "string",
                description: "Total number of available pods (ready for at least minReadySeconds) targeted by this deployment.",
                cell: |o| json!(number(o, "/status/availableReplicas")),
            },
        ],
        ("coordination.k8s.io", "leases") => vec![BuiltinColumn {
            name: "Holder",
            kind: "string",
            description: "The holder of the lease",
            cell: |o| text(o, "/spec/holderIdentity"),
        }],
        _ => Vec::new(),
    }
}

/// The Table of `objects` as the real server renders it for `t`.
pub fn render(t: &ResourceType, objects: &[Value], resource_version: Option<String>) -> Value {
    let mut columns = vec![json!({"name": "Name", "type": "string", "format": "name",
        "description": "Name must be unique within a namespace.", "priority": 0})];
    let builtin = builtin_columns(t);
    for column in &builtin {
        columns.push(
            json!({"name": column.name, "type": column.kind, "format": "",
            "description": column.description, "priority": 0}),
        );
    }
    for column in &t.printer_columns {
        columns.push(json!({
            "name": column.get("name").cloned().unwrap_or(json!("")),
            "type": column.get("type").cloned().unwrap_or(json!("string")),
            "format": column.get("format").cloned().unwrap_or(json!("")),
            "description": column.get("description").cloned().unwrap_or(json!("")),
            "priority": column.get("priority").cloned().unwrap_or(json!(0)),
        }));
    }
    let has_age = t
        .printer_columns
        .iter()
        .any(|c| c.get("name").and_then(Value::as_str) == Some("Age"));
    if !has_age {
        columns.push(json!({"name": "Age", "type": "date", "format": "",
            "description": "CreationTimestamp is a timestamp representing the server time when this object was created.",
            "priority": 0}));
    }
    let rows: Vec<Value> = objects
        .iter()
        .map(|object| {
            let mut cells = vec![
                object
                    .pointer("/metadata/name")
                    .cloned()
                    .unwrap_or(Value::Null),
            ];
            cells.extend(builtin.iter().map(|column| (column.cell)(object)));
            for column in &t.printer_columns {
                let path = column
                    .get("jsonPath")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let column_type = column
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("string");
                cells.push(cell(json_path(object, path), column_type));
            }
            if !has_age {
                cells.push(json!(age(object)));
            }
            let mut metadata = object.get("metadata").cloned().unwrap_or(json!({}));
            if let Some(m) = metadata.as_object_mut() {
                m.remove("managedFields");
            }
            json!({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1", "metadata": metadata}})
        })
        .collect();
    let mut metadata = json!({});
    if let Some(rv) = resource_version {
        metadata["resourceVersion"] = json!(rv);
    }
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata,
        "columnDefinitions": columns, "rows": rows})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_paths_of_printer_columns() {
        let object = json!({"spec": {"size": 3, "items": [{"a": 1}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        assert_eq!(json_path(&object, ".spec.size"), Some(&json!(3)));
        assert_eq!(json_path(&object, ".spec.items[0].a"), Some(&json!(1)));
        assert_eq!(
            json_path(&object, ".status.conditions[?(@.type==\"Ready\")].status"),
            Some(&json!("True"))
        );
        assert_eq!(json_path(&object, ".spec.missing"), None);
    }

    #[test]
    fn kubectl_accept_header_asks_for_a_table() {
        assert!(wanted(
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
        ));
        assert!(!wanted("application/json"));
    }

    #[test]
    fn ages_read_as_kubectl_prints_them() {
        assert_eq!(human_age(45), "45s");
        assert_eq!(human_age(600), "10m");
        assert_eq!(human_age(3 * 3600), "3h");
        assert_eq!(human_age(5 * 86_400), "5d");
    }
}

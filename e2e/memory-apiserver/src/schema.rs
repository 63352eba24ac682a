//! CustomResourceDefinition schemas as the API server applies them: a CRD
//! must be valid and structural; objects are pruned of unknown fields,
//! defaulted and validated against the `openAPIV3Schema` of the version
//! they are written or read through.

use serde_json::Value;

/// One field error: (field, cause reason, message).
pub type FieldError = (String, &'static str, String);

fn preserves_unknown(schema: &Value) -> bool {
    schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Removes what the schema does not know, unless it preserves unknown
/// fields. At the top, `apiVersion`, `kind` and `metadata` always stay.
pub fn prune(schema: &Value, object: &mut Value) {
    prune_at(schema, object, true);
}

fn prune_at(schema: &Value, value: &mut Value, top: bool) {
    match value {
        Value::Object(map) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            let keep_unknown = preserves_unknown(schema)
                || matches!(additional, Some(Value::Bool(true)) | Some(Value::Object(_)));
            map.retain(|key, _| {
                (top && matches!(key.as_str(), "apiVersion" | "kind" | "metadata"))
                    || keep_unknown
                    || properties.is_some_and(|p| p.contains_key(key))
            });
            for (key, child) in map.iter_mut() {
                if top && key == "metadata" {
                    continue;
                }
                let child_schema = properties
                    .and_then(|p| p.get(key))
                    .or(additional.filter(|a| a.is_object()));
                if let Some(child_schema) = child_schema {
                    prune_at(child_schema, child, false);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    prune_at(item_schema, item, false);
                }
            }
        }
        _ => {}
    }
}

/// Fills in `default`s of missing properties of the objects present.
pub fn apply_defaults(schema: &Value, value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                for (key, property) in properties {
                    if !map.contains_key(key)
                        && let Some(default) = property.get("default")
                    {
                        map.insert(key.clone(), default.clone());
                    }
                }
                for (key, child) in map.iter_mut() {
                    if let Some(property) = properties.get(key) {
                        apply_defaults(property, child);
                    }
                }
            } else if let Some(additional @ Value::Object(_)) = schema.get("additionalProperties") {
                for child in map.values_mut() {
                    apply_defaults(additional, child);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    apply_defaults(item_schema, item);
                }
            }
        }
        _ => {}
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// Every violation of `schema` in `object` (metadata is not the schema's).
pub fn validate(schema: &Value, object: &Value) -> Vec<FieldError> {
    let mut errors = Vec::new();
    validate_at(schema, object, "", true, &mut errors);
    errors
}

fn validate_at(schema: &Value, value: &Value, path: &str, top: bool, errors: &mut Vec<FieldError>) {
    if value.is_null() {
        if schema.get("nullable") != Some(&Value::Bool(true))
            && !top
            && let Some(expected) = schema.get("type").and_then(Value::as_str)
        {
            errors.push((
                path.to_string(),
                "FieldValueTypeInvalid",
                format!(
                    "Invalid value: \"null\": {path} in body must be of type {expected}: \"null\""
                ),
            ));
        }
        return;
    }
    let int_or_string = schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    if let Some(expected) = schema.get("type").and_then(Value::as_str) {
        let actual = type_name(value);
        let fits = actual == expected
            || (expected == "number" && actual == "integer")
            || (int_or_string && matches!(actual, "integer" | "string"));
        if !fits {
            errors.push((
                path.to_string(),
                "FieldValueTypeInvalid",
                format!("Invalid value: \"{actual}\": {path} in body must be of type {expected}: \"{actual}\""),
            ));
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        let listed: Vec<String> = allowed.iter().map(shown).collect();
        errors.push((
            path.to_string(),
            "FieldValueNotSupported",
            format!(
                "Unsupported value: {}: supported values: {}",
                shown(value),
                listed.join(", ")
            ),
        ));
    }
    if let Some(number) = value.as_f64() {
        if let Some(minimum) = schema.get("minimum").and_then(Value::as_f64)
            && number < minimum
        {
            errors.push((
                path.to_string(),
                "FieldValueInvalid",
                format!(
                    "Invalid value: {value}: {path} in body should be greater than or equal to {}",
                    schema["minimum"]
                ),
            ));
        }
        if let Some(maximum) = schema.get("maximum").and_then(Value::as_f64)
            && number > maximum
        {
            errors.push((
                path.to_string(),
                "FieldValueInvalid",
                format!(
                    "Invalid value: {value}: {path} in body should be less than or equal to {}",
                    schema["maximum"]
                ),
            ));
        }
    }
    if let Some(text) = value.as_str() {
        let length = text.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && length < min
        {
            errors.push((
                path.to_string(),
                "FieldValueInvalid",
                format!(
                    "Invalid value: {text:?}: {path} in body should be at least {min} chars long"
                ),
            ));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && length > max
        {
            errors.push((
                path.to_string(),
                "FieldValueTooLong",
                format!("Too long: may not be more than {max} bytes"),
            ));
        }
    }
    match value {
        Value::Object(map) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            if let Some(required) = schema.get("required").and_then(Value::as_array) {
                for name in required.iter().filter_map(Value::as_str) {
                    if !map.contains_key(name) {
                        errors.push((
                            join(path, name),
                            "FieldValueRequired",
                            "Required value".into(),
                        ));
                    }
                }
            }
            for (key, child) in map {
                if top && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                    continue;
                }
                let child_schema = properties
                    .and_then(|p| p.get(key))
                    .or_else(|| schema.get("additionalProperties").filter(|a| a.is_object()));
                if let Some(child_schema) = child_schema {
                    validate_at(child_schema, child, &join(path, key), false, errors);
                }
            }
        }
        Value::Array(items) => {
            let count = items.len() as u64;
            if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
                && count > max
            {
                errors.push((
                    path.to_string(),
                    "FieldValueTooMany",
                    format!("Too many: {count}: must have at most {max} items"),
                ));
            }
            if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
                && count < min
            {
                errors.push((
                    path.to_string(),
                    "FieldValueInvalid",
                    format!(
                        "Invalid value: {count}: {path} in body should have at least {min} items"
                    ),
                ));
            }
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate_at(item_schema, item, &format!("{path}[{i}]"), false, errors);
                }
            }
        }
        _ => {}
    }
}

/// The structural-schema rule the API server enforces first: every
/// property and item names its type (unless int-or-string or preserving
/// unknown fields).
fn structural(schema: &Value, path: &str, errors: &mut Vec<FieldError>) {
    let Some(map) = schema.as_object() else {
        return;
    };
    let exempt = map.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true))
        || map.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    if !map.contains_key("type") && !exempt {
        errors.push((
            format!("{path}.type"),
            "FieldValueRequired",
            "Required value: must not be empty for specified object fields".into(),
        ));
    }
    if let Some(properties) = map.get("properties").and_then(Value::as_object) {
        for (name, property) in properties {
            structural(property, &format!("{path}.properties[{name}]"), errors);
        }
    }
    if let Some(items) = map.get("items") {
        structural(items, &format!("{path}.items"), errors);
    }
    if let Some(additional @ Value::Object(_)) = map.get("additionalProperties") {
        structural(additional, &format!("{path}.additionalProperties"), errors);
    }
}

fn is_dns_label(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

/// What makes a CustomResourceDefinition invalid (422 on the real server).
pub fn crd_errors(crd: &Value) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let text = |pointer: &str| {
        crd.pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let group = text("/spec/group");
    let plural = text("/spec/names/plural");
    let name = text("/metadata/name");
    if group.is_empty() || !group.contains('.') {
        errors.push((
            "spec.group".into(),
            "FieldValueInvalid",
            format!("Invalid value: {group:?}: should be a domain with at least one dot"),
        ));
    }
    if !is_dns_label(plural) {
        errors.push((
            "spec.names.plural".into(),
            "FieldValueInvalid",
            format!(
                "Invalid value: {plural:?}: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character"
            ),
        ));
    }
    if text("/spec/names/kind").is_empty() {
        errors.push((
            "spec.names.kind".into(),
            "FieldValueRequired",
            "Required value".into(),
        ));
    }
    if name != format!("{plural}.{group}") {
        errors.push((
            "metadata.name".into(),
            "FieldValueInvalid",
            format!("Invalid value: {name:?}: must be spec.names.plural+\".\"+spec.group"),
        ));
    }
    let versions = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if versions.is_empty() {
        errors.push((
            "spec.versions".into(),
            "FieldValueInvalid",
            "Invalid value: \"null\": must have exactly one version marked as storage version"
                .into(),
        ));
    }
    let storage = versions
        .iter()
        .filter(|v| v.get("storage") == Some(&Value::Bool(true)))
        .count();
    if !versions.is_empty() && storage != 1 {
        errors.push((
            "spec.versions".into(),
            "FieldValueInvalid",
            format!(
                "Invalid value: {}: must have exactly one version marked as storage version",
                Value::Array(versions.clone())
            ),
        ));
    }
    for (i, version) in versions.iter().enumerate() {
        let base = format!("spec.versions[{i}].schema.openAPIV3Schema");
        match version.pointer("/schema/openAPIV3Schema") {
            None => errors.push((
                base,
                "FieldValueRequired",
                "Required value: schemas are required".into(),
            )),
            Some(schema) => structural(schema, &base, &mut errors),
        }
    }
    errors
}

/// Sorts versions as Kubernetes prefers them: GA before beta before alpha,
/// higher numbers first, anything else last in alphabetical order.
pub fn by_priority(versions: &mut [String]) {
    fn key(version: &str) -> (u8, std::cmp::Reverse<u64>, std::cmp::Reverse<u64>, String) {
        let parsed = version.strip_prefix('v').and_then(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let major: u64 = digits.parse().ok()?;
            let tail = &rest[digits.len()..];
            let (class, minor_text) = if tail.is_empty() {
                (0, "0")
            } else if let Some(m) = tail.strip_prefix("beta") {
                (1, m)
            } else if let Some(m) = tail.strip_prefix("alpha") {
                (2, m)
            } else {
                return None;
            };
            let minor: u64 = if minor_text.is_empty() && class != 0 {
                0
            } else {
                minor_text.parse().ok()?
            };
            Some((class, major, minor))
        });
        match parsed {
            Some((class, major, minor)) => (
                class,
                std::cmp::Reverse(major),
                std::cmp::Reverse(minor),
                String::new(),
            ),
            None => (
                3,
                std::cmp::Reverse(0),
                std::cmp::Reverse(0),
                version.to_string(),
            ),
        }
    }
    versions.sort_by_key(|v| key(v));
}

/// An object as the requested version presents it: pruned and defaulted
/// through that version's schema.
pub fn present(schema: Option<&Value>, object: &mut Value) {
    if let Some(schema) = schema {
        prune(schema, object);
        apply_defaults(schema, object);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {"spec": {"type": "object",
        "required": ["size"],
        "properties": {
            "size": {"type": "integer", "minimum": 1, "maximum": 10},
            "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
        }}}})
    }

    #[test]
    fn prunes_unknown_fields_and_applies_defaults() {
        let mut object = json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n"},
            "spec": {"size": 1, "extra": true, "free": {"anything": 1}}, "other": 1});
        present(Some(&schema()), &mut object);
        assert_eq!(
            object,
            json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n"},
                "spec": {"size": 1, "mode": "a", "free": {"anything": 1}}})
        );
    }

    #[test]
    fn reports_one_cause_per_field() {
        let errors = validate(&schema(), &json!({"spec": {"size": "big", "mode": "c"}}));
        let fields: Vec<&str> = errors.iter().map(|(f, _, _)| f.as_str()).collect();
        assert_eq!(fields, ["spec.mode", "spec.size"]);
        assert_eq!(
            errors[1].2,
            "Invalid value: \"string\": spec.size in body must be of type integer: \"string\""
        );
        assert_eq!(
            errors[0].2,
            "Unsupported value: \"c\": supported values: \"a\", \"b\""
        );
        let missing = validate(&schema(), &json!({"spec": {}}));
        assert_eq!(missing[0].0, "spec.size");
        let big = validate(&schema(), &json!({"spec": {"size": 11}}));
        assert!(big[0].2.ends_with("should be less than or equal to 10"));
    }

    #[test]
    fn version_priority() {
        let mut versions: Vec<String> = ["v1alpha1", "foo", "v1beta1", "v2alpha1", "v1", "v1beta2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        by_priority(&mut versions);
        assert_eq!(
            versions,
            ["v1", "v1beta2", "v1beta1", "v2alpha1", "v1alpha1", "foo"]
        );
    }

    #[test]
    fn a_crd_without_types_is_not_structural() {
        let crd = json!({"metadata": {"name": "ks.example.io"}, "spec": {"group": "example.io",
            "names": {"kind": "K", "plural": "ks"}, "scope": "Namespaced",
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {}}}}}]}});
        let errors = crd_errors(&crd);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].0,
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].type"
        );
    }
}

//! The API server's per-type rules on writes: decoding (a Lease's
//! MicroTime), defaulting and normalising (a Secret's `stringData`, a CSR's
//! condition times), validation (CSRs, Leases, finalizers, immutable
//! Secrets and ConfigMaps) and `metadata.generation`. Messages and causes follow the
//! real server's (`Kind.group "name" is invalid: field: …`).

use serde_json::{Value, json};

use super::error::ApiError;
use super::resources::ResourceType;

/// One field error: (field, cause reason, message).
type FieldError = (String, &'static str, String);

/// Finalizers every type understands without a domain prefix.
const STANDARD_FINALIZERS: &[&str] = &["kubernetes", "orphan", "foregroundDeletion"];

fn is(t: &ResourceType, group: &str, plural: &str) -> bool {
    t.group == group && t.plural == plural
}

/// Rules of a create; `object` is what will be stored.
pub fn on_create(
    t: &ResourceType,
    name: &str,
    object: &mut Value,
    now: &str,
) -> Result<(), ApiError> {
    decode(t, object)?;
    normalise(t, object, None, now);
    let mut errors = Vec::new();
    errors.extend(finalizer_names(t, object));
    errors.extend(type_rules(t, None, object));
    if !t.generation
        && let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut)
    {
        metadata.remove("generation");
    }
    finish(t, name, errors)
}

/// Rules of an update from `old` to `new` (any write but a create).
pub fn on_update(
    t: &ResourceType,
    name: &str,
    old: &Value,
    new: &mut Value,
    now: &str,
) -> Result<(), ApiError> {
    decode(t, new)?;
    normalise(t, new, Some(old), now);
    let mut errors = Vec::new();
    errors.extend(finalizer_names(t, new));
    if old.pointer("/metadata/deletionTimestamp").is_some() {
        let before = strings(old.pointer("/metadata/finalizers"));
        let added: Vec<String> = strings(new.pointer("/metadata/finalizers"))
            .into_iter()
            .filter(|f| !before.contains(f))
            .collect();
        if !added.is_empty() {
            errors.push((
                "metadata.finalizers".into(),
                "FieldValueForbidden",
                format!(
                    "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {}",
                    go_strings(&added)
                ),
            ));
        }
    }
    errors.extend(immutability(t, old, new));
    errors.extend(type_rules(t, Some(old), new));
    finish(t, name, errors)?;
    set_generation(t, old, new);
    Ok(())
}

/// A PUT without `resourceVersion`, for the types that insist on one.
pub fn unconditional_update(t: &ResourceType, name: &str, body: &Value) -> Result<(), ApiError> {
    let strict = t.custom || is(t, "coordination.k8s.io", "leases");
    let version = body
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if strict && version.is_empty() {
        // The real server names the resource here, not the kind.
        let as_resource = ResourceType {
            kind: t.plural.clone(),
            ..t.clone()
        };
        return Err(ApiError::invalid_fields(
            &as_resource,
            name,
            &[(
                "metadata.resourceVersion".into(),
                "FieldValueInvalid",
                "Invalid value: 0: must be specified for an update".into(),
            )],
        ));
    }
    Ok(())
}

fn finish(t: &ResourceType, name: &str, errors: Vec<FieldError>) -> Result<(), ApiError> {
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_fields(t, name, &errors))
    }
}

fn strings(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// A list of strings as Go prints it (`[]string{"a", "b"}`).
fn go_strings(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("{s:?}")).collect();
    format!("[]string{{{}}}", quoted.join(", "))
}

/// Bytes as kube-apiserver v1.36 quotes an invalid value: their JSON
/// form, a base64 string (`"LXg="`).
fn quoted_bytes(bytes: &[u8]) -> String {
    use base64::Engine;
    format!(
        "{:?}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// Values the real server cannot even decode: 400, before any validation.
fn decode(t: &ResourceType, object: &Value) -> Result<(), ApiError> {
    if is(t, "", "secrets") {
        use base64::Engine;
        let data = object.get("data").and_then(Value::as_object);
        for value in data.into_iter().flat_map(|d| d.values()) {
            let text = value.as_str().unwrap_or_default();
            if let Err(e) = base64::engine::general_purpose::STANDARD.decode(text) {
                return Err(ApiError::bad_request(format!(
                    "Secret in version \"v1\" cannot be handled as a Secret: {e}"
                )));
            }
        }
    }
    if is(t, "coordination.k8s.io", "leases") {
        for field in ["renewTime", "acquireTime"] {
            let Some(value) = object.pointer(&format!("/spec/{field}")) else {
                continue;
            };
            if value.is_null() {
                continue;
            }
            let text = value.as_str().unwrap_or_default();
            if !is_micro_time(text) {
                return Err(ApiError::bad_request(format!(
                    "Lease in version \"v1\" cannot be handled as a Lease: parsing time {text:?} as \"2006-01-02T15:04:05.000000Z07:00\": spec.{field} must be a MicroTime with six fractional digits"
                )));
            }
        }
    }
    Ok(())
}

/// RFC 3339 with exactly six fractional digits, as MicroTime decodes.
fn is_micro_time(text: &str) -> bool {
    let bytes = text.as_bytes();
    let digits = |range: std::ops::Range<usize>| {
        bytes
            .get(range)
            .is_some_and(|b| b.iter().all(u8::is_ascii_digit))
    };
    let at = |i: usize, c: u8| bytes.get(i) == Some(&c);
    let zone_ok = match bytes.get(26) {
        Some(b'Z') => bytes.len() == 27,
        Some(b'+' | b'-') => bytes.len() == 32 && digits(27..29) && at(29, b':') && digits(30..32),
        _ => false,
    };
    digits(0..4)
        && at(4, b'-')
        && digits(5..7)
        && at(7, b'-')
        && digits(8..10)
        && at(10, b'T')
        && digits(11..13)
        && at(13, b':')
        && digits(14..16)
        && at(16, b':')
        && digits(17..19)
        && at(19, b'.')
        && digits(20..26)
        && zone_ok
        && time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).is_ok()
}

/// What the server changes in what it is sent.
fn normalise(t: &ResourceType, object: &mut Value, old: Option<&Value>, now: &str) {
    if is(t, "", "secrets") {
        // stringData is write-only: merged into data, never stored.
        if let Some(Value::Object(plain)) =
            object.as_object_mut().and_then(|m| m.remove("stringData"))
        {
            use base64::Engine;
            let data = object
                .as_object_mut()
                .map(|m| m.entry("data").or_insert_with(|| json!({})));
            if let Some(Value::Object(data)) = data {
                for (key, value) in plain {
                    let text = value.as_str().unwrap_or_default();
                    data.insert(
                        key,
                        json!(base64::engine::general_purpose::STANDARD.encode(text)),
                    );
                }
            }
        }
        if object.get("type").is_none() {
            object["type"] = json!("Opaque");
        }
    }
    if is(t, "certificates.k8s.io", "certificatesigningrequests") {
        let previous = old
            .and_then(|o| o.pointer("/status/conditions"))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if let Some(conditions) = object
            .pointer_mut("/status/conditions")
            .and_then(Value::as_array_mut)
        {
            for condition in conditions.iter_mut() {
                let Some(map) = condition.as_object_mut() else {
                    continue;
                };
                let same = previous.iter().find(|p| p.get("type") == map.get("type"));
                for field in ["lastUpdateTime", "lastTransitionTime"] {
                    if map.get(field).is_none_or(Value::is_null) {
                        let kept = same
                            .and_then(|p| p.get(field))
                            .filter(|v| !v.is_null())
                            .cloned();
                        map.insert(field.into(), kept.unwrap_or_else(|| json!(now)));
                    }
                }
            }
        }
    }
}

/// Built-in types want a domain in a finalizer's name unless it is a
/// standard one; CRDs and custom objects are validated by the generic
/// rules, which accept any qualified name (the server's own
/// `customresourcecleanup.apiextensions.k8s.io` included).
fn finalizer_names(t: &ResourceType, object: &Value) -> Vec<FieldError> {
    if t.custom || is(t, "apiextensions.k8s.io", "customresourcedefinitions") {
        return Vec::new();
    }
    strings(object.pointer("/metadata/finalizers"))
        .iter()
        .enumerate()
        .filter(|(_, name)| !STANDARD_FINALIZERS.contains(&name.as_str()) && !name.contains('/'))
        .map(|(i, name)| {
            (
                format!("metadata.finalizers[{i}]"),
                "FieldValueInvalid",
                format!(
                    "Invalid value: {name:?}: name is neither a standard finalizer name nor is it fully qualified"
                ),
            )
        })
        .collect()
}

/// Immutable Secrets and ConfigMaps refuse changes to their content.
fn immutability(t: &ResourceType, old: &Value, new: &Value) -> Vec<FieldError> {
    if !(is(t, "", "secrets") || is(t, "", "configmaps")) {
        return Vec::new();
    }
    if old.get("immutable") != Some(&Value::Bool(true)) {
        return Vec::new();
    }
    let mut errors = Vec::new();
    if new.get("immutable") != Some(&Value::Bool(true)) {
        errors.push((
            "immutable".to_string(),
            "FieldValueForbidden",
            "Forbidden: field is immutable when `immutable` is set".to_string(),
        ));
    }
    for field in ["data", "binaryData"] {
        let empty = json!({});
        let before = old.get(field).unwrap_or(&empty);
        let after = new.get(field).unwrap_or(&empty);
        if before != after {
            errors.push((
                field.to_string(),
                "FieldValueForbidden",
                "Forbidden: field is immutable when `immutable` is set".to_string(),
            ));
        }
    }
    errors
}

fn type_rules(t: &ResourceType, old: Option<&Value>, new: &Value) -> Vec<FieldError> {
    if is(t, "coordination.k8s.io", "leases") {
        return lease_rules(new);
    }
    if is(t, "certificates.k8s.io", "certificatesigningrequests") {
        return csr_rules(old, new);
    }
    Vec::new()
}

fn lease_rules(lease: &Value) -> Vec<FieldError> {
    let mut errors = Vec::new();
    if let Some(duration) = lease
        .pointer("/spec/leaseDurationSeconds")
        .and_then(Value::as_i64)
        && duration <= 0
    {
        errors.push((
            "spec.leaseDurationSeconds".into(),
            "FieldValueInvalid",
            format!("Invalid value: {duration}: must be greater than 0"),
        ));
    }
    if let Some(transitions) = lease
        .pointer("/spec/leaseTransitions")
        .and_then(Value::as_i64)
        && transitions < 0
    {
        errors.push((
            "spec.leaseTransitions".into(),
            "FieldValueInvalid",
            format!("Invalid value: {transitions}: must be greater than or equal to 0"),
        ));
    }
    errors
}

/// The PEM blocks of `text`: (label, DER bytes), or why they cannot be read.
fn pem_blocks(text: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    use base64::Engine;
    let text = std::str::from_utf8(text).map_err(|_| "not PEM text".to_string())?;
    let mut blocks = Vec::new();
    let mut lines = text.lines().map(str::trim);
    while let Some(line) = lines.next() {
        let Some(label) = line
            .strip_prefix("-----BEGIN ")
            .and_then(|l| l.strip_suffix("-----"))
        else {
            continue;
        };
        let end = format!("-----END {label}-----");
        let mut body = String::new();
        let mut closed = false;
        for inner in lines.by_ref() {
            if inner == end {
                closed = true;
                break;
            }
            body.push_str(inner);
        }
        if !closed {
            return Err(format!("unterminated PEM block {label}"));
        }
        let der = base64::engine::general_purpose::STANDARD
            .decode(body)
            .map_err(|e| format!("PEM block {label}: {e}"))?;
        blocks.push((label.to_string(), der));
    }
    Ok(blocks)
}

fn decode_base64_field(value: Option<&Value>) -> Option<Vec<u8>> {
    use base64::Engine;
    value
        .and_then(Value::as_str)
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
}

fn csr_rules(old: Option<&Value>, csr: &Value) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let request = decode_base64_field(csr.pointer("/spec/request")).unwrap_or_default();
    let request_ok = match pem_blocks(&request) {
        Ok(blocks) => match blocks.as_slice() {
            [(label, der)] if label == "CERTIFICATE REQUEST" => {
                use x509_parser::prelude::FromDer;
                x509_parser::certification_request::X509CertificationRequest::from_der(der)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            _ => Err("PEM block type must be CERTIFICATE REQUEST".into()),
        },
        Err(_) => Err("PEM block type must be CERTIFICATE REQUEST".into()),
    };
    if let Err(detail) = request_ok {
        errors.push((
            "spec.request".into(),
            "FieldValueInvalid",
            format!("Invalid value: {}: {detail}", quoted_bytes(&request)),
        ));
    }
    if csr
        .pointer("/spec/usages")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty)
    {
        errors.push((
            "spec.usages".into(),
            "FieldValueRequired",
            "Required value: usages must be provided".into(),
        ));
    }
    if csr
        .pointer("/spec/signerName")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        errors.push((
            "spec.signerName".into(),
            "FieldValueRequired",
            "Required value".into(),
        ));
    }
    if let Some(seconds) = csr
        .pointer("/spec/expirationSeconds")
        .and_then(Value::as_i64)
        && seconds < 600
    {
        errors.push((
            "spec.expirationSeconds".into(),
            "FieldValueInvalid",
            format!(
                "Invalid value: {seconds}: may not specify a duration less than 600 seconds (10 minutes)"
            ),
        ));
    }
    let conditions = csr
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut seen: Vec<String> = Vec::new();
    for (i, condition) in conditions.iter().enumerate() {
        let kind = condition
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let field = format!("status.conditions[{i}].type");
        if kind.is_empty() {
            errors.push((field, "FieldValueRequired", "Required value".into()));
            continue;
        }
        if seen.contains(&kind) {
            errors.push((
                field,
                "FieldValueDuplicate",
                format!("Duplicate value: {kind:?}"),
            ));
            continue;
        }
        let exclusive = match kind.as_str() {
            "Approved" => Some("Denied"),
            "Denied" => Some("Approved"),
            _ => None,
        };
        if let Some(other) = exclusive
            && seen.iter().any(|s| s == other)
        {
            errors.push((
                field,
                "FieldValueInvalid",
                format!(
                    "Invalid value: {kind:?}: Approved and Denied conditions are mutually exclusive"
                ),
            ));
        }
        seen.push(kind);
    }
    let certificate = csr.pointer("/status/certificate");
    let previous = old.and_then(|o| o.pointer("/status/certificate"));
    if let Some(previous) = previous.filter(|p| p.as_str().is_some_and(|s| !s.is_empty()))
        && certificate != Some(previous)
    {
        errors.push((
            "status.certificate".into(),
            "FieldValueForbidden",
            "Forbidden: updates may not modify existing certificate content".into(),
        ));
    } else if let Some(bytes) = decode_base64_field(certificate).filter(|b| !b.is_empty()) {
        let problem = match pem_blocks(&bytes) {
            Err(e) => Some(e),
            Ok(blocks) if blocks.is_empty() => {
                Some("must contain at least one CERTIFICATE PEM block".into())
            }
            Ok(blocks) => blocks.iter().find_map(|(label, der)| {
                if label != "CERTIFICATE" {
                    return Some(format!(
                        "only CERTIFICATE PEM blocks are allowed, found {label:?}"
                    ));
                }
                x509_parser::parse_x509_certificate(der)
                    .err()
                    .map(|e| e.to_string())
            }),
        };
        if let Some(detail) = problem {
            errors.push((
                "status.certificate".into(),
                "FieldValueInvalid",
                format!("Invalid value: \"<certificate data>\": {detail}"),
            ));
        }
    }
    errors
}

/// `metadata.generation` after an update, for the types that keep one:
/// custom objects and CRDs on any change but metadata and status,
/// Deployments also on annotation changes, and any of them when deletion
/// starts.
fn set_generation(t: &ResourceType, old: &Value, new: &mut Value) {
    if !t.generation {
        if let Some(metadata) = new.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.remove("generation");
        }
        return;
    }
    let generation = old
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let content = |o: &Value| {
        let mut o = o.clone();
        if let Some(map) = o.as_object_mut() {
            for field in ["metadata", "status", "apiVersion", "kind"] {
                map.remove(field);
            }
        }
        o
    };
    let mut changed = content(old) != content(new);
    if is(t, "apps", "deployments") {
        changed |= old.pointer("/metadata/annotations") != new.pointer("/metadata/annotations");
    }
    let deletion_starts = old.pointer("/metadata/deletionTimestamp").is_none()
        && new.pointer("/metadata/deletionTimestamp").is_some();
    let next = if changed || deletion_starts {
        generation + 1
    } else {
        generation
    };
    new["metadata"]["generation"] = json!(next);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_needs_six_fractional_digits() {
        assert!(is_micro_time("2026-01-02T03:04:05.000000Z"));
        assert!(is_micro_time("2026-01-02T03:04:05.123456+02:00"));
        assert!(!is_micro_time("2026-01-02T03:04:05Z"));
        assert!(!is_micro_time("2026-01-02T03:04:05.123Z"));
        assert!(!is_micro_time("2026-01-02T03:04:05.1234567Z"));
        assert!(!is_micro_time("2026-13-02T03:04:05.000000Z"));
        assert!(!is_micro_time(""));
    }

    #[test]
    fn go_formatting_of_values() {
        assert_eq!(
            go_strings(&["a".into(), "b".into()]),
            "[]string{\"a\", \"b\"}"
        );
        assert_eq!(quoted_bytes(b"-x"), "\"LXg=\"");
    }
}

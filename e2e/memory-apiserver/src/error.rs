//! The error of every request the API refuses, rendered as the
//! `meta/v1 Status` kube-apiserver answers with.

use serde_json::{Value, json};

use super::fields::Conflicts;
use super::resources::ResourceType;

/// A failed request, rendered as a `meta/v1 Status`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    /// `details` of the Status (`name`, `group`, `kind`, `causes`), or null.
    pub details: Value,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: Value::Null,
        }
    }

    /// The same error, naming the object it is about.
    pub fn about(mut self, t: &ResourceType, name: &str) -> Self {
        let mut details = json!({"name": name, "kind": t.plural});
        if !t.group.is_empty() {
            details["group"] = json!(t.group);
        }
        if let Some(causes) = self.details.get("causes") {
            details["causes"] = causes.clone();
        }
        self.details = details;
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn not_found(t: &ResourceType, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", group_resource(t)),
        )
        .about(t, name)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }

    /// `422 Invalid` for field errors, as the API server words them:
    /// `Kind.group "name" is invalid: field: Invalid value: …`, one cause
    /// each. Each error is (field, cause reason, message).
    pub fn invalid_fields(t: &ResourceType, name: &str, errors: &[(String, &str, String)]) -> Self {
        let rendered: Vec<String> = errors
            .iter()
            .map(|(field, _, message)| format!("{field}: {message}"))
            .collect();
        let all = match rendered.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let group_kind = if t.group.is_empty() {
            t.kind.clone()
        } else {
            format!("{}.{}", t.kind, t.group)
        };
        let mut error = Self::invalid(format!("{group_kind} {name:?} is invalid: {all}"));
        let causes: Vec<Value> = errors
            .iter()
            .map(|(field, reason, message)| json!({"reason": reason, "message": message, "field": field}))
            .collect();
        let mut details = json!({"name": name, "kind": t.kind, "causes": causes});
        if !t.group.is_empty() {
            details["group"] = json!(t.group);
        }
        error.details = details;
        error
    }

    /// A write based on an outdated resourceVersion.
    pub fn stale(t: &ResourceType, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                group_resource(t)
            ),
        )
        .about(t, name)
    }

    /// A server-side apply that changes fields other managers own.
    pub fn apply_conflict(conflicts: &Conflicts) -> Self {
        let causes: Vec<Value> = conflicts
            .0
            .iter()
            .map(|(manager, path)| {
                json!({"reason": "FieldManagerConflict", "message": format!("conflict with {manager}"), "field": path})
            })
            .collect();
        let mut error = Self::new(409, "Conflict", conflicts.message());
        error.details = json!({"causes": causes});
        error
    }

    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        // Internal errors carry no reason.
        if self.reason.is_empty()
            && let Some(fields) = status.as_object_mut()
        {
            fields.remove("reason");
        }
        if !self.details.is_null() {
            status["details"] = self.details.clone();
        }
        status
    }
}

pub(crate) fn group_resource(t: &ResourceType) -> String {
    if t.group.is_empty() {
        t.plural.clone()
    } else {
        format!("{}.{}", t.plural, t.group)
    }
}

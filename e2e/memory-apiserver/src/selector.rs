//! Label and field selectors, as the API server parses them.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid {kind} selector {input:?}: {reason}")]
pub struct SelectorError {
    kind: &'static str,
    input: String,
    reason: String,
}

/// Splits on commas that are not inside parentheses.
fn split_terms(input: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in input.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&input[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&input[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn set_values(text: &str) -> Option<Vec<String>> {
    let inner = text.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(
        inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect(),
    )
}

impl LabelSelector {
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let err = |reason: &str| SelectorError {
            kind: "label",
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let mut requirements = Vec::new();
        for term in split_terms(input) {
            let requirement = if let Some(key) = term.strip_prefix('!') {
                Requirement::NotExists(key.trim().to_string())
            } else if let Some((key, value)) = term.split_once("!=") {
                Requirement::NotEquals(key.trim().into(), value.trim().into())
            } else if let Some((key, value)) = term.split_once("==") {
                Requirement::Equals(key.trim().into(), value.trim().into())
            } else if let Some((key, value)) = term.split_once('=') {
                Requirement::Equals(key.trim().into(), value.trim().into())
            } else if let Some((key, rest)) = term.split_once(" notin ") {
                let values = set_values(rest).ok_or_else(|| err("notin needs (values)"))?;
                Requirement::NotIn(key.trim().into(), values)
            } else if let Some((key, rest)) = term.split_once(" in ") {
                let values = set_values(rest).ok_or_else(|| err("in needs (values)"))?;
                Requirement::In(key.trim().into(), values)
            } else {
                Requirement::Exists(term.to_string())
            };
            let key = match &requirement {
                Requirement::Equals(k, _)
                | Requirement::NotEquals(k, _)
                | Requirement::In(k, _)
                | Requirement::NotIn(k, _)
                | Requirement::Exists(k)
                | Requirement::NotExists(k) => k,
            };
            if !valid_key(key) {
                return Err(err(&format!("invalid key {key:?}")));
            }
            requirements.push(requirement);
        }
        Ok(LabelSelector(requirements))
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        let label = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => label(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            Requirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => !label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::NotExists(k) => label(k).is_none(),
        })
    }
}

/// A parsed field selector over dotted paths (`metadata.name`,
/// `spec.signerName`, …); empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let err = |reason: &str| SelectorError {
            kind: "field",
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let mut terms = Vec::new();
        for term in split_terms(input) {
            let (path, equal, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, true, v)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, true, v)
            } else {
                return Err(err("each term must be path=value or path!=value"));
            };
            let path = path.trim();
            if path.is_empty() || path.split('.').any(str::is_empty) {
                return Err(err(&format!("invalid field path {path:?}")));
            }
            terms.push((path.to_string(), equal, value.trim().to_string()));
        }
        Ok(FieldSelector(terms))
    }

    /// The value `path` must equal, when a term requires it (as
    /// apimachinery's `RequiresExactMatch`).
    pub fn requires_exact_match(&self, path: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(p, equal, _)| *equal && p == path)
            .map(|(_, _, value)| value.as_str())
    }

    /// The field paths the selector names.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(path, _, _)| path.as_str())
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(path, equal, value)| {
            let mut current = Some(object);
            for part in path.split('.') {
                current = current.and_then(|v| v.get(part));
            }
            let actual = match current {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object() -> Value {
        json!({"metadata": {"name": "n", "namespace": "ns", "labels": {"app": "web", "tier": "front"}},
               "spec": {"signerName": "x/y"}})
    }

    #[test]
    fn label_operators() {
        let o = object();
        for (selector, expected) in [
            ("app=web", true),
            ("app==web,tier=front", true),
            ("app!=web", false),
            ("app in (web, api)", true),
            ("app notin (web)", false),
            ("tier", true),
            ("!missing", true),
            ("!tier", false),
            ("", true),
        ] {
            assert_eq!(
                LabelSelector::parse(selector).unwrap().matches(&o),
                expected,
                "{selector}"
            );
        }
    }

    #[test]
    fn bad_selectors_are_errors() {
        assert!(LabelSelector::parse("app in web").is_err());
        assert!(LabelSelector::parse("a b=c").is_err());
        assert!(FieldSelector::parse("metadata.name").is_err());
        assert!(FieldSelector::parse("metadata..name=x").is_err());
    }

    #[test]
    fn field_paths() {
        let o = object();
        assert!(
            FieldSelector::parse("metadata.name=n,metadata.namespace==ns")
                .unwrap()
                .matches(&o)
        );
        assert!(
            FieldSelector::parse("spec.signerName=x/y")
                .unwrap()
                .matches(&o)
        );
        assert!(
            !FieldSelector::parse("spec.signerName!=x/y")
                .unwrap()
                .matches(&o)
        );
        assert!(FieldSelector::parse("spec.missing=").unwrap().matches(&o));
    }
}

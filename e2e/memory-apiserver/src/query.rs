//! What connect (`exec`, `attach`) and `log` requests name in their
//! query: booleans as Go parses them, and the container.

use serde_json::Value;

use super::error::ApiError;

/// A boolean query parameter, as Go's `strconv.ParseBool` reads it.
pub fn parse_bool(key: &str, value: &str) -> Result<bool, ApiError> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        other => Err(ApiError::bad_request(format!(
            "{key}: invalid boolean value {other:?}"
        ))),
    }
}

/// The container a connect or log request is for: the named one, which
/// must be in the pod, or the pod's only container.
pub fn container_of(pod: &Value, requested: Option<&str>, name: &str) -> Result<String, ApiError> {
    let containers: Vec<&str> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|c| c.get("name").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    match requested {
        Some(container) if containers.contains(&container) => Ok(container.to_string()),
        Some(container) => Err(ApiError::bad_request(format!(
            "container {container} is not valid for pod {name}"
        ))),
        None => match containers.as_slice() {
            [only] => Ok((*only).to_string()),
            [] => Err(ApiError::bad_request(format!(
                "pod {name} does not have any containers"
            ))),
            many => Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}, choose one of: [{}]",
                many.join(" ")
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_container_is_named_or_the_only_one() {
        let pod = json!({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(container_of(&pod, Some("b"), "p").unwrap(), "b");
        let many = container_of(&pod, None, "p").unwrap_err();
        assert_eq!(
            many.message,
            "a container name must be specified for pod p, choose one of: [a b]"
        );
        assert_eq!(container_of(&pod, Some("c"), "p").unwrap_err().code, 400);
        let one = json!({"spec": {"containers": [{"name": "a"}]}});
        assert_eq!(container_of(&one, None, "p").unwrap(), "a");
    }
}

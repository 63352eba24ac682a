//! Authorization as kube-apiserver's RBAC authorizer decides it, when the
//! API is started with `rbac` on: `system:masters` may do anything; anyone
//! else needs a rule of a (Cluster)Role bound to them, their groups or
//! their ServiceAccount. The bootstrap roles every cluster has
//! (`cluster-admin`, `system:discovery`, `system:basic-user`,
//! `system:public-info-viewer`) are created at start.

use serde_json::{Value, json};

use super::error::ApiError;
use super::resources::ResourceType;
use super::store::{Store, User};

pub const RBAC_GROUP: &str = "rbac.authorization.k8s.io";
const MASTERS: &str = "system:masters";

/// What a request asks to do.
#[derive(Debug, Clone)]
pub enum Attributes {
    Resource {
        verb: String,
        group: String,
        /// `plural` or `plural/subresource`.
        resource: String,
        namespace: Option<String>,
        name: Option<String>,
    },
    Path {
        verb: String,
        path: String,
    },
}

fn strings(value: Option<&Value>) -> Vec<&str> {
    value
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn rule_allows(rule: &Value, attributes: &Attributes) -> bool {
    let verbs = strings(rule.get("verbs"));
    match attributes {
        Attributes::Resource {
            verb,
            group,
            resource,
            name,
            ..
        } => {
            let groups = strings(rule.get("apiGroups"));
            let resources = strings(rule.get("resources"));
            let names = strings(rule.get("resourceNames"));
            let subresource_wildcard = resource.split_once('/').map(|(_, sub)| format!("*/{sub}"));
            (verbs.contains(&"*") || verbs.contains(&verb.as_str()))
                && (groups.contains(&"*") || groups.contains(&group.as_str()))
                && (resources.contains(&"*")
                    || resources.contains(&resource.as_str())
                    || subresource_wildcard
                        .as_deref()
                        .is_some_and(|w| resources.contains(&w)))
                && (names.is_empty() || name.as_deref().is_some_and(|n| names.contains(&n)))
        }
        Attributes::Path { verb, path } => {
            (verbs.contains(&"*") || verbs.contains(&verb.as_str()))
                && strings(rule.get("nonResourceURLs")).iter().any(|url| {
                    *url == "*"
                        || url == path
                        || url
                            .strip_suffix('*')
                            .is_some_and(|prefix| path.starts_with(prefix))
                })
        }
    }
}

fn subject_matches(subject: &Value, user: &User, binding_namespace: &str) -> bool {
    let text = |f: &str| subject.get(f).and_then(Value::as_str).unwrap_or_default();
    match text("kind") {
        "User" => text("name") == user.name,
        "Group" => user.groups.iter().any(|g| g == text("name")),
        "ServiceAccount" => {
            let namespace = match text("namespace") {
                "" => binding_namespace,
                ns => ns,
            };
            user.name == format!("system:serviceaccount:{namespace}:{}", text("name"))
        }
        _ => false,
    }
}

fn object_namespace(object: &Value) -> &str {
    object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// One authorization decision, as [`KubeApiOptions::record_requests`]
/// keeps them: who asked to do what, and whether it was allowed (with RBAC
/// off, every request is).
///
/// [`KubeApiOptions::record_requests`]: super::KubeApiOptions::record_requests
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub user: String,
    pub verb: String,
    /// API group (empty for the core group and for non-resource paths).
    pub group: String,
    /// Plural resource; empty for a non-resource path.
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// A non-resource request's path (discovery).
    pub path: Option<String>,
    pub allowed: bool,
    /// A further check of a request recorded already: kube-apiserver
    /// authorizes an apply that creates its object as `patch`, then again
    /// as `create`. Counting requests skips these.
    pub further_check: bool,
}

impl RequestRecord {
    pub fn new(user: &User, attributes: &Attributes, allowed: bool) -> Self {
        match attributes {
            Attributes::Resource {
                verb,
                group,
                resource,
                namespace,
                name,
            } => {
                let (resource, subresource) = match resource.split_once('/') {
                    Some((plural, sub)) => (plural.to_string(), Some(sub.to_string())),
                    None => (resource.clone(), None),
                };
                RequestRecord {
                    user: user.name.clone(),
                    verb: verb.clone(),
                    group: group.clone(),
                    resource,
                    subresource,
                    namespace: namespace.clone(),
                    name: name.clone(),
                    path: None,
                    allowed,
                    further_check: false,
                }
            }
            Attributes::Path { verb, path } => RequestRecord {
                user: user.name.clone(),
                verb: verb.clone(),
                group: String::new(),
                resource: String::new(),
                subresource: None,
                namespace: None,
                name: None,
                path: Some(path.clone()),
                allowed,
                further_check: false,
            },
        }
    }

    /// `resource` or `resource/subresource`, as RBAC rules name it.
    pub fn rule_resource(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.clone(),
        }
    }
}

impl std::fmt::Display for RequestRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let decision = if self.allowed { "allowed" } else { "REFUSED" };
        if let Some(path) = &self.path {
            return write!(f, "{decision}: {} {} {path}", self.user, self.verb);
        }
        write!(
            f,
            "{decision}: {} {} {}/{}",
            self.user,
            self.verb,
            self.group,
            self.rule_resource()
        )?;
        if let Some(namespace) = &self.namespace {
            write!(f, " in {namespace}")?;
        }
        if let Some(name) = &self.name {
            write!(f, " named {name}")?;
        }
        Ok(())
    }
}

/// Whether `user` may do what `attributes` say.
pub fn allowed(store: &Store, user: &User, attributes: &Attributes) -> bool {
    if user.groups.iter().any(|g| g == MASTERS) {
        return true;
    }
    let request_namespace = match attributes {
        Attributes::Resource { namespace, .. } => namespace.clone(),
        Attributes::Path { .. } => None,
    };
    let mut bindings = store.find_in(
        |t| t.group == RBAC_GROUP && t.plural == "clusterrolebindings",
        |_, _| true,
    );
    // A RoleBinding grants only inside its namespace.
    if let Some(namespace) = &request_namespace {
        bindings.extend(store.in_namespace(namespace).into_iter().filter(|located| {
            located.resource.group == RBAC_GROUP && located.resource.plural == "rolebindings"
        }));
    }
    for binding in bindings {
        let namespace = object_namespace(&binding.object).to_string();
        let subjects = binding
            .object
            .get("subjects")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if !subjects
            .iter()
            .any(|s| subject_matches(s, user, &namespace))
        {
            continue;
        }
        let role_kind = binding
            .object
            .pointer("/roleRef/kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let role_name = binding
            .object
            .pointer("/roleRef/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let role = match role_kind.as_str() {
            "ClusterRole" => store.lookup(RBAC_GROUP, "clusterroles", None, &role_name),
            "Role" => store.lookup(RBAC_GROUP, "roles", Some(&namespace), &role_name),
            _ => None,
        };
        if let Some(role) = role {
            let rules = role
                .object
                .get("rules")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if rules.iter().any(|rule| rule_allows(rule, attributes)) {
                return true;
            }
        }
    }
    false
}

/// The 403 the real server answers, in its words.
pub fn forbidden(user: &User, attributes: &Attributes) -> ApiError {
    match attributes {
        Attributes::Path { verb, path } => ApiError::new(
            403,
            "Forbidden",
            format!(
                "forbidden: User {:?} cannot {verb} path {path:?}",
                user.name
            ),
        ),
        Attributes::Resource {
            verb,
            group,
            resource,
            namespace,
            name,
        } => {
            let scope = match namespace {
                Some(ns) => format!("in the namespace {ns:?}"),
                None => "at the cluster scope".to_string(),
            };
            let reason = format!(
                "User {:?} cannot {verb} resource {resource:?} in API group {group:?} {scope}",
                user.name
            );
            let plural = resource.split('/').next().unwrap_or_default();
            let qualified = if group.is_empty() {
                plural.to_string()
            } else {
                format!("{plural}.{group}")
            };
            let message = match name {
                Some(name) => format!("{qualified} {name:?} is forbidden: {reason}"),
                None => format!("{qualified} is forbidden: {reason}"),
            };
            let mut error = ApiError::new(403, "Forbidden", message);
            let mut details = json!({"kind": plural});
            if let Some(name) = name {
                details["name"] = json!(name);
            }
            if !group.is_empty() {
                details["group"] = json!(group);
            }
            error.details = details;
            error
        }
    }
}

/// The roles and bindings every cluster starts with.
pub fn bootstrap(store: &Store, system: &User) {
    let cluster_roles = [
        (
            "cluster-admin",
            json!([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                   {"nonResourceURLs": ["*"], "verbs": ["*"]}]),
            vec![("Group", MASTERS)],
        ),
        (
            "system:discovery",
            json!([{"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez",
                "/openapi", "/openapi/*", "/readyz", "/version", "/version/"], "verbs": ["get"]}]),
            vec![("Group", "system:authenticated")],
        ),
        (
            "system:basic-user",
            json!([{"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]},
                   {"apiGroups": ["authorization.k8s.io"],
                    "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"], "verbs": ["create"]}]),
            vec![("Group", "system:authenticated")],
        ),
        (
            // Bound by delegating authenticators and authorizers (an
            // aggregated API, the user-server): no subject by default.
            "system:auth-delegator",
            json!([{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                   {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}]),
            vec![],
        ),
        (
            "system:public-info-viewer",
            json!([{"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"],
                "verbs": ["get"]}]),
            vec![
                ("Group", "system:authenticated"),
                ("Group", "system:unauthenticated"),
            ],
        ),
    ];
    let registry = store.registry();
    let (Some(role_type), Some(binding_type)) = (
        registry.get(RBAC_GROUP, "v1", "clusterroles").cloned(),
        registry
            .get(RBAC_GROUP, "v1", "clusterrolebindings")
            .cloned(),
    ) else {
        return;
    };
    for (name, rules, subjects) in cluster_roles {
        let role = json!({"metadata": {"name": name,
            "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}}, "rules": rules});
        let subjects: Vec<Value> = subjects
            .iter()
            .map(|(kind, subject)| json!({"apiGroup": RBAC_GROUP, "kind": kind, "name": subject}))
            .collect();
        let binding = json!({"metadata": {"name": name,
                "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
            "subjects": subjects});
        let _ = store.create(&role_type, None, role, system, &Default::default());
        if !subjects.is_empty() {
            let _ = store.create(&binding_type, None, binding, system, &Default::default());
        }
    }
}

/// The verb of a request on a resource path.
pub fn verb(method: &http::Method, named: bool, watch: bool) -> &'static str {
    match (method.as_str(), named) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "unknown",
    }
}

/// The attributes of a request on a resource.
pub fn resource_attributes(
    t: &ResourceType,
    verb: &str,
    subresource: Option<&str>,
    namespace: Option<&str>,
    name: Option<&str>,
) -> Attributes {
    Attributes::Resource {
        verb: verb.to_string(),
        group: t.group.clone(),
        resource: match subresource {
            Some(sub) => format!("{}/{sub}", t.plural),
            None => t.plural.clone(),
        },
        namespace: namespace.map(str::to_string),
        name: name.map(str::to_string),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(groups: &[&str]) -> User {
        User {
            name: "u".into(),
            uid: String::new(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        }
    }

    #[test]
    fn rules_match_verbs_groups_resources_and_names() {
        let rule = json!({"apiGroups": [""], "resources": ["configmaps", "*/status"],
            "verbs": ["get", "list"], "resourceNames": []});
        let request = |verb: &str, resource: &str| Attributes::Resource {
            verb: verb.into(),
            group: String::new(),
            resource: resource.into(),
            namespace: Some("default".into()),
            name: None,
        };
        assert!(rule_allows(&rule, &request("get", "configmaps")));
        assert!(rule_allows(&rule, &request("list", "pods/status")));
        assert!(!rule_allows(&rule, &request("delete", "configmaps")));
        assert!(!rule_allows(&rule, &request("get", "secrets")));
        let named = json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
            "resourceNames": ["one"]});
        assert!(!rule_allows(&named, &request("get", "secrets")));
        let path = json!({"nonResourceURLs": ["/apis/*"], "verbs": ["get"]});
        assert!(rule_allows(
            &path,
            &Attributes::Path {
                verb: "get".into(),
                path: "/apis/apps".into()
            }
        ));
    }

    #[test]
    fn forbidden_messages_read_as_the_api_servers() {
        let attributes = Attributes::Resource {
            verb: "list".into(),
            group: String::new(),
            resource: "configmaps".into(),
            namespace: Some("default".into()),
            name: None,
        };
        assert_eq!(
            forbidden(&user(&[]), &attributes).message,
            "configmaps is forbidden: User \"u\" cannot list resource \"configmaps\" in API group \"\" in the namespace \"default\""
        );
    }

    #[test]
    fn a_record_splits_the_subresource_as_rules_name_it() {
        let attributes = Attributes::Resource {
            verb: "patch".into(),
            group: "addon.open-cluster-management.io".into(),
            resource: "managedclusteraddons/status".into(),
            namespace: Some("cluster-a".into()),
            name: Some("cluster-proxy".into()),
        };
        let record = RequestRecord::new(&user(&[]), &attributes, false);
        assert_eq!(record.resource, "managedclusteraddons");
        assert_eq!(record.subresource.as_deref(), Some("status"));
        assert_eq!(record.rule_resource(), "managedclusteraddons/status");
        assert_eq!(
            record.to_string(),
            "REFUSED: u patch addon.open-cluster-management.io/managedclusteraddons/status in cluster-a named cluster-proxy"
        );
        let discovery = Attributes::Path {
            verb: "get".into(),
            path: "/apis".into(),
        };
        let record = RequestRecord::new(&user(&[]), &discovery, true);
        assert_eq!(
            (record.resource.as_str(), record.path.as_deref()),
            ("", Some("/apis"))
        );
        assert_eq!(record.to_string(), "allowed: u get /apis");
    }
}

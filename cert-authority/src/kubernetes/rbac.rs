//! The least privilege the `kubernetes` backend needs, kept in one place:
//! the README's table is generated from [`RULES`] (a test keeps them
//! equal), and the tests check every request the backend makes against
//! them with [`check`], so code and documentation cannot drift apart.

use super::csr::SIGNER_NAME;

/// One RBAC policy rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub api_group: &'static str,
    /// A resource, or `resource/subresource`.
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
    /// `true`: a Role in the authority's namespace (and in the signer's,
    /// and in the followed ManagedProxyConfiguration's proxy-server
    /// namespace, when those differ); `false`: a ClusterRole.
    pub namespaced: bool,
    /// Empty: any name.
    pub resource_names: &'static [&'static str],
}

pub const RULES: &[Rule] = &[
    Rule {
        api_group: "",
        resource: "secrets",
        // create: the signer is created, never applied over; list and
        // watch: deleted or edited Secrets are repaired at once.
        verbs: &["get", "list", "watch", "create", "patch"],
        namespaced: true,
        resource_names: &[],
    },
    Rule {
        api_group: "",
        resource: "services",
        // The LoadBalancer entrypoint's published address goes into the
        // server certificates' SANs.
        verbs: &["get", "list", "watch"],
        namespaced: true,
        resource_names: &[],
    },
    Rule {
        api_group: "coordination.k8s.io",
        resource: "leases",
        verbs: &["get", "create", "update"],
        namespaced: true,
        resource_names: &[],
    },
    Rule {
        api_group: "events.k8s.io",
        resource: "events",
        // A Warning Event on a damaged signer Secret; patch: its repeats.
        verbs: &["create", "patch"],
        namespaced: true,
        resource_names: &[],
    },
    Rule {
        api_group: "certificates.k8s.io",
        resource: "certificatesigningrequests",
        verbs: &["list", "watch"],
        namespaced: false,
        resource_names: &[],
    },
    Rule {
        api_group: "certificates.k8s.io",
        resource: "certificatesigningrequests/status",
        verbs: &["patch"],
        namespaced: false,
        resource_names: &[],
    },
    Rule {
        api_group: "proxy.open-cluster-management.io",
        resource: "managedproxyconfigurations",
        verbs: &["get", "list", "watch"],
        namespaced: false,
        resource_names: &[],
    },
    Rule {
        api_group: "proxy.open-cluster-management.io",
        resource: "managedproxyconfigurations/status",
        // The certificate conditions, by server-side apply.
        verbs: &["patch"],
        namespaced: false,
        resource_names: &[],
    },
    // Not a request of ours: the API server's signing admission checks it
    // whenever a CSR's certificate or conditions change, refusals included.
    Rule {
        api_group: "certificates.k8s.io",
        resource: "signers",
        verbs: &["sign"],
        namespaced: false,
        resource_names: &[SIGNER_NAME],
    },
];

/// What an API request asks to do, in RBAC terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub verb: String,
    pub api_group: String,
    /// A resource, or `resource/subresource`.
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Reads an API request (`method`, and the path with its query) as RBAC
/// sees it; `None` for paths that are not resource requests.
pub fn access_of(method: &str, uri: &str) -> Option<Access> {
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (api_group, rest) = match segments.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", namespace, rest @ ..] if !rest.is_empty() => (Some(*namespace), rest),
        _ => (None, rest),
    };
    let (resource, name, subresource) = match rest {
        [resource] => (*resource, None, None),
        [resource, name] => (*resource, Some(*name), None),
        [resource, name, subresource] => (*resource, Some(*name), Some(*subresource)),
        _ => return None,
    };
    let watching = query
        .split('&')
        .any(|pair| pair == "watch=true" || pair == "watch=1");
    let verb = match (method, name) {
        ("GET", Some(_)) => "get",
        ("GET", None) if watching => "watch",
        ("GET", None) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", Some(_)) => "delete",
        ("DELETE", None) => "deletecollection",
        _ => return None,
    };
    Some(Access {
        verb: verb.to_string(),
        api_group: api_group.to_string(),
        resource: match subresource {
            Some(sub) => format!("{resource}/{sub}"),
            None => resource.to_string(),
        },
        namespace: namespace.map(str::to_string),
        name: name.map(str::to_string),
    })
}

/// Whether [`RULES`] allow the request; the error says what is missing.
pub fn check(method: &str, uri: &str) -> Result<(), String> {
    let access = access_of(method, uri)
        .ok_or_else(|| format!("{method} {uri} is not a resource request"))?;
    let allowed = RULES.iter().any(|rule| {
        rule.api_group == access.api_group
            && rule.resource == access.resource
            && rule.verbs.contains(&access.verb.as_str())
            && (!rule.namespaced || access.namespace.is_some())
            && (rule.resource_names.is_empty()
                || access
                    .name
                    .as_deref()
                    .is_some_and(|n| rule.resource_names.contains(&n)))
    });
    if allowed {
        Ok(())
    } else {
        Err(format!(
            "{method} {uri} needs `{}` on {}{} which the documented rules do not grant",
            access.verb,
            access.resource,
            if access.api_group.is_empty() {
                String::new()
            } else {
                format!(".{}", access.api_group)
            },
        ))
    }
}

/// [`RULES`] as the README's Markdown table.
pub fn markdown_table() -> String {
    let mut table = String::from(
        "| kind | apiGroups | resources | verbs | resourceNames |\n|---|---|---|---|---|\n",
    );
    for rule in RULES {
        table.push_str(&format!(
            "| {} | `{}` | `{}` | {} | {} |\n",
            if rule.namespaced {
                "Role"
            } else {
                "ClusterRole"
            },
            rule.api_group,
            rule.resource,
            rule.verbs.join(", "),
            if rule.resource_names.is_empty() {
                "any".to_string()
            } else {
                rule.resource_names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_map_to_rbac_verbs_and_only_documented_ones_pass() {
        let secret = "/api/v1/namespaces/ns/secrets/proxy-server";
        assert_eq!(
            access_of("GET", secret),
            Some(Access {
                verb: "get".into(),
                api_group: String::new(),
                resource: "secrets".into(),
                namespace: Some("ns".into()),
                name: Some("proxy-server".into()),
            })
        );
        check("GET", secret).unwrap();
        check("PATCH", &format!("{secret}?fieldManager=x&force=true")).unwrap();
        check("POST", "/api/v1/namespaces/ns/secrets").unwrap();
        check(
            "GET",
            "/api/v1/namespaces/ns/secrets?labelSelector=a%3Db&watch=true",
        )
        .unwrap();
        check(
            "PUT",
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases/cluster-proxy-cert-authority",
        )
        .unwrap();
        let csrs = "/apis/certificates.k8s.io/v1/certificatesigningrequests";
        check("GET", csrs).unwrap();
        check("PATCH", &format!("{csrs}/x/status")).unwrap();
        let mpcs = "/apis/proxy.open-cluster-management.io/v1alpha1/managedproxyconfigurations";
        check("GET", &format!("{mpcs}/cluster-proxy")).unwrap();
        check("GET", &format!("{mpcs}?watch=true")).unwrap();
        check("PATCH", &format!("{mpcs}/cluster-proxy/status")).unwrap();
        check(
            "GET",
            "/api/v1/namespaces/ns/services/proxy-agent-entrypoint",
        )
        .unwrap();

        // What the rules do not grant.
        assert!(check("DELETE", secret).unwrap_err().contains("delete"));
        assert!(check("PUT", secret).is_err());
        assert!(check("GET", &format!("{csrs}/x")).is_err());
        assert!(check("PATCH", &format!("{csrs}/x")).is_err());
        assert!(check("PUT", &format!("{csrs}/x/approval")).is_err());
        assert!(check("GET", "/api/v1/secrets").is_err(), "cluster-wide");
        assert!(
            check("PATCH", &format!("{mpcs}/cluster-proxy")).is_err(),
            "spec"
        );
        assert!(check("PATCH", "/api/v1/namespaces/ns/services/x").is_err());
        assert!(check("GET", "/version").is_err());
    }

    #[test]
    fn the_readme_documents_exactly_these_rules() {
        let readme = include_str!("../../../README.md");
        assert!(
            readme.contains(&markdown_table()),
            "README.md must contain this table (generated from RULES):\n{}",
            markdown_table()
        );
    }
}

//! The resource types the API serves: built-in ones and CustomResourceDefinitions.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use super::fields::Shape;

/// One served group/version/resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceType {
    /// `""` for the core group.
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    pub singular: String,
    pub namespaced: bool,
    /// Writes to the main resource keep `.status`; `/status` changes only it.
    pub status: bool,
    /// CertificateSigningRequests' `/approval`.
    pub approval: bool,
    pub short_names: Vec<String>,
    /// Discovery categories (`kubectl get all` lists the `all` category).
    pub categories: Vec<String>,
    /// How its objects merge (server-side apply and field ownership).
    pub shape: Arc<Shape>,
    /// Served for a CustomResourceDefinition.
    pub custom: bool,
    /// The server keeps `metadata.generation` (not every type has one).
    pub generation: bool,
    /// A custom type's `openAPIV3Schema` for this version.
    pub schema: Option<Arc<Value>>,
    /// A custom type's `additionalPrinterColumns` for this version.
    pub printer_columns: Vec<Value>,
}

impl ResourceType {
    fn builtin(group: &str, version: &str, kind: &str, plural: &str, namespaced: bool) -> Self {
        ResourceType {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            singular: kind.to_lowercase(),
            namespaced,
            status: false,
            approval: false,
            short_names: Vec::new(),
            categories: Vec::new(),
            shape: Arc::new(Shape::builtin()),
            custom: false,
            generation: false,
            schema: None,
            printer_columns: Vec::new(),
        }
    }

    fn with_generation(mut self) -> Self {
        self.generation = true;
        self
    }

    fn with_status(mut self) -> Self {
        self.status = true;
        self
    }

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Objects of every version of a group/resource share one store.
    pub fn storage_key(&self) -> String {
        format!("{}/{}", self.group, self.plural)
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CrdError {
    #[error("CustomResourceDefinition is missing {0}")]
    Missing(&'static str),
    #[error("CustomResourceDefinition has an invalid {0}")]
    Invalid(&'static str),
}

/// The types a CustomResourceDefinition object serves.
pub fn from_crd(crd: &Value) -> Result<Vec<ResourceType>, CrdError> {
    let spec = crd.get("spec").ok_or(CrdError::Missing("spec"))?;
    let text = |v: Option<&Value>, what: &'static str| {
        v.and_then(Value::as_str)
            .map(str::to_string)
            .ok_or(CrdError::Missing(what))
    };
    let group = text(spec.get("group"), "spec.group")?;
    let names = spec.get("names").ok_or(CrdError::Missing("spec.names"))?;
    let kind = text(names.get("kind"), "spec.names.kind")?;
    let plural = text(names.get("plural"), "spec.names.plural")?;
    let singular = names
        .get("singular")
        .and_then(Value::as_str)
        .map_or_else(|| kind.to_lowercase(), str::to_string);
    let namespaced = match spec.get("scope").and_then(Value::as_str) {
        Some("Namespaced") => true,
        Some("Cluster") => false,
        _ => return Err(CrdError::Invalid("spec.scope (Namespaced or Cluster)")),
    };
    let list = |field: &str| -> Vec<String> {
        names
            .get(field)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let short_names = list("shortNames");
    let categories = list("categories");
    let versions = spec
        .get("versions")
        .and_then(Value::as_array)
        .ok_or(CrdError::Missing("spec.versions"))?;
    let mut types = Vec::new();
    for version in versions {
        if version.get("served").and_then(Value::as_bool) == Some(false) {
            continue;
        }
        let name = text(version.get("name"), "spec.versions[].name")?;
        let shape = version
            .pointer("/schema/openAPIV3Schema")
            .map_or_else(Shape::deduced, Shape::from_schema)
            .with_object_meta();
        types.push(ResourceType {
            group: group.clone(),
            version: name,
            kind: kind.clone(),
            plural: plural.clone(),
            singular: singular.clone(),
            namespaced,
            status: version.pointer("/subresources/status").is_some(),
            approval: false,
            short_names: short_names.clone(),
            categories: categories.clone(),
            shape: Arc::new(shape),
            custom: true,
            generation: true,
            schema: version
                .pointer("/schema/openAPIV3Schema")
                .cloned()
                .map(Arc::new),
            printer_columns: version
                .get("additionalPrinterColumns")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        });
    }
    if types.is_empty() {
        return Err(CrdError::Invalid("spec.versions (none served)"));
    }
    Ok(types)
}

/// Every served type, by (group, version, plural).
#[derive(Debug, Clone, Default)]
pub struct Registry {
    types: BTreeMap<(String, String, String), ResourceType>,
}

impl Registry {
    pub fn with_builtins() -> Self {
        let mut registry = Registry::default();
        let core = [
            ("Namespace", "namespaces", false, true),
            ("Secret", "secrets", true, false),
            ("ConfigMap", "configmaps", true, false),
            ("Service", "services", true, true),
            ("ServiceAccount", "serviceaccounts", true, false),
            ("Pod", "pods", true, true),
            ("Event", "events", true, false),
        ];
        for (kind, plural, namespaced, status) in core {
            let mut t = ResourceType::builtin("", "v1", kind, plural, namespaced);
            if kind == "Pod" {
                t = t.with_generation();
            }
            registry.add(if status { t.with_status() } else { t });
        }
        registry.add(
            ResourceType::builtin("apps", "v1", "Deployment", "deployments", true)
                .with_status()
                .with_generation(),
        );
        registry.add(ResourceType::builtin(
            "coordination.k8s.io",
            "v1",
            "Lease",
            "leases",
            true,
        ));
        let mut csr = ResourceType::builtin(
            "certificates.k8s.io",
            "v1",
            "CertificateSigningRequest",
            "certificatesigningrequests",
            false,
        )
        .with_status();
        csr.approval = true;
        registry.add(csr);
        for (kind, plural, namespaced) in [
            ("Role", "roles", true),
            ("ClusterRole", "clusterroles", false),
            ("RoleBinding", "rolebindings", true),
            ("ClusterRoleBinding", "clusterrolebindings", false),
        ] {
            registry.add(ResourceType::builtin(
                "rbac.authorization.k8s.io",
                "v1",
                kind,
                plural,
                namespaced,
            ));
        }
        registry.add(ResourceType::builtin(
            "events.k8s.io",
            "v1",
            "Event",
            "events",
            true,
        ));
        registry.add(
            ResourceType::builtin(
                "apiextensions.k8s.io",
                "v1",
                "CustomResourceDefinition",
                "customresourcedefinitions",
                false,
            )
            .with_status()
            .with_generation(),
        );
        registry
    }

    /// The short names and categories kube-apiserver gives built-in types.
    fn with_builtin_names(mut t: ResourceType) -> ResourceType {
        let (short, categories): (&[&str], &[&str]) = match (t.group.as_str(), t.plural.as_str()) {
            ("", "namespaces") => (&["ns"], &[]),
            ("", "configmaps") => (&["cm"], &[]),
            ("", "services") => (&["svc"], &["all"]),
            ("", "serviceaccounts") => (&["sa"], &[]),
            ("", "pods") => (&["po"], &["all"]),
            ("", "events") => (&["ev"], &[]),
            ("events.k8s.io", "events") => (&["ev"], &[]),
            ("apps", "deployments") => (&["deploy"], &["all"]),
            ("certificates.k8s.io", "certificatesigningrequests") => (&["csr"], &[]),
            ("apiextensions.k8s.io", "customresourcedefinitions") => {
                (&["crd", "crds"], &["api-extensions"])
            }
            _ => (&[], &[]),
        };
        t.short_names = short.iter().map(|s| s.to_string()).collect();
        t.categories = categories.iter().map(|s| s.to_string()).collect();
        t
    }

    pub fn add(&mut self, t: ResourceType) {
        let t = if t.custom {
            t
        } else {
            Self::with_builtin_names(t)
        };
        self.types
            .insert((t.group.clone(), t.version.clone(), t.plural.clone()), t);
    }

    pub fn get(&self, group: &str, version: &str, plural: &str) -> Option<&ResourceType> {
        self.types
            .get(&(group.to_string(), version.to_string(), plural.to_string()))
    }

    /// The type the objects of `group`/`plural` are presented as when no
    /// version is asked for: the version of highest priority.
    pub fn preferred(&self, group: &str, plural: &str) -> Option<&ResourceType> {
        let mut versions: Vec<String> = self
            .types
            .values()
            .filter(|t| t.group == group && t.plural == plural)
            .map(|t| t.version.clone())
            .collect();
        super::schema::by_priority(&mut versions);
        self.get(group, versions.first()?, plural)
    }

    /// Every group with its versions, preferred first (the core group is
    /// `""`).
    pub fn groups(&self) -> BTreeMap<String, Vec<String>> {
        let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (group, version, _) in self.types.keys() {
            let versions = groups.entry(group.clone()).or_default();
            if !versions.contains(version) {
                versions.push(version.clone());
            }
        }
        for versions in groups.values_mut() {
            super::schema::by_priority(versions);
        }
        groups
    }

    /// Stops serving every version of a custom resource.
    pub fn remove_resource(&mut self, group: &str, plural: &str) {
        self.types
            .retain(|(g, _, p), t| !(g == group && p == plural && t.custom));
    }

    pub fn in_group_version<'a>(
        &'a self,
        group: &'a str,
        version: &'a str,
    ) -> impl Iterator<Item = &'a ResourceType> + 'a {
        self.types
            .values()
            .filter(move |t| t.group == group && t.version == version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn crd_with_two_versions_and_status() {
        let crd = json!({"spec": {"group": "example.io", "scope": "Namespaced",
        "names": {"kind": "Widget", "plural": "widgets"},
        "versions": [
            {"name": "v1", "served": true, "subresources": {"status": {}}},
            {"name": "v2", "served": false}
        ]}});
        let types = from_crd(&crd).unwrap();
        assert_eq!(types.len(), 1);
        assert!(types[0].status && types[0].namespaced);
        assert_eq!(types[0].singular, "widget");
    }

    #[test]
    fn crd_without_scope_is_refused() {
        let crd =
            json!({"spec": {"group": "g", "names": {"kind": "K", "plural": "ks"}, "versions": []}});
        assert!(matches!(from_crd(&crd), Err(CrdError::Invalid(_))));
    }
}

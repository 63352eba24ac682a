//! Field ownership as the API server's structured merge does it: an
//! object's shape (from a CRD's `openAPIV3Schema`, or the built-in merge
//! keys), the field sets managers own (`managedFields`, `fieldsV1`), the
//! merge of an applied configuration, and the comparison that tells which
//! fields a write added, changed or removed.
//!
//! Every write goes through the same model: an update gives its manager
//! what it changed and takes it from the others; an apply merges its
//! configuration, conflicts with other owners of the fields it changes
//! (unless forced), and removes what it stopped applying when no other
//! manager owns it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::{Map, Value, json};

/// How lists of one place in an object merge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListKind {
    /// Replaced and owned whole.
    Atomic,
    /// Scalar items, merged as a set (`v:` entries).
    Set,
    /// Objects merged by the values of these key fields (`k:` entries).
    Map(Vec<String>),
}

/// The shape of one place in an object, as far as merging cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    Object {
        fields: BTreeMap<String, Shape>,
        /// Fields not named in `fields`.
        other: Box<Shape>,
        atomic: bool,
    },
    List {
        items: Box<Shape>,
        kind: ListKind,
    },
    Scalar,
    /// No schema: objects merge field by field, lists are atomic, except
    /// the lists built-in types merge by key (`builtin`).
    Deduced {
        builtin: bool,
    },
}

/// Lists the built-in types merge by key, by field name (their
/// `x-kubernetes-list-map-keys`; `ports` are keyed by `containerPort` in
/// containers and by `port` in Services, whichever the entry has).
const BUILTIN_LIST_KEYS: &[(&str, &[&str])] = &[
    ("containers", &["name"]),
    ("initContainers", &["name"]),
    ("ephemeralContainers", &["name"]),
    ("env", &["name"]),
    ("volumes", &["name"]),
    ("volumeMounts", &["mountPath"]),
    ("volumeDevices", &["devicePath"]),
    ("imagePullSecrets", &["name"]),
    ("hostAliases", &["ip"]),
    ("ports", &["containerPort", "port", "protocol"]),
    ("conditions", &["type"]),
    (
        "topologySpreadConstraints",
        &["topologyKey", "whenUnsatisfiable"],
    ),
    ("resourceClaims", &["name"]),
];

impl Shape {
    pub fn deduced() -> Shape {
        Shape::Deduced { builtin: false }
    }

    /// Every built-in type: deduced, with the built-in merge keys.
    pub fn builtin() -> Shape {
        Shape::Deduced { builtin: true }.with_object_meta()
    }

    /// `metadata` as every object has it: labels and annotations merge by
    /// key, finalizers are a set, ownerReferences merge by `uid`.
    fn object_meta() -> Shape {
        let granular = || Shape::Object {
            fields: BTreeMap::new(),
            other: Box::new(Shape::Scalar),
            atomic: false,
        };
        let fields = BTreeMap::from([
            ("labels".to_string(), granular()),
            ("annotations".to_string(), granular()),
            (
                "finalizers".to_string(),
                Shape::List {
                    items: Box::new(Shape::Scalar),
                    kind: ListKind::Set,
                },
            ),
            (
                "ownerReferences".to_string(),
                Shape::List {
                    items: Box::new(Shape::deduced()),
                    kind: ListKind::Map(vec!["uid".into()]),
                },
            ),
        ]);
        Shape::Object {
            fields,
            other: Box::new(Shape::deduced()),
            atomic: false,
        }
    }

    /// The same shape, with the standard `metadata` at its top.
    pub fn with_object_meta(self) -> Shape {
        let (mut fields, other) = match self {
            Shape::Object { fields, other, .. } => (fields, other),
            deduced => (BTreeMap::new(), Box::new(deduced)),
        };
        fields.insert("metadata".into(), Shape::object_meta());
        Shape::Object {
            fields,
            other,
            atomic: false,
        }
    }

    /// The shape an `openAPIV3Schema` describes.
    pub fn from_schema(schema: &Value) -> Shape {
        if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
            return Shape::Scalar;
        }
        let preserve =
            schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
        match schema.get("type").and_then(Value::as_str) {
            Some("object") => {
                let fields: BTreeMap<String, Shape> = schema
                    .get("properties")
                    .and_then(Value::as_object)
                    .map(|p| {
                        p.iter()
                            .map(|(k, v)| (k.clone(), Shape::from_schema(v)))
                            .collect()
                    })
                    .unwrap_or_default();
                let other = match schema.get("additionalProperties") {
                    Some(additional @ Value::Object(_)) => Shape::from_schema(additional),
                    _ => Shape::deduced(),
                };
                if fields.is_empty() && preserve && !matches!(other, Shape::Deduced { .. }) {
                    return Shape::deduced();
                }
                let atomic =
                    schema.get("x-kubernetes-map-type").and_then(Value::as_str) == Some("atomic");
                Shape::Object {
                    fields,
                    other: Box::new(other),
                    atomic,
                }
            }
            Some("array") => {
                let items = schema
                    .get("items")
                    .map_or_else(Shape::deduced, Shape::from_schema);
                let kind = match schema.get("x-kubernetes-list-type").and_then(Value::as_str) {
                    Some("set") => ListKind::Set,
                    Some("map") => ListKind::Map(
                        schema
                            .get("x-kubernetes-list-map-keys")
                            .and_then(Value::as_array)
                            .map(|keys| {
                                keys.iter()
                                    .filter_map(Value::as_str)
                                    .map(str::to_string)
                                    .collect()
                            })
                            .unwrap_or_default(),
                    ),
                    _ => ListKind::Atomic,
                };
                Shape::List {
                    items: Box::new(items),
                    kind,
                }
            }
            Some(_) => Shape::Scalar,
            None => Shape::deduced(),
        }
    }

    fn field(&self, name: &str) -> Shape {
        match self {
            Shape::Object { fields, other, .. } => fields
                .get(name)
                .cloned()
                .unwrap_or_else(|| (**other).clone()),
            Shape::Deduced { builtin: true } => BUILTIN_LIST_KEYS
                .iter()
                .find(|(field, _)| *field == name)
                .map_or(Shape::Deduced { builtin: true }, |(_, keys)| Shape::List {
                    items: Box::new(Shape::Deduced { builtin: true }),
                    kind: ListKind::Map(keys.iter().map(|k| k.to_string()).collect()),
                }),
            _ => Shape::deduced(),
        }
    }

    /// How a list here merges (lists without a declared type are atomic).
    fn list(&self) -> (Shape, ListKind) {
        match self {
            Shape::List { items, kind } => ((**items).clone(), kind.clone()),
            _ => (Shape::deduced(), ListKind::Atomic),
        }
    }

    fn atomic_object(&self) -> bool {
        matches!(self, Shape::Object { atomic: true, .. })
    }
}

/// One step of a field path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    Field(String),
    /// A list-map entry: its key fields as compact JSON, keys sorted.
    Key(String),
    /// A set entry: the value as compact JSON.
    Value(String),
}

pub type FieldPath = Vec<Step>;

/// The path as the API server prints it in conflicts: `.spec.x`,
/// `.status.conditions[type="A"]`, `.metadata.finalizers[="f"]`.
pub struct Display<'a>(pub &'a [Step]);

impl fmt::Display for Display<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn scalar(v: &Value) -> String {
            match v {
                Value::String(s) => format!("{s:?}"),
                other => other.to_string(),
            }
        }
        for step in self.0 {
            match step {
                Step::Field(name) => write!(f, ".{name}")?,
                Step::Key(json) => {
                    let keys: Map<String, Value> = serde_json::from_str(json).unwrap_or_default();
                    let parts: Vec<String> = keys
                        .iter()
                        .map(|(k, v)| format!("{k}={}", scalar(v)))
                        .collect();
                    write!(f, "[{}]", parts.join(","))?;
                }
                Step::Value(json) => {
                    let value: Value = serde_json::from_str(json).unwrap_or(Value::Null);
                    write!(f, "[={}]", scalar(&value))?;
                }
            }
        }
        Ok(())
    }
}

pub type FieldSet = BTreeSet<FieldPath>;

/// Fields no manager owns: identity and what only the server writes.
fn stripped(path: &[Step]) -> bool {
    match path {
        [Step::Field(top)] => matches!(top.as_str(), "apiVersion" | "kind" | "metadata"),
        [Step::Field(top), Step::Field(field), ..] if top == "metadata" => matches!(
            field.as_str(),
            "name"
                | "namespace"
                | "creationTimestamp"
                | "selfLink"
                | "uid"
                | "generation"
                | "managedFields"
                | "resourceVersion"
                | "deletionTimestamp"
                | "deletionGracePeriodSeconds"
        ),
        _ => false,
    }
}

/// One place in an object.
#[derive(Debug, Clone, PartialEq)]
struct Node {
    /// Scalars and atomic lists or objects: compared and owned whole.
    leaf: Option<Value>,
    /// An entry of a list-map or set: owned as an entry.
    entry: bool,
    /// An empty object or mergeable list: owned itself, having no children.
    empty: bool,
}

fn entry_key(item: &Value, keys: &[String]) -> Option<String> {
    let object = item.as_object()?;
    let key: Map<String, Value> = keys
        .iter()
        .filter_map(|k| object.get(k).map(|v| (k.clone(), v.clone())))
        .collect();
    if key.is_empty() {
        return None;
    }
    serde_json::to_string(&Value::Object(key)).ok()
}

fn item_step(item: &Value, kind: &ListKind) -> Option<Step> {
    match kind {
        ListKind::Map(keys) => entry_key(item, keys).map(Step::Key),
        ListKind::Set => serde_json::to_string(item).ok().map(Step::Value),
        ListKind::Atomic => None,
    }
}

/// Why an object cannot be merged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("{path}: entries of a keyed list need their key fields ({keys})")]
    MissingKey { path: String, keys: String },
    #[error("{path}: duplicate entries for key {key}")]
    Duplicate { path: String, key: String },
}

fn walk(
    value: &Value,
    shape: &Shape,
    path: &mut FieldPath,
    entry: bool,
    out: &mut BTreeMap<FieldPath, Node>,
) -> Result<(), ShapeError> {
    fn record(path: &FieldPath, node: Node, out: &mut BTreeMap<FieldPath, Node>) {
        if !path.is_empty() {
            out.insert(path.clone(), node);
        }
    }
    match value {
        Value::Object(map) if !shape.atomic_object() && !matches!(shape, Shape::Scalar) => {
            let empty = map.is_empty();
            record(
                path,
                Node {
                    leaf: None,
                    entry,
                    empty,
                },
                out,
            );
            for (name, child) in map {
                path.push(Step::Field(name.clone()));
                walk(child, &shape.field(name), path, false, out)?;
                path.pop();
            }
        }
        Value::Array(items) => {
            let (item_shape, kind) = shape.list();
            if kind == ListKind::Atomic {
                let leaf = Some(value.clone());
                record(
                    path,
                    Node {
                        leaf,
                        entry,
                        empty: false,
                    },
                    out,
                );
                return Ok(());
            }
            let empty = items.is_empty();
            record(
                path,
                Node {
                    leaf: None,
                    entry,
                    empty,
                },
                out,
            );
            let mut seen = BTreeSet::new();
            for item in items {
                let step = item_step(item, &kind).ok_or_else(|| ShapeError::MissingKey {
                    path: Display(path).to_string(),
                    keys: match &kind {
                        ListKind::Map(keys) => keys.join(", "),
                        _ => String::new(),
                    },
                })?;
                if !seen.insert(step.clone()) {
                    return Err(ShapeError::Duplicate {
                        path: Display(path).to_string(),
                        key: Display(std::slice::from_ref(&step)).to_string(),
                    });
                }
                path.push(step);
                if kind == ListKind::Set {
                    let leaf = Some(item.clone());
                    record(
                        path,
                        Node {
                            leaf,
                            entry: true,
                            empty: false,
                        },
                        out,
                    );
                } else {
                    walk(item, &item_shape, path, true, out)?;
                }
                path.pop();
            }
        }
        other => {
            let leaf = Some(other.clone());
            record(
                path,
                Node {
                    leaf,
                    entry,
                    empty: false,
                },
                out,
            );
        }
    }
    Ok(())
}

/// Every place in `object` with what it holds, ownable ones only.
fn nodes(object: &Value, shape: &Shape) -> Result<BTreeMap<FieldPath, Node>, ShapeError> {
    let mut out = BTreeMap::new();
    walk(object, shape, &mut Vec::new(), false, &mut out)?;
    out.retain(|path, _| !stripped(path));
    Ok(out)
}

/// The fields an applied configuration sets: its leaves, its list entries
/// and its empty objects (an object with fields owns only those).
pub fn applied_set(config: &Value, shape: &Shape) -> Result<FieldSet, ShapeError> {
    Ok(nodes(config, shape)?
        .into_iter()
        .filter(|(_, node)| node.leaf.is_some() || node.entry || node.empty)
        .map(|(path, _)| path)
        .collect())
}

/// What a write changed.
#[derive(Debug, Default)]
pub struct Changes {
    pub added: FieldSet,
    pub modified: FieldSet,
    pub removed: FieldSet,
}

pub fn compare(old: &Value, new: &Value, shape: &Shape) -> Result<Changes, ShapeError> {
    let before = nodes(old, shape)?;
    let after = nodes(new, shape)?;
    let mut changes = Changes::default();
    for (path, node) in &after {
        match before.get(path) {
            None => {
                changes.added.insert(path.clone());
            }
            Some(previous) if previous.leaf != node.leaf => {
                changes.modified.insert(path.clone());
            }
            Some(_) => {}
        }
    }
    changes.removed = before
        .keys()
        .filter(|p| !after.contains_key(*p))
        .cloned()
        .collect();
    Ok(changes)
}

/// `config` merged into `live`: objects field by field, keyed lists entry
/// by entry, sets as a union, everything else replaced.
pub fn merge(live: &Value, config: &Value, shape: &Shape) -> Value {
    match (live, config) {
        (Value::Object(live_map), Value::Object(config_map))
            if !shape.atomic_object() && !matches!(shape, Shape::Scalar) =>
        {
            let mut merged = live_map.clone();
            for (name, value) in config_map {
                if value.is_null() {
                    merged.remove(name);
                    continue;
                }
                let child = match live_map.get(name) {
                    Some(existing) => merge(existing, value, &shape.field(name)),
                    None => value.clone(),
                };
                merged.insert(name.clone(), child);
            }
            Value::Object(merged)
        }
        (Value::Array(live_items), Value::Array(config_items)) => {
            let (item_shape, kind) = shape.list();
            if kind == ListKind::Atomic {
                return config.clone();
            }
            let mut merged = live_items.clone();
            for item in config_items {
                let step = item_step(item, &kind);
                let position = merged
                    .iter()
                    .position(|existing| step.is_some() && item_step(existing, &kind) == step);
                match position {
                    Some(i) if kind == ListKind::Set => merged[i] = item.clone(),
                    Some(i) => merged[i] = merge(&merged[i], item, &item_shape),
                    None => merged.push(item.clone()),
                }
            }
            Value::Array(merged)
        }
        _ => config.clone(),
    }
}

/// A strategic merge patch applied to `live`: objects merge key by key
/// (`null` deletes), keyed lists merge entry by entry (an entry with
/// `$patch: delete` goes), sets are united, other lists are replaced, and
/// `$patch: replace` replaces an object whole.
pub fn strategic_merge(live: &Value, patch: &Value, shape: &Shape) -> Value {
    match patch {
        Value::Object(directives)
            if directives.get("$patch").and_then(Value::as_str) == Some("replace") =>
        {
            without_directives(patch)
        }
        Value::Object(changes) if !shape.atomic_object() && !matches!(shape, Shape::Scalar) => {
            let mut merged = live.as_object().cloned().unwrap_or_default();
            for (name, value) in changes {
                if name.starts_with('$') {
                    continue;
                }
                if value.is_null() {
                    merged.remove(name);
                    continue;
                }
                let existing = merged.get(name).cloned().unwrap_or(Value::Null);
                merged.insert(
                    name.clone(),
                    strategic_merge(&existing, value, &shape.field(name)),
                );
            }
            for (directive, value) in changes {
                if let Some(name) = directive.strip_prefix("$deleteFromPrimitiveList/")
                    && let (Some(Value::Array(items)), Some(gone)) =
                        (merged.get_mut(name), value.as_array())
                {
                    items.retain(|item| !gone.contains(item));
                }
            }
            for (directive, value) in changes {
                if let Some(name) = directive.strip_prefix("$setElementOrder/")
                    && let (Some(Value::Array(items)), Some(order)) =
                        (merged.get_mut(name), value.as_array())
                {
                    let (_, kind) = shape.field(name).list();
                    set_element_order(items, order, &kind);
                }
            }
            Value::Object(merged)
        }
        Value::Array(changes) => {
            let (item_shape, kind) = shape.list();
            let Some(live_items) = live.as_array() else {
                return without_directives(patch);
            };
            match kind {
                ListKind::Atomic => without_directives(patch),
                ListKind::Set => {
                    let mut merged = live_items.clone();
                    for item in changes {
                        if !merged.contains(item) {
                            merged.push(item.clone());
                        }
                    }
                    Value::Array(merged)
                }
                ListKind::Map(_) => {
                    let mut merged = live_items.clone();
                    for item in changes {
                        let step = item_step(item, &kind);
                        let position = merged.iter().position(|existing| {
                            step.is_some() && item_step(existing, &kind) == step
                        });
                        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
                        match (position, delete) {
                            (Some(i), true) => {
                                merged.remove(i);
                            }
                            (None, true) => {}
                            (Some(i), false) => {
                                merged[i] = strategic_merge(&merged[i], item, &item_shape);
                            }
                            (None, false) => merged.push(without_directives(item)),
                        }
                    }
                    Value::Array(merged)
                }
            }
        }
        other => without_directives(other),
    }
}

/// `$setElementOrder`: the entries the order names come in its order; the
/// others (the server's own) keep their place after them.
fn set_element_order(items: &mut [Value], order: &[Value], kind: &ListKind) {
    let rank = |item: &Value| {
        order.iter().position(|named| match kind {
            ListKind::Map(_) => {
                let step = item_step(item, kind);
                step.is_some() && item_step(named, kind) == step
            }
            _ => named == item,
        })
    };
    // A stable sort: unnamed entries (rank None → last) keep their order.
    items.sort_by_key(|item| rank(item).unwrap_or(usize::MAX));
}

/// `value` without strategic-merge directives (`$patch`, `$retainKeys`, …).
fn without_directives(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), without_directives(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_directives).collect()),
        other => other.clone(),
    }
}

/// Removes the places `paths` name from `object` (the ones that exist).
pub fn remove(object: &mut Value, paths: &FieldSet, shape: &Shape) {
    // A place whose parent goes too goes with it (removing a key field
    // first would make its entry unfindable).
    for path in paths {
        let parent_goes = (1..path.len()).any(|n| paths.contains(&path[..n]));
        if !parent_goes {
            remove_one(object, path, shape);
        }
    }
}

fn remove_one(object: &mut Value, path: &[Step], shape: &Shape) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    match (object, first) {
        (Value::Object(map), Step::Field(name)) => {
            if rest.is_empty() {
                map.remove(name);
            } else if let Some(child) = map.get_mut(name) {
                remove_one(child, rest, &shape.field(name));
            }
        }
        (Value::Array(items), step @ (Step::Key(_) | Step::Value(_))) => {
            let (item_shape, kind) = shape.list();
            let Some(i) = items
                .iter()
                .position(|item| item_step(item, &kind).as_ref() == Some(step))
            else {
                return;
            };
            if rest.is_empty() {
                items.remove(i);
            } else {
                remove_one(&mut items[i], rest, &item_shape);
            }
        }
        _ => {}
    }
}

/// `fieldsV1` of a field set: a tree of `f:`, `k:` and `v:` steps, where
/// `.` marks a place owned itself that also has owned children.
pub fn to_fields_v1(set: &FieldSet) -> Value {
    let mut root = Map::new();
    for path in set {
        let mut node = &mut root;
        for step in path {
            let key = match step {
                Step::Field(name) => format!("f:{name}"),
                Step::Key(json) => format!("k:{json}"),
                Step::Value(json) => format!("v:{json}"),
            };
            let child = node.entry(key).or_insert_with(|| json!({}));
            if !child.is_object() {
                *child = json!({});
            }
            let Some(map) = child.as_object_mut() else {
                return Value::Object(root);
            };
            node = map;
        }
    }
    mark_owned(&mut root, set, &mut Vec::new());
    Value::Object(root)
}

fn mark_owned(node: &mut Map<String, Value>, set: &FieldSet, path: &mut FieldPath) {
    for (key, child) in node.iter_mut() {
        let Some(step) = parse_step(key) else {
            continue;
        };
        path.push(step);
        if let Some(map) = child.as_object_mut()
            && !map.is_empty()
        {
            mark_owned(map, set, path);
            if set.contains(path.as_slice()) {
                map.insert(".".into(), json!({}));
            }
        }
        path.pop();
    }
}

fn parse_step(key: &str) -> Option<Step> {
    if let Some(name) = key.strip_prefix("f:") {
        Some(Step::Field(name.to_string()))
    } else if let Some(json) = key.strip_prefix("k:") {
        Some(Step::Key(json.to_string()))
    } else {
        key.strip_prefix("v:")
            .map(|json| Step::Value(json.to_string()))
    }
}

/// The field set a `fieldsV1` tree names; unknown steps are skipped.
pub fn from_fields_v1(fields: &Value) -> FieldSet {
    fn read(node: &Value, path: &mut FieldPath, out: &mut FieldSet) {
        let Some(map) = node.as_object() else {
            return;
        };
        if (map.is_empty() || map.contains_key(".")) && !path.is_empty() {
            out.insert(path.clone());
        }
        for (key, child) in map {
            if let Some(step) = parse_step(key) {
                path.push(step);
                read(child, path, out);
                path.pop();
            }
        }
    }
    let mut out = FieldSet::new();
    read(fields, &mut Vec::new(), &mut out);
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Apply,
    Update,
}

impl Operation {
    fn name(self) -> &'static str {
        match self {
            Operation::Apply => "Apply",
            Operation::Update => "Update",
        }
    }
}

/// One `managedFields` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Manager {
    pub manager: String,
    pub operation: Operation,
    pub subresource: Option<String>,
    pub api_version: String,
    pub time: String,
    pub fields: FieldSet,
}

impl Manager {
    fn same_writer(&self, other: &Manager) -> bool {
        self.manager == other.manager
            && self.operation == other.operation
            && self.subresource == other.subresource
            // Appliers are one manager whatever version they apply.
            && (self.operation == Operation::Apply || self.api_version == other.api_version)
    }

    /// As conflicts name it: `"A"`, `"B" using v1`, with its subresource.
    fn describe(&self) -> String {
        let mut text = format!("{:?}", self.manager);
        if let Some(sub) = &self.subresource {
            text = format!("{text} with subresource {sub:?}");
        }
        if self.operation == Operation::Update {
            text = format!("{text} using {}", self.api_version);
        }
        text
    }
}

/// The managers recorded on an object (malformed entries are skipped).
pub fn read_managers(object: &Value) -> Vec<Manager> {
    let Some(entries) = object
        .pointer("/metadata/managedFields")
        .and_then(Value::as_array)
    else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|entry| {
            let text = |field: &str| entry.get(field).and_then(Value::as_str);
            let operation = match text("operation")? {
                "Apply" => Operation::Apply,
                "Update" => Operation::Update,
                _ => return None,
            };
            Some(Manager {
                manager: text("manager").unwrap_or_default().to_string(),
                operation,
                subresource: text("subresource")
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
                api_version: text("apiVersion").unwrap_or_default().to_string(),
                time: text("time").unwrap_or_default().to_string(),
                fields: entry
                    .get("fieldsV1")
                    .map(from_fields_v1)
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// Writes `managers` as the object's `managedFields` (none: the field goes).
pub fn write_managers(object: &mut Value, managers: &[Manager]) {
    let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    if managers.is_empty() {
        metadata.remove("managedFields");
        return;
    }
    let entries: Vec<Value> = managers
        .iter()
        .map(|m| {
            let mut entry = json!({
                "manager": m.manager,
                "operation": m.operation.name(),
                "apiVersion": m.api_version,
                "time": m.time,
                "fieldsType": "FieldsV1",
                "fieldsV1": to_fields_v1(&m.fields),
            });
            if let Some(sub) = &m.subresource {
                entry["subresource"] = json!(sub);
            }
            entry
        })
        .collect();
    metadata.insert("managedFields".into(), Value::Array(entries));
}

/// The writer of one request.
#[derive(Debug, Clone)]
pub struct Writer {
    pub manager: String,
    pub subresource: Option<String>,
    pub api_version: String,
    pub time: String,
}

impl Writer {
    fn entry(&self, operation: Operation, fields: FieldSet) -> Manager {
        Manager {
            manager: self.manager.clone(),
            operation,
            subresource: self.subresource.clone(),
            api_version: self.api_version.clone(),
            time: self.time.clone(),
            fields,
        }
    }
}

/// Managers whose fields another's write took over, in the API's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflicts(pub Vec<(String, String)>);

impl Conflicts {
    /// `Apply failed with 1 conflict: conflict with "A": .spec.x`, or the
    /// multi-line form grouped by manager.
    pub fn message(&self) -> String {
        if let [(manager, path)] = self.0.as_slice() {
            return format!("Apply failed with 1 conflict: conflict with {manager}: {path}");
        }
        let mut by_manager: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (manager, path) in &self.0 {
            by_manager.entry(manager).or_default().push(path);
        }
        let mut lines = Vec::new();
        for (manager, paths) in by_manager {
            lines.push(format!("conflicts with {manager}:"));
            lines.extend(paths.iter().map(|p| format!("- {p}")));
        }
        format!(
            "Apply failed with {} conflicts: {}",
            self.0.len(),
            lines.join("\n")
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error("{}", .0.message())]
    Conflicts(Conflicts),
    #[error(transparent)]
    Shape(#[from] ShapeError),
}

fn without_empty(managers: Vec<Manager>) -> Vec<Manager> {
    managers
        .into_iter()
        .filter(|m| !m.fields.is_empty())
        .collect()
}

/// The managers after an update from `old` to `new`: the writer owns what
/// it changed, and nobody owns what is gone.
pub fn record_update(
    old: &Value,
    new: &Value,
    managers: Vec<Manager>,
    writer: &Writer,
    shape: &Shape,
) -> Result<Vec<Manager>, ShapeError> {
    let changes = compare(old, new, shape)?;
    let taken: FieldSet = changes.added.union(&changes.modified).cloned().collect();
    let me = writer.entry(Operation::Update, FieldSet::new());
    let mut mine = FieldSet::new();
    let mut others = Vec::new();
    for mut manager in managers {
        if manager.same_writer(&me) {
            mine.extend(manager.fields);
            continue;
        }
        let before = manager.fields.len();
        manager
            .fields
            .retain(|p| !taken.contains(p) && !changes.removed.contains(p));
        if manager.fields.len() != before {
            // Its entry changed, though not by its own write.
            manager.time.clone_from(&writer.time);
        }
        others.push(manager);
    }
    mine.extend(taken);
    mine.retain(|p| !changes.removed.contains(p));
    if !mine.is_empty() {
        others.push(writer.entry(Operation::Update, mine));
    }
    Ok(without_empty(others))
}

/// Server-side apply of `config` (already limited to what the write may
/// change) onto `live`: the merged object and its managers, or the
/// conflicts with other managers when not forced.
pub fn apply(
    live: &Value,
    config: &Value,
    managers: Vec<Manager>,
    writer: &Writer,
    force: bool,
    shape: &Shape,
) -> Result<(Value, Vec<Manager>), OwnershipError> {
    let applied = applied_set(config, shape)?;
    let merged = merge(live, config, shape);
    let changes = compare(live, &merged, shape)?;
    let me = writer.entry(Operation::Apply, FieldSet::new());
    let changed: FieldSet = changes.added.union(&changes.modified).cloned().collect();

    let mut conflicts = Vec::new();
    for manager in managers.iter().filter(|m| !m.same_writer(&me)) {
        for path in manager.fields.intersection(&changed) {
            conflicts.push((manager.describe(), Display(path).to_string()));
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(OwnershipError::Conflicts(Conflicts(conflicts)));
    }

    let mut previous = FieldSet::new();
    let mut others = Vec::new();
    for mut manager in managers {
        if manager.same_writer(&me) {
            previous = manager.fields;
            continue;
        }
        let before = manager.fields.len();
        // Forced: the fields move to this applier.
        manager.fields.retain(|p| !changed.contains(p));
        if manager.fields.len() != before {
            manager.time.clone_from(&writer.time);
        }
        others.push(manager);
    }
    // What this manager applied before and applies no more goes, unless
    // someone else still owns it.
    let still_owned: FieldSet = others
        .iter()
        .flat_map(|m| m.fields.iter().cloned())
        .chain(applied.iter().cloned())
        .collect();
    let dropped: FieldSet = previous
        .difference(&still_owned)
        .filter(|p| !still_owned.iter().any(|owned| owned.starts_with(p)))
        .cloned()
        .collect();
    let mut result = merged;
    remove(&mut result, &dropped, shape);
    let removed = compare(live, &result, shape)?.removed;
    for manager in &mut others {
        manager.fields.retain(|p| !removed.contains(p));
    }
    others.push(writer.entry(Operation::Apply, applied));
    Ok((result, without_empty(others)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer(name: &str) -> Writer {
        Writer {
            manager: name.into(),
            subresource: None,
            api_version: "example.io/v1".into(),
            time: "2026-01-01T00:00:00Z".into(),
        }
    }

    fn conditions_shape() -> Shape {
        Shape::from_schema(&json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "x": {"type": "string"},
                "items": {"type": "array", "items": {"type": "string"}},
                "conditions": {"type": "array", "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["type"],
                    "items": {"type": "object", "properties": {
                        "type": {"type": "string"}, "status": {"type": "string"}}}}
            }}
        }}))
        .with_object_meta()
    }

    #[test]
    fn fields_v1_round_trip_with_entries() {
        let shape = conditions_shape();
        let config = json!({"spec": {"x": "1", "conditions": [{"type": "A", "status": "True"}]}});
        let set = applied_set(&config, &shape).unwrap();
        let v1 = to_fields_v1(&set);
        assert_eq!(
            v1,
            json!({"f:spec": {"f:x": {}, "f:conditions": {
                "k:{\"type\":\"A\"}": {".": {}, "f:type": {}, "f:status": {}}}}})
        );
        assert_eq!(from_fields_v1(&v1), set);
    }

    #[test]
    fn two_appliers_of_one_keyed_list_keep_both_entries() {
        let shape = conditions_shape();
        let a = json!({"spec": {"conditions": [{"type": "A", "status": "True"}]}});
        let b = json!({"spec": {"conditions": [{"type": "B", "status": "False"}]}});
        let (live, managers) =
            apply(&json!({}), &a, Vec::new(), &writer("a"), false, &shape).unwrap();
        let (live, managers) = apply(&live, &b, managers, &writer("b"), false, &shape).unwrap();
        assert_eq!(live["spec"]["conditions"].as_array().unwrap().len(), 2);
        // A stops applying its entry: only its entry goes.
        let (live, _) = apply(
            &live,
            &json!({"spec": {}}),
            managers,
            &writer("a"),
            false,
            &shape,
        )
        .unwrap();
        assert_eq!(
            live["spec"]["conditions"],
            json!([{"type": "B", "status": "False"}])
        );
    }

    #[test]
    fn a_changed_field_of_another_manager_conflicts_unless_forced() {
        let shape = conditions_shape();
        let (live, managers) = apply(
            &json!({}),
            &json!({"spec": {"x": "1"}}),
            Vec::new(),
            &writer("A"),
            false,
            &shape,
        )
        .unwrap();
        let err = apply(
            &live,
            &json!({"spec": {"x": "2"}}),
            managers.clone(),
            &writer("B"),
            false,
            &shape,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "Apply failed with 1 conflict: conflict with \"A\": .spec.x"
        );
        // The same value is shared, not a conflict.
        let (_, shared) = apply(
            &live,
            &json!({"spec": {"x": "1"}}),
            managers.clone(),
            &writer("B"),
            false,
            &shape,
        )
        .unwrap();
        assert_eq!(shared.len(), 2);
        let (forced, managers) = apply(
            &live,
            &json!({"spec": {"x": "2"}}),
            managers,
            &writer("B"),
            true,
            &shape,
        )
        .unwrap();
        assert_eq!(forced["spec"]["x"], "2");
        assert_eq!(managers.len(), 1, "A owned nothing else: {managers:?}");
    }

    #[test]
    fn atomic_lists_are_replaced_whole_and_sets_merge() {
        let shape = conditions_shape();
        let merged = merge(
            &json!({"spec": {"items": ["a", "b"]}, "metadata": {"finalizers": ["x/a"]}}),
            &json!({"spec": {"items": ["c"]}, "metadata": {"finalizers": ["x/b"]}}),
            &shape,
        );
        assert_eq!(merged["spec"]["items"], json!(["c"]));
        assert_eq!(merged["metadata"]["finalizers"], json!(["x/a", "x/b"]));
        let set = applied_set(&json!({"spec": {"items": ["c"]}}), &shape).unwrap();
        assert!(set.contains(&vec![
            Step::Field("spec".into()),
            Step::Field("items".into())
        ]));
        assert_eq!(set.len(), 1);
    }

    #[test]
    fn builtin_containers_merge_by_name() {
        let shape = Shape::builtin();
        let live = json!({"spec": {"containers": [{"name": "a", "image": "1"}]}});
        let merged = merge(
            &live,
            &json!({"spec": {"containers": [{"name": "b", "image": "2"}]}}),
            &shape,
        );
        assert_eq!(merged["spec"]["containers"].as_array().unwrap().len(), 2);
        let err =
            applied_set(&json!({"spec": {"containers": [{"image": "x"}]}}), &shape).unwrap_err();
        assert!(matches!(err, ShapeError::MissingKey { .. }));
    }

    #[test]
    fn strategic_merge_orders_and_deletes_as_kubectl_edit_asks() {
        let shape = Shape::builtin();
        let live = json!({"metadata": {"finalizers": ["e/a", "e/b", "e/server"]},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        let patch = json!({"metadata": {
                "$deleteFromPrimitiveList/finalizers": ["e/a"],
                "$setElementOrder/finalizers": ["e/c", "e/b"],
                "finalizers": ["e/c"]},
            "spec": {"$setElementOrder/containers": [{"name": "b"}, {"name": "a"}]}});
        let merged = strategic_merge(&live, &patch, &shape);
        assert_eq!(
            merged["metadata"]["finalizers"],
            json!(["e/c", "e/b", "e/server"])
        );
        assert_eq!(
            merged["spec"]["containers"],
            json!([{"name": "b"}, {"name": "a"}])
        );
    }

    #[test]
    fn strategic_merge_merges_keyed_lists_and_deletes_entries() {
        let shape = Shape::builtin();
        let live = json!({"metadata": {"finalizers": ["a/x"], "labels": {"k": "v"}},
            "spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}],
                "args": ["x"]}});
        let patch = json!({"metadata": {"finalizers": ["a/y"], "labels": {"k": null}},
            "spec": {"containers": [{"name": "a", "image": "2"}, {"name": "b", "$patch": "delete"},
                {"name": "c", "image": "3"}], "args": ["y"]}});
        let merged = strategic_merge(&live, &patch, &shape);
        assert_eq!(
            merged,
            json!({"metadata": {"finalizers": ["a/x", "a/y"], "labels": {}},
                "spec": {"containers": [{"name": "a", "image": "2"}, {"name": "c", "image": "3"}],
                    "args": ["y"]}})
        );
    }

    #[test]
    fn conflict_paths_print_keys_as_the_api_server_does() {
        let path = vec![
            Step::Field("status".into()),
            Step::Field("conditions".into()),
            Step::Key("{\"type\":\"A\"}".into()),
            Step::Field("status".into()),
        ];
        assert_eq!(
            Display(&path).to_string(),
            ".status.conditions[type=\"A\"].status"
        );
    }
}

//! The object store: every object as JSON, one global resourceVersion
//! counter, a bounded history of changes for watches, and the write
//! semantics of the API server (optimistic concurrency, generation,
//! status subresource, finalizers and deletionTimestamp).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::error::{ApiError, group_resource};
use super::fields::{self, Manager, OwnershipError, Writer};
use super::resources::{Registry, ResourceType, from_crd};
use super::selector::{FieldSelector, LabelSelector};
use super::{schema, validate};

/// The authenticated requester.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn name(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as watchers see it.
#[derive(Debug)]
pub struct Event {
    pub resource_version: u64,
    pub storage_key: String,
    pub namespace: String,
    pub kind: EventType,
    pub object: Value,
    /// The object before the change (for selector transitions).
    pub old: Option<Value>,
    /// The watch lines written for this change so far, by the version
    /// presented and the event type a watcher sees: every watcher of a
    /// type shares one rendering instead of each copying and encoding the
    /// object again.
    rendered: Mutex<Vec<(String, EventType, bytes::Bytes)>>,
}

impl Event {
    fn new(
        resource_version: u64,
        storage_key: String,
        namespace: String,
        kind: EventType,
        object: Value,
        old: Option<Value>,
    ) -> Self {
        Event {
            resource_version,
            storage_key,
            namespace,
            kind,
            object,
            old,
            rendered: Mutex::new(Vec::new()),
        }
    }

    /// The watch line of this change as `seen` for a watcher of
    /// `api_version`, rendered by `render` the first time it is asked for.
    pub fn line(
        &self,
        api_version: &str,
        seen: EventType,
        render: impl FnOnce() -> bytes::Bytes,
    ) -> bytes::Bytes {
        let mut rendered = self.rendered.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, line)) = rendered
            .iter()
            .find(|(version, kind, _)| version == api_version && *kind == seen)
        {
            return line.clone();
        }
        let line = render();
        rendered.push((api_version.to_string(), seen, line.clone()));
        line
    }
}

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Main,
    Status,
    Approval,
}

impl Part {
    fn subresource(self) -> Option<&'static str> {
        match self {
            Part::Main => None,
            Part::Status => Some("status"),
            Part::Approval => Some("approval"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    /// Built-in types only: keyed lists merge by their merge keys.
    StrategicMerge,
    Json,
    /// Server-side apply, treated as a merge with field-manager bookkeeping.
    Apply,
}

/// The result of a patch: server-side apply creates what does not exist.
#[derive(Debug)]
pub struct Patched {
    pub object: Value,
    pub created: bool,
}

/// The request's options that matter to writes.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    pub field_manager: Option<String>,
    pub dry_run: bool,
    /// Server-side apply takes fields other managers own.
    pub force: bool,
    /// Names the manager of a write without `fieldManager`, as the real
    /// server does (the part before the first `/`).
    pub user_agent: Option<String>,
}

impl WriteOptions {
    fn manager(&self) -> String {
        match &self.field_manager {
            Some(m) if !m.is_empty() => m.clone(),
            _ => self
                .user_agent
                .as_deref()
                .and_then(|ua| ua.split('/').next())
                .filter(|m| !m.is_empty())
                .map(|m| m.chars().take(128).collect())
                // Without either, the real server records an empty name.
                .unwrap_or_default(),
        }
    }

    fn writer(&self, t: &ResourceType, part: Part) -> Writer {
        Writer {
            manager: self.manager(),
            subresource: part.subresource().map(str::to_string),
            api_version: t.api_version(),
            time: now_rfc3339(),
        }
    }
}

/// Who owns the fields of a write's result.
enum Ownership {
    /// An update: its writer gets what it changed.
    Update(Writer),
    /// An apply: worked out with the merge.
    Applied(Vec<Manager>),
}

type ObjectKey = (String, String);

/// Where one object is stored: its storage key and key.
type Place = (String, ObjectKey);

/// What the server's own controllers look objects up by, kept with every
/// commit so that a lookup costs what it finds, not the whole store (the
/// garbage collector asks about owners for each change; walking every
/// object each time made a fleet's worth of objects quadratic).
#[derive(Default)]
struct Indexes {
    /// Each object's place by its uid.
    uids: HashMap<String, Place>,
    /// The dependents of each owner uid (named by their ownerReferences;
    /// the owner may be gone).
    dependents: HashMap<String, BTreeSet<Place>>,
    /// What each namespace holds.
    content: HashMap<String, BTreeSet<Place>>,
    /// The objects with a deletionTimestamp (held by finalizers).
    deleting: BTreeSet<Place>,
}

impl Indexes {
    fn add(&mut self, storage_key: &str, key: &ObjectKey, object: &Value) {
        let place = || (storage_key.to_string(), key.clone());
        if let Some(uid) = object.pointer("/metadata/uid").and_then(Value::as_str) {
            self.uids.insert(uid.to_string(), place());
        }
        for owner in owner_uids(object) {
            self.dependents.entry(owner).or_default().insert(place());
        }
        if !key.0.is_empty() {
            self.content
                .entry(key.0.clone())
                .or_default()
                .insert(place());
        }
        if object.pointer("/metadata/deletionTimestamp").is_some() {
            self.deleting.insert(place());
        }
    }

    fn remove(&mut self, storage_key: &str, key: &ObjectKey, object: &Value) {
        let place = (storage_key.to_string(), key.clone());
        if let Some(uid) = object.pointer("/metadata/uid").and_then(Value::as_str)
            && self.uids.get(uid) == Some(&place)
        {
            self.uids.remove(uid);
        }
        for owner in owner_uids(object) {
            if let Some(dependents) = self.dependents.get_mut(&owner) {
                dependents.remove(&place);
                if dependents.is_empty() {
                    self.dependents.remove(&owner);
                }
            }
        }
        if let Some(content) = self.content.get_mut(&key.0) {
            content.remove(&place);
            if content.is_empty() {
                self.content.remove(&key.0);
            }
        }
        self.deleting.remove(&place);
    }
}

struct Inner {
    resource_version: u64,
    objects: BTreeMap<String, BTreeMap<ObjectKey, Value>>,
    indexes: Indexes,
    history: VecDeque<Arc<Event>>,
    history_limit: usize,
    registry: Registry,
    /// The changes of each type, for its watches: a watch is woken by its
    /// own type's changes only, and falls behind only when its own type's
    /// changes pile up (the real server's watch cache is per type, too).
    by_type: HashMap<String, broadcast::Sender<Arc<Event>>>,
}

pub struct Store {
    inner: Mutex<Inner>,
    events: broadcast::Sender<Arc<Event>>,
}

pub(crate) fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let now = now.replace_nanosecond(0).unwrap_or(now);
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

fn meta(object: &Value, field: &str) -> Option<String> {
    object
        .get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn metadata_mut(object: &mut Value) -> Result<&mut Map<String, Value>, ApiError> {
    let map = object
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))?;
    let metadata = map
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if metadata.is_null() {
        *metadata = Value::Object(Map::new());
    }
    metadata
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("metadata must be an object"))
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[rand::random::<u8>() as usize % ALPHABET.len()] as char)
        .collect()
}

/// Finalizers that hold a deleted object back: `metadata.finalizers`, and
/// a Namespace's `spec.finalizers` (the namespace controller's).
fn has_finalizers(object: &Value) -> bool {
    let any = |pointer: &str| {
        object
            .pointer(pointer)
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty())
    };
    any("/metadata/finalizers") || (is_namespace(object) && any("/spec/finalizers"))
}

fn is_namespace(object: &Value) -> bool {
    object.get("kind").and_then(Value::as_str) == Some("Namespace")
        && object.get("apiVersion").and_then(Value::as_str) == Some("v1")
}

/// Finalizers the garbage collector acts on.
pub const ORPHAN_FINALIZER: &str = "orphan";
pub const FOREGROUND_FINALIZER: &str = "foregroundDeletion";

/// What happens to dependents when their owner is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// The owner goes now, the garbage collector deletes dependents after.
    #[default]
    Background,
    /// The owner stays (`foregroundDeletion`) until blocking dependents are gone.
    Foreground,
    /// Dependents stay, their ownerReference to the owner is removed.
    Orphan,
}

impl Propagation {
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        match text {
            "Background" => Ok(Propagation::Background),
            "Foreground" => Ok(Propagation::Foreground),
            "Orphan" => Ok(Propagation::Orphan),
            other => Err(ApiError::bad_request(format!(
                "propagationPolicy: Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
            ))),
        }
    }
}

/// The `DeleteOptions` of a request.
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub propagation: Propagation,
    pub precondition_uid: Option<String>,
    pub precondition_resource_version: Option<String>,
    pub dry_run: bool,
}

/// The result of a DELETE.
#[derive(Debug)]
pub enum Deleted {
    /// Removed from the store.
    Gone(Value),
    /// Marked deleting; finalizers hold it.
    Pending(Value),
}

/// The `uid`s an object's ownerReferences name.
pub fn owner_uids(object: &Value) -> Vec<String> {
    object
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .map(|refs| {
            refs.iter()
                .filter_map(|r| r.get("uid").and_then(Value::as_str))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

fn finalizer_names(object: &Value) -> Vec<String> {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| {
            f.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The API server's rules for `metadata.ownerReferences`.
fn validate_owner_references(t: &ResourceType, name: &str, object: &Value) -> Result<(), ApiError> {
    let Some(refs) = object.pointer("/metadata/ownerReferences") else {
        return Ok(());
    };
    let Some(refs) = refs.as_array() else {
        return Err(ApiError::bad_request(
            "metadata.ownerReferences must be a list",
        ));
    };
    let mut errors = Vec::new();
    let mut controllers = 0;
    for reference in refs {
        // kube-apiserver v1.36's words (apimachinery ValidateOwnerReference).
        for (field, detail) in [
            ("apiVersion", "version must not be empty"),
            ("kind", "must not be empty"),
            ("name", "must not be empty"),
            ("uid", "must not be empty"),
        ] {
            let value = reference
                .get(field)
                .and_then(Value::as_str)
                .unwrap_or_default();
            if value.is_empty() {
                errors.push((
                    format!("metadata.ownerReferences.{field}"),
                    "FieldValueInvalid",
                    format!("Invalid value: \"\": {detail}"),
                ));
            }
        }
        if reference.get("controller") == Some(&Value::Bool(true)) {
            controllers += 1;
        }
    }
    if controllers > 1 {
        errors.push((
            "metadata.ownerReferences".to_string(),
            "FieldValueInvalid",
            format!(
                "Invalid value: {}: Only one reference can have Controller set to true",
                serde_json::to_string(refs).unwrap_or_default()
            ),
        ));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_fields(t, name, &errors))
    }
}

/// One page of a list.
#[derive(Debug)]
pub struct ListPage {
    pub items: Vec<Value>,
    pub resource_version: u64,
    /// Where the next page starts after (`namespace/name`), if any.
    pub next: Option<String>,
    /// How many matching items the later pages hold.
    pub remaining: usize,
}

/// One stored object, where it lives.
#[derive(Debug, Clone)]
pub struct Located {
    pub resource: ResourceType,
    pub namespace: Option<String>,
    pub name: String,
    pub object: Value,
}

fn conflict_error(error: OwnershipError) -> ApiError {
    match error {
        OwnershipError::Conflicts(conflicts) => ApiError::apply_conflict(&conflicts),
        OwnershipError::Shape(shape) => ApiError::invalid(shape.to_string()),
    }
}

/// What an apply to `part` may change: the main resource leaves a status
/// subresource alone; `/status` changes only status.
fn applicable_config(t: &ResourceType, config: &Value, part: Part) -> Value {
    match part {
        Part::Main => {
            let mut config = config.clone();
            if t.status
                && let Some(map) = config.as_object_mut()
            {
                map.remove("status");
            }
            config
        }
        Part::Status | Part::Approval => {
            let mut limited = json!({});
            for field in ["apiVersion", "kind"] {
                if let Some(v) = config.get(field) {
                    limited[field] = v.clone();
                }
            }
            if let Some(status) = config.get("status") {
                limited["status"] = status.clone();
            }
            limited
        }
    }
}

/// `managedFields` without their times: a write that changes nothing else
/// is a no-op even though it would stamp a new time.
fn without_times(object: &Value) -> Value {
    let mut object = object.clone();
    if let Some(entries) = object
        .pointer_mut("/metadata/managedFields")
        .and_then(Value::as_array_mut)
    {
        for entry in entries {
            if let Some(map) = entry.as_object_mut() {
                map.remove("time");
            }
        }
    }
    if let Some(m) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("resourceVersion");
    }
    object
}

impl Store {
    pub fn new(registry: Registry, history_limit: usize) -> Self {
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        Store {
            inner: Mutex::new(Inner {
                resource_version: 1,
                objects: BTreeMap::new(),
                indexes: Indexes::default(),
                history: VecDeque::new(),
                history_limit: history_limit.max(1),
                registry,
                by_type: HashMap::new(),
            }),
            events,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-written object
        // (each write replaces whole values), so a poisoned lock is usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn registry(&self) -> Registry {
        self.lock().registry.clone()
    }

    /// One served type, without copying the whole registry (every request
    /// looks one up).
    pub fn resource_type(&self, group: &str, version: &str, plural: &str) -> Option<ResourceType> {
        self.lock().registry.get(group, version, plural).cloned()
    }

    pub fn resource_version(&self) -> u64 {
        self.lock().resource_version
    }

    pub fn register(&self, t: ResourceType) {
        self.lock().registry.add(t);
    }

    fn commit(
        &self,
        inner: &mut Inner,
        t: &ResourceType,
        key: ObjectKey,
        kind: EventType,
        mut object: Value,
        old: Option<Value>,
    ) -> Value {
        inner.resource_version += 1;
        let rv = inner.resource_version;
        if let Ok(metadata) = metadata_mut(&mut object) {
            metadata.insert("resourceVersion".into(), json!(rv.to_string()));
        }
        if kind == EventType::Deleted
            && t.plural == "customresourcedefinitions"
            && t.group == "apiextensions.k8s.io"
        {
            // Its API goes with it.
            let group = object.pointer("/spec/group").and_then(Value::as_str);
            let plural = object.pointer("/spec/names/plural").and_then(Value::as_str);
            if let (Some(group), Some(plural)) = (group, plural) {
                inner.registry.remove_resource(group, plural);
            }
        }
        let storage_key = t.storage_key();
        let store = inner.objects.entry(storage_key.clone()).or_default();
        let replaced = if kind == EventType::Deleted {
            store.remove(&key)
        } else {
            store.insert(key.clone(), object.clone())
        };
        if let Some(replaced) = &replaced {
            inner.indexes.remove(&storage_key, &key, replaced);
        }
        if kind != EventType::Deleted {
            inner.indexes.add(&storage_key, &key, &object);
        }
        let event = Arc::new(Event::new(
            rv,
            storage_key,
            key.0,
            kind,
            object.clone(),
            old,
        ));
        inner.history.push_back(event.clone());
        while inner.history.len() > inner.history_limit {
            inner.history.pop_front();
        }
        if let Some(watches) = inner.by_type.get(&event.storage_key) {
            let _ = watches.send(event.clone());
        }
        let _ = self.events.send(event);
        object
    }

    fn check_namespace(
        inner: &Inner,
        t: &ResourceType,
        namespace: &str,
        name: &str,
    ) -> Result<(), ApiError> {
        if !t.namespaced {
            return Ok(());
        }
        let found = inner
            .objects
            .get("/namespaces")
            .and_then(|m| m.get(&(String::new(), namespace.to_string())));
        if let Some(ns) = found {
            if ns.pointer("/metadata/deletionTimestamp").is_some() {
                let message = format!(
                    "unable to create new content in namespace {namespace} because it is being terminated"
                );
                let mut error = ApiError::new(
                    403,
                    "Forbidden",
                    format!("{} \"{name}\" is forbidden: {message}", group_resource(t)),
                )
                .about(t, name);
                error.details["causes"] = json!([{"reason": "NamespaceTerminating", "message": message, "field": "metadata.namespace"}]);
                return Err(error);
            }
            Ok(())
        } else {
            Err(ApiError::new(
                404,
                "NotFound",
                format!("namespaces \"{namespace}\" not found"),
            ))
        }
    }

    fn stored(
        inner: &Inner,
        t: &ResourceType,
        key: &ObjectKey,
        name: &str,
    ) -> Result<Value, ApiError> {
        inner
            .objects
            .get(&t.storage_key())
            .and_then(|m| m.get(key))
            .cloned()
            .ok_or_else(|| ApiError::not_found(t, name))
    }

    fn key_of(t: &ResourceType, namespace: Option<&str>, name: &str) -> ObjectKey {
        let namespace = if t.namespaced {
            namespace.unwrap_or_default().to_string()
        } else {
            String::new()
        };
        (namespace, name.to_string())
    }

    pub fn get(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let inner = self.lock();
        inner
            .objects
            .get(&t.storage_key())
            .and_then(|m| m.get(&Self::key_of(t, namespace, name)))
            .cloned()
            .map(|o| as_version(o, t))
            .ok_or_else(|| ApiError::not_found(t, name))
    }

    /// Objects matching the selectors, ordered by namespace and name, from
    /// after `continue_after` on, at most `limit` (0: all).
    pub fn list(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        labels: &LabelSelector,
        fields: &FieldSelector,
        limit: usize,
        continue_after: Option<&str>,
    ) -> ListPage {
        let inner = self.lock();
        let mut page = ListPage {
            items: Vec::new(),
            resource_version: inner.resource_version,
            next: None,
            remaining: 0,
        };
        if let Some(objects) = inner.objects.get(&t.storage_key()) {
            // One namespace's objects are next to each other: a namespaced
            // list looks at its own objects only.
            let first = match namespace.filter(|_| t.namespaced) {
                Some(ns) => Bound::Included((ns.to_string(), String::new())),
                None => Bound::Unbounded,
            };
            for ((ns, name), object) in objects.range((first, Bound::Unbounded)) {
                if t.namespaced && namespace.is_some_and(|want| want != ns) {
                    break;
                }
                let token = format!("{ns}/{name}");
                if continue_after.is_some_and(|after| token.as_str() <= after) {
                    continue;
                }
                if !labels.matches(object) || !fields.matches(object) {
                    continue;
                }
                if limit > 0 && page.items.len() == limit {
                    if page.next.is_none() {
                        page.next = page.items.last().map(|o: &Value| {
                            format!(
                                "{}/{}",
                                meta(o, "namespace").unwrap_or_default(),
                                meta(o, "name").unwrap_or_default()
                            )
                        });
                    }
                    page.remaining += 1;
                    continue;
                }
                page.items.push(as_version(object.clone(), t));
            }
        }
        page
    }

    pub fn create(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        body: Value,
        user: &User,
        options: &WriteOptions,
    ) -> Result<Value, ApiError> {
        self.create_as(t, namespace, body, user, options, false)
    }

    /// Creates the object; `applied`: by a server-side apply of `body`.
    fn create_as(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        mut body: Value,
        user: &User,
        options: &WriteOptions,
        applied: bool,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let metadata = metadata_mut(&mut body)?;
        if let Some(ns) = namespace.filter(|_| t.namespaced) {
            match metadata.get("namespace").and_then(Value::as_str) {
                Some(body_ns) if !body_ns.is_empty() && body_ns != ns => {
                    return Err(ApiError::bad_request(format!(
                        "the namespace of the provided object ({body_ns}) does not match the namespace sent on the request ({ns})"
                    )));
                }
                _ => {
                    metadata.insert("namespace".into(), json!(ns));
                }
            }
        } else if !t.namespaced {
            metadata.remove("namespace");
        }
        let name = match metadata.get("name").and_then(Value::as_str) {
            Some(name) if !name.is_empty() => name.to_string(),
            _ => match metadata.get("generateName").and_then(Value::as_str) {
                Some(prefix) if !prefix.is_empty() => format!("{prefix}{}", random_suffix()),
                _ => {
                    return Err(ApiError::invalid(
                        "metadata.name: Required value: name or generateName is required",
                    ));
                }
            },
        };
        if !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | ':'))
            || name.len() > 253
        {
            return Err(ApiError::invalid(format!(
                "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"
            )));
        }
        metadata.insert("name".into(), json!(name));
        metadata.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        metadata.insert("creationTimestamp".into(), json!(now_rfc3339()));
        metadata.insert("generation".into(), json!(1));
        metadata.remove("deletionTimestamp");
        metadata.remove("resourceVersion");
        let ns_value = metadata
            .get("namespace")
            .and_then(Value::as_str)
            .map(str::to_string);
        if let Some(map) = body.as_object_mut() {
            map.insert("apiVersion".into(), json!(t.api_version()));
            map.insert("kind".into(), json!(t.kind));
        }
        validate_owner_references(t, &name, &body)?;
        if let Some(ns) = &ns_value {
            Self::check_namespace(&inner, t, ns, &name)?;
        }
        let key = Self::key_of(t, ns_value.as_deref(), &name);
        if inner
            .objects
            .get(&t.storage_key())
            .is_some_and(|m| m.contains_key(&key))
        {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", group_resource(t)),
            )
            .about(t, &name));
        }
        if t.status
            && let Some(map) = body.as_object_mut()
        {
            // Status is written through its subresource only.
            map.remove("status");
        }
        validate::on_create(t, &name, &mut body, &now_rfc3339())?;
        // Ownership is of what the requester sent, before the server adds
        // its own fields; an applier does not own what defaulting adds.
        let writer = options.writer(t, Part::Main);
        let applied_managers = if applied {
            let (_, managers) =
                fields::apply(&json!({}), &body, Vec::new(), &writer, true, &t.shape)
                    .map_err(conflict_error)?;
            Some(managers)
        } else {
            None
        };
        conform(t, &name, &mut body)?;
        let managers = match applied_managers {
            Some(managers) => managers,
            // As the real server, a body it cannot track fields of is
            // stored all the same, without managedFields.
            None => fields::record_update(&json!({}), &body, Vec::new(), &writer, &t.shape)
                .unwrap_or_default(),
        };
        if t.plural == "customresourcedefinitions" {
            check_crd(t, &name, &body)?;
            let mut finalizers = finalizer_names(&body);
            if !finalizers.iter().any(|f| f == CRD_CLEANUP_FINALIZER) {
                finalizers.push(CRD_CLEANUP_FINALIZER.into());
            }
            body["metadata"]["finalizers"] = json!(finalizers);
        }
        if t.plural == "certificatesigningrequests" && t.group == "certificates.k8s.io" {
            // As the real server: the requester is who authenticated, never
            // what the body claims.
            let spec = body
                .as_object_mut()
                .map(|m| m.entry("spec").or_insert_with(|| json!({})));
            if let Some(Value::Object(spec)) = spec {
                spec.insert("username".into(), json!(user.name));
                spec.insert("uid".into(), json!(user.uid));
                spec.insert("groups".into(), json!(user.groups));
                spec.remove("extra");
            }
            if let Some(map) = body.as_object_mut() {
                map.insert("status".into(), json!({}));
            }
        }
        if is_namespace(&body) {
            // The namespace controller's finalizer, from birth.
            if body.pointer("/spec/finalizers").is_none() {
                body["spec"] = json!({"finalizers": ["kubernetes"]});
            }
            body["status"] = json!({"phase": "Active"});
        }
        if t.plural == "customresourcedefinitions" {
            let types = from_crd(&body).map_err(|e| ApiError::invalid(e.to_string()))?;
            let names = body.pointer("/spec/names").cloned().unwrap_or(json!({}));
            body["status"] = json!({
                "conditions": [
                    {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now_rfc3339()},
                    {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now_rfc3339()}
                ],
                "acceptedNames": names,
                "storedVersions": types.iter().map(|t| t.version.clone()).collect::<Vec<_>>(),
            });
            if !options.dry_run {
                for t in types {
                    inner.registry.add(t);
                }
            }
        }
        fields::write_managers(&mut body, &managers);
        if options.dry_run {
            return Ok(body);
        }
        Ok(self.commit(&mut inner, t, key, EventType::Added, body, None))
    }

    /// Replaces the object (PUT).
    pub fn update(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        body: Value,
        part: Part,
        options: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let key = Self::key_of(t, namespace, name);
        let old = Self::stored(&inner, t, &key, name)?;
        if let Some(body_name) = meta(&body, "name")
            && body_name != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        validate::unconditional_update(t, name, &body)?;
        if let Some(rv) = meta(&body, "resourceVersion").filter(|rv| !rv.is_empty())
            && Some(rv) != meta(&old, "resourceVersion")
        {
            return Err(ApiError::stale(t, name));
        }
        let new = self.merge_part(t, &old, body, part)?;
        let ownership = Ownership::Update(options.writer(t, part));
        self.finish_write(&mut inner, t, key, old, new, options, ownership)
    }

    /// The new object of a write to `part`: the main resource keeps status
    /// (when the type has a status subresource); `/status` and `/approval`
    /// change only their part.
    fn merge_part(
        &self,
        t: &ResourceType,
        old: &Value,
        mut new: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        if !new.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        match part {
            Part::Main => {
                if t.status {
                    match old.get("status") {
                        Some(status) => new["status"] = status.clone(),
                        None => {
                            if let Some(map) = new.as_object_mut() {
                                map.remove("status");
                            }
                        }
                    }
                }
                Ok(new)
            }
            Part::Status => {
                let mut result = old.clone();
                result["status"] = new.get("status").cloned().unwrap_or(Value::Null);
                Ok(result)
            }
            Part::Approval => {
                let mut result = old.clone();
                let conditions = new
                    .pointer("/status/conditions")
                    .cloned()
                    .unwrap_or(json!([]));
                if !result.get("status").is_some_and(Value::is_object) {
                    result["status"] = json!({});
                }
                result["status"]["conditions"] = conditions;
                Ok(result)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn finish_write(
        &self,
        inner: &mut Inner,
        t: &ResourceType,
        key: ObjectKey,
        old: Value,
        mut new: Value,
        options: &WriteOptions,
        ownership: Ownership,
    ) -> Result<Value, ApiError> {
        // Managers the client sent replace the recorded ones; none sent
        // keeps them.
        let sent_managers = new
            .pointer("/metadata/managedFields")
            .filter(|sent| Some(*sent) != old.pointer("/metadata/managedFields"))
            .map(|_| fields::read_managers(&new));
        // Fields only the server sets.
        {
            let old_meta = old.get("metadata").cloned().unwrap_or(json!({}));
            let metadata = metadata_mut(&mut new)?;
            for field in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "generation",
                "name",
            ] {
                match old_meta.get(field) {
                    Some(v) => {
                        metadata.insert(field.into(), v.clone());
                    }
                    None => {
                        metadata.remove(field);
                    }
                }
            }
            if t.namespaced {
                metadata.insert("namespace".into(), json!(key.0));
            }
        }
        if let Some(map) = new.as_object_mut() {
            map.insert("apiVersion".into(), json!(t.api_version()));
            map.insert("kind".into(), json!(t.kind));
        }
        validate_owner_references(t, &key.1, &new)?;
        validate::on_update(t, &key.1, &old, &mut new, &now_rfc3339())?;
        conform(t, &key.1, &mut new)?;
        if t.plural == "customresourcedefinitions" {
            check_crd(t, &key.1, &new)?;
        }
        let managers = match ownership {
            Ownership::Applied(managers) => managers,
            Ownership::Update(writer) => {
                let base = sent_managers.unwrap_or_else(|| fields::read_managers(&old));
                // Fields that cannot be tracked (say, a keyed list with
                // duplicates) keep the managers as they were.
                fields::record_update(&old, &new, base.clone(), &writer, &t.shape).unwrap_or(base)
            }
        };
        fields::write_managers(&mut new, &managers);
        if t.plural == "customresourcedefinitions" && !options.dry_run {
            for crd_type in from_crd(&new).map_err(|e| ApiError::invalid(e.to_string()))? {
                inner.registry.add(crd_type);
            }
        }
        if options.dry_run {
            return Ok(as_version(new, t));
        }
        if without_times(&old) == without_times(&new) {
            // A no-op write changes nothing, not even the resourceVersion.
            return Ok(as_version(old, t));
        }
        let deleting = new.pointer("/metadata/deletionTimestamp").is_some();
        let kind = if deleting && !has_finalizers(&new) {
            EventType::Deleted
        } else {
            EventType::Modified
        };
        let stored = self.commit(inner, t, key, kind, new, Some(old));
        Ok(as_version(stored, t))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        kind: PatchKind,
        patch: Value,
        part: Part,
        user: &User,
        options: &WriteOptions,
    ) -> Result<Patched, ApiError> {
        if kind == PatchKind::Apply {
            if options.field_manager.as_deref().is_none_or(str::is_empty) {
                return Err(ApiError::bad_request(
                    "PatchOptions.fieldManager: Required value: is required for apply patch",
                ));
            }
            for field in ["apiVersion", "kind"] {
                if patch.get(field).and_then(Value::as_str).is_none() {
                    return Err(ApiError::bad_request(format!(
                        "{field} must be set in an apply patch"
                    )));
                }
            }
            let exists = self.get(t, namespace, name).is_ok();
            if !exists {
                if part != Part::Main {
                    return Err(ApiError::not_found(t, name));
                }
                let mut body = patch;
                metadata_mut(&mut body)?.insert("name".into(), json!(name));
                return self
                    .create_as(t, namespace, body, user, options, true)
                    .map(|object| Patched {
                        object,
                        created: true,
                    });
            }
        }
        let mut inner = self.lock();
        let key = Self::key_of(t, namespace, name);
        let old = Self::stored(&inner, t, &key, name)?;
        if let Some(rv) = patch
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            && Some(rv.to_string()) != meta(&old, "resourceVersion")
        {
            return Err(ApiError::stale(t, name));
        }
        let writer = options.writer(t, part);
        let mut patched = old.clone();
        let mut ownership = Ownership::Update(writer.clone());
        match kind {
            PatchKind::Merge => {
                json_patch::merge(&mut patched, &patch);
            }
            PatchKind::StrategicMerge => {
                if !patch.is_object() {
                    return Err(ApiError::bad_request(
                        "a strategic merge patch must be a JSON object",
                    ));
                }
                patched = fields::strategic_merge(&old, &patch, &t.shape);
            }
            PatchKind::Apply => {
                let config = applicable_config(t, &patch, part);
                let (merged, managers) = fields::apply(
                    &old,
                    &config,
                    fields::read_managers(&old),
                    &writer,
                    options.force,
                    &t.shape,
                )
                .map_err(conflict_error)?;
                patched = merged;
                ownership = Ownership::Applied(managers);
            }
            PatchKind::Json => {
                let operations: json_patch::Patch = serde_json::from_value(patch)
                    .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
                for operation in operations.0 {
                    // As the real server: testing a missing path against
                    // null succeeds (kube-runtime's finalizer() relies on it).
                    if let json_patch::PatchOperation::Test(test) = &operation
                        && test.value.is_null()
                        && patched.pointer(test.path.as_str()).is_none()
                    {
                        continue;
                    }
                    json_patch::patch(&mut patched, &[operation]).map_err(|e| {
                        ApiError::invalid(format!("the JSON patch could not be applied: {e}"))
                    })?;
                }
            }
        }
        let new = self.merge_part(t, &old, patched, part)?;
        self.finish_write(&mut inner, t, key, old, new, options, ownership)
            .map(|object| Patched {
                object,
                created: false,
            })
    }

    /// Deletes the object, or marks it deleting while finalizers remain
    /// (the garbage collector's for Foreground and Orphan propagation, a
    /// Namespace's `kubernetes` while its content goes).
    pub fn delete(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        options: &DeleteOptions,
    ) -> Result<Deleted, ApiError> {
        let mut inner = self.lock();
        let key = Self::key_of(t, namespace, name);
        let old = Self::stored(&inner, t, &key, name)?;
        let current_uid = meta(&old, "uid").unwrap_or_default();
        if let Some(uid) = &options.precondition_uid
            && *uid != current_uid
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the UID in the precondition ({uid}) does not match the UID in record ({current_uid}). The object might have been deleted and then recreated",
                    t.kind
                ),
            )
            .about(t, name));
        }
        let current_rv = meta(&old, "resourceVersion").unwrap_or_default();
        if let Some(rv) = &options.precondition_resource_version
            && *rv != current_rv
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the ResourceVersion in the precondition ({rv}) does not match the ResourceVersion in record ({current_rv}). The object might have been modified",
                    t.kind
                ),
            )
            .about(t, name));
        }
        if options.dry_run {
            return Ok(Deleted::Gone(as_version(old, t)));
        }
        let mut new = old.clone();
        let gc_finalizer = match options.propagation {
            Propagation::Background => None,
            Propagation::Foreground => Some(FOREGROUND_FINALIZER),
            Propagation::Orphan => Some(ORPHAN_FINALIZER),
        };
        if let Some(finalizer) = gc_finalizer {
            let mut finalizers = finalizer_names(&new);
            if !finalizers.iter().any(|f| f == finalizer) {
                finalizers.push(finalizer.to_string());
            }
            new["metadata"]["finalizers"] = json!(finalizers);
        }
        if is_namespace(&new) {
            new["status"] = json!({"phase": "Terminating"});
        }
        if !has_finalizers(&new) {
            let stored = self.commit(
                &mut inner,
                t,
                key,
                EventType::Deleted,
                old.clone(),
                Some(old),
            );
            return Ok(Deleted::Gone(as_version(stored, t)));
        }
        if new.pointer("/metadata/deletionTimestamp").is_none() {
            new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            new["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            // Deletion starting is a change of the object's desired state.
            if let Some(generation) = new.pointer("/metadata/generation").and_then(Value::as_i64) {
                new["metadata"]["generation"] = json!(generation + 1);
            }
        }
        if new == old {
            return Ok(Deleted::Pending(as_version(old, t)));
        }
        let stored = self.commit(&mut inner, t, key, EventType::Modified, new, Some(old));
        Ok(Deleted::Pending(as_version(stored, t)))
    }

    /// Changes a stored object as a controller of the server would (the
    /// garbage collector, the namespace controller), recording `manager`.
    /// Missing objects are fine: someone else got there first.
    pub fn mutate(
        &self,
        t: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        manager: &str,
        change: impl FnOnce(&mut Value),
    ) -> Result<(), ApiError> {
        let mut inner = self.lock();
        let key = Self::key_of(t, namespace, name);
        let Ok(old) = Self::stored(&inner, t, &key, name) else {
            return Ok(());
        };
        let mut new = old.clone();
        change(&mut new);
        let options = WriteOptions {
            field_manager: Some(manager.to_string()),
            ..WriteOptions::default()
        };
        let ownership = Ownership::Update(options.writer(t, Part::Main));
        self.finish_write(&mut inner, t, key, old, new, &options, ownership)
            .map(|_| ())
    }

    /// One type per storage (every version of a resource shares one).
    fn storage_types(inner: &Inner) -> Vec<ResourceType> {
        let mut seen = std::collections::HashSet::new();
        let registry = &inner.registry;
        registry
            .groups()
            .iter()
            .flat_map(|(g, vs)| {
                vs.iter()
                    .flat_map(|v| registry.in_group_version(g, v).cloned().collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            })
            .filter(|t| seen.insert(t.storage_key()))
            .collect()
    }

    /// Every stored object matching `keep`.
    pub fn find(&self, keep: impl Fn(&ResourceType, &Value) -> bool) -> Vec<Located> {
        self.find_in(|_| true, keep)
    }

    /// The stored objects of the types `types` selects that match `keep`:
    /// the other types' objects are not looked at.
    pub fn find_in(
        &self,
        types: impl Fn(&ResourceType) -> bool,
        keep: impl Fn(&ResourceType, &Value) -> bool,
    ) -> Vec<Located> {
        let inner = self.lock();
        let mut found = Vec::new();
        for t in Self::storage_types(&inner).into_iter().filter(|t| types(t)) {
            let Some(objects) = inner.objects.get(&t.storage_key()) else {
                continue;
            };
            for ((ns, name), object) in objects {
                if keep(&t, object) {
                    found.push(Located {
                        resource: t.clone(),
                        namespace: t.namespaced.then(|| ns.clone()),
                        name: name.clone(),
                        object: object.clone(),
                    });
                }
            }
        }
        found
    }

    /// The objects at `places`, as far as they are still stored.
    fn at_places<'a>(inner: &Inner, places: impl IntoIterator<Item = &'a Place>) -> Vec<Located> {
        let mut types: HashMap<&str, Option<&ResourceType>> = HashMap::new();
        places
            .into_iter()
            .filter_map(|(storage_key, key)| {
                let t = (*types.entry(storage_key).or_insert_with(|| {
                    let (group, plural) = storage_key.split_once('/')?;
                    inner.registry.preferred(group, plural)
                }))?;
                let object = inner.objects.get(storage_key)?.get(key)?;
                Some(Located {
                    resource: t.clone(),
                    namespace: t.namespaced.then(|| key.0.clone()),
                    name: key.1.clone(),
                    object: object.clone(),
                })
            })
            .collect()
    }

    /// Whether an object with this uid is stored.
    pub fn uid_exists(&self, uid: &str) -> bool {
        self.lock().indexes.uids.contains_key(uid)
    }

    /// The object with this uid, if stored.
    pub fn by_uid(&self, uid: &str) -> Option<Located> {
        let inner = self.lock();
        let place = inner.indexes.uids.get(uid)?;
        Self::at_places(&inner, [place]).pop()
    }

    /// The objects whose ownerReferences name `owner_uid`.
    pub fn dependents_of(&self, owner_uid: &str) -> Vec<Located> {
        let inner = self.lock();
        match inner.indexes.dependents.get(owner_uid) {
            Some(places) => Self::at_places(&inner, places),
            None => Vec::new(),
        }
    }

    /// Everything stored in `namespace`.
    pub fn in_namespace(&self, namespace: &str) -> Vec<Located> {
        let inner = self.lock();
        match inner.indexes.content.get(namespace) {
            Some(places) => Self::at_places(&inner, places),
            None => Vec::new(),
        }
    }

    /// The object `name` (in `namespace`, for namespaced types) of the
    /// resource `group`/`plural`, if stored.
    pub fn lookup(
        &self,
        group: &str,
        plural: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Located> {
        let inner = self.lock();
        let place = (
            format!("{group}/{plural}"),
            (namespace.unwrap_or_default().to_string(), name.to_string()),
        );
        Self::at_places(&inner, [&place]).pop()
    }

    /// Every object being deleted (a deletionTimestamp, held by finalizers).
    pub fn deleting(&self) -> Vec<Located> {
        let inner = self.lock();
        Self::at_places(&inner, &inner.indexes.deleting)
    }

    /// Whether `namespace` holds anything.
    pub fn namespace_is_empty(&self, namespace: &str) -> bool {
        !self.lock().indexes.content.contains_key(namespace)
    }

    /// The objects with at least one owner that is not stored.
    pub fn with_missing_owners(&self) -> Vec<Located> {
        let inner = self.lock();
        let places: BTreeSet<&Place> = inner
            .indexes
            .dependents
            .iter()
            .filter(|(owner, _)| !inner.indexes.uids.contains_key(*owner))
            .flat_map(|(_, places)| places)
            .collect();
        Self::at_places(&inner, places)
    }

    /// Receives every change from now on (the server's own controllers).
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.events.subscribe()
    }

    /// Subscribes to changes and returns what a watch from
    /// `resource_version` must send first: the current objects (ADDED) when
    /// it is `None` or 0, else the history after it. `Err(410)` when the
    /// history no longer reaches back that far.
    pub fn watch_from(
        &self,
        t: &ResourceType,
        resource_version: Option<u64>,
    ) -> Result<WatchStart, ApiError> {
        let mut inner = self.lock();
        let receiver = inner
            .by_type
            .entry(t.storage_key())
            .or_insert_with(|| broadcast::channel(WATCH_BUFFER).0)
            .subscribe();
        let current = inner.resource_version;
        let replay = match resource_version {
            None | Some(0) => inner
                .objects
                .get(&t.storage_key())
                .map(|objects| {
                    objects
                        .iter()
                        .map(|((ns, _), object)| {
                            Arc::new(Event::new(
                                current,
                                t.storage_key(),
                                ns.clone(),
                                EventType::Added,
                                object.clone(),
                                None,
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default(),
            Some(rv) => {
                let oldest = inner
                    .history
                    .front()
                    .map_or(current + 1, |e| e.resource_version);
                // Events rv+1 .. oldest-1 are gone when rv+1 < oldest.
                if rv < current && rv + 1 < oldest {
                    return Err(ApiError::new(
                        410,
                        "Expired",
                        format!("too old resource version: {rv} ({})", oldest - 1),
                    ));
                }
                if rv > current {
                    // A version from the future: start from now, as the
                    // real server waits for it to exist.
                    Vec::new()
                } else {
                    inner
                        .history
                        .iter()
                        .filter(|e| e.resource_version > rv && e.storage_key == t.storage_key())
                        .cloned()
                        .collect()
                }
            }
        };
        Ok((replay, receiver, current))
    }
}

/// How many changes a watch (or the server's own controllers) may fall
/// behind before it ends with 410 Expired.
const WATCH_BUFFER: usize = 4096;

/// What a new watch sends first, its subscription to later changes, and
/// the resourceVersion it starts at.
pub type WatchStart = (Vec<Arc<Event>>, broadcast::Receiver<Arc<Event>>, u64);

/// The object as the requested version presents it (every version of a
/// type shares storage; only `apiVersion` differs here).
pub fn as_version(mut object: Value, t: &ResourceType) -> Value {
    if let Some(map) = object.as_object_mut() {
        map.insert("apiVersion".into(), json!(t.api_version()));
    }
    // Without a conversion webhook, each version shows what its own
    // schema knows.
    schema::present(t.schema.as_deref(), &mut object);
    object
}

/// A custom object as its version's schema has it: pruned, defaulted,
/// valid (422 with one cause per field otherwise).
fn conform(t: &ResourceType, name: &str, object: &mut Value) -> Result<(), ApiError> {
    let Some(openapi) = t.schema.as_deref() else {
        return Ok(());
    };
    schema::present(Some(openapi), object);
    let errors = schema::validate(openapi, object);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_fields(t, name, &errors))
    }
}

/// A CustomResourceDefinition the real server would accept.
fn check_crd(t: &ResourceType, name: &str, crd: &Value) -> Result<(), ApiError> {
    let errors = schema::crd_errors(crd);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_fields(t, name, &errors))
    }
}

/// The finalizer that holds a deleted CRD until its objects are gone.
pub const CRD_CLEANUP_FINALIZER: &str = "customresourcecleanup.apiextensions.k8s.io";

#[cfg(test)]
mod tests {
    use super::*;

    fn admin() -> User {
        User {
            name: "admin".into(),
            uid: "admin".into(),
            groups: vec!["system:masters".into()],
        }
    }

    fn names(found: Vec<Located>) -> BTreeSet<String> {
        found
            .into_iter()
            .map(|l| format!("{}/{}", l.namespace.unwrap_or_default(), l.name))
            .collect()
    }

    fn uid_of(object: &Value) -> String {
        object["metadata"]["uid"].as_str().unwrap().to_string()
    }

    /// The indexes answer what a walk over every object answers, after
    /// creations, owner changes, deletions held by finalizers and removals.
    #[test]
    fn indexes_answer_what_a_walk_over_every_object_answers() {
        let store = Store::new(Registry::with_builtins(), 100);
        let registry = store.registry();
        let namespaces = registry.get("", "v1", "namespaces").unwrap().clone();
        let maps = registry.get("", "v1", "configmaps").unwrap().clone();
        let options = WriteOptions::default();
        for ns in ["a", "b"] {
            store
                .create(
                    &namespaces,
                    None,
                    json!({"metadata": {"name": ns}}),
                    &admin(),
                    &options,
                )
                .unwrap();
        }
        let owner = |name: &str, ns: &str| {
            store
                .create(
                    &maps,
                    Some(ns),
                    json!({"metadata": {"name": name}}),
                    &admin(),
                    &options,
                )
                .unwrap()
        };
        let reference = |owner: &Value| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]})
        };
        let first = owner("first", "a");
        let second = owner("second", "a");
        let owned = |name: &str, ns: &str, owners: &[&Value]| {
            let refs: Vec<Value> = owners.iter().map(|o| reference(o)).collect();
            store
                .create(
                    &maps,
                    Some(ns),
                    json!({"metadata": {"name": name, "ownerReferences": refs}}),
                    &admin(),
                    &options,
                )
                .unwrap()
        };
        owned("only-first", "a", &[&first]);
        owned("both", "a", &[&first, &second]);
        owned("elsewhere", "b", &[&second]);
        // A dependent moves from `first` to `second`.
        store
            .patch(
                &maps,
                Some("a"),
                "only-first",
                PatchKind::Merge,
                json!({"metadata": {"ownerReferences": [reference(&second)]}}),
                Part::Main,
                &admin(),
                &options,
            )
            .unwrap();
        // `second` is held by a finalizer, `first` is gone.
        store
            .patch(
                &maps,
                Some("a"),
                "second",
                PatchKind::Merge,
                json!({"metadata": {"finalizers": ["example.com/hold"]}}),
                Part::Main,
                &admin(),
                &options,
            )
            .unwrap();
        store
            .delete(&maps, Some("a"), "second", &DeleteOptions::default())
            .unwrap();
        store
            .delete(&maps, Some("a"), "first", &DeleteOptions::default())
            .unwrap();

        let walk_dependents =
            |uid: &str| names(store.find(|_, o| owner_uids(o).iter().any(|u| u == uid)));
        for owner in [&first, &second] {
            let uid = uid_of(owner);
            assert_eq!(names(store.dependents_of(&uid)), walk_dependents(&uid));
        }
        assert_eq!(
            names(store.dependents_of(&uid_of(&second))),
            BTreeSet::from([
                "a/both".to_string(),
                "a/only-first".into(),
                "b/elsewhere".into()
            ])
        );
        assert!(
            store
                .dependents_of(&uid_of(&first))
                .iter()
                .all(|l| l.name == "both")
        );
        assert!(!store.uid_exists(&uid_of(&first)));
        assert!(store.uid_exists(&uid_of(&second)));
        let stored_uids: BTreeSet<String> = store
            .find(|_, _| true)
            .iter()
            .map(|l| uid_of(&l.object))
            .collect();
        assert_eq!(
            names(store.with_missing_owners()),
            names(store.find(|_, o| owner_uids(o).iter().any(|u| !stored_uids.contains(u))))
        );
        assert_eq!(
            names(store.with_missing_owners()),
            BTreeSet::from(["a/both".to_string()])
        );
        assert_eq!(
            names(store.deleting()),
            BTreeSet::from(["a/second".to_string()])
        );
        for ns in ["a", "b", "c"] {
            assert_eq!(
                names(store.in_namespace(ns)),
                names(
                    store.find(
                        |t, o| t.namespaced && o["metadata"]["namespace"].as_str() == Some(ns)
                    )
                ),
                "namespace {ns}"
            );
            assert_eq!(store.namespace_is_empty(ns), ns == "c");
        }
        assert_eq!(
            store.by_uid(&uid_of(&second)).map(|l| l.name),
            Some("second".to_string())
        );
        assert!(store.lookup("", "namespaces", None, "a").is_some());
        assert!(
            store
                .lookup("", "configmaps", Some("b"), "elsewhere")
                .is_some()
        );
        assert!(
            store
                .lookup("", "configmaps", Some("a"), "elsewhere")
                .is_none()
        );
    }
}

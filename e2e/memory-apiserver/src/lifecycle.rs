//! The controllers a real control plane runs beside the API server, as far
//! as object lifecycles go: the garbage collector (ownerReferences with
//! Background, Foreground and Orphan propagation) and the namespace
//! controller (a deleted namespace is `Terminating` until its content is
//! gone). Both are driven by the store's own change events, as the real
//! ones are by watches, and resynchronise from the whole store when they
//! fall behind.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use super::store::{
    CRD_CLEANUP_FINALIZER, DeleteOptions, Event, EventType, FOREGROUND_FINALIZER, Located,
    ORPHAN_FINALIZER, Propagation, Store, owner_uids,
};

const GC_MANAGER: &str = "generic-garbage-collector";
const NAMESPACE_MANAGER: &str = "namespace-controller";
const NAMESPACE_FINALIZER: &str = "kubernetes";

/// How often everything is looked at again, whatever the events said
/// (a safety net, as the real controllers' resyncs).
const RESYNC: Duration = Duration::from_secs(2);

/// Runs the controllers until `shutdown`.
pub async fn run(store: Arc<Store>, mut shutdown: watch::Receiver<bool>) {
    let mut events = store.subscribe();
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        tokio::select! {
            received = events.recv() => match received {
                Ok(event) => on_event(&store, &event),
                Err(broadcast::error::RecvError::Lagged(_)) => resync_all(&store),
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = resync.tick() => resync_all(&store),
            _ = shutdown.changed() => return,
        }
    }
}

fn uid(object: &Value) -> String {
    object
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn deleting(object: &Value) -> bool {
    object.pointer("/metadata/deletionTimestamp").is_some()
}

fn has_finalizer(object: &Value, finalizer: &str) -> bool {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| f.iter().any(|v| v.as_str() == Some(finalizer)))
}

fn is_namespace(located: &Located) -> bool {
    located.resource.group.is_empty() && located.resource.plural == "namespaces"
}

fn is_crd(located: &Located) -> bool {
    located.resource.group == "apiextensions.k8s.io"
        && located.resource.plural == "customresourcedefinitions"
}

/// A deleted CRD: its objects go first, then its finalizer (and with the
/// CRD, its API).
fn cleanup_crd(store: &Store, crd: &Located) {
    if !deleting(&crd.object) || !has_finalizer(&crd.object, CRD_CLEANUP_FINALIZER) {
        return;
    }
    let text = |pointer: &str| {
        crd.object
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let storage_key = format!("{}/{}", text("/spec/group"), text("/spec/names/plural"));
    let of_crd = |t: &super::resources::ResourceType| t.custom && t.storage_key() == storage_key;
    let objects = store.find_in(of_crd, |_, _| true);
    for object in &objects {
        if !deleting(&object.object) {
            let _ = store.delete(
                &object.resource,
                object.namespace.as_deref(),
                &object.name,
                &DeleteOptions::default(),
            );
        }
    }
    if store.find_in(of_crd, |_, _| true).is_empty() {
        remove_finalizer(store, crd, CRD_CLEANUP_FINALIZER);
    }
}

fn on_lifecycle_object(store: &Store, located: &Located) {
    finish_owner(store, located);
    if is_namespace(located) {
        terminate_namespace(store, located);
    }
    if is_crd(located) {
        cleanup_crd(store, located);
    }
}

fn on_event(store: &Store, event: &Event) {
    match event.kind {
        EventType::Deleted => {
            collect_dependents_of(store, &uid(&event.object));
            // A dependent that is gone may unblock its owners' foreground
            // deletion, or its namespace's termination.
            for owner in owner_uids(&event.object)
                .iter()
                .filter_map(|owner| store.by_uid(owner))
            {
                if deleting(&owner.object) {
                    finish_owner(store, &owner);
                }
            }
            // The last object of a deleted CRD releases it.
            let storage_key = event.storage_key.clone();
            let crds = |t: &super::resources::ResourceType| {
                t.plural == "customresourcedefinitions" && t.group == "apiextensions.k8s.io"
            };
            for crd in store.find_in(crds, |_, o| {
                deleting(o)
                    && format!(
                        "{}/{}",
                        o.pointer("/spec/group")
                            .and_then(Value::as_str)
                            .unwrap_or_default(),
                        o.pointer("/spec/names/plural")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                    ) == storage_key
            }) {
                cleanup_crd(store, &crd);
            }
            if !event.namespace.is_empty()
                && let Some(ns) = store.lookup("", "namespaces", None, &event.namespace)
            {
                terminate_namespace(store, &ns);
            }
        }
        EventType::Added | EventType::Modified => {
            if deleting(&event.object)
                && let Some(located) = store.by_uid(&uid(&event.object))
            {
                on_lifecycle_object(store, &located);
            }
            // An object added with owners that are already gone is garbage.
            if event.kind == EventType::Added
                && !owner_uids(&event.object).is_empty()
                && let Some(located) = store.by_uid(&uid(&event.object))
            {
                collect_if_orphaned(store, &located);
            }
        }
    }
}

fn resync_all(store: &Store) {
    for located in store.deleting() {
        on_lifecycle_object(store, &located);
    }
    for located in store.with_missing_owners() {
        collect_if_orphaned(store, &located);
    }
}

/// An owner being deleted with Orphan or Foreground propagation: release
/// or delete its dependents, then drop the garbage collector's finalizer.
fn finish_owner(store: &Store, owner: &Located) {
    let owner_uid = uid(&owner.object);
    if has_finalizer(&owner.object, ORPHAN_FINALIZER) {
        for dependent in store.dependents_of(&owner_uid) {
            let _ = store.mutate(
                &dependent.resource,
                dependent.namespace.as_deref(),
                &dependent.name,
                GC_MANAGER,
                |object| remove_owner_reference(object, &owner_uid),
            );
        }
        remove_finalizer(store, owner, ORPHAN_FINALIZER);
    }
    if has_finalizer(&owner.object, FOREGROUND_FINALIZER) {
        let dependents = store.dependents_of(&owner_uid);
        for dependent in &dependents {
            if !deleting(&dependent.object) {
                // Dependents of a foreground deletion go in the foreground
                // too, so blocking chains hold their owners.
                let _ = store.delete(
                    &dependent.resource,
                    dependent.namespace.as_deref(),
                    &dependent.name,
                    &DeleteOptions {
                        propagation: Propagation::Foreground,
                        ..DeleteOptions::default()
                    },
                );
            }
        }
        let blocking = store
            .dependents_of(&owner_uid)
            .into_iter()
            .any(|dependent| {
                dependent
                    .object
                    .pointer("/metadata/ownerReferences")
                    .and_then(Value::as_array)
                    .is_some_and(|refs| {
                        refs.iter().any(|r| {
                            r.get("uid").and_then(Value::as_str) == Some(owner_uid.as_str())
                                && r.get("blockOwnerDeletion") == Some(&Value::Bool(true))
                        })
                    })
            });
        if !blocking {
            remove_finalizer(store, owner, FOREGROUND_FINALIZER);
        }
    }
}

fn remove_finalizer(store: &Store, located: &Located, finalizer: &str) {
    let _ = store.mutate(
        &located.resource,
        located.namespace.as_deref(),
        &located.name,
        GC_MANAGER,
        |object| {
            if let Some(list) = object
                .pointer_mut("/metadata/finalizers")
                .and_then(Value::as_array_mut)
            {
                list.retain(|f| f.as_str() != Some(finalizer));
            }
        },
    );
}

fn remove_owner_reference(object: &mut Value, owner_uid: &str) {
    let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(refs) = metadata
        .get_mut("ownerReferences")
        .and_then(Value::as_array_mut)
    {
        refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(owner_uid));
        if refs.is_empty() {
            metadata.remove("ownerReferences");
        }
    }
}

/// The dependents of an owner that is gone.
fn collect_dependents_of(store: &Store, owner_uid: &str) {
    if owner_uid.is_empty() {
        return;
    }
    for dependent in store.dependents_of(owner_uid) {
        collect_if_orphaned(store, &dependent);
    }
}

/// A dependent whose owners are all gone is deleted (in the background);
/// one with an owner left only loses its references to the missing ones.
fn collect_if_orphaned(store: &Store, dependent: &Located) {
    let owners = owner_uids(&dependent.object);
    let missing: Vec<&String> = owners.iter().filter(|u| !store.uid_exists(u)).collect();
    if missing.is_empty() {
        return;
    }
    if missing.len() == owners.len() {
        if !deleting(&dependent.object) {
            let _ = store.delete(
                &dependent.resource,
                dependent.namespace.as_deref(),
                &dependent.name,
                &DeleteOptions::default(),
            );
        }
        return;
    }
    let _ = store.mutate(
        &dependent.resource,
        dependent.namespace.as_deref(),
        &dependent.name,
        GC_MANAGER,
        |object| {
            for owner in &missing {
                remove_owner_reference(object, owner);
            }
        },
    );
}

/// A namespace being deleted: delete what is inside, and once nothing is
/// left, release the namespace controller's finalizer (the namespace goes).
fn terminate_namespace(store: &Store, namespace: &Located) {
    if !deleting(&namespace.object) {
        return;
    }
    let name = namespace.name.clone();
    for item in &store.in_namespace(&name) {
        if !deleting(&item.object) {
            let _ = store.delete(
                &item.resource,
                item.namespace.as_deref(),
                &item.name,
                &DeleteOptions::default(),
            );
        }
    }
    if store.namespace_is_empty(&name) {
        let _ = store.mutate(
            &namespace.resource,
            None,
            &namespace.name,
            NAMESPACE_MANAGER,
            |object| {
                if let Some(list) = object
                    .pointer_mut("/spec/finalizers")
                    .and_then(Value::as_array_mut)
                {
                    list.retain(|f| f.as_str() != Some(NAMESPACE_FINALIZER));
                }
                if object.get("status").is_none() {
                    object["status"] = json!({"phase": "Terminating"});
                }
            },
        );
    }
}

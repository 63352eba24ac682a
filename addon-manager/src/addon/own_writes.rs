//! Read-your-writes for the reflector caches. A reconcile that runs before
//! the watch event of this process's own last write has reached the cache
//! would see the object as it was: it would write it again, or read it back
//! from the API, for nothing. On a hub with hundreds of clusters that was a
//! third of the addon-manager's requests (every cluster's reconcile is
//! triggered again by the events of the objects it just wrote).
//!
//! Each write is remembered with the versions the cache may still show that
//! are older than it: the one the write was decided on and, for writes in
//! a row, the earlier writes' (a missing object counts as a version). While
//! the cache shows one of them, the written object is the fresher copy. A
//! watch event of any other version, the cache showing any other version,
//! or age ends the memory: resource versions never repeat, so anything else
//! the cache shows is the write or something after it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kube::Resource;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

/// How long a write is remembered at most: a watch event arrives within
/// milliseconds; a watch that is down re-lists, and this is only a bound.
const MEMORY: Duration = Duration::from_secs(60);

struct OwnWrite<K> {
    /// Versions older than `written` the cache may still show (`None`: no
    /// object, before it was created).
    older: Vec<Option<String>>,
    written: Arc<K>,
    at: Instant,
}

impl<K: Resource> OwnWrite<K> {
    fn shows_older(&self, version: Option<&String>) -> bool {
        self.older.iter().any(|older| older.as_ref() == version)
    }
}

/// The objects of one kind this process wrote and its cache has not shown
/// yet.
pub struct OwnWrites<K: Resource<DynamicType = ()>> {
    writes: Arc<Mutex<Writes<K>>>,
    /// [`MEMORY`], but in tests.
    memory: Duration,
}

struct Writes<K: Resource<DynamicType = ()>> {
    by_object: HashMap<ObjectRef<K>, OwnWrite<K>>,
    /// Writes since expired ones were last dropped: an object deleted
    /// without an event this sees is never looked up again.
    since_pruned: usize,
}

impl<K: Resource<DynamicType = ()>> Default for Writes<K> {
    fn default() -> Self {
        Self {
            by_object: HashMap::new(),
            since_pruned: 0,
        }
    }
}

/// Expired writes are dropped every this many writes.
const PRUNE_EVERY: usize = 1024;

impl<K: Resource<DynamicType = ()>> Clone for OwnWrites<K> {
    fn clone(&self) -> Self {
        Self {
            writes: self.writes.clone(),
            memory: self.memory,
        }
    }
}

impl<K: Resource<DynamicType = ()>> Default for OwnWrites<K> {
    fn default() -> Self {
        Self {
            writes: Arc::default(),
            memory: MEMORY,
        }
    }
}

impl<K> OwnWrites<K>
where
    K: Resource<DynamicType = ()> + Clone,
{
    /// The freshest copy of `key`: `cached`, unless the cache still shows
    /// the object as it was before this process wrote it.
    pub fn freshest(&self, key: &ObjectRef<K>, cached: Option<Arc<K>>) -> Option<Arc<K>> {
        let mut writes = self.lock();
        let Some(write) = writes.by_object.get(key) else {
            return cached;
        };
        let cached_version = cached.as_ref().and_then(|object| object.resource_version());
        if write.at.elapsed() < self.memory && write.shows_older(cached_version.as_ref()) {
            return Some(write.written.clone());
        }
        writes.by_object.remove(key);
        cached
    }

    /// Remembers `written`, the API's answer to a write (or a read) made
    /// when the cache held `before`, and returns it.
    pub fn wrote(&self, before: Option<&K>, mut written: K) -> Arc<K> {
        // As the cache keeps it (see `reflected_objects`).
        written.managed_fields_mut().clear();
        let written = Arc::new(written);
        let key = ObjectRef::from_obj(written.as_ref());
        let before = before.and_then(|object| object.resource_version());
        let version = written.resource_version();
        // Without a version the cache's copy cannot be told from ours.
        if version.is_none() || version == before {
            return written;
        }
        let mut writes = self.lock();
        writes.since_pruned += 1;
        if writes.since_pruned >= PRUNE_EVERY {
            writes.since_pruned = 0;
            let memory = self.memory;
            writes
                .by_object
                .retain(|_, write| write.at.elapsed() < memory);
        }
        let mut older = vec![before];
        if let Some(earlier) = writes.by_object.remove(&key) {
            // Writes in a row: the cache may still show any of the earlier.
            older.extend(earlier.older);
            older.push(earlier.written.resource_version());
        }
        older.dedup();
        writes.by_object.insert(
            key,
            OwnWrite {
                older,
                written: written.clone(),
                at: Instant::now(),
            },
        );
        written
    }

    /// Forgets a write once `event` shows the cache at it or past it. Watch
    /// after the reflector, so the cache holds the event's object first.
    pub fn seen(&self, event: &watcher::Event<K>) {
        match event {
            watcher::Event::Apply(object) | watcher::Event::InitApply(object) => {
                let key = ObjectRef::from_obj(object);
                let mut writes = self.lock();
                if writes
                    .by_object
                    .get(&key)
                    .is_some_and(|write| !write.shows_older(object.resource_version().as_ref()))
                {
                    writes.by_object.remove(&key);
                }
            }
            watcher::Event::Delete(object) => {
                self.lock().by_object.remove(&ObjectRef::from_obj(object));
            }
            // A re-list replaces the cache: what it shows is current.
            watcher::Event::Init | watcher::Event::InitDone => self.lock().by_object.clear(),
        }
    }

    /// How many writes are remembered (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().by_object.len()
    }

    /// Whether no write is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Writes<K>> {
        // The map holds plain data: a panic elsewhere leaves it consistent.
        self.writes.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn config_map(version: Option<&str>, value: &str) -> ConfigMap {
        let mut object = ConfigMap::default();
        object.metadata.name = Some("c".into());
        object.metadata.namespace = Some("ns".into());
        object.metadata.resource_version = version.map(str::to_owned);
        object.data = Some([("k".to_owned(), value.to_owned())].into());
        object
    }

    fn key() -> ObjectRef<ConfigMap> {
        ObjectRef::new("c").within("ns")
    }

    fn value(object: Option<Arc<ConfigMap>>) -> Option<String> {
        object?.data.as_ref()?.get("k").cloned()
    }

    #[test]
    fn a_cache_behind_the_write_reads_as_written_until_it_moves() {
        let own = OwnWrites::default();
        let old = config_map(Some("1"), "old");
        own.wrote(Some(&old), config_map(Some("2"), "new"));
        // The cache still holds version 1: the write is fresher.
        assert_eq!(
            value(own.freshest(&key(), Some(Arc::new(old.clone())))),
            Some("new".into())
        );
        // The cache reached the write: it is read, and the write forgotten.
        let caught_up = Arc::new(config_map(Some("2"), "new"));
        assert_eq!(
            value(own.freshest(&key(), Some(caught_up))),
            Some("new".into())
        );
        assert!(own.is_empty());
        // Forgotten: even version 1 is now taken as it is.
        assert_eq!(
            value(own.freshest(&key(), Some(Arc::new(old)))),
            Some("old".into())
        );
    }

    #[test]
    fn writes_in_a_row_are_fresher_than_every_earlier_version() {
        let own = OwnWrites::default();
        let first = config_map(Some("1"), "first");
        let second = own.wrote(Some(&first), config_map(Some("2"), "second"));
        // The next write is decided on the second, which the cache lacks.
        own.wrote(Some(&second), config_map(Some("3"), "third"));
        for lagging in [first.clone(), config_map(Some("2"), "second")] {
            assert_eq!(
                value(own.freshest(&key(), Some(Arc::new(lagging)))),
                Some("third".into())
            );
        }
        // The second write's event leaves the third remembered; the third's
        // ends it.
        own.seen(&watcher::Event::Apply(config_map(Some("2"), "second")));
        assert_eq!(own.len(), 1);
        own.seen(&watcher::Event::Apply(config_map(Some("3"), "third")));
        assert!(own.is_empty());
        assert_eq!(
            value(own.freshest(&key(), Some(Arc::new(first)))),
            Some("first".into()),
            "forgotten"
        );
    }

    #[test]
    fn expired_writes_are_not_fresher_and_are_dropped() {
        let own = OwnWrites {
            memory: Duration::ZERO,
            ..OwnWrites::default()
        };
        let old = config_map(Some("1"), "old");
        own.wrote(Some(&old), config_map(Some("2"), "new"));
        assert_eq!(
            value(own.freshest(&key(), Some(Arc::new(old)))),
            Some("old".into())
        );
        // Writes of objects never looked up again (deleted, say) go with
        // the pruning.
        for index in 0..PRUNE_EVERY {
            let mut object = config_map(Some("2"), "gone");
            object.metadata.name = Some(format!("c{index}"));
            own.wrote(None, object);
        }
        assert!(own.len() < PRUNE_EVERY / 2, "{} remembered", own.len());
    }

    #[test]
    fn someone_elses_later_write_wins() {
        let own = OwnWrites::default();
        own.wrote(
            Some(&config_map(Some("1"), "old")),
            config_map(Some("2"), "ours"),
        );
        let theirs = Arc::new(config_map(Some("3"), "theirs"));
        assert_eq!(
            value(own.freshest(&key(), Some(theirs))),
            Some("theirs".into())
        );
        assert!(own.is_empty());
    }

    #[test]
    fn a_creation_is_seen_until_its_event_and_a_later_deletion_is_not_hidden() {
        let own = OwnWrites::default();
        let created = config_map(Some("5"), "created");
        own.wrote(None, created.clone());
        assert_eq!(value(own.freshest(&key(), None)), Some("created".into()));
        // The creation's event reaches the cache; then someone deletes it.
        own.seen(&watcher::Event::Apply(created.clone()));
        assert!(own.is_empty());
        assert_eq!(own.freshest(&key(), None), None, "the deletion shows");
        // The same when the deletion's event comes first.
        own.wrote(None, created.clone());
        own.seen(&watcher::Event::Delete(created));
        assert_eq!(own.freshest(&key(), None), None);
    }

    #[test]
    fn a_relist_forgets_everything_and_an_unchanged_write_is_not_remembered() {
        let own = OwnWrites::default();
        own.wrote(None, config_map(Some("5"), "created"));
        own.seen(&watcher::Event::<ConfigMap>::Init);
        assert!(own.is_empty());
        // A write the API answered with the same version changed nothing.
        let same = config_map(Some("7"), "same");
        own.wrote(Some(&same), same.clone());
        assert!(own.is_empty());
        // Nor can a write without a version be told from the cache's copy.
        own.wrote(None, config_map(None, "unversioned"));
        assert!(own.is_empty());
    }
}

//! Which managed clusters exist: a reflector of the hub's ManagedClusters,
//! so a request for an unknown cluster is a 404 without asking the hub, at
//! any fleet size.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use futures_util::StreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

#[derive(Clone)]
pub struct Clusters {
    store: Store<ManagedCluster>,
    ready: Arc<AtomicBool>,
}

impl Clusters {
    /// Starts following the hub's ManagedClusters (until the runtime ends).
    pub fn follow(client: Client) -> Self {
        let (store, writer) = reflector::store();
        let stream = watcher(
            Api::<ManagedCluster>::all(client),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(writer)
        .applied_objects();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                if let Err(error) = event {
                    tracing::warn!(%error, "watching ManagedClusters");
                }
            }
        });
        let ready = Arc::new(AtomicBool::new(false));
        tokio::spawn({
            let (store, ready) = (store.clone(), ready.clone());
            async move {
                if store.wait_until_ready().await.is_ok() {
                    ready.store(true, Ordering::Relaxed);
                }
            }
        });
        Clusters { store, ready }
    }

    /// Whether the first list has arrived.
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Waits for the first list.
    pub async fn wait_ready(&self) {
        let _ = self.store.wait_until_ready().await;
    }

    pub fn exists(&self, name: &str) -> bool {
        self.store.get(&ObjectRef::new(name)).is_some()
    }
}

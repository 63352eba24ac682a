//! The exposed-services allowlist: which Services of the managed clusters
//! users may reach through the `proxy-service` path. Default deny: a
//! Service is reachable only while an entry of the ConfigMap admits it
//! (upstream's `cluster-proxy-exposed-services`, its format):
//!
//! ```yaml
//! data:
//!   services: |            # any key; every key's value is a list
//!     - namespace: monitoring
//!       service: prometheus-k8s
//!       port: "9091"       # optional: any port
//!       protocol: https    # optional: http or https, any
//!       clusters: [prod-1] # optional (not upstream's): every cluster
//! ```
//!
//! The ConfigMap is followed with a watch: a change applies within the
//! watch's latency, a value that does not parse keeps the last good list
//! (and says why in the log and a metric), and deleting the ConfigMap
//! denies every Service. The kube-apiserver path never consults it: who
//! may use it is the hub's RBAC and the cluster's.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use cluster_proxy_proto::identity::is_dns1123_label;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use serde::Deserialize;

/// Upstream's ConfigMap name (`--exposed-services-configmap`).
pub const DEFAULT_CONFIGMAP: &str = "cluster-proxy-exposed-services";

/// One allowlist entry. Unknown fields are refused, so a misspelt key
/// (`prot: 80`) is an error instead of a wider entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExposedService {
    pub namespace: String,
    pub service: String,
    /// Any port when absent or empty. Upstream writes it as a string
    /// (`"8000"`); a YAML number is taken too.
    #[serde(default, deserialize_with = "port")]
    pub port: Option<u16>,
    /// `http` or `https`; any when absent or empty.
    #[serde(default, deserialize_with = "protocol")]
    pub protocol: Option<String>,
    /// The clusters it applies to; every cluster when absent.
    #[serde(default)]
    pub clusters: Option<Vec<String>>,
}

/// A Service a request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted<'a> {
    pub cluster: &'a str,
    pub namespace: &'a str,
    pub service: &'a str,
    pub port: u16,
    pub protocol: &'a str,
}

impl ExposedService {
    fn admits(&self, wanted: &Wanted<'_>) -> bool {
        self.namespace == wanted.namespace
            && self.service == wanted.service
            && self.port.is_none_or(|port| port == wanted.port)
            && self
                .protocol
                .as_deref()
                .is_none_or(|protocol| protocol == wanted.protocol)
            && self
                .clusters
                .as_ref()
                .is_none_or(|clusters| clusters.iter().any(|c| c == wanted.cluster))
    }

    fn check(&self) -> Result<(), String> {
        if self.namespace.is_empty() {
            return Err("namespace is required".into());
        }
        if self.service.is_empty() {
            return Err("service is required".into());
        }
        for (what, name) in [("namespace", &self.namespace), ("service", &self.service)] {
            if !is_dns1123_label(name) {
                return Err(format!("{what} {name:?} is not a DNS-1123 label"));
            }
        }
        if let Some(clusters) = &self.clusters
            && clusters.is_empty()
        {
            return Err("clusters is empty: leave it out to mean every cluster".into());
        }
        Ok(())
    }
}

fn port<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<u16>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Port {
        Number(u64),
        Text(String),
    }
    let bad = |shown: String| {
        serde::de::Error::custom(format!("port {shown} is not a number from 1 to 65535"))
    };
    match Option::<Port>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Port::Text(text)) if text.is_empty() => Ok(None),
        Some(Port::Text(text)) => match text.parse::<u16>() {
            Ok(port) if port != 0 => Ok(Some(port)),
            _ => Err(bad(format!("{text:?}"))),
        },
        Some(Port::Number(number)) => match u16::try_from(number) {
            Ok(port) if port != 0 => Ok(Some(port)),
            _ => Err(bad(number.to_string())),
        },
    }
}

fn protocol<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    match Option::<String>::deserialize(deserializer)?.as_deref() {
        None | Some("") => Ok(None),
        Some(protocol @ ("http" | "https")) => Ok(Some(protocol.to_owned())),
        Some(other) => Err(serde::de::Error::custom(format!(
            "protocol {other:?} is neither http nor https"
        ))),
    }
}

/// Every key's list, in key order; an error names the key and the entry.
pub fn parse(data: &BTreeMap<String, String>) -> Result<Vec<ExposedService>, String> {
    let mut all = Vec::new();
    for (key, text) in data {
        if text.trim().is_empty() {
            continue;
        }
        let entries: Option<Vec<ExposedService>> =
            serde_saphyr::from_str(text).map_err(|e| format!("key {key:?}: {e}"))?;
        for (index, entry) in entries.unwrap_or_default().into_iter().enumerate() {
            entry
                .check()
                .map_err(|e| format!("key {key:?}, entry {index}: {e}"))?;
            all.push(entry);
        }
    }
    Ok(all)
}

/// Why a Service request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(
        "service {namespace}/{service} port {port} ({protocol}) of cluster {cluster:?} is not exposed: no entry of the exposed-services allowlist ({source_name}) admits it"
    )]
    NotListed {
        cluster: String,
        namespace: String,
        service: String,
        port: u16,
        protocol: String,
        source_name: String,
    },
    #[error("the exposed-services allowlist ({0}) is not loaded yet")]
    NotLoaded(String),
}

#[derive(Debug, Default)]
struct State {
    /// Whether the first list of the ConfigMap has been seen.
    loaded: bool,
    entries: Arc<Vec<ExposedService>>,
}

/// The allowlist's metrics.
#[derive(Clone, Default)]
pub struct AllowlistMetrics {
    pub entries: Gauge,
    pub parse_errors: Counter,
}

impl AllowlistMetrics {
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "user_server_exposed_services",
            "Entries of the exposed-services allowlist in force",
            self.entries.clone(),
        );
        registry.register(
            "user_server_exposed_services_errors",
            "Versions of the exposed-services ConfigMap refused (the last good list stays)",
            self.parse_errors.clone(),
        );
    }
}

/// The allowlist in force.
#[derive(Clone)]
pub struct Allowlist {
    /// `namespace/name` of the ConfigMap, for messages.
    source_name: String,
    state: Arc<RwLock<State>>,
    metrics: AllowlistMetrics,
}

impl Allowlist {
    /// No ConfigMap (`--exposed-services-configmap=""`): every Service is
    /// refused.
    pub fn none(metrics: AllowlistMetrics) -> Self {
        Allowlist {
            source_name: "none configured".into(),
            state: Arc::new(RwLock::new(State {
                loaded: true,
                entries: Arc::default(),
            })),
            metrics,
        }
    }

    /// Follows ConfigMap `namespace/name` (until the runtime ends).
    pub fn follow(client: Client, namespace: &str, name: &str, metrics: AllowlistMetrics) -> Self {
        let allowlist = Allowlist {
            source_name: format!("ConfigMap {namespace}/{name}"),
            state: Arc::default(),
            metrics,
        };
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let stream =
            watcher(Api::<ConfigMap>::namespaced(client, namespace), config).default_backoff();
        let follower = allowlist.clone();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut listed = None;
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::Init) => listed = Some(None),
                    Ok(watcher::Event::InitApply(map)) => listed = Some(Some(map)),
                    Ok(watcher::Event::InitDone) => match listed.take().flatten() {
                        Some(map) => follower.apply(&map),
                        None => {
                            follower.set(Vec::new(), "does not exist: every Service is refused")
                        }
                    },
                    Ok(watcher::Event::Apply(map)) => follower.apply(&map),
                    Ok(watcher::Event::Delete(_)) => {
                        follower.set(Vec::new(), "was deleted: every Service is refused")
                    }
                    Err(error) => {
                        tracing::warn!(%error, source = follower.source_name, "watching the exposed-services allowlist")
                    }
                }
            }
        });
        allowlist
    }

    fn apply(&self, map: &ConfigMap) {
        let data = map.data.clone().unwrap_or_default();
        match parse(&data) {
            Ok(entries) => {
                let count = entries.len();
                self.set(entries, &format!("loaded, {count} entries"));
            }
            Err(error) => {
                self.metrics.parse_errors.inc();
                let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
                let kept = if state.loaded {
                    format!("the last good list ({} entries) stays", state.entries.len())
                } else {
                    // Nothing good was seen yet: deny, but say it is loaded so
                    // requests get the allowlist's refusal, not a wait.
                    state.loaded = true;
                    "every Service is refused until it is fixed".to_owned()
                };
                tracing::error!(source = self.source_name, %error, "the exposed-services allowlist does not parse; {kept}");
            }
        }
    }

    fn set(&self, entries: Vec<ExposedService>, what: &str) {
        self.metrics.entries.set(entries.len() as i64);
        tracing::info!(
            source = self.source_name,
            "exposed-services allowlist {what}"
        );
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        state.loaded = true;
        state.entries = Arc::new(entries);
    }

    /// Whether the first list has been seen (readiness).
    pub fn loaded(&self) -> bool {
        self.state.read().unwrap_or_else(|p| p.into_inner()).loaded
    }

    /// Whether `wanted` is admitted.
    pub fn check(&self, wanted: &Wanted<'_>) -> Result<(), Refused> {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        if !state.loaded {
            return Err(Refused::NotLoaded(self.source_name.clone()));
        }
        if state.entries.iter().any(|entry| entry.admits(wanted)) {
            return Ok(());
        }
        Err(Refused::NotListed {
            cluster: wanted.cluster.to_owned(),
            namespace: wanted.namespace.to_owned(),
            service: wanted.service.to_owned(),
            port: wanted.port,
            protocol: wanted.protocol.to_owned(),
            source_name: self.source_name.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn wanted<'a>(service: &'a str, port: u16, protocol: &'a str) -> Wanted<'a> {
        Wanted {
            cluster: "cluster-a",
            namespace: "apps",
            service,
            port,
            protocol,
        }
    }

    fn loaded(entries: Vec<ExposedService>) -> Allowlist {
        let allowlist = Allowlist::none(AllowlistMetrics::default());
        allowlist.set(entries, "test");
        allowlist
    }

    #[test]
    fn upstreams_format_parses_from_every_key() {
        let entries = parse(&data(&[
            (
                "services",
                "- namespace: apps\n  service: hello\n  port: \"8000\"\n  protocol: http\n",
            ),
            (
                "more",
                "- {namespace: apps, service: web}\n- {namespace: apps, service: api, port: 8443, clusters: [cluster-b]}\n",
            ),
            ("empty", ""),
        ]))
        .unwrap();
        assert_eq!(entries.len(), 3);
        // Keys are read in order: "more" before "services".
        assert_eq!(entries[0].service, "web");
        assert_eq!(entries[0].port, None);
        assert_eq!(entries[1].port, Some(8443));
        assert_eq!(entries[2].port, Some(8000));
        assert_eq!(entries[2].protocol.as_deref(), Some("http"));
    }

    #[test]
    fn bad_entries_name_the_key_and_the_entry() {
        for (text, expected) in [
            ("- service: hello\n", "namespace"),
            ("- namespace: apps\n", "service"),
            (
                "- {namespace: apps, service: hello, port: \"http\"}\n",
                "port",
            ),
            ("- {namespace: apps, service: hello, port: 70000}\n", "port"),
            (
                "- {namespace: apps, service: hello, protocol: ftp}\n",
                "ftp",
            ),
            ("- {namespace: apps, service: hello, prot: 80}\n", "prot"),
            ("- {namespace: apps, service: Hello_World}\n", "DNS-1123"),
            (
                "- {namespace: apps, service: hello, clusters: []}\n",
                "clusters",
            ),
            ("namespace: apps\n", "services"),
        ] {
            let error = parse(&data(&[("services", text)])).unwrap_err();
            assert!(error.contains("\"services\""), "{text}: {error}");
            assert!(
                error.to_lowercase().contains(&expected.to_lowercase()),
                "{text}: {error}"
            );
        }
    }

    #[test]
    fn empty_port_and_protocol_are_wildcards_and_the_rest_must_match() {
        let entries = parse(&data(&[(
            "services",
            "- {namespace: apps, service: hello, port: \"\", protocol: \"\"}\n- {namespace: apps, service: web, port: 8000, protocol: http}\n- {namespace: apps, service: prod-only, clusters: [cluster-b]}\n",
        )]))
        .unwrap();
        let allowlist = loaded(entries);
        assert!(allowlist.check(&wanted("hello", 1, "https")).is_ok());
        assert!(allowlist.check(&wanted("hello", 65535, "http")).is_ok());
        assert!(allowlist.check(&wanted("web", 8000, "http")).is_ok());
        assert!(allowlist.check(&wanted("web", 8000, "https")).is_err());
        assert!(allowlist.check(&wanted("web", 8001, "http")).is_err());
        assert!(allowlist.check(&wanted("other", 80, "http")).is_err());
        assert!(
            allowlist
                .check(&Wanted {
                    namespace: "default",
                    ..wanted("hello", 80, "http")
                })
                .is_err()
        );
        // Scoped to cluster-b only.
        assert!(allowlist.check(&wanted("prod-only", 80, "http")).is_err());
        assert!(
            allowlist
                .check(&Wanted {
                    cluster: "cluster-b",
                    ..wanted("prod-only", 80, "http")
                })
                .is_ok()
        );
        let refusal = allowlist.check(&wanted("web", 9, "http")).unwrap_err();
        assert!(
            refusal.to_string().contains("apps/web port 9 (http)"),
            "{refusal}"
        );
    }

    #[test]
    fn nothing_is_admitted_before_loading_or_without_a_configmap() {
        let pending = Allowlist {
            source_name: "ConfigMap x/y".into(),
            state: Arc::default(),
            metrics: AllowlistMetrics::default(),
        };
        assert!(!pending.loaded());
        assert!(matches!(
            pending.check(&wanted("hello", 80, "http")),
            Err(Refused::NotLoaded(_))
        ));
        let none = Allowlist::none(AllowlistMetrics::default());
        assert!(none.loaded());
        assert!(matches!(
            none.check(&wanted("hello", 80, "http")),
            Err(Refused::NotListed { .. })
        ));
    }

    #[test]
    fn a_bad_version_keeps_the_last_good_list() {
        let metrics = AllowlistMetrics::default();
        let allowlist = Allowlist::none(metrics.clone());
        let configmap = |text: &str| ConfigMap {
            data: Some(data(&[("services", text)])),
            ..Default::default()
        };
        allowlist.apply(&configmap("- {namespace: apps, service: hello}\n"));
        assert!(allowlist.check(&wanted("hello", 80, "http")).is_ok());
        allowlist.apply(&configmap("- {namespace: apps}\n"));
        assert!(allowlist.check(&wanted("hello", 80, "http")).is_ok());
        assert_eq!(metrics.parse_errors.get(), 1);
        assert_eq!(metrics.entries.get(), 1);
        allowlist.apply(&configmap(""));
        assert!(allowlist.check(&wanted("hello", 80, "http")).is_err());
        assert_eq!(metrics.entries.get(), 0);
    }
}

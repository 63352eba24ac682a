//! Which agent tunnel serves a dial: the upstream routing strategies, tried in
//! the configured order, spreading dials over the healthy tunnels that match.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use cluster_proxy_proto::packet::split_host_port;

use crate::tunnel::AgentTunnel;

/// A backend selection strategy (`--proxy-strategies`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Strategy {
    /// Exact match of the dial host against `host`/`ipv4`/`ipv6` identifiers.
    #[serde(rename = "destHost")]
    DestHost,
    /// Any agent.
    #[serde(rename = "default")]
    Default,
    /// Agents that declared `default-route=true`.
    #[serde(rename = "defaultRoute")]
    DefaultRoute,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::DestHost => "destHost",
            Strategy::Default => "default",
            Strategy::DefaultRoute => "defaultRoute",
        }
    }

    pub fn parse(s: &str) -> Option<Strategy> {
        match s.trim() {
            "destHost" => Some(Strategy::DestHost),
            "default" => Some(Strategy::Default),
            "defaultRoute" => Some(Strategy::DefaultRoute),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Tables {
    by_host: HashMap<String, Vec<Arc<AgentTunnel>>>,
    all: Vec<Arc<AgentTunnel>>,
    default_route: Vec<Arc<AgentTunnel>>,
}

/// Connected agent tunnels, indexed for each strategy.
pub struct Registry {
    strategies: Vec<Strategy>,
    tables: RwLock<Tables>,
    next: AtomicUsize,
}

/// Whose tunnel this is, for `--max-tunnels-per-agent`: the certificate's
/// cluster when bound, else the agent id the agent claims.
fn identity_key(tunnel: &AgentTunnel) -> (bool, &str) {
    match tunnel.cluster() {
        Some(cluster) => (true, cluster.as_str()),
        None => (false, tunnel.agent_id()),
    }
}

fn remove(list: &mut Vec<Arc<AgentTunnel>>, tunnel: &AgentTunnel) {
    list.retain(|t| t.id() != tunnel.id());
}

impl Registry {
    pub fn new(strategies: Vec<Strategy>) -> Self {
        Registry {
            strategies,
            tables: RwLock::new(Tables::default()),
            next: AtomicUsize::new(0),
        }
    }

    pub fn strategies(&self) -> &[Strategy] {
        &self.strategies
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tables> {
        self.tables.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.tables.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn register(&self, tunnel: Arc<AgentTunnel>) {
        let mut t = self.write();
        Self::insert(&mut t, tunnel);
    }

    /// Registers `tunnel` unless its agent identity (the cluster its
    /// certificate names, else its agent id) already holds `max` tunnels;
    /// then answers how many it holds.
    pub fn register_bounded(&self, tunnel: Arc<AgentTunnel>, max: usize) -> Result<(), usize> {
        let mut t = self.write();
        let key = identity_key(&tunnel);
        let held = t
            .all
            .iter()
            .filter(|other| !other.is_closed() && identity_key(other) == key)
            .count();
        if held >= max {
            return Err(held);
        }
        Self::insert(&mut t, tunnel);
        Ok(())
    }

    fn insert(t: &mut Tables, tunnel: Arc<AgentTunnel>) {
        for key in tunnel.identifiers().destination_keys() {
            t.by_host
                .entry(key.to_owned())
                .or_default()
                .push(tunnel.clone());
        }
        if tunnel.identifiers().default_route {
            t.default_route.push(tunnel.clone());
        }
        t.all.push(tunnel);
    }

    pub fn unregister(&self, tunnel: &AgentTunnel) {
        let mut t = self.write();
        for key in tunnel.identifiers().destination_keys() {
            if let Some(list) = t.by_host.get_mut(key) {
                remove(list, tunnel);
                if list.is_empty() {
                    t.by_host.remove(key);
                }
            }
        }
        remove(&mut t.default_route, tunnel);
        remove(&mut t.all, tunnel);
    }

    /// Picks a tunnel for a dial to `address` (`host:port`).
    pub fn pick(&self, address: &str) -> Option<Arc<AgentTunnel>> {
        self.pick_with_strategy(address).map(|(tunnel, _)| tunnel)
    }

    /// [`Self::pick`], also saying which strategy found the tunnel.
    pub fn pick_with_strategy(&self, address: &str) -> Option<(Arc<AgentTunnel>, Strategy)> {
        let host = split_host_port(address).map_or(address, |(h, _)| h);
        let t = self.read();
        for strategy in &self.strategies {
            let candidates = match strategy {
                Strategy::DestHost => t.by_host.get(host).map(Vec::as_slice),
                Strategy::Default => Some(t.all.as_slice()),
                Strategy::DefaultRoute => Some(t.default_route.as_slice()),
            };
            if let Some(found) = candidates.and_then(|c| self.spread(c)) {
                return Some((found, *strategy));
            }
        }
        None
    }

    /// Round-robin over the live, non-draining tunnels; draining ones only
    /// when nothing else is left (as upstream).
    fn spread(&self, candidates: &[Arc<AgentTunnel>]) -> Option<Arc<AgentTunnel>> {
        let live: Vec<&Arc<AgentTunnel>> = candidates.iter().filter(|t| !t.is_closed()).collect();
        if live.is_empty() {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..live.len())
            .map(|i| live[(start + i) % live.len()])
            .find(|t| !t.is_draining())
            .or(live.first().copied())
            .cloned()
    }

    /// Number of connected tunnels.
    pub fn tunnel_count(&self) -> usize {
        self.read().all.len()
    }

    /// Number of distinct agents (by agent id) with a live tunnel; an
    /// agent reconnecting may briefly hold two.
    pub fn agent_count(&self) -> usize {
        let t = self.read();
        let mut ids: Vec<&str> = t
            .all
            .iter()
            .filter(|tunnel| !tunnel.is_closed())
            .map(|tunnel| tunnel.agent_id())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// Distinct keys per strategy (the upstream `ready_backends` gauge).
    pub fn ready_backends(&self, strategy: Strategy) -> usize {
        let t = self.read();
        match strategy {
            Strategy::DestHost => t.by_host.len(),
            Strategy::Default => t.all.len(),
            Strategy::DefaultRoute => t.default_route.len(),
        }
    }

    /// Every tunnel, for shutdown.
    pub fn all(&self) -> Vec<Arc<AgentTunnel>> {
        self.read().all.clone()
    }
}

//! From the replicas' probe outcomes to the `ClusterProxyReachable`
//! condition, and the key deciding whether a new condition is worth a write.

use crate::probe::ProbeOutcome;

/// The condition type the prober owns on the ManagedClusterAddOn.
pub const CONDITION_TYPE: &str = "ClusterProxyReachable";
pub const REASON_REACHABLE: &str = "Reachable";
pub const REASON_DEGRADED: &str = "Degraded";
pub const REASON_UNREACHABLE: &str = "Unreachable";

/// A cluster's state as one round saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub reachable: bool,
    pub reason: &'static str,
    /// `key=value` pairs separated by spaces; a free-text `error="…"` last.
    pub message: String,
    pub key: VerdictKey,
}

/// What must change for the condition to be written again: the state,
/// or the latency by more than a factor of two (see [`VerdictKey::differs`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerdictKey {
    pub reason: String,
    pub replicas: String,
    pub latency_ms: Option<u64>,
    pub status: Option<u16>,
    pub failing: String,
}

/// Latencies below this count as equal by default: loopback and
/// in-datacenter jitter must not cause writes.
pub const LATENCY_FLOOR_MS: u64 = 16;

impl VerdictKey {
    /// Whether a condition saying `self` must be rewritten to say `new`.
    /// Latency is compared by ratio rather than by fixed power-of-two
    /// buckets: a latency hovering at a bucket edge would otherwise flip
    /// the bucket (and write) every round.
    /// Latencies under `floor_ms` count as `floor_ms`.
    pub fn differs(&self, new: &VerdictKey, floor_ms: u64) -> bool {
        self.change_to(new, floor_ms) != Change::None
    }
}

/// What a round's verdict is worth, compared with the stored condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Nothing worth a write.
    None,
    /// Only the latency moved (by more than a factor of two above the
    /// floor): written at most once per latency write interval.
    Latency,
    /// The state changed (status, reason, replicas, HTTP status, failing
    /// replicas), or there is no condition yet: written at once.
    State,
}

impl VerdictKey {
    /// How `new` differs from the stored `self`.
    pub fn change_to(&self, new: &VerdictKey, floor_ms: u64) -> Change {
        if self.reason != new.reason
            || self.replicas != new.replicas
            || self.status != new.status
            || self.failing != new.failing
            || self.latency_ms.is_some() != new.latency_ms.is_some()
        {
            Change::State
        } else if latency_differs(self.latency_ms, new.latency_ms, floor_ms) {
            Change::Latency
        } else {
            Change::None
        }
    }
}

fn latency_differs(old: Option<u64>, new: Option<u64>, floor_ms: u64) -> bool {
    match (old, new) {
        (Some(old), Some(new)) => {
            let (old, new) = (old.max(floor_ms), new.max(floor_ms));
            new > old.saturating_mul(2) || old > new.saturating_mul(2)
        }
        (None, None) => false,
        _ => true,
    }
}

/// Judges one cluster from `(replica address, outcome)` pairs (at least one).
pub fn judge(outcomes: &[(String, ProbeOutcome)]) -> Verdict {
    let total = outcomes.len();
    let healthy: Vec<&ProbeOutcome> = outcomes
        .iter()
        .map(|(_, o)| o)
        .filter(|o| o.healthy())
        .collect();
    let failing: Vec<&(String, ProbeOutcome)> =
        outcomes.iter().filter(|(_, o)| !o.healthy()).collect();
    let replicas = format!("{}/{total}", healthy.len());
    let mut fields = vec![format!("replicas={replicas}")];

    // The slowest path that works: what a client may get.
    let slowest = healthy
        .iter()
        .filter_map(|o| o.total().map(|t| (t, *o)))
        .max_by_key(|(t, _)| *t);
    let mut slowest_ms = None;
    if let Some((latency, outcome)) = slowest {
        let ms = |d: Option<std::time::Duration>| d.map(|d| d.as_millis()).unwrap_or(0);
        let latency_ms = latency.as_millis();
        slowest_ms = Some(u64::try_from(latency_ms).unwrap_or(u64::MAX));
        fields.push(format!("latency_ms={latency_ms}"));
        fields.push(format!("dial_ms={}", ms(outcome.dial)));
        fields.push(format!("tls_ms={}", ms(outcome.tls)));
        fields.push(format!("first_byte_ms={}", ms(outcome.first_byte)));
    }
    // A status code from the healthy replicas, else from any that got one.
    let status = healthy
        .iter()
        .find_map(|o| o.status)
        .or_else(|| failing.iter().find_map(|(_, o)| o.status));
    if let Some(status) = status {
        fields.push(format!("status={status}"));
    }
    let failing_names = failing
        .iter()
        .map(|(replica, _)| replica.as_str())
        .collect::<Vec<_>>()
        .join(",");
    if !failing.is_empty() {
        fields.push(format!("failing={failing_names}"));
    }
    if let Some((replica, outcome)) = failing.first() {
        let error = outcome.error.as_deref().unwrap_or("unknown");
        fields.push(format!("error={:?}", format!("{replica}: {error}")));
    }
    let reason = if healthy.is_empty() {
        REASON_UNREACHABLE
    } else if failing.is_empty() {
        REASON_REACHABLE
    } else {
        REASON_DEGRADED
    };
    Verdict {
        reachable: reason == REASON_REACHABLE,
        reason,
        message: fields.join(" "),
        key: VerdictKey {
            reason: reason.to_owned(),
            replicas,
            latency_ms: slowest_ms,
            status,
            failing: failing_names,
        },
    }
}

/// The key of a condition written earlier (by this or a previous process),
/// so that a restart does not rewrite every cluster.
pub fn key_of_condition(reason: &str, message: &str) -> VerdictKey {
    let mut key = VerdictKey {
        reason: reason.to_owned(),
        ..VerdictKey::default()
    };
    for token in message.split(' ') {
        if token.starts_with("error=") {
            break;
        }
        let Some((name, value)) = token.split_once('=') else {
            continue;
        };
        match name {
            "replicas" => key.replicas = value.to_owned(),
            "latency_ms" => key.latency_ms = value.parse().ok(),
            "status" => key.status = value.parse().ok(),
            "failing" => key.failing = value.to_owned(),
            _ => {}
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn healthy(ms: u64) -> ProbeOutcome {
        ProbeOutcome {
            dial: Some(Duration::from_millis(ms)),
            tls: Some(Duration::from_millis(1)),
            first_byte: Some(Duration::from_millis(1)),
            status: Some(200),
            error: None,
            replica_failed: false,
        }
    }

    fn failed(error: &str, status: Option<u16>) -> ProbeOutcome {
        ProbeOutcome {
            status,
            error: Some(error.into()),
            ..ProbeOutcome::default()
        }
    }

    fn key(latency_ms: Option<u64>) -> VerdictKey {
        VerdictKey {
            reason: REASON_REACHABLE.into(),
            replicas: "1/1".into(),
            latency_ms,
            status: Some(200),
            failing: String::new(),
        }
    }

    #[test]
    fn latency_must_double_or_halve_above_the_floor_to_count() {
        assert!(!key(Some(1)).differs(&key(Some(15)), LATENCY_FLOOR_MS));
        assert!(!key(Some(16)).differs(&key(Some(32)), LATENCY_FLOOR_MS));
        assert!(key(Some(16)).differs(&key(Some(33)), LATENCY_FLOOR_MS));
        assert!(!key(Some(100)).differs(&key(Some(60)), LATENCY_FLOOR_MS));
        assert!(key(Some(100)).differs(&key(Some(49)), LATENCY_FLOOR_MS));
        assert!(key(Some(100)).differs(&key(None), LATENCY_FLOOR_MS));
        let mut degraded = key(Some(100));
        degraded.reason = REASON_DEGRADED.into();
        assert!(key(Some(100)).differs(&degraded, LATENCY_FLOOR_MS));
    }

    #[test]
    fn a_latency_move_is_told_apart_from_a_state_change() {
        let floor = LATENCY_FLOOR_MS;
        assert_eq!(
            key(Some(100)).change_to(&key(Some(90)), floor),
            Change::None
        );
        assert_eq!(
            key(Some(100)).change_to(&key(Some(300)), floor),
            Change::Latency
        );
        assert_eq!(key(Some(100)).change_to(&key(None), floor), Change::State);
        let mut degraded = key(Some(100));
        degraded.reason = REASON_DEGRADED.into();
        assert_eq!(key(Some(100)).change_to(&degraded, floor), Change::State);
        let mut failing = key(Some(100));
        failing.status = Some(500);
        assert_eq!(key(Some(100)).change_to(&failing, floor), Change::State);
    }

    #[test]
    fn every_replica_through_is_reachable_with_the_slowest_latency() {
        let verdict = judge(&[("a:1".into(), healthy(1)), ("b:1".into(), healthy(5))]);
        assert!(verdict.reachable);
        assert_eq!(verdict.reason, REASON_REACHABLE);
        assert_eq!(
            verdict.message,
            "replicas=2/2 latency_ms=7 dial_ms=5 tls_ms=1 first_byte_ms=1 status=200"
        );
        assert_eq!(verdict.key.latency_ms, Some(7));
    }

    #[test]
    fn one_replica_failing_is_degraded_and_named() {
        let verdict = judge(&[
            ("a:1".into(), healthy(1)),
            ("b:1".into(), failed("dial: no agent connected", None)),
        ]);
        assert!(!verdict.reachable);
        assert_eq!(verdict.reason, REASON_DEGRADED);
        assert!(
            verdict.message.starts_with("replicas=1/2 "),
            "{}",
            verdict.message
        );
        assert!(
            verdict.message.contains("failing=b:1"),
            "{}",
            verdict.message
        );
        assert!(
            verdict
                .message
                .ends_with(r#"error="b:1: dial: no agent connected""#),
            "{}",
            verdict.message
        );
    }

    #[test]
    fn every_replica_failing_is_unreachable_with_the_status_code() {
        let verdict = judge(&[
            ("a:1".into(), failed("/healthz answered 500", Some(500))),
            ("b:1".into(), failed("/healthz answered 500", Some(500))),
        ]);
        assert_eq!(verdict.reason, REASON_UNREACHABLE);
        assert!(
            verdict
                .message
                .starts_with("replicas=0/2 status=500 failing=a:1,b:1 error="),
            "{}",
            verdict.message
        );
    }

    #[test]
    fn a_written_message_gives_back_its_key() {
        for verdict in [
            judge(&[("a:1".into(), healthy(3)), ("b:1".into(), healthy(9))]),
            judge(&[
                ("a:1".into(), healthy(3)),
                ("b:1".into(), failed("x y=z", Some(503))),
            ]),
            judge(&[("a:1".into(), failed("dial: timed out", None))]),
        ] {
            assert_eq!(
                key_of_condition(verdict.reason, &verdict.message),
                verdict.key,
                "{}",
                verdict.message
            );
        }
    }

    #[test]
    fn small_latency_changes_keep_the_key() {
        let a = judge(&[("a:1".into(), healthy(4))]);
        let b = judge(&[("a:1".into(), healthy(5))]);
        let c = judge(&[("a:1".into(), healthy(60))]);
        assert_ne!(a.message, b.message);
        assert!(!a.key.differs(&b.key, LATENCY_FLOOR_MS));
        assert!(a.key.differs(&c.key, LATENCY_FLOOR_MS));
    }
}

//! The `kubernetes` backend's Prometheus metrics. [`Metrics::register`]
//! adds them to a registry that the shared metrics server serves; a
//! [`Metrics::default`] counts without being exported.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use time::OffsetDateTime;

use super::csr::Decision;
use crate::authority::Report;

type Labels = Vec<(&'static str, String)>;

/// Cheap to clone: every clone counts into the same metrics.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    renewals: Family<Labels, Counter>,
    csr_decisions: Family<Labels, Counter>,
    leader: Gauge,
    signer_damaged: Gauge,
    waiting_for_configuration: Gauge,
    pass_failures: Counter,
    last_successful_pass: Gauge<f64, AtomicU64>,
}

impl Metrics {
    /// New metrics, registered in `registry` under `cert_authority_`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Metrics::default();
        let registry = registry.sub_registry_with_prefix("cert_authority");
        registry.register(
            "renewals",
            "Certificates and CAs written, by what (a Secret, or CA) and why",
            metrics.renewals.clone(),
        );
        registry.register(
            "csr_decisions",
            "CertificateSigningRequests for our signer acted on, by decision (signed, refused, ignored) and reason",
            metrics.csr_decisions.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the Lease and writes",
            metrics.leader.clone(),
        );
        registry.register(
            "signer_damaged",
            "1 while the signer Secret holds damaged CA material and nothing is written",
            metrics.signer_damaged.clone(),
        );
        registry.register(
            "waiting_for_configuration",
            "1 while the followed ManagedProxyConfiguration is missing or cannot be followed and nothing is written",
            metrics.waiting_for_configuration.clone(),
        );
        registry.register(
            "pass_failures",
            "Passes over the Secrets that failed",
            metrics.pass_failures.clone(),
        );
        registry.register(
            "last_successful_pass_timestamp_seconds",
            "When a pass over the Secrets last succeeded (Unix time)",
            metrics.last_successful_pass.clone(),
        );
        metrics
    }

    pub fn set_waiting_for_configuration(&self, waiting: bool) {
        self.waiting_for_configuration.set(i64::from(waiting));
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// A pass succeeded at `now` and did what `report` says.
    pub fn pass_succeeded(&self, report: &Report, now: OffsetDateTime) {
        for renewed in &report.renewed {
            let (what, reason) = renewed.split_once(": ").unwrap_or((renewed, ""));
            self.renewals
                .get_or_create(&vec![
                    ("what", what.to_string()),
                    ("reason", reason.to_string()),
                ])
                .inc();
        }
        if let Some(step) = &report.rollover {
            self.renewals
                .get_or_create(&vec![("what", "CA".to_string()), ("reason", step.clone())])
                .inc();
        }
        self.signer_damaged.set(0);
        self.last_successful_pass.set(now.unix_timestamp() as f64);
    }

    /// A pass failed; `damaged_signer`: because of the signer Secret.
    pub fn pass_failed(&self, damaged_signer: bool) {
        self.pass_failures.inc();
        self.signer_damaged.set(i64::from(damaged_signer));
    }

    pub fn csr_decided(&self, decision: &Decision) {
        let labels = match decision {
            Decision::Sign { .. } => vec![
                ("decision", "signed".to_string()),
                ("reason", String::new()),
            ],
            Decision::Refuse { reason, .. } => {
                vec![
                    ("decision", "refused".to_string()),
                    ("reason", (*reason).to_string()),
                ]
            }
            Decision::Ignore(reason) => {
                vec![
                    ("decision", "ignored".to_string()),
                    ("reason", (*reason).to_string()),
                ]
            }
        };
        self.csr_decisions.get_or_create(&labels).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn what_happened_is_exported() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.set_leader(true);
        metrics.set_waiting_for_configuration(true);
        let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        metrics.pass_succeeded(
            &Report {
                rollover: Some("CreateNextCa".into()),
                renewed: vec![
                    "CA: created".into(),
                    "proxy-server: PastRenewalPoint".into(),
                ],
            },
            at,
        );
        metrics.pass_failed(true);
        metrics.csr_decided(&Decision::Refuse {
            reason: "ClusterMismatch",
            message: String::new(),
        });
        metrics.csr_decided(&Decision::Ignore("not approved yet"));
        let exported = text(&registry);
        for line in [
            "cert_authority_leader 1",
            r#"cert_authority_renewals_total{what="CA",reason="created"} 1"#,
            r#"cert_authority_renewals_total{what="CA",reason="CreateNextCa"} 1"#,
            r#"cert_authority_renewals_total{what="proxy-server",reason="PastRenewalPoint"} 1"#,
            r#"cert_authority_csr_decisions_total{decision="refused",reason="ClusterMismatch"} 1"#,
            r#"cert_authority_csr_decisions_total{decision="ignored",reason="not approved yet"} 1"#,
            "cert_authority_signer_damaged 1",
            "cert_authority_waiting_for_configuration 1",
            "cert_authority_pass_failures_total 1",
            "cert_authority_last_successful_pass_timestamp_seconds 1800000000",
        ] {
            assert!(
                exported.lines().any(|l| l.starts_with(line)),
                "{line} missing from\n{exported}"
            );
        }
    }
}

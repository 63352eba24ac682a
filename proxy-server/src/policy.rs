//! Which hub client may reach which clusters (`--client-policy`), beyond
//! upstream. Without a policy every hub client may dial every cluster, as
//! upstream allows; with one, a client may dial only through agents of the
//! clusters its certificate subject is given, for gRPC and HTTP CONNECT alike.
//!
//! ```toml
//! [[client]]
//! subject = "CN=health-prober"
//! clusters = ["*"]
//!
//! [[client]]
//! subject = "CN=team-a-operator, O=team-a"
//! clusters = ["cluster-a", "cluster-b"]
//! ```
//!
//! The subject is matched exactly as the server logs it. A client whose
//! subject is not listed may dial nothing. Clients of the Unix-socket
//! frontend present no certificate and are not restricted.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use cluster_proxy_proto::identity::ClusterName;
use figment::providers::{Format, Toml};
use serde::Deserialize;
use tracing::warn;

use crate::listener::PeerInfo;

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("reading the client policy {path} (--client-policy): {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("client policy {path} (--client-policy): {message}")]
    Invalid { path: String, message: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    client: Vec<Rule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    subject: String,
    clusters: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Reach {
    Every,
    Only(HashSet<String>),
}

/// The parsed `--client-policy` file.
#[derive(Debug, Default)]
pub struct ClientPolicy {
    by_subject: HashMap<String, Reach>,
}

impl ClientPolicy {
    /// Reads and checks the policy file at `path`.
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses a policy; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, PolicyError> {
        let invalid = |message: String| PolicyError::Invalid {
            path: origin.to_owned(),
            message,
        };
        let file: PolicyFile = figment::Figment::from(Toml::string(text))
            .extract()
            .map_err(|e| invalid(e.to_string()))?;
        let mut by_subject = HashMap::new();
        for rule in file.client {
            if rule.subject.trim().is_empty() {
                return Err(invalid("a client rule has an empty subject".into()));
            }
            let reach = if rule.clusters.iter().any(|c| c == "*") {
                Reach::Every
            } else {
                let clusters = rule
                    .clusters
                    .iter()
                    .map(|c| {
                        ClusterName::new(c.as_str())
                            .map(|name| name.as_str().to_owned())
                            .map_err(|e| invalid(format!("subject {:?}: {e}", rule.subject)))
                    })
                    .collect::<Result<HashSet<_>, _>>()?;
                Reach::Only(clusters)
            };
            if by_subject.insert(rule.subject.clone(), reach).is_some() {
                return Err(invalid(format!(
                    "subject {:?} is listed twice",
                    rule.subject
                )));
            }
        }
        Ok(ClientPolicy { by_subject })
    }

    /// Whether the client with certificate `subject` may dial through an
    /// agent of `cluster` (`None`: an agent whose certificate names no cluster,
    /// reachable only by clients given `*`).
    pub fn allows(&self, subject: &str, cluster: Option<&ClusterName>) -> bool {
        match self.by_subject.get(subject) {
            Some(Reach::Every) => true,
            Some(Reach::Only(clusters)) => cluster.is_some_and(|c| clusters.contains(c.as_str())),
            None => false,
        }
    }
}

/// Why the client port refuses `peer`, if it does. A certificate that
/// names a cluster is an agent's: agents and hub clients share the CA, so
/// without this check one managed cluster's agent key would reach every
/// other cluster through the client port.
pub(crate) fn refusal(peer: &PeerInfo) -> Option<String> {
    let cluster = peer.cluster.as_ref()?;
    warn!(
        remote = %peer.remote,
        subject = peer.subject,
        %cluster,
        "refusing an agent certificate on the client port"
    );
    Some(format!(
        "the client certificate names cluster {cluster}: agent certificates may not dial through the client port; use a hub client certificate"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(name: &str) -> ClusterName {
        ClusterName::new(name).unwrap()
    }

    #[test]
    fn clients_reach_only_their_clusters() {
        let policy = ClientPolicy::parse(
            r#"
            [[client]]
            subject = "CN=prober"
            clusters = ["*"]

            [[client]]
            subject = "CN=team-a, O=a"
            clusters = ["cluster-a"]
            "#,
            "test",
        )
        .unwrap();
        let (a, b) = (cluster("cluster-a"), cluster("cluster-b"));
        assert!(policy.allows("CN=prober", Some(&b)));
        assert!(policy.allows("CN=prober", None));
        assert!(policy.allows("CN=team-a, O=a", Some(&a)));
        assert!(!policy.allows("CN=team-a, O=a", Some(&b)));
        assert!(!policy.allows("CN=team-a, O=a", None));
        assert!(
            !policy.allows("CN=team-a", Some(&a)),
            "subjects match exactly"
        );
        assert!(!policy.allows("CN=stranger", Some(&a)));
    }

    #[test]
    fn bad_policies_are_refused_with_the_reason() {
        for (text, expected) in [
            ("[[client]]\nsubject = \"CN=x\"\n", "clusters"),
            (
                "[[client]]\nsubject = \"\"\nclusters = []\n",
                "empty subject",
            ),
            (
                "[[client]]\nsubject = \"CN=x\"\nclusters = [\"Not A Cluster!\"]\n",
                "CN=x",
            ),
            (
                "[[client]]\nsubject = \"CN=x\"\nclusters = []\n[[client]]\nsubject = \"CN=x\"\nclusters = []\n",
                "twice",
            ),
            ("[[client]]\nsubjekt = \"CN=x\"\nclusters = []\n", "subjekt"),
            ("not toml at all [", "policy.toml"),
        ] {
            let err = ClientPolicy::parse(text, "policy.toml")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(expected) && err.contains("policy.toml"),
                "{text}: {err}"
            );
        }
        let err = ClientPolicy::load(Path::new("/nonexistent/policy.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/policy.toml"), "{err}");
    }
}

//! Checks of a [`ManagedProxyConfigurationSpec`] that its schema cannot
//! express. The schema only types the fields (and, as upstream's, accepts a
//! negative replica count or no entrypoint at all); a controller that deployed
//! such a spec would crash-loop or render broken objects. Instead it reports
//! [`InvalidSpec`] in a `False` condition with reason [`REASON_INVALID_SPEC`]
//! and leaves what is deployed alone.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::resource::{EntrypointType, ManagedProxyConfigurationSpec, SignerType};
use crate::identity::is_dns1123_label;

/// Condition reason for a spec that fails [`ManagedProxyConfigurationSpec::validate`].
/// Ours: upstream has no validation beyond the schema.
pub const REASON_INVALID_SPEC: &str = "InvalidSpec";

/// One problem, with the JSON path of the field it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecProblem {
    /// JSON path, e.g. `spec.proxyServer.replicas`.
    pub field: String,
    /// What is wrong, for people.
    pub message: String,
}

/// Why a spec cannot be deployed: every problem found, in field order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid ManagedProxyConfiguration: {}", describe(.problems))]
pub struct InvalidSpec {
    /// The problems; never empty.
    pub problems: Vec<SpecProblem>,
}

fn describe(problems: &[SpecProblem]) -> String {
    problems
        .iter()
        .map(|problem| format!("{}: {}", problem.field, problem.message))
        .collect::<Vec<_>>()
        .join("; ")
}

#[derive(Default)]
struct Problems(Vec<SpecProblem>);

impl Problems {
    fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(SpecProblem {
            field: field.into(),
            message: message.into(),
        });
    }

    fn image(&mut self, field: &str, image: &str) {
        if image.trim().is_empty() {
            self.add(field, "an image is required");
        } else if image.chars().any(char::is_whitespace) {
            self.add(field, format!("{image:?} contains whitespace"));
        }
    }

    fn replicas(&mut self, field: &str, replicas: i32) {
        if replicas < 0 {
            self.add(field, format!("{replicas} is negative"));
        }
    }

    fn port(&mut self, field: &str, port: i32) {
        if !(1..=65535).contains(&port) {
            self.add(field, format!("{port} is not a TCP port (1-65535)"));
        }
    }

    fn dns_label(&mut self, field: &str, value: &str) {
        if !is_dns1123_label(value) {
            self.add(
                field,
                format!("{value:?} is not a DNS-1123 label (lowercase alphanumerics and '-', at most 63)"),
            );
        }
    }

    fn service_name(&mut self, field: &str, value: &str) {
        let starts_with_letter = value
            .bytes()
            .next()
            .is_some_and(|first| first.is_ascii_lowercase());
        if !is_dns1123_label(value) || !starts_with_letter {
            self.add(
                field,
                format!("{value:?} is not a Service name (a DNS-1035 label: starts with a letter, lowercase alphanumerics and '-', at most 63)"),
            );
        }
    }

    fn object_name(&mut self, field: &str, value: &str) {
        if !is_dns1123_subdomain(value) {
            self.add(field, format!("{value:?} is not a DNS-1123 subdomain"));
        }
    }

    fn san(&mut self, field: &str, value: &str) {
        let host = value.strip_prefix("*.").unwrap_or(value);
        if value.parse::<IpAddr>().is_err() && !is_dns1123_subdomain(&host.to_ascii_lowercase()) {
            self.add(
                field,
                format!("{value:?} is neither an IP address nor a DNS name"),
            );
        }
    }
}

pub use crate::identity::is_dns1123_subdomain;

/// Whether `key` is a qualified name as annotation and label keys must be:
/// an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// alphanumerics, `-`, `_` and `.` that starts and ends alphanumeric.
pub fn is_qualified_name(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(is_dns1123_subdomain);
    let bytes = name.as_bytes();
    let name_ok = !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        && bytes
            .iter()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'));
    prefix_ok && name_ok
}

impl ManagedProxyConfigurationSpec {
    /// Checks what the schema cannot: images, replica counts, names, the
    /// entrypoint, ports, SANs and annotation keys. Returns every problem at
    /// once, so one status update tells the user all that needs fixing.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let mut problems = Problems::default();

        let signer = &self.authentication.signer;
        if signer.type_ != SignerType::SelfSigned {
            problems.add(
                "spec.authentication.signer.type",
                format!("{:?} is not implemented; only SelfSigned is", signer.type_),
            );
        }
        if let Some(self_signed) = &signer.self_signed {
            for (index, san) in self_signed.additional_sans.iter().enumerate() {
                problems.san(
                    &format!("spec.authentication.signer.selfSigned.additionalSANs[{index}]"),
                    san,
                );
            }
        }
        let secrets = &self.authentication.dump.secrets;
        let secret_names = [
            (
                "signingProxyServerSecretName",
                &secrets.signing_proxy_server_secret_name,
            ),
            (
                "signingProxyClientSecretName",
                &secrets.signing_proxy_client_secret_name,
            ),
            (
                "signingAgentServerSecretName",
                &secrets.signing_agent_server_secret_name,
            ),
        ];
        let mut seen_secrets = BTreeSet::new();
        for (key, name) in secret_names {
            let field = format!("spec.authentication.dump.secrets.{key}");
            problems.object_name(&field, name);
            if !seen_secrets.insert(name.as_str()) {
                problems.add(
                    field,
                    format!("{name:?} is already used for another certificate"),
                );
            }
        }

        let server = &self.proxy_server;
        problems.image("spec.proxyServer.image", &server.image);
        problems.replicas("spec.proxyServer.replicas", server.replicas);
        problems.dns_label("spec.proxyServer.namespace", &server.namespace);
        problems.service_name(
            "spec.proxyServer.inClusterServiceName",
            &server.in_cluster_service_name,
        );
        match &server.entrypoint {
            None => problems.add(
                "spec.proxyServer.entrypoint",
                "an entrypoint is required: agents need an address to dial",
            ),
            Some(entrypoint) => {
                problems.port("spec.proxyServer.entrypoint.port", entrypoint.port);
                match entrypoint.type_ {
                    EntrypointType::Hostname => match &entrypoint.hostname {
                        None => problems.add(
                            "spec.proxyServer.entrypoint.hostname",
                            "type Hostname needs hostname.value",
                        ),
                        Some(hostname) => {
                            let value = hostname.value.as_str();
                            let valid = value.parse::<IpAddr>().is_ok()
                                || is_dns1123_subdomain(&value.to_ascii_lowercase());
                            if !valid {
                                problems.add(
                                    "spec.proxyServer.entrypoint.hostname.value",
                                    format!("{value:?} is neither an IP address nor a DNS name"),
                                );
                            }
                        }
                    },
                    EntrypointType::LoadBalancerService => {
                        if let Some(service) = &entrypoint.load_balancer_service {
                            let field = "spec.proxyServer.entrypoint.loadBalancerService";
                            problems.service_name(&format!("{field}.name"), &service.name);
                            let mut seen_keys = BTreeSet::new();
                            for (index, annotation) in service.annotations.iter().enumerate() {
                                let key_field = format!("{field}.annotations[{index}].key");
                                if !is_qualified_name(&annotation.key) {
                                    problems.add(
                                        key_field,
                                        format!(
                                            "{:?} is not a valid annotation key",
                                            annotation.key
                                        ),
                                    );
                                } else if !seen_keys.insert(annotation.key.as_str()) {
                                    problems.add(
                                        key_field,
                                        format!("{:?} is set twice", annotation.key),
                                    );
                                }
                            }
                        }
                    }
                    EntrypointType::PortForward => {}
                }
            }
        }

        let agent = &self.proxy_agent;
        problems.image("spec.proxyAgent.image", &agent.image);
        problems.replicas("spec.proxyAgent.replicas", agent.replicas);
        for (index, secret) in agent.image_pull_secrets.iter().enumerate() {
            problems.object_name(
                &format!("spec.proxyAgent.imagePullSecrets[{index}]"),
                secret,
            );
        }
        if let Some(config_map) = &agent.additional_service_ca_config_map {
            problems.object_name("spec.proxyAgent.additionalServiceCAConfigMap", config_map);
        }

        if let Some(deploy) = &self.deploy {
            let ports = &deploy.ports;
            let all = [
                ("proxyServer", ports.proxy_server),
                ("agentServer", ports.agent_server),
                ("healthServer", ports.health_server),
                ("adminServer", ports.admin_server),
            ];
            let mut seen_ports = BTreeSet::new();
            for (key, port) in all {
                let field = format!("spec.deploy.ports.{key}");
                problems.port(&field, port);
                if !seen_ports.insert(port) {
                    problems.add(
                        field,
                        format!("port {port} is already used by another listener"),
                    );
                }
            }
        }

        // Impersonation is per cluster (the AddOnDeploymentConfig's
        // enableImpersonation, with its RBAC): a flag here would contradict
        // the rendered ClusterRole. Upstream refuses it too.
        for (index, arg) in self
            .proxy_agent
            .additional_service_proxy_args
            .iter()
            .enumerate()
        {
            let flag = arg
                .trim_start_matches('-')
                .split('=')
                .next()
                .unwrap_or_default();
            if flag == "enable-impersonation" {
                problems.add(
                    format!("spec.proxyAgent.additionalServiceProxyArgs[{index}]"),
                    "--enable-impersonation is set per cluster by the AddOnDeploymentConfig variable enableImpersonation, not here".to_owned(),
                );
            }
        }

        if let Some(user_server) = &self.user_server {
            for (index, san) in user_server.additional_sans.iter().enumerate() {
                problems.san(&format!("spec.userServer.additionalSANs[{index}]"), san);
            }
        }

        if problems.0.is_empty() {
            Ok(())
        } else {
            Err(InvalidSpec {
                problems: problems.0,
            })
        }
    }
}

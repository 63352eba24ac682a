//! The proxy-servers' OpenTelemetry trace export: what addon-manager renders
//! as `OTEL_*` variables on the proxy-server container, so that in a real
//! install the data plane's hub half exports as the other hub services do.
//!
//! The settings come from addon-manager's `--proxy-server-otlp-*` flags,
//! which default to addon-manager's own standard variables for everything
//! that means the same in another pod (endpoint, sampler, resource
//! attributes, compression). The two that do not are references only:
//! collector headers are usually a credential, and addon-manager's own
//! `OTEL_EXPORTER_OTLP_HEADERS` holds the value, which must never be written
//! into a Deployment; its `OTEL_EXPORTER_OTLP_CERTIFICATE` is a path in its
//! own pod. So the headers come from a Secret (`secretKeyRef`) and the CA
//! bundle from a ConfigMap (a volume), both in the proxy-server namespace.
//!
//! Everything rendered is checked with the runtime's own parser
//! ([`TelemetryFlags::to_config`]) before it is accepted: a value the
//! proxy-server would refuse at start-up would otherwise crash-loop the
//! data plane over a tracing setting.

use std::collections::BTreeMap;

use cluster_proxy_runtime::telemetry::TelemetryFlags;
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, EnvVar, EnvVarSource, KeyToPath, SecretKeySelector, Volume, VolumeMount,
};
use sha2::{Digest, Sha256};

/// The proxy-server pod template annotation that changes with the OTLP
/// settings, as [`super::tls_profile::ANNOTATION_TLS_CONFIG_HASH`] does with
/// the TLS profile: a change shows, and rolls the replicas.
pub const ANNOTATION_OTLP_CONFIG_HASH: &str = "proxy.open-cluster-management.io/otlp-config-hash";
/// The pod volume of the collector's CA bundle.
pub const OTLP_CA_VOLUME: &str = "otlp-ca";
/// Where that volume is mounted.
pub const OTLP_CA_MOUNT: &str = "/etc/otlp-ca";
/// The file the ConfigMap's key becomes in [`OTLP_CA_MOUNT`].
pub const OTLP_CA_FILE: &str = "ca.crt";
/// The headers Secret's key unless one is named.
pub const DEFAULT_HEADERS_KEY: &str = "headers";
/// The CA ConfigMap's key unless one is named.
pub const DEFAULT_CA_KEY: &str = "ca.crt";

/// A Secret's or ConfigMap's key, in the proxy-server namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRef {
    pub name: String,
    pub key: String,
}

/// The proxy-servers' OTLP settings. With no endpoint nothing is rendered at
/// all, so a hub without tracing has the pod template it had before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyServerTelemetry {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; `None`: no export.
    pub endpoint: Option<String>,
    /// `OTEL_TRACES_SAMPLER`.
    pub sampler: Option<String>,
    /// `OTEL_TRACES_SAMPLER_ARG`.
    pub sampler_arg: Option<String>,
    /// `OTEL_RESOURCE_ATTRIBUTES` beyond the pod's own (see [`Self::env`]).
    pub resource_attributes: Option<String>,
    /// `OTEL_EXPORTER_OTLP_COMPRESSION`.
    pub compression: Option<String>,
    /// `OTEL_EXPORTER_OTLP_HEADERS` from this Secret's key.
    pub headers_secret: Option<KeyRef>,
    /// `OTEL_EXPORTER_OTLP_CERTIFICATE`: this ConfigMap's key, mounted.
    pub ca_config_map: Option<KeyRef>,
}

/// Settings the proxy-server would refuse, or references that name nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct ProxyServerTelemetryError {
    /// The addon-manager setting (its flag with underscores).
    pub setting: &'static str,
    pub reason: String,
}

fn given(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

impl ProxyServerTelemetry {
    /// Whether the proxy-servers export at all.
    pub fn is_enabled(&self) -> bool {
        given(&self.endpoint).is_some()
    }

    /// Checks the settings as the proxy-server will read them, and the
    /// names of the Secret and ConfigMap.
    pub fn validate(&self) -> Result<(), ProxyServerTelemetryError> {
        let error = |setting, reason: String| ProxyServerTelemetryError { setting, reason };
        let flags = TelemetryFlags {
            otlp_endpoint: self.endpoint.clone(),
            otel_traces_sampler: self.sampler.clone(),
            otel_traces_sampler_arg: self.sampler_arg.clone(),
            otel_resource_attributes: self.resource_attributes.clone(),
            otlp_compression: self.compression.clone(),
            ..TelemetryFlags::default()
        };
        if let Err(problem) = flags.to_config("proxy-server") {
            use cluster_proxy_runtime::telemetry::TelemetryError as E;
            let setting = match problem {
                E::Endpoint { .. } => "proxy_server_otlp_endpoint",
                E::Sampler(_) => "proxy_server_otel_traces_sampler",
                E::SamplerArg(_) => "proxy_server_otel_traces_sampler_arg",
                E::ResourceAttribute(_) => "proxy_server_otel_resource_attributes",
                E::Compression(_) => "proxy_server_otlp_compression",
                _ => "proxy_server_otlp_endpoint",
            };
            return Err(error(setting, problem.to_string()));
        }
        // The exporter verifies an https collector against a configured CA
        // only, and without one the proxy-server would refuse to start.
        let https = given(&self.endpoint).is_some_and(|e| e.starts_with("https://"));
        if https && self.ca_config_map.is_none() {
            return Err(error(
                "proxy_server_otlp_ca_configmap",
                "an https collector needs the CA bundle that signed its certificate (a \
                 ConfigMap in the proxy-server namespace): without it the proxy-servers \
                 would not start"
                    .to_owned(),
            ));
        }
        let key_chars = |key: &str| {
            !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        };
        for (reference, name_setting, key_setting) in [
            (
                &self.headers_secret,
                "proxy_server_otlp_headers_secret",
                "proxy_server_otlp_headers_secret_key",
            ),
            (
                &self.ca_config_map,
                "proxy_server_otlp_ca_configmap",
                "proxy_server_otlp_ca_configmap_key",
            ),
        ] {
            let Some(reference) = reference else { continue };
            if !cluster_proxy_proto::identity::is_dns1123_subdomain(&reference.name) {
                return Err(error(
                    name_setting,
                    format!("{:?} is not a DNS-1123 subdomain", reference.name),
                ));
            }
            if !key_chars(&reference.key) {
                return Err(error(
                    key_setting,
                    format!(
                        "{:?} is not a key (letters, digits, '-', '_', '.')",
                        reference.key
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The container's variables, after the proxy-server's `server_id_env`
    /// (the variable holding the pod's name, which the resource attributes
    /// name through Kubernetes' `$(VAR)` expansion); empty when not enabled.
    ///
    /// The resource attributes start with the pod's namespace and name so
    /// that the replicas tell apart in a trace; the configured ones follow.
    /// `$(` in those is escaped, as Kubernetes would otherwise expand it.
    /// The headers Secret is `optional`: a missing credential must degrade
    /// export, never keep the data plane from starting; the CA ConfigMap is
    /// not (see [`Self::volume`]).
    pub fn env(&self, namespace: &str, server_id_env: &str) -> Vec<EnvVar> {
        let Some(endpoint) = given(&self.endpoint) else {
            return Vec::new();
        };
        let plain = |name: &str, value: &str| EnvVar {
            name: name.to_owned(),
            value: Some(value.to_owned()),
            value_from: None,
        };
        let mut env = vec![plain("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)];
        if let Some(sampler) = given(&self.sampler) {
            env.push(plain("OTEL_TRACES_SAMPLER", sampler));
        }
        if let Some(arg) = given(&self.sampler_arg) {
            env.push(plain("OTEL_TRACES_SAMPLER_ARG", arg));
        }
        let mut attributes =
            format!("k8s.namespace.name={namespace},k8s.pod.name=$({server_id_env})");
        if let Some(extra) = given(&self.resource_attributes) {
            attributes.push(',');
            attributes.push_str(&extra.replace("$(", "$$("));
        }
        env.push(plain("OTEL_RESOURCE_ATTRIBUTES", &attributes));
        if let Some(compression) = given(&self.compression) {
            env.push(plain("OTEL_EXPORTER_OTLP_COMPRESSION", compression));
        }
        if let Some(secret) = &self.headers_secret {
            env.push(EnvVar {
                name: "OTEL_EXPORTER_OTLP_HEADERS".to_owned(),
                value: None,
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: secret.name.clone(),
                        key: secret.key.clone(),
                        optional: Some(true),
                    }),
                    ..EnvVarSource::default()
                }),
            });
        }
        if self.ca_config_map.is_some() {
            env.push(plain(
                "OTEL_EXPORTER_OTLP_CERTIFICATE",
                &format!("{OTLP_CA_MOUNT}/{OTLP_CA_FILE}"),
            ));
        }
        env
    }

    /// The CA bundle's volume, when export is on and a ConfigMap is named.
    /// Not `optional`: without the file the proxy-server would refuse to
    /// start and restart forever; a missing ConfigMap instead holds the new
    /// pod in `ContainerCreating` with an event naming it, while the
    /// rolling update keeps the old replicas serving.
    pub fn volume(&self) -> Option<Volume> {
        let config_map = self.ca_config_map.as_ref().filter(|_| self.is_enabled())?;
        Some(Volume {
            name: OTLP_CA_VOLUME.to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map.name.clone(),
                items: Some(vec![KeyToPath {
                    key: config_map.key.clone(),
                    path: OTLP_CA_FILE.to_owned(),
                    mode: None,
                }]),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        })
    }

    /// The mount of [`Self::volume`].
    pub fn volume_mount(&self) -> Option<VolumeMount> {
        self.volume().map(|_| VolumeMount {
            name: OTLP_CA_VOLUME.to_owned(),
            mount_path: OTLP_CA_MOUNT.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        })
    }

    /// 16 hex digits over what is rendered (never a secret's value: only
    /// its name and key are rendered); `None` when nothing is.
    pub fn hash(&self, namespace: &str) -> Option<String> {
        if !self.is_enabled() {
            return None;
        }
        // The name of the server id's variable is the renderer's constant,
        // not a setting: the hash covers the settings.
        let rendered = serde_json::json!({
            "env": self.env(namespace, ""),
            "volume": self.volume(),
        });
        let digest = Sha256::digest(rendered.to_string().as_bytes());
        Some(hex::encode(&digest[..8]))
    }

    /// The pod template annotation carrying [`Self::hash`].
    pub fn annotations(&self, namespace: &str) -> BTreeMap<String, String> {
        self.hash(namespace)
            .map(|hash| (ANNOTATION_OTLP_CONFIG_HASH.to_owned(), hash))
            .into_iter()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> ProxyServerTelemetry {
        ProxyServerTelemetry {
            endpoint: Some("http://collector.observability:4317".into()),
            ..ProxyServerTelemetry::default()
        }
    }

    #[test]
    fn nothing_is_rendered_without_an_endpoint() {
        let off = ProxyServerTelemetry {
            endpoint: Some(" ".into()),
            sampler: Some("always_on".into()),
            headers_secret: Some(KeyRef {
                name: "otlp".into(),
                key: "headers".into(),
            }),
            ca_config_map: Some(KeyRef {
                name: "otlp-ca".into(),
                key: "ca.crt".into(),
            }),
            ..ProxyServerTelemetry::default()
        };
        assert!(off.validate().is_ok());
        assert!(off.env("ns", "PROXY_SERVER_ID").is_empty());
        assert!(off.volume().is_none());
        assert!(off.volume_mount().is_none());
        assert!(off.annotations("ns").is_empty());
    }

    #[test]
    fn user_attributes_cannot_expand_other_variables() {
        let telemetry = ProxyServerTelemetry {
            resource_attributes: Some("team=$(SECRET)".into()),
            ..on()
        };
        let env = telemetry.env("hub", "PROXY_SERVER_ID");
        let attributes = env
            .iter()
            .find(|var| var.name == "OTEL_RESOURCE_ATTRIBUTES")
            .and_then(|var| var.value.clone())
            .unwrap_or_default();
        assert_eq!(
            attributes,
            "k8s.namespace.name=hub,k8s.pod.name=$(PROXY_SERVER_ID),team=$$(SECRET)"
        );
    }

    #[test]
    fn bad_values_are_refused_naming_the_setting() {
        for (telemetry, setting) in [
            (
                ProxyServerTelemetry {
                    endpoint: Some("collector:4317".into()),
                    ..ProxyServerTelemetry::default()
                },
                "proxy_server_otlp_endpoint",
            ),
            (
                ProxyServerTelemetry {
                    sampler: Some("sometimes".into()),
                    ..on()
                },
                "proxy_server_otel_traces_sampler",
            ),
            (
                ProxyServerTelemetry {
                    endpoint: Some("https://collector:4317".into()),
                    ..ProxyServerTelemetry::default()
                },
                "proxy_server_otlp_ca_configmap",
            ),
            (
                ProxyServerTelemetry {
                    sampler: Some("traceidratio".into()),
                    sampler_arg: Some("2".into()),
                    ..on()
                },
                "proxy_server_otel_traces_sampler_arg",
            ),
            (
                ProxyServerTelemetry {
                    resource_attributes: Some("novalue".into()),
                    ..on()
                },
                "proxy_server_otel_resource_attributes",
            ),
            (
                ProxyServerTelemetry {
                    compression: Some("zstd".into()),
                    ..on()
                },
                "proxy_server_otlp_compression",
            ),
            (
                ProxyServerTelemetry {
                    headers_secret: Some(KeyRef {
                        name: "Not_A_Name".into(),
                        key: "headers".into(),
                    }),
                    ..on()
                },
                "proxy_server_otlp_headers_secret",
            ),
            (
                ProxyServerTelemetry {
                    ca_config_map: Some(KeyRef {
                        name: "otlp-ca".into(),
                        key: "ca/crt".into(),
                    }),
                    ..on()
                },
                "proxy_server_otlp_ca_configmap_key",
            ),
        ] {
            let error = telemetry.validate().expect_err(setting);
            assert_eq!(error.setting, setting, "{error}");
        }
    }
}

//! Following a `ManagedProxyConfiguration` (MPC): where the hub leaf
//! Secrets live, what they are called and which SANs the server
//! certificates carry all come from the MPC (and, for a
//! `LoadBalancerService` entrypoint, from that Service's published
//! address), as upstream's MPC reconciler derives them (§3.2). The
//! certificate conditions go back onto the MPC's status.
//!
//! [`follow`] watches the MPC and the entrypoint Service and publishes what
//! they ask for as a [`Following`]; the run loop reacts to every change at
//! once. [`publish_conditions`] writes cert-authority's own conditions with
//! server-side apply on the status subresource, so the conditions other
//! writers own (addon-manager's `ProxyServerDeployed`) stay theirs.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use cluster_proxy_proto::api::proxy::v1alpha1::{
    CONDITION_AGENT_SERVER_SECRET_SIGNED, CONDITION_PROXY_CLIENT_SECRET_SIGNED,
    CONDITION_PROXY_SERVER_SECRET_SIGNED, CONDITION_USER_SERVER_SECRET_SIGNED, EntrypointType,
    ManagedProxyConfiguration, REASON_NOT_YET_SIGNED, REASON_SUCCESSFULLY_SIGNED,
    USER_SERVER_SECRET_NAME,
};
use cluster_proxy_proto::api::{CONDITION_FALSE, CONDITION_TRUE, Condition};
use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use time::OffsetDateTime;
use tokio::sync::watch;

use super::common::{FIELD_MANAGER, KubeError};
use super::options::{LeafSecretNames, is_dns_subdomain};
use super::secrets::LeafCertificates;

/// What the followed MPC asks for, once read and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `spec.proxyServer.namespace`: where the leaf Secrets and the bundle go.
    pub namespace: String,
    /// `spec.proxyServer.inClusterServiceName`.
    pub service_name: String,
    /// `spec.authentication.dump.secrets`.
    pub secret_names: LeafSecretNames,
    /// SANs beyond upstream's common ones: `additionalSANs`, then the
    /// entrypoint's host name or load balancer address.
    pub sans: Vec<String>,
    /// SANs of the MPC left out because they are neither an IP address nor
    /// a DNS name.
    pub ignored_sans: Vec<String>,
    /// The MPC's `metadata.generation`, recorded in the conditions.
    pub generation: Option<i64>,
    /// `spec.userServer.additionalSANs` when `spec.userServer` is set (then
    /// the service-access certificates are kept too).
    pub user_server_additional_sans: Option<Vec<String>>,
}

/// The state of the followed MPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Following {
    /// Not found (or not readable yet): nothing is written until it is.
    Missing(String),
    /// Found, but it cannot be followed; the reason goes into `False`
    /// conditions and nothing else is written.
    Invalid {
        reason: String,
        generation: Option<i64>,
    },
    Ready(Target),
}

/// Whether `san` can go into a certificate: an IP address, or a DNS name
/// (a leading `*.` wildcard allowed).
pub fn is_valid_san(san: &str) -> bool {
    if san.parse::<IpAddr>().is_ok() {
        return true;
    }
    let name = san.strip_prefix("*.").unwrap_or(san);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn is_dns_label(name: &str) -> bool {
    name.len() <= 63 && !name.contains('.') && is_dns_subdomain(name)
}

/// The LoadBalancer Service the MPC's entrypoint names, if it is of that type.
pub fn load_balancer_service(mpc: &ManagedProxyConfiguration) -> Option<(String, String)> {
    mpc.load_balancer_service()
}

/// The address a LoadBalancer Service publishes: its first ingress's IP,
/// else its host name (load balancers such as AWS's publish only that).
pub fn published_address(service: &Service) -> Option<String> {
    cluster_proxy_proto::api::proxy::v1alpha1::load_balancer_address(service)
}

/// What `mpc` asks for; `entrypoint_service` is the LoadBalancer Service
/// of its entrypoint as read (`None`: absent or not of that type).
pub fn derive(
    mpc: &ManagedProxyConfiguration,
    entrypoint_service: Option<&Service>,
) -> Result<Target, String> {
    let server = &mpc.spec.proxy_server;
    if !is_dns_label(&server.namespace) {
        return Err(format!(
            "spec.proxyServer.namespace {:?} is not a valid namespace name",
            server.namespace
        ));
    }
    if !is_dns_label(&server.in_cluster_service_name) {
        return Err(format!(
            "spec.proxyServer.inClusterServiceName {:?} is not a valid Service name",
            server.in_cluster_service_name
        ));
    }
    let secret_names = LeafSecretNames {
        proxy_server: mpc
            .spec
            .authentication
            .dump
            .secrets
            .signing_proxy_server_secret_name
            .clone(),
        agent_server: mpc
            .spec
            .authentication
            .dump
            .secrets
            .signing_agent_server_secret_name
            .clone(),
        proxy_client: mpc
            .spec
            .authentication
            .dump
            .secrets
            .signing_proxy_client_secret_name
            .clone(),
    };
    secret_names
        .validate()
        .map_err(|e| format!("spec.authentication.dump.secrets: {e}"))?;
    let mut wanted: Vec<String> = mpc
        .spec
        .authentication
        .signer
        .self_signed
        .iter()
        .flat_map(|s| s.additional_sans.iter().cloned())
        .collect();
    if let Some(entrypoint) = &server.entrypoint {
        match entrypoint.type_ {
            EntrypointType::Hostname => {
                wanted.extend(entrypoint.hostname.as_ref().map(|h| h.value.clone()));
            }
            EntrypointType::LoadBalancerService => {
                wanted.extend(entrypoint_service.and_then(published_address));
            }
            // Agents dial a local port-forward: the local SANs cover it.
            EntrypointType::PortForward => {}
        }
    }
    let mut ignored_sans = Vec::new();
    let mut valid = |wanted: Vec<String>| {
        let mut sans = Vec::new();
        for san in wanted {
            let san = san.trim().to_owned();
            if !is_valid_san(&san) {
                ignored_sans.push(san);
            } else if !sans.contains(&san) {
                sans.push(san);
            }
        }
        sans
    };
    let sans = valid(wanted);
    let user_server_additional_sans = mpc
        .spec
        .user_server
        .as_ref()
        .map(|user_server| valid(user_server.additional_sans.clone()));
    Ok(Target {
        namespace: server.namespace.clone(),
        service_name: server.in_cluster_service_name.clone(),
        secret_names,
        sans,
        ignored_sans,
        generation: mpc.metadata.generation,
        user_server_additional_sans,
    })
}

type Events = Pin<Box<dyn Stream<Item = Result<(), watcher::Error>> + Send>>;

fn changes<K>(api: Api<K>, name: &str) -> Events
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    Box::pin(
        watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .default_backoff()
        .filter_map(|event| async move {
            match event {
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => None,
                Ok(_) => Some(Ok(())),
                Err(error) => Some(Err(error)),
            }
        }),
    )
}

/// Reads the MPC `name` (and its entrypoint Service) and says what it asks
/// for. `Err`: the API could not be read; the previous state stands.
pub async fn read(client: &Client, name: &str) -> Result<Following, KubeError> {
    Ok(read_with_service(client, name).await?.0)
}

/// [`read`], and the LoadBalancer Service (namespace, name) the MPC's
/// entrypoint names, to watch.
async fn read_with_service(
    client: &Client,
    name: &str,
) -> Result<(Following, Option<(String, String)>), KubeError> {
    let mpcs: Api<ManagedProxyConfiguration> = Api::all(client.clone());
    let Some(mpc) = mpcs.get_opt(name).await? else {
        let reason = format!(
            "ManagedProxyConfiguration {name} does not exist (or its CRD is not installed)"
        );
        return Ok((Following::Missing(reason), None));
    };
    let entrypoint_service = load_balancer_service(&mpc)
        .filter(|(namespace, service)| is_dns_label(namespace) && is_dns_subdomain(service));
    let service = match &entrypoint_service {
        Some((namespace, service)) => {
            Api::<Service>::namespaced(client.clone(), namespace)
                .get_opt(service)
                .await?
        }
        None => None,
    };
    let following = match derive(&mpc, service.as_ref()) {
        Ok(target) => Following::Ready(target),
        Err(reason) => Following::Invalid {
            reason,
            generation: mpc.metadata.generation,
        },
    };
    Ok((following, entrypoint_service))
}

/// Keeps `state` equal to what the MPC `name` asks for: re-reads it (and
/// its entrypoint Service) whenever either changes. Runs until aborted.
pub async fn follow(client: Client, name: String, state: Arc<watch::Sender<Following>>) {
    let mpcs: Api<ManagedProxyConfiguration> = Api::all(client.clone());
    let mut mpc_events = changes(mpcs, &name);
    // The Service watched, and its events; replaced when the MPC names
    // another one.
    let mut watched_service: Option<(String, String)> = None;
    let mut service_events: Option<Events> = None;
    loop {
        match read_with_service(&client, &name).await {
            Ok((following, wanted_service)) => {
                if wanted_service != watched_service {
                    service_events = wanted_service.as_ref().map(|(namespace, service)| {
                        changes(
                            Api::<Service>::namespaced(client.clone(), namespace),
                            service,
                        )
                    });
                    watched_service = wanted_service;
                }
                state.send_if_modified(|current| {
                    if *current == following {
                        return false;
                    }
                    *current = following;
                    true
                });
            }
            Err(error) => {
                tracing::warn!(%error, mpc = %name, "reading the ManagedProxyConfiguration failed; retrying on the next change");
            }
        }
        let next = async {
            match service_events.as_mut() {
                Some(events) => events.next().await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            event = mpc_events.next() => event,
            event = next => event,
        };
        match event {
            Some(Ok(())) => {}
            Some(Err(error)) => {
                tracing::warn!(%error, mpc = %name, "watching the ManagedProxyConfiguration or its entrypoint Service failed; retrying");
            }
            // A watcher stream never ends; if one did, stop following
            // rather than spin.
            None => return,
        }
    }
}

/// What one certificate condition should say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateCondition {
    pub type_: &'static str,
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

fn expiry_message(pem: &str) -> Result<String, String> {
    let (_, block) =
        x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|e| format!("not PEM: {e}"))?;
    let certificate = block
        .parse_x509()
        .map_err(|e| format!("not a certificate: {e}"))?;
    let not_after = certificate.validity().not_after.timestamp();
    let not_after = k8s_openapi::jiff::Timestamp::from_second(not_after)
        .map_err(|e| format!("expiry out of range: {e}"))?;
    Ok(format!("Expiry:{not_after}"))
}

/// The certificate conditions for the certificates a pass left in the
/// Secrets of `target`: three, and `UserServerSecretSigned` while
/// `spec.userServer` is set.
pub fn certificate_conditions(
    target: &Target,
    certificates: &LeafCertificates,
) -> Vec<CertificateCondition> {
    let names = &target.secret_names;
    let user_server = target.user_server_additional_sans.as_ref().map(|_| {
        (
            CONDITION_USER_SERVER_SECRET_SIGNED,
            USER_SERVER_SECRET_NAME,
            &certificates.user_server,
        )
    });
    [
        (
            CONDITION_PROXY_SERVER_SECRET_SIGNED,
            names.proxy_server.as_str(),
            &certificates.proxy_server,
        ),
        (
            CONDITION_AGENT_SERVER_SECRET_SIGNED,
            names.agent_server.as_str(),
            &certificates.agent_server,
        ),
        (
            CONDITION_PROXY_CLIENT_SECRET_SIGNED,
            names.proxy_client.as_str(),
            &certificates.proxy_client,
        ),
    ]
    .into_iter()
    .chain(user_server)
    .map(|(type_, secret, pem)| {
        let checked = match pem {
            None => Err(format!(
                "Secret {}/{secret} holds no certificate yet",
                target.namespace
            )),
            Some(pem) => expiry_message(pem)
                .map_err(|e| format!("Secret {}/{secret}: {e}", target.namespace)),
        };
        match checked {
            Ok(message) => CertificateCondition {
                type_,
                status: CONDITION_TRUE,
                reason: REASON_SUCCESSFULLY_SIGNED,
                message,
            },
            Err(message) => not_signed(type_, message),
        }
    })
    .collect()
}

fn not_signed(type_: &'static str, message: String) -> CertificateCondition {
    CertificateCondition {
        type_,
        status: CONDITION_FALSE,
        reason: REASON_NOT_YET_SIGNED,
        message,
    }
}

/// All three conditions `False`, saying why: the MPC cannot be followed.
pub fn unsigned_conditions(reason: &str) -> Vec<CertificateCondition> {
    [
        CONDITION_PROXY_SERVER_SECRET_SIGNED,
        CONDITION_AGENT_SERVER_SECRET_SIGNED,
        CONDITION_PROXY_CLIENT_SECRET_SIGNED,
    ]
    .into_iter()
    .map(|type_| not_signed(type_, reason.to_owned()))
    .collect()
}

/// The conditions to apply: `wanted`, each keeping its stored
/// `lastTransitionTime` unless its status changes. `None`: the stored ones
/// already say exactly this, so nothing is written.
pub fn merge_conditions(
    stored: &[Condition],
    wanted: &[CertificateCondition],
    generation: Option<i64>,
    now: OffsetDateTime,
) -> Option<Vec<Condition>> {
    let now = Time(
        k8s_openapi::jiff::Timestamp::from_second(now.unix_timestamp())
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    );
    let mut changed = false;
    let merged = wanted
        .iter()
        .map(|want| {
            let old = stored.iter().find(|c| c.type_ == want.type_);
            let same = old.is_some_and(|old| {
                old.status == want.status
                    && old.reason == want.reason
                    && old.message == want.message
                    && old.observed_generation == generation
            });
            changed |= !same;
            let last_transition_time = match old {
                Some(old) if old.status == want.status => old.last_transition_time.clone(),
                _ => now.clone(),
            };
            Condition {
                type_: want.type_.to_owned(),
                status: want.status.to_owned(),
                reason: want.reason.to_owned(),
                message: want.message.clone(),
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect();
    changed.then_some(merged)
}

/// Applies `wanted` to the status of the MPC `name` under [`FIELD_MANAGER`]
/// (only these condition types; the list is keyed by type, so the other
/// writers' conditions stay). Returns whether it wrote; no write when the
/// stored conditions already say this, or when the MPC is gone.
pub async fn publish_conditions(
    client: &Client,
    name: &str,
    wanted: &[CertificateCondition],
    generation: Option<i64>,
    now: OffsetDateTime,
) -> Result<bool, KubeError> {
    let mpcs: Api<ManagedProxyConfiguration> = Api::all(client.clone());
    let Some(mpc) = mpcs.get_opt(name).await? else {
        return Ok(false);
    };
    let stored = mpc.status.map(|s| s.conditions).unwrap_or_default();
    let Some(conditions) = merge_conditions(&stored, wanted, generation, now) else {
        return Ok(false);
    };
    let patch = serde_json::json!({
        "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
        "kind": "ManagedProxyConfiguration",
        "metadata": {"name": name},
        "status": {"conditions": conditions},
    });
    // Forced: these condition types are ours alone; a conflict could only
    // come from a writer that took one over by mistake.
    mpcs.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn mpc(spec: serde_json::Value) -> ManagedProxyConfiguration {
        serde_json::from_value(json!({
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy", "generation": 3},
            "spec": spec,
        }))
        .unwrap()
    }

    fn base(entrypoint: serde_json::Value) -> serde_json::Value {
        json!({
            "authentication": {"signer": {"type": "SelfSigned", "selfSigned": {"additionalSANs": ["foo", "bad san", "10.0.0.9"]}}},
            "proxyServer": {"image": "i", "namespace": "hub-ns", "inClusterServiceName": "entry", "entrypoint": entrypoint},
            "proxyAgent": {"image": "a"},
        })
    }

    #[test]
    fn derives_namespace_names_and_sans() {
        let target = derive(
            &mpc(base(
                json!({"type": "Hostname", "hostname": {"value": "proxy.example.com"}, "port": 8091}),
            )),
            None,
        )
        .unwrap();
        assert_eq!(target.namespace, "hub-ns");
        assert_eq!(target.service_name, "entry");
        assert_eq!(target.secret_names, LeafSecretNames::default());
        assert_eq!(target.sans, ["foo", "10.0.0.9", "proxy.example.com"]);
        assert_eq!(target.ignored_sans, ["bad san"]);
        assert_eq!(target.generation, Some(3));
    }

    #[test]
    fn a_load_balancer_adds_its_ip_or_else_its_hostname() {
        let lb = mpc(base(json!({"type": "LoadBalancerService", "port": 8091})));
        assert_eq!(
            load_balancer_service(&lb),
            Some(("hub-ns".into(), "proxy-agent-entrypoint".into()))
        );
        let service = |ingress: serde_json::Value| -> Service {
            serde_json::from_value(json!({"status": {"loadBalancer": {"ingress": ingress}}}))
                .unwrap()
        };
        let pending = service(json!([]));
        assert_eq!(
            derive(&lb, Some(&pending)).unwrap().sans,
            ["foo", "10.0.0.9"]
        );
        let ip = service(json!([{"ip": "203.0.113.7", "hostname": "lb.example.com"}]));
        assert!(
            derive(&lb, Some(&ip))
                .unwrap()
                .sans
                .contains(&"203.0.113.7".into())
        );
        let named = service(json!([{"hostname": "lb.example.com"}]));
        assert!(
            derive(&lb, Some(&named))
                .unwrap()
                .sans
                .contains(&"lb.example.com".into())
        );
    }

    #[test]
    fn an_unusable_configuration_is_a_reason_not_a_target() {
        let mut spec = base(json!({"type": "PortForward", "port": 8091}));
        spec["authentication"]["dump"] = json!({"secrets": {"signingProxyServerSecretName": "same", "signingAgentServerSecretName": "same"}});
        let err = derive(&mpc(spec), None).unwrap_err();
        assert!(err.contains("both \"same\""), "{err}");
        let mut spec = base(json!({"type": "PortForward", "port": 8091}));
        spec["proxyServer"]["namespace"] = json!("Not_A_Namespace");
        let err = derive(&mpc(spec), None).unwrap_err();
        assert!(err.contains("spec.proxyServer.namespace"), "{err}");
    }

    #[test]
    fn conditions_keep_their_transition_time_and_unchanged_ones_are_not_rewritten() {
        let t0 = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let later = t0 + time::Duration::hours(1);
        let wanted = unsigned_conditions("waiting");
        let first = merge_conditions(&[], &wanted, Some(1), t0).unwrap();
        assert_eq!(first.len(), 3);
        assert_eq!(merge_conditions(&first, &wanted, Some(1), later), None);
        // Same status, new message: rewritten, transition time kept.
        let reworded = unsigned_conditions("still waiting");
        let second = merge_conditions(&first, &reworded, Some(1), later).unwrap();
        assert_eq!(
            second[0].last_transition_time,
            first[0].last_transition_time
        );
        // A new status: a new transition time.
        let mut signed = reworded.clone();
        signed[0].status = CONDITION_TRUE;
        signed[0].reason = REASON_SUCCESSFULLY_SIGNED;
        let third = merge_conditions(&second, &signed, Some(1), later).unwrap();
        assert_ne!(third[0].last_transition_time, first[0].last_transition_time);
        assert_eq!(third[1].last_transition_time, first[1].last_transition_time);
    }
}

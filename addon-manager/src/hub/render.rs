//! Pure rendering: a `ManagedProxyConfiguration` in, the hub objects that
//! run its proxy-servers out. No I/O, so every name, label and argument is
//! checked by unit tests without an API server.

use super::telemetry::ProxyServerTelemetry;
use super::tls_profile::{ANNOTATION_TLS_CONFIG_HASH, TlsProfile};
use std::collections::BTreeMap;

use crate::apply::owner_reference;
use cluster_proxy_proto::api::proxy::v1alpha1::{
    ANNOTATION_CONFIGURATION_GENERATION, COMPONENT_PROXY_SERVER, DeployPorts, EntrypointType,
    LABEL_COMPONENT_NAME, ManagedProxyConfiguration, PROXY_SERVER_CA_SECRET_NAME,
    validation::is_qualified_name,
};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Namespace,
    ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SeccompProfile,
    SecretVolumeSource, SecurityContext, Service, ServiceAccount, ServicePort, ServiceSpec, Volume,
    VolumeMount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Label every object addon-manager renders carries.
pub const LABEL_ADDON: &str = "open-cluster-management.io/addon";
/// [`LABEL_ADDON`]'s value.
pub const ADDON_NAME: &str = "cluster-proxy";
/// The proxy-servers' ServiceAccount (upstream's name).
pub const SERVICE_ACCOUNT_NAME: &str = "cluster-proxy";
/// The proxy-server container.
pub const CONTAINER_NAME: &str = "proxy-server";
/// Role and RoleBinding that let addon-agents port-forward to proxy-server
/// pods (entrypoint `PortForward`).
pub const PORT_FORWARD_RBAC_NAME: &str = "cluster-proxy-addon-agent:portforward";
/// The group OCM puts every cluster-proxy addon-agent in.
pub const ADDON_AGENT_GROUP: &str = "open-cluster-management:cluster-proxy";
/// Environment variable the proxy-server reads its server id from; the
/// Deployment fills it with the pod name through the downward API.
pub const SERVER_ID_ENV: &str = "PROXY_SERVER_ID";
/// Where the CA certificate (`ca.crt` of [`PROXY_SERVER_CA_SECRET_NAME`]) is mounted.
pub const SERVER_CA_MOUNT: &str = "/etc/server-ca-pki";
/// Where the client-port serving certificate is mounted.
pub const SERVER_PKI_MOUNT: &str = "/etc/server-pki";
/// Where the agent-port serving certificate is mounted.
pub const AGENT_PKI_MOUNT: &str = "/etc/agent-pki";
/// The headless Service over every proxy-server pod, ready or not, that
/// the replicas resolve to count themselves (`--server-count-source`).
pub const PEER_SERVICE_NAME: &str = "proxy-server-peers";
/// The distroless `nonroot` user the image runs as.
pub const NON_ROOT_UID: i64 = 65532;

/// Port names of the proxy-server container and its Services.
pub const PORT_NAME_PROXY_SERVER: &str = "proxy-server";
/// See [`PORT_NAME_PROXY_SERVER`].
pub const PORT_NAME_AGENT_SERVER: &str = "agent-server";
/// See [`PORT_NAME_PROXY_SERVER`].
pub const PORT_NAME_HEALTH: &str = "health";
/// See [`PORT_NAME_PROXY_SERVER`].
pub const PORT_NAME_ADMIN: &str = "admin";

/// Why a configuration cannot be rendered. The controller validates the spec
/// first ([`ManagedProxyConfigurationSpec::validate`]), so these only guard
/// against an object the API server would not have handed out.
///
/// [`ManagedProxyConfigurationSpec::validate`]: cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfigurationSpec::validate
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("the ManagedProxyConfiguration has no metadata.name")]
    Unnamed,
    #[error(
        "the ManagedProxyConfiguration has no metadata.uid (it was not read from the API server)"
    )]
    NoUid,
}

pub use cluster_proxy_proto::api::proxy::v1alpha1::{EntrypointError, PORT_FORWARD_HOST};

/// Everything the hub runs for one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct HubObjects {
    /// The proxy-server namespace (not owned by the MPC: see [`render`]).
    pub namespace: Namespace,
    pub service_account: ServiceAccount,
    pub deployment: Deployment,
    /// ClusterIP Service hub clients dial.
    pub in_cluster_service: Service,
    /// Headless Service the replicas count each other by
    /// ([`PEER_SERVICE_NAME`]).
    pub peer_service: Service,
    /// Only for the `LoadBalancerService` entrypoint.
    pub load_balancer_service: Option<Service>,
    /// Only for the `PortForward` entrypoint.
    pub port_forward_role: Option<Role>,
    /// Only for the `PortForward` entrypoint.
    pub port_forward_role_binding: Option<RoleBinding>,
}

/// The ports the proxy-servers listen on: `spec.deploy.ports`, else the defaults.
pub fn ports(mpc: &ManagedProxyConfiguration) -> DeployPorts {
    mpc.spec
        .deploy
        .as_ref()
        .map(|deploy| deploy.ports.clone())
        .unwrap_or_default()
}

/// The proxy-server namespace.
pub fn namespace_of(mpc: &ManagedProxyConfiguration) -> &str {
    &mpc.spec.proxy_server.namespace
}

/// The LoadBalancer Service's name when the entrypoint is
/// `LoadBalancerService` (the default name when `loadBalancerService` is unset).
pub fn load_balancer_service_name(mpc: &ManagedProxyConfiguration) -> Option<String> {
    mpc.load_balancer_service().map(|(_, name)| name)
}

/// Labels of every rendered object.
pub fn common_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(LABEL_ADDON.to_owned(), ADDON_NAME.to_owned())])
}

/// The selector of proxy-server pods (Deployment and Services). Only the
/// component label, as upstream, so a Deployment upstream created keeps its
/// (immutable) selector when we take it over.
pub fn pod_selector() -> BTreeMap<String, String> {
    BTreeMap::from([(
        LABEL_COMPONENT_NAME.to_owned(),
        COMPONENT_PROXY_SERVER.to_owned(),
    )])
}

/// Renders the hub objects of `mpc`. The MPC must come from the API server
/// (it needs a name and uid for the owner references).
///
/// The Namespace carries no owner reference, unlike every other object: it
/// may be the namespace addon-manager itself, the CA Secret and the
/// user-server run in (the chart puts them together), and garbage collection
/// of an owned Namespace would delete all of them with the MPC.
pub fn render(mpc: &ManagedProxyConfiguration) -> Result<HubObjects, RenderError> {
    render_with(mpc, &HubRenderOptions::default())
}

/// What besides the MPC shapes the proxy-servers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HubRenderOptions {
    /// OCM's TLS profile: `--tls-min-version`, `--cipher-suites` and the pod
    /// template annotation [`ANNOTATION_TLS_CONFIG_HASH`], so a change of
    /// profile rolls them.
    pub tls_profile: TlsProfile,
    /// The container's `imagePullPolicy` (addon-manager's
    /// `--image-pull-policy`); `None`: Kubernetes' default.
    pub image_pull_policy: Option<String>,
    /// The proxy-servers' trace export (addon-manager's
    /// `--proxy-server-otlp-*`): `OTEL_*` variables, the collector's CA
    /// volume and the pod template annotation
    /// [`super::telemetry::ANNOTATION_OTLP_CONFIG_HASH`], so a change rolls
    /// them. Off by default: nothing is rendered.
    pub telemetry: ProxyServerTelemetry,
}

/// [`render`] with `options`.
pub fn render_with(
    mpc: &ManagedProxyConfiguration,
    options: &HubRenderOptions,
) -> Result<HubObjects, RenderError> {
    let tls = &options.tls_profile;
    let name = mpc.metadata.name.clone().ok_or(RenderError::Unnamed)?;
    let owner = owner_reference(mpc).ok_or(RenderError::NoUid)?;
    let namespace = namespace_of(mpc).to_owned();
    let generation = mpc.metadata.generation.unwrap_or_default().to_string();
    let ports = ports(mpc);

    let meta = |object_name: &str| ObjectMeta {
        name: Some(object_name.to_owned()),
        namespace: Some(namespace.clone()),
        labels: Some(common_labels()),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    };

    let namespace_object = Namespace {
        metadata: ObjectMeta {
            name: Some(namespace.clone()),
            labels: Some(common_labels()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };

    let service_account = ServiceAccount {
        metadata: meta(SERVICE_ACCOUNT_NAME),
        ..ServiceAccount::default()
    };

    let generation_annotation = BTreeMap::from([(
        ANNOTATION_CONFIGURATION_GENERATION.to_owned(),
        generation.clone(),
    )]);
    let mut pod_labels = common_labels();
    pod_labels.extend(pod_selector());
    let deployment = Deployment {
        metadata: ObjectMeta {
            annotations: Some(generation_annotation),
            ..meta(&name)
        },
        spec: Some(DeploymentSpec {
            replicas: Some(mpc.spec.proxy_server.replicas),
            selector: LabelSelector {
                match_labels: Some(pod_selector()),
                ..LabelSelector::default()
            },
            // Upstream recreates; ours roll one pod at a time: a draining
            // proxy-server stops accepting, sends DRAIN to its agents and
            // serves the connections it already has, so agents move to the
            // other replicas without dropping tunnels.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_unavailable: Some(IntOrString::Int(1)),
                    max_surge: Some(IntOrString::Int(1)),
                }),
            }),
            template: PodTemplateSpec {
                // No generation annotation here: a change of the MPC that
                // leaves the pods alone, such as `replicas`, must not roll
                // them (the replicas count each other, see `peer_service`).
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: pod_annotations(tls, &options.telemetry, &namespace),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod_spec(mpc, &ports, options)),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    };

    let in_cluster_service = Service {
        metadata: meta(&mpc.spec.proxy_server.in_cluster_service_name),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            selector: Some(pod_selector()),
            ports: Some(vec![
                service_port(
                    PORT_NAME_PROXY_SERVER,
                    ports.proxy_server,
                    ports.proxy_server,
                ),
                service_port(
                    PORT_NAME_AGENT_SERVER,
                    ports.agent_server,
                    ports.agent_server,
                ),
            ]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };

    // Ready or not: a new replica is ready only once agents hold it, and
    // agents look for it only once the replicas count it.
    let peer_service = Service {
        metadata: meta(PEER_SERVICE_NAME),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            publish_not_ready_addresses: Some(true),
            selector: Some(pod_selector()),
            ports: Some(vec![service_port(
                PORT_NAME_AGENT_SERVER,
                ports.agent_server,
                ports.agent_server,
            )]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };

    let entrypoint = mpc.spec.proxy_server.entrypoint.as_ref();
    let entrypoint_type = entrypoint.map(|entrypoint| entrypoint.type_);

    let load_balancer_service = load_balancer_service_name(mpc).map(|service_name| {
        let annotations = valid_load_balancer_annotations(mpc);
        let agent_port = entrypoint.map_or(ports.agent_server, |entrypoint| entrypoint.port);
        Service {
            metadata: ObjectMeta {
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..meta(&service_name)
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".to_owned()),
                // Agents must reach a replica before it is ready: it is
                // ready only once they do.
                publish_not_ready_addresses: Some(true),
                selector: Some(pod_selector()),
                ports: Some(vec![
                    service_port(
                        PORT_NAME_PROXY_SERVER,
                        ports.proxy_server,
                        ports.proxy_server,
                    ),
                    service_port(PORT_NAME_AGENT_SERVER, agent_port, ports.agent_server),
                ]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        }
    });

    let port_forward = entrypoint_type == Some(EntrypointType::PortForward);
    let port_forward_role = port_forward.then(|| Role {
        metadata: meta(PORT_FORWARD_RBAC_NAME),
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods".to_owned()]),
                verbs: vec!["get".to_owned(), "list".to_owned()],
                ..PolicyRule::default()
            },
            // A WebSocket port-forward (kube-rs, client-go since 1.31) is
            // a GET: authorized as `get`, and since Kubernetes 1.35 also
            // as `create` (AuthorizePodWebsocketUpgradeCreatePermission),
            // the verb SPDY's POST needs. Upstream grants only `create`.
            PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods/portforward".to_owned()]),
                verbs: vec!["get".to_owned(), "create".to_owned()],
                ..PolicyRule::default()
            },
        ]),
    });
    let port_forward_role_binding = port_forward.then(|| RoleBinding {
        metadata: meta(PORT_FORWARD_RBAC_NAME),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".to_owned(),
            kind: "Role".to_owned(),
            name: PORT_FORWARD_RBAC_NAME.to_owned(),
        },
        // Upstream's group, and the one every addon-agent's hub identity
        // is in here (its per-cluster registration subject has no
        // `open-cluster-management:cluster-proxy`).
        subjects: Some(
            [ADDON_AGENT_GROUP, crate::addon::render::ADDON_AGENTS_GROUP]
                .into_iter()
                .map(|group| Subject {
                    api_group: Some("rbac.authorization.k8s.io".to_owned()),
                    kind: "Group".to_owned(),
                    name: group.to_owned(),
                    namespace: None,
                })
                .collect(),
        ),
    });

    Ok(HubObjects {
        namespace: namespace_object,
        service_account,
        deployment,
        in_cluster_service,
        peer_service,
        load_balancer_service,
        port_forward_role,
        port_forward_role_binding,
    })
}

/// The pod template annotations that change with settings from outside the
/// MPC (the TLS profile, the OTLP export), so that a change rolls the
/// replicas; none when neither is set, so the template stays as it was.
fn pod_annotations(
    tls: &TlsProfile,
    telemetry: &ProxyServerTelemetry,
    namespace: &str,
) -> Option<BTreeMap<String, String>> {
    let mut annotations = telemetry.annotations(namespace);
    if !tls.is_empty() {
        annotations.insert(ANNOTATION_TLS_CONFIG_HASH.to_owned(), tls.hash());
    }
    (!annotations.is_empty()).then_some(annotations)
}

/// The LoadBalancer Service annotations whose keys are qualified names.
/// Upstream's check is inverted and keeps only the invalid ones (§11);
/// invalid keys are reported by validation, never sent to the API server.
pub fn valid_load_balancer_annotations(
    mpc: &ManagedProxyConfiguration,
) -> BTreeMap<String, String> {
    mpc.spec
        .proxy_server
        .entrypoint
        .as_ref()
        .and_then(|entrypoint| entrypoint.load_balancer_service.as_ref())
        .map(|service| {
            service
                .annotations
                .iter()
                .filter(|annotation| is_qualified_name(&annotation.key))
                .map(|annotation| (annotation.key.clone(), annotation.value.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// The proxy-server arguments: the fixed ones, the ports when
/// `spec.deploy.ports` is set, the TLS profile's flags, then `additionalArgs`
/// in their order (last, so a user's flag overrides ours).
///
/// The replicas count each other through the headless [`PEER_SERVICE_NAME`]
/// Service rather than a `--server-count` flag, so scaling needs no change of
/// the pod template and so no restart; `additionalArgs` may still set
/// `--server-count-source=static --server-count=N`.
pub fn proxy_server_args(mpc: &ManagedProxyConfiguration, tls: &TlsProfile) -> Vec<String> {
    let mut args = vec![
        format!(
            "--server-count-source=dns:{PEER_SERVICE_NAME}.{}.svc",
            namespace_of(mpc)
        ),
        "--proxy-strategies=destHost".to_owned(),
        format!("--server-ca-cert={SERVER_CA_MOUNT}/ca.crt"),
        format!("--server-cert={SERVER_PKI_MOUNT}/tls.crt"),
        format!("--server-key={SERVER_PKI_MOUNT}/tls.key"),
        format!("--cluster-ca-cert={SERVER_CA_MOUNT}/ca.crt"),
        format!("--cluster-cert={AGENT_PKI_MOUNT}/tls.crt"),
        format!("--cluster-key={AGENT_PKI_MOUNT}/tls.key"),
    ];
    if let Some(deploy) = &mpc.spec.deploy {
        let ports = &deploy.ports;
        args.extend([
            format!("--server-port={}", ports.proxy_server),
            format!("--agent-port={}", ports.agent_server),
            format!("--health-port={}", ports.health_server),
            format!("--admin-port={}", ports.admin_server),
        ]);
    }
    args.extend(tls.args());
    args.extend(mpc.spec.proxy_server.additional_args.iter().cloned());
    args
}

fn pod_spec(
    mpc: &ManagedProxyConfiguration,
    ports: &DeployPorts,
    options: &HubRenderOptions,
) -> PodSpec {
    let secrets = &mpc.spec.authentication.dump.secrets;
    let placement = &mpc.spec.proxy_server.node_placement;
    let health_probe = |path: &str| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String(PORT_NAME_HEALTH.to_owned()),
            scheme: Some("HTTP".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(10),
        failure_threshold: Some(3),
        ..Probe::default()
    };
    let container = Container {
        name: CONTAINER_NAME.to_owned(),
        image: Some(mpc.spec.proxy_server.image.clone()),
        command: Some(vec!["/proxy-server".to_owned()]),
        image_pull_policy: options.image_pull_policy.clone(),
        args: Some(proxy_server_args(mpc, &options.tls_profile)),
        // The server id first: the OTLP resource attributes name it.
        env: Some(
            std::iter::once(EnvVar {
                name: SERVER_ID_ENV.to_owned(),
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.name".to_owned(),
                        ..ObjectFieldSelector::default()
                    }),
                    ..EnvVarSource::default()
                }),
                ..EnvVar::default()
            })
            .chain(options.telemetry.env(namespace_of(mpc), SERVER_ID_ENV))
            .collect(),
        ),
        ports: Some(vec![
            container_port(PORT_NAME_PROXY_SERVER, ports.proxy_server),
            container_port(PORT_NAME_AGENT_SERVER, ports.agent_server),
            container_port(PORT_NAME_HEALTH, ports.health_server),
            container_port(PORT_NAME_ADMIN, ports.admin_server),
        ]),
        // `/readyz` passes once this replica holds as many agents as the
        // others (or `--readiness-agent-wait` passed), so clients reach a
        // new replica only once their clusters' agents do; agents reach it
        // before, through the agent entrypoint's not-ready addresses.
        // Probed often: a caught-up replica should not wait 10 s to serve.
        readiness_probe: Some(Probe {
            period_seconds: Some(2),
            ..health_probe("/readyz")
        }),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(10),
            ..health_probe("/healthz")
        }),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(NON_ROOT_UID),
            run_as_group: Some(NON_ROOT_UID),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(
            [
                read_only_mount("server-ca-pki", SERVER_CA_MOUNT),
                read_only_mount("server-pki", SERVER_PKI_MOUNT),
                read_only_mount("agent-pki", AGENT_PKI_MOUNT),
            ]
            .into_iter()
            .chain(options.telemetry.volume_mount())
            .collect(),
        ),
        resources: mpc.spec.proxy_server.resources.clone(),
        ..Container::default()
    };
    PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT_NAME.to_owned()),
        containers: vec![container],
        volumes: Some(
            [
                secret_volume("server-ca-pki", PROXY_SERVER_CA_SECRET_NAME),
                secret_volume("server-pki", &secrets.signing_proxy_server_secret_name),
                secret_volume("agent-pki", &secrets.signing_agent_server_secret_name),
            ]
            .into_iter()
            .chain(options.telemetry.volume())
            .collect(),
        ),
        node_selector: (!placement.node_selector.is_empty())
            .then(|| placement.node_selector.clone()),
        tolerations: (!placement.tolerations.is_empty()).then(|| placement.tolerations.clone()),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        ..PodSpec::default()
    }
}

fn container_port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_owned()),
        container_port: port,
        protocol: Some("TCP".to_owned()),
        ..ContainerPort::default()
    }
}

fn service_port(name: &str, port: i32, target_port: i32) -> ServicePort {
    ServicePort {
        name: Some(name.to_owned()),
        port,
        target_port: Some(IntOrString::Int(target_port)),
        protocol: Some("TCP".to_owned()),
        ..ServicePort::default()
    }
}

fn read_only_mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

fn secret_volume(name: &str, secret_name: &str) -> Volume {
    Volume {
        name: name.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret_name.to_owned()),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The address agents dial, as `(host, port)`
/// ([`ManagedProxyConfiguration::agent_entrypoint`]); `Ok(None)` while a
/// `LoadBalancerService` entrypoint's Service has no address yet.
pub fn entrypoint_address(
    mpc: &ManagedProxyConfiguration,
    load_balancer_service: Option<&Service>,
) -> Result<Option<(String, u16)>, EntrypointError> {
    match mpc.agent_entrypoint(load_balancer_service) {
        Ok(address) => Ok(Some(address)),
        Err(error) if error.is_pending() => Ok(None),
        Err(error) => Err(error),
    }
}

/// The first ingress address a LoadBalancer Service publishes: its IP, else its hostname.
pub fn load_balancer_host(service: &Service) -> Option<String> {
    cluster_proxy_proto::api::proxy::v1alpha1::load_balancer_address(service)
}

//! Pure rendering: what the addon controller writes for one managed cluster,
//! computed from its inputs without touching the API. Every name, label and
//! argument here is part of a contract with OCM (upstream object names) or
//! with the local environment, which starts the agents from these fields.

use std::collections::BTreeMap;

use base64::Engine;
use cluster_proxy_egress::ProxyUrl;
use cluster_proxy_proto::api::addon::v1alpha1::{
    ANNOTATION_DELETION_ORPHAN, AddOnDeploymentConfig, LABEL_ADDON_NAME, LABEL_ADDON_NAMESPACE,
    ManagedClusterAddOn, RegistrationConfig, Subject,
};
use cluster_proxy_proto::api::proxy::v1alpha1::{
    ANNOTATION_CONFIGURATION_GENERATION, COMPONENT_PROXY_AGENT, EntrypointType,
    LABEL_COMPONENT_NAME, ManagedProxyConfiguration,
};
use cluster_proxy_proto::api::work::v1::{
    DeleteOption, Manifest, ManifestError, ManifestWork, ManifestWorkSpec, ManifestsTemplate,
    PROPAGATION_FOREGROUND, PROPAGATION_SELECTIVELY_ORPHAN, ResourceIdentifier, SelectivelyOrphan,
};
use cluster_proxy_proto::identity::ClusterName;
use cluster_proxy_proto::service_access::SERVICE_PROXY_SUBCOMMAND;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, EnvVarSource, HTTPGetAction, HostAlias, LocalObjectReference,
    Namespace, ObjectFieldSelector, PodSpec, PodTemplateSpec, Probe, SecretVolumeSource,
    SecurityContext, Service, ServiceAccount, ServiceSpec, Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject as RbacSubject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

use super::customize::AgentCustomization;
use super::names::{
    ADDON_NAME, AGENT_CA_SECRET, AGENT_CLIENT_CERT_SECRET, AGENT_DEPLOYMENT, AGENT_RBAC_NAME,
    AGENT_SERVICE_ACCOUNT, HUB_KUBECONFIG_SECRET, MANIFEST_WORK_NAME,
};

/// Signer of the proxy-agent's client certificate (upstream F15).
pub const PROXY_AGENT_SIGNER: &str = "open-cluster-management.io/proxy-agent-signer";
/// Signer of the addon-agent's hub kubeconfig certificate.
pub const KUBE_APISERVER_CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";
/// Subject user of the proxy-agent's certificate.
pub const PROXY_AGENT_USER: &str = "open-cluster-management:cluster-proxy:proxy-agent";
/// The group every addon-agent's hub identity is in (the addon
/// framework's addon-wide group).
pub const ADDON_AGENTS_GROUP: &str = "system:open-cluster-management:addon:cluster-proxy";
/// Group of both agent identities.
pub const CLUSTER_PROXY_GROUP: &str = "open-cluster-management:cluster-proxy";
/// Label naming the addon on the agent's pods (upstream's selector).
pub const LABEL_ADDON: &str = "open-cluster-management.io/addon";
/// Pod annotation that lets OpenShift's workload partitioning place the agent.
pub const ANNOTATION_WORKLOAD_MANAGEMENT: &str = "target.workload.openshift.io/management";
/// ADC customized variable naming the managed cluster's service DNS domain.
pub const VARIABLE_SERVICE_DOMAIN: &str = "serviceDomain";
/// The service DNS domain when the ADC names none.
pub const DEFAULT_SERVICE_DOMAIN: &str = "svc.cluster.local";
/// The proxy-agent's health port (konnectivity default).
pub const AGENT_HEALTH_PORT: i32 = 8093;
/// The tunnel container of the agent Deployment (the name in an ADC's
/// `deployments:cluster-proxy-proxy-agent:proxy-agent`).
pub const PROXY_AGENT_CONTAINER: &str = "proxy-agent";
/// The Lease-renewing container of the agent Deployment.
pub const ADDON_AGENT_CONTAINER: &str = "addon-agent";
/// Where the agents run as a non-root user (distroless `nonroot`).
const NON_ROOT_UID: i64 = 65532;
/// The service-proxy container (`--enable-service-proxy`), run as
/// `/proxy-agent service-proxy` from the agent image.
pub const SERVICE_PROXY_CONTAINER: &str = "service-proxy";
/// Upstream's managed-side copy of the hub's service-proxy certificate.
pub const SERVICE_PROXY_CERT_SECRET: &str = "cluster-proxy-service-proxy-server-certificates";
/// The service-proxy's health port (`/healthz`, `/readyz`), upstream's.
pub const SERVICE_PROXY_HEALTH_PORT: i32 = 8000;
/// Upstream's ClusterRole letting the agent's ServiceAccount impersonate
/// hub users and groups.
pub const IMPERSONATOR: &str = "cluster-proxy-addon-agent-impersonator";
/// The AddOnDeploymentConfig variable that turns impersonation off for a
/// cluster (upstream's; a Go boolean, default `true`).
pub const VARIABLE_ENABLE_IMPERSONATION: &str = "enableImpersonation";

/// The service-proxy beside the agent: what it is rendered from.
#[derive(Debug, Clone, Copy)]
pub struct ServiceProxyInputs<'a> {
    /// The hub's service-proxy serving certificate and key (PEM), from
    /// cert-authority's `cluster-proxy-service-proxy-server-cert`.
    pub cert_pem: &'a [u8],
    pub key_pem: &'a [u8],
}

/// Whether the service-proxy of a cluster with `deployment_config`
/// impersonates hub users (`enableImpersonation`, default true); a value
/// that is no Go boolean is an error naming it.
pub fn impersonation(deployment_config: Option<&AddOnDeploymentConfig>) -> Result<bool, String> {
    match deployment_config.and_then(|adc| adc.variable(VARIABLE_ENABLE_IMPERSONATION)) {
        None | Some("") => Ok(true),
        Some(value) => cluster_proxy_runtime::cli::parse_go_bool(value).map_err(|_| {
            format!(
                "customizedVariables {VARIABLE_ENABLE_IMPERSONATION}={value:?} is not a boolean"
            )
        }),
    }
}

/// `customizedVariables` name that picks a cluster's tunnel transport:
/// `websocket` (the proxy-agent's `--transport=websocket`, for networks
/// whose middleboxes break HTTP/2) or `auto` (the default).
pub const VARIABLE_AGENT_TRANSPORT: &str = "agentTransport";

/// The proxy-agent's `--transport` for a cluster with `deployment_config`:
/// `None` for the default; a value that is no transport is an error naming it.
pub fn agent_transport(
    deployment_config: Option<&AddOnDeploymentConfig>,
) -> Result<Option<&'static str>, String> {
    match deployment_config.and_then(|adc| adc.variable(VARIABLE_AGENT_TRANSPORT)) {
        None | Some("") | Some("auto") => Ok(None),
        Some("websocket") => Ok(Some("websocket")),
        Some(value) => Err(format!(
            "customizedVariables {VARIABLE_AGENT_TRANSPORT}={value:?} is not a transport (auto or websocket)"
        )),
    }
}

/// `customizedVariables` name of a cluster's own OTLP/gRPC collector (a URL
/// the agent reaches inside its network, e.g.
/// `http://otel-collector.observability:4317`): the proxy-agent's
/// `--otlp-endpoint`. Without one the agent sends its spans home through its
/// tunnel ([`VARIABLE_TRACE_RELAY`]); the hub's collector is never rendered
/// here, as a hub Service name does not resolve on a managed cluster.
pub const VARIABLE_OTLP_ENDPOINT: &str = "otlpEndpoint";
/// `customizedVariables` name of the proxy-agent's sampler
/// (`--otel-traces-sampler`: `parentbased_always_on`, `traceidratio`, ...).
pub const VARIABLE_OTLP_SAMPLER: &str = "otlpSampler";
/// `customizedVariables` name of the sampler's ratio
/// (`--otel-traces-sampler-arg`, 0 to 1).
pub const VARIABLE_OTLP_SAMPLER_ARG: &str = "otlpSamplerArg";
/// `customizedVariables` name that lets a cluster keep its spans off its
/// tunnel: `off` renders the proxy-agent's `--trace-relay=off`; `auto` (the
/// default) leaves the agent's own choice (relay when it has no collector).
pub const VARIABLE_TRACE_RELAY: &str = "traceRelay";

/// A cluster's tracing settings from its AddOnDeploymentConfig, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentTelemetry {
    pub endpoint: Option<String>,
    pub sampler: Option<String>,
    pub sampler_arg: Option<String>,
    /// `--trace-relay=off`.
    pub relay_off: bool,
}

impl AgentTelemetry {
    /// The proxy-agent flags, in a fixed order. Flags rather than `OTEL_*`
    /// variables: they come after `spec.proxyAgent.additionalArgs`, so the
    /// cluster's choice wins over the fleet's (a flag given twice keeps its
    /// last value), where a variable would lose to any flag there.
    pub fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(endpoint) = &self.endpoint {
            args.push(format!("--otlp-endpoint={endpoint}"));
        }
        if let Some(sampler) = &self.sampler {
            args.push(format!("--otel-traces-sampler={sampler}"));
        }
        if let Some(arg) = &self.sampler_arg {
            args.push(format!("--otel-traces-sampler-arg={arg}"));
        }
        if self.relay_off {
            args.push("--trace-relay=off".to_owned());
        }
        args
    }

    /// The TCP port of the cluster's collector, which the agent's
    /// NetworkPolicy lets out.
    pub fn collector_port(&self) -> Option<i32> {
        let uri: http::Uri = self.endpoint.as_deref()?.parse().ok()?;
        let default = if uri.scheme_str() == Some("https") {
            443
        } else {
            80
        };
        Some(uri.port_u16().map_or(default, i32::from))
    }
}

/// The tracing variables of a cluster with `deployment_config`
/// ([`VARIABLE_OTLP_ENDPOINT`], [`VARIABLE_OTLP_SAMPLER`],
/// [`VARIABLE_OTLP_SAMPLER_ARG`], [`VARIABLE_TRACE_RELAY`]); empty values
/// count as unset. They are checked with the agent's own parser, so what
/// the agent would refuse at start-up is refused here instead, naming the
/// variable, and never reaches the cluster.
pub fn agent_telemetry(
    deployment_config: Option<&AddOnDeploymentConfig>,
) -> Result<AgentTelemetry, String> {
    let variable = |name: &str| {
        deployment_config
            .and_then(|adc| adc.variable(name))
            .map(str::trim)
            .filter(|value| !value.is_empty())
            .map(str::to_owned)
    };
    let telemetry = AgentTelemetry {
        endpoint: variable(VARIABLE_OTLP_ENDPOINT),
        sampler: variable(VARIABLE_OTLP_SAMPLER),
        sampler_arg: variable(VARIABLE_OTLP_SAMPLER_ARG),
        relay_off: match variable(VARIABLE_TRACE_RELAY).as_deref() {
            None | Some("auto") => false,
            Some("off") => true,
            Some(value) => {
                return Err(format!(
                    "customizedVariables {VARIABLE_TRACE_RELAY}={value:?} is not auto or off"
                ));
            }
        },
    };
    let flags = cluster_proxy_runtime::telemetry::TelemetryFlags {
        otlp_endpoint: telemetry.endpoint.clone(),
        otel_traces_sampler: telemetry.sampler.clone(),
        otel_traces_sampler_arg: telemetry.sampler_arg.clone(),
        ..Default::default()
    };
    if telemetry
        .endpoint
        .as_deref()
        .is_some_and(|endpoint| endpoint.starts_with("https://"))
    {
        // The agent verifies an https collector only against a CA it is
        // given, and a variable cannot carry one: it would not start.
        return Err(format!(
            "customizedVariables {VARIABLE_OTLP_ENDPOINT}={:?}: an https collector needs a CA \
             bundle the agent cannot be given through an AddOnDeploymentConfig; use an http:// \
             collector inside the cluster, or none (spans then go home through the tunnel)",
            telemetry.endpoint.as_deref().unwrap_or_default()
        ));
    }
    if let Err(problem) = flags.to_config("proxy-agent") {
        use cluster_proxy_runtime::telemetry::TelemetryError as E;
        let (name, value) = match &problem {
            E::Sampler(_) => (VARIABLE_OTLP_SAMPLER, &telemetry.sampler),
            E::SamplerArg(_) => (VARIABLE_OTLP_SAMPLER_ARG, &telemetry.sampler_arg),
            _ => (VARIABLE_OTLP_ENDPOINT, &telemetry.endpoint),
        };
        return Err(format!(
            "customizedVariables {name}={:?}: {problem}",
            value.as_deref().unwrap_or_default()
        ));
    }
    Ok(telemetry)
}

/// Where the agent dials the proxy-servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entrypoint {
    pub host: String,
    pub port: i32,
}

pub use cluster_proxy_proto::api::proxy::v1alpha1::EntrypointError;

/// The load balancer Service an MPC's entrypoint names, if its type is
/// `LoadBalancerService`: `(namespace, name)`.
pub fn load_balancer_service(mpc: &ManagedProxyConfiguration) -> Option<(String, String)> {
    mpc.load_balancer_service()
}

/// The address agents dial ([`ManagedProxyConfiguration::agent_entrypoint`]:
/// the hostname, the load balancer's first ingress, or loopback for
/// `PortForward`; port 0 means 8091).
pub fn entrypoint(
    mpc: &ManagedProxyConfiguration,
    load_balancer: Option<&Service>,
) -> Result<Entrypoint, EntrypointError> {
    let (host, port) = mpc.agent_entrypoint(load_balancer)?;
    Ok(Entrypoint {
        host,
        port: i32::from(port),
    })
}

/// The organizational unit that ties agent certificates to one CA:
/// `signer-` + hex of the ASCII of base64(sha256(CA PEM)), exactly as
/// upstream (§11.6), so a CA rollover changes the requested subject and the
/// klusterlet asks for a new certificate.
pub fn signer_organization_unit(ca_pem: &[u8]) -> String {
    let digest = Sha256::digest(ca_pem);
    let encoded = base64::engine::general_purpose::STANDARD.encode(digest);
    format!("signer-{}", hex::encode(encoded.as_bytes()))
}

/// The credentials the klusterlet of `cluster` requests for the agents:
/// the proxy-agent's client certificate from our signer and the
/// addon-agent's hub kubeconfig.
///
/// The hub kubeconfig's subject is per cluster (the addon framework's
/// default, `system:open-cluster-management:cluster:<c>:addon:cluster-proxy:agent:…`),
/// not upstream's shared `open-cluster-management:cluster-proxy:addon-agent`:
/// with a shared user, the Role binding in every cluster namespace would let
/// any cluster's addon-agent write every other cluster's Lease (and so fake
/// its `Available`).
pub fn registrations(ca_pem: &[u8], cluster: &str) -> Vec<RegistrationConfig> {
    vec![
        RegistrationConfig {
            signer_name: PROXY_AGENT_SIGNER.to_owned(),
            subject: Some(Subject {
                user: Some(PROXY_AGENT_USER.to_owned()),
                groups: Some(vec![CLUSTER_PROXY_GROUP.to_owned()]),
                organization_units: Some(vec![signer_organization_unit(ca_pem)]),
            }),
        },
        RegistrationConfig {
            signer_name: KUBE_APISERVER_CLIENT_SIGNER.to_owned(),
            subject: Some(Subject {
                user: Some(framework_agent_user(cluster)),
                groups: Some(vec![
                    framework_agent_group(cluster),
                    ADDON_AGENTS_GROUP.to_owned(),
                ]),
                organization_units: None,
            }),
        },
    ]
}

/// Whether `name` is a DNS-1035 label (a valid Service name): the cluster's
/// name becomes the ExternalName Service the agent resolves.
pub fn is_dns1035_label(name: &str) -> bool {
    cluster_proxy_proto::identity::is_dns1123_label(name)
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
}

/// Everything the agent's objects are rendered from.
#[derive(Debug, Clone)]
pub struct AgentInputs<'a> {
    pub cluster: &'a ClusterName,
    pub install_namespace: &'a str,
    pub mpc: &'a ManagedProxyConfiguration,
    pub deployment_config: Option<&'a AddOnDeploymentConfig>,
    pub entrypoint: &'a Entrypoint,
    /// The hub CA bundle (PEM) the agent verifies the proxy-servers with.
    pub ca_pem: &'a [u8],
    /// The cluster's image and container resources.
    pub customization: &'a AgentCustomization,
    /// Make the cluster's kube-apiserver reachable by the cluster's name
    /// (`--enable-kube-api-proxy`): the agent identifiers `host=<cluster>`
    /// and `host=<cluster>.<namespace>`, and the ExternalName Service
    /// `<cluster>` they resolve through. Without it the agent answers only
    /// to its service-proxy host.
    pub kube_api_proxy: bool,
    /// Ship [`AGENT_NETWORK_POLICY`] with the agent
    /// (`--enable-network-policies`), letting it reach the kube-apiserver
    /// on these ports (`--agent-kube-apiserver-ports`).
    pub network_policy: Option<&'a [i32]>,
    /// The containers' `imagePullPolicy` (`--image-pull-policy`); `None`:
    /// Kubernetes' default.
    pub image_pull_policy: Option<&'a str>,
    /// The service-proxy (`--enable-service-proxy`, once cert-authority
    /// has issued its certificate); `None`: the agent without it.
    pub service_proxy: Option<ServiceProxyInputs<'a>>,
    /// Whether that service-proxy impersonates hub users (see
    /// [`impersonation`]).
    pub impersonation: bool,
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect()
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        ..ObjectMeta::default()
    }
}

fn agent_labels() -> BTreeMap<String, String> {
    labels(&[
        (LABEL_ADDON, ADDON_NAME),
        (LABEL_COMPONENT_NAME, COMPONENT_PROXY_AGENT),
    ])
}

/// The agent's NetworkPolicy (upstream's name), with `--enable-network-policies`.
pub const AGENT_NETWORK_POLICY: &str = "cluster-proxy-proxy-agent-network-policy";
/// Ports of a kube-apiserver the agent pods may reach with the policy on,
/// unless `--agent-kube-apiserver-ports` says otherwise: the addon-agent
/// renews its Lease there, and a cluster's name leads there.
pub const KUBE_API_SERVER_PORTS: [i32; 2] = [443, 6443];

/// The agent pods' NetworkPolicy: in, only the health port (probes and
/// `/metrics`); out, DNS, `kube_apiserver_ports`, the hub entrypoint's port
/// and the ADC proxies' ports. Upstream's, without the service-proxy ports. Other policies that
/// select the agent pods add to it: NetworkPolicies are unions.
pub fn agent_network_policy(
    namespace: &str,
    entrypoint_port: i32,
    kube_apiserver_ports: &[i32],
    proxy_ports: &[i32],
) -> NetworkPolicy {
    let tcp = |port: i32| NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".into()),
        ..NetworkPolicyPort::default()
    };
    let udp = |port: i32| NetworkPolicyPort {
        protocol: Some("UDP".into()),
        ..tcp(port)
    };
    let mut apiserver_and_hub: Vec<NetworkPolicyPort> =
        kube_apiserver_ports.iter().map(|port| tcp(*port)).collect();
    let mut extra: Vec<i32> = std::iter::once(entrypoint_port)
        .chain(proxy_ports.iter().copied())
        .filter(|port| !kube_apiserver_ports.contains(port))
        .collect();
    extra.sort_unstable();
    extra.dedup();
    apiserver_and_hub.extend(extra.into_iter().map(tcp));
    NetworkPolicy {
        metadata: meta(AGENT_NETWORK_POLICY, Some(namespace)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(agent_labels()),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                ports: Some(vec![tcp(AGENT_HEALTH_PORT)]),
                ..NetworkPolicyIngressRule::default()
            }]),
            egress: Some(vec![
                NetworkPolicyEgressRule {
                    ports: Some(vec![udp(53), tcp(53), udp(5353), tcp(5353)]),
                    ..NetworkPolicyEgressRule::default()
                },
                NetworkPolicyEgressRule {
                    ports: Some(apiserver_and_hub),
                    ..NetworkPolicyEgressRule::default()
                },
            ]),
        }),
    }
}

/// Tolerations upstream's agent chart sets unless the ADC names its own.
pub fn default_tolerations() -> Vec<Toleration> {
    vec![
        Toleration {
            key: Some("dedicated".into()),
            operator: Some("Equal".into()),
            value: Some("infra".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        },
        Toleration {
            key: Some("node-role.kubernetes.io/infra".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        },
    ]
}

/// The service DNS domain of the managed cluster.
pub fn service_domain(deployment_config: Option<&AddOnDeploymentConfig>) -> String {
    deployment_config
        .and_then(|adc| adc.variable(VARIABLE_SERVICE_DOMAIN))
        .filter(|domain| !domain.is_empty())
        .unwrap_or(DEFAULT_SERVICE_DOMAIN)
        .to_owned()
}

/// Key of the ADC proxy's CA bundle in the agent's CA Secret.
pub const PROXY_CA_KEY: &str = "proxy-ca.crt";
/// Where the agent's containers find the CA Secret's keys.
const CA_MOUNT: &str = "/etc/ca";

/// The ADC proxy's CA bundle (`proxyConfig.caBundle`), which the agent's
/// containers get as `--proxy-ca-cert` to verify an `https://` proxy.
/// Upstream appends it to the hub CA the agent trusts, so the proxy's CA
/// could vouch for a forged hub; here it verifies the proxy only.
pub fn proxy_ca_bundle(deployment_config: Option<&AddOnDeploymentConfig>) -> Option<&[u8]> {
    deployment_config
        .and_then(|adc| adc.spec.proxy_config.as_ref())
        .and_then(|proxy| proxy.ca_bundle.as_ref())
        .map(|bundle| bundle.0.as_slice())
        .filter(|bundle| !bundle.is_empty())
}

/// The ports of the ADC's proxies (`httpProxy`, `httpsProxy`): the agent's
/// NetworkPolicy lets them out. A URL that does not parse adds none (the
/// agent refuses it at start-up, naming the variable).
pub fn proxy_ports(deployment_config: Option<&AddOnDeploymentConfig>) -> Vec<i32> {
    let Some(proxy) = deployment_config.and_then(|adc| adc.spec.proxy_config.as_ref()) else {
        return Vec::new();
    };
    let mut ports: Vec<i32> = [
        ("httpProxy", &proxy.http_proxy),
        ("httpsProxy", &proxy.https_proxy),
    ]
    .into_iter()
    .filter_map(|(name, url)| {
        let url = url.as_deref().filter(|url| !url.trim().is_empty())?;
        ProxyUrl::parse(name, url)
            .ok()
            .map(|url| i32::from(url.port))
    })
    .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// The ports besides the hub's and the kube-apiserver's that the agent's
/// NetworkPolicy lets out: the ADC's proxies and the cluster's own OTLP
/// collector.
pub fn egress_ports(deployment_config: Option<&AddOnDeploymentConfig>) -> Vec<i32> {
    let mut ports = proxy_ports(deployment_config);
    ports.extend(
        agent_telemetry(deployment_config)
            .ok()
            .and_then(|telemetry| telemetry.collector_port()),
    );
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// `--proxy-ca-cert` for both agent containers when the ADC gives a bundle.
fn proxy_ca_args(inputs: &AgentInputs<'_>) -> Option<String> {
    proxy_ca_bundle(inputs.deployment_config)
        .map(|_| format!("--proxy-ca-cert={CA_MOUNT}/{PROXY_CA_KEY}"))
}

fn proxy_env(deployment_config: Option<&AddOnDeploymentConfig>) -> Vec<EnvVar> {
    let Some(proxy) = deployment_config.and_then(|adc| adc.spec.proxy_config.as_ref()) else {
        return Vec::new();
    };
    [
        ("HTTP_PROXY", &proxy.http_proxy),
        ("HTTPS_PROXY", &proxy.https_proxy),
        ("NO_PROXY", &proxy.no_proxy),
    ]
    .into_iter()
    .filter_map(|(name, value)| {
        value
            .as_ref()
            .filter(|value| !value.is_empty())
            .map(|value| EnvVar {
                name: name.to_owned(),
                value: Some(value.clone()),
                value_from: None,
            })
    })
    .collect()
}

fn hardened() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NON_ROOT_UID),
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        ..SecurityContext::default()
    }
}

fn http_probe(path: &str, port: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::Int(port),
            ..HTTPGetAction::default()
        }),
        ..Probe::default()
    }
}

fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

fn secret_volume(name: &str, secret: &str) -> Volume {
    Volume {
        name: name.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.to_owned()),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The proxy-agent's arguments, in the fixed order the local environment
/// and upstream's chart use, then `spec.proxyAgent.additionalArgs`.
pub fn proxy_agent_args(inputs: &AgentInputs<'_>) -> Vec<String> {
    let mut identifiers = inputs.cluster.default_identifiers(inputs.install_namespace);
    if !inputs.kube_api_proxy {
        let service_proxy_host = inputs.cluster.service_proxy_host();
        identifiers.hosts.retain(|host| *host == service_proxy_host);
    }
    let identifiers = identifiers.to_query();
    let mut args = vec![
        format!("--proxy-server-host={}", inputs.entrypoint.host),
        format!("--proxy-server-port={}", inputs.entrypoint.port),
        format!("--ca-cert={CA_MOUNT}/ca.crt"),
        "--agent-cert=/etc/tls/tls.crt".to_owned(),
        "--agent-key=/etc/tls/tls.key".to_owned(),
        format!("--agent-identifiers={identifiers}"),
    ];
    args.extend(proxy_ca_args(inputs));
    args.extend(inputs.mpc.spec.proxy_agent.additional_args.iter().cloned());
    // Last: the cluster's own choice wins over the fleet's additionalArgs.
    // The reconciler refuses a value that is no transport before rendering.
    if let Ok(Some(transport)) = agent_transport(inputs.deployment_config) {
        args.push(format!("--transport={transport}"));
    }
    if let Ok(telemetry) = agent_telemetry(inputs.deployment_config) {
        args.extend(telemetry.args());
    }
    args
}

/// The addon-agent's arguments. With the `PortForward` entrypoint it
/// serves the proxy-agent's 127.0.0.1:8091 by port-forwarding to the
/// proxy-server pods of the MPC's namespace, as upstream passes it.
pub fn addon_agent_args(inputs: &AgentInputs<'_>) -> Vec<String> {
    let mut args = vec![
        "--hub-kubeconfig=/etc/kubeconfig/kubeconfig".to_owned(),
        format!("--cluster-name={}", inputs.cluster),
        format!("--lease-name={ADDON_NAME}"),
    ];
    args.extend(proxy_ca_args(inputs));
    let port_forward = inputs
        .mpc
        .spec
        .proxy_server
        .entrypoint
        .as_ref()
        .is_some_and(|entrypoint| entrypoint.type_ == EntrypointType::PortForward);
    if port_forward {
        args.push(format!(
            "--proxy-server-namespace={}",
            inputs.mpc.spec.proxy_server.namespace
        ));
        args.push("--enable-port-forward-proxy=true".to_owned());
        // The proxy-agent dials the entrypoint's port on loopback.
        args.push(format!(
            "--port-forward-proxy-address={}:{}",
            inputs.entrypoint.host, inputs.entrypoint.port
        ));
    }
    args
}

/// The service-proxy's arguments (after the `service-proxy` subcommand),
/// then `spec.proxyAgent.additionalServiceProxyArgs`.
pub fn service_proxy_args(inputs: &AgentInputs<'_>) -> Vec<String> {
    let mut args = vec![
        format!("--cluster-name={}", inputs.cluster),
        "--cert=/etc/service-proxy/tls.crt".to_owned(),
        "--key=/etc/service-proxy/tls.key".to_owned(),
        // cert-authority signs the user-server's identity with the hub CA.
        "--user-server-ca=/etc/ca/ca.crt".to_owned(),
        format!("--enable-impersonation={}", inputs.impersonation),
        format!("--health-port={SERVICE_PROXY_HEALTH_PORT}"),
    ];
    args.extend(
        inputs
            .mpc
            .spec
            .proxy_agent
            .additional_service_proxy_args
            .iter()
            .cloned(),
    );
    args
}

/// The agent Deployment `cluster-proxy-proxy-agent`.
pub fn agent_deployment(inputs: &AgentInputs<'_>) -> Deployment {
    let generation = inputs.mpc.metadata.generation.unwrap_or(0).to_string();
    let generation_annotation = labels(&[(ANNOTATION_CONFIGURATION_GENERATION, &generation)]);
    let mut pod_annotations = generation_annotation.clone();
    pod_annotations.insert(
        ANNOTATION_WORKLOAD_MANAGEMENT.to_owned(),
        r#"{"effect":"PreferredDuringScheduling"}"#.to_owned(),
    );
    let image = inputs.customization.image().to_owned();
    let placement = inputs
        .deployment_config
        .and_then(|adc| adc.spec.node_placement.as_ref());
    let tolerations = placement
        .and_then(|placement| placement.tolerations.clone())
        .unwrap_or_else(default_tolerations);
    let node_selector = inputs.customization.node_selector().cloned();
    let env = proxy_env(inputs.deployment_config);
    let image_pull_secrets: Vec<LocalObjectReference> = inputs
        .mpc
        .spec
        .proxy_agent
        .image_pull_secrets
        .iter()
        .map(|name| LocalObjectReference { name: name.clone() })
        .collect();

    let proxy_agent = Container {
        name: PROXY_AGENT_CONTAINER.into(),
        image: Some(image.clone()),
        image_pull_policy: inputs.image_pull_policy.map(str::to_owned),
        command: Some(vec!["/proxy-agent".into()]),
        args: Some(proxy_agent_args(inputs)),
        env: (!env.is_empty()).then(|| env.clone()),
        volume_mounts: Some(vec![mount("ca", CA_MOUNT), mount("tls", "/etc/tls")]),
        readiness_probe: Some(http_probe("/readyz", AGENT_HEALTH_PORT)),
        liveness_probe: Some(http_probe("/healthz", AGENT_HEALTH_PORT)),
        security_context: Some(hardened()),
        resources: inputs
            .customization
            .resources(AGENT_DEPLOYMENT, PROXY_AGENT_CONTAINER),
        ..Container::default()
    };
    let addon_agent = Container {
        name: ADDON_AGENT_CONTAINER.into(),
        image: Some(image),
        image_pull_policy: inputs.image_pull_policy.map(str::to_owned),
        command: Some(vec!["/addon-agent".into()]),
        args: Some(addon_agent_args(inputs)),
        // The addon-agent reaches the hub API through the same proxy.
        env: Some(
            std::iter::once(EnvVar {
                name: "POD_NAMESPACE".into(),
                value: None,
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.namespace".into(),
                        api_version: None,
                    }),
                    ..EnvVarSource::default()
                }),
            })
            .chain(env.iter().cloned())
            .collect(),
        ),
        volume_mounts: Some(
            std::iter::once(mount("hub-kubeconfig", "/etc/kubeconfig"))
                .chain(proxy_ca_bundle(inputs.deployment_config).map(|_| mount("ca", CA_MOUNT)))
                .collect(),
        ),
        security_context: Some(hardened()),
        resources: inputs
            .customization
            .resources(AGENT_DEPLOYMENT, ADDON_AGENT_CONTAINER),
        ..Container::default()
    };

    let mut containers = vec![proxy_agent, addon_agent];
    let mut volumes = vec![
        secret_volume("ca", AGENT_CA_SECRET),
        secret_volume("tls", AGENT_CLIENT_CERT_SECRET),
        secret_volume("hub-kubeconfig", HUB_KUBECONFIG_SECRET),
    ];
    let mut host_aliases = None;
    if inputs.service_proxy.is_some() {
        containers.push(Container {
            name: SERVICE_PROXY_CONTAINER.into(),
            image: Some(inputs.customization.image().to_owned()),
            image_pull_policy: inputs.image_pull_policy.map(str::to_owned),
            command: Some(vec!["/proxy-agent".into()]),
            args: Some(
                std::iter::once(SERVICE_PROXY_SUBCOMMAND.to_owned())
                    .chain(service_proxy_args(inputs))
                    .collect(),
            ),
            volume_mounts: Some(vec![
                mount("ca", "/etc/ca"),
                mount("service-proxy", "/etc/service-proxy"),
            ]),
            readiness_probe: Some(http_probe("/readyz", SERVICE_PROXY_HEALTH_PORT)),
            liveness_probe: Some(http_probe("/healthz", SERVICE_PROXY_HEALTH_PORT)),
            security_context: Some(hardened()),
            resources: inputs
                .customization
                .resources(AGENT_DEPLOYMENT, SERVICE_PROXY_CONTAINER),
            ..Container::default()
        });
        volumes.push(secret_volume("service-proxy", SERVICE_PROXY_CERT_SECRET));
        // The proxy-agent dials the cluster's hashed host (its identifier)
        // for the user-server's requests: the service-proxy on loopback.
        host_aliases = Some(vec![HostAlias {
            ip: "127.0.0.1".into(),
            hostnames: Some(vec![inputs.cluster.service_proxy_host()]),
        }]);
    }

    Deployment {
        metadata: ObjectMeta {
            labels: Some(agent_labels()),
            annotations: Some(generation_annotation),
            ..meta(AGENT_DEPLOYMENT, Some(inputs.install_namespace))
        },
        spec: Some(DeploymentSpec {
            replicas: Some(inputs.mpc.spec.proxy_agent.replicas),
            selector: LabelSelector {
                match_labels: Some(agent_labels()),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(agent_labels()),
                    annotations: Some(pod_annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(AGENT_SERVICE_ACCOUNT.into()),
                    containers,
                    host_aliases,
                    tolerations: Some(tolerations),
                    node_selector,
                    image_pull_secrets: (!image_pull_secrets.is_empty())
                        .then_some(image_pull_secrets),
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

fn lease_rules() -> Vec<PolicyRule> {
    vec![PolicyRule {
        api_groups: Some(vec!["coordination.k8s.io".into()]),
        resources: Some(vec!["leases".into()]),
        verbs: vec!["*".into()],
        ..PolicyRule::default()
    }]
}

fn lease_role(namespace: &str) -> Role {
    Role {
        metadata: meta(AGENT_RBAC_NAME, Some(namespace)),
        rules: Some(lease_rules()),
    }
}

fn role_binding(namespace: &str, subjects: Vec<RbacSubject>) -> RoleBinding {
    RoleBinding {
        metadata: meta(AGENT_RBAC_NAME, Some(namespace)),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: AGENT_RBAC_NAME.into(),
        },
        subjects: Some(subjects),
    }
}

/// The manifests of the agent, in apply order (namespace first).
pub fn agent_manifests(inputs: &AgentInputs<'_>) -> Result<Vec<Manifest>, ManifestError> {
    let namespace = inputs.install_namespace;
    let namespace_object = Namespace {
        metadata: ObjectMeta {
            annotations: Some(labels(&[(ANNOTATION_DELETION_ORPHAN, "")])),
            ..meta(namespace, None)
        },
        ..Namespace::default()
    };
    let service_account = ServiceAccount {
        metadata: meta(AGENT_SERVICE_ACCOUNT, Some(namespace)),
        ..ServiceAccount::default()
    };
    let ca_secret = k8s_openapi::api::core::v1::Secret {
        metadata: meta(AGENT_CA_SECRET, Some(namespace)),
        type_: Some("Opaque".into()),
        data: Some(
            std::iter::once(("ca.crt".to_owned(), ByteString(inputs.ca_pem.to_vec())))
                .chain(
                    proxy_ca_bundle(inputs.deployment_config)
                        .map(|bundle| (PROXY_CA_KEY.to_owned(), ByteString(bundle.to_vec()))),
                )
                .collect(),
        ),
        ..k8s_openapi::api::core::v1::Secret::default()
    };
    let cluster_service = Service {
        metadata: meta(inputs.cluster.as_str(), Some(namespace)),
        spec: Some(ServiceSpec {
            type_: Some("ExternalName".into()),
            external_name: Some(format!(
                "kubernetes.default.{}",
                service_domain(inputs.deployment_config)
            )),
            ..ServiceSpec::default()
        }),
        status: None,
    };
    let role = lease_role(namespace);
    let binding = role_binding(
        namespace,
        vec![RbacSubject {
            kind: "ServiceAccount".into(),
            name: AGENT_SERVICE_ACCOUNT.into(),
            namespace: Some(namespace.to_owned()),
            api_group: None,
        }],
    );
    let mut manifests = vec![
        Manifest::new(&namespace_object)?,
        Manifest::new(&service_account)?,
        Manifest::new(&ca_secret)?,
    ];
    if inputs.kube_api_proxy {
        manifests.push(Manifest::new(&cluster_service)?);
    }
    if let Some(kube_apiserver_ports) = inputs.network_policy {
        manifests.push(Manifest::new(&agent_network_policy(
            namespace,
            inputs.entrypoint.port,
            kube_apiserver_ports,
            &egress_ports(inputs.deployment_config),
        ))?);
    }
    manifests.extend([Manifest::new(&role)?, Manifest::new(&binding)?]);
    if let Some(service_proxy) = inputs.service_proxy {
        manifests.extend(service_proxy_manifests(inputs, service_proxy)?);
    }
    manifests.push(Manifest::new(&agent_deployment(inputs))?);
    Ok(manifests)
}

/// The service-proxy's certificate Secret, and (with impersonation) the
/// ClusterRole that lets the agent's ServiceAccount impersonate users and
/// groups, bound under upstream's names.
fn service_proxy_manifests(
    inputs: &AgentInputs<'_>,
    service_proxy: ServiceProxyInputs<'_>,
) -> Result<Vec<Manifest>, ManifestError> {
    let namespace = inputs.install_namespace;
    let certificate = k8s_openapi::api::core::v1::Secret {
        metadata: meta(SERVICE_PROXY_CERT_SECRET, Some(namespace)),
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_owned(),
                ByteString(service_proxy.cert_pem.to_vec()),
            ),
            (
                "tls.key".to_owned(),
                ByteString(service_proxy.key_pem.to_vec()),
            ),
        ])),
        ..k8s_openapi::api::core::v1::Secret::default()
    };
    let mut manifests = vec![Manifest::new(&certificate)?];
    if inputs.impersonation {
        let role = ClusterRole {
            metadata: meta(IMPERSONATOR, None),
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["users".into(), "groups".into()]),
                verbs: vec!["impersonate".into()],
                ..PolicyRule::default()
            }]),
            ..ClusterRole::default()
        };
        let binding = ClusterRoleBinding {
            metadata: meta(&impersonator_binding_name(namespace), None),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: IMPERSONATOR.into(),
            },
            subjects: Some(vec![RbacSubject {
                kind: "ServiceAccount".into(),
                name: AGENT_SERVICE_ACCOUNT.into(),
                namespace: Some(namespace.to_owned()),
                api_group: None,
            }]),
        };
        manifests.extend([Manifest::new(&role)?, Manifest::new(&binding)?]);
    }
    Ok(manifests)
}

/// Upstream's name of the impersonator binding: the ClusterRole's in the
/// addon framework's default namespace, else suffixed with the namespace
/// (two installs in different namespaces keep their own binding).
pub fn impersonator_binding_name(namespace: &str) -> String {
    if namespace == "open-cluster-management-agent-addon" {
        IMPERSONATOR.to_owned()
    } else {
        format!("{IMPERSONATOR}:{namespace}")
    }
}

/// What the work agent deletes with the work: everything but the manifests
/// annotated `deletion-orphan` (the agent namespace), which it must keep.
/// The work agent never reads that annotation; the addon framework turns
/// it into `SelectivelyOrphan` rules, and so must we.
fn delete_option(manifests: &[Manifest]) -> DeleteOption {
    let rules: Vec<ResourceIdentifier> = manifests
        .iter()
        .filter(|m| {
            m.0.pointer("/metadata/annotations")
                .and_then(|a| a.get(ANNOTATION_DELETION_ORPHAN))
                .is_some()
        })
        .filter_map(Manifest::identifier)
        .collect();
    if rules.is_empty() {
        return DeleteOption {
            propagation_policy: Some(PROPAGATION_FOREGROUND.into()),
            ..DeleteOption::default()
        };
    }
    DeleteOption {
        propagation_policy: Some(PROPAGATION_SELECTIVELY_ORPHAN.into()),
        selectively_orphan: Some(SelectivelyOrphan {
            orphaning_rules: Some(rules),
        }),
        ..DeleteOption::default()
    }
}

/// The ManifestWork `addon-cluster-proxy-deploy-0` in the cluster's
/// namespace, owned by the ManagedClusterAddOn so it goes with it.
pub fn manifest_work(
    inputs: &AgentInputs<'_>,
    owner: Option<OwnerReference>,
) -> Result<ManifestWork, ManifestError> {
    let manifests = agent_manifests(inputs)?;
    let mut work = ManifestWork::new(
        MANIFEST_WORK_NAME,
        ManifestWorkSpec {
            delete_option: Some(delete_option(&manifests)),
            workload: Some(ManifestsTemplate {
                manifests: Some(manifests),
            }),
            ..ManifestWorkSpec::default()
        },
    );
    work.metadata.namespace = Some(inputs.cluster.as_str().to_owned());
    work.metadata.labels = Some(labels(&[
        (LABEL_ADDON_NAME, ADDON_NAME),
        (LABEL_ADDON_NAMESPACE, inputs.install_namespace),
    ]));
    work.metadata.owner_references = owner.map(|owner| vec![owner]);
    Ok(work)
}

/// The user the addon framework gives the agent of `cluster` (token driver).
pub fn framework_agent_user(cluster: &str) -> String {
    format!(
        "system:open-cluster-management:cluster:{cluster}:addon:{ADDON_NAME}:agent:{ADDON_NAME}-agent"
    )
}

/// The per-cluster group the addon framework gives the agent of `cluster`.
pub fn framework_agent_group(cluster: &str) -> String {
    format!("system:open-cluster-management:cluster:{cluster}:addon:{ADDON_NAME}")
}

/// Hub RBAC of the addon-agent in the cluster's namespace (upstream F16):
/// Role and RoleBinding `cluster-proxy-addon-agent` on leases, bound to the
/// registration subjects, owned by the ManagedClusterAddOn.
pub fn hub_agent_rbac(cluster: &str, owner: Option<OwnerReference>) -> (Role, RoleBinding) {
    let user = |name: String| RbacSubject {
        kind: "User".into(),
        name,
        api_group: Some("rbac.authorization.k8s.io".into()),
        namespace: None,
    };
    let group = |name: String| RbacSubject {
        kind: "Group".into(),
        ..user(name)
    };
    let mut role = lease_role(cluster);
    let mut binding = role_binding(
        cluster,
        vec![
            user(framework_agent_user(cluster)),
            group(framework_agent_group(cluster)),
        ],
    );
    role.metadata.owner_references = owner.clone().map(|owner| vec![owner]);
    binding.metadata.owner_references = owner.map(|owner| vec![owner]);
    (role, binding)
}

/// The namespace the agent is installed in: the ADC's
/// `agentInstallNamespace`, else the MCA's (deprecated) `installNamespace`,
/// else the manager's default.
pub fn install_namespace(
    addon: &ManagedClusterAddOn,
    deployment_config: Option<&AddOnDeploymentConfig>,
    default: &str,
) -> String {
    deployment_config
        .and_then(|adc| adc.spec.agent_install_namespace.clone())
        .filter(|namespace| !namespace.is_empty())
        .or_else(|| {
            addon
                .spec
                .install_namespace
                .clone()
                .filter(|namespace| !namespace.is_empty())
        })
        .unwrap_or_else(|| default.to_owned())
}

//! The resource's types, defaults and condition names (re-exported by
//! [`super`]). Apart from the logic on them (`entrypoint`, `validation`),
//! which depends on them and which the parent re-exports too.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::Condition;

/// The name of the one `ManagedProxyConfiguration` the addon reads; upstream
/// hard-codes it in the agent's rendering and the chart creates it.
pub const MANAGED_PROXY_CONFIGURATION_NAME: &str = "cluster-proxy";

/// Condition type: the proxy-server Deployment exists (set by addon-manager).
pub const CONDITION_PROXY_SERVER_DEPLOYED: &str = "ProxyServerDeployed";
/// Condition type: the proxy-server (client-facing) serving certificate is
/// signed (set by cert-authority).
pub const CONDITION_PROXY_SERVER_SECRET_SIGNED: &str = "ProxyServerSecretSigned";
/// Condition type: the agent-server serving certificate is signed.
pub const CONDITION_AGENT_SERVER_SECRET_SIGNED: &str = "AgentServerSecretSigned";
/// Condition type: the proxy-client certificate is signed. Upstream defines it
/// but never sets it.
pub const CONDITION_PROXY_CLIENT_SECRET_SIGNED: &str = "ProxyClientSecretSigned";
/// Condition type: the user-server serving certificate is signed (only while
/// `spec.userServer` is set).
pub const CONDITION_USER_SERVER_SECRET_SIGNED: &str = "UserServerSecretSigned";

/// Reason of a `True` [`CONDITION_PROXY_SERVER_DEPLOYED`]; upstream's message
/// is `Replicas: <n>`.
pub const REASON_SUCCESSFULLY_DEPLOYED: &str = "SuccessfullyDeployed";
/// Reason of a `False` [`CONDITION_PROXY_SERVER_DEPLOYED`].
pub const REASON_NOT_YET_DEPLOYED: &str = "NotYetDeployed";
/// Reason of a `True` certificate condition; upstream's message is
/// `Expiry:<notAfter>`.
pub const REASON_SUCCESSFULLY_SIGNED: &str = "SuccessfullySigned";
/// Reason of a `False` certificate condition.
pub const REASON_NOT_YET_SIGNED: &str = "NotYetSigned";

/// Label on proxy-server pods; the PortForward entrypoint selects pods by it.
pub const LABEL_COMPONENT_NAME: &str = "proxy.open-cluster-management.io/component-name";
/// [`LABEL_COMPONENT_NAME`] value of the proxy-server pods.
pub const COMPONENT_PROXY_SERVER: &str = "proxy-server";
/// [`LABEL_COMPONENT_NAME`] value of the proxy-agent pods.
pub const COMPONENT_PROXY_AGENT: &str = "proxy-agent";
/// Annotation carrying the MPC `metadata.generation` an object was rendered
/// from (proxy-server Deployment, agent Deployment and pod template).
pub const ANNOTATION_CONFIGURATION_GENERATION: &str =
    "proxy.open-cluster-management.io/configuration-generation";

/// Default of `spec.authentication.dump.secrets.signingProxyServerSecretName`.
pub const DEFAULT_PROXY_SERVER_SECRET_NAME: &str = "proxy-server";
/// Default of `spec.authentication.dump.secrets.signingProxyClientSecretName`.
pub const DEFAULT_PROXY_CLIENT_SECRET_NAME: &str = "proxy-client";
/// Default of `spec.authentication.dump.secrets.signingAgentServerSecretName`.
pub const DEFAULT_AGENT_SERVER_SECRET_NAME: &str = "agent-server";
/// Secret holding only the CA certificate (`ca.crt`) for hub clients.
pub const PROXY_SERVER_CA_SECRET_NAME: &str = "proxy-server-ca";
/// Secret of the user-server serving certificate (when `spec.userServer` is set).
pub const USER_SERVER_SECRET_NAME: &str = "cluster-proxy-user-serving-cert";
/// Service of the user-server; its DNS names are in the user certificate.
pub const USER_SERVER_SERVICE_NAME: &str = "cluster-proxy-addon-user";
/// Secret of the user-server's client certificate toward service-proxies
/// (common name [`crate::service_access::USER_SERVER_IDENTITY`]), when
/// `spec.userServer` is set. Service-proxies believe a hub identity only
/// from this certificate.
pub const USER_SERVER_IDENTITY_SECRET_NAME: &str = "cluster-proxy-user-server-identity";
/// Secret of the service-proxy serving certificate (upstream's name), when
/// `spec.userServer` is set; agents get a copy.
pub const SERVICE_PROXY_SECRET_NAME: &str = "cluster-proxy-service-proxy-server-cert";
/// Default of `spec.proxyServer.replicas` and `spec.proxyAgent.replicas`.
pub const DEFAULT_REPLICAS: i32 = 3;
/// Default of `spec.proxyServer.inClusterServiceName`.
pub const DEFAULT_IN_CLUSTER_SERVICE_NAME: &str = "proxy-entrypoint";
/// Default of `spec.proxyServer.namespace`.
pub const DEFAULT_PROXY_SERVER_NAMESPACE: &str = "open-cluster-management-cluster-proxy";
/// Default of `spec.proxyServer.entrypoint.loadBalancerService.name`.
pub const DEFAULT_LOAD_BALANCER_SERVICE_NAME: &str = "proxy-agent-entrypoint";
/// Default client port (`spec.deploy.ports.proxyServer`).
pub const DEFAULT_PROXY_SERVER_PORT: i32 = 8090;
/// Default agent port (`spec.deploy.ports.agentServer`, `entrypoint.port`).
pub const DEFAULT_AGENT_SERVER_PORT: i32 = 8091;
/// Default health port (`spec.deploy.ports.healthServer`).
pub const DEFAULT_HEALTH_SERVER_PORT: i32 = 8092;
/// Default admin port (`spec.deploy.ports.adminServer`).
pub const DEFAULT_ADMIN_SERVER_PORT: i32 = 8095;

/// How proxy-servers are deployed on the hub and agents on managed clusters.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "proxy.open-cluster-management.io",
    version = "v1alpha1",
    kind = "ManagedProxyConfiguration",
    plural = "managedproxyconfigurations",
    status = "ManagedProxyConfigurationStatus",
    derive = "PartialEq",
    doc = "ManagedProxyConfiguration configures the cluster-proxy servers on the hub and the agents on every managed cluster.",
    printcolumn = r#"{"name": "Entrypoint", "type": "string", "jsonPath": ".spec.proxyServer.entrypoint.type"}"#,
    printcolumn = r#"{"name": "Replicas", "type": "integer", "jsonPath": ".spec.proxyServer.replicas"}"#,
    printcolumn = r#"{"name": "Deployed", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"ProxyServerDeployed\")].status"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ManagedProxyConfigurationSpec {
    /// How the certificates between servers, agents and clients are signed and stored.
    pub authentication: Authentication,
    /// The proxy-server Deployment on the hub.
    pub proxy_server: ProxyServer,
    /// The proxy-agent Deployment on every managed cluster.
    pub proxy_agent: ProxyAgent,
    /// Ports of the proxy-servers. Upstream declares them but ignores them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deploy: Option<Deploy>,
    /// When set, a user-server serving certificate is issued and rotated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_server: Option<UserServer>,
}

/// `spec.authentication`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Authentication {
    /// Who signs the certificates.
    #[serde(default)]
    pub signer: Signer,
    /// Where the signed certificates are stored.
    #[serde(default)]
    pub dump: CertificateDump,
}

/// `spec.authentication.signer`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Signer {
    /// The signer type; only `SelfSigned` is implemented.
    #[serde(rename = "type", default)]
    pub type_: SignerType,
    /// Options of the self-signed CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_signed: Option<SelfSigned>,
}

/// `spec.authentication.signer.type`. The CRD admits all three values, as
/// upstream's does; only `SelfSigned` is implemented there and here.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SignerType {
    /// A CA generated on the hub if absent.
    #[default]
    SelfSigned,
    /// Reserved by upstream, not implemented.
    Provided,
    /// Reserved by upstream, not implemented.
    CertManager,
}

/// `spec.authentication.signer.selfSigned`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct SelfSigned {
    /// Extra DNS names or IPs in the proxy-server, agent-server and
    /// proxy-client certificates.
    #[serde(
        rename = "additionalSANs",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    pub additional_sans: Vec<String>,
}

/// `spec.authentication.dump`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct CertificateDump {
    /// Names of the Secrets in the proxy-server namespace.
    #[serde(default)]
    pub secrets: CertificateSecrets,
}

/// `spec.authentication.dump.secrets`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CertificateSecrets {
    /// Serving certificate of the client port (8090).
    #[serde(default = "default_proxy_server_secret_name")]
    pub signing_proxy_server_secret_name: String,
    /// Client certificate of hub clients (client auth only).
    #[serde(default = "default_proxy_client_secret_name")]
    pub signing_proxy_client_secret_name: String,
    /// Serving certificate of the agent port (8091).
    #[serde(default = "default_agent_server_secret_name")]
    pub signing_agent_server_secret_name: String,
}

impl Default for CertificateSecrets {
    fn default() -> Self {
        Self {
            signing_proxy_server_secret_name: default_proxy_server_secret_name(),
            signing_proxy_client_secret_name: default_proxy_client_secret_name(),
            signing_agent_server_secret_name: default_agent_server_secret_name(),
        }
    }
}

/// `spec.proxyServer`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyServer {
    /// Container image of the proxy-server.
    pub image: String,
    /// Deployment replicas; they count each other (headless Service `proxy-server-peers`).
    #[serde(default = "default_replicas")]
    pub replicas: i32,
    /// Name of the ClusterIP Service hub clients dial (ports 8090 and 8091).
    #[serde(default = "default_in_cluster_service_name")]
    pub in_cluster_service_name: String,
    /// Namespace of the proxy-servers and their objects.
    #[serde(default = "default_proxy_server_namespace")]
    pub namespace: String,
    /// How agents reach the proxy-servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Entrypoint>,
    /// Arguments appended after the fixed proxy-server arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_args: Vec<String>,
    /// Node selector and tolerations of the proxy-server pods.
    #[serde(default, skip_serializing_if = "NodePlacement::is_empty")]
    pub node_placement: NodePlacement,
    /// Requests and limits of the proxy-server container (not in upstream's
    /// API; a namespace with a ResourceQuota admits only pods that set them).
    /// proxy-server runs as many worker threads as its CPU limit allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// `spec.proxyServer.entrypoint`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Entrypoint {
    /// The kind of entrypoint.
    #[serde(rename = "type")]
    pub type_: EntrypointType,
    /// The LoadBalancer Service (type `LoadBalancerService`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancer_service: Option<LoadBalancerServiceEntrypoint>,
    /// The fixed host name agents dial (type `Hostname`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<HostnameEntrypoint>,
    /// The port agents dial.
    #[serde(default = "default_agent_server_port")]
    #[schemars(range(min = 1))]
    pub port: i32,
}

/// `spec.proxyServer.entrypoint.type`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum EntrypointType {
    /// Agents dial `hostname.value:port`.
    Hostname,
    /// Agents dial the address a LoadBalancer Service publishes.
    LoadBalancerService,
    /// Agents dial a local port that the addon-agent forwards to a
    /// proxy-server pod through the hub API (`pods/portforward`).
    PortForward,
}

/// `spec.proxyServer.entrypoint.loadBalancerService`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct LoadBalancerServiceEntrypoint {
    /// Service name, in the proxy-server namespace.
    #[serde(default = "default_load_balancer_service_name")]
    pub name: String,
    /// Annotations of the Service (cloud load balancer options).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub annotations: Vec<AnnotationVar>,
}

/// One annotation of the LoadBalancer Service.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct AnnotationVar {
    /// Annotation key.
    pub key: String,
    /// Annotation value.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
}

/// `spec.proxyServer.entrypoint.hostname`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct HostnameEntrypoint {
    /// Host name (or IP) agents dial.
    pub value: String,
}

/// Node placement of pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePlacement {
    /// Node labels the pods require.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

impl NodePlacement {
    /// No selector and no tolerations.
    pub fn is_empty(&self) -> bool {
        self.node_selector.is_empty() && self.tolerations.is_empty()
    }
}

/// `spec.proxyAgent`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyAgent {
    /// Container image of the proxy-agent.
    pub image: String,
    /// Agent Deployment replicas on each managed cluster.
    #[serde(default = "default_replicas")]
    pub replicas: i32,
    /// Arguments appended to the proxy-agent arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_args: Vec<String>,
    /// Arguments appended to the service-proxy arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_service_proxy_args: Vec<String>,
    /// Names of image pull Secrets of the agent pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    /// ConfigMap on the managed cluster whose `service-ca.crt` adds trusted
    /// CAs for services.
    #[serde(
        rename = "additionalServiceCAConfigMap",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub additional_service_ca_config_map: Option<String>,
}

/// `spec.deploy`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct Deploy {
    /// Listening ports of the proxy-servers.
    pub ports: DeployPorts,
}

/// `spec.deploy.ports`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeployPorts {
    /// Client port.
    #[serde(default = "default_proxy_server_port")]
    pub proxy_server: i32,
    /// Agent port.
    #[serde(default = "default_agent_server_port")]
    pub agent_server: i32,
    /// Health port.
    #[serde(default = "default_health_server_port")]
    pub health_server: i32,
    /// Admin (debug and metrics) port.
    #[serde(default = "default_admin_server_port")]
    pub admin_server: i32,
}

impl Default for DeployPorts {
    fn default() -> Self {
        Self {
            proxy_server: DEFAULT_PROXY_SERVER_PORT,
            agent_server: DEFAULT_AGENT_SERVER_PORT,
            health_server: DEFAULT_HEALTH_SERVER_PORT,
            admin_server: DEFAULT_ADMIN_SERVER_PORT,
        }
    }
}

/// `spec.userServer`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct UserServer {
    /// Extra DNS names or IPs in the user-server certificate.
    #[serde(
        rename = "additionalSANs",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    pub additional_sans: Vec<String>,
}

/// Observed state, written by addon-manager (deployment conditions) and
/// cert-authority (certificate conditions).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ManagedProxyConfigurationStatus {
    /// The `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_observed_generation: Option<i64>,
    /// Conditions, one per type; each writer owns its own types.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// The schema of `status.conditions`: a list map keyed by `type`, whose items
/// carry the checks the API conventions give `metav1.Condition` (and that
/// upstream's controller-gen CRD has), which k8s-openapi's schema lacks.
fn conditions_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "description": "Conditions, one per type; each writer owns its own types.",
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "description": "One aspect of the observed state.",
            "type": "object",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": {
                    "description": "When the status last changed.",
                    "type": "string",
                    "format": "date-time"
                },
                "message": {
                    "description": "Details for people; may be empty.",
                    "type": "string",
                    "maxLength": 32768
                },
                "observedGeneration": {
                    "description": "The metadata.generation the condition describes.",
                    "type": "integer",
                    "format": "int64",
                    "minimum": 0
                },
                "reason": {
                    "description": "CamelCase identifier of why the status is what it is.",
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 1024,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
                },
                "status": {
                    "description": "True, False or Unknown.",
                    "type": "string",
                    "enum": ["True", "False", "Unknown"]
                },
                "type": {
                    "description": "The condition type, e.g. ProxyServerDeployed.",
                    "type": "string",
                    "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
                }
            }
        }
    })
}

fn default_proxy_server_secret_name() -> String {
    DEFAULT_PROXY_SERVER_SECRET_NAME.to_owned()
}

fn default_proxy_client_secret_name() -> String {
    DEFAULT_PROXY_CLIENT_SECRET_NAME.to_owned()
}

fn default_agent_server_secret_name() -> String {
    DEFAULT_AGENT_SERVER_SECRET_NAME.to_owned()
}

fn default_replicas() -> i32 {
    DEFAULT_REPLICAS
}

fn default_in_cluster_service_name() -> String {
    DEFAULT_IN_CLUSTER_SERVICE_NAME.to_owned()
}

fn default_proxy_server_namespace() -> String {
    DEFAULT_PROXY_SERVER_NAMESPACE.to_owned()
}

fn default_load_balancer_service_name() -> String {
    DEFAULT_LOAD_BALANCER_SERVICE_NAME.to_owned()
}

fn default_proxy_server_port() -> i32 {
    DEFAULT_PROXY_SERVER_PORT
}

fn default_agent_server_port() -> i32 {
    DEFAULT_AGENT_SERVER_PORT
}

fn default_health_server_port() -> i32 {
    DEFAULT_HEALTH_SERVER_PORT
}

fn default_admin_server_port() -> i32 {
    DEFAULT_ADMIN_SERVER_PORT
}

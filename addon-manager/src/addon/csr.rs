//! Approval of the addon's CertificateSigningRequests: the proxy-agent's
//! client certificate (`open-cluster-management.io/proxy-agent-signer`,
//! signed by cert-authority) and the addon-agent's hub kubeconfig
//! (`kubernetes.io/kube-apiserver-client`, signed by the hub's
//! kube-controller-manager). OCM's own addon-manager approves addon CSRs
//! only for template addons, so without this nobody approves the second and
//! the addon-agent never gets its hub kubeconfig.
//!
//! A CSR labelled for the addon and a cluster is approved only when all of
//! these hold:
//!
//! * the requester the API server authenticated (`spec.username`) is the
//!   cluster's own registration identity,
//!   `system:open-cluster-management:<cluster>:<agent>` in group
//!   `system:open-cluster-management:<cluster>`;
//! * the cluster label names that same cluster;
//! * the ManagedCluster exists and the hub accepts it (`hubAcceptsClient`);
//! * the request's subject is the one the addon's registration for that
//!   signer asks for (render::registrations): for the proxy-agent, user,
//!   group and the organizational unit of the current CA; for the hub
//!   kubeconfig, the cluster's own addon user and groups, nothing more;
//! * a hub kubeconfig asks for client-certificate usages only.
//!
//! Anything else is left for a human (never denied) and the reason logged.

use std::future::Future;
use std::sync::Arc;

use cluster_proxy_proto::api::addon::v1alpha1::LABEL_ADDON_NAME;
use cluster_proxy_proto::api::cluster::v1::{LABEL_CLUSTER_NAME, ManagedCluster};
use cluster_proxy_proto::identity::ClusterName;
use futures_util::{Stream, StreamExt};
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::PostParams;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use x509_parser::prelude::{FromDer, X509CertificationRequest};

use super::cache::get_opt;
use super::context::Context;
use super::error::{AddonError, requeue_failed};
use super::names::{ADDON_NAME, CA_BUNDLE_KEY, CA_BUNDLE_SECRET};
use super::render::{
    ADDON_AGENTS_GROUP, CLUSTER_PROXY_GROUP, KUBE_APISERVER_CLIENT_SIGNER, PROXY_AGENT_SIGNER,
    PROXY_AGENT_USER, framework_agent_group, framework_agent_user,
};

const CONTROLLER: &str = "csr";
const OCM_USER_PREFIX: &str = "system:open-cluster-management:";
/// The reason of the `Approved` condition we write.
pub const REASON_APPROVED: &str = "AutoApprovedByClusterProxyAddonManager";

/// What to do with one CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Approval {
    /// Not ours, or decided already.
    Ignore(&'static str),
    /// Approve: it is `cluster`'s own agent asking for its certificate.
    Approve { cluster: ClusterName },
    /// Leave it for a human; the reason is logged.
    Leave(String),
}

/// The cluster of an OCM registration identity:
/// `system:open-cluster-management:<cluster>:<agent>` in group
/// `system:open-cluster-management:<cluster>`.
pub fn requester_cluster(username: &str, groups: &[String]) -> Result<ClusterName, String> {
    let rest = username.strip_prefix(OCM_USER_PREFIX).ok_or_else(|| {
        format!("requester {username:?} is not a managed cluster's registration identity")
    })?;
    let (cluster, agent) = rest
        .split_once(':')
        .filter(|(_, agent)| !agent.is_empty() && !agent.contains(':'))
        .ok_or_else(|| format!("requester {username:?} does not name one cluster and one agent"))?;
    let cluster =
        ClusterName::new(cluster).map_err(|error| format!("requester {username:?}: {error}"))?;
    let group = format!("{OCM_USER_PREFIX}{cluster}");
    if !groups.contains(&group) {
        return Err(format!(
            "requester {username:?} (agent {agent:?}) is not in group {group:?}"
        ));
    }
    Ok(cluster)
}

fn has_condition(csr: &CertificateSigningRequest, type_: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| conditions.iter().any(|condition| condition.type_ == type_))
}

/// The subject attributes of a certificate request the approval checks.
#[derive(Debug, Default)]
struct RequestSubject {
    common_names: Vec<String>,
    organizations: Vec<String>,
    units: Vec<String>,
}

/// The subject of a PEM-encoded PKCS#10 request.
fn request_subject(pem: &[u8]) -> Result<RequestSubject, String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem)
        .map_err(|error| format!("spec.request is not PEM: {error}"))?;
    let (_, request) = X509CertificationRequest::from_der(&block.contents)
        .map_err(|error| format!("spec.request is not a PKCS#10 request: {error}"))?;
    let subject = &request.certification_request_info.subject;
    let text = |values: Vec<Result<&str, _>>| -> Result<Vec<String>, String> {
        values
            .into_iter()
            .map(|value| {
                value
                    .map(str::to_owned)
                    .map_err(|_| "a subject attribute is not text".to_owned())
            })
            .collect()
    };
    Ok(RequestSubject {
        common_names: text(
            subject
                .iter_common_name()
                .map(|attribute| attribute.as_str())
                .collect(),
        )?,
        organizations: text(
            subject
                .iter_organization()
                .map(|attribute| attribute.as_str())
                .collect(),
        )?,
        units: text(
            subject
                .iter_organizational_unit()
                .map(|attribute| attribute.as_str())
                .collect(),
        )?,
    })
}

/// Decides about `csr`. `cluster` is the ManagedCluster its requester
/// belongs to (None: it does not exist); `expected_unit` the organizational
/// unit of the current CA (None: no CA published yet).
pub fn decide(
    csr: &CertificateSigningRequest,
    cluster: Option<&ManagedCluster>,
    expected_unit: Option<&str>,
) -> Approval {
    let credential = match csr.spec.signer_name.as_str() {
        PROXY_AGENT_SIGNER => Credential::ProxyAgent,
        KUBE_APISERVER_CLIENT_SIGNER => Credential::HubKubeconfig,
        _ => return Approval::Ignore("another signer"),
    };
    if has_condition(csr, "Approved")
        || has_condition(csr, "Denied")
        || has_condition(csr, "Failed")
    {
        return Approval::Ignore("decided already");
    }
    let labels = csr.labels();
    if labels.get(LABEL_ADDON_NAME).map(String::as_str) != Some(ADDON_NAME) {
        return Approval::Leave(format!("label {LABEL_ADDON_NAME} is not {ADDON_NAME}"));
    }
    let Some(label_cluster) = labels.get(LABEL_CLUSTER_NAME) else {
        return Approval::Leave(format!("no label {LABEL_CLUSTER_NAME}"));
    };
    let username = csr.spec.username.as_deref().unwrap_or_default();
    let groups = csr.spec.groups.as_deref().unwrap_or_default();
    let requester = match requester_cluster(username, groups) {
        Ok(requester) => requester,
        Err(why) => return Approval::Leave(why),
    };
    if label_cluster != requester.as_str() {
        return Approval::Leave(format!(
            "label {LABEL_CLUSTER_NAME}={label_cluster} but the requester belongs to cluster {requester}"
        ));
    }
    let Some(managed_cluster) = cluster.filter(|found| found.name_any() == requester.as_str())
    else {
        return Approval::Leave(format!("ManagedCluster {requester} does not exist"));
    };
    if !managed_cluster.hub_accepts_client() {
        return Approval::Leave(format!(
            "the hub does not accept cluster {requester} (hubAcceptsClient)"
        ));
    }
    let subject = match request_subject(&csr.spec.request.0) {
        Ok(subject) => subject,
        Err(why) => return Approval::Leave(why),
    };
    let checked = match credential {
        Credential::ProxyAgent => match expected_unit {
            Some(unit) => proxy_agent_subject(&subject, unit),
            None => Err("the hub CA is not published yet; the subject cannot be checked".into()),
        },
        Credential::HubKubeconfig => hub_kubeconfig_subject(&subject, &requester)
            .and_then(|()| client_usages_only(csr.spec.usages.as_deref().unwrap_or_default())),
    };
    if let Err(why) = checked {
        return Approval::Leave(why);
    }
    Approval::Approve { cluster: requester }
}

/// Which of the addon's two credentials a CSR asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Credential {
    ProxyAgent,
    HubKubeconfig,
}

fn proxy_agent_subject(subject: &RequestSubject, expected_unit: &str) -> Result<(), String> {
    if subject.common_names != [PROXY_AGENT_USER] {
        return Err(format!(
            "subject common name {:?} is not {PROXY_AGENT_USER:?}",
            subject.common_names
        ));
    }
    if subject.organizations != [CLUSTER_PROXY_GROUP] {
        return Err(format!(
            "subject organizations {:?} are not [{CLUSTER_PROXY_GROUP:?}]",
            subject.organizations
        ));
    }
    if subject.units != [expected_unit] {
        return Err(format!(
            "subject organizational units {:?} are not those of the current CA ([{expected_unit:?}])",
            subject.units
        ));
    }
    Ok(())
}

/// The hub kubeconfig authenticates to the hub API as its subject: the
/// cluster's own addon user and groups (compared as a set: Go's encoder
/// sorts a multi-valued RDN), and nothing that would name another cluster
/// or a group with more rights.
fn hub_kubeconfig_subject(subject: &RequestSubject, cluster: &ClusterName) -> Result<(), String> {
    let user = framework_agent_user(cluster.as_str());
    if subject.common_names != [user.as_str()] {
        return Err(format!(
            "subject common name {:?} is not {user:?}",
            subject.common_names
        ));
    }
    let mut groups = subject.organizations.clone();
    groups.sort();
    let mut expected = vec![
        framework_agent_group(cluster.as_str()),
        ADDON_AGENTS_GROUP.to_owned(),
    ];
    expected.sort();
    if groups != expected {
        return Err(format!(
            "subject organizations {:?} are not {expected:?}",
            subject.organizations
        ));
    }
    if !subject.units.is_empty() {
        return Err(format!(
            "subject organizational units {:?}: the hub kubeconfig asks for none",
            subject.units
        ));
    }
    Ok(())
}

/// kube-controller-manager signs a `kube-apiserver-client` CSR for these
/// usages only, and `client auth` must be among them.
fn client_usages_only(usages: &[String]) -> Result<(), String> {
    const ALLOWED: [&str; 3] = ["client auth", "digital signature", "key encipherment"];
    if let Some(other) = usages.iter().find(|u| !ALLOWED.contains(&u.as_str())) {
        return Err(format!(
            "usage {other:?} is not one of a client certificate's ({ALLOWED:?})"
        ));
    }
    if !usages.iter().any(|u| u == "client auth") {
        return Err("the usages do not include \"client auth\"".into());
    }
    Ok(())
}

/// `csr` with an `Approved` condition added.
pub fn approved(
    csr: &CertificateSigningRequest,
    cluster: &ClusterName,
    now: Time,
) -> CertificateSigningRequest {
    let mut csr = csr.clone();
    let status = csr.status.get_or_insert_with(Default::default);
    status
        .conditions
        .get_or_insert_with(Vec::new)
        .push(CertificateSigningRequestCondition {
            type_: "Approved".into(),
            status: "True".into(),
            reason: Some(REASON_APPROVED.into()),
            message: Some(format!(
                "cluster-proxy addon-manager approved the {} of cluster {cluster}",
                credential_name(&csr.spec.signer_name)
            )),
            last_update_time: Some(now.clone()),
            last_transition_time: Some(now),
        });
    csr
}

fn credential_name(signer: &str) -> &'static str {
    if signer == KUBE_APISERVER_CLIENT_SIGNER {
        "addon-agent hub kubeconfig"
    } else {
        "proxy-agent certificate"
    }
}

/// Reconciles one CSR.
pub async fn reconcile(
    csr: Arc<CertificateSigningRequest>,
    context: Arc<Context>,
) -> Result<Action, AddonError> {
    context.metrics.reconciled(CONTROLLER);
    let client = &context.client;
    let name = csr.name_any();
    // Cheap checks first: most CSRs were decided long ago.
    if let Approval::Ignore(_) = decide(&csr, None, None) {
        return Ok(Action::await_change());
    }
    let requester = requester_cluster(
        csr.spec.username.as_deref().unwrap_or_default(),
        csr.spec.groups.as_deref().unwrap_or_default(),
    );
    let cluster = match &requester {
        Ok(cluster) => {
            get_opt(
                &Api::<ManagedCluster>::all(client.clone()),
                cluster.as_str(),
            )
            .await?
        }
        Err(_) => None,
    };
    // Only the proxy-agent's subject names the CA.
    let expected_unit = if csr.spec.signer_name == PROXY_AGENT_SIGNER {
        let secrets = Api::<Secret>::namespaced(client.clone(), &context.settings.hub_namespace);
        get_opt(&secrets, CA_BUNDLE_SECRET)
            .await?
            .and_then(|secret| secret.data)
            .and_then(|mut data| data.remove(CA_BUNDLE_KEY))
            .filter(|pem| !pem.0.is_empty())
            .map(|pem| super::render::signer_organization_unit(&pem.0))
    } else {
        None
    };
    match decide(&csr, cluster.as_ref(), expected_unit.as_deref()) {
        Approval::Ignore(_) => {}
        Approval::Leave(why) => {
            context.metrics.csr_decision("left");
            tracing::warn!(csr = %name, signer = %csr.spec.signer_name, reason = %why, "not approving an addon CSR; left for an administrator");
        }
        Approval::Approve { cluster } => {
            let api = Api::<CertificateSigningRequest>::all(client.clone());
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            api.replace_subresource(
                "approval",
                &name,
                &PostParams::default(),
                &approved(&csr, &cluster, now),
            )
            .await
            .map_err(AddonError::api(format!("approving CSR {name}")))?;
            context.metrics.csr_decision("approved");
            tracing::info!(csr = %name, %cluster, signer = %csr.spec.signer_name, "approved an addon CSR");
        }
    }
    Ok(Action::await_change())
}

fn error_policy(
    csr: Arc<CertificateSigningRequest>,
    error: &AddonError,
    context: Arc<Context>,
) -> Action {
    requeue_failed(&context.metrics, CONTROLLER, &csr.name_any(), error)
}

/// CSRs looked at, at most, at the same time. Unbounded (kube's default),
/// a fleet asking at once has the controller make a request for every CSR
/// at once: a connection each (measured: 10,000 CSRs ran the process of
/// `examples/csr_scale.rs`, API included, out of its 20,000 descriptors),
/// far past what an API server serves in flight.
pub const CONCURRENT_RECONCILES: u16 = 32;

/// ManagedCluster events taken together, at most, for one look at every
/// CSR (those already waiting when the controller polls the stream).
const CLUSTER_EVENT_BURST: usize = 4096;

/// The CSR approval controller, as a stream of reconcile results. It
/// watches only CSRs labelled for the addon (both signers: a field selector
/// cannot name two); a ManagedCluster change (say, `hubAcceptsClient`
/// turning true) looks at them all again, once per burst of changes.
pub fn controller(
    context: Arc<Context>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> impl Stream<Item = ()> + Send {
    use kube::runtime::WatchStreamExt;
    let client = context.client.clone();
    let ours = watcher::Config::default().labels(&format!("{LABEL_ADDON_NAME}={ADDON_NAME}"));
    let clusters = watcher(
        Api::<ManagedCluster>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .touched_objects()
    .filter_map(|result| async move { result.ok().map(|_| ()) })
    // One look at every CSR per burst of cluster events, not one per
    // event: a (re)list delivers every ManagedCluster at once, and with
    // 10,000 clusters and as many CSRs one look each is 10^8 reconcile
    // requests for the controller to queue.
    .ready_chunks(CLUSTER_EVENT_BURST)
    .map(|_| ());
    Controller::new(Api::<CertificateSigningRequest>::all(client), ours)
        .with_config(controller::Config::default().concurrency(CONCURRENT_RECONCILES))
        .reconcile_all_on(clusters)
        .graceful_shutdown_on(shutdown)
        .run(
            |object, context| crate::trace::traced(CONTROLLER, object, context, reconcile),
            error_policy,
            context,
        )
        .map(|result| {
            if let Err(error) = result {
                tracing::debug!(%error, "CSR controller event");
            }
        })
}

//! The `kubernetes` backend: the PKI in Secrets ([`secrets`]), proxy-agent
//! certificates through CertificateSigningRequests ([`csr`]), and leader
//! election on a Lease ([`leader`]) so that of several replicas exactly one
//! writes. Every write is a server-side apply by field manager
//! [`FIELD_MANAGER`].

pub mod csr;
pub mod leader;
pub mod secrets;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client};
use time::OffsetDateTime;

use crate::authority::{AuthorityError, Desired};
use crate::pki::Authority;
use crate::rotation::{LeafPolicy, RolloverPolicy};

pub const FIELD_MANAGER: &str = "cluster-proxy-cert-authority";
pub const LEASE_NAME: &str = "cluster-proxy-cert-authority";

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    #[error("Secret {name}: {detail}")]
    BadSecret { name: String, detail: String },
    #[error("another replica ({0}) holds the lease")]
    NotLeader(String),
}

/// What the backend keeps, and where.
#[derive(Debug, Clone)]
pub struct KubeOptions {
    /// Where the hub Secrets and the Lease live.
    pub namespace: String,
    pub signer_secret_name: String,
    pub signer_secret_namespace: String,
    /// Extra SANs of both server certificates.
    pub additional_sans: Vec<String>,
    /// The in-cluster Service hub clients and agents dial.
    pub service_name: String,
    pub leaf_policy: LeafPolicy,
    pub rollover_policy: RolloverPolicy,
    /// How often the Secrets are checked.
    pub interval: Duration,
    /// This replica's name in the Lease.
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_every: Duration,
}

impl KubeOptions {
    pub fn new(namespace: &str) -> Self {
        let host = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "cert-authority".into());
        KubeOptions {
            namespace: namespace.to_string(),
            signer_secret_name: "cluster-proxy-signer".into(),
            signer_secret_namespace: namespace.to_string(),
            additional_sans: Vec::new(),
            service_name: "proxy-entrypoint".into(),
            leaf_policy: LeafPolicy::default(),
            rollover_policy: RolloverPolicy::default(),
            interval: Duration::from_secs(60),
            identity: format!("{host}_{:08x}", rand::random::<u32>()),
            lease_duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
        }
    }

    /// The server certificates' SANs: upstream's common SANs (local names,
    /// the Service's in-cluster names) plus the additional ones.
    pub fn desired(&self) -> Desired {
        let mut sans = self.additional_sans.clone();
        sans.push(format!("{}.{}", self.service_name, self.namespace));
        sans.push(format!("{}.{}.svc", self.service_name, self.namespace));
        Desired {
            outside_leaves_on_previous: 0,
            clusters: Vec::new(),
            server_sans: crate::files::server_sans(&sans),
            leaf_policy: self.leaf_policy.clone(),
            rollover_policy: self.rollover_policy.clone(),
        }
    }

    fn elector(&self, client: &Client) -> leader::Elector {
        leader::Elector {
            api: Api::<Lease>::namespaced(client.clone(), &self.namespace),
            name: LEASE_NAME.into(),
            identity: self.identity.clone(),
            lease_duration_seconds: i32::try_from(self.lease_duration.as_secs()).unwrap_or(15),
        }
    }
}

/// The signing CA as stored now (it changes on a rollover).
async fn current_signer(
    client: &Client,
    options: &KubeOptions,
) -> Result<Option<Authority>, KubeError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &options.signer_secret_namespace);
    let Some(secret) = api.get_opt(&options.signer_secret_name).await? else {
        return Ok(None);
    };
    let data = secrets::texts(&secret)?;
    let (Some(cert), Some(key)) = (data.get("ca.crt"), data.get("ca.key")) else {
        return Ok(None);
    };
    Authority::from_pem(cert, key)
        .map(Some)
        .map_err(|e| KubeError::BadSecret {
            name: options.signer_secret_name.clone(),
            detail: e.to_string(),
        })
}

/// Signs or refuses every pending CSR once.
pub async fn sign_pending(
    client: &Client,
    options: &KubeOptions,
) -> Result<Vec<csr::Decision>, KubeError> {
    let Some(signer) = current_signer(client, options).await? else {
        return Ok(Vec::new());
    };
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let mut decisions = Vec::new();
    for item in api.list(&Default::default()).await? {
        decisions.push(
            csr::reconcile_csr(
                &api,
                Arc::new(item),
                &signer,
                options.leaf_policy.validity,
                OffsetDateTime::now_utc(),
            )
            .await?,
        );
    }
    Ok(decisions)
}

/// One pass, as `run --once`: take the lease (or fail), reconcile the
/// Secrets, sign what is pending, release.
pub async fn run_once(
    client: &Client,
    options: &KubeOptions,
) -> Result<crate::authority::Report, KubeError> {
    let elector = options.elector(client);
    if !elector.try_lead(OffsetDateTime::now_utc()).await? {
        let holder = elector
            .api
            .get_opt(LEASE_NAME)
            .await?
            .and_then(|l| l.spec.and_then(|s| s.holder_identity))
            .unwrap_or_default();
        return Err(KubeError::NotLeader(holder));
    }
    let report = secrets::reconcile_secrets(
        client,
        options,
        &options.desired(),
        OffsetDateTime::now_utc(),
    )
    .await?;
    sign_pending(client, options).await?;
    elector.release().await?;
    Ok(report)
}

struct CsrContext {
    client: Client,
    options: KubeOptions,
    leading: Arc<AtomicBool>,
}

async fn reconcile_csr(
    object: Arc<CertificateSigningRequest>,
    ctx: Arc<CsrContext>,
) -> Result<Action, KubeError> {
    if !ctx.leading.load(Ordering::SeqCst) {
        // Another replica signs; look again in case we take over.
        return Ok(Action::requeue(ctx.options.renew_every));
    }
    let Some(signer) = current_signer(&ctx.client, &ctx.options).await? else {
        return Ok(Action::requeue(ctx.options.renew_every));
    };
    let api: Api<CertificateSigningRequest> = Api::all(ctx.client.clone());
    csr::reconcile_csr(
        &api,
        object,
        &signer,
        ctx.options.leaf_policy.validity,
        OffsetDateTime::now_utc(),
    )
    .await?;
    Ok(Action::await_change())
}

fn csr_error_policy(
    _: Arc<CertificateSigningRequest>,
    error: &KubeError,
    _: Arc<CsrContext>,
) -> Action {
    tracing::warn!(%error, "CSR reconcile failed; retrying");
    Action::requeue(Duration::from_secs(10))
}

/// Runs until `shutdown` completes: keeps the Lease, and while leading
/// keeps the Secrets current every `interval` and signs approved CSRs as
/// they come.
pub async fn run(
    client: Client,
    options: KubeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KubeError> {
    let leading = Arc::new(AtomicBool::new(false));
    let ctx = Arc::new(CsrContext {
        client: client.clone(),
        options: options.clone(),
        leading: leading.clone(),
    });
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let controller = Controller::new(csrs, watcher::Config::default())
        .run(reconcile_csr, csr_error_policy, ctx)
        .for_each(|_| async {});
    let controller = tokio::spawn(controller);
    let elector = options.elector(&client);
    let desired = options.desired();
    let mut last_pass: Option<tokio::time::Instant> = None;
    let mut ticker = tokio::time::interval(options.renew_every);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        let now = OffsetDateTime::now_utc();
        let lead = match elector.try_lead(now).await {
            Ok(lead) => lead,
            Err(error) => {
                // Cannot tell whether we still lead: stop writing at once.
                tracing::warn!(%error, "cannot renew the lease");
                false
            }
        };
        if leading.swap(lead, Ordering::SeqCst) && !lead {
            tracing::warn!("lost the lease; no longer writing");
        }
        if !lead {
            last_pass = None;
            continue;
        }
        if last_pass.is_none_or(|at| at.elapsed() >= options.interval) {
            match secrets::reconcile_secrets(&client, &options, &desired, now).await {
                Ok(report) => {
                    if !report.renewed.is_empty() || report.rollover.is_some() {
                        tracing::info!(renewed = ?report.renewed, rollover = ?report.rollover, "PKI updated");
                    }
                    last_pass = Some(tokio::time::Instant::now());
                }
                Err(error) => {
                    tracing::warn!(%error, "reconciling the PKI Secrets failed; retrying")
                }
            }
        }
    }
    leading.store(false, Ordering::SeqCst);
    controller.abort();
    elector.release().await
}

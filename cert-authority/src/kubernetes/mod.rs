//! The `kubernetes` backend: the PKI in Secrets ([`secrets`]), proxy-agent
//! certificates through CertificateSigningRequests ([`csr`]), and leader
//! election on a Lease ([`leader`]) so that of several replicas exactly one
//! writes. Every write is a server-side apply by field manager
//! [`FIELD_MANAGER`]. With a ManagedProxyConfiguration to follow
//! ([`follow`]), the hub leaf Secrets' namespace, names and SANs come from
//! it, and their conditions go onto its status.

mod common;
pub mod csr;
pub mod follow;
pub mod leader;
pub mod metrics;
mod options;
pub mod rbac;
pub mod secrets;

pub use self::common::{
    FIELD_MANAGER, KubeError, LEASE_NAME, MANAGED_BY_LABEL, USER_AGENT, client, identify,
};
pub use self::options::KubeOptions;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use time::OffsetDateTime;
use tokio::sync::{Notify, watch};
use tracing::Instrument;

use self::follow::{Following, Target};
use self::metrics::Metrics;
use crate::pki::Authority;

/// These options with what `target` asks for: its namespace for the hub
/// Secrets, its Secret names and Service name, and its SANs after the
/// ones given here. The Lease and the signer Secret stay where they are.
fn options_following(options: &KubeOptions, target: &Target) -> KubeOptions {
    let mut options = options.clone();
    options.namespace = target.namespace.clone();
    options.service_name = target.service_name.clone();
    options.secret_names = target.secret_names.clone();
    options.user_server_additional_sans = target.user_server_additional_sans.clone();
    for san in &target.sans {
        if !options.additional_sans.contains(san) {
            options.additional_sans.push(san.clone());
        }
    }
    options
}

fn elector(options: &KubeOptions, client: &Client) -> leader::Elector {
    leader::Elector {
        api: Api::<Lease>::namespaced(client.clone(), &options.namespace),
        name: LEASE_NAME.into(),
        identity: options.identity.clone(),
        lease_duration_seconds: i32::try_from(options.lease_duration.as_secs()).unwrap_or(15),
    }
}

/// The signing CA as the last pass over the Secrets stored it. CSR events
/// read it from here: the Secret is read once per pass, never per event.
type SignerCache = Arc<RwLock<Option<Arc<Authority>>>>;

/// What [`CsrSigner::handle`] did with one CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CsrOutcome {
    /// For another signer: not looked at further.
    NotOurs,
    /// Another replica leads and signs.
    NotLeading,
    /// No pass has stored and read the CA yet.
    NoSignerYet,
    Decided(csr::Decision),
}

/// Signs or refuses CSRs with the cached signing CA while this replica
/// leads.
#[derive(Clone)]
pub struct CsrSigner {
    api: Api<CertificateSigningRequest>,
    signer: SignerCache,
    leading: Arc<AtomicBool>,
    validity: Duration,
    metrics: Metrics,
}

impl CsrSigner {
    pub fn new(client: &Client, validity: Duration) -> Self {
        CsrSigner {
            api: Api::all(client.clone()),
            signer: Arc::default(),
            leading: Arc::default(),
            validity,
            metrics: Metrics::default(),
        }
    }

    /// Counts decisions into `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Replaces the cached signing CA (`None`: sign nothing).
    pub fn set_signer(&self, signer: Option<Arc<Authority>>) {
        *self.signer.write().unwrap_or_else(PoisonError::into_inner) = signer;
    }

    pub fn set_leading(&self, leading: bool) {
        self.leading.store(leading, Ordering::SeqCst);
    }

    fn signer(&self) -> Option<Arc<Authority>> {
        self.signer
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Acts on one CSR event. The signer name is checked before anything
    /// else, so other signers' CSRs cost no request and no lock.
    pub async fn handle(
        &self,
        object: Arc<CertificateSigningRequest>,
    ) -> Result<CsrOutcome, KubeError> {
        if object.spec.signer_name != csr::SIGNER_NAME {
            return Ok(CsrOutcome::NotOurs);
        }
        if !self.leading.load(Ordering::SeqCst) {
            return Ok(CsrOutcome::NotLeading);
        }
        let Some(signer) = self.signer() else {
            return Ok(CsrOutcome::NoSignerYet);
        };
        let decision = csr::reconcile_csr(
            &self.api,
            object,
            &signer,
            self.validity,
            OffsetDateTime::now_utc(),
        )
        .await?;
        self.metrics.csr_decided(&decision);
        Ok(CsrOutcome::Decided(decision))
    }
}

/// Signs or refuses every pending CSR for our signer once, with `signer`.
pub async fn sign_pending(
    client: &Client,
    options: &KubeOptions,
    signer: Arc<Authority>,
) -> Result<Vec<csr::Decision>, KubeError> {
    let signing = CsrSigner::new(client, options.leaf_policy.validity);
    signing.set_signer(Some(signer));
    signing.set_leading(true);
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let mut decisions = Vec::new();
    for item in api.list(&csr::own_signer_only()).await? {
        if let CsrOutcome::Decided(decision) = signing.handle(Arc::new(item)).await? {
            decisions.push(decision);
        }
    }
    Ok(decisions)
}

/// One pass, as `run --once`: take the lease (or fail), reconcile the
/// Secrets, sign what is pending, release.
pub async fn run_once(
    client: &Client,
    options: &KubeOptions,
) -> Result<crate::authority::Report, KubeError> {
    let elector = elector(options, client);
    if !elector.try_lead(OffsetDateTime::now_utc()).await? {
        let holder = elector
            .api
            .get_opt(LEASE_NAME)
            .await?
            .and_then(|l| l.spec.and_then(|s| s.holder_identity))
            .unwrap_or_default();
        return Err(KubeError::NotLeader(holder));
    }
    let span = pass_span(options);
    let result =
        cluster_proxy_runtime::telemetry::in_reconcile_span(span, pass_once(client, options)).await;
    elector.release().await?;
    result
}

async fn pass_once(
    client: &Client,
    options: &KubeOptions,
) -> Result<crate::authority::Report, KubeError> {
    let now = OffsetDateTime::now_utc();
    let Some(name) = &options.managed_proxy_configuration else {
        let pass = secrets::pass(client, options, &options.desired(), now).await?;
        sign_pending(client, options, pass.signer).await?;
        return Ok(pass.report);
    };
    match follow::read(client, name).await? {
        Following::Missing(reason) => Err(KubeError::Configuration(reason)),
        Following::Invalid { reason, generation } => {
            follow::publish_conditions(
                client,
                name,
                &follow::unsigned_conditions(&reason),
                generation,
                now,
            )
            .await?;
            Err(KubeError::Configuration(reason))
        }
        Following::Ready(target) => {
            let effective = options_following(options, &target);
            let pass = secrets::pass(client, &effective, &effective.desired(), now).await?;
            let conditions = follow::certificate_conditions(&target, &pass.certificates);
            follow::publish_conditions(client, name, &conditions, target.generation, now).await?;
            sign_pending(client, options, pass.signer).await?;
            Ok(pass.report)
        }
    }
}

/// The span of one pass over the PKI Secrets, named after the signer.
fn pass_span(options: &KubeOptions) -> tracing::Span {
    cluster_proxy_runtime::telemetry::reconcile_span(
        "cert-authority",
        "Secret",
        &options.signer_secret_name,
        Some(&options.signer_secret_namespace),
    )
}

/// CSRs signed, at most, at the same time. Unbounded (kube's default), a
/// fleet asking at once has every signed certificate written at once, a
/// connection to the API server each.
pub const CONCURRENT_SIGNINGS: u16 = 32;

struct CsrContext {
    signer: CsrSigner,
    retry_after: Duration,
}

async fn reconcile_csr(
    object: Arc<CertificateSigningRequest>,
    ctx: Arc<CsrContext>,
) -> Result<Action, KubeError> {
    let span = cluster_proxy_runtime::telemetry::reconcile_span(
        "cert-authority",
        "CertificateSigningRequest",
        &object.name_any(),
        None,
    );
    let outcome =
        cluster_proxy_runtime::telemetry::in_reconcile_span(span, ctx.signer.handle(object))
            .await?;
    Ok(match outcome {
        CsrOutcome::NotOurs | CsrOutcome::Decided(_) => Action::await_change(),
        // Look again: this replica may take over, or a pass store the CA.
        CsrOutcome::NotLeading | CsrOutcome::NoSignerYet => Action::requeue(ctx.retry_after),
    })
}

fn csr_error_policy(
    _: Arc<CertificateSigningRequest>,
    error: &KubeError,
    _: Arc<CsrContext>,
) -> Action {
    tracing::warn!(%error, "CSR reconcile failed; retrying");
    Action::requeue(Duration::from_secs(10))
}

/// Watches the Secrets this authority keeps (its own, by label, and the
/// signer, by name) and wakes `kick` on every change, so that a deleted or
/// edited Secret is repaired at once rather than at the next interval.
async fn watch_owned_secrets(client: Client, options: KubeOptions, kick: Arc<Notify>) {
    let owned = watcher(
        Api::<Secret>::namespaced(client.clone(), &options.namespace),
        watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={FIELD_MANAGER}")),
    )
    .default_backoff();
    let signer = watcher(
        Api::<Secret>::namespaced(client, &options.signer_secret_namespace),
        watcher::Config::default().fields(&format!("metadata.name={}", options.signer_secret_name)),
    )
    .default_backoff();
    let mut events = std::pin::pin!(futures_util::stream::select(owned, signer));
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                kick.notify_one();
            }
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Err(error) => tracing::warn!(%error, "watching the PKI Secrets failed; retrying"),
        }
    }
}

/// Puts a Warning Event on the signer Secret, so `kubectl describe` and
/// event-based alerting show why nothing is written. Repeats become one
/// Event series.
async fn report_damaged_signer(recorder: &Recorder, options: &KubeOptions, error: &KubeError) {
    let regarding = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Secret".into()),
        name: Some(options.signer_secret_name.clone()),
        namespace: Some(options.signer_secret_namespace.clone()),
        ..ObjectReference::default()
    };
    // An Event's note holds at most 1 kB.
    let mut note = error.to_string();
    if note.len() > EVENT_NOTE_LIMIT {
        let mut end = EVENT_NOTE_LIMIT;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
    }
    let event = Event {
        type_: EventType::Warning,
        reason: "SignerDamaged".into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, &regarding).await {
        tracing::warn!(%error, "could not record an Event about the damaged signer Secret");
    }
}

const EVENT_NOTE_LIMIT: usize = 1024;

/// Runs until `shutdown` completes: keeps the Lease, and while leading
/// keeps the Secrets current (every `interval`, and at once when one of
/// them or the followed ManagedProxyConfiguration changes), writes the
/// certificate conditions, and signs approved CSRs as they come. While the
/// followed configuration is missing or unusable no Secret is written.
pub async fn run(
    client: Client,
    options: KubeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KubeError> {
    run_with_metrics(client, options, Metrics::default(), shutdown).await
}

/// [`run`], counting into `metrics` (see [`Metrics::register`]).
pub async fn run_with_metrics(
    client: Client,
    options: KubeOptions,
    metrics: Metrics,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KubeError> {
    let signing =
        CsrSigner::new(&client, options.leaf_policy.validity).with_metrics(metrics.clone());
    let ctx = Arc::new(CsrContext {
        signer: signing.clone(),
        retry_after: options.renew_every,
    });
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let controller = Controller::new(
        csrs,
        watcher::Config::default().fields(&csr::own_signer_field_selector()),
    )
    .with_config(controller::Config::default().concurrency(CONCURRENT_SIGNINGS))
    .run(reconcile_csr, csr_error_policy, ctx)
    .for_each(|_| async {});
    let controller = tokio::spawn(controller);
    let kick = Arc::new(Notify::new());
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some(options.identity.clone()),
        },
    );
    let elector = elector(&options, &client);
    let initial = match &options.managed_proxy_configuration {
        Some(name) => Following::Missing(format!("ManagedProxyConfiguration {name} not read yet")),
        None => Following::Ready(Target {
            namespace: options.namespace.clone(),
            service_name: options.service_name.clone(),
            secret_names: options.secret_names.clone(),
            sans: Vec::new(),
            ignored_sans: Vec::new(),
            generation: None,
            user_server_additional_sans: options.user_server_additional_sans.clone(),
        }),
    };
    let (follow_tx, mut follow_rx) = watch::channel(initial);
    let follow_tx = Arc::new(follow_tx);
    let follower = options
        .managed_proxy_configuration
        .clone()
        .map(|name| tokio::spawn(follow::follow(client.clone(), name, follow_tx.clone())));
    // The Secret watch, and the namespace it watches: restarted when the
    // followed configuration moves the Secrets.
    let mut secret_watch: Option<(String, tokio::task::JoinHandle<()>)> = None;
    // The configuration state last logged, so a wait is said once.
    let mut logged: Option<Following> = None;
    let mut leading = false;
    // When the next pass is due; `None`: at once.
    let mut next_pass: Option<tokio::time::Instant> = None;
    let mut ticker = tokio::time::interval(options.renew_every);
    tokio::pin!(shutdown);
    loop {
        let kicked = tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => false,
            _ = kick.notified() => true,
            // Never an error: `follow_tx` lives as long as this loop.
            _ = follow_rx.changed() => true,
        };
        if !kicked {
            let lead = match elector.try_lead(OffsetDateTime::now_utc()).await {
                Ok(lead) => lead,
                Err(error) => {
                    // Cannot tell whether we still lead: stop writing at once.
                    tracing::warn!(%error, "cannot renew the lease");
                    false
                }
            };
            if lead && !leading {
                tracing::info!(identity = %options.identity, "leading: keeping the PKI Secrets and signing CSRs");
            } else if leading && !lead {
                tracing::warn!(identity = %options.identity, "lost the lease; no longer writing or signing");
                // Another leader may roll the CA over meanwhile.
                signing.set_signer(None);
            }
            leading = lead;
            signing.set_leading(lead);
            metrics.set_leader(lead);
        }
        if !leading {
            next_pass = None;
            continue;
        }
        if !kicked && next_pass.is_some_and(|at| tokio::time::Instant::now() < at) {
            continue;
        }
        let following = follow_rx.borrow_and_update().clone();
        let newly = logged.as_ref() != Some(&following);
        logged = Some(following.clone());
        let now = OffsetDateTime::now_utc();
        let target = match following {
            Following::Ready(target) => target,
            Following::Missing(reason) => {
                metrics.set_waiting_for_configuration(true);
                if newly {
                    tracing::warn!(%reason, "waiting for the ManagedProxyConfiguration: writing no Secret until it exists");
                }
                continue;
            }
            Following::Invalid { reason, generation } => {
                metrics.set_waiting_for_configuration(true);
                if newly {
                    tracing::error!(%reason, "the ManagedProxyConfiguration cannot be followed: writing no Secret until it is fixed");
                }
                let name = options
                    .managed_proxy_configuration
                    .as_deref()
                    .unwrap_or_default();
                let conditions = follow::unsigned_conditions(&reason);
                next_pass = match follow::publish_conditions(
                    &client,
                    name,
                    &conditions,
                    generation,
                    now,
                )
                .await
                {
                    Ok(_) => Some(tokio::time::Instant::now() + options.interval),
                    Err(error) => {
                        tracing::warn!(%error, "writing the certificate conditions failed; retrying");
                        None
                    }
                };
                continue;
            }
        };
        metrics.set_waiting_for_configuration(false);
        if newly && options.managed_proxy_configuration.is_some() {
            tracing::info!(namespace = %target.namespace, sans = ?target.sans, "following the ManagedProxyConfiguration");
            if !target.ignored_sans.is_empty() {
                tracing::warn!(ignored = ?target.ignored_sans, "SANs of the ManagedProxyConfiguration that are neither an IP address nor a DNS name are left out of the certificates");
            }
        }
        let effective = options_following(&options, &target);
        if secret_watch.as_ref().map(|(namespace, _)| namespace) != Some(&effective.namespace) {
            if let Some((_, old)) = secret_watch.take() {
                old.abort();
            }
            let task = tokio::spawn(watch_owned_secrets(
                client.clone(),
                effective.clone(),
                kick.clone(),
            ));
            secret_watch = Some((effective.namespace.clone(), task));
        }
        let pass = pass_span(&effective);
        let passed = secrets::pass(&client, &effective, &effective.desired(), now)
            .instrument(pass.clone())
            .await;
        cluster_proxy_runtime::telemetry::record_outcome(&pass, &passed);
        match passed {
            Ok(pass) => {
                let report = pass.report;
                metrics.pass_succeeded(&report, now);
                if !report.renewed.is_empty() || report.rollover.is_some() {
                    tracing::info!(renewed = ?report.renewed, rollover = ?report.rollover, "PKI updated");
                }
                signing.set_signer(Some(pass.signer));
                next_pass = Some(tokio::time::Instant::now() + options.interval);
                if let Some(name) = &options.managed_proxy_configuration {
                    let conditions = follow::certificate_conditions(&target, &pass.certificates);
                    if let Err(error) = follow::publish_conditions(
                        &client,
                        name,
                        &conditions,
                        target.generation,
                        now,
                    )
                    .await
                    {
                        tracing::warn!(%error, "writing the certificate conditions failed; retrying");
                        next_pass = None;
                    }
                }
            }
            Err(error) if error.is_damaged_signer() => {
                metrics.pass_failed(true);
                // Retrying cannot help until a person repairs the Secret;
                // the signer watch wakes us as soon as it changes.
                tracing::error!(%error, "the signer Secret is damaged: writing nothing and signing nothing until it is repaired");
                signing.set_signer(None);
                report_damaged_signer(&recorder, &options, &error).await;
                next_pass = Some(tokio::time::Instant::now() + options.interval);
            }
            Err(error) => {
                metrics.pass_failed(false);
                tracing::warn!(%error, "reconciling the PKI Secrets failed; retrying");
                next_pass = None;
            }
        }
    }
    signing.set_leading(false);
    metrics.set_leader(false);
    controller.abort();
    if let Some((_, task)) = secret_watch {
        task.abort();
    }
    if let Some(task) = follower {
        task.abort();
    }
    // Shutting down anyway: a Lease it can no longer release (its account
    // and RBAC deleted with it by `helm uninstall`) expires on its own, as
    // addon-manager and health-prober treat theirs.
    if let Err(error) = elector.release().await {
        tracing::warn!(%error, "releasing the leader Lease");
    }
    Ok(())
}

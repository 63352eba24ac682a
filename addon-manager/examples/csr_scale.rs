//! Many managed clusters asking for their proxy-agent certificate at once:
//! the addon-manager's CSR approver and cert-authority's signer, both as
//! their binaries run them (`addon::run`, `kubernetes::run_with_metrics`,
//! default settings), against the in-memory Kubernetes API with every
//! request recorded.
//!
//! ```sh
//! cargo run --release -p addon-manager --example csr_scale
//! CP_CSR_CLUSTERS=10000 cargo run --release -p addon-manager --example csr_scale
//! ```
//!
//! Each of `CP_CSR_CLUSTERS` (1000) clusters has a ManagedCluster the hub
//! accepts; its registration agent, as OCM's, makes a fresh key and a
//! PKCS#10 request for the subject the addon's registration names (user,
//! group, the current CA's organizational unit) and creates a CSR for
//! `open-cluster-management.io/proxy-agent-signer` as its own identity
//! (`system:open-cluster-management:<cluster>:<agent>`, impersonated), with
//! OCM's labels. `CP_CSR_CONCURRENCY` (64) agents submit at a time: the
//! whole fleet joining at once is the worst case. The example reports how
//! long until every CSR is approved and carries a certificate, the rate, the
//! controllers' API requests per CSR (by verb and resource), their CPU time
//! (each controller runs on its own runtime, `CP_CSR_CONTROLLER_THREADS`
//! (2) threads, measured from /proc), and the process's resident set.
//!
//! Then the fleet's rotation: cert-authority's own renewal rule
//! (`rotation::leaf_decision`, as it times the agent leaves it keeps in the
//! files backend) applied to the certificates just issued, with the
//! default renewal jitter and without it: the window the renewals spread
//! over and the most renewals due in one minute and in one hour.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use addon_manager::addon::render::{
    CLUSTER_PROXY_GROUP, PROXY_AGENT_USER, signer_organization_unit,
};
use addon_manager::addon::{self, AddonMetrics, AddonSettings};
use anyhow::{Context as _, bail};
use cert_authority::kubernetes::{self as authority, KubeOptions};
use cert_authority::rotation::{LeafDecision, LeafPolicy, leaf_decision};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::json;
use time::OffsetDateTime;

const HUB: &str = "open-cluster-management-addon";
const SIGNER: &str = "open-cluster-management.io/proxy-agent-signer";
/// The users the two controllers run as: only their requests are counted.
const APPROVER_USER: &str = "cluster-proxy-addon-manager";
const SIGNER_USER: &str = "cluster-proxy-cert-authority";
/// The names of the controllers' runtime threads (/proc/<pid>/task/*/comm).
const APPROVER_THREAD: &str = "csr-approver";
const SIGNER_THREAD: &str = "csr-signer";

/// A benchmark knob: the environment variable as a number, or `default`.
fn knob(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{name}={value:?} is not a whole number")),
        Err(_) => Ok(default),
    }
}

/// This process's resident set, in MiB.
fn rss_mib() -> anyhow::Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .context("/proc/self/status has no VmRSS")?;
    Ok(kib / 1024.0)
}

/// The CPU seconds (user + system) in a /proc `stat` file.
fn stat_cpu_seconds(stat: &str) -> anyhow::Result<f64> {
    // utime and stime: fields 14 and 15, the 12th and 13th after the
    // parenthesized command name.
    let fields: Vec<&str> = stat
        .rfind(')')
        .and_then(|end| stat.get(end + 2..))
        .context("a stat file without a command name")?
        .split(' ')
        .collect();
    let mut ticks = 0.0;
    for index in [11, 12] {
        ticks += fields
            .get(index)
            .and_then(|value| value.parse::<f64>().ok())
            .context("a short stat file")?;
    }
    // USER_HZ is 100 on Linux.
    Ok(ticks / 100.0)
}

/// CPU seconds of this process's threads named `name`.
fn thread_cpu_seconds(name: &str) -> anyhow::Result<f64> {
    let mut seconds = 0.0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let path = task?.path();
        // A thread may end between the listing and the reads.
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("stat")),
        ) else {
            continue;
        };
        if comm.trim() == name {
            seconds += stat_cpu_seconds(&stat)?;
        }
    }
    Ok(seconds)
}

/// CPU seconds of the whole process.
fn process_cpu_seconds() -> anyhow::Result<f64> {
    stat_cpu_seconds(&std::fs::read_to_string("/proc/self/stat")?)
}

/// The requests of `user` recorded since `from`, by "verb resource[/sub]".
/// The record also holds the API server's own authorization checks of an
/// approval or a certificate against the signer (`approve signers`, `sign
/// signers`): no request of the controller's, left out.
fn requests_of(api: &KubeApi, user: &str, from: usize) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for request in api
        .requests()
        .iter()
        .skip(from)
        .filter(|request| request.user == user && request.resource != "signers")
    {
        let resource = match &request.subresource {
            Some(sub) => format!("{}/{sub}", request.resource),
            None => request.resource.clone(),
        };
        *counts
            .entry(format!("{} {resource}", request.verb))
            .or_insert(0) += 1;
    }
    counts
}

fn report_requests(who: &str, counts: &BTreeMap<String, usize>, csrs: usize) {
    let total: usize = counts.values().sum();
    println!(
        "  {who}: {total} API requests, {:.2} per CSR",
        total as f64 / csrs as f64
    );
    for (kind, count) in counts {
        println!("    {count:>8}  {kind}");
    }
}

/// Polls `check` every 50 ms until it holds, or fails after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let started = Instant::now();
    while !check().await? {
        if started.elapsed() > limit {
            bail!("{what}: not after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Starts `run` on a runtime of its own, `threads` threads named `name`, so
/// that its CPU time can be told apart. Returns the thread's handle.
fn spawn_controller<F, Fut>(
    name: &'static str,
    threads: usize,
    run: F,
) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<()>>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(name)
        .enable_all()
        .build()?;
    Ok(std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || runtime.block_on(run()))?)
}

/// A fresh key and a PEM PKCS#10 request for the proxy-agent's subject,
/// as OCM's registration agent makes them (an ECDSA P-256 key).
fn agent_request(unit: &str) -> anyhow::Result<String> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, PROXY_AGENT_USER);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, CLUSTER_PROXY_GROUP);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationalUnitName, unit);
    Ok(params.serialize_request(&key)?.pem()?)
}

/// Creates `cluster`'s CSR as its registration agent: the API server takes
/// `spec.username` and `spec.groups` from the (impersonated) requester.
async fn submit(client: &kube::Client, cluster: &str, pem: &str) -> anyhow::Result<String> {
    use base64::Engine;
    let object = json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {
            "generateName": format!("addon-{cluster}-{}-", addon::ADDON_NAME),
            "labels": {
                "open-cluster-management.io/cluster-name": cluster,
                "open-cluster-management.io/addon-name": addon::ADDON_NAME,
            },
        },
        "spec": {
            "signerName": SIGNER,
            "request": base64::engine::general_purpose::STANDARD.encode(pem.as_bytes()),
            "usages": ["digital signature", "key encipherment", "client auth"],
        },
    });
    let request = kube::core::Request::new(CertificateSigningRequest::url_path(&(), None));
    let mut request = request.create(&PostParams::default(), serde_json::to_vec(&object)?)?;
    let headers = request.headers_mut();
    headers.append(
        "impersonate-user",
        format!("system:open-cluster-management:{cluster}:registration-agent").try_into()?,
    );
    for group in [
        format!("system:open-cluster-management:{cluster}"),
        "system:open-cluster-management:managed-clusters".to_owned(),
    ] {
        headers.append("impersonate-group", group.try_into()?);
    }
    let created: CertificateSigningRequest = client.request(request).await?;
    Ok(created.name_any())
}

fn approved(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|condition| condition.type_ == "Approved" && condition.status == "True")
        })
}

fn certificate(csr: &CertificateSigningRequest) -> Option<&[u8]> {
    csr.status
        .as_ref()
        .and_then(|status| status.certificate.as_ref())
        .map(|certificate| certificate.0.as_slice())
        .filter(|certificate| !certificate.is_empty())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// When cert-authority's renewal rule, with `policy`, renews each of
/// `certificates`, summarized: the window and the most due in one minute
/// and in one hour.
fn renewal_spread(
    certificates: &[String],
    bundle: &str,
    policy: &LeafPolicy,
    now: OffsetDateTime,
) -> anyhow::Result<String> {
    let mut points = Vec::with_capacity(certificates.len());
    for pem in certificates {
        // Agent leaves carry no DNS or IP names.
        match leaf_decision(pem, &[], &[bundle.to_owned()], bundle, policy, now)? {
            LeafDecision::Keep { renew_at } => points.push(renew_at.unix_timestamp()),
            LeafDecision::Renew(reason) => bail!("a fresh certificate is due: {reason}"),
        }
    }
    points.sort_unstable();
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        bail!("no certificates");
    };
    let most_in = |width: i64| -> usize {
        let mut buckets: HashMap<i64, usize> = HashMap::new();
        for point in &points {
            *buckets.entry(point.div_euclid(width)).or_insert(0) += 1;
        }
        buckets.into_values().max().unwrap_or(0)
    };
    let days = |seconds: i64| seconds as f64 / 86_400.0;
    Ok(format!(
        "renewals from day {:.2} to day {:.2} after issue ({:.2} days); \
         at most {} in one minute, {} in one hour",
        days(first - now.unix_timestamp()),
        days(last - now.unix_timestamp()),
        days(last - first),
        most_in(60),
        most_in(3600),
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let clusters = knob("CP_CSR_CLUSTERS", 1000)?;
    let concurrency = knob("CP_CSR_CONCURRENCY", 64)?;
    let threads = knob("CP_CSR_CONTROLLER_THREADS", 2)?;
    let limit = Duration::from_secs(knob("CP_CSR_TIMEOUT_SECS", 1800)? as u64);
    let dir = tempfile::tempdir()?;
    let api = KubeApi::start(KubeApiOptions {
        record_requests: true,
        ..KubeApiOptions::new(dir.path())
    })
    .await?;
    api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)?;
    let admin = api.client().await?;
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": HUB}}))?,
        )
        .await?;

    // The fleet: one accepted ManagedCluster per cluster.
    let names: Vec<String> = (0..clusters)
        .map(|index| format!("cluster-{index:05}"))
        .collect();
    let managed_clusters = Api::<ManagedCluster>::all(admin.clone());
    futures_util::stream::iter(&names)
        .map(|name| {
            let managed_clusters = managed_clusters.clone();
            async move {
                let cluster: ManagedCluster = serde_json::from_value(
                    json!({"metadata": {"name": name}, "spec": {"hubAcceptsClient": true}}),
                )?;
                managed_clusters
                    .create(&PostParams::default(), &cluster)
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    let rss_before = rss_mib()?;
    println!(
        "{clusters} ManagedClusters; the approver and the signer start (RSS {rss_before:.0} MiB)"
    );

    // The controllers, each on its own runtime.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stopped_signal = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let approver_config = api.kubeconfig_for(APPROVER_USER, &["system:masters"])?;
    let approver_stopped = stopped.clone();
    let approver = spawn_controller(APPROVER_THREAD, threads, move || async move {
        let client = KubeApi::client_from(&approver_config).await?;
        addon::run(
            client,
            AddonSettings::new(HUB),
            AddonMetrics::default(),
            stopped_signal(approver_stopped),
        )
        .await;
        Ok(())
    })?;
    let signer_config = api.kubeconfig_for(SIGNER_USER, &["system:masters"])?;
    let signer_stopped = stopped.clone();
    let signer = spawn_controller(SIGNER_THREAD, threads, move || async move {
        let client = KubeApi::client_from(&signer_config).await?;
        let mut options = KubeOptions::new(HUB);
        options.identity = "cert-authority-0".into();
        authority::run(client, options, stopped_signal(signer_stopped)).await?;
        Ok(())
    })?;

    // Ready: the signer published the CA bundle, and both watch CSRs.
    let secrets = Api::<Secret>::namespaced(admin.clone(), HUB);
    let waited = Instant::now();
    let bundle = loop {
        let found = secrets
            .get_opt(addon::CA_BUNDLE_SECRET)
            .await?
            .and_then(|secret| secret.data)
            .and_then(|mut data| data.remove(addon::CA_BUNDLE_KEY))
            .filter(|pem| !pem.0.is_empty());
        if let Some(pem) = found {
            break String::from_utf8(pem.0)?;
        }
        if waited.elapsed() > limit {
            bail!("no CA bundle after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    wait_until("the controllers' CSR watches", limit, || async {
        let watching = |user: &str| {
            requests_of(&api, user, 0).contains_key("watch certificatesigningrequests")
        };
        Ok(watching(APPROVER_USER) && watching(SIGNER_USER))
    })
    .await?;
    // The addon controllers' own start (a look at every cluster) done: no
    // request of theirs for a second.
    let mut seen = requests_of(&api, APPROVER_USER, 0).values().sum::<usize>();
    let mut quiet_since = Instant::now();
    let waited = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(1) {
        if waited.elapsed() > limit {
            bail!("the addon controllers still busy after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = requests_of(&api, APPROVER_USER, 0).values().sum::<usize>();
        if now != seen {
            seen = now;
            quiet_since = Instant::now();
        }
    }
    let rss_ready = rss_mib()?;

    // Each agent's key and request, made before the clock starts.
    let unit = signer_organization_unit(bundle.as_bytes());
    let made = Instant::now();
    let requests = names
        .iter()
        .map(|_| agent_request(&unit))
        .collect::<anyhow::Result<Vec<String>>>()?;
    println!(
        "{clusters} keys and requests made in {:.2} s; the controllers ready (RSS {rss_ready:.0} MiB)",
        made.elapsed().as_secs_f64()
    );

    // The whole fleet asks at once; one watch sees every CSR's progress.
    let mark = api.requests().len();
    let cpu_before = (
        thread_cpu_seconds(APPROVER_THREAD)?,
        thread_cpu_seconds(SIGNER_THREAD)?,
        process_cpu_seconds()?,
    );
    let created_at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut progress = std::pin::pin!(
        watcher(
            Api::<CertificateSigningRequest>::all(admin.clone()),
            watcher::Config::default().fields(&format!("spec.signerName={SIGNER}")),
        )
        .default_backoff()
        .applied_objects()
    );
    let started = Instant::now();
    let created = created_at.clone();
    let submitted_client = admin.clone();
    let submitting = tokio::spawn(async move {
        futures_util::stream::iter(names.into_iter().zip(requests))
            .map(|(cluster, pem)| {
                let client = submitted_client.clone();
                let created = created.clone();
                async move {
                    let name = submit(&client, &cluster, &pem).await?;
                    created
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(name, Instant::now());
                    anyhow::Ok(())
                }
            })
            .buffer_unordered(concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        anyhow::Ok(started.elapsed())
    });
    let mut approved_at: HashMap<String, Instant> = HashMap::new();
    let mut signed_at: HashMap<String, Instant> = HashMap::new();
    let mut peak_rss = rss_ready;
    let mut last_rss = Instant::now();
    while signed_at.len() < clusters {
        let remaining = limit.saturating_sub(started.elapsed());
        let event = tokio::time::timeout(remaining, progress.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "after {limit:?}: {} of {clusters} approved, {} signed",
                    approved_at.len(),
                    signed_at.len()
                )
            })?;
        // A watch error (history expired) re-lists.
        let Some(Ok(csr)) = event else {
            if event.is_none() {
                bail!("the CSR watch ended");
            }
            continue;
        };
        let name = csr.name_any();
        let now = Instant::now();
        if approved(&csr) {
            approved_at.entry(name.clone()).or_insert(now);
        }
        if certificate(&csr).is_some() {
            signed_at.entry(name).or_insert(now);
        }
        if last_rss.elapsed() > Duration::from_millis(500) {
            peak_rss = peak_rss.max(rss_mib()?);
            last_rss = now;
        }
    }
    let took = started.elapsed();
    let submit_took = submitting.await??;
    peak_rss = peak_rss.max(rss_mib()?);
    let cpu = (
        thread_cpu_seconds(APPROVER_THREAD)? - cpu_before.0,
        thread_cpu_seconds(SIGNER_THREAD)? - cpu_before.1,
        process_cpu_seconds()? - cpu_before.2,
    );
    let last_approved = approved_at.values().max().map(|at| *at - started);
    // Each CSR's time from its creation to its certificate.
    let created = created_at
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let mut latencies: Vec<Duration> = signed_at
        .iter()
        .filter_map(|(name, signed)| Some(signed.saturating_duration_since(*created.get(name)?)))
        .collect();
    latencies.sort_unstable();
    println!(
        "{clusters} CSRs ({concurrency} agents at a time) submitted in {:.2} s; \
         all approved after {:.2} s, all signed after {:.2} s: {:.0} CSRs/s",
        submit_took.as_secs_f64(),
        last_approved.unwrap_or_default().as_secs_f64(),
        took.as_secs_f64(),
        clusters as f64 / took.as_secs_f64(),
    );
    println!(
        "  creation to certificate: p50 {:.2} s, p99 {:.2} s, max {:.2} s",
        percentile(&latencies, 0.5).as_secs_f64(),
        percentile(&latencies, 0.99).as_secs_f64(),
        percentile(&latencies, 1.0).as_secs_f64(),
    );
    println!(
        "  CPU: approver {:.2} s ({:.2} ms per CSR), signer {:.2} s ({:.2} ms per CSR), \
         the in-memory API and the agents {:.2} s; process RSS {rss_ready:.0} MiB ready, \
         peak {peak_rss:.0} MiB",
        cpu.0,
        cpu.0 * 1000.0 / clusters as f64,
        cpu.1,
        cpu.1 * 1000.0 / clusters as f64,
        cpu.2 - cpu.0 - cpu.1,
    );
    report_requests(
        &format!("approver ({APPROVER_USER})"),
        &requests_of(&api, APPROVER_USER, mark),
        clusters,
    );
    report_requests(
        &format!("signer ({SIGNER_USER})"),
        &requests_of(&api, SIGNER_USER, mark),
        clusters,
    );

    // The fleet's renewals, by cert-authority's renewal rule.
    let issued: Vec<String> = Api::<CertificateSigningRequest>::all(admin.clone())
        .list(&ListParams::default().fields(&format!("spec.signerName={SIGNER}")))
        .await?
        .items
        .iter()
        .filter_map(|csr| Some(String::from_utf8_lossy(certificate(csr)?).into_owned()))
        .collect();
    let now = OffsetDateTime::now_utc();
    let policy = LeafPolicy::default();
    println!(
        "rotation of these {} certificates (validity {:.0} days), cert-authority's renewal rule:",
        issued.len(),
        policy.validity.as_secs_f64() / 86_400.0
    );
    println!(
        "  with jitter (default): {}",
        renewal_spread(&issued, &bundle, &policy, now)?
    );
    let fixed = LeafPolicy {
        renew_jitter: 0.0,
        ..LeafPolicy::default()
    };
    println!(
        "  without jitter:        {}",
        renewal_spread(&issued, &bundle, &fixed, now)?
    );

    let _ = stop.send(true);
    for (name, thread) in [("approver", approver), ("signer", signer)] {
        let joined = tokio::task::spawn_blocking(move || thread.join());
        tokio::time::timeout(Duration::from_secs(30), joined)
            .await
            .with_context(|| format!("the {name} stops"))??
            .map_err(|_| anyhow::anyhow!("the {name} panicked"))??;
    }
    api.shutdown().await;
    Ok(())
}

//! The chart's RBAC held against the calls the hub services really make.
//!
//! The chart is rendered with its default values (Helm's own library, through
//! `charts/tests/check.py`'s renderer in the chart venv `target/chart-venv`,
//! which `.ci/run` creates). Its Namespaces, (Cluster)Roles and bindings are
//! loaded into the in-memory API with RBAC on, and addon-manager,
//! cert-authority and health-prober run as the chart's ServiceAccounts
//! through a control-plane scenario: two clusters join, get their agents,
//! certificates and `Available`, are probed through both replicas, the
//! agent entrypoint changes type and back, a cluster leaves, an addon names
//! an AddOnDeploymentConfig, every Lease is renewed, and a damaged signer
//! Secret makes cert-authority report it (an Event, then its repeat). Then:
//!
//! * no request of the three services was refused;
//! * every rendered rule was used by some request of a service bound to it,
//!   except the few in [`UNUSED_RULES`], each with the reason the scenario
//!   cannot trigger it.
//!
//! The API records every authorization decision
//! (`KubeApiOptions::record_requests`); it also plays kube-apiserver's
//! CSR signer admission (`approve` and `sign` on `signers`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use cluster_proxy_proto::api::addon::v1alpha1::{AddOnDeploymentConfig, ManagedClusterAddOn};
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use e2e::env::control_plane::{self, HubRbac};
use e2e::env::{ADDON_NAMESPACE, EnvOptions, Environment, Isolation, IsolationChoice};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::Role;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use memory_apiserver::rbac::RequestRecord;
use serde_json::{Value, json};

const READY: Duration = Duration::from_secs(180);
const CHANGE: Duration = Duration::from_secs(60);
/// What the addon-manager creates for the PortForward and LoadBalancer
/// entrypoints (reference §3).
const PORT_FORWARD_ROLE: &str = "cluster-proxy-addon-agent:portforward";
const LOAD_BALANCER_SERVICE: &str = "proxy-agent-entrypoint";
/// The Leases two services elect a leader on.
const LEASES: [&str; 2] = [
    "cluster-proxy-addon-manager",
    "cluster-proxy-cert-authority",
];
/// The label of health-prober's member Leases (one per replica, named by
/// its identity: health-prober/src/shards.rs).
const PROBER_MEMBER_SELECTOR: &str =
    "cluster-proxy.open-cluster-management.io/health-prober-member=true";
const SIGNER_SECRET: &str = "cluster-proxy-signer";

/// Rules the scenario cannot exercise, as (role, api group, resource, verb),
/// with the reason each stays in the chart.
const UNUSED_RULES: &[(&str, &str, &str, &str, &str)] = &[
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "",
        "services",
        "get",
        "the addon controller watches the hub namespace's Services and reads (get) only an \
         agents' LoadBalancer Service in another namespace; the chart's MPC uses none",
    ),
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "addon.open-cluster-management.io",
        "addondeploymentconfigs",
        "get",
        "the addon controller reads (get) an AddOnDeploymentConfig only when an addon names one \
         its watch does not hold, before reporting it missing; the scenario names none",
    ),
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "apps",
        "deployments",
        "delete",
        "the hub controller deletes the proxy-server Deployment it no longer wants when \
         spec.proxyServer.namespace moves; the scenario cannot move it (cert-authority's Role \
         exists only in the namespace the chart was installed for)",
    ),
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "",
        "serviceaccounts",
        "delete",
        "as the Deployment: only when spec.proxyServer.namespace moves",
    ),
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "",
        "namespaces",
        "create",
        "the chart makes the proxy-server namespace before addon-manager runs (cert-authority's \
         Role must be in it); addon-manager's apply creates it only for an MPC naming a namespace \
         the chart did not make, which the scenario cannot move to (as the Deployment's delete)",
    ),
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "rbac.authorization.k8s.io",
        "roles",
        "escalate",
        "kube-apiserver checks escalate/bind when addon-manager writes Roles granting what it \
         does not hold itself (leases, pods/portforward); the in-memory API does not play RBAC \
         escalation prevention",
    ),
    (
        "open-cluster-management:cluster-proxy:addon-manager",
        "rbac.authorization.k8s.io",
        "roles",
        "bind",
        "as escalate: checked by kube-apiserver's escalation prevention, not played here",
    ),
    (
        "open-cluster-management:cluster-proxy:health-prober",
        "coordination.k8s.io",
        "leases",
        "delete",
        "health-prober deletes its member Lease on SIGTERM, and other members' Leases 150 s \
         after they expired; the scenario checks before stopping it and kills no prober",
    ),
];

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The chart rendered with its default values, one JSON value per object;
/// `None` (after saying why) when the chart venv is missing outside CI.
fn render_chart() -> Option<Vec<Value>> {
    match control_plane::render_chart_defaults() {
        Ok(docs) => Some(docs),
        Err(control_plane::ChartRenderError::NoVenv(python)) => {
            let message = control_plane::ChartRenderError::NoVenv(python).to_string();
            assert!(!under_ci(), "{message}");
            eprintln!("SKIPPED: the chart RBAC test needs Helm's renderer: {message}");
            None
        }
        Err(error) => panic!("{error}"),
    }
}

fn text<'a>(object: &'a Value, pointer: &str) -> &'a str {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// One rendered rule, expanded: a role grants `verb` on `group`/`resource`
/// (`name`: one of its resourceNames) to `users`, in `namespace` for a Role.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Grant {
    role: String,
    namespace: Option<String>,
    group: String,
    resource: String,
    verb: String,
    name: Option<String>,
    users: BTreeSet<String>,
}

impl Grant {
    fn used_by(&self, record: &RequestRecord) -> bool {
        record.allowed
            && record.path.is_none()
            && self.users.contains(&record.user)
            && record.group == self.group
            && record.rule_resource() == self.resource
            && record.verb == self.verb
            && (self.name.is_none() || record.name == self.name)
            && (self.namespace.is_none() || record.namespace == self.namespace)
    }
}

/// Every rule of every rendered (Cluster)Role, with the users bound to it.
fn grants(docs: &[Value]) -> Vec<Grant> {
    let mut grants = Vec::new();
    for role in docs
        .iter()
        .filter(|d| matches!(text(d, "/kind"), "ClusterRole" | "Role"))
    {
        let kind = text(role, "/kind");
        let name = text(role, "/metadata/name");
        let namespace = (kind == "Role").then(|| text(role, "/metadata/namespace").to_string());
        let users: BTreeSet<String> = docs
            .iter()
            .filter(|b| {
                let binding_kind = text(b, "/kind");
                (binding_kind == "ClusterRoleBinding"
                    || (binding_kind == "RoleBinding"
                        && Some(text(b, "/metadata/namespace")) == namespace.as_deref()))
                    && text(b, "/roleRef/kind") == kind
                    && text(b, "/roleRef/name") == name
            })
            .flat_map(|b| b["subjects"].as_array().cloned().unwrap_or_default())
            .map(|s| {
                assert_eq!(
                    text(&s, "/kind"),
                    "ServiceAccount",
                    "{kind} {name} is bound to something else than a ServiceAccount: {s}"
                );
                HubRbac::service_account(text(&s, "/namespace"), text(&s, "/name"))
            })
            .collect();
        assert!(!users.is_empty(), "{kind} {name} is bound to nobody");
        for rule in role["rules"].as_array().cloned().unwrap_or_default() {
            let names = strings(&rule["resourceNames"]);
            let names: Vec<Option<String>> = if names.is_empty() {
                vec![None]
            } else {
                names.into_iter().map(Some).collect()
            };
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        for resource_name in &names {
                            grants.push(Grant {
                                role: name.to_string(),
                                namespace: namespace.clone(),
                                group: group.clone(),
                                resource: resource.clone(),
                                verb: verb.clone(),
                                name: resource_name.clone(),
                                users: users.clone(),
                            });
                        }
                    }
                }
            }
        }
    }
    grants
}

/// Waits until `check` passes. A refused request of a hub service fails
/// at once (`refusals` lists them): under RBAC that is the finding, and
/// waiting longer would only time out.
async fn wait_for<F, Fut>(
    what: &str,
    timeout: Duration,
    refusals: &dyn Fn() -> Option<String>,
    mut check: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(()) => return,
            Err(err) => {
                if let Some(refused) = refusals() {
                    panic!("{what}: requests were refused:\n{refused}\n(last: {err})");
                }
                assert!(
                    started.elapsed() < timeout,
                    "{what}: not after {timeout:?}: {err}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// The refused requests of `services` so far, one a line; `None` when
/// there are none.
fn refused(env: &Environment, services: &[String]) -> Option<String> {
    let mut lines: Vec<String> = env
        .kube_api
        .as_ref()
        .map(|api| api.requests())
        .unwrap_or_default()
        .into_iter()
        .filter(|r| !r.allowed && services.contains(&r.user))
        .map(|r| r.to_string())
        .collect();
    lines.dedup();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

fn dump_logs(env: &Environment) {
    for name in ["addon-manager", "cert-authority-kube", "health-prober"] {
        eprintln!("----- {name} -----\n{}", env.logs.tail(name, 40));
    }
}

/// Replaces the MPC's agent entrypoint. The controllers write the MPC's
/// status meanwhile, which moves its resourceVersion: a replace that loses
/// that race gets a 409 and is made again from a fresh read, as `kubectl
/// edit` would.
async fn set_entrypoint(admin: &kube::Client, entrypoint: Value) {
    let mpcs: Api<ManagedProxyConfiguration> = Api::all(admin.clone());
    for _ in 0..20 {
        let mut mpc = serde_json::to_value(mpcs.get("cluster-proxy").await.unwrap()).unwrap();
        mpc["spec"]["proxyServer"]["entrypoint"] = entrypoint.clone();
        let mpc: ManagedProxyConfiguration = serde_json::from_value(mpc).unwrap();
        match mpcs
            .replace("cluster-proxy", &PostParams::default(), &mpc)
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => panic!("replacing the MPC's entrypoint: {error}"),
        }
    }
    panic!("replacing the MPC's entrypoint: 20 conflicts in a row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_charts_rbac_allows_every_call_of_the_hub_services_and_nothing_more() {
    let started = Instant::now();
    let Some(docs) = render_chart() else {
        return;
    };
    let rbac = HubRbac::from_chart_documents(&docs).unwrap_or_else(|e| panic!("{e}"));
    let services = [
        rbac.addon_manager.clone(),
        rbac.cert_authority.clone(),
        rbac.health_prober.clone(),
    ];
    let grants = grants(&docs);

    let mut options = EnvOptions::new(2);
    options.control_plane = true;
    options.isolation = if under_ci() {
        IsolationChoice::Netns
    } else {
        IsolationChoice::Auto
    };
    options.hub_rbac = Some(rbac);
    options.record_requests = true;
    let names = options.clusters.clone();
    let replicas = options.replicas;
    let env = Environment::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting the environment: {e}"));
    if let Isolation::Loopback(reason) = &env.summary.isolation {
        eprintln!("NOTE: running on loopback without network isolation: {reason}");
    }
    let explain = || refused(&env, &services);
    if let Err(err) = env.wait_clusters_ready(&names, replicas, READY).await {
        dump_logs(&env);
        panic!("{err}\nrefused requests: {:?}", explain());
    }
    let admin = env.admin_client().await.unwrap();
    wait_for(
        "health-prober: every cluster Reachable 2/2",
        READY,
        &explain,
        || async {
            let rows = control_plane::addon_status(&admin)
                .await
                .map_err(|e| e.to_string())?;
            let reachable = rows
                .iter()
                .filter(|r| r.probe.starts_with("Reachable 2/2"))
                .count();
            if reachable == names.len() {
                Ok(())
            } else {
                Err(format!("{rows:?}"))
            }
        },
    )
    .await;

    // The agent entrypoint goes from the environment's (PortForward with
    // network namespaces, Hostname on loopback) → PortForward →
    // LoadBalancer → back: the addon-manager creates and deletes the
    // port-forward Role and RoleBinding, then the LoadBalancer Service.
    let original = Api::<ManagedProxyConfiguration>::all(admin.clone())
        .get("cluster-proxy")
        .await
        .unwrap();
    let hostname =
        serde_json::to_value(&original).unwrap()["spec"]["proxyServer"]["entrypoint"].clone();
    let roles: Api<Role> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    let services_api: Api<Service> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    set_entrypoint(&admin, json!({"type": "PortForward"})).await;
    wait_for("the port-forward Role", CHANGE, &explain, || async {
        match roles.get_opt(PORT_FORWARD_ROLE).await {
            Ok(Some(_)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    set_entrypoint(
        &admin,
        json!({"type": "LoadBalancerService", "loadBalancerService": {}}),
    )
    .await;
    wait_for(
        "the LoadBalancer Service, the port-forward Role gone",
        CHANGE,
        &explain,
        || async {
            match (
                services_api.get_opt(LOAD_BALANCER_SERVICE).await,
                roles.get_opt(PORT_FORWARD_ROLE).await,
            ) {
                (Ok(Some(_)), Ok(None)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    set_entrypoint(&admin, hostname).await;
    wait_for(
        "the LoadBalancer Service gone",
        CHANGE,
        &explain,
        || async {
            match services_api.get_opt(LOAD_BALANCER_SERVICE).await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    // A cluster leaves: its addon, ManifestWork and hub Role go.
    let leaving = &names[1];
    control_plane::leave(&admin, leaving).await.unwrap();
    wait_for(
        "the leaving cluster's addon gone",
        CHANGE,
        &explain,
        || async {
            let rows = control_plane::addon_status(&admin)
                .await
                .map_err(|e| e.to_string())?;
            if rows.iter().any(|r| &r.name == leaving) {
                Err(format!("{rows:?}"))
            } else {
                Ok(())
            }
        },
    )
    .await;

    // cluster-a's addon names an AddOnDeploymentConfig: the addon
    // controller reads it and records it among the config references.
    let config: AddOnDeploymentConfig = serde_json::from_value(json!({
        "metadata": {"name": "cluster-proxy-config", "namespace": names[0]},
        "spec": {},
    }))
    .unwrap();
    Api::<AddOnDeploymentConfig>::namespaced(admin.clone(), &names[0])
        .create(&PostParams::default(), &config)
        .await
        .expect("creating an AddOnDeploymentConfig");
    let addons: Api<ManagedClusterAddOn> = Api::namespaced(admin.clone(), &names[0]);
    addons
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"configs": [{
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "name": "cluster-proxy-config",
            }]}})),
        )
        .await
        .expect("naming the AddOnDeploymentConfig in the addon");
    wait_for(
        "the AddOnDeploymentConfig among the config references",
        CHANGE,
        &explain,
        || async {
            let addon = serde_json::to_value(
                addons
                    .get("cluster-proxy")
                    .await
                    .map_err(|e| e.to_string())?,
            )
            .map_err(|e| e.to_string())?;
            let references = addon
                .pointer("/status/configReferences")
                .cloned()
                .unwrap_or_default();
            let found = references.as_array().into_iter().flatten().any(|r| {
                text(r, "/resource") == "addondeploymentconfigs"
                    && (text(r, "/name") == "cluster-proxy-config"
                        || text(r, "/desiredConfig/name") == "cluster-proxy-config")
            });
            if found {
                Ok(())
            } else {
                Err(format!("{references}"))
            }
        },
    )
    .await;

    // Every elected service has renewed its Lease at least once, and
    // health-prober its member Lease.
    let leases: Api<Lease> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    let renewed = |spec: Option<&k8s_openapi::api::coordination::v1::LeaseSpec>| {
        spec.is_some_and(|s| {
            s.renew_time.is_some()
                && s.renew_time.as_ref().map(|t| &t.0) != s.acquire_time.as_ref().map(|t| &t.0)
        })
    };
    wait_for("every hub Lease renewed", CHANGE, &explain, || async {
        let mut waiting = Vec::new();
        for name in LEASES {
            let lease = leases.get_opt(name).await.map_err(|e| e.to_string())?;
            let spec = lease.and_then(|l| l.spec);
            if !renewed(spec.as_ref()) {
                waiting.push(format!("{name}: {spec:?}"));
            }
        }
        let members = leases
            .list(&kube::api::ListParams::default().labels(PROBER_MEMBER_SELECTOR))
            .await
            .map_err(|e| e.to_string())?;
        if !members.items.iter().any(|l| renewed(l.spec.as_ref())) {
            let specs: Vec<_> = members.items.iter().map(|l| &l.spec).collect();
            waiting.push(format!("health-prober member Leases: {specs:?}"));
        }
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(waiting.join("; "))
        }
    })
    .await;

    // Last, as it stops cert-authority: a damaged signer Secret, twice,
    // gives a Warning Event and then its repeat (an Event series).
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    let events: Api<Event> = Api::namespaced(admin.clone(), ADDON_NAMESPACE);
    for (round, garbage) in ["not a key", "still not a key"].into_iter().enumerate() {
        secrets
            .patch(
                SIGNER_SECRET,
                &PatchParams::default(),
                &Patch::Merge(json!({"stringData": {"ca.key": garbage}})),
            )
            .await
            .expect("damaging the signer Secret");
        wait_for(
            "cert-authority's SignerDamaged Event",
            CHANGE,
            &explain,
            || async {
                let list = events
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let event = list
                    .items
                    .iter()
                    .find(|e| e.reason.as_deref() == Some("SignerDamaged"));
                let repeats = event
                    .and_then(|e| e.series.as_ref())
                    .map(|s| s.count)
                    .unwrap_or(0);
                match (round, event) {
                    (0, Some(_)) => Ok(()),
                    (_, Some(_)) if repeats >= 2 => Ok(()),
                    _ => Err(format!("{event:?}")),
                }
            },
        )
        .await;
    }

    let api = env.kube_api.as_ref().expect("the environment's API");
    let records = api.requests();
    let mut problems = Vec::new();
    for service in &services {
        let mine: Vec<&RequestRecord> = records.iter().filter(|r| &r.user == service).collect();
        if mine.is_empty() {
            problems.push(format!("{service} made no request (did it run as itself?)"));
        }
        let mut refused: Vec<String> = mine
            .iter()
            .filter(|r| !r.allowed)
            .map(|r| r.to_string())
            .collect();
        refused.dedup();
        problems.extend(refused);
    }
    for grant in &grants {
        let exempt = UNUSED_RULES.iter().any(|(role, group, resource, verb, _)| {
            *role == grant.role
                && *group == grant.group
                && *resource == grant.resource
                && *verb == grant.verb
        });
        let used = records.iter().any(|r| grant.used_by(r));
        match (used, exempt) {
            (false, false) => problems.push(format!(
                "unused: {} grants {} {}/{}{}{} and no request of {:?} needed it",
                grant.role,
                grant.verb,
                grant.group,
                grant.resource,
                grant
                    .name
                    .as_ref()
                    .map(|n| format!(" named {n}"))
                    .unwrap_or_default(),
                grant
                    .namespace
                    .as_ref()
                    .map(|n| format!(" in {n}"))
                    .unwrap_or_default(),
                grant.users,
            )),
            (true, true) => problems.push(format!(
                "UNUSED_RULES lists {} {} {}/{}, but a request used it: drop it from the list",
                grant.role, grant.verb, grant.group, grant.resource
            )),
            _ => {}
        }
    }
    // What each service asked for, for whoever reads the log.
    let mut calls: std::collections::BTreeMap<String, usize> = Default::default();
    for record in records.iter().filter(|r| services.contains(&r.user)) {
        let summary = RequestRecord {
            name: None,
            ..record.clone()
        };
        *calls.entry(summary.to_string()).or_default() += 1;
    }
    for (call, count) in &calls {
        eprintln!("{count:>5} × {call}");
    }
    let service_requests = calls.values().sum::<usize>();
    eprintln!(
        "{service_requests} requests of the hub services checked against {} rendered rules in {:.1}s",
        grants.len(),
        started.elapsed().as_secs_f64()
    );
    if !problems.is_empty() {
        dump_logs(&env);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    env.shutdown().await;
}

/// `e2e up` and every control-plane test run under the RBAC of the chart's
/// checked default render: it must be what the chart renders today.
#[test]
fn the_environments_rbac_is_the_charts() {
    let Some(docs) = render_chart() else {
        return;
    };
    let live = HubRbac::from_chart_documents(&docs).unwrap();
    let checked = HubRbac::chart_defaults().unwrap();
    assert_eq!(
        (
            &checked.addon_manager,
            &checked.cert_authority,
            &checked.health_prober
        ),
        (
            &live.addon_manager,
            &live.cert_authority,
            &live.health_prober
        )
    );
    assert!(
        checked.objects == live.objects,
        "charts/tests/snapshots/default.yaml is not what the chart renders: \
         UPDATE_SNAPSHOTS=1 target/chart-venv/bin/python charts/tests/check.py"
    );
    assert!(checked.objects.iter().any(|o| o["kind"] == "ClusterRole"
        && o["metadata"]["name"] == "open-cluster-management:cluster-proxy:addon-manager"));
}

//! The addon controllers against the in-memory Kubernetes API (with the
//! environment's OCM CRDs, `e2e/simulated-cluster/crds/ocm.yaml`): installation by
//! placement, the agent ManifestWork and the addon's status, updates,
//! drift, removal, bad input, and CSR approval.

use std::time::Duration;

use addon_manager::addon::render::signer_organization_unit;
use addon_manager::addon::{self, AddonMetrics, AddonSettings, InstallStrategy};
use cluster_proxy_proto::api::addon::v1alpha1::{
    AddOnDeploymentConfig, ClusterManagementAddOn, ManagedClusterAddOn,
};
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use cluster_proxy_proto::api::cluster::v1beta1::PlacementDecision;
use cluster_proxy_proto::api::proxy::v1alpha1::ManagedProxyConfiguration;
use cluster_proxy_proto::api::work::v1::ManifestWork;
use cluster_proxy_proto::api::{Condition, find_condition};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::{Value, json};
use simulated_cluster::wait::eventually;
use tokio::sync::oneshot;

/// How long a test waits for an observable state.
const WAIT: Duration = Duration::from_secs(20);

const HUB: &str = "open-cluster-management-addon";
const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBtestCA\n-----END CERTIFICATE-----\n";
const MPC_CRD: &str =
    include_str!("../../charts/cluster-proxy/crds/managedproxyconfigurations.yaml");

struct Hub {
    api: KubeApi,
    admin: kube::Client,
    metrics: AddonMetrics,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

fn object<K: serde::de::DeserializeOwned>(value: Value) -> K {
    serde_json::from_value(value).expect("test object parses")
}

fn mpc_object(replicas: i32) -> ManagedProxyConfiguration {
    simulated_cluster::ocm::sample_managed_proxy_configuration(HUB, replicas)
        .expect("the sample parses")
}

impl Hub {
    /// The API with the CRDs, the hub namespace and CA Secret, and the MPC
    /// when `with_mpc`; the controllers are not running yet.
    async fn new(with_mpc: bool) -> Hub {
        Hub::with_options(with_mpc, false).await
    }

    /// [`Hub::new`], keeping a record of every request when
    /// `record_requests`.
    async fn with_options(with_mpc: bool, record_requests: bool) -> Hub {
        let dir = tempfile::tempdir().unwrap();
        let api = KubeApi::start(KubeApiOptions {
            record_requests,
            ..KubeApiOptions::new(dir.path())
        })
        .await
        .unwrap();
        api.register_crds_from_yaml(simulated_cluster::ocm::CRDS)
            .unwrap();
        api.register_crds_from_yaml(MPC_CRD).unwrap();
        let admin = api.client().await.unwrap();
        let hub = Hub {
            api,
            admin,
            metrics: AddonMetrics::default(),
            stop: None,
            task: None,
            _dir: dir,
        };
        hub.namespace(HUB).await;
        let secret = simulated_cluster::ocm::ca_bundle_secret(HUB, CA_PEM);
        Api::<Secret>::namespaced(hub.admin.clone(), HUB)
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
        if with_mpc {
            Api::<ManagedProxyConfiguration>::all(hub.admin.clone())
                .create(&PostParams::default(), &mpc_object(2))
                .await
                .unwrap();
        }
        hub
    }

    fn start(&mut self, settings: AddonSettings) {
        self.start_with_client(settings, self.admin.clone());
    }

    fn start_with_client(&mut self, settings: AddonSettings, client: kube::Client) {
        let (stop, stopped) = oneshot::channel::<()>();
        let metrics = self.metrics.clone();
        self.stop = Some(stop);
        self.task = Some(tokio::spawn(async move {
            addon::run(client, settings, metrics, async {
                let _ = stopped.await;
            })
            .await;
        }));
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .expect("the controllers stop on shutdown")
                .unwrap();
        }
        self.api.shutdown().await;
    }

    async fn namespace(&self, name: &str) {
        let namespace: Namespace = object(json!({"metadata": {"name": name}}));
        Api::<Namespace>::all(self.admin.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap();
    }

    async fn cluster(&self, name: &str, accepted: bool) {
        self.namespace(name).await;
        let cluster: ManagedCluster = object(json!({
            "metadata": {"name": name},
            "spec": {"hubAcceptsClient": accepted},
        }));
        Api::<ManagedCluster>::all(self.admin.clone())
            .create(&PostParams::default(), &cluster)
            .await
            .unwrap();
    }

    /// Sets the decisions of the default placement to `clusters`.
    async fn decide(&self, clusters: &[&str]) {
        self.decide_in(1, clusters).await;
    }

    /// Sets the clusters of the default placement's decision object
    /// `index` (OCM splits a placement's decisions 100 clusters to an object).
    async fn decide_in(&self, index: usize, clusters: &[&str]) {
        let api = Api::<PlacementDecision>::namespaced(self.admin.clone(), HUB);
        let name = &format!("cluster-proxy-placement-decision-{index}");
        let decision = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1",
            "kind": "PlacementDecision",
            "metadata": {"name": name, "namespace": HUB,
                "labels": {"cluster.open-cluster-management.io/placement": "cluster-proxy-placement"}},
        });
        api.patch(
            name,
            &PatchParams::apply("placement-controller"),
            &Patch::Apply(&decision),
        )
        .await
        .unwrap();
        let decisions: Vec<Value> = clusters
            .iter()
            .map(|cluster| json!({"clusterName": cluster, "reason": ""}))
            .collect();
        let status = json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1",
            "kind": "PlacementDecision",
            "metadata": {"name": name},
            "status": {"decisions": decisions},
        });
        api.patch_status(
            name,
            &PatchParams::apply("placement-controller").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
    }

    /// Merge-patches the MPC `cluster-proxy`, as a user editing it.
    async fn patch_mpc(&self, patch: Value) -> ManagedProxyConfiguration {
        Api::<ManagedProxyConfiguration>::all(self.admin.clone())
            .patch(
                "cluster-proxy",
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .unwrap()
    }

    fn addons(&self, cluster: &str) -> Api<ManagedClusterAddOn> {
        Api::namespaced(self.admin.clone(), cluster)
    }

    fn works(&self, cluster: &str) -> Api<ManifestWork> {
        Api::namespaced(self.admin.clone(), cluster)
    }

    async fn addon(&self, cluster: &str) -> Option<ManagedClusterAddOn> {
        self.addons(cluster).get_opt("cluster-proxy").await.unwrap()
    }

    async fn work(&self, cluster: &str) -> Option<ManifestWork> {
        self.works(cluster)
            .get_opt("addon-cluster-proxy-deploy-0")
            .await
            .unwrap()
    }

    /// Waits until the addon of `cluster` has condition `type_` with
    /// `status` and `reason`, and returns the addon.
    async fn wait_condition(
        &self,
        cluster: &str,
        type_: &str,
        status: &str,
        reason: &str,
    ) -> ManagedClusterAddOn {
        eventually(
            &format!("{cluster}: {type_}={status} ({reason})"),
            WAIT,
            || async {
                let addon = self.addon(cluster).await?;
                let condition: &Condition = find_condition(addon.conditions(), type_)?;
                (condition.status == status && condition.reason == reason).then_some(addon.clone())
            },
        )
        .await
    }
}

/// The message of `addon`'s condition `type_` (which must be set).
fn condition_message(addon: &ManagedClusterAddOn, type_: &str) -> String {
    find_condition(addon.conditions(), type_)
        .unwrap_or_else(|| panic!("no {type_} condition"))
        .message
        .clone()
}

fn deployment_of(work: &ManifestWork) -> Value {
    let manifests = work
        .spec
        .workload
        .as_ref()
        .unwrap()
        .manifests
        .as_ref()
        .unwrap();
    manifests
        .iter()
        .find(|m| m.kind() == Some("Deployment"))
        .expect("the work deploys the agent")
        .0
        .clone()
}

fn proxy_agent_args(work: &ManifestWork) -> Vec<String> {
    let deployment = deployment_of(work);
    serde_json::from_value(deployment["spec"]["template"]["spec"]["containers"][0]["args"].clone())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_installs_the_agent_and_removal_cleans_up() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.cluster("cluster-b", true).await;
    hub.cluster("cluster-c", true).await;
    hub.decide(&["cluster-a", "cluster-b"]).await;
    hub.start(AddonSettings {
        removal_grace: Duration::from_secs(1),
        ..AddonSettings::new(HUB)
    });

    let management = eventually("the ClusterManagementAddOn", WAIT, || async {
        Api::<ClusterManagementAddOn>::all(hub.admin.clone())
            .get_opt("cluster-proxy")
            .await
            .unwrap()
    })
    .await;
    assert_eq!(
        management.annotations()["addon.open-cluster-management.io/lifecycle"],
        "self",
        "the controller installs the addons, so OCM's addon-manager must not"
    );
    // Set back to OCM's value (as OCM does on a ClusterManagementAddOn that
    // lost it): the controller says `self` again.
    let handed_over = json!({"metadata": {"annotations": {"addon.open-cluster-management.io/lifecycle": "addon-manager"}}});
    Api::<ClusterManagementAddOn>::all(hub.admin.clone())
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(&handed_over),
        )
        .await
        .unwrap();
    eventually("the lifecycle annotation restored", WAIT, || async {
        let management = Api::<ClusterManagementAddOn>::all(hub.admin.clone())
            .get("cluster-proxy")
            .await
            .unwrap();
        (management.annotations()["addon.open-cluster-management.io/lifecycle"] == "self")
            .then_some(())
    })
    .await;

    for cluster in ["cluster-a", "cluster-b"] {
        let addon = hub
            .wait_condition(
                cluster,
                "RegistrationApplied",
                "True",
                "SetPermissionApplied",
            )
            .await;
        assert_eq!(
            addon.owner_references()[0].uid,
            management.meta().uid.clone().unwrap(),
            "installed addons belong to the ClusterManagementAddOn"
        );
        let status = addon.status.clone().unwrap();
        assert_eq!(
            status.namespace.as_deref(),
            Some("open-cluster-management-cluster-proxy")
        );
        assert_eq!(status.health_check.unwrap().mode.as_deref(), Some("Lease"));
        let registrations = status.registrations.unwrap();
        assert_eq!(registrations.len(), 2);
        assert_eq!(
            registrations[0]
                .subject
                .as_ref()
                .unwrap()
                .organization_units,
            Some(vec![signer_organization_unit(CA_PEM.as_bytes())])
        );
        let references = status.config_references.unwrap();
        assert_eq!(references[0].resource, "managedproxyconfigurations");
        assert!(
            references[0]
                .desired_config
                .as_ref()
                .unwrap()
                .spec_hash
                .is_some()
        );
        let configured = find_condition(addon.conditions(), "Configured").unwrap();
        assert_eq!(configured.status, "True");

        let work = eventually("the agent ManifestWork", WAIT, || hub.work(cluster)).await;
        assert_eq!(
            work.labels()["open-cluster-management.io/addon-name"],
            "cluster-proxy"
        );
        assert_eq!(work.owner_references()[0].uid, addon.uid().unwrap());
        let args = proxy_agent_args(&work);
        assert_eq!(args[0], "--proxy-server-host=proxy.hub.example");
        assert!(args.iter().any(|a| a.contains(&format!(
            "host={cluster}&host={cluster}.open-cluster-management-cluster-proxy"
        ))));

        let role = Api::<Role>::namespaced(hub.admin.clone(), cluster)
            .get("cluster-proxy-addon-agent")
            .await
            .unwrap();
        assert_eq!(role.owner_references()[0].uid, addon.uid().unwrap());
        Api::<RoleBinding>::namespaced(hub.admin.clone(), cluster)
            .get("cluster-proxy-addon-agent")
            .await
            .unwrap();
        // The work agent has not reported: ManifestApplied is not claimed.
        let applied = find_condition(addon.conditions(), "ManifestApplied").unwrap();
        assert_ne!(applied.status, "True");
        assert!(find_condition(addon.conditions(), "Available").is_none());
    }
    assert!(
        hub.addon("cluster-c").await.is_none(),
        "cluster-c is not selected"
    );

    // The work agent reports the work applied: ManifestApplied follows.
    let applied = json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": {"name": "addon-cluster-proxy-deploy-0"},
        "status": {"conditions": [{"type": "Applied", "status": "True", "reason": "AppliedManifestWorkComplete",
            "message": "applied", "lastTransitionTime": "2026-11-23T10:00:00Z"}]},
    });
    hub.works("cluster-a")
        .patch_status(
            "addon-cluster-proxy-deploy-0",
            &PatchParams::apply("work-agent"),
            &Patch::Apply(&applied),
        )
        .await
        .unwrap();
    hub.wait_condition(
        "cluster-a",
        "ManifestApplied",
        "True",
        "AddonManifestApplied",
    )
    .await;

    // An installed addon deleted while its cluster is still placed comes back.
    let first = hub.addon("cluster-b").await.unwrap();
    hub.addons("cluster-b")
        .delete("cluster-proxy", &DeleteParams::default())
        .await
        .unwrap();
    eventually("cluster-b's addon installed again", WAIT, || async {
        let addon = hub.addon("cluster-b").await?;
        (addon.metadata.uid != first.metadata.uid).then_some(())
    })
    .await;

    // cluster-b leaves the placement: after the grace, its addon and
    // everything it owns go.
    hub.decide(&["cluster-a"]).await;
    eventually("cluster-b's removal pending", WAIT, || async {
        (hub.metrics.pending_removal_count() == 1).then_some(())
    })
    .await;
    eventually("cluster-b's addon removed", WAIT, || async {
        hub.addon("cluster-b").await.is_none().then_some(())
    })
    .await;
    assert_eq!(hub.metrics.pending_removal_count(), 0);
    eventually("cluster-b's work garbage-collected", WAIT, || async {
        hub.work("cluster-b").await.is_none().then_some(())
    })
    .await;
    eventually("cluster-b's hub Role garbage-collected", WAIT, || async {
        Api::<Role>::namespaced(hub.admin.clone(), "cluster-b")
            .get_opt("cluster-proxy-addon-agent")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(hub.addon("cluster-a").await.is_some());

    // cluster-a's ManagedCluster is deleted: its addon goes too.
    Api::<ManagedCluster>::all(hub.admin.clone())
        .delete("cluster-a", &DeleteParams::default())
        .await
        .unwrap();
    eventually("cluster-a's addon removed", WAIT, || async {
        hub.addon("cluster-a").await.is_none().then_some(())
    })
    .await;
    eventually("cluster-a's work garbage-collected", WAIT, || async {
        hub.work("cluster-a").await.is_none().then_some(())
    })
    .await;
    hub.stop().await;
}

/// Regression: OCM's placement controller rewrites a placement's decision
/// objects one after another, so a cluster moving from one object to the
/// next is in none between the two writes. The installer took that for the
/// cluster leaving and removed its addon (uninstalling the agent), then
/// installed it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_moving_between_decision_objects_keeps_its_addon() {
    let mut hub = Hub::new(true).await;
    for cluster in ["cluster-a", "cluster-b", "cluster-c"] {
        hub.cluster(cluster, true).await;
    }
    hub.decide_in(1, &["cluster-a", "cluster-b"]).await;
    hub.decide_in(2, &["cluster-c"]).await;
    // Longer than any test run: the move must not depend on timing.
    hub.start(AddonSettings {
        removal_grace: Duration::from_secs(600),
        ..AddonSettings::new(HUB)
    });
    let mut before = Vec::new();
    for cluster in ["cluster-a", "cluster-b", "cluster-c"] {
        let addon = eventually(&format!("{cluster}'s addon"), WAIT, || hub.addon(cluster)).await;
        before.push(addon.metadata.uid.clone());
    }

    // cluster-b moves from the first object to the second, first written
    // first; the controller sees it in no decision.
    hub.decide_in(1, &["cluster-a"]).await;
    eventually("cluster-b's removal pending", WAIT, || async {
        (hub.metrics.pending_removal_count() == 1).then_some(())
    })
    .await;
    hub.decide_in(2, &["cluster-b", "cluster-c"]).await;
    eventually("cluster-b's removal called off", WAIT, || async {
        (hub.metrics.pending_removal_count() == 0).then_some(())
    })
    .await;

    for (cluster, uid) in ["cluster-a", "cluster-b", "cluster-c"].iter().zip(&before) {
        let addon = hub.addon(cluster).await.expect("the addon is still there");
        assert_eq!(&addon.metadata.uid, uid, "{cluster}'s addon was re-created");
        assert!(addon.metadata.deletion_timestamp.is_none());
    }
    hub.stop().await;
}

/// Plays the cluster's work agent and registration agent: the work of
/// `cluster` is applied (or not, when `applied` is false) and available at
/// its current generation, and the addon is `Available`.
async fn report_work(hub: &Hub, cluster: &str, applied: bool) {
    let work = hub.work(cluster).await.expect("the work exists");
    let generation = work.metadata.generation;
    let condition = |type_: &str, ok: bool| {
        json!({"type": type_, "status": if ok {"True"} else {"False"},
            "reason": if ok {"Done"} else {"AppliedManifestWorkFailed"},
            "message": if ok {"done"} else {"the Deployment is invalid"},
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": generation})
    };
    let status = json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": "addon-cluster-proxy-deploy-0", "namespace": cluster},
        "status": {"conditions": [condition("Applied", applied), condition("Available", applied)]},
    });
    hub.works(cluster)
        .patch_status(
            "addon-cluster-proxy-deploy-0",
            &PatchParams::apply("work-agent").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
    let available = json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1", "kind": "ManagedClusterAddOn",
        "metadata": {"name": "cluster-proxy", "namespace": cluster},
        "status": {"conditions": [{"type": "Available", "status": "True",
            "reason": "ManagedClusterAddOnLeaseUpdated", "message": "renewed",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
    });
    hub.addons(cluster)
        .patch_status(
            "cluster-proxy",
            &PatchParams::apply("registration-agent").force(),
            &Patch::Apply(&available),
        )
        .await
        .unwrap();
}

/// The agent replicas `cluster`'s work deploys.
async fn work_replicas(hub: &Hub, cluster: &str) -> Value {
    let work = hub.work(cluster).await.expect("the work exists");
    deployment_of(&work)["spec"]["replicas"].clone()
}

/// The ClusterManagementAddOn's rollout summary for the one placement:
/// its `Progressing` condition's reason and message, and the MPC's last
/// known good spec hash.
async fn install_progression(hub: &Hub) -> Option<(String, String, Option<String>)> {
    let management = Api::<ClusterManagementAddOn>::all(hub.admin.clone())
        .get_opt("cluster-proxy")
        .await
        .unwrap()?;
    let progressions = management.status?.install_progressions?;
    let progression = progressions.first()?;
    let condition = find_condition(progression.conditions.as_deref()?, "Progressing")?;
    let good = progression
        .config_references
        .as_ref()?
        .first()?
        .last_known_good_config
        .as_ref()
        .and_then(|config| config.spec_hash.clone());
    Some((condition.reason.clone(), condition.message.clone(), good))
}

/// Waits until the summary's `Progressing` says `reason` and `message`.
async fn wait_install_progression(hub: &Hub, reason: &str, message: &str) -> Option<String> {
    eventually(
        &format!("installProgressions: {reason}, {message}"),
        WAIT,
        || async {
            let (now_reason, now_message, good) = install_progression(hub).await?;
            (now_reason == reason && now_message == message).then_some(good)
        },
    )
    .await
}

/// Places `clusters`, starts the controllers, chooses a `Progressive`
/// rollout with `maxConcurrency: 1` on the ClusterManagementAddOn (as a user
/// would) and plays the work and registration agents until every cluster's
/// install is `Completed`; returns the ClusterManagementAddOn first seen.
async fn install_one_at_a_time(hub: &mut Hub, clusters: &[&str]) -> ClusterManagementAddOn {
    for cluster in clusters {
        hub.cluster(cluster, true).await;
    }
    hub.decide(clusters).await;
    hub.start(AddonSettings::new(HUB));
    let management = eventually("the ClusterManagementAddOn", WAIT, || async {
        Api::<ClusterManagementAddOn>::all(hub.admin.clone())
            .get_opt("cluster-proxy")
            .await
            .unwrap()
    })
    .await;
    let rollout = json!({"spec": {"installStrategy": {"type": "Placements", "placements": [{
        "name": "cluster-proxy-placement", "namespace": HUB,
        "rolloutStrategy": {"type": "Progressive", "progressive": {"maxConcurrency": 1}}}]}}});
    Api::<ClusterManagementAddOn>::all(hub.admin.clone())
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(&rollout),
        )
        .await
        .unwrap();
    // Installation is not held back: every cluster gets its agent at once.
    for cluster in clusters {
        eventually(&format!("{cluster}'s work"), WAIT, || hub.work(cluster)).await;
        report_work(hub, cluster, true).await;
        hub.wait_condition(cluster, "Progressing", "False", "Completed")
            .await;
    }
    management
}

/// A `Progressive` rollout with `maxConcurrency: 1` updates one cluster at a
/// time, in name order, each once the one before is applied and available;
/// a failure stops it until the failed cluster recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progressive_rollout_updates_one_cluster_at_a_time() {
    let clusters = ["cluster-a", "cluster-b", "cluster-c"];
    let mut hub = Hub::new(true).await;
    let management = install_one_at_a_time(&mut hub, &clusters).await;
    for cluster in clusters {
        assert_eq!(work_replicas(&hub, cluster).await, 2);
    }
    // The ClusterManagementAddOn sums it up, as OCM's addon-manager would.
    let installed_good = wait_install_progression(
        &hub,
        "Completed",
        "selected clusters 3. configured addons 3/3 completed with no errors, 0 failed 0 timeout.",
    )
    .await;
    assert!(
        installed_good.is_some(),
        "the installed configuration is the last known good"
    );
    // The controller keeps the user's rollout strategy.
    let kept = Api::<ClusterManagementAddOn>::all(hub.admin.clone())
        .get("cluster-proxy")
        .await
        .unwrap();
    let placements = kept.spec.install_strategy.unwrap().placements.unwrap();
    assert_eq!(
        placements[0]
            .rollout_strategy
            .as_ref()
            .and_then(|s| s.type_.as_deref()),
        Some("Progressive"),
        "{management:?}"
    );

    // A configuration change: cluster-a first, the others wait.
    hub.patch_mpc(json!({"spec": {"proxyAgent": {"replicas": 3}}}))
        .await;
    eventually("cluster-b and cluster-c wait", WAIT, || async {
        (hub.metrics.rollout_waiting_count() == 2).then_some(())
    })
    .await;
    hub.wait_condition("cluster-a", "Progressing", "True", "Progressing")
        .await;
    assert_eq!(work_replicas(&hub, "cluster-a").await, 3);
    assert_eq!(work_replicas(&hub, "cluster-b").await, 2, "cluster-b waits");
    assert_eq!(work_replicas(&hub, "cluster-c").await, 2, "cluster-c waits");
    let good = wait_install_progression(
        &hub,
        "Progressing",
        "selected clusters 3. configured addons 1/3 progressing..., 0 failed 0 timeout.",
    )
    .await;
    assert_eq!(
        good, installed_good,
        "the last known good stays while rolling"
    );
    let waiting = hub.addon("cluster-b").await.unwrap();
    let progressing = find_condition(waiting.conditions(), "Progressing").unwrap();
    assert_eq!(
        progressing.reason, "Completed",
        "a waiting cluster keeps its last rollout's condition"
    );

    // cluster-a fails to apply: the rollout stops (maxFailures 0).
    report_work(&hub, "cluster-a", false).await;
    hub.wait_condition("cluster-a", "Progressing", "False", "Failed")
        .await;
    assert_eq!(hub.metrics.rollout_waiting_count(), 2);
    assert_eq!(work_replicas(&hub, "cluster-b").await, 2, "stopped");
    wait_install_progression(
        &hub,
        "Progressing",
        "selected clusters 3. configured addons 0/3 progressing..., 1 failed 0 timeout.",
    )
    .await;

    // cluster-a recovers: cluster-b's turn, then cluster-c's.
    report_work(&hub, "cluster-a", true).await;
    hub.wait_condition("cluster-a", "Progressing", "False", "Completed")
        .await;
    eventually("cluster-b updated", WAIT, || async {
        (work_replicas(&hub, "cluster-b").await == 3).then_some(())
    })
    .await;
    assert_eq!(work_replicas(&hub, "cluster-c").await, 2, "cluster-c waits");
    report_work(&hub, "cluster-b", true).await;
    eventually("cluster-c updated", WAIT, || async {
        (work_replicas(&hub, "cluster-c").await == 3).then_some(())
    })
    .await;
    report_work(&hub, "cluster-c", true).await;
    for cluster in clusters {
        hub.wait_condition(cluster, "Progressing", "False", "Completed")
            .await;
    }
    assert_eq!(hub.metrics.rollout_waiting_count(), 0);
    let good = wait_install_progression(
        &hub,
        "Completed",
        "selected clusters 3. configured addons 3/3 completed with no errors, 0 failed 0 timeout.",
    )
    .await;
    assert!(
        good.is_some() && good != installed_good,
        "the new configuration is the last known good"
    );
    hub.stop().await;
}

/// The hub CA bundle the work ships to the agent (Secret `cluster-proxy-ca`).
fn work_ca_bundle(work: &ManifestWork) -> String {
    let secret = work
        .spec
        .workload
        .as_ref()
        .and_then(|workload| workload.manifests.as_ref())
        .and_then(|manifests| {
            manifests.iter().find(|m| {
                m.kind() == Some("Secret") && m.0["metadata"]["name"] == "cluster-proxy-ca"
            })
        })
        .expect("the work carries the CA bundle");
    let encoded = secret.0["data"]["ca.crt"].as_str().expect("ca.crt is set");
    let decoded = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, encoded)
        .expect("ca.crt is base64");
    String::from_utf8(decoded).expect("the bundle is text")
}

/// A cluster waiting for its turn in a rollout keeps its configuration but
/// still gets the rest: here a hub CA rollover, without which its agent
/// would stop trusting the proxy-servers once they serve from the new CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_cluster_still_gets_a_ca_rollover() {
    let clusters = ["cluster-a", "cluster-b"];
    let mut hub = Hub::new(true).await;
    install_one_at_a_time(&mut hub, &clusters).await;
    let installed = hub.addon("cluster-b").await.unwrap();
    let installed_references = installed.status.as_ref().unwrap().config_references.clone();
    let installed_hash = hub.work("cluster-b").await.unwrap().annotations()
        ["open-cluster-management.io/config-spec-hash"]
        .clone();

    // A change that cluster-a takes first and never finishes: cluster-b waits.
    hub.patch_mpc(json!({"spec": {"proxyAgent": {"replicas": 3}}}))
        .await;
    eventually("cluster-b waits", WAIT, || async {
        (hub.metrics.rollout_waiting_count() == 1).then_some(())
    })
    .await;
    assert_eq!(work_replicas(&hub, "cluster-a").await, 3);

    // The hub CA rolls over while it waits.
    let bundle =
        format!("{CA_PEM}-----BEGIN CERTIFICATE-----\nMIIBnewCA\n-----END CERTIFICATE-----\n");
    let rollover = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "proxy-server-ca"},
        "stringData": {"ca.crt": bundle}});
    Api::<Secret>::namespaced(hub.admin.clone(), HUB)
        .patch(
            "proxy-server-ca",
            &PatchParams::default(),
            &Patch::Merge(&rollover),
        )
        .await
        .unwrap();
    for cluster in clusters {
        eventually(
            &format!("{cluster}'s agent gets the new bundle"),
            WAIT,
            || async {
                let work = hub.work(cluster).await?;
                (work_ca_bundle(&work) == bundle).then_some(())
            },
        )
        .await;
    }
    // cluster-b still has its configuration: the same replicas, hash and
    // references, and it still waits.
    let waiting = hub.work("cluster-b").await.unwrap();
    assert_eq!(
        deployment_of(&waiting)["spec"]["replicas"],
        2,
        "cluster-b waits"
    );
    assert_eq!(
        waiting.annotations()["open-cluster-management.io/config-spec-hash"],
        installed_hash
    );
    let addon = hub.addon("cluster-b").await.unwrap();
    assert_eq!(
        addon.status.as_ref().unwrap().config_references,
        installed_references
    );
    assert_eq!(hub.metrics.rollout_waiting_count(), 1);

    // Its turn comes: the new configuration, with the new bundle.
    report_work(&hub, "cluster-a", true).await;
    eventually("cluster-b updated", WAIT, || async {
        (work_replicas(&hub, "cluster-b").await == 3).then_some(())
    })
    .await;
    assert_eq!(
        work_ca_bundle(&hub.work("cluster-b").await.unwrap()),
        bundle
    );
    hub.stop().await;
}

/// Regression: a reconcile triggered by the events of the objects the first
/// one created ran on a cached addon without the status just written, and
/// wrote it again (with new transition times when a second had passed).
/// Holding the addon watch back makes the cache lag every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_cache_does_not_rewrite_the_status() {
    // The first reconcile writes the status; the events of the work and RBAC
    // it created queue a second one on the lagging cache, and the delayed
    // status event a third.
    let (hub, addon) = installed_with_lagging_watches("managedclusteraddons").await;
    let status_writes = hub
        .api
        .requests()
        .into_iter()
        .filter(|request| {
            request.verb == "patch"
                && request.resource == "managedclusteraddons"
                && request.subresource.as_deref() == Some("status")
        })
        .count();
    assert_eq!(status_writes, 1, "the status was written more than once");
    assert_eq!(
        hub.addon("cluster-a").await.unwrap().resource_version(),
        addon.resource_version()
    );
    // Nor is the addon read back: our own write is known. The one read is
    // the install controller's, confirming the addon is missing before it
    // creates it.
    assert_eq!(
        requests_of(&hub, CONTROLLER_USER, "get", "managedclusteraddons"),
        1
    );
    hub.stop().await;
}

/// The user the controllers run as in the tests that count their requests.
const CONTROLLER_USER: &str = "cluster-proxy-addon-manager";

/// A client for [`CONTROLLER_USER`] whose watches of `plural` trail the API
/// by two seconds.
async fn lagging_controller_client(hub: &Hub, plural: &str) -> kube::Client {
    let kubeconfig = hub
        .api
        .kubeconfig_for(CONTROLLER_USER, &["system:masters"])
        .unwrap();
    KubeApi::lagging_client_from(&kubeconfig, plural, Duration::from_secs(2))
        .await
        .unwrap()
}

/// cluster-a installed by controllers whose watches of `plural` trail the
/// API by two seconds, recording every request, once its registration is
/// applied and three reconciles have run; with the addon as it was then.
async fn installed_with_lagging_watches(plural: &str) -> (Hub, ManagedClusterAddOn) {
    let mut hub = Hub::with_options(true, true).await;
    hub.cluster("cluster-a", true).await;
    hub.decide(&["cluster-a"]).await;
    let lagging = lagging_controller_client(&hub, plural).await;
    hub.start_with_client(AddonSettings::new(HUB), lagging);
    let addon = hub
        .wait_condition(
            "cluster-a",
            "RegistrationApplied",
            "True",
            "SetPermissionApplied",
        )
        .await;
    eventually("three reconciles", WAIT, || async {
        (hub.metrics.reconciliation_count("managedclusteraddon") >= 3).then_some(())
    })
    .await;
    (hub, addon)
}

/// How many requests `user` made of `verb` on `resource` (not a
/// subresource).
fn requests_of(hub: &Hub, user: &str, verb: &str, resource: &str) -> usize {
    hub.api
        .requests()
        .into_iter()
        .filter(|request| {
            request.user == user
                && request.verb == verb
                && request.resource == resource
                && request.subresource.is_none()
        })
        .count()
}

/// The same for the objects the addon controller writes: a reconcile that
/// runs before the watch event of the work (Role, RoleBinding) it just wrote
/// neither writes it again nor takes it for missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lagging_caches_do_not_rewrite_the_work_or_the_hub_rbac() {
    // The events of the Role, RoleBinding and status the first reconcile
    // wrote queue more while the work's event is held back.
    let (hub, _) = installed_with_lagging_watches("manifestworks").await;
    // The work agent reports; its event, after the work's own, reaches the
    // cache and a reconcile on it.
    report_work(&hub, "cluster-a", true).await;
    hub.wait_condition(
        "cluster-a",
        "ManifestApplied",
        "True",
        "AddonManifestApplied",
    )
    .await;
    assert_eq!(
        requests_of(&hub, CONTROLLER_USER, "patch", "manifestworks"),
        1,
        "the work was written more than once"
    );
    assert_eq!(requests_of(&hub, CONTROLLER_USER, "patch", "roles"), 1);
    assert_eq!(
        requests_of(&hub, CONTROLLER_USER, "patch", "rolebindings"),
        1
    );
    hub.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn current_work_is_left_alone_changes_and_drift_are_applied() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.decide(&["cluster-a"]).await;
    hub.start(AddonSettings::new(HUB));
    let work = eventually("the agent ManifestWork", WAIT, || hub.work("cluster-a")).await;
    let addon = hub
        .wait_condition(
            "cluster-a",
            "RegistrationApplied",
            "True",
            "SetPermissionApplied",
        )
        .await;

    // A reconcile with nothing changed writes nothing.
    let before = hub.metrics.reconciliation_count("managedclusteraddon");
    let touch = json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
        "metadata": {"name": "cluster-a", "labels": {"touched": "yes"}}});
    Api::<ManagedCluster>::all(hub.admin.clone())
        .patch(
            "cluster-a",
            &PatchParams::apply("someone"),
            &Patch::Apply(&touch),
        )
        .await
        .unwrap();
    eventually("a reconcile after the touch", WAIT, || async {
        (hub.metrics.reconciliation_count("managedclusteraddon") > before).then_some(())
    })
    .await;
    // Wait until the touched reconcile has finished: a second touch's
    // reconcile starts only after the first one ended.
    let after_first = hub.metrics.reconciliation_count("managedclusteraddon");
    let touch_again = json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
        "metadata": {"name": "cluster-a", "labels": {"touched": "twice"}}});
    Api::<ManagedCluster>::all(hub.admin.clone())
        .patch(
            "cluster-a",
            &PatchParams::apply("someone"),
            &Patch::Apply(&touch_again),
        )
        .await
        .unwrap();
    eventually("a second reconcile", WAIT, || async {
        (hub.metrics.reconciliation_count("managedclusteraddon") > after_first).then_some(())
    })
    .await;
    let unchanged = hub.work("cluster-a").await.unwrap();
    assert_eq!(
        unchanged.resource_version(),
        work.resource_version(),
        "no write when current"
    );
    let addon_now = hub.addon("cluster-a").await.unwrap();
    assert_eq!(
        addon_now.resource_version(),
        addon.resource_version(),
        "status not rewritten when current"
    );

    // MPC spec change: replicas and the generation annotation follow.
    let mpc = hub
        .patch_mpc(json!({"spec": {"proxyAgent": {"replicas": 3}}}))
        .await;
    let generation = mpc.metadata.generation.unwrap().to_string();
    let updated = eventually("the work follows the MPC", WAIT, || async {
        let work = hub.work("cluster-a").await?;
        (deployment_of(&work)["spec"]["replicas"] == 3).then_some(work)
    })
    .await;
    let deployment = deployment_of(&updated);
    assert_eq!(
        deployment["metadata"]["annotations"]["proxy.open-cluster-management.io/configuration-generation"],
        generation.as_str()
    );
    assert_eq!(
        deployment["spec"]["template"]["metadata"]["annotations"]["proxy.open-cluster-management.io/configuration-generation"],
        generation.as_str()
    );

    // Drift: someone empties the work; the controller puts it back.
    let drift = json!({"spec": {"workload": {"manifests": []}}});
    hub.works("cluster-a")
        .patch(
            "addon-cluster-proxy-deploy-0",
            &PatchParams::default(),
            &Patch::Merge(&drift),
        )
        .await
        .unwrap();
    eventually("the drifted work restored", WAIT, || async {
        let work = hub.work("cluster-a").await?;
        (work.spec.workload.as_ref()?.manifests.as_ref()?.len() == 7).then_some(())
    })
    .await;

    // A CA rollover changes the registration's organizational unit.
    let new_ca = "-----BEGIN CERTIFICATE-----\nMIIBnewCA\n-----END CERTIFICATE-----\n";
    let rollover = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "proxy-server-ca"},
        "stringData": {"ca.crt": new_ca}});
    Api::<Secret>::namespaced(hub.admin.clone(), HUB)
        .patch(
            "proxy-server-ca",
            &PatchParams::default(),
            &Patch::Merge(&rollover),
        )
        .await
        .unwrap();
    let expected = signer_organization_unit(new_ca.as_bytes());
    eventually("the registration follows the CA", WAIT, || async {
        let addon = hub.addon("cluster-a").await?;
        let registrations = addon.status?.registrations?;
        (registrations[0]
            .subject
            .as_ref()?
            .organization_units
            .as_ref()?
            == &vec![expected.clone()])
            .then_some(())
    })
    .await;
    hub.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_false_condition_and_breaks_nothing_else() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.cluster("1cluster", true).await;
    hub.cluster("cluster-d", true).await;
    let mut settings = AddonSettings::new(HUB);
    settings.install_strategy = InstallStrategy::Manual;
    // Users create the addons (Manual): cluster-d's names a missing ADC.
    for cluster in ["cluster-a", "1cluster", "cluster-d"] {
        let mut addon = ManagedClusterAddOn::new("cluster-proxy", Default::default());
        addon.metadata.namespace = Some(cluster.to_owned());
        if cluster == "cluster-d" {
            addon.spec.configs = Some(vec![object(json!({
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "namespace": "cluster-d",
                "name": "tuned",
            }))]);
        }
        hub.addons(cluster)
            .create(&PostParams::default(), &addon)
            .await
            .unwrap();
    }
    hub.start(settings);

    hub.wait_condition("1cluster", "ManifestApplied", "False", "InvalidClusterName")
        .await;
    let missing = hub
        .wait_condition("cluster-d", "Configured", "False", "ConfigurationNotFound")
        .await;
    assert!(condition_message(&missing, "Configured").contains("cluster-d/tuned"));
    eventually("cluster-a's work", WAIT, || hub.work("cluster-a")).await;
    assert!(hub.work("1cluster").await.is_none());
    assert!(
        hub.work("cluster-d").await.is_none(),
        "no work while the ADC is missing"
    );

    // The ADC appears: cluster-d is configured and its agent placed by it.
    let adc: AddOnDeploymentConfig = object(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "AddOnDeploymentConfig",
        "metadata": {"name": "tuned", "namespace": "cluster-d"},
        "spec": {
            "nodePlacement": {"nodeSelector": {"kubernetes.io/os": "linux"}},
            "agentInstallNamespace": "proxy-agents",
        },
    }));
    Api::<AddOnDeploymentConfig>::namespaced(hub.admin.clone(), "cluster-d")
        .create(&PostParams::default(), &adc)
        .await
        .unwrap();
    let work = eventually("cluster-d's work", WAIT, || hub.work("cluster-d")).await;
    let deployment = deployment_of(&work);
    assert_eq!(deployment["metadata"]["namespace"], "proxy-agents");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/os"],
        "linux"
    );
    let configured = hub
        .wait_condition(
            "cluster-d",
            "Configured",
            "True",
            "ConfigurationsConfigured",
        )
        .await;
    let references = configured.status.unwrap().config_references.unwrap();
    assert_eq!(references[1].resource, "addondeploymentconfigs");
    assert_eq!(references[1].name.as_deref(), Some("tuned"));

    // The ADC is deleted again: Configured turns False, the work stays as it was.
    let rendered = work.resource_version();
    Api::<AddOnDeploymentConfig>::namespaced(hub.admin.clone(), "cluster-d")
        .delete("tuned", &DeleteParams::default())
        .await
        .unwrap();
    hub.wait_condition("cluster-d", "Configured", "False", "ConfigurationNotFound")
        .await;
    assert_eq!(
        hub.work("cluster-d").await.unwrap().resource_version(),
        rendered
    );

    // The MPC is deleted: every addon says so, nobody crashes.
    Api::<ManagedProxyConfiguration>::all(hub.admin.clone())
        .delete("cluster-proxy", &DeleteParams::default())
        .await
        .unwrap();
    let addon = hub
        .wait_condition("cluster-a", "Configured", "False", "ConfigurationNotFound")
        .await;
    assert!(condition_message(&addon, "Configured").contains("ManagedProxyConfiguration"));
    // It comes back with an invalid spec: ManifestApplied says why.
    let mut invalid = mpc_object(2);
    invalid.spec.proxy_agent.replicas = -1;
    Api::<ManagedProxyConfiguration>::all(hub.admin.clone())
        .create(&PostParams::default(), &invalid)
        .await
        .unwrap();
    let addon = hub
        .wait_condition(
            "cluster-a",
            "ManifestApplied",
            "False",
            "InvalidManagedProxyConfiguration",
        )
        .await;
    assert!(condition_message(&addon, "ManifestApplied").contains("spec.proxyAgent.replicas"));
    hub.stop().await;
}

fn csr_request(cluster_ou: &str) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut name = rcgen::DistinguishedName::new();
    name.push(
        rcgen::DnType::CommonName,
        "open-cluster-management:cluster-proxy:proxy-agent",
    );
    name.push(
        rcgen::DnType::OrganizationName,
        "open-cluster-management:cluster-proxy",
    );
    name.push(rcgen::DnType::OrganizationalUnitName, cluster_ou);
    params.distinguished_name = name;
    params.serialize_request(&key).unwrap().pem().unwrap()
}

/// Files a proxy-agent CSR labelled for `label_cluster` as the
/// registration identity of `requester_cluster`.
async fn file_csr(hub: &Hub, name: &str, label_cluster: &str, requester_cluster: &str) {
    let config = hub
        .api
        .kubeconfig_for(
            &format!("system:open-cluster-management:{requester_cluster}:agent1"),
            &[
                &format!("system:open-cluster-management:{requester_cluster}"),
                "system:authenticated",
            ],
        )
        .unwrap();
    let client = KubeApi::client_from(&config).await.unwrap();
    use base64::Engine;
    let csr: CertificateSigningRequest = object(json!({
        "metadata": {"name": name, "labels": {
            "open-cluster-management.io/addon-name": "cluster-proxy",
            "open-cluster-management.io/cluster-name": label_cluster,
        }},
        "spec": {
            "signerName": "open-cluster-management.io/proxy-agent-signer",
            "request": base64::engine::general_purpose::STANDARD
                .encode(csr_request(&signer_organization_unit(CA_PEM.as_bytes()))),
            "usages": ["client auth"],
        },
    }));
    Api::<CertificateSigningRequest>::all(client)
        .create(&PostParams::default(), &csr)
        .await
        .unwrap();
}

fn is_approved(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Approved" && c.status == "True")
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_accepted_clusters_own_agent_csr_is_approved() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.cluster("cluster-b", true).await;
    hub.cluster("cluster-c", false).await;
    hub.start(AddonSettings::new(HUB));
    let csrs = Api::<CertificateSigningRequest>::all(hub.admin.clone());

    // cluster-b's identity asking for cluster-a, and not-yet-accepted cluster-c.
    file_csr(&hub, "stolen", "cluster-a", "cluster-b").await;
    file_csr(&hub, "not-accepted", "cluster-c", "cluster-c").await;
    eventually("both CSRs looked at and left", WAIT, || async {
        (hub.metrics.csr_decision_count("left") >= 2).then_some(())
    })
    .await;
    file_csr(&hub, "own", "cluster-a", "cluster-a").await;
    eventually("cluster-a's own CSR approved", WAIT, || async {
        is_approved(&csrs.get("own").await.unwrap()).then_some(())
    })
    .await;
    assert!(!is_approved(&csrs.get("stolen").await.unwrap()));
    assert!(!is_approved(&csrs.get("not-accepted").await.unwrap()));
    let stolen = csrs.get("stolen").await.unwrap();
    assert!(
        stolen
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .is_empty(),
        "nothing is denied: left for a human"
    );

    // The hub accepts cluster-c: its CSR is approved now.
    let accept = json!({"apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
        "metadata": {"name": "cluster-c"}, "spec": {"hubAcceptsClient": true}});
    Api::<ManagedCluster>::all(hub.admin.clone())
        .patch(
            "cluster-c",
            &PatchParams::apply("admin").force(),
            &Patch::Apply(&accept),
        )
        .await
        .unwrap();
    eventually("cluster-c's CSR approved once accepted", WAIT, || async {
        is_approved(&csrs.get("not-accepted").await.unwrap()).then_some(())
    })
    .await;
    assert!(!is_approved(&csrs.get("stolen").await.unwrap()));
    hub.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_deployment_config_applies_to_addons_naming_none() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.decide(&["cluster-a"]).await;
    deployment_config(&hub, "fleet", "svc.fleet.local").await;
    let mut settings = AddonSettings::new(HUB);
    settings.default_deployment_config = Some((HUB.to_owned(), "fleet".to_owned()));
    hub.start(settings);

    eventually("cluster-a's work", WAIT, || hub.work("cluster-a")).await;
    assert_eq!(
        work_service_domain(&hub, "cluster-a").await.as_deref(),
        Some("svc.fleet.local")
    );
    let addon = hub
        .wait_condition(
            "cluster-a",
            "Configured",
            "True",
            "ConfigurationsConfigured",
        )
        .await;
    let references = addon.status.unwrap().config_references.unwrap();
    assert_eq!(references[1].namespace.as_deref(), Some(HUB));
    assert_eq!(references[1].name.as_deref(), Some("fleet"));
    hub.stop().await;
}

/// The service domain `cluster`'s work renders (its AddOnDeploymentConfig's
/// `serviceDomain`), once the work exists.
async fn work_service_domain(hub: &Hub, cluster: &str) -> Option<String> {
    let work = hub.work(cluster).await?;
    let manifests = work.spec.workload?.manifests?;
    let service = manifests
        .iter()
        .find(|m| m.kind() == Some("Service") && m.name() == Some(cluster))?;
    let name = service.0["spec"]["externalName"].as_str()?;
    Some(name.strip_prefix("kubernetes.default.")?.to_owned())
}

async fn wait_service_domain(hub: &Hub, cluster: &str, domain: &str) {
    eventually(&format!("{cluster} renders {domain}"), WAIT, || async {
        (work_service_domain(hub, cluster).await.as_deref() == Some(domain)).then_some(())
    })
    .await;
}

async fn deployment_config(hub: &Hub, name: &str, domain: &str) {
    let adc: AddOnDeploymentConfig = object(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "AddOnDeploymentConfig",
        "metadata": {"name": name, "namespace": HUB},
        "spec": {"customizedVariables": [{"name": "serviceDomain", "value": domain}]},
    }));
    Api::<AddOnDeploymentConfig>::namespaced(hub.admin.clone(), HUB)
        .patch(
            name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&adc),
        )
        .await
        .unwrap();
}

/// OCM's `installStrategy.placements[].configs`: the placement's
/// AddOnDeploymentConfig wins over the ClusterManagementAddOn's default, an
/// addon's own `configs` win over both, the controller keeps what the user
/// wrote there, and a cluster out of every decision keeps what it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placements_configs_override_the_default_deployment_config() {
    let mut hub = Hub::new(true).await;
    for cluster in ["cluster-a", "cluster-b"] {
        hub.cluster(cluster, true).await;
    }
    hub.decide(&["cluster-a", "cluster-b"]).await;
    deployment_config(&hub, "fleet", "svc.fleet.local").await;
    deployment_config(&hub, "by-placement", "svc.placement.local").await;
    deployment_config(&hub, "own", "svc.own.local").await;
    hub.start(AddonSettings {
        default_deployment_config: Some((HUB.to_owned(), "fleet".to_owned())),
        removal_grace: Duration::from_secs(600),
        ..AddonSettings::new(HUB)
    });
    for cluster in ["cluster-a", "cluster-b"] {
        wait_service_domain(&hub, cluster, "svc.fleet.local").await;
    }

    // The user gives the placement a configuration.
    let managements = Api::<ClusterManagementAddOn>::all(hub.admin.clone());
    managements
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"installStrategy": {"placements": [{
                "name": "cluster-proxy-placement", "namespace": HUB,
                "configs": [{"group": "addon.open-cluster-management.io",
                    "resource": "addondeploymentconfigs",
                    "namespace": HUB, "name": "by-placement"}],
            }]}}})),
        )
        .await
        .unwrap();
    for cluster in ["cluster-a", "cluster-b"] {
        wait_service_domain(&hub, cluster, "svc.placement.local").await;
    }
    let addon = hub
        .wait_condition(
            "cluster-a",
            "Configured",
            "True",
            "ConfigurationsConfigured",
        )
        .await;
    let references = addon.status.unwrap().config_references.unwrap();
    assert_eq!(references[1].name.as_deref(), Some("by-placement"));
    // The summary's desired configuration is the placement's.
    let summary = eventually("the placement's desired configuration", WAIT, || async {
        let management = managements.get("cluster-proxy").await.ok()?;
        let progression = management
            .status?
            .install_progressions?
            .into_iter()
            .next()?;
        let adc = progression
            .config_references?
            .into_iter()
            .find(|reference| reference.resource == "addondeploymentconfigs")?;
        let desired = adc.desired_config?;
        (desired.name == "by-placement").then_some(desired)
    })
    .await;
    assert_eq!(summary.namespace.as_deref(), Some(HUB));
    assert!(summary.spec_hash.is_some());

    // An addon's own configuration wins over the placement's.
    hub.addons("cluster-b")
        .patch(
            "cluster-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"configs": [{
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "namespace": HUB, "name": "own"}]}})),
        )
        .await
        .unwrap();
    wait_service_domain(&hub, "cluster-b", "svc.own.local").await;

    // cluster-a leaves every decision (its addon waits out the removal
    // grace); the default changes meanwhile, and every addon is reconciled.
    hub.decide(&["cluster-b"]).await;
    eventually("cluster-a's removal pending", WAIT, || async {
        (hub.metrics.pending_removal_count() == 1).then_some(())
    })
    .await;
    let reconciled = hub.metrics.reconciliation_count("managedclusteraddon");
    deployment_config(&hub, "fleet", "svc.fleet2.local").await;
    eventually("both addons reconciled again", WAIT, || async {
        (hub.metrics.reconciliation_count("managedclusteraddon") >= reconciled + 2).then_some(())
    })
    .await;
    assert_eq!(
        work_service_domain(&hub, "cluster-a").await.as_deref(),
        Some("svc.placement.local"),
        "a cluster out of every decision was re-rendered"
    );
    let placements = managements
        .get("cluster-proxy")
        .await
        .unwrap()
        .spec
        .install_strategy
        .unwrap()
        .placements
        .unwrap();
    assert!(
        placements[0].configs.is_some(),
        "the controller dropped the user's configs"
    );
    hub.stop().await;
}

fn containers_of(work: &ManifestWork) -> Vec<Value> {
    deployment_of(work)["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("the agent pod has containers")
        .clone()
}

async fn annotate_cluster(hub: &Hub, cluster: &str, registries: Option<&str>) {
    let patch = json!({"metadata": {"annotations": {
        "open-cluster-management.io/image-registries": registries,
    }}});
    Api::<ManagedCluster>::all(hub.admin.clone())
        .patch(cluster, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_mirrors_and_container_resources_follow_the_cluster_and_its_config() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.decide(&["cluster-a"]).await;
    let adc: AddOnDeploymentConfig = object(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "AddOnDeploymentConfig",
        "metadata": {"name": "fleet", "namespace": HUB},
        "spec": {"resourceRequirements": [{
            "containerID": "deployments:cluster-proxy-proxy-agent:proxy-agent",
            "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "1", "memory": "256Mi"}},
        }]},
    }));
    let configs = Api::<AddOnDeploymentConfig>::namespaced(hub.admin.clone(), HUB);
    configs.create(&PostParams::default(), &adc).await.unwrap();
    let mut settings = AddonSettings::new(HUB);
    settings.default_deployment_config = Some((HUB.to_owned(), "fleet".to_owned()));
    hub.start(settings);

    let work = eventually("cluster-a's work", WAIT, || hub.work("cluster-a")).await;
    let containers = containers_of(&work);
    assert_eq!(
        containers[0]["resources"],
        json!({"requests": {"cpu": "250m"}, "limits": {"cpu": "1", "memory": "256Mi"}})
    );
    assert!(
        containers[1].get("resources").is_none(),
        "{}",
        containers[1]
    );
    assert_eq!(containers[0]["image"], "registry.local/cluster-proxy:1");

    // A mirror annotated on the ManagedCluster redeploys the agent from it.
    annotate_cluster(
        &hub,
        "cluster-a",
        Some(r#"{"registries":[{"source":"registry.local","mirror":"mirror.corp/ocm"}]}"#),
    )
    .await;
    let mirrored = eventually("the work follows the annotation", WAIT, || async {
        let work = hub.work("cluster-a").await?;
        containers_of(&work)
            .iter()
            .all(|container| container["image"] == "mirror.corp/ocm/cluster-proxy:1")
            .then_some(work)
    })
    .await;

    // A broken annotation is reported on the addon; the work stays as it was.
    annotate_cluster(&hub, "cluster-a", Some("{registries: mirror.corp")).await;
    let addon = hub
        .wait_condition(
            "cluster-a",
            "ManifestApplied",
            "False",
            "InvalidImageRegistries",
        )
        .await;
    assert!(
        condition_message(&addon, "ManifestApplied")
            .contains("open-cluster-management.io/image-registries")
    );
    assert_eq!(
        hub.work("cluster-a").await.unwrap().resource_version(),
        mirrored.resource_version()
    );

    // The annotation removed: the MPC's image again.
    annotate_cluster(&hub, "cluster-a", None).await;
    eventually("the MPC's image again", WAIT, || async {
        let work = hub.work("cluster-a").await?;
        (containers_of(&work)[0]["image"] == "registry.local/cluster-proxy:1").then_some(())
    })
    .await;

    // An ADC whose container ID is not kind:name:container is reported too.
    let broken = json!({"spec": {"resourceRequirements": [{
        "containerID": "proxy-agent", "resources": {"limits": {"cpu": "2"}},
    }]}});
    configs
        .patch("fleet", &PatchParams::default(), &Patch::Merge(&broken))
        .await
        .unwrap();
    let addon = hub
        .wait_condition(
            "cluster-a",
            "ManifestApplied",
            "False",
            "InvalidResourceRequirements",
        )
        .await;
    assert!(condition_message(&addon, "ManifestApplied").contains("\"proxy-agent\""));
    assert_eq!(
        containers_of(&hub.work("cluster-a").await.unwrap())[0]["resources"]["limits"]["cpu"],
        "1",
        "the work keeps the last valid resources"
    );
    hub.stop().await;
}

/// Regression: `--managed-proxy-configuration`, `--agent-image-name` and
/// `--enable-kube-api-proxy` were parsed and ignored. The agents now follow
/// the MPC named, run the image named, and without the kube-apiserver proxy
/// get no ExternalName Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_named_configuration_and_agent_image_are_followed() {
    let mut hub = Hub::new(false).await;
    let mut mpc = mpc_object(1);
    mpc.metadata.name = Some("fleet-proxy".to_owned());
    Api::<ManagedProxyConfiguration>::all(hub.admin.clone())
        .create(&PostParams::default(), &mpc)
        .await
        .unwrap();
    hub.cluster("cluster-a", true).await;
    hub.decide(&["cluster-a"]).await;
    hub.start(AddonSettings {
        managed_proxy_configuration: "fleet-proxy".to_owned(),
        agent_image: Some("registry.local/agent-override:7".to_owned()),
        enable_kube_api_proxy: false,
        ..AddonSettings::new(HUB)
    });

    let addon = hub
        .wait_condition(
            "cluster-a",
            "Configured",
            "True",
            "ConfigurationsConfigured",
        )
        .await;
    let references = addon.status.unwrap().config_references.unwrap();
    assert!(
        references
            .iter()
            .any(|r| r.resource == "managedproxyconfigurations"
                && r.name.as_deref() == Some("fleet-proxy")),
        "{references:?}"
    );
    let management = Api::<ClusterManagementAddOn>::all(hub.admin.clone())
        .get("cluster-proxy")
        .await
        .unwrap();
    let supported = management.spec.supported_configs.unwrap();
    assert!(
        supported.iter().any(|config| config
            .default_config
            .as_ref()
            .is_some_and(|default| default.name == "fleet-proxy")),
        "{supported:?}"
    );
    let work = eventually("cluster-a's work", WAIT, || hub.work("cluster-a")).await;
    let deployment = deployment_of(&work);
    for container in deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
    {
        assert_eq!(container["image"], "registry.local/agent-override:7");
    }
    let manifests = work.spec.workload.unwrap().manifests.unwrap();
    assert!(
        !manifests
            .iter()
            .any(|m| m.kind() == Some("Service") && m.name() == Some("cluster-a")),
        "no ExternalName Service without the kube-apiserver proxy"
    );
    hub.stop().await;
}

/// The container names of `cluster`'s agent, once its work exists.
async fn agent_containers(hub: &Hub, cluster: &str) -> Option<Vec<String>> {
    let work = hub.work(cluster).await?;
    Some(
        containers_of(&work)
            .iter()
            .filter_map(|c| c["name"].as_str().map(str::to_owned))
            .collect(),
    )
}

/// `--enable-service-proxy`: the agent goes without its service-proxy until
/// cert-authority's certificate exists, gets it (with the certificate and
/// the impersonator role) when it appears, and loses it with it; without
/// the flag the Secret changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_proxy_joins_the_agent_once_its_certificate_exists() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.decide(&["cluster-a"]).await;
    let mut settings = AddonSettings::new(HUB);
    settings.enable_service_proxy = true;
    hub.start(settings);
    eventually(
        "cluster-a's agent without a service-proxy",
        WAIT,
        || async {
            (agent_containers(&hub, "cluster-a").await? == ["proxy-agent", "addon-agent"])
                .then_some(())
        },
    )
    .await;

    let certificate = json!({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "cluster-proxy-service-proxy-server-cert", "namespace": HUB},
        "stringData": {"tls.crt": "SERVICE-PROXY CERT", "tls.key": "SERVICE-PROXY KEY"}});
    let secrets = Api::<Secret>::namespaced(hub.admin.clone(), HUB);
    secrets
        .create(&PostParams::default(), &object(certificate))
        .await
        .unwrap();
    let work = eventually("cluster-a's agent with its service-proxy", WAIT, || async {
        let containers = agent_containers(&hub, "cluster-a").await?;
        (containers == ["proxy-agent", "addon-agent", "service-proxy"]).then_some(())?;
        hub.work("cluster-a").await
    })
    .await;
    let manifests = &serde_json::to_value(&work).unwrap()["spec"]["workload"]["manifests"];
    let copied = manifests
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["metadata"]["name"] == "cluster-proxy-service-proxy-server-certificates")
        .expect("the certificate's copy is in the work");
    use base64::Engine as _;
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(copied["data"]["tls.crt"].as_str().unwrap())
            .unwrap(),
        b"SERVICE-PROXY CERT"
    );
    assert!(
        manifests
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["kind"] == "ClusterRole"
                && m["metadata"]["name"] == "cluster-proxy-addon-agent-impersonator")
    );

    secrets
        .delete(
            "cluster-proxy-service-proxy-server-cert",
            &Default::default(),
        )
        .await
        .unwrap();
    eventually(
        "the service-proxy leaves with its certificate",
        WAIT,
        || async {
            (agent_containers(&hub, "cluster-a").await? == ["proxy-agent", "addon-agent"])
                .then_some(())
        },
    )
    .await;
    hub.stop().await;
}

/// Tracing per cluster: the fleet's AddOnDeploymentConfig (the
/// ClusterManagementAddOn's default) keeps every agent's spans off its
/// tunnel, a cluster whose addon names its own ADC gets its own collector
/// instead (OCM replaces the whole config, it does not merge variables),
/// and an invalid value stops only that cluster's agent, with the variable
/// named in ManifestApplied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adc_tracing_variables_reach_each_clusters_agent() {
    let mut hub = Hub::new(true).await;
    hub.cluster("cluster-a", true).await;
    hub.cluster("cluster-b", true).await;
    apply_variables(
        &hub,
        HUB,
        "fleet",
        json!([{"name": "traceRelay", "value": "off"}]),
    )
    .await;
    apply_variables(
        &hub,
        "cluster-b",
        "own",
        json!([{"name": "otlpEndpoint", "value": "http://otel-collector.observability:4317"}]),
    )
    .await;
    for cluster in ["cluster-a", "cluster-b"] {
        let mut addon = ManagedClusterAddOn::new("cluster-proxy", Default::default());
        addon.metadata.namespace = Some(cluster.to_owned());
        if cluster == "cluster-b" {
            addon.spec.configs = Some(vec![object(json!({
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "namespace": "cluster-b",
                "name": "own",
            }))]);
        }
        hub.addons(cluster)
            .create(&PostParams::default(), &addon)
            .await
            .unwrap();
    }
    let mut settings = AddonSettings::new(HUB);
    settings.install_strategy = InstallStrategy::Manual;
    settings.default_deployment_config = Some((HUB.to_owned(), "fleet".to_owned()));
    hub.start(settings);

    // The work may be written once before the configuration is resolved:
    // wait for the one rendered from it.
    let a = work_whose_last_arg(&hub, "cluster-a", "--trace-relay=off").await;
    let args = proxy_agent_args(&a);
    assert!(
        !args.iter().any(|a| a.starts_with("--otlp-endpoint")),
        "{args:?}"
    );
    let b = work_whose_last_arg(
        &hub,
        "cluster-b",
        "--otlp-endpoint=http://otel-collector.observability:4317",
    )
    .await;
    let args = proxy_agent_args(&b);
    assert!(
        !args.iter().any(|a| a.starts_with("--trace-relay")),
        "{args:?}"
    );

    // A value the agent would refuse: cluster-b's agent is left as it was.
    let rendered = b.resource_version();
    apply_variables(
        &hub,
        "cluster-b",
        "own",
        json!([{"name": "otlpEndpoint", "value": "otel-collector:4317"}]),
    )
    .await;
    let addon = hub
        .wait_condition(
            "cluster-b",
            "ManifestApplied",
            "False",
            "InvalidManagedProxyConfiguration",
        )
        .await;
    let message = condition_message(&addon, "ManifestApplied");
    assert!(
        message.contains("otlpEndpoint") && message.contains("otel-collector:4317"),
        "{message}"
    );
    assert_eq!(
        hub.work("cluster-b").await.unwrap().resource_version(),
        rendered
    );
    assert_eq!(
        proxy_agent_args(&hub.work("cluster-a").await.unwrap())
            .last()
            .map(String::as_str),
        Some("--trace-relay=off")
    );
    hub.stop().await;
}

/// Applies the AddOnDeploymentConfig `namespace/name` with `variables`.
async fn apply_variables(hub: &Hub, namespace: &str, name: &str, variables: Value) {
    let adc: AddOnDeploymentConfig = object(json!({
        "apiVersion": "addon.open-cluster-management.io/v1alpha1",
        "kind": "AddOnDeploymentConfig",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"customizedVariables": variables},
    }));
    Api::<AddOnDeploymentConfig>::namespaced(hub.admin.clone(), namespace)
        .patch(
            name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&adc),
        )
        .await
        .unwrap();
}

/// `cluster`'s work once its proxy-agent's last argument is `last`.
async fn work_whose_last_arg(hub: &Hub, cluster: &str, last: &str) -> ManifestWork {
    eventually(&format!("{cluster}'s agent gets {last}"), WAIT, || async {
        let work = hub.work(cluster).await?;
        (proxy_agent_args(&work).last().map(String::as_str) == Some(last)).then_some(work)
    })
    .await
}

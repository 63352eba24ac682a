//! Which proxy-agent CSRs the addon manager approves: only the cluster's own
//! registration identity, for an accepted cluster, with the subject the
//! registration asks for.

use addon_manager::addon::csr::{Approval, approved, decide, requester_cluster};
use addon_manager::addon::render::signer_organization_unit;
use cluster_proxy_proto::api::cluster::v1::ManagedCluster;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
use serde_json::json;

const CA: &[u8] = b"the hub CA";

fn request_pem(common_name: &str, organizations: &[&str], units: &[&str]) -> String {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    for organization in organizations {
        name.push(DnType::OrganizationName, *organization);
    }
    for unit in units {
        name.push(DnType::OrganizationalUnitName, *unit);
    }
    params.distinguished_name = name;
    params.serialize_request(&key).unwrap().pem().unwrap()
}

fn good_request() -> String {
    request_pem(
        "open-cluster-management:cluster-proxy:proxy-agent",
        &["open-cluster-management:cluster-proxy"],
        &[&signer_organization_unit(CA)],
    )
}

fn csr(
    label_cluster: &str,
    username: &str,
    groups: &[&str],
    request: &str,
) -> CertificateSigningRequest {
    use base64::Engine;
    serde_json::from_value(json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {
            "name": "addon-cluster-a-cluster-proxy-x1",
            "labels": {
                "open-cluster-management.io/addon-name": "cluster-proxy",
                "open-cluster-management.io/cluster-name": label_cluster,
            },
        },
        "spec": {
            "signerName": "open-cluster-management.io/proxy-agent-signer",
            "request": base64::engine::general_purpose::STANDARD.encode(request),
            "usages": ["digital signature", "key encipherment", "client auth"],
            "username": username,
            "groups": groups,
        },
    }))
    .unwrap()
}

fn own_csr(request: &str) -> CertificateSigningRequest {
    csr(
        "cluster-a",
        "system:open-cluster-management:cluster-a:agent1",
        &[
            "system:open-cluster-management:cluster-a",
            "system:authenticated",
        ],
        request,
    )
}

fn cluster(name: &str, accepted: bool) -> ManagedCluster {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"hubAcceptsClient": accepted},
    }))
    .unwrap()
}

fn unit() -> String {
    signer_organization_unit(CA)
}

fn assert_left(approval: Approval, why: &str) {
    match approval {
        Approval::Leave(reason) => assert!(reason.contains(why), "{reason:?} does not say {why:?}"),
        other => panic!("expected the CSR to be left ({why}), got {other:?}"),
    }
}

#[test]
fn the_clusters_own_agent_is_approved() {
    let approval = decide(
        &own_csr(&good_request()),
        Some(&cluster("cluster-a", true)),
        Some(&unit()),
    );
    match approval {
        Approval::Approve { cluster } => assert_eq!(cluster.as_str(), "cluster-a"),
        other => panic!("expected approval, got {other:?}"),
    }
}

#[test]
fn another_clusters_identity_is_never_approved() {
    // cluster-b's registration agent asks for a certificate labelled cluster-a.
    let request = csr(
        "cluster-a",
        "system:open-cluster-management:cluster-b:agent1",
        &["system:open-cluster-management:cluster-b"],
        &good_request(),
    );
    assert_left(
        decide(&request, Some(&cluster("cluster-a", true)), Some(&unit())),
        "requester belongs to cluster cluster-b",
    );
    // ... and even with its own label, the looked-up cluster must be its own.
    let request = csr(
        "cluster-b",
        "system:open-cluster-management:cluster-b:agent1",
        &["system:open-cluster-management:cluster-b"],
        &good_request(),
    );
    assert_left(
        decide(&request, Some(&cluster("cluster-a", true)), Some(&unit())),
        "does not exist",
    );
    // A user claiming a cluster without its group.
    let request = csr(
        "cluster-a",
        "system:open-cluster-management:cluster-a:agent1",
        &["system:authenticated"],
        &good_request(),
    );
    assert_left(
        decide(&request, Some(&cluster("cluster-a", true)), Some(&unit())),
        "is not in group",
    );
    // Any other user.
    let request = csr("cluster-a", "alice", &["system:masters"], &good_request());
    assert_left(
        decide(&request, Some(&cluster("cluster-a", true)), Some(&unit())),
        "not a managed cluster's registration identity",
    );
}

#[test]
fn clusters_the_hub_does_not_accept_are_not_approved() {
    assert_left(
        decide(
            &own_csr(&good_request()),
            Some(&cluster("cluster-a", false)),
            Some(&unit()),
        ),
        "hubAcceptsClient",
    );
    assert_left(
        decide(&own_csr(&good_request()), None, Some(&unit())),
        "does not exist",
    );
}

#[test]
fn the_subject_must_be_the_registrations() {
    let accepted = cluster("cluster-a", true);
    let wrong_user = request_pem(
        "system:admin",
        &["open-cluster-management:cluster-proxy"],
        &[&unit()],
    );
    assert_left(
        decide(&own_csr(&wrong_user), Some(&accepted), Some(&unit())),
        "common name",
    );
    let extra_group = request_pem(
        "open-cluster-management:cluster-proxy:proxy-agent",
        &["open-cluster-management:cluster-proxy", "system:masters"],
        &[&unit()],
    );
    assert_left(
        decide(&own_csr(&extra_group), Some(&accepted), Some(&unit())),
        "organizations",
    );
    let old_ca = request_pem(
        "open-cluster-management:cluster-proxy:proxy-agent",
        &["open-cluster-management:cluster-proxy"],
        &[&signer_organization_unit(b"the previous CA")],
    );
    assert_left(
        decide(&own_csr(&old_ca), Some(&accepted), Some(&unit())),
        "current CA",
    );
    assert_left(
        decide(&own_csr(&good_request()), Some(&accepted), None),
        "not published",
    );
    assert_left(
        decide(&own_csr("not a request"), Some(&accepted), Some(&unit())),
        "PEM",
    );
}

#[test]
fn other_signers_labels_and_decided_csrs_are_ignored_or_left() {
    let accepted = cluster("cluster-a", true);
    let mut other_signer = own_csr(&good_request());
    other_signer.spec.signer_name = "example.com/another-signer".into();
    assert!(matches!(
        decide(&other_signer, Some(&accepted), Some(&unit())),
        Approval::Ignore(_)
    ));
    // The proxy-agent's subject is not the hub kubeconfig's.
    let mut wrong_subject = own_csr(&good_request());
    wrong_subject.spec.signer_name = "kubernetes.io/kube-apiserver-client".into();
    assert_left(
        decide(&wrong_subject, Some(&accepted), Some(&unit())),
        "common name",
    );

    let mut other_addon = own_csr(&good_request());
    other_addon.metadata.labels.as_mut().unwrap().insert(
        "open-cluster-management.io/addon-name".into(),
        "other".into(),
    );
    assert_left(
        decide(&other_addon, Some(&accepted), Some(&unit())),
        "addon-name",
    );

    let mut unlabelled = own_csr(&good_request());
    unlabelled
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .remove("open-cluster-management.io/cluster-name");
    assert_left(
        decide(&unlabelled, Some(&accepted), Some(&unit())),
        "cluster-name",
    );

    let cluster_name = cluster_proxy_proto::identity::ClusterName::new("cluster-a").unwrap();
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let done = approved(&own_csr(&good_request()), &cluster_name, now);
    let condition = &done.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
    assert_eq!(
        (condition.type_.as_str(), condition.status.as_str()),
        ("Approved", "True")
    );
    assert!(matches!(
        decide(&done, Some(&accepted), Some(&unit())),
        Approval::Ignore(_)
    ));
}

#[test]
fn requester_rule() {
    let groups = |g: &[&str]| g.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        requester_cluster(
            "system:open-cluster-management:c1:agent",
            &groups(&["system:open-cluster-management:c1"])
        )
        .unwrap()
        .as_str(),
        "c1"
    );
    for (user, group) in [
        (
            "system:open-cluster-management:c1",
            "system:open-cluster-management:c1",
        ),
        (
            "system:open-cluster-management:c1:",
            "system:open-cluster-management:c1",
        ),
        (
            "system:open-cluster-management:C1:agent",
            "system:open-cluster-management:C1",
        ),
        (
            "system:open-cluster-management:cluster:c1:addon:cluster-proxy",
            "system:open-cluster-management:cluster",
        ),
        (
            "open-cluster-management:c1:agent",
            "system:open-cluster-management:c1",
        ),
    ] {
        assert!(
            requester_cluster(user, &groups(&[group])).is_err(),
            "{user} must not pass"
        );
    }
}

/// A hub kubeconfig request: the addon framework's subject for `cluster`
/// (two organizations, each in a subject attribute of its own), its second
/// group replaced by `other_group` when given.
fn hub_kubeconfig_request(cluster: &str, other_group: Option<&str>) -> String {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut name = DistinguishedName::new();
    name.push(
        DnType::CommonName,
        format!("system:open-cluster-management:cluster:{cluster}:addon:cluster-proxy:agent:cluster-proxy-agent"),
    );
    name.push(
        DnType::OrganizationName,
        format!("system:open-cluster-management:cluster:{cluster}:addon:cluster-proxy"),
    );
    // The same attribute type once more (rcgen keeps one value per type).
    name.push(
        DnType::CustomDnType(vec![2, 5, 4, 10]),
        other_group.unwrap_or("system:open-cluster-management:addon:cluster-proxy"),
    );
    params.distinguished_name = name;
    params.serialize_request(&key).unwrap().pem().unwrap()
}

fn hub_kubeconfig_csr(request: &str, usages: &[&str]) -> CertificateSigningRequest {
    let mut csr = own_csr(request);
    csr.spec.signer_name = "kubernetes.io/kube-apiserver-client".into();
    csr.spec.usages = Some(usages.iter().map(|u| u.to_string()).collect());
    csr
}

/// Regression (issue 56): nothing approved the addon-agent's
/// `kubernetes.io/kube-apiserver-client` CSR (OCM's addon-manager approves
/// only template addons' CSRs), so its hub kubeconfig never appeared.
#[test]
fn the_addon_agents_hub_kubeconfig_is_approved_for_its_own_subject_only() {
    let accepted = cluster("cluster-a", true);
    let usages = ["digital signature", "key encipherment", "client auth"];
    let good = hub_kubeconfig_csr(&hub_kubeconfig_request("cluster-a", None), &usages);
    // No CA is needed for it.
    assert_eq!(
        decide(&good, Some(&accepted), None),
        Approval::Approve {
            cluster: cluster_proxy_proto::identity::ClusterName::new("cluster-a").unwrap()
        }
    );
    // Another cluster's user, asked for by cluster-a's registration agent.
    assert_left(
        decide(
            &hub_kubeconfig_csr(&hub_kubeconfig_request("cluster-b", None), &usages),
            Some(&accepted),
            None,
        ),
        "common name",
    );
    // A group with more rights slipped in.
    assert_left(
        decide(
            &hub_kubeconfig_csr(
                &hub_kubeconfig_request("cluster-a", Some("system:masters")),
                &usages,
            ),
            Some(&accepted),
            None,
        ),
        "organizations",
    );
    // A serving certificate is not a hub kubeconfig.
    assert_left(
        decide(
            &hub_kubeconfig_csr(
                &hub_kubeconfig_request("cluster-a", None),
                &["digital signature", "server auth"],
            ),
            Some(&accepted),
            None,
        ),
        "server auth",
    );
    // The hub must accept the cluster, as for the proxy-agent.
    assert_left(
        decide(&good, Some(&cluster("cluster-a", false)), None),
        "hubAcceptsClient",
    );
}

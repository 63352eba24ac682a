//! `cluster-proxy kubeconfig`: a kubeconfig with one context per managed
//! cluster, each reaching that cluster through the user-server
//! (`https://<user-server>/<cluster>`) as the hub user of the current (or
//! named) context: that context's own credential (token, client
//! certificate, exec plugin) is carried over, and the user-server's CA is
//! trusted. Never insecure TLS (`clusteradm proxy kubectl` skips it).

use std::path::Path;

use base64::Engine;
use kube::config::{Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};

/// The name of the (one) user of the written kubeconfig.
pub const HUB_USER: &str = "cluster-proxy-hub-user";

#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("the hub kubeconfig has no context {0:?}")]
    NoContext(String),
    #[error("the hub kubeconfig names no current context: pass --context")]
    NoCurrentContext,
    #[error("context {context:?} names user {user:?}, which the kubeconfig does not define")]
    NoUser { context: String, user: String },
    #[error(
        "context {0:?} carries no credential the user-server accepts (a token, a client certificate or an exec plugin)"
    )]
    NoCredential(String),
    #[error("--user-server {0:?} must be an https:// URL without a path")]
    UserServer(String),
    #[error("the user-server CA is not PEM: {0}")]
    Ca(String),
    #[error("no managed clusters to write contexts for")]
    NoClusters,
}

/// The kubeconfig for `clusters` through `user_server` (`https://host:port`),
/// trusting `ca_pem`, as the user of `context` (default: the current one)
/// in `hub`.
pub fn for_clusters(
    hub: &Kubeconfig,
    context: Option<&str>,
    user_server: &str,
    ca_pem: &str,
    clusters: &[String],
) -> Result<Kubeconfig, KubeconfigError> {
    let base = user_server.trim_end_matches('/');
    let parsed: http::Uri = base
        .parse()
        .map_err(|_| KubeconfigError::UserServer(user_server.to_owned()))?;
    if parsed.scheme_str() != Some("https")
        || parsed.host().is_none()
        || parsed.path_and_query().is_some_and(|p| p.as_str() != "/")
    {
        return Err(KubeconfigError::UserServer(user_server.to_owned()));
    }
    if !ca_pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(KubeconfigError::Ca("no CERTIFICATE block found".to_owned()));
    }
    if clusters.is_empty() {
        return Err(KubeconfigError::NoClusters);
    }
    let context_name = match context {
        Some(name) => name.to_owned(),
        None => hub
            .current_context
            .clone()
            .ok_or(KubeconfigError::NoCurrentContext)?,
    };
    let named = hub
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .ok_or_else(|| KubeconfigError::NoContext(context_name.clone()))?;
    let user_name = named
        .context
        .as_ref()
        .map(|c| c.user.clone().unwrap_or_default())
        .unwrap_or_default();
    let auth = hub
        .auth_infos
        .iter()
        .find(|a| a.name == user_name)
        .and_then(|a| a.auth_info.clone())
        .ok_or_else(|| KubeconfigError::NoUser {
            context: context_name.clone(),
            user: user_name.clone(),
        })?;
    let has_credential = auth.token.is_some()
        || auth.token_file.is_some()
        || auth.exec.is_some()
        || auth.auth_provider.is_some()
        || (auth.client_certificate.is_some() || auth.client_certificate_data.is_some())
            && (auth.client_key.is_some() || auth.client_key_data.is_some());
    if !has_credential {
        return Err(KubeconfigError::NoCredential(context_name));
    }
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let mut clusters: Vec<&String> = clusters.iter().collect();
    clusters.sort();
    clusters.dedup();
    Ok(Kubeconfig {
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        clusters: clusters
            .iter()
            .map(|name| NamedCluster {
                name: (*name).clone(),
                cluster: Some(Cluster {
                    server: Some(format!("{base}/{name}")),
                    certificate_authority_data: Some(ca.clone()),
                    ..Cluster::default()
                }),
                other: Default::default(),
            })
            .collect(),
        auth_infos: vec![NamedAuthInfo {
            name: HUB_USER.into(),
            auth_info: Some(auth),
            other: Default::default(),
        }],
        contexts: clusters
            .iter()
            .map(|name| NamedContext {
                name: (*name).clone(),
                context: Some(Context {
                    cluster: (*name).clone(),
                    user: Some(HUB_USER.into()),
                    ..Context::default()
                }),
                other: Default::default(),
            })
            .collect(),
        current_context: None,
        ..Kubeconfig::default()
    })
}

/// Writes `config` to `path` readable by its owner only (it holds the hub
/// credential).
pub fn write(config: &Kubeconfig, path: &Path) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // JSON is YAML: kubectl and every client library read it.
    let text = serde_json::to_string_pretty(config).map_err(std::io::Error::other)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    file.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    fn hub() -> Kubeconfig {
        Kubeconfig::from_yaml(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: hub\n  cluster:\n    server: https://hub:6443\ncontexts:\n- name: admin\n  context:\n    cluster: hub\n    user: admin\n- name: robot\n  context:\n    cluster: hub\n    user: robot\n- name: nobody\n  context:\n    cluster: hub\n    user: nobody\ncurrent-context: admin\nusers:\n- name: admin\n  user:\n    token: hub-token\n- name: robot\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: get-token\n- name: nobody\n  user: {}\n",
        )
        .unwrap()
    }

    #[test]
    fn one_context_per_cluster_with_the_hub_users_credential() {
        let clusters = vec!["cluster-b".to_owned(), "cluster-a".to_owned()];
        let config =
            for_clusters(&hub(), None, "https://proxy.example:9092/", CA, &clusters).unwrap();
        let names: Vec<&str> = config.contexts.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["cluster-a", "cluster-b"]);
        let server = config.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(
            server.server.as_deref(),
            Some("https://proxy.example:9092/cluster-a")
        );
        assert!(server.insecure_skip_tls_verify.is_none());
        assert!(server.certificate_authority_data.is_some());
        let text = serde_json::to_string(&config).unwrap();
        assert!(text.contains("hub-token"), "{text}");
        let robot = for_clusters(&hub(), Some("robot"), "https://p:1", CA, &clusters).unwrap();
        assert!(
            robot.auth_infos[0]
                .auth_info
                .as_ref()
                .unwrap()
                .exec
                .is_some()
        );
    }

    #[test]
    fn what_cannot_work_is_an_error() {
        let clusters = vec!["cluster-a".to_owned()];
        let hub = hub();
        let cases: Vec<(Result<Kubeconfig, KubeconfigError>, &str)> = vec![
            (
                for_clusters(&hub, Some("nobody"), "https://p:1", CA, &clusters),
                "no credential",
            ),
            (
                for_clusters(&hub, Some("missing"), "https://p:1", CA, &clusters),
                "no context",
            ),
            (
                for_clusters(&hub, None, "http://p:1", CA, &clusters),
                "https://",
            ),
            (
                for_clusters(&hub, None, "https://p:1/x", CA, &clusters),
                "https://",
            ),
            (
                for_clusters(&hub, None, "https://p:1", "not pem", &clusters),
                "not PEM",
            ),
            (
                for_clusters(&hub, None, "https://p:1", CA, &[]),
                "no managed clusters",
            ),
        ];
        for (result, says) in cases {
            let error = result.unwrap_err().to_string();
            assert!(error.contains(says), "{error:?} should say {says:?}");
        }
    }

    #[test]
    fn the_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let config = for_clusters(&hub(), None, "https://p:1", CA, &["c".to_owned()]).unwrap();
        write(&config, &path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let back = Kubeconfig::read_from(&path).unwrap();
        assert_eq!(back.contexts.len(), 1);
    }
}

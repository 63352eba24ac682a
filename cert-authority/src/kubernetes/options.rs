//! What the backend keeps, and where: its options, and the names of the
//! hub Secrets.

use std::time::Duration;

use cluster_proxy_proto::api::proxy::v1alpha1::{
    SERVICE_PROXY_SECRET_NAME, USER_SERVER_IDENTITY_SECRET_NAME, USER_SERVER_SECRET_NAME,
    USER_SERVER_SERVICE_NAME,
};

use crate::authority::{Desired, Leaf};
use crate::files;
use crate::rotation::{LeafPolicy, RolloverPolicy};

/// The Secret holding the trust bundle (upstream's name).
pub const BUNDLE_SECRET: &str = "proxy-server-ca";

/// What the backend keeps, and where.
#[derive(Debug, Clone)]
pub struct KubeOptions {
    /// Where the Lease lives, and the hub Secrets unless a followed
    /// ManagedProxyConfiguration names their namespace.
    pub namespace: String,
    /// The names of the three hub leaf Secrets.
    pub secret_names: LeafSecretNames,
    /// The cluster-scoped ManagedProxyConfiguration to follow; `None`:
    /// everything comes from these options.
    pub managed_proxy_configuration: Option<String>,
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
    /// Service access: `Some` (the user-server certificate's additional
    /// SANs) keeps its three certificates too (`spec.userServer` is set).
    pub user_server_additional_sans: Option<Vec<String>>,
}

impl KubeOptions {
    pub fn new(namespace: &str) -> Self {
        let host = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "cert-authority".into());
        KubeOptions {
            namespace: namespace.to_string(),
            secret_names: LeafSecretNames::default(),
            managed_proxy_configuration: None,
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
            user_server_additional_sans: None,
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
            user_server_sans: self
                .user_server_additional_sans
                .as_deref()
                .map(|additional| user_server_sans(&self.namespace, additional)),
        }
    }
}

/// The user-server certificate's SANs (upstream's): the local names, the
/// Service's names in `namespace`, then `additional`.
pub fn user_server_sans(namespace: &str, additional: &[String]) -> Vec<String> {
    let service = USER_SERVER_SERVICE_NAME;
    let mut sans: Vec<String> = vec![
        "127.0.0.1".into(),
        "localhost".into(),
        service.into(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ];
    for san in additional {
        if !sans.contains(san) {
            sans.push(san.clone());
        }
    }
    sans
}

/// The names of the three hub leaf Secrets (upstream's
/// `spec.authentication.dump.secrets`); service access's have fixed names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafSecretNames {
    pub proxy_server: String,
    pub agent_server: String,
    pub proxy_client: String,
}

impl Default for LeafSecretNames {
    fn default() -> Self {
        LeafSecretNames {
            proxy_server: files::PROXY_SERVER.into(),
            agent_server: files::AGENT_SERVER.into(),
            proxy_client: files::PROXY_CLIENT.into(),
        }
    }
}

impl LeafSecretNames {
    /// The Secret holding `leaf`; `None` for agents, which get their
    /// certificates through CSRs in this backend.
    pub fn of(&self, leaf: &Leaf) -> Option<&str> {
        match leaf {
            Leaf::ProxyServer => Some(&self.proxy_server),
            Leaf::AgentServer => Some(&self.agent_server),
            Leaf::ProxyClient => Some(&self.proxy_client),
            Leaf::UserServer => Some(USER_SERVER_SECRET_NAME),
            Leaf::UserServerIdentity => Some(USER_SERVER_IDENTITY_SECRET_NAME),
            Leaf::ServiceProxy => Some(SERVICE_PROXY_SECRET_NAME),
            Leaf::Agent(_) => None,
        }
    }

    /// Every name is a valid Secret name and names one Secret only, so no
    /// two certificates (or a certificate and the bundle) overwrite each
    /// other.
    pub fn validate(&self) -> Result<(), String> {
        let names = [
            ("signingProxyServerSecretName", &self.proxy_server),
            ("signingAgentServerSecretName", &self.agent_server),
            ("signingProxyClientSecretName", &self.proxy_client),
        ];
        for (field, name) in names {
            if !is_dns_subdomain(name) {
                return Err(format!(
                    "{field} {name:?} is not a valid Secret name (lower-case DNS subdomain)"
                ));
            }
            if name == BUNDLE_SECRET {
                return Err(format!(
                    "{field} {name:?} is the trust bundle's Secret; choose another name"
                ));
            }
            if Leaf::SERVICE_ACCESS
                .iter()
                .any(|leaf| self.of(leaf) == Some(name.as_str()))
            {
                return Err(format!(
                    "{field} {name:?} is a service-access certificate's Secret; choose another name"
                ));
            }
        }
        for (i, (field, name)) in names.iter().enumerate() {
            if let Some((other, _)) = names[i + 1..].iter().find(|(_, n)| n == name) {
                return Err(format!(
                    "{field} and {other} are both {name:?}; each certificate needs its own Secret"
                ));
            }
        }
        Ok(())
    }
}

/// A Kubernetes object name (RFC 1123 subdomain).
pub(crate) use cluster_proxy_proto::identity::is_dns1123_subdomain as is_dns_subdomain;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_secret_may_not_take_a_service_access_secrets_name() {
        for reserved in [
            USER_SERVER_SECRET_NAME,
            USER_SERVER_IDENTITY_SECRET_NAME,
            SERVICE_PROXY_SECRET_NAME,
        ] {
            let names = LeafSecretNames {
                proxy_client: reserved.into(),
                ..LeafSecretNames::default()
            };
            let error = names.validate().unwrap_err();
            assert!(error.contains("service-access"), "{error}");
        }
        assert_eq!(LeafSecretNames::default().validate(), Ok(()));
    }

    #[test]
    fn user_server_sans_are_upstreams_then_the_additional_ones_once() {
        assert_eq!(
            user_server_sans("hub", &["users.example.com".into(), "localhost".into()]),
            [
                "127.0.0.1",
                "localhost",
                "cluster-proxy-addon-user",
                "cluster-proxy-addon-user.hub",
                "cluster-proxy-addon-user.hub.svc",
                "cluster-proxy-addon-user.hub.svc.cluster.local",
                "users.example.com",
            ]
        );
    }
}

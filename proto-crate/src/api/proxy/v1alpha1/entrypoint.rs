//! Where agents dial the proxy-servers, derived once from a
//! `ManagedProxyConfiguration` for every service that needs it: the
//! addon-manager renders it into the agents' `--proxy-server-host/port`,
//! cert-authority puts it into the server certificates' SANs, and the hub
//! controller waits for a load balancer's address.

use k8s_openapi::api::core::v1::Service;

use super::resource::{
    DEFAULT_AGENT_SERVER_PORT, DEFAULT_LOAD_BALANCER_SERVICE_NAME, EntrypointType,
    ManagedProxyConfiguration,
};

/// The host agents dial with a `PortForward` entrypoint: the local end of
/// the addon-agent's port-forward.
pub const PORT_FORWARD_HOST: &str = "127.0.0.1";

/// Why the entrypoint address cannot be told (yet).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntrypointError {
    #[error("spec.proxyServer.entrypoint is not set: agents have no address to dial")]
    NotSet,
    #[error("entrypoint type Hostname needs spec.proxyServer.entrypoint.hostname.value")]
    NoHostname,
    #[error("spec.proxyServer.entrypoint.port {0} is not a TCP port (1-65535)")]
    BadPort(i32),
    #[error("load balancer Service {namespace}/{name} does not exist yet")]
    LoadBalancerMissing { namespace: String, name: String },
    #[error("load balancer Service {namespace}/{name} has no ingress address yet")]
    LoadBalancerPending { namespace: String, name: String },
}

impl EntrypointError {
    /// Whether only a load balancer's address is missing: the configuration
    /// is right, and the address comes when the cloud provisions it.
    pub fn is_pending(&self) -> bool {
        matches!(
            self,
            EntrypointError::LoadBalancerMissing { .. }
                | EntrypointError::LoadBalancerPending { .. }
        )
    }
}

/// The address a LoadBalancer Service publishes: its first ingress's IP,
/// else its host name (load balancers such as AWS's publish only that;
/// upstream ignores host names, so those never worked there).
pub fn load_balancer_address(service: &Service) -> Option<String> {
    let ingress = service
        .status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?
        .first()?;
    ingress
        .ip
        .as_deref()
        .filter(|ip| !ip.is_empty())
        .or(ingress.hostname.as_deref().filter(|host| !host.is_empty()))
        .map(str::to_owned)
}

impl ManagedProxyConfiguration {
    /// The LoadBalancer Service of the entrypoint, `(namespace, name)`, when
    /// its type is `LoadBalancerService` (default name
    /// `proxy-agent-entrypoint`, in the proxy-server namespace).
    pub fn load_balancer_service(&self) -> Option<(String, String)> {
        let entrypoint = self.spec.proxy_server.entrypoint.as_ref()?;
        if entrypoint.type_ != EntrypointType::LoadBalancerService {
            return None;
        }
        let name = entrypoint
            .load_balancer_service
            .as_ref()
            .map(|service| service.name.clone())
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| DEFAULT_LOAD_BALANCER_SERVICE_NAME.to_owned());
        Some((self.spec.proxy_server.namespace.clone(), name))
    }

    /// The address agents dial, `(host, port)`:
    ///
    /// * `Hostname`: `hostname.value`;
    /// * `LoadBalancerService`: [`load_balancer_address`] of
    ///   `load_balancer` (the Service [`Self::load_balancer_service`] names,
    ///   as read; `None` when it does not exist);
    /// * `PortForward`: [`PORT_FORWARD_HOST`].
    ///
    /// The port is `entrypoint.port`, where 0 means 8091 as upstream reads it.
    pub fn agent_entrypoint(
        &self,
        load_balancer: Option<&Service>,
    ) -> Result<(String, u16), EntrypointError> {
        let entrypoint = self
            .spec
            .proxy_server
            .entrypoint
            .as_ref()
            .ok_or(EntrypointError::NotSet)?;
        let port = match entrypoint.port {
            0 => DEFAULT_AGENT_SERVER_PORT,
            port => port,
        };
        let port = u16::try_from(port)
            .ok()
            .filter(|port| *port != 0)
            .ok_or(EntrypointError::BadPort(entrypoint.port))?;
        let host = match entrypoint.type_ {
            EntrypointType::Hostname => entrypoint
                .hostname
                .as_ref()
                .map(|hostname| hostname.value.trim())
                .filter(|value| !value.is_empty())
                .map(str::to_owned)
                .ok_or(EntrypointError::NoHostname)?,
            EntrypointType::PortForward => PORT_FORWARD_HOST.to_owned(),
            EntrypointType::LoadBalancerService => {
                let (namespace, name) = self.load_balancer_service().unwrap_or_default();
                let service =
                    load_balancer.ok_or_else(|| EntrypointError::LoadBalancerMissing {
                        namespace: namespace.clone(),
                        name: name.clone(),
                    })?;
                load_balancer_address(service)
                    .ok_or(EntrypointError::LoadBalancerPending { namespace, name })?
            }
        };
        Ok((host, port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mpc(entrypoint: serde_json::Value) -> ManagedProxyConfiguration {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "proxy.open-cluster-management.io/v1alpha1",
            "kind": "ManagedProxyConfiguration",
            "metadata": {"name": "cluster-proxy"},
            "spec": {
                "authentication": {},
                "proxyServer": {"image": "s", "namespace": "hub", "entrypoint": entrypoint},
                "proxyAgent": {"image": "a"},
            },
        }))
        .unwrap()
    }

    fn service(ingress: serde_json::Value) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "proxy-agent-entrypoint"},
            "status": {"loadBalancer": {"ingress": ingress}},
        }))
        .unwrap()
    }

    #[test]
    fn every_entrypoint_type_gives_its_address() {
        let hostname = mpc(
            serde_json::json!({"type": "Hostname", "hostname": {"value": "proxy.example"}, "port": 0}),
        );
        assert_eq!(
            hostname.agent_entrypoint(None),
            Ok(("proxy.example".into(), 8091))
        );
        let forward = mpc(serde_json::json!({"type": "PortForward", "port": 9091}));
        assert_eq!(
            forward.agent_entrypoint(None),
            Ok(("127.0.0.1".into(), 9091))
        );
        let lb = mpc(serde_json::json!({"type": "LoadBalancerService"}));
        assert_eq!(
            lb.load_balancer_service(),
            Some(("hub".into(), "proxy-agent-entrypoint".into()))
        );
        assert!(lb.agent_entrypoint(None).unwrap_err().is_pending());
        assert!(
            lb.agent_entrypoint(Some(&service(serde_json::json!([]))))
                .unwrap_err()
                .is_pending()
        );
        assert_eq!(
            lb.agent_entrypoint(Some(&service(serde_json::json!([{"hostname": "elb.aws"}])))),
            Ok(("elb.aws".into(), 8091))
        );
        assert_eq!(
            lb.agent_entrypoint(Some(&service(
                serde_json::json!([{"ip": "203.0.113.7", "hostname": "elb.aws"}])
            ))),
            Ok(("203.0.113.7".into(), 8091))
        );
    }

    #[test]
    fn bad_entrypoints_say_what_is_wrong() {
        let mut none = mpc(serde_json::json!({"type": "PortForward"}));
        none.spec.proxy_server.entrypoint = None;
        assert_eq!(none.agent_entrypoint(None), Err(EntrypointError::NotSet));
        let no_host = mpc(serde_json::json!({"type": "Hostname", "hostname": {"value": " "}}));
        assert_eq!(
            no_host.agent_entrypoint(None),
            Err(EntrypointError::NoHostname)
        );
        let port = mpc(serde_json::json!({"type": "PortForward", "port": 70000}));
        assert_eq!(
            port.agent_entrypoint(None),
            Err(EntrypointError::BadPort(70000))
        );
        let negative = mpc(serde_json::json!({"type": "PortForward", "port": -1}));
        assert_eq!(
            negative.agent_entrypoint(None),
            Err(EntrypointError::BadPort(-1))
        );
    }
}

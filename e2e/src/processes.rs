//! A proxy-server and one proxy-agent as child processes on loopback, for
//! benchmarks and tests that need each side's own RSS and CPU (read from
//! `/proc`) or the services exactly as they ship (their own runtimes,
//! their own OpenTelemetry exporters).

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use cluster_proxy_proto::identity::ClusterName;

use crate::env::binaries::Binaries;
use crate::harness::{ServerPorts, health_get, proxy_agent_args, proxy_server_args};
use crate::loadgen::{ProcessUsage, process_usage};
use crate::pki::TestPki;

/// Variables a child never inherits from the caller: the services' log
/// filter and every OpenTelemetry setting, so a process exports only when
/// its [`ChildTunnelOptions`] say so.
const SCRUBBED_ENV: &[&str] = &[
    "RUST_LOG",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_RESOURCE_ATTRIBUTES",
];

/// What a [`ChildTunnel`] gives its processes beyond the shared loopback
/// flags ([`proxy_server_args`], [`proxy_agent_args`]).
#[derive(Debug, Clone, Default)]
pub struct ChildTunnelOptions {
    pub server_args: Vec<String>,
    pub agent_args: Vec<String>,
    pub server_env: Vec<(String, String)>,
    pub agent_env: Vec<(String, String)>,
}

/// Why a [`ChildTunnel`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum ChildTunnelError {
    #[error("writing the PKI files: {0}")]
    Pki(#[from] crate::pki::TestPkiError),
    #[error("creating the certificate directory: {0}")]
    CertDir(#[source] std::io::Error),
    #[error("starting {binary}: {source}")]
    Spawn {
        binary: String,
        source: std::io::Error,
    },
    #[error("{0} did not stop within 30 s of SIGTERM")]
    DidNotStop(&'static str),
    #[error("{0} exited while starting")]
    Exited(&'static str),
    #[error("the agent of {cluster} held no tunnel to the server within {within:?}")]
    NotReady { cluster: String, within: Duration },
}

/// A proxy-server and a proxy-agent of one cluster, both killed on drop.
pub struct ChildTunnel {
    pub ports: ServerPorts,
    pub server: tokio::process::Child,
    pub agent: tokio::process::Child,
    pub server_pid: u32,
    pub agent_pid: u32,
    _certs: tempfile::TempDir,
}

impl ChildTunnel {
    /// How long [`ChildTunnel::start`] waits for the agent's tunnel.
    pub const READY_WAIT: Duration = Duration::from_secs(60);
    /// How long [`ChildTunnel::stop`] waits for each process to exit.
    pub const STOP_WAIT: Duration = Duration::from_secs(30);

    /// Starts both processes with `pki`'s credentials (written to a
    /// temporary directory) and returns once the server reports ready,
    /// which with a static server count means the agent holds a tunnel.
    /// `name` tells the processes apart (server and agent ids).
    pub async fn start(
        binaries: &Binaries,
        pki: &TestPki,
        cluster: &ClusterName,
        name: &str,
        options: &ChildTunnelOptions,
    ) -> Result<Self, ChildTunnelError> {
        let certs = tempfile::tempdir().map_err(ChildTunnelError::CertDir)?;
        let layout = pki.write(certs.path())?;
        let ports = ServerPorts::free();
        let spawn = |binary: &std::path::Path,
                     args: Vec<String>,
                     extra_args: &[String],
                     env: &[(String, String)]| {
            let mut command = tokio::process::Command::new(binary);
            command.args(args).args(extra_args);
            for variable in SCRUBBED_ENV {
                command.env_remove(variable);
            }
            command
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .map_err(|source| ChildTunnelError::Spawn {
                    binary: binary.display().to_string(),
                    source,
                })
        };
        let server = spawn(
            &binaries.proxy_server,
            proxy_server_args(&format!("{name}-server"), &ports, &layout),
            &options.server_args,
            &options.server_env,
        )?;
        let agent = spawn(
            &binaries.proxy_agent,
            proxy_agent_args(cluster, &format!("{name}-agent"), ports.agent, &layout),
            &options.agent_args,
            &options.agent_env,
        )?;
        let server_pid = server
            .id()
            .ok_or(ChildTunnelError::Exited("proxy-server"))?;
        let agent_pid = agent.id().ok_or(ChildTunnelError::Exited("proxy-agent"))?;
        let tunnel = ChildTunnel {
            ports,
            server,
            agent,
            server_pid,
            agent_pid,
            _certs: certs,
        };
        let waiting = Instant::now();
        while !matches!(
            health_get(tunnel.ports.health_addr(), "/readyz").await,
            Ok((200, _))
        ) {
            if waiting.elapsed() > Self::READY_WAIT {
                return Err(ChildTunnelError::NotReady {
                    cluster: cluster.to_string(),
                    within: Self::READY_WAIT,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(tunnel)
    }

    /// SIGTERM to both (they flush their last spans and close their
    /// tunnels), then waits up to [`ChildTunnel::STOP_WAIT`] for each to
    /// exit; one that does not is killed when `self` drops.
    pub async fn stop(mut self) -> Result<(), ChildTunnelError> {
        for child in [&mut self.server, &mut self.agent] {
            if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
        for (child, name) in [
            (&mut self.server, "proxy-server"),
            (&mut self.agent, "proxy-agent"),
        ] {
            if tokio::time::timeout(Self::STOP_WAIT, child.wait())
                .await
                .is_err()
            {
                return Err(ChildTunnelError::DidNotStop(name));
            }
        }
        Ok(())
    }

    /// The server's client port (gRPC and HTTP CONNECT).
    pub fn client_addr(&self) -> SocketAddr {
        self.ports.client_addr()
    }

    /// The server's and the agent's RSS and CPU time so far.
    pub fn usage(&self) -> std::io::Result<(ProcessUsage, ProcessUsage)> {
        Ok((
            process_usage(self.server_pid)?,
            process_usage(self.agent_pid)?,
        ))
    }
}

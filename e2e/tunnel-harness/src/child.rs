//! A proxy-server and one proxy-agent as child processes on loopback, for
//! benchmarks and tests that need each side's own RSS and CPU (read from
//! `/proc`) or the services exactly as they ship (their own runtimes,
//! their own OpenTelemetry exporters).

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use cluster_proxy_proto::identity::ClusterName;

use crate::in_process::{ServerPorts, health_get, proxy_agent_args, proxy_server_args};
use crate::loadgen::{ProcessUsage, process_usage};
use crate::pki::TestPki;
use simulated_cluster::binaries::Binaries;

/// Variables a child never inherits from the caller: the services' log
/// filter and backtraces (a test harness asks for them; an error the log
/// quotes should end in its message). Every `OTEL_*` variable goes too
/// ([`simulated_cluster::process::inherited_otel_variables`]), so a process exports only when its
/// [`ChildTunnelOptions`] say so.
const SCRUBBED_ENV: &[&str] = &["RUST_LOG", "RUST_BACKTRACE", "RUST_LIB_BACKTRACE"];

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
    #[error("{binary} exited while starting ({status}); the end of its log:\n{log_tail}")]
    ExitedWithLog {
        binary: &'static str,
        status: std::process::ExitStatus,
        log_tail: String,
    },
    #[error(
        "the agent of {cluster} held no tunnel to the server within {within:?}; \
         the end of the server's log:\n{server_log_tail}\nthe end of the agent's log:\n{agent_log_tail}"
    )]
    NotReady {
        cluster: String,
        within: Duration,
        server_log_tail: String,
        agent_log_tail: String,
    },
}

impl ChildTunnelError {
    /// Whether a process exited because a port picked for it was taken in
    /// the meantime: [`ServerPorts::free`] can only pick ports that were
    /// free a moment ago, and any process's outgoing connection may take
    /// one before the server binds it. Starting again on fresh ports is the
    /// remedy.
    fn is_port_taken(&self) -> bool {
        matches!(self, ChildTunnelError::ExitedWithLog { log_tail, .. }
            if log_tail.contains("Address already in use"))
    }
}

/// How many times [`ChildTunnel::start`] starts the pair on fresh ports
/// when a picked port was taken before the server bound it.
const START_ATTEMPTS: usize = 3;
/// How much of a process's log an error quotes.
const LOG_TAIL_BYTES: usize = 4096;

/// The last [`LOG_TAIL_BYTES`] of the log at `path` (empty if unreadable).
fn log_tail(path: &std::path::Path) -> String {
    let Ok(log) = std::fs::read(path) else {
        return String::new();
    };
    let start = log.len().saturating_sub(LOG_TAIL_BYTES);
    String::from_utf8_lossy(&log[start..]).into_owned()
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
    /// `name` tells the processes apart (server and agent ids). Each
    /// process's log goes to a file beside the credentials, quoted by the
    /// error when it exits or never gets ready; when a picked port was
    /// taken before the server bound it, the pair starts again on fresh
    /// ports (up to [`START_ATTEMPTS`] times).
    pub async fn start(
        binaries: &Binaries,
        pki: &TestPki,
        cluster: &ClusterName,
        name: &str,
        options: &ChildTunnelOptions,
    ) -> Result<Self, ChildTunnelError> {
        let mut attempt = 1;
        loop {
            let ports = ServerPorts::free();
            match Self::start_on(ports, binaries, pki, cluster, name, options).await {
                Err(e) if e.is_port_taken() && attempt < START_ATTEMPTS => {
                    eprintln!(
                        "{name}: a picked port was taken, starting again on fresh ports: {e}"
                    );
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// One attempt of [`ChildTunnel::start`], on `ports`.
    async fn start_on(
        ports: ServerPorts,
        binaries: &Binaries,
        pki: &TestPki,
        cluster: &ClusterName,
        name: &str,
        options: &ChildTunnelOptions,
    ) -> Result<Self, ChildTunnelError> {
        let certs = tempfile::tempdir().map_err(ChildTunnelError::CertDir)?;
        let layout = pki.write(certs.path())?;
        let server_log = certs.path().join("proxy-server.log");
        let agent_log = certs.path().join("proxy-agent.log");
        let spawn = |binary: &std::path::Path,
                     args: Vec<String>,
                     extra_args: &[String],
                     env: &[(String, String)],
                     log: &std::path::Path| {
            let spawn_error = |source| ChildTunnelError::Spawn {
                binary: binary.display().to_string(),
                source,
            };
            let log = std::fs::File::create(log).map_err(spawn_error)?;
            let mut command = tokio::process::Command::new(binary);
            command.args(args).args(extra_args);
            for variable in SCRUBBED_ENV {
                command.env_remove(variable);
            }
            for variable in simulated_cluster::process::inherited_otel_variables() {
                command.env_remove(variable);
            }
            command
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdout(Stdio::null())
                .stderr(log)
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
            &server_log,
        )?;
        let agent = spawn(
            &binaries.proxy_agent,
            proxy_agent_args(cluster, &format!("{name}-agent"), ports.agent, &layout),
            &options.agent_args,
            &options.agent_env,
            &agent_log,
        )?;
        let server_pid = server
            .id()
            .ok_or(ChildTunnelError::Exited("proxy-server"))?;
        let agent_pid = agent.id().ok_or(ChildTunnelError::Exited("proxy-agent"))?;
        let mut tunnel = ChildTunnel {
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
            for (child, binary, log) in [
                (&mut tunnel.server, "proxy-server", &server_log),
                (&mut tunnel.agent, "proxy-agent", &agent_log),
            ] {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(ChildTunnelError::ExitedWithLog {
                        binary,
                        status,
                        log_tail: log_tail(log),
                    });
                }
            }
            if waiting.elapsed() > Self::READY_WAIT {
                return Err(ChildTunnelError::NotReady {
                    cluster: cluster.to_string(),
                    within: Self::READY_WAIT,
                    server_log_tail: log_tail(&server_log),
                    agent_log_tail: log_tail(&agent_log),
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

#[cfg(test)]
mod tests {
    use super::*;
    use simulated_cluster::binaries::Progress;

    /// The race [`ChildTunnel::start`] retries: a port picked for the
    /// server is taken before the server binds it. The server exits, the
    /// error quotes why, and it is recognised as a taken port.
    #[tokio::test]
    async fn a_server_whose_port_is_taken_is_reported_with_its_log() {
        let binaries = tokio::task::spawn_blocking(|| Binaries::build(Progress::Quiet))
            .await
            .expect("build task")
            .expect("the service binaries build");
        let pki = TestPki::new(&["cluster-a"]).expect("test PKI");
        let cluster = ClusterName::new("cluster-a").expect("cluster name");
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let mut ports = ServerPorts::free();
        ports.agent = taken.local_addr().expect("its address").port();
        let error = ChildTunnel::start_on(
            ports,
            &binaries,
            &pki,
            &cluster,
            "taken",
            &ChildTunnelOptions::default(),
        )
        .await
        .err()
        .expect("the server cannot bind a taken port");
        assert!(
            matches!(
                error,
                ChildTunnelError::ExitedWithLog {
                    binary: "proxy-server",
                    ..
                }
            ),
            "{error}"
        );
        assert!(error.is_port_taken(), "{error}");
        eprintln!("as reported: {error}");
    }
}

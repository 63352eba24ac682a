//! Supervised child processes: every service of the environment is a real
//! process whose output goes, line by line, to its own log file and (when
//! asked) to our terminal with the component's name in front.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// The OpenTelemetry variables (`OTEL_*`) of this process's environment,
/// for a harness to remove from a child's: the services read many of them
/// (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` overrides the endpoint a harness
/// sets, `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` stops a service), and
/// what a child exports is the harness's decision, not the shell's.
pub fn inherited_otel_variables() -> Vec<std::ffi::OsString> {
    otel_variables(std::env::vars_os().map(|(name, _)| name))
}

fn otel_variables(names: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    names
        .filter(|name| name.as_encoded_bytes().starts_with(b"OTEL_"))
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("starting {name} ({program}): {source}")]
    Spawn {
        name: String,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("log file {}: {source}", path.display())]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where process output goes.
#[derive(Debug, Clone)]
pub struct Logs {
    dir: PathBuf,
    echo: bool,
    terminal: Arc<Mutex<()>>,
    /// The OTLP endpoint every process gets (see `env::traces`).
    trace_endpoint: Option<String>,
    /// With network namespaces: the one namespace (besides the machine's
    /// own) that reaches the endpoint. A process in any other (a managed
    /// cluster's) is not given it: it has no route there, and a proxy-agent
    /// without an endpoint sends its spans home through its tunnels.
    trace_netns: Option<String>,
}

impl Logs {
    /// `echo` also prints every line to stdout, prefixed by its component.
    pub fn new(dir: impl Into<PathBuf>, echo: bool) -> Self {
        Logs {
            dir: dir.into(),
            echo,
            terminal: Arc::new(Mutex::new(())),
            trace_endpoint: None,
            trace_netns: None,
        }
    }

    /// Every process started with these logs exports traces to `endpoint`
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT`, with `OTEL_SERVICE_NAME` its name).
    pub fn with_trace_endpoint(mut self, endpoint: Option<String>) -> Self {
        self.trace_endpoint = endpoint;
        self
    }

    /// Only processes on the machine itself or in network namespace
    /// `netns` (the hub's) get the trace endpoint; `None`: every process.
    pub fn with_trace_netns(mut self, netns: Option<String>) -> Self {
        self.trace_netns = netns;
        self
    }

    /// Whether a process in network namespace `netns` is given the trace
    /// endpoint (see [`Logs::with_trace_netns`]).
    pub fn reaches_trace_endpoint(&self, netns: Option<&str>) -> bool {
        match (netns, &self.trace_netns) {
            (Some(netns), Some(reaching)) => netns == reaching,
            _ => true,
        }
    }

    /// The OTLP endpoint processes get, if any.
    pub fn trace_endpoint(&self) -> Option<&str> {
        self.trace_endpoint.as_deref()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path_of(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// The last `lines` lines of a component's log, for failure reports.
    pub fn tail(&self, name: &str, lines: usize) -> String {
        let text = std::fs::read_to_string(self.path_of(name)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn color_of(name: &str) -> u8 {
        // Stable per component, skipping black/white and hard-to-read blue.
        const COLORS: [u8; 5] = [32, 33, 35, 36, 91];
        let sum: usize = name.bytes().map(usize::from).sum();
        COLORS[sum % COLORS.len()]
    }

    fn forward(&self, name: &str, reader: impl AsyncRead + Unpin + Send + 'static) {
        let path = self.path_of(name);
        let name = name.to_string();
        let logs = self.clone();
        tokio::spawn(async move {
            if let Some(parent) = path.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path);
            let mut file = file.ok();
            let mut lines = BufReader::new(reader).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(file) = file.as_mut() {
                    let _ = writeln!(file, "{line}");
                }
                if logs.echo {
                    let _guard = logs.terminal.lock();
                    if std::io::stdout().is_terminal() {
                        println!("\x1b[{}m{name:>16}\x1b[0m | {line}", Logs::color_of(&name));
                    } else {
                        println!("{name:>16} | {line}");
                    }
                }
            }
        });
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
}

impl ProcessSpec {
    pub fn new(name: &str, program: &Path) -> Self {
        ProcessSpec {
            name: name.to_string(),
            program: program.to_path_buf(),
            args: Vec::new(),
            netns: None,
            env: Vec::new(),
        }
    }

    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.push((key.to_string(), value.into()));
        self
    }

    pub fn in_netns(mut self, netns: Option<String>) -> Self {
        self.netns = netns;
        self
    }

    /// The command line as a user would type it.
    pub fn command_line(&self) -> String {
        let mut parts = Vec::new();
        if let Some(ns) = &self.netns {
            parts.push(format!("ip netns exec {ns}"));
        }
        parts.push(self.program.display().to_string());
        parts.extend(self.args.iter().cloned());
        parts.join(" ")
    }
}

/// How a supervised process is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessState {
    Running(u32),
    Exited(String),
    Stopped,
}

impl std::fmt::Display for ProcessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessState::Running(pid) => write!(f, "running (pid {pid})"),
            ProcessState::Exited(status) => write!(f, "exited ({status})"),
            ProcessState::Stopped => f.write_str("stopped"),
        }
    }
}

/// One child process, restartable.
pub struct Supervised {
    pub spec: ProcessSpec,
    logs: Logs,
    child: Option<Child>,
}

impl Supervised {
    pub fn start(spec: ProcessSpec, logs: &Logs) -> Result<Self, ProcessError> {
        let mut supervised = Supervised {
            spec,
            logs: logs.clone(),
            child: None,
        };
        supervised.spawn()?;
        Ok(supervised)
    }

    fn spawn(&mut self) -> Result<(), ProcessError> {
        let mut command = match &self.spec.netns {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns]).arg(&self.spec.program);
                command
            }
            None => Command::new(&self.spec.program),
        };
        command.args(&self.spec.args).env("NO_COLOR", "1");
        // Where traces go is `up`'s choice (its receiver, `--otlp-endpoint`
        // or none): a shell's `OTEL_*` settings would override or break it.
        for variable in inherited_otel_variables() {
            command.env_remove(variable);
        }
        if let Some(endpoint) = &self.logs.trace_endpoint {
            if self.logs.reaches_trace_endpoint(self.spec.netns.as_deref()) {
                command.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
            }
            command.env("OTEL_SERVICE_NAME", self.spec.name.replace('/', "."));
        }
        command
            .envs(self.spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A backstop: a dropped handle never leaves its process behind.
            .kill_on_drop(true);
        let path = self.logs.path_of(&self.spec.name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| ProcessError::Log {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| ProcessError::Log {
                path: path.clone(),
                source,
            })?;
        let _ = writeln!(file, "# {}", self.spec.command_line());
        let mut child = command.spawn().map_err(|source| ProcessError::Spawn {
            name: self.spec.name.clone(),
            program: self.spec.program.display().to_string(),
            source,
        })?;
        if let Some(stdout) = child.stdout.take() {
            self.logs.forward(&self.spec.name, stdout);
        }
        if let Some(stderr) = child.stderr.take() {
            self.logs.forward(&self.spec.name, stderr);
        }
        self.child = Some(child);
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The file its stdout and stderr go to.
    pub fn log_path(&self) -> PathBuf {
        self.logs.path_of(&self.spec.name)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    pub fn state(&mut self) -> ProcessState {
        let Some(child) = self.child.as_mut() else {
            return ProcessState::Stopped;
        };
        match child.try_wait() {
            Ok(Some(status)) => ProcessState::Exited(status.to_string()),
            Ok(None) => child
                .id()
                .map(ProcessState::Running)
                .unwrap_or(ProcessState::Stopped),
            Err(err) => ProcessState::Exited(err.to_string()),
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            if tokio::time::timeout(grace, child.wait()).await.is_ok() {
                return;
            }
        }
        let _ = child.kill().await;
    }

    /// SIGKILL: the process gets no chance to say goodbye (a crash).
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Starts the same command again (after `stop` or `kill`, or a crash).
    pub async fn restart(&mut self) -> Result<(), ProcessError> {
        self.kill().await;
        self.spawn()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every OpenTelemetry variable is taken out of a child's environment
    /// (the traces-only and protocol ones override or break what the
    /// harness sets); nothing else is.
    #[test]
    fn every_otel_variable_and_only_those_is_scrubbed() {
        let names = [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_SDK_DISABLED",
            "PATH",
            "MY_OTEL_SETTING",
            "otel_lowercase",
        ]
        .map(std::ffi::OsString::from);
        assert_eq!(
            otel_variables(names.into_iter()),
            [
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_PROTOCOL",
                "OTEL_SDK_DISABLED",
            ]
            .map(std::ffi::OsString::from)
        );
    }
}

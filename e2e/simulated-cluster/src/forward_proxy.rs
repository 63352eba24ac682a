//! A real forward proxy for the tests of managed clusters whose only way
//! out is one (issue 53): tinyproxy's configuration and command line, what
//! its log says it was asked to CONNECT to, and whether a test that needs
//! network namespaces and such tools can run here.
//!
//! A test without root, `ip netns` or one of its tools skips loudly; under
//! `CI=true` (`.ci/run` installs the proxies) such a skip is a failure.

use std::net::SocketAddr;
use std::path::Path;

use crate::netns;
use crate::process::ProcessSpec;

/// Whether this runs under CI (`CI=true`), where a skip is a failure.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Whether `tool` is an executable on `PATH`.
pub fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .any(|dir| std::fs::metadata(dir.join(tool)).is_ok_and(|m| m.is_file()))
    })
}

/// `true` when network namespaces and `tools` are usable; otherwise says
/// why, loudly, and panics under CI (test `test` must run there).
pub fn can_run(test: &str, tools: &[&str]) -> bool {
    let missing: Vec<String> = netns::availability()
        .err()
        .into_iter()
        .chain(
            tools
                .iter()
                .filter(|tool| !on_path(tool))
                .map(|tool| format!("`{tool}` is not installed")),
        )
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = missing.join("; ");
    assert!(
        !under_ci(),
        "{test}: CI=true requires network namespaces and {tools:?} (.ci/run installs the proxies): {why}"
    );
    eprintln!("SKIPPED: {test} needs root, `ip netns` and {tools:?}: {why}");
    false
}

/// One tinyproxy: where it listens, and what it asks of its clients.
#[derive(Debug, Clone)]
pub struct Tinyproxy {
    pub listen: SocketAddr,
    /// Basic credentials it requires (`BasicAuth`).
    pub basic_auth: Option<(String, String)>,
    /// The only port it CONNECTs to (`ConnectPort`; others get 403).
    pub connect_port: Option<u16>,
    /// How long a connection may stay quiet before tinyproxy closes it
    /// (`Timeout`; 60 s, like many corporate proxies).
    pub idle_timeout_seconds: u32,
}

impl Tinyproxy {
    /// A tinyproxy on `listen` that asks for nothing and CONNECTs anywhere.
    pub fn new(listen: SocketAddr) -> Self {
        Tinyproxy {
            listen,
            basic_auth: None,
            connect_port: None,
            idle_timeout_seconds: 60,
        }
    }

    /// Its configuration file's text: in the foreground (`-d`) it logs
    /// every request to its standard error, so to its process's log.
    pub fn config(&self) -> String {
        let mut config = format!(
            "Port {}\nListen {}\nTimeout {}\nMaxClients 50\nLogLevel Info\n",
            self.listen.port(),
            self.listen.ip(),
            self.idle_timeout_seconds
        );
        if let Some((user, password)) = &self.basic_auth {
            config.push_str(&format!("BasicAuth {user} {password}\n"));
        }
        if let Some(allowed) = self.connect_port {
            config.push_str(&format!("ConnectPort {allowed}\n"));
        }
        config
    }

    /// Writes the configuration to `<dir>/<name>.conf` and returns the
    /// process to start (in whatever network namespace the caller puts it).
    pub fn spec(&self, name: &str, dir: &Path) -> std::io::Result<ProcessSpec> {
        let config = dir.join(format!("{name}.conf"));
        std::fs::write(&config, self.config())?;
        Ok(ProcessSpec::new(name, Path::new("tinyproxy"))
            .arg("-d")
            .arg("-c")
            .arg(config.display().to_string()))
    }
}

/// The targets (`host:port`) of the CONNECT requests tinyproxy's `log`
/// shows, in order (its line `Request (file descriptor N): CONNECT
/// host:port HTTP/1.1`), whatever it then answered.
pub fn connect_requests(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|line| line.split_once("): CONNECT ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_requests_are_read_from_tinyproxys_log() {
        let log = "\
CONNECT   Dec 07 14:25:24.121 [11442]: Connect (file descriptor 4): 198.18.0.10
CONNECT   Dec 07 14:25:24.123 [11442]: Request (file descriptor 4): CONNECT 198.18.7.1:8091 HTTP/1.1
INFO      Dec 07 14:25:24.123 [11442]: No upstream proxy for 198.18.7.1
CONNECT   Dec 07 14:25:25.123 [11442]: Request (file descriptor 5): GET http://example/ HTTP/1.1
CONNECT   Dec 07 14:25:26.123 [11442]: Request (file descriptor 6): CONNECT 198.18.7.1:6443 HTTP/1.1
";
        assert_eq!(
            connect_requests(log),
            ["198.18.7.1:8091".to_owned(), "198.18.7.1:6443".to_owned()]
        );
    }

    #[test]
    fn the_configuration_has_what_was_asked_for() {
        let mut proxy = Tinyproxy::new(SocketAddr::from(([198, 18, 0, 1], 3128)));
        let plain = proxy.config();
        assert!(plain.contains("Port 3128\nListen 198.18.0.1\n"), "{plain}");
        assert!(!plain.contains("BasicAuth") && !plain.contains("ConnectPort"));
        proxy.basic_auth = Some(("agent".into(), "secret".into()));
        proxy.connect_port = Some(443);
        let strict = proxy.config();
        assert!(strict.contains("BasicAuth agent secret\n"), "{strict}");
        assert!(strict.contains("ConnectPort 443\n"), "{strict}");
    }
}

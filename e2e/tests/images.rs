//! The container images as images: what `images/build.sh` produced is run
//! with podman (runc runtime, read-only root filesystem, the image's own
//! non-root user) and must answer `--help` and `--version`, carry its OCI
//! labels, hold no shell, and — proxy-server and proxy-agent containers on the
//! host network — carry a request by cluster name from curl, with a PKI that
//! the cert-authority image wrote.
//!
//! The images are built by `images/build.sh` (`.ci/run` calls it before the
//! tests): building them here would nest a release build inside `cargo test`.
//! Without podman, curl or the images these tests skip loudly; under `CI=true`
//! that is a failure.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread;
use std::time::{Duration, Instant};

const VERSION: &str = env!("CARGO_PKG_VERSION");
const NONROOT_UID: u32 = 65532;
/// The budget per image. The proxy-agent image is the largest: /proxy-agent
/// (with the service-proxy) and /addon-agent, both with a Kubernetes client;
/// forward-proxy support and the WebSocket transport took it from 19.0 MB
/// to 20.1 MB (2026-12-07).
const MAX_IMAGE_BYTES: u64 = 22_000_000;
const BODY: &str = "hello from inside cluster-a, through two containers\n";

/// An image and the binaries it runs; the first is the entrypoint.
struct ImageSpec {
    name: &'static str,
    binaries: &'static [&'static str],
}

const IMAGES: &[ImageSpec] = &[
    ImageSpec {
        name: "proxy-server",
        binaries: &["proxy-server"],
    },
    ImageSpec {
        name: "proxy-agent",
        binaries: &["proxy-agent", "addon-agent"],
    },
    ImageSpec {
        name: "cert-authority",
        binaries: &["cert-authority"],
    },
    ImageSpec {
        name: "addon-manager",
        binaries: &["addon-manager"],
    },
    ImageSpec {
        name: "health-prober",
        binaries: &["health-prober"],
    },
    ImageSpec {
        name: "user-server",
        binaries: &["user-server"],
    },
];

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The health-prober binary is being written on another branch; its image is
/// expected once the crate has a binary, exactly as `images/build.sh` decides.
fn expected_images() -> Vec<&'static ImageSpec> {
    let prober_has_binary = workspace_dir().join("health-prober/src/main.rs").exists();
    IMAGES
        .iter()
        .filter(|image| image.name != "health-prober" || prober_has_binary)
        .collect()
}

fn image_ref(name: &str) -> String {
    let repo =
        std::env::var("IMAGE_REPO").unwrap_or_else(|_| "localhost/cluster-proxy".to_string());
    let tag = std::env::var("IMAGE_TAG").unwrap_or_else(|_| VERSION.to_string());
    format!("{repo}/{name}:{tag}")
}

/// podman with the machine's working settings (runc, cgroupfs, no ulimits),
/// unless the caller chose a containers.conf.
fn podman() -> Command {
    let mut command = Command::new("podman");
    if std::env::var_os("CONTAINERS_CONF").is_none() {
        command.env(
            "CONTAINERS_CONF",
            workspace_dir().join("images/containers.conf"),
        );
    }
    command
}

fn run(command: &mut Command) -> Output {
    match command.output() {
        Ok(output) => output,
        Err(e) => panic!("{command:?} did not start: {e}"),
    }
}

fn stdout_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Checks podman, curl and the images; `false` means skip (never under CI).
fn prerequisites() -> bool {
    let problem = if !Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Some("podman is not installed (apt-get install podman buildah runc)".to_string())
    } else if !Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Some("curl is not installed".to_string())
    } else {
        let missing: Vec<String> = expected_images()
            .iter()
            .map(|image| image_ref(image.name))
            .filter(|reference| {
                !podman()
                    .args(["image", "exists", reference])
                    .status()
                    .is_ok_and(|s| s.success())
            })
            .collect();
        (!missing.is_empty()).then(|| {
            format!(
                "images {} are not built; run images/build.sh",
                missing.join(", ")
            )
        })
    };
    match problem {
        None => true,
        Some(why) if under_ci() => panic!("image tests are required under CI=true: {why}"),
        Some(why) => {
            eprintln!("SKIPPED: {why}");
            false
        }
    }
}

/// `podman run --rm` with the settings every container here gets: the runc
/// runtime, a read-only root filesystem and the image's own user.
fn podman_run() -> Command {
    let mut command = podman();
    command.args(["run", "--rm", "--runtime", "runc", "--read-only"]);
    command
}

#[test]
fn every_binary_answers_help_and_version_as_nonroot_on_a_read_only_root() {
    if !prerequisites() {
        return;
    }
    for image in expected_images() {
        let reference = image_ref(image.name);
        for binary in image.binaries {
            let entrypoint = format!("/{binary}");
            let version = run(podman_run()
                .args(["--network", "none", "--entrypoint", &entrypoint])
                .args([&reference, "--version"]));
            assert!(
                version.status.success(),
                "{reference} {binary} --version failed: {}",
                stderr_of(&version)
            );
            assert_eq!(
                stdout_of(&version).trim(),
                format!("{binary} {VERSION}"),
                "{reference} {binary} --version"
            );

            let help = run(podman_run()
                .args(["--network", "none", "--entrypoint", &entrypoint])
                .args([&reference, "--help"]));
            assert!(
                help.status.success(),
                "{reference} {binary} --help failed: {}",
                stderr_of(&help)
            );
            let help = stdout_of(&help);
            assert!(
                help.contains(&format!("Usage: {binary}")),
                "{reference} {binary} --help printed no usage:\n{help}"
            );
        }
    }
}

#[test]
fn images_are_small_nonroot_labelled_and_hold_no_shell() {
    if !prerequisites() {
        return;
    }
    for image in expected_images() {
        let reference = image_ref(image.name);
        let inspect = run(podman().args(["image", "inspect", &reference]));
        assert!(inspect.status.success(), "{}", stderr_of(&inspect));
        let parsed: serde_json::Value = match serde_json::from_slice(&inspect.stdout) {
            Ok(value) => value,
            Err(e) => panic!("podman image inspect {reference}: {e}"),
        };
        let details = &parsed[0];
        let config = &details["Config"];
        assert_eq!(config["User"], "65532:65532", "{reference} user");
        assert_eq!(
            config["Entrypoint"],
            serde_json::json!([format!("/{}", image.name)]),
            "{reference} entrypoint"
        );
        let labels = &config["Labels"];
        assert_eq!(
            labels["org.opencontainers.image.version"], VERSION,
            "{reference}"
        );
        assert_eq!(
            labels["org.opencontainers.image.licenses"], "Apache-2.0",
            "{reference}"
        );
        assert_eq!(
            labels["org.opencontainers.image.title"], image.name,
            "{reference}"
        );
        let source = labels["org.opencontainers.image.source"]
            .as_str()
            .unwrap_or_default();
        assert!(
            source.starts_with("https://"),
            "{reference} source {source}"
        );
        let revision = labels["org.opencontainers.image.revision"]
            .as_str()
            .unwrap_or_default();
        assert!(
            revision.len() >= 40 && revision[..40].chars().all(|c| c.is_ascii_hexdigit()),
            "{reference} revision {revision:?} is not a git commit"
        );
        let size = details["Size"].as_u64().unwrap_or(u64::MAX);
        assert!(
            size < MAX_IMAGE_BYTES,
            "{reference} is {size} bytes, over {MAX_IMAGE_BYTES}"
        );

        // FROM scratch plus the binaries: there is nothing to exec but them.
        for shell in ["/bin/sh", "/bin/bash", "/busybox"] {
            let attempt = run(podman_run()
                .args(["--network", "none", "--entrypoint", shell])
                .args([&reference, "-c", "true"]));
            assert!(
                !attempt.status.success(),
                "{reference} has a shell at {shell}"
            );
        }
    }
}

/// A podman container removed when dropped, so a failing assertion leaves
/// nothing running.
struct Container {
    name: String,
}

impl Container {
    fn start(name_prefix: &str, args: &[&str]) -> Container {
        let name = format!("{name_prefix}-{}", uuid::Uuid::new_v4().simple());
        let output = run(podman_run()
            .args(["--detach", "--name", &name, "--network", "host"])
            .args(args));
        assert!(
            output.status.success(),
            "podman run {name}: {}",
            stderr_of(&output)
        );
        Container { name }
    }

    fn logs(&self) -> String {
        let output = run(podman().args(["logs", &self.name]));
        format!("{}{}", stdout_of(&output), stderr_of(&output))
    }

    /// The uid the container's main process runs as, read from the host's
    /// /proc (no rootless user namespace here, so host and container agree).
    fn process_uid(&self) -> u32 {
        let output = run(podman().args(["inspect", "--format", "{{.State.Pid}}", &self.name]));
        let pid = stdout_of(&output).trim().to_string();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_else(|e| panic!("{}: /proc/{pid}/status: {e}", self.name));
        let uid_line = status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .unwrap_or_else(|| panic!("{}: no Uid line in /proc/{pid}/status", self.name));
        match uid_line.split_whitespace().next().map(str::parse) {
            Some(Ok(uid)) => uid,
            _ => panic!("{}: unreadable Uid line {uid_line:?}", self.name),
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rm", "--force", "--time", "0", &self.name])
            .output();
    }
}

/// Loopback ports nothing listens on right now.
fn free_ports<const N: usize>() -> [u16; N] {
    let mut ports = [0; N];
    for i in 0..N {
        ports[i] = loop {
            let port = simulated_cluster::targets::free_port();
            if !ports[..i].contains(&port) {
                break port;
            }
        };
    }
    ports
}

/// A one-response-per-connection HTTP server on loopback: the service
/// "inside cluster-a".
fn serve_body(listener: TcpListener) {
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            thread::spawn(move || answer(stream));
        }
    });
}

fn answer(stream: TcpStream) {
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    // Read the request head up to its empty line.
    while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
        if line == "\r\n" || line == "\n" {
            break;
        }
        line.clear();
    }
    let mut writer = write_half;
    let _ = write!(
        writer,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
}

fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        thread::sleep(Duration::from_millis(200));
    }
    eprintln!("timed out after {timeout:?} waiting for {what}");
    false
}

fn curl_ok(url: &str) -> bool {
    Command::new("curl")
        .args(["--silent", "--fail", "--max-time", "2", url])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn proxy_server_and_agent_containers_carry_a_request_by_cluster_name() {
    if !prerequisites() {
        return;
    }
    // The cert-authority image writes the PKI as its own non-root user into a
    // directory it owns, as a Kubernetes fsGroup volume would be.
    let pki_dir = tempfile::tempdir().expect("temporary directory");
    let pki = pki_dir.path();
    chown(pki, Some(NONROOT_UID), Some(NONROOT_UID))
        .expect("chown the PKI directory to 65532 (the test runs as root, as CI does)");
    std::fs::set_permissions(pki, std::fs::Permissions::from_mode(0o700))
        .expect("chmod the PKI directory");
    let pki_volume = format!("{}:/pki:rw", pki.display());
    let init = run(podman_run()
        .args(["--network", "none", "-v", &pki_volume])
        .args([
            &image_ref("cert-authority"),
            "init",
            "--dir",
            "/pki",
            "--clusters",
            "cluster-a",
        ]));
    assert!(
        init.status.success(),
        "cert-authority init in its image: {}",
        stderr_of(&init)
    );
    for file in [
        "ca-bundle.crt",
        "proxy-server/tls.key",
        "agent-server/tls.key",
        "proxy-client/tls.key",
        "agents/cluster-a/tls.key",
    ] {
        assert!(
            pki.join(file).is_file(),
            "cert-authority init wrote no {file}"
        );
    }

    let target = TcpListener::bind("127.0.0.1:0").expect("bind the target");
    let target_port = target.local_addr().expect("target address").port();
    serve_body(target);

    let [
        server_port,
        agent_port,
        health_port,
        admin_port,
        agent_health,
        agent_admin,
    ] = free_ports::<6>();
    let read_only_pki = format!("{}:/pki:ro", pki.display());
    let server = Container::start(
        "cp-image-proxy-server",
        &[
            "-v",
            &read_only_pki,
            &image_ref("proxy-server"),
            "--proxy-strategies=destHost",
            "--server-bind-address=127.0.0.1",
            &format!("--server-port={server_port}"),
            "--agent-bind-address=127.0.0.1",
            &format!("--agent-port={agent_port}"),
            "--health-bind-address=127.0.0.1",
            &format!("--health-port={health_port}"),
            &format!("--admin-port={admin_port}"),
            "--server-cert=/pki/proxy-server/tls.crt",
            "--server-key=/pki/proxy-server/tls.key",
            "--server-ca-cert=/pki/ca-bundle.crt",
            "--cluster-cert=/pki/agent-server/tls.crt",
            "--cluster-key=/pki/agent-server/tls.key",
            "--cluster-ca-cert=/pki/ca-bundle.crt",
        ],
    );
    let agent = Container::start(
        "cp-image-proxy-agent",
        &[
            "-v",
            &read_only_pki,
            &image_ref("proxy-agent"),
            "--proxy-server-host=127.0.0.1",
            &format!("--proxy-server-port={agent_port}"),
            "--health-server-host=127.0.0.1",
            &format!("--health-server-port={agent_health}"),
            "--admin-bind-address=127.0.0.1",
            &format!("--admin-server-port={agent_admin}"),
            "--ca-cert=/pki/ca-bundle.crt",
            "--agent-cert=/pki/agents/cluster-a/tls.crt",
            "--agent-key=/pki/agents/cluster-a/tls.key",
            "--agent-identifiers=host=cluster-a",
            "--host-alias=cluster-a=127.0.0.1",
        ],
    );

    let readyz = format!("http://127.0.0.1:{health_port}/readyz");
    assert!(
        wait_for(
            "the server's readiness (an agent connected)",
            Duration::from_secs(30),
            || { curl_ok(&readyz) }
        ),
        "server logs:\n{}\nagent logs:\n{}",
        server.logs(),
        agent.logs()
    );
    assert_eq!(server.process_uid(), NONROOT_UID, "proxy-server's uid");
    assert_eq!(agent.process_uid(), NONROOT_UID, "proxy-agent's uid");

    let proxy = format!("https://127.0.0.1:{server_port}");
    let request = run(Command::new("curl").args([
        "--silent",
        "--show-error",
        "--max-time",
        "10",
        "--proxytunnel",
        "--proxy",
        &proxy,
        "--proxy-cacert",
        &pki.join("ca-bundle.crt").display().to_string(),
        "--proxy-cert",
        &pki.join("proxy-client/tls.crt").display().to_string(),
        "--proxy-key",
        &pki.join("proxy-client/tls.key").display().to_string(),
        &format!("http://cluster-a:{target_port}/"),
    ]));
    assert!(
        request.status.success(),
        "curl through the containers failed: {}\nserver logs:\n{}\nagent logs:\n{}",
        stderr_of(&request),
        server.logs(),
        agent.logs()
    );
    assert_eq!(stdout_of(&request), BODY);

    // A cluster no agent serves is refused by the server in the container.
    let unknown = run(Command::new("curl").args([
        "--silent",
        "--max-time",
        "10",
        "--proxytunnel",
        "--proxy",
        &proxy,
        "--proxy-cacert",
        &pki.join("ca-bundle.crt").display().to_string(),
        "--proxy-cert",
        &pki.join("proxy-client/tls.crt").display().to_string(),
        "--proxy-key",
        &pki.join("proxy-client/tls.key").display().to_string(),
        "--write-out",
        "%{http_connect}",
        &format!("http://cluster-b:{target_port}/"),
    ]));
    assert!(!unknown.status.success(), "cluster-b must not be reachable");
    assert_eq!(
        stdout_of(&unknown),
        "500",
        "CONNECT to a cluster without agent"
    );
}

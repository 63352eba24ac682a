//! The `e2e up` / `fetch` / `join` / `leave` / `status` / `down` commands
//! as a user runs them: a process that installs cluster-proxy through the
//! control plane and prints each cluster's addon status, answers `fetch`,
//! lets clusters join and leave while it runs, cleans up after itself on
//! Ctrl-C, and leaves `down` something to clean when it is killed.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use e2e::env::{IsolationChoice, registry};
use simulated_cluster::netns;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const E2E: &str = env!("CARGO_BIN_EXE_e2e");

fn isolation() -> (&'static str, IsolationChoice) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        ("netns", IsolationChoice::Netns)
    } else {
        ("auto", IsolationChoice::Auto)
    }
}

/// Starts `e2e up` and waits for its "ready" line; returns the process and
/// everything it printed so far.
async fn up(id: &str, state: &Path) -> (Child, String) {
    let (flag, choice) = isolation();
    let slot = e2e::env::free_slot(choice).expect("a free address slot");
    let mut child = Command::new(E2E)
        .args(["up", "--clusters", "2", "--quiet", "--isolation", flag])
        .args(["--id", id, "--slot", &slot.to_string(), "--state"])
        .arg(state)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("starting e2e up");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = String::new();
    let ready = tokio::time::timeout(Duration::from_secs(180), async {
        while let Ok(Some(line)) = lines.next_line().await {
            printed.push_str(&line);
            printed.push('\n');
            if line.starts_with("Ctrl-C stops everything") {
                return true;
            }
        }
        false
    })
    .await;
    assert!(
        matches!(ready, Ok(true)),
        "e2e up did not get ready:\n{printed}"
    );
    // Keep draining stdout so the process never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, printed)
}

async fn fetch(state: &Path, url: &str, via: &str) -> String {
    let out = Command::new(E2E)
        .args(["fetch", "--via", via, "--state"])
        .arg(state)
        .arg(url)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "fetch {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs an `e2e` subcommand with `--state DIR` last; it must succeed.
async fn run(args: &[&str], state: &Path) -> String {
    let out = Command::new(E2E)
        .args(args)
        .arg(state)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "e2e {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits (up to two minutes) until `e2e status` prints what `wanted` accepts.
async fn wait_for_status(state: &Path, wanted: impl Fn(&str) -> bool) {
    let started = std::time::Instant::now();
    loop {
        let status = run(&["status", "--state"], state).await;
        if wanted(&status) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "e2e status never got there:\n{status}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn namespaces_of(id: &str) -> Vec<String> {
    let prefix = format!("{}{id}-", netns::NETNS_PREFIX);
    netns::existing()
        .into_iter()
        .filter(|ns| ns.starts_with(&prefix))
        .collect()
}

fn alive(pids: &[u32]) -> Vec<u32> {
    pids.iter()
        .copied()
        .filter(|p| registry::is_alive(*p))
        .collect()
}

fn test_id(tag: &str) -> String {
    format!("{tag}{:04x}", rand_suffix())
}

fn rand_suffix() -> u16 {
    (std::process::id() as u16)
        ^ (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() as u16)
            .unwrap_or(0))
}

#[tokio::test]
async fn up_prints_how_to_reach_clusters_and_cleans_up_on_ctrl_c() {
    let id = test_id("i");
    let state = tempfile::tempdir().unwrap();
    let (mut child, printed) = up(&id, state.path()).await;
    for expected in [
        "ADDON AVAILABLE",
        "cluster-b        True (ManagedClusterAddOnLeaseUpdated)",
        "curl -p -x https://",
        "cargo run -p e2e -- join",
    ] {
        assert!(
            printed.contains(expected),
            "missing {expected:?} in:\n{printed}"
        );
    }
    assert_eq!(
        fetch(state.path(), "http://cluster-b:8080/", "grpc").await,
        "hello from cluster-b\n"
    );
    assert_eq!(
        fetch(state.path(), "https://cluster-a:6443/healthz", "connect").await,
        "ok\n"
    );

    // The environment's own trace receiver got the server's span of that
    // connection; `e2e traces` lists it and prints it as a tree.
    assert!(printed.contains("traces.jsonl"), "{printed}");
    let spans_file = state.path().join(e2e::env::traces::SPAN_FILE);
    let connection = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let spans = simulated_cluster::otlp::read_span_file(&spans_file).unwrap_or_default();
            if let Some(span) = spans.into_iter().find(|s| {
                s.name == "tunnel.connection"
                    && s.attribute("cluster_proxy.frontend") == Some("http-connect")
            }) {
                return span;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the server's connection span reaches traces.jsonl");
    assert!(
        run(&["traces", "--state"], state.path())
            .await
            .contains(&connection.trace_id)
    );
    let tree = run(&["traces", &connection.trace_id, "--state"], state.path()).await;
    assert!(tree.starts_with("tunnel.connection ["), "{tree}");

    // A newcomer joins while `up` runs, and leaves again.
    run(&["join", "cluster-c", "--state"], state.path()).await;
    wait_for_status(state.path(), |status| {
        status.lines().any(|l| {
            l.starts_with("cluster-c ") && l.contains("True (ManagedClusterAddOnLeaseUpdated)")
        })
    })
    .await;
    assert_eq!(
        fetch(state.path(), "http://cluster-c:8080/", "grpc").await,
        "hello from cluster-c\n"
    );
    run(&["leave", "cluster-c", "--state"], state.path()).await;
    wait_for_status(state.path(), |status| {
        !status.lines().any(|l| l.starts_with("cluster-c "))
    })
    .await;

    let record = registry::find(&id).expect("a running environment is recorded");
    let pids: Vec<u32> = record.processes.iter().map(|p| p.pid).collect();
    assert!(!pids.is_empty());

    // Ctrl-C: everything stops by itself.
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("up stops within 30 s of Ctrl-C")
        .unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(alive(&pids), Vec::<u32>::new(), "processes left behind");
    assert_eq!(
        namespaces_of(&id),
        Vec::<String>::new(),
        "namespaces left behind"
    );
    assert!(registry::find(&id).is_none(), "the record is left behind");
    // --state keeps PKI and logs.
    assert!(state.path().join("pki/ca-bundle.crt").exists());
    assert!(
        state
            .path()
            .join("logs/hub/cluster-proxy-0/proxy-server.log")
            .exists()
    );
}

#[tokio::test]
async fn down_cleans_up_after_a_crashed_up() {
    let id = test_id("k");
    let state = tempfile::tempdir().unwrap();
    let (mut child, _) = up(&id, state.path()).await;
    let record = registry::find(&id).expect("a running environment is recorded");
    let pids: Vec<u32> = record.processes.iter().map(|p| p.pid).collect();

    // A crash: the supervisor dies without cleaning anything.
    child.kill().await.unwrap();
    let _ = child.wait().await;
    assert!(!alive(&pids).is_empty(), "its children outlive a crash");
    if matches!(isolation().1, IsolationChoice::Netns) || !namespaces_of(&id).is_empty() {
        assert!(!namespaces_of(&id).is_empty());
    }

    let out = Command::new(E2E)
        .args(["down", "--id", &id])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("killed"), "{said}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        alive(&pids),
        Vec::<u32>::new(),
        "processes left behind:\n{said}"
    );
    assert_eq!(
        namespaces_of(&id),
        Vec::<String>::new(),
        "namespaces left behind"
    );
    assert!(registry::find(&id).is_none());
}

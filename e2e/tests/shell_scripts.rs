//! The repository's shell scripts (CI, image build, fuzzing, the kind suite,
//! the bench plugin) must not end a pipeline in a reader that quits early.
//!
//! Under `set -o pipefail`, `writer | head -n1` or `writer | grep -q x` fails
//! whenever the reader exits before the writer's last write: the writer dies of
//! SIGPIPE and the pipeline's status is 141. Whether that happens depends on how
//! the writer splits its output, so it passes on one machine and fails on
//! another: `kubectl version --client | head -n1` failed a CI run after 18 s on
//! a machine whose kubectl writes its version lines separately.

use std::io::Read;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lives inside the workspace")
        .to_path_buf()
}

/// Every shell script of the repository: files named `*.sh` or starting
/// with a shell's `#!` line (`.ci/run`), outside build output and `.git`.
fn shell_scripts() -> Vec<PathBuf> {
    let mut scripts = Vec::new();
    let mut directories = vec![repo_root()];
    while let Some(directory) = directories.pop() {
        let entries = std::fs::read_dir(&directory)
            .unwrap_or_else(|e| panic!("{}: {e}", directory.display()));
        for entry in entries {
            let path = entry.expect("a readable directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !matches!(name, "target" | ".git") {
                    directories.push(path);
                }
            } else if name.ends_with(".sh") || starts_as_shell_script(&path) {
                scripts.push(path);
            }
        }
    }
    scripts.sort();
    scripts
}

/// Whether `path` begins with a `#!` line that runs bash or sh.
fn starts_as_shell_script(path: &Path) -> bool {
    let mut head = [0u8; 64];
    let Ok(read) = std::fs::File::open(path).and_then(|mut f| f.read(&mut head)) else {
        return false;
    };
    let first_line = head[..read]
        .split(|b| *b == b'\n')
        .next()
        .unwrap_or_default();
    first_line.starts_with(b"#!")
        && [&b"bash"[..], b"/sh"]
            .iter()
            .any(|shell| first_line.windows(shell.len()).any(|w| w == *shell))
}

/// The commands of `line` that read a pipe (after a single `|`), as their words.
fn piped_commands(line: &str) -> Vec<Vec<&str>> {
    let code = match line.find(" #") {
        Some(comment) => &line[..comment],
        None if line.trim_start().starts_with('#') => "",
        None => line,
    };
    let mut commands = Vec::new();
    let mut rest = code;
    while let Some(bar) = rest.find('|') {
        let after = &rest[bar + 1..];
        if let Some(second) = after.strip_prefix('|') {
            // `||` is a list operator, not a pipe.
            rest = second;
            continue;
        }
        let end = after.find(['|', ';', ')', '&']).unwrap_or(after.len());
        commands.push(after[..end].split_whitespace().collect());
        rest = after;
    }
    commands
}

/// Why a piped command may quit before its writer finishes, if it may.
fn quits_early(words: &[&str]) -> Option<&'static str> {
    match words.first().copied() {
        Some("head") => Some("head exits after its lines"),
        Some("grep") => words
            .iter()
            .skip(1)
            .take_while(|word| word.starts_with('-'))
            .any(|option| {
                option.trim_start_matches('-') == "quiet"
                    || (!option.starts_with("--") && option.contains('q'))
            })
            .then_some("grep -q exits at the first match"),
        _ => None,
    }
}

/// Pipelines of `script` whose status can be a reader's early exit.
fn early_exit_pipelines(script: &str) -> Vec<String> {
    if !script.contains("pipefail") {
        return Vec::new();
    }
    script
        .lines()
        .enumerate()
        .flat_map(|(index, line)| {
            piped_commands(line).into_iter().filter_map(move |words| {
                quits_early(&words)
                    .map(|why| format!("line {}: `{}` ({why})", index + 1, line.trim()))
            })
        })
        .collect()
}

#[test]
fn no_pipeline_under_pipefail_ends_in_a_reader_that_quits_early() {
    let scripts = shell_scripts();
    let names: Vec<String> = scripts.iter().map(|s| s.display().to_string()).collect();
    for expected in [
        ".ci/run",
        "images/build.sh",
        "e2e/kind/run.sh",
        "bench/peers/",
    ] {
        assert!(
            names.iter().any(|name| name.contains(expected)),
            "{expected} is not among the scripts found: {names:#?}"
        );
    }
    let mut findings = Vec::new();
    for script in scripts {
        let text = std::fs::read_to_string(&script)
            .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        for finding in early_exit_pipelines(&text) {
            findings.push(format!("{}: {finding}", script.display()));
        }
    }
    assert!(
        findings.is_empty(),
        "a writer piped into these can die of SIGPIPE (status 141) under pipefail; \
         read the whole output first (`sed -n 1p`, `grep -q x <<<\"$(writer)\"`):\n{}",
        findings.join("\n")
    );
}

#[test]
fn the_check_finds_the_pipelines_that_failed_ci_and_passes_their_mends() {
    let failing = "set -euo pipefail\n\
                   kubectl version --client | head -n1\n\
                   kind get clusters | grep -qx \"$cluster\" || kind create cluster\n\
                   if readelf -l \"$bin\" | grep -q 'interpreter'; then die; fi\n\
                   x=$(podman images | head -n1)\n";
    let findings = early_exit_pipelines(failing);
    assert_eq!(findings.len(), 4, "{findings:#?}");
    assert!(findings[0].starts_with("line 2: "), "{findings:#?}");

    let mended = "set -euo pipefail\n\
                  kubectl version --client | sed -n 1p\n\
                  grep -qx \"$cluster\" <<<\"$(kind get clusters)\" || kind create cluster\n\
                  cargo build 2>&1 | grep -v warning || true\n\
                  a || b | tee log # | head in a comment\n";
    assert_eq!(early_exit_pipelines(mended), Vec::<String>::new());

    // Without pipefail the reader's early exit does not reach the status.
    assert_eq!(
        early_exit_pipelines("kubectl version --client | head -n1\n"),
        Vec::<String>::new()
    );
}

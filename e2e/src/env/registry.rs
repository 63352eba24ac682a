//! A record of every running environment, so `e2e down` (and the next
//! `up`) can clean up after one whose supervisor crashed or was killed:
//! its processes and its network namespaces.
//!
//! Records live in `$TMPDIR/cluster-proxy-e2e/<id>.json`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use simulated_cluster::netns;

/// One process, identified beyond its pid by its executable path, so a
/// recycled pid is never killed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessRecord {
    pub pid: u32,
    pub exe: PathBuf,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    /// The process that supervises the environment (`up` or a test).
    pub owner: u32,
    pub netns: Vec<String>,
    pub processes: Vec<ProcessRecord>,
    /// Where the environment keeps its PKI, logs and `env.json`.
    pub state_dir: PathBuf,
    /// A state directory to delete on cleanup (a temporary one).
    pub temporary_state: Option<PathBuf>,
}

pub fn dir() -> PathBuf {
    std::env::temp_dir().join("cluster-proxy-e2e")
}

/// The record of environment `id`, if it runs.
pub fn find(id: &str) -> Option<Record> {
    Record::load(&path_of(id))
}

fn path_of(id: &str) -> PathBuf {
    dir().join(format!("{id}.json"))
}

impl Record {
    pub fn save(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(dir())?;
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        let path = path_of(&self.id);
        let partial = path.with_extension("json.partial");
        std::fs::write(&partial, text)?;
        std::fs::rename(partial, path)
    }

    pub fn remove(id: &str) {
        let _ = std::fs::remove_file(path_of(id));
    }

    fn load(path: &Path) -> Option<Record> {
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
    }

    pub fn all() -> Vec<Record> {
        let Ok(entries) = std::fs::read_dir(dir()) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
            .filter_map(|path| Record::load(&path))
            .collect()
    }
}

fn exe_of(pid: u32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// Whether `pid` runs (a zombie, dead but not yet reaped by whoever
/// inherited it, does not count).
pub fn is_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the parenthesised command name, which may itself
    // contain spaces and parentheses.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

fn signal(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// Removes everything `record` describes.
pub fn clean(record: &Record) -> Vec<String> {
    let mut done = Vec::new();
    for process in &record.processes {
        if exe_of(process.pid).is_some_and(|exe| exe == process.exe) {
            signal(process.pid, Signal::SIGKILL);
            done.push(format!(
                "killed {} (pid {})",
                process.exe.display(),
                process.pid
            ));
        }
    }
    for ns in &record.netns {
        if netns::existing().contains(ns) {
            netns::remove_netns(ns);
            done.push(format!("removed network namespace {ns}"));
        }
    }
    if let Some(dir) = &record.temporary_state
        && dir.exists()
    {
        let _ = std::fs::remove_dir_all(dir);
        done.push(format!("removed {}", dir.display()));
    }
    Record::remove(&record.id);
    done
}

/// Cleans up environments whose supervisor is gone; returns what it did.
pub fn clean_orphans() -> Vec<String> {
    let mut done = Vec::new();
    for record in Record::all() {
        if !is_alive(record.owner) {
            done.extend(clean(&record));
        }
    }
    done
}

/// Stops every environment: asks live supervisors to shut down (SIGTERM),
/// gives them `grace` to clean up themselves, then removes whatever is
/// left, including namespaces of ours that no record names.
pub fn clean_all(grace: Duration) -> Vec<String> {
    let mut done = Vec::new();
    let me = std::process::id();
    for record in Record::all() {
        if record.owner != me && is_alive(record.owner) {
            signal(record.owner, Signal::SIGTERM);
            done.push(format!(
                "asked environment {} (pid {}) to stop",
                record.id, record.owner
            ));
        }
    }
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline
        && Record::all()
            .iter()
            .any(|r| r.owner != me && is_alive(r.owner))
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    for record in Record::all() {
        if record.owner != me && is_alive(record.owner) {
            signal(record.owner, Signal::SIGKILL);
        }
        done.extend(clean(&record));
    }
    for ns in netns::existing() {
        netns::remove_netns(&ns);
        done.push(format!("removed network namespace {ns}"));
    }
    done
}

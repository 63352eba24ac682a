//! The workspace binaries the environment runs, built with cargo on demand
//! so `cargo run -p e2e -- up` needs no separate build step.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The service binaries (and this crate's own, for the sample services and
/// the load balancer).
pub const PACKAGES: &[(&str, &str)] = &[
    ("proxy-server", "proxy-server"),
    ("proxy-agent", "proxy-agent"),
    ("cert-authority", "cert-authority"),
    ("addon-manager", "addon-manager"),
    ("addon-agent", "addon-agent"),
    ("health-prober", "health-prober"),
    ("user-server", "user-server"),
    ("e2e", "e2e"),
];

/// Names a directory of prebuilt binaries that [`Binaries::build`] uses
/// instead of building.
pub const BINARIES_DIR_VARIABLE: &str = "CP_BINARIES_DIR";

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot tell where the build output lives: {0}")]
    Locate(String),
    #[error("running cargo: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("cargo build failed:\n{0}")]
    Failed(String),
    #[error("{} is missing after the build", .0.display())]
    Missing(PathBuf),
}

/// Paths of the built binaries.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
    pub proxy_server: PathBuf,
    pub proxy_agent: PathBuf,
    pub cert_authority: PathBuf,
    pub e2e: PathBuf,
}

/// Whether cargo's output is shown while building.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    Show,
    Quiet,
}

impl Binaries {
    /// The output directory of the running executable's profile
    /// (`target/debug` for `cargo run`, for tests, whose executables are
    /// in `target/debug/deps`, and for examples, in `target/debug/examples`).
    pub fn output_dir() -> Result<PathBuf, BuildError> {
        let exe = std::env::current_exe().map_err(|e| BuildError::Locate(e.to_string()))?;
        let mut dir = exe
            .parent()
            .ok_or_else(|| BuildError::Locate(exe.display().to_string()))?
            .to_path_buf();
        if dir
            .file_name()
            .is_some_and(|name| name == "deps" || name == "examples")
        {
            dir.pop();
        }
        Ok(dir)
    }

    /// Builds (or confirms up to date) every binary with the profile of the
    /// running executable, then returns their paths. With
    /// `CP_BINARIES_DIR` set, builds nothing and takes the binaries from
    /// that directory instead (to compare builds, e.g. two commits, with
    /// the same benchmark executable).
    pub fn build(progress: Progress) -> Result<Self, BuildError> {
        if let Some(dir) = std::env::var_os(BINARIES_DIR_VARIABLE) {
            return Self::in_dir(Path::new(&dir));
        }
        let dir = Self::output_dir()?;
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_string(),
            Some(other) => other.to_string(),
            None => return Err(BuildError::Locate(dir.display().to_string())),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| BuildError::Locate("workspace root".into()))?;
        let mut command = Command::new(cargo);
        // `cargo run` and `cargo test` describe the running package in the
        // environment; build scripts track some of those variables, so
        // passing them on would rebuild half the dependency graph and make the
        // next plain `cargo build` rebuild it back.
        for (key, _) in std::env::vars_os() {
            let Some(key) = key.to_str() else { continue };
            if key == "CARGO_MANIFEST_DIR"
                || key == "CARGO_MANIFEST_PATH"
                || key == "CARGO_PRIMARY_PACKAGE"
                || key == "CARGO_CRATE_NAME"
                || key == "CARGO_BIN_NAME"
                || key == "CARGO_TARGET_TMPDIR"
                || key == "CARGO_RUSTC_CURRENT_DIR"
                || key == "OUT_DIR"
                || key.starts_with("CARGO_PKG_")
                || key.starts_with("CARGO_BIN_EXE_")
            {
                command.env_remove(key);
            }
        }
        command
            .current_dir(&workspace)
            .args(["build", "--profile", &profile, "--bins"]);
        for (package, _) in PACKAGES {
            command.args(["-p", package]);
        }
        if progress == Progress::Show {
            let status = command.status().map_err(BuildError::Spawn)?;
            if !status.success() {
                return Err(BuildError::Failed(format!("cargo exited with {status}")));
            }
        } else {
            let out = command
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .output()
                .map_err(BuildError::Spawn)?;
            if !out.status.success() {
                return Err(BuildError::Failed(
                    String::from_utf8_lossy(&out.stderr).into_owned(),
                ));
            }
        }
        Self::in_dir(&dir)
    }

    /// The binaries in `dir`, which must all exist.
    pub fn in_dir(dir: &Path) -> Result<Self, BuildError> {
        let path = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(BuildError::Missing(path))
            }
        };
        Ok(Binaries {
            dir: dir.to_path_buf(),
            proxy_server: path("proxy-server")?,
            proxy_agent: path("proxy-agent")?,
            cert_authority: path("cert-authority")?,
            e2e: path("e2e")?,
        })
    }
}

//! Hot reload of credentials from files.
//!
//! Kubernetes updates a mounted Secret by swapping a symlink (`..data`), so
//! the paths stay the same while their content changes; editors and
//! `cert-authority` replace files by rename. Both are caught by re-reading the
//! files' content on an interval (they are small) and comparing digests.
//! A change rebuilds the configuration; a build that fails (half-written
//! pair, expired certificate, key that does not match) keeps the last good
//! configuration and logs why. Consumers read the newest configuration for
//! each new handshake; established connections are never touched.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{info, warn};

use crate::tls::TlsError;

/// How often files are checked by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// The newest configuration built from the watched files.
pub type Watched<T> = watch::Receiver<Arc<T>>;

/// A value built from a watched configuration and rebuilt only when that
/// configuration changes: a pooled client over the current TLS
/// configuration (the old pool drains as its requests end).
pub struct Derived<S, T> {
    source: Watched<S>,
    current: std::sync::Mutex<Option<(Arc<S>, T)>>,
}

impl<S, T: Clone> Derived<S, T> {
    pub fn new(source: Watched<S>) -> Self {
        Derived {
            source,
            current: std::sync::Mutex::new(None),
        }
    }

    /// The value for the current configuration, built by `build` if the
    /// configuration changed since the last call.
    pub fn get(&self, build: impl FnOnce(&Arc<S>) -> T) -> T {
        let now = self.source.borrow().clone();
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((used, value)) = &*current
            && Arc::ptr_eq(used, &now)
        {
            return value.clone();
        }
        let value = build(&now);
        *current = Some((now, value.clone()));
        value
    }
}

/// A configuration that never changes (in-memory credentials, tests).
pub fn fixed<T>(value: Arc<T>) -> Watched<T> {
    // Without a sender the receiver keeps returning this value.
    watch::channel(value).1
}

fn digest(paths: &[PathBuf]) -> u64 {
    let mut hasher = DefaultHasher::new();
    for path in paths {
        path.hash(&mut hasher);
        match std::fs::read(path) {
            Ok(bytes) => bytes.hash(&mut hasher),
            Err(e) => e.kind().hash(&mut hasher),
        }
    }
    hasher.finish()
}

/// Builds a configuration from `paths` now (an error is returned, for startup
/// to fail clearly), then rebuilds it whenever any file changes. Must be
/// called within a tokio runtime; the watcher stops when every receiver is gone.
pub fn watch_files<T, F>(
    what: &'static str,
    paths: Vec<PathBuf>,
    interval: Duration,
    build: F,
) -> Result<Watched<T>, TlsError>
where
    T: Send + Sync + 'static,
    F: Fn() -> Result<Arc<T>, TlsError> + Send + 'static,
{
    let mut seen = digest(&paths);
    let (tx, rx) = watch::channel(build()?);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = ticker.tick() => {}
            }
            let now = digest(&paths);
            if now == seen {
                continue;
            }
            seen = now;
            match build() {
                Ok(config) => {
                    info!(what, "credentials changed on disk; new handshakes use them");
                    let _ = tx.send(config);
                }
                Err(e) => {
                    warn!(what, error = %e, "credentials changed on disk but cannot be used; keeping the last good ones")
                }
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_pki::TestCa;
    use crate::tls::{Identity, Pem, server_config};

    async fn changed<T>(rx: &mut Watched<T>) -> bool {
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn follows_symlink_swaps_and_keeps_the_last_good_config() {
        let ca = TestCa::new();
        let dir = tempfile::tempdir().unwrap();
        // Kubernetes' layout: tls.crt -> ..data/tls.crt, ..data -> ..<timestamp>
        let publish = |name: &str, cert: &str, key: &str| {
            let version = dir.path().join(name);
            std::fs::create_dir(&version).unwrap();
            std::fs::write(version.join("tls.crt"), cert).unwrap();
            std::fs::write(version.join("tls.key"), key).unwrap();
            let tmp = dir.path().join("..data_tmp");
            std::os::unix::fs::symlink(name, &tmp).unwrap();
            std::fs::rename(&tmp, dir.path().join("..data")).unwrap();
        };
        let first = ca.server("one");
        publish("..v1", &first.cert_pem, &first.key_pem);
        for f in ["tls.crt", "tls.key"] {
            std::os::unix::fs::symlink(format!("..data/{f}"), dir.path().join(f)).unwrap();
        }
        let cert = dir.path().join("tls.crt");
        let key = dir.path().join("tls.key");
        let build = {
            let (cert, key) = (cert.clone(), key.clone());
            move || {
                let identity = Identity::new(&Pem::file("cert", &cert)?, &Pem::file("key", &key)?)?;
                server_config(identity, None, &[])
            }
        };
        let mut rx =
            watch_files("test", vec![cert, key], Duration::from_millis(20), build).unwrap();
        let original = rx.borrow().clone();

        let second = ca.server("two");
        publish("..v2", &second.cert_pem, &second.key_pem);
        assert!(changed(&mut rx).await, "symlink swap not noticed");
        assert!(!Arc::ptr_eq(&original, &rx.borrow_and_update()));

        // A mismatched pair is not used.
        let third = ca.server("three");
        publish("..v3", &third.cert_pem, &second.key_pem);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !rx.has_changed().unwrap(),
            "a broken pair replaced good credentials"
        );
    }

    #[tokio::test]
    async fn startup_fails_clearly_on_bad_files() {
        let err =
            watch_files::<rustls::ServerConfig, _>("test", vec![], Duration::from_secs(1), || {
                Err(TlsError::Config("broken".into()))
            })
            .unwrap_err();
        assert!(err.to_string().contains("broken"));
    }
}

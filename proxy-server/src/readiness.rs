//! When this replica may take client dials: its `/readyz`.
//!
//! Upstream's rule, kept for `--server-count-source=static`: ready once any
//! agent holds a tunnel. With replicas that count each other
//! (`--server-count-source=dns:`) that rule is wrong both ways: a new
//! replica is ready as soon as the first of many agents arrives, so client
//! dials for every other cluster fail with "No agent available" until their
//! agents arrive too; and with no cluster at all it is never ready.
//!
//! So a counting replica catches up first: it asks every replica the
//! headless Service lists (itself included) how many agents it holds
//! (`GET /agent-count` on their health ports) and becomes ready once it
//! holds as many as the most any of them holds. `--readiness-agent-wait`
//! bounds the wait: an agent that can never reach this replica (a broken
//! network path, a stale tunnel on a peer) must not stall a rollout, so
//! past it the replica is ready anyway, with a warning. Once caught up it
//! stays ready until it drains: a peer that gains an agent first is no
//! reason to take this replica out of the Service.
//!
//! Agents must reach a replica before it is ready, so the Services agents
//! dial publish not-ready addresses (the hub controller renders them so).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cluster_proxy_runtime::admin::NotReady;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::registry::Registry;

/// The health-port path where a replica says how many agents it holds.
pub const AGENT_COUNT_PATH: &str = "/agent-count";
/// How long one peer may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a replica that has not caught up looks again.
const CATCH_UP_INTERVAL: Duration = Duration::from_millis(250);
/// A count larger than any real deployment's: a peer answering more is
/// answering nonsense, not raising the bar.
const MAX_PLAUSIBLE_AGENTS: usize = 1_000_000;

/// What `/readyz` answers.
pub struct Readiness {
    draining: Arc<AtomicBool>,
    registry: Arc<Registry>,
    /// `None`: upstream's rule (any agent).
    catch_up: Option<Arc<CatchUp>>,
}

/// Where catching up with the peers stands.
#[derive(Debug, Default)]
pub struct CatchUp {
    done: AtomicBool,
    /// The most agents a peer held when last asked.
    expected: AtomicUsize,
}

impl CatchUp {
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
}

impl Readiness {
    /// Upstream's rule: ready while not draining and some agent holds a tunnel.
    pub fn any_agent(draining: Arc<AtomicBool>, registry: Arc<Registry>) -> Self {
        Readiness {
            draining,
            registry,
            catch_up: None,
        }
    }

    /// Ready while not draining and once `catch_up` is done.
    pub fn caught_up(
        draining: Arc<AtomicBool>,
        registry: Arc<Registry>,
        catch_up: Arc<CatchUp>,
    ) -> Self {
        Readiness {
            draining,
            registry,
            catch_up: Some(catch_up),
        }
    }

    pub fn check(&self) -> Result<(), NotReady> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(NotReady {
                status: StatusCode::SERVICE_UNAVAILABLE,
                body: "draining".into(),
            });
        }
        match &self.catch_up {
            None if self.registry.tunnel_count() > 0 => Ok(()),
            None => Err(NotReady {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                body: "no connection to any proxy agent".into(),
            }),
            Some(catch_up) if catch_up.is_done() => Ok(()),
            Some(catch_up) => Err(NotReady {
                status: StatusCode::SERVICE_UNAVAILABLE,
                body: format!(
                    "waiting for agents: holding {} of the {} another replica holds",
                    self.registry.agent_count(),
                    catch_up.expected.load(Ordering::SeqCst)
                ),
            }),
        }
    }
}

/// Why a peer's agent count could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("{peer}: {source}")]
    Connect {
        peer: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{peer}: {source}")]
    Http {
        peer: SocketAddr,
        #[source]
        source: hyper::Error,
    },
    #[error("{peer}: no answer within {ASK_TIMEOUT:?}")]
    Timeout { peer: SocketAddr },
    #[error("{peer} answered {status} to {AGENT_COUNT_PATH}")]
    Status {
        peer: SocketAddr,
        status: StatusCode,
    },
    #[error("{peer} answered {body:?} to {AGENT_COUNT_PATH}, not a count")]
    NotACount { peer: SocketAddr, body: String },
}

impl AskError {
    /// The replica that was asked.
    pub fn peer(&self) -> SocketAddr {
        match self {
            AskError::Connect { peer, .. }
            | AskError::Http { peer, .. }
            | AskError::Timeout { peer }
            | AskError::Status { peer, .. }
            | AskError::NotACount { peer, .. } => *peer,
        }
    }
}

/// How many agents the replica whose health endpoint is `peer` holds.
pub async fn ask_agent_count(peer: SocketAddr) -> Result<usize, AskError> {
    tokio::time::timeout(ASK_TIMEOUT, ask(peer))
        .await
        .unwrap_or(Err(AskError::Timeout { peer }))
}

async fn ask(peer: SocketAddr) -> Result<usize, AskError> {
    let http = |source| AskError::Http { peer, source };
    let tcp = tokio::net::TcpStream::connect(peer)
        .await
        .map_err(|source| AskError::Connect { peer, source })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(http)?;
    let connection = tokio::spawn(connection);
    let request = Request::get(AGENT_COUNT_PATH)
        .header(header::HOST, peer.to_string())
        .body(Empty::<Bytes>::new())
        .map_err(|_| AskError::NotACount {
            peer,
            body: String::new(),
        })?;
    let response = sender.send_request(request).await.map_err(http)?;
    let status = response.status();
    let body = response.into_body().collect().await.map_err(http)?;
    connection.abort();
    if status != StatusCode::OK {
        return Err(AskError::Status { peer, status });
    }
    let body = String::from_utf8_lossy(&body.to_bytes()).into_owned();
    match body.trim().parse::<usize>() {
        Ok(count) if count <= MAX_PLAUSIBLE_AGENTS => Ok(count),
        _ => Err(AskError::NotACount { peer, body }),
    }
}

/// Asks the replicas in `peers` until this one holds as many agents as
/// the most any of them holds, or `wait` has passed since `started`; then
/// marks `catch_up` done. Also done at once when `wait` is zero.
pub(crate) async fn catch_up(
    catch_up: Arc<CatchUp>,
    registry: Arc<Registry>,
    mut peers: watch::Receiver<Vec<SocketAddr>>,
    started: Instant,
    wait: Duration,
    shutdown: CancellationToken,
) {
    let deadline = tokio::time::Instant::from_std(started + wait);
    let mut ticks = tokio::time::interval(CATCH_UP_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unanswered: Vec<SocketAddr> = Vec::new();
    if wait.is_zero() {
        catch_up.done.store(true, Ordering::SeqCst);
        return;
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(deadline) => {
                let expected = catch_up.expected.load(Ordering::SeqCst);
                let held = registry.agent_count();
                if held >= expected {
                    info!(agents = held, "ready: holding as many agents as the other replicas");
                } else {
                    warn!(agents = held, expected, ?wait, "ready without every agent: --readiness-agent-wait passed");
                }
                catch_up.done.store(true, Ordering::SeqCst);
                return;
            }
            _ = ticks.tick() => {}
        }
        // Before the first lookup nothing is known: a replica that has
        // not seen its peers must not count itself caught up.
        let known = peers.borrow_and_update().clone();
        if known.is_empty() {
            continue;
        }
        let answers =
            futures_util::future::join_all(known.iter().map(|&p| ask_agent_count(p))).await;
        let mut expected = 0;
        for answer in answers {
            match answer {
                Ok(count) => expected = expected.max(count),
                // A peer that is gone or starting tells nothing; each one is
                // logged once, at debug, as peers come and go in a rollout.
                Err(e) => {
                    if !unanswered.contains(&e.peer()) {
                        unanswered.push(e.peer());
                        debug!(error = %e, "cannot ask a replica how many agents it holds");
                    }
                }
            }
        }
        catch_up.expected.store(expected, Ordering::SeqCst);
        let held = registry.agent_count();
        if held >= expected {
            info!(agents = held, replicas = known.len(), waited = ?started.elapsed(), "ready: holding as many agents as the other replicas");
            catch_up.done.store(true, Ordering::SeqCst);
            return;
        }
    }
}

//! Where the environment's services send their traces: nowhere (the
//! default), a collector the user runs (`e2e up --otlp-endpoint`), or a
//! receiver of the environment's own that writes every span as a JSON line
//! to `traces.jsonl` in the state directory (`e2e traces` reads it).
//!
//! The endpoint reaches every process the environment starts on the
//! machine or in the hub's network, as `OTEL_EXPORTER_OTLP_ENDPOINT` in its
//! environment (and `OTEL_SERVICE_NAME` naming the component), which every
//! service reads as its `--otlp-endpoint`. With network namespaces the
//! managed clusters have no route to it, as in a real install: their
//! processes get only `OTEL_SERVICE_NAME`, and their proxy-agents send their
//! spans home through their tunnels, which the proxy-servers forward here
//! (the span relay). On loopback every process gets the endpoint.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use tokio_util::sync::CancellationToken;

use simulated_cluster::otlp::{Collector, CollectorError};

/// The span file of the environment's own receiver, in the state directory.
pub const SPAN_FILE: &str = "traces.jsonl";
/// Spans the receiver keeps in memory besides the file.
const KEEP_IN_MEMORY: usize = 10_000;

/// Where traces go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TraceExport {
    /// No tracing.
    #[default]
    Off,
    /// A collector the user runs, e.g. `http://127.0.0.1:4317`.
    Collector(String),
    /// A receiver of the environment's own.
    Receiver,
}

/// The environment's own OTLP receiver; stops when dropped.
pub struct TraceReceiver {
    pub endpoint: String,
    pub file: PathBuf,
    pub collector: Collector,
    stop: CancellationToken,
}

impl Drop for TraceReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts the receiver when asked, on `ip` (an address every hub service
/// reaches); returns the endpoint the services get.
pub async fn start(
    export: &TraceExport,
    state_dir: &Path,
    ip: IpAddr,
) -> Result<(Option<String>, Option<TraceReceiver>), CollectorError> {
    match export {
        TraceExport::Off => Ok((None, None)),
        TraceExport::Collector(endpoint) => Ok((Some(endpoint.clone()), None)),
        TraceExport::Receiver => {
            let file = state_dir.join(SPAN_FILE);
            let (collector, address, stop) = Collector::start_with_file(
                &SocketAddr::new(ip, 0).to_string(),
                &file,
                KEEP_IN_MEMORY,
            )
            .await?;
            let endpoint = format!("http://{address}");
            Ok((
                Some(endpoint.clone()),
                Some(TraceReceiver {
                    endpoint,
                    file,
                    collector,
                    stop,
                }),
            ))
        }
    }
}

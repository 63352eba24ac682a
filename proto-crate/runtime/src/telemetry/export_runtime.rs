//! The exporters' own Tokio runtime and thread priority: export (to a
//! collector, or of relayed spans) must never take CPU from the data path.

use super::error::TelemetryError;

/// The exporter's own Tokio runtime (one thread, `otel-export`); it stops
/// when dropped.
#[derive(Debug)]
pub(crate) struct ExportRuntime {
    pub(crate) handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ExportRuntime {
    /// Starts the runtime on a thread named `name`.
    pub(crate) fn start(name: &str) -> Result<Self, TelemetryError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(TelemetryError::ExportRuntime)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                yield_to_the_data_path(None);
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(TelemetryError::ExportRuntime)?;
        Ok(ExportRuntime {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for ExportRuntime {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The nice value of the export threads (the batch processor's and the
/// `otel-export` runtime's): the lowest priority. Export must never slow the
/// data path; on a saturated machine a batch of hundreds of spans turned
/// into OTLP and encoded holds a core for milliseconds, and at the default
/// priority the scheduler gives it the same share as the tunnel's workers.
/// Starved, the queue fills and spans are dropped (the batch queue's bound),
/// which is the bound this module promises anyway.
pub const EXPORT_THREAD_NICE: i32 = 19;

/// Gives `thread` (the calling thread when `None`) the lowest priority
/// ([`EXPORT_THREAD_NICE`]). Lowering a priority needs no privilege; a
/// failure (a thread gone already) only leaves it where it was.
pub(crate) fn yield_to_the_data_path(thread: Option<i32>) {
    let thread = thread.and_then(rustix::process::Pid::from_raw);
    let _ = rustix::process::setpriority_process(thread, EXPORT_THREAD_NICE);
}

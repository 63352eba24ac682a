//! The Tokio runtime a data-path service runs on, sized by `--worker-threads`.
//!
//! Every tunneled byte passes through several tasks in each process (the
//! HTTP/2 connection tasks of both peers and the relay between them). With
//! one worker thread those hand-offs stay on the thread that is already
//! running; with several, a woken task is often picked up by, or wakes,
//! another worker, and each such hand-off costs a futex wake and a context
//! switch, which on a virtual machine is an inter-processor interrupt. When
//! a service may use only one CPU anyway, as under a Kubernetes CPU limit of
//! one core or less, that buys nothing, so one worker means Tokio's
//! single-threaded scheduler.

use std::num::NonZeroUsize;

/// `--worker-threads 0`: one worker per CPU this process may use.
pub const PER_CPU: u32 = 0;

/// The most worker threads `--worker-threads` accepts. Each is a thread
/// spawned at start; far more than the CPUs only adds hand-offs, and a
/// mistyped count must not exhaust the process's threads.
pub const MAX_WORKERS: u32 = 1024;

/// Why a `--worker-threads` value is refused, if it is.
pub fn check(requested: u32) -> Result<(), String> {
    if requested > MAX_WORKERS {
        return Err(format!(
            "{requested} is more than {MAX_WORKERS}; 0 means one per CPU"
        ));
    }
    Ok(())
}

/// How many worker threads `--worker-threads requested` means:
/// [`PER_CPU`] is the CPUs this process may use (its affinity mask and its
/// cgroup's CPU quota, as [`std::thread::available_parallelism`] reads them,
/// so a container limited to 1.5 CPUs gets one).
pub fn worker_count(requested: u32) -> NonZeroUsize {
    match NonZeroUsize::new(usize::try_from(requested).unwrap_or(usize::MAX)) {
        Some(count) => count,
        None => std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
    }
}

/// The runtime for `--worker-threads requested`: Tokio's single-threaded
/// scheduler for one worker, its multi-threaded one with that many workers
/// otherwise. Blocking work (`spawn_blocking`) has its own threads either way.
pub fn build(requested: u32) -> std::io::Result<tokio::runtime::Runtime> {
    let workers = worker_count(requested).get();
    let mut builder = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(workers);
        builder
    };
    builder.enable_all().build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_past_the_maximum_are_refused() {
        assert!(check(PER_CPU).is_ok());
        assert!(check(MAX_WORKERS).is_ok());
        let refused = check(MAX_WORKERS + 1).expect_err("too many");
        assert!(refused.contains("more than 1024"), "{refused}");
    }

    #[test]
    fn an_explicit_count_is_kept_and_zero_means_the_usable_cpus() {
        assert_eq!(worker_count(3).get(), 3);
        assert_eq!(worker_count(1).get(), 1);
        assert_eq!(
            worker_count(PER_CPU),
            std::thread::available_parallelism().expect("the CPUs of this machine")
        );
    }

    /// One worker is the single-threaded scheduler, whose tasks all run on
    /// the thread that drives it; more get the multi-threaded one.
    #[test]
    fn one_worker_runs_every_task_on_the_driving_thread() {
        let single = build(1).expect("runtime");
        assert_eq!(
            single.handle().runtime_flavor(),
            tokio::runtime::RuntimeFlavor::CurrentThread
        );
        let driver = std::thread::current().id();
        let ran_on = single.block_on(async {
            tokio::spawn(async { std::thread::current().id() })
                .await
                .expect("task")
        });
        assert_eq!(ran_on, driver);
        // Blocking work still has threads of its own.
        let blocking_on = single.block_on(async {
            tokio::task::spawn_blocking(|| std::thread::current().id())
                .await
                .expect("blocking task")
        });
        assert_ne!(blocking_on, driver);

        let multi = build(2).expect("runtime");
        assert_eq!(
            multi.handle().runtime_flavor(),
            tokio::runtime::RuntimeFlavor::MultiThread
        );
        assert_eq!(multi.metrics().num_workers(), 2);
    }
}

//! What every long-running command of the binary shares: the worker threads' name and count,
//! logging to stderr, and the shutdown signal.

/// Name of the server's worker threads, `kvpages serve`'s and `kvpages bench`'s in-process
/// servers' alike (the kernel keeps 15 bytes of a thread's name), and of the runtime's blocking
/// threads (recovery, snapshot writes): `top -H` shows them, and the bench sums their CPU time.
pub const SERVER_THREAD: &str = "kvpages-server";

/// Worker threads a server gets unless told otherwise: half the CPUs, at least one. The
/// clients (vLLM's scheduler and workers, or the load generator) run on the same host and get
/// the other half. The engine is one lock, held for microseconds a command, so more workers
/// add HTTP parsing in parallel, not engine throughput. Measured on 2 CPUs with the load
/// generator beside it (docs/BENCHMARKS.md, "Threads"): one worker served the save/load
/// cycle and `get_locations` at 16 connections up to 1.8x the requests of two (one pairing
/// even), at half the p99.
pub fn default_threads() -> usize {
    (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1)
}

/// The multi-threaded runtime a server runs on: `threads` workers named [`SERVER_THREAD`].
pub fn server_runtime(threads: usize) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(SERVER_THREAD)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the server's {threads} threads: {e}"))
}

/// Logs to stderr through `filter` (`info`, `kvpages=debug`, any `EnvFilter` directive),
/// coloured only on a terminal.
pub fn init_logging(filter: &str) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| format!("--log '{filter}': {e}"))?;
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .map_err(|e| e.to_string())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: finishing open requests");
}

//! The application: the one engine behind its lock, the write-ahead log beside it, recovery
//! and snapshots. Every route reaches the core through [`App::apply`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::header;
use kvpages_core::{Command, Millis, Reply};

use crate::api::{ApiError, ErrorCode};
use crate::config::{DurableConfig, ServeConfig};
use crate::engine::{Engine, EngineError, EngineKind, NativeEngine};
use crate::plugin::PluginEngine;

/// Tries of the engine lock before a request waits for it asynchronously (see
/// [`App::try_lock_spinning`]): a few tens of microseconds of spinning at most.
const SPIN_TRIES: u32 = 1_000;

/// State shared by every request.
pub(crate) struct Shared {
    /// The one engine; locked only while it applies a command. An async lock, so a request
    /// that waits for it past its deadline is answered 503 instead of waiting forever.
    engine: tokio::sync::Mutex<Box<dyn Engine>>,
    /// What the engine is (kept outside the lock for `/health`).
    pub(crate) kind: EngineKind,
    /// Zero of the uptime and of the clock handed to the core.
    pub(crate) started: Instant,
    /// Milliseconds added to `started.elapsed()` for the core's clock: the wall clock at start,
    /// raised after recovery to the last logged time, so time never goes back across restarts.
    clock_base: AtomicU64,
    /// False while recovering: API routes answer 503 `recovering`.
    ready: AtomicBool,
    /// Records recovered so far (for `/health` while recovering).
    pub(crate) recovered: AtomicU64,
    /// The write-ahead log, when durable.
    log: OnceLock<crate::durable::Log>,
    /// The data directory's lock, held for the life of the server: one server per directory.
    dir_lock: OnceLock<crate::durable::DirLock>,
    /// Seq of the newest snapshot.
    snapshot_seq: AtomicU64,
    /// Snapshots are being skipped for want of room (so that is logged once).
    snapshot_skipping: AtomicBool,
    pub(crate) config: ServeConfig,
}

/// A handle on the shared state, cloned into every handler.
#[derive(Clone)]
pub(crate) struct App(Arc<Shared>);

impl std::ops::Deref for App {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl App {
    /// The application over `engine`; in memory it is configured at once, durable it waits for
    /// recovery ([`Handle::start`]).
    pub(crate) fn new(config: ServeConfig, engine: Box<dyn Engine>) -> Result<App, String> {
        let kind = engine.kind();
        let mut engine = engine;
        let durable = config.durability.is_some();
        if !durable {
            // Settings are a command (the durable start logs them after recovery).
            engine
                .apply(0, &Command::Configure(config.settings))
                .map_err(|e| format!("the engine refused its settings: {e:?}"))?;
        }
        let wall =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Ok(App(Arc::new(Shared {
            engine: tokio::sync::Mutex::new(engine),
            kind,
            started: Instant::now(),
            // In memory the clock starts at 0 (nothing outlives the process); durable, it is the
            // wall clock, raised past the last logged time by recovery.
            clock_base: AtomicU64::new(if durable { wall } else { 0 }),
            ready: AtomicBool::new(!durable),
            recovered: AtomicU64::new(0),
            log: OnceLock::new(),
            dir_lock: OnceLock::new(),
            snapshot_seq: AtomicU64::new(0),
            snapshot_skipping: AtomicBool::new(false),
            config,
        })))
    }

    fn now(&self) -> Millis {
        self.clock_base.load(Ordering::Acquire) + self.started.elapsed().as_millis() as Millis
    }

    /// Faults the engine contained since start-up (wasm plugin traps), for `/stats`.
    pub(crate) async fn engine_traps(&self) -> u64 {
        self.engine.lock().await.traps()
    }

    /// Whether recovery is over.
    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Applies one command; the lock is held for this call only. Waiting for the lock past
    /// `deadline` gives up with [`EngineError::Busy`]. When durable, a state-changing command
    /// is logged under the lock (so the log order is the apply order) and the reply waits for
    /// its record; a read, or a command that only takes read leases, waits for every record
    /// before it that changes more, so it never shows state a crash could take back.
    pub(crate) async fn apply(&self, cmd: &Command, deadline: Instant) -> Result<Reply, EngineError> {
        if !self.is_ready() {
            return Err(EngineError::Recovering);
        }
        let log = self.log.get();
        // While the log cannot write, a change is refused before it is applied: it could not
        // be acknowledged, and the state stays what the disk holds (plus the records waiting).
        if let Some(why) = log.filter(|_| cmd.is_mutating()).and_then(crate::durable::Log::fault) {
            return Err(EngineError::StorageDown(why));
        }
        let mut engine = match self.try_lock_spinning() {
            Some(engine) => engine,
            None => tokio::time::timeout_at(deadline.into(), self.engine.lock())
                .await
                .map_err(|_| EngineError::Busy(self.config.request_timeout))?,
        };
        let now = self.now();
        let reply = engine.apply(now, cmd);
        let logged = reply.is_ok() && cmd.is_mutating();
        let wait_for = log.map(|log| if logged { log.append(now, cmd) } else { log.barrier() });
        drop(engine);
        if let (Some(log), Some(seq)) = (log, wait_for) {
            log.wait(seq, deadline).await.map_err(|e| match e {
                // A read (or a refused change) shows state that is not durable yet.
                crate::durable::NotDurable::Fault(why) if !logged => EngineError::StorageDown(why),
                e => EngineError::Storage(e.to_string()),
            })?;
        }
        reply
    }

    /// The storage fault the server is in (`path: OS error`), if its log cannot write.
    pub(crate) fn storage_fault(&self) -> Option<String> {
        self.log.get().and_then(crate::durable::Log::fault)
    }

    /// The engine lock if it comes free within [`SPIN_TRIES`] tries. It is held for one
    /// command (microseconds), so a request that finds it taken usually gets it a moment later
    /// by spinning; waiting asynchronously instead parks the request, hands it to the worker
    /// that releases the lock and may put this worker to sleep. Measured with two worker
    /// threads under the save/load cycle (`kvpages bench --threads 2`, 16 connections): 27 % of
    /// acquisitions found the lock taken; spinning up to 2,000 tries, 1 % still had to wait.
    fn try_lock_spinning(&self) -> Option<tokio::sync::MutexGuard<'_, Box<dyn Engine>>> {
        for _ in 0..SPIN_TRIES {
            if let Ok(engine) = self.engine.try_lock() {
                return Some(engine);
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Recovers the state from the data directory into the engine, then starts the log.
    /// Blocking; run it off the async threads. Progress goes to the log (see [`replay`]).
    fn recover(&self, dur: &DurableConfig, seed: u64) -> Result<(), String> {
        let start = Instant::now();
        let lock = crate::durable::lock_dir(&dur.dir)?;
        let _ = self.dir_lock.set(lock);
        crate::durable::open_dir(&dur.dir)?;
        crate::durable::remove_temp_files(&dur.dir)?;
        let rec = crate::durable::recover(&dur.dir)?;
        if let Some(note) = &rec.dropped_tail {
            tracing::warn!("recovery: the log was torn: {note}");
        }
        let mut engine = self.engine.blocking_lock();
        *engine = replay(&self.config, &rec, seed, &mut |n| self.recovered.store(n, Ordering::Relaxed))?;
        if let Some((seq, _)) = &rec.snapshot {
            self.snapshot_seq.store(*seq, Ordering::Release);
        }
        let total = rec.records.len();
        // Time never goes back: past the last logged time, whatever the wall clock says.
        let elapsed = self.started.elapsed().as_millis() as u64;
        if rec.last_now() + 1 > self.now() {
            self.clock_base.store(rec.last_now() + 1 - elapsed, Ordering::Release);
        }
        let log = crate::durable::Log::start(&dur.dir, dur.fsync, rec.last_seq())?;
        // Settings are logged, so older records replay under the settings they ran with; then a
        // blanket read lease protects readers whose lease records never reached the disk.
        let now = self.now();
        for cmd in [Command::Configure(self.config.settings), Command::LeaseAll] {
            engine.apply(now, &cmd).map_err(|e| format!("the engine refused {cmd:?} after recovery: {e:?}"))?;
            log.append(now, &cmd);
        }
        let _ = self.log.set(log);
        drop(engine);
        self.ready.store(true, Ordering::Release);
        tracing::info!(
            records = total,
            seconds = start.elapsed().as_secs_f64(),
            dir = %dur.dir.display(),
            "recovery done: serving"
        );
        Ok(())
    }

    /// Takes a snapshot when enough records or time have passed since the last one.
    async fn maybe_snapshot(&self, dur: &DurableConfig, last_time: &mut Instant, force: bool) {
        let Some(log) = self.log.get() else { return };
        if log.fault().is_some() {
            // The log needs the disk first; the snapshot is taken once it writes again.
            return;
        }
        let since = log.last_seq().saturating_sub(self.snapshot_seq.load(Ordering::Acquire));
        let due = since >= dur.snapshot_every || (since > 0 && (force || last_time.elapsed() >= dur.snapshot_interval));
        if !due {
            return;
        }
        let (seq, bytes) = {
            let mut engine = self.engine.lock().await;
            let seq = log.last_seq();
            match engine.snapshot() {
                Ok(bytes) => (seq, bytes),
                Err(e) => {
                    tracing::error!("snapshot failed: {e:?}");
                    return;
                }
            }
        };
        let dir = dur.dir.clone();
        let start = Instant::now();
        let size = bytes.len();
        match tokio::task::spawn_blocking(move || crate::durable::write_snapshot(&dir, seq, &bytes)).await {
            Ok(Ok(())) => {
                self.snapshot_seq.store(seq, Ordering::Release);
                *last_time = Instant::now();
                if self.snapshot_skipping.swap(false, Ordering::Relaxed) {
                    tracing::info!("snapshots: the disk has room again");
                }
                tracing::info!(seq, bytes = size, seconds = start.elapsed().as_secs_f64(), "snapshot written");
            }
            Ok(Err(crate::durable::SnapshotError::NoRoom { needed, available })) => {
                crate::telemetry::snapshot_skipped();
                // One line when skipping starts, not one a second.
                if !self.snapshot_skipping.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "snapshots skipped until the disk has room: {} has {available} bytes free, a snapshot \
                         needs {needed} (the log keeps the space; it grows until a snapshot is written)",
                        dur.dir.display()
                    );
                }
                *last_time = Instant::now();
            }
            Ok(Err(e)) => {
                tracing::error!("writing a snapshot in {} failed: {e}; the log is untouched", dur.dir.display());
                *last_time = Instant::now();
            }
            Err(e) => tracing::error!("snapshot task failed: {e}"),
        }
    }

    /// Reads the whole body: 413 past `--max-body`, 408 if it has not arrived by `deadline`
    /// (a client that stalls is not the server's fault, so no 5xx), 400 if it is broken.
    pub(crate) async fn body(&self, req: Request, limit: usize, deadline: Instant) -> Result<Bytes, ApiError> {
        let too_large = || ApiError::filled(ErrorCode::BodyTooLarge, &[("limit", &limit)]);
        let declared =
            req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let read = axum::body::to_bytes(req.into_body(), limit);
        match tokio::time::timeout_at(deadline.into(), read).await {
            Err(_) => Err(ApiError::filled(
                ErrorCode::BodyTimeout,
                &[("seconds", &self.config.request_timeout.as_secs_f64())],
            )),
            Ok(Ok(body)) => Ok(body),
            Ok(Err(e)) => {
                let inner = e.into_inner();
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*inner);
                while let Some(c) = cause {
                    if c.is::<http_body_util::LengthLimitError>() {
                        return Err(too_large());
                    }
                    cause = c.source();
                }
                Err(ApiError::because(ErrorCode::BodyUnreadable, inner))
            }
        }
    }
}

/// The engine a recovered data directory holds: its snapshot restored (or a fresh engine of
/// `seed`), then every record after it applied at its logged time. Progress lines go to the
/// log; `replayed` is told the count of records applied as it goes (for `/health`).
pub fn replay(
    config: &ServeConfig,
    rec: &crate::durable::Recovered,
    seed: u64,
    replayed: &mut dyn FnMut(u64),
) -> Result<Box<dyn Engine>, String> {
    let mut engine = match &rec.snapshot {
        Some((seq, bytes)) => {
            let t = Instant::now();
            tracing::info!("recovery: restoring snapshot {seq} ({} bytes)", bytes.len());
            let engine = restore_engine(config, bytes)?;
            let secs = t.elapsed().as_secs_f64();
            tracing::info!(
                "recovery: snapshot restored in {secs:.2} s ({:.0} MiB/s)",
                bytes.len() as f64 / (1 << 20) as f64 / secs.max(1e-9)
            );
            engine
        }
        None => try_build_engine(config, seed)?,
    };
    let total = rec.records.len() as u64;
    let mut progress = crate::progress::Progress::new("recovery: replaying the log", "records", Some(total));
    for (i, r) in rec.records.iter().enumerate() {
        // Replies were checked when the command first ran; replay only rebuilds the state.
        let _ = engine.apply(r.now, &r.command);
        let done = i as u64 + 1;
        progress.update(done);
        replayed(done);
    }
    progress.finish(total);
    Ok(engine)
}

/// An engine of the configured kind restored from core snapshot bytes.
pub fn restore_engine(config: &ServeConfig, bytes: &[u8]) -> Result<Box<dyn Engine>, String> {
    match config.engine {
        EngineKind::Native => Ok(Box::new(NativeEngine::restore(bytes)?)),
        EngineKind::Wasm => Ok(Box::new(PluginEngine::restore(config.plugin.sandbox()?, bytes)?)),
    }
}

/// Builds the engine the config names, or says why it cannot (a `--plugin` that does not load,
/// a `--plugin-memory-mib` too small for the plugin to start).
pub fn try_build_engine(config: &ServeConfig, seed: u64) -> Result<Box<dyn Engine>, String> {
    match config.engine {
        EngineKind::Native => Ok(Box::new(NativeEngine::new(seed, config.settings))),
        EngineKind::Wasm => Ok(Box::new(PluginEngine::new(config.plugin.sandbox()?, seed, config.settings)?)),
    }
}

/// [`try_build_engine`] for callers whose configuration is known to be good (tests, benches).
pub fn build_engine(config: &ServeConfig, seed: u64) -> Box<dyn Engine> {
    try_build_engine(config, seed).unwrap_or_else(|e| panic!("cannot build the {} engine: {e}", config.engine))
}

/// A running server's handle: recovery, snapshots, shutdown.
#[derive(Clone)]
pub struct Handle(App);

impl Handle {
    pub(crate) fn new(app: App) -> Handle {
        Handle(app)
    }

    /// With durability configured: recovers the state (blocking; the router answers 503
    /// `recovering` meanwhile), then takes snapshots in the background. Without: nothing.
    pub async fn start(&self, seed: u64) -> Result<(), String> {
        let Some(dur) = self.0.config.durability.clone() else { return Ok(()) };
        let app = self.0.clone();
        let d = dur.clone();
        tokio::task::spawn_blocking(move || app.recover(&d, seed)).await.map_err(|e| e.to_string())??;
        let app = self.0.clone();
        tokio::spawn(async move {
            let mut last = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                app.maybe_snapshot(&dur, &mut last, false).await;
            }
        });
        Ok(())
    }

    /// Loads SGLang's persistence file through the log (all or nothing), for `--import-sglang`.
    /// Progress goes to the log: reading, parsing (keys read, rate), loading, and a final line.
    pub async fn import_sglang(&self, path: &std::path::Path) -> Result<(), String> {
        let start = Instant::now();
        let bytes = std::fs::read(path).map_err(|e| format!("--import-sglang {}: {e}", path.display()))?;
        tracing::info!(
            "import: read {} ({} bytes) in {:.2} s",
            path.display(),
            bytes.len(),
            start.elapsed().as_secs_f64()
        );
        let pools = crate::sglang_file::parse(&bytes)
            .map_err(|e| format!("--import-sglang {}: {e}; nothing was imported", path.display()))?;
        drop(bytes);
        let keys: usize = pools.iter().map(|p| p.keys.len()).sum();
        tracing::info!("import: loading {keys} keys of {} pools (one logged command)", pools.len());
        let loading = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(3600);
        match self.0.apply(&Command::ImportSglang { pools, replace: false }, deadline).await {
            Ok(Reply::Imported { pools, keys, leaked_pages }) => {
                let secs = start.elapsed().as_secs_f64();
                tracing::info!(
                    "import: done, {keys} keys of {pools} pools in {secs:.2} s ({:.0} keys/s; loading and \
                     logging {:.2} s), {leaked_pages} leaked pages made free",
                    keys as f64 / secs.max(1e-9),
                    loading.elapsed().as_secs_f64()
                );
                Ok(())
            }
            Ok(other) => Err(format!("unexpected reply {other:?}")),
            Err(EngineError::Domain(e)) => {
                Err(format!("--import-sglang {}: {e}; nothing was imported", path.display()))
            }
            Err(e) => Err(format!("--import-sglang {}: {e:?}; nothing was imported", path.display())),
        }
    }

    /// On shutdown: a last snapshot (so the next start replays little) and a closed log.
    pub async fn stop(&self) {
        let Some(dur) = self.0.config.durability.clone() else { return };
        let mut last = Instant::now();
        self.0.maybe_snapshot(&dur, &mut last, true).await;
        if let Some(log) = self.0.log.get() {
            log.close();
        }
    }
}

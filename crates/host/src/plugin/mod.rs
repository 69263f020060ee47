//! The wasm plugin engine: `kvpages-core` compiled to a component (`crates/wasm/plugin`), run in
//! a wasmtime sandbox behind the same [`Engine`] trait as the native core.
//!
//! # Layout
//! - [`sandbox`]: the narrow wrapper around wasmtime (engine config, epoch deadlines, memory cap,
//!   no imports, `InstancePre`, the way in: the direct entry point or the WIT interface); the only
//!   code here that names wasmtime's configuration.
//! - `convert`: `Command` → one call (a direct request, or a WIT call) → `Reply`.
//! - this file: [`PluginEngine`], which adds containment: after a trap, the instance is rebuilt and
//!   its state restored to exactly what it was before the failing call.
//!
//! # Containment
//! A trap poisons the instance (wasmtime refuses to enter it again), and the guest's memory may
//! hold a half-applied command, so the engine never reuses it. It keeps the last snapshot
//! (`Core::snapshot`, taken inside the guest) and a journal of the mutating commands applied
//! since; a trap rebuilds the instance from the `InstancePre`, restores the snapshot and replays
//! the journal. The core is deterministic, so the replayed state is the state before the failing
//! call; that call is answered 503 (`plugin-trapped`) and was not applied. Reads are never
//! journaled: the core guarantees that replay does not depend on them. A malformed answer to a
//! mutating command (or one that does not fit its batch, see `kvpages_abi::fits`) is an engine
//! fault, and the instance is rebuilt the same way: the guest may have applied the command,
//! which the journal does not hold. Every malformed answer, to a read too, is logged at `error`
//! and counted (`PluginEngine::faults`, `kvpages_plugin_faults_total`), not as a trap.
//!
//! A snapshot is taken when the time spent applying the journaled commands reaches
//! [`SNAPSHOT_RATIO`] times what the last snapshot took (and the journal holds at least
//! [`MIN_JOURNAL_UNITS`] commands + keys), or when the journal reaches [`MAX_JOURNAL_UNITS`]: so
//! the journal's memory is bounded (~17–21 bytes a unit for 32-hex keys), a recovery replays in
//! about `SNAPSHOT_RATIO` snapshot times at most, and snapshots cost ~1/`SNAPSHOT_RATIO` of the
//! command time until the cap binds first. It does once a snapshot takes more than a
//! `SNAPSHOT_RATIO`th of the time 4 Mi units take to apply (~0.5 s of saves): from a few hundred
//! thousand stored keys on. Measured in the server under the bench's saves (up to 10^6 keys):
//! snapshots take 9–10 % of the command time, with pauses of up to ~50 ms.

mod convert;
mod journal;
pub mod sandbox;

use kvpages_core::{Command, Millis, Reply, Settings};

use crate::engine::{Engine, EngineError, EngineKind};
pub use sandbox::{Budget, Calls, Instance, Limits, Sandbox, Trap};

/// Host-side bindings of `wit/kvpages.wit`'s world `plugin`.
#[allow(missing_docs, clippy::all)]
mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "plugin",
    });
}

/// The plugin component built by `cargo xtask plugin` (see `build.rs`).
pub(crate) static EMBEDDED: &[u8] = include_bytes!(env!("KVPAGES_PLUGIN_WASM"));

/// Fewest journal units (commands + keys) between two snapshots.
pub const MIN_JOURNAL_UNITS: usize = 16 * 1024;
/// Most journal units between two snapshots: bounds the journal's memory and the replay.
pub const MAX_JOURNAL_UNITS: usize = 4 * 1024 * 1024;
/// Command time per snapshot time (see the module docs).
pub const SNAPSHOT_RATIO: u32 = 20;

/// What the engine knows to rebuild its state after a trap.
#[derive(Debug, Default)]
struct Recovery {
    /// The state at the start of `journal` (empty: a fresh `create`).
    snapshot: Vec<u8>,
    /// Mutating commands applied since, in order (one buffer; see `journal.rs`).
    journal: journal::Journal,
    /// Commands + keys in `journal`.
    units: usize,
    /// Time spent applying the journaled commands.
    applied: std::time::Duration,
    /// What taking `snapshot` took.
    snapshot_took: std::time::Duration,
    /// After a failed snapshot, no new try before the journal has this many units (doubling),
    /// so a state too big to snapshot does not turn every command into a trap and a replay.
    retry_at: usize,
}

/// kvpages-core in the wasm sandbox.
#[derive(Debug)]
pub struct PluginEngine {
    sandbox: Sandbox,
    /// `None` only while a recovery failed; the next call tries again.
    instance: Option<Instance>,
    seed: u64,
    settings: Settings,
    recovery: Recovery,
    traps: u64,
    /// Malformed answers since start-up (see [`PluginEngine::faults`]).
    faults: u64,
    /// The bytes of the call in progress (kept: one buffer for every call, which the journal
    /// copies the packed keys from).
    buf: convert::CallBuffer,
}

impl PluginEngine {
    /// A fresh engine in a new instance of `sandbox`'s component.
    pub fn new(sandbox: Sandbox, seed: u64, settings: Settings) -> Result<PluginEngine, String> {
        let mut engine = PluginEngine {
            sandbox,
            instance: None,
            seed,
            settings,
            recovery: Recovery::default(),
            traps: 0,
            faults: 0,
            buf: convert::CallBuffer::default(),
        };
        engine.instance = Some(engine.rebuild().map_err(|e| format!("{}: {e}", engine.sandbox.origin()))?);
        Ok(engine)
    }

    /// An engine holding the state of `snapshot` (`Core::snapshot` bytes).
    pub fn restore(sandbox: Sandbox, snapshot: &[u8]) -> Result<PluginEngine, String> {
        let mut engine = PluginEngine {
            sandbox,
            instance: None,
            seed: 0,
            settings: Settings::default(),
            recovery: Recovery { snapshot: snapshot.to_vec(), ..Recovery::default() },
            traps: 0,
            faults: 0,
            buf: convert::CallBuffer::default(),
        };
        engine.instance = Some(engine.rebuild().map_err(|e| format!("{}: {e}", engine.sandbox.origin()))?);
        Ok(engine)
    }

    /// Traps contained since start-up.
    pub fn traps(&self) -> u64 {
        self.traps
    }

    /// Malformed answers since start-up (each an engine fault; after one to a mutating command
    /// the instance was rebuilt).
    pub fn faults(&self) -> u64 {
        self.faults
    }

    /// The guest's linear memory, in bytes.
    pub fn memory(&self) -> u64 {
        self.instance.as_ref().map_or(0, Instance::memory)
    }

    /// A new instance holding the state of the snapshot plus the journal.
    fn rebuild(&self) -> Result<Instance, String> {
        let mut inst = self.sandbox.instantiate()?;
        let r = &self.recovery;
        if r.snapshot.is_empty() {
            convert::create(&mut inst, self.seed, self.settings)?;
        } else {
            convert::restore(&mut inst, &r.snapshot)?;
        }
        let mut buf = convert::CallBuffer::default();
        for (i, entry) in r.journal.entries().enumerate() {
            let (now, cmd) = entry?;
            // Only applied commands are journaled, and the core is deterministic: each applies again.
            convert::call(&mut inst, now, &cmd, &mut buf)
                .map_err(|t| format!("replaying journal entry {i}: {t}"))?
                .map_err(|e| format!("journal entry {i} ({}) was refused on replay: {e:?}", cmd.name()))?;
        }
        Ok(inst)
    }

    /// Records an applied mutating command; snapshots when the journal has grown enough.
    fn journal(&mut self, now: Millis, cmd: &Command, took: std::time::Duration) {
        let r = &mut self.recovery;
        r.units += 1 + cmd.keys_in();
        r.applied += took;
        r.journal.push(now, cmd, self.buf.keys());
        let due = r.units >= MIN_JOURNAL_UNITS.max(r.retry_at) && r.applied >= r.snapshot_took * SNAPSHOT_RATIO;
        if !due && r.units < MAX_JOURNAL_UNITS.max(r.retry_at) {
            return;
        }
        let Some(inst) = self.instance.as_mut() else { return };
        let start = std::time::Instant::now();
        match convert::snapshot(inst) {
            Ok(Ok(bytes)) => {
                let mut journal = std::mem::take(&mut self.recovery.journal);
                journal.clear();
                self.recovery =
                    Recovery { snapshot: bytes, journal, snapshot_took: start.elapsed(), ..Recovery::default() };
            }
            Ok(Err(e)) => {
                self.recovery.retry_at = self.recovery.units * 2;
                tracing::error!(error = %e, "the plugin refused a snapshot; keeping the journal");
            }
            Err(trap) => {
                self.recovery.retry_at = self.recovery.units * 2;
                // The command itself was applied; only the snapshot failed. The journal still
                // holds everything, so a rebuild loses nothing.
                self.contain(&trap, "snapshot");
            }
        }
    }

    /// Counts and logs a trap, then rebuilds the instance from the snapshot and the journal.
    fn contain(&mut self, trap: &Trap, during: &str) -> bool {
        self.traps += 1;
        crate::telemetry::plugin_trapped();
        tracing::error!(
            kind = trap.kind(),
            during,
            traps = self.traps,
            "plugin trapped: {trap}; rebuilding the engine"
        );
        self.reinstate()
    }

    /// Drops the instance and rebuilds it from the snapshot and the journal; on failure, the
    /// next call tries again.
    fn reinstate(&mut self) -> bool {
        self.instance = None;
        match self.rebuild() {
            Ok(inst) => {
                self.instance = Some(inst);
                true
            }
            Err(e) => {
                tracing::error!("the plugin engine could not be restored: {e}; the next request tries again");
                false
            }
        }
    }
}

impl Engine for PluginEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Wasm
    }

    fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, EngineError> {
        if self.instance.is_none() {
            let inst =
                self.rebuild().map_err(|e| EngineError::Fault(format!("the plugin could not be restored: {e}")))?;
            self.instance = Some(inst);
        }
        let inst = self.instance.as_mut().expect("just ensured");
        let start = std::time::Instant::now();
        match convert::call(inst, now, cmd, &mut self.buf) {
            Ok(Err(EngineError::Fault(why))) => {
                // The guest answered something malformed (or refused what the host built). To a
                // mutating command, it may have applied the command all the same, which the
                // journal does not hold: the instance is rebuilt from the snapshot and the
                // journal, so its state stays the one recovery would give.
                self.faults += 1;
                crate::telemetry::plugin_faulted();
                let mutating = cmd.is_mutating();
                tracing::error!(command = cmd.name(), faults = self.faults, rebuild = mutating, "{why}");
                if mutating {
                    self.reinstate();
                }
                Err(EngineError::Fault(why))
            }
            Ok(result) => {
                // Like the write-ahead log: a refused command changed nothing worth replaying.
                if cmd.is_mutating() && result.is_ok() {
                    self.journal(now, cmd, start.elapsed());
                }
                result
            }
            Err(trap) => {
                let restored = self.contain(&trap, cmd.name());
                Err(EngineError::Trapped { cause: trap.to_string(), restored })
            }
        }
    }

    fn traps(&self) -> u64 {
        self.traps
    }

    fn snapshot(&mut self) -> Result<Vec<u8>, EngineError> {
        let inst = self.instance.as_mut().ok_or_else(|| EngineError::Fault("the plugin is being restored".into()))?;
        match convert::snapshot(inst) {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(e)) => Err(EngineError::Fault(format!("the plugin refused a snapshot: {e}"))),
            Err(trap) => {
                let restored = self.contain(&trap, "snapshot");
                Err(EngineError::Trapped { cause: trap.to_string(), restored })
            }
        }
    }
}

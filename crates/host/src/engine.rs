//! The interface the server drives, and the native engine (the core, called directly).
//!
//! The wasm plugin engine (`crate::plugin`) implements the same trait; the server does not know
//! which one it runs beyond [`Engine::kind`].

use std::fmt;

use kvpages_core::{Command, Core, Millis, Reply, Settings};

/// Which engine runs the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// `kvpages-core` compiled to a WebAssembly component, run in a wasmtime sandbox (the
    /// default: a fault in the core is contained, see `plugin`).
    Wasm,
    /// `kvpages-core` compiled into the server.
    Native,
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::Native => "native",
            EngineKind::Wasm => "wasm",
        })
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    /// `wasm` or `native`, in any case.
    fn from_str(s: &str) -> Result<EngineKind, String> {
        match s.to_ascii_lowercase().as_str() {
            "wasm" => Ok(EngineKind::Wasm),
            "native" => Ok(EngineKind::Native),
            _ => Err(format!("the engine is `wasm` or `native`, not '{s}'")),
        }
    }
}

/// Why an engine could not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The core refused the command; nothing changed.
    Domain(kvpages_core::Error),
    /// The engine itself failed (never the request's fault): answered 503.
    Fault(String),
    /// The engine was not free within the request's time bound (`--request-timeout`): 503.
    Busy(std::time::Duration),
    /// The server is still recovering its state from the data directory: 503.
    Recovering,
    /// The command applied but its log record could not be made durable: 503 (the client
    /// retries; the command is idempotent for the clients' flows).
    Storage(String),
    /// The log cannot be written (a full disk, an I/O error): the command was not applied, or
    /// it is a read that would show records not yet durable. 503 until the disk takes writes.
    StorageDown(String),
    /// The wasm plugin trapped on this command: it was not applied, the engine was rebuilt
    /// (`restored`: with the state it had before the command). 503.
    Trapped {
        /// What happened (deadline, memory cap, abort, ...).
        cause: String,
        /// Whether the rebuilt engine holds the earlier state (otherwise the next request
        /// retries the rebuild).
        restored: bool,
    },
}

/// Something that applies core commands.
pub trait Engine: Send + 'static {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;
    /// Applies `cmd` at time `now` (milliseconds of the host's monotonic clock).
    fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, EngineError>;
    /// The whole state as `kvpages_core::Core::snapshot` bytes (for snapshots and recovery).
    fn snapshot(&mut self) -> Result<Vec<u8>, EngineError>;
    /// Faults contained since start-up (traps of the wasm plugin; 0 for the native core).
    fn traps(&self) -> u64 {
        0
    }
}

/// The core in-process.
#[derive(Debug)]
pub struct NativeEngine {
    core: Core,
}

impl NativeEngine {
    /// A fresh core with these settings.
    pub fn new(seed: u64, settings: Settings) -> NativeEngine {
        NativeEngine { core: Core::new(seed, settings) }
    }

    /// A core restored from snapshot bytes.
    pub fn restore(bytes: &[u8]) -> Result<NativeEngine, String> {
        Core::restore(bytes).map(|core| NativeEngine { core }).map_err(|e| e.to_string())
    }
}

impl Engine for NativeEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Native
    }

    fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, EngineError> {
        self.core.apply(now, cmd).map_err(EngineError::Domain)
    }

    fn snapshot(&mut self) -> Result<Vec<u8>, EngineError> {
        Ok(self.core.snapshot())
    }
}

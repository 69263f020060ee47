//! The interface the server drives, and the native engine (the core, called directly).
//!
//! A second engine (the wasm plugin) implements the same trait; the server does not know which
//! one it runs beyond [`Engine::kind`].

use std::fmt;

use kvpages_core::{Command, Core, Millis, Reply, Settings};

/// Which engine runs the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    /// `kvpages-core` compiled into the server.
    Native,
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::Native => "native",
        })
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
}

/// Something that applies core commands.
pub trait Engine: Send + 'static {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;
    /// Applies `cmd` at time `now` (milliseconds of the host's monotonic clock).
    fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, EngineError>;
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
}

impl Engine for NativeEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Native
    }

    fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, EngineError> {
        self.core.apply(now, cmd).map_err(EngineError::Domain)
    }
}

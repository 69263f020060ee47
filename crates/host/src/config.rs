//! Everything `kvpages serve` needs to know: the engine, its plugin and limits, durability,
//! access and connection limits.

use std::time::Duration;

use kvpages_core::Settings;

use crate::engine::EngineKind;
use crate::plugin::Sandbox;

/// Everything `kvpages serve` needs to know.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Which engine runs the core.
    pub engine: EngineKind,
    /// The plugin the wasm engine runs, and its sandbox limits.
    pub plugin: PluginConfig,
    /// Largest accepted request body, in bytes.
    pub max_body: usize,
    /// Longest time a request may take before it is answered 503.
    pub request_timeout: Duration,
    /// The core's settings (world size, reservation TTL).
    pub settings: Settings,
    /// Where the state lives, or `None` to keep it in memory only.
    pub durability: Option<DurableConfig>,
    /// `--allow` and `--admin-token`: who may send what (default: everyone, everything).
    pub access: crate::access::Access,
    /// `--header-timeout`, `--idle-timeout`, `--max-connections`.
    pub connections: crate::connections::Limits,
}

impl Default for ServeConfig {
    fn default() -> ServeConfig {
        ServeConfig {
            engine: EngineKind::Wasm,
            plugin: PluginConfig::default(),
            max_body: 16 * 1024 * 1024,
            request_timeout: Duration::from_secs(5),
            settings: Settings::default(),
            durability: None,
            access: crate::access::Access::default(),
            connections: crate::connections::Limits::default(),
        }
    }
}

/// Which component the wasm engine runs (`--plugin`), within which limits.
#[derive(Clone, Debug, Default)]
pub struct PluginConfig {
    /// `None`: the component embedded in the binary. `Some`: one loaded (and checked against
    /// the WIT world) from `--plugin PATH` at start-up.
    pub loaded: Option<Sandbox>,
    /// `--plugin-memory-mib`, `--plugin-budget`.
    pub limits: crate::plugin::Limits,
    /// `--plugin-calls`: the way into the plugin.
    pub calls: crate::plugin::Calls,
}

impl PluginConfig {
    /// Loads `--plugin PATH` (compiled once, here) with `limits`, to be called `calls`.
    pub fn from_file(
        path: &std::path::Path,
        limits: crate::plugin::Limits,
        calls: crate::plugin::Calls,
    ) -> Result<PluginConfig, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("--plugin {}: {e}", path.display()))?;
        let sandbox = Sandbox::load(&bytes, &format!("--plugin {}", path.display()), limits, calls)?;
        Ok(PluginConfig { loaded: Some(sandbox), limits, calls })
    }

    /// The compiled component, ready to instantiate.
    pub fn sandbox(&self) -> Result<Sandbox, String> {
        match &self.loaded {
            Some(s) => Ok(s.clone()),
            None => Sandbox::embedded(self.limits, self.calls),
        }
    }
}

/// `--data-dir` and friends.
#[derive(Clone, Debug)]
pub struct DurableConfig {
    /// The data directory.
    pub dir: std::path::PathBuf,
    /// When a record counts as durable.
    pub fsync: crate::durable::FsyncMode,
    /// Take a snapshot after this many log records...
    pub snapshot_every: u64,
    /// ...or after this long with any record since the last one.
    pub snapshot_interval: Duration,
}

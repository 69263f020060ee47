//! The sandbox: the one place that configures wasmtime, so no caller can forget a limit.
//!
//! - One process-wide `wasmtime::Engine` with epoch interruption on, ticked every [`TICK`] by one
//!   thread; every call into the plugin gets a deadline in ticks ([`Budget`]), and a call that
//!   runs past it traps.
//! - Every store gets a [`Guard`], a `ResourceLimiter` capping linear memory at
//!   `--plugin-memory-mib`; a `memory.grow` past it traps at once (instead of handing the guest
//!   a failed allocation), and the guard remembers it so the trap can be named.
//! - The linker is empty: the plugin is granted no imports at all (no WASI, no clock, no host
//!   functions). A component that imports anything, or that does not export
//!   `kvpages:engine/engine@0.2.0`, is refused when it is loaded, with the reason.
//! - A component is compiled once ([`Sandbox::load`]) into an `InstancePre`; instantiating it
//!   again after a trap costs ~0.1 ms.

use std::sync::OnceLock;
use std::time::Duration;

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, ResourceLimiter, Store};

use super::bindings::{Plugin, PluginPre};

/// How often the epoch advances. Budgets are rounded up to whole ticks (plus one, because a
/// deadline of n ticks can fire anywhere in the n-th tick).
pub const TICK: Duration = Duration::from_millis(1);

/// The largest linear memory a wasm32 guest can have: 4 GiB.
pub const WASM32_MAX_MEMORY: u64 = 4 << 30;

/// The sandbox's limits (flags of `kvpages serve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Cap on the plugin's linear memory, in bytes.
    pub memory: u64,
    /// Time one call may take, before the per-key and per-state allowances below.
    pub call: Duration,
    /// Added per key of a batch (allocate, confirm, exists, locations, delete).
    pub per_key: Duration,
    /// Added per MiB of the plugin's linear memory for calls whose cost grows with the state
    /// (snapshot, restore, initialize — re-creating a pool is O(pages used) —, clear, reset,
    /// configure).
    pub per_state_mib: Duration,
}

impl Default for Limits {
    /// 4 GiB (wasm32's maximum, so the plugin holds every state the native engine can, up to
    /// that size: see README "The wasm plugin"); 1 s per call — a batch of 1,250 keys takes
    /// ~0.3 ms, so only a runaway call hits it, and the deadline is wall-clock time, so a thread
    /// descheduled on a loaded machine must not trip it —, 0.1 ms per key, 20 ms per MiB of state
    /// (snapshot/restore run at ~200 MiB/s, so 4x slack).
    fn default() -> Limits {
        Limits {
            memory: WASM32_MAX_MEMORY,
            call: Duration::from_secs(1),
            per_key: Duration::from_micros(100),
            per_state_mib: Duration::from_millis(20),
        }
    }
}

/// What a call may cost, decided by the caller from the call's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// A call of fixed cost (stats, inspect).
    Fixed,
    /// A batch of this many keys.
    Keys(usize),
    /// A call whose cost grows with the state.
    State,
    /// A restore of a snapshot of this many bytes (decoding, invariant checks and rebuilding the
    /// key index cost more per byte than writing a snapshot: 5x the per-MiB allowance).
    Restore(usize),
}

/// Why a call did not return: the instance is unusable afterwards (wasmtime refuses to enter a
/// component instance that trapped) and must be rebuilt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trap {
    /// The call ran past its deadline (epoch interruption).
    Deadline(Duration),
    /// The guest asked for more linear memory than the cap.
    MemoryCap {
        /// The cap, in bytes.
        cap: u64,
        /// What the guest asked for, in bytes.
        wanted: u64,
    },
    /// The guest aborted (a Rust panic in the guest is `unreachable`).
    Abort,
    /// Any other trap (out-of-bounds access, stack overflow, ...), with wasmtime's text.
    Other(String),
}

impl Trap {
    /// A short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Trap::Deadline(_) => "deadline",
            Trap::MemoryCap { .. } => "memory-cap",
            Trap::Abort => "abort",
            Trap::Other(_) => "other",
        }
    }
}

impl std::fmt::Display for Trap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Trap::Deadline(d) => write!(f, "the plugin ran past its time budget of {d:?} (--plugin-budget)"),
            Trap::MemoryCap { cap, wanted } => write!(
                f,
                "the plugin asked for {} MiB of memory, over the cap of {} MiB (--plugin-memory-mib)",
                wanted >> 20,
                cap >> 20
            ),
            Trap::Abort => f.write_str("the plugin aborted (a panic in the guest)"),
            Trap::Other(e) => write!(f, "the plugin trapped: {e}"),
        }
    }
}

/// Per-store state: the memory cap, and what the guest did to it.
#[derive(Debug)]
pub struct Guard {
    cap: u64,
    /// Set when a `memory.grow` was refused, so the trap is named correctly.
    refused: Option<u64>,
    /// Current size of the guest's linear memory, in bytes.
    memory: u64,
}

impl ResourceLimiter for Guard {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let desired = desired as u64;
        if desired > self.cap {
            self.refused = Some(desired);
            // An error (not `Ok(false)`): the guest traps at the `memory.grow`, so the failure is
            // one clear event instead of an allocation error somewhere in the guest.
            wasmtime::bail!("memory cap of {} bytes reached", self.cap);
        }
        self.memory = desired;
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        // The plugin's tables hold a few dozen function references.
        Ok(desired <= 10_000)
    }
}

/// The process-wide engine (its `Config` is the sandbox's) and its epoch ticker.
fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut config = Config::new();
        config.epoch_interruption(true);
        config.wasm_component_model(true);
        config.cranelift_opt_level(wasmtime::OptLevel::Speed);
        // For `perf record`: name the plugin's compiled functions in /tmp/perf-PID.map.
        if std::env::var_os("KVPAGES_PLUGIN_PERFMAP").is_some_and(|v| v == "1") {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&config).expect("the sandbox's wasmtime configuration is valid");
        let ticker = engine.clone();
        std::thread::Builder::new()
            .name("kvpages-epoch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(TICK);
                    ticker.increment_epoch();
                }
            })
            .expect("spawn the epoch ticker");
        engine
    })
}

/// A compiled plugin component, ready to be instantiated any number of times.
#[derive(Clone)]
pub struct Sandbox {
    pre: PluginPre<Guard>,
    limits: Limits,
    /// What was loaded (`embedded` or the file's path), for messages.
    origin: String,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("origin", &self.origin).field("limits", &self.limits).finish()
    }
}

impl Sandbox {
    /// Compiles `bytes` (a component; with the `wat` feature, in tests, also its text form) and
    /// checks it against the plugin world. `origin` names it in messages.
    pub fn load(bytes: &[u8], origin: &str, limits: Limits) -> Result<Sandbox, String> {
        let engine = engine();
        let start = std::time::Instant::now();
        let component =
            Component::new(engine, bytes).map_err(|e| format!("{origin} is not a valid component: {e:#}"))?;
        tracing::info!(bytes = bytes.len(), ms = start.elapsed().as_millis() as u64, "compiled {origin}");
        Sandbox::from_component(&component, origin, limits)
    }

    fn from_component(component: &Component, origin: &str, limits: Limits) -> Result<Sandbox, String> {
        let engine = engine();
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(engine).map(|(name, _)| name.to_owned()).collect();
        if !imports.is_empty() {
            return Err(format!("{origin} imports {imports:?}; kvpages grants a plugin no imports at all"));
        }
        // The empty linker: nothing to import.
        let linker = Linker::<Guard>::new(engine);
        let instance_pre = linker.instantiate_pre(component).map_err(|e| format!("{origin}: {e:#}"))?;
        let pre = PluginPre::new(instance_pre).map_err(|e| {
            let exports: Vec<String> = ty.exports(engine).map(|(name, _)| name.to_owned()).collect();
            format!(
                "{origin} does not implement the WIT world kvpages:engine/plugin@0.2.0 (wit/kvpages.wit): {e:#}; it exports {exports:?}"
            )
        })?;
        Ok(Sandbox { pre, limits, origin: origin.to_owned() })
    }

    /// The component built into the binary, compiled once per process.
    pub fn embedded(limits: Limits) -> Result<Sandbox, String> {
        static COMPILED: OnceLock<Result<Component, String>> = OnceLock::new();
        let component = COMPILED.get_or_init(|| {
            // Compiled at each start (~0.3 s in a release build): no precompiled cache, which would
            // mean trusting bytes on disk as native code (`Component::deserialize` is unsafe).
            let start = std::time::Instant::now();
            let c = Component::from_binary(engine(), super::EMBEDDED)
                .map_err(|e| format!("the embedded plugin does not compile: {e:#}"));
            let ms = start.elapsed().as_millis() as u64;
            tracing::info!(bytes = super::EMBEDDED.len(), ms, "compiled the embedded plugin");
            c
        });
        Sandbox::from_component(component.as_ref().map_err(Clone::clone)?, "the embedded plugin", limits)
    }

    /// The limits every instance gets.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What was loaded.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// A fresh instance: new store, new memory, nothing shared with earlier instances.
    pub fn instantiate(&self) -> Result<Instance, String> {
        let mut store = Store::new(engine(), Guard { cap: self.limits.memory, refused: None, memory: 0 });
        store.limiter(|g| g as &mut dyn ResourceLimiter);
        // Instantiation runs no guest code of ours, but give it a deadline all the same.
        store.set_epoch_deadline(ticks(self.limits.call));
        let plugin = self.pre.instantiate(&mut store).map_err(|e| format!("instantiating {}: {e:#}", self.origin))?;
        Ok(Instance { store, plugin, limits: self.limits })
    }
}

fn ticks(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(TICK.as_nanos()) as u64).saturating_add(1)
}

/// One instance of the plugin in its own store.
pub struct Instance {
    store: Store<Guard>,
    plugin: Plugin,
    limits: Limits,
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance").field("memory", &self.store.data().memory).finish()
    }
}

impl Instance {
    /// Current size of the guest's linear memory, in bytes.
    pub fn memory(&self) -> u64 {
        self.store.data().memory
    }

    /// The deadline a call of this size gets.
    pub fn budget(&self, budget: Budget) -> Duration {
        let l = &self.limits;
        match budget {
            Budget::Fixed => l.call,
            Budget::Keys(n) => l.call.saturating_add(l.per_key.saturating_mul(n.min(u32::MAX as usize) as u32)),
            Budget::State => l.call.saturating_add(l.per_state_mib.saturating_mul((self.memory() >> 20) as u32 + 1)),
            Budget::Restore(bytes) => {
                l.call.saturating_add(l.per_state_mib.saturating_mul(5 * ((bytes >> 20) as u32 + 1)))
            }
        }
    }

    /// Calls into the guest with a deadline fitted to `budget`; a trap comes back as [`Trap`].
    pub fn call<R>(
        &mut self,
        budget: Budget,
        f: impl FnOnce(&Plugin, &mut Store<Guard>) -> wasmtime::Result<R>,
    ) -> Result<R, Trap> {
        let limit = self.budget(budget);
        self.store.set_epoch_deadline(ticks(limit));
        self.store.data_mut().refused = None;
        f(&self.plugin, &mut self.store).map_err(|e| {
            if let Some(wanted) = self.store.data().refused {
                return Trap::MemoryCap { cap: self.limits.memory, wanted };
            }
            match e.downcast_ref::<wasmtime::Trap>() {
                Some(wasmtime::Trap::Interrupt) => Trap::Deadline(limit),
                Some(wasmtime::Trap::UnreachableCodeReached) => Trap::Abort,
                _ => Trap::Other(format!("{e:#}")),
            }
        })
    }
}

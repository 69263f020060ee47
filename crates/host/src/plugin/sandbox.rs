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
//!   again after a trap costs ~0.1 ms. A `--plugin` file taken the direct way is compiled twice
//!   at start-up (the component, to check its world, then its core module); the embedded plugin
//!   only as its core module (unless that is refused and `auto` falls back to WIT).
//! - Two ways in ([`Calls`]): the component's WIT interface, or — when the component's core
//!   module exports kvpages' direct entry point (`kvpages_abi::direct`; kvpages' own plugin
//!   does) — that module instantiated on its own and driven through one plain call a command.
//!   Same store, same limits, same (empty) imports: the sandbox is wasmtime's either way.

use std::sync::OnceLock;
use std::time::Duration;

use kvpages_abi::direct;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, ResourceLimiter, Store, TypedFunc};

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
    /// that size: see docs/plugin.md, "Memory"); 1 s per call — a batch of 1,250 keys takes
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

/// Which way the host calls into the plugin (`--plugin-calls`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Calls {
    /// The direct entry point when the component's core module has it, else the WIT interface.
    #[default]
    Auto,
    /// The direct entry point; a component without it is refused.
    Direct,
    /// The WIT interface, always (what any other component-model host uses).
    Wit,
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
/// component instance that trapped; a core instance would run, but the guest's memory may hold a
/// half-applied command and borrows never released) and must be rebuilt.
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
    way: Way,
    limits: Limits,
    /// What was loaded (`embedded` or the file's path), for messages.
    origin: String,
}

/// How a [`Sandbox`] instantiates and calls its plugin.
#[derive(Clone)]
enum Way {
    /// The component, through its WIT interface.
    Wit(Box<PluginPre<Guard>>),
    /// The component's core module on its own, through the direct entry point.
    Direct(wasmtime::InstancePre<Guard>),
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("origin", &self.origin)
            .field("calls", &self.calls())
            .field("limits", &self.limits)
            .finish()
    }
}

impl Sandbox {
    /// Compiles `bytes` (a component; with the `wat` feature, in tests, also its text form) and
    /// checks it against the plugin world. `origin` names it in messages; `calls` picks the way
    /// in (see [`Calls`]).
    pub fn load(bytes: &[u8], origin: &str, limits: Limits, calls: Calls) -> Result<Sandbox, String> {
        let engine = engine();
        let start = std::time::Instant::now();
        let component =
            Component::new(engine, bytes).map_err(|e| format!("{origin} is not a valid component: {e:#}"))?;
        tracing::info!(bytes = bytes.len(), ms = start.elapsed().as_millis() as u64, "compiled {origin}");
        let pre = Sandbox::wit(&component, origin)?;
        let way = Sandbox::choose(calls, origin, "", || direct_module(bytes, origin), || Ok(pre))?;
        Ok(Sandbox { way, limits, origin: origin.to_owned() })
    }

    /// The component's WIT interface, checked against the plugin world.
    fn wit(component: &Component, origin: &str) -> Result<PluginPre<Guard>, String> {
        let engine = engine();
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(engine).map(|(name, _)| name.to_owned()).collect();
        if !imports.is_empty() {
            return Err(format!("{origin} imports {imports:?}; kvpages grants a plugin no imports at all"));
        }
        // The empty linker: nothing to import.
        let linker = Linker::<Guard>::new(engine);
        let instance_pre = linker.instantiate_pre(component).map_err(|e| format!("{origin}: {e:#}"))?;
        PluginPre::new(instance_pre).map_err(|e| {
            let exports: Vec<String> = ty.exports(engine).map(|(name, _)| name.to_owned()).collect();
            format!(
                "{origin} does not implement the WIT world kvpages:engine/plugin@0.2.0 (wit/kvpages.wit): {e:#}; it exports {exports:?}"
            )
        })
    }

    /// The core module's direct entry point, with nothing to import; its exports' types are
    /// checked here, so a module that only names them is refused before any instance exists.
    fn direct(module: &wasmtime::Module, origin: &str) -> Result<wasmtime::InstancePre<Guard>, String> {
        use wasmtime::{ExternType, ValType};
        for name in [direct::BUFFER, direct::CALL] {
            let i32_to_i32 = match module.get_export(name) {
                Some(ExternType::Func(f)) => {
                    let params: Vec<ValType> = f.params().collect();
                    let results: Vec<ValType> = f.results().collect();
                    matches!(params[..], [ValType::I32]) && matches!(results[..], [ValType::I32])
                }
                _ => false,
            };
            if !i32_to_i32 {
                return Err(format!("{origin}'s core module exports `{name}`, but not as a function (i32) -> i32"));
            }
        }
        if !matches!(module.get_export("memory"), Some(ExternType::Memory(_))) {
            return Err(format!("{origin}'s core module has the direct entry point but exports no `memory`"));
        }
        let linker = wasmtime::Linker::<Guard>::new(engine());
        linker.instantiate_pre(module).map_err(|e| format!("{origin}'s core module: {e:#}"))
    }

    /// The component built into the binary, compiled once per process. It is kvpages' own,
    /// checked against the world by the tests, so with its direct entry point in use only its
    /// core module is compiled, not the component.
    pub fn embedded(limits: Limits, calls: Calls) -> Result<Sandbox, String> {
        static COMPONENT: OnceLock<Result<Component, String>> = OnceLock::new();
        static MODULE: OnceLock<Result<Option<wasmtime::Module>, String>> = OnceLock::new();
        let origin = "the embedded plugin";
        if super::EMBEDDED.is_empty() {
            return Err("this kvpages was built without its wasm plugin (target/plugin/kvpages_plugin.wasm was \
                        missing at build time): run `cargo xtask plugin` and build again (or `cargo xtask serve`), \
                        or start it with `--engine native`"
                .to_owned());
        }
        // Compiled at each start (~1.2 s on a 2-CPU machine): no precompiled cache, which would
        // mean trusting bytes on disk as native code (`deserialize` is unsafe).
        let compiled = |what: &str, start: std::time::Instant| {
            let ms = start.elapsed().as_millis() as u64;
            tracing::info!(bytes = super::EMBEDDED.len(), ms, "compiled the embedded plugin's {what}");
        };
        let module = || {
            MODULE
                .get_or_init(|| {
                    let start = std::time::Instant::now();
                    let module = direct_module(super::EMBEDDED, origin);
                    if let Ok(Some(_)) = module {
                        compiled("core module", start);
                    }
                    module
                })
                .clone()
        };
        let rebuild = "rebuild it with `cargo xtask plugin`, or ";
        let way = Sandbox::choose(calls, origin, rebuild, module, || {
            let component = COMPONENT.get_or_init(|| {
                let start = std::time::Instant::now();
                let component = Component::from_binary(engine(), super::EMBEDDED)
                    .map_err(|e| format!("the embedded plugin does not compile: {e:#}"));
                compiled("component", start);
                component
            });
            Sandbox::wit(component.as_ref().map_err(Clone::clone)?, origin)
        })?;
        Ok(Sandbox { way, limits, origin: origin.to_owned() })
    }

    /// The way in `calls` asks for: the direct entry point when `module` (the search for it,
    /// not made under [`Calls::Wit`]) finds one that [`Sandbox::direct`] accepts; otherwise
    /// `wit` (the checked WIT interface), unless `calls` is [`Calls::Direct`], which refuses.
    /// Under [`Calls::Auto`] a component whose entry point is broken is called through WIT,
    /// with a warning. `hint` starts the advice of the refusal of a component without it.
    fn choose(
        calls: Calls,
        origin: &str,
        hint: &str,
        module: impl FnOnce() -> Result<Option<wasmtime::Module>, String>,
        wit: impl FnOnce() -> Result<PluginPre<Guard>, String>,
    ) -> Result<Way, String> {
        let found = match calls {
            Calls::Wit => Ok(None),
            Calls::Auto | Calls::Direct => module().and_then(|m| m.map(|m| Sandbox::direct(&m, origin)).transpose()),
        };
        match (found, calls) {
            (Ok(Some(pre)), _) => Ok(Way::Direct(pre)),
            (Err(e), Calls::Direct) => Err(e),
            (Ok(None), Calls::Direct) => Err(format!(
                "{origin} has no direct entry point (a core module exporting `{}` and `{}`); \
                 {hint}use --plugin-calls wit or auto",
                direct::BUFFER,
                direct::CALL
            )),
            (Err(e), _) => {
                tracing::warn!("{e}; calling it through its WIT interface");
                Ok(Way::Wit(Box::new(wit()?)))
            }
            (Ok(None), _) => Ok(Way::Wit(Box::new(wit()?))),
        }
    }

    /// The limits every instance gets.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What was loaded.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The way in this sandbox uses: [`Calls::Direct`] or [`Calls::Wit`].
    pub fn calls(&self) -> Calls {
        match self.way {
            Way::Wit(_) => Calls::Wit,
            Way::Direct(_) => Calls::Direct,
        }
    }

    /// A fresh instance: new store, new memory, nothing shared with earlier instances.
    pub fn instantiate(&self) -> Result<Instance, String> {
        let mut store = Store::new(engine(), Guard { cap: self.limits.memory, refused: None, memory: 0 });
        store.limiter(|g| g as &mut dyn ResourceLimiter);
        // Instantiation runs no guest code of ours, but give it a deadline all the same.
        store.set_epoch_deadline(ticks(self.limits.call));
        let fail = |e: wasmtime::Error| format!("instantiating {}: {e:#}", self.origin);
        let exports = match &self.way {
            Way::Wit(pre) => Exports::Wit(Box::new(pre.instantiate(&mut store).map_err(fail)?)),
            Way::Direct(pre) => {
                let instance = pre.instantiate(&mut store).map_err(fail)?;
                let missing = |what: &str| format!("{}'s core module has no {what}", self.origin);
                Exports::Direct(Direct {
                    memory: instance.get_memory(&mut store, "memory").ok_or_else(|| missing("memory"))?,
                    buffer: instance
                        .get_typed_func(&mut store, direct::BUFFER)
                        .map_err(|e| format!("{}: {e:#}", missing(direct::BUFFER)))?,
                    call: instance
                        .get_typed_func(&mut store, direct::CALL)
                        .map_err(|e| format!("{}: {e:#}", missing(direct::CALL)))?,
                    request: None,
                })
            }
        };
        Ok(Instance { store, exports, limits: self.limits })
    }
}

/// The bytes `[at, at + len)` of a guest's memory as a host range (computed in u64: no overflow
/// whatever the host's pointer width); `None` when it does not fit a `usize`.
fn span(at: u32, len: u64) -> Option<std::ops::Range<usize>> {
    let end = u64::from(at).checked_add(len)?;
    Some(usize::try_from(at).ok()?..usize::try_from(end).ok()?)
}

/// The core module of `component` that exports the direct entry point, compiled; `None` when
/// there is none. More than one, or one that imports anything, is refused.
fn direct_module(component: &[u8], origin: &str) -> Result<Option<wasmtime::Module>, String> {
    use wasmparser::{Parser, Payload};
    let bad = |e: wasmparser::BinaryReaderError| format!("{origin} does not parse: {e}");
    let mut found = None;
    for payload in Parser::new(0).parse_all(component) {
        let Payload::ModuleSection { unchecked_range, .. } = payload.map_err(bad)? else { continue };
        let module = component.get(unchecked_range).ok_or_else(|| format!("{origin}: a module runs past its end"))?;
        let (mut exports, mut imports) = (Vec::new(), 0);
        for payload in Parser::new(0).parse_all(module) {
            match payload.map_err(bad)? {
                Payload::ImportSection(s) => imports += s.count(),
                Payload::ExportSection(s) => {
                    for export in s {
                        exports.push(export.map_err(bad)?.name.to_owned());
                    }
                }
                _ => {}
            }
        }
        if !(exports.iter().any(|e| e == direct::BUFFER) && exports.iter().any(|e| e == direct::CALL)) {
            continue;
        }
        if imports > 0 {
            return Err(format!("{origin}'s direct entry point is in a core module that imports {imports} items"));
        }
        if found.replace(module).is_some() {
            return Err(format!("{origin} has more than one core module with a direct entry point"));
        }
    }
    let Some(module) = found else { return Ok(None) };
    wasmtime::Module::new(engine(), module)
        .map(Some)
        .map_err(|e| format!("{origin}'s core module does not compile: {e:#}"))
}

fn ticks(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(TICK.as_nanos()) as u64).saturating_add(1)
}

/// One instance of the plugin in its own store.
pub struct Instance {
    store: Store<Guard>,
    exports: Exports,
    limits: Limits,
}

/// What the host calls in an instance.
enum Exports {
    Wit(Box<Plugin>),
    Direct(Direct),
}

/// The direct entry point's exports (`kvpages_abi::direct`).
struct Direct {
    memory: wasmtime::Memory,
    buffer: TypedFunc<u32, u32>,
    call: TypedFunc<u32, u32>,
    /// The request buffer the guest last handed out, `(address, length)`: reused while
    /// requests fit and `direct::keeps_buffer` says the guest kept it (not after a restore or a
    /// request over 1 MiB).
    request: Option<(u32, u32)>,
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let calls = match self.exports {
            Exports::Wit(_) => Calls::Wit,
            Exports::Direct(_) => Calls::Direct,
        };
        f.debug_struct("Instance").field("calls", &calls).field("memory", &self.store.data().memory).finish()
    }
}

impl Instance {
    /// Current size of the guest's linear memory, in bytes.
    pub fn memory(&self) -> u64 {
        self.store.data().memory
    }

    /// Whether this instance is called through the direct entry point.
    pub fn is_direct(&self) -> bool {
        matches!(self.exports, Exports::Direct(_))
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

    /// Arms the deadline for a call of `budget`; returns the limit.
    fn arm(&mut self, budget: Budget) -> Duration {
        let limit = self.budget(budget);
        self.store.set_epoch_deadline(ticks(limit));
        self.store.data_mut().refused = None;
        limit
    }

    /// Names what stopped a call.
    fn trap(&self, e: wasmtime::Error, limit: Duration) -> Trap {
        if let Some(wanted) = self.store.data().refused {
            return Trap::MemoryCap { cap: self.limits.memory, wanted };
        }
        match e.downcast_ref::<wasmtime::Trap>() {
            Some(wasmtime::Trap::Interrupt) => Trap::Deadline(limit),
            Some(wasmtime::Trap::UnreachableCodeReached) => Trap::Abort,
            _ => Trap::Other(format!("{e:#}")),
        }
    }

    /// Calls into the guest's WIT interface with a deadline fitted to `budget`; a trap comes
    /// back as [`Trap`] (as does a call on an instance taken the direct way, which has none).
    pub fn call<R>(
        &mut self,
        budget: Budget,
        f: impl FnOnce(&Plugin, &mut Store<Guard>) -> wasmtime::Result<R>,
    ) -> Result<R, Trap> {
        let limit = self.arm(budget);
        let Exports::Wit(plugin) = &self.exports else {
            return Err(Trap::Other("a WIT call on an instance taken through the direct entry point".into()));
        };
        f(plugin, &mut self.store).map_err(|e| self.trap(e, limit))
    }

    /// Hands `request` to the guest's direct entry point with a deadline fitted to `budget`:
    /// the reply's status and bytes (in the guest's memory, valid until the next call). A trap,
    /// or a reply the guest points outside its memory, comes back as [`Trap`] (the instance is
    /// not to be trusted again; as is a call on an instance taken the WIT way, which has none).
    pub fn exchange(&mut self, budget: Budget, request: &[u8]) -> Result<(u32, &[u8]), Trap> {
        let limit = self.arm(budget);
        let Exports::Direct(d) = &mut self.exports else {
            return Err(Trap::Other("a direct call on an instance taken through the WIT interface".into()));
        };
        let store = &mut self.store;
        let result = (|| -> wasmtime::Result<(u32, std::ops::Range<usize>)> {
            let len = u32::try_from(request.len()).map_err(|_| wasmtime::format_err!("a request over 4 GiB"))?;
            let ptr = match d.request {
                Some((ptr, cap)) if cap >= len => ptr,
                _ => {
                    let ptr = d.buffer.call(&mut *store, len)?;
                    d.request = Some((ptr, len));
                    ptr
                }
            };
            let memory = d.memory.data_mut(&mut *store);
            let Some(buffer) = span(ptr, request.len() as u64).and_then(|at| memory.get_mut(at)) else {
                d.request = None;
                wasmtime::bail!("the plugin's request buffer lies outside its memory");
            };
            buffer.copy_from_slice(request);
            if !direct::keeps_buffer(request) {
                // The guest frees this buffer after the call (the rule is `keeps_buffer`'s).
                d.request = None;
            }
            let at = d.call.call(&mut *store, len)?;
            let memory = d.memory.data(&*store);
            let descriptor = span(at, 12)
                .and_then(|at| memory.get(at))
                .and_then(|b| <[u8; 12]>::try_from(b).ok())
                .ok_or_else(|| wasmtime::format_err!("the plugin's reply descriptor lies outside its memory"))?;
            let (status, ptr, len) = direct::descriptor(descriptor);
            match span(ptr, len.into()) {
                Some(reply) if memory.get(reply.clone()).is_some() => Ok((status, reply)),
                _ => wasmtime::bail!("the plugin's reply lies outside its memory"),
            }
        })();
        match result {
            Ok((status, reply)) => Ok((status, &d.memory.data(&self.store)[reply])),
            Err(e) => Err(self.trap(e, limit)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox of a core module (WAT) exporting the direct entry point, as if found in a
    /// component: the guest's side of the exchange is whatever the module does.
    fn direct_sandbox(wat: &str) -> Sandbox {
        let module = wasmtime::Module::new(engine(), wat).unwrap();
        let limits = Limits { memory: 1 << 20, call: Duration::from_millis(50), ..Limits::default() };
        Sandbox { way: Way::Direct(Sandbox::direct(&module, "test").unwrap()), limits, origin: "test".into() }
    }

    /// A guest whose `call` answers the descriptor at `descriptor`, which holds `(status, ptr,
    /// len)`; its buffer is at 1024.
    fn guest(descriptor: u32, status: u32, ptr: u32, len: u32) -> String {
        format!(
            r#"(module
                (memory (export "memory") 1)
                (func (export "kvpages_direct_v1_buffer") (param i32) (result i32) i32.const 1024)
                (func (export "kvpages_direct_v1_call") (param i32) (result i32)
                    (i32.store (i32.const 64) (i32.const {status}))
                    (i32.store (i32.const 68) (i32.const {ptr}))
                    (i32.store (i32.const 72) (i32.const {len}))
                    i32.const {descriptor}))"#
        )
    }

    #[test]
    fn a_well_behaved_direct_guest_is_read_where_its_descriptor_points() {
        // The reply is the request's own first 3 bytes, in the buffer at 1024.
        let mut inst = direct_sandbox(&guest(64, 7, 1024, 3)).instantiate().unwrap();
        assert!(inst.is_direct());
        let (status, reply) = inst.exchange(Budget::Fixed, b"abcdef").unwrap();
        assert_eq!((status, reply), (7, &b"abc"[..]));
    }

    #[test]
    fn the_host_asks_for_a_buffer_again_only_when_the_guest_drops_or_outgrows_it() {
        // `buffer` counts its calls at address 0; every reply is that count.
        let wat = r#"(module
            (memory (export "memory") 1)
            (func (export "kvpages_direct_v1_buffer") (param i32) (result i32)
                (i32.store (i32.const 0) (i32.add (i32.load (i32.const 0)) (i32.const 1)))
                i32.const 1024)
            (func (export "kvpages_direct_v1_call") (param i32) (result i32)
                (i32.store (i32.const 64) (i32.const 0))
                (i32.store (i32.const 68) (i32.const 0))
                (i32.store (i32.const 72) (i32.const 4))
                i32.const 64))"#;
        let mut inst = direct_sandbox(wat).instantiate().unwrap();
        let mut asked = |request: &[u8]| {
            let (_, reply) = inst.exchange(Budget::Fixed, request).unwrap();
            u32::from_le_bytes(reply.try_into().unwrap())
        };
        assert_eq!(asked(b"xy"), 1);
        assert_eq!(asked(b"z"), 1, "fits: reused");
        assert_eq!(asked(b"xyz"), 2, "outgrown: asked again");
        assert_eq!(asked(&[direct::RESTORE]), 2, "fits, but the guest drops it after");
        assert_eq!(asked(b"x"), 3, "asked again after a restore");
    }

    #[test]
    fn a_direct_guest_pointing_outside_its_memory_is_a_trap_not_a_read() {
        let page = 64 * 1024;
        for (wat, why) in [
            (guest(page - 8, 0, 0, 0), "descriptor lies outside"),
            (guest(64, 0, page - 2, 3), "reply lies outside"),
            (guest(64, 0, u32::MAX, 1), "reply lies outside"),
            (guest(64, 0, 16, u32::MAX), "reply lies outside"),
        ] {
            let mut inst = direct_sandbox(&wat).instantiate().unwrap();
            match inst.exchange(Budget::Fixed, b"x") {
                Err(Trap::Other(e)) => assert!(e.contains(why), "{e}"),
                other => panic!("{other:?}"),
            }
        }
        // A request buffer outside the memory: nothing is written anywhere.
        let wat = guest(64, 0, 0, 0).replace("i32.const 1024", "i32.const 65534");
        let mut inst = direct_sandbox(&wat).instantiate().unwrap();
        match inst.exchange(Budget::Fixed, b"xyz") {
            Err(Trap::Other(e)) => assert!(e.contains("request buffer lies outside"), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_direct_guest_is_held_to_its_deadline_and_memory_cap() {
        let looping = r#"(module
            (memory (export "memory") 1)
            (func (export "kvpages_direct_v1_buffer") (param i32) (result i32) i32.const 1024)
            (func (export "kvpages_direct_v1_call") (param i32) (result i32) (loop (br 0)) i32.const 0))"#;
        let mut inst = direct_sandbox(looping).instantiate().unwrap();
        assert!(matches!(inst.exchange(Budget::Fixed, b"x"), Err(Trap::Deadline(_))));
        let growing = r#"(module
            (memory (export "memory") 1)
            (func (export "kvpages_direct_v1_buffer") (param i32) (result i32) i32.const 1024)
            (func (export "kvpages_direct_v1_call") (param i32) (result i32)
                (drop (memory.grow (i32.const 100))) i32.const 0))"#;
        let mut inst = direct_sandbox(growing).instantiate().unwrap();
        match inst.exchange(Budget::Fixed, b"x") {
            Err(Trap::MemoryCap { cap, wanted }) => assert_eq!((cap, wanted), (1 << 20, 101 * 65536)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_direct_guest_answering_malformed_replies_is_a_fault_not_a_panic() {
        use crate::engine::{Engine, EngineError};
        use kvpages_core::{Command, Key, Space};
        // Every request answered "OK" with the bytes ff ff ff.
        let wat = guest(64, direct::OK, 128, 3).replace(
            "(func (export \"kvpages_direct_v1_buffer\")",
            "(data (i32.const 128) \"\\ff\\ff\\ff\") (func (export \"kvpages_direct_v1_buffer\")",
        );
        let mut e =
            super::super::PluginEngine::new(direct_sandbox(&wat), 1, kvpages_core::Settings::default()).unwrap();
        let keys = vec![Key::parse("k").unwrap()];
        for (cmd, why) in [
            (Command::Exists { space: Space::Vllm, keys: keys.clone() }, "an exists byte 255"),
            (Command::Allocate { space: Space::Vllm, rank: 0, keys: keys.clone() }, "a partial word"),
            (Command::Delete { space: Space::Vllm, keys }, "a reply cut short"),
            (Command::Stats, "a malformed reply"),
        ] {
            match e.apply(1, &cmd) {
                Err(EngineError::Fault(f)) => assert!(f.contains(why), "{cmd:?}: {f}"),
                other => panic!("{cmd:?}: {other:?}"),
            }
        }
        assert_eq!((e.traps(), e.faults()), (0, 4));

        // A guest that grows its memory a page a call: a malformed answer to a mutating command
        // rebuilds the instance (what it may have applied is not in the journal), one to a read
        // does not.
        let grows = wat.replace(
            "(func (export \"kvpages_direct_v1_call\") (param i32) (result i32)",
            "(func (export \"kvpages_direct_v1_call\") (param i32) (result i32) (drop (memory.grow (i32.const 1)))",
        );
        assert_ne!(grows, wat);
        let mut e =
            super::super::PluginEngine::new(direct_sandbox(&grows), 1, kvpages_core::Settings::default()).unwrap();
        let page = 64 * 1024;
        assert_eq!(e.memory(), 2 * page); // one page, one `create`
        let keys = vec![Key::parse("k").unwrap()];
        assert!(matches!(
            e.apply(1, &Command::Exists { space: Space::Vllm, keys: keys.clone() }),
            Err(EngineError::Fault(_))
        ));
        assert_eq!(e.memory(), 3 * page);
        let alloc = Command::Allocate { space: Space::Vllm, rank: 0, keys };
        assert!(matches!(e.apply(2, &alloc), Err(EngineError::Fault(_))));
        assert_eq!(e.memory(), 2 * page, "rebuilt: a new instance, one `create`");
        assert_eq!((e.traps(), e.faults()), (0, 2));
    }

    /// A component (WAT) holding the given core modules, instantiated and nothing else.
    fn component(modules: &[&str]) -> Vec<u8> {
        let body: String = modules.iter().map(|m| format!("(core module {m})")).collect();
        wat::parse_str(format!("(component {body})")).unwrap()
    }

    const ENTRY: &str = r#"(memory (export "memory") 1)
        (func (export "kvpages_direct_v1_buffer") (param i32) (result i32) i32.const 0)
        (func (export "kvpages_direct_v1_call") (param i32) (result i32) i32.const 0)"#;

    #[test]
    fn the_direct_entry_point_is_the_one_core_module_with_both_exports() {
        assert!(direct_module(&component(&[ENTRY]), "c").unwrap().is_some());
        // Beside a module without it: found.
        assert!(direct_module(&component(&["(func (export \"f\"))", ENTRY]), "c").unwrap().is_some());
        // Only one of the two exports: none.
        let half = r#"(memory (export "memory") 1)
            (func (export "kvpages_direct_v1_call") (param i32) (result i32) i32.const 0)"#;
        assert!(direct_module(&component(&[half]), "c").unwrap().is_none());
        assert!(direct_module(&component(&[]), "c").unwrap().is_none());
        // Two: refused, as is one that imports anything.
        let e = direct_module(&component(&[ENTRY, ENTRY]), "c").unwrap_err();
        assert!(e.contains("more than one core module"), "{e}");
        let importing = format!(r#"(import "env" "f" (func)) {ENTRY}"#);
        let e = direct_module(&component(&[&importing]), "c").unwrap_err();
        assert!(e.contains("imports 1 items"), "{e}");
        // A module that names the exports with the wrong types, or has no memory, is refused
        // before any instance exists (so `auto` can fall back to the WIT interface).
        let wrong = r#"(memory (export "memory") 1)
            (func (export "kvpages_direct_v1_buffer") (result i32) i32.const 0)
            (func (export "kvpages_direct_v1_call") (param i32) (result i32) i32.const 0)"#;
        let module = direct_module(&component(&[wrong]), "c").unwrap().unwrap();
        let e = Sandbox::direct(&module, "c").map(|_| ()).unwrap_err();
        assert!(e.contains("exports `kvpages_direct_v1_buffer`, but not as a function (i32) -> i32"), "{e}");
        let no_memory = ENTRY.replace(r#"(memory (export "memory") 1)"#, "(memory 1)");
        let module = direct_module(&component(&[&no_memory]), "c").unwrap().unwrap();
        let e = Sandbox::direct(&module, "c").map(|_| ()).unwrap_err();
        assert!(e.contains("exports no `memory`"), "{e}");
    }

    #[test]
    fn the_way_in_falls_back_to_wit_under_auto_only() {
        let wit = || match Sandbox::embedded(Limits::default(), Calls::Wit)?.way {
            Way::Wit(pre) => Ok(*pre),
            Way::Direct(_) => Err("the embedded plugin under `wit` went the direct way".to_owned()),
        };
        let no_memory = ENTRY.replace(r#"(memory (export "memory") 1)"#, "(memory 1)");
        let good = || direct_module(&component(&[ENTRY]), "c");
        let broken = || direct_module(&component(&[&no_memory]), "c");
        let none = || Ok(None);
        let unscannable = || Err("c does not parse".to_owned());
        let way = |calls, module: &dyn Fn() -> Result<Option<wasmtime::Module>, String>| match Sandbox::choose(
            calls, "c", "HINT; ", module, wit,
        ) {
            Ok(Way::Direct(_)) => Ok("direct"),
            Ok(Way::Wit(_)) => Ok("wit"),
            Err(e) => Err(e),
        };
        assert_eq!(way(Calls::Auto, &good), Ok("direct"));
        assert_eq!(way(Calls::Direct, &good), Ok("direct"));
        for module in [&broken as &dyn Fn() -> _, &none, &unscannable] {
            assert_eq!(way(Calls::Auto, module), Ok("wit"));
        }
        // `wit` never looks for the entry point.
        assert_eq!(way(Calls::Wit, &|| panic!("scanned under `wit`")), Ok("wit"));
        // `direct` refuses, with the reason.
        let e = way(Calls::Direct, &broken).unwrap_err();
        assert!(e.contains("exports no `memory`"), "{e}");
        let e = way(Calls::Direct, &none).unwrap_err();
        assert!(
            e.contains("c has no direct entry point") && e.contains("; HINT; use --plugin-calls wit or auto"),
            "{e}"
        );
        assert_eq!(way(Calls::Direct, &unscannable).unwrap_err(), "c does not parse");
    }

    #[test]
    fn the_embedded_plugin_is_called_through_its_direct_entry_point() {
        let auto = Sandbox::embedded(Limits::default(), Calls::Auto).unwrap();
        assert_eq!(auto.calls(), Calls::Direct);
        assert_eq!(Sandbox::embedded(Limits::default(), Calls::Wit).unwrap().calls(), Calls::Wit);
    }
}

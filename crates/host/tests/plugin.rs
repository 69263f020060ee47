//! The wasm plugin engine: parity with the native core, and containment of hostile plugins.
//!
//! - `differential_*`: one seeded random command stream (every command kind, bad inputs
//!   included) through `NativeEngine` and `PluginEngine`, asserting identical replies after every
//!   command and identical snapshots (byte for byte) along the way and at the end. Set
//!   `KVPAGES_TEST_SEED` to replay a failure; the seed is printed.
//! - `hostile_*`: the server running `kvpages_plugin.chaos.wasm` (the real plugin plus
//!   misbehaviour on magic keys, `crates/wasm/plugin/src/chaos.rs`): an infinite loop, a memory
//!   bomb, a panic before and after the state changed. Each fails only its request (503
//!   `plugin-trapped` naming the cause), the state is exactly what it was, and the server keeps
//!   serving. Components of the wrong world (inline WAT) are refused at start-up. Budgets are
//!   wall-clock time, so the tests give ordinary calls 500 ms: a loaded CI machine must not turn
//!   a legitimate call into a trap.
//!
//! The components come from `target/plugin/` (`cargo xtask plugin`), or from
//! `KVPAGES_TEST_PLUGIN_DIR`, which `cargo xtask test` points at the other toolchain route's
//! build so that both routes' plugins pass these tests.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::Server;
use kvpages_core::{Command, Eviction, Key, Settings, SglangPool, Space};
use kvpages_host::config::{PluginConfig, ServeConfig};
use kvpages_host::engine::{Engine, EngineError, EngineKind, NativeEngine};
use kvpages_host::plugin::{Calls, Limits, PluginEngine, Sandbox};

fn plugin_dir() -> PathBuf {
    match std::env::var_os("KVPAGES_TEST_PLUGIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/plugin"),
    }
}

fn component(name: &str) -> PathBuf {
    let path = plugin_dir().join(name);
    assert!(path.exists(), "{} is missing: run `cargo xtask plugin`", path.display());
    path
}

/// `name` in a sandbox called through its direct entry point (which both of kvpages'
/// artifacts have: `Calls::Direct` refuses a component without it).
fn sandbox(name: &str, limits: Limits) -> Sandbox {
    sandbox_calls(name, limits, Calls::Direct)
}

fn sandbox_calls(name: &str, limits: Limits, calls: Calls) -> Sandbox {
    let bytes = std::fs::read(component(name)).unwrap();
    let sandbox = Sandbox::load(&bytes, name, limits, calls).unwrap();
    assert_eq!(sandbox.calls(), calls);
    sandbox
}

use kvpages_rng::Rng;

/// Generates commands over a small key and rank universe, so they collide: cache hits, two
/// writers, full pools, evictions, expiries, refused confirms, uninitialized ranks.
struct Gen {
    rng: Rng,
    keys: Vec<Key>,
    /// Recent (rank, key, page) answers of allocate, for confirms that match.
    recent: Vec<(Space, u32, Key, u32)>,
    now: u64,
}

impl Gen {
    fn new(seed: u64) -> Gen {
        let mut rng = Rng::new(seed);
        let keys = (0..400)
            .map(|i| {
                let text = match i % 4 {
                    0 | 1 => format!("{:016x}{:016x}", rng.next_u64(), i),
                    2 => format!("k{i}"),
                    _ => format!("K-{i}-{}", "x".repeat(i % 7)),
                };
                Key::parse(&text).unwrap()
            })
            .collect();
        Gen { rng, keys, recent: Vec::new(), now: 0 }
    }

    fn key(&mut self) -> Key {
        let i = self.rng.below(self.keys.len() as u64) as usize;
        self.keys[i].clone()
    }

    fn batch(&mut self, max: u64) -> Vec<Key> {
        let n = self.rng.below(max + 1);
        (0..n).map(|_| self.key()).collect()
    }

    fn rank(&mut self) -> u32 {
        // Ranks 0..3 get initialized; 3 mostly not, 9 never.
        [0, 0, 1, 1, 2, 3, 9][self.rng.below(7) as usize]
    }

    fn space(&mut self) -> Space {
        if self.rng.chance(80) {
            Space::Vllm
        } else {
            Space::Sglang {
                rank: self.rng.below(2) as u32,
                namespace: if self.rng.chance(70) { "kv" } else { "mamba" }.into(),
            }
        }
    }

    fn settings(&mut self) -> Settings {
        let high = 500 + self.rng.below(500) as u16;
        Settings {
            reservation_ttl: 1 + self.rng.below(8_000),
            world_size: match self.rng.below(5) {
                0 => Some(1 + self.rng.below(4) as u32),
                _ => None,
            },
            read_lease: self.rng.below(4_000),
            quarantine: self.rng.below(6_000),
            eviction: if self.rng.chance(70) { Eviction::Lru } else { Eviction::Off },
            evict_high_permille: high,
            evict_low_permille: high - self.rng.below(u64::from(high) / 2) as u16,
        }
    }

    fn command(&mut self) -> (u64, Command) {
        self.now += self.rng.below(400);
        let cmd = match self.rng.below(100) {
            0 => Command::Configure(self.settings()),
            1..=5 => Command::Initialize {
                space: self.space(),
                rank: self.rank(),
                num_pages: [0, 1, 4, 16, 64, 64, 200][self.rng.below(7) as usize],
            },
            6..=34 => Command::Allocate { space: self.space(), rank: self.rank(), keys: self.batch(24) },
            35..=59 => {
                // Mostly pairs an allocation answered on that rank (committed, or superseded
                // by a second writer), sometimes stale or made-up ones.
                let (space, rank) = match self.recent.last() {
                    Some((sp, rank, _, _)) if self.rng.chance(85) => (sp.clone(), *rank),
                    _ => (self.space(), self.rank()),
                };
                let mut confirmations = Vec::new();
                for _ in 0..self.rng.below(12) {
                    let mine: Vec<usize> = (0..self.recent.len())
                        .filter(|&i| self.recent[i].0 == space && self.recent[i].1 == rank)
                        .collect();
                    if !mine.is_empty() && self.rng.chance(85) {
                        let i = mine[self.rng.below(mine.len() as u64) as usize];
                        let (_, _, k, p) = self.recent[i].clone();
                        confirmations.push((k, p));
                    } else {
                        // A page that may be out of range, or reserved for another key.
                        let page = self.rng.below(260) as u32;
                        confirmations.push((self.key(), page));
                    }
                }
                let releases = (0..self.rng.below(4)).map(|_| self.rng.below(220) as u32).collect();
                Command::Confirm { space, rank, confirmations, releases }
            }
            60..=69 => Command::Exists { space: self.space(), keys: self.batch(30) },
            70..=81 => Command::Locations { space: self.space(), rank: self.rank(), keys: self.batch(30) },
            82..=85 => Command::Delete { space: self.space(), keys: self.batch(6) },
            86..=89 => Command::Inspect { space: self.space(), key: self.key() },
            90 => Command::Clear { space: self.space() },
            91 => Command::Reset { space: self.space() },
            92..=94 => Command::Stats,
            95 => Command::ExportSglang,
            96 => Command::LeaseAll,
            97 => {
                // An import that may be refused (pages out of range, a page both free and used).
                let num_pages = 1 + self.rng.below(32) as u32;
                let keys: Vec<(Key, u32)> =
                    (0..self.rng.below(5)).map(|_| (self.key(), self.rng.below(40) as u32)).collect();
                let free_pages = (0..self.rng.below(6)).map(|_| self.rng.below(40) as u32).collect();
                let pool =
                    SglangPool { rank: self.rng.below(3) as u32, namespace: "kv".into(), num_pages, free_pages, keys };
                Command::ImportSglang { pools: vec![pool], replace: self.rng.chance(50) }
            }
            _ => Command::Allocate { space: Space::Vllm, rank: 0, keys: self.batch(64) },
        };
        (self.now, cmd)
    }

    fn learn(&mut self, cmd: &Command, reply: &Result<kvpages_core::Reply, EngineError>) {
        if let (Command::Allocate { space, rank, keys }, Ok(kvpages_core::Reply::Allocated(a))) = (cmd, reply) {
            for al in a {
                if let Some(page) = al.page {
                    self.recent.push((space.clone(), *rank, keys[al.index as usize].clone(), page));
                }
            }
            if self.recent.len() > 256 {
                self.recent.drain(..128);
            }
        }
    }
}

/// Two tests of `$run`: through the plugin's direct entry point (`$direct`) and through WIT
/// (`$wit`).
macro_rules! through_both_ways {
    ($run:ident, $direct:ident, $wit:ident) => {
        #[test]
        fn $direct() {
            $run(Calls::Direct);
        }

        #[test]
        fn $wit() {
            $run(Calls::Wit);
        }
    };
}

fn seed() -> u64 {
    let seed = std::env::var("KVPAGES_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6b76_7067_0004);
    println!("seed {seed} (KVPAGES_TEST_SEED={seed} replays it)");
    seed
}

// The same stream through both ways into the plugin: its direct entry point, and its WIT
// interface (what `--plugin-calls wit` and any other component-model host use).
through_both_ways!(
    differential,
    differential_native_and_plugin_agree_on_120k_commands,
    differential_native_and_plugin_through_wit_agree_on_120k_commands
);

fn differential(calls: Calls) {
    let seed = seed();
    let settings = Settings { reservation_ttl: 3_000, read_lease: 1_000, quarantine: 2_000, ..Settings::default() };
    let mut native = NativeEngine::new(seed, settings);
    let sandbox = sandbox_calls("kvpages_plugin.wasm", Limits::default(), calls);
    let mut plugin = PluginEngine::new(sandbox, seed, settings).unwrap();
    assert_eq!(plugin.kind(), EngineKind::Wasm);
    let mut g = Gen::new(seed);
    let mut kinds = std::collections::BTreeMap::<String, (u64, u64)>::new();
    for i in 0..120_000u32 {
        let (now, cmd) = g.command();
        let a = native.apply(now, &cmd);
        let b = plugin.apply(now, &cmd);
        assert_eq!(a, b, "seed {seed}, command {i} at {now}: {cmd:?}");
        let kind = format!("{cmd:?}").split([' ', '(', '{']).next().unwrap().to_owned();
        let e = kinds.entry(kind).or_default();
        if a.is_ok() {
            e.0 += 1
        } else {
            e.1 += 1
        }
        g.learn(&cmd, &a);
        if i % 20_000 == 0 {
            assert_eq!(native.snapshot().unwrap(), plugin.snapshot().unwrap(), "seed {seed}: state after command {i}");
        }
    }
    let end = native.snapshot().unwrap();
    assert_eq!(end, plugin.snapshot().unwrap(), "seed {seed}: final state");
    assert_eq!(plugin.traps(), 0);
    println!("commands (ok, refused): {kinds:?}; final snapshot {} bytes", end.len());
    // Every kind ran, and most kinds were both accepted and refused somewhere in the stream.
    assert_eq!(kinds.len(), 14, "{kinds:?}");
    for k in ["Allocate", "Confirm", "Initialize", "Locations", "ImportSglang", "Reset", "Configure"] {
        assert!(kinds[k].0 > 0 && kinds[k].1 > 0, "{k} was not both applied and refused: {kinds:?}");
    }
    let restored = kvpages_core::Core::restore(&end).expect("the plugin's snapshot restores natively");
    restored.check_invariants().unwrap();
}

#[test]
fn a_restored_plugin_continues_like_the_native_core() {
    restored_continues(Calls::Direct);
    restored_continues(Calls::Wit);
}

fn restored_continues(calls: Calls) {
    let seed = seed() ^ 1;
    let mut g = Gen::new(seed);
    let mut native = NativeEngine::new(seed, Settings::default());
    for _ in 0..5_000 {
        let (now, cmd) = g.command();
        let r = native.apply(now, &cmd);
        g.learn(&cmd, &r);
    }
    let snap = native.snapshot().unwrap();
    let sandbox = sandbox_calls("kvpages_plugin.wasm", Limits::default(), calls);
    let mut plugin = PluginEngine::restore(sandbox, &snap).unwrap();
    for i in 0..5_000 {
        let (now, cmd) = g.command();
        let a = native.apply(now, &cmd);
        assert_eq!(a, plugin.apply(now, &cmd), "seed {seed}, command {i}: {cmd:?}");
        g.learn(&cmd, &a);
    }
    assert_eq!(native.snapshot().unwrap(), plugin.snapshot().unwrap());
}

// A trap in the middle of a long stream: the plugin's state afterwards is the native core's
// (which never saw the trapping command), so recovery restored exactly the earlier state —
// across snapshots taken along the way and the journal since the last one.
through_both_ways!(
    traps_mid_stream,
    traps_mid_stream_leave_the_state_exactly_as_before,
    traps_mid_stream_through_wit_leave_the_state_exactly_as_before
);

fn traps_mid_stream(calls: Calls) {
    let seed = seed() ^ 2;
    let mut g = Gen::new(seed);
    let settings = Settings::default();
    let mut native = NativeEngine::new(seed, settings);
    let limits = Limits { memory: 64 << 20, call: Duration::from_millis(500), ..Limits::default() };
    let mut plugin =
        PluginEngine::new(sandbox_calls("kvpages_plugin.chaos.wasm", limits, calls), seed, settings).unwrap();
    let mut traps = 0;
    for i in 0..40_000u32 {
        if i % 7_919 == 7_000 {
            let magic = ["chaos:panic", "chaos:after", "chaos:bomb", "chaos:loop"][traps % 4];
            // A pool to allocate from, so the core gets as far as the misbehaviour.
            let init = Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 64 };
            assert_eq!(native.apply(g.now, &init), plugin.apply(g.now, &init));
            let cmd = Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![Key::parse(magic).unwrap()] };
            match plugin.apply(g.now, &cmd) {
                Err(EngineError::Trapped { restored: true, .. }) => traps += 1,
                other => panic!("{magic}: {other:?}"),
            }
            continue;
        }
        let (now, cmd) = g.command();
        let a = native.apply(now, &cmd);
        assert_eq!(a, plugin.apply(now, &cmd), "seed {seed}, command {i}: {cmd:?}");
        g.learn(&cmd, &a);
    }
    assert_eq!(traps, 5);
    assert_eq!(plugin.traps(), 5);
    assert_eq!(native.snapshot().unwrap(), plugin.snapshot().unwrap(), "seed {seed}");
}

fn chaos_server() -> Server {
    chaos_server_calls(Calls::Auto)
}

fn chaos_server_calls(calls: Calls) -> Server {
    let limits = Limits { memory: 64 << 20, call: Duration::from_millis(500), ..Limits::default() };
    let plugin = PluginConfig::from_file(&component("kvpages_plugin.chaos.wasm"), limits, calls).unwrap();
    Server::start(ServeConfig { engine: EngineKind::Wasm, plugin, ..common::config() })
}

const KEYS: [&str; 4] = ["386b2d9cf5aa91ba3a4b42c35396c822", "k1", "k2", "k3"];

fn hostile(magic: &str, cause: &str) {
    hostile_calls(magic, cause, Calls::Auto);
}

fn hostile_calls(magic: &str, cause: &str, calls: Calls) {
    let s = chaos_server_calls(calls);
    s.init(0, 64);
    s.init(1, 64);
    let a = s.allocate(0, &KEYS[..3]);
    let pairs: Vec<(&str, u32)> = a.iter().map(|(k, p)| (k.as_str(), *p as u32)).collect();
    s.confirm_ok(0, &pairs, &[]);
    s.allocate(1, &KEYS[..2]);
    let before = s.fingerprint(&[0, 1], &KEYS);

    let body = serde_json::json!({ "rank": 0, "keys": [["k3", ""], [magic, ""]] }).to_string();
    let r = s.post("/keys/batch_allocate", body);
    assert_eq!(r.status, 503, "{r:?}");
    let detail = r.detail();
    assert!(detail.starts_with("Engine plugin trapped; the request was not applied ("), "{detail}");
    assert!(detail.contains(cause), "{detail} lacks {cause:?}");
    assert!(detail.contains("rebuilt with the state from before this request"), "{detail}");

    assert_eq!(s.fingerprint(&[0, 1], &KEYS), before, "{magic} changed the state");
    // Still serving, with the rules intact: the next allocation gets the next page.
    assert_eq!(s.allocate(0, &["k3"]), vec![("k3".to_owned(), 3)]);
    let stats = s.get("/stats").json();
    assert_eq!(stats["engine"], "wasm");
    assert_eq!(stats["engine_traps"], 1, "{stats}");
}

#[test]
fn hostile_infinite_loop_is_stopped_by_the_deadline() {
    hostile("chaos:loop", "the plugin ran past its time budget");
}

#[test]
fn hostile_memory_bomb_is_stopped_by_the_cap() {
    hostile("chaos:bomb", "over the cap of 64 MiB (--plugin-memory-mib)");
}

#[test]
fn hostile_panic_is_contained() {
    hostile("chaos:panic", "the plugin aborted (a panic in the guest)");
}

#[test]
fn hostile_panic_after_the_state_changed_is_rolled_back() {
    hostile("chaos:after", "the plugin aborted (a panic in the guest)");
}

#[test]
fn hostile_plugins_through_wit_are_contained_alike() {
    hostile_calls("chaos:after", "the plugin aborted (a panic in the guest)", Calls::Wit);
    hostile_calls("chaos:loop", "the plugin ran past its time budget", Calls::Wit);
}

#[test]
fn many_traps_in_a_row_leave_a_serving_server() {
    let s = chaos_server();
    s.init(0, 8);
    for i in 0..20 {
        let magic = ["chaos:panic", "chaos:after", "chaos:loop", "chaos:bomb"][i % 4];
        let body = serde_json::json!({ "rank": 0, "keys": [[magic, ""]] }).to_string();
        assert_eq!(s.post("/keys/batch_allocate", body).status, 503);
        assert_eq!(s.allocate(0, &[&format!("k{i}")]).len(), 1);
    }
    assert_eq!(s.get("/stats").json()["engine_traps"], 20);
}

fn refused(wat: &str) -> String {
    let dir = std::env::temp_dir().join(format!("kvpages-plugin-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{:x}.wat", wat.len() ^ wat.as_bytes()[wat.len() / 2] as usize));
    std::fs::write(&path, wat).unwrap();
    let err = PluginConfig::from_file(&path, Limits::default(), Calls::Auto).map(|_| ()).unwrap_err();
    let _ = std::fs::remove_file(&path);
    err
}

#[test]
fn a_component_of_another_world_is_refused_at_start_up() {
    // Exports a function, but not the engine interface.
    let e = refused(
        r#"(component
            (core module $m (func (export "f") (result i32) i32.const 7))
            (core instance $i (instantiate $m))
            (func (export "answer") (result u32) (canon lift (core func $i "f"))))"#,
    );
    assert!(e.contains("does not implement the WIT world kvpages:engine/plugin@0.2.0"), "{e}");
    assert!(e.contains("\"answer\""), "{e}");
}

#[test]
fn a_component_exporting_an_engine_of_the_wrong_shape_is_refused() {
    // The right interface name, but `create` takes the wrong arguments.
    let e = refused(
        r#"(component
            (core module $m (func (export "create")))
            (core instance $i (instantiate $m))
            (func $create (canon lift (core func $i "create")))
            (instance $engine (export "create" (func $create)))
            (export "kvpages:engine/engine@0.2.0" (instance $engine)))"#,
    );
    assert!(e.contains("does not implement the WIT world"), "{e}");
}

#[test]
fn a_component_with_imports_is_refused_at_start_up() {
    let e = refused(r#"(component (import "wasi:clocks/wall-clock@0.2.0" (instance)))"#);
    assert!(e.contains("imports [\"wasi:clocks/wall-clock@0.2.0\"]"), "{e}");
    assert!(e.contains("kvpages grants a plugin no imports"), "{e}");
}

#[test]
fn a_file_that_is_no_component_is_refused() {
    let e = refused("(module)");
    assert!(e.contains("is not a valid component"), "{e}");
}

#[test]
fn the_default_memory_cap_is_wasm32s_maximum_and_a_tiny_cap_fails_at_start_up() {
    assert_eq!(Limits::default().memory, 4 << 30);
    let tiny = Limits { memory: 1 << 20, ..Limits::default() };
    let e = PluginEngine::new(sandbox("kvpages_plugin.wasm", tiny), 1, Settings::default()).unwrap_err();
    assert!(e.contains("memory"), "{e}");
}

/// What the plugin's memory holds per stored key (for the sizing of
/// `--plugin-memory-mib` in docs/plugin.md): 200k 32-hex keys on 2 ranks, committed, then a snapshot.
#[test]
fn plugin_memory_per_key_is_bounded() {
    let mut p = PluginEngine::new(sandbox("kvpages_plugin.wasm", Limits::default()), 1, Settings::default()).unwrap();
    let base = p.memory();
    let n = 200_000u32;
    for rank in 0..2 {
        p.apply(0, &Command::Initialize { space: Space::Vllm, rank, num_pages: n }).unwrap();
    }
    for chunk in 0..n / 1000 {
        let keys: Vec<Key> =
            (0..1000).map(|i| Key::parse(&format!("{:032x}", u64::from(chunk * 1000 + i) * 7919)).unwrap()).collect();
        for rank in 0..2 {
            let Ok(kvpages_core::Reply::Allocated(a)) =
                p.apply(1, &Command::Allocate { space: Space::Vllm, rank, keys: keys.clone() })
            else {
                panic!("allocate")
            };
            let confirmations = keys.iter().cloned().zip(a.iter().map(|a| a.page.unwrap())).collect();
            p.apply(2, &Command::Confirm { space: Space::Vllm, rank, confirmations, releases: vec![] }).unwrap();
        }
    }
    let used = p.memory() - base;
    let snapshot = p.snapshot().unwrap().len();
    let after_snapshot = p.memory() - base;
    println!(
        "plugin memory: {} B/key on 2 ranks ({} MiB for {n} keys), {} B/key after a snapshot of {} B/key",
        used / u64::from(n),
        used >> 20,
        after_snapshot / u64::from(n),
        snapshot / n as usize
    );
    // ~300 B/key of state; a snapshot taken during the fill raises the high-water mark to ~700.
    assert!(used / u64::from(n) < 1024, "{used} bytes for {n} keys");
}

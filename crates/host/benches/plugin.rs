//! The plugin's cost per command against the native core, and why key batches are packed.
//!
//! - `command/{exists,cycle}/{native,wasm,wasm-wit}/{32,128}`: one `exists` of N stored keys (a
//!   pure read) and one allocate + confirm + delete cycle of N fresh keys (three mutating
//!   commands, journaled by the plugin engine, snapshots included), through `NativeEngine` and
//!   `PluginEngine` (its direct entry point, and its WIT interface).
//! - `marshal/{strings,packed}/{32,128}`: the canonical-ABI cost alone of handing N 32-byte keys
//!   to a component as `list<string>` versus one packed `list<u8>` (two inline-WAT components whose
//!   function only returns the length), which is why `wit/kvpages.wit` packs key batches.
//!
//! - `plugin_{allocate_confirm,exists,locations}_32/PAGES`: the core's pool-size benchmarks
//!   (`crates/core/benches/common/pool.rs`, included by path: the same command streams as the
//!   core's `allocate_confirm_32`, `exists_32`, `locations_32`) through `PluginEngine`, per key
//!   at 10^3..10^8 pages; `cargo xtask bench` puts them beside the core's in one table.
//!
//! Run: `cargo xtask plugin && cargo bench -p kvpages-host --bench plugin`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvpages_core::{Command, Key, Settings, Space};
use kvpages_host::engine::{Engine, NativeEngine};
use kvpages_host::plugin::{Calls, Limits, PluginEngine, Sandbox};

#[path = "../../core/benches/common/mod.rs"]
mod common;
#[path = "../../core/benches/common/pool.rs"]
mod pool;

fn keys(n: usize, salt: u64) -> Vec<Key> {
    (0..n as u64).map(|i| Key::parse(&format!("{:016x}{:016x}", salt, i)).unwrap()).collect()
}

/// The native core, the plugin through its direct entry point (`wasm`, the server's default)
/// and through its WIT interface (`wasm-wit`).
fn engines() -> Vec<(&'static str, Box<dyn Engine>)> {
    let plugin = |calls| {
        let sandbox = Sandbox::embedded(Limits::default(), calls).unwrap();
        Box::new(PluginEngine::new(sandbox, 1, Settings::default()).unwrap())
    };
    vec![
        ("native", Box::new(NativeEngine::new(1, Settings::default()))),
        ("wasm", plugin(Calls::Direct)),
        ("wasm-wit", plugin(Calls::Wit)),
    ]
}

fn command(c: &mut Criterion) {
    let mut g = c.benchmark_group("command");
    for n in [32usize, 128] {
        for (name, mut e) in engines() {
            e.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 1 << 20 }).unwrap();
            let stored = keys(n, 0xfeed);
            let Ok(kvpages_core::Reply::Allocated(a)) =
                e.apply(1, &Command::Allocate { space: Space::Vllm, rank: 0, keys: stored.clone() })
            else {
                panic!("allocate")
            };
            let confirmations = stored.iter().cloned().zip(a.iter().map(|a| a.page.unwrap())).collect();
            e.apply(2, &Command::Confirm { space: Space::Vllm, rank: 0, confirmations, releases: vec![] }).unwrap();
            let exists = Command::Exists { space: Space::Vllm, keys: stored };
            g.bench_with_input(BenchmarkId::new(format!("exists/{name}"), n), &n, |b, _| {
                b.iter(|| black_box(e.apply(3, &exists).unwrap()))
            });
            let fresh = keys(n, 0xbeef);
            let mut now = 4;
            g.bench_with_input(BenchmarkId::new(format!("cycle/{name}"), n), &n, |b, _| {
                b.iter(|| {
                    now += 1;
                    let alloc = Command::Allocate { space: Space::Vllm, rank: 0, keys: fresh.clone() };
                    let Ok(kvpages_core::Reply::Allocated(a)) = e.apply(now, &alloc) else { panic!("allocate") };
                    let confirmations = fresh.iter().cloned().zip(a.iter().map(|a| a.page.unwrap())).collect();
                    e.apply(now, &Command::Confirm { space: Space::Vllm, rank: 0, confirmations, releases: vec![] })
                        .unwrap();
                    black_box(e.apply(now, &Command::Delete { space: Space::Vllm, keys: fresh.clone() }).unwrap())
                })
            });
        }
    }
    g.finish();
}

/// A component with `strings: func(keys: list<string>) -> u32` and `packed: func(keys: list<u8>)
/// -> u32`; both only return the length. The bump allocator resets on every call.
const PROBE: &str = r#"(component
  (core module $m
    (memory (export "mem") 16)
    (global $bump (mut i32) (i32.const 1024))
    (func (export "realloc") (param i32 i32 i32 i32) (result i32)
      (local $p i32)
      (local.set $p (i32.and (i32.add (global.get $bump) (i32.sub (local.get 2) (i32.const 1)))
                             (i32.xor (i32.sub (local.get 2) (i32.const 1)) (i32.const -1))))
      (global.set $bump (i32.add (local.get $p) (local.get 3)))
      (local.get $p))
    (func (export "count") (param i32 i32) (result i32)
      (global.set $bump (i32.const 1024))
      (local.get 1)))
  (core instance $i (instantiate $m))
  (alias core export $i "mem" (core memory $mem))
  (alias core export $i "realloc" (core func $realloc))
  (alias core export $i "count" (core func $count))
  (func (export "strings") (param "keys" (list string)) (result u32)
    (canon lift (core func $count) (memory $mem) (realloc $realloc)))
  (func (export "packed") (param "keys" (list u8)) (result u32)
    (canon lift (core func $count) (memory $mem) (realloc $realloc))))"#;

fn marshal(c: &mut Criterion) {
    use wasmtime::component::{Component, Linker};
    let engine = wasmtime::Engine::default();
    let component = Component::new(&engine, PROBE).unwrap();
    let mut store = wasmtime::Store::new(&engine, ());
    let instance = Linker::new(&engine).instantiate(&mut store, &component).unwrap();
    let strings = instance.get_typed_func::<(&[&str],), (u32,)>(&mut store, "strings").unwrap();
    let packed = instance.get_typed_func::<(&[u8],), (u32,)>(&mut store, "packed").unwrap();
    let mut g = c.benchmark_group("marshal");
    for n in [32usize, 128] {
        let texts: Vec<String> = keys(n, 0xabc).iter().map(ToString::to_string).collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        g.bench_with_input(BenchmarkId::new("strings", n), &n, |b, _| {
            b.iter(|| strings.call(&mut store, (black_box(&refs[..]),)).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("packed", n), &n, |b, _| {
            b.iter(|| {
                // Packing is part of the cost: the host does it per call.
                let mut buf = Vec::with_capacity(n * 34);
                for t in &refs {
                    buf.extend_from_slice(&(t.len() as u16).to_le_bytes());
                    buf.extend_from_slice(t.as_bytes());
                }
                packed.call(&mut store, (black_box(&buf[..]),)).unwrap()
            })
        });
    }
    g.finish();
}

/// A fresh plugin engine behind `pool`'s interface (seed 7, as the core's bench).
fn plugin() -> pool::Apply {
    let mut e =
        PluginEngine::new(Sandbox::embedded(Limits::default(), Calls::Auto).unwrap(), 7, Settings::default()).unwrap();
    Box::new(move |now, cmd: &Command| e.apply(now, cmd).expect("the bench's commands are valid"))
}

fn pool_sizes(c: &mut Criterion) {
    pool::allocate_confirm(c, "plugin_", plugin);
    pool::exists(c, "plugin_", plugin);
    pool::locations(c, "plugin_", plugin);
}

criterion_group!(benches, command, marshal);
criterion_group! { name = pools; config = pool::config(); targets = pool_sizes }
criterion_main!(benches, pools);

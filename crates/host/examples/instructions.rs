//! Drives one engine (native, or the plugin through the sandbox) with the load generator's
//! commands, without HTTP, for counting instructions: on a shared, noisy machine, timings move
//! by ±15 % between identical runs, instruction counts by well under 1 %.
//!
//! ```text
//! cargo build --release -p kvpages-host --example instructions
//! X=target/release/examples/instructions
//! count() { valgrind --tool=cachegrind --cache-sim=no --smc-check=all-non-file \
//!     --cachegrind-out-file=/dev/null "$@" 2>&1 | grep 'I *refs' | tr -d , | awk '{print $NF}'; }
//! echo $(( ($(count $X wasm allocate 2000) - $(count $X wasm allocate 0)) / 2000 ))
//! ```
//!
//! The difference of two runs that differ only in the iteration count is the cost of the
//! iterations alone (start-up, compiling the plugin and the fixture cancel out) — up to
//! ±350 instructions an iteration at 2,000: Cranelift compiles on several threads and its hash
//! maps are randomly seeded, so start-up itself varies. To count only the engine's work, which
//! repeats within ~150 (the plugin's recovery snapshots are scheduled by time), let callgrind
//! collect inside `apply` alone:
//!
//! ```text
//! tc() { valgrind --tool=callgrind --toggle-collect="*$1 as kvpages_host::engine::Engine>::apply" \
//!     --smc-check=all-non-file --callgrind-out-file=/tmp/tc.out $X "${@:2}" >/dev/null 2>&1
//!     grep ^summary /tmp/tc.out | awk '{print $2}'; }
//! echo $(( ($(tc PluginEngine wasm allocate 2000) - $(tc PluginEngine wasm allocate 0)) / 2000 ))
//! echo $(( ($(tc NativeEngine native allocate 2000) - $(tc NativeEngine native allocate 0)) / 2000 ))
//! ```
//! With `--cache-sim=yes` added, the `summary` line also counts first-level instruction-cache
//! misses (its fourth number, `I1mr`; the `events:` line names them), which instruction counts
//! do not show.
//! `--smc-check` lets valgrind follow the code Cranelift writes at run time; `cg_diff` of two
//! `--cachegrind-out-file`s splits the difference by function (the plugin's compiled code shows
//! as `???`). `KVPAGES_PLUGIN=PATH` runs another component instead of the embedded one.
//! Through the plugin, a state-changing workload's count includes the recovery snapshots the
//! engine takes, which are scheduled by elapsed time, so it can move by a few percent between
//! runs (switching them off changes the 2,000-save count by under 1 %);
//! `exists` is never journaled. `allocate` never deletes: the key table grows from 16,384 to
//! 16,384 + 32 × ITERATIONS keys, its growth included.
//!
//! Timing, not counting: for the lookups (`exists`, `locations`) the harness also prints the
//! mean wall time of the engine's `apply` (`apply: N ns a call`). Two environment variables
//! bring the call closer to a server's: `STORED=N` stores N keys instead of 16,384, and
//! `THRASH=MiB` writes a buffer of that size between calls, so each call starts with the key
//! table out of the caches, as a server's calls can (its network stack runs in between). For
//! example `THRASH=4 $X native locations 30000`.
//!
//! Usage: `instructions native|wasm|wasm-wit allocate|exists|locations|full|snapshot ITERATIONS [BATCH=32]`
//! - `allocate`: `allocate` of BATCH fresh keys, then `confirm` of their pages (a save);
//! - `exists` / `locations`: BATCH keys drawn from the 16,384 (or `STORED`) stored ones (a
//!   lookup, a load);
//! - `full`: `allocate` of BATCH fresh keys on a full 1,024-page rank with eviction off, every
//!   page -1 (the bench's `pool-full`);
//! - `snapshot`: a snapshot of the whole state (the STORED keys; BATCH is unused), timed
//!   (`snapshot: N ms a call`): what a recovery snapshot of the plugin, or a durable one,
//!   holds the engine for. For example `STORED=1000000 $X wasm snapshot 5`.

use kvpages_core::{Command, Eviction, Key, Reply, Settings, Space};
use kvpages_host::engine::{Engine, NativeEngine};
use kvpages_host::plugin::{Calls, Limits, PluginEngine, Sandbox};

/// `n` distinct 32-hex keys of the family `salt`, numbered from `from`.
fn keys(n: usize, salt: u64, from: u64) -> Vec<Key> {
    (from..from + n as u64).map(|i| Key::parse(&format!("{salt:016x}{i:016x}")).expect("32 hex digits")).collect()
}

fn engine(name: &str, settings: Settings) -> Result<Box<dyn Engine>, String> {
    Ok(match name {
        "native" => Box::new(NativeEngine::new(1, settings)),
        "wasm" | "wasm-wit" => {
            let calls = if name == "wasm" { Calls::Auto } else { Calls::Wit };
            let sandbox = match std::env::var("KVPAGES_PLUGIN") {
                Ok(path) => {
                    let bytes = std::fs::read(&path).map_err(|e| format!("{path}: {e}"))?;
                    Sandbox::load(&bytes, &path, Limits::default(), calls)?
                }
                Err(_) => Sandbox::embedded(Limits::default(), calls)?,
            };
            Box::new(PluginEngine::new(sandbox, 1, settings)?)
        }
        other => return Err(format!("engine {other:?}: expected native, wasm or wasm-wit")),
    })
}

/// Allocates and confirms `keys` on `rank`.
fn save(e: &mut dyn Engine, now: u64, rank: u32, keys: Vec<Key>) -> Result<(), String> {
    let reply = e.apply(now, &Command::Allocate { space: Space::Vllm, rank, keys: keys.clone() });
    let Ok(Reply::Allocated(allocations)) = reply else { return Err(format!("allocate answered {reply:?}")) };
    let pages = allocations.iter().map(|a| a.page.ok_or("the pool ran out of pages"));
    let confirmations = keys.into_iter().zip(pages).map(|(k, p)| p.map(|p| (k, p))).collect::<Result<_, _>>()?;
    let reply = e.apply(now, &Command::Confirm { space: Space::Vllm, rank, confirmations, releases: vec![] });
    reply.map(|_| ()).map_err(|err| format!("confirm answered {err:?}"))
}

fn run(args: &[String]) -> Result<(), String> {
    let [engine_name, workload, iterations, rest @ ..] = args else {
        return Err(
            "usage: instructions native|wasm allocate|exists|locations|full|snapshot ITERATIONS [BATCH=32]".into()
        );
    };
    let iterations: u64 = iterations.parse().map_err(|e| format!("ITERATIONS: {e}"))?;
    let batch: usize = rest.first().map_or(Ok(32), |b| b.parse()).map_err(|e| format!("BATCH: {e}"))?;
    // `full` needs eviction off, as the bench's pool-full server has it; the rest the default.
    let settings = if workload == "full" {
        Settings { eviction: Eviction::Off, ..Settings::default() }
    } else {
        Settings::default()
    };
    let mut e = engine(engine_name, settings)?;
    e.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 1_000_000 })
        .map_err(|err| format!("initialize: {err:?}"))?;
    let stored = match env_number("STORED", 16_384)? {
        0 => return Err("STORED=0: a lookup needs stored keys".into()),
        n => keys(n, 0xfeed, 0),
    };
    let mut thrash = vec![0u8; env_number("THRASH", 0)? << 20];
    let mut apply_time = std::time::Duration::ZERO;
    let mut snapshot_bytes = 0;
    for chunk in stored.chunks(128) {
        save(e.as_mut(), 1, 0, chunk.to_vec())?;
    }
    if workload == "full" {
        e.apply(1, &Command::Initialize { space: Space::Vllm, rank: 1, num_pages: 1_024 })
            .map_err(|err| format!("initialize: {err:?}"))?;
        for chunk in keys(1_024, 0xf011, 0).chunks(128) {
            save(e.as_mut(), 1, 1, chunk.to_vec())?;
        }
    }
    // A fixed LCG picks the keys a lookup asks for: the same sequence in every run.
    let mut x = 12_345u64;
    for i in 0..iterations {
        // The clock advances 1 ms every 16 iterations. A short run (2,000 iterations: 127 ms)
        // ends before any lease (5 s) or reservation (60 s) would expire.
        let now = 2 + i / 16;
        for byte in thrash.iter_mut().step_by(64) {
            *byte = byte.wrapping_add(1);
        }
        std::hint::black_box(&thrash);
        match workload.as_str() {
            "allocate" => save(e.as_mut(), now, 0, keys(batch, 0xbeef, i * batch as u64))?,
            "full" => {
                let cmd =
                    Command::Allocate { space: Space::Vllm, rank: 1, keys: keys(batch, 0xbeef, i * batch as u64) };
                match e.apply(now, &cmd) {
                    Ok(Reply::Allocated(a)) if a.iter().all(|a| a.page.is_none()) => {}
                    other => return Err(format!("full: expected every page -1, got {other:?}")),
                }
            }
            "exists" | "locations" => {
                let picked = (0..batch)
                    .map(|_| {
                        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                        stored[(x >> 33) as usize % stored.len()].clone()
                    })
                    .collect();
                let cmd = if workload == "exists" {
                    Command::Exists { space: Space::Vllm, keys: picked }
                } else {
                    Command::Locations { space: Space::Vllm, rank: 0, keys: picked }
                };
                let start = std::time::Instant::now();
                std::hint::black_box(e.apply(now, &cmd).map_err(|err| format!("{workload}: {err:?}"))?);
                apply_time += start.elapsed();
            }
            "snapshot" => {
                let start = std::time::Instant::now();
                let bytes = e.snapshot().map_err(|err| format!("snapshot: {err:?}"))?;
                apply_time += start.elapsed();
                snapshot_bytes = bytes.len();
            }
            other => {
                return Err(format!("workload {other:?}: expected allocate, exists, locations, full or snapshot"));
            }
        }
    }
    if matches!(workload.as_str(), "exists" | "locations") && iterations > 0 {
        eprintln!("apply: {} ns a call", apply_time.as_nanos() / u128::from(iterations));
    }
    if workload == "snapshot" && iterations > 0 {
        let ms = apply_time.as_secs_f64() * 1e3 / iterations as f64;
        eprintln!("snapshot: {ms:.1} ms a call, {snapshot_bytes} bytes of {} stored keys", stored.len());
    }
    Ok(())
}

/// The environment variable `name` as a number, `default` when it is not set.
fn env_number(name: &str, default: usize) -> Result<usize, String> {
    match std::env::var(name) {
        Ok(v) => v.parse().map_err(|e| format!("{name}={v}: {e}")),
        Err(_) => Ok(default),
    }
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("instructions: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

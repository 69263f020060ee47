//! `kvpages bench --memory`: what stored keys cost in resident memory, per engine, and what a
//! huge rank costs to create. Each engine is measured on its engine object in a process of its
//! own (no HTTP buffers in the figure, nothing else has touched the heap), from the kernel's
//! VmRSS; with more than one engine this process runs itself once per engine and merges the
//! reports.

use std::path::Path;
use std::process::Command as Process;
use std::time::{Duration, Instant};

use kvpages_core::{Command, Key, Reply, Settings, Space};
use kvpages_host::config::ServeConfig;
use kvpages_host::engine::{Engine, EngineKind, NativeEngine};
use kvpages_host::plugin::PluginEngine;
use serde::{Deserialize, Serialize};

use super::workload::KeyGen;
use super::{Machine, Options, write_json};

/// Pages of the rank whose initialization is timed.
const HUGE_RANK: u32 = 100_000_000;

/// Keys of one allocate and one confirm (the largest batch vLLM's connector sends).
const BATCH: u32 = 4096;

#[derive(Serialize, Deserialize)]
struct MemoryReport {
    kind: String,
    machine: Machine,
    command: Vec<String>,
    /// Keys stored, each on every one of `ranks` ranks.
    keys: u32,
    ranks: u32,
    key_form: String,
    /// Pages of each rank.
    pool_pages: u32,
    engines: Vec<EngineMemory>,
    huge_rank_pages: u32,
    huge_rank_init_us: f64,
    huge_rank_rss_kib: i64,
    /// The first allocate+confirm of 32 keys on the huge rank.
    huge_rank_first_allocate_confirm_us: f64,
}

/// One engine's figures.
#[derive(Serialize, Deserialize)]
struct EngineMemory {
    engine: String,
    /// VmRSS with the ranks initialized and no key stored, then with every key stored.
    rss_before_kib: u64,
    rss_after_kib: u64,
    rss_per_key_bytes: f64,
    store_seconds: f64,
    /// The plugin's linear memory with every key stored (what its 4 GiB cap bounds).
    linear_memory_bytes: Option<u64>,
    /// The state's snapshot, and the peak VmRSS while it was taken (from VmHWM, reset first);
    /// `snapshot_error` instead when the engine could not take it.
    snapshot_bytes: Option<u64>,
    snapshot_peak_rss_kib: u64,
    snapshot_seconds: f64,
    snapshot_error: Option<String>,
    /// Traps the plugin contained while the keys were stored and snapshotted (each rebuilt it).
    traps: u64,
}

/// A VmRSS-style line of this process's status, in KiB.
fn status_kib(field: &str) -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| format!("/proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| format!("no {field} line in /proc/self/status"))
}

fn rss_kib() -> Result<u64, String> {
    status_kib("VmRSS:")
}

/// Resets VmHWM (the peak RSS) to the current RSS.
fn reset_peak() -> Result<(), String> {
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("/proc/self/clear_refs: {e}"))
}

fn allocate_confirm(engine: &mut dyn Engine, now: u64, rank: u32, keys: &[Key]) -> Result<(), String> {
    let space = Space::Vllm;
    let reply = engine.apply(now, &Command::Allocate { space: space.clone(), rank, keys: keys.to_vec() });
    let Ok(Reply::Allocated(got)) = reply else { return Err(format!("allocate: {reply:?}")) };
    let mut confirmations = Vec::with_capacity(got.len());
    for a in got {
        let page = a.page.ok_or("allocate: the pool is full")?;
        confirmations.push((keys[a.index as usize].clone(), page));
    }
    engine
        .apply(now, &Command::Confirm { space, rank, confirmations, releases: vec![] })
        .map(|_| ())
        .map_err(|e| format!("confirm: {e:?}"))
}

/// Stores `n` keys on each of `ranks` ranks of `engine` and measures it; `linear` reads the
/// plugin's linear memory.
fn measure<E: Engine>(
    mut engine: E,
    n: u32,
    ranks: u32,
    pages: u32,
    linear: impl Fn(&E) -> Option<u64>,
) -> Result<EngineMemory, String> {
    let kind = engine.kind();
    for rank in 0..ranks {
        engine
            .apply(0, &Command::Initialize { space: Space::Vllm, rank, num_pages: pages })
            .map_err(|e| format!("initialize: {e:?}"))?;
    }
    let keygen = KeyGen::new(7);
    let mut text = Vec::with_capacity(BATCH as usize);
    let before = rss_kib()?;
    let start = Instant::now();
    let mut stored = 0;
    let mut shown = Instant::now();
    while stored < n {
        let batch = (n - stored).min(BATCH) as usize;
        text.clear();
        keygen.fresh(batch, &mut text);
        let keys =
            text.iter().map(|k| Key::parse(k).map_err(|e| format!("{k}: {e:?}"))).collect::<Result<Vec<_>, _>>()?;
        for rank in 0..ranks {
            allocate_confirm(&mut engine, 1, rank, &keys)?;
        }
        stored += batch as u32;
        if shown.elapsed() >= Duration::from_secs(10) {
            shown = Instant::now();
            eprintln!("  … {kind}: {stored} of {n} keys stored on {ranks} ranks, RSS {} MiB", rss_kib()? / 1024);
        }
    }
    // A command past the reservation TTL drains the reservation queue, as a live server does.
    let later = Duration::from_secs(24 * 3600).as_millis() as u64;
    engine
        .apply(later, &Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![], releases: vec![] })
        .map_err(|e| format!("confirm: {e:?}"))?;
    let store_seconds = start.elapsed().as_secs_f64();
    let after = rss_kib()?;
    let Ok(Reply::Stats(stats)) = engine.apply(later, &Command::Stats) else { return Err("stats: no answer".into()) };
    let keys_now = stats.spaces.first().map_or(0, |s| s.keys);
    if keys_now != u64::from(n) {
        return Err(format!("{kind}: stored {keys_now} keys, expected {n}"));
    }
    let linear_memory_bytes = linear(&engine);
    reset_peak()?;
    let t = Instant::now();
    let snapshot = engine.snapshot();
    let snapshot_seconds = t.elapsed().as_secs_f64();
    let snapshot_peak_rss_kib = status_kib("VmHWM:")?;
    Ok(EngineMemory {
        engine: kind.to_string(),
        rss_before_kib: before,
        rss_after_kib: after,
        rss_per_key_bytes: (after.saturating_sub(before) * 1024) as f64 / f64::from(n),
        store_seconds,
        linear_memory_bytes,
        snapshot_bytes: snapshot.as_ref().ok().map(|b| b.len() as u64),
        snapshot_peak_rss_kib,
        snapshot_seconds,
        snapshot_error: snapshot.err().map(|e| format!("{e:?}")),
        traps: engine.traps(),
    })
}

/// Runs this binary's `bench --memory` for one engine and reads back its report.
fn in_own_process(args: &Options, kind: EngineKind, dir: &Path) -> Result<MemoryReport, String> {
    let json = dir.join(format!("memory-{kind}.json"));
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let status = Process::new(exe)
        .args(["bench", "--memory", "--engines", &kind.to_string()])
        .args(["--keys", &args.keys.to_string(), "--ranks", &args.ranks.to_string(), "--json"])
        .arg(&json)
        .status()
        .map_err(|e| format!("running bench --memory for {kind}: {e}"))?;
    if !status.success() {
        return Err(format!("bench --memory for {kind} failed: {status}"));
    }
    let text = std::fs::read(&json).map_err(|e| format!("{}: {e}", json.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", json.display()))
}

pub(super) fn run(args: &Options) -> Result<(), String> {
    let (n, ranks) = (args.keys.max(1), args.ranks.max(1));
    // Twice the pages the keys need: the pool stays under the eviction watermark, so every key
    // stays (an untouched page costs nothing).
    let pages = n.saturating_mul(2);
    let report = match args.engines.as_slice() {
        [] => return Err("--engines names no engine".into()),
        &[kind] => one_engine(kind, n, ranks, pages)?,
        kinds => {
            let dir = std::env::temp_dir().join(format!("kvpages-bench-memory-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let reports = kinds.iter().map(|&k| in_own_process(args, k, &dir)).collect::<Result<Vec<_>, _>>();
            let _ = std::fs::remove_dir_all(&dir);
            let mut reports = reports?.into_iter();
            let mut merged = reports.next().expect("two engines or more");
            merged.command = crate::command_line();
            merged.engines.extend(reports.flat_map(|r| r.engines));
            merged
        }
    };
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

/// Measures one engine here, then a huge rank on the native core.
fn one_engine(kind: EngineKind, n: u32, ranks: u32, pages: u32) -> Result<MemoryReport, String> {
    let figures = match kind {
        EngineKind::Native => measure(NativeEngine::new(7, Settings::default()), n, ranks, pages, |_| None)?,
        EngineKind::Wasm => {
            let engine = PluginEngine::new(ServeConfig::default().plugin.sandbox()?, 7, Settings::default())?;
            measure(engine, n, ranks, pages, |e| Some(e.memory()))?
        }
    };
    let e = &figures;
    println!(
        "kvpages bench --memory, {kind}: {n} keys (32-hex) stored on {ranks} rank(s) of {pages} pages in {:.2} s: RSS {} KiB -> {} KiB = {:.1} B per key{}",
        e.store_seconds,
        e.rss_before_kib,
        e.rss_after_kib,
        e.rss_per_key_bytes,
        e.linear_memory_bytes.map_or(String::new(), |b| format!(", linear memory {} MiB", b >> 20)),
    );
    if e.traps > 0 {
        println!(
            "  the plugin trapped {} times on the way (each time rebuilt from its last snapshot and journal)",
            e.traps
        );
    }
    let taken = match (&e.snapshot_bytes, &e.snapshot_error) {
        (Some(bytes), _) => format!("snapshot of {} MB in {:.2} s", bytes / 1_000_000, e.snapshot_seconds),
        (None, error) => {
            format!("the snapshot FAILED after {:.2} s ({})", e.snapshot_seconds, error.as_deref().unwrap_or("?"))
        }
    };
    println!(
        "  {taken}; peak RSS while taking it {} KiB ({:+} KiB over the state)",
        e.snapshot_peak_rss_kib,
        e.snapshot_peak_rss_kib as i64 - e.rss_after_kib as i64
    );
    let (init_us, huge_rss, first_us) = huge_rank()?;
    println!(
        "  initialize a {HUGE_RANK}-page rank (native): {init_us:.1} µs, RSS {huge_rss:+} KiB; first allocate+confirm of 32 keys on it: {first_us:.1} µs",
    );
    Ok(MemoryReport {
        kind: "memory".into(),
        machine: Machine::read(),
        command: crate::command_line(),
        keys: n,
        ranks,
        key_form: "32-char lowercase hex, the same keys on every rank".into(),
        pool_pages: pages,
        engines: vec![figures],
        huge_rank_pages: HUGE_RANK,
        huge_rank_init_us: init_us,
        huge_rank_rss_kib: huge_rss,
        huge_rank_first_allocate_confirm_us: first_us,
    })
}

/// A 10^8-page rank on a fresh native core: initialization time, RSS growth, first save.
fn huge_rank() -> Result<(f64, i64, f64), String> {
    let mut huge = NativeEngine::new(8, Settings::default());
    let rss0 = rss_kib()?;
    let t = Instant::now();
    huge.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: HUGE_RANK })
        .map_err(|e| format!("initialize {HUGE_RANK}: {e:?}"))?;
    let init_us = t.elapsed().as_secs_f64() * 1e6;
    let rss1 = rss_kib()?;
    let mut text = Vec::new();
    KeyGen::new(8).fresh(32, &mut text);
    let keys = text.iter().map(|k| Key::parse(k).map_err(|e| format!("{k}: {e:?}"))).collect::<Result<Vec<_>, _>>()?;
    let t = Instant::now();
    allocate_confirm(&mut huge, 1, 0, &keys)?;
    let first_us = t.elapsed().as_secs_f64() * 1e6;
    Ok((init_us, rss1 as i64 - rss0 as i64, first_us))
}

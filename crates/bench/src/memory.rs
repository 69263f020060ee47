//! `kvpages bench --memory`: what stored keys cost in resident memory, and what a huge rank
//! costs to create. Measured on the core in this process (no HTTP buffers in the figure), from
//! the kernel's VmRSS; run it as its own process so nothing else has touched the heap.

use std::time::{Duration, Instant};

use kvpages_core::{Command, Core, Key, Reply, Settings, Space};
use serde::Serialize;

use super::workload::KeyGen;
use super::{Machine, Options, write_json};

/// Pages of the rank whose initialization is timed.
const HUGE_RANK: u32 = 100_000_000;

#[derive(Serialize)]
struct MemoryReport {
    kind: &'static str,
    machine: Machine,
    command: Vec<String>,
    keys: u32,
    key_form: &'static str,
    pool_pages: u32,
    rss_before_kib: u64,
    rss_after_kib: u64,
    rss_per_key_bytes: f64,
    store_seconds: f64,
    huge_rank_pages: u32,
    huge_rank_init_us: f64,
    huge_rank_rss_kib: i64,
    /// The first allocate+confirm of 32 keys on the huge rank.
    huge_rank_first_allocate_confirm_us: f64,
}

/// VmRSS of this process, in KiB.
fn rss_kib() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| format!("/proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no VmRSS line in /proc/self/status".into())
}

fn allocate_confirm(core: &mut Core, now: u64, rank: u32, keys: Vec<Key>) -> Result<(), String> {
    let space = Space::Vllm;
    let reply = core.apply(now, &Command::Allocate { space: space.clone(), rank, keys: keys.clone() });
    let Ok(Reply::Allocated(got)) = reply else { return Err(format!("allocate: {reply:?}")) };
    let mut confirmations = Vec::with_capacity(got.len());
    for a in got {
        let page = a.page.ok_or("allocate: the pool is full")?;
        confirmations.push((keys[a.index as usize].clone(), page));
    }
    core.apply(now, &Command::Confirm { space, rank, confirmations, releases: vec![] })
        .map(|_| ())
        .map_err(|e| format!("confirm: {e}"))
}

pub(super) fn run(args: &Options) -> Result<(), String> {
    let n = args.memory_keys.max(1);
    let keygen = KeyGen::new(7);
    let mut text = Vec::with_capacity(128);

    let mut core = Core::new(7, Settings::default());
    // Twice the pages the keys need: the pool stays under the eviction watermark, so every key
    // stays (an untouched page costs nothing).
    let pages = n.saturating_mul(2);
    core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: pages })
        .map_err(|e| format!("initialize: {e}"))?;
    let before = rss_kib()?;
    let start = Instant::now();
    let mut stored = 0;
    while stored < n {
        let batch = (n - stored).min(128) as usize;
        text.clear();
        keygen.fresh(batch, &mut text);
        let keys = text.iter().map(|k| Key::parse(k).map_err(|e| format!("{k}: {e:?}"))).collect::<Result<_, _>>()?;
        allocate_confirm(&mut core, 1, 0, keys)?;
        stored += batch as u32;
    }
    // A command past the reservation TTL drains the reservation queue, as a live server does.
    let later = Duration::from_secs(24 * 3600).as_millis() as u64;
    core.apply(later, &Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![], releases: vec![] })
        .map_err(|e| format!("confirm: {e}"))?;
    let store_seconds = start.elapsed().as_secs_f64();
    let after = rss_kib()?;
    let keys_now = core.stats().spaces.first().map_or(0, |s| s.keys);
    if keys_now != u64::from(n) {
        return Err(format!("stored {keys_now} keys, expected {n}"));
    }
    let per_key = (after.saturating_sub(before) * 1024) as f64 / f64::from(n);
    drop(core);

    let mut huge = Core::new(8, Settings::default());
    let rss0 = rss_kib()?;
    let t = Instant::now();
    huge.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: HUGE_RANK })
        .map_err(|e| format!("initialize {HUGE_RANK}: {e}"))?;
    let init_us = t.elapsed().as_secs_f64() * 1e6;
    let rss1 = rss_kib()?;
    text.clear();
    keygen.fresh(32, &mut text);
    let keys = text.iter().map(|k| Key::parse(k).map_err(|e| format!("{k}: {e:?}"))).collect::<Result<_, _>>()?;
    let t = Instant::now();
    allocate_confirm(&mut huge, 1, 0, keys)?;
    let first_us = t.elapsed().as_secs_f64() * 1e6;

    let report = MemoryReport {
        kind: "memory",
        machine: Machine::read(),
        command: crate::command_line(),
        keys: n,
        key_form: "32-char lowercase hex, one rank",
        pool_pages: pages,
        rss_before_kib: before,
        rss_after_kib: after,
        rss_per_key_bytes: per_key,
        store_seconds,
        huge_rank_pages: HUGE_RANK,
        huge_rank_init_us: init_us,
        huge_rank_rss_kib: rss1 as i64 - rss0 as i64,
        huge_rank_first_allocate_confirm_us: first_us,
    };
    println!("kvpages bench --memory (the core in this process, VmRSS from /proc/self/status)");
    println!(
        "  {n} keys stored (32-hex, one rank of {pages} pages) in {store_seconds:.2} s: RSS {before} KiB -> {after} KiB = {per_key:.1} B per key"
    );
    println!(
        "  initialize a {HUGE_RANK}-page rank: {init_us:.1} µs, RSS {:+} KiB; first allocate+confirm of 32 keys on it: {first_us:.1} µs",
        report.huge_rank_rss_kib
    );
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

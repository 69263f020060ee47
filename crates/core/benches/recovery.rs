//! What recovery costs at 10^6 stored keys (goal: under 2 s in all): restoring a snapshot
//! (`Core::restore`, which also checks every invariant) and replaying the log records that
//! stored them (allocate + confirm, 128 keys a command, as vLLM's workers send them).
//! `cargo bench -p kvpages-core --features serde --bench recovery`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvpages_core::{Command, Core, Key, Reply, Settings, Space};

const KEYS: u64 = 1_000_000;
const BATCH: u64 = 128;

fn key(i: u64) -> Key {
    let a = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    Key::parse(&format!("{a:016x}{:016x}", a.rotate_left(29))).expect("32 hex digits")
}

/// The commands a live server logged to store KEYS keys on one rank.
fn log() -> Vec<(u64, Command)> {
    let mut core = Core::new(1, Settings::default());
    let mut out = vec![(0, Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 2 * KEYS as u32 })];
    core.apply(0, &out[0].1).unwrap();
    for start in (0..KEYS).step_by(BATCH as usize) {
        let now = start / BATCH;
        let keys: Vec<Key> = (start..start + BATCH).map(key).collect();
        let alloc = Command::Allocate { space: Space::Vllm, rank: 0, keys: keys.clone() };
        let Ok(Reply::Allocated(got)) = core.apply(now, &alloc) else { panic!("allocate") };
        let confirmations = got.iter().map(|a| (keys[a.index as usize].clone(), a.page.unwrap())).collect();
        let confirm = Command::Confirm { space: Space::Vllm, rank: 0, confirmations, releases: vec![] };
        core.apply(now, &confirm).unwrap();
        out.push((now, alloc));
        out.push((now, confirm));
    }
    out
}

fn recovery(c: &mut Criterion) {
    let log = log();
    let mut g = c.benchmark_group("recovery-1e6-keys");
    g.sample_size(10);
    g.bench_function("replay-log", |b| {
        b.iter(|| {
            let mut core = Core::new(1, Settings::default());
            for (now, cmd) in &log {
                let _ = core.apply(*now, cmd);
            }
            black_box(core)
        })
    });
    let mut core = Core::new(1, Settings::default());
    for (now, cmd) in &log {
        let _ = core.apply(*now, cmd);
    }
    let snapshot = core.snapshot();
    eprintln!("snapshot of {KEYS} keys: {} bytes", snapshot.len());
    g.bench_function("restore-snapshot", |b| b.iter(|| black_box(Core::restore(&snapshot).unwrap())));
    g.bench_function("take-snapshot", |b| b.iter(|| black_box(core.snapshot())));
    g.finish();
}

criterion_group!(benches, recovery);
criterion_main!(benches);

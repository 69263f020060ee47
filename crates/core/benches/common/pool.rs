//! The pool-size benchmarks — the cost per key of allocate+confirm, exists and locations at
//! 10^3..10^8 pages — generic over what applies the commands: `benches/core.rs` runs them on
//! the core itself, `crates/host/benches/plugin.rs` through the wasm plugin engine (it includes
//! this file by path), so both measure exactly the same command streams.
//!
//! Every pool holds the same kind of state: `min(N/2, 65,536)` stored 32-hex keys on one rank,
//! so only the pool size changes between sizes (a pool of 10^3 pages simply cannot hold more
//! keys). The clock advances 1 ms per command, so leases and reservations expire as in a live
//! server.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use kvpages_core::{Command, Key, Reply, Space};

/// Pool sizes, in pages.
pub const POOL_SIZES: [u32; 6] = [1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000];
/// Keys per command (the connector's usual save batch).
pub const BATCH: usize = 32;
const MAX_STORED: u32 = 65_536;

/// Applies one command at a time (`now`, command) and returns the reply; panics on a refusal,
/// which none of these streams should get.
pub type Apply = Box<dyn FnMut(u64, &Command) -> Reply>;

/// The `i`-th distinct 32-hex key.
fn key(i: u64) -> Key {
    Key::parse(&crate::common::key_text(i)).expect("32 hex digits")
}

fn keys(range: std::ops::Range<u64>) -> Vec<Key> {
    range.map(key).collect()
}

/// An engine (a fresh one from `new`) whose rank 0 has `pages` pages, `stored` of them holding
/// keys `0..stored`.
struct Fixture {
    apply: Apply,
    now: u64,
    stored: u32,
    next_key: u64,
}

impl Fixture {
    fn new(pages: u32, new: &mut dyn FnMut() -> Apply) -> Fixture {
        let mut apply = new();
        apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: pages });
        let stored = (pages / 2).min(MAX_STORED);
        let mut f = Fixture { apply, now: 1, stored, next_key: u64::from(stored) };
        for start in (0..u64::from(stored)).step_by(128) {
            f.allocate_confirm(keys(start..(start + 128).min(u64::from(stored))));
        }
        f
    }

    fn tick(&mut self) -> u64 {
        self.now += 1;
        self.now
    }

    fn run(&mut self, cmd: &Command) -> Reply {
        let now = self.tick();
        (self.apply)(now, cmd)
    }

    fn allocate_confirm(&mut self, keys: Vec<Key>) {
        let Reply::Allocated(got) = self.run(&Command::Allocate { space: Space::Vllm, rank: 0, keys: keys.clone() })
        else {
            panic!("allocate failed")
        };
        let confirmations: Vec<(Key, u32)> =
            got.iter().map(|a| (keys[a.index as usize].clone(), a.page.expect("the pool never fills here"))).collect();
        black_box(self.run(&Command::Confirm { space: Space::Vllm, rank: 0, confirmations, releases: vec![] }));
    }

    /// Fresh keys, half of them stored: a lookup with 50 % hits.
    fn lookup_keys(&mut self, n: usize) -> Vec<Key> {
        (0..n as u64)
            .map(|i| {
                if i % 2 == 1 {
                    key((self.next_key.wrapping_mul(31) + i) % u64::from(self.stored))
                } else {
                    self.next_key += 1;
                    key(self.next_key + (1 << 40))
                }
            })
            .collect()
    }
}

/// Short runs, so six pool sizes of every group fit in a few minutes.
pub fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

/// `{prefix}allocate_confirm_32`: allocate + confirm of 32 fresh keys, per pool size.
pub fn allocate_confirm(c: &mut Criterion, prefix: &str, mut new: impl FnMut() -> Apply) {
    let mut g = c.benchmark_group(format!("{prefix}allocate_confirm_32"));
    g.throughput(Throughput::Elements(BATCH as u64));
    for pages in POOL_SIZES {
        let mut f = Fixture::new(pages, &mut new);
        // Iterations between clean-ups: the pool stays under 90 % (eviction never starts), and
        // a chunk stores at most MAX_STORED more keys, so the key table is the same size at
        // every pool from 10^5 pages up (uncapped, a chunk at 10^6 pages grew it to ~900,000
        // keys: that measured the table's size, not the pool's).
        let room = ((u64::from(pages) * 9 / 10).saturating_sub(u64::from(f.stored)) / BATCH as u64)
            .clamp(1, u64::from(MAX_STORED) / BATCH as u64);
        g.bench_with_input(BenchmarkId::from_parameter(pages), &pages, |b, _| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let chunk = left.min(room);
                    let first = f.next_key;
                    let batches: Vec<Vec<Key>> =
                        (0..chunk).map(|i| keys(first + i * BATCH as u64..first + (i + 1) * BATCH as u64)).collect();
                    f.next_key += chunk * BATCH as u64;
                    let start = Instant::now();
                    for batch in batches {
                        f.allocate_confirm(batch);
                    }
                    timed += start.elapsed();
                    // Untimed: delete what the chunk stored, so the pool and the key table
                    // stay the same size however long criterion runs.
                    f.run(&Command::Delete { space: Space::Vllm, keys: keys(first..f.next_key) });
                    left -= chunk;
                }
                timed
            })
        });
    }
    g.finish();
}

/// Runs `iters` commands made by `make` (untimed, in chunks so the inputs stay small) and
/// returns the time spent applying them.
fn timed_chunks(f: &mut Fixture, iters: u64, make: &mut impl FnMut(&mut Fixture) -> Command) -> Duration {
    const CHUNK: u64 = 1_024;
    let mut timed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let inputs: Vec<Command> = (0..n).map(|_| make(f)).collect();
        let start = Instant::now();
        for cmd in &inputs {
            black_box(f.run(cmd));
        }
        timed += start.elapsed();
        left -= n;
    }
    timed
}

/// A group of one command per iteration, made by `make` (untimed), at every pool size.
fn per_command(
    c: &mut Criterion,
    group: String,
    new: &mut dyn FnMut() -> Apply,
    mut make: impl FnMut(&mut Fixture) -> Command,
) {
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(BATCH as u64));
    for pages in POOL_SIZES {
        let mut f = Fixture::new(pages, new);
        g.bench_with_input(BenchmarkId::from_parameter(pages), &pages, |b, _| {
            b.iter_custom(|iters| timed_chunks(&mut f, iters, &mut make))
        });
    }
    g.finish();
}

/// `{prefix}exists_32`: batch_exists of 32 keys with 50 % hits, per pool size.
pub fn exists(c: &mut Criterion, prefix: &str, mut new: impl FnMut() -> Apply) {
    per_command(c, format!("{prefix}exists_32"), &mut new, |f| Command::Exists {
        space: Space::Vllm,
        keys: f.lookup_keys(BATCH),
    });
}

/// `{prefix}locations_32`: get_locations of 32 stored keys, per pool size.
pub fn locations(c: &mut Criterion, prefix: &str, mut new: impl FnMut() -> Apply) {
    per_command(c, format!("{prefix}locations_32"), &mut new, |f| {
        // Stored keys only: a load asks for blocks the lookup found.
        f.next_key += BATCH as u64;
        let at = f.next_key;
        let keys = (0..BATCH as u64).map(|i| key((at + i * 977) % u64::from(f.stored))).collect();
        Command::Locations { space: Space::Vllm, rank: 0, keys }
    });
}

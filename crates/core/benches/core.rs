//! Criterion benchmarks of the core alone: the cost per key of allocate+confirm, exists and
//! locations at pool sizes 10^3..10^8 pages, and of initializing a rank. The claim they check:
//! no command's cost grows with the pool (the peer's copies and scans its free list).
//!
//! Every pool holds the same kind of state: `min(N/2, 65,536)` stored 32-hex keys on one
//! rank, so only the pool size changes between sizes (a pool of 10^3 pages simply cannot hold
//! more keys). The clock advances 1 ms per command, so leases and reservations expire as in a
//! live server. `cargo bench -p kvpages-core --bench core -- --test` runs each once (CI).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpages_core::{Command, Core, Key, Reply, Settings, Space};

const POOL_SIZES: [u32; 6] = [1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000];
/// Keys per command (the connector's usual save batch).
const BATCH: usize = 32;
const MAX_STORED: u32 = 65_536;

mod common;

/// The `i`-th distinct 32-hex key.
fn key(i: u64) -> Key {
    Key::parse(&common::key_text(i)).expect("32 hex digits")
}

fn keys(range: std::ops::Range<u64>) -> Vec<Key> {
    range.map(key).collect()
}

/// A core whose rank 0 has `pages` pages, `stored` of them holding keys `0..stored`.
struct Fixture {
    core: Core,
    now: u64,
    stored: u32,
    next_key: u64,
}

impl Fixture {
    fn new(pages: u32) -> Fixture {
        let mut core = Core::new(7, Settings::default());
        core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: pages }).expect("initialize");
        let stored = (pages / 2).min(MAX_STORED);
        let mut f = Fixture { core, now: 1, stored, next_key: u64::from(stored) };
        for start in (0..u64::from(stored)).step_by(128) {
            f.allocate_confirm(keys(start..(start + 128).min(u64::from(stored))));
        }
        f
    }

    fn tick(&mut self) -> u64 {
        self.now += 1;
        self.now
    }

    fn allocate_confirm(&mut self, keys: Vec<Key>) {
        let now = self.tick();
        let space = Space::Vllm;
        let Ok(Reply::Allocated(got)) =
            self.core.apply(now, &Command::Allocate { space: space.clone(), rank: 0, keys: keys.clone() })
        else {
            panic!("allocate failed")
        };
        let confirmations: Vec<(Key, u32)> =
            got.iter().map(|a| (keys[a.index as usize].clone(), a.page.expect("the pool never fills here"))).collect();
        let now = self.tick();
        black_box(self.core.apply(now, &Command::Confirm { space, rank: 0, confirmations, releases: vec![] }))
            .expect("confirm");
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

fn allocate_confirm(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocate_confirm_32");
    g.throughput(Throughput::Elements(BATCH as u64));
    for pages in POOL_SIZES {
        let mut f = Fixture::new(pages);
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
                    let now = f.tick();
                    f.core
                        .apply(now, &Command::Delete { space: Space::Vllm, keys: keys(first..f.next_key) })
                        .expect("delete");
                    left -= chunk;
                }
                timed
            })
        });
    }
    g.finish();
}

/// Runs `iters` commands made by `make` (untimed, in chunks so the inputs stay small) and
/// returns the time spent in `run` alone.
fn timed_chunks<T>(
    f: &mut Fixture,
    iters: u64,
    mut make: impl FnMut(&mut Fixture) -> T,
    mut run: impl FnMut(&mut Fixture, T),
) -> Duration {
    const CHUNK: u64 = 1_024;
    let mut timed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let inputs: Vec<T> = (0..n).map(|_| make(f)).collect();
        let start = Instant::now();
        for input in inputs {
            run(f, input);
        }
        timed += start.elapsed();
        left -= n;
    }
    timed
}

fn exists(c: &mut Criterion) {
    let mut g = c.benchmark_group("exists_32");
    g.throughput(Throughput::Elements(BATCH as u64));
    for pages in POOL_SIZES {
        let mut f = Fixture::new(pages);
        g.bench_with_input(BenchmarkId::from_parameter(pages), &pages, |b, _| {
            b.iter_custom(|iters| {
                timed_chunks(
                    &mut f,
                    iters,
                    |f| f.lookup_keys(BATCH),
                    |f, keys| {
                        let now = f.tick();
                        black_box(f.core.apply(now, &Command::Exists { space: Space::Vllm, keys })).expect("exists");
                    },
                )
            })
        });
    }
    g.finish();
}

fn locations(c: &mut Criterion) {
    let mut g = c.benchmark_group("locations_32");
    g.throughput(Throughput::Elements(BATCH as u64));
    for pages in POOL_SIZES {
        let mut f = Fixture::new(pages);
        g.bench_with_input(BenchmarkId::from_parameter(pages), &pages, |b, _| {
            b.iter_custom(|iters| {
                timed_chunks(
                    &mut f,
                    iters,
                    // Stored keys only: a load asks for blocks the lookup found.
                    |f| {
                        f.next_key += BATCH as u64;
                        let at = f.next_key;
                        (0..BATCH as u64).map(|i| key((at + i * 977) % u64::from(f.stored))).collect::<Vec<_>>()
                    },
                    |f, keys| {
                        let now = f.tick();
                        black_box(f.core.apply(now, &Command::Locations { space: Space::Vllm, rank: 0, keys }))
                            .expect("locations");
                    },
                )
            })
        });
    }
    g.finish();
}

fn initialize(c: &mut Criterion) {
    let mut g = c.benchmark_group("initialize");
    for pages in POOL_SIZES {
        g.bench_with_input(BenchmarkId::from_parameter(pages), &pages, |b, &pages| {
            // An empty core, the command and dropping the core, all timed. (With iter_batched,
            // which keeps a batch's cores alive, every command's new space landed in fresh heap
            // pages: the bench measured first-touch page faults, ~2 µs, not the command.)
            b.iter(|| {
                let mut core = Core::new(7, Settings::default());
                black_box(core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: pages }))
                    .expect("initialize");
                core
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! { name = benches; config = config(); targets = allocate_confirm, exists, locations, initialize }
criterion_main!(benches);

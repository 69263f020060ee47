//! Criterion benchmarks of the core alone: the cost per key of allocate+confirm, exists and
//! locations at pool sizes 10^3..10^8 pages (`common/pool.rs`, which the plugin's bench runs
//! through the wasm engine too), and of initializing a rank. The claim they check: no
//! command's cost grows with the pool (the peer's copies and scans its free list).
//! `cargo bench -p kvpages-core --bench core -- --test` runs each once (CI).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvpages_core::{Command, Core, Settings, Space};

mod common;
#[path = "common/pool.rs"]
mod pool;

use pool::POOL_SIZES;

/// A fresh core behind `pool`'s interface.
fn core() -> pool::Apply {
    let mut core = Core::new(7, Settings::default());
    Box::new(move |now, cmd: &Command| core.apply(now, cmd).expect("the bench's commands are valid"))
}

fn allocate_confirm(c: &mut Criterion) {
    pool::allocate_confirm(c, "", core);
}

fn exists(c: &mut Criterion) {
    pool::exists(c, "", core);
}

fn locations(c: &mut Criterion) {
    pool::locations(c, "", core);
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

criterion_group! { name = benches; config = pool::config(); targets = allocate_confirm, exists, locations, initialize }
criterion_main!(benches);

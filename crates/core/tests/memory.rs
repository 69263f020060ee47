//! Heap bytes per stored key: the target is under 100 B for 32-hex keys on one rank
//! (vLLM's Python server: ~480 B). Counted with a global allocator, so the figure is exact
//! and independent of the machine's noise.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use kvpages_core::{Command, Core, Key, Reply, Settings, Space};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn hex_key(i: u64) -> Key {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    Key::parse(&format!("{:016x}{:016x}", x, x.rotate_left(17))).unwrap()
}

#[test]
fn a_stored_key_costs_under_100_bytes() {
    const KEYS: u64 = 1_000_000;
    // Eviction off: this measures a pool filled to the last page.
    let mut core = Core::new(7, Settings { eviction: kvpages_core::Eviction::Off, ..Settings::default() });
    let space = Space::Vllm;
    core.apply(0, &Command::Initialize { space: space.clone(), rank: 0, num_pages: KEYS as u32 }).unwrap();
    let before = LIVE.load(Ordering::Relaxed);
    for start in (0..KEYS).step_by(128) {
        let keys: Vec<Key> = (start..(start + 128).min(KEYS)).map(hex_key).collect();
        let Ok(Reply::Allocated(got)) =
            core.apply(1, &Command::Allocate { space: space.clone(), rank: 0, keys: keys.clone() })
        else {
            panic!("allocate failed")
        };
        let confirmations = got.iter().map(|a| (keys[a.index as usize].clone(), a.page.unwrap())).collect();
        core.apply(1, &Command::Confirm { space: space.clone(), rank: 0, confirmations, releases: vec![] }).unwrap();
    }
    // Let the reservation queue drain (a later command past the TTL), as it does in a live server.
    core.apply(
        10_000_000,
        &Command::Confirm { space: space.clone(), rank: 0, confirmations: vec![], releases: vec![] },
    )
    .unwrap();
    let stats = core.stats();
    assert_eq!(stats.spaces[0].keys, KEYS);
    assert_eq!(stats.spaces[0].ranks[0].pages.committed, KEYS as u32);
    let per_key = (LIVE.load(Ordering::Relaxed) - before) as f64 / KEYS as f64;
    println!("heap per stored key (32-hex, one rank, 10^6 keys): {per_key:.1} B");
    assert!(per_key < 100.0, "{per_key:.1} B per key");
}

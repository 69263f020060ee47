//! A long soak: over a million random commands against small pools, so that eviction, expiry,
//! quarantine and leases run all the time, ending with zero leaked pages.
//!
//! The workload is vLLM's, with its failures: workers save the same blocks on every rank; most
//! writers confirm, some release (write failure), some crash (never confirm) or confirm late;
//! readers take leases; keys are deleted; settings change now and then. The invariant checker
//! runs every `CHECK_EVERY` steps and at the end. Once the clock has passed every TTL,
//! quarantine and lease, nothing may be left reserved or quarantined: every page is free or
//! committed to a live key.
//!
//! `KVPAGES_SEED` / `KVPAGES_STEPS` override the seed and the step count.

mod common;

use std::collections::HashMap;

use common::{Rng, check_conservation, hex_key};
use kvpages_core::{Command, Core, Counters, Eviction, Key, Millis, Reply, Settings, Space};

const SEED: u64 = 0x736f_616b_0000_0001;
const STEPS: u64 = 1_000_000;
const CHECK_EVERY: u64 = 1_000;
const UNIVERSE: u64 = 300;
/// Pool sizes of ranks 0 and 1: small, so the pools are full all the time.
const POOL: [u32; 2] = [24, 32];
/// Outstanding reservations kept per rank; older ones are writers that crashed.
const PENDING_CAP: usize = 48;

/// The settings the soak cycles through (all durations short against the run).
fn settings_cycle() -> [Settings; 4] {
    let base = Settings {
        reservation_ttl: 400,
        quarantine: 300,
        read_lease: 150,
        eviction: Eviction::Lru,
        evict_high_permille: 950,
        evict_low_permille: 900,
        world_size: None,
    };
    [
        base,
        Settings { evict_high_permille: 800, evict_low_permille: 500, read_lease: 40, ..base },
        Settings { quarantine: 0, read_lease: 0, evict_high_permille: 1000, evict_low_permille: 1000, ..base },
        Settings { eviction: Eviction::Off, reservation_ttl: 150, ..base },
    ]
}

struct Soak {
    seed: u64,
    rng: Rng,
    core: Core,
    now: Millis,
    step: u64,
    universe: Vec<Key>,
    pending: [Vec<(Key, u32)>; 2],
    last_batch: Option<(u32, Vec<Key>)>,
    recent: Vec<Key>,
    longest: Millis,
    /// Pages that readers and cache hits were promised: `(rank, page)` → end of the lease.
    leases: HashMap<(u32, u32), Millis>,
    /// Fresh pages handed out while checked against the leases, and leases granted (coverage).
    checked_against_leases: u64,
    leases_granted: u64,
}

impl Soak {
    fn new(seed: u64) -> Soak {
        let s = settings_cycle()[0];
        let mut soak = Soak {
            seed,
            rng: Rng::new(seed),
            core: Core::new(seed, s),
            now: 0,
            step: 0,
            universe: (0..UNIVERSE).map(hex_key).collect(),
            pending: [Vec::new(), Vec::new()],
            last_batch: None,
            recent: Vec::new(),
            longest: 0,
            leases: HashMap::new(),
            checked_against_leases: 0,
            leases_granted: 0,
        };
        soak.note_settings(&s);
        for (rank, &n) in POOL.iter().enumerate() {
            soak.apply(&Command::Initialize { space: Space::Vllm, rank: rank as u32, num_pages: n }).unwrap();
        }
        soak
    }

    fn note_settings(&mut self, s: &Settings) {
        self.longest = self.longest.max(s.reservation_ttl).max(s.quarantine).max(s.read_lease);
    }

    fn fail(&self, msg: &str) -> ! {
        panic!(
            "soak seed {:#x} step {} at now={}: {msg} (replay: KVPAGES_SEED={:#x})",
            self.seed, self.step, self.now, self.seed
        )
    }

    fn apply(&mut self, cmd: &Command) -> Result<Reply, kvpages_core::Error> {
        self.core.apply(self.now, cmd)
    }

    fn key(&mut self) -> Key {
        if !self.recent.is_empty() && self.rng.chance(50) {
            self.recent[self.rng.index(self.recent.len())].clone()
        } else {
            self.universe[self.rng.index(self.universe.len())].clone()
        }
    }

    fn keys(&mut self, max: u64) -> Vec<Key> {
        let n = 1 + self.rng.below(max);
        (0..n).map(|_| self.key()).collect()
    }

    fn step(&mut self) {
        self.now += match self.rng.below(100) {
            0..40 => 0,
            40..99 => self.rng.below(12),
            _ => self.rng.below(2 * self.longest),
        };
        let space = Space::Vllm;
        match self.rng.below(1000) {
            0..350 => {
                let (rank, keys) = match self.last_batch.take() {
                    Some((rank, keys)) if self.rng.chance(50) => (1 - rank, keys),
                    _ => {
                        let keys = self.keys(4);
                        (self.rng.below_u32(2), keys)
                    }
                };
                let Ok(Reply::Allocated(out)) = self.apply(&Command::Allocate { space, rank, keys: keys.clone() })
                else {
                    self.fail("allocate on an initialized rank failed");
                };
                let fresh: Vec<Option<u32>> = out.iter().filter(|a| !a.cached).map(|a| a.page).collect();
                if fresh.iter().any(Option::is_some) && fresh.iter().any(Option::is_none) {
                    self.fail(&format!("not all-or-nothing: {out:?}"));
                }
                // A leased page is never handed out again while the lease runs.
                let read_lease = self.core.settings().read_lease;
                for a in &out {
                    let Some(p) = a.page else { continue };
                    if a.cached {
                        self.lease(rank, p, read_lease);
                    } else if self.leases.get(&(rank, p)).is_some_and(|&end| end > self.now) {
                        self.fail(&format!(
                            "rank {rank} page {p} handed out to {:?} under a lease",
                            keys[a.index as usize]
                        ));
                    } else {
                        self.checked_against_leases += 1;
                    }
                }
                let pending = &mut self.pending[rank as usize];
                for a in &out {
                    if let (Some(p), false) = (a.page, a.cached) {
                        pending.push((keys[a.index as usize].clone(), p));
                    }
                }
                if pending.len() > PENDING_CAP {
                    let crashed = pending.len() - PENDING_CAP;
                    pending.drain(..crashed);
                }
                self.recent.extend(keys.iter().cloned());
                if self.recent.len() > 64 {
                    let extra = self.recent.len() - 64;
                    self.recent.drain(..extra);
                }
                self.last_batch = Some((rank, keys));
            }
            350..650 => {
                let rank = self.rng.below_u32(2);
                let mut confirmations = Vec::new();
                let mut releases = Vec::new();
                let mut i = 0;
                while i < self.pending[rank as usize].len() {
                    if self.rng.chance(50) {
                        let (k, p) = self.pending[rank as usize].swap_remove(i);
                        match self.rng.below(100) {
                            0..72 => confirmations.push((k, p)),
                            72..92 => releases.push(p),
                            _ => {} // the writer crashed
                        }
                    } else {
                        i += 1;
                    }
                }
                let _ = self.apply(&Command::Confirm { space, rank, confirmations, releases });
            }
            650..800 => {
                let rank = self.rng.below_u32(2);
                let keys = self.keys(4);
                let Ok(Reply::Locations(v)) = self.apply(&Command::Locations { space, rank, keys: keys.clone() })
                else {
                    self.fail("get_locations on an initialized rank failed");
                };
                if v.len() != keys.len() {
                    self.fail("get_locations answered the wrong number of pages");
                }
                let read_lease = self.core.settings().read_lease;
                for p in v.into_iter().flatten() {
                    self.lease(rank, p, read_lease);
                }
            }
            800..880 => {
                let keys = self.keys(8);
                self.apply(&Command::Exists { space, keys }).unwrap();
            }
            880..930 => {
                let keys = self.keys(2);
                self.apply(&Command::Delete { space, keys }).unwrap();
            }
            930..940 => {
                let key = self.key();
                self.apply(&Command::Inspect { space, key }).unwrap();
            }
            940..950 => {
                self.apply(&Command::Stats).unwrap();
            }
            950..951 => {
                let s = *self.rng.pick(&settings_cycle());
                self.note_settings(&s);
                self.apply(&Command::Configure(s)).unwrap();
            }
            951..952 => {
                // Re-initialization: nearly always the same size (a restarted worker); rarely a
                // new file layout, which drops the rank's keys.
                let rank = self.rng.below_u32(2);
                let (current, _) = self.counts(rank);
                let small = POOL[rank as usize];
                let n = match self.rng.chance(95) {
                    true => current,
                    false if current == small => small + 8,
                    false => small,
                };
                self.apply(&Command::Initialize { space, rank, num_pages: n }).unwrap();
                if n != current {
                    // A new file layout: the rank's old page numbers mean nothing any more.
                    self.pending[rank as usize].clear();
                    self.leases.retain(|&(r, _), _| r != rank);
                }
            }
            _ => {
                // Lookups of the last batch on the other rank, as a loading worker would do.
                if let Some((rank, keys)) = self.last_batch.clone() {
                    let Ok(Reply::Locations(v)) = self.apply(&Command::Locations { space, rank: 1 - rank, keys })
                    else {
                        self.fail("get_locations on an initialized rank failed");
                    };
                    let read_lease = self.core.settings().read_lease;
                    for p in v.into_iter().flatten() {
                        self.lease(1 - rank, p, read_lease);
                    }
                }
            }
        }
    }

    fn lease(&mut self, rank: u32, page: u32, duration: Millis) {
        if duration > 0 {
            self.leases_granted += 1;
            let end = self.leases.entry((rank, page)).or_insert(0);
            *end = (*end).max(self.now + duration);
        }
        if self.leases.len() > 4_096 {
            let now = self.now;
            self.leases.retain(|_, end| *end > now);
        }
    }

    /// `(num_pages, counts)` of a rank as of the last command.
    fn counts(&self, rank: u32) -> (u32, kvpages_core::PageCounts) {
        let stats = self.core.stats();
        let r = stats.spaces[0].ranks.iter().find(|r| r.rank == rank).expect("rank exists");
        (r.num_pages, r.pages)
    }

    fn check(&self) {
        if let Err(e) = self.core.check_invariants() {
            self.fail(&format!("invariant violated: {e}"));
        }
        if let Err(e) = check_conservation(&self.core) {
            self.fail(&format!("page conservation: {e}"));
        }
    }

    fn counters(&self) -> Counters {
        self.core.stats().spaces[0].counters
    }
}

#[test]
fn a_million_random_commands_on_small_pools_leak_no_page() {
    let seed = common::seeds(SEED, &[])[0];
    let steps = common::steps(STEPS);
    println!("soak seed {seed:#x}, {steps} steps (replay: KVPAGES_SEED={seed:#x} KVPAGES_STEPS={steps})");
    let mut s = Soak::new(seed);
    for step in 0..steps {
        s.step = step;
        s.step();
        if step % CHECK_EVERY == 0 {
            s.check();
        } else {
            // Cheap, every step: the counts add up (they are kept incrementally).
            for rank in 0..2 {
                let (n, p) = s.counts(rank);
                if p.free + p.reserved + p.committed + p.quarantined != n || p.leased > p.committed {
                    s.fail(&format!("rank {rank}: {p:?} does not add up to {n} pages"));
                }
            }
        }
    }
    s.check();
    let c = s.counters();
    println!(
        "  counters: {c:?}; {} leases granted, {} fresh pages checked against them",
        s.leases_granted, s.checked_against_leases
    );
    assert!(s.leases_granted > steps / 100, "readers should hold leases all the time");
    // The run exercised what it claims to.
    let wanted = [
        "evictions",
        "expired_reservations",
        "quarantined_pages",
        "deleted",
        "superseded",
        "released",
        "cache_hits",
        "misses",
        "location_hits",
        "dropped_keys",
    ];
    for (name, n) in c.named().into_iter().filter(|(name, _)| wanted.contains(name)) {
        assert!(n > 0, "the soak never produced {name}: {c:?}");
    }
    assert!(c.evictions > steps / 100, "eviction should run all the time: {c:?}");
    assert!(c.expired_reservations > steps / 100, "expiry should run all the time: {c:?}");

    // Past every deadline, one more command lets the clock act: nothing reserved, quarantined
    // or leased is left; every page is free or committed to a live key.
    s.now += 10 * s.longest + 1_000;
    let Ok(Reply::Stats(stats)) = s.apply(&Command::Stats) else { panic!("stats") };
    s.check();
    let sp = &stats.spaces[0];
    assert_eq!(sp.pending_keys, 0, "{sp:?}");
    let mut committed_per_rank = [0u32; 2];
    for k in s.universe.clone() {
        let Ok(Reply::Key(info)) = s.apply(&Command::Inspect { space: Space::Vllm, key: k }) else { panic!("inspect") };
        if let Some(info) = info {
            assert_eq!(info.reservations, 0, "{info:?}");
            assert_eq!(info.lease_remaining, 0, "{info:?}");
            for (rank, _) in &info.pages {
                committed_per_rank[*rank as usize] += 1;
            }
        }
    }
    for r in &sp.ranks {
        let p = r.pages;
        println!("  rank {}: {} pages, {p:?}", r.rank, r.num_pages);
        assert_eq!((p.reserved, p.quarantined, p.leased), (0, 0, 0), "rank {}: {p:?}", r.rank);
        assert_eq!(p.free + p.committed, r.num_pages, "rank {}: {p:?}", r.rank);
        assert_eq!(p.committed, committed_per_rank[r.rank as usize], "rank {}: committed pages of live keys", r.rank);
    }
}

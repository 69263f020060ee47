//! Helpers shared by the core's integration tests: the seeded generator, the seeds to run and a
//! checked driver.
#![allow(dead_code)]

use kvpages_core::{
    Allocation, Command, ConfirmReport, Core, Counters, Error, InitOutcome, Key, KeyInfo, Millis, PageCounts, Reply,
    Settings, Space, Stats,
};

#[allow(unused_imports)]
pub use kvpages_rng::Rng;

/// A fresh page for the batch's key at `index`.
pub fn fresh(index: u32, page: u32) -> Allocation {
    Allocation { index, page: Some(page), cached: false }
}

/// The key at `index` answered with the page it holds.
pub fn cached(index: u32, page: u32) -> Allocation {
    Allocation { index, page: Some(page), cached: true }
}

/// The key at `index` answered -1.
pub fn miss(index: u32) -> Allocation {
    Allocation { index, page: None, cached: false }
}

/// The seeds a randomized test runs: `KVPAGES_SEED` (decimal or 0x-hex) if set, else `default`,
/// followed by `fixed`.
pub fn seeds(default: u64, fixed: &[u64]) -> Vec<u64> {
    let first = match std::env::var("KVPAGES_SEED") {
        Ok(s) => parse_u64(&s).unwrap_or_else(|| panic!("KVPAGES_SEED={s:?} is not a u64")),
        Err(_) => default,
    };
    let mut out = vec![first];
    out.extend(fixed.iter().copied().filter(|&s| s != first));
    out
}

/// `KVPAGES_STEPS` if set, else `default`.
pub fn steps(default: u64) -> u64 {
    match std::env::var("KVPAGES_STEPS") {
        Ok(s) => parse_u64(&s).unwrap_or_else(|| panic!("KVPAGES_STEPS={s:?} is not a u64")),
        Err(_) => default,
    }
}

fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

pub fn key(s: &str) -> Key {
    Key::parse(s).expect("test keys are valid")
}

pub fn keys(ks: &[&str]) -> Vec<Key> {
    ks.iter().map(|s| key(s)).collect()
}

/// The `i`-th key of a test universe, shaped like vLLM's (32 lowercase hex characters).
pub fn hex_key(i: u64) -> Key {
    key(&format!("{:032x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed))
}

/// A core plus the clock, with one method per command; every call checks the invariants.
#[derive(Clone, Debug)]
pub struct Harness {
    pub core: Core,
    pub now: Millis,
}

/// Settings under which kvpages answers exactly like vLLM's server (`--eviction off`):
/// no eviction; quarantine and leases off so freed pages come back at once, as in the peer.
pub fn peer_settings() -> Settings {
    Settings { eviction: kvpages_core::Eviction::Off, quarantine: 0, read_lease: 0, ..Settings::default() }
}

impl Harness {
    /// The peer's rules: no eviction, no quarantine, no leases.
    pub fn new() -> Harness {
        Harness::with(peer_settings())
    }

    pub fn with(settings: Settings) -> Harness {
        Harness { core: Core::new(7, settings), now: 0 }
    }

    pub fn apply(&mut self, cmd: Command) -> Result<Reply, Error> {
        let r = self.core.apply(self.now, &cmd);
        if let Err(e) = self.core.check_invariants() {
            panic!("invariant broken after {cmd:?} -> {r:?}: {e}");
        }
        r
    }

    pub fn init(&mut self, rank: u32, num_pages: u32) -> Result<InitOutcome, Error> {
        match self.apply(Command::Initialize { space: Space::Vllm, rank, num_pages })? {
            Reply::Initialized { rank: r, num_pages: n, outcome } => {
                assert_eq!((r, n), (rank, num_pages));
                Ok(outcome)
            }
            other => panic!("initialize answered {other:?}"),
        }
    }

    pub fn try_alloc(&mut self, rank: u32, ks: &[&str]) -> Result<Vec<Allocation>, Error> {
        match self.apply(Command::Allocate { space: Space::Vllm, rank, keys: keys(ks) })? {
            Reply::Allocated(a) => Ok(a),
            other => panic!("allocate answered {other:?}"),
        }
    }

    /// The pages of an allocation, one per distinct key.
    pub fn alloc(&mut self, rank: u32, ks: &[&str]) -> Vec<Option<u32>> {
        self.try_alloc(rank, ks).expect("allocate").iter().map(|a| a.page).collect()
    }

    pub fn confirm(&mut self, rank: u32, pairs: &[(&str, u32)], releases: &[u32]) -> Result<ConfirmReport, Error> {
        let confirmations = pairs.iter().map(|&(k, p)| (key(k), p)).collect();
        let cmd = Command::Confirm { space: Space::Vllm, rank, confirmations, releases: releases.to_vec() };
        match self.apply(cmd)? {
            Reply::Confirmed(r) => Ok(r),
            other => panic!("confirm answered {other:?}"),
        }
    }

    /// Allocates `ks` and confirms every fresh page; returns the pages.
    pub fn store(&mut self, rank: u32, ks: &[&str]) -> Vec<u32> {
        let got = self.try_alloc(rank, ks).expect("allocate");
        let pages: Vec<u32> = got.iter().map(|a| a.page.expect("pool has room")).collect();
        let pairs: Vec<(&str, u32)> =
            got.iter().filter(|a| !a.cached).map(|a| (ks[a.index as usize], a.page.unwrap())).collect();
        if !pairs.is_empty() {
            let r = self.confirm(rank, &pairs, &[]).expect("confirm");
            assert!(r.refused.is_empty(), "{r:?}");
        }
        pages
    }

    pub fn exists(&mut self, ks: &[&str]) -> Vec<bool> {
        match self.apply(Command::Exists { space: Space::Vllm, keys: keys(ks) }).expect("exists") {
            Reply::Exists(v) => v,
            other => panic!("exists answered {other:?}"),
        }
    }

    pub fn try_locations(&mut self, rank: u32, ks: &[&str]) -> Result<Vec<Option<u32>>, Error> {
        match self.apply(Command::Locations { space: Space::Vllm, rank, keys: keys(ks) })? {
            Reply::Locations(v) => Ok(v),
            other => panic!("get_locations answered {other:?}"),
        }
    }

    pub fn locations(&mut self, rank: u32, ks: &[&str]) -> Vec<Option<u32>> {
        self.try_locations(rank, ks).expect("get_locations")
    }

    /// Deletes keys; returns how many had a committed page.
    pub fn delete(&mut self, ks: &[&str]) -> u32 {
        match self.apply(Command::Delete { space: Space::Vllm, keys: keys(ks) }).expect("delete") {
            Reply::Deleted(n) => n,
            other => panic!("delete answered {other:?}"),
        }
    }

    /// Everything known about one key (a pure read).
    pub fn inspect(&mut self, k: &str) -> Option<KeyInfo> {
        match self.apply(Command::Inspect { space: Space::Vllm, key: key(k) }).expect("inspect") {
            Reply::Key(info) => info.map(|b| *b),
            other => panic!("inspect answered {other:?}"),
        }
    }

    /// The `Stats` command (which lets the clock act first), the vLLM space's figures.
    pub fn stats_cmd(&mut self) -> Stats {
        match self.apply(Command::Stats).expect("stats") {
            Reply::Stats(s) => *s,
            other => panic!("stats answered {other:?}"),
        }
    }

    /// The vLLM space's counters, as of the last command.
    pub fn counters(&self) -> Counters {
        self.stats().spaces.iter().find(|s| s.space == Space::Vllm).map(|s| s.counters).unwrap_or_default()
    }

    pub fn configure(&mut self, settings: Settings) {
        assert_eq!(self.apply(Command::Configure(settings)), Ok(Reply::Configured));
    }

    pub fn clear(&mut self) -> Reply {
        self.apply(Command::Clear { space: Space::Vllm }).expect("clear")
    }

    pub fn free_list(&self, rank: u32) -> Vec<u32> {
        self.core.free_list(&Space::Vllm, rank).expect("rank is initialized")
    }

    pub fn counts(&self, rank: u32) -> PageCounts {
        let stats = self.core.stats();
        let sp = stats.spaces.iter().find(|s| s.space == Space::Vllm).expect("space exists");
        sp.ranks.iter().find(|r| r.rank == rank).expect("rank exists").pages
    }

    pub fn stats(&self) -> Stats {
        self.core.stats()
    }

    /// Everything observable without a command: stats and every rank's free list.
    pub fn snapshot(&self) -> Snapshot {
        snapshot(&self.core)
    }
}

impl Default for Harness {
    fn default() -> Harness {
        Harness::new()
    }
}

/// Stats plus every rank's free list, for "nothing changed" checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub stats: Stats,
    pub free_lists: Vec<(u32, Vec<u32>)>,
}

pub fn snapshot(core: &Core) -> Snapshot {
    let stats = core.stats();
    let free_lists = stats
        .spaces
        .iter()
        .flat_map(|sp| sp.ranks.iter().map(|r| (r.rank, core.free_list(&sp.space, r.rank).expect("rank listed"))))
        .collect();
    Snapshot { stats, free_lists }
}

/// What `core` looks like once reservations due at `now` have expired, and nothing else.
///
/// Expiry is driven by the clock, not by a command: a refused command still lets time pass
/// (it runs the expiry that `now` implies before deciding). An empty allocation on any
/// initialized rank does exactly that expiry and nothing more.
pub fn expired_at(core: &Core, now: Millis) -> Snapshot {
    let mut c = core.clone();
    let first_rank =
        c.stats().spaces.iter().find(|s| s.space == Space::Vllm).and_then(|s| s.ranks.first().map(|r| r.rank));
    if let Some(rank) = first_rank {
        let r = c.apply(now, &Command::Allocate { space: Space::Vllm, rank, keys: vec![] });
        assert_eq!(r, Ok(Reply::Allocated(vec![])));
    }
    snapshot(&c)
}

/// Whether `after` is `before` with nothing applied: either untouched, or with only the
/// reservations due at `now` expired (some refusals are decided before the clock runs, some after).
pub fn refused_cleanly(before: &Core, after: &Core, now: Millis) -> bool {
    let got = snapshot(after);
    got == snapshot(before) || got == expired_at(before, now)
}

/// Checks free + reserved + committed + quarantined = num_pages and leased <= committed for
/// every rank, from `stats()`, and that the free list holds exactly the free pages.
pub fn check_conservation(core: &Core) -> Result<(), String> {
    for sp in core.stats().spaces {
        for r in sp.ranks {
            let p = r.pages;
            let sum = u64::from(p.free) + u64::from(p.reserved) + u64::from(p.committed) + u64::from(p.quarantined);
            if sum != u64::from(r.num_pages) {
                return Err(format!("rank {}: {p:?} does not add up to {} pages", r.rank, r.num_pages));
            }
            if p.leased > p.committed {
                return Err(format!("rank {}: {p:?} has more leased than committed pages", r.rank));
            }
            let listed = core.free_list(&sp.space, r.rank).expect("rank listed").len();
            if listed != p.free as usize {
                return Err(format!("rank {}: {} pages free but the free list holds {listed}", r.rank, p.free));
            }
        }
    }
    Ok(())
}

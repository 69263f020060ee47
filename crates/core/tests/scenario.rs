//! Seeded random scenarios over valid and invalid input, with the invariant checker after
//! every step.
//!
//! Replay a failure with `KVPAGES_SEED=<seed> cargo test -p kvpages-core --test scenario`
//! (`KVPAGES_STEPS` sets the step count of that seed). The seed is printed at the start.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use common::{Rng, Snapshot, check_conservation, hex_key, refused_cleanly, snapshot};
use kvpages_core::{Command, Core, Counters, Key, Millis, Reply, Settings, Space};

const DEFAULT_SEED: u64 = 0x6b76_7061_6765_7301;
const FIXED_SEEDS: [u64; 3] = [1, 0xdead_beef, 20_250_101];
const MAIN_STEPS: u64 = 100_000;
const EXTRA_STEPS: u64 = 20_000;

const RANKS: u32 = 3;
const SIZES: [u32; 4] = [8, 16, 32, 64];
const UNIVERSE: u64 = 100;
const PENDING_CAP: usize = 256;

struct Scenario {
    seed: u64,
    step: u64,
    rng: Rng,
    core: Core,
    now: Millis,
    settings: Settings,
    universe: Vec<Key>,
    /// Recent allocations `(rank, key, page)`, to build confirms that mostly match.
    pending: Vec<(u32, Key, u32)>,
    /// Counters of the spaces that `Clear` dropped, so coverage survives a clear.
    cleared: Counters,
}

impl Scenario {
    fn new(seed: u64) -> Scenario {
        let mut rng = Rng::new(seed);
        let world_size = *rng.pick(&[None, None, Some(2), Some(3)]);
        let settings = Settings { reservation_ttl: *rng.pick(&[200, 1_000, 5_000]), world_size, ..Settings::default() };
        let universe = (0..UNIVERSE)
            .map(|i| if i % 4 == 3 { Key::parse(&format!("k-{i}")).unwrap() } else { hex_key(i) })
            .collect();
        Scenario {
            seed,
            step: 0,
            rng,
            core: Core::new(seed, settings),
            now: 0,
            settings,
            universe,
            pending: Vec::new(),
            cleared: Counters::default(),
        }
    }

    fn fail(&self, cmd: &Command, msg: &str) -> ! {
        panic!("scenario seed {:#x} step {}: {msg}\n  at now={} command {cmd:?}", self.seed, self.step, self.now)
    }

    fn random_key(&mut self) -> Key {
        let i = self.rng.index(self.universe.len());
        self.universe[i].clone()
    }

    fn random_rank(&mut self) -> u32 {
        if self.rng.chance(3) { *self.rng.pick(&[3, 9]) } else { self.rng.below_u32(RANKS) }
    }

    /// Counters of the live space (zero when there is none).
    fn counters(&self) -> Counters {
        self.core.stats().spaces.first().map(|sp| sp.counters).unwrap_or_default()
    }

    /// Counters over the whole run, clears included.
    fn total_counters(&self) -> Counters {
        let mut t = self.cleared;
        add(&mut t, &self.counters());
        t
    }

    fn num_pages(&self, rank: u32) -> Option<u32> {
        let stats = self.core.stats();
        let sp = stats.spaces.into_iter().find(|s| s.space == Space::Vllm)?;
        sp.ranks.iter().find(|r| r.rank == rank).map(|r| r.num_pages)
    }

    fn next_command(&mut self) -> Command {
        let space = Space::Vllm;
        let roll = self.rng.below(1000);
        match roll {
            0..25 => {
                let rank = self.random_rank();
                let num_pages = match self.num_pages(rank) {
                    _ if self.rng.chance(2) => 0,
                    Some(n) if self.rng.chance(85) => n,
                    _ => *self.rng.pick(&SIZES),
                };
                Command::Initialize { space, rank, num_pages }
            }
            25..400 => {
                let rank = self.random_rank();
                let len = *self.rng.pick(&[0, 1, 1, 1, 2, 3, 4, 6, 8, 12]);
                let mut keys: Vec<Key> = Vec::with_capacity(len);
                for _ in 0..len {
                    let k = if !keys.is_empty() && self.rng.chance(15) {
                        keys[self.rng.index(keys.len())].clone()
                    } else {
                        self.random_key()
                    };
                    keys.push(k);
                }
                Command::Allocate { space, rank, keys }
            }
            400..760 => self.random_confirm(),
            760..860 => {
                let len = self.rng.index(20);
                Command::Exists { space, keys: (0..len).map(|_| self.random_key()).collect() }
            }
            860..960 => {
                let rank = self.random_rank();
                let len = self.rng.index(20);
                Command::Locations { space, rank, keys: (0..len).map(|_| self.random_key()).collect() }
            }
            960..963 => Command::Clear { space },
            963..968 => {
                // The TTL may change mid-run (the command log replays old settings); the TP
                // world does not, since a running deployment cannot change its TP size.
                self.settings.reservation_ttl = *self.rng.pick(&[0, 50, 200, 1_000, 5_000]);
                Command::Configure(self.settings)
            }
            _ => Command::Stats,
        }
    }

    fn random_confirm(&mut self) -> Command {
        // Usually the rank of a recent allocation, so most pairs match a reservation.
        let rank = if !self.pending.is_empty() && self.rng.chance(85) {
            self.pending[self.rng.index(self.pending.len())].0
        } else {
            self.random_rank()
        };
        let num_pages = self.num_pages(rank).unwrap_or(8);
        let mut confirmations = Vec::new();
        let mut releases = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].0 == rank && self.rng.chance(60) {
                let (_, k, p) = self.pending.swap_remove(i);
                match self.rng.below(100) {
                    0..65 => confirmations.push((k, p)),
                    65..90 => releases.push(p),
                    90..95 => {
                        // Both: the release of a page just committed must be ignored.
                        confirmations.push((k, p));
                        releases.push(p);
                    }
                    _ => {
                        // The wrong key for a reserved page.
                        let other = self.random_key();
                        confirmations.push((other, p));
                    }
                }
            } else {
                i += 1;
            }
        }
        // Pairs and releases that match nothing (never handed out, committed, or stale).
        for _ in 0..self.rng.below(3) {
            if self.rng.chance(60) {
                let k = self.random_key();
                confirmations.push((k, self.rng.below_u32(num_pages)));
            } else {
                releases.push(self.rng.below_u32(num_pages));
            }
        }
        if self.rng.chance(2) {
            let bad = num_pages + self.rng.below_u32(3);
            if self.rng.chance(50) { releases.push(bad) } else { confirmations.push((self.random_key(), bad)) }
        }
        self.rng.shuffle(&mut confirmations);
        self.rng.shuffle(&mut releases);
        Command::Confirm { space: Space::Vllm, rank, confirmations, releases }
    }

    fn advance_clock(&mut self) {
        self.now += match self.rng.below(100) {
            0..60 => 0,
            60..97 => self.rng.below(40),
            _ => self.rng.below(3 * self.settings.reservation_ttl.max(1)),
        };
    }

    fn step(&mut self) {
        self.advance_clock();
        let cmd = self.next_command();
        if matches!(cmd, Command::Clear { .. }) {
            let c = self.counters();
            add(&mut self.cleared, &c);
        }
        let before: Option<Core> = cmd.is_mutating().then(|| self.core.clone());
        let before_snapshot: Option<Snapshot> = (!cmd.is_mutating()).then(|| snapshot(&self.core));
        let (now, core) = (self.now, &mut self.core);
        let reply = match catch_unwind(AssertUnwindSafe(|| core.apply(now, &cmd))) {
            Ok(r) => r,
            Err(p) => {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                self.fail(&cmd, &format!("the core panicked: {}", msg.unwrap_or_default()))
            }
        };
        if let Err(e) = self.core.check_invariants() {
            self.fail(&cmd, &format!("invariant violated: {e} (reply {reply:?})"));
        }
        if let Err(e) = check_conservation(&self.core) {
            self.fail(&cmd, &format!("page conservation: {e}"));
        }
        if let Some(s) = before_snapshot
            && snapshot(&self.core) != s
        {
            self.fail(&cmd, "a read changed the state");
        }
        match &reply {
            Err(e) => {
                // (A refused read was checked above like every read.)
                if let Some(before) = before
                    && !refused_cleanly(&before, &self.core, now)
                {
                    self.fail(&cmd, &format!("refused with {e:?} but changed the state"));
                }
            }
            Ok(r) => self.check_reply(&cmd, r),
        }
    }

    fn check_reply(&mut self, cmd: &Command, reply: &Reply) {
        match (cmd, reply) {
            (Command::Allocate { rank, keys, .. }, Reply::Allocated(out)) => {
                let mut first = Vec::new();
                for (i, k) in keys.iter().enumerate() {
                    if !keys[..i].contains(k) {
                        first.push(i as u32);
                    }
                }
                let indices: Vec<u32> = out.iter().map(|a| a.index).collect();
                if indices != first {
                    self.fail(cmd, &format!("entries at {indices:?}, first occurrences are {first:?}"));
                }
                let fresh: Vec<Option<u32>> = out.iter().filter(|a| !a.cached).map(|a| a.page).collect();
                if fresh.iter().any(|p| p.is_none()) && fresh.iter().any(|p| p.is_some()) {
                    self.fail(cmd, &format!("not all-or-nothing: {out:?}"));
                }
                let mut pages: Vec<u32> = fresh.iter().flatten().copied().collect();
                pages.sort_unstable();
                pages.dedup();
                if pages.len() != fresh.iter().flatten().count() {
                    self.fail(cmd, &format!("one page handed out twice: {out:?}"));
                }
                for a in out {
                    let k = &keys[a.index as usize];
                    if a.cached {
                        let loc = Command::Locations { space: Space::Vllm, rank: *rank, keys: vec![k.clone()] };
                        let got = self.core.apply(self.now, &loc);
                        if got != Ok(Reply::Locations(vec![a.page])) {
                            self.fail(cmd, &format!("cache hit {a:?} but get_locations says {got:?}"));
                        }
                    } else if let Some(p) = a.page {
                        self.pending.push((*rank, k.clone(), p));
                    }
                }
                if self.pending.len() > PENDING_CAP {
                    let extra = self.pending.len() - PENDING_CAP;
                    self.pending.drain(..extra);
                }
            }
            (Command::Exists { keys, .. }, Reply::Exists(flags)) => {
                if flags.len() != keys.len() {
                    self.fail(cmd, "exists answered the wrong number of flags");
                }
                // A complete key has a page on every rank of the world.
                let world: Vec<u32> = match self.settings.world_size {
                    Some(n) => (0..n).collect(),
                    None => {
                        self.core.stats().spaces.first().map_or(vec![], |s| s.ranks.iter().map(|r| r.rank).collect())
                    }
                };
                let complete: Vec<Key> = keys.iter().zip(flags).filter(|(_, f)| **f).map(|(k, _)| k.clone()).collect();
                if complete.is_empty() {
                    return;
                }
                for rank in world {
                    let loc = Command::Locations { space: Space::Vllm, rank, keys: complete.clone() };
                    match self.core.apply(self.now, &loc) {
                        Ok(Reply::Locations(v)) if v.iter().all(Option::is_some) => {}
                        other => self.fail(cmd, &format!("complete keys {complete:?}, rank {rank} answers {other:?}")),
                    }
                }
            }
            (Command::Locations { keys, .. }, Reply::Locations(v)) if v.len() != keys.len() => {
                self.fail(cmd, "get_locations answered the wrong number of pages")
            }
            (Command::Clear { .. }, Reply::Cleared { .. }) if !self.core.stats().spaces.is_empty() => {
                self.fail(cmd, "clear left a space behind")
            }
            _ => {}
        }
    }
}

fn run(seed: u64, steps: u64) {
    println!("scenario seed {seed:#x}, {steps} steps (replay: KVPAGES_SEED={seed:#x})");
    let mut s = Scenario::new(seed);
    for step in 0..steps {
        s.step = step;
        s.step();
    }
    println!("  counters over the run: {:?}", s.total_counters());
}

#[test]
fn random_scenarios_keep_every_invariant() {
    let seeds = common::seeds(DEFAULT_SEED, &FIXED_SEEDS);
    for (i, &seed) in seeds.iter().enumerate() {
        let steps = if i == 0 { common::steps(MAIN_STEPS) } else { EXTRA_STEPS };
        run(seed, steps);
    }
}

/// The scenario exercises what it claims to: every kind of event happens under each seed.
#[test]
fn random_scenarios_reach_every_rule() {
    for seed in [DEFAULT_SEED, FIXED_SEEDS[0], FIXED_SEEDS[1]] {
        let mut s = Scenario::new(seed);
        for step in 0..20_000 {
            s.step = step;
            s.step();
        }
        let t = s.total_counters();
        for (name, n) in [
            ("reserved", t.reserved),
            ("cache_hits", t.cache_hits),
            ("misses", t.misses),
            ("committed", t.committed),
            ("refused_confirms", t.refused_confirms),
            ("superseded", t.superseded),
            ("released", t.released),
            ("ignored_releases", t.ignored_releases),
            ("expired_reservations", t.expired_reservations),
            ("dropped_keys", t.dropped_keys),
        ] {
            assert!(n > 0, "seed {seed:#x}: the scenario never produced {name} ({t:?})");
        }
    }
}

fn add(total: &mut Counters, c: &Counters) {
    total.reserved += c.reserved;
    total.cache_hits += c.cache_hits;
    total.misses += c.misses;
    total.committed += c.committed;
    total.refused_confirms += c.refused_confirms;
    total.superseded += c.superseded;
    total.released += c.released;
    total.ignored_releases += c.ignored_releases;
    total.expired_reservations += c.expired_reservations;
    total.dropped_keys += c.dropped_keys;
}

//! Differential test: the core against a naive re-implementation of the peer's rules.
//!
//! The model is the peer's "slow path": a `Vec` free list that starts as `0..n`, taken from
//! the front and appended to at the back, and a map from key to `rank -> page`. Both are driven
//! with random *valid* input in the sense of the notes' "Parity" section, where kvpages must
//! answer exactly as the peer does, page numbers included:
//! every rank is initialized before the first confirm and never re-initialized with another
//! size; no key appears twice in one batch; each page a rank got is confirmed or released
//! once, by that rank; no release names a committed page; the clock never reaches the TTL.
//!
//! Two rules are kvpages', not the peer's: when a key that already has a page on a rank is
//! confirmed there again with another page (two writers), the peer overwrites the location and
//! leaks the old page; the model, like kvpages, keeps the first page and frees the second.
//! And `delete` (the peer has none) frees a key's pages on every rank at once, as releases would.
//!
//! Runs under `common::peer_settings()` (`Eviction::Off`, no quarantine, no read lease): the
//! settings under which kvpages promises the peer's replies.
//!
//! Replay with `KVPAGES_SEED=<seed> cargo test -p kvpages-core --test reference`.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};

use common::{Rng, hex_key};
use kvpages_core::{
    Allocation, Command, ConfirmReport, Core, Counters, InitOutcome, Key, Millis, PageCounts, Reply, Settings, Space,
};

const DEFAULT_SEED: u64 = 0x7265_6665_7265_6e63;
const FIXED_SEEDS: [u64; 4] = [2, 3, 0xfeed_f00d, 0x0123_4567_89ab_cdef];
const STEPS_PER_RUN: u64 = 6_000;
const UNIVERSE: u64 = 60;

/// One rank of the model.
#[derive(Debug)]
struct ModelRank {
    num_pages: u32,
    /// The peer's `free_pages` list.
    free: Vec<u32>,
    /// Pages handed out and not yet confirmed or released, with their key.
    reserved: HashMap<u32, Key>,
}

/// The peer's state rules, written the obvious way.
#[derive(Debug, Default)]
struct Model {
    ranks: BTreeMap<u32, ModelRank>,
    /// Confirmed pages: key -> rank -> page.
    keys: HashMap<Key, BTreeMap<u32, u32>>,
}

impl Model {
    fn complete(&self, key: &Key) -> bool {
        !self.ranks.is_empty() && self.keys.get(key).is_some_and(|pages| pages.len() == self.ranks.len())
    }

    fn initialize(&mut self, rank: u32, num_pages: u32) -> InitOutcome {
        match self.ranks.get(&rank) {
            Some(r) => {
                assert_eq!(r.num_pages, num_pages, "the driver only re-initializes with the same size");
                InitOutcome::Unchanged
            }
            None => {
                let joined_after_keys = self.keys.values().any(|p| !p.is_empty());
                let r = ModelRank { num_pages, free: (0..num_pages).collect(), reserved: HashMap::new() };
                self.ranks.insert(rank, r);
                InitOutcome::Created { joined_after_keys }
            }
        }
    }

    fn allocate(&mut self, rank: u32, keys: &[Key]) -> Vec<Allocation> {
        let hits: Vec<Option<u32>> =
            keys.iter().map(|k| if self.complete(k) { Some(self.keys[k][&rank]) } else { None }).collect();
        let r = self.ranks.get_mut(&rank).expect("initialized");
        if r.free.len() < keys.len() {
            return hits
                .iter()
                .enumerate()
                .map(|(i, &hit)| Allocation { index: i as u32, page: hit, cached: hit.is_some() })
                .collect();
        }
        let taken: Vec<u32> = r.free.drain(..keys.len()).collect();
        let mut out = Vec::new();
        for (i, (k, page)) in keys.iter().zip(taken).enumerate() {
            match hits[i] {
                Some(existing) => {
                    r.free.push(page);
                    out.push(Allocation { index: i as u32, page: Some(existing), cached: true });
                }
                None => {
                    r.reserved.insert(page, k.clone());
                    out.push(Allocation { index: i as u32, page: Some(page), cached: false });
                }
            }
        }
        out
    }

    fn confirm(&mut self, rank: u32, confirmations: &[(Key, u32)], releases: &[u32]) -> ConfirmReport {
        let mut report = ConfirmReport::default();
        let r = self.ranks.get_mut(&rank).expect("initialized");
        for (k, page) in confirmations {
            let pages = self.keys.entry(k.clone()).or_default();
            if pages.get(&rank) == Some(page) {
                report.unchanged += 1;
                continue;
            }
            let owner = r.reserved.remove(page);
            assert_eq!(owner.as_ref(), Some(k), "the driver confirms only its own reservations");
            match pages.entry(rank) {
                // kvpages' two-writers rule (the peer would overwrite and leak the old page).
                std::collections::btree_map::Entry::Occupied(_) => {
                    r.free.push(*page);
                    report.superseded += 1;
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(*page);
                    report.committed += 1;
                }
            }
        }
        for page in releases {
            assert!(r.reserved.remove(page).is_some(), "the driver releases only its own reservations");
            r.free.push(*page);
            report.released += 1;
        }
        self.keys.retain(|_, pages| !pages.is_empty());
        report
    }

    fn exists(&self, keys: &[Key]) -> Vec<bool> {
        keys.iter().map(|k| self.complete(k)).collect()
    }

    fn locations(&self, rank: u32, keys: &[Key]) -> Vec<Option<u32>> {
        keys.iter().map(|k| if self.complete(k) { self.keys[k].get(&rank).copied() } else { None }).collect()
    }

    /// kvpages' delete (the peer has none): every committed page of each distinct key goes to
    /// its rank's tail, in rank order; reservations stay; keys with no committed page don't count.
    fn delete(&mut self, keys: &[Key]) -> u32 {
        let mut deleted = 0;
        for (i, k) in keys.iter().enumerate() {
            if keys[..i].contains(k) {
                continue;
            }
            if let Some(pages) = self.keys.remove(k) {
                for (rank, page) in pages {
                    self.ranks.get_mut(&rank).expect("initialized").free.push(page);
                }
                deleted += 1;
            }
        }
        deleted
    }

    fn clear(&mut self) -> Reply {
        let ranks = self.ranks.len() as u32;
        let keys = self.stored_keys();
        *self = Model::default();
        Reply::Cleared { ranks, keys }
    }

    /// Keys that hold a page somewhere, committed or reserved.
    fn stored_keys(&self) -> u64 {
        let mut all: HashSet<&Key> = self.keys.keys().collect();
        for r in self.ranks.values() {
            all.extend(r.reserved.values());
        }
        all.len() as u64
    }

    /// Keys with a committed page somewhere.
    fn committed_keys(&self) -> u64 {
        self.keys.len() as u64
    }

    fn counts(&self, rank: u32) -> PageCounts {
        let r = &self.ranks[&rank];
        let committed = self.keys.values().filter(|p| p.contains_key(&rank)).count() as u32;
        PageCounts { free: r.free.len() as u32, reserved: r.reserved.len() as u32, committed, ..PageCounts::default() }
    }
}

struct Diff {
    seed: u64,
    step: u64,
    rng: Rng,
    core: Core,
    model: Model,
    now: Millis,
    universe: Vec<Key>,
    /// Per rank: fresh pages handed out and not yet confirmed or released.
    outstanding: BTreeMap<u32, Vec<(Key, u32)>>,
    /// Per rank: cache hits answered, which a writer may confirm again (a no-op).
    hits: BTreeMap<u32, Vec<(Key, u32)>>,
    /// The last batch: the rank it started on, the rank it was last sent to, its keys.
    last_batch: Option<(u32, u32, Vec<Key>)>,
    /// Counters of the spaces dropped by `Clear`.
    cleared: Counters,
    /// Never start a second writer of a key on a rank: then every rule used is the peer's own.
    strict: bool,
}

impl Diff {
    fn new(seed: u64, strict: bool) -> Diff {
        // The TTL is far beyond any clock the run reaches, so no reservation expires.
        let settings = Settings { reservation_ttl: 1 << 50, world_size: None, ..common::peer_settings() };
        let universe = (0..UNIVERSE)
            .map(|i| if i % 5 == 4 { Key::parse(&format!("key/{i}")).unwrap() } else { hex_key(1000 + i) })
            .collect();
        let mut d = Diff {
            seed,
            step: 0,
            rng: Rng::new(seed),
            core: Core::new(seed ^ 0x55, settings),
            model: Model::default(),
            now: 0,
            universe,
            outstanding: BTreeMap::new(),
            hits: BTreeMap::new(),
            last_batch: None,
            cleared: Counters::default(),
            strict,
        };
        d.initialize_world();
        d
    }

    fn fail(&self, cmd: &Command, msg: &str) -> ! {
        let mode = if self.strict { "strict" } else { "two-writers" };
        panic!("reference seed {:#x} ({mode}) step {}: {msg}\n  command {cmd:?}", self.seed, self.step)
    }

    /// Initializes 1..=3 ranks of random sizes, in random order, before any confirm; half the
    /// time with `world_size` set to that number (the same completeness on valid input).
    fn initialize_world(&mut self) {
        let n = 1 + self.rng.below_u32(3);
        let world_size = if self.rng.chance(50) { Some(n) } else { None };
        let settings = Settings { world_size, ..self.core.settings() };
        assert_eq!(self.core.apply(self.now, &Command::Configure(settings)), Ok(Reply::Configured));
        let mut ranks: Vec<u32> = (0..n).collect();
        self.rng.shuffle(&mut ranks);
        for rank in ranks {
            let num_pages = *self.rng.pick(&[1, 8, 16, 24, 64, 100]);
            self.run(Command::Initialize { space: Space::Vllm, rank, num_pages });
        }
        self.outstanding.clear();
        self.hits.clear();
        self.last_batch = None;
    }

    /// Whether allocating `key` on `rank` would start a second writer there: the key has a
    /// pending page on that rank, or a committed one while incomplete (so it is no cache hit).
    fn would_supersede(&self, rank: u32, key: &Key) -> bool {
        let pending = self.outstanding.get(&rank).is_some_and(|v| v.iter().any(|(k, _)| k == key));
        let committed = self.model.keys.get(key).is_some_and(|p| p.contains_key(&rank));
        pending || (committed && !self.model.complete(key))
    }

    fn ranks(&self) -> Vec<u32> {
        self.model.ranks.keys().copied().collect()
    }

    fn random_rank(&mut self) -> u32 {
        let ranks = self.ranks();
        *self.rng.pick(&ranks)
    }

    /// Distinct keys, often ones that are already stored so that cache hits happen.
    fn distinct_keys(&mut self, len: usize) -> Vec<Key> {
        let mut out: Vec<Key> = Vec::with_capacity(len);
        // Sorted: HashMap order differs between processes and would break replay.
        let mut stored: Vec<Key> = if self.rng.chance(50) { self.model.keys.keys().cloned().collect() } else { vec![] };
        stored.sort();
        let mut tries = 0;
        while out.len() < len && tries < 4 * len {
            tries += 1;
            let k = if !stored.is_empty() && self.rng.chance(50) {
                self.rng.pick(&stored).clone()
            } else {
                self.rng.pick(&self.universe).clone()
            };
            if !out.contains(&k) {
                out.push(k);
            }
        }
        out
    }

    fn next_command(&mut self) -> Command {
        let space = Space::Vllm;
        match self.rng.below(1000) {
            0..400 => {
                // Like vLLM, every rank saves the same blocks: often the last batch, on the next rank.
                let ranks = self.ranks();
                let next = |last: u32| ranks.iter().copied().find(|&r| r > last).unwrap_or(ranks[0]);
                let (first, rank, keys) = match self.last_batch.clone() {
                    Some((first, last, keys)) if next(last) != first && self.rng.chance(80) => {
                        (first, next(last), keys)
                    }
                    _ => {
                        let len = *self.rng.pick(&[0, 1, 1, 2, 3, 4, 5, 8]);
                        let rank = self.random_rank();
                        (rank, rank, self.distinct_keys(len))
                    }
                };
                self.last_batch = Some((first, rank, keys.clone()));
                let mut keys = keys;
                if self.strict {
                    keys.retain(|k| !self.would_supersede(rank, k));
                }
                Command::Allocate { space, rank, keys }
            }
            400..750 => {
                let rank = self.random_rank();
                let mut confirmations = Vec::new();
                let mut releases = Vec::new();
                let mine = self.outstanding.entry(rank).or_default();
                let mut i = 0;
                while i < mine.len() {
                    if self.rng.chance(80) {
                        let (k, p) = mine.swap_remove(i);
                        if self.rng.chance(75) { confirmations.push((k, p)) } else { releases.push(p) }
                    } else {
                        i += 1;
                    }
                }
                let hits = self.hits.entry(rank).or_default();
                for _ in 0..self.rng.below(2) {
                    if let Some(h) = hits.pop() {
                        confirmations.push(h);
                    }
                }
                self.rng.shuffle(&mut confirmations);
                self.rng.shuffle(&mut releases);
                Command::Confirm { space, rank, confirmations, releases }
            }
            750..870 => {
                let len = self.rng.index(12);
                let mut keys = self.distinct_keys(len);
                if let Some(k) = keys.first().cloned() {
                    keys.push(k); // lookups may repeat keys
                }
                Command::Exists { space, keys }
            }
            870..985 => {
                let rank = self.random_rank();
                let len = self.rng.index(12);
                Command::Locations { space, rank, keys: self.distinct_keys(len) }
            }
            985..990 => {
                let len = 1 + self.rng.index(4);
                let mut keys = self.distinct_keys(len);
                if self.rng.chance(20) {
                    keys.push(keys[0].clone()); // a repeated key counts once
                }
                Command::Delete { space, keys }
            }
            990..998 => {
                let rank = self.random_rank();
                Command::Initialize { space, rank, num_pages: self.model.ranks[&rank].num_pages }
            }
            _ => Command::Clear { space },
        }
    }

    /// What the model answers for `cmd` (applying it to the model).
    fn expect(&mut self, cmd: &Command) -> Reply {
        match cmd {
            Command::Initialize { rank, num_pages, .. } => Reply::Initialized {
                rank: *rank,
                num_pages: *num_pages,
                outcome: self.model.initialize(*rank, *num_pages),
            },
            Command::Allocate { rank, keys, .. } => Reply::Allocated(self.model.allocate(*rank, keys)),
            Command::Confirm { rank, confirmations, releases, .. } => {
                Reply::Confirmed(self.model.confirm(*rank, confirmations, releases))
            }
            Command::Exists { keys, .. } => Reply::Exists(self.model.exists(keys)),
            Command::Locations { rank, keys, .. } => Reply::Locations(self.model.locations(*rank, keys)),
            Command::Delete { keys, .. } => Reply::Deleted(self.model.delete(keys)),
            Command::Clear { .. } => self.model.clear(),
            other => unreachable!("the driver does not send {other:?}"),
        }
    }

    fn run(&mut self, cmd: Command) {
        let want = self.expect(&cmd);
        let got = self.core.apply(self.now, &cmd);
        if got.as_ref() != Ok(&want) {
            self.fail(&cmd, &format!("core answered {got:?}, the reference {want:?}"));
        }
        if let (Command::Allocate { rank, keys, .. }, Reply::Allocated(out)) = (&cmd, &want) {
            for a in out {
                let k = keys[a.index as usize].clone();
                match (a.page, a.cached) {
                    (Some(p), false) => self.outstanding.entry(*rank).or_default().push((k, p)),
                    (Some(p), true) => self.hits.entry(*rank).or_default().push((k, p)),
                    (None, _) => {}
                }
            }
        }
        if let Command::Delete { keys, .. } = &cmd {
            // A deleted key's cache hits are gone: confirming them again would be refused.
            for hits in self.hits.values_mut() {
                hits.retain(|(k, _)| !keys.contains(k));
            }
        }
        if let Err(e) = self.core.check_invariants() {
            self.fail(&cmd, &format!("invariant violated: {e}"));
        }
        self.compare_state(&cmd);
    }

    fn compare_state(&self, cmd: &Command) {
        let stats = self.core.stats();
        let Some(sp) = stats.spaces.first() else {
            if !self.model.ranks.is_empty() {
                self.fail(cmd, "the core has no space, the reference has ranks");
            }
            return;
        };
        let (committed, stored) = (self.model.committed_keys(), self.model.stored_keys());
        if (sp.keys, sp.keys + sp.pending_keys) != (committed, stored) {
            self.fail(
                cmd,
                &format!(
                    "core stores {} keys with pages and {} pending, the reference {committed} of {stored}",
                    sp.keys, sp.pending_keys
                ),
            );
        }
        let ranks: Vec<u32> = sp.ranks.iter().map(|r| r.rank).collect();
        if ranks != self.ranks() || (sp.world_size != ranks.len() as u32 && self.core.settings().world_size.is_none()) {
            self.fail(cmd, &format!("core ranks {ranks:?} (world {}), reference {:?}", sp.world_size, self.ranks()));
        }
        for r in &sp.ranks {
            let want = self.model.counts(r.rank);
            if r.pages != want {
                self.fail(cmd, &format!("rank {}: core counts {:?}, reference {want:?}", r.rank, r.pages));
            }
            let free = self.core.free_list(&Space::Vllm, r.rank).expect("rank listed");
            if free != self.model.ranks[&r.rank].free {
                self.fail(
                    cmd,
                    &format!(
                        "rank {}: core free list {free:?}, reference {:?}",
                        r.rank, self.model.ranks[&r.rank].free
                    ),
                );
            }
        }
    }

    fn counters(&self) -> Counters {
        self.core.stats().spaces.first().map(|sp| sp.counters).unwrap_or_default()
    }

    fn total_counters(&self) -> Counters {
        let mut t = self.cleared;
        t.add(&self.counters());
        t
    }

    fn step(&mut self) {
        self.now += self.rng.below(5);
        let cmd = self.next_command();
        let clear = matches!(cmd, Command::Clear { .. });
        if clear {
            let c = self.counters();
            self.cleared.add(&c);
        }
        self.run(cmd);
        if clear {
            self.initialize_world();
        }
    }
}

#[test]
fn the_core_answers_like_the_reference_model_on_valid_input() {
    for seed in common::seeds(DEFAULT_SEED, &FIXED_SEEDS) {
        for strict in [true, false] {
            run(seed, strict);
        }
    }
}

fn run(seed: u64, strict: bool) {
    let mode = if strict { "strict" } else { "two-writers" };
    println!("reference seed {seed:#x} ({mode}), {STEPS_PER_RUN} steps (replay: KVPAGES_SEED={seed:#x})");
    let mut d = Diff::new(seed, strict);
    for step in 0..STEPS_PER_RUN {
        d.step = step;
        d.step();
    }
    let t = d.total_counters();
    println!("  counters over the run: {t:?}");
    let wanted = ["reserved", "cache_hits", "misses", "committed", "released", "deleted"];
    for (name, n) in t.named().into_iter().filter(|(name, _)| wanted.contains(name)) {
        assert!(n > 0, "reference seed {seed:#x} ({mode}): the run never produced {name} ({t:?})");
    }
    assert_eq!(t.superseded == 0, strict, "reference seed {seed:#x} ({mode}): {t:?}");
    for (name, n) in
        [("refused", t.refused_confirms), ("ignored", t.ignored_releases), ("expired", t.expired_reservations)]
    {
        assert_eq!(n, 0, "reference seed {seed:#x} ({mode}): valid input had {name} events ({t:?})");
    }
}

/// The model itself on the notes' examples, so a wrong model cannot agree with a wrong core.
#[test]
fn the_reference_model_follows_the_notes() {
    let k = |s: &str| Key::parse(s).unwrap();
    let mut m = Model::default();
    m.initialize(0, 4);
    let a = m.allocate(0, &[k("a"), k("b")]);
    assert_eq!(a.iter().map(|a| a.page).collect::<Vec<_>>(), vec![Some(0), Some(1)]);
    m.confirm(0, &[(k("a"), 0)], &[1]);
    assert_eq!(m.ranks[&0].free, vec![2, 3, 1]);
    let a = m.allocate(0, &[k("a"), k("c")]);
    assert_eq!(a.iter().map(|a| (a.page, a.cached)).collect::<Vec<_>>(), vec![(Some(0), true), (Some(3), false)]);
    assert_eq!(m.ranks[&0].free, vec![1, 2]);
    let a = m.allocate(0, &[k("a"), k("d"), k("e")]);
    assert_eq!(a.iter().map(|a| a.page).collect::<Vec<_>>(), vec![Some(0), None, None]);
    assert_eq!(m.ranks[&0].free, vec![1, 2]);
    assert_eq!(m.exists(&[k("a"), k("c")]), vec![true, false]);
    assert_eq!(m.delete(&[k("a"), k("zz"), k("a")]), 1);
    assert_eq!(m.ranks[&0].free, vec![1, 2, 0]);
    assert_eq!(m.exists(&[k("a")]), vec![false]);
}

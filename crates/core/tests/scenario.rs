//! Seeded random scenarios over valid and invalid input, with the invariant checker after
//! every step.
//!
//! Every seed runs twice: under the peer's settings (`Eviction::Off`, no quarantine, no read
//! lease) and under random settings of kvpages' own (LRU eviction with watermarks, read leases,
//! quarantine, small pools so eviction runs all the time). Besides the core's own invariants,
//! the test keeps one of its own: **a leased page is never reassigned**. Every `(rank, page,
//! key)` returned by `get_locations` or as an allocate cache hit is tracked with its lease end;
//! while the lease runs, the page stays committed to that key or (deleted, evicted, dropped)
//! quarantined — never free, never handed out again.
//!
//! Replay a failure with `KVPAGES_SEED=<seed> cargo test -p kvpages-core --test scenario`
//! (`KVPAGES_STEPS` sets the step count of that seed). The seed is printed at the start.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

use common::{Rng, Snapshot, check_conservation, expired_at, hex_key, peer_settings, refused_cleanly, snapshot};
use kvpages_core::{Command, Core, Counters, Eviction, InitOutcome, Key, KeyInfo, Millis, Reply, Settings, Space};

const DEFAULT_SEED: u64 = 0x6b76_7061_6765_7301;
const FIXED_SEEDS: [u64; 3] = [1, 0xdead_beef, 20_250_101];
const MAIN_STEPS: u64 = 60_000;
const EXTRA_STEPS: u64 = 15_000;

const RANKS: u32 = 3;
const PEER_SIZES: [u32; 4] = [8, 16, 32, 64];
/// Small pools under kvpages' settings, so eviction runs all the time.
const OUR_SIZES: [u32; 5] = [4, 8, 12, 16, 24];
const UNIVERSE: u64 = 100;
const PENDING_CAP: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The peer's behaviour: `common::peer_settings()`, only the TTL varies.
    Peer,
    /// kvpages' own: random leases, quarantine, eviction policy and watermarks.
    Ours,
}

struct Scenario {
    seed: u64,
    mode: Mode,
    step: u64,
    rng: Rng,
    core: Core,
    now: Millis,
    settings: Settings,
    universe: Vec<Key>,
    /// Recent allocations `(rank, key, page)`, to build confirms that mostly match.
    pending: Vec<(u32, Key, u32)>,
    /// The last allocation's rank and keys: like vLLM, every rank saves the same blocks.
    last_batch: Option<(u32, Vec<Key>)>,
    /// Keys of recent allocations, so lookups and deletes often name stored keys.
    recent: Vec<Key>,
    /// Read leases handed out: `(rank, page, key)` → end of the lease the reply promised.
    leases: BTreeMap<(u32, u32, Key), Millis>,
    /// Counters of the spaces that `Clear` dropped, so coverage survives a clear.
    cleared: Counters,
    /// Leases checked while still running (coverage of the leased-page invariant).
    leases_checked: u64,
    /// Leased pages found quarantined after their key lost them (delete, eviction, drop).
    leased_quarantined: u64,
}

impl Scenario {
    fn new(seed: u64, mode: Mode) -> Scenario {
        let mut rng = Rng::new(seed);
        let world_size = *rng.pick(&[None, None, Some(2), Some(3)]);
        let reservation_ttl = *rng.pick(&[200, 1_000, 5_000]);
        let settings = match mode {
            Mode::Peer => Settings { reservation_ttl, world_size, ..peer_settings() },
            Mode::Ours => {
                let mut s = Settings { reservation_ttl, world_size, ..Settings::default() };
                randomize(&mut rng, &mut s);
                s
            }
        };
        let universe = (0..UNIVERSE)
            .map(|i| if i % 4 == 3 { Key::parse(&format!("k-{i}")).unwrap() } else { hex_key(i) })
            .collect();
        Scenario {
            seed,
            mode,
            step: 0,
            rng,
            core: Core::new(seed, settings),
            now: 0,
            settings,
            universe,
            pending: Vec::new(),
            last_batch: None,
            recent: Vec::new(),
            leases: BTreeMap::new(),
            cleared: Counters::default(),
            leases_checked: 0,
            leased_quarantined: 0,
        }
    }

    fn fail(&self, cmd: &Command, msg: &str) -> ! {
        panic!(
            "scenario seed {:#x} ({:?}) step {}: {msg}\n  at now={} command {cmd:?}\n  settings {:?}\n  replay: KVPAGES_SEED={:#x}",
            self.seed, self.mode, self.step, self.now, self.settings, self.seed
        )
    }

    fn random_key(&mut self) -> Key {
        let i = self.rng.index(self.universe.len());
        self.universe[i].clone()
    }

    /// Half the time a key of a recent allocation.
    fn likely_key(&mut self) -> Key {
        if !self.recent.is_empty() && self.rng.chance(50) {
            self.recent[self.rng.index(self.recent.len())].clone()
        } else {
            self.random_key()
        }
    }

    fn random_keys(&mut self, max: usize) -> Vec<Key> {
        let len = self.rng.index(max + 1);
        (0..len).map(|_| self.likely_key()).collect()
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
        t.add(&self.counters());
        t
    }

    fn num_pages(&self, rank: u32) -> Option<u32> {
        let stats = self.core.stats();
        let sp = stats.spaces.into_iter().find(|s| s.space == Space::Vllm)?;
        sp.ranks.iter().find(|r| r.rank == rank).map(|r| r.num_pages)
    }

    fn ranks(&self) -> Vec<u32> {
        self.core.stats().spaces.first().map_or(vec![], |s| s.ranks.iter().map(|r| r.rank).collect())
    }

    /// `Inspect` (a pure read, checked as such by every step that sends one).
    fn inspect(&mut self, key: &Key) -> Option<KeyInfo> {
        match self.core.apply(self.now, &Command::Inspect { space: Space::Vllm, key: key.clone() }) {
            Ok(Reply::Key(info)) => info.map(|b| *b),
            other => panic!("scenario seed {:#x} step {}: inspect answered {other:?}", self.seed, self.step),
        }
    }

    fn next_command(&mut self) -> Command {
        let space = Space::Vllm;
        let roll = self.rng.below(1000);
        match roll {
            0..25 => {
                let rank = self.random_rank();
                let sizes: &[u32] = if self.mode == Mode::Peer { &PEER_SIZES } else { &OUR_SIZES };
                let num_pages = match self.num_pages(rank) {
                    _ if self.rng.chance(2) => 0,
                    Some(n) if self.rng.chance(85) => n,
                    _ => *self.rng.pick(sizes),
                };
                Command::Initialize { space, rank, num_pages }
            }
            25..390 if self.last_batch.is_some() && self.rng.chance(45) => {
                // The same blocks on the next rank, as vLLM's workers save them.
                let (rank, keys) = self.last_batch.clone().unwrap();
                Command::Allocate { space, rank: (rank + 1) % RANKS, keys }
            }
            25..390 => {
                let rank = self.random_rank();
                let len = *self.rng.pick(&[0, 1, 1, 1, 2, 3, 4, 6, 8, 12]);
                let mut keys: Vec<Key> = Vec::with_capacity(len);
                for _ in 0..len {
                    let k = if !keys.is_empty() && self.rng.chance(15) {
                        keys[self.rng.index(keys.len())].clone()
                    } else if self.rng.chance(30) {
                        self.likely_key()
                    } else {
                        self.random_key()
                    };
                    keys.push(k);
                }
                Command::Allocate { space, rank, keys }
            }
            390..730 => self.random_confirm(),
            730..810 => Command::Exists { space, keys: self.random_keys(19) },
            810..910 => {
                let rank = self.random_rank();
                Command::Locations { space, rank, keys: self.random_keys(19) }
            }
            910..935 => Command::Delete { space, keys: self.random_keys(4) },
            935..955 => Command::Inspect { space, key: self.likely_key() },
            955..958 => Command::Clear { space },
            958..965 => {
                // Settings may change mid-run (the command log replays old settings); the TP
                // world does not, since a running deployment cannot change its TP size.
                self.settings.reservation_ttl = *self.rng.pick(&[0, 50, 200, 1_000, 5_000]);
                if self.mode == Mode::Ours {
                    let mut s = self.settings;
                    randomize(&mut self.rng, &mut s);
                    self.settings = s;
                }
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
        let s = self.settings;
        let longest = s.reservation_ttl.max(s.read_lease).max(s.quarantine).max(1);
        self.now += match self.rng.below(100) {
            0..55 => 0,
            55..97 => self.rng.below(40),
            _ => self.rng.below(3 * longest),
        };
    }

    fn step(&mut self) {
        self.advance_clock();
        let cmd = self.next_command();
        if matches!(cmd, Command::Clear { .. }) {
            let c = self.counters();
            self.cleared.add(&c);
        }
        // What the step needs to know about the state before the command.
        let deleted_before: Option<Vec<Option<KeyInfo>>> = match &cmd {
            Command::Delete { keys, .. } => Some(keys.iter().map(|k| self.inspect(k)).collect()),
            _ => None,
        };
        let universe_before: Option<Vec<Option<KeyInfo>>> = match &cmd {
            Command::Allocate { .. } if self.settings.eviction == Eviction::Lru => {
                let u = self.universe.clone();
                Some(u.iter().map(|k| self.inspect(k)).collect())
            }
            _ => None,
        };
        let counters_before = self.counters();
        let before: Option<Core> =
            (cmd.is_mutating() || matches!(cmd, Command::Stats | Command::Inspect { .. })).then(|| self.core.clone());
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
        if let Some(s) = before_snapshot {
            // Reads change nothing; `Stats` and `Inspect` let the clock act first, and nothing else.
            let want = match (&cmd, &before) {
                (Command::Stats | Command::Inspect { .. }, Some(b)) => expired_at(b, now),
                _ => s,
            };
            if snapshot(&self.core) != want {
                self.fail(&cmd, "a read changed the state");
            }
        }
        match &reply {
            Err(e) => {
                // (A refused read was checked above like every read.)
                if let Some(before) = before
                    && cmd.is_mutating()
                    && !refused_cleanly(&before, &self.core, now)
                {
                    self.fail(&cmd, &format!("refused with {e:?} but changed the state"));
                }
            }
            Ok(r) => {
                self.check_reply(&cmd, r, deleted_before, universe_before, counters_before);
            }
        }
        self.check_leases(&cmd);
    }

    fn check_reply(
        &mut self,
        cmd: &Command,
        reply: &Reply,
        deleted_before: Option<Vec<Option<KeyInfo>>>,
        universe_before: Option<Vec<Option<KeyInfo>>>,
        counters_before: Counters,
    ) {
        match (cmd, reply) {
            (Command::Allocate { rank, keys, .. }, Reply::Allocated(out)) => {
                self.last_batch = Some((*rank, keys.clone()));
                self.recent.extend(keys.iter().cloned());
                if self.recent.len() > 40 {
                    let extra = self.recent.len() - 40;
                    self.recent.drain(..extra);
                }
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
                // A leased page is never reassigned: no fresh page may be one a reader still holds.
                for &p in &pages {
                    let now = self.now;
                    if let Some(((_, _, k), end)) =
                        self.leases.iter().find(|((r, page, _), end)| *r == *rank && *page == p && **end > now)
                    {
                        self.fail(cmd, &format!("page {p} handed out while {k:?} holds a lease on it until {end}"));
                    }
                }
                let read_lease = self.core.settings().read_lease;
                for a in out {
                    let k = &keys[a.index as usize];
                    if a.cached {
                        // Still its page after the batch: a cache hit is never evicted by its batch.
                        let info = self.inspect(k);
                        let ok =
                            info.as_ref().is_some_and(|i| i.complete && i.pages.contains(&(*rank, a.page.unwrap())));
                        if !ok {
                            self.fail(cmd, &format!("cache hit {a:?} but inspect says {info:?}"));
                        }
                        self.lease(*rank, a.page.unwrap(), k, read_lease);
                    } else if let Some(p) = a.page {
                        self.pending.push((*rank, k.clone(), p));
                    }
                }
                if self.pending.len() > PENDING_CAP {
                    let extra = self.pending.len() - PENDING_CAP;
                    self.pending.drain(..extra);
                }
                if let Some(before) = universe_before {
                    self.check_evictions(cmd, *rank, keys, out, &before, counters_before);
                }
            }
            (Command::Exists { keys, .. }, Reply::Exists(flags)) => {
                if flags.len() != keys.len() {
                    self.fail(cmd, "exists answered the wrong number of flags");
                }
                // A complete key has a page on every rank of the world.
                let world: Vec<u32> = match self.settings.world_size {
                    Some(n) => (0..n).collect(),
                    None => self.ranks(),
                };
                for (k, &flag) in keys.iter().zip(flags) {
                    let info = self.inspect(k);
                    let complete = info.as_ref().is_some_and(|i| i.complete);
                    if complete != flag {
                        self.fail(cmd, &format!("exists says {flag} for {k:?}, inspect {info:?}"));
                    }
                    if flag {
                        let ranks: Vec<u32> = info.unwrap().pages.iter().map(|p| p.0).collect();
                        if ranks != world {
                            self.fail(cmd, &format!("complete key {k:?} has pages on {ranks:?}, world {world:?}"));
                        }
                    }
                }
            }
            (Command::Locations { rank, keys, .. }, Reply::Locations(v)) => {
                if v.len() != keys.len() {
                    self.fail(cmd, "get_locations answered the wrong number of pages");
                }
                let read_lease = self.core.settings().read_lease;
                for (k, &page) in keys.iter().zip(v) {
                    let info = self.inspect(k);
                    let want = info
                        .as_ref()
                        .filter(|i| i.complete)
                        .and_then(|i| i.pages.iter().find(|(r, _)| r == rank).map(|&(_, p)| p));
                    if page != want {
                        self.fail(cmd, &format!("get_locations says {page:?} for {k:?}, inspect {info:?}"));
                    }
                    if let Some(p) = page {
                        if read_lease > 0 && info.as_ref().is_some_and(|i| i.lease_remaining < read_lease) {
                            self.fail(cmd, &format!("{k:?} was just read but its lease is {info:?}"));
                        }
                        self.lease(*rank, p, k, read_lease);
                    }
                }
            }
            (Command::Delete { keys, .. }, Reply::Deleted(n)) => {
                let before = deleted_before.expect("inspected before the delete");
                let mut want = 0;
                for (i, (k, info)) in keys.iter().zip(&before).enumerate() {
                    if !keys[..i].contains(k) && info.as_ref().is_some_and(|i| !i.pages.is_empty()) {
                        want += 1;
                    }
                }
                if *n != want {
                    self.fail(cmd, &format!("deleted {n}, {want} of the keys had pages"));
                }
                for k in keys {
                    let info = self.inspect(k);
                    if info.as_ref().is_some_and(|i| !i.pages.is_empty()) {
                        self.fail(cmd, &format!("{k:?} still has pages after delete: {info:?}"));
                    }
                }
            }
            (Command::Inspect { key, .. }, Reply::Key(info)) => {
                let exists =
                    match self.core.apply(self.now, &Command::Exists { space: Space::Vllm, keys: vec![key.clone()] }) {
                        Ok(Reply::Exists(v)) => v[0],
                        other => self.fail(cmd, &format!("exists answered {other:?}")),
                    };
                if info.as_ref().is_some_and(|i| i.complete) != exists {
                    self.fail(cmd, &format!("inspect {info:?} but exists says {exists}"));
                }
                if let Some(i) = info {
                    let mut ranks: Vec<u32> = i.pages.iter().map(|p| p.0).collect();
                    ranks.dedup();
                    if ranks.len() != i.pages.len() || !ranks.is_sorted() {
                        self.fail(cmd, &format!("pages not in rank order: {i:?}"));
                    }
                    if i.pages.is_empty() && i.reservations == 0 {
                        self.fail(cmd, &format!("a stored key holds nothing: {i:?}"));
                    }
                    if i.evictable && i.lease_remaining > 0 {
                        self.fail(cmd, &format!("a leased key is evictable: {i:?}"));
                    }
                }
            }
            (Command::Initialize { rank, .. }, Reply::Initialized { outcome: InitOutcome::Recreated { .. }, .. }) => {
                // The rank's file layout changed: its old page numbers mean nothing any more.
                self.leases.retain(|(r, _, _), _| r != rank);
            }
            (Command::Clear { .. }, Reply::Cleared { .. }) => {
                if !self.core.stats().spaces.is_empty() {
                    self.fail(cmd, "clear left a space behind")
                }
                self.leases.clear();
            }
            _ => {}
        }
    }

    /// Records a lease the reply promised (none when leases are off).
    fn lease(&mut self, rank: u32, page: u32, key: &Key, duration: Millis) {
        if duration == 0 {
            return;
        }
        let end = self.now + duration;
        let e = self.leases.entry((rank, page, key.clone())).or_insert(end);
        *e = (*e).max(end);
    }

    /// An allocation that evicted keys: each evicted key had a page on this rank, was evictable
    /// and held no lease, was no cache hit of the batch; the counter counts exactly them.
    fn check_evictions(
        &mut self,
        cmd: &Command,
        rank: u32,
        keys: &[Key],
        out: &[kvpages_core::Allocation],
        before: &[Option<KeyInfo>],
        counters_before: Counters,
    ) {
        let hits: BTreeSet<&Key> = out.iter().filter(|a| a.cached).map(|a| &keys[a.index as usize]).collect();
        let mut evicted = 0;
        let u = self.universe.clone();
        for (k, b) in u.iter().zip(before) {
            let Some(b) = b.as_ref().filter(|b| !b.pages.is_empty()) else { continue };
            let after = self.inspect(k);
            if after.as_ref().is_some_and(|a| a.pages == b.pages) {
                continue;
            }
            if after.as_ref().is_some_and(|a| !a.pages.is_empty()) {
                self.fail(cmd, &format!("{k:?} changed pages {:?} -> {after:?} without being evicted", b.pages));
            }
            evicted += 1;
            if !b.pages.iter().any(|p| p.0 == rank) {
                self.fail(cmd, &format!("{k:?} evicted for rank {rank}, where it had no page ({b:?})"));
            }
            if !b.evictable || b.lease_remaining > 0 {
                self.fail(cmd, &format!("{k:?} evicted but it was not evictable: {b:?}"));
            }
            if hits.contains(k) {
                self.fail(cmd, &format!("{k:?} reported cached and evicted by the same batch"));
            }
        }
        let counted = self.counters().evictions - counters_before.evictions;
        if counted != evicted {
            self.fail(cmd, &format!("{evicted} keys lost their pages, evictions counter moved by {counted}"));
        }
    }

    /// The leased-page invariant, after every step: every running lease's page is still
    /// committed to its key (which then is not evictable and has at least that much lease
    /// left), or else quarantined: not free, and (checked at allocation) never handed out.
    fn check_leases(&mut self, cmd: &Command) {
        let now = self.now;
        self.leases.retain(|_, end| *end > now);
        if self.leases.is_empty() {
            return;
        }
        let mut free: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        let mut quarantined: BTreeMap<u32, u32> = BTreeMap::new();
        if let Some(sp) = self.core.stats().spaces.first() {
            for r in &sp.ranks {
                free.insert(r.rank, self.core.free_list(&Space::Vllm, r.rank).unwrap().into_iter().collect());
                quarantined.insert(r.rank, r.pages.quarantined);
            }
        }
        let mut displaced: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        let leases: Vec<((u32, u32, Key), Millis)> = self.leases.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for ((rank, page, key), end) in leases {
            self.leases_checked += 1;
            let Some(f) = free.get(&rank) else {
                self.fail(cmd, &format!("rank {rank} vanished under a lease of {key:?} on page {page}"));
            };
            if f.contains(&page) {
                self.fail(cmd, &format!("rank {rank} page {page} is free while {key:?} holds a lease until {end}"));
            }
            let info = self.inspect(&key);
            match info.as_ref().filter(|i| i.pages.contains(&(rank, page))) {
                Some(i) => {
                    if i.evictable || i.lease_remaining < end - now {
                        self.fail(cmd, &format!("{key:?} leased until {end} but inspect says {i:?}"));
                    }
                }
                None => {
                    displaced.entry(rank).or_default().insert(page);
                }
            }
        }
        for (rank, pages) in displaced {
            self.leased_quarantined += pages.len() as u64;
            let q = quarantined.get(&rank).copied().unwrap_or(0);
            if pages.len() as u32 > q {
                self.fail(
                    cmd,
                    &format!("rank {rank}: leased pages {pages:?} left their keys but only {q} pages are quarantined"),
                );
            }
        }
    }
}

/// Random lease, quarantine, eviction and watermark settings (kvpages' own).
fn randomize(rng: &mut Rng, s: &mut Settings) {
    s.read_lease = *rng.pick(&[0, 20, 100, 500, 2_000]);
    s.quarantine = *rng.pick(&[0, 50, s.reservation_ttl, 2 * s.reservation_ttl]);
    s.eviction = if rng.chance(80) { Eviction::Lru } else { Eviction::Off };
    let (high, low) = *rng.pick(&[(950, 900), (950, 900), (1000, 1000), (800, 500), (700, 700)]);
    s.evict_high_permille = high;
    s.evict_low_permille = low;
}

fn run(seed: u64, mode: Mode, steps: u64) -> Scenario {
    println!("scenario seed {seed:#x} ({mode:?}), {steps} steps (replay: KVPAGES_SEED={seed:#x})");
    let mut s = Scenario::new(seed, mode);
    for step in 0..steps {
        s.step = step;
        s.step();
    }
    println!(
        "  counters over the run: {:?}; {} running leases checked, {} leased pages seen quarantined",
        s.total_counters(),
        s.leases_checked,
        s.leased_quarantined
    );
    s
}

/// The main seed (`KVPAGES_SEED`, `KVPAGES_STEPS` steps) and the fixed ones, under `mode`.
fn run_seeds(mode: Mode) {
    let seeds = common::seeds(DEFAULT_SEED, &FIXED_SEEDS);
    for (i, &seed) in seeds.iter().enumerate() {
        let steps = if i == 0 { common::steps(MAIN_STEPS) } else { EXTRA_STEPS };
        run(seed, mode, steps);
    }
}

#[test]
fn random_scenarios_keep_every_invariant_under_the_peer_settings() {
    run_seeds(Mode::Peer);
}

#[test]
fn random_scenarios_keep_every_invariant_with_leases_quarantine_and_eviction() {
    run_seeds(Mode::Ours);
}

/// The scenario exercises what it claims to: every kind of event happens under each seed.
#[test]
fn random_scenarios_reach_every_rule() {
    for seed in [DEFAULT_SEED, FIXED_SEEDS[0], FIXED_SEEDS[1]] {
        for mode in [Mode::Peer, Mode::Ours] {
            let s = run(seed, mode, 15_000);
            let t = s.total_counters();
            // Every counter; eviction and quarantine only where they are on.
            let ours_only = ["evictions", "quarantined_pages"];
            let mut want: Vec<(&str, u64)> =
                t.named().into_iter().filter(|(name, _)| mode == Mode::Ours || !ours_only.contains(name)).collect();
            if mode == Mode::Ours {
                want.extend([
                    ("running leases checked", s.leases_checked),
                    ("leased pages seen quarantined", s.leased_quarantined),
                ]);
            } else {
                for (name, n) in [("evictions", t.evictions), ("quarantined_pages", t.quarantined_pages)] {
                    assert_eq!(n, 0, "seed {seed:#x} (Peer): {name} under the peer's settings ({t:?})");
                }
            }
            for (name, n) in want {
                assert!(n > 0, "seed {seed:#x} ({mode:?}): the scenario never produced {name} ({t:?})");
            }
        }
    }
}

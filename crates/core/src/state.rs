//! The state machine: [`Core::apply`] runs one command against every space's pools and keys.

use alloc::collections::{BTreeMap, VecDeque};
use alloc::string::String;
use alloc::vec::Vec;
use core::hash::BuildHasher;

use hashbrown::HashTable;

use crate::command::*;
use crate::error::{Error, PagePlace};
use crate::key::Key;
use crate::keys::KeyTable;
use crate::pool::{GEN_MASK, Page, PageState, Pool, PoolOrder};

/// A pending reservation, queued in deadline order (the TTL is fixed, so creation order).
#[derive(Clone, Copy, Debug)]
struct Reservation {
    deadline: Millis,
    rank: u32,
    page: u32,
    generation: u64,
}

/// One space's pools, keys and pending reservations.
#[derive(Clone, Debug)]
struct SpaceState {
    order: PoolOrder,
    ranks: BTreeMap<u32, Pool>,
    keys: KeyTable,
    /// Reservations by deadline; entries whose page moved on are skipped by generation.
    reservations: VecDeque<Reservation>,
    /// Reservation generations, so a stale expiry record never ends a newer reservation.
    next_generation: u64,
    counters: Counters,
}

/// The deterministic kvpages state machine.
///
/// Same seed and same `(now, Command)` sequence ⇒ same replies and same state, on every target.
#[derive(Clone, Debug)]
pub struct Core {
    seed: u64,
    settings: Settings,
    spaces: BTreeMap<Space, SpaceState>,
}

impl Core {
    /// An empty core. `seed` keys the hash tables (the core has no randomness of its own).
    pub fn new(seed: u64, settings: Settings) -> Core {
        Core { seed, settings, spaces: BTreeMap::new() }
    }

    /// The settings in force.
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Applies one command at time `now`. An `Err` means the command applied nothing.
    ///
    /// Time passing is not part of any command: reservations whose deadline is `<= now` may
    /// have expired by the time a command is answered, `Ok` or `Err`. That is a function of
    /// `now` alone, so replaying the same `(now, Command)` sequence gives the same state.
    pub fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, Error> {
        match cmd {
            Command::Configure(s) => {
                if let Some(world_size) = s.world_size {
                    let outside = self.spaces.values().filter_map(|sp| sp.ranks.keys().next_back()).max();
                    if let Some(&rank) = outside.filter(|&&r| r >= world_size) {
                        return Err(Error::RankOutsideWorld { rank, world_size });
                    }
                }
                self.settings = *s;
                Ok(Reply::Configured)
            }
            Command::Initialize { space, rank, num_pages } => self.initialize(now, space, *rank, *num_pages),
            Command::Allocate { space, rank, keys } => self.allocate(now, space, *rank, keys),
            Command::Confirm { space, rank, confirmations, releases } => {
                self.confirm(now, space, *rank, confirmations, releases)
            }
            Command::Exists { space, keys } => Ok(Reply::Exists(self.exists(space, keys))),
            Command::Locations { space, rank, keys } => self.locations(space, *rank, keys),
            Command::Clear { space } => Ok(self.clear(space)),
            Command::Stats => Ok(Reply::Stats(alloc::boxed::Box::new(self.stats()))),
        }
    }

    fn world_count(settings: &Settings, sp: &SpaceState) -> u32 {
        settings.world_size.unwrap_or(sp.ranks.len() as u32)
    }

    fn is_complete(world: u32, pages: usize) -> bool {
        world > 0 && pages == world as usize
    }

    fn space_mut(&mut self, space: &Space, now: Millis) -> Option<&mut SpaceState> {
        let sp = self.spaces.get_mut(space)?;
        expire(sp, now);
        Some(sp)
    }

    fn initialize(&mut self, now: Millis, space: &Space, rank: u32, num_pages: u32) -> Result<Reply, Error> {
        if num_pages == 0 {
            return Err(Error::ZeroPages { rank });
        }
        if let Some(world_size) = self.settings.world_size
            && rank >= world_size
        {
            return Err(Error::RankOutsideWorld { rank, world_size });
        }
        let seed = self.seed;
        let sp = self.spaces.entry(space.clone()).or_insert_with(|| SpaceState {
            order: match space {
                Space::Vllm => PoolOrder::Fifo,
            },
            ranks: BTreeMap::new(),
            keys: KeyTable::new(seed),
            reservations: VecDeque::new(),
            next_generation: 0,
            counters: Counters::default(),
        });
        expire(sp, now);
        let outcome = match sp.ranks.get(&rank) {
            None => {
                let joined_after_keys = sp.ranks.values().any(|p| p.counts().committed > 0);
                sp.ranks.insert(rank, Pool::new(num_pages, sp.order));
                InitOutcome::Created { joined_after_keys }
            }
            Some(p) if p.num_pages() == num_pages => InitOutcome::Unchanged,
            Some(_) => {
                let old = sp.ranks.insert(rank, Pool::new(num_pages, sp.order)).expect("rank exists");
                let mut dropped = Vec::new();
                let mut unreserved = Vec::new();
                for (_, page) in old.used_pages() {
                    match page {
                        Page::Committed { slot } => dropped.push(slot),
                        Page::Reserved { slot, .. } => unreserved.push(slot),
                        Page::Free => {}
                    }
                }
                for &slot in &unreserved {
                    sp.keys.get_mut(slot).reservations -= 1;
                }
                for &slot in &dropped {
                    let pages = core::mem::take(&mut sp.keys.get_mut(slot).pages);
                    for (r, page) in pages.iter() {
                        if r != rank {
                            sp.ranks.get_mut(&r).expect("key's rank exists").free(page);
                        }
                    }
                }
                // A key can hold several of the old pages (two writers), so a slot may appear
                // more than once; releasing it twice would touch a vacant slot.
                let mut touched: Vec<u32> = dropped.iter().chain(&unreserved).copied().collect();
                touched.sort_unstable();
                touched.dedup();
                for slot in touched {
                    sp.keys.release_if_unused(slot);
                }
                sp.counters.dropped_keys += dropped.len() as u64;
                InitOutcome::Recreated { old_num_pages: old.num_pages(), dropped_keys: dropped.len() as u32 }
            }
        };
        Ok(Reply::Initialized { rank, num_pages, outcome })
    }

    fn allocate(&mut self, now: Millis, space: &Space, rank: u32, keys: &[Key]) -> Result<Reply, Error> {
        let settings = self.settings;
        let Some(sp) = self.space_mut(space, now) else {
            return Err(Error::RankNotInitialized { rank });
        };
        let world = Self::world_count(&settings, sp);
        let SpaceState { ranks, keys: table, reservations, next_generation, counters, .. } = sp;
        let Some(pool) = ranks.get_mut(&rank) else {
            return Err(Error::RankNotInitialized { rank });
        };

        // One entry per distinct key, at its first position.
        let distinct = distinct_indices(table.hasher(), keys);
        // The existing page of every key that is complete and stored on this rank.
        let hits: Vec<Option<u32>> = distinct
            .iter()
            .map(|&i| {
                let slot = table.find(&keys[i as usize])?;
                let e = table.get(slot);
                if Self::is_complete(world, e.pages.len()) { e.pages.get(rank) } else { None }
            })
            .collect();

        let mut out = Vec::with_capacity(distinct.len());
        if pool.counts().free as usize >= distinct.len() {
            // The peer takes one page per key first, then returns the pages of cache hits to
            // the back of the free list, in key order.
            let taken: Vec<u32> = (0..distinct.len())
                .map(|_| pool.take(PageState::reserved(u32::MAX, 0)).expect("enough free pages"))
                .collect();
            for ((&index, hit), page) in distinct.iter().zip(hits).zip(taken) {
                if let Some(existing) = hit {
                    pool.free(page);
                    counters.cache_hits += 1;
                    out.push(Allocation { index, page: Some(existing), cached: true });
                } else {
                    let slot = table.find_or_insert(&keys[index as usize]);
                    table.get_mut(slot).reservations += 1;
                    let generation = *next_generation;
                    *next_generation += 1;
                    pool.mark(page, PageState::reserved(slot, generation));
                    reservations.push_back(Reservation {
                        deadline: now.saturating_add(settings.reservation_ttl),
                        rank,
                        page,
                        generation,
                    });
                    counters.reserved += 1;
                    out.push(Allocation { index, page: Some(page), cached: false });
                }
            }
        } else {
            for (&index, hit) in distinct.iter().zip(hits) {
                match hit {
                    Some(_) => counters.cache_hits += 1,
                    None => counters.misses += 1,
                }
                out.push(Allocation { index, page: hit, cached: hit.is_some() });
            }
        }
        Ok(Reply::Allocated(out))
    }

    fn confirm(
        &mut self,
        now: Millis,
        space: &Space,
        rank: u32,
        confirmations: &[(Key, u32)],
        releases: &[u32],
    ) -> Result<Reply, Error> {
        let Some(sp) = self.spaces.get(space) else {
            return Err(Error::RankNotInitialized { rank });
        };
        let Some(pool) = sp.ranks.get(&rank) else {
            return Err(Error::RankNotInitialized { rank });
        };
        let num_pages = pool.num_pages();
        let out_of_range = confirmations
            .iter()
            .enumerate()
            .map(|(i, c)| (c.1, PagePlace::Confirmation(i as u32)))
            .chain(releases.iter().enumerate().map(|(i, &p)| (p, PagePlace::Release(i as u32))))
            .find(|(p, _)| *p >= num_pages);
        if let Some((page, place)) = out_of_range {
            return Err(Error::PageOutOfRange { rank, page, num_pages, place });
        }

        let sp = self.space_mut(space, now).expect("space exists");
        let SpaceState { ranks, keys: table, counters, .. } = sp;
        let pool = ranks.get_mut(&rank).expect("rank exists");
        let verdict = |pool: &Pool, table: &KeyTable, key: &Key, page: u32| -> Result<(), Refusal> {
            let slot = table.find(key);
            match pool.state(page) {
                Page::Free => Err(Refusal::NotReserved),
                Page::Reserved { slot: s, .. } if Some(s) == slot => Ok(()),
                Page::Reserved { .. } => Err(Refusal::ReservedForAnotherKey),
                Page::Committed { slot: s } if Some(s) == slot => Ok(()),
                Page::Committed { .. } => Err(Refusal::CommittedToAnotherKey),
            }
        };
        // Refused pairs change nothing, so the first pair acceptable now is accepted when its
        // turn comes: "every pair refused" can be decided before anything is applied.
        if !confirmations.is_empty() && confirmations.iter().all(|(k, p)| verdict(pool, table, k, *p).is_err()) {
            let refused = confirmations
                .iter()
                .enumerate()
                .map(|(i, (k, p))| Refused {
                    index: i as u32,
                    page: *p,
                    reason: verdict(pool, table, k, *p).expect_err("all refused"),
                })
                .collect();
            return Err(Error::NothingConfirmed { refused });
        }

        let mut report = ConfirmReport::default();
        for (i, (key, page)) in confirmations.iter().enumerate() {
            let page = *page;
            if let Err(reason) = verdict(pool, table, key, page) {
                report.refused.push(Refused { index: i as u32, page, reason });
                continue;
            }
            let slot = table.find(key).expect("accepted pairs name a stored key");
            match pool.state(page) {
                Page::Committed { .. } => report.unchanged += 1,
                _ => {
                    let e = table.get_mut(slot);
                    e.reservations -= 1;
                    if e.pages.get(rank).is_some() {
                        // Another writer committed this key on this rank first.
                        pool.free(page);
                        report.superseded += 1;
                    } else {
                        e.pages.insert(rank, page);
                        pool.mark(page, PageState::committed(slot));
                        report.committed += 1;
                    }
                }
            }
        }
        for &page in releases {
            match pool.state(page) {
                Page::Reserved { slot, .. } => {
                    pool.free(page);
                    table.get_mut(slot).reservations -= 1;
                    table.release_if_unused(slot);
                    report.released += 1;
                }
                Page::Free => report.ignored_releases.push((page, IgnoredRelease::AlreadyFree)),
                Page::Committed { .. } => report.ignored_releases.push((page, IgnoredRelease::Committed)),
            }
        }
        counters.committed += u64::from(report.committed);
        counters.superseded += u64::from(report.superseded);
        counters.refused_confirms += report.refused.len() as u64;
        counters.released += u64::from(report.released);
        counters.ignored_releases += report.ignored_releases.len() as u64;
        Ok(Reply::Confirmed(report))
    }

    fn exists(&self, space: &Space, keys: &[Key]) -> Vec<bool> {
        let Some(sp) = self.spaces.get(space) else {
            return alloc::vec![false; keys.len()];
        };
        let world = Self::world_count(&self.settings, sp);
        keys.iter()
            .map(|k| sp.keys.find(k).is_some_and(|s| Self::is_complete(world, sp.keys.get(s).pages.len())))
            .collect()
    }

    fn locations(&self, space: &Space, rank: u32, keys: &[Key]) -> Result<Reply, Error> {
        let sp = self.spaces.get(space).filter(|sp| sp.ranks.contains_key(&rank));
        let Some(sp) = sp else {
            return Err(Error::RankNotInitialized { rank });
        };
        let world = Self::world_count(&self.settings, sp);
        let pages = keys
            .iter()
            .map(|k| {
                let e = sp.keys.get(sp.keys.find(k)?);
                if Self::is_complete(world, e.pages.len()) { e.pages.get(rank) } else { None }
            })
            .collect();
        Ok(Reply::Locations(pages))
    }

    fn clear(&mut self, space: &Space) -> Reply {
        match self.spaces.remove(space) {
            Some(sp) => Reply::Cleared { ranks: sp.ranks.len() as u32, keys: sp.keys.len() as u64 },
            None => Reply::Cleared { ranks: 0, keys: 0 },
        }
    }

    /// Figures for every space; O(spaces + ranks).
    pub fn stats(&self) -> Stats {
        let spaces = self
            .spaces
            .iter()
            .map(|(space, sp)| SpaceStats {
                space: space.clone(),
                keys: sp.keys.len() as u64,
                world_size: Self::world_count(&self.settings, sp),
                ranks: sp
                    .ranks
                    .iter()
                    .map(|(&rank, p)| RankStats { rank, num_pages: p.num_pages(), pages: p.counts() })
                    .collect(),
                counters: sp.counters,
            })
            .collect();
        Stats { settings: self.settings, spaces }
    }

    /// The free list of one rank in hand-out order. O(pool): for tests and debugging.
    pub fn free_list(&self, space: &Space, rank: u32) -> Option<Vec<u32>> {
        Some(self.spaces.get(space)?.ranks.get(&rank)?.free_list())
    }

    /// Checks every invariant of the state; O(state), for tests and debugging.
    ///
    /// Per rank: free + reserved + committed = num_pages and the free queue holds exactly the
    /// free pages; no page is owned by two keys; every key's page points back at that key;
    /// every reserved page belongs to a stored key whose reservation count matches.
    pub fn check_invariants(&self) -> Result<(), String> {
        use alloc::format;
        for (space, sp) in &self.spaces {
            sp.keys.check().map_err(|e| format!("{space:?} keys: {e}"))?;
            let mut reserved_per_slot: BTreeMap<u32, u32> = BTreeMap::new();
            for (&rank, pool) in &sp.ranks {
                pool.check().map_err(|e| format!("{space:?} rank {rank}: {e}"))?;
                for (page, state) in pool.used_pages() {
                    match state {
                        Page::Committed { slot } => {
                            let e = sp.keys.get_live(slot);
                            let Some(e) = e else {
                                return Err(format!(
                                    "{space:?} rank {rank} page {page} committed to a vacant slot {slot}"
                                ));
                            };
                            if e.pages.get(rank) != Some(page) {
                                return Err(format!(
                                    "{space:?} rank {rank} page {page} is committed to {:?}, which points at {:?}",
                                    e.key,
                                    e.pages.get(rank)
                                ));
                            }
                        }
                        Page::Reserved { slot, generation } => {
                            *reserved_per_slot.entry(slot).or_default() += 1;
                            let pending = sp.reservations.iter().any(|r| {
                                r.rank == rank && r.page == page && (r.generation & GEN_MASK) as u32 == generation
                            });
                            if !pending {
                                return Err(format!("{space:?} rank {rank} page {page} is reserved with no deadline"));
                            }
                        }
                        Page::Free => {}
                    }
                }
            }
            for (slot, e) in sp.keys.entries() {
                for (rank, page) in e.pages.iter() {
                    let Some(pool) = sp.ranks.get(&rank) else {
                        return Err(format!("{space:?} key {:?} has a page on missing rank {rank}", e.key));
                    };
                    if page >= pool.num_pages() || pool.state(page) != (Page::Committed { slot }) {
                        return Err(format!(
                            "{space:?} key {:?} points at rank {rank} page {page}, which is not its own",
                            e.key
                        ));
                    }
                }
                let counted = reserved_per_slot.get(&slot).copied().unwrap_or(0);
                if counted != e.reservations {
                    return Err(format!(
                        "{space:?} key {:?} counts {} reservations, pools hold {counted}",
                        e.key, e.reservations
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Ends every reservation whose deadline is `<= now`: its page goes back to the free list.
fn expire(sp: &mut SpaceState, now: Millis) {
    while let Some(r) = sp.reservations.front().copied() {
        if r.deadline > now {
            break;
        }
        sp.reservations.pop_front();
        let Some(pool) = sp.ranks.get_mut(&r.rank) else { continue };
        if r.page >= pool.num_pages() {
            continue;
        }
        if let Page::Reserved { slot, generation } = pool.state(r.page)
            && generation == (r.generation & GEN_MASK) as u32
        {
            pool.free(r.page);
            sp.keys.get_mut(slot).reservations -= 1;
            sp.keys.release_if_unused(slot);
            sp.counters.expired_reservations += 1;
        }
    }
    // A burst of reservations leaves a large, mostly empty queue behind; give the memory back
    // (amortised O(1): this copies len entries only after 3/4 of the capacity was drained).
    let q = &mut sp.reservations;
    if q.capacity() > 1024 && q.len() * 4 < q.capacity() {
        q.shrink_to(q.len() * 2);
    }
}

/// Indices of the first occurrence of each distinct key, in order; O(batch).
fn distinct_indices(hasher: &crate::keys::Hasher, keys: &[Key]) -> Vec<u32> {
    let mut seen: HashTable<u32> = HashTable::with_capacity(keys.len());
    let mut out = Vec::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        let hash = hasher.hash_one(k);
        let dup = seen.find(hash, |&j| keys[j as usize] == *k).is_some();
        if !dup {
            seen.insert_unique(hash, i as u32, |&j| hasher.hash_one(&keys[j as usize]));
            out.push(i as u32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_size_that_leaves_a_rank_outside_is_refused() {
        let mut core = Core::new(1, Settings::default());
        for rank in 0..3 {
            core.apply(0, &Command::Initialize { space: Space::Vllm, rank, num_pages: 4 }).unwrap();
        }
        let small = Settings { world_size: Some(2), ..Settings::default() };
        assert_eq!(
            core.apply(0, &Command::Configure(small)),
            Err(Error::RankOutsideWorld { rank: 2, world_size: 2 })
        );
        assert_eq!(core.settings(), Settings::default());
        let fits = Settings { world_size: Some(3), ..Settings::default() };
        assert_eq!(core.apply(0, &Command::Configure(fits)), Ok(Reply::Configured));
    }
}

//! Time passing: reservations that run out (their pages quarantined or freed), quarantines and
//! read leases that end, all drained in deadline order so when a drain happens never matters.

use alloc::collections::VecDeque;
use alloc::vec::Vec;

use super::{Deadlines, PageDeadline, SpaceState};
use crate::command::{Millis, Settings};
use crate::pool::{GEN_MASK, Page, PageState, Pool};

impl Deadlines {
    pub(super) fn new() -> Self {
        Deadlines(VecDeque::new())
    }

    /// Queues `item`, raising its deadline to the last one if needed; returns the deadline used.
    pub(super) fn push(&mut self, mut item: PageDeadline) -> Millis {
        if let Some(last) = self.0.back() {
            item.at = item.at.max(last.at);
        }
        self.0.push_back(item);
        item.at
    }

    fn due(&self, now: Millis) -> Option<Millis> {
        self.0.front().map(|d| d.at).filter(|&at| at <= now)
    }

    fn pop(&mut self) -> Option<PageDeadline> {
        self.0.pop_front()
    }

    /// Gives back the memory of a drained burst (amortised O(1): copies only after 3/4 of the
    /// capacity was drained).
    fn shrink(&mut self) {
        if self.0.capacity() > 1024 && self.0.len() * 4 < self.0.capacity() {
            self.0.shrink_to(self.0.len() * 2);
        }
    }
}

/// Stale reservation deadlines tolerated beyond the live ones before they are dropped.
const STALE_DEADLINES: usize = 4096;

impl SpaceState {
    /// Applies every deadline `<= now`, in deadline order across the queues (ties: reservations,
    /// then expiry quarantine, then lease quarantine), so draining at t1 and then t2 ends in the
    /// same state as draining once at t2.
    pub(super) fn expire(&mut self, settings: &Settings, now: Millis) {
        loop {
            let due = [self.reservations.due(now), self.expired.due(now), self.held.due(now)];
            let Some((which, _)) =
                due.iter().enumerate().filter_map(|(i, at)| at.map(|at| (i, at))).min_by_key(|&(i, at)| (at, i))
            else {
                break;
            };
            match which {
                0 => {
                    let d = self.reservations.pop().expect("due");
                    self.end_reservation(settings, d);
                }
                1 => {
                    let d = self.expired.pop().expect("due");
                    self.end_quarantine(d);
                }
                _ => {
                    let d = self.held.pop().expect("due");
                    self.end_quarantine(d);
                }
            }
        }
        let mut ended = Vec::new();
        while let Some((_, slot)) = self.leases.pop_due(now) {
            let until = self.leases.until(slot);
            if until > now {
                // Extended since this entry was queued: it ends later.
                self.leases.start(until, slot);
            } else {
                ended.push(slot);
            }
        }
        // Each ending lease finds its key's candidate place through its recency neighbours;
        // when a large share of the keys' leases end at once (`LeaseAll` after a recovery ends
        // every lease in one drain, in slot order), one pass over the recency list is cheaper.
        let rebuild = ended.len() > 1024 && ended.len() * 8 > self.keys.committed_len();
        for &slot in &ended {
            self.set_unleased(slot, !rebuild);
        }
        if rebuild {
            let leases = &self.leases;
            self.keys.rebuild_candidates(|slot| leases.until(slot) > 0);
        }
        self.reservations.shrink();
        self.expired.shrink();
        self.held.shrink();
    }

    /// Whether `d`, a deadline of `pool`'s rank, still names a reserved page (the reservation
    /// it was queued for).
    fn reservation_is_live(pool: &Pool, d: &PageDeadline) -> bool {
        d.page < pool.num_pages()
            && matches!(pool.state(d.page), Page::Reserved { generation, .. } if generation == (d.generation & GEN_MASK) as u32)
    }

    /// Drops the deadlines of reservations that were confirmed or released (expiry would skip
    /// them) once they outnumber the live ones by [`STALE_DEADLINES`]: a confirmed page's
    /// deadline would otherwise stay queued for the whole reservation TTL (at a million saves a
    /// second and the 60 s default, ~1.4 GB of them). Order is kept; amortised O(1) a push.
    pub(super) fn compact_reservations(&mut self) {
        let live: usize = self.ranks.values().map(|p| p.counts().reserved as usize).sum();
        if self.reservations.0.len() <= 2 * live + STALE_DEADLINES {
            return;
        }
        // Runs of deadlines share a rank: its pool is looked up once a run, not once a
        // deadline (a map search per deadline was most of this through the plugin).
        let mut pool: Option<(u32, Option<&Pool>)> = None;
        let ranks = &self.ranks;
        self.reservations.0.retain(|d| {
            let p = match pool {
                Some((rank, p)) if rank == d.rank => p,
                _ => pool.insert((d.rank, ranks.get(&d.rank))).1,
            };
            p.is_some_and(|p| SpaceState::reservation_is_live(p, d))
        });
        self.reservations.shrink();
    }

    fn end_reservation(&mut self, settings: &Settings, d: PageDeadline) {
        let Some(pool) = self.ranks.get_mut(&d.rank) else { return };
        if d.page >= pool.num_pages() {
            return;
        }
        let Page::Reserved { slot, generation } = pool.state(d.page) else { return };
        if generation != (d.generation & GEN_MASK) as u32 {
            return;
        }
        self.counters.expired_reservations += 1;
        if settings.quarantine > 0 {
            let generation = self.next_generation;
            self.next_generation += 1;
            pool.mark(d.page, PageState::quarantined(generation));
            self.expired.push(PageDeadline { at: d.at.saturating_add(settings.quarantine), generation, ..d });
            self.counters.quarantined_pages += 1;
        } else {
            pool.free(d.page);
        }
        self.keys.get_mut(slot).reservations -= 1;
        self.keys.release_if_unused(slot);
    }

    fn end_quarantine(&mut self, d: PageDeadline) {
        let Some(pool) = self.ranks.get_mut(&d.rank) else { return };
        if d.page < pool.num_pages()
            && pool.state(d.page) == (Page::Quarantined { generation: (d.generation & GEN_MASK) as u32 })
        {
            pool.free(d.page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Allocation, Command, Reply, Space};
    use crate::key::Key;
    use crate::state::Core;
    use crate::state::tests::{candidates, store, stored_core};
    use alloc::vec;

    #[test]
    fn a_wave_of_lease_ends_rebuilds_the_candidates_in_recency_order() {
        // LeaseAll (as after a recovery), with recency unrelated to slot order: every lease
        // ends in one drain, which rebuilds the candidate list in one pass.
        let v = Space::Vllm;
        let (mut core, keys, _) = stored_core(Settings { read_lease: 1_000, ..Settings::default() }, 4_096, 3_000);
        // Reads (lease 0: none) in a scrambled order make the recency order differ from slots.
        core.apply(1, &Command::Configure(Settings { read_lease: 0, ..Settings::default() })).unwrap();
        let scrambled: Vec<Key> = (0..3_000).map(|i| keys[(i * 1_237) % 3_000].clone()).collect();
        core.apply(1, &Command::Locations { space: v.clone(), rank: 0, keys: scrambled.clone() }).unwrap();
        core.apply(2, &Command::Configure(Settings { read_lease: 1_000, ..Settings::default() })).unwrap();
        assert_eq!(core.apply(2, &Command::LeaseAll), Ok(Reply::Leased(3_000)));
        assert!(candidates(&core, &v).is_empty());
        core.apply(1_002, &Command::Delete { space: v.clone(), keys: vec![Key::parse("none").unwrap()] }).unwrap();
        let want: Vec<u32> = scrambled.iter().map(|k| core.spaces[&v].keys.find(k).unwrap()).collect();
        assert_eq!(candidates(&core, &v), want);
        core.check_invariants().unwrap();
    }

    #[test]
    fn when_leases_end_does_not_change_what_is_evicted() {
        // Two extended leases whose queued ends come due in one drain or in two (a read drains):
        // the same key is evicted either way (the least recently used one).
        let v = Space::Vllm;
        let mut core = Core::new(1, Settings { read_lease: 100, quarantine: 0, ..Settings::default() });
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 2 }).unwrap();
        let (a, b) = (Key::parse("a").unwrap(), Key::parse("b").unwrap());
        let pages = store(&mut core, 0, &v, &[a.clone(), b.clone()]);
        let read = |core: &mut Core, now: Millis, k: &Key| {
            core.apply(now, &Command::Locations { space: v.clone(), rank: 0, keys: vec![k.clone()] }).unwrap();
        };
        read(&mut core, 0, &a);
        read(&mut core, 80, &b);
        read(&mut core, 90, &a); // a is the most recently used; its queued end (100) is stale
        let mut other = core.clone();
        other.apply(150, &Command::Stats).unwrap();
        let c = Key::parse("c").unwrap();
        let alloc = Command::Allocate { space: v.clone(), rank: 0, keys: vec![c] };
        let want = Ok(Reply::Allocated(vec![Allocation { index: 0, page: Some(pages[1]), cached: false }]));
        assert_eq!(core.apply(300, &alloc), want, "b is the least recently used");
        assert_eq!(other.apply(300, &alloc), want);
        assert_eq!(candidates(&core, &v), candidates(&other, &v));
        #[cfg(feature = "serde")]
        assert_eq!(core.snapshot(), other.snapshot());
    }

    #[test]
    fn confirmed_reservations_do_not_keep_their_deadlines_and_a_pending_one_still_expires() {
        let v = Space::Vllm;
        let mut core = Core::new(1, Settings::default());
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 100_000 }).unwrap();
        let pending = Key::parse("pending").unwrap();
        core.apply(0, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![pending.clone()] }).unwrap();
        for i in 0..20_000u32 {
            let key = Key::parse(&alloc::format!("k{i}")).unwrap();
            let Ok(Reply::Allocated(a)) =
                core.apply(1, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![key.clone()] })
            else {
                panic!("allocate")
            };
            let confirmations = vec![(key, a[0].page.unwrap())];
            core.apply(1, &Command::Confirm { space: v.clone(), rank: 0, confirmations, releases: vec![] }).unwrap();
        }
        // 20,001 deadlines were queued; one reservation is live.
        let queued = core.spaces[&v].reservations.0.len();
        assert!(queued <= 2 + STALE_DEADLINES, "{queued} deadlines queued for 1 live reservation");
        core.check_invariants().unwrap();
        // The pending reservation still ends at its TTL, not before.
        let ttl = Settings::default().reservation_ttl;
        let touch = |core: &mut Core, now: Millis| {
            core.apply(now, &Command::Locations { space: Space::Vllm, rank: 0, keys: vec![] }).unwrap();
        };
        touch(&mut core, ttl - 1);
        assert_eq!(core.spaces[&v].counters.expired_reservations, 0);
        touch(&mut core, ttl);
        assert_eq!(core.spaces[&v].counters.expired_reservations, 1);
        core.check_invariants().unwrap();
    }
}

//! Taking committed pages back from their keys: least-recently-used eviction when a rank runs
//! short, and delete. Pages a reader still holds a lease on wait in quarantine until it ends.

use super::{Core, PageDeadline, SpaceState, distinct_indices, is_complete, missing_space, world_count};
use crate::command::{Millis, Settings, Space};
use crate::error::Error;
use crate::key::Key;
use crate::pool::PageState;

impl SpaceState {
    /// Takes every committed page from `slot` (except on `gone_rank`, whose pool was replaced):
    /// pages a reader still holds a lease on are quarantined until the lease ends, the rest are
    /// free at once.
    pub(super) fn drop_pages(&mut self, slot: u32, gone_rank: Option<u32>) {
        let lease_until = self.leases.until(slot);
        let pages = core::mem::take(&mut self.keys.get_mut(slot).pages);
        for (rank, page) in pages.iter() {
            if Some(rank) == gone_rank {
                continue;
            }
            let pool = self.ranks.get_mut(&rank).expect("key's rank exists");
            if lease_until > 0 {
                pool.add_leased(-1);
                let generation = self.next_generation;
                self.next_generation += 1;
                pool.mark(page, PageState::quarantined(generation));
                self.held.push(PageDeadline { at: lease_until, rank, page, generation });
                self.counters.quarantined_pages += 1;
            } else {
                pool.free(page);
            }
        }
        if lease_until > 0 {
            self.leases.set_until(slot, 0);
            self.leases.forget(slot);
        }
        self.keys.unlink(slot);
        self.keys.release_if_unused(slot);
    }

    pub(super) fn evictable(&self, settings: &Settings, world: u32, slot: u32, now: Millis) -> bool {
        if self.leases.until(slot) > now {
            return false;
        }
        let e = self.keys.get(slot);
        is_complete(world, e.pages.len()) || now / 1000 > u64::from(e.since_s) + settings.reservation_ttl.div_ceil(1000)
    }

    /// Evicts least-recently-used keys with a page on `rank` until `need` pages are free and
    /// `need` more would keep usage at or under the low watermark. O(evicted + skipped).
    ///
    /// `protected`: the oldest of the batch's cache hits, which were just made the most recently
    /// used keys; the walk stops there, so no key reported cached is evicted by its own batch
    /// (even with no read lease to protect it).
    fn make_room(&mut self, settings: &Settings, now: Millis, rank: u32, need: u32, protected: Option<u32>) {
        let world = world_count(settings, self);
        let n = u64::from(self.ranks[&rank].num_pages());
        let low = n * u64::from(settings.evict_low_permille) / 1000;
        // Only candidates (committed keys without a lease), in recency order: a leased key is
        // never evicted, so the walk does not step over one.
        let mut cur = self.keys.oldest_candidate();
        if let Some(oldest) = cur {
            self.keys.prefetch_entry(oldest);
        }
        while let Some(slot) = cur {
            if Some(slot) == protected {
                break;
            }
            let counts = self.ranks[&rank].counts();
            let used = n - u64::from(counts.free);
            if counts.free >= need && used + u64::from(need) <= low {
                break;
            }
            cur = self.keys.newer_candidate(slot);
            if let Some(next) = cur {
                self.keys.prefetch_walk(next);
            }
            if self.keys.get(slot).pages.get(rank).is_some() && self.evictable(settings, world, slot, now) {
                self.drop_pages(slot, None);
                self.counters.evictions += 1;
            }
        }
    }

    /// Evicts for `fresh` new keys on `rank` when taking them would leave too few free pages or
    /// push usage over the high watermark; returns whether the walk ran (slots may have been
    /// freed, so a caller holding looked-up slots looks them up again).
    ///
    /// The batch's hits are the newest keys; the walk stops at the first of them it can reach:
    /// the oldest hit without a lease (a leased one is no candidate, and a lease outlives a
    /// setting that lowered the read lease to 0).
    pub(super) fn make_room_for(
        &mut self,
        settings: &Settings,
        now: Millis,
        rank: u32,
        fresh: u32,
        hits: &[Option<(u32, u32)>],
    ) -> bool {
        let counts = self.ranks[&rank].counts();
        let n = u64::from(self.ranks[&rank].num_pages());
        let high = n * u64::from(settings.evict_high_permille) / 1000;
        if counts.free < fresh || n - u64::from(counts.free) + u64::from(fresh) > high {
            let protected = hits.iter().flatten().map(|&(slot, _)| slot).find(|&slot| self.leases.until(slot) == 0);
            self.make_room(settings, now, rank, fresh, protected);
            return true;
        }
        false
    }
}

impl Core {
    pub(super) fn delete(&mut self, now: Millis, space: &Space, keys: &[Key]) -> Result<u32, Error> {
        let Some(sp) = self.space_mut(space, now) else {
            return match space {
                Space::Vllm => Ok(0),
                Space::Sglang { .. } => Err(missing_space(space)),
            };
        };
        let mut deleted = 0;
        for &(i, hash) in &distinct_indices(sp.keys.hasher(), keys) {
            let Some(slot) = sp.keys.find_hashed(&keys[i as usize], hash) else { continue };
            if sp.keys.get(slot).pages.len() > 0 {
                sp.drop_pages(slot, None);
                deleted += 1;
            }
        }
        sp.counters.deleted += u64::from(deleted);
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Allocation, Command, Reply};
    use crate::state::tests::{candidates, store, stored_core};
    use alloc::vec;
    use alloc::vec::Vec;

    #[test]
    fn the_eviction_walk_never_steps_over_leased_keys() {
        // A full pool whose keys are all being read but one: the walk must reach that one at
        // once (it used to step over every leased key on each allocate: ~15 ms at 10^6 keys).
        let v = Space::Vllm;
        let (mut core, keys, pages) = stored_core(Settings { read_lease: 5_000, ..Settings::default() }, 1_000, 1_000);
        assert_eq!(candidates(&core, &v).len(), 1_000);
        // Read every key but the 500th.
        let read: Vec<Key> = keys.iter().enumerate().filter(|&(i, _)| i != 500).map(|(_, k)| k.clone()).collect();
        core.apply(1, &Command::Locations { space: v.clone(), rank: 0, keys: read }).unwrap();
        let slot = |core: &Core, k: &Key| core.spaces[&v].keys.find(k).unwrap();
        assert_eq!(candidates(&core, &v), vec![slot(&core, &keys[500])], "the one unleased key is all the walk sees");
        core.check_invariants().unwrap();
        let fresh = Key::parse("fresh").unwrap();
        let reply = core.apply(2, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![fresh] }).unwrap();
        assert_eq!(reply, Reply::Allocated(vec![Allocation { index: 0, page: Some(pages[500]), cached: false }]));
        // When the leases end, the keys are candidates again in recency order (read order: the
        // read touched them), whatever order their ends were handled in.
        core.apply(5_001, &Command::Delete { space: v.clone(), keys: vec![Key::parse("none").unwrap()] }).unwrap();
        let want: Vec<u32> = (0..1_000).filter(|&i| i != 500).map(|i| slot(&core, &keys[i])).collect();
        assert_eq!(candidates(&core, &v), want);
        core.check_invariants().unwrap();
    }

    #[test]
    fn a_hit_is_not_evicted_by_its_own_batch_after_the_read_lease_is_set_to_zero() {
        // The oldest hit still holds a lease from before the setting (so it is no candidate):
        // the walk must still stop at the batch's hits (a case the native-vs-plugin differential found).
        let v = Space::Vllm;
        let settings = Settings { quarantine: 0, ..Settings::default() };
        let mut core = Core::new(1, settings);
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 2 }).unwrap();
        let (a, b, d) = (Key::parse("a").unwrap(), Key::parse("b").unwrap(), Key::parse("d").unwrap());
        store(&mut core, 0, &v, &[a.clone(), b.clone()]);
        core.apply(1, &Command::Locations { space: v.clone(), rank: 0, keys: vec![a.clone()] }).unwrap();
        core.apply(2, &Command::Configure(Settings { read_lease: 0, ..settings })).unwrap();
        let reply = core.apply(3, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![a, b.clone(), d] });
        let want = vec![
            Allocation { index: 0, page: Some(0), cached: true },
            Allocation { index: 1, page: Some(1), cached: true },
            Allocation { index: 2, page: None, cached: false },
        ];
        assert_eq!(reply, Ok(Reply::Allocated(want)));
        assert!(core.apply(3, &Command::Inspect { space: v.clone(), key: b }).unwrap() != Reply::Key(None));
        core.check_invariants().unwrap();
    }
}

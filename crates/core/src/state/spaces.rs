//! Spaces and ranks coming and going: initialize (a rank created, kept or recreated at a new
//! size), clear and reset, and the spare memory a cleared space leaves for the next one.

use alloc::vec::Vec;

use super::{Core, SPARE_TABLES, SpaceState, Spare, missing_space};
use crate::command::{InitOutcome, Millis, Reply, Space};
use crate::error::Error;
use crate::pool::{Page, Pool, PoolOrder};

impl Spare {
    /// Keeps the memory of `sp`, a space just removed.
    fn keep(&mut self, sp: SpaceState) {
        self.tables.extend(sp.ranks.into_values().map(Pool::into_table));
        // Clears without initializes between them (SGLang's import makes its own pools) must
        // not pile tables up: the largest few are the ones worth keeping; `pool` takes the
        // last, the largest.
        self.tables.sort_by_key(Vec::capacity);
        let surplus = self.tables.len().saturating_sub(SPARE_TABLES);
        self.tables.drain(..surplus);
        let mut keys = sp.keys;
        if self.keys.as_ref().is_none_or(|k| k.capacity() < keys.capacity()) {
            keys.clear();
            self.keys = Some(keys);
        }
    }

    /// A new, empty space in the spare key table's memory.
    fn space(&mut self, space: &Space, seed: u64) -> SpaceState {
        let mut sp = SpaceState::new(space, seed);
        if let Some(keys) = self.keys.take() {
            // Every space of a core hashes with the core's seed.
            sp.keys = keys;
        }
        sp
    }

    /// A new pool in a spare page table's memory.
    fn pool(&mut self, num_pages: u32, order: PoolOrder) -> Pool {
        match self.tables.pop() {
            Some(table) => Pool::reusing(num_pages, order, table),
            None => Pool::new(num_pages, order),
        }
    }
}

impl Core {
    pub(super) fn initialize(&mut self, now: Millis, space: &Space, rank: u32, num_pages: u32) -> Result<Reply, Error> {
        if num_pages == 0 {
            return Err(Error::ZeroPages { rank });
        }
        if let Some(world_size) = self.settings.world_size
            && *space == Space::Vllm
            && rank >= world_size
        {
            return Err(Error::RankOutsideWorld { rank, world_size });
        }
        let (seed, spare) = (self.seed, &mut self.spare);
        let sp = self.spaces.entry(space.clone()).or_insert_with(|| spare.space(space, seed));
        sp.expire(&self.settings, now);
        let outcome = match sp.ranks.get(&rank) {
            None => {
                let joined_after_keys = sp.ranks.values().any(|p| p.counts().committed > 0);
                sp.ranks.insert(rank, spare.pool(num_pages, sp.order));
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
                        Page::Free | Page::Quarantined { .. } => {}
                    }
                }
                for &slot in &unreserved {
                    sp.keys.get_mut(slot).reservations -= 1;
                }
                for &slot in &dropped {
                    sp.drop_pages(slot, Some(rank));
                }
                // A key can hold several of the old pages (two writers) and also have been
                // dropped: releasing is a no-op for a slot already gone.
                for slot in unreserved {
                    sp.keys.release_if_unused(slot);
                }
                sp.counters.dropped_keys += dropped.len() as u64;
                InitOutcome::Recreated { old_num_pages: old.num_pages(), dropped_keys: dropped.len() as u32 }
            }
        };
        Ok(Reply::Initialized { rank, num_pages, outcome })
    }

    pub(super) fn clear(&mut self, space: &Space) -> Reply {
        match self.spaces.remove(space) {
            Some(sp) => {
                let reply = Reply::Cleared { ranks: sp.ranks.len() as u32, keys: sp.keys.len() as u64 };
                self.spare.keep(sp);
                reply
            }
            None => Reply::Cleared { ranks: 0, keys: 0 },
        }
    }

    pub(super) fn reset(&mut self, now: Millis, space: &Space) -> Result<Reply, Error> {
        self.space_mut(space, now);
        let Some(old) = self.spaces.remove(space) else {
            return Err(missing_space(space));
        };
        // A clear that keeps the ranks: the new space and pools reuse the old memory.
        let keys = old.keys.len() as u64;
        let (order, ranks): (PoolOrder, Vec<(u32, u32)>) =
            (old.order, old.ranks.iter().map(|(&rank, p)| (rank, p.num_pages())).collect());
        self.spare.keep(old);
        let mut sp = self.spare.space(space, self.seed);
        for (rank, num_pages) in ranks {
            sp.ranks.insert(rank, self.spare.pool(num_pages, order));
        }
        self.spaces.insert(space.clone(), sp);
        Ok(Reply::Cleared { ranks: 0, keys })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Command, Settings};
    use crate::key::Key;
    use crate::keys::KeyTable;
    use crate::state::tests::store;
    use alloc::vec;

    /// A seeded mix of saves, lookups, loads and deletes on vLLM ranks 0 and 1 (96 pages each,
    /// eviction on, so pages are reused), from `step` on; every reply in order.
    fn mixed_stream(core: &mut Core, seed: u64, step: u64, commands: u64) -> Vec<Result<Reply, Error>> {
        let v = Space::Vllm;
        let mut rng = seed | 1;
        let mut replies = Vec::new();
        for i in step..step + commands {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let rank = (rng >> 40) as u32 % 2;
            let keys: Vec<Key> = (0..1 + rng % 24)
                .map(|j| Key::parse(&alloc::format!("{:032x}", (rng >> 8) % 300 + j)).unwrap())
                .collect();
            let now = i * 7;
            let reply = match rng % 5 {
                0 | 1 => match core.apply(now, &Command::Allocate { space: v.clone(), rank, keys: keys.clone() }) {
                    Ok(Reply::Allocated(a)) => {
                        let confirmations =
                            a.iter().filter_map(|x| Some((keys[x.index as usize].clone(), x.page?))).collect();
                        replies.push(Ok(Reply::Allocated(a)));
                        core.apply(now, &Command::Confirm { space: v.clone(), rank, confirmations, releases: vec![] })
                    }
                    other => other,
                },
                2 => core.apply(now, &Command::Exists { space: v.clone(), keys }),
                3 => core.apply(now, &Command::Locations { space: v.clone(), rank, keys }),
                _ => core.apply(now, &Command::Delete { space: v.clone(), keys }),
            };
            replies.push(reply);
        }
        replies
    }

    fn init_ranks(core: &mut Core, now: Millis) {
        for rank in 0..2 {
            core.apply(now, &Command::Initialize { space: Space::Vllm, rank, num_pages: 96 }).unwrap();
        }
    }

    #[test]
    fn a_cleared_or_reset_core_answers_like_a_fresh_one_in_the_memory_it_kept() {
        let v = Space::Vllm;
        for seed in [3u64, 0x5eed, 0xdead_beef] {
            // Fill (the tables grow), then clear or reset: the spare memory is reused.
            let mut cleared = Core::new(9, Settings::default());
            init_ranks(&mut cleared, 0);
            mixed_stream(&mut cleared, seed ^ 1, 0, 2_000);
            let grown = cleared.spaces[&v].keys.capacity();
            assert!(grown >= 64, "the table grew: {grown}");
            cleared.apply(14_000, &Command::Clear { space: v.clone() }).unwrap();
            init_ranks(&mut cleared, 14_000);
            assert_eq!(cleared.spaces[&v].keys.capacity(), grown, "the new space took the cleared table");
            assert!(cleared.spare.keys.is_none() && cleared.spare.tables.is_empty());

            let mut reset = Core::new(9, Settings::default());
            init_ranks(&mut reset, 0);
            mixed_stream(&mut reset, seed ^ 1, 0, 2_000);
            reset.apply(14_000, &Command::Reset { space: v.clone() }).unwrap();

            let mut fresh = Core::new(9, Settings::default());
            init_ranks(&mut fresh, 14_000);
            let want = mixed_stream(&mut fresh, seed, 2_000, 3_000);
            assert!(want.iter().any(|r| matches!(r, Ok(Reply::Deleted(n)) if *n > 0)), "the stream deletes");
            for core in [&mut cleared, &mut reset] {
                assert_eq!(mixed_stream(core, seed, 2_000, 3_000), want);
                core.check_invariants().unwrap();
                assert_eq!(core.stats(), fresh.stats());
                assert_eq!(core.free_list(&v, 0), fresh.free_list(&v, 0));
                #[cfg(feature = "serde")]
                assert!(core.snapshot() == fresh.snapshot(), "same state, byte for byte");
            }
        }
    }

    #[test]
    fn clearing_keeps_the_largest_key_table_and_the_largest_page_tables() {
        let mut core = Core::new(9, Settings::default());
        let spaces = [Space::Vllm, Space::Sglang { rank: 0, namespace: "a".into() }];
        for (n, space) in [600u32, 60].into_iter().zip(&spaces) {
            core.apply(0, &Command::Initialize { space: space.clone(), rank: 0, num_pages: n }).unwrap();
            let keys: Vec<Key> = (0..n).map(|i| Key::parse(&alloc::format!("{i:032x}")).unwrap()).collect();
            store(&mut core, 0, space, &keys);
        }
        let big = core.spaces[&spaces[0]].keys.capacity();
        assert!(big > core.spaces[&spaces[1]].keys.capacity());
        core.apply(1, &Command::Clear { space: spaces[0].clone() }).unwrap();
        core.apply(1, &Command::Clear { space: spaces[1].clone() }).unwrap();
        assert_eq!(core.spare.keys.as_ref().map(KeyTable::capacity), Some(big));
        assert_eq!(core.spare.keys.as_ref().map(KeyTable::len), Some(0));
        assert_eq!(core.spare.tables.len(), 2);
        // A clone (and so a restored core) starts without spare memory; the state is the same.
        assert!(core.clone().spare.keys.is_none());
        // A clear of more ranks than SPARE_TABLES keeps that many page tables, the largest
        // (a new rank takes the largest).
        let v = Space::Vllm;
        for rank in 0..20u32 {
            core.apply(2, &Command::Initialize { space: v.clone(), rank, num_pages: 64 }).unwrap();
            let keys: Vec<Key> = (0..rank + 1).map(|i| Key::parse(&alloc::format!("{i:032x}")).unwrap()).collect();
            core.apply(2, &Command::Allocate { space: v.clone(), rank, keys }).unwrap();
        }
        core.apply(3, &Command::Clear { space: v }).unwrap();
        assert_eq!(core.spare.tables.len(), SPARE_TABLES);
        let caps: Vec<usize> = core.spare.tables.iter().map(Vec::capacity).collect();
        assert!(caps.is_sorted(), "{caps:?}");
        assert!(caps[SPARE_TABLES - 1] >= 600, "the 600-page rank's table is kept: {caps:?}");
    }
}

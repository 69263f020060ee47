//! Allocate: a batch of keys on one rank gets each key's page, cached when the key is complete,
//! else freshly reserved until its writer confirms it or the reservation runs out.

use alloc::vec::Vec;

use super::{Core, PageDeadline, SpaceState, distinct_indices, is_complete, world_count};
use crate::command::{Allocation, Eviction, Millis, Reply, Settings, Space};
use crate::error::Error;
use crate::key::Key;
use crate::keys::KeyTable;
use crate::pool::{PageState, Pool, PoolOrder};

impl Core {
    /// Answers `keys` on `rank` (reserving pages for new keys, `cached` for complete ones).
    pub(super) fn allocate(&mut self, now: Millis, space: &Space, rank: u32, keys: &[Key]) -> Result<Reply, Error> {
        let settings = self.settings;
        let Some(sp) = self.space_mut(space, now) else {
            return Err(Error::RankNotInitialized { rank });
        };
        if !sp.ranks.contains_key(&rank) {
            return Err(Error::RankNotInitialized { rank });
        }
        let world = world_count(&settings, sp);

        // One entry per distinct key, at its first position, with its hash.
        let distinct = distinct_indices(sp.keys.hasher(), keys);
        let find = |sp: &SpaceState| -> Vec<Option<u32>> {
            sp.keys.find_batch(distinct.len(), |j| &keys[distinct[j].0 as usize], |j| distinct[j].1)
        };
        // Each distinct key's slot, if it has one.
        let mut found = find(sp);
        // The slot and existing page of every key that is complete and stored on this rank.
        let hits: Vec<Option<(u32, u32)>> = found
            .iter()
            .map(|&slot| {
                let slot = slot?;
                let e = sp.keys.get(slot);
                if is_complete(world, e.pages.len()) { e.pages.get(rank).map(|p| (slot, p)) } else { None }
            })
            .collect();
        // A cache hit is written again into its page: protect it, and it is now recently used.
        sp.lease_hits(&hits, now, settings.read_lease);
        let fresh = hits.iter().filter(|h| h.is_none()).count() as u32;
        if settings.eviction == Eviction::Lru && fresh > 0 && sp.make_room_for(&settings, now, rank, fresh, &hits) {
            // Evicted keys lost their slots (hits are protected and keep theirs).
            found = find(sp);
        }
        let batch = Batch { keys, distinct: &distinct, found: &found, hits: &hits, fresh };
        let out = sp.hand_out(&settings, now, rank, batch);
        sp.compact_reservations();
        Ok(Reply::Allocated(out))
    }
}

/// One allocate batch as looked up, before any page is taken.
#[derive(Clone, Copy)]
struct Batch<'a> {
    keys: &'a [Key],
    /// One entry per distinct key, at its first position, with its hash.
    distinct: &'a [(u32, u64)],
    /// Each distinct key's slot, if it has one.
    found: &'a [Option<u32>],
    /// The slot and existing page of every key that is complete and stored on this rank.
    hits: &'a [Option<(u32, u32)>],
    /// The distinct keys that are no hit.
    fresh: u32,
}

impl SpaceState {
    /// Takes the batch's pages on `rank` and counts its hits, misses and reservations; one answer
    /// per distinct key.
    fn hand_out(&mut self, settings: &Settings, now: Millis, rank: u32, batch: Batch<'_>) -> Vec<Allocation> {
        let Batch { keys, distinct, found, hits, fresh } = batch;
        let SpaceState { ranks, keys: table, reservations, next_generation, counters, order, .. } = self;
        let pool = ranks.get_mut(&rank).expect("rank exists");
        let free = pool.counts().free as usize;
        // SGLang's server serves each new key while a page is free, and leaves hits alone.
        let per_key = *order == PoolOrder::Lifo;
        // vLLM's server is all or nothing: it takes one page per key, then returns the pages of
        // cache hits to the back of the free list, in key order; that rotation is kept while
        // the pool covers the batch.
        let rotate = !per_key && free >= distinct.len();
        let serve_fresh = rotate || (settings.eviction == Eviction::Lru && free >= fresh as usize);
        // Fresh keys that got a page.
        let mut served = 0u64;
        // The `j`-th distinct key takes `page`.
        let mut reserve = |table: &mut KeyTable, pool: &mut Pool, j: usize, page: u32| {
            served += 1;
            let (index, hash) = distinct[j];
            // Distinct keys: one absent before its own insert stays absent until then.
            let slot = found[j].unwrap_or_else(|| table.insert_absent(&keys[index as usize], hash));
            table.get_mut(slot).reservations += 1;
            let generation = *next_generation;
            *next_generation += 1;
            pool.mark(page, PageState::reserved(slot, generation));
            reservations.push(PageDeadline {
                at: now.saturating_add(settings.reservation_ttl),
                rank,
                page,
                generation,
            });
        };
        table.prefetch_vacant(fresh as usize);
        let mut out = Vec::with_capacity(distinct.len());
        if rotate {
            // One page taken per key, a hit's given back at once: the same pages as taking them
            // all first, since FIFO takes come from the `free` pages there were (`free` ≥ keys)
            // and a page given back goes behind all of them.
            for (j, hit) in hits.iter().enumerate() {
                let index = distinct[j].0;
                let page = pool.take(PageState::reserved(u32::MAX, 0)).expect("enough free pages");
                if let Some((_, existing)) = *hit {
                    pool.free(page);
                    out.push(Allocation { index, page: Some(existing), cached: true });
                } else {
                    reserve(table, pool, j, page);
                    out.push(Allocation { index, page: Some(page), cached: false });
                }
            }
        } else {
            for (j, hit) in hits.iter().enumerate() {
                let index = distinct[j].0;
                let page = match *hit {
                    Some((_, existing)) => Some(existing),
                    None if serve_fresh || (per_key && pool.counts().free > 0) => {
                        let page = pool.take(PageState::reserved(u32::MAX, 0)).expect("enough free pages");
                        reserve(table, pool, j, page);
                        Some(page)
                    }
                    None => None,
                };
                out.push(Allocation { index, page, cached: hit.is_some() });
            }
        }
        counters.cache_hits += (hits.len() - fresh as usize) as u64;
        counters.reserved += served;
        counters.misses += u64::from(fresh) - served;
        out
    }
}

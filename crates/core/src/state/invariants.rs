//! The invariant checker: every count, queue and cross-reference of the state checked against
//! the others, so tests and restores can refuse a state that the rules could never reach.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::String;

use super::{Core, Deadlines, SpaceState};
use crate::command::{Millis, Space};
use crate::pool::{GEN_MASK, Page};

/// What a deadline queue holds, as `(rank, page, generation)`: a set, so the check stays
/// O(state log state).
type Queued = BTreeSet<(u32, u32, u32)>;

impl Core {
    /// Checks every invariant of the state; O(state), for tests and debugging.
    ///
    /// Per rank: free + reserved + committed + quarantined = num_pages and the free queue holds
    /// exactly the free pages; no page is owned by two keys; every key's page points back at
    /// that key; every reserved page belongs to a stored key whose reservation count matches and
    /// has a pending deadline; every quarantined page has a pending deadline; the leased-page
    /// counts match the keys holding leases; the recency list holds exactly the committed keys.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (space, sp) in &self.spaces {
            let live = check_leases(space, sp)?;
            let reserved_per_slot = check_pages(space, sp)?;
            let leased_per_rank = check_keys(space, sp, &reserved_per_slot, &live)?;
            check_leased_counts(space, sp, &leased_per_rank)?;
        }
        Ok(())
    }
}

fn queued(q: &Deadlines) -> Queued {
    q.0.iter().map(|d| (d.rank, d.page, (d.generation & GEN_MASK) as u32)).collect()
}

/// The key table's own checks and the lease queue's: returns each leased slot's live lease end
/// (a slot with two live entries is refused).
fn check_leases(space: &Space, sp: &SpaceState) -> Result<BTreeMap<u32, Millis>, String> {
    sp.keys.check(|slot| sp.leases.until(slot) > 0).map_err(|e| format!("{space:?} keys: {e}"))?;
    if let Some(slot) = (0..sp.leases.slots.len() as u32)
        .find(|&s| sp.leases.until(s) > 0 && sp.keys.get_live(s).is_none_or(|e| e.pages.len() == 0))
    {
        return Err(format!("{space:?} slot {slot} holds a lease but no committed page"));
    }
    let mut live: BTreeMap<u32, Millis> = BTreeMap::new();
    for (at, slot) in sp.leases.live() {
        if live.insert(slot, at).is_some() {
            return Err(format!("{space:?} slot {slot} has two live lease ends"));
        }
    }
    let leased = sp.keys.entries().filter(|&(s, _)| sp.leases.until(s) > 0).count();
    if live.len() != leased {
        return Err(format!("{space:?} {leased} keys hold a lease, {} lease ends are live", live.len()));
    }
    Ok(live)
}

/// Every used page of every rank against its owner and its deadline; returns how many pages
/// each slot holds reserved.
fn check_pages(space: &Space, sp: &SpaceState) -> Result<BTreeMap<u32, u32>, String> {
    let mut reserved_per_slot: BTreeMap<u32, u32> = BTreeMap::new();
    let (reservations, expired, held) = (queued(&sp.reservations), queued(&sp.expired), queued(&sp.held));
    let pending = |q: &Queued, rank: u32, page: u32, generation: u32| q.contains(&(rank, page, generation));
    for (&rank, pool) in &sp.ranks {
        pool.check().map_err(|e| format!("{space:?} rank {rank}: {e}"))?;
        for (page, state) in pool.used_pages() {
            match state {
                Page::Committed { slot } => {
                    let Some(e) = sp.keys.get_live(slot) else {
                        return Err(format!("{space:?} rank {rank} page {page} committed to a vacant slot {slot}"));
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
                    if !pending(&reservations, rank, page, generation) {
                        return Err(format!("{space:?} rank {rank} page {page} is reserved with no deadline"));
                    }
                }
                Page::Quarantined { generation } => {
                    if !pending(&expired, rank, page, generation) && !pending(&held, rank, page, generation) {
                        return Err(format!("{space:?} rank {rank} page {page} is quarantined with no end"));
                    }
                }
                Page::Free => {}
            }
        }
    }
    Ok(reserved_per_slot)
}

/// Every key's pages, reservation count and lease end against the pools and the lease queue;
/// returns how many leased pages each rank should count.
fn check_keys(
    space: &Space,
    sp: &SpaceState,
    reserved_per_slot: &BTreeMap<u32, u32>,
    live: &BTreeMap<u32, Millis>,
) -> Result<BTreeMap<u32, u32>, String> {
    let mut leased_per_rank: BTreeMap<u32, u32> = BTreeMap::new();
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
            if sp.leases.until(slot) > 0 {
                *leased_per_rank.entry(rank).or_default() += 1;
            }
        }
        let counted = reserved_per_slot.get(&slot).copied().unwrap_or(0);
        if counted != e.reservations {
            return Err(format!(
                "{space:?} key {:?} counts {} reservations, pools hold {counted}",
                e.key, e.reservations
            ));
        }
        if sp.leases.until(slot) > 0 && live.get(&slot).is_none_or(|&at| at > sp.leases.until(slot)) {
            return Err(format!("{space:?} key {:?} holds a lease with no end queued", e.key));
        }
    }
    Ok(leased_per_rank)
}

fn check_leased_counts(space: &Space, sp: &SpaceState, leased_per_rank: &BTreeMap<u32, u32>) -> Result<(), String> {
    for (&rank, pool) in &sp.ranks {
        let want = leased_per_rank.get(&rank).copied().unwrap_or(0);
        if pool.counts().leased != want {
            return Err(format!(
                "{space:?} rank {rank} counts {} leased pages, keys hold {want}",
                pool.counts().leased
            ));
        }
    }
    Ok(())
}

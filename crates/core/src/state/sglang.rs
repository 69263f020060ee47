//! SGLang's own persisted pools in and out: import checks every pool before it replaces the
//! SGLang spaces, export writes them back in the same format so a rollback loses no page.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::{Core, SpaceState};
use crate::command::{Millis, Reply, SglangPool, Space};
use crate::error::Error;
use crate::pool::{Page, Pool};

impl Core {
    pub(super) fn import_sglang(&mut self, now: Millis, pools: &[SglangPool], replace: bool) -> Result<Reply, Error> {
        let existing = self.spaces.keys().filter(|s| matches!(s, Space::Sglang { .. })).count();
        if existing > 0 && !replace {
            return Err(Error::SglangPoolsExist { pools: existing as u32 });
        }
        // Check everything before changing anything.
        check_pools(pools).map_err(|reason| Error::ImportRefused { reason })?;
        self.spaces.retain(|s, _| !matches!(s, Space::Sglang { .. }));
        let (mut keys_loaded, mut leaked) = (0u64, 0u64);
        let since_s = u32::try_from(now / 1000).unwrap_or(u32::MAX);
        for p in pools {
            let space = Space::Sglang { rank: p.rank, namespace: p.namespace.clone() };
            let mut sp = SpaceState::new(&space, self.seed);
            let mut committed = Vec::with_capacity(p.keys.len());
            for (k, page) in &p.keys {
                let slot = sp.keys.find_or_insert(k);
                let e = sp.keys.get_mut(slot);
                e.pages.insert(p.rank, *page);
                e.since_s = since_s;
                sp.keys.touch(slot);
                committed.push((*page, slot));
            }
            leaked += u64::from(p.num_pages) - (p.keys.len() + p.free_pages.len()) as u64;
            keys_loaded += p.keys.len() as u64;
            sp.ranks.insert(p.rank, Pool::imported(p.num_pages, sp.order, &committed, &p.free_pages));
            self.spaces.insert(space, sp);
        }
        Ok(Reply::Imported { pools: pools.len() as u32, keys: keys_loaded, leaked_pages: leaked })
    }

    /// Every SGLang pool as SGLang persists it; pages that are neither free nor committed
    /// (reserved, quarantined) are listed free at the bottom of the stack, so a rollback to the
    /// peer loses none. O(pages + keys).
    pub(super) fn export_sglang(&self) -> Vec<SglangPool> {
        let mut out = Vec::new();
        for (space, sp) in &self.spaces {
            let Space::Sglang { rank, namespace } = space else { continue };
            let Some(pool) = sp.ranks.get(rank) else { continue };
            let mut keys = Vec::with_capacity(sp.keys.committed_len());
            let mut cur = sp.keys.oldest();
            while let Some(slot) = cur {
                let e = sp.keys.get(slot);
                if let Some(page) = e.pages.get(*rank) {
                    keys.push((e.key.clone(), page));
                }
                cur = sp.keys.newer_than(slot);
            }
            let mut free_pages: Vec<u32> = pool
                .used_pages()
                .filter(|(_, st)| matches!(st, Page::Reserved { .. } | Page::Quarantined { .. }))
                .map(|(p, _)| p)
                .collect();
            free_pages.extend(pool.free_list().into_iter().rev());
            out.push(SglangPool {
                rank: *rank,
                namespace: namespace.clone(),
                num_pages: pool.num_pages(),
                free_pages,
                keys,
            });
        }
        out
    }
}

/// Why `pools` cannot be imported, if they cannot: a pool listed twice or empty, a page out of
/// range or listed twice, a key listed twice.
fn check_pools(pools: &[SglangPool]) -> Result<(), String> {
    let mut seen_pools = BTreeSet::new();
    for p in pools {
        let name = format!("{}:{}", p.rank, p.namespace);
        if !seen_pools.insert((p.rank, p.namespace.clone())) {
            return Err(format!("pool \"{name}\" appears twice"));
        }
        if p.num_pages == 0 {
            return Err(format!("\"{name}\".num_pages: must be at least 1"));
        }
        let mut owner: Vec<Option<(&str, usize)>> = alloc::vec![None; p.num_pages as usize];
        let places = p
            .free_pages
            .iter()
            .enumerate()
            .map(|(i, &pg)| ("free_pages", i, pg))
            .chain(p.keys.iter().enumerate().map(|(i, (_, pg))| ("key_to_index", i, *pg)));
        for (field, i, page) in places {
            let Some(slot) = owner.get_mut(page as usize) else {
                return Err(format!(
                    "\"{name}\".{field}[{i}]: page {page} is out of range (the pool has {} pages)",
                    p.num_pages
                ));
            };
            if let Some((f0, i0)) = *slot {
                return Err(format!("\"{name}\".{field}[{i}]: page {page} is listed twice (also {f0}[{i0}])"));
            }
            *slot = Some((field, i));
        }
        let mut keys = BTreeMap::new();
        for (i, (k, _)) in p.keys.iter().enumerate() {
            if let Some(j) = keys.insert(k, i) {
                return Err(format!("\"{name}\".key_to_index[{i}]: key {k:?} is listed twice (also [{j}])"));
            }
        }
    }
    Ok(())
}

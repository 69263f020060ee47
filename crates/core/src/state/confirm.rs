//! Confirm and release: a writer commits the pages it wrote (each pair accepted or refused on
//! the page's own state) and hands back the reservations it will not use.

use super::{Core, Leases, SpaceState};
use crate::command::{ConfirmReport, IgnoredRelease, Millis, Refusal, Refused, Reply, Space};
use crate::error::{Error, PagePlace};
use crate::key::Key;
use crate::keys::KeyTable;
use crate::pool::{Page, PageState, Pool};

impl Core {
    pub(super) fn confirm(
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

        let SpaceState { ranks, keys: table, leases, counters, .. } = self.space_mut(space, now).expect("space exists");
        // Looked up once: a map lookup per pair costs more than the pair's own work in wasm.
        let pool = ranks.get_mut(&rank).expect("rank exists");
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
        confirm_pairs(pool, table, leases, rank, now, confirmations, &mut report);
        for &page in releases {
            match pool.state(page) {
                Page::Reserved { slot, .. } => {
                    pool.free(page);
                    table.get_mut(slot).reservations -= 1;
                    table.release_if_unused(slot);
                    report.released += 1;
                }
                Page::Free | Page::Quarantined { .. } => {
                    report.ignored_releases.push((page, IgnoredRelease::AlreadyFree))
                }
                Page::Committed { .. } => report.ignored_releases.push((page, IgnoredRelease::Committed)),
            }
        }
        let c = counters;
        c.committed += u64::from(report.committed);
        c.superseded += u64::from(report.superseded);
        c.refused_confirms += report.refused.len() as u64;
        c.released += u64::from(report.released);
        c.ignored_releases += report.ignored_releases.len() as u64;
        Ok(Reply::Confirmed(report))
    }
}

/// Whether confirming `key` on `page` is accepted (the key's slot) or refused (why). The page
/// names its key's slot: one look at that entry, no hash lookup (the table holds each key in
/// one slot, so "slot s holds key" is "key's slot is s").
fn verdict(pool: &Pool, table: &KeyTable, key: &Key, page: u32) -> Result<u32, Refusal> {
    let holds = |s: u32| table.get_live(s).is_some_and(|e| e.key == *key);
    match pool.state(page) {
        Page::Free | Page::Quarantined { .. } => Err(Refusal::NotReserved),
        Page::Reserved { slot: s, .. } if holds(s) => Ok(s),
        Page::Reserved { .. } => Err(Refusal::ReservedForAnotherKey),
        Page::Committed { slot: s } if holds(s) => Ok(s),
        Page::Committed { .. } => Err(Refusal::CommittedToAnotherKey),
    }
}

/// Applies confirm's pairs (the verdict decides each). Its own function in the guest: inlined
/// into `Core::apply` there, its loop shared registers with the whole handler and spilled.
#[cfg_attr(target_arch = "wasm32", inline(never))]
fn confirm_pairs(
    pool: &mut Pool,
    table: &mut KeyTable,
    leases: &Leases,
    rank: u32,
    now: Millis,
    confirmations: &[(Key, u32)],
    report: &mut ConfirmReport,
) {
    for (i, (key, page)) in confirmations.iter().enumerate() {
        let page = *page;
        let slot = match verdict(pool, table, key, page) {
            Ok(slot) => slot,
            Err(reason) => {
                report.refused.push(Refused { index: i as u32, page, reason });
                continue;
            }
        };
        if let Page::Committed { .. } = pool.state(page) {
            report.unchanged += 1;
            continue;
        }
        let e = table.get_mut(slot);
        e.reservations -= 1;
        if e.pages.get(rank).is_some() {
            // Another writer committed this key on this rank first.
            pool.free(page);
            report.superseded += 1;
            continue;
        }
        if e.pages.len() == 0 {
            e.since_s = u32::try_from(now / 1000).unwrap_or(u32::MAX);
        }
        e.pages.insert(rank, page);
        if leases.until(slot) > 0 {
            pool.add_leased(1);
        }
        pool.mark(page, PageState::committed(slot));
        table.touch(slot);
        report.committed += 1;
    }
}

//! Read-only views of the pages for viewers such as the browser simulator's page map. Nothing
//! here is part of a reply or of the command log, and nothing changes state.

use alloc::vec;
use alloc::vec::Vec;

use super::{Core, Deadlines};
use crate::command::{Millis, Space};
use crate::key::Key;
use crate::pool::{GEN_MASK, Page};

/// Number of page classes in a [`Core::page_map`] cell.
pub const PAGE_CLASSES: usize = 5;

/// What one page is doing, as a viewer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageView {
    /// Can be handed out.
    Free,
    /// Handed out to `key`, not yet confirmed; the reservation ends at `until` (ms).
    Reserved {
        /// The key it was reserved for.
        key: Key,
        /// When the reservation expires.
        until: Option<Millis>,
    },
    /// Holds `key`'s confirmed block.
    Committed {
        /// The key.
        key: Key,
        /// The key holds a read lease (as of the last command that changed the state).
        leased: bool,
        /// Second of the key's first committed page.
        since_s: u32,
    },
    /// Taken back from a writer or reader that may still use it; free again at `until`.
    Quarantined {
        /// When the quarantine ends.
        until: Option<Millis>,
    },
}

fn deadline(q: &Deadlines, rank: u32, page: u32, generation: u32) -> Option<Millis> {
    q.0.iter()
        .find(|d| d.rank == rank && d.page == page && (d.generation & GEN_MASK) as u32 == generation)
        .map(|d| d.at)
}

impl Core {
    /// Page counts of `rank` in `cells` equal runs of pages: cell `i` covers pages
    /// `⌈i·n/cells⌉ .. ⌈(i+1)·n/cells⌉` (page `p` is in cell `⌊p·cells/n⌋`), and holds [`PAGE_CLASSES`] counts — free, reserved,
    /// committed without a lease, committed with a lease, quarantined. `None` when the rank does
    /// not exist. O(pages ever handed out + cells).
    pub fn page_map(&self, space: &Space, rank: u32, cells: u32) -> Option<Vec<u32>> {
        let sp = self.spaces.get(space)?;
        let pool = sp.ranks.get(&rank)?;
        let n = u64::from(pool.num_pages());
        let cells = u64::from(cells.clamp(1, pool.num_pages()));
        let cell_of = |page: u32| (u64::from(page) * cells / n) as usize;
        let mut out = vec![0u32; cells as usize * PAGE_CLASSES];
        for c in 0..cells {
            let (lo, hi) = ((c * n).div_ceil(cells), ((c + 1) * n).div_ceil(cells));
            out[c as usize * PAGE_CLASSES] = (hi - lo) as u32;
        }
        for (page, state) in pool.used_pages() {
            let class = match state {
                Page::Free => continue,
                Page::Reserved { .. } => 1,
                Page::Committed { slot } => {
                    if sp.leases.until(slot) > 0 {
                        3
                    } else {
                        2
                    }
                }
                Page::Quarantined { .. } => 4,
            };
            let base = cell_of(page) * PAGE_CLASSES;
            out[base] -= 1;
            out[base + class] += 1;
        }
        Some(out)
    }

    /// What `page` of `rank` is doing; `None` when the rank or the page does not exist.
    /// O(1), plus O(pending deadlines) for a reserved or quarantined page's deadline.
    pub fn page_view(&self, space: &Space, rank: u32, page: u32) -> Option<PageView> {
        let sp = self.spaces.get(space)?;
        let pool = sp.ranks.get(&rank)?;
        if page >= pool.num_pages() {
            return None;
        }
        Some(match pool.state(page) {
            Page::Free => PageView::Free,
            Page::Reserved { slot, generation } => PageView::Reserved {
                key: sp.keys.get(slot).key.clone(),
                until: deadline(&sp.reservations, rank, page, generation),
            },
            Page::Committed { slot } => {
                let e = sp.keys.get(slot);
                PageView::Committed { key: e.key.clone(), leased: sp.leases.until(slot) > 0, since_s: e.since_s }
            }
            Page::Quarantined { generation } => PageView::Quarantined {
                until: deadline(&sp.expired, rank, page, generation)
                    .or_else(|| deadline(&sp.held, rank, page, generation)),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Command, Settings};

    fn key(i: u32) -> Key {
        Key::parse(&alloc::format!("{i:032x}")).unwrap()
    }

    #[test]
    fn page_map_and_view_follow_the_pages() {
        let settings = Settings { read_lease: 1_000, ..Settings::default() };
        let mut core = Core::new(7, settings);
        let vllm = Space::Vllm;
        core.apply(0, &Command::Initialize { space: vllm.clone(), rank: 0, num_pages: 10 }).unwrap();
        // Pages 0..4 reserved for keys 0..4 (FIFO from page 0).
        core.apply(0, &Command::Allocate { space: vllm.clone(), rank: 0, keys: (0..4).map(key).collect() }).unwrap();
        // Keys 0 and 1 confirmed on pages 0 and 1.
        let confirmations = alloc::vec![(key(0), 0), (key(1), 1)];
        core.apply(2_000, &Command::Confirm { space: vllm.clone(), rank: 0, confirmations, releases: Vec::new() })
            .unwrap();
        // Key 1 read: leased.
        core.apply(2_000, &Command::Locations { space: vllm.clone(), rank: 0, keys: alloc::vec![key(1)] }).unwrap();

        // Two cells: pages 0..5 and 5..10.
        assert_eq!(core.page_map(&vllm, 0, 2).unwrap(), alloc::vec![1, 2, 1, 1, 0, 5, 0, 0, 0, 0]);
        // One cell per page, and more cells than pages are clamped to one per page.
        let per_page = core.page_map(&vllm, 0, 50).unwrap();
        assert_eq!(per_page.len(), 10 * PAGE_CLASSES);
        assert_eq!(&per_page[..4 * PAGE_CLASSES], &[0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(core.page_map(&vllm, 1, 2), None);

        assert_eq!(core.page_view(&vllm, 0, 0), Some(PageView::Committed { key: key(0), leased: false, since_s: 2 }));
        assert_eq!(core.page_view(&vllm, 0, 1), Some(PageView::Committed { key: key(1), leased: true, since_s: 2 }));
        assert_eq!(core.page_view(&vllm, 0, 2), Some(PageView::Reserved { key: key(2), until: Some(60_000) }));
        assert_eq!(core.page_view(&vllm, 0, 9), Some(PageView::Free));
        assert_eq!(core.page_view(&vllm, 0, 10), None);

        // After the reservation TTL the unconfirmed pages are quarantined until TTL + quarantine.
        core.apply(60_000, &Command::Delete { space: vllm.clone(), keys: alloc::vec![key(9)] }).unwrap();
        assert_eq!(core.page_view(&vllm, 0, 2), Some(PageView::Quarantined { until: Some(120_000) }));
        assert_eq!(core.page_map(&vllm, 0, 1).unwrap(), alloc::vec![6, 0, 2, 0, 2]);
    }
}

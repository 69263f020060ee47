//! One rank's pages: a per-page state table and a lazily materialised free list.
//!
//! The peers keep the free list as a Python list of every free page; kvpages keeps the same
//! order without the list. Pages that were never handed out form a "fresh" range that is not
//! stored at all; pages that came back wait in a queue. Only pages that were handed out at least
//! once have an entry in the state table, so initializing 10^8 pages allocates nothing.

use alloc::collections::VecDeque;
use alloc::vec::Vec;

/// In which order a pool hands out its free pages (the peers differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PoolOrder {
    /// vLLM: a FIFO queue starting as `0..n`; released pages join the back.
    Fifo,
    /// SGLang: a stack starting as `0..n` and popped from the end (`n-1` first);
    /// released pages are pushed on top.
    Lifo,
}

/// The state of one page, packed in a u64.
///
/// Bits 62..64 hold the tag, bits 0..32 the key slot, bits 32..62 a reservation generation
/// (so a stale expiry record cannot end a newer reservation of the same page).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageState(pub(crate) u64);

const TAG_SHIFT: u32 = 62;
const TAG_FREE: u64 = 0;
const TAG_RESERVED: u64 = 1;
const TAG_COMMITTED: u64 = 2;
const TAG_QUARANTINED: u64 = 3;
pub(crate) const GEN_MASK: u64 = (1 << 30) - 1;

/// What a page is doing, unpacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Page {
    Free,
    Reserved {
        slot: u32,
        generation: u32,
    },
    Committed {
        slot: u32,
    },
    /// Taken back from a writer or reader that may still be using it; free again later.
    Quarantined {
        generation: u32,
    },
}

impl PageState {
    pub(crate) const FREE: PageState = PageState(TAG_FREE);

    pub(crate) fn reserved(slot: u32, generation: u64) -> PageState {
        PageState(TAG_RESERVED << TAG_SHIFT | (generation & GEN_MASK) << 32 | u64::from(slot))
    }

    pub(crate) fn committed(slot: u32) -> PageState {
        PageState(TAG_COMMITTED << TAG_SHIFT | u64::from(slot))
    }

    pub(crate) fn quarantined(generation: u64) -> PageState {
        PageState(TAG_QUARANTINED << TAG_SHIFT | (generation & GEN_MASK) << 32)
    }

    pub(crate) fn get(self) -> Page {
        let slot = self.0 as u32;
        match self.0 >> TAG_SHIFT {
            TAG_FREE => Page::Free,
            TAG_RESERVED => Page::Reserved { slot, generation: ((self.0 >> 32) & GEN_MASK) as u32 },
            TAG_COMMITTED => Page::Committed { slot },
            _ => Page::Quarantined { generation: ((self.0 >> 32) & GEN_MASK) as u32 },
        }
    }
}

/// Page counts of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PageCounts {
    /// Pages that can be handed out.
    pub free: u32,
    /// Pages handed out by an allocation and not yet confirmed or released.
    pub reserved: u32,
    /// Pages holding a confirmed key.
    pub committed: u32,
    /// Committed pages whose key holds a read lease (a subset of `committed`), as of the last
    /// command that changed the state.
    pub leased: u32,
    /// Pages taken back from a writer whose reservation expired, or from a deleted key a
    /// reader still holds a lease on: not handed out until their quarantine ends.
    pub quarantined: u32,
}

impl PageCounts {
    /// Every state's count with its field name, in declaration order.
    pub fn by_state(&self) -> [(&'static str, u32); 5] {
        [
            ("free", self.free),
            ("reserved", self.reserved),
            ("committed", self.committed),
            ("leased", self.leased),
            ("quarantined", self.quarantined),
        ]
    }
}

/// One rank's pages.
#[derive(Clone, Debug)]
pub(crate) struct Pool {
    pub(crate) num_pages: u32,
    pub(crate) order: PoolOrder,
    /// State of every page handed out at least once, indexed by [`Pool::index`].
    /// Its length is the number of pages taken from the fresh range.
    pub(crate) table: Vec<PageState>,
    /// Free pages that were handed out before, in the order they will be handed out again
    /// (front first for FIFO, back first for LIFO).
    pub(crate) returned: VecDeque<u32>,
    pub(crate) counts: PageCounts,
}

impl core::fmt::Debug for PageState {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        self.get().fmt(f)
    }
}

impl Pool {
    pub(crate) fn new(num_pages: u32, order: PoolOrder) -> Pool {
        Pool {
            num_pages,
            order,
            table: Vec::new(),
            returned: VecDeque::new(),
            counts: PageCounts { free: num_pages, ..PageCounts::default() },
        }
    }

    /// [`Pool::new`] in the memory of `table` (a cleared rank's page table, emptied here): a
    /// rank whose pages are handed out again does not grow its table a second time.
    pub(crate) fn reusing(num_pages: u32, order: PoolOrder, mut table: Vec<PageState>) -> Pool {
        table.clear();
        Pool { table, ..Pool::new(num_pages, order) }
    }

    /// The page table's memory, for [`Pool::reusing`].
    pub(crate) fn into_table(self) -> Vec<PageState> {
        self.table
    }

    /// A pool in a given state: `committed` pages held by key slots, `free_stack` free pages in
    /// hand-out order reversed (the last is handed out first, as SGLang persists it); every other
    /// page is free too and goes out after those. The caller has checked the pages are distinct
    /// and in range. O(num_pages).
    pub(crate) fn imported(num_pages: u32, order: PoolOrder, committed: &[(u32, u32)], free_stack: &[u32]) -> Pool {
        let mut pool = Pool::new(num_pages, order);
        pool.table = alloc::vec![PageState::FREE; num_pages as usize];
        let mut listed = alloc::vec![false; num_pages as usize];
        for &(page, slot) in committed {
            let i = pool.index(page);
            pool.table[i] = PageState::committed(slot);
            listed[page as usize] = true;
        }
        for &p in free_stack {
            listed[p as usize] = true;
        }
        // Unlisted pages (the peer's leaks) at the bottom of the stack / the back of the queue.
        let leaked = (0..num_pages).filter(|&p| !listed[p as usize]);
        pool.returned = match order {
            PoolOrder::Lifo => leaked.chain(free_stack.iter().copied()).collect(),
            PoolOrder::Fifo => free_stack.iter().rev().copied().chain(leaked).collect(),
        };
        pool.counts = PageCounts {
            free: num_pages - committed.len() as u32,
            committed: committed.len() as u32,
            ..PageCounts::default()
        };
        pool
    }

    pub(crate) fn num_pages(&self) -> u32 {
        self.num_pages
    }

    pub(crate) fn counts(&self) -> PageCounts {
        self.counts
    }

    /// Position of `page` in the order the fresh range is consumed.
    fn index(&self, page: u32) -> usize {
        match self.order {
            PoolOrder::Fifo => page as usize,
            PoolOrder::Lifo => (self.num_pages - 1 - page) as usize,
        }
    }

    fn page_at(&self, index: usize) -> u32 {
        match self.order {
            PoolOrder::Fifo => index as u32,
            PoolOrder::Lifo => self.num_pages - 1 - index as u32,
        }
    }

    /// The state of `page`, which must be `< num_pages`.
    pub(crate) fn state(&self, page: u32) -> Page {
        debug_assert!(page < self.num_pages);
        self.table.get(self.index(page)).map_or(Page::Free, |s| s.get())
    }

    fn set(&mut self, page: u32, state: PageState) {
        let i = self.index(page);
        self.table[i] = state;
    }

    /// Takes the next free page (in the pool's order) and marks it `state`.
    pub(crate) fn take(&mut self, state: PageState) -> Option<u32> {
        let page = if (self.table.len() as u64) < u64::from(self.num_pages) {
            // Fresh pages come before returned ones in FIFO order; below them in LIFO order.
            let fresh_first = self.order == PoolOrder::Fifo || self.returned.is_empty();
            if fresh_first {
                let page = self.page_at(self.table.len());
                self.table.push(PageState::FREE);
                page
            } else {
                self.returned.pop_back()?
            }
        } else {
            match self.order {
                PoolOrder::Fifo => self.returned.pop_front()?,
                PoolOrder::Lifo => self.returned.pop_back()?,
            }
        };
        self.set(page, state);
        self.counts.free -= 1;
        self.bump(state, 1);
        Some(page)
    }

    /// Changes a non-free page's state (reserved → committed).
    pub(crate) fn mark(&mut self, page: u32, state: PageState) {
        let old = self.state(page);
        debug_assert!(old != Page::Free);
        self.unbump(old);
        self.set(page, state);
        self.bump(state, 1);
    }

    /// Returns a non-free page to the free list (at the back: the peers' `append`).
    pub(crate) fn free(&mut self, page: u32) {
        let old = self.state(page);
        debug_assert!(old != Page::Free, "page {page} freed twice");
        self.unbump(old);
        self.set(page, PageState::FREE);
        self.counts.free += 1;
        self.returned.push_back(page);
    }

    fn bump(&mut self, state: PageState, by: u32) {
        *self.count_of(state.get()) += by;
    }

    fn unbump(&mut self, page: Page) {
        *self.count_of(page) -= 1;
    }

    fn count_of(&mut self, page: Page) -> &mut u32 {
        match page {
            Page::Free => &mut self.counts.free,
            Page::Reserved { .. } => &mut self.counts.reserved,
            Page::Committed { .. } => &mut self.counts.committed,
            Page::Quarantined { .. } => &mut self.counts.quarantined,
        }
    }

    /// Adjusts the leased-page count (leases are the key table's business; the pool counts).
    pub(crate) fn add_leased(&mut self, delta: i32) {
        self.counts.leased = self.counts.leased.checked_add_signed(delta).expect("leased count stays in range");
    }

    /// Every page that is not free, in page-table order (for re-initialization and checks).
    pub(crate) fn used_pages(&self) -> impl Iterator<Item = (u32, Page)> + '_ {
        self.table.iter().enumerate().filter(|(_, s)| s.get() != Page::Free).map(|(i, s)| (self.page_at(i), s.get()))
    }

    /// The free list in hand-out order, materialised: O(pool), for tests and checks only.
    pub(crate) fn free_list(&self) -> Vec<u32> {
        let fresh = (self.table.len()..self.num_pages as usize).map(|i| self.page_at(i));
        match self.order {
            PoolOrder::Fifo => fresh.chain(self.returned.iter().copied()).collect(),
            PoolOrder::Lifo => self.returned.iter().rev().copied().chain(fresh).collect(),
        }
    }

    /// Checks the pool's own bookkeeping; O(pool).
    pub(crate) fn check(&self) -> Result<(), alloc::string::String> {
        use alloc::format;
        let mut counts = PageCounts {
            free: self.num_pages - self.table.len() as u32,
            leased: self.counts.leased,
            ..PageCounts::default()
        };
        for s in &self.table {
            match s.get() {
                Page::Free => counts.free += 1,
                Page::Reserved { .. } => counts.reserved += 1,
                Page::Committed { .. } => counts.committed += 1,
                Page::Quarantined { .. } => counts.quarantined += 1,
            }
        }
        if counts != self.counts {
            return Err(format!("counts {:?} but table says {:?}", self.counts, counts));
        }
        if counts.leased > counts.committed {
            return Err(format!("{} leased pages but only {} committed", counts.leased, counts.committed));
        }
        if counts.free + counts.reserved + counts.committed + counts.quarantined != self.num_pages {
            return Err(format!(
                "free + reserved + committed + quarantined != num_pages ({counts:?}, {})",
                self.num_pages
            ));
        }
        let mut seen = alloc::collections::BTreeSet::new();
        for &p in &self.returned {
            if p >= self.num_pages || self.index(p) >= self.table.len() {
                return Err(format!("returned page {p} was never handed out"));
            }
            if self.state(p) != Page::Free {
                return Err(format!("returned page {p} is not free: {:?}", self.state(p)));
            }
            if !seen.insert(p) {
                return Err(format!("page {p} is in the free queue twice"));
            }
        }
        let touched_free = self.table.iter().filter(|s| s.get() == Page::Free).count();
        if touched_free != self.returned.len() {
            return Err(format!("{touched_free} touched free pages but {} queued", self.returned.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take_n(p: &mut Pool, n: usize) -> Vec<u32> {
        (0..n).map(|_| p.take(PageState::committed(0)).unwrap()).collect()
    }

    /// One step of a pool script, and what it must give.
    enum Step {
        /// Take pages: exactly these, in this order.
        Take(&'static [u32]),
        /// Nothing left to take.
        Empty,
        Free(u32),
        /// The free list reads exactly this.
        FreeList(&'static [u32]),
    }

    /// Runs `steps` on a fresh pool of `n` pages, checking each and the pool's invariants.
    fn script(n: u32, order: PoolOrder, steps: &[Step]) {
        let mut p = Pool::new(n, order);
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Take(want) => assert_eq!(take_n(&mut p, want.len()), want, "step {i}"),
                Step::Empty => assert_eq!(p.take(PageState::committed(0)), None, "step {i}"),
                Step::Free(page) => p.free(page),
                Step::FreeList(want) => assert_eq!(p.free_list(), want, "step {i}"),
            }
        }
        p.check().unwrap();
    }

    #[test]
    fn fifo_order_matches_the_peer_list() {
        use Step::*;
        script(
            5,
            PoolOrder::Fifo,
            &[
                Take(&[0, 1]),
                Free(0),
                FreeList(&[2, 3, 4, 0]),
                Take(&[2, 3, 4, 0]),
                Empty,
                Free(3),
                Free(1),
                Take(&[3, 1]),
            ],
        );
    }

    #[test]
    fn lifo_order_matches_the_sglang_stack() {
        use Step::*;
        script(
            5,
            PoolOrder::Lifo,
            &[Take(&[4, 3]), Free(4), FreeList(&[4, 2, 1, 0]), Take(&[4, 2]), Free(3), Free(2), Take(&[2, 3, 1, 0])],
        );
    }

    #[test]
    fn a_huge_pool_allocates_nothing_up_front() {
        let mut p = Pool::new(100_000_000, PoolOrder::Fifo);
        assert_eq!(p.table.capacity(), 0);
        assert_eq!(p.counts().free, 100_000_000);
        assert_eq!(p.take(PageState::committed(0)), Some(0));
        assert_eq!(p.state(99_999_999), Page::Free);
        let mut q = Pool::new(100_000_000, PoolOrder::Lifo);
        assert_eq!(q.take(PageState::committed(0)), Some(99_999_999));
    }

    #[test]
    fn page_state_packs_and_unpacks() {
        let s = PageState::reserved(u32::MAX, (1 << 40) + 7);
        assert_eq!(s.get(), Page::Reserved { slot: u32::MAX, generation: 7 });
        assert_eq!(PageState::committed(9).get(), Page::Committed { slot: 9 });
        assert_eq!(PageState::FREE.get(), Page::Free);
        assert_eq!(PageState::quarantined(5).get(), Page::Quarantined { generation: 5 });
    }
}

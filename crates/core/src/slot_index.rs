//! The key table's hash index: an open-addressing array of `(tag, slot)` pairs with linear
//! probing.
//!
//! Each bucket is one `u64` holding a key's slot and 32 bits of its hash (the tag), so a probe
//! compares tags in the bucket itself and reads the key's entry only on a tag match; a lookup
//! on a large table costs one cache miss (the bucket's line; the next buckets are on the same
//! or the adjacent line), where a SwissTable costs two (its control bytes, then its buckets).
//! A bucket's address is known from the tag alone, so a batch can read every key's first
//! bucket before probing ([`SlotIndex::home_bucket`]), and a walk can ask for a line ahead
//! ([`SlotIndex::prefetch`]). Growth re-places buckets from their tags and never reads the
//! entries. Removal shifts the following buckets back (no tombstones), so probe lengths
//! depend only on the load, which stays at most 3/4.
//!
//! Nothing iterates the index: the order of buckets never reaches a reply.

use alloc::vec::Vec;

/// A vacant bucket. Never a real pair: slot `u32::MAX` is the key table's "no slot".
const EMPTY: u64 = u64::MAX;

/// Fewest buckets a non-empty index has.
const MIN_BUCKETS: usize = 16;

fn pair(tag: u32, slot: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(slot)
}

fn tag_of(bucket: u64) -> u32 {
    (bucket >> 32) as u32
}

fn slot_of(bucket: u64) -> u32 {
    bucket as u32
}

/// A bucket's `(tag, slot)` pair; `None` for an empty bucket.
#[inline]
pub(crate) fn unpack(bucket: u64) -> Option<(u32, u32)> {
    (bucket != EMPTY).then(|| (tag_of(bucket), slot_of(bucket)))
}

/// Open-addressing index of `(tag, slot)` pairs; see the module docs.
#[derive(Clone, Default)]
pub(crate) struct SlotIndex {
    /// A power of two long (or empty).
    buckets: Vec<u64>,
    /// Pairs stored.
    len: usize,
}

impl SlotIndex {
    /// An index with room for `n` pairs before it grows (a restore sizes it at once).
    #[cfg(any(feature = "serde", test))]
    pub(crate) fn with_capacity(n: usize) -> SlotIndex {
        let mut index = SlotIndex::default();
        if n > 0 {
            index.buckets = alloc::vec![EMPTY; buckets_for(n)];
        }
        index
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Removes every pair and keeps the buckets: an index filled again to its old size does
    /// not grow again.
    pub(crate) fn clear(&mut self) {
        self.buckets.fill(EMPTY);
        self.len = 0;
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// The first bucket `tag` is probed at: the top bits of a multiplicative hash (an odd
    /// multiplier is a bijection on the tag, and its top bits depend on every tag bit).
    pub(crate) fn home(&self, tag: u32) -> usize {
        let spread = u64::from(tag).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (spread >> (64 - self.buckets.len().trailing_zeros())) as usize
    }

    /// The slot of the first pair with `tag` whose slot satisfies `is`, in probe order.
    #[inline]
    pub(crate) fn find(&self, tag: u32, mut is: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return None;
            }
            if tag_of(b) == tag && is(slot_of(b)) {
                return Some(slot_of(b));
            }
            i = (i + 1) & mask;
        }
    }

    /// The pair in the bucket a probe for `tag` starts at, `None` if that bucket is empty (then
    /// no pair with `tag` is stored: probes never pass an empty bucket). For the tests; the
    /// batched lookup reads the raw bucket ([`SlotIndex::home_bucket`]) and [`unpack`]s it.
    #[cfg(test)]
    pub(crate) fn first(&self, tag: u32) -> Option<(u32, u32)> {
        if self.len == 0 {
            return None;
        }
        unpack(self.home_bucket(tag))
    }

    /// The raw bucket a probe for `tag` starts at: one load, for a loop that reads many keys'
    /// first buckets in a row and decodes them later (see `KeyTable::find_batch`). Only for an
    /// index that holds pairs (one never filled has no buckets; callers check `len` first).
    #[inline]
    pub(crate) fn home_bucket(&self, tag: u32) -> u64 {
        self.buckets[self.home(tag)]
    }

    /// Adds a pair the caller knows is absent.
    #[inline]
    pub(crate) fn insert_unique(&mut self, tag: u32, slot: u32) {
        debug_assert!(slot != u32::MAX, "slot u32::MAX marks an empty bucket");
        if (self.len + 1) * 4 > self.buckets.len() * 3 {
            self.grow();
        }
        let i = self.empty_bucket(tag);
        self.buckets[i] = pair(tag, slot);
        self.len += 1;
    }

    /// The first empty bucket of `tag`'s probe, where a new pair with that tag goes.
    fn empty_bucket(&self, tag: u32) -> usize {
        let mask = self.mask();
        let mut i = self.home(tag);
        while self.buckets[i] != EMPTY {
            i = (i + 1) & mask;
        }
        i
    }

    /// Removes the pair `(tag, slot)`; returns whether it was there.
    pub(crate) fn remove(&mut self, tag: u32, slot: u32) -> bool {
        if self.len == 0 {
            return false;
        }
        let mask = self.mask();
        let want = pair(tag, slot);
        let mut hole = self.home(tag);
        loop {
            let b = self.buckets[hole];
            if b == EMPTY {
                return false;
            }
            if b == want {
                break;
            }
            hole = (hole + 1) & mask;
        }
        // Shift back every following pair that may sit in the hole: one whose home is not
        // cyclically after the hole (its probe from home passes the hole).
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b == EMPTY {
                break;
            }
            let home = self.home(tag_of(b));
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Asks the CPU to fetch the line `tag` is probed at first, so that a batch's lookups wait
    /// for memory together rather than one after another (see [`prefetch`]).
    #[inline]
    pub(crate) fn prefetch(&self, tag: u32) {
        if self.len > 0 {
            prefetch(self.buckets.as_ptr().wrapping_add(self.home(tag)));
        }
    }

    /// Doubles the buckets, re-placing every pair from its tag.
    #[cold]
    fn grow(&mut self) {
        let n = (self.buckets.len() * 2).max(MIN_BUCKETS);
        let old = core::mem::replace(&mut self.buckets, alloc::vec![EMPTY; n]);
        for b in old.into_iter().filter(|&b| b != EMPTY) {
            let i = self.empty_bucket(tag_of(b));
            self.buckets[i] = b;
        }
    }
}

/// Whether [`prefetch`] does anything on this target: callers skip the work of finding what to
/// prefetch where it would be wasted (wasm has no prefetch instruction).
pub(crate) const PREFETCHES: bool = cfg!(target_arch = "x86_64");

/// Asks the CPU to start fetching the cache line at `p`. A hint only: it never faults, reads
/// nothing visible and changes no result; a no-op where the target has no prefetch (wasm).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is not a memory access in the abstract machine; any address is fine.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Buckets that hold `n` pairs at a load of at most 3/4.
#[cfg(any(feature = "serde", test))]
fn buckets_for(n: usize) -> usize {
    (n * 4).div_ceil(3).next_power_of_two().max(MIN_BUCKETS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain model: the multiset of pairs.
    fn check(index: &SlotIndex, model: &[(u32, u32)]) {
        assert_eq!(index.len(), model.len());
        for &(tag, slot) in model {
            assert_eq!(index.find(tag, |s| s == slot), Some(slot), "({tag}, {slot})");
            assert!(index.first(tag).is_some(), "a stored tag's first bucket is never empty");
        }
        let stored = index.buckets.iter().filter(|&&b| b != EMPTY).count();
        assert_eq!(stored, model.len());
        assert!(index.buckets.is_empty() || index.len * 4 <= index.buckets.len() * 3, "load over 3/4");
    }

    #[test]
    fn a_cleared_index_keeps_its_buckets_and_finds_nothing_it_held() {
        let mut index = SlotIndex::default();
        for slot in 0..1000 {
            index.insert_unique(slot % 97, slot);
        }
        let buckets = index.buckets.len();
        index.clear();
        check(&index, &[]);
        assert_eq!(index.buckets.len(), buckets);
        assert_eq!(index.find(5, |_| true), None);
        assert_eq!(index.first(5), None);
        let model: Vec<(u32, u32)> = (0..1000).map(|slot| (slot % 89, slot + 7)).collect();
        for &(tag, slot) in &model {
            index.insert_unique(tag, slot);
        }
        check(&index, &model);
        assert_eq!(index.buckets.len(), buckets, "refilled to its old size, it did not grow");
    }

    #[test]
    fn inserts_removes_and_finds_through_collisions() {
        // Few distinct tags: long probe runs that wrap around the end of the buckets, and
        // removals from their middles.
        let mut index = SlotIndex::default();
        let mut model = Vec::new();
        let mut x = 12345u64;
        for step in 0..20_000u32 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let r = (x >> 33) as u32;
            if !r.is_multiple_of(3) || model.is_empty() {
                let tag = r % 61;
                index.insert_unique(tag, step);
                model.push((tag, step));
            } else {
                let (tag, slot) = model.swap_remove(r as usize % model.len());
                assert!(index.remove(tag, slot));
                assert!(!index.remove(tag, slot), "removed twice");
                assert_eq!(index.find(tag, |s| s == slot), None);
            }
            if step % 997 == 0 {
                check(&index, &model);
            }
        }
        check(&index, &model);
        for (tag, slot) in core::mem::take(&mut model) {
            assert!(index.remove(tag, slot));
        }
        check(&index, &model);
        assert_eq!(index.find(3, |_| true), None);
    }

    #[test]
    fn find_sees_only_matching_tags_and_the_predicate_picks() {
        let mut index = SlotIndex::with_capacity(4);
        index.insert_unique(7, 1);
        index.insert_unique(7, 2);
        index.insert_unique(8, 3);
        assert_eq!(index.find(7, |s| s == 2), Some(2));
        assert_eq!(index.find(7, |s| s == 3), None, "slot 3 has another tag");
        assert_eq!(index.find(9, |_| true), None);
        assert_eq!(index.first(7), Some((7, 1)), "the first pair placed for a tag sits at its home");
        assert_eq!(SlotIndex::default().first(7), None);
        assert!(!index.remove(8, 1), "no such pair");
        assert_eq!(SlotIndex::default().find(1, |_| true), None);
        assert!(!SlotIndex::default().remove(1, 1));
    }

    #[test]
    fn capacity_keeps_the_load_under_three_quarters() {
        assert_eq!(buckets_for(1), 16);
        assert_eq!(buckets_for(12), 16);
        assert_eq!(buckets_for(13), 32);
        assert_eq!(buckets_for(1_000_000), 1 << 21);
        let mut index = SlotIndex::with_capacity(12);
        for slot in 0..12 {
            index.insert_unique(slot, slot);
        }
        assert_eq!(index.buckets.len(), 16, "12 pairs fit without growing");
        index.insert_unique(99, 12);
        assert_eq!(index.buckets.len(), 32);
    }
}

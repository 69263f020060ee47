//! The key table: a slab of entries found through a seeded hash index of slots.
//!
//! Entries are addressed by a u32 slot so pages can point back at their key in 4 bytes; the
//! index ([`SlotIndex`]) stores slots and 32 bits of each key's hash (the key lives once, in the
//! entry), so growing the index and probing past other keys never reads the entries. Nothing
//! here iterates the index, so replies never depend on the hasher seed.

use alloc::vec::Vec;
use core::hash::BuildHasher;

use crate::chunked::Chunked;
use crate::key::Key;
use crate::slot_index::{PREFETCHES, SlotIndex};

/// The key table's hash of a key, seeded by the caller (the core has no randomness).
///
/// On 64-bit targets a 32-hex key (every vLLM and SGLang key: already a digest of its tokens)
/// is its two 64-bit halves, each XORed with a seed, then [`mix`]ed: a few instructions
/// inlined where they are needed. Through foldhash's `Hasher` interface the same key cost ~25
/// instructions (a call to `Key::hash`, the hasher's set-up and finish) for one multiply of
/// mixing: `exists` of 32 stored keys 5.6k → 5.1k instructions, `get_locations` 12.3k → 11.7k
/// (`examples/instructions.rs`). Any other key, and every key on wasm32, is hashed by
/// foldhash: wasm32 has no 64×64→128-bit multiply, and foldhash's 32-bit fold measured
/// cheaper there than any inlined mix tried (a splitmix-style one cost the plugin +2–3 %
/// instructions a save). Nothing stored or answered depends on the hash (see the module
/// docs), so the two forms may differ.
#[derive(Clone)]
pub(crate) struct Hasher {
    #[cfg_attr(not(target_pointer_width = "64"), allow(dead_code))]
    seeds: [u64; 2],
    fold: foldhash::fast::FixedState,
}

impl Hasher {
    pub(crate) fn with_seed(seed: u64) -> Hasher {
        let fold = foldhash::fast::FixedState::with_seed(seed);
        // Two seeds drawn from foldhash's, so nearby seeds give unrelated ones.
        Hasher { seeds: [fold.hash_one(0u64), fold.hash_one(1u64)], fold }
    }

    /// The hash of `key`.
    #[inline(always)]
    pub(crate) fn hash_one(&self, key: &Key) -> u64 {
        match key {
            #[cfg(target_pointer_width = "64")]
            Key::Hex(bytes) => {
                let (lo, hi) = bytes.split_at(8);
                let lo = u64::from_le_bytes(lo.try_into().expect("8 bytes"));
                let hi = u64::from_le_bytes(hi.try_into().expect("8 bytes"));
                mix(lo ^ self.seeds[0], hi ^ self.seeds[1])
            }
            _ => self.fold.hash_one(key),
        }
    }
}

/// Two words mixed into one: their 128-bit product with its halves XORed, folded once more
/// with a constant. (With one fold — foldhash's own mix for 16 bytes — the instruction
/// harness's sequential keys under its seed met more collisions in the batch's duplicate
/// check, which indexes by the hash's top bits: 2.0k instructions there a 32-key batch
/// against 1.7k through foldhash. The second multiply costs ~3 instructions.)
#[cfg(target_pointer_width = "64")]
#[inline(always)]
fn mix(a: u64, b: u64) -> u64 {
    fn folded_multiply(a: u64, b: u64) -> u64 {
        let full = u128::from(a) * u128::from(b);
        (full as u64) ^ ((full >> 64) as u64)
    }
    folded_multiply(folded_multiply(a, b), 0x9e37_79b9_7f4a_7c15)
}

/// A key's committed page on each rank, sorted by rank. One rank, or two ranks below 2^16 (a
/// TP world of two), are stored inline; more in a boxed vector, so the enum stays at 16 bytes
/// and the common worlds allocate nothing (a boxed vector of two costs ~64 heap bytes a key).
/// The variant follows from the set of pages alone, so equal sets compare equal.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[allow(clippy::box_collection)] // the box is the point: 8 bytes inline instead of 24
pub(crate) enum RankPages {
    #[default]
    None,
    One {
        rank: u32,
        page: u32,
    },
    /// `ranks[0] < ranks[1]`.
    Two {
        ranks: [u16; 2],
        pages: [u32; 2],
    },
    Many(alloc::boxed::Box<Vec<(u32, u32)>>),
}

impl RankPages {
    pub(crate) fn get(&self, rank: u32) -> Option<u32> {
        match self {
            RankPages::None => None,
            RankPages::One { rank: r, page } => (*r == rank).then_some(*page),
            RankPages::Two { ranks, pages } => ranks.iter().position(|&r| u32::from(r) == rank).map(|i| pages[i]),
            RankPages::Many(v) => v.binary_search_by_key(&rank, |e| e.0).ok().map(|i| v[i].1),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            RankPages::None => 0,
            RankPages::One { .. } => 1,
            RankPages::Two { .. } => 2,
            RankPages::Many(v) => v.len(),
        }
    }

    /// Records `page` for `rank`, which must not have one yet.
    pub(crate) fn insert(&mut self, rank: u32, page: u32) {
        debug_assert!(self.get(rank).is_none());
        match self {
            RankPages::None => *self = RankPages::One { rank, page },
            RankPages::One { rank: r, page: p } => {
                let (mut a, mut b) = ((*r, *p), (rank, page));
                if b.0 < a.0 {
                    core::mem::swap(&mut a, &mut b);
                }
                *self = match (u16::try_from(a.0), u16::try_from(b.0)) {
                    (Ok(ra), Ok(rb)) => RankPages::Two { ranks: [ra, rb], pages: [a.1, b.1] },
                    _ => RankPages::Many(alloc::boxed::Box::new(alloc::vec![a, b])),
                };
            }
            RankPages::Two { .. } => {
                let mut v: Vec<(u32, u32)> = self.iter().collect();
                let i = v.binary_search_by_key(&rank, |e| e.0).unwrap_err();
                v.insert(i, (rank, page));
                *self = RankPages::Many(alloc::boxed::Box::new(v));
            }
            RankPages::Many(v) => {
                let i = v.binary_search_by_key(&rank, |e| e.0).unwrap_err();
                v.insert(i, (rank, page));
            }
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u32)> + Clone + '_ {
        type RankPage = (u32, u32);
        let (inline, many): ([Option<RankPage>; 2], &[RankPage]) = match self {
            RankPages::None => ([None, None], &[]),
            RankPages::One { rank, page } => ([Some((*rank, *page)), None], &[]),
            RankPages::Two { ranks, pages } => {
                ([Some((u32::from(ranks[0]), pages[0])), Some((u32::from(ranks[1]), pages[1]))], &[])
            }
            RankPages::Many(v) => ([None, None], v.as_slice()),
        };
        inline.into_iter().flatten().chain(many.iter().copied())
    }
}

/// Everything known about one key.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub(crate) key: Key,
    /// Committed page per rank.
    pub(crate) pages: RankPages,
    /// Pages currently reserved for this key (on any rank). The entry, and so its slot, lives
    /// while this is non-zero, so a reservation can never be confirmed for a different key
    /// that reused the slot.
    pub(crate) reservations: u32,
    /// Neighbours in the recency list (towards the least and the most recently used end);
    /// [`NIL`] at the ends. Only keys with a committed page are in the list.
    pub(crate) older: u32,
    pub(crate) newer: u32,
    /// Neighbours in the candidate list: the recency list without the keys holding a read
    /// lease, in the same order (what the eviction walk follows). Derived: not in snapshots.
    /// (A key's lease end lives beside the lease queue, not here: most keys hold none.)
    pub(crate) cand_older: u32,
    pub(crate) cand_newer: u32,
    /// Second (of the host's clock) of the key's first committed page: a key committed on
    /// only some ranks becomes evictable once the reservation TTL has passed since then.
    pub(crate) since_s: u32,
}

/// 32 bits of a key's hash: what the index keeps of it.
fn tag(hash: u64) -> u32 {
    (hash >> 32) as u32 ^ hash as u32
}

/// Whether `slot` holds `key`.
fn holds(slots: &Chunked<Option<Entry>>, slot: u32, key: &Key) -> bool {
    slots[slot as usize].as_ref().is_some_and(|e| e.key == *key)
}

/// The slot the next new entry takes (the last vacated one, else a new one at `len`);
/// [`KeyTable::fill`] takes it.
fn next_slot(vacant: &[u32], len: usize) -> u32 {
    match vacant.last() {
        Some(&s) => s,
        // u32::MAX is `NIL` (no slot, as in the lists and the batched lookup): never a slot.
        None => u32::try_from(len).ok().filter(|&s| s != NIL).expect("fewer than 2^32 - 1 keys"),
    }
}

/// "No slot": the end of the recency list.
pub(crate) const NIL: u32 = u32::MAX;

/// The two intrusive lists through the entries: the recency list of committed keys, and the
/// candidate list (the same order, without the keys holding a read lease).
#[derive(Clone, Copy, Debug)]
enum List {
    Recency,
    Candidates,
}

/// Slab + hash index of keys.
#[derive(Clone)]
pub(crate) struct KeyTable {
    /// The slab: chunked, so that growing it never copies the entries (see [`Chunked`]).
    pub(crate) slots: Chunked<Option<Entry>>,
    pub(crate) vacant: Vec<u32>,
    pub(crate) index: SlotIndex,
    pub(crate) hasher: Hasher,
    /// Most and least recently used ends of the recency list, and its length.
    pub(crate) newest: u32,
    pub(crate) oldest: u32,
    pub(crate) committed: usize,
    /// The candidate list's ends (see [`Entry::cand_older`]).
    pub(crate) cand_newest: u32,
    pub(crate) cand_oldest: u32,
}

impl core::fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KeyTable").field("len", &self.len()).finish()
    }
}

impl KeyTable {
    pub(crate) fn new(seed: u64) -> KeyTable {
        KeyTable {
            slots: Chunked::new(),
            vacant: Vec::new(),
            index: SlotIndex::default(),
            hasher: Hasher::with_seed(seed),
            newest: NIL,
            oldest: NIL,
            committed: 0,
            cand_newest: NIL,
            cand_oldest: NIL,
        }
    }

    /// Removes every key and keeps the memory: the slab's capacity and the index's buckets,
    /// so a table filled again to its old size neither grows nor copies (see `Spare` in
    /// `state`).
    pub(crate) fn clear(&mut self) {
        self.slots.clear();
        self.vacant.clear();
        self.index.clear();
        (self.newest, self.oldest, self.committed) = (NIL, NIL, 0);
        (self.cand_newest, self.cand_oldest) = (NIL, NIL);
    }

    /// Entries the slab holds before it grows.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    pub(crate) fn hasher(&self) -> &Hasher {
        &self.hasher
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Keys with a committed page (those in the recency list).
    pub(crate) fn committed_len(&self) -> usize {
        self.committed
    }

    /// The tag of `key`.
    fn tag_of(&self, key: &Key) -> u32 {
        tag(self.hasher.hash_one(key))
    }

    pub(crate) fn find(&self, key: &Key) -> Option<u32> {
        self.find_hashed(key, self.hasher.hash_one(key))
    }

    /// [`KeyTable::find`] for a key whose hash (`hasher().hash_one(key)`) is known.
    pub(crate) fn find_hashed(&self, key: &Key, hash: u64) -> Option<u32> {
        self.index.find(tag(hash), |s| holds(&self.slots, s, key))
    }

    /// [`KeyTable::find_hashed`] for a batch: the slot of each of `n` keys (`key(i)` gives the
    /// `i`-th key, `hash(i)` its hash). One key's lookup on a large table waits for two cache
    /// misses in a row (its index line, then its entry, to compare the key); a batch makes the
    /// misses of many keys overlap. Where the CPU can prefetch (x86_64) the batch runs as a
    /// pipeline over chunks of 16 keys ([`KeyTable::find_batch_pipelined`]): `exists` of 1,250
    /// among 10^6 keys with the table out of the caches 75 → 50 µs, of 32 among 16,384 1.60 →
    /// 1.19 µs, `get_locations` of 32 3.98 → 3.26 µs; 1,250 hits on a table already in the
    /// caches ~3 % slower (medians of 5–7, `examples/instructions.rs` with `THRASH`). On wasm,
    /// without prefetch, a chunk of 32 keys is hashed in one loop, has its first buckets read
    /// in a second and its entries compared in a third (plain loads in the pipeline's places
    /// gained nothing there). Same answers as `find_hashed` one by one.
    pub(crate) fn find_batch<'k>(
        &self,
        n: usize,
        key: impl Fn(usize) -> &'k Key,
        hash: impl Fn(usize) -> u64,
    ) -> Vec<Option<u32>> {
        self.find_batch_with::<PREFETCHES, _>(n, key, hash, |slot| slot)
    }

    /// [`KeyTable::find_batch`] answering `f(slot)` for each key, right after the key's
    /// comparison, while its entry is still in the cache (a caller that reads the entry needs
    /// no second pass over the slots), pipelined with prefetches (`PREFETCH`) or in plain loops
    /// a chunk: the tests run both on any target. Never inlined on wasm: inlined into its
    /// callers, Cranelift's code for them grew (through the plugin `exists` of 1,250 keys
    /// 346k → 365k instructions, `get_locations` of 32 26.9k → 27.5k).
    #[cfg_attr(target_arch = "wasm32", inline(never))]
    fn find_batch_with<'k, const PREFETCH: bool, T>(
        &self,
        n: usize,
        key: impl Fn(usize) -> &'k Key,
        hash: impl Fn(usize) -> u64,
        f: impl Fn(Option<u32>) -> T,
    ) -> Vec<T> {
        if self.index.len() == 0 {
            return (0..n).map(|_| f(None)).collect();
        }
        if PREFETCH {
            return self.find_batch_pipelined(n, key, hash, f);
        }
        /// Keys whose first buckets are read together (on the stack: no allocation).
        const CHUNK: usize = 32;
        let mut out = Vec::with_capacity(n);
        let mut hashes = [0u64; CHUNK];
        // The raw buckets: their loop only loads (a store each), so many of its iterations fit
        // in the CPU's window of instructions in flight — and their misses with them; a decoded
        // `Option` cost three stores and a branch an iteration. The hashes come first, in a loop
        // of their own: a hash is many instructions (more on wasm32), and hashing in the loads'
        // loop left fewer loads in flight (`exists` of 32 keys through the plugin, table
        // out of the caches: 4.66 → 3.48–3.94 µs a call; the same with the table cached).
        let mut first = [0u64; CHUNK];
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start);
            for (j, h) in hashes.iter_mut().enumerate().take(len) {
                *h = hash(start + j);
            }
            for j in 0..len {
                first[j] = self.index.home_bucket(tag(hashes[j]));
            }
            for j in 0..len {
                let (k, hash) = (key(start + j), hashes[j]);
                let slot = match crate::slot_index::unpack(first[j]) {
                    None => None,
                    Some((t, slot)) if t == tag(hash) && holds(&self.slots, slot, k) => Some(slot),
                    Some(_) => self.find_hashed(k, hash),
                };
                out.push(f(slot));
            }
        }
        out
    }

    /// [`KeyTable::find_batch`] where the CPU can prefetch: a pipeline of three stages over
    /// chunks of keys. Each round hashes one chunk and asks for its first buckets; finds the
    /// previous chunk's candidates (the first pair with the key's tag, probing on past a taken
    /// first bucket) in the lines asked for a round earlier, and asks for their entries; and
    /// compares the keys of the chunk before that with the entries asked for a round earlier.
    /// So a lookup never waits for the miss it just caused: the work of two other chunks runs
    /// while its line arrives. A key its candidate does not settle is looked up in full.
    fn find_batch_pipelined<'k, T>(
        &self,
        n: usize,
        key: impl Fn(usize) -> &'k Key,
        hash: impl Fn(usize) -> u64,
        f: impl Fn(Option<u32>) -> T,
    ) -> Vec<T> {
        /// Keys a stage handles at a time (on the stack: no allocation).
        const CHUNK: usize = 16;
        /// Chunks in flight: one a stage.
        const STAGES: usize = 3;
        let mut out = Vec::with_capacity(n);
        let mut hashes = [[0u64; CHUNK]; STAGES];
        // Each key's candidate slot, `NIL` when no pair has its tag.
        let mut candidate = [[NIL; CHUNK]; STAGES];
        let chunks = n.div_ceil(CHUNK);
        let len = |c: usize| CHUNK.min(n - c * CHUNK);
        for round in 0..chunks + STAGES - 1 {
            if round < chunks {
                let (c, h) = (round, &mut hashes[round % STAGES]);
                for (j, h) in h.iter_mut().enumerate().take(len(c)) {
                    *h = hash(c * CHUNK + j);
                    self.index.prefetch(tag(*h));
                }
            }
            if let Some(c) = round.checked_sub(1).filter(|&c| c < chunks) {
                let (h, cand) = (&hashes[c % STAGES], &mut candidate[c % STAGES]);
                for j in 0..len(c) {
                    cand[j] = self.index.find(tag(h[j]), |_| true).unwrap_or(NIL);
                    if cand[j] != NIL {
                        self.prefetch_entry(cand[j]);
                    }
                }
            }
            if let Some(c) = round.checked_sub(2) {
                let (h, cand) = (&hashes[c % STAGES], &candidate[c % STAGES]);
                for j in 0..len(c) {
                    let k = key(c * CHUNK + j);
                    out.push(f(match cand[j] {
                        NIL => None,
                        slot if holds(&self.slots, slot, k) => Some(slot),
                        _ => self.find_hashed(k, h[j]),
                    }));
                }
            }
        }
        out
    }

    /// `f(slot)` of each of `keys` (see [`KeyTable::find_batch_with`]; `|slot| slot` gives the
    /// slots): `exists` asks there whether each key is complete (of 1,250 keys natively 174k →
    /// 161k instructions, of 32 5.1k → 4.5k, against a second pass over the slots).
    pub(crate) fn find_batch_of<T>(&self, keys: &[Key], f: impl Fn(Option<u32>) -> T) -> Vec<T> {
        self.find_batch_with::<PREFETCHES, _>(keys.len(), |i| &keys[i], |i| self.hasher.hash_one(&keys[i]), f)
    }

    /// Starts fetching `slot`'s entry.
    pub(crate) fn prefetch_entry(&self, slot: u32) {
        crate::slot_index::prefetch(self.slots.ptr(slot as usize));
    }

    /// Starts fetching the entries a [`KeyTable::touch`] of the live `slot` writes: its
    /// neighbours in the recency list and, if it has any, in the candidate list. A batch that
    /// touches many keys asks for all of them first, so their misses overlap instead of each
    /// touch waiting for its own. (On wasm, where there is no prefetch, plain loads of the same
    /// lines ahead of time measured no gain: `get_locations` of 32 among 10^6 keys.)
    pub(crate) fn prefetch_touch(&self, slot: u32) {
        if !PREFETCHES {
            return;
        }
        let e = self.get(slot);
        for s in [e.older, e.newer, e.cand_older, e.cand_newer] {
            if s != NIL {
                self.prefetch_entry(s);
            }
        }
    }

    /// For a walk of the candidate list that is about to visit `slot` (whose entry it asked for
    /// one step earlier): starts fetching `slot`'s index line and the next key's entry, so the
    /// walk waits for one miss a key instead of three in a row.
    pub(crate) fn prefetch_walk(&self, slot: u32) {
        if !PREFETCHES {
            return;
        }
        let e = self.get(slot);
        self.index.prefetch(self.tag_of(&e.key));
        if e.cand_newer != NIL {
            self.prefetch_entry(e.cand_newer);
        }
    }

    /// Starts fetching the entries the next `n` new keys will be written to (vacated slots,
    /// scattered after evictions).
    pub(crate) fn prefetch_vacant(&self, n: usize) {
        if !PREFETCHES {
            return;
        }
        for &slot in self.vacant.iter().rev().take(n) {
            self.prefetch_entry(slot);
        }
    }

    /// The entry at `slot`, if the slot is live.
    pub(crate) fn get_live(&self, slot: u32) -> Option<&Entry> {
        self.slots.get(slot as usize)?.as_ref()
    }

    pub(crate) fn get(&self, slot: u32) -> &Entry {
        self.slots[slot as usize].as_ref().expect("live slot")
    }

    pub(crate) fn get_mut(&mut self, slot: u32) -> &mut Entry {
        self.slots[slot as usize].as_mut().expect("live slot")
    }

    /// The slot of `key`, creating an empty entry if it has none.
    pub(crate) fn find_or_insert(&mut self, key: &Key) -> u32 {
        let hash = self.hasher.hash_one(key);
        match self.find_hashed(key, hash) {
            Some(slot) => slot,
            None => self.insert_absent(key, hash),
        }
    }

    /// Creates an empty entry for `key`, which is not in the table (the caller found it absent
    /// with [`KeyTable::find_hashed`] and inserted nothing since); `hash` is its hash. Probes for
    /// a free bucket only, comparing no keys.
    pub(crate) fn insert_absent(&mut self, key: &Key, hash: u64) -> u32 {
        debug_assert!(self.find_hashed(key, hash).is_none(), "insert_absent of a present key");
        let slot = next_slot(&self.vacant, self.slots.len());
        self.index.insert_unique(tag(hash), slot);
        self.fill(slot, key);
        slot
    }

    /// Puts an empty entry for `key` at `slot`, the [`next_slot`] just indexed. The entry is
    /// written in place, a packed key's bytes copied in last: an entry built whole and then
    /// moved is read back from the stack in pieces the CPU cannot forward from its stores
    /// (`perf annotate` of a 128-key save).
    fn fill(&mut self, slot: u32, key: &Key) {
        let blank = |key: Key| {
            Some(Entry {
                key,
                pages: RankPages::None,
                reservations: 0,
                older: NIL,
                newer: NIL,
                cand_older: NIL,
                cand_newer: NIL,
                since_s: 0,
            })
        };
        if self.vacant.pop().is_none() {
            self.slots.push(None);
        }
        let place = &mut self.slots[slot as usize];
        match key {
            Key::Hex(bytes) => {
                *place = blank(Key::Hex([0; 16]));
                if let Some(Entry { key: Key::Hex(dest), .. }) = place {
                    *dest = *bytes;
                }
            }
            Key::Text(_) => *place = blank(key.clone()),
        }
    }

    /// `slot`'s (older, newer) links in `list`.
    fn links(&self, list: List, slot: u32) -> (u32, u32) {
        let e = self.get(slot);
        match list {
            List::Recency => (e.older, e.newer),
            List::Candidates => (e.cand_older, e.cand_newer),
        }
    }

    fn set_older(&mut self, list: List, slot: u32, older: u32) {
        let e = self.get_mut(slot);
        *match list {
            List::Recency => &mut e.older,
            List::Candidates => &mut e.cand_older,
        } = older;
    }

    fn set_newer(&mut self, list: List, slot: u32, newer: u32) {
        let e = self.get_mut(slot);
        *match list {
            List::Recency => &mut e.newer,
            List::Candidates => &mut e.cand_newer,
        } = newer;
    }

    /// `list`'s (oldest, newest) ends.
    fn ends(&mut self, list: List) -> (&mut u32, &mut u32) {
        match list {
            List::Recency => (&mut self.oldest, &mut self.newest),
            List::Candidates => (&mut self.cand_oldest, &mut self.cand_newest),
        }
    }

    /// Whether `slot` is in `list`.
    fn listed(&self, list: List, slot: u32) -> bool {
        let (older, newer) = self.links(list, slot);
        let newest = match list {
            List::Recency => self.newest,
            List::Candidates => self.cand_newest,
        };
        older != NIL || newer != NIL || newest == slot
    }

    /// Links `slot` (not in `list`) into `list` just after `older` (NIL: as the oldest).
    fn link_after(&mut self, list: List, slot: u32, older: u32) {
        let newer = if older == NIL { *self.ends(list).0 } else { self.links(list, older).1 };
        self.set_older(list, slot, older);
        self.set_newer(list, slot, newer);
        if older == NIL {
            *self.ends(list).0 = slot;
        } else {
            self.set_newer(list, older, slot);
        }
        if newer == NIL {
            *self.ends(list).1 = slot;
        } else {
            self.set_older(list, newer, slot);
        }
    }

    /// Takes `slot` out of `list` (no-op if it is not in it); returns whether it was in it.
    fn unlink_from(&mut self, list: List, slot: u32) -> bool {
        if !self.listed(list, slot) {
            return false;
        }
        let (older, newer) = self.links(list, slot);
        self.set_older(list, slot, NIL);
        self.set_newer(list, slot, NIL);
        if older != NIL {
            self.set_newer(list, older, newer);
        } else {
            *self.ends(list).0 = newer;
        }
        if newer != NIL {
            self.set_older(list, newer, older);
        } else {
            *self.ends(list).1 = older;
        }
        true
    }

    /// Whether `slot` is in the recency list.
    pub(crate) fn in_recency(&self, slot: u32) -> bool {
        self.listed(List::Recency, slot)
    }

    /// Puts `slot` at the most recently used end (inserting it if it is not in the list).
    pub(crate) fn touch(&mut self, slot: u32) {
        if self.newest == slot {
            return;
        }
        // The common case (every read of a stored key): a listed key that is not the newest
        // moves to the newest end. Its newer neighbour exists, and so does the newest key, so
        // the recency move needs no end checks but one; the entry is read once.
        let e = self.get(slot);
        let (older, newer) = (e.older, e.newer);
        if newer != NIL {
            let candidate = e.cand_older != NIL || e.cand_newer != NIL || self.cand_newest == slot;
            let newest = self.newest;
            self.get_mut(newer).older = older;
            if older == NIL {
                self.oldest = newer;
            } else {
                self.get_mut(older).newer = newer;
            }
            self.get_mut(newest).newer = slot;
            let e = self.get_mut(slot);
            e.older = newest;
            e.newer = NIL;
            self.newest = slot;
            if candidate {
                self.unlink_from(List::Candidates, slot);
                self.link_after(List::Candidates, slot, self.cand_newest);
            }
            return;
        }
        // Otherwise the key is not listed (a listed key without a newer neighbour is the
        // newest): it joins both lists at their newest ends. It holds no lease (a lease needs a
        // committed page), so it is a candidate. Written out rather than through `link_after`
        // twice: a new key's links cost ~100 instructions less (a 128-key save: ~1,000 a key).
        debug_assert!(older == NIL && !self.in_candidates(slot), "an unlisted key has no links");
        let (newest, cand_newest) = (self.newest, self.cand_newest);
        let e = self.get_mut(slot);
        e.older = newest;
        e.cand_older = cand_newest;
        match newest {
            NIL => self.oldest = slot,
            n => self.get_mut(n).newer = slot,
        }
        match cand_newest {
            NIL => self.cand_oldest = slot,
            n => self.get_mut(n).cand_newer = slot,
        }
        (self.newest, self.cand_newest) = (slot, slot);
        self.committed += 1;
    }

    /// Takes `slot` out of the recency list (no-op if it is not in it).
    pub(crate) fn unlink(&mut self, slot: u32) {
        if self.unlink_from(List::Recency, slot) {
            self.committed -= 1;
            self.unlink_from(List::Candidates, slot);
        }
    }

    /// Whether `slot` is in the candidate list.
    fn in_candidates(&self, slot: u32) -> bool {
        self.listed(List::Candidates, slot)
    }

    /// `slot`'s read lease starts: it is no candidate for eviction until the lease ends.
    pub(crate) fn leave_candidates(&mut self, slot: u32) {
        self.unlink_from(List::Candidates, slot);
    }

    /// `slot`'s read lease ends: a key in the recency list is a candidate again, at its place
    /// in recency order (so when leases end never changes what is evicted). That place is found
    /// by stepping from the key through its recency neighbours, older and newer in turn, until
    /// one is a candidate or an end of the list is reached: as many steps as the nearer run of
    /// leased neighbours is long (leases mostly end in recency order, since a read both leases
    /// and touches a key, so that run is short).
    pub(crate) fn join_candidates(&mut self, slot: u32) {
        if !self.in_recency(slot) || self.in_candidates(slot) {
            return;
        }
        let (mut older, mut newer) = {
            let e = self.get(slot);
            (e.older, e.newer)
        };
        loop {
            if older == NIL || self.in_candidates(older) {
                // Every key between `older` and `slot` is leased: `slot` comes just after it.
                self.link_after(List::Candidates, slot, older);
                return;
            }
            if newer == NIL || self.in_candidates(newer) {
                let before = if newer == NIL { self.cand_newest } else { self.get(newer).cand_older };
                self.link_after(List::Candidates, slot, before);
                return;
            }
            older = self.get(older).older;
            newer = self.get(newer).newer;
        }
    }

    /// The least recently used candidate for eviction (committed, no lease), if any.
    pub(crate) fn oldest_candidate(&self) -> Option<u32> {
        (self.cand_oldest != NIL).then_some(self.cand_oldest)
    }

    /// The candidate used just after `slot`, if any.
    pub(crate) fn newer_candidate(&self, slot: u32) -> Option<u32> {
        let n = self.get(slot).cand_newer;
        (n != NIL).then_some(n)
    }

    /// The least recently used key, if any.
    pub(crate) fn oldest(&self) -> Option<u32> {
        (self.oldest != NIL).then_some(self.oldest)
    }

    /// The key used just after `slot`, if any.
    pub(crate) fn newer_than(&self, slot: u32) -> Option<u32> {
        let n = self.get(slot).newer;
        (n != NIL).then_some(n)
    }

    /// Removes the entry at `slot` if nothing refers to it any more.
    pub(crate) fn release_if_unused(&mut self, slot: u32) {
        let Some(e) = self.get_live(slot) else { return };
        if e.reservations > 0 || e.pages.len() > 0 {
            return;
        }
        debug_assert!(!self.in_recency(slot), "a key without pages is not in the recency list");
        let tag = self.tag_of(&e.key);
        let removed = self.index.remove(tag, slot);
        debug_assert!(removed, "a live slot is indexed");
        self.slots[slot as usize] = None;
        self.vacant.push(slot);
    }

    /// Rebuilds the hash index, the recency count and the candidate list (the listed keys that
    /// are not `leased`) from the slots (after a restore).
    #[cfg(feature = "serde")]
    pub(crate) fn rebuild_index(&mut self, leased: impl Fn(u32) -> bool) -> Result<(), alloc::string::String> {
        self.index = SlotIndex::with_capacity(self.slots.len());
        self.committed = 0;
        for (slot, e) in self.slots.iter().enumerate() {
            let Some(e) = e else { continue };
            if e.pages.len() > 0 {
                self.committed += 1;
            }
            let tag = self.tag_of(&e.key);
            if self.index.find(tag, |s| holds(&self.slots, s, &e.key)).is_some() {
                return Err(alloc::format!("key {:?} is stored twice", e.key));
            }
            self.index.insert_unique(tag, slot as u32);
        }
        let n = self.slots.len() as u32;
        let bad_link = |s: u32| s != NIL && (s >= n || self.slots[s as usize].is_none());
        if bad_link(self.newest) || bad_link(self.oldest) {
            return Err("recency list ends point at vacant slots".into());
        }
        for e in self.slots.iter().flatten() {
            if bad_link(e.older) || bad_link(e.newer) {
                return Err(alloc::format!("key {:?} links to a vacant slot", e.key));
            }
        }
        self.rebuild_candidates(leased);
        Ok(())
    }

    /// Rebuilds the candidate list from the recency list: its keys that are not `leased`, in
    /// its order; O(keys). At most one step per slot, so a cycle in a damaged image ends here
    /// (`check` refuses it). Every key not in the recency list must have no candidate links.
    pub(crate) fn rebuild_candidates(&mut self, leased: impl Fn(u32) -> bool) {
        self.cand_oldest = NIL;
        self.cand_newest = NIL;
        let mut cur = self.oldest;
        for _ in 0..self.slots.len() {
            let Some(e) = self.slots.get_mut(cur as usize).and_then(Option::as_mut) else { break };
            e.cand_older = NIL;
            e.cand_newer = NIL;
            let next = e.newer;
            if !leased(cur) {
                self.link_after(List::Candidates, cur, self.cand_newest);
            }
            cur = next;
        }
    }

    /// Live entries in slot order (deterministic); O(table), for checks and snapshots.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, &Entry)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|e| (i as u32, e)))
    }

    /// Checks that the index and the slab agree, and the lists (`leased`: whether a slot holds
    /// a read lease); O(table).
    pub(crate) fn check(&self, leased: impl Fn(u32) -> bool) -> Result<(), alloc::string::String> {
        use alloc::format;
        let live = self.slots.iter().filter(|e| e.is_some()).count();
        if live != self.index.len() {
            return Err(format!("{live} live slots but {} indexed", self.index.len()));
        }
        for (slot, e) in self.entries() {
            if self.find(&e.key) != Some(slot) {
                return Err(format!("key {:?} at slot {slot} is not found through the index", e.key));
            }
            if e.reservations == 0 && e.pages.len() == 0 {
                return Err(format!("key {:?} at slot {slot} holds nothing but is still stored", e.key));
            }
        }
        // The vacant list names every empty slot once: a slot listed twice would be handed to
        // two keys, one out of range would panic when taken.
        let mut seen = alloc::vec![false; self.slots.len()];
        for &v in &self.vacant {
            match self.slots.get(v as usize) {
                None => return Err(format!("vacant slot {v} is out of range ({} slots)", self.slots.len())),
                Some(Some(_)) => return Err(format!("vacant slot {v} is occupied")),
                Some(None) if seen[v as usize] => return Err(format!("vacant slot {v} is listed twice")),
                Some(None) => seen[v as usize] = true,
            }
        }
        if self.vacant.len() != self.slots.len() - live {
            return Err(format!(
                "{} vacant slots listed, {} slots are empty",
                self.vacant.len(),
                self.slots.len() - live
            ));
        }
        // The recency list runs oldest → newest through exactly the keys with committed pages;
        // `want`: its unleased keys, what the candidate list must hold, in that order.
        let mut want = Vec::new();
        let mut listed = 0usize;
        let mut prev = NIL;
        let mut cur = self.oldest;
        while cur != NIL {
            let Some(e) = self.get_live(cur) else {
                return Err(format!("recency list reaches vacant slot {cur}"));
            };
            if e.older != prev {
                return Err(format!("recency list: slot {cur} points back at {} instead of {prev}", e.older));
            }
            if e.pages.len() == 0 {
                return Err(format!("key {:?} without committed pages is in the recency list", e.key));
            }
            listed += 1;
            if listed > live {
                return Err("recency list has a cycle".into());
            }
            if !leased(cur) {
                want.push(cur);
            }
            prev = cur;
            cur = e.newer;
        }
        if prev != self.newest {
            return Err(format!("recency list ends at {prev}, newest is {}", self.newest));
        }
        let with_pages = self.entries().filter(|(_, e)| e.pages.len() > 0).count();
        // A key outside the list links nowhere: `touch` takes a key without a newer neighbour
        // that is not the newest for one joining the list, and links it from scratch.
        if let Some((_, e)) = self.entries().find(|(_, e)| e.pages.len() == 0 && (e.older != NIL || e.newer != NIL)) {
            return Err(format!("key {:?} is outside the recency list but linked in it", e.key));
        }
        if listed != with_pages || listed != self.committed {
            return Err(format!(
                "{listed} keys in the recency list, {with_pages} keys with pages, {} counted",
                self.committed
            ));
        }
        // The candidate list is the recency list without the leased keys, in the same order.
        let mut prev = NIL;
        let mut cur = self.cand_oldest;
        for (i, &w) in want.iter().enumerate() {
            if cur != w {
                return Err(format!("candidate {i} is slot {cur}, the recency list's unleased key {i} is {w}"));
            }
            if self.get(cur).cand_older != prev {
                return Err(format!("candidate list: slot {cur} points back at the wrong slot"));
            }
            prev = cur;
            cur = self.get(cur).cand_newer;
        }
        if cur != NIL || self.cand_newest != prev {
            return Err(format!("the candidate list does not end after its {} keys", want.len()));
        }
        let mut is_candidate = alloc::vec![false; self.slots.len()];
        for &w in &want {
            is_candidate[w as usize] = true;
        }
        if let Some((_, e)) =
            self.entries().find(|&(s, e)| !is_candidate[s as usize] && (e.cand_older != NIL || e.cand_newer != NIL))
        {
            return Err(format!("key {:?} is linked as a candidate but is none", e.key));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(t: &KeyTable) -> Vec<u32> {
        let mut v = Vec::new();
        let mut cur = t.oldest();
        while let Some(s) = cur {
            v.push(s);
            cur = t.newer_than(s);
        }
        v
    }

    #[test]
    fn recency_list_touch_and_unlink() {
        let mut t = KeyTable::new(3);
        let slots: Vec<u32> = ["a", "b", "c"].iter().map(|k| t.find_or_insert(&Key::parse(k).unwrap())).collect();
        for &s in &slots {
            t.get_mut(s).pages.insert(0, s);
            t.touch(s);
        }
        assert_eq!(order(&t), slots);
        t.touch(slots[0]);
        assert_eq!(order(&t), alloc::vec![slots[1], slots[2], slots[0]]);
        t.unlink(slots[2]);
        assert_eq!(order(&t), alloc::vec![slots[1], slots[0]]);
        t.unlink(slots[2]);
        t.get_mut(slots[2]).pages = RankPages::None;
        t.release_if_unused(slots[2]);
        t.check(|_| false).unwrap();
        t.unlink(slots[1]);
        t.unlink(slots[0]);
        assert!(order(&t).is_empty(), "the recency list is empty");
    }

    /// Structured 32-hex keys (a counter at either end or in the middle, two bits set) hash
    /// to distinct values whose tags are distinct and whose top bits — what the batch's
    /// duplicate check indexes by, and what `SlotIndex::home` takes of the tag — spread
    /// evenly. (A mix that XORs the halves before one multiply fails it: 43 of the two-bit
    /// keys share a top byte.)
    #[test]
    fn hex_keys_hash_apart_whatever_their_pattern() {
        type Pattern = (&'static str, fn(u64) -> [u8; 16]);
        let patterns: [Pattern; 4] = [
            ("counter in the first bytes", |i| (u128::from(i)).to_be_bytes()),
            ("counter in the last bytes", |i| (u128::from(i)).to_le_bytes()),
            ("counter in the middle", |i| (u128::from(i) << 56).to_le_bytes()),
            ("two bits set", |i| {
                // The i-th pair of bit positions j < k, in order.
                let (mut j, mut rest) = (0, i);
                while rest >= 127 - j {
                    rest -= 127 - j;
                    j += 1;
                }
                ((1u128 << j) | (1u128 << (j + 1 + rest))).to_le_bytes()
            }),
        ];
        for seed in [0, 1, 0x5eed] {
            let hasher = Hasher::with_seed(seed);
            for (name, key) in patterns {
                let n = 4096u64;
                let mut hashes: Vec<u64> = (0..n).map(|i| hasher.hash_one(&Key::Hex(key(i)))).collect();
                // An index of 256 buckets: its `home` takes a tag's top 8 bits of mixing.
                let index = SlotIndex::with_capacity(192);
                let mut top = [0u32; 256];
                let mut home = [0u32; 256];
                for &h in &hashes {
                    top[(h >> 56) as usize] += 1;
                    home[index.home(tag(h))] += 1;
                }
                // 16 a bucket on average: a uniform hash puts at most ~35 in any of 256.
                let worst = |b: &[u32; 256]| b.iter().copied().max().unwrap();
                assert!(worst(&top) <= 40, "{name}, seed {seed}: {} hashes share their top byte", worst(&top));
                assert!(worst(&home) <= 40, "{name}, seed {seed}: {} tags share a home", worst(&home));
                let mut tags: Vec<u32> = hashes.iter().map(|&h| tag(h)).collect();
                tags.sort_unstable();
                tags.dedup();
                hashes.sort_unstable();
                hashes.dedup();
                assert_eq!(hashes.len() as u64, n, "{name}, seed {seed}: hashes collide");
                assert!(tags.len() as u64 >= n - 2, "{name}, seed {seed}: {} distinct tags of {n}", tags.len());
            }
        }
    }

    /// `find_batch` answers as `find_hashed` does key by key, also where a key's first bucket
    /// or its first pair with its tag belongs to another key: a third of the keys share one
    /// 32-bit tag (so one probe chain, where the first pair with the tag is mostly another
    /// key's), and the queries mix stored keys, absent ones and repeats, past a chunk's end.
    #[test]
    fn find_batch_agrees_with_find_hashed_under_tag_collisions() {
        const SHARED: u64 = 0x5eed_0001;
        // tag(hash) = high ^ low: every hash of an `i` divisible by 3 has the tag SHARED.
        let hash = |i: u64| {
            if i.is_multiple_of(3) { ((i ^ SHARED) << 32) | i } else { i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xabcd }
        };
        let keys: Vec<Key> = (0..300u64).map(|i| Key::parse(&alloc::format!("key-{i}")).unwrap()).collect();
        let mut t = KeyTable::new(7);
        let mut slots = alloc::vec![None; keys.len()];
        for i in 0..200 {
            slots[i] = Some(t.insert_absent(&keys[i], hash(i as u64)));
        }
        let query: Vec<u64> = (0..keys.len() as u64).rev().chain([5, 0, 3, 299, 3]).collect();
        let want: Vec<Option<u32>> = query.iter().map(|&i| t.find_hashed(&keys[i as usize], hash(i))).collect();
        let expected: Vec<Option<u32>> = query.iter().map(|&i| slots[i as usize]).collect();
        assert_eq!(want, expected, "every stored key at its slot, every other absent");
        // Both ways the batch can run (the pipeline is x86_64's; wasm runs plain loops), on
        // batches that end inside, at and just past a chunk (16 and 32 keys) and the whole query.
        let (empty, slot, found) = (KeyTable::new(7), |slot: Option<u32>| slot, |slot: Option<u32>| slot.is_some());
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, query.len()] {
            let (keys_of, hash_of) = (|j: usize| &keys[query[j] as usize], |j: usize| hash(query[j]));
            assert_eq!(t.find_batch_with::<true, _>(n, keys_of, hash_of, slot), want[..n], "pipelined, {n} keys");
            assert_eq!(t.find_batch_with::<false, _>(n, keys_of, hash_of, slot), want[..n], "plain loops, {n} keys");
            // An empty table answers `f(None)` for every key.
            assert_eq!(empty.find_batch_with::<true, _>(n, keys_of, hash_of, found), alloc::vec![false; n]);
            assert_eq!(empty.find_batch_with::<false, _>(n, keys_of, hash_of, found), alloc::vec![false; n]);
        }
    }

    fn candidates(t: &KeyTable) -> Vec<u32> {
        let mut v = Vec::new();
        let mut cur = t.oldest_candidate();
        while let Some(s) = cur {
            v.push(s);
            cur = t.newer_candidate(s);
        }
        v
    }

    #[test]
    fn a_key_whose_lease_ends_is_a_candidate_again_at_its_recency_place() {
        let mut t = KeyTable::new(3);
        let s: Vec<u32> = ["a", "b", "c", "d", "e"].iter().map(|k| t.find_or_insert(&Key::parse(k).unwrap())).collect();
        for &x in &s {
            t.get_mut(x).pages.insert(0, x);
            t.touch(x);
        }
        assert_eq!(candidates(&t), s);
        let mut leased = alloc::vec![false; 5];
        for i in [0, 1, 2, 3] {
            t.leave_candidates(s[i]);
            leased[i] = true;
        }
        t.touch(s[1]); // a read of a leased key: recency a c d e b, candidates e
        assert_eq!((order(&t), candidates(&t)), (alloc::vec![s[0], s[2], s[3], s[4], s[1]], alloc::vec![s[4]]));
        t.check(|x| leased[x as usize]).unwrap();
        // Ends in any order; each finds its place through its nearer side.
        for (i, want) in [
            (2, alloc::vec![s[2], s[4]]),             // c: a and d are leased, then the old end: first
            (1, alloc::vec![s[2], s[4], s[1]]),       // b: the newest: after e
            (0, alloc::vec![s[0], s[2], s[4], s[1]]), // a: the oldest
            (3, alloc::vec![s[0], s[2], s[3], s[4], s[1]]),
        ] {
            leased[i] = false;
            t.join_candidates(s[i]);
            assert_eq!(candidates(&t), want, "after {i}");
            t.check(|x| leased[x as usize]).unwrap();
        }
        // The check refuses a candidate list out of recency order.
        t.leave_candidates(s[0]);
        t.link_after(List::Candidates, s[0], s[4]);
        assert!(t.check(|_| false).unwrap_err().starts_with("candidate 0 is slot"));
    }

    #[test]
    fn a_new_key_joins_both_lists_at_their_newest_ends_and_an_unlisted_key_links_nowhere() {
        let mut t = KeyTable::new(5);
        let s: Vec<u32> = ["a", "b", "c", "d"].iter().map(|k| t.find_or_insert(&Key::parse(k).unwrap())).collect();
        // Each holds a reservation until its commit (a key that holds nothing is not stored).
        for &slot in &s {
            t.get_mut(slot).reservations = 1;
        }
        let commit = |t: &mut KeyTable, slot: u32| {
            t.get_mut(slot).reservations = 0;
            t.get_mut(slot).pages.insert(0, slot);
            t.touch(slot);
        };
        // Into empty lists.
        commit(&mut t, s[0]);
        assert_eq!((order(&t), candidates(&t)), (alloc::vec![s[0]], alloc::vec![s[0]]));
        // Every listed key leased: the candidate list is empty, the recency list is not.
        t.leave_candidates(s[0]);
        commit(&mut t, s[1]);
        assert_eq!((order(&t), candidates(&t)), (alloc::vec![s[0], s[1]], alloc::vec![s[1]]));
        t.check(|x| x == s[0]).unwrap();
        // Behind a listed, unleased key.
        commit(&mut t, s[2]);
        assert_eq!((order(&t), candidates(&t)), (alloc::vec![s[0], s[1], s[2]], alloc::vec![s[1], s[2]]));
        assert_eq!(t.committed_len(), 3);
        t.check(|x| x == s[0]).unwrap();
        // The check refuses a key outside the list whose links point into it (a forged
        // snapshot): its first commit would splice the list at that point.
        t.get_mut(s[3]).newer = s[1];
        assert_eq!(
            t.check(|x| x == s[0]).unwrap_err(),
            alloc::format!("key {:?} is outside the recency list but linked in it", Key::parse("d").unwrap())
        );
    }

    #[test]
    fn check_refuses_a_bad_vacant_list() {
        let table = || {
            let mut t = KeyTable::new(3);
            let slots: Vec<u32> = ["a", "b", "c"].iter().map(|k| t.find_or_insert(&Key::parse(k).unwrap())).collect();
            for &s in &slots {
                t.get_mut(s).pages.insert(0, s);
                t.touch(s);
            }
            t.unlink(slots[1]);
            t.get_mut(slots[1]).pages = RankPages::None;
            t.release_if_unused(slots[1]);
            t.check(|_| false).unwrap();
            (t, slots[1])
        };
        let (mut t, vacated) = table();
        t.vacant.push(vacated);
        assert_eq!(t.check(|_| false).unwrap_err(), alloc::format!("vacant slot {vacated} is listed twice"));
        let (mut t, _) = table();
        t.vacant.push(7);
        assert_eq!(t.check(|_| false).unwrap_err(), "vacant slot 7 is out of range (3 slots)");
        let (mut t, _) = table();
        t.vacant.clear();
        assert_eq!(t.check(|_| false).unwrap_err(), "0 vacant slots listed, 1 slots are empty");
    }

    #[test]
    fn rank_pages_insert_and_get() {
        let mut p = RankPages::None;
        p.insert(3, 30);
        assert_eq!(p.get(3), Some(30));
        p.insert(1, 10);
        assert_eq!(p, RankPages::Two { ranks: [1, 3], pages: [10, 30] });
        assert_eq!((p.get(1), p.get(3), p.get(2)), (Some(10), Some(30), None));
        p.insert(2, 20);
        assert_eq!(p.iter().collect::<Vec<_>>(), alloc::vec![(1, 10), (2, 20), (3, 30)]);
        assert_eq!(p.get(2), Some(20));
        assert_eq!(p.get(4), None);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn rank_pages_take_the_same_form_in_any_order() {
        // Every order of inserting a set gives one value (equal sets compare equal), the pages
        // sorted by rank; two ranks go inline only when both fit in 16 bits.
        let sets: [&[(u32, u32)]; 4] =
            [&[(0, 5), (1, 6)], &[(70_000, 1), (2, 2)], &[(9, 1), (4, 2), (65_535, 3)], &[(u32::MAX - 1, 7)]];
        for set in sets {
            let mut want: Vec<(u32, u32)> = set.to_vec();
            want.sort_unstable();
            let mut forms = Vec::new();
            let mut order: Vec<(u32, u32)> = set.to_vec();
            for _ in 0..set.len() {
                order.rotate_left(1);
                for reversed in [false, true] {
                    let mut p = RankPages::None;
                    let seq: Vec<_> = if reversed { order.iter().rev().copied().collect() } else { order.clone() };
                    for (rank, page) in seq {
                        p.insert(rank, page);
                    }
                    assert_eq!(p.iter().collect::<Vec<_>>(), want, "{set:?}");
                    assert_eq!(p.len(), set.len());
                    for &(rank, page) in set {
                        assert_eq!(p.get(rank), Some(page));
                    }
                    forms.push(p);
                }
            }
            assert!(forms.windows(2).all(|w| w[0] == w[1]), "{forms:?}");
            let inline = matches!(forms[0], RankPages::Two { .. });
            assert_eq!(inline, set.len() == 2 && set.iter().all(|&(r, _)| r <= 0xffff), "{set:?}");
        }
    }

    #[test]
    fn entry_is_small() {
        // Budget: under 100 bytes per stored key including the index and the page table.
        assert_eq!(core::mem::size_of::<RankPages>(), 16);
        assert!(core::mem::size_of::<Option<Entry>>() <= 64, "{}", core::mem::size_of::<Option<Entry>>());
    }
}

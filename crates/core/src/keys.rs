//! The key table: a slab of entries found through a seeded hash table of slot numbers.
//!
//! Entries are addressed by a u32 slot so pages can point back at their key in 4 bytes; the
//! hash table stores only slots (the key lives once, in the entry). Nothing here iterates the
//! table in hash order, so replies never depend on the hasher seed.

use alloc::vec::Vec;
use core::hash::BuildHasher;

use hashbrown::HashTable;

use crate::key::Key;

/// The hasher the key table uses, seeded by the caller (the core has no randomness).
pub(crate) type Hasher = foldhash::fast::FixedState;

/// A key's committed page on each rank, sorted by rank; one rank is stored inline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum RankPages {
    #[default]
    None,
    One {
        rank: u32,
        page: u32,
    },
    Many(Vec<(u32, u32)>),
}

impl RankPages {
    pub(crate) fn get(&self, rank: u32) -> Option<u32> {
        match self {
            RankPages::None => None,
            RankPages::One { rank: r, page } => (*r == rank).then_some(*page),
            RankPages::Many(v) => v.binary_search_by_key(&rank, |e| e.0).ok().map(|i| v[i].1),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            RankPages::None => 0,
            RankPages::One { .. } => 1,
            RankPages::Many(v) => v.len(),
        }
    }

    /// Records `page` for `rank`, which must not have one yet.
    pub(crate) fn insert(&mut self, rank: u32, page: u32) {
        match self {
            RankPages::None => *self = RankPages::One { rank, page },
            RankPages::One { rank: r, page: p } => {
                debug_assert!(*r != rank);
                let mut v = alloc::vec![(*r, *p), (rank, page)];
                v.sort_unstable();
                *self = RankPages::Many(v);
            }
            RankPages::Many(v) => {
                let i = v.binary_search_by_key(&rank, |e| e.0).unwrap_err();
                v.insert(i, (rank, page));
            }
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        type RankPage = (u32, u32);
        let (one, many): (Option<RankPage>, &[RankPage]) = match self {
            RankPages::None => (None, &[]),
            RankPages::One { rank, page } => (Some((*rank, *page)), &[]),
            RankPages::Many(v) => (None, v),
        };
        one.into_iter().chain(many.iter().copied())
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
}

/// Slab + hash index of keys.
#[derive(Clone)]
pub(crate) struct KeyTable {
    slots: Vec<Option<Entry>>,
    vacant: Vec<u32>,
    index: HashTable<u32>,
    hasher: Hasher,
}

impl core::fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KeyTable").field("len", &self.len()).finish()
    }
}

impl KeyTable {
    pub(crate) fn new(seed: u64) -> KeyTable {
        KeyTable { slots: Vec::new(), vacant: Vec::new(), index: HashTable::new(), hasher: Hasher::with_seed(seed) }
    }

    pub(crate) fn hasher(&self) -> &Hasher {
        &self.hasher
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn find(&self, key: &Key) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        self.index.find(hash, |&s| slots[s as usize].as_ref().is_some_and(|e| e.key == *key)).copied()
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
        if let Some(slot) = self.find(key) {
            return slot;
        }
        let entry = Entry { key: key.clone(), pages: RankPages::None, reservations: 0 };
        let slot = match self.vacant.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(entry);
                s
            }
            None => {
                let s = u32::try_from(self.slots.len()).expect("fewer than 2^32 keys");
                self.slots.push(Some(entry));
                s
            }
        };
        let hash = self.hasher.hash_one(key);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.index.insert_unique(hash, slot, |&s| hasher.hash_one(&slots[s as usize].as_ref().expect("live slot").key));
        slot
    }

    /// Removes the entry at `slot` if nothing refers to it any more.
    pub(crate) fn release_if_unused(&mut self, slot: u32) {
        let e = self.get(slot);
        if e.reservations > 0 || e.pages.len() > 0 {
            return;
        }
        let hash = self.hasher.hash_one(&e.key);
        if let Ok(found) = self.index.find_entry(hash, |&s| s == slot) {
            found.remove();
        }
        self.slots[slot as usize] = None;
        self.vacant.push(slot);
    }

    /// Live entries in slot order (deterministic); O(table), for checks and snapshots.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, &Entry)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|e| (i as u32, e)))
    }

    /// Checks that the index and the slab agree; O(table).
    pub(crate) fn check(&self) -> Result<(), alloc::string::String> {
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
        for &v in &self.vacant {
            if self.slots[v as usize].is_some() {
                return Err(format!("vacant slot {v} is occupied"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_pages_insert_and_get() {
        let mut p = RankPages::None;
        p.insert(3, 30);
        assert_eq!(p.get(3), Some(30));
        p.insert(1, 10);
        p.insert(2, 20);
        assert_eq!(p.iter().collect::<Vec<_>>(), alloc::vec![(1, 10), (2, 20), (3, 30)]);
        assert_eq!(p.get(2), Some(20));
        assert_eq!(p.get(4), None);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn entry_is_small() {
        // Budget: under 100 bytes per stored key including the index and the page table.
        assert!(core::mem::size_of::<Option<Entry>>() <= 56, "{}", core::mem::size_of::<Option<Entry>>());
    }
}

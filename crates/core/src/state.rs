//! The state machine: [`Core::apply`] runs one command against every space's pools and keys.
//!
//! Page life cycle: free → reserved (allocate, with a deadline) → committed (confirm) → free
//! (release, delete, eviction, expiry). Pages taken from a writer whose reservation expired, or
//! from a deleted key that a reader still holds a lease on, pass through quarantine first.
//! Every deadline lives in a FIFO queue drained at the start of each state-changing command,
//! in deadline order across the queues, so when a drain happens never changes its outcome.
//!
//! This module holds the state's types, the dispatch and the helpers the rules share; each rule
//! lives in a submodule of its own (`allocate`, `confirm`, `lookups`, `leases`, `eviction`,
//! `expiry`, `spaces`, `sglang`, `invariants`).

use alloc::collections::{BTreeMap, VecDeque};
use alloc::vec::Vec;

use crate::command::*;
use crate::error::Error;
use crate::key::Key;
use crate::keys::KeyTable;
use crate::pool::{PageState, Pool, PoolOrder};

mod allocate;
mod confirm;
mod eviction;
mod expiry;
mod invariants;
mod leases;
mod lookups;
mod sglang;
#[cfg(feature = "serde")]
pub(crate) mod snapshot;
mod spaces;
pub(crate) mod view;

/// Something that happens to one page at a deadline: a reservation ends, a quarantine ends.
/// The generation tells whether the page is still in the state that queued it.
#[derive(Clone, Copy, Debug)]
struct PageDeadline {
    at: Millis,
    rank: u32,
    page: u32,
    generation: u64,
}

/// Read leases: each leased slot's end (`until`), and the ends queued as `(at, slot, stamp)`,
/// soonest first. A key's lease is queued once, when it
/// starts; extending it only raises the key's `lease_until`, and when the queued end comes due
/// for a key whose lease was extended, it is queued again at the new end. So a lookup that
/// extends 32 leases costs 32 stores, not 32 queue entries (a server answering `get_locations`
/// at 90k requests/s would otherwise queue ~3M entries a second and keep 5 s of them), and every
/// lease ends exactly at its `lease_until`.
///
/// An entry is live while its stamp is its slot's current stamp: queueing and forgetting both
/// move the slot's stamp on, so an entry left behind (its lease was cut short, its slot reused,
/// or it was queued again) is stale and dropped when it comes due. End and stamp are kept per
/// slot in one array, grown only as far as the highest slot ever leased (a lookup-free server
/// pays nothing, and key entries stay 64 bytes), read and written by index: no hashing. A stamp
/// wraps after 2^32 moves of one slot, far more than can happen while a stale entry waits (at
/// most one lease length).
#[derive(Clone, Debug, Default)]
struct Leases {
    /// A min-heap (an array: no allocation per entry).
    queue: alloc::collections::BinaryHeap<core::cmp::Reverse<(Millis, u32, u32)>>,
    /// Slot → its lease end and current stamp.
    slots: Vec<LeaseSlot>,
}

#[derive(Clone, Copy, Debug, Default)]
struct LeaseSlot {
    /// End of the key's read lease (ms); 0 when it holds none. A leased key is never evicted
    /// and its pages are never handed to another key before this time.
    until: Millis,
    stamp: u32,
}

/// A FIFO of deadlines. Durations are fixed per queue, so creation order is deadline order;
/// a push never goes below the last deadline (after a setting shrinks a duration, newer entries
/// wait for older ones rather than break the order).
#[derive(Clone, Debug)]
struct Deadlines(VecDeque<PageDeadline>);

/// One space's pools, keys and deadlines.
#[derive(Clone, Debug)]
struct SpaceState {
    order: PoolOrder,
    ranks: BTreeMap<u32, Pool>,
    keys: KeyTable,
    /// Reservation deadlines; entries whose page moved on are skipped by generation.
    reservations: Deadlines,
    /// Quarantine of pages taken back from expired reservations.
    expired: Deadlines,
    /// Quarantine of pages of deleted or dropped keys that a reader still held a lease on.
    held: Deadlines,
    /// Read lease ends, soonest first (see [`Leases`]).
    leases: Leases,
    /// Generations of reservations and quarantines, so a stale deadline never ends a newer one.
    next_generation: u64,
    counters: Counters,
}

/// The deterministic kvpages state machine.
///
/// Same seed and same `(now, Command)` sequence ⇒ same replies and same state, on every target.
#[derive(Clone, Debug)]
pub struct Core {
    seed: u64,
    settings: Settings,
    spaces: BTreeMap<Space, SpaceState>,
    spare: Spare,
}

/// Memory a cleared space leaves for the spaces and ranks initialized after it: its key table,
/// emptied (the slab's capacity and the index's buckets), and its ranks' page tables. A server
/// cleared and filled again (vLLM's `/clear`, then the same workload: tests, benchmarks, a
/// restarted job) then does not pay a second time for growing its tables: up to 10^6 keys,
/// that is ~20 doublings that copy the table and fault in fresh pages, about a third of an
/// allocate+confirm's cost in the core over a fill. Not state: no reply, snapshot or
/// invariant depends on it, and a clone or a restored core starts without it. Bounded: one key
/// table (the largest cleared) and at most [`SPARE_TABLES`] page tables (the largest), each
/// taken by the next space or rank initialized.
#[derive(Default)]
struct Spare {
    keys: Option<KeyTable>,
    tables: Vec<Vec<PageState>>,
}

/// Most page tables a [`Spare`] keeps (more than vLLM's usual tensor-parallel world).
const SPARE_TABLES: usize = 16;

impl Clone for Spare {
    fn clone(&self) -> Spare {
        Spare::default()
    }
}

impl core::fmt::Debug for Spare {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Spare")
            .field("keys", &self.keys.as_ref().map(KeyTable::capacity))
            .field("tables", &self.tables.len())
            .finish()
    }
}

fn is_complete(world: u32, pages: usize) -> bool {
    world > 0 && pages == world as usize
}

/// How many ranks must hold a key for it to be complete: vLLM's TP world (`--world-size`, or
/// the initialized ranks); an SGLang space has one rank.
fn world_count(settings: &Settings, sp: &SpaceState) -> u32 {
    match sp.order {
        PoolOrder::Fifo => settings.world_size.unwrap_or(sp.ranks.len() as u32),
        PoolOrder::Lifo => sp.ranks.len() as u32,
    }
}

impl SpaceState {
    fn new(space: &Space, seed: u64) -> SpaceState {
        SpaceState {
            order: match space {
                Space::Vllm => PoolOrder::Fifo,
                Space::Sglang { .. } => PoolOrder::Lifo,
            },
            ranks: BTreeMap::new(),
            keys: KeyTable::new(seed),
            reservations: Deadlines::new(),
            expired: Deadlines::new(),
            held: Deadlines::new(),
            leases: Leases::default(),
            next_generation: 0,
            counters: Counters::default(),
        }
    }
}

impl Core {
    /// An empty core. `seed` keys the hash tables (the core has no randomness of its own).
    pub fn new(seed: u64, settings: Settings) -> Core {
        Core { seed, settings, spaces: BTreeMap::new(), spare: Spare::default() }
    }

    /// The settings in force.
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Applies one command at time `now`. An `Err` means the command applied nothing.
    ///
    /// Time passing is not part of any command: deadlines `<= now` (reservations, quarantines,
    /// leases) may have run out by the time a command is answered, `Ok` or `Err`. That is a
    /// function of `now` alone, so replaying the same `(now, Command)` sequence gives the same
    /// state, whichever commands in between only read.
    pub fn apply(&mut self, now: Millis, cmd: &Command) -> Result<Reply, Error> {
        match cmd {
            Command::Configure(s) => self.configure(now, s),
            Command::Initialize { space, rank, num_pages } => self.initialize(now, space, *rank, *num_pages),
            Command::Allocate { space, rank, keys } => self.allocate(now, space, *rank, keys),
            Command::Confirm { space, rank, confirmations, releases } => {
                self.confirm(now, space, *rank, confirmations, releases)
            }
            Command::Exists { space, keys } => self.exists(space, keys).map(Reply::Exists),
            Command::Locations { space, rank, keys } => self.locations(now, space, *rank, keys),
            Command::Delete { space, keys } => self.delete(now, space, keys).map(Reply::Deleted),
            Command::Inspect { space, key } => {
                self.space_mut(space, now);
                Ok(Reply::Key(self.inspect(now, space, key).map(alloc::boxed::Box::new)))
            }
            // Counts and lists (and Inspect's view, above) are taken after the clock has acted, so
            // they are the same whether or not a read (Stats) drained the due deadlines first.
            Command::Clear { space } => {
                self.space_mut(space, now);
                Ok(self.clear(space))
            }
            Command::ImportSglang { pools, replace } => self.import_sglang(now, pools, *replace),
            Command::ExportSglang => {
                self.expire_all(now);
                Ok(Reply::SglangPools(self.export_sglang()))
            }
            Command::LeaseAll => Ok(self.lease_all(now)),
            Command::Reset { space } => self.reset(now, space),
            Command::Stats => {
                self.expire_all(now);
                Ok(Reply::Stats(alloc::boxed::Box::new(self.stats())))
            }
        }
    }

    fn configure(&mut self, now: Millis, s: &Settings) -> Result<Reply, Error> {
        if let Some(world_size) = s.world_size {
            let outside = self.spaces.get(&Space::Vllm).and_then(|sp| sp.ranks.keys().next_back());
            if let Some(&rank) = outside.filter(|&&r| r >= world_size) {
                return Err(Error::RankOutsideWorld { rank, world_size });
            }
        }
        // Deadlines due by now run out under the settings they were made with, whether or not a
        // read (Stats) drained them earlier: replay must not depend on reads.
        self.expire_all(now);
        self.settings = *s;
        Ok(Reply::Configured)
    }

    /// Lets the clock act in every space (deadlines `<= now` run out).
    fn expire_all(&mut self, now: Millis) {
        let settings = self.settings;
        for sp in self.spaces.values_mut() {
            sp.expire(&settings, now);
        }
    }

    fn space_mut(&mut self, space: &Space, now: Millis) -> Option<&mut SpaceState> {
        let sp = self.spaces.get_mut(space)?;
        sp.expire(&self.settings, now);
        Some(sp)
    }

    /// Figures for every space, as of the last command; O(spaces + ranks).
    pub fn stats(&self) -> Stats {
        let spaces = self
            .spaces
            .iter()
            .map(|(space, sp)| {
                let keys = sp.keys.committed_len() as u64;
                SpaceStats {
                    space: space.clone(),
                    keys,
                    pending_keys: sp.keys.len() as u64 - keys,
                    world_size: world_count(&self.settings, sp),
                    ranks: sp
                        .ranks
                        .iter()
                        .map(|(&rank, p)| RankStats { rank, num_pages: p.num_pages(), pages: p.counts() })
                        .collect(),
                    counters: sp.counters,
                }
            })
            .collect();
        Stats { settings: self.settings, spaces }
    }

    /// The free list of one rank in hand-out order. O(pool): for tests and debugging.
    pub fn free_list(&self, space: &Space, rank: u32) -> Option<Vec<u32>> {
        Some(self.spaces.get(space)?.ranks.get(&rank)?.free_list())
    }
}

/// The refusal for a command on a space that does not exist.
fn missing_space(space: &Space) -> Error {
    match space {
        Space::Vllm => Error::RankNotInitialized { rank: 0 },
        Space::Sglang { rank, .. } => Error::RankNotInitialized { rank: *rank },
    }
}

/// Indices of the first occurrence of each distinct key, in order, with the key's hash under
/// `hasher` (the key table's); O(batch).
///
/// The seen set is a linear-probing table of positions in `out` (+1; 0 is empty) at most half
/// full, found by the hash's top bits: a fresh key (the common case) costs one probe and one
/// store, where hashbrown's table probed twice (find, then insert) and wrote control bytes.
fn distinct_indices(hasher: &crate::keys::Hasher, keys: &[Key]) -> Vec<(u32, u64)> {
    /// Buckets of the largest table kept on the stack.
    const SMALL_SEEN: usize = 128;
    let mut out: Vec<(u32, u64)> = Vec::with_capacity(keys.len());
    // 2..4 buckets a key; a power of two, so the top bits pick the bucket (no key, no bits).
    let bits = (keys.len() * 2).next_power_of_two().trailing_zeros();
    let mask = (1usize << bits) - 1;
    // A batch of up to 64 keys (every vLLM batch but the largest saves) keeps its table on the
    // stack: a `calloc` and a `free` a call cost more than zeroing 512 bytes.
    let (mut small, mut large);
    let seen: &mut [u32] = if 1 << bits <= SMALL_SEEN {
        small = [0u32; SMALL_SEEN];
        &mut small[..1 << bits]
    } else {
        large = alloc::vec![0u32; 1 << bits];
        &mut large
    };
    for (i, k) in keys.iter().enumerate() {
        let hash = hasher.hash_one(k);
        let mut b = (hash >> (64 - bits)) as usize;
        loop {
            match seen[b] {
                0 => {
                    out.push((i as u32, hash));
                    seen[b] = out.len() as u32;
                    break;
                }
                at => {
                    let (j, h) = out[at as usize - 1];
                    if h == hash && keys[j as usize] == *k {
                        break; // a repeat of key `j`
                    }
                }
            }
            b = (b + 1) & mask;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn distinct_indices_are_each_keys_first_position_with_its_hash() {
        let hasher = crate::keys::Hasher::with_seed(7);
        // Sizes around the table's power-of-two steps, from no repeats to almost all repeats.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0usize, 1, 2, 3, 4, 5, 31, 32, 33, 64, 127, 128, 129, 1000] {
            for distinct in [1u64, 2, 7, len as u64 / 2 + 1, len as u64 + 1] {
                let keys: Vec<Key> = (0..len)
                    .map(|_| {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let n = rng % distinct;
                        // Hex and text keys both.
                        Key::parse(&if n.is_multiple_of(2) {
                            alloc::format!("{n:032x}")
                        } else {
                            alloc::format!("k{n}")
                        })
                        .unwrap()
                    })
                    .collect();
                let mut want: Vec<(u32, u64)> = Vec::new();
                for (i, k) in keys.iter().enumerate() {
                    if !keys[..i].contains(k) {
                        want.push((i as u32, hasher.hash_one(k)));
                    }
                }
                assert_eq!(distinct_indices(&hasher, &keys), want, "{len} keys of {distinct}");
            }
        }
    }

    /// The candidates for eviction, oldest first.
    pub(super) fn candidates(core: &Core, space: &Space) -> Vec<u32> {
        let keys = &core.spaces[space].keys;
        let mut out = vec![];
        let mut cur = keys.oldest_candidate();
        while let Some(slot) = cur {
            out.push(slot);
            cur = keys.newer_candidate(slot);
        }
        out
    }

    pub(super) fn store(core: &mut Core, now: Millis, space: &Space, keys: &[Key]) -> Vec<u32> {
        let Ok(Reply::Allocated(a)) =
            core.apply(now, &Command::Allocate { space: space.clone(), rank: 0, keys: keys.to_vec() })
        else {
            panic!("allocate")
        };
        let pages: Vec<u32> = a.iter().map(|a| a.page.unwrap()).collect();
        let confirmations = keys.iter().cloned().zip(pages.iter().copied()).collect();
        core.apply(now, &Command::Confirm { space: space.clone(), rank: 0, confirmations, releases: vec![] }).unwrap();
        pages
    }

    /// A core with one vLLM rank of `pages` pages holding `n` keys `k0`, `k1`, … (stored at 0).
    pub(super) fn stored_core(settings: Settings, pages: u32, n: usize) -> (Core, Vec<Key>, Vec<u32>) {
        let mut core = Core::new(1, settings);
        core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: pages }).unwrap();
        let keys: Vec<Key> = (0..n).map(|i| Key::parse(&alloc::format!("k{i}")).unwrap()).collect();
        let stored = store(&mut core, 0, &Space::Vllm, &keys);
        (core, keys, stored)
    }

    /// Clear, Reset, ExportSglang and Inspect answer as of `now`: the same whether or not a read
    /// (Stats) let the clock act on a reservation that ran out just before (found by
    /// `dropping_the_reads_changes_no_reply_and_no_state`).
    #[cfg(feature = "serde")] // compares snapshots
    #[test]
    fn counts_and_exports_do_not_depend_on_an_earlier_read() {
        let sglang = Space::Sglang { rank: 0, namespace: "ns".into() };
        // No quarantine: a page whose reservation ran out goes straight back to the free list.
        let settings = Settings { quarantine: 0, ..Settings::default() };
        let ttl = settings.reservation_ttl;
        let inspect = Command::Inspect { space: Space::Vllm, key: Key::parse("a").unwrap() };
        for cmd in [
            Command::Clear { space: Space::Vllm },
            Command::Reset { space: Space::Vllm },
            Command::ExportSglang,
            inspect,
        ] {
            let run = |read: bool| {
                let mut core = Core::new(1, settings);
                for space in [Space::Vllm, sglang.clone()] {
                    core.apply(0, &Command::Initialize { space: space.clone(), rank: 0, num_pages: 3 }).unwrap();
                    let keys = vec![Key::parse("a").unwrap(), Key::parse("b").unwrap()];
                    core.apply(0, &Command::Allocate { space, rank: 0, keys }).unwrap();
                }
                if read {
                    core.apply(ttl, &Command::Stats).unwrap();
                }
                let reply = core.apply(ttl, &cmd);
                // Once the clock has acted everywhere, the states agree too.
                (reply, core.apply(ttl, &Command::Stats), core.snapshot())
            };
            assert_eq!(run(true), run(false), "{cmd:?}");
        }
    }

    #[test]
    fn a_world_size_that_leaves_a_rank_outside_is_refused() {
        let mut core = Core::new(1, Settings::default());
        for rank in 0..3 {
            core.apply(0, &Command::Initialize { space: Space::Vllm, rank, num_pages: 4 }).unwrap();
        }
        let small = Settings { world_size: Some(2), ..Settings::default() };
        assert_eq!(core.apply(0, &Command::Configure(small)), Err(Error::RankOutsideWorld { rank: 2, world_size: 2 }));
        assert_eq!(core.settings(), Settings::default());
        let fits = Settings { world_size: Some(3), ..Settings::default() };
        assert_eq!(core.apply(0, &Command::Configure(fits)), Ok(Reply::Configured));
    }
}

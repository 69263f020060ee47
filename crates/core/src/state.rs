//! The state machine: [`Core::apply`] runs one command against every space's pools and keys.
//!
//! Page life cycle: free → reserved (allocate, with a deadline) → committed (confirm) → free
//! (release, delete, eviction, expiry). Pages taken from a writer whose reservation expired, or
//! from a deleted key that a reader still holds a lease on, pass through quarantine first.
//! Every deadline lives in a FIFO queue drained at the start of each state-changing command,
//! in deadline order across the queues, so when a drain happens never changes its outcome.

use alloc::collections::{BTreeMap, VecDeque};
use alloc::string::String;
use alloc::vec::Vec;

use crate::command::*;
use crate::error::{Error, PagePlace};
use crate::key::Key;
use crate::keys::KeyTable;
use crate::pool::{GEN_MASK, Page, PageState, Pool, PoolOrder};

#[cfg(feature = "serde")]
pub(crate) mod snapshot;
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

impl Leases {
    fn slot_mut(&mut self, slot: u32) -> &mut LeaseSlot {
        let i = slot as usize;
        if i >= self.slots.len() {
            self.slots.resize(i + 1, LeaseSlot::default());
        }
        &mut self.slots[i]
    }

    /// The end of `slot`'s lease; 0 when it holds none.
    fn until(&self, slot: u32) -> Millis {
        self.slots.get(slot as usize).map_or(0, |s| s.until)
    }

    /// Starts fetching `slot`'s lease record (see [`KeyTable::prefetch_touch`]).
    fn prefetch(&self, slot: u32) {
        crate::slot_index::prefetch(self.slots.as_ptr().wrapping_add(slot as usize));
    }

    fn set_until(&mut self, slot: u32, until: Millis) {
        if until > 0 || (slot as usize) < self.slots.len() {
            self.slot_mut(slot).until = until;
        }
    }

    /// Moves `slot`'s stamp on (every entry queued for it so far is stale now); returns it.
    fn bump(&mut self, slot: u32) -> u32 {
        let s = self.slot_mut(slot);
        s.stamp = s.stamp.wrapping_add(1);
        s.stamp
    }

    /// Whether an entry of `slot` with `stamp` is its live one.
    fn is_live(&self, slot: u32, stamp: u32) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.stamp == stamp)
    }

    /// Queues the end of `slot`'s lease at `at`, as its one live entry.
    fn start(&mut self, at: Millis, slot: u32) {
        let stamp = self.bump(slot);
        self.queue.push(core::cmp::Reverse((at, slot, stamp)));
    }

    /// `slot`'s lease ended early (delete, dropped pages): its entry is stale now.
    fn forget(&mut self, slot: u32) {
        if (slot as usize) < self.slots.len() {
            self.bump(slot);
        }
    }

    /// The next live entry due by `now` (taken out of the queue: the slot has no live entry
    /// until the caller queues or forgets it), dropping stale ones on the way.
    fn pop_due(&mut self, now: Millis) -> Option<(Millis, u32)> {
        while let Some(&core::cmp::Reverse((at, slot, stamp))) = self.queue.peek()
            && at <= now
        {
            self.queue.pop();
            if self.is_live(slot, stamp) {
                self.forget(slot);
                return Some((at, slot));
            }
        }
        None
    }

    /// The live entries `(at, slot)`, in no particular order.
    fn live(&self) -> impl Iterator<Item = (Millis, u32)> + '_ {
        self.queue.iter().filter(|e| self.is_live(e.0.1, e.0.2)).map(|e| (e.0.0, e.0.1))
    }
}

/// A FIFO of deadlines. Durations are fixed per queue, so creation order is deadline order;
/// a push never goes below the last deadline (after a setting shrinks a duration, newer entries
/// wait for older ones rather than break the order).
#[derive(Clone, Debug)]
struct Deadlines(VecDeque<PageDeadline>);

impl Deadlines {
    fn new() -> Self {
        Deadlines(VecDeque::new())
    }

    /// Queues `item`, raising its deadline to the last one if needed; returns the deadline used.
    fn push(&mut self, mut item: PageDeadline) -> Millis {
        if let Some(last) = self.0.back() {
            item.at = item.at.max(last.at);
        }
        self.0.push_back(item);
        item.at
    }

    fn due(&self, now: Millis) -> Option<Millis> {
        self.0.front().map(|d| d.at).filter(|&at| at <= now)
    }

    fn pop(&mut self) -> Option<PageDeadline> {
        self.0.pop_front()
    }

    /// Gives back the memory of a drained burst (amortised O(1): copies only after 3/4 of the
    /// capacity was drained).
    fn shrink(&mut self) {
        if self.0.capacity() > 1024 && self.0.len() * 4 < self.0.capacity() {
            self.0.shrink_to(self.0.len() * 2);
        }
    }
}

/// Stale reservation deadlines tolerated beyond the live ones before they are dropped.
const STALE_DEADLINES: usize = 4096;

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

impl Spare {
    /// Keeps the memory of `sp`, a space just removed.
    fn keep(&mut self, sp: SpaceState) {
        self.tables.extend(sp.ranks.into_values().map(Pool::into_table));
        // Clears without initializes between them (SGLang's import makes its own pools) must
        // not pile tables up: the largest few are the ones worth keeping; `pool` takes the
        // last, the largest.
        self.tables.sort_by_key(Vec::capacity);
        let surplus = self.tables.len().saturating_sub(SPARE_TABLES);
        self.tables.drain(..surplus);
        let mut keys = sp.keys;
        if self.keys.as_ref().is_none_or(|k| k.capacity() < keys.capacity()) {
            keys.clear();
            self.keys = Some(keys);
        }
    }

    /// A new, empty space in the spare key table's memory.
    fn space(&mut self, space: &Space, seed: u64) -> SpaceState {
        let mut sp = SpaceState::new(space, seed);
        if let Some(keys) = self.keys.take() {
            // Every space of a core hashes with the core's seed.
            sp.keys = keys;
        }
        sp
    }

    /// A new pool in a spare page table's memory.
    fn pool(&mut self, num_pages: u32, order: PoolOrder) -> Pool {
        match self.tables.pop() {
            Some(table) => Pool::reusing(num_pages, order, table),
            None => Pool::new(num_pages, order),
        }
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

    /// Applies every deadline `<= now`, in deadline order across the queues (ties: reservations,
    /// then expiry quarantine, then lease quarantine), so draining at t1 and then t2 ends in the
    /// same state as draining once at t2.
    fn expire(&mut self, settings: &Settings, now: Millis) {
        loop {
            let due = [self.reservations.due(now), self.expired.due(now), self.held.due(now)];
            let Some((which, _)) =
                due.iter().enumerate().filter_map(|(i, at)| at.map(|at| (i, at))).min_by_key(|&(i, at)| (at, i))
            else {
                break;
            };
            match which {
                0 => {
                    let d = self.reservations.pop().expect("due");
                    self.end_reservation(settings, d);
                }
                1 => {
                    let d = self.expired.pop().expect("due");
                    self.end_quarantine(d);
                }
                _ => {
                    let d = self.held.pop().expect("due");
                    self.end_quarantine(d);
                }
            }
        }
        let mut ended = Vec::new();
        while let Some((_, slot)) = self.leases.pop_due(now) {
            let until = self.leases.until(slot);
            if until > now {
                // Extended since this entry was queued: it ends later.
                self.leases.start(until, slot);
            } else {
                ended.push(slot);
            }
        }
        // Each ending lease finds its key's candidate place through its recency neighbours;
        // when a large share of the keys' leases end at once (`LeaseAll` after a recovery ends
        // every lease in one drain, in slot order), one pass over the recency list is cheaper.
        let rebuild = ended.len() > 1024 && ended.len() * 8 > self.keys.committed_len();
        for &slot in &ended {
            self.set_unleased(slot, !rebuild);
        }
        if rebuild {
            let leases = &self.leases;
            self.keys.rebuild_candidates(|slot| leases.until(slot) > 0);
        }
        self.reservations.shrink();
        self.expired.shrink();
        self.held.shrink();
    }

    /// Whether `d`, a deadline of `pool`'s rank, still names a reserved page (the reservation
    /// it was queued for).
    fn reservation_is_live(pool: &Pool, d: &PageDeadline) -> bool {
        d.page < pool.num_pages()
            && matches!(pool.state(d.page), Page::Reserved { generation, .. } if generation == (d.generation & GEN_MASK) as u32)
    }

    /// Drops the deadlines of reservations that were confirmed or released (expiry would skip
    /// them) once they outnumber the live ones by [`STALE_DEADLINES`]: a confirmed page's
    /// deadline would otherwise stay queued for the whole reservation TTL (at a million saves a
    /// second and the 60 s default, ~1.4 GB of them). Order is kept; amortised O(1) a push.
    fn compact_reservations(&mut self) {
        let live: usize = self.ranks.values().map(|p| p.counts().reserved as usize).sum();
        if self.reservations.0.len() <= 2 * live + STALE_DEADLINES {
            return;
        }
        // Runs of deadlines share a rank: its pool is looked up once a run, not once a
        // deadline (a map search per deadline was most of this through the plugin).
        let mut pool: Option<(u32, Option<&Pool>)> = None;
        let ranks = &self.ranks;
        self.reservations.0.retain(|d| {
            let p = match pool {
                Some((rank, p)) if rank == d.rank => p,
                _ => pool.insert((d.rank, ranks.get(&d.rank))).1,
            };
            p.is_some_and(|p| SpaceState::reservation_is_live(p, d))
        });
        self.reservations.shrink();
    }

    fn end_reservation(&mut self, settings: &Settings, d: PageDeadline) {
        let Some(pool) = self.ranks.get_mut(&d.rank) else { return };
        if d.page >= pool.num_pages() {
            return;
        }
        let Page::Reserved { slot, generation } = pool.state(d.page) else { return };
        if generation != (d.generation & GEN_MASK) as u32 {
            return;
        }
        self.counters.expired_reservations += 1;
        if settings.quarantine > 0 {
            let generation = self.next_generation;
            self.next_generation += 1;
            pool.mark(d.page, PageState::quarantined(generation));
            self.expired.push(PageDeadline { at: d.at.saturating_add(settings.quarantine), generation, ..d });
            self.counters.quarantined_pages += 1;
        } else {
            pool.free(d.page);
        }
        self.keys.get_mut(slot).reservations -= 1;
        self.keys.release_if_unused(slot);
    }

    fn end_quarantine(&mut self, d: PageDeadline) {
        let Some(pool) = self.ranks.get_mut(&d.rank) else { return };
        if d.page < pool.num_pages()
            && pool.state(d.page) == (Page::Quarantined { generation: (d.generation & GEN_MASK) as u32 })
        {
            pool.free(d.page);
        }
    }

    /// Gives `slot` a read lease until `now + duration` (or longer, if it has one already).
    /// Most reads extend a lease (a key read again soon), so that part is inlined into
    /// `get_locations`' per-key loop and a lease's start is a call of its own: through the
    /// plugin a 32-key `get_locations` ran 26.9k → 25.8k instructions (one wasm call less a
    /// key). Natively a plain `#[inline]` left it a call (11.7k); forced, 11.1k
    /// (`examples/instructions.rs`, callgrind). (`touch` forced inline cost more: 12.2k.)
    #[inline(always)]
    fn lease(&mut self, slot: u32, now: Millis, duration: Millis) {
        if duration == 0 {
            return;
        }
        let at = now.saturating_add(duration);
        let until = self.leases.until(slot);
        if until == 0 {
            self.start_lease(slot, at);
        } else if at > until {
            self.leases.set_until(slot, at);
        }
    }

    /// [`SpaceState::lease`] and a touch for each of `allocate`'s cache hits. Its own function
    /// in the guest: with the lease inlined into `allocate`'s handler, the plugin's 32-key
    /// saves (which hit nothing) ran +0.3k instructions.
    #[cfg_attr(target_arch = "wasm32", inline(never))]
    fn lease_hits(&mut self, hits: &[Option<(u32, u32)>], now: Millis, duration: Millis) {
        for &(slot, _) in hits.iter().flatten() {
            self.lease(slot, now, duration);
            self.keys.touch(slot);
        }
    }

    /// [`SpaceState::lease`] for a key that holds none: its pages count as leased, it waits in
    /// the lease queue, and it is no eviction candidate until the lease ends.
    #[cfg_attr(target_arch = "wasm32", inline(never))]
    fn start_lease(&mut self, slot: u32, at: Millis) {
        for (rank, _) in self.keys.get(slot).pages.iter() {
            self.ranks.get_mut(&rank).expect("key's rank exists").add_leased(1);
        }
        self.leases.set_until(slot, at);
        self.leases.start(at, slot);
        self.keys.leave_candidates(slot);
    }

    /// Ends `slot`'s lease; `rejoin`: put it back among the eviction candidates now (else the
    /// caller rebuilds the candidate list).
    fn set_unleased(&mut self, slot: u32, rejoin: bool) {
        if self.leases.until(slot) == 0 {
            return;
        }
        self.leases.set_until(slot, 0);
        if rejoin {
            self.keys.join_candidates(slot);
        }
        self.leases.forget(slot);
        for (rank, _) in self.keys.get(slot).pages.iter() {
            self.ranks.get_mut(&rank).expect("key's rank exists").add_leased(-1);
        }
    }

    /// Takes every committed page from `slot` (except on `gone_rank`, whose pool was replaced):
    /// pages a reader still holds a lease on are quarantined until the lease ends, the rest are
    /// free at once.
    fn drop_pages(&mut self, slot: u32, gone_rank: Option<u32>) {
        let lease_until = self.leases.until(slot);
        let pages = core::mem::take(&mut self.keys.get_mut(slot).pages);
        for (rank, page) in pages.iter() {
            if Some(rank) == gone_rank {
                continue;
            }
            let pool = self.ranks.get_mut(&rank).expect("key's rank exists");
            if lease_until > 0 {
                pool.add_leased(-1);
                let generation = self.next_generation;
                self.next_generation += 1;
                pool.mark(page, PageState::quarantined(generation));
                self.held.push(PageDeadline { at: lease_until, rank, page, generation });
                self.counters.quarantined_pages += 1;
            } else {
                pool.free(page);
            }
        }
        if lease_until > 0 {
            self.leases.set_until(slot, 0);
            self.leases.forget(slot);
        }
        self.keys.unlink(slot);
        self.keys.release_if_unused(slot);
    }

    fn evictable(&self, settings: &Settings, world: u32, slot: u32, now: Millis) -> bool {
        if self.leases.until(slot) > now {
            return false;
        }
        let e = self.keys.get(slot);
        is_complete(world, e.pages.len()) || now / 1000 > u64::from(e.since_s) + settings.reservation_ttl.div_ceil(1000)
    }

    /// Evicts least-recently-used keys with a page on `rank` until `need` pages are free and
    /// `need` more would keep usage at or under the low watermark. O(evicted + skipped).
    ///
    /// `protected`: the oldest of the batch's cache hits, which were just made the most recently
    /// used keys; the walk stops there, so no key reported cached is evicted by its own batch
    /// (even with no read lease to protect it).
    fn make_room(&mut self, settings: &Settings, now: Millis, rank: u32, need: u32, protected: Option<u32>) {
        let world = world_count(settings, self);
        let n = u64::from(self.ranks[&rank].num_pages());
        let low = n * u64::from(settings.evict_low_permille) / 1000;
        // Only candidates (committed keys without a lease), in recency order: a leased key is
        // never evicted, so the walk does not step over one.
        let mut cur = self.keys.oldest_candidate();
        if let Some(oldest) = cur {
            self.keys.prefetch_entry(oldest);
        }
        while let Some(slot) = cur {
            if Some(slot) == protected {
                break;
            }
            let counts = self.ranks[&rank].counts();
            let used = n - u64::from(counts.free);
            if counts.free >= need && used + u64::from(need) <= low {
                break;
            }
            cur = self.keys.newer_candidate(slot);
            if let Some(next) = cur {
                self.keys.prefetch_walk(next);
            }
            if self.keys.get(slot).pages.get(rank).is_some() && self.evictable(settings, world, slot, now) {
                self.drop_pages(slot, None);
                self.counters.evictions += 1;
            }
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
            Command::Configure(s) => {
                if let Some(world_size) = s.world_size {
                    let outside = self.spaces.get(&Space::Vllm).and_then(|sp| sp.ranks.keys().next_back());
                    if let Some(&rank) = outside.filter(|&&r| r >= world_size) {
                        return Err(Error::RankOutsideWorld { rank, world_size });
                    }
                }
                // Deadlines due by now run out under the settings they were made with, whether
                // or not a read (Stats) drained them earlier: replay must not depend on reads.
                self.expire_all(now);
                self.settings = *s;
                Ok(Reply::Configured)
            }
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
            Command::LeaseAll => {
                self.expire_all(now);
                let settings = self.settings;
                let mut keys = 0u64;
                for sp in self.spaces.values_mut() {
                    let slots: Vec<u32> =
                        sp.keys.entries().filter(|(_, e)| e.pages.len() > 0).map(|(s, _)| s).collect();
                    for slot in slots {
                        sp.lease(slot, now, settings.read_lease);
                        keys += 1;
                    }
                }
                Ok(Reply::Leased(keys))
            }
            Command::Reset { space } => {
                self.space_mut(space, now);
                let Some(old) = self.spaces.remove(space) else {
                    return Err(missing_space(space));
                };
                // A clear that keeps the ranks: the new space and pools reuse the old memory.
                let keys = old.keys.len() as u64;
                let (order, ranks): (PoolOrder, Vec<(u32, u32)>) =
                    (old.order, old.ranks.iter().map(|(&rank, p)| (rank, p.num_pages())).collect());
                self.spare.keep(old);
                let mut sp = self.spare.space(space, self.seed);
                for (rank, num_pages) in ranks {
                    sp.ranks.insert(rank, self.spare.pool(num_pages, order));
                }
                self.spaces.insert(space.clone(), sp);
                Ok(Reply::Cleared { ranks: 0, keys })
            }
            Command::Stats => {
                self.expire_all(now);
                Ok(Reply::Stats(alloc::boxed::Box::new(self.stats())))
            }
        }
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

    fn initialize(&mut self, now: Millis, space: &Space, rank: u32, num_pages: u32) -> Result<Reply, Error> {
        if num_pages == 0 {
            return Err(Error::ZeroPages { rank });
        }
        if let Some(world_size) = self.settings.world_size
            && *space == Space::Vllm
            && rank >= world_size
        {
            return Err(Error::RankOutsideWorld { rank, world_size });
        }
        let (seed, spare) = (self.seed, &mut self.spare);
        let sp = self.spaces.entry(space.clone()).or_insert_with(|| spare.space(space, seed));
        sp.expire(&self.settings, now);
        let outcome = match sp.ranks.get(&rank) {
            None => {
                let joined_after_keys = sp.ranks.values().any(|p| p.counts().committed > 0);
                sp.ranks.insert(rank, spare.pool(num_pages, sp.order));
                InitOutcome::Created { joined_after_keys }
            }
            Some(p) if p.num_pages() == num_pages => InitOutcome::Unchanged,
            Some(_) => {
                let old = sp.ranks.insert(rank, Pool::new(num_pages, sp.order)).expect("rank exists");
                let mut dropped = Vec::new();
                let mut unreserved = Vec::new();
                for (_, page) in old.used_pages() {
                    match page {
                        Page::Committed { slot } => dropped.push(slot),
                        Page::Reserved { slot, .. } => unreserved.push(slot),
                        Page::Free | Page::Quarantined { .. } => {}
                    }
                }
                for &slot in &unreserved {
                    sp.keys.get_mut(slot).reservations -= 1;
                }
                for &slot in &dropped {
                    sp.drop_pages(slot, Some(rank));
                }
                // A key can hold several of the old pages (two writers) and also have been
                // dropped: releasing is a no-op for a slot already gone.
                for slot in unreserved {
                    sp.keys.release_if_unused(slot);
                }
                sp.counters.dropped_keys += dropped.len() as u64;
                InitOutcome::Recreated { old_num_pages: old.num_pages(), dropped_keys: dropped.len() as u32 }
            }
        };
        Ok(Reply::Initialized { rank, num_pages, outcome })
    }

    fn allocate(&mut self, now: Millis, space: &Space, rank: u32, keys: &[Key]) -> Result<Reply, Error> {
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
        if settings.eviction == Eviction::Lru && fresh > 0 {
            let counts = sp.ranks[&rank].counts();
            let n = u64::from(sp.ranks[&rank].num_pages());
            let high = n * u64::from(settings.evict_high_permille) / 1000;
            if counts.free < fresh || n - u64::from(counts.free) + u64::from(fresh) > high {
                // The batch's hits are the newest keys; the walk stops at the first of them it
                // can reach: the oldest hit without a lease (a leased one is no candidate, and
                // a lease outlives a setting that lowered the read lease to 0).
                let protected = hits.iter().flatten().map(|&(slot, _)| slot).find(|&slot| sp.leases.until(slot) == 0);
                sp.make_room(&settings, now, rank, fresh, protected);
                // Evicted keys lost their slots (hits are protected and keep theirs).
                found = find(sp);
            }
        }

        let SpaceState { ranks, keys: table, reservations, next_generation, counters, order, .. } = sp;
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
        sp.compact_reservations();
        Ok(Reply::Allocated(out))
    }

    fn confirm(
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

    fn exists(&self, space: &Space, keys: &[Key]) -> Result<Vec<bool>, Error> {
        let Some(sp) = self.spaces.get(space) else {
            // vLLM's lookup names no rank: before any rank exists, nothing exists.
            return match space {
                Space::Vllm => Ok(alloc::vec![false; keys.len()]),
                Space::Sglang { .. } => Err(missing_space(space)),
            };
        };
        let world = world_count(&self.settings, sp);
        let complete = |slot: Option<u32>| slot.is_some_and(|s| is_complete(world, sp.keys.get(s).pages.len()));
        Ok(sp.keys.find_batch_of(keys, complete))
    }

    fn locations(&mut self, now: Millis, space: &Space, rank: u32, keys: &[Key]) -> Result<Reply, Error> {
        let settings = self.settings;
        let sp = self.space_mut(space, now).filter(|sp| sp.ranks.contains_key(&rank));
        let Some(sp) = sp else {
            return Err(Error::RankNotInitialized { rank });
        };
        let world = world_count(&settings, sp);
        let mut pages = Vec::with_capacity(keys.len());
        // Leases and touches below add and remove no key: every slot found here stays right.
        let found = sp.keys.find_batch_of(keys, |slot| slot);
        // Every hit's lease record and recency neighbours, asked for at once (see
        // `KeyTable::prefetch_touch`): 32 keys among 10^6, 8.6 → 7.2 µs natively (medians of 3).
        if crate::slot_index::PREFETCHES {
            for &slot in found.iter().flatten() {
                sp.keys.prefetch_touch(slot);
                sp.leases.prefetch(slot);
            }
        }
        for slot in found {
            let hit = slot.and_then(|slot| {
                let e = sp.keys.get(slot);
                if is_complete(world, e.pages.len()) { e.pages.get(rank).map(|p| (slot, p)) } else { None }
            });
            match hit {
                Some((slot, page)) => {
                    // The reader is about to read the page: it must not change hands meanwhile.
                    sp.lease(slot, now, settings.read_lease);
                    sp.keys.touch(slot);
                    sp.counters.location_hits += 1;
                    pages.push(Some(page));
                }
                None => {
                    sp.counters.location_misses += 1;
                    pages.push(None);
                }
            }
        }
        Ok(Reply::Locations(pages))
    }

    fn delete(&mut self, now: Millis, space: &Space, keys: &[Key]) -> Result<u32, Error> {
        let Some(sp) = self.space_mut(space, now) else {
            return match space {
                Space::Vllm => Ok(0),
                Space::Sglang { .. } => Err(missing_space(space)),
            };
        };
        let mut deleted = 0;
        for &(i, hash) in &distinct_indices(sp.keys.hasher(), keys) {
            let Some(slot) = sp.keys.find_hashed(&keys[i as usize], hash) else { continue };
            if sp.keys.get(slot).pages.len() > 0 {
                sp.drop_pages(slot, None);
                deleted += 1;
            }
        }
        sp.counters.deleted += u64::from(deleted);
        Ok(deleted)
    }

    fn inspect(&self, now: Millis, space: &Space, key: &Key) -> Option<KeyInfo> {
        let sp = self.spaces.get(space)?;
        let slot = sp.keys.find(key)?;
        let e = sp.keys.get(slot);
        let world = world_count(&self.settings, sp);
        Some(KeyInfo {
            key: e.key.clone(),
            pages: e.pages.iter().collect(),
            complete: is_complete(world, e.pages.len()),
            reservations: e.reservations,
            lease_remaining: sp.leases.until(slot).saturating_sub(now),
            evictable: e.pages.len() > 0 && sp.evictable(&self.settings, world, slot, now),
        })
    }

    fn import_sglang(&mut self, now: Millis, pools: &[SglangPool], replace: bool) -> Result<Reply, Error> {
        use alloc::format;
        let refuse = |reason: String| Err(Error::ImportRefused { reason });
        let existing = self.spaces.keys().filter(|s| matches!(s, Space::Sglang { .. })).count();
        if existing > 0 && !replace {
            return Err(Error::SglangPoolsExist { pools: existing as u32 });
        }
        // Check everything before changing anything.
        let mut seen_pools = alloc::collections::BTreeSet::new();
        for p in pools {
            let name = format!("{}:{}", p.rank, p.namespace);
            if !seen_pools.insert((p.rank, p.namespace.clone())) {
                return refuse(format!("pool \"{name}\" appears twice"));
            }
            if p.num_pages == 0 {
                return refuse(format!("\"{name}\".num_pages: must be at least 1"));
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
                    return refuse(format!(
                        "\"{name}\".{field}[{i}]: page {page} is out of range (the pool has {} pages)",
                        p.num_pages
                    ));
                };
                if let Some((f0, i0)) = *slot {
                    return refuse(format!("\"{name}\".{field}[{i}]: page {page} is listed twice (also {f0}[{i0}])"));
                }
                *slot = Some((field, i));
            }
            let mut keys = alloc::collections::BTreeMap::new();
            for (i, (k, _)) in p.keys.iter().enumerate() {
                if let Some(j) = keys.insert(k, i) {
                    return refuse(format!("\"{name}\".key_to_index[{i}]: key {k:?} is listed twice (also [{j}])"));
                }
            }
        }
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
    fn export_sglang(&self) -> Vec<SglangPool> {
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

    fn clear(&mut self, space: &Space) -> Reply {
        match self.spaces.remove(space) {
            Some(sp) => {
                let reply = Reply::Cleared { ranks: sp.ranks.len() as u32, keys: sp.keys.len() as u64 };
                self.spare.keep(sp);
                reply
            }
            None => Reply::Cleared { ranks: 0, keys: 0 },
        }
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

    /// Checks every invariant of the state; O(state), for tests and debugging.
    ///
    /// Per rank: free + reserved + committed + quarantined = num_pages and the free queue holds
    /// exactly the free pages; no page is owned by two keys; every key's page points back at
    /// that key; every reserved page belongs to a stored key whose reservation count matches and
    /// has a pending deadline; every quarantined page has a pending deadline; the leased-page
    /// counts match the keys holding leases; the recency list holds exactly the committed keys.
    pub fn check_invariants(&self) -> Result<(), String> {
        use alloc::format;
        for (space, sp) in &self.spaces {
            sp.keys.check(|slot| sp.leases.until(slot) > 0).map_err(|e| format!("{space:?} keys: {e}"))?;
            if let Some(slot) = (0..sp.leases.slots.len() as u32)
                .find(|&s| sp.leases.until(s) > 0 && sp.keys.get_live(s).is_none_or(|e| e.pages.len() == 0))
            {
                return Err(format!("{space:?} slot {slot} holds a lease but no committed page"));
            }
            let mut reserved_per_slot: BTreeMap<u32, u32> = BTreeMap::new();
            // Sets of what the queues hold, so the check stays O(state log state).
            let queued = |q: &Deadlines| {
                q.0.iter()
                    .map(|d| (d.rank, d.page, (d.generation & GEN_MASK) as u32))
                    .collect::<alloc::collections::BTreeSet<_>>()
            };
            let (reservations, expired, held) = (queued(&sp.reservations), queued(&sp.expired), queued(&sp.held));
            // Slot → the end of its live entry; a slot with two live entries is refused.
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
            let pending = |q: &alloc::collections::BTreeSet<(u32, u32, u32)>, rank: u32, page: u32, generation: u32| {
                q.contains(&(rank, page, generation))
            };
            for (&rank, pool) in &sp.ranks {
                pool.check().map_err(|e| format!("{space:?} rank {rank}: {e}"))?;
                for (page, state) in pool.used_pages() {
                    match state {
                        Page::Committed { slot } => {
                            let Some(e) = sp.keys.get_live(slot) else {
                                return Err(format!(
                                    "{space:?} rank {rank} page {page} committed to a vacant slot {slot}"
                                ));
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
            for (&rank, pool) in &sp.ranks {
                let want = leased_per_rank.get(&rank).copied().unwrap_or(0);
                if pool.counts().leased != want {
                    return Err(format!(
                        "{space:?} rank {rank} counts {} leased pages, keys hold {want}",
                        pool.counts().leased
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The refusal for a command on a space that does not exist.
fn missing_space(space: &Space) -> Error {
    match space {
        Space::Vllm => Error::RankNotInitialized { rank: 0 },
        Space::Sglang { rank, .. } => Error::RankNotInitialized { rank: *rank },
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

    /// A seeded mix of saves, lookups, loads and deletes on vLLM ranks 0 and 1 (96 pages each,
    /// eviction on, so pages are reused), from `step` on; every reply in order.
    fn mixed_stream(core: &mut Core, seed: u64, step: u64, commands: u64) -> Vec<Result<Reply, Error>> {
        let v = Space::Vllm;
        let mut rng = seed | 1;
        let mut replies = Vec::new();
        for i in step..step + commands {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let rank = (rng >> 40) as u32 % 2;
            let keys: Vec<Key> = (0..1 + rng % 24)
                .map(|j| Key::parse(&alloc::format!("{:032x}", (rng >> 8) % 300 + j)).unwrap())
                .collect();
            let now = i * 7;
            let reply = match rng % 5 {
                0 | 1 => match core.apply(now, &Command::Allocate { space: v.clone(), rank, keys: keys.clone() }) {
                    Ok(Reply::Allocated(a)) => {
                        let confirmations =
                            a.iter().filter_map(|x| Some((keys[x.index as usize].clone(), x.page?))).collect();
                        replies.push(Ok(Reply::Allocated(a)));
                        core.apply(now, &Command::Confirm { space: v.clone(), rank, confirmations, releases: vec![] })
                    }
                    other => other,
                },
                2 => core.apply(now, &Command::Exists { space: v.clone(), keys }),
                3 => core.apply(now, &Command::Locations { space: v.clone(), rank, keys }),
                _ => core.apply(now, &Command::Delete { space: v.clone(), keys }),
            };
            replies.push(reply);
        }
        replies
    }

    fn init_ranks(core: &mut Core, now: Millis) {
        for rank in 0..2 {
            core.apply(now, &Command::Initialize { space: Space::Vllm, rank, num_pages: 96 }).unwrap();
        }
    }

    #[test]
    fn a_cleared_or_reset_core_answers_like_a_fresh_one_in_the_memory_it_kept() {
        let v = Space::Vllm;
        for seed in [3u64, 0x5eed, 0xdead_beef] {
            // Fill (the tables grow), then clear or reset: the spare memory is reused.
            let mut cleared = Core::new(9, Settings::default());
            init_ranks(&mut cleared, 0);
            mixed_stream(&mut cleared, seed ^ 1, 0, 2_000);
            let grown = cleared.spaces[&v].keys.capacity();
            assert!(grown >= 64, "the table grew: {grown}");
            cleared.apply(14_000, &Command::Clear { space: v.clone() }).unwrap();
            init_ranks(&mut cleared, 14_000);
            assert_eq!(cleared.spaces[&v].keys.capacity(), grown, "the new space took the cleared table");
            assert!(cleared.spare.keys.is_none() && cleared.spare.tables.is_empty());

            let mut reset = Core::new(9, Settings::default());
            init_ranks(&mut reset, 0);
            mixed_stream(&mut reset, seed ^ 1, 0, 2_000);
            reset.apply(14_000, &Command::Reset { space: v.clone() }).unwrap();

            let mut fresh = Core::new(9, Settings::default());
            init_ranks(&mut fresh, 14_000);
            let want = mixed_stream(&mut fresh, seed, 2_000, 3_000);
            assert!(want.iter().any(|r| matches!(r, Ok(Reply::Deleted(n)) if *n > 0)), "the stream deletes");
            for core in [&mut cleared, &mut reset] {
                assert_eq!(mixed_stream(core, seed, 2_000, 3_000), want);
                core.check_invariants().unwrap();
                assert_eq!(core.stats(), fresh.stats());
                assert_eq!(core.free_list(&v, 0), fresh.free_list(&v, 0));
                #[cfg(feature = "serde")]
                assert!(core.snapshot() == fresh.snapshot(), "same state, byte for byte");
            }
        }
    }

    #[test]
    fn clearing_keeps_the_largest_key_table_and_the_largest_page_tables() {
        let mut core = Core::new(9, Settings::default());
        let spaces = [Space::Vllm, Space::Sglang { rank: 0, namespace: "a".into() }];
        for (n, space) in [600u32, 60].into_iter().zip(&spaces) {
            core.apply(0, &Command::Initialize { space: space.clone(), rank: 0, num_pages: n }).unwrap();
            let keys: Vec<Key> = (0..n).map(|i| Key::parse(&alloc::format!("{i:032x}")).unwrap()).collect();
            store(&mut core, 0, space, &keys);
        }
        let big = core.spaces[&spaces[0]].keys.capacity();
        assert!(big > core.spaces[&spaces[1]].keys.capacity());
        core.apply(1, &Command::Clear { space: spaces[0].clone() }).unwrap();
        core.apply(1, &Command::Clear { space: spaces[1].clone() }).unwrap();
        assert_eq!(core.spare.keys.as_ref().map(KeyTable::capacity), Some(big));
        assert_eq!(core.spare.keys.as_ref().map(KeyTable::len), Some(0));
        assert_eq!(core.spare.tables.len(), 2);
        // A clone (and so a restored core) starts without spare memory; the state is the same.
        assert!(core.clone().spare.keys.is_none());
        // A clear of more ranks than SPARE_TABLES keeps that many page tables, the largest
        // (a new rank takes the largest).
        let v = Space::Vllm;
        for rank in 0..20u32 {
            core.apply(2, &Command::Initialize { space: v.clone(), rank, num_pages: 64 }).unwrap();
            let keys: Vec<Key> = (0..rank + 1).map(|i| Key::parse(&alloc::format!("{i:032x}")).unwrap()).collect();
            core.apply(2, &Command::Allocate { space: v.clone(), rank, keys }).unwrap();
        }
        core.apply(3, &Command::Clear { space: v }).unwrap();
        assert_eq!(core.spare.tables.len(), SPARE_TABLES);
        let caps: Vec<usize> = core.spare.tables.iter().map(Vec::capacity).collect();
        assert!(caps.is_sorted(), "{caps:?}");
        assert!(caps[SPARE_TABLES - 1] >= 600, "the 600-page rank's table is kept: {caps:?}");
    }

    #[cfg(feature = "serde")] // compares snapshots
    #[test]
    fn leases_cut_short_leave_no_lasting_entry_and_a_restored_core_goes_on_alike() {
        let v = Space::Vllm;
        let mut core = Core::new(1, Settings { read_lease: 10_000, quarantine: 0, ..Settings::default() });
        // Deleted leased pages wait out their lease: ~1,000 at a time here.
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 4_096 }).unwrap();
        let k = Key::parse("k").unwrap();
        // Every 10 ms: store k, read it (a lease), delete it: 3,000 times, 3 lease lengths.
        for cycle in 0..3_000u64 {
            let now = cycle * 10;
            let Ok(Reply::Allocated(a)) =
                core.apply(now, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![k.clone()] })
            else {
                panic!("allocate")
            };
            let confirmations = vec![(k.clone(), a[0].page.unwrap())];
            core.apply(now, &Command::Confirm { space: v.clone(), rank: 0, confirmations, releases: vec![] }).unwrap();
            core.apply(now + 1, &Command::Locations { space: v.clone(), rank: 0, keys: vec![k.clone()] }).unwrap();
            core.apply(now + 2, &Command::Delete { space: v.clone(), keys: vec![k.clone()] }).unwrap();
            core.check_invariants().unwrap();
        }
        // Entries of leases cut short leave when due (one lease length of them), not later.
        let queued = core.spaces[&v].leases.queue.len();
        assert!(queued <= 1_001, "{queued} lease entries queued");
        // A restored copy answers and ends like the original, even after the lease shrinks.
        let mut copy = Core::restore(&core.snapshot()).unwrap();
        let short = Settings { read_lease: 1_000, quarantine: 0, ..Settings::default() };
        let script = [
            (30_000, Command::Configure(short)),
            (30_001, Command::Allocate { space: v.clone(), rank: 0, keys: vec![k.clone()] }),
            (30_002, Command::Locations { space: v.clone(), rank: 0, keys: vec![k.clone()] }),
            (30_500, Command::Inspect { space: v.clone(), key: k.clone() }),
            (45_000, Command::Stats),
        ];
        for (now, cmd) in &script {
            assert_eq!(core.apply(*now, cmd), copy.apply(*now, cmd), "{cmd:?}");
        }
        assert_eq!(core.snapshot(), copy.snapshot());
    }

    /// The candidates for eviction, oldest first.
    fn candidates(core: &Core, space: &Space) -> Vec<u32> {
        let keys = &core.spaces[space].keys;
        let mut out = vec![];
        let mut cur = keys.oldest_candidate();
        while let Some(slot) = cur {
            out.push(slot);
            cur = keys.newer_candidate(slot);
        }
        out
    }

    fn store(core: &mut Core, now: Millis, space: &Space, keys: &[Key]) -> Vec<u32> {
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
    fn stored_core(settings: Settings, pages: u32, n: usize) -> (Core, Vec<Key>, Vec<u32>) {
        let mut core = Core::new(1, settings);
        core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: pages }).unwrap();
        let keys: Vec<Key> = (0..n).map(|i| Key::parse(&alloc::format!("k{i}")).unwrap()).collect();
        let stored = store(&mut core, 0, &Space::Vllm, &keys);
        (core, keys, stored)
    }

    #[test]
    fn the_eviction_walk_never_steps_over_leased_keys() {
        // A full pool whose keys are all being read but one: the walk must reach that one at
        // once (it used to step over every leased key on each allocate: ~15 ms at 10^6 keys).
        let v = Space::Vllm;
        let (mut core, keys, pages) = stored_core(Settings { read_lease: 5_000, ..Settings::default() }, 1_000, 1_000);
        assert_eq!(candidates(&core, &v).len(), 1_000);
        // Read every key but the 500th.
        let read: Vec<Key> = keys.iter().enumerate().filter(|&(i, _)| i != 500).map(|(_, k)| k.clone()).collect();
        core.apply(1, &Command::Locations { space: v.clone(), rank: 0, keys: read }).unwrap();
        let slot = |core: &Core, k: &Key| core.spaces[&v].keys.find(k).unwrap();
        assert_eq!(candidates(&core, &v), vec![slot(&core, &keys[500])], "the one unleased key is all the walk sees");
        core.check_invariants().unwrap();
        let fresh = Key::parse("fresh").unwrap();
        let reply = core.apply(2, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![fresh] }).unwrap();
        assert_eq!(reply, Reply::Allocated(vec![Allocation { index: 0, page: Some(pages[500]), cached: false }]));
        // When the leases end, the keys are candidates again in recency order (read order: the
        // read touched them), whatever order their ends were handled in.
        core.apply(5_001, &Command::Delete { space: v.clone(), keys: vec![Key::parse("none").unwrap()] }).unwrap();
        let want: Vec<u32> = (0..1_000).filter(|&i| i != 500).map(|i| slot(&core, &keys[i])).collect();
        assert_eq!(candidates(&core, &v), want);
        core.check_invariants().unwrap();
    }

    #[test]
    fn a_hit_is_not_evicted_by_its_own_batch_after_the_read_lease_is_set_to_zero() {
        // The oldest hit still holds a lease from before the setting (so it is no candidate):
        // the walk must still stop at the batch's hits (a case the native-vs-plugin differential found).
        let v = Space::Vllm;
        let settings = Settings { quarantine: 0, ..Settings::default() };
        let mut core = Core::new(1, settings);
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 2 }).unwrap();
        let (a, b, d) = (Key::parse("a").unwrap(), Key::parse("b").unwrap(), Key::parse("d").unwrap());
        store(&mut core, 0, &v, &[a.clone(), b.clone()]);
        core.apply(1, &Command::Locations { space: v.clone(), rank: 0, keys: vec![a.clone()] }).unwrap();
        core.apply(2, &Command::Configure(Settings { read_lease: 0, ..settings })).unwrap();
        let reply = core.apply(3, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![a, b.clone(), d] });
        let want = vec![
            Allocation { index: 0, page: Some(0), cached: true },
            Allocation { index: 1, page: Some(1), cached: true },
            Allocation { index: 2, page: None, cached: false },
        ];
        assert_eq!(reply, Ok(Reply::Allocated(want)));
        assert!(core.apply(3, &Command::Inspect { space: v.clone(), key: b }).unwrap() != Reply::Key(None));
        core.check_invariants().unwrap();
    }

    #[test]
    fn a_wave_of_lease_ends_rebuilds_the_candidates_in_recency_order() {
        // LeaseAll (as after a recovery), with recency unrelated to slot order: every lease
        // ends in one drain, which rebuilds the candidate list in one pass.
        let v = Space::Vllm;
        let (mut core, keys, _) = stored_core(Settings { read_lease: 1_000, ..Settings::default() }, 4_096, 3_000);
        // Reads (lease 0: none) in a scrambled order make the recency order differ from slots.
        core.apply(1, &Command::Configure(Settings { read_lease: 0, ..Settings::default() })).unwrap();
        let scrambled: Vec<Key> = (0..3_000).map(|i| keys[(i * 1_237) % 3_000].clone()).collect();
        core.apply(1, &Command::Locations { space: v.clone(), rank: 0, keys: scrambled.clone() }).unwrap();
        core.apply(2, &Command::Configure(Settings { read_lease: 1_000, ..Settings::default() })).unwrap();
        assert_eq!(core.apply(2, &Command::LeaseAll), Ok(Reply::Leased(3_000)));
        assert!(candidates(&core, &v).is_empty());
        core.apply(1_002, &Command::Delete { space: v.clone(), keys: vec![Key::parse("none").unwrap()] }).unwrap();
        let want: Vec<u32> = scrambled.iter().map(|k| core.spaces[&v].keys.find(k).unwrap()).collect();
        assert_eq!(candidates(&core, &v), want);
        core.check_invariants().unwrap();
    }

    #[test]
    fn when_leases_end_does_not_change_what_is_evicted() {
        // Two extended leases whose queued ends come due in one drain or in two (a read drains):
        // the same key is evicted either way (the least recently used one).
        let v = Space::Vllm;
        let mut core = Core::new(1, Settings { read_lease: 100, quarantine: 0, ..Settings::default() });
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 2 }).unwrap();
        let (a, b) = (Key::parse("a").unwrap(), Key::parse("b").unwrap());
        let pages = store(&mut core, 0, &v, &[a.clone(), b.clone()]);
        let read = |core: &mut Core, now: Millis, k: &Key| {
            core.apply(now, &Command::Locations { space: v.clone(), rank: 0, keys: vec![k.clone()] }).unwrap();
        };
        read(&mut core, 0, &a);
        read(&mut core, 80, &b);
        read(&mut core, 90, &a); // a is the most recently used; its queued end (100) is stale
        let mut other = core.clone();
        other.apply(150, &Command::Stats).unwrap();
        let c = Key::parse("c").unwrap();
        let alloc = Command::Allocate { space: v.clone(), rank: 0, keys: vec![c] };
        let want = Ok(Reply::Allocated(vec![Allocation { index: 0, page: Some(pages[1]), cached: false }]));
        assert_eq!(core.apply(300, &alloc), want, "b is the least recently used");
        assert_eq!(other.apply(300, &alloc), want);
        assert_eq!(candidates(&core, &v), candidates(&other, &v));
        #[cfg(feature = "serde")]
        assert_eq!(core.snapshot(), other.snapshot());
    }

    #[test]
    fn confirmed_reservations_do_not_keep_their_deadlines_and_a_pending_one_still_expires() {
        let v = Space::Vllm;
        let mut core = Core::new(1, Settings::default());
        core.apply(0, &Command::Initialize { space: v.clone(), rank: 0, num_pages: 100_000 }).unwrap();
        let pending = Key::parse("pending").unwrap();
        core.apply(0, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![pending.clone()] }).unwrap();
        for i in 0..20_000u32 {
            let key = Key::parse(&alloc::format!("k{i}")).unwrap();
            let Ok(Reply::Allocated(a)) =
                core.apply(1, &Command::Allocate { space: v.clone(), rank: 0, keys: vec![key.clone()] })
            else {
                panic!("allocate")
            };
            let confirmations = vec![(key, a[0].page.unwrap())];
            core.apply(1, &Command::Confirm { space: v.clone(), rank: 0, confirmations, releases: vec![] }).unwrap();
        }
        // 20,001 deadlines were queued; one reservation is live.
        let queued = core.spaces[&v].reservations.0.len();
        assert!(queued <= 2 + STALE_DEADLINES, "{queued} deadlines queued for 1 live reservation");
        core.check_invariants().unwrap();
        // The pending reservation still ends at its TTL, not before.
        let ttl = Settings::default().reservation_ttl;
        let touch = |core: &mut Core, now: Millis| {
            core.apply(now, &Command::Locations { space: Space::Vllm, rank: 0, keys: vec![] }).unwrap();
        };
        touch(&mut core, ttl - 1);
        assert_eq!(core.spaces[&v].counters.expired_reservations, 0);
        touch(&mut core, ttl);
        assert_eq!(core.spaces[&v].counters.expired_reservations, 1);
        core.check_invariants().unwrap();
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

//! Read leases: a key a reader was just told about keeps its pages, and stays out of eviction,
//! until its lease ends; a lease is queued once and extended in place.

use alloc::vec::Vec;

use super::{Core, LeaseSlot, Leases, SpaceState};
use crate::command::{Millis, Reply};

impl Leases {
    fn slot_mut(&mut self, slot: u32) -> &mut LeaseSlot {
        let i = slot as usize;
        if i >= self.slots.len() {
            self.slots.resize(i + 1, LeaseSlot::default());
        }
        &mut self.slots[i]
    }

    /// The end of `slot`'s lease; 0 when it holds none.
    pub(super) fn until(&self, slot: u32) -> Millis {
        self.slots.get(slot as usize).map_or(0, |s| s.until)
    }

    /// Starts fetching `slot`'s lease record (see
    /// [`KeyTable::prefetch_touch`](crate::keys::KeyTable::prefetch_touch)).
    pub(super) fn prefetch(&self, slot: u32) {
        crate::slot_index::prefetch(self.slots.as_ptr().wrapping_add(slot as usize));
    }

    pub(super) fn set_until(&mut self, slot: u32, until: Millis) {
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
    pub(super) fn start(&mut self, at: Millis, slot: u32) {
        let stamp = self.bump(slot);
        self.queue.push(core::cmp::Reverse((at, slot, stamp)));
    }

    /// `slot`'s lease ended early (delete, dropped pages): its entry is stale now.
    pub(super) fn forget(&mut self, slot: u32) {
        if (slot as usize) < self.slots.len() {
            self.bump(slot);
        }
    }

    /// The next live entry due by `now` (taken out of the queue: the slot has no live entry
    /// until the caller queues or forgets it), dropping stale ones on the way.
    pub(super) fn pop_due(&mut self, now: Millis) -> Option<(Millis, u32)> {
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
    pub(super) fn live(&self) -> impl Iterator<Item = (Millis, u32)> + '_ {
        self.queue.iter().filter(|e| self.is_live(e.0.1, e.0.2)).map(|e| (e.0.0, e.0.1))
    }
}

impl SpaceState {
    /// Gives `slot` a read lease until `now + duration` (or longer, if it has one already).
    /// Most reads extend a lease (a key read again soon), so that part is inlined into
    /// `get_locations`' per-key loop and a lease's start is a call of its own: through the
    /// plugin a 32-key `get_locations` ran 26.9k → 25.8k instructions (one wasm call less a
    /// key). Natively a plain `#[inline]` left it a call (11.7k); forced, 11.1k
    /// (`examples/instructions.rs`, callgrind). (`touch` forced inline cost more: 12.2k.)
    #[inline(always)]
    pub(super) fn lease(&mut self, slot: u32, now: Millis, duration: Millis) {
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
    pub(super) fn lease_hits(&mut self, hits: &[Option<(u32, u32)>], now: Millis, duration: Millis) {
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
    pub(super) fn set_unleased(&mut self, slot: u32, rejoin: bool) {
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
}

impl Core {
    /// Gives every committed key a full read lease, so after a recovery a reader whose lease
    /// record never reached the disk stays protected; returns how many keys took one.
    pub(super) fn lease_all(&mut self, now: Millis) -> Reply {
        self.expire_all(now);
        let settings = self.settings;
        let mut keys = 0u64;
        for sp in self.spaces.values_mut() {
            let slots: Vec<u32> = sp.keys.entries().filter(|(_, e)| e.pages.len() > 0).map(|(s, _)| s).collect();
            for slot in slots {
                sp.lease(slot, now, settings.read_lease);
                keys += 1;
            }
        }
        Reply::Leased(keys)
    }
}

#[cfg(all(test, feature = "serde"))] // compares snapshots
mod tests {
    use super::*;
    use crate::command::{Command, Settings, Space};
    use crate::key::Key;
    use alloc::vec;

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
}

//! Property tests: invariants and conservation under any command sequence, refusals that change
//! nothing, the allocation rule on arbitrary states, seed independence, and key round trips.
//!
//! Settings are drawn from the peer's (`Eviction::Off`, no quarantine, no lease) and from
//! kvpages' own (LRU eviction with watermarks, quarantine, read leases), in short durations so
//! that they all run out inside a case.

mod common;

use std::collections::BTreeSet;

use common::{check_conservation, expired_at, peer_settings, refused_cleanly, snapshot};
use kvpages_core::{
    Allocation, Command, Core, Eviction, Key, KeyError, KeyInfo, MAX_KEY_LEN, Millis, Reply, Settings, Space,
};
use proptest::prelude::*;

/// A small key universe, mixing packed hex keys and verbatim ones that look almost alike.
const KEYS: [&str; 8] = [
    "386b2d9cf5aa91ba3a4b42c35396c822",
    "386B2D9CF5AA91BA3A4B42C35396C822",
    "00000000000000000000000000000000",
    "ffffffffffffffffffffffffffffffff",
    "386b2d9cf5aa91ba3a4b42c35396c82",
    "a",
    "b-k",
    "b-v",
];

fn key(i: u8) -> Key {
    Key::parse(KEYS[usize::from(i) % KEYS.len()]).unwrap()
}

#[derive(Clone, Debug)]
enum Op {
    Init {
        rank: u32,
        num_pages: u32,
    },
    Alloc {
        rank: u32,
        keys: Vec<u8>,
    },
    /// Confirm or release (per entry: 0..6 confirm, 6..9 release, else skip) the last allocation.
    ConfirmLast {
        choices: Vec<u8>,
    },
    Confirm {
        rank: u32,
        confirmations: Vec<(u8, u32)>,
        releases: Vec<u32>,
    },
    Exists {
        keys: Vec<u8>,
    },
    Locations {
        rank: u32,
        keys: Vec<u8>,
    },
    Delete {
        keys: Vec<u8>,
    },
    Inspect {
        key: u8,
    },
    Stats,
    Clear,
    /// Drop every key, keep the ranks.
    Reset,
    /// A read lease on every stored key (what recovery grants).
    LeaseAll,
    /// The SGLang spaces as pools (a read).
    Export,
    Ttl(Millis),
    /// New lease, quarantine and eviction settings (the TTL and the TP world stay).
    Reconfigure {
        read_lease: Millis,
        quarantine: Millis,
        lru: bool,
    },
    Advance(Millis),
}

fn op() -> impl Strategy<Value = Op> {
    let rank = 0..4u32;
    let keys = || prop::collection::vec(0..8u8, 0..6);
    prop_oneof![
        4 => (rank.clone(), prop_oneof![1 => Just(0u32), 6 => 1..6u32, 2 => 8..13u32])
            .prop_map(|(rank, num_pages)| Op::Init { rank, num_pages }),
        12 => (rank.clone(), keys()).prop_map(|(rank, keys)| Op::Alloc { rank, keys }),
        8 => prop::collection::vec(0..10u8, 0..6).prop_map(|choices| Op::ConfirmLast { choices }),
        6 => (rank.clone(), prop::collection::vec((0..8u8, 0..14u32), 0..4), prop::collection::vec(0..14u32, 0..3))
            .prop_map(|(rank, confirmations, releases)| Op::Confirm { rank, confirmations, releases }),
        2 => keys().prop_map(|keys| Op::Exists { keys }),
        3 => (rank, keys()).prop_map(|(rank, keys)| Op::Locations { rank, keys }),
        2 => prop::collection::vec(0..8u8, 0..4).prop_map(|keys| Op::Delete { keys }),
        1 => (0..8u8).prop_map(|key| Op::Inspect { key }),
        1 => Just(Op::Stats),
        1 => Just(Op::Clear),
        1 => Just(Op::Reset),
        1 => Just(Op::LeaseAll),
        1 => prop_oneof![Just(0u64), Just(30), Just(100), Just(1_000)].prop_map(Op::Ttl),
        1 => (durations(), durations(), any::<bool>())
            .prop_map(|(read_lease, quarantine, lru)| Op::Reconfigure { read_lease, quarantine, lru }),
        6 => prop_oneof![3 => 0..20u64, 1 => 20..400u64].prop_map(Op::Advance),
    ]
}

/// `op()` with more reads, settings changes and clock moves: what replay equivalence is about.
fn op_with_reads() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => op(),
        1 => Just(Op::Stats),
        1 => Just(Op::Export),
        1 => (durations(), durations(), any::<bool>())
            .prop_map(|(read_lease, quarantine, lru)| Op::Reconfigure { read_lease, quarantine, lru }),
        1 => prop_oneof![0..100u64, 100..1_000u64].prop_map(Op::Advance),
    ]
}

/// Lease and quarantine durations: off, short, or longer than a case.
fn durations() -> impl Strategy<Value = Millis> {
    prop_oneof![Just(0u64), Just(30), Just(150), Just(60_000)]
}

fn settings() -> impl Strategy<Value = Settings> {
    let ttl = prop_oneof![Just(50u64), Just(200), Just(60_000)];
    let world = prop_oneof![3 => Just(None), 1 => (1..4u32).prop_map(Some)];
    let watermarks = prop_oneof![Just((950u16, 900u16)), Just((1000, 1000)), Just((800, 500)), Just((500, 0))];
    let ours = (durations(), durations(), prop_oneof![3 => Just(Eviction::Lru), 1 => Just(Eviction::Off)], watermarks)
        .prop_map(|(read_lease, quarantine, eviction, (high, low))| Settings {
            read_lease,
            quarantine,
            eviction,
            evict_high_permille: high,
            evict_low_permille: low,
            ..Settings::default()
        });
    let base = prop_oneof![1 => Just(peer_settings()), 1 => Just(Settings::default()), 2 => ours];
    (base, ttl, world).prop_map(|(base, reservation_ttl, world_size)| Settings { reservation_ttl, world_size, ..base })
}

/// Turns ops into commands against a running core (the last allocation feeds `ConfirmLast`).
struct Interp {
    now: Millis,
    settings: Settings,
    last_alloc: Option<(u32, Vec<Key>, Vec<Allocation>)>,
    /// Ops name SGLang's `rank:kv` spaces (rankless ops: rank 0's) instead of vLLM's.
    sglang: bool,
}

impl Interp {
    fn new(settings: Settings) -> Interp {
        Interp { now: 0, settings, last_alloc: None, sglang: false }
    }

    /// The space an op on `rank` names.
    fn space(&self, rank: u32) -> Space {
        if self.sglang { Space::Sglang { rank, namespace: "kv".into() } } else { Space::Vllm }
    }

    /// The command for `op`, or `None` when the op only moves the clock.
    fn command(&mut self, op: &Op) -> Option<Command> {
        let space = self.space(0);
        let keys_of = |ks: &[u8]| ks.iter().map(|&i| key(i)).collect::<Vec<_>>();
        Some(match op {
            Op::Init { rank, num_pages } => {
                Command::Initialize { space: self.space(*rank), rank: *rank, num_pages: *num_pages }
            }
            Op::Alloc { rank, keys } => {
                Command::Allocate { space: self.space(*rank), rank: *rank, keys: keys_of(keys) }
            }
            Op::ConfirmLast { choices } => {
                let (rank, keys, out) = self.last_alloc.clone()?;
                let mut confirmations = Vec::new();
                let mut releases = Vec::new();
                for (a, c) in out.iter().zip(choices) {
                    let Some(page) = a.page else { continue };
                    match c {
                        0..6 => confirmations.push((keys[a.index as usize].clone(), page)),
                        6..9 => releases.push(page),
                        _ => {}
                    }
                }
                Command::Confirm { space: self.space(rank), rank, confirmations, releases }
            }
            Op::Confirm { rank, confirmations, releases } => Command::Confirm {
                space: self.space(*rank),
                rank: *rank,
                confirmations: confirmations.iter().map(|&(k, p)| (key(k), p)).collect(),
                releases: releases.clone(),
            },
            Op::Exists { keys } => Command::Exists { space, keys: keys_of(keys) },
            Op::Locations { rank, keys } => {
                Command::Locations { space: self.space(*rank), rank: *rank, keys: keys_of(keys) }
            }
            Op::Delete { keys } => Command::Delete { space, keys: keys_of(keys) },
            Op::Inspect { key: k } => Command::Inspect { space, key: key(*k) },
            Op::Stats => Command::Stats,
            Op::Clear => Command::Clear { space },
            Op::Reset => Command::Reset { space },
            Op::LeaseAll => Command::LeaseAll,
            Op::Export => Command::ExportSglang,
            Op::Ttl(ttl) => {
                self.settings.reservation_ttl = *ttl;
                Command::Configure(self.settings)
            }
            Op::Reconfigure { read_lease, quarantine, lru } => {
                self.settings.read_lease = *read_lease;
                self.settings.quarantine = *quarantine;
                self.settings.eviction = if *lru { Eviction::Lru } else { Eviction::Off };
                Command::Configure(self.settings)
            }
            Op::Advance(ms) => {
                self.now += ms;
                return None;
            }
        })
    }

    fn observe(&mut self, cmd: &Command, reply: &Result<Reply, kvpages_core::Error>) {
        if let (Command::Allocate { rank, keys, .. }, Ok(Reply::Allocated(out))) = (cmd, reply) {
            self.last_alloc = Some((*rank, keys.clone(), out.clone()));
        }
    }
}

/// Runs `ops` on a core and, without its reads, on a second one: every command gets the same
/// reply from both (a read is asked of a copy of the second), and once the clock has acted
/// everywhere the two states agree.
fn check_dropping_reads(s: Settings, ops: &[Op], sglang: bool) -> Result<(), TestCaseError> {
    let mut live = Core::new(4, s);
    let mut replay = Core::new(4, s);
    let mut it = Interp { sglang, ..Interp::new(s) };
    // Every space's clock, not only vLLM's (`expired_at`): `Stats` lets it act everywhere.
    let settled = |core: &Core, now: Millis| {
        let mut c = core.clone();
        c.apply(now, &Command::Stats).expect("stats");
        snapshot(&c)
    };
    for (i, op) in ops.iter().enumerate() {
        let Some(cmd) = it.command(op) else { continue };
        let r = live.apply(it.now, &cmd);
        it.observe(&cmd, &r);
        if cmd.is_mutating() {
            prop_assert_eq!(&r, &replay.apply(it.now, &cmd), "op {} {:?}", i, cmd);
            prop_assert_eq!(settled(&live, it.now), settled(&replay, it.now), "op {} {:?}", i, cmd);
        } else {
            // A read answers the same as on a core that never saw the earlier reads.
            prop_assert_eq!(&r, &replay.clone().apply(it.now, &cmd), "op {} {:?} (a read)", i, cmd);
        }
    }
    Ok(())
}

/// `cases` per property, or `PROPTEST_CASES` when set (a deeper run: `PROPTEST_CASES=20000`).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    ProptestConfig { cases, max_shrink_iters: 2_000, ..ProptestConfig::default() }
}

/// Applies `ops` (as the interpreter turns them into commands) to a core seeded `seed`, and
/// calls `step` after each with its index, the command, the state before and after, the reply
/// and the time.
fn drive(
    seed: u64,
    s: Settings,
    ops: &[Op],
    mut step: impl FnMut(
        usize,
        &Command,
        &Core,
        &Core,
        &Result<Reply, kvpages_core::Error>,
        u64,
    ) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    let mut core = Core::new(seed, s);
    let mut it = Interp::new(s);
    for (i, op) in ops.iter().enumerate() {
        let Some(cmd) = it.command(op) else { continue };
        let before = core.clone();
        let reply = core.apply(it.now, &cmd);
        it.observe(&cmd, &reply);
        step(i, &cmd, &before, &core, &reply, it.now)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(96))]

    /// Any command sequence keeps every invariant, and free + reserved + committed +
    /// quarantined = num_pages with leased <= committed.
    #[test]
    fn commands_keep_invariants_and_conserve_pages(s in settings(), ops in prop::collection::vec(op(), 1..80)) {
        drive(1, s, &ops, |i, cmd, _, core, reply, _| {
            prop_assert!(core.check_invariants().is_ok(), "op {i} {cmd:?} -> {reply:?}: {:?}", core.check_invariants());
            prop_assert!(check_conservation(core).is_ok(), "op {i} {cmd:?}: {:?}", check_conservation(core));
            Ok(())
        })?;
    }

    /// A refused command applies nothing (at most the clock's expiry up to `now`), and reads
    /// never change anything (`Stats` and `Inspect` let the clock act first, and nothing else).
    #[test]
    fn refused_commands_and_reads_change_nothing(s in settings(), ops in prop::collection::vec(op(), 1..80)) {
        drive(2, s, &ops, |i, cmd, before, core, reply, now| {
            if matches!(cmd, Command::Stats | Command::Inspect { .. }) {
                prop_assert_eq!(snapshot(core), expired_at(before, now), "op {} {:?}", i, cmd);
            } else if !cmd.is_mutating() {
                prop_assert_eq!(snapshot(core), snapshot(before), "op {} {:?} is a read", i, cmd);
            }
            if let Err(e) = reply {
                prop_assert!(refused_cleanly(before, core, now), "op {i} {cmd:?} refused with {e:?} but changed the state");
            }
            Ok(())
        })?;
    }

    /// On any reachable state, an allocation follows the peer's rule exactly whenever it evicts
    /// nothing (always with `Eviction::Off`): all or nothing; fresh pages come from the head of
    /// the free list in key order; a complete key gets its page and the page taken for it goes
    /// to the tail; one entry per distinct key. When LRU eviction runs, see `check_evicting`.
    #[test]
    fn allocation_follows_the_peer_rule_on_any_state(
        s in settings(),
        ops in prop::collection::vec(op(), 0..60),
        rank in 0..4u32,
        num_pages in prop_oneof![6 => 1..6u32, 2 => 8..13u32],
        batch in prop::collection::vec(0..8u8, 0..8),
    ) {
        let mut core = Core::new(3, s);
        let mut it = Interp::new(s);
        for op in &ops {
            let Some(cmd) = it.command(op) else { continue };
            let reply = core.apply(it.now, &cmd);
            it.observe(&cmd, &reply);
        }
        let space = Space::Vllm;
        // Every case checks the rule: a rank outside the TP world could never be initialized, so
        // the drawn rank is taken inside it, and a rank the ops left uninitialized (or cleared)
        // joins now, with a size the ops could have given it. (Allocating on a missing rank is
        // a refusal, covered elsewhere.)
        let rank = s.world_size.map_or(rank, |world| rank % world);
        if core.free_list(&space, rank).is_none() {
            let init = Command::Initialize { space: space.clone(), rank, num_pages };
            prop_assert!(core.apply(it.now, &init).is_ok(), "initialize rank {} with {} pages", rank, num_pages);
        }
        // Let the clock act first, so the free list read below is the one the allocation sees.
        let settle = core.apply(it.now, &Command::Allocate { space: space.clone(), rank, keys: vec![] });
        prop_assert!(settle.is_ok(), "an empty allocation on initialized rank {}: {:?}", rank, settle);
        let settings = core.settings();
        let keys: Vec<Key> = batch.iter().map(|&i| key(i)).collect();
        let free = core.free_list(&space, rank).unwrap();
        let num_pages = u64::from(rank_pages(&core, rank));
        // Cache hits, read without side effects (get_locations would take leases).
        let before: Vec<Option<KeyInfo>> = keys.iter().map(|k| inspect(&core, k)).collect();
        let hits: Vec<Option<u32>> = before
            .iter()
            .map(|info| info.as_ref().filter(|i| i.complete).and_then(|i| page_on(i, rank)))
            .collect();
        let first: Vec<usize> = (0..keys.len()).filter(|&i| !keys[..i].contains(&keys[i])).collect();
        let fresh = first.iter().filter(|&&i| hits[i].is_none()).count() as u64;
        let used = num_pages - free.len() as u64;
        let high = num_pages * u64::from(settings.evict_high_permille) / 1000;
        let lru = settings.eviction == Eviction::Lru;
        let evicts = lru && fresh > 0 && ((free.len() as u64) < fresh || used + fresh > high);
        if evicts {
            let universe: Vec<Key> = (0..KEYS.len() as u8).map(key).collect();
            let all_before: Vec<Option<KeyInfo>> = universe.iter().map(|k| inspect(&core, k)).collect();
            let got = core.apply(it.now, &Command::Allocate { space: space.clone(), rank, keys: keys.clone() });
            let Ok(Reply::Allocated(out)) = got else { panic!("allocate on an initialized rank: {got:?}") };
            check_evicting(&core, rank, &keys, &first, &hits, &free, &universe, &all_before, &out)
                .map_err(|e| TestCaseError::fail(format!("{e}\n  batch {keys:?} -> {out:?}")))?;
            prop_assert!(core.check_invariants().is_ok());
            return Ok(());
        }
        let (want, want_free) = if free.len() < first.len() && !(lru && free.len() as u64 >= fresh) {
            let out = first.iter().map(|&i| Allocation { index: i as u32, page: hits[i], cached: hits[i].is_some() }).collect();
            (out, free.clone())
        } else if free.len() < first.len() {
            // kvpages' own rule with LRU: the pool covers the fresh keys but not the whole batch,
            // so there is no rotation: fresh keys take pages from the head, hits take none.
            let mut head = free.iter().copied();
            let out = first
                .iter()
                .map(|&i| match hits[i] {
                    Some(existing) => Allocation { index: i as u32, page: Some(existing), cached: true },
                    None => Allocation { index: i as u32, page: head.next(), cached: false },
                })
                .collect();
            (out, head.collect())
        } else {
            let (taken, rest) = free.split_at(first.len());
            let mut tail = rest.to_vec();
            let mut out = Vec::new();
            for (&i, &page) in first.iter().zip(taken) {
                match hits[i] {
                    Some(existing) => {
                        tail.push(page);
                        out.push(Allocation { index: i as u32, page: Some(existing), cached: true });
                    }
                    None => out.push(Allocation { index: i as u32, page: Some(page), cached: false }),
                }
            }
            (out, tail)
        };
        let got = core.apply(it.now, &Command::Allocate { space: space.clone(), rank, keys });
        prop_assert_eq!(got, Ok(Reply::Allocated(want)));
        prop_assert_eq!(core.free_list(&space, rank).unwrap(), want_free);
        prop_assert!(core.check_invariants().is_ok());
    }

    /// Reads are not logged, so they must not change what later commands do: the same sequence
    /// without its reads (`Stats`, `batch_exists`, `inspect`, the SGLang export) gives the same
    /// replies to every other command and, once the clock has acted, the same state. (`Stats`
    /// lets the clock act; a settings change must not make that visible.)
    #[test]
    fn dropping_the_reads_changes_no_reply_and_no_state(s in settings(), ops in prop::collection::vec(op_with_reads(), 1..80)) {
        check_dropping_reads(s, &ops, false)?;
    }

    /// The same in SGLang's spaces (one per rank, LIFO pages, per-key allocation).
    #[test]
    fn dropping_the_reads_changes_no_reply_and_no_state_in_sglang_spaces(
        s in settings(),
        ops in prop::collection::vec(op_with_reads(), 1..80),
    ) {
        check_dropping_reads(s, &ops, true)?;
    }

    /// The seed keys only the hash tables: replies and free lists never depend on it.
    #[test]
    fn replies_do_not_depend_on_the_hasher_seed(
        s in settings(),
        seeds in (any::<u64>(), any::<u64>()),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut a = Core::new(seeds.0, s);
        let mut b = Core::new(seeds.1, s);
        let mut it = Interp::new(s);
        for (i, op) in ops.iter().enumerate() {
            let Some(cmd) = it.command(op) else { continue };
            let ra = a.apply(it.now, &cmd);
            let rb = b.apply(it.now, &cmd);
            prop_assert_eq!(&ra, &rb, "op {} {:?}", i, cmd);
            it.observe(&cmd, &ra);
            prop_assert_eq!(snapshot(&a), snapshot(&b), "op {} {:?}", i, cmd);
        }
    }
}

fn inspect(core: &Core, k: &Key) -> Option<KeyInfo> {
    // Inspect is a pure read, so a clone is not needed; `apply` takes `&mut`, though.
    let mut c = core.clone();
    match c.apply(0, &Command::Inspect { space: Space::Vllm, key: k.clone() }) {
        Ok(Reply::Key(info)) => info.map(|b| *b),
        other => panic!("inspect answered {other:?}"),
    }
}

fn page_on(info: &KeyInfo, rank: u32) -> Option<u32> {
    info.pages.iter().find(|(r, _)| *r == rank).map(|&(_, p)| p)
}

fn rank_pages(core: &Core, rank: u32) -> u32 {
    let stats = core.stats();
    stats.spaces[0].ranks.iter().find(|r| r.rank == rank).expect("rank exists").num_pages
}

/// What an allocation that evicts must still do: one entry per distinct key; cache hits answered
/// with their page and never evicted by their own batch; fresh keys all served or none; every
/// fresh page distinct and either free before or taken from an evicted key; every evicted key
/// had a page on this rank, was evictable and was no cache hit of the batch.
#[allow(clippy::too_many_arguments)]
fn check_evicting(
    core: &Core,
    rank: u32,
    keys: &[Key],
    first: &[usize],
    hits: &[Option<u32>],
    free: &[u32],
    universe: &[Key],
    all_before: &[Option<KeyInfo>],
    out: &[Allocation],
) -> Result<(), String> {
    let indices: Vec<usize> = out.iter().map(|a| a.index as usize).collect();
    if indices != first {
        return Err(format!("entries at {indices:?}, first occurrences {first:?}"));
    }
    let mut evicted_pages = BTreeSet::new();
    for (k, before) in universe.iter().zip(all_before) {
        let Some(before) = before.as_ref().filter(|b| !b.pages.is_empty()) else { continue };
        let after = inspect(core, k);
        let kept = after.as_ref().is_some_and(|a| a.pages == before.pages);
        if kept {
            continue;
        }
        if after.as_ref().is_some_and(|a| !a.pages.is_empty()) {
            return Err(format!("{k:?} changed pages {:?} -> {:?} without being evicted", before.pages, after));
        }
        let Some(page) = page_on(before, rank) else {
            return Err(format!("{k:?} was evicted but had no page on rank {rank}"));
        };
        if !before.evictable {
            return Err(format!("{k:?} was evicted but was not evictable ({before:?})"));
        }
        if keys.contains(k) && hits[keys.iter().position(|x| x == k).unwrap()].is_some() {
            return Err(format!("{k:?} was a cache hit of the batch and was evicted by it"));
        }
        evicted_pages.insert(page);
    }
    let mut served = BTreeSet::new();
    let mut any_none = false;
    let mut any_some = false;
    for a in out {
        let i = a.index as usize;
        match hits[i] {
            Some(p) => {
                if (a.page, a.cached) != (Some(p), true) {
                    return Err(format!("cache hit {:?} on page {p} answered {a:?}", keys[i]));
                }
            }
            None => {
                if a.cached {
                    return Err(format!("{:?} is no cache hit but answered {a:?}", keys[i]));
                }
                match a.page {
                    None => any_none = true,
                    Some(p) => {
                        any_some = true;
                        if !served.insert(p) {
                            return Err(format!("page {p} handed out twice"));
                        }
                        if !free.contains(&p) && !evicted_pages.contains(&p) {
                            return Err(format!("page {p} was neither free nor evicted"));
                        }
                    }
                }
            }
        }
    }
    if any_none && any_some {
        return Err("not all-or-nothing".into());
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Any non-empty string up to the limit is a key and displays exactly as sent.
    #[test]
    fn any_key_round_trips(s in "(?s).{1,256}") {
        prop_assume!(s.len() <= MAX_KEY_LEN);
        let k = Key::parse(&s).unwrap();
        prop_assert_eq!(k.to_string(), s.clone());
        prop_assert_eq!(k.text_len(), s.len());
        prop_assert_eq!(Key::parse(&k.to_string()), Ok(k));
    }

    /// Keys at the length limit, in bytes (multi-byte characters included).
    #[test]
    fn long_keys_round_trip(c in "[a-zA-Z0-9é€😀]", extra in 0..8usize) {
        let n = (MAX_KEY_LEN - extra) / c.len();
        let s = c.repeat(n);
        let k = Key::parse(&s).unwrap();
        prop_assert_eq!(k.to_string(), s);
        let over = c.repeat(MAX_KEY_LEN / c.len() + 1);
        prop_assert_eq!(Key::parse(&over), Err(KeyError::TooLong { len: over.len() }));
    }

    /// 32 lowercase hex characters are packed; any case mix still round-trips exactly.
    #[test]
    fn hex_keys_round_trip(s in "[0-9a-f]{32}", mixed in "[0-9a-fA-F]{32}") {
        let k = Key::parse(&s).unwrap();
        prop_assert!(matches!(k, Key::Hex(_)));
        prop_assert_eq!(k.to_string(), s);
        let m = Key::parse(&mixed).unwrap();
        prop_assert_eq!(matches!(m, Key::Hex(_)), !mixed.bytes().any(|b| b.is_ascii_uppercase()));
        prop_assert_eq!(m.to_string(), mixed);
    }

    /// Two keys are equal exactly when their texts are.
    #[test]
    fn key_equality_is_text_equality((a, b) in key_text_pairs()) {
        let (ka, kb) = (Key::parse(&a).unwrap(), Key::parse(&b).unwrap());
        prop_assert_eq!(ka == kb, a == b);
        prop_assert_eq!(Key::parse(&a.to_lowercase()).unwrap() == ka, a == a.to_lowercase());
    }
}

/// Two key texts of about the packed length: the same text, the other case of it, one character
/// changed, or an independent text. Two independent draws are practically never equal, so
/// without the first three both halves of "equal exactly when the texts are" would not be
/// tested: equal texts, and texts one packed nibble or one letter's case apart. `a` is all
/// lowercase half the time, so that packed keys (32 lowercase digits) are common too.
fn key_text_pairs() -> impl Strategy<Value = (String, String)> {
    let text = || "[0-9a-fA-F]{31,33}";
    prop_oneof!["[0-9a-f]{31,33}", text()].prop_flat_map(move |a| {
        let n = a.len();
        let (upper, lower) = (a.to_uppercase(), a.to_lowercase());
        let one_changed = (0..n, "[0-9a-fA-F]").prop_map({
            let a = a.clone();
            move |(i, c)| format!("{}{c}{}", &a[..i], &a[i + 1..])
        });
        let b = prop_oneof![Just(a.clone()), Just(upper), Just(lower), one_changed, text()];
        (Just(a), b)
    })
}

#[test]
fn empty_keys_are_refused() {
    assert_eq!(Key::parse(""), Err(KeyError::Empty));
}

//! Issue 5's rules as scenario tests with explicit time steps: reservations and their expiry,
//! quarantine, two writers, read leases, LRU eviction with watermarks, delete, inspect, stats.
//!
//! Every test asserts exact replies, page numbers included. The harness checks
//! `check_invariants()` after every command. Time only moves when a test sets `h.now`.

mod common;

use common::{Harness, cached, fresh, miss, peer_settings};
use kvpages_core::{
    Allocation, Command, ConfirmReport, Counters, Error, Eviction, IgnoredRelease, KeyInfo, PageCounts, Refusal,
    Refused, Reply, Settings, Space,
};

fn counts(free: u32, reserved: u32, committed: u32, leased: u32, quarantined: u32) -> PageCounts {
    PageCounts { free, reserved, committed, leased, quarantined }
}

fn with_tail(a: u32, b: u32, tail: &[u32]) -> Vec<u32> {
    let mut v: Vec<u32> = (a..b).collect();
    v.extend_from_slice(tail);
    v
}

fn not_reserved(index: u32, page: u32) -> Refused {
    Refused { index, page, reason: Refusal::NotReserved }
}

/// LRU eviction with the given watermarks; no lease, no quarantine unless a test adds them.
fn lru(high: u16, low: u16) -> Settings {
    Settings {
        eviction: Eviction::Lru,
        evict_high_permille: high,
        evict_low_permille: low,
        read_lease: 0,
        quarantine: 0,
        ..Settings::default()
    }
}

/// LRU that only evicts when a batch does not fit (watermarks at 100 %).
fn lru_when_full() -> Settings {
    lru(1000, 1000)
}

fn info(key: &str, pages: &[(u32, u32)], complete: bool, reservations: u32, lease: u64, evictable: bool) -> KeyInfo {
    KeyInfo { key: common::key(key), pages: pages.to_vec(), complete, reservations, lease_remaining: lease, evictable }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

// ---- reservations: a crashed writer, a late confirm ------------------------------------------

#[test]
fn a_crashed_writers_pages_come_back_after_the_ttl_and_a_quarantine() {
    let mut h = Harness::with(Settings { reservation_ttl: 1_000, quarantine: 500, ..lru(950, 900) });
    h.init(0, 100).unwrap();
    h.now = 100;
    assert_eq!(h.alloc(0, &["a", "b", "c"]), vec![Some(0), Some(1), Some(2)]);
    h.now = 500;
    assert_eq!(h.inspect("a"), Some(info("a", &[], false, 1, 0, false)));
    // The writer crashes: nothing is confirmed. Up to the deadline the pages stay reserved.
    h.now = 1_099;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(97, 3, 0, 0, 0));
    // At 100 + TTL they are taken back, but quarantined: a slow writer may still be writing.
    h.now = 1_100;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(97, 0, 0, 0, 3));
    assert_eq!(h.free_list(0), with_tail(3, 100, &[]));
    assert_eq!(h.inspect("a"), None);
    let c = h.counters();
    assert_eq!((c.expired_reservations, c.quarantined_pages), (3, 3));
    // Not handed out while quarantined.
    h.now = 1_599;
    assert_eq!(h.try_alloc(0, &["d"]), Ok(vec![fresh(0, 3)]));
    assert_eq!(h.counts(0), counts(96, 1, 0, 0, 3));
    // Free again `quarantine` ms after the reservation deadline, at the tail, in page order.
    h.now = 1_600;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(99, 1, 0, 0, 0));
    assert_eq!(h.free_list(0), with_tail(4, 100, &[0, 1, 2]));
}

#[test]
fn quarantine_counts_from_the_deadline_even_when_no_command_came_in_between() {
    let mut h = Harness::with(Settings { reservation_ttl: 1_000, quarantine: 500, ..lru(950, 900) });
    h.init(0, 8).unwrap();
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    // The first command after the deadline (1000) comes at 1400: the quarantine still ends at 1500.
    h.now = 1_400;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(7, 0, 0, 0, 1));
    h.now = 1_499;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(7, 0, 0, 0, 1));
    h.now = 1_500;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(8, 0, 0, 0, 0));
    // A command long after both deadlines does both at once.
    assert_eq!(h.alloc(0, &["b"]), vec![Some(1)]);
    h.now = 100_000;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.counts(0), counts(8, 0, 0, 0, 0));
    assert_eq!(h.free_list(0), with_tail(2, 8, &[0, 1]));
}

#[test]
fn a_late_confirm_is_refused_during_and_after_the_quarantine() {
    let mut h = Harness::with(Settings { reservation_ttl: 1_000, quarantine: 1_000, ..lru_when_full() });
    h.init(0, 2).unwrap();
    assert_eq!(h.alloc(0, &["a", "b"]), vec![Some(0), Some(1)]);
    h.now = 999;
    assert_eq!(h.confirm(0, &[("a", 0)], &[]).map(|r| r.committed), Ok(1));
    // `b` is late: every pair refused is a 409 with the pairs, and nothing is applied.
    h.now = 1_000;
    let before = h.snapshot();
    assert_eq!(h.confirm(0, &[("b", 1)], &[]), Err(Error::NothingConfirmed { refused: vec![not_reserved(0, 1)] }));
    assert_eq!(h.counts(0), counts(0, 0, 1, 0, 1));
    assert_ne!(h.snapshot(), before, "the clock took the reservation back (and only that)");
    // With an acceptable pair in the request the rest applies: refused pairs are reported.
    let r = h.confirm(0, &[("b", 1), ("a", 0)], &[]).unwrap();
    assert_eq!(r, ConfirmReport { unchanged: 1, refused: vec![not_reserved(0, 1)], ..ConfirmReport::default() });
    // After the quarantine the page is free: still not `b`'s.
    h.now = 2_000;
    assert_eq!(h.confirm(0, &[("b", 1)], &[]), Err(Error::NothingConfirmed { refused: vec![not_reserved(0, 1)] }));
    // Handed to `c`: now reserved for another key.
    assert_eq!(h.alloc(0, &["c"]), vec![Some(1)]);
    assert_eq!(
        h.confirm(0, &[("b", 1)], &[]),
        Err(Error::NothingConfirmed {
            refused: vec![Refused { index: 0, page: 1, reason: Refusal::ReservedForAnotherKey }]
        })
    );
    assert_eq!(h.exists(&["a", "b", "c"]), vec![true, false, false]);
    // A 409 applies nothing, counters included: only the pair refused inside the 204 counts.
    assert_eq!(h.counters().refused_confirms, 1);
}

#[test]
fn releasing_an_expired_or_quarantined_page_is_ignored() {
    let mut h = Harness::with(Settings { reservation_ttl: 100, quarantine: 100, ..lru(950, 900) });
    h.init(0, 4).unwrap();
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    h.now = 150;
    let r = h.confirm(0, &[], &[0]).unwrap();
    assert_eq!(
        r,
        ConfirmReport { ignored_releases: vec![(0, IgnoredRelease::AlreadyFree)], ..ConfirmReport::default() }
    );
    // The release did not end the quarantine early.
    assert_eq!(h.counts(0), counts(3, 0, 0, 0, 1));
    h.now = 200;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.free_list(0), vec![1, 2, 3, 0]);
}

// ---- two writers -------------------------------------------------------------------------------

#[test]
fn two_writers_of_one_new_key_one_winner_no_leak_and_no_half_written_key() {
    let mut h = Harness::with(Settings::default());
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    // Two vLLM instances save the same new block on both ranks.
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.alloc(0, &["a"]), vec![Some(1)]);
    assert_eq!(h.alloc(1, &["a"]), vec![Some(0)]);
    assert_eq!(h.alloc(1, &["a"]), vec![Some(1)]);
    assert_eq!(h.inspect("a"), Some(info("a", &[], false, 4, 0, false)));
    // Writer 2 finishes rank 0 first: it wins there. Readers see nothing until every rank has it.
    assert_eq!(h.confirm(0, &[("a", 1)], &[]), Ok(ConfirmReport { committed: 1, ..ConfirmReport::default() }));
    assert_eq!(h.exists(&["a"]), vec![false]);
    assert_eq!(h.locations(0, &["a"]), vec![None]);
    assert_eq!(h.locations(1, &["a"]), vec![None]);
    // Writer 1 finishes rank 0 second: its page is freed at once (it is done writing).
    assert_eq!(h.confirm(0, &[("a", 0)], &[]), Ok(ConfirmReport { superseded: 1, ..ConfirmReport::default() }));
    assert_eq!(h.counts(0), counts(7, 0, 1, 0, 0));
    assert_eq!(h.free_list(0), with_tail(2, 8, &[0]));
    // On rank 1 writer 1 wins; writer 2 crashes and never confirms.
    assert_eq!(h.confirm(1, &[("a", 0)], &[]), Ok(ConfirmReport { committed: 1, ..ConfirmReport::default() }));
    assert_eq!(h.exists(&["a"]), vec![true]);
    assert_eq!(h.locations(0, &["a"]), vec![Some(1)]);
    assert_eq!(h.locations(1, &["a"]), vec![Some(0)]);
    assert_eq!(h.counts(1), counts(6, 1, 1, 1, 0));
    // The crashed writer's page comes back: TTL (60 s), then quarantine (60 s).
    h.now = 60_000;
    h.stats_cmd();
    assert_eq!(h.counts(1), counts(6, 0, 1, 0, 1));
    h.now = 120_000;
    h.stats_cmd();
    assert_eq!(h.counts(1), counts(7, 0, 1, 0, 0));
    assert_eq!(h.free_list(1), with_tail(2, 8, &[1]));
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 1), (1, 0)], true, 0, 0, true)));
    let c = h.counters();
    assert_eq!((c.committed, c.superseded, c.expired_reservations), (2, 1, 1));
}

// ---- releases never take a page from its owner -----------------------------------------------

#[test]
fn releasing_an_owned_page_is_ignored_even_while_a_reader_holds_it() {
    let mut h = Harness::with(Settings { read_lease: 1_000, ..lru(950, 900) });
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    // The connector's write-failure path releases the cache hit it was given, too.
    assert_eq!(h.try_alloc(0, &["a", "b"]), Ok(vec![cached(0, 0), fresh(1, 2)]));
    let before = h.counts(0);
    assert_eq!(before, counts(2, 1, 1, 1, 0));
    let r = h.confirm(0, &[], &[0, 2, 0]).unwrap();
    assert_eq!(
        r,
        ConfirmReport {
            released: 1,
            ignored_releases: vec![(0, IgnoredRelease::Committed), (0, IgnoredRelease::Committed)],
            ..ConfirmReport::default()
        }
    );
    assert_eq!(h.counts(0), counts(3, 0, 1, 1, 0));
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.free_list(0), vec![3, 1, 2]);
    assert_eq!(h.counters().ignored_releases, 2);
}

// ---- read leases ------------------------------------------------------------------------------

#[test]
fn a_readers_lease_blocks_eviction_until_it_ends() {
    let mut h = Harness::with(Settings { read_lease: 1_000, ..lru_when_full() });
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    h.now = 10;
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 1_000, false)));
    assert_eq!(h.counts(0), counts(3, 0, 1, 1, 0));
    h.now = 20;
    h.store(0, &["b"]);
    h.store(0, &["c"]);
    h.store(0, &["d"]);
    // Full. `a` is the least recently used key, but a reader holds it: `b` goes.
    h.now = 30;
    assert_eq!(h.try_alloc(0, &["e"]), Ok(vec![fresh(0, 1)]));
    assert_eq!(h.inspect("b"), None);
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 980, false)));
    h.confirm(0, &[("e", 1)], &[]).unwrap();
    // One millisecond before the lease ends, still protected: `c` goes.
    h.now = 1_009;
    assert_eq!(h.try_alloc(0, &["f"]), Ok(vec![fresh(0, 2)]));
    h.confirm(0, &[("f", 2)], &[]).unwrap();
    // When it ends, `a` is an ordinary least recently used key.
    h.now = 1_010;
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 0, true)));
    assert_eq!(h.try_alloc(0, &["g"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.inspect("a"), None);
    assert_eq!(h.exists(&["a", "b", "c", "d", "e", "f"]), vec![false, false, false, true, true, true]);
    assert_eq!(h.counters().evictions, 3);
}

#[test]
fn when_every_stored_key_is_leased_a_full_pool_answers_none_until_a_lease_ends() {
    let mut h = Harness::with(Settings { read_lease: 500, ..lru_when_full() });
    h.init(0, 2).unwrap();
    h.store(0, &["a", "b"]);
    assert_eq!(h.locations(0, &["a", "b"]), vec![Some(0), Some(1)]);
    assert_eq!(h.counts(0), counts(0, 0, 2, 2, 0));
    h.now = 499;
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![miss(0)]));
    assert_eq!(h.counters().evictions, 0);
    h.now = 500;
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.counts(0), counts(0, 1, 1, 0, 0));
    assert_eq!(h.counters().evictions, 1);
}

#[test]
fn a_later_read_extends_the_lease() {
    let mut h = Harness::with(Settings { read_lease: 1_000, ..lru_when_full() });
    h.init(0, 1).unwrap();
    h.store(0, &["a"]);
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    h.now = 800;
    assert_eq!(h.locations(0, &["a", "a"]), vec![Some(0), Some(0)]);
    assert_eq!(h.inspect("a").unwrap().lease_remaining, 1_000);
    h.now = 1_500;
    assert_eq!(h.try_alloc(0, &["b"]), Ok(vec![miss(0)]));
    h.now = 1_800;
    assert_eq!(h.try_alloc(0, &["b"]), Ok(vec![fresh(0, 0)]));
    let c = h.counters();
    assert_eq!((c.location_hits, c.location_misses, c.evictions, c.misses), (3, 0, 1, 1));
}

#[test]
fn allocate_cache_hits_take_the_same_lease() {
    let mut h = Harness::with(Settings { read_lease: 1_000, ..lru_when_full() });
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    // The connector writes a cache hit again into its page: the page must not change hands.
    h.now = 100;
    assert_eq!(h.try_alloc(0, &["a"]), Ok(vec![cached(0, 0)]));
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 1_000, false)));
    assert_eq!(h.counts(0), counts(3, 0, 1, 1, 0));
    // Its confirm of the hit is a no-op.
    assert_eq!(h.confirm(0, &[("a", 0)], &[]), Ok(ConfirmReport { unchanged: 1, ..ConfirmReport::default() }));
    // The hit rotated the page taken for it (1) to the tail, as the peer does.
    assert_eq!(h.store(0, &["b", "c", "d"]), vec![2, 3, 1]);
    h.now = 200;
    assert_eq!(h.try_alloc(0, &["b"]), Ok(vec![cached(0, 2)])); // refreshes `b` and leases it
    // Full; recency a c d b: `a` is least recently used but leased: `c` goes.
    assert_eq!(h.try_alloc(0, &["e"]), Ok(vec![fresh(0, 3)]));
    h.now = 1_100;
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 0, true)));
    assert_eq!(h.try_alloc(0, &["f"]), Ok(vec![fresh(0, 0)]));
    let c = h.counters();
    assert_eq!((c.cache_hits, c.evictions), (2, 2));
}

// ---- LRU order ---------------------------------------------------------------------------------

#[test]
fn eviction_order_is_lru_refreshed_by_allocate_hits_and_locations_but_not_by_exists() {
    let mut h = Harness::with(lru_when_full());
    h.init(0, 4).unwrap();
    for (t, k) in ["a", "b", "c", "d"].iter().enumerate() {
        h.now = t as u64;
        h.store(0, &[k]);
    }
    // Recency, oldest first: a b c d. A location lookup refreshes b, an allocate hit c.
    h.now = 10;
    assert_eq!(h.locations(0, &["b"]), vec![Some(1)]);
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![cached(0, 2)]));
    // Now a d b c. `batch_exists` and `inspect` are pure reads: `a` stays the oldest.
    assert_eq!(h.exists(&["a", "a"]), vec![true, true]);
    assert!(h.inspect("a").is_some());
    h.now = 20;
    assert_eq!(h.try_alloc(0, &["e"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.exists(&["a", "b", "c", "d"]), vec![false, true, true, true]);
    // `e` is not yet committed, so it is no candidate; `d` is the oldest stored key.
    assert_eq!(h.try_alloc(0, &["f"]), Ok(vec![fresh(0, 3)]));
    assert_eq!(h.try_alloc(0, &["g"]), Ok(vec![fresh(0, 1)]));
    assert_eq!(h.try_alloc(0, &["h"]), Ok(vec![fresh(0, 2)]));
    assert_eq!(h.exists(&["a", "b", "c", "d"]), vec![false, false, false, false]);
    // Four reservations and nothing committed: nothing to evict.
    assert_eq!(h.try_alloc(0, &["i"]), Ok(vec![miss(0)]));
    assert_eq!(h.counters().evictions, 4);
}

#[test]
fn a_commit_makes_a_key_the_most_recently_used() {
    let mut h = Harness::with(lru_when_full());
    h.init(0, 3).unwrap();
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    h.store(0, &["b"]);
    h.store(0, &["c"]);
    h.confirm(0, &[("a", 0)], &[]).unwrap(); // allocated first, committed last
    assert_eq!(h.try_alloc(0, &["d"]), Ok(vec![fresh(0, 1)]));
    assert_eq!(h.exists(&["a", "b", "c"]), vec![true, false, true]);
}

#[test]
fn an_evicted_key_is_evicted_on_every_rank() {
    let mut h = Harness::with(lru_when_full());
    h.init(0, 2).unwrap();
    h.init(1, 4).unwrap();
    h.store(0, &["a", "b"]);
    h.store(1, &["x", "a", "b"]);
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.inspect("a"), None);
    assert_eq!(h.counts(1), counts(2, 0, 2, 0, 0));
    assert_eq!(h.free_list(1), vec![3, 1]);
    assert_eq!(h.exists(&["b"]), vec![true]);
}

// ---- a batch and its own cache hits ----------------------------------------------------------

#[test]
fn a_key_reported_cached_is_never_evicted_later_in_the_same_batch() {
    // No lease to protect the hits: the batch itself must not evict them.
    let mut h = Harness::with(lru_when_full());
    h.init(0, 4).unwrap();
    h.store(0, &["a", "b", "c", "d"]);
    assert_eq!(h.try_alloc(0, &["a", "x", "y", "z"]), Ok(vec![cached(0, 0), fresh(1, 1), fresh(2, 2), fresh(3, 3)]));
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 0, true)));
    assert_eq!(h.counts(0), counts(0, 3, 1, 0, 0));
    h.confirm(0, &[("x", 1), ("y", 2), ("z", 3)], &[]).unwrap();
    // More fresh keys than there are other keys to evict: the hit keeps its page, the rest -1.
    assert_eq!(h.try_alloc(0, &["w", "a", "v", "u", "t"]), Ok(vec![miss(0), cached(1, 0), miss(2), miss(3), miss(4)]));
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0)], true, 0, 0, true)));
}

#[test]
fn a_cache_hit_survives_a_batch_that_evicts_everything_else_at_the_watermarks() {
    let mut h = Harness::with(lru(950, 900));
    h.init(0, 20).unwrap();
    let ks = names("k", 19);
    for k in &ks {
        h.store(0, &[k]);
    }
    assert_eq!(h.counts(0), counts(1, 0, 19, 0, 0));
    let mut batch = vec!["k0".to_string()];
    batch.extend(names("x", 18));
    let got = h.try_alloc(0, &strs(&batch)).unwrap();
    assert_eq!(got[0], cached(0, 0));
    let mut want: Vec<Allocation> = vec![cached(0, 0)];
    want.extend((1..19).map(|i| fresh(i, i)));
    assert_eq!(got, want);
    assert_eq!(h.inspect("k0"), Some(info("k0", &[(0, 0)], true, 0, 0, true)));
    assert_eq!(h.counters().evictions, 18);
}

#[test]
fn cache_hits_never_cause_eviction() {
    let mut h = Harness::with(lru(950, 900));
    h.init(0, 20).unwrap();
    let ks = names("k", 19);
    for k in &ks {
        h.store(0, &[k]);
    }
    // Usage is at the high watermark: a batch of hits alone evicts nothing.
    let hits = strs(&ks);
    let got = h.try_alloc(0, &hits).unwrap();
    assert!(got.iter().all(|a| a.cached), "{got:?}");
    assert_eq!(h.counters().evictions, 0);
    assert_eq!(h.counts(0), counts(1, 0, 19, 0, 0));
}

#[test]
fn with_lru_a_batch_that_covers_its_new_keys_but_not_its_hits_is_served_without_rotation() {
    let mut h = Harness::with(lru_when_full());
    h.init(0, 4).unwrap();
    h.store(0, &["a", "b"]);
    assert_eq!(h.free_list(0), vec![2, 3]);
    // Three distinct keys, two free pages: the peer would answer -1 for `x` and `y`. Here the
    // new keys fit (evicting nothing), so they are served from the head; no page rotates.
    assert_eq!(h.try_alloc(0, &["x", "a", "y"]), Ok(vec![fresh(0, 2), cached(1, 0), fresh(2, 3)]));
    assert_eq!(h.free_list(0), Vec::<u32>::new());
    assert_eq!(h.counters().evictions, 0);
    // Under `Eviction::Off` the peer's rule holds: nothing is taken.
    let mut p = Harness::with(Settings { eviction: Eviction::Off, ..lru_when_full() });
    p.init(0, 4).unwrap();
    p.store(0, &["a", "b"]);
    assert_eq!(p.try_alloc(0, &["x", "a", "y"]), Ok(vec![miss(0), cached(1, 0), miss(2)]));
    assert_eq!(p.free_list(0), vec![2, 3]);
}

// ---- watermarks --------------------------------------------------------------------------------

#[test]
fn eviction_starts_above_the_high_watermark_and_stops_at_the_low_one() {
    // 20 pages: high = 95 % = 19 pages, low = 90 % = 18 pages (per mille, rounded down).
    let mut h = Harness::with(lru(950, 900));
    h.init(0, 20).unwrap();
    let ks = names("k", 30);
    // Up to 19 used pages nothing is evicted.
    for (i, k) in ks.iter().take(19).enumerate() {
        assert_eq!(h.store(0, &[k]), vec![i as u32]);
    }
    assert_eq!(h.counts(0), counts(1, 0, 19, 0, 0));
    assert_eq!(h.counters().evictions, 0);
    // The 20th page would exceed 19: evict the two oldest keys so that usage after the batch
    // is 18; the fresh page (19) is still handed out first, in the peer's order.
    assert_eq!(h.store(0, &[&ks[19]]), vec![19]);
    assert_eq!(h.exists(&["k0", "k1", "k2"]), vec![false, false, true]);
    assert_eq!(h.counts(0), counts(2, 0, 18, 0, 0));
    assert_eq!(h.counters().evictions, 2);
    // 18 + 1 = 19 does not exceed the high watermark: no eviction.
    assert_eq!(h.store(0, &[&ks[20]]), vec![0]);
    assert_eq!(h.counters().evictions, 2);
    // 19 + 1 does: two more.
    assert_eq!(h.store(0, &[&ks[21]]), vec![1]);
    assert_eq!(h.exists(&["k2", "k3", "k4"]), vec![false, false, true]);
    assert_eq!(h.counters().evictions, 4);
    assert_eq!(h.counts(0), counts(2, 0, 18, 0, 0));
    // A batch of 3 at 18 used pages: 21 > 19, so evict down to 18 - 3 = 15 used: 3 keys.
    assert_eq!(h.store(0, &[&ks[22], &ks[23], &ks[24]]), vec![2, 3, 4]);
    assert_eq!(h.exists(&["k4", "k5", "k6", "k7"]), vec![false, false, false, true]);
    assert_eq!(h.counters().evictions, 7);
    assert_eq!(h.counts(0), counts(2, 0, 18, 0, 0));
    // Reserved and quarantined pages count as used too; only committed keys can be evicted.
    assert_eq!(h.alloc(0, &[&ks[25]]), vec![Some(5)]);
    assert_eq!(h.counts(0), counts(1, 1, 18, 0, 0));
    assert_eq!(h.alloc(0, &[&ks[26]]), vec![Some(6)]);
    assert_eq!(h.exists(&["k7", "k8", "k9"]), vec![false, false, true]);
    assert_eq!(h.counts(0), counts(2, 2, 16, 0, 0));
}

#[test]
fn a_lower_low_watermark_evicts_more_at_once() {
    // 10 pages, high 80 % = 8, low 50 % = 5.
    let mut h = Harness::with(lru(800, 500));
    h.init(0, 10).unwrap();
    let ks = names("k", 10);
    for k in ks.iter().take(8) {
        h.store(0, &[k]);
    }
    assert_eq!(h.counters().evictions, 0);
    // 8 + 1 > 8: evict until 1 more page keeps usage at 5: four keys go.
    assert_eq!(h.store(0, &[&ks[8]]), vec![8]);
    assert_eq!(h.counters().evictions, 4);
    assert_eq!(h.counts(0), counts(5, 0, 5, 0, 0));
    assert_eq!(h.exists(&strs(&ks[..5])), vec![false, false, false, false, true]);
}

// ---- partial keys ------------------------------------------------------------------------------

#[test]
fn a_partial_key_becomes_evictable_only_after_the_reservation_ttl() {
    let mut h = Harness::with(Settings { reservation_ttl: 1_000, ..lru_when_full() });
    h.init(0, 2).unwrap();
    h.init(1, 4).unwrap();
    // `p` is committed on rank 0 only (its rank-1 writer died); `q` on both.
    h.store(0, &["p"]);
    h.store(0, &["q"]);
    h.store(1, &["q"]);
    assert_eq!(h.inspect("p"), Some(info("p", &[(0, 0)], false, 0, 0, false)));
    // At the TTL the partial key may still be completed: `q` goes although `p` is older.
    h.now = 1_000;
    assert!(!h.inspect("p").unwrap().evictable);
    assert_eq!(h.try_alloc(0, &["x"]), Ok(vec![fresh(0, 1)]));
    assert_eq!(h.exists(&["q"]), vec![false]);
    assert_eq!(h.counts(1), counts(4, 0, 0, 0, 0));
    h.confirm(0, &[("x", 1)], &[]).unwrap();
    // Past the TTL (tracked in whole seconds, so by 2 s here) it is evictable like a complete key.
    h.now = 2_000;
    assert_eq!(h.inspect("p"), Some(info("p", &[(0, 0)], false, 0, 0, true)));
    assert_eq!(h.try_alloc(0, &["y"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.inspect("p"), None);
    assert_eq!(h.counters().evictions, 2);
}

#[test]
fn a_key_with_only_reservations_is_never_evicted() {
    let mut h = Harness::with(lru_when_full());
    h.init(0, 2).unwrap();
    assert_eq!(h.alloc(0, &["a", "b"]), vec![Some(0), Some(1)]);
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![miss(0)]));
    assert_eq!(h.counts(0), counts(0, 2, 0, 0, 0));
    assert_eq!(h.counters().evictions, 0);
}

// ---- eviction off: the peer --------------------------------------------------------------------

#[test]
fn eviction_off_answers_none_when_full_like_the_peer() {
    let mut h = Harness::with(Settings { eviction: Eviction::Off, ..Settings::default() });
    h.init(0, 2).unwrap();
    h.store(0, &["a", "b"]);
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![miss(0)]));
    assert_eq!(h.try_alloc(0, &["a", "c"]), Ok(vec![cached(0, 0), miss(1)]));
    h.now = 1_000_000;
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![miss(0)]));
    let c = h.counters();
    assert_eq!((c.evictions, c.misses, c.cache_hits), (0, 3, 1));
    assert_eq!(h.exists(&["a", "b"]), vec![true, true]);
}

#[test]
fn eviction_off_with_leases_and_quarantine_answers_what_the_peer_settings_answer() {
    // On valid input within the TTL, leases and quarantine change no reply: only eviction would.
    // (Deleting a leased key would: its pages are held until the lease ends. The peer has no
    // delete.)
    let mut ours = Harness::with(Settings { eviction: Eviction::Off, ..Settings::default() });
    let mut peer = Harness::with(peer_settings());
    let script = |h: &mut Harness| -> Vec<Result<Reply, Error>> {
        let k = common::keys;
        let pair = |key: &str, page: u32| (common::key(key), page);
        let vllm = || Space::Vllm;
        let cmds = vec![
            Command::Initialize { space: vllm(), rank: 0, num_pages: 4 },
            Command::Initialize { space: vllm(), rank: 1, num_pages: 4 },
            Command::Allocate { space: vllm(), rank: 0, keys: k(&["a", "b"]) },
            Command::Confirm {
                space: vllm(),
                rank: 0,
                confirmations: vec![pair("a", 0), pair("b", 1)],
                releases: vec![],
            },
            Command::Allocate { space: vllm(), rank: 1, keys: k(&["a", "b"]) },
            Command::Confirm {
                space: vllm(),
                rank: 1,
                confirmations: vec![pair("a", 0), pair("b", 1)],
                releases: vec![],
            },
            Command::Locations { space: vllm(), rank: 0, keys: k(&["a", "b", "c"]) },
            Command::Allocate { space: vllm(), rank: 0, keys: k(&["a", "c", "d"]) },
            Command::Allocate { space: vllm(), rank: 0, keys: k(&["c", "a"]) },
            Command::Confirm { space: vllm(), rank: 0, confirmations: vec![pair("c", 2)], releases: vec![] },
            Command::Allocate { space: vllm(), rank: 0, keys: k(&["d"]) },
            Command::Confirm { space: vllm(), rank: 0, confirmations: vec![], releases: vec![3] },
            Command::Exists { space: vllm(), keys: k(&["a", "b", "c"]) },
            Command::Allocate { space: vllm(), rank: 1, keys: k(&["c", "d"]) },
            Command::Confirm { space: vllm(), rank: 1, confirmations: vec![pair("c", 2)], releases: vec![3] },
            Command::Exists { space: vllm(), keys: k(&["a", "b", "c", "d"]) },
            Command::Locations { space: vllm(), rank: 1, keys: k(&["c", "a"]) },
        ];
        cmds.into_iter().map(|c| h.apply(c)).collect()
    };
    let got = script(&mut ours);
    assert_eq!(got, script(&mut peer));
    assert_eq!(got[6], Ok(Reply::Locations(vec![Some(0), Some(1), None])));
    assert_eq!(got[7], Ok(Reply::Allocated(vec![cached(0, 0), miss(1), miss(2)])));
    assert_eq!(got[8], Ok(Reply::Allocated(vec![fresh(0, 2), cached(1, 0)])));
    assert_eq!(got[10], Ok(Reply::Allocated(vec![fresh(0, 3)])));
    assert_eq!(got[13], Ok(Reply::Allocated(vec![fresh(0, 2), fresh(1, 3)])));
    assert_eq!(got[15], Ok(Reply::Exists(vec![true, true, true, false])));
    assert_eq!(got[16], Ok(Reply::Locations(vec![Some(2), Some(0)])));
    assert_eq!(ours.free_list(0), peer.free_list(0));
    assert_eq!(ours.free_list(1), peer.free_list(1));
    assert_eq!(ours.counts(0), counts(1, 0, 3, 3, 0));
    assert_eq!(peer.counts(0), counts(1, 0, 3, 0, 0));
}

// ---- delete ------------------------------------------------------------------------------------

#[test]
fn delete_frees_pages_on_every_rank_and_counts_keys_that_had_pages() {
    let mut h = Harness::with(Settings::default());
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    h.store(0, &["a", "b"]);
    h.store(1, &["pad", "a", "b"]);
    assert_eq!(h.alloc(0, &["r"]), vec![Some(2)]);
    // Repeated and unknown keys are ignored; `r` has only a reservation: not counted, kept.
    assert_eq!(h.delete(&["a", "zz", "a", "r"]), 1);
    assert_eq!(h.free_list(0), with_tail(3, 8, &[0]));
    assert_eq!(h.free_list(1), with_tail(3, 8, &[1]));
    assert_eq!(h.exists(&["a", "b"]), vec![false, true]);
    assert_eq!(h.locations(1, &["a"]), vec![None]);
    assert_eq!(h.inspect("a"), None);
    assert_eq!(h.inspect("r"), Some(info("r", &[], false, 1, 0, false)));
    assert_eq!(h.confirm(0, &[("r", 2)], &[]).map(|r| r.committed), Ok(1));
    // A partial key is deleted too; an empty delete is valid.
    assert_eq!(h.delete(&["r", "b", "pad"]), 3);
    assert_eq!(h.delete(&[]), 0);
    assert_eq!(h.counts(0), counts(8, 0, 0, 0, 0));
    assert_eq!(h.counts(1), counts(8, 0, 0, 0, 0));
    let sp = &h.stats().spaces[0];
    assert_eq!((sp.keys, sp.pending_keys, sp.counters.deleted), (0, 0, 4));
    // Deleting before any rank exists answers 0.
    let mut empty = Harness::with(Settings::default());
    assert_eq!(empty.delete(&["a"]), 0);
}

#[test]
fn deleting_a_leased_key_quarantines_its_pages_until_the_lease_ends() {
    let mut h = Harness::with(Settings { read_lease: 1_000, eviction: Eviction::Off, ..Settings::default() });
    h.init(0, 2).unwrap();
    h.init(1, 2).unwrap();
    h.store(0, &["a", "b"]);
    h.store(1, &["a", "b"]);
    h.now = 100;
    assert_eq!(h.locations(1, &["a"]), vec![Some(0)]);
    // The lease is the key's: its pages are held on every rank.
    assert_eq!(h.counts(0), counts(0, 0, 2, 1, 0));
    h.now = 200;
    assert_eq!(h.delete(&["a"]), 1);
    assert_eq!(h.counts(0), counts(0, 0, 1, 0, 1));
    assert_eq!(h.counts(1), counts(0, 0, 1, 0, 1));
    assert_eq!(h.counters().quarantined_pages, 2);
    // Not handed out while the reader may still be reading.
    h.now = 1_099;
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![miss(0)]));
    h.now = 1_100;
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.try_alloc(1, &["c"]), Ok(vec![fresh(0, 0)]));
    assert_eq!(h.counts(1), counts(0, 1, 1, 0, 0));
}

#[test]
fn an_unleased_key_is_freed_at_once_and_an_expired_lease_does_not_hold_it() {
    let mut h = Harness::with(Settings { read_lease: 100, ..Settings::default() });
    h.init(0, 4).unwrap();
    h.store(0, &["a", "b"]);
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    h.now = 100;
    assert_eq!(h.delete(&["a", "b"]), 2);
    assert_eq!(h.counts(0), counts(4, 0, 0, 0, 0));
    assert_eq!(h.free_list(0), vec![2, 3, 0, 1]);
    assert_eq!(h.counters().quarantined_pages, 0);
}

// ---- inspect -----------------------------------------------------------------------------------

#[test]
fn inspect_reports_pages_completeness_reservations_lease_and_evictability() {
    let mut h = Harness::with(Settings { read_lease: 1_000, reservation_ttl: 5_000, ..Settings::default() });
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    assert_eq!(h.inspect("a"), None);
    h.store(1, &["pad"]);
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.alloc(1, &["a"]), vec![Some(1)]);
    assert_eq!(h.alloc(1, &["a"]), vec![Some(2)]); // a second writer on rank 1
    assert_eq!(h.inspect("a"), Some(info("a", &[], false, 3, 0, false)));
    h.confirm(1, &[("a", 1)], &[]).unwrap();
    assert_eq!(h.inspect("a"), Some(info("a", &[(1, 1)], false, 2, 0, false)));
    h.confirm(0, &[("a", 0)], &[]).unwrap();
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0), (1, 1)], true, 1, 0, true)));
    h.now = 10;
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    let before = h.snapshot();
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0), (1, 1)], true, 1, 1_000, false)));
    assert_eq!(h.snapshot(), before, "inspect is a pure read");
    h.now = 610;
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0), (1, 1)], true, 1, 400, false)));
    h.now = 1_010;
    assert_eq!(h.inspect("a"), Some(info("a", &[(0, 0), (1, 1)], true, 1, 0, true)));
    // Keys are matched exactly as sent.
    assert_eq!(h.inspect("A"), None);
    assert_eq!(h.inspect("pad").map(|i| i.complete), Some(false));
}

// ---- stats -------------------------------------------------------------------------------------

#[test]
fn stats_count_every_event_and_page_state() {
    let mut h =
        Harness::with(Settings { reservation_ttl: 1_000, quarantine: 1_000, read_lease: 500, ..lru_when_full() });
    h.init(0, 4).unwrap();
    h.store(0, &["a", "b"]);
    assert_eq!(h.locations(0, &["a", "zz", "b", "a"]), vec![Some(0), None, Some(1), Some(0)]);
    assert_eq!(h.alloc(0, &["c"]), vec![Some(2)]); // never confirmed
    h.now = 100;
    assert_eq!(h.delete(&["b"]), 1); // leased: quarantined
    let s = h.stats_cmd();
    let sp = &s.spaces[0];
    assert_eq!((sp.keys, sp.pending_keys), (1, 1));
    assert_eq!(sp.ranks[0].pages, counts(1, 1, 1, 1, 1));
    h.now = 1_000;
    // The Stats command lets the clock act: the reservation expired, the delete's quarantine and
    // the leases ended. `core.stats()` alone (a plain read) would show the last command's state.
    assert_eq!(h.stats().spaces[0].ranks[0].pages, counts(1, 1, 1, 1, 1));
    let s = h.stats_cmd();
    assert_eq!(s.spaces[0].ranks[0].pages, counts(2, 0, 1, 0, 1));
    assert_eq!(s.spaces[0].pending_keys, 0);
    h.store(0, &["d", "e"]);
    h.store(0, &["f"]); // full: `a` is evicted
    h.now = 2_000;
    let s = h.stats_cmd();
    assert_eq!(s.spaces[0].ranks[0].pages, counts(1, 0, 3, 0, 0));
    assert_eq!(
        s.spaces[0].counters,
        Counters {
            reserved: 6,
            cache_hits: 0,
            misses: 0,
            committed: 5,
            refused_confirms: 0,
            superseded: 0,
            released: 0,
            ignored_releases: 0,
            expired_reservations: 1,
            dropped_keys: 0,
            evictions: 1,
            deleted: 1,
            quarantined_pages: 2,
            location_hits: 3,
            location_misses: 1,
        }
    );
    assert_eq!(s.settings, h.core.settings());
}

// ---- determinism: reads never change what later commands do ---------------------------------

#[test]
fn a_stats_read_before_a_settings_change_does_not_change_the_outcome() {
    // `Stats` lets the clock act but is not a logged command; a settings change must end the
    // deadlines due by then under the old settings, or replay would differ from the live run.
    let run = |with_stats: bool| {
        let mut h = Harness::with(Settings { reservation_ttl: 100, quarantine: 1_000, ..Settings::default() });
        h.init(0, 4).unwrap();
        assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
        h.now = 150;
        if with_stats {
            h.stats_cmd();
        }
        h.now = 200;
        h.configure(Settings { reservation_ttl: 100, quarantine: 0, ..Settings::default() });
        h.now = 300;
        assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
        h.snapshot()
    };
    let live = run(true);
    assert_eq!(live, run(false));
    // The reservation expired at 100 under a 1 s quarantine, which still runs at 300.
    assert_eq!(live.stats.spaces[0].ranks[0].pages, counts(3, 0, 0, 0, 1));
}

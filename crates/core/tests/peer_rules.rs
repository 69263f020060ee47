//! The vLLM peer's rules (and kvpages' rules where the peer is wrong) as exact tests.
//!
//! Each test restates one rule of `docs/protocol.md` ("The peer's rules", "The peer's
//! defects") and asserts the exact replies, page numbers included. The harness checks `check_invariants()` after every command.

mod common;

use common::{Harness, cached, fresh, key, miss};
use kvpages_core::{
    Command, ConfirmReport, Error, IgnoredRelease, InitOutcome, PageCounts, PagePlace, Refusal, Refused, Reply,
    Settings, Space,
};

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..b).collect()
}

fn with_tail(a: u32, b: u32, tail: &[u32]) -> Vec<u32> {
    let mut v = range(a, b);
    v.extend_from_slice(tail);
    v
}

fn counts(free: u32, reserved: u32, committed: u32) -> PageCounts {
    PageCounts { free, reserved, committed, ..PageCounts::default() }
}

// ---- free list order -------------------------------------------------------------------------

#[test]
fn pages_are_handed_out_in_fifo_order_from_zero() {
    let mut h = Harness::new();
    assert_eq!(h.init(0, 8), Ok(InitOutcome::Created { joined_after_keys: false }));
    assert_eq!(h.free_list(0), range(0, 8));
    assert_eq!(h.try_alloc(0, &["a", "b", "c"]), Ok(vec![fresh(0, 0), fresh(1, 1), fresh(2, 2)]));
    assert_eq!(h.free_list(0), range(3, 8));
    assert_eq!(h.alloc(0, &["d"]), vec![Some(3)]);
    assert_eq!(h.free_list(0), range(4, 8));
}

#[test]
fn released_pages_go_to_the_tail_and_come_back_after_the_untouched_ones() {
    let mut h = Harness::new();
    h.init(0, 6).unwrap();
    assert_eq!(h.alloc(0, &["a", "b", "c"]), vec![Some(0), Some(1), Some(2)]);
    let r = h.confirm(0, &[], &[1, 0]).unwrap();
    assert_eq!(r, ConfirmReport { released: 2, ..ConfirmReport::default() });
    assert_eq!(h.free_list(0), vec![3, 4, 5, 1, 0]);
    assert_eq!(h.alloc(0, &["d", "e", "f", "g"]), vec![Some(3), Some(4), Some(5), Some(1)]);
    assert_eq!(h.free_list(0), vec![0]);
    assert_eq!(h.alloc(0, &["h"]), vec![Some(0)]);
    assert_eq!(h.free_list(0), Vec::<u32>::new());
}

#[test]
fn each_rank_has_its_own_free_list() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.init(1, 6).unwrap();
    assert_eq!(h.alloc(0, &["a", "b"]), vec![Some(0), Some(1)]);
    assert_eq!(h.alloc(1, &["b"]), vec![Some(0)]);
    assert_eq!(h.free_list(0), range(2, 4));
    assert_eq!(h.free_list(1), range(1, 6));
}

// ---- all-or-nothing allocation ---------------------------------------------------------------

#[test]
fn a_batch_larger_than_the_free_pages_takes_nothing() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.store(0, &["a", "b", "c"]);
    assert_eq!(h.free_list(0), vec![3]);
    let before = h.counts(0);
    assert_eq!(h.try_alloc(0, &["d", "e"]), Ok(vec![miss(0), miss(1)]));
    assert_eq!(h.free_list(0), vec![3]);
    assert_eq!(h.counts(0), before);
    assert_eq!(h.counts(0), counts(1, 0, 3));
    assert_eq!(h.stats().spaces[0].counters.misses, 2);
    // A batch that fits still works afterwards.
    assert_eq!(h.alloc(0, &["d"]), vec![Some(3)]);
}

#[test]
fn a_short_pool_still_answers_complete_keys_with_their_page() {
    let mut h = Harness::new();
    h.init(0, 3).unwrap();
    assert_eq!(h.store(0, &["a", "b"]), vec![0, 1]);
    assert_eq!(h.free_list(0), vec![2]);
    // Four distinct keys, one free page: nothing is taken, but cached keys get their page.
    assert_eq!(h.try_alloc(0, &["a", "x", "b", "y"]), Ok(vec![cached(0, 0), miss(1), cached(2, 1), miss(3)]));
    assert_eq!(h.free_list(0), vec![2]);
    assert_eq!(h.counts(0), counts(1, 0, 2));
    let c = h.stats().spaces[0].counters;
    assert_eq!((c.cache_hits, c.misses), (2, 2));
}

#[test]
fn a_cache_hit_rotates_the_page_taken_for_it_to_the_tail() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    assert_eq!(h.store(0, &["a"]), vec![0]);
    assert_eq!(h.free_list(0), range(1, 8));
    // Pages 1 and 2 are taken; 1 was for the hit `a` and goes to the tail, `b` keeps 2.
    assert_eq!(h.try_alloc(0, &["a", "b"]), Ok(vec![cached(0, 0), fresh(1, 2)]));
    assert_eq!(h.free_list(0), with_tail(3, 8, &[1]));
    assert_eq!(h.counts(0), counts(6, 1, 1));
    // A hit after the fresh key: the rotation follows key order.
    assert_eq!(h.try_alloc(0, &["c", "a", "d"]), Ok(vec![fresh(0, 3), cached(1, 0), fresh(2, 5)]));
    assert_eq!(h.free_list(0), with_tail(6, 8, &[1, 4]));
}

#[test]
fn confirming_a_cache_hit_changes_nothing() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.store(0, &["a"]);
    assert_eq!(h.try_alloc(0, &["a"]), Ok(vec![cached(0, 0)]));
    let before = h.snapshot();
    // The connector confirms every pair it allocated, cache hits included.
    assert_eq!(h.confirm(0, &[("a", 0)], &[]), Ok(ConfirmReport { unchanged: 1, ..ConfirmReport::default() }));
    assert_eq!(h.snapshot(), before);
    assert_eq!(h.free_list(0), with_tail(2, 8, &[1]));
    assert_eq!(h.counts(0), counts(7, 0, 1));
}

#[test]
fn an_exhausted_pool_answers_none_until_a_page_comes_back() {
    let mut h = Harness::new();
    h.init(0, 2).unwrap();
    assert_eq!(h.alloc(0, &["a", "b"]), vec![Some(0), Some(1)]);
    assert_eq!(h.try_alloc(0, &["c"]), Ok(vec![miss(0)]));
    assert_eq!(h.free_list(0), Vec::<u32>::new());
    h.confirm(0, &[("a", 0)], &[1]).unwrap();
    assert_eq!(h.alloc(0, &["c"]), vec![Some(1)]);
    assert_eq!(h.alloc(0, &["d"]), vec![None]);
}

#[test]
fn release_restores_the_counts() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    assert_eq!(h.counts(0), counts(8, 0, 0));
    h.alloc(0, &["a", "b", "c"]);
    assert_eq!(h.counts(0), counts(5, 3, 0));
    let r = h.confirm(0, &[("b", 1)], &[0, 2]).unwrap();
    assert_eq!(r, ConfirmReport { committed: 1, released: 2, ..ConfirmReport::default() });
    assert_eq!(h.counts(0), counts(7, 0, 1));
    assert_eq!(h.free_list(0), with_tail(3, 8, &[0, 2]));
    // Released keys hold nothing, so they are no longer stored.
    assert_eq!(h.stats().spaces[0].keys, 1);
}

#[test]
fn a_second_release_of_a_page_is_ignored() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.alloc(0, &["a", "b"]);
    h.confirm(0, &[], &[1]).unwrap();
    assert_eq!(h.free_list(0), vec![2, 3, 1]);
    let r = h.confirm(0, &[], &[1]).unwrap();
    assert_eq!(
        r,
        ConfirmReport { ignored_releases: vec![(1, IgnoredRelease::AlreadyFree)], ..ConfirmReport::default() }
    );
    assert_eq!(h.free_list(0), vec![2, 3, 1]);
    // Twice in one request: the first frees it, the second is ignored.
    let r = h.confirm(0, &[], &[0, 0]).unwrap();
    assert_eq!(
        r,
        ConfirmReport {
            released: 1,
            ignored_releases: vec![(0, IgnoredRelease::AlreadyFree)],
            ..ConfirmReport::default()
        }
    );
    assert_eq!(h.free_list(0), vec![2, 3, 1, 0]);
    assert_eq!(h.counts(0), counts(4, 0, 0));
    assert_eq!(h.stats().spaces[0].counters.ignored_releases, 2);
}

#[test]
fn releasing_a_page_never_handed_out_is_ignored_and_does_not_move_it() {
    let mut h = Harness::new();
    h.init(0, 6).unwrap();
    h.alloc(0, &["a"]);
    let r = h.confirm(0, &[], &[4]).unwrap();
    assert_eq!(
        r,
        ConfirmReport { ignored_releases: vec![(4, IgnoredRelease::AlreadyFree)], ..ConfirmReport::default() }
    );
    assert_eq!(h.free_list(0), range(1, 6));
}

// ---- uninitialized ranks ---------------------------------------------------------------------

#[test]
fn an_uninitialized_rank_is_refused_on_every_route_that_names_one() {
    let mut h = Harness::new();
    // No space at all yet.
    assert_eq!(h.try_alloc(0, &["a"]), Err(Error::RankNotInitialized { rank: 0 }));
    assert_eq!(h.confirm(0, &[("a", 0)], &[]), Err(Error::RankNotInitialized { rank: 0 }));
    assert_eq!(h.confirm(0, &[], &[]), Err(Error::RankNotInitialized { rank: 0 }));
    assert_eq!(h.try_locations(0, &["a"]), Err(Error::RankNotInitialized { rank: 0 }));
    assert_eq!(h.exists(&["a", "b"]), vec![false, false]);
    // The space exists, rank 5 does not.
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    let before = h.snapshot();
    assert_eq!(h.try_alloc(5, &["a"]), Err(Error::RankNotInitialized { rank: 5 }));
    assert_eq!(h.confirm(5, &[("a", 0)], &[0]), Err(Error::RankNotInitialized { rank: 5 }));
    assert_eq!(h.try_locations(5, &["a"]), Err(Error::RankNotInitialized { rank: 5 }));
    assert_eq!(h.snapshot(), before);
}

#[test]
fn a_worker_needs_at_least_one_page() {
    let mut h = Harness::new();
    assert_eq!(h.init(0, 0), Err(Error::ZeroPages { rank: 0 }));
    assert!(h.stats().spaces.is_empty());
    h.init(0, 4).unwrap();
    assert_eq!(h.init(0, 0), Err(Error::ZeroPages { rank: 0 }));
    assert_eq!(h.stats().spaces[0].ranks[0].num_pages, 4);
}

#[test]
fn empty_batches_are_valid() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.confirm(0, &[], &[]), Ok(ConfirmReport::default()));
    assert_eq!(h.exists(&[]), Vec::<bool>::new());
    assert_eq!(h.locations(0, &[]), Vec::<Option<u32>>::new());
    assert_eq!(h.free_list(0), range(0, 4));
}

// ---- completeness across the TP world ------------------------------------------------------

#[test]
fn a_key_is_complete_once_every_initialized_rank_confirmed_it() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    h.store(1, &["pad"]); // so the key's pages differ between the ranks
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.alloc(1, &["a"]), vec![Some(1)]);
    h.confirm(0, &[("a", 0)], &[]).unwrap();
    assert_eq!(h.exists(&["a"]), vec![false]);
    assert_eq!(h.locations(0, &["a"]), vec![None]);
    assert_eq!(h.locations(1, &["a"]), vec![None]);
    // Incomplete, so an allocation on rank 0 is no cache hit: the key gets a fresh page.
    assert_eq!(h.try_alloc(0, &["a"]), Ok(vec![fresh(0, 1)]));
    h.confirm(0, &[], &[1]).unwrap();
    h.confirm(1, &[("a", 1)], &[]).unwrap();
    assert_eq!(h.exists(&["a", "pad", "zz"]), vec![true, false, false]);
    assert_eq!(h.locations(0, &["a", "zz"]), vec![Some(0), None]);
    assert_eq!(h.locations(1, &["a"]), vec![Some(1)]);
    assert_eq!(h.try_alloc(1, &["a"]), Ok(vec![cached(0, 1)]));
}

#[test]
fn with_one_rank_a_single_confirm_completes_a_key() {
    let mut h = Harness::new();
    h.init(3, 4).unwrap();
    assert_eq!(h.store(3, &["a", "b"]), vec![0, 1]);
    assert_eq!(h.exists(&["b", "a", "c"]), vec![true, true, false]);
    assert_eq!(h.locations(3, &["b", "a", "c"]), vec![Some(1), Some(0), None]);
}

#[test]
fn a_rank_that_joins_later_makes_stored_keys_incomplete_until_it_stores_them() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    assert_eq!(h.exists(&["a"]), vec![true]);
    assert_eq!(h.init(1, 4), Ok(InitOutcome::Created { joined_after_keys: true }));
    assert_eq!(h.exists(&["a"]), vec![false]);
    assert_eq!(h.locations(0, &["a"]), vec![None]);
    h.store(1, &["a"]);
    assert_eq!(h.exists(&["a"]), vec![true]);
    assert_eq!(h.locations(1, &["a"]), vec![Some(0)]);
}

// ---- duplicates ------------------------------------------------------------------------------

#[test]
fn a_key_repeated_in_one_batch_counts_once() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    assert_eq!(h.try_alloc(0, &["a", "a", "b"]), Ok(vec![fresh(0, 0), fresh(2, 1)]));
    assert_eq!(h.free_list(0), range(2, 8));
    assert_eq!(h.counts(0), counts(6, 2, 0));
    // Duplicates do not count towards the pages a batch needs: 2 distinct keys fit in 2 pages.
    let mut h = Harness::new();
    h.init(0, 2).unwrap();
    assert_eq!(h.try_alloc(0, &["b", "a", "b", "a", "a"]), Ok(vec![fresh(0, 0), fresh(1, 1)]));
}

#[test]
fn repeated_keys_in_exists_and_locations_answer_each_position() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    assert_eq!(h.exists(&["a", "b", "a"]), vec![true, false, true]);
    assert_eq!(h.locations(0, &["a", "a", "b"]), vec![Some(0), Some(0), None]);
}

// ---- re-initialization -----------------------------------------------------------------------

#[test]
fn initializing_a_rank_again_with_the_same_size_changes_nothing() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    h.store(0, &["a", "b"]);
    h.store(1, &["a"]);
    h.alloc(0, &["c"]);
    h.confirm(0, &[], &[0]).unwrap();
    let before = h.snapshot();
    assert_eq!(h.init(0, 8), Ok(InitOutcome::Unchanged));
    assert_eq!(h.init(1, 8), Ok(InitOutcome::Unchanged));
    assert_eq!(h.snapshot(), before);
    assert_eq!(h.exists(&["a", "b"]), vec![true, false]);
    // The reservation of `c` survived: it can still be confirmed.
    assert_eq!(h.confirm(0, &[("c", 2)], &[]).map(|r| r.committed), Ok(1));
}

#[test]
fn initializing_a_rank_with_another_size_drops_its_keys_on_every_rank() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    assert_eq!(h.store(0, &["a", "b"]), vec![0, 1]);
    assert_eq!(h.store(1, &["pad", "a", "b", "c"]), vec![0, 1, 2, 3]);
    assert_eq!(h.exists(&["a", "b", "c"]), vec![true, true, false]);
    assert_eq!(h.free_list(1), range(4, 8));
    // `d` is reserved on rank 0 when the rank changes size.
    assert_eq!(h.alloc(0, &["d"]), vec![Some(2)]);

    let r = h.init(0, 16);
    assert_eq!(r, Ok(InitOutcome::Recreated { old_num_pages: 8, dropped_keys: 2 }));
    assert_eq!(h.free_list(0), range(0, 16));
    assert_eq!(h.counts(0), counts(16, 0, 0));
    // `a` and `b` lost their pages on rank 1 too, which went to the tail; `pad` and `c` stay.
    assert_eq!(h.free_list(1), with_tail(4, 8, &[1, 2]));
    assert_eq!(h.counts(1), counts(6, 0, 2));
    assert_eq!(h.exists(&["a", "b", "c", "pad"]), vec![false, false, false, false]);
    assert_eq!(h.locations(1, &["a", "b", "c", "pad"]), vec![None, None, None, None]);
    let sp = &h.stats().spaces[0];
    assert_eq!(sp.keys, 2);
    assert_eq!(sp.counters.dropped_keys, 2);
    // The stale reservation of `d` names a page of the old file: refused, nothing applied.
    assert_eq!(
        h.confirm(0, &[("d", 2)], &[]),
        Err(Error::NothingConfirmed { refused: vec![Refused { index: 0, page: 2, reason: Refusal::NotReserved }] })
    );
    // A dropped key can be stored again from scratch.
    assert_eq!(h.store(0, &["a"]), vec![0]);
    assert_eq!(h.store(1, &["a"]), vec![4]);
    assert_eq!(h.exists(&["a"]), vec![true]);
}

#[test]
fn a_smaller_size_drops_keys_and_makes_old_high_pages_out_of_range() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.store(0, &["a", "b", "c", "d", "e", "f"]);
    assert_eq!(h.init(0, 4), Ok(InitOutcome::Recreated { old_num_pages: 8, dropped_keys: 6 }));
    assert_eq!(h.free_list(0), range(0, 4));
    assert_eq!(h.stats().spaces[0].keys, 0);
    assert_eq!(
        h.confirm(0, &[], &[5]),
        Err(Error::PageOutOfRange { rank: 0, page: 5, num_pages: 4, place: PagePlace::Release(0) })
    );
}

#[test]
fn recreating_a_rank_where_one_key_holds_several_pages_keeps_the_key_table_sound() {
    // Two writers of one key on the rank being re-created: `a` holds two reservations there,
    // `b` is committed there with a second writer's reservation still pending; neither has
    // anything on another rank, so both leave the key table.
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.init(1, 8).unwrap();
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.alloc(0, &["a"]), vec![Some(1)]);
    assert_eq!(h.alloc(0, &["b"]), vec![Some(2)]);
    h.confirm(0, &[("b", 2)], &[]).unwrap();
    assert_eq!(h.alloc(0, &["b"]), vec![Some(3)]); // incomplete (rank 1 lacks it): fresh page
    assert_eq!(h.alloc(1, &["c"]), vec![Some(0)]);
    assert_eq!(h.alloc(0, &["c"]), vec![Some(4)]);
    // `b` has a committed page; `a` and `c` only reservations.
    assert_eq!((h.stats().spaces[0].keys, h.stats().spaces[0].pending_keys), (1, 2));

    assert_eq!(h.init(0, 4), Ok(InitOutcome::Recreated { old_num_pages: 8, dropped_keys: 1 }));
    assert_eq!((h.stats().spaces[0].keys, h.stats().spaces[0].pending_keys), (0, 1));
    assert_eq!(h.counts(0), counts(4, 0, 0));
    assert_eq!(h.counts(1), counts(7, 1, 0));
    // `c` keeps its reservation on rank 1; everything can be stored again.
    assert_eq!(h.confirm(1, &[("c", 0)], &[]).map(|r| r.committed), Ok(1));
    assert_eq!(h.store(0, &["a", "b", "c"]), vec![0, 1, 2]);
    assert_eq!(h.exists(&["a", "b", "c"]), vec![false, false, true]);
    assert_eq!(h.locations(0, &["c"]), vec![Some(2)]);
}

// ---- a fixed TP world ------------------------------------------------------------------------

#[test]
fn with_a_world_size_ranks_outside_it_are_refused_and_completeness_needs_all_of_it() {
    let mut h = Harness::with(Settings { world_size: Some(2), ..common::peer_settings() });
    assert_eq!(h.init(2, 8), Err(Error::RankOutsideWorld { rank: 2, world_size: 2 }));
    assert!(h.stats().spaces.is_empty());
    h.init(0, 8).unwrap();
    assert_eq!(h.init(7, 8), Err(Error::RankOutsideWorld { rank: 7, world_size: 2 }));
    h.store(0, &["a"]);
    // Rank 1 has not even joined: the key is not complete with a world of 2.
    assert_eq!(h.exists(&["a"]), vec![false]);
    assert_eq!(h.locations(0, &["a"]), vec![None]);
    assert_eq!(h.stats().spaces[0].world_size, 2);
    assert_eq!(h.init(1, 8), Ok(InitOutcome::Created { joined_after_keys: true }));
    assert_eq!(h.exists(&["a"]), vec![false]);
    h.store(1, &["a"]);
    assert_eq!(h.exists(&["a"]), vec![true]);
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.locations(1, &["a"]), vec![Some(0)]);
}

// ---- confirm rules for requests that do not match the state ---------------------------------

#[test]
fn confirmations_not_reserved_for_their_key_are_refused_one_by_one() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    assert_eq!(h.alloc(0, &["a", "b"]), vec![Some(0), Some(1)]);
    let r = h.confirm(0, &[("a", 0), ("x", 5), ("a", 1), ("b", 0)], &[]).unwrap();
    assert_eq!(
        r,
        ConfirmReport {
            committed: 1,
            refused: vec![
                Refused { index: 1, page: 5, reason: Refusal::NotReserved },
                Refused { index: 2, page: 1, reason: Refusal::ReservedForAnotherKey },
                Refused { index: 3, page: 0, reason: Refusal::CommittedToAnotherKey },
            ],
            ..ConfirmReport::default()
        }
    );
    assert_eq!(h.stats().spaces[0].counters.refused_confirms, 3);
    assert_eq!(h.counts(0), counts(6, 1, 1));
    assert_eq!(h.locations(0, &["a", "b", "x"]), vec![Some(0), None, None]);
    // `b` still holds page 1, reserved.
    assert_eq!(h.confirm(0, &[("b", 1)], &[]).map(|r| r.committed), Ok(1));
    assert_eq!(h.stats().spaces[0].keys, 2);
}

#[test]
fn when_every_confirmation_is_refused_nothing_is_applied_not_even_releases() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.store(0, &["c"]);
    assert_eq!(h.alloc(0, &["a", "b"]), vec![Some(1), Some(2)]);
    let before = h.snapshot();
    let r = h.confirm(0, &[("x", 5), ("b", 1), ("a", 0)], &[2, 1]);
    assert_eq!(
        r,
        Err(Error::NothingConfirmed {
            refused: vec![
                Refused { index: 0, page: 5, reason: Refusal::NotReserved },
                Refused { index: 1, page: 1, reason: Refusal::ReservedForAnotherKey },
                Refused { index: 2, page: 0, reason: Refusal::CommittedToAnotherKey },
            ]
        })
    );
    assert_eq!(h.snapshot(), before);
    assert_eq!(h.counts(0), counts(5, 2, 1));
    // The releases did not happen: both reservations are still there.
    let r = h.confirm(0, &[("a", 1)], &[2]).unwrap();
    assert_eq!(r, ConfirmReport { committed: 1, released: 1, ..ConfirmReport::default() });
}

#[test]
fn releases_alone_are_never_refused() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    let r = h.confirm(0, &[], &[0, 3]).unwrap();
    assert_eq!(
        r,
        ConfirmReport {
            ignored_releases: vec![(0, IgnoredRelease::Committed), (3, IgnoredRelease::AlreadyFree)],
            ..ConfirmReport::default()
        }
    );
}

#[test]
fn confirming_a_page_already_committed_to_the_same_key_is_a_no_op() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.alloc(0, &["a", "b"]);
    h.confirm(0, &[("a", 0)], &[]).unwrap();
    let before = h.snapshot();
    let r = h.confirm(0, &[("a", 0)], &[]).unwrap();
    assert_eq!(r, ConfirmReport { unchanged: 1, ..ConfirmReport::default() });
    assert_eq!(h.snapshot(), before);
    // Twice in one request: one commit, one no-op.
    let r = h.confirm(0, &[("b", 1), ("b", 1)], &[]).unwrap();
    assert_eq!(r, ConfirmReport { committed: 1, unchanged: 1, ..ConfirmReport::default() });
}

#[test]
fn of_two_writers_of_one_new_key_the_first_confirm_wins_and_the_other_page_is_freed() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.alloc(0, &["a"]), vec![Some(1)]);
    assert_eq!(h.counts(0), counts(6, 2, 0));
    assert_eq!(h.confirm(0, &[("a", 1)], &[]), Ok(ConfirmReport { committed: 1, ..ConfirmReport::default() }));
    assert_eq!(h.confirm(0, &[("a", 0)], &[]), Ok(ConfirmReport { superseded: 1, ..ConfirmReport::default() }));
    assert_eq!(h.free_list(0), with_tail(2, 8, &[0]));
    assert_eq!(h.counts(0), counts(7, 0, 1));
    assert_eq!(h.locations(0, &["a"]), vec![Some(1)]);
    assert_eq!(h.stats().spaces[0].counters.superseded, 1);
    // Both writers in one request: the same rule, in request order.
    assert_eq!(h.alloc(0, &["b"]), vec![Some(2)]);
    assert_eq!(h.alloc(0, &["b"]), vec![Some(3)]);
    let r = h.confirm(0, &[("b", 2), ("b", 3)], &[]).unwrap();
    assert_eq!(r, ConfirmReport { committed: 1, superseded: 1, ..ConfirmReport::default() });
    assert_eq!(h.free_list(0), with_tail(4, 8, &[0, 3]));
    assert_eq!(h.locations(0, &["b"]), vec![Some(2)]);
}

#[test]
fn releasing_a_committed_page_is_ignored_and_never_frees_it() {
    let mut h = Harness::new();
    h.init(0, 3).unwrap();
    h.store(0, &["a"]);
    // The connector's write-failure path releases every page it got, cache hits included.
    assert_eq!(h.try_alloc(0, &["a", "b"]), Ok(vec![cached(0, 0), fresh(1, 2)]));
    let r = h.confirm(0, &[], &[0, 2]).unwrap();
    assert_eq!(
        r,
        ConfirmReport {
            released: 1,
            ignored_releases: vec![(0, IgnoredRelease::Committed)],
            ..ConfirmReport::default()
        }
    );
    assert_eq!(h.free_list(0), vec![1, 2]);
    assert_eq!(h.exists(&["a"]), vec![true]);
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
    // Page 0 is not handed to anyone else.
    assert_eq!(h.alloc(0, &["c", "d"]), vec![Some(1), Some(2)]);
    assert_eq!(h.alloc(0, &["e"]), vec![None]);
}

#[test]
fn a_page_out_of_range_refuses_the_whole_confirm() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.alloc(0, &["a", "b"]);
    let before = h.snapshot();
    assert_eq!(
        h.confirm(0, &[("a", 0)], &[1, 8]),
        Err(Error::PageOutOfRange { rank: 0, page: 8, num_pages: 8, place: PagePlace::Release(1) })
    );
    assert_eq!(
        h.confirm(0, &[("a", 0), ("b", u32::MAX)], &[1]),
        Err(Error::PageOutOfRange { rank: 0, page: u32::MAX, num_pages: 8, place: PagePlace::Confirmation(1) })
    );
    assert_eq!(h.snapshot(), before);
    assert_eq!(h.exists(&["a"]), vec![false]);
    assert_eq!(h.counts(0), counts(6, 2, 0));
}

// ---- reservation TTL -------------------------------------------------------------------------

#[test]
fn an_unconfirmed_reservation_expires_after_the_ttl_and_a_late_confirm_is_refused() {
    let mut h = Harness::with(Settings { reservation_ttl: 1_000, ..common::peer_settings() });
    h.init(0, 8).unwrap();
    h.now = 100;
    assert_eq!(h.alloc(0, &["a", "b", "c"]), vec![Some(0), Some(1), Some(2)]);
    h.now = 1_099;
    assert_eq!(h.confirm(0, &[("a", 0)], &[]).map(|r| r.committed), Ok(1));
    assert_eq!(h.counts(0), counts(5, 2, 1));
    // At exactly 100 + ttl the reservations end; an empty allocation lets the clock act.
    h.now = 1_100;
    assert_eq!(h.try_alloc(0, &[]), Ok(vec![]));
    assert_eq!(h.free_list(0), with_tail(3, 8, &[1, 2]));
    assert_eq!(h.counts(0), counts(7, 0, 1));
    let sp = &h.stats().spaces[0];
    assert_eq!((sp.keys, sp.counters.expired_reservations), (1, 2));
    assert_eq!(
        h.confirm(0, &[("b", 1)], &[2]),
        Err(Error::NothingConfirmed { refused: vec![Refused { index: 0, page: 1, reason: Refusal::NotReserved }] })
    );
    // The committed key is untouched by expiry.
    assert_eq!(h.exists(&["a"]), vec![true]);
}

#[test]
fn a_late_confirm_of_a_page_handed_to_another_key_is_refused() {
    let mut h = Harness::with(Settings { reservation_ttl: 50, ..common::peer_settings() });
    h.init(0, 1).unwrap();
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    h.now = 49;
    assert_eq!(h.alloc(0, &["b"]), vec![None]);
    h.now = 50;
    assert_eq!(h.alloc(0, &["b"]), vec![Some(0)]);
    assert_eq!(
        h.confirm(0, &[("a", 0)], &[]),
        Err(Error::NothingConfirmed {
            refused: vec![Refused { index: 0, page: 0, reason: Refusal::ReservedForAnotherKey }]
        })
    );
    // Once `b` commits the page, no release (late or not) can take it from `b`.
    assert_eq!(h.confirm(0, &[("b", 0)], &[]).map(|r| r.committed), Ok(1));
    let r = h.confirm(0, &[], &[0]).unwrap();
    assert_eq!(r.ignored_releases, vec![(0, IgnoredRelease::Committed)]);
    assert_eq!(h.exists(&["a", "b"]), vec![false, true]);
}

#[test]
fn an_expired_second_writer_does_not_disturb_the_committed_page() {
    let mut h = Harness::with(Settings { reservation_ttl: 10, ..common::peer_settings() });
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    h.init(1, 4).unwrap(); // `a` is now incomplete, so rank 0 allocates it afresh
    assert_eq!(h.alloc(0, &["a"]), vec![Some(1)]);
    h.now = 10;
    assert_eq!(h.alloc(1, &["a"]), vec![Some(0)]);
    assert_eq!(h.free_list(0), vec![2, 3, 1]);
    assert_eq!(h.confirm(1, &[("a", 0)], &[]).map(|r| r.committed), Ok(1));
    assert_eq!(h.locations(0, &["a"]), vec![Some(0)]);
}

// ---- clear -----------------------------------------------------------------------------------

#[test]
fn clear_drops_every_rank_and_key() {
    let mut h = Harness::new();
    h.init(0, 8).unwrap();
    h.init(1, 4).unwrap();
    h.store(0, &["a", "b"]);
    h.store(1, &["a"]);
    h.alloc(1, &["c"]);
    assert_eq!(h.clear(), Reply::Cleared { ranks: 2, keys: 3 });
    assert!(h.stats().spaces.is_empty());
    assert_eq!(h.core.free_list(&Space::Vllm, 0), None);
    assert_eq!(h.exists(&["a", "b", "c"]), vec![false, false, false]);
    assert_eq!(h.try_alloc(0, &["a"]), Err(Error::RankNotInitialized { rank: 0 }));
    assert_eq!(h.try_locations(1, &["a"]), Err(Error::RankNotInitialized { rank: 1 }));
    assert_eq!(h.clear(), Reply::Cleared { ranks: 0, keys: 0 });
    // A fresh start: pages from 0 again, counters from zero.
    assert_eq!(h.init(0, 8), Ok(InitOutcome::Created { joined_after_keys: false }));
    assert_eq!(h.alloc(0, &["a"]), vec![Some(0)]);
    assert_eq!(h.stats().spaces[0].counters.committed, 0);
}

// ---- keys ------------------------------------------------------------------------------------

#[test]
fn keys_are_matched_exactly_as_sent() {
    let lower = "386b2d9cf5aa91ba3a4b42c35396c822";
    let upper = "386B2D9CF5AA91BA3A4B42C35396C822";
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.store(0, &[lower]);
    assert_eq!(h.exists(&[lower, upper]), vec![true, false]);
    assert_eq!(h.try_alloc(0, &[upper, lower]), Ok(vec![fresh(0, 1), cached(1, 0)]));
    assert_eq!(key(upper).to_string(), upper);
}

#[test]
fn a_refused_command_changes_nothing() {
    let mut h = Harness::new();
    h.init(0, 4).unwrap();
    h.store(0, &["a"]);
    h.alloc(0, &["b"]);
    let before = h.snapshot();
    let refused = [
        Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 0 },
        Command::Allocate { space: Space::Vllm, rank: 1, keys: vec![key("a")] },
        Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![(key("b"), 0)], releases: vec![1] },
        Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![(key("b"), 1)], releases: vec![4] },
        Command::Locations { space: Space::Vllm, rank: 2, keys: vec![key("a")] },
    ];
    for cmd in refused {
        assert!(h.apply(cmd.clone()).is_err(), "{cmd:?}");
        assert_eq!(h.snapshot(), before, "{cmd:?}");
    }
}

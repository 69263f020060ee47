//! SGLang HiCache's `rank:namespace` pools: the peer's rules restated (stack order, per-key
//! reserve, hits untouched), and kvpages' fixes of its defects.

use kvpages_core::{Allocation, Command, Core, Error, Eviction, Key, Reply, Settings, Space};

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

fn space(rank: u32, ns: &str) -> Space {
    Space::Sglang { rank, namespace: ns.into() }
}

/// The peer's behaviour: no eviction, no quarantine, no leases.
fn peer() -> Core {
    Core::new(5, Settings { eviction: Eviction::Off, quarantine: 0, read_lease: 0, ..Settings::default() })
}

fn init(c: &mut Core, sp: &Space, n: u32) {
    let Space::Sglang { rank, .. } = sp else { unreachable!() };
    c.apply(0, &Command::Initialize { space: sp.clone(), rank: *rank, num_pages: n }).unwrap();
}

fn reserve(c: &mut Core, sp: &Space, keys: &[&str]) -> Vec<(bool, Option<u32>)> {
    let Space::Sglang { rank, .. } = sp else { unreachable!() };
    let keys: Vec<Key> = keys.iter().map(|k| key(k)).collect();
    match c.apply(0, &Command::Allocate { space: sp.clone(), rank: *rank, keys }).unwrap() {
        Reply::Allocated(a) => a.iter().map(|a: &Allocation| (a.cached, a.page)).collect(),
        other => panic!("{other:?}"),
    }
}

fn confirm(c: &mut Core, sp: &Space, pairs: &[(&str, u32)], releases: &[u32]) {
    let Space::Sglang { rank, .. } = sp else { unreachable!() };
    let confirmations = pairs.iter().map(|(k, p)| (key(k), *p)).collect();
    c.apply(0, &Command::Confirm { space: sp.clone(), rank: *rank, confirmations, releases: releases.to_vec() })
        .unwrap();
    c.check_invariants().unwrap();
}

/// `keys` (distinct) stored in a fresh pool of `n` pages: the pages they were given.
fn stored(c: &mut Core, sp: &Space, n: u32, keys: &[&str]) -> Vec<u32> {
    init(c, sp, n);
    let pages: Vec<u32> = reserve(c, sp, keys).into_iter().map(|(_, page)| page.expect("a free page")).collect();
    let pairs: Vec<(&str, u32)> = keys.iter().copied().zip(pages.iter().copied()).collect();
    confirm(c, sp, &pairs, &[]);
    pages
}

#[test]
fn pages_come_from_the_end_and_released_pages_go_on_top() {
    let mut c = peer();
    let s = space(0, "kv");
    init(&mut c, &s, 4);
    assert_eq!(reserve(&mut c, &s, &["a", "b"]), vec![(false, Some(3)), (false, Some(2))]);
    confirm(&mut c, &s, &[("a", 3)], &[2]);
    // 2 was pushed back on top of the stack: it is handed out next.
    assert_eq!(reserve(&mut c, &s, &["c", "a"]), vec![(false, Some(2)), (true, Some(3))]);
    assert_eq!(c.free_list(&s, 0), Some(vec![1, 0]));
}

#[test]
fn each_new_key_takes_a_page_while_one_is_free() {
    let mut c = peer();
    let s = space(1, "kv");
    init(&mut c, &s, 2);
    // Not all or nothing: the first two keys get pages, the third -1 (the peer would evict).
    assert_eq!(reserve(&mut c, &s, &["a", "b", "c"]), vec![(false, Some(1)), (false, Some(0)), (false, None)]);
}

#[test]
fn a_repeated_new_key_takes_one_page() {
    let mut c = peer();
    let s = space(0, "kv");
    init(&mut c, &s, 4);
    // The core answers per distinct key; the host repeats the answer for each position.
    assert_eq!(reserve(&mut c, &s, &["a", "a", "b"]), vec![(false, Some(3)), (false, Some(2))]);
    assert_eq!(c.stats().spaces[0].ranks[0].pages.reserved, 2);
}

#[test]
fn ranks_and_namespaces_are_separate_pools_and_key_spaces() {
    let mut c = peer();
    let (kv0, kv1, mamba0) = (space(0, "kv"), space(1, "kv"), space(0, "mamba"));
    for s in [&kv0, &kv1, &mamba0] {
        init(&mut c, s, 3);
    }
    assert_eq!(reserve(&mut c, &kv0, &["a"]), vec![(false, Some(2))]);
    confirm(&mut c, &kv0, &[("a", 2)], &[]);
    let exists = |c: &mut Core, s: &Space| c.apply(0, &Command::Exists { space: s.clone(), keys: vec![key("a")] });
    assert_eq!(exists(&mut c, &kv0), Ok(Reply::Exists(vec![true])));
    assert_eq!(exists(&mut c, &kv1), Ok(Reply::Exists(vec![false])));
    assert_eq!(exists(&mut c, &mamba0), Ok(Reply::Exists(vec![false])));
    assert_eq!(reserve(&mut c, &mamba0, &["a"]), vec![(false, Some(2))]);
    // The vLLM space is another world again.
    assert_eq!(
        c.apply(0, &Command::Exists { space: Space::Vllm, keys: vec![key("a")] }),
        Ok(Reply::Exists(vec![false]))
    );
}

#[test]
fn an_uninitialized_rank_namespace_is_refused_everywhere() {
    let mut c = peer();
    let s = space(3, "swa");
    let k = vec![key("a")];
    for cmd in [
        Command::Exists { space: s.clone(), keys: k.clone() },
        Command::Allocate { space: s.clone(), rank: 3, keys: k.clone() },
        Command::Locations { space: s.clone(), rank: 3, keys: k.clone() },
        Command::Delete { space: s.clone(), keys: k.clone() },
        Command::Reset { space: s.clone() },
        Command::Confirm { space: s.clone(), rank: 3, confirmations: vec![], releases: vec![] },
    ] {
        assert_eq!(c.apply(0, &cmd), Err(Error::RankNotInitialized { rank: 3 }), "{cmd:?}");
    }
}

#[test]
fn reset_frees_every_page_and_keeps_the_pool() {
    let mut c = peer();
    let s = space(0, "kv");
    assert_eq!(stored(&mut c, &s, 3, &["a", "b"]), [2, 1]);
    c.apply(0, &Command::Reset { space: s.clone() }).unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.free_list(&s, 0), Some(vec![2, 1, 0]));
    assert_eq!(c.apply(0, &Command::Exists { space: s.clone(), keys: vec![key("a")] }), Ok(Reply::Exists(vec![false])));
}

#[test]
fn delete_pushes_the_page_back_on_top() {
    let mut c = peer();
    let s = space(0, "kv");
    assert_eq!(stored(&mut c, &s, 3, &["a", "b"]), [2, 1]);
    assert_eq!(
        c.apply(0, &Command::Delete { space: s.clone(), keys: vec![key("a"), key("zz")] }),
        Ok(Reply::Deleted(1))
    );
    assert_eq!(reserve(&mut c, &s, &["c"]), vec![(false, Some(2))]);
}

#[test]
fn with_lru_eviction_a_full_pool_keeps_learning_and_hits_survive_their_batch() {
    let mut c = Core::new(5, Settings { quarantine: 0, ..Settings::default() });
    let s = space(0, "kv");
    init(&mut c, &s, 3);
    for k in ["a", "b"] {
        let got = reserve(&mut c, &s, &[k]);
        confirm(&mut c, &s, &[(k, got[0].1.unwrap())], &[]);
    }
    // 3 pages, watermarks at 2: "a" is the least recently used, but it is a hit in this batch.
    let got = reserve(&mut c, &s, &["a", "c"]);
    assert_eq!(got[0], (true, Some(2)));
    assert!(!got[1].0);
    assert!(got[1].1.is_some());
    assert_eq!(
        c.apply(0, &Command::Exists { space: s.clone(), keys: vec![key("a"), key("b")] }),
        Ok(Reply::Exists(vec![true, false]))
    );
}

fn pool(rank: u32, ns: &str, n: u32, free: &[u32], keys: &[(&str, u32)]) -> kvpages_core::SglangPool {
    kvpages_core::SglangPool {
        rank,
        namespace: ns.into(),
        num_pages: n,
        free_pages: free.to_vec(),
        keys: keys.iter().map(|(k, p)| (key(k), *p)).collect(),
    }
}

#[test]
fn an_import_continues_exactly_where_the_peer_stopped() {
    let mut c = peer();
    // The notes' example: {"0:kv": {"num_pages": 3, "free_pages": [0], "key_to_index": [["a", 2]]}}
    // — page 1 is in neither list (the peer leaked it).
    let pools = vec![pool(0, "kv", 3, &[0], &[("a", 2)])];
    assert_eq!(
        c.apply(0, &Command::ImportSglang { pools, replace: false }),
        Ok(Reply::Imported { pools: 1, keys: 1, leaked_pages: 1 })
    );
    c.check_invariants().unwrap();
    let s = space(0, "kv");
    // The peer would pop 0 next; the leaked page 1 comes after it.
    assert_eq!(reserve(&mut c, &s, &["a", "b", "c"]), vec![(true, Some(2)), (false, Some(0)), (false, Some(1))]);
}

#[test]
fn export_gives_the_peers_format_back() {
    let mut c = peer();
    let s = space(2, "mamba");
    assert_eq!(stored(&mut c, &s, 4, &["a", "b"]), [3, 2]);
    // get_page_indices makes "a" the most recently used.
    c.apply(0, &Command::Locations { space: s.clone(), rank: 2, keys: vec![key("a")] }).unwrap();
    let Ok(Reply::SglangPools(pools)) = c.apply(0, &Command::ExportSglang) else { panic!() };
    assert_eq!(pools, vec![pool(2, "mamba", 4, &[0, 1], &[("b", 2), ("a", 3)])]);
    // And back: the same state.
    let mut d = peer();
    d.apply(0, &Command::ImportSglang { pools: pools.clone(), replace: false }).unwrap();
    let Ok(Reply::SglangPools(again)) = d.apply(0, &Command::ExportSglang) else { panic!() };
    assert_eq!(again, pools);
}

#[test]
fn a_bad_import_is_refused_whole_with_the_place_named() {
    let mut c = peer();
    let refused = |c: &mut Core, pools, replace| match c.apply(0, &Command::ImportSglang { pools, replace }) {
        Err(Error::ImportRefused { reason }) => reason,
        other => panic!("{other:?}"),
    };
    let good = pool(0, "kv", 3, &[0], &[("a", 2)]);
    assert_eq!(
        refused(&mut c, vec![good.clone(), pool(1, "kv", 3, &[0, 0], &[])], false),
        "\"1:kv\".free_pages[1]: page 0 is listed twice (also free_pages[0])"
    );
    assert_eq!(
        refused(&mut c, vec![pool(0, "kv", 3, &[1], &[("a", 1)])], false),
        "\"0:kv\".key_to_index[0]: page 1 is listed twice (also free_pages[0])"
    );
    assert_eq!(
        refused(&mut c, vec![pool(0, "kv", 3, &[3], &[])], false),
        "\"0:kv\".free_pages[0]: page 3 is out of range (the pool has 3 pages)"
    );
    assert_eq!(
        refused(&mut c, vec![pool(0, "kv", 3, &[], &[("a", 1), ("a", 2)])], false),
        "\"0:kv\".key_to_index[1]: key \"a\" is listed twice (also [0])"
    );
    assert_eq!(refused(&mut c, vec![good.clone(), good.clone()], false), "pool \"0:kv\" appears twice");
    // Nothing was loaded by the refused imports.
    assert!(c.stats().spaces.is_empty());
    c.apply(0, &Command::ImportSglang { pools: vec![good.clone()], replace: false }).unwrap();
    assert_eq!(
        c.apply(0, &Command::ImportSglang { pools: vec![good.clone()], replace: false }),
        Err(Error::SglangPoolsExist { pools: 1 })
    );
    assert!(c.apply(0, &Command::ImportSglang { pools: vec![pool(5, "kv", 2, &[], &[])], replace: true }).is_ok());
    assert_eq!(c.stats().spaces.len(), 1);
}

//! `Command` → one call → `Reply`, by either way in: a request to the plugin's direct entry
//! point (in `kvpages_abi::direct`'s frames, the codec the guest shares), or the host side of
//! `wit/kvpages.wit`, field for field.
//!
//! The guest's domain errors come back as the core's [`kvpages_core::Error`], so the routes
//! answer them exactly as for the native engine. The WIT-only errors (`invalid-input`,
//! `not-created`, ...) and the direct entry point's faults mean the host sent something it never
//! should, or the guest answered something malformed: a fault.

use std::hash::BuildHasher;

use kvpages_abi::{Seen, direct, keys};
use kvpages_core as kv;
use kvpages_core::{Command, Key, Millis, Reply};

use super::bindings::exports::kvpages::engine::engine as wit;
use super::sandbox::{Budget, Instance, Trap};
use crate::engine::EngineError;

/// A call's bytes, kept by the engine across calls (one buffer): through the WIT interface the
/// packed keys, through the direct entry point the whole request, its packed keys from `keys`
/// on. The journal copies the keys from here.
#[derive(Debug)]
pub(super) struct CallBuffer {
    bytes: Vec<u8>,
    keys: usize,
    /// [`kvpages_abi::fits`]' tables.
    seen: Seen,
}

impl Default for CallBuffer {
    fn default() -> CallBuffer {
        CallBuffer { bytes: Vec::new(), keys: 0, seen: seen() }
    }
}

/// [`kvpages_abi::fits`]' tables, hashing with a seed drawn at random: a client that knew it
/// could send keys that all collide, or shape the free list so that a batch's pages did.
fn seen() -> Seen {
    Seen::new(std::collections::hash_map::RandomState::new().hash_one(0u64))
}

impl CallBuffer {
    /// The last call's packed keys (empty for a command without).
    pub(super) fn keys(&self) -> &[u8] {
        &self.bytes[self.keys..]
    }
}

fn space(s: &kv::Space) -> wit::Space {
    match s {
        kv::Space::Vllm => wit::Space::Vllm,
        kv::Space::Sglang { rank, namespace } => {
            wit::Space::Sglang(wit::SglangSpace { rank: *rank, namespace: namespace.to_string() })
        }
    }
}

fn space_in(s: wit::Space) -> kv::Space {
    match s {
        wit::Space::Vllm => kv::Space::Vllm,
        wit::Space::Sglang(p) => kv::Space::Sglang { rank: p.rank, namespace: p.namespace.into_boxed_str() },
    }
}

fn settings(s: kv::Settings) -> wit::Settings {
    kv::copy_settings!(kv => wit, s)
}

fn refused(r: wit::Refused) -> kv::Refused {
    kv::Refused {
        index: r.index,
        page: r.page,
        reason: match r.reason {
            wit::Refusal::NotReserved => kv::Refusal::NotReserved,
            wit::Refusal::ReservedForAnotherKey => kv::Refusal::ReservedForAnotherKey,
            wit::Refusal::CommittedToAnotherKey => kv::Refusal::CommittedToAnotherKey,
        },
    }
}

fn error(e: wit::Error) -> EngineError {
    EngineError::Domain(match e {
        wit::Error::RankNotInitialized(rank) => kv::Error::RankNotInitialized { rank },
        wit::Error::ZeroPages(rank) => kv::Error::ZeroPages { rank },
        wit::Error::RankOutsideWorld(r) => kv::Error::RankOutsideWorld { rank: r.rank, world_size: r.world_size },
        wit::Error::PageOutOfRange(p) => kv::Error::PageOutOfRange {
            rank: p.rank,
            page: p.page,
            num_pages: p.num_pages,
            place: match p.place {
                wit::PagePlace::Confirmation(i) => kv::PagePlace::Confirmation(i),
                wit::PagePlace::Release(i) => kv::PagePlace::Release(i),
            },
        },
        wit::Error::SglangPoolsExist(pools) => kv::Error::SglangPoolsExist { pools },
        wit::Error::ImportRefused(reason) => kv::Error::ImportRefused { reason },
        wit::Error::NothingConfirmed(r) => {
            kv::Error::NothingConfirmed { refused: r.into_iter().map(refused).collect() }
        }
        other => return EngineError::Fault(capped(&format!("the plugin refused a call the host built: {other:?}"))),
    })
}

fn key(text: &str) -> Result<Key, EngineError> {
    Key::parse(text).map_err(|e| EngineError::Fault(format!("the plugin answered a key that does not parse: {e}")))
}

fn stats(s: wit::EngineStats) -> kv::Stats {
    kv::copy_stats!(wit => kv::Stats, s, |sp: &wit::Space| space_in(sp.clone()))
}

fn key_info(k: wit::KeyInfo) -> Result<kv::KeyInfo, EngineError> {
    Ok(kv::KeyInfo {
        key: key(&k.key)?,
        pages: k.pages.into_iter().map(|p| (p.rank, p.page)).collect(),
        complete: k.complete,
        reservations: k.reservations,
        lease_remaining: k.lease_remaining,
        evictable: k.evictable,
    })
}

fn sglang_pool(p: &kv::SglangPool) -> wit::SglangPool {
    wit::SglangPool {
        rank: p.rank,
        namespace: p.namespace.to_string(),
        num_pages: p.num_pages,
        free_pages: p.free_pages.clone(),
        keys: {
            let mut packed = Vec::new();
            keys::pack_keys(&mut packed, p.keys.iter().map(|(k, _)| k));
            packed
        },
        pages: p.keys.iter().map(|(_, page)| *page).collect(),
    }
}

fn sglang_pool_in(p: wit::SglangPool) -> Result<kv::SglangPool, EngineError> {
    keys::sglang_pool(p.rank, p.namespace, p.num_pages, p.free_pages, &p.keys, p.pages)
        .map_err(|why| EngineError::Fault(format!("the plugin answered a malformed SGLang pool: {why}")))
}

/// Applies `cmd` through one call into `inst` (either way in), its bytes built in `buf` (the
/// packed keys left there for the journal). The outer `Err` is a trap; the inner result is
/// what the native engine would answer.
pub(super) fn call(
    inst: &mut Instance,
    now: Millis,
    cmd: &Command,
    buf: &mut CallBuffer,
) -> Result<Result<Reply, EngineError>, Trap> {
    let budget = budget(cmd);
    let result = if inst.is_direct() {
        buf.bytes.clear();
        buf.keys = direct::encode_apply(&mut buf.bytes, now, cmd);
        let (status, reply) = inst.exchange(budget, &buf.bytes)?;
        match direct::decode_reply(cmd, status, reply) {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(refusal)) => Err(EngineError::Domain(refusal)),
            Err(why) => Err(EngineError::Fault(format!("the plugin's direct entry point: {why}"))),
        }
    } else {
        keys::pack_keys_of(&mut buf.bytes, cmd);
        buf.keys = 0;
        call_wit(inst, now, cmd, budget, &buf.bytes)?
    };
    Ok(match fits(cmd, &result, &mut buf.seen) {
        // The one refusal that carries the plugin's own text: capped, by either way in.
        Ok(()) => result.map_err(|e| match e {
            EngineError::Domain(kv::Error::ImportRefused { reason }) => {
                EngineError::Domain(kv::Error::ImportRefused { reason: capped(&reason) })
            }
            e => e,
        }),
        Err(why) => Err(EngineError::Fault(format!("the plugin answered {}: {why}", cmd.name()))),
    })
}

/// A text from the plugin, at most 1 KiB of it (`direct::fault_text`'s rule, for both ways in):
/// it goes into logs and answers, and a hostile plugin could make it as long as its memory.
fn capped(text: &str) -> String {
    direct::fault_text(text.as_bytes())
}

/// [`kvpages_abi::fits`] over the engine's result: a fault or a trap carries no answer to check.
fn fits(cmd: &Command, answer: &Result<Reply, EngineError>, seen: &mut Seen) -> Result<(), String> {
    match answer {
        Ok(reply) => kvpages_abi::fits(cmd, Ok(reply), seen),
        Err(EngineError::Domain(e)) => kvpages_abi::fits(cmd, Err(e), seen),
        Err(_) => Ok(()),
    }
}

/// A fresh engine in `inst` (either way in).
pub(super) fn create(inst: &mut Instance, seed: u64, set: kv::Settings) -> Result<(), String> {
    if inst.is_direct() {
        let mut request = Vec::new();
        direct::encode_create(&mut request, seed, &set);
        let (status, reply) = inst.exchange(Budget::Fixed, &request).map_err(|t| format!("create: {t}"))?;
        return direct::decode_done(status, reply).map_err(|why| format!("create: {why}"));
    }
    let set = settings(set);
    inst.call(Budget::Fixed, |p, s| p.kvpages_engine_engine().call_create(s, seed, set))
        .map_err(|t| format!("create: {t}"))
}

/// `inst`'s state replaced by a snapshot's (either way in).
pub(super) fn restore(inst: &mut Instance, snapshot: &[u8]) -> Result<(), String> {
    let budget = Budget::Restore(snapshot.len());
    if inst.is_direct() {
        let mut request = Vec::new();
        direct::encode_restore(&mut request, snapshot);
        let (status, reply) = inst.exchange(budget, &request).map_err(|t| format!("restore: {t}"))?;
        return direct::decode_done(status, reply).map_err(|why| format!("restore refused the snapshot: {why}"));
    }
    inst.call(budget, |p, s| p.kvpages_engine_engine().call_restore(s, snapshot))
        .map_err(|t| format!("restore: {t}"))?
        .map_err(|e| capped(&format!("restore refused the snapshot: {e:?}")))
}

/// `inst`'s snapshot (either way in): the outer `Err` a trap, the inner a refusal.
pub(super) fn snapshot(inst: &mut Instance) -> Result<Result<Vec<u8>, String>, Trap> {
    if inst.is_direct() {
        let mut request = Vec::new();
        direct::encode_snapshot(&mut request);
        let (status, reply) = inst.exchange(Budget::State, &request)?;
        return Ok(direct::decode_snapshot(status, reply).map(<[u8]>::to_vec));
    }
    Ok(inst
        .call(Budget::State, |p, s| p.kvpages_engine_engine().call_snapshot(s))?
        .map_err(|e| capped(&format!("{e:?}"))))
}

/// The time a command may take.
fn budget(cmd: &Command) -> Budget {
    match cmd {
        Command::Configure(_)
        | Command::Initialize { .. }
        | Command::Clear { .. }
        | Command::Reset { .. }
        | Command::ExportSglang
        | Command::LeaseAll
        | Command::ImportSglang { .. } => Budget::State,
        Command::Stats | Command::Inspect { .. } => Budget::Fixed,
        Command::Allocate { .. }
        | Command::Confirm { .. }
        | Command::Exists { .. }
        | Command::Locations { .. }
        | Command::Delete { .. } => Budget::Keys(cmd.keys_in()),
    }
}

/// [`call`] through the WIT interface, `keys` packed (a `Vec`: the bindings take `&Vec<u8>`).
#[allow(clippy::ptr_arg)]
fn call_wit(
    inst: &mut Instance,
    now: Millis,
    cmd: &Command,
    budget: Budget,
    keys: &Vec<u8>,
) -> Result<Result<Reply, EngineError>, Trap> {
    inst.call(budget, |p, s| {
        let e = p.kvpages_engine_engine();
        Ok(match cmd {
            Command::Configure(set) => {
                e.call_configure(s, now, settings(*set))?.map(|()| Reply::Configured).map_err(error)
            }
            Command::Initialize { space: sp, rank, num_pages } => e
                .call_initialize(s, now, &space(sp), *rank, *num_pages)?
                .map(|o| Reply::Initialized {
                    rank: *rank,
                    num_pages: *num_pages,
                    outcome: match o {
                        wit::InitOutcome::Created(joined_after_keys) => kv::InitOutcome::Created { joined_after_keys },
                        wit::InitOutcome::Unchanged => kv::InitOutcome::Unchanged,
                        wit::InitOutcome::Recreated(r) => {
                            kv::InitOutcome::Recreated { old_num_pages: r.old_num_pages, dropped_keys: r.dropped_keys }
                        }
                    },
                })
                .map_err(error),
            Command::Allocate { space: sp, rank, .. } => {
                e.call_allocate(s, now, &space(sp), *rank, keys)?.map_err(error).and_then(|words| {
                    kvpages_abi::allocations::unpack_allocations(&words)
                        .map(Reply::Allocated)
                        .map_err(|why| EngineError::Fault(format!("the plugin answered {why}")))
                })
            }
            Command::Confirm { space: sp, rank, confirmations, releases } => {
                let pages: Vec<u32> = confirmations.iter().map(|(_, p)| *p).collect();
                e.call_confirm(s, now, &space(sp), *rank, keys, &pages, releases)?
                    .map(|r| {
                        Reply::Confirmed(kv::ConfirmReport {
                            committed: r.committed,
                            unchanged: r.unchanged,
                            superseded: r.superseded,
                            refused: r.refused.into_iter().map(refused).collect(),
                            released: r.released,
                            ignored_releases: r
                                .ignored_releases
                                .into_iter()
                                .map(|i| {
                                    let why = match i.reason {
                                        wit::IgnoredReason::AlreadyFree => kv::IgnoredRelease::AlreadyFree,
                                        wit::IgnoredReason::Committed => kv::IgnoredRelease::Committed,
                                    };
                                    (i.page, why)
                                })
                                .collect(),
                        })
                    })
                    .map_err(error)
            }
            Command::Exists { space: sp, .. } => {
                e.call_exists(s, now, &space(sp), keys)?.map(Reply::Exists).map_err(error)
            }
            Command::Locations { space: sp, rank, .. } => {
                e.call_locations(s, now, &space(sp), *rank, keys)?.map(Reply::Locations).map_err(error)
            }
            Command::Delete { space: sp, .. } => {
                e.call_delete(s, now, &space(sp), keys)?.map(Reply::Deleted).map_err(error)
            }
            Command::Inspect { space: sp, key: k } => match e.call_inspect(s, now, &space(sp), &k.to_string())? {
                Ok(None) => Ok(Reply::Key(None)),
                Ok(Some(info)) => key_info(info).map(|i| Reply::Key(Some(Box::new(i)))),
                Err(err) => Err(error(err)),
            },
            Command::Clear { space: sp } => e
                .call_clear(s, now, &space(sp))?
                .map(|c| Reply::Cleared { ranks: c.ranks, keys: c.keys })
                .map_err(error),
            Command::Reset { space: sp } => e
                .call_reset(s, now, &space(sp))?
                .map(|c| Reply::Cleared { ranks: c.ranks, keys: c.keys })
                .map_err(error),
            Command::Stats => e.call_stats(s, now)?.map(|st| Reply::Stats(Box::new(stats(st)))).map_err(error),
            Command::ImportSglang { pools, replace } => {
                let pools: Vec<wit::SglangPool> = pools.iter().map(sglang_pool).collect();
                e.call_import_sglang(s, now, &pools, *replace)?
                    .map(|i| Reply::Imported { pools: i.pools, keys: i.keys, leaked_pages: i.leaked_pages })
                    .map_err(error)
            }
            Command::LeaseAll => e.call_lease_all(s, now)?.map(Reply::Leased).map_err(error),
            Command::ExportSglang => match e.call_export_sglang(s, now)? {
                Ok(pools) => {
                    pools.into_iter().map(sglang_pool_in).collect::<Result<Vec<_>, _>>().map(Reply::SglangPools)
                }
                Err(err) => Err(error(err)),
            },
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cores_allocations_answer_each_distinct_key_once_and_a_broken_plugins_do_not() {
        // Seeded batches with repeats, hits (some keys stored), and pools too small for the
        // batch (-1 answers; with eviction on, evictions), in vLLM's space and SGLang's (per-key
        // LIFO serving), 32-hex keys and a few text ones, through one set of tables reused
        // across batch sizes, as a plugin engine's are.
        let mut seen = seen();
        let mut totals = kv::Counters::default();
        for seed in 0..40 {
            let mut rng = kvpages_rng::Rng::new(seed);
            let mut n = |below: u64| rng.below(below);
            let settings = kv::Settings {
                eviction: if seed % 2 == 0 { kv::Eviction::Lru } else { kv::Eviction::Off },
                ..kv::Settings::default()
            };
            let space = match seed % 4 {
                3 => kv::Space::Sglang { rank: 0, namespace: "kv".into() },
                _ => kv::Space::Vllm,
            };
            let mut core = kv::Core::new(seed, settings);
            let pages = 1 + n(300) as u32;
            core.apply(0, &Command::Initialize { space: space.clone(), rank: 0, num_pages: pages }).unwrap();
            for round in 0..12u64 {
                let keys: Vec<Key> = (0..n(200))
                    .map(|_| match n(8) {
                        0 => Key::parse(&format!("k{}", n(20))).unwrap(),
                        _ => Key::parse(&format!("{:032x}", n(150))).unwrap(),
                    })
                    .collect();
                let cmd = Command::Allocate { space: space.clone(), rank: 0, keys: keys.clone() };
                let reply = core.apply(1 + round, &cmd).map_err(EngineError::Domain);
                assert_eq!(fits(&cmd, &reply, &mut seen), Ok(()), "seed {seed} round {round}");
                let Ok(Reply::Allocated(a)) = reply else { panic!("{reply:?}") };
                // Confirm half of them, so later batches meet hits.
                let pairs: Vec<(Key, u32)> = a
                    .iter()
                    .filter(|x| !x.cached && x.index % 2 == 0)
                    .filter_map(|x| Some((keys[x.index as usize].clone(), x.page?)))
                    .collect();
                let confirm =
                    Command::Confirm { space: space.clone(), rank: 0, confirmations: pairs, releases: vec![] };
                let _ = core.apply(1 + round, &confirm);
                // Broken four ways: a key left out, a repeat answered, a page past any rank's,
                // a page given twice.
                let reply = |a: Vec<kv::Allocation>| Ok(Reply::Allocated(a));
                if !a.is_empty() {
                    let mut left_out = a.clone();
                    let gone = left_out.remove(n(a.len() as u64) as usize);
                    let why = fits(&cmd, &reply(left_out), &mut seen).unwrap_err();
                    assert_eq!(why, format!("no allocation for key {}, the first of its kind", gone.index));
                }
                let repeat = (1..keys.len()).find(|&i| keys[..i].contains(&keys[i]));
                if let Some(i) = repeat {
                    let mut twice = a.clone();
                    let at = twice.partition_point(|x| (x.index as usize) < i);
                    twice.insert(at, kv::Allocation { index: i as u32, page: None, cached: false });
                    let why = fits(&cmd, &reply(twice), &mut seen).unwrap_err();
                    assert_eq!(why, format!("an allocation for key {i}, a repeat of an earlier key"));
                }
                if let Some(first) = a.first() {
                    let mut past = a.clone();
                    past[0].page = Some(u32::MAX);
                    let why = fits(&cmd, &reply(past), &mut seen).unwrap_err();
                    assert_eq!(why, format!("page {} for key {}, past any rank's pages", u32::MAX, first.index));
                }
                let with_pages: Vec<usize> = (0..a.len()).filter(|&j| a[j].page.is_some()).collect();
                if let [.., x, y] = with_pages[..] {
                    let mut shared = a.clone();
                    shared[y].page = shared[x].page;
                    let why = fits(&cmd, &reply(shared), &mut seen).unwrap_err();
                    let (page, second) = (a[x].page.unwrap(), a[y].index);
                    assert_eq!(why, format!("page {page} allocated to two keys (the second: key {second})"));
                }
            }
            let c = core.stats().spaces[0].counters;
            (totals.cache_hits, totals.misses, totals.evictions) =
                (totals.cache_hits + c.cache_hits, totals.misses + c.misses, totals.evictions + c.evictions);
        }
        // The batches met what they are there for.
        assert!(totals.cache_hits > 100 && totals.misses > 100 && totals.evictions > 100, "{totals:?}");
    }
}

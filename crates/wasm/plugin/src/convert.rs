//! Conversions between the WIT types and `kvpages-core`'s (the packed key batches and
//! allocations are `kvpages_abi`'s).
//!
//! Field for field, no logic: a name means the same thing on both sides (WIT's kebab-case
//! `num-pages` is the core's `num_pages`).

use alloc::string::ToString;
use alloc::vec::Vec;

use kvpages_abi::keys;
use kvpages_core as kv;
use kvpages_core::Key;

use crate::bindings::exports::kvpages::engine::engine as wit;

/// A packed batch ([`keys::unpack_batch`]) and whether every key came in the raw form; a
/// malformed one is WIT's `invalid-input`.
pub(crate) fn batch(bytes: &[u8]) -> Result<(Vec<Key>, bool), wit::Error> {
    keys::unpack_batch(bytes, |_, key| key).map_err(wit::Error::InvalidInput)
}

/// A confirm's batch, one page a key ([`keys::confirmations`]); WIT's `invalid-input` if not.
pub(crate) fn confirmations(bytes: &[u8], pages: &[u32]) -> Result<(Vec<(Key, u32)>, bool), wit::Error> {
    keys::confirmations(bytes, pages.len(), |i| pages.get(i).copied()).map_err(wit::Error::InvalidInput)
}

/// One key, checked as the core's parser checks it.
pub(crate) fn key(text: &str) -> Result<Key, wit::Error> {
    keys::parse_key(text, 0).map_err(wit::Error::InvalidInput)
}

pub(crate) fn space(s: wit::Space) -> kv::Space {
    match s {
        wit::Space::Vllm => kv::Space::Vllm,
        wit::Space::Sglang(wit::SglangSpace { rank, namespace }) => {
            kv::Space::Sglang { rank, namespace: namespace.into_boxed_str() }
        }
    }
}

fn space_out(s: &kv::Space) -> wit::Space {
    match s {
        kv::Space::Vllm => wit::Space::Vllm,
        kv::Space::Sglang { rank, namespace } => {
            wit::Space::Sglang(wit::SglangSpace { rank: *rank, namespace: namespace.to_string() })
        }
    }
}

pub(crate) fn settings(s: wit::Settings) -> kv::Settings {
    kv::copy_settings!(wit => kv, s)
}

/// The core's settings as WIT's (for `stats`, and for tests).
pub fn settings_out(s: kv::Settings) -> wit::Settings {
    kv::copy_settings!(kv => wit, s)
}

pub(crate) fn init_outcome(o: kv::InitOutcome) -> wit::InitOutcome {
    match o {
        kv::InitOutcome::Created { joined_after_keys } => wit::InitOutcome::Created(joined_after_keys),
        kv::InitOutcome::Unchanged => wit::InitOutcome::Unchanged,
        kv::InitOutcome::Recreated { old_num_pages, dropped_keys } => {
            wit::InitOutcome::Recreated(wit::Recreated { old_num_pages, dropped_keys })
        }
    }
}

fn refused(r: &kv::Refused) -> wit::Refused {
    wit::Refused {
        index: r.index,
        page: r.page,
        reason: match r.reason {
            kv::Refusal::NotReserved => wit::Refusal::NotReserved,
            kv::Refusal::ReservedForAnotherKey => wit::Refusal::ReservedForAnotherKey,
            kv::Refusal::CommittedToAnotherKey => wit::Refusal::CommittedToAnotherKey,
        },
    }
}

pub(crate) fn confirm_report(r: kv::ConfirmReport) -> wit::ConfirmReport {
    wit::ConfirmReport {
        committed: r.committed,
        unchanged: r.unchanged,
        superseded: r.superseded,
        refused: r.refused.iter().map(refused).collect(),
        released: r.released,
        ignored_releases: r
            .ignored_releases
            .iter()
            .map(|&(page, why)| wit::IgnoredRelease {
                page,
                reason: match why {
                    kv::IgnoredRelease::AlreadyFree => wit::IgnoredReason::AlreadyFree,
                    kv::IgnoredRelease::Committed => wit::IgnoredReason::Committed,
                },
            })
            .collect(),
    }
}

pub(crate) fn key_info(k: &kv::KeyInfo) -> wit::KeyInfo {
    wit::KeyInfo {
        key: k.key.to_string(),
        pages: k.pages.iter().map(|&(rank, page)| wit::RankPage { rank, page }).collect(),
        complete: k.complete,
        reservations: k.reservations,
        lease_remaining: k.lease_remaining,
        evictable: k.evictable,
    }
}

pub(crate) fn stats(s: &kv::Stats) -> wit::EngineStats {
    kv::copy_stats!(kv => wit::EngineStats, *s, space_out)
}

pub(crate) fn error(e: &kv::Error) -> wit::Error {
    match e {
        kv::Error::RankNotInitialized { rank } => wit::Error::RankNotInitialized(*rank),
        kv::Error::ZeroPages { rank } => wit::Error::ZeroPages(*rank),
        kv::Error::RankOutsideWorld { rank, world_size } => {
            wit::Error::RankOutsideWorld(wit::RankOutsideWorld { rank: *rank, world_size: *world_size })
        }
        kv::Error::PageOutOfRange { rank, page, num_pages, place } => wit::Error::PageOutOfRange(wit::PageOutOfRange {
            rank: *rank,
            page: *page,
            num_pages: *num_pages,
            place: match place {
                kv::PagePlace::Confirmation(i) => wit::PagePlace::Confirmation(*i),
                kv::PagePlace::Release(i) => wit::PagePlace::Release(*i),
            },
        }),
        kv::Error::SglangPoolsExist { pools } => wit::Error::SglangPoolsExist(*pools),
        kv::Error::ImportRefused { reason } => wit::Error::ImportRefused(reason.clone()),
        kv::Error::NothingConfirmed { refused: r } => wit::Error::NothingConfirmed(r.iter().map(refused).collect()),
    }
}

pub(crate) fn sglang_pool(p: wit::SglangPool, index: usize) -> Result<kv::SglangPool, wit::Error> {
    keys::sglang_pool(p.rank, p.namespace, p.num_pages, p.free_pages, &p.keys, p.pages)
        .map_err(|why| wit::Error::InvalidInput(alloc::format!("pools[{index}]: {why}")))
}

pub(crate) fn sglang_pool_out(p: &kv::SglangPool) -> wit::SglangPool {
    let mut keys = Vec::new();
    let mut pages = Vec::with_capacity(p.keys.len());
    for (k, page) in &p.keys {
        keys::pack_core_key(&mut keys, k);
        pages.push(*page);
    }
    wit::SglangPool {
        rank: p.rank,
        namespace: p.namespace.to_string(),
        num_pages: p.num_pages,
        free_pages: p.free_pages.clone(),
        keys,
        pages,
    }
}

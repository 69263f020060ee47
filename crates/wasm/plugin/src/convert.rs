//! Conversions between the WIT types and `kvpages-core`'s, and the packed key batches.
//!
//! Field for field, no logic: a name means the same thing on both sides (WIT's kebab-case
//! `num-pages` is the core's `num_pages`).

use alloc::string::ToString;
use alloc::vec::Vec;

use kvpages_core as kv;
use kvpages_core::Key;

use crate::bindings::exports::kvpages::engine::engine as wit;

/// Appends one key to a packed batch: its length as a little-endian u16, then its bytes.
/// (The encoder hosts use; the guest only decodes. Keys longer than u16 are the caller's bug.)
pub fn pack_key(out: &mut Vec<u8>, key: &str) {
    let len = u16::try_from(key.len()).expect("keys are at most 1024 bytes");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

/// The prefix of a key sent as its 16 raw bytes (`0x8000 | 16`): a 32-char lowercase hex key,
/// which needs no parsing (see `packed-keys` in `wit/kvpages.wit`).
pub const RAW_HEX: u16 = 0x8000 | 16;

/// Appends one key in the shortest form: [`RAW_HEX`] and 16 bytes for a 32-hex key, else its
/// text (see [`pack_key`]).
pub fn pack_core_key(out: &mut Vec<u8>, key: &Key) {
    pack_keys(out, core::iter::once(key));
}

/// Appends `keys` as a packed batch, each in the shortest form ([`pack_core_key`]). kvpages'
/// host packs its calls' keys with this, for both ways in (the WIT interface and `direct`).
pub fn pack_keys<'a>(out: &mut Vec<u8>, keys: impl ExactSizeIterator<Item = &'a Key>) {
    // 18 bytes a key in the common case; text keys grow it as needed.
    out.reserve(keys.len() * 18);
    for key in keys {
        match key {
            Key::Hex(bytes) => {
                // One 18-byte record, one capacity check (two `extend_from_slice` calls cost
                // ~24 instructions a key, this ~half).
                let mut record = [0; 18];
                let (prefix, raw) = record.split_at_mut(2);
                prefix.copy_from_slice(&RAW_HEX.to_le_bytes());
                raw.copy_from_slice(bytes);
                out.extend_from_slice(&record);
            }
            Key::Text(text) => pack_key(out, text),
        }
    }
}

/// Decodes a packed batch, refusing (never trapping on) anything malformed; `keys[i]` names
/// the culprit the way the host's JSON errors do.
pub(crate) fn unpack_keys(bytes: &[u8]) -> Result<Vec<Key>, wit::Error> {
    unpack_batch(bytes, |_, key| key).map(|(keys, _)| keys)
}

/// [`unpack_keys`], each key `i` handed to `item` as it is decoded (`confirm` pairs keys with
/// their pages without a vector of keys in between), and whether every key came in the raw
/// form (then [`discard`] may free the items without visiting them).
pub(crate) fn unpack_batch<T: KeyItem>(
    bytes: &[u8],
    mut item: impl FnMut(usize, Key) -> T,
) -> Result<(Vec<T>, bool), wit::Error> {
    match unpack_raw(bytes, &mut item) {
        Some(items) => Ok((items, true)),
        None => unpack_any(bytes, item).map(|items| (items, false)),
    }
}

/// A confirm's batch: each key paired with its page as it is decoded (`page(i)` is page `i`,
/// if there is one), refused unless there is exactly one page per key. Both ways in decode a
/// confirm with this.
pub(crate) fn confirmations(
    bytes: &[u8],
    pages: usize,
    page: impl Fn(usize) -> Option<u32>,
) -> Result<(Vec<(Key, u32)>, bool), wit::Error> {
    let (confirmations, raw) = unpack_batch(bytes, |i, key| (key, page(i).unwrap_or(u32::MAX)))?;
    if confirmations.len() != pages {
        return Err(wit::Error::InvalidInput(alloc::format!(
            "{} keys but {pages} pages: confirmations need one page per key",
            confirmations.len()
        )));
    }
    Ok((confirmations, raw))
}

/// What a batch decodes into: a key, or a key with its page. Dropping one whose key is a
/// [`Key::Hex`] frees nothing (the key is 16 bytes in place, a page a `u32`).
pub(crate) trait KeyItem {}
impl KeyItem for Key {}
impl KeyItem for (Key, u32) {}

/// Frees a decoded batch. When every key came in the raw form (`raw` from [`unpack_batch`]),
/// the vector's buffer is freed without a drop of each item, which would find nothing to free
/// (a loop that cost ~19 instructions a key under Cranelift: ~1.2k a 32-key save).
pub(crate) fn discard<T: KeyItem>(mut items: Vec<T>, raw: bool) {
    if raw {
        // SAFETY: `raw` means every item's key is a `Key::Hex` (the core only reads the batch),
        // so no item owns heap memory: not running their drops leaks nothing. `set_len(0)`
        // exposes no uninitialised item (and were `raw` ever wrong, a text key would leak, no
        // more).
        unsafe { items.set_len(0) };
    }
}

/// The common batch, every key in the raw form (vLLM's and SGLang's 32-hex keys): its 18-byte
/// records are checked in one tight pass and copied in another, with no per-key length or
/// bounds checks; `None` for any other batch.
fn unpack_raw<T>(bytes: &[u8], item: &mut impl FnMut(usize, Key) -> T) -> Option<Vec<T>> {
    let (keys, []) = bytes.as_chunks::<18>() else { return None };
    if !keys.iter().all(|[lo, hi, ..]| u16::from_le_bytes([*lo, *hi]) == RAW_HEX) {
        return None;
    }
    Some(keys.iter().enumerate().map(|(i, [_, _, raw @ ..])| item(i, Key::Hex(*raw))).collect())
}

/// Any batch: raw and text keys mixed, or malformed (refused with the culprit's index).
fn unpack_any<T>(mut bytes: &[u8], mut item: impl FnMut(usize, Key) -> T) -> Result<Vec<T>, wit::Error> {
    let bad = |i: usize, why: &str| wit::Error::InvalidInput(alloc::format!("keys[{i}]: {why}"));
    // Sized for raw hex keys (18 bytes each, the common form); text keys grow it as needed.
    let mut items = Vec::with_capacity(bytes.len() / 18 + 1);
    while !bytes.is_empty() {
        let i = items.len();
        let [lo, hi, rest @ ..] = bytes else { return Err(bad(i, "the length prefix is cut off")) };
        let prefix = u16::from_le_bytes([*lo, *hi]);
        if prefix & 0x8000 != 0 {
            if prefix != RAW_HEX {
                return Err(bad(i, &alloc::format!("prefix {prefix:#06x}: the only raw form is 0x8010")));
            }
            let Some((raw, tail)) = rest.split_first_chunk::<16>() else {
                return Err(bad(i, &alloc::format!("16 raw bytes announced, {} left", rest.len())));
            };
            items.push(item(i, Key::Hex(*raw)));
            bytes = tail;
            continue;
        }
        let len = usize::from(prefix);
        if rest.len() < len {
            return Err(bad(i, &alloc::format!("{len} bytes announced, {} left", rest.len())));
        }
        let text = core::str::from_utf8(&rest[..len]).map_err(|_| bad(i, "the key is not UTF-8"))?;
        items.push(item(i, key(text, i)?));
        bytes = &rest[len..];
    }
    Ok(items)
}

/// One key, checked as the core's parser checks it.
pub(crate) fn key(text: &str, index: usize) -> Result<Key, wit::Error> {
    Key::parse(text).map_err(|e| wit::Error::InvalidInput(alloc::format!("keys[{index}]: {e}")))
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
    kv::Settings {
        reservation_ttl: s.reservation_ttl,
        world_size: s.world_size,
        read_lease: s.read_lease,
        quarantine: s.quarantine,
        eviction: match s.eviction {
            wit::Eviction::Lru => kv::Eviction::Lru,
            wit::Eviction::Off => kv::Eviction::Off,
        },
        evict_high_permille: s.evict_high_permille,
        evict_low_permille: s.evict_low_permille,
    }
}

/// The core's settings as WIT's (for `stats`, and for tests).
pub fn settings_out(s: kv::Settings) -> wit::Settings {
    wit::Settings {
        reservation_ttl: s.reservation_ttl,
        world_size: s.world_size,
        read_lease: s.read_lease,
        quarantine: s.quarantine,
        eviction: match s.eviction {
            kv::Eviction::Lru => wit::Eviction::Lru,
            kv::Eviction::Off => wit::Eviction::Off,
        },
        evict_high_permille: s.evict_high_permille,
        evict_low_permille: s.evict_low_permille,
    }
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

/// `packed-allocations` (wit/kvpages.wit): two words a distinct key, the index with bit 31 for
/// a cache hit, then the page or `NO_PAGE`.
pub(crate) fn allocations(a: &[kv::Allocation]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() * 2);
    for a in a {
        out.extend_from_slice(&allocation_words(a));
    }
    out
}

/// One allocation as its two `packed-allocations` words.
pub fn allocation_words(a: &kv::Allocation) -> [u32; 2] {
    [a.index | if a.cached { CACHED } else { 0 }, a.page.unwrap_or(NO_PAGE)]
}

/// The allocation of two `packed-allocations` words ([`allocation_words`]' inverse).
pub fn allocation_of(index: u32, page: u32) -> kv::Allocation {
    kv::Allocation { index: index & !CACHED, page: (page != NO_PAGE).then_some(page), cached: index & CACHED != 0 }
}

/// `packed-allocations`' flag of a cache hit, on word 0. An index is below the batch's length,
/// under 2^31: a packed key takes at least 3 bytes, and a wasm32 memory holds 4 GiB.
const CACHED: u32 = 1 << 31;
/// `packed-allocations`' word 1 when the key got no page (a page is below the pool's size).
const NO_PAGE: u32 = u32::MAX;

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

fn counters(c: &kv::Counters) -> wit::Counters {
    wit::Counters {
        reserved: c.reserved,
        cache_hits: c.cache_hits,
        misses: c.misses,
        committed: c.committed,
        refused_confirms: c.refused_confirms,
        superseded: c.superseded,
        released: c.released,
        ignored_releases: c.ignored_releases,
        expired_reservations: c.expired_reservations,
        dropped_keys: c.dropped_keys,
        evictions: c.evictions,
        deleted: c.deleted,
        quarantined_pages: c.quarantined_pages,
        location_hits: c.location_hits,
        location_misses: c.location_misses,
    }
}

pub(crate) fn stats(s: &kv::Stats) -> wit::EngineStats {
    wit::EngineStats {
        settings: settings_out(s.settings),
        spaces: s
            .spaces
            .iter()
            .map(|sp| wit::SpaceStats {
                space: space_out(&sp.space),
                keys: sp.keys,
                pending_keys: sp.pending_keys,
                world_size: sp.world_size,
                ranks: sp
                    .ranks
                    .iter()
                    .map(|r| wit::RankStats {
                        rank: r.rank,
                        num_pages: r.num_pages,
                        pages: wit::PageCounts {
                            free: r.pages.free,
                            reserved: r.pages.reserved,
                            committed: r.pages.committed,
                            leased: r.pages.leased,
                            quarantined: r.pages.quarantined,
                        },
                    })
                    .collect(),
                counters: counters(&sp.counters),
            })
            .collect(),
    }
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
    let keys = unpack_keys(&p.keys).map_err(|e| match e {
        wit::Error::InvalidInput(m) => wit::Error::InvalidInput(alloc::format!("pools[{index}].{m}")),
        other => other,
    })?;
    if keys.len() != p.pages.len() {
        return Err(wit::Error::InvalidInput(alloc::format!(
            "pools[{index}]: {} keys but {} pages",
            keys.len(),
            p.pages.len()
        )));
    }
    Ok(kv::SglangPool {
        rank: p.rank,
        namespace: p.namespace.into_boxed_str(),
        num_pages: p.num_pages,
        free_pages: p.free_pages,
        keys: keys.into_iter().zip(p.pages).collect(),
    })
}

pub(crate) fn sglang_pool_out(p: &kv::SglangPool) -> wit::SglangPool {
    let mut keys = Vec::new();
    let mut pages = Vec::with_capacity(p.keys.len());
    for (k, page) in &p.keys {
        pack_core_key(&mut keys, k);
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

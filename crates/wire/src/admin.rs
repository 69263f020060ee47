//! The operator's routes that the core answers: `GET /stats` and `GET /admin/keys/{key}`.

use std::string::String;
use std::vec::Vec;

use serde::Serialize;

use super::{Answer, ErrorCode, Failure, HostInfo, Parsed, Shape, apply, unexpected, unexpected_refusal};
use kvpages_core::PageCounts;
use kvpages_core::command::{Command, Counters, Eviction, Reply, Space};
use kvpages_core::error::Error;
use kvpages_core::key::Key;

/// How `/stats` names a space: the family, and for SGLang the rank and namespace.
fn space_name(space: &Space) -> (&'static str, Option<u32>, Option<&str>) {
    match space {
        Space::Vllm => ("vllm", None, None),
        Space::Sglang { rank, namespace } => ("sglang", Some(*rank), Some(namespace)),
    }
}

#[derive(Serialize)]
struct SettingsOut {
    reservation_ttl_seconds: f64,
    read_lease_seconds: f64,
    quarantine_seconds: f64,
    eviction: &'static str,
    evict_high: f64,
    evict_low: f64,
    world_size: Option<u32>,
}

#[derive(Serialize)]
struct RankOut {
    rank: u32,
    num_pages: u32,
    /// `free`, `reserved`, `committed`, `leased`, `quarantined`, in that order.
    #[serde(flatten)]
    pages: PageCounts,
}

#[derive(Serialize)]
struct SpaceOut<'a> {
    space: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<&'a str>,
    keys: u64,
    pending_keys: u64,
    world_size: u32,
    ranks: Vec<RankOut>,
    counters: Counters,
}

#[derive(Serialize)]
struct StatsOut<'a> {
    engine: &'a str,
    /// Wasm plugin traps contained since start-up (each failed one request with 503).
    engine_traps: u64,
    uptime_seconds: f64,
    settings: SettingsOut,
    spaces: Vec<SpaceOut<'a>>,
}

/// `GET /stats`: every space's pages by state per rank, keys, and event counters.
pub(super) fn stats(result: Result<Reply, Error>, host: &HostInfo<'_>) -> Result<Answer, Failure> {
    let stats = match result.map_err(|e| unexpected_refusal(&e))? {
        Reply::Stats(s) => s,
        other => return Err(unexpected(&other)),
    };
    let st = &stats.settings;
    let secs = |ms: u64| ms as f64 / 1000.0;
    Ok(Answer::json(&StatsOut {
        engine: host.engine,
        engine_traps: host.engine_traps,
        uptime_seconds: host.uptime_seconds,
        settings: SettingsOut {
            reservation_ttl_seconds: secs(st.reservation_ttl),
            read_lease_seconds: secs(st.read_lease),
            quarantine_seconds: secs(st.quarantine),
            eviction: match st.eviction {
                Eviction::Lru => "lru",
                Eviction::Off => "off",
            },
            evict_high: f64::from(st.evict_high_permille) / 1000.0,
            evict_low: f64::from(st.evict_low_permille) / 1000.0,
            world_size: st.world_size,
        },
        spaces: stats
            .spaces
            .iter()
            .map(|s| {
                let (space, rank, namespace) = space_name(&s.space);
                SpaceOut {
                    space,
                    rank,
                    namespace,
                    keys: s.keys,
                    pending_keys: s.pending_keys,
                    world_size: s.world_size,
                    ranks: s
                        .ranks
                        .iter()
                        .map(|r| RankOut { rank: r.rank, num_pages: r.num_pages, pages: r.pages })
                        .collect(),
                    counters: s.counters,
                }
            })
            .collect(),
    }))
}

/// Decodes `%XX` escapes of a path segment; `None` if an escape is malformed or the result is
/// not UTF-8.
fn percent_decode(seg: &str) -> Option<String> {
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = seg.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `GET /admin/keys/{key}` (the key percent-encoded) into [`Command::Inspect`].
pub(super) fn parse_inspect(path: &str) -> Result<Parsed, Failure> {
    let raw = path.strip_prefix("/admin/keys/").unwrap_or("");
    let text = percent_decode(raw)
        .ok_or_else(|| Failure::because(ErrorCode::KeyInvalid, "the path is not valid percent-encoded UTF-8"))?;
    let key = Key::parse(&text).map_err(|e| Failure::because(ErrorCode::KeyInvalid, e))?;
    Ok(apply("inspect", Shape::Inspect, Command::Inspect { space: Space::Vllm, key }))
}

#[derive(Serialize)]
struct PageOut {
    rank: u32,
    page: u32,
}

#[derive(Serialize)]
struct KeyOut<'a> {
    key: &'a Key,
    complete: bool,
    pages: Vec<PageOut>,
    reservations: u32,
    lease_remaining_seconds: f64,
    evictable: bool,
}

/// One key's pages per rank and its state; 404 when it is not stored.
pub(super) fn inspect(command: Command, result: Result<Reply, Error>) -> Result<Answer, Failure> {
    let info = match result.map_err(|e| unexpected_refusal(&e))? {
        Reply::Key(Some(info)) => info,
        Reply::Key(None) => {
            let Command::Inspect { key, .. } = &command else { unreachable!("built by parse_inspect") };
            let text = std::string::ToString::to_string(key);
            return Err(Failure::because(ErrorCode::KeyNotFound, format_args!("{text:?}")));
        }
        other => return Err(unexpected(&other)),
    };
    Ok(Answer::json(&KeyOut {
        key: &info.key,
        complete: info.complete,
        pages: info.pages.iter().map(|&(rank, page)| PageOut { rank, page }).collect(),
        reservations: info.reservations,
        lease_remaining_seconds: info.lease_remaining as f64 / 1000.0,
        evictable: info.evictable,
    }))
}

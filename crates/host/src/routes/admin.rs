//! The operator's routes: `GET /health`, `GET /stats`, `GET /admin/keys/{key}`.

use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use kvpages_core::{Command, Counters, Eviction, Key, Reply, Space, Stats};
use serde::Serialize;

use super::{Ctx, KeyText, fault, handle_async, handle_limited, unexpected};
use crate::api::{ApiError, ErrorCode, json_ok};
use crate::server::App;

/// How `/stats` names a space: the family, and for SGLang the rank and namespace.
fn space_name(space: &Space) -> (&'static str, Option<u32>, Option<&str>) {
    match space {
        Space::Vllm => ("vllm", None, None),
        Space::Sglang { rank, namespace } => ("sglang", Some(*rank), Some(namespace)),
    }
}

async fn stats_now(app: &App) -> Result<Box<Stats>, ApiError> {
    let deadline = Instant::now() + app.config.request_timeout;
    match app.apply(&Command::Stats, deadline).await {
        Ok(Reply::Stats(s)) => Ok(s),
        Ok(other) => Err(unexpected(&other)),
        Err(e) => Err(fault(e)),
    }
}

/// `GET /health`: engine, uptime, and the vLLM space's page counts per rank.
pub(crate) async fn health(State(app): State<App>) -> Response {
    #[derive(Serialize)]
    struct RankHealth {
        rank: u32,
        num_pages: u32,
        free: u32,
        reserved: u32,
        committed: u32,
        quarantined: u32,
    }
    #[derive(Serialize)]
    struct Health {
        status: &'static str,
        engine: String,
        uptime_seconds: f64,
        world_size: u32,
        keys: u64,
        ranks: Vec<RankHealth>,
    }
    if !app.is_ready() {
        #[derive(Serialize)]
        struct Recovering {
            status: &'static str,
            detail: &'static str,
            engine: String,
            uptime_seconds: f64,
            recovered_records: u64,
        }
        let body = Recovering {
            status: "recovering",
            detail: ErrorCode::Recovering.template(),
            engine: app.kind.to_string(),
            uptime_seconds: app.started.elapsed().as_secs_f64(),
            recovered_records: app.recovered.load(std::sync::atomic::Ordering::Relaxed),
        };
        let body = serde_json::to_vec(&body).expect("serializes");
        return crate::api::json_bytes(axum::http::StatusCode::SERVICE_UNAVAILABLE, body);
    }
    let stats = match stats_now(&app).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let vllm = stats.spaces.iter().find(|s| s.space == Space::Vllm);
    json_ok(&Health {
        status: "serving",
        engine: app.kind.to_string(),
        uptime_seconds: app.started.elapsed().as_secs_f64(),
        world_size: vllm.map_or(stats.settings.world_size.unwrap_or(0), |s| s.world_size),
        keys: vllm.map_or(0, |s| s.keys),
        ranks: vllm
            .map(|s| {
                s.ranks
                    .iter()
                    .map(|r| RankHealth {
                        rank: r.rank,
                        num_pages: r.num_pages,
                        free: r.pages.free,
                        reserved: r.pages.reserved,
                        committed: r.pages.committed,
                        quarantined: r.pages.quarantined,
                    })
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// `GET /stats`: every space's pages by state per rank, keys, and event counters.
pub(crate) async fn stats(State(app): State<App>) -> Response {
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
        free: u32,
        reserved: u32,
        committed: u32,
        leased: u32,
        quarantined: u32,
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
        engine: String,
        /// Wasm plugin traps contained since start-up (each failed one request with 503).
        engine_traps: u64,
        uptime_seconds: f64,
        settings: SettingsOut,
        spaces: Vec<SpaceOut<'a>>,
    }
    let stats = match stats_now(&app).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let st = &stats.settings;
    let secs = |ms: u64| ms as f64 / 1000.0;
    let engine_traps = app.engine_traps().await;
    json_ok(&StatsOut {
        engine: app.kind.to_string(),
        engine_traps,
        uptime_seconds: app.started.elapsed().as_secs_f64(),
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
            .map(|s| SpaceOut {
                space: space_name(&s.space).0,
                rank: space_name(&s.space).1,
                namespace: space_name(&s.space).2,
                keys: s.keys,
                pending_keys: s.pending_keys,
                world_size: s.world_size,
                ranks: s
                    .ranks
                    .iter()
                    .map(|r| RankOut {
                        rank: r.rank,
                        num_pages: r.num_pages,
                        free: r.pages.free,
                        reserved: r.pages.reserved,
                        committed: r.pages.committed,
                        leased: r.pages.leased,
                        quarantined: r.pages.quarantined,
                    })
                    .collect(),
                counters: s.counters,
            })
            .collect(),
    })
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

/// `GET /admin/keys/{key}`: one key's pages per rank and its state.
pub(crate) async fn inspect(State(app): State<App>, req: Request) -> Response {
    #[derive(Serialize)]
    struct PageOut {
        rank: u32,
        page: u32,
    }
    #[derive(Serialize)]
    struct KeyOut<'a> {
        key: KeyText<'a>,
        complete: bool,
        pages: Vec<PageOut>,
        reservations: u32,
        lease_remaining_seconds: f64,
        evictable: bool,
    }
    handle_async(app, "inspect", req, async |cx: Ctx<'_>| {
        let raw = cx.path.strip_prefix("/admin/keys/").unwrap_or("");
        let text = percent_decode(raw)
            .ok_or_else(|| ApiError::because(ErrorCode::KeyInvalid, "the path is not valid percent-encoded UTF-8"))?;
        let key = Key::parse(&text).map_err(|e| ApiError::because(ErrorCode::KeyInvalid, e))?;
        let info = match cx.apply(&Command::Inspect { space: Space::Vllm, key: key.clone() }).await.map_err(fault)? {
            Reply::Key(Some(info)) => info,
            Reply::Key(None) => return Err(ApiError::because(ErrorCode::KeyNotFound, format_args!("{text:?}"))),
            other => return Err(unexpected(&other)),
        };
        Ok(json_ok(&KeyOut {
            key: KeyText(&info.key),
            complete: info.complete,
            pages: info.pages.iter().map(|&(rank, page)| PageOut { rank, page }).collect(),
            reservations: info.reservations,
            lease_remaining_seconds: info.lease_remaining as f64 / 1000.0,
            evictable: info.evictable,
        }))
    })
    .await
}

/// The largest SGLang persistence file `/admin/import/sglang` takes (10^6 keys are ~50 MB).
pub const IMPORT_MAX_BODY: usize = 1 << 30;

/// `POST /admin/import/sglang[?replace=true]` with SGLang's persistence file as the body: loads
/// it all or nothing.
pub(crate) async fn import_sglang(State(app): State<App>, req: Request) -> Response {
    #[derive(Serialize)]
    struct Imported {
        pools: u32,
        keys: u64,
        leaked_pages: u64,
        seconds: f64,
    }
    let replace = req.uri().query().is_some_and(|q| q.split('&').any(|kv| kv == "replace=true" || kv == "replace=1"));
    handle_limited(app, "import_sglang", req, IMPORT_MAX_BODY, async |cx: Ctx<'_>| {
        let start = Instant::now();
        let pools =
            super::sglang_file::parse(cx.body).map_err(|why| ApiError::because(ErrorCode::ImportInvalid, why))?;
        match cx.apply(&Command::ImportSglang { pools, replace }).await {
            Ok(Reply::Imported { pools, keys, leaked_pages }) => {
                let seconds = start.elapsed().as_secs_f64();
                tracing::info!(pools, keys, leaked_pages, seconds, "imported SGLang's persistence file");
                Ok(json_ok(&Imported { pools, keys, leaked_pages, seconds }))
            }
            Ok(other) => Err(unexpected(&other)),
            Err(crate::engine::EngineError::Domain(kvpages_core::Error::ImportRefused { reason })) => {
                Err(ApiError::because(ErrorCode::ImportInvalid, reason))
            }
            Err(crate::engine::EngineError::Domain(kvpages_core::Error::SglangPoolsExist { pools })) => {
                Err(ApiError::filled_because(
                    ErrorCode::ImportConflict,
                    &[("pools", &pools)],
                    "add ?replace=true to drop them",
                ))
            }
            Err(e) => Err(fault(e)),
        }
    })
    .await
}

/// `GET /admin/export/sglang`: every SGLang pool as SGLang's server persists it (for rollback).
pub(crate) async fn export_sglang(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "export_sglang", req, async |cx: Ctx<'_>| match cx.apply(&Command::ExportSglang).await {
        Ok(Reply::SglangPools(pools)) => {
            Ok(crate::api::json_bytes(axum::http::StatusCode::OK, super::sglang_file::render(&pools)))
        }
        Ok(other) => Err(unexpected(&other)),
        Err(e) => Err(fault(e)),
    })
    .await
}

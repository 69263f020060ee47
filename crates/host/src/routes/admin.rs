//! The operator's routes: `GET /health`, `GET /stats`, `GET /metrics`, SGLang's file import and
//! export.
//! (`GET /admin/keys/{key}` is a wire route, see `routes::serve`.)

use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use kvpages_core::{Command, Reply, Space, Stats};
use kvpages_wire::{self as wire, HostInfo, Parsed};
use serde::Serialize;

use super::{Ctx, fault, handle_async, handle_limited, unexpected};
use crate::api::{ApiError, ErrorCode, answer_response, json_ok};
use crate::app::App;
use crate::engine::EngineError;

async fn stats_now(app: &App) -> Result<Box<Stats>, ApiError> {
    let deadline = Instant::now() + app.config.request_timeout;
    match app.apply(&Command::Stats, deadline).await {
        Ok(Reply::Stats(s)) => Ok(s),
        Ok(other) => Err(unexpected(&other)),
        Err(e) => Err(fault(e)),
    }
}

/// `GET /metrics`. The core's figures come from the engine (within `--request-timeout`); while
/// it cannot answer (recovering, busy) the process figures are still served, with
/// `kvpages_engine_up 0`, so a scrape never fails for the engine's sake.
pub(crate) async fn metrics(State(app): State<App>) -> Response {
    let deadline = Instant::now() + app.config.request_timeout;
    let stats = match app.apply(&Command::Stats, deadline).await {
        Ok(Reply::Stats(s)) => Some(s),
        Ok(other) => {
            tracing::error!("/metrics: unexpected reply {other:?}");
            None
        }
        Err(e) => {
            tracing::debug!("/metrics: the engine did not answer: {e:?}");
            None
        }
    };
    let traps = tokio::time::timeout_at(deadline.into(), app.engine_traps()).await.ok();
    let body = crate::telemetry::render(stats.as_deref(), traps, &app.kind.to_string(), app.started.elapsed());
    let mut resp = (axum::http::StatusCode::OK, body).into_response();
    resp.headers_mut()
        .insert(axum::http::header::CONTENT_TYPE, axum::http::HeaderValue::from_static(crate::telemetry::CONTENT_TYPE));
    resp
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
    /// `/health` while the server cannot serve: 503 with the status and why.
    #[derive(Serialize)]
    struct Unavailable {
        status: &'static str,
        detail: String,
        engine: String,
        uptime_seconds: f64,
        #[serde(skip_serializing_if = "Option::is_none")]
        recovered_records: Option<u64>,
    }
    let unavailable = |status, detail, recovered_records| {
        let body = Unavailable {
            status,
            detail,
            engine: app.kind.to_string(),
            uptime_seconds: app.started.elapsed().as_secs_f64(),
            recovered_records,
        };
        let body = serde_json::to_vec(&body).expect("serializes");
        crate::api::json_bytes(axum::http::StatusCode::SERVICE_UNAVAILABLE, body)
    };
    if !app.is_ready() {
        let recovered = app.recovered.load(std::sync::atomic::Ordering::Relaxed);
        return unavailable("recovering", ErrorCode::Recovering.template().to_owned(), Some(recovered));
    }
    if let Some(why) = app.storage_fault() {
        let detail = ApiError::because(ErrorCode::StorageUnavailable, why).detail;
        return unavailable(ErrorCode::StorageUnavailable.name(), detail, None);
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

/// `GET /stats`: every space's pages by state per rank, keys, and event counters (encoded by
/// `kvpages_wire`, with the engine, its traps and the uptime added). The body is not read.
pub(crate) async fn stats(State(app): State<App>, route: &'static wire::Route) -> Response {
    let Parsed::Apply(pending) = route.parse("/stats", b"") else { unreachable!("/stats parses into a command") };
    let deadline = Instant::now() + app.config.request_timeout;
    let result = match app.apply(pending.command(), deadline).await {
        Ok(reply) => Ok(reply),
        Err(EngineError::Domain(e)) => Err(e),
        Err(e) => return fault(e).into_response(),
    };
    let engine = app.kind.to_string();
    let host = HostInfo {
        engine: &engine,
        engine_traps: app.engine_traps().await,
        uptime_seconds: app.started.elapsed().as_secs_f64(),
    };
    answer_response(pending.answer_with(result, &host))
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
            crate::sglang_file::parse(cx.body).map_err(|why| ApiError::because(ErrorCode::ImportInvalid, why))?;
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
            Ok(crate::api::json_bytes(axum::http::StatusCode::OK, crate::sglang_file::render(&pools)))
        }
        Ok(other) => Err(unexpected(&other)),
        Err(e) => Err(fault(e)),
    })
    .await
}

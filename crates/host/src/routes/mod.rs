//! Route families. Each turns wire requests into core commands and replies back into its wire
//! format; the shared plumbing (reading the body, logging rejections) lives here.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use kvpages_core::{Command, Key, Refusal, Refused, Reply};
use serde::Serialize;

use crate::api::{ApiError, ErrorCode};
use crate::engine::EngineError;
use crate::server::App;

pub(crate) mod admin;
pub(crate) mod sglang;
pub(crate) mod sglang_file;
pub(crate) mod vllm;

/// How many bytes of a rejected body the warning shows.
const PREVIEW_BYTES: usize = 200;

/// What a route's handler gets: the request's path and body, and the engine through the
/// request's deadline.
pub(crate) struct Ctx<'a> {
    pub(crate) app: &'a App,
    pub(crate) path: &'a str,
    pub(crate) body: &'a [u8],
    deadline: Instant,
}

impl Ctx<'_> {
    /// Applies `cmd`, waiting for the engine no later than the request's deadline.
    pub(crate) async fn apply(&self, cmd: &Command) -> Result<Reply, EngineError> {
        self.app.apply(cmd, self.deadline).await
    }
}

/// Reads the body (bounded by `--max-body` and by the request's deadline) and runs `f` on it;
/// every error answer is logged with a body preview.
pub(crate) async fn handle_async(
    app: App,
    route: &'static str,
    req: Request,
    f: impl AsyncFnOnce(Ctx<'_>) -> Result<Response, ApiError>,
) -> Response {
    let limit = app.config.max_body;
    handle_limited(app, route, req, limit, f).await
}

/// [`handle_async`] with another body limit (an import's file is larger than any request).
pub(crate) async fn handle_limited(
    app: App,
    route: &'static str,
    req: Request,
    limit: usize,
    f: impl AsyncFnOnce(Ctx<'_>) -> Result<Response, ApiError>,
) -> Response {
    let deadline = Instant::now() + app.config.request_timeout;
    let path = req.uri().path().to_owned();
    let body = match app.body(req, limit, deadline).await {
        Ok(b) => b,
        Err(e) => return rejected(route, &Bytes::new(), e),
    };
    match f(Ctx { app: &app, path: &path, body: &body, deadline }).await {
        Ok(resp) => resp,
        Err(e) => rejected(route, &body, e),
    }
}

/// [`handle_async`] for handlers that do not touch the engine.
pub(crate) async fn handle(
    app: App,
    route: &'static str,
    req: Request,
    f: impl FnOnce(&App, &str, &[u8]) -> Result<Response, ApiError>,
) -> Response {
    handle_async(app, route, req, async move |cx: Ctx<'_>| f(cx.app, cx.path, cx.body)).await
}

fn rejected(route: &str, body: &[u8], e: ApiError) -> Response {
    let cut = body.len().min(PREVIEW_BYTES);
    let preview = String::from_utf8_lossy(&body[..cut]);
    let more = if body.len() > cut { "…" } else { "" };
    if e.code.status().is_server_error() {
        tracing::error!(route, status = e.code.status().as_u16(), detail = %e.detail, body = %format_args!("{preview}{more}"), "request failed");
    } else {
        tracing::warn!(route, status = e.code.status().as_u16(), detail = %e.detail, body = %format_args!("{preview}{more}"), "request rejected");
    }
    e.into_response()
}

/// An engine fault or a busy engine: 503, never the client's fault.
pub(crate) fn fault(e: EngineError) -> ApiError {
    match e {
        EngineError::Fault(why) => ApiError::because(ErrorCode::EngineFault, why),
        EngineError::Recovering => {
            ApiError::because(ErrorCode::Recovering, "the state is being recovered from the data directory")
        }
        EngineError::Storage(why) => ApiError::because(ErrorCode::StorageFault, why),
        EngineError::Trapped { cause, restored: true } => ApiError::because(
            ErrorCode::PluginTrapped,
            format_args!("{cause}; the engine was rebuilt with the state from before this request"),
        ),
        EngineError::Trapped { cause, restored: false } => ApiError::because(
            ErrorCode::PluginTrapped,
            format_args!("{cause}; the engine could not be rebuilt yet, the next request retries"),
        ),
        EngineError::Busy(limit) => ApiError::filled_because(
            ErrorCode::Timeout,
            &[("seconds", &limit.as_secs_f64())],
            "the engine was not free in time",
        ),
        EngineError::Domain(e) => ApiError::because(ErrorCode::EngineFault, format_args!("unexpected refusal: {e}")),
    }
}

/// The engine answered a command with the wrong kind of reply.
pub(crate) fn unexpected(reply: &Reply) -> ApiError {
    ApiError::because(ErrorCode::EngineFault, format_args!("unexpected reply {reply:?}"))
}

/// A key serialized as the exact text the client sent.
pub(crate) struct KeyText<'a>(pub(crate) &'a Key);

impl Serialize for KeyText<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self.0)
    }
}

/// 409: every confirmation of a request was refused; `field` is the request's member name.
pub(crate) fn nothing_confirmed(refused: &[Refused], field: &str, confirmations: &[(Key, u32)]) -> ApiError {
    const SHOWN: usize = 16;
    let mut parts: Vec<String> = refused
        .iter()
        .take(SHOWN)
        .map(|r| {
            let key = confirmations.get(r.index as usize).map(|c| c.0.to_string()).unwrap_or_default();
            let why = match r.reason {
                Refusal::NotReserved => "page is not reserved (never allocated, released, or expired)",
                Refusal::ReservedForAnotherKey => "page is reserved for another key",
                Refusal::CommittedToAnotherKey => "page holds another key",
            };
            format!("{field}[{}] [{key:?}, {}]: {why}", r.index, r.page)
        })
        .collect();
    if refused.len() > SHOWN {
        parts.push(format!("and {} more", refused.len() - SHOWN));
    }
    ApiError::because(ErrorCode::NothingConfirmed, parts.join("; "))
}

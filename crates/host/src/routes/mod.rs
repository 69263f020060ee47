//! The routes. vLLM's and SGLang's data routes, `/stats` and `/admin/keys/{key}` go through
//! `kvpages_wire` ([`serve`]): the request becomes a command, the engine applies it, the
//! wire module encodes the answer. The host adds what is its own: the body limits and deadline,
//! engine faults (503), log lines. The shared plumbing (reading the body, logging rejections)
//! lives here.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use kvpages_core::{Command, Reply};
use kvpages_wire::{self as wire, Answer, Parsed};

use crate::api::{ApiError, ErrorCode, answer_response, status_of};
use crate::app::App;
use crate::engine::EngineError;

pub(crate) mod admin;
pub(crate) mod simulator;
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

/// A `POST` route added from outside the server ([`crate::server::build_with`]; the load
/// generator's floor): its body is read like every route's (`--max-body`, the request's
/// deadline, the same log lines), then `answer` gets the query string and the body.
pub struct ExtraRoute {
    pub(crate) path: &'static str,
    pub(crate) method: MethodRouter<App>,
}

impl ExtraRoute {
    /// `POST path`, `name` naming it in logs.
    pub fn post<F>(path: &'static str, name: &'static str, answer: F) -> ExtraRoute
    where
        F: Fn(Option<&str>, &[u8]) -> Response + Clone + Send + Sync + 'static,
    {
        let method = post(move |State(app): State<App>, req: Request| {
            let query = req.uri().query().map(str::to_owned);
            handle(app, name, req, move |_, _, body| Ok(answer(query.as_deref(), body)))
        });
        ExtraRoute { path, method }
    }
}

/// A `POST` route of the wire crate, answered by [`serve`].
pub(crate) fn post_route(route: &'static wire::Route) -> MethodRouter<App> {
    post(move |State(app): State<App>, req: Request| serve(app, route, req))
}

/// A `GET` route of the wire crate, answered by [`serve`].
pub(crate) fn get_route(route: &'static wire::Route) -> MethodRouter<App> {
    get(move |State(app): State<App>, req: Request| serve(app, route, req))
}

/// A route of `kvpages_wire`: reads the body (bounded by `--max-body` and the request's
/// deadline), parses it into a command, applies it, answers. Engine faults are the host's 503s;
/// every error answer is logged with a body preview.
pub(crate) async fn serve(app: App, route: &'static wire::Route, req: Request) -> Response {
    let deadline = Instant::now() + app.config.request_timeout;
    let path = req.uri().path().to_owned();
    let name = route.name;
    let body = match app.body(req, app.config.max_body, deadline).await {
        Ok(b) => b,
        Err(e) => return rejected(name, &Bytes::new(), e),
    };
    let answer = match route.parse(&path, &body) {
        Parsed::Answer(answer) => answer,
        Parsed::Apply(pending) => match app.apply(pending.command(), deadline).await {
            Ok(reply) => {
                vllm::log_applied(pending.command(), &reply);
                pending.answer(Ok(reply))
            }
            Err(EngineError::Domain(e)) => pending.answer(Err(e)),
            Err(e) => return rejected(name, &body, fault(e)),
        },
    };
    answered(name, &body, answer)
}

/// Sends a wire answer, logging it like [`rejected`] when it is an error.
fn answered(route: &str, body: &[u8], answer: Answer) -> Response {
    if let Some(code) = answer.code {
        log_rejected(route, body, code, &answer.detail().unwrap_or_default());
    }
    answer_response(answer)
}

fn rejected(route: &str, body: &[u8], e: ApiError) -> Response {
    log_rejected(route, body, e.code, &e.detail);
    e.into_response()
}

fn log_rejected(route: &str, body: &[u8], code: ErrorCode, detail: &str) {
    let cut = body.len().min(PREVIEW_BYTES);
    let preview = String::from_utf8_lossy(&body[..cut]);
    let more = if body.len() > cut { "…" } else { "" };
    let status = status_of(code);
    if status.is_server_error() {
        tracing::error!(route, status = status.as_u16(), detail = %detail, body = %format_args!("{preview}{more}"), "request failed");
    } else {
        tracing::warn!(route, status = status.as_u16(), detail = %detail, body = %format_args!("{preview}{more}"), "request rejected");
    }
}

/// An engine fault or a busy engine: 503, never the client's fault.
pub(crate) fn fault(e: EngineError) -> ApiError {
    match e {
        EngineError::Fault(why) => ApiError::because(ErrorCode::EngineFault, why),
        EngineError::Recovering => {
            ApiError::because(ErrorCode::Recovering, "the state is being recovered from the data directory")
        }
        EngineError::Storage(why) => ApiError::because(ErrorCode::StorageFault, why),
        EngineError::StorageDown(why) => ApiError::because(ErrorCode::StorageUnavailable, why),
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

//! kvpages-wire: the HTTP API of kvpages as data: a request's method, path and body in, a [`Command`]
//! for the core, and the exact status and bytes of the answer out.
//!
//! The server (`kvpages-host`) and the browser simulator both go through here, so they accept
//! exactly the same requests, by the same rules, with the same answers. The state machine itself
//! never sees JSON: [`parse`] builds a typed [`Command`], the caller applies it (through an
//! engine, under a lock, with a log), and [`Pending::answer`] encodes the [`Reply`] or [`Error`].
//!
//! ```
//! use kvpages_core::{Core, Settings};
//! use kvpages_wire as wire;
//!
//! let mut core = Core::new(7, Settings::default());
//! let wire::Parsed::Apply(p) = wire::parse("POST", "/rank/0/initialize", br#"{"num_pages": 8}"#) else {
//!     unreachable!("a valid request");
//! };
//! let result = core.apply(0, p.command());
//! let answer = p.answer(result);
//! assert_eq!((answer.status, &answer.body[..]), (200, &br#"{"message":"Rank 0 initialized with 8 pages"}"#[..]));
//! ```
//!
//! What stays the host's: body limits and timeouts, access control, engine faults (busy,
//! recovering, storage, plugin traps — their codes are in the one catalogue, [`ErrorCode`]),
//! metrics, logging, and the server's own routes (`/health`, `/metrics`, SGLang's persistence
//! file, the simulator's files).
//!
//! # Layout
//! - [`json`]: strict JSON decoding (no duplicate members, u32 integers, exact pairs); `fast`:
//!   a one-pass reader of the clients' usual bodies that defers to [`json`] whenever unsure.
//! - `errors`: [`ErrorCode`], the catalogue (status + `detail` template), and [`Failure`].
//! - `vllm`: vLLM's seven routes; `sglang`: SGLang's `POST /{rank}/{op}`; `admin`: `/stats`
//!   and `/admin/keys/{key}`.

use std::format;
use std::string::{String, ToString};
use std::vec::Vec;

use serde::Serialize;

use kvpages_core::command::{Command, Refusal, Refused, Reply};
use kvpages_core::error::Error;
use kvpages_core::key::Key;

mod admin;
mod errors;
mod fast;
pub mod json;
mod sglang;
mod vllm;

pub use errors::{ErrorCode, Failure};
pub use sglang::{MAX_NAMESPACE_LEN, SGLANG_OPS};

/// A complete answer: status, body and, for an error, its code.
///
/// The body is JSON (`application/json`), or empty for a 204.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The exact bytes to send.
    pub body: Vec<u8>,
    /// Which error, when it is one (`{"detail": ...}`).
    pub code: Option<ErrorCode>,
}

impl Answer {
    /// `value` as a compact JSON body with status 200.
    fn json<T: Serialize>(value: &T) -> Answer {
        match serde_json::to_vec(value) {
            Ok(body) => Answer { status: 200, body, code: None },
            Err(e) => {
                Failure::because(ErrorCode::EngineFault, format_args!("reply could not be encoded: {e}")).answer()
            }
        }
    }

    /// 200 with these JSON bytes.
    fn ok(body: Vec<u8>) -> Answer {
        Answer { status: 200, body, code: None }
    }

    /// 204 with an empty body.
    fn no_content() -> Answer {
        Answer { status: 204, body: Vec::new(), code: None }
    }

    /// An error answer's `detail` text (decoded from the body; for logs and tests).
    pub fn detail(&self) -> Option<String> {
        #[derive(serde::Deserialize)]
        struct Body {
            detail: String,
        }
        self.code?;
        serde_json::from_slice::<Body>(&self.body).ok().map(|b| b.detail)
    }
}

/// What [`parse`] made of a request.
#[derive(Debug)]
pub enum Parsed {
    /// Answered without the engine: a malformed request (400), no such route (404), another
    /// method (405), or a vLLM scheduler's initialize (200).
    Answer(Answer),
    /// A command to apply; [`Pending::answer`] turns its result into the answer.
    Apply(Pending),
}

/// A parsed request waiting for the core's result.
#[derive(Debug)]
pub struct Pending {
    route: &'static str,
    shape: Shape,
    command: Command,
}

/// How the result of a pending command is encoded: the route family's JSON.
#[derive(Clone, Copy, Debug)]
enum Shape {
    Vllm(vllm::Route),
    Sglang(sglang::Op),
    Stats,
    Inspect,
}

/// Facts only the host knows, shown by `/stats`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostInfo<'a> {
    /// Which engine runs the core (`wasm`, `native`, ...).
    pub engine: &'a str,
    /// Engine faults contained since start-up (wasm plugin traps).
    pub engine_traps: u64,
    /// Seconds since start-up.
    pub uptime_seconds: f64,
}

impl Default for HostInfo<'_> {
    /// The core applied directly: engine `core`, no traps, no uptime.
    fn default() -> Self {
        HostInfo { engine: "core", engine_traps: 0, uptime_seconds: 0.0 }
    }
}

impl Pending {
    /// The command to apply.
    pub fn command(&self) -> &Command {
        &self.command
    }

    /// The route's name, as the host's logs use it: `initialize`, `batch_allocate`,
    /// `confirm_write`, `batch_exists`, `get_locations`, `clear`, `delete`, `sglang`, `stats`,
    /// `inspect`.
    pub fn route(&self) -> &'static str {
        self.route
    }

    /// The answer to the command's result: the reply in the route family's JSON, or a refusal
    /// as its status and `{"detail": ...}`. `/stats` shows [`HostInfo::default`].
    pub fn answer(self, result: Result<Reply, Error>) -> Answer {
        self.answer_with(result, &HostInfo::default())
    }

    /// [`Pending::answer`] with the host's facts for `/stats`.
    pub fn answer_with(self, result: Result<Reply, Error>, host: &HostInfo<'_>) -> Answer {
        let answered = match self.shape {
            Shape::Vllm(route) => vllm::answer(route, self.command, result),
            Shape::Sglang(op) => sglang::answer(op, self.command, result),
            Shape::Stats => admin::stats(result, host),
            Shape::Inspect => admin::inspect(self.command, result),
        };
        answered.unwrap_or_else(Failure::answer)
    }
}

/// What a route parses its requests into.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Vllm(vllm::Route),
    Sglang,
    Stats,
    Inspect,
}

/// A route of the HTTP API: its method and path template as the server's router writes them, and
/// its name in logs. The server registers every one of [`ROUTES`] and hands the requests it
/// matched to [`Route::parse`], so a request is routed once; the browser simulator, which has no
/// router, finds the route with [`Route::find`].
#[derive(Clone, Copy, Debug)]
pub struct Route {
    /// `GET` or `POST` (a `GET` route also answers `HEAD`).
    pub method: &'static str,
    /// The path template: `{name}` is one segment.
    pub path: &'static str,
    /// The route's name, as the host's logs and [`Pending::route`] give it.
    pub name: &'static str,
    kind: Kind,
}

/// Every route of the HTTP API: vLLM's, SGLang's `/{rank}/{op}`, `/stats` and key inspection.
/// The server's own routes (`/health`, `/metrics`, SGLang's file import and export, the
/// simulator's files) are the host's, not here.
pub const ROUTES: &[Route] = {
    use vllm::Route as V;
    const fn route(method: &'static str, path: &'static str, name: &'static str, kind: Kind) -> Route {
        Route { method, path, name, kind }
    }
    &[
        route("POST", "/rank/{rank}/initialize", "initialize", Kind::Vllm(V::Initialize)),
        route("POST", "/keys/batch_allocate", "batch_allocate", Kind::Vllm(V::Allocate)),
        route("POST", "/keys/confirm_write", "confirm_write", Kind::Vllm(V::Confirm)),
        route("POST", "/keys/batch_exists", "batch_exists", Kind::Vllm(V::Exists)),
        route("POST", "/keys/get_locations", "get_locations", Kind::Vllm(V::Locations)),
        route("POST", "/clear", "clear", Kind::Vllm(V::Clear)),
        route("POST", "/keys/delete", "delete", Kind::Vllm(V::Delete)),
        route("GET", "/stats", "stats", Kind::Stats),
        route("GET", "/admin/keys/{key}", "inspect", Kind::Inspect),
        route("POST", "/{rank}/{op}", "sglang", Kind::Sglang),
    ]
};

impl Route {
    /// Turns a request for this route into a command to apply, or answers it. `path` is the
    /// request target's path without the query string, as sent (percent escapes are not
    /// decoded); the method is the router's business.
    pub fn parse(&self, path: &str, body: &[u8]) -> Parsed {
        let parsed = match self.kind {
            Kind::Vllm(r) => vllm::parse(r, path, body),
            Kind::Sglang => sglang::parse(path, body),
            Kind::Stats => Ok(apply("stats", Shape::Stats, Command::Stats)),
            Kind::Inspect => admin::parse_inspect(path),
        };
        parsed.unwrap_or_else(|f| Parsed::Answer(f.answer()))
    }

    /// The route of [`ROUTES`] that `path` names, matched as the server's router matches.
    pub fn find(path: &str) -> Option<&'static Route> {
        best_match(ROUTES.iter().map(|r| (r.path, r)), path)
    }
}

/// How specifically `template` matches `path`, as axum's router matches: each `{name}` one
/// segment (empty only when it is not the last: `/rank//initialize` is a bad rank, `/0/` no
/// route), a trailing `{*name}` one or more segments, every other segment exactly; `None` when
/// it does not match, else its count of exact segments (a static path wins over a parameter).
pub fn matches(template: &str, path: &str) -> Option<usize> {
    let want = template.strip_prefix('/')?.split('/');
    let mut got = path.strip_prefix('/')?.split('/').peekable();
    let mut exact = 0;
    for w in want {
        if w.starts_with("{*") {
            return got.peek().is_some_and(|g| !g.is_empty()).then_some(exact);
        }
        let g = got.next()?;
        if w.starts_with('{') {
            if g.is_empty() && got.peek().is_none() {
                return None;
            }
        } else if w == g {
            exact += 1;
        } else {
            return None;
        }
    }
    got.next().is_none().then_some(exact)
}

/// The item of `routes` (template, item) whose template matches `path` most specifically.
pub fn best_match<T>(routes: impl Iterator<Item = (&'static str, T)>, path: &str) -> Option<T> {
    routes
        .filter_map(|(template, item)| matches(template, path).map(|n| (n, item)))
        .max_by_key(|(n, _)| *n)
        .map(|(_, item)| item)
}

/// Turns a request into a command to apply, or answers it, matching its route first (what the
/// browser simulator does; the server's router matches and calls [`Route::parse`]). `path` is
/// the request target's path without the query string, as sent.
pub fn parse(method: &str, path: &str, body: &[u8]) -> Parsed {
    let Some(route) = Route::find(path) else { return Parsed::Answer(not_found(method, path)) };
    if method != route.method && !(route.method == "GET" && method == "HEAD") {
        return Parsed::Answer(method_not_allowed(method, path, route.method));
    }
    route.parse(path, body)
}

fn apply(route: &'static str, shape: Shape, command: Command) -> Parsed {
    Parsed::Apply(Pending { route, shape, command })
}

/// 404 for a path no route has.
pub fn not_found(method: &str, path: &str) -> Answer {
    Failure::because(ErrorCode::RouteNotFound, format_args!("no route {method} {path}")).answer()
}

/// 405 for a path whose route takes `allowed`, not `method` (the host adds `Allow: allowed`).
pub fn method_not_allowed(method: &str, path: &str, allowed: &str) -> Answer {
    Failure::because(ErrorCode::MethodNotAllowed, format_args!("{path} accepts {allowed}, not {method}")).answer()
}

/// The engine answered a command with the wrong kind of reply.
fn unexpected(reply: &Reply) -> Failure {
    Failure::because(ErrorCode::EngineFault, format_args!("unexpected reply {reply:?}"))
}

/// The core refused a command the route never expects a refusal of.
fn unexpected_refusal(e: &Error) -> Failure {
    Failure::because(ErrorCode::EngineFault, format_args!("unexpected refusal: {e}"))
}

/// 409: every confirmation of a request was refused; `field` is the request's member name.
fn nothing_confirmed(refused: &[Refused], field: &str, confirmations: &[(Key, u32)]) -> Failure {
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
    Failure::because(ErrorCode::NothingConfirmed, parts.join("; "))
}

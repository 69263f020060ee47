//! The error catalogue: every error kvpages answers, with its status and `detail` template.
//!
//! Each [`ErrorCode`] has one status and one `detail` template; `docs/errors.md` documents every
//! code and a test checks that the page lists all of [`ErrorCode::ALL`], so it cannot drift. The
//! host's own errors (body limits, access control, engine faults) are in the same catalogue:
//! one list, whoever answers.

use core::fmt::{self, Display};
use std::format;
use std::string::{String, ToString};

use super::Answer;

/// Every kind of error the server can answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// `/rank/{rank}/initialize` with a malformed body, a bad path rank, or no pages.
    InitializeInvalid,
    /// `batch_allocate` / `get_locations` with a malformed body.
    KeysRequestInvalid,
    /// `confirm_write` with a malformed body or a page beyond the pool.
    ConfirmRequestInvalid,
    /// `batch_exists` with a malformed body.
    ExistsRequestInvalid,
    /// A route named a rank that has no pool.
    RankNotInitialized,
    /// `--world-size N` is set and the rank is `>= N`.
    RankOutsideWorld,
    /// A confirm whose every confirmation was refused.
    NothingConfirmed,
    /// `/keys/delete` with a malformed body.
    DeleteRequestInvalid,
    /// An SGLang route (`/{rank}/{op}`) with a malformed body.
    SglangRequestInvalid,
    /// An SGLang route for a `rank:namespace` nobody initialized.
    SglangRankNotInitialized,
    /// `/admin/keys/{key}` with a key that is not valid.
    KeyInvalid,
    /// An SGLang persistence file that is malformed or inconsistent.
    ImportInvalid,
    /// An SGLang import while SGLang pools exist, without `replace`.
    ImportConflict,
    /// `/admin/keys/{key}` for a key that is not stored.
    KeyNotFound,
    /// The body could not be read (broken chunked encoding, connection cut).
    BodyUnreadable,
    /// The body did not arrive within `--request-timeout`.
    BodyTimeout,
    /// No such route.
    RouteNotFound,
    /// The route exists for another method.
    MethodNotAllowed,
    /// The body is over `--max-body`.
    BodyTooLarge,
    /// The engine was not free within `--request-timeout`.
    Timeout,
    /// The engine failed (a fault of the server, never of the request).
    EngineFault,
    /// The server is recovering its state.
    Recovering,
    /// The log could not be made durable.
    StorageFault,
    /// The log cannot be written (full disk, I/O error); nothing was applied.
    StorageUnavailable,
    /// The wasm plugin trapped on this request (deadline, memory cap, abort); it was not applied.
    PluginTrapped,
    /// `--allow` is set and the client's address is in none of its blocks.
    AccessDenied,
    /// `--admin-token` is set and a guarded route came without it (or with another one).
    AdminTokenRequired,
    /// `kvpages forward` could not reach the server.
    UpstreamUnavailable,
}

impl ErrorCode {
    /// All codes, for the docs check.
    pub const ALL: [ErrorCode; 28] = [
        ErrorCode::InitializeInvalid,
        ErrorCode::KeysRequestInvalid,
        ErrorCode::ConfirmRequestInvalid,
        ErrorCode::ExistsRequestInvalid,
        ErrorCode::RankNotInitialized,
        ErrorCode::RankOutsideWorld,
        ErrorCode::NothingConfirmed,
        ErrorCode::DeleteRequestInvalid,
        ErrorCode::SglangRequestInvalid,
        ErrorCode::SglangRankNotInitialized,
        ErrorCode::KeyInvalid,
        ErrorCode::ImportInvalid,
        ErrorCode::ImportConflict,
        ErrorCode::KeyNotFound,
        ErrorCode::RouteNotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::BodyTooLarge,
        ErrorCode::BodyUnreadable,
        ErrorCode::BodyTimeout,
        ErrorCode::Timeout,
        ErrorCode::EngineFault,
        ErrorCode::Recovering,
        ErrorCode::StorageFault,
        ErrorCode::StorageUnavailable,
        ErrorCode::PluginTrapped,
        ErrorCode::AccessDenied,
        ErrorCode::AdminTokenRequired,
        ErrorCode::UpstreamUnavailable,
    ];

    /// The HTTP status.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InitializeInvalid
            | ErrorCode::KeysRequestInvalid
            | ErrorCode::ConfirmRequestInvalid
            | ErrorCode::ExistsRequestInvalid
            | ErrorCode::DeleteRequestInvalid
            | ErrorCode::SglangRequestInvalid
            | ErrorCode::KeyInvalid
            | ErrorCode::ImportInvalid
            | ErrorCode::BodyUnreadable => 400,
            ErrorCode::RankNotInitialized
            | ErrorCode::SglangRankNotInitialized
            | ErrorCode::RouteNotFound
            | ErrorCode::KeyNotFound => 404,
            ErrorCode::BodyTimeout => 408,
            ErrorCode::RankOutsideWorld | ErrorCode::NothingConfirmed | ErrorCode::ImportConflict => 409,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::BodyTooLarge => 413,
            ErrorCode::Timeout
            | ErrorCode::EngineFault
            | ErrorCode::Recovering
            | ErrorCode::StorageFault
            | ErrorCode::StorageUnavailable
            | ErrorCode::PluginTrapped => 503,
            ErrorCode::AccessDenied => 403,
            ErrorCode::AdminTokenRequired => 401,
            ErrorCode::UpstreamUnavailable => 502,
        }
    }

    /// The fixed start of `detail`: the peer's own text where it has one, so clients that match
    /// on it keep working. `{rank}`, `{n}`, `{limit}`, `{seconds}` stand for numbers.
    pub fn template(self) -> &'static str {
        match self {
            ErrorCode::InitializeInvalid => "Invalid initialization parameters",
            ErrorCode::KeysRequestInvalid => "Invalid request format: need 'rank' and 'keys'",
            ErrorCode::ConfirmRequestInvalid => "Invalid request format: need 'rank' and 'confirmations'",
            ErrorCode::ExistsRequestInvalid => "Invalid keys format",
            ErrorCode::RankNotInitialized => "Rank {rank} not initialized",
            ErrorCode::RankOutsideWorld => "Rank {rank} is outside the TP world of {n} ranks (--world-size)",
            ErrorCode::NothingConfirmed => "No confirmation matched a reservation; nothing was applied",
            ErrorCode::DeleteRequestInvalid => "Invalid delete request: need 'keys'",
            ErrorCode::SglangRequestInvalid => "Invalid {op} request",
            ErrorCode::SglangRankNotInitialized => {
                "Rank {rank} namespace '{namespace}' not initialized. Please call /{rank}/initialize first."
            }
            ErrorCode::KeyInvalid => "Invalid key",
            ErrorCode::ImportInvalid => "Invalid SGLang persistence file; nothing was imported",
            ErrorCode::ImportConflict => "kvpages already holds {pools} SGLang pools; nothing was imported",
            ErrorCode::KeyNotFound => "Key not stored",
            ErrorCode::BodyUnreadable => "Request body could not be read",
            ErrorCode::BodyTimeout => "Request body not received within {seconds} s (--request-timeout)",
            ErrorCode::RouteNotFound => "Not Found",
            ErrorCode::MethodNotAllowed => "Method Not Allowed",
            ErrorCode::BodyTooLarge => "Request body too large: the limit is {limit} bytes (--max-body)",
            ErrorCode::Timeout => "Request timed out after {seconds} s (--request-timeout)",
            ErrorCode::EngineFault => "Engine unavailable",
            ErrorCode::Recovering => "Recovering: not serving yet",
            ErrorCode::StorageFault => "Storage error: the request applied but is not durable",
            ErrorCode::StorageUnavailable => {
                "Storage unavailable: the data directory cannot be written; nothing was applied"
            }
            ErrorCode::PluginTrapped => "Engine plugin trapped; the request was not applied",
            ErrorCode::AccessDenied => "Forbidden: client address not allowed (--allow)",
            ErrorCode::AdminTokenRequired => "Unauthorized: this route needs the admin token (--admin-token)",
            ErrorCode::UpstreamUnavailable => "kvpages forward: the metadata server is unreachable",
        }
    }

    /// The name used as the heading in `docs/errors.md`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::InitializeInvalid => "initialize-invalid",
            ErrorCode::KeysRequestInvalid => "keys-request-invalid",
            ErrorCode::ConfirmRequestInvalid => "confirm-request-invalid",
            ErrorCode::ExistsRequestInvalid => "exists-request-invalid",
            ErrorCode::RankNotInitialized => "rank-not-initialized",
            ErrorCode::RankOutsideWorld => "rank-outside-world",
            ErrorCode::NothingConfirmed => "nothing-confirmed",
            ErrorCode::DeleteRequestInvalid => "delete-request-invalid",
            ErrorCode::SglangRequestInvalid => "sglang-request-invalid",
            ErrorCode::SglangRankNotInitialized => "sglang-rank-not-initialized",
            ErrorCode::KeyInvalid => "key-invalid",
            ErrorCode::ImportInvalid => "import-invalid",
            ErrorCode::ImportConflict => "import-conflict",
            ErrorCode::KeyNotFound => "key-not-found",
            ErrorCode::BodyUnreadable => "body-unreadable",
            ErrorCode::BodyTimeout => "body-timeout",
            ErrorCode::RouteNotFound => "route-not-found",
            ErrorCode::MethodNotAllowed => "method-not-allowed",
            ErrorCode::BodyTooLarge => "body-too-large",
            ErrorCode::Timeout => "timeout",
            ErrorCode::EngineFault => "engine-fault",
            ErrorCode::Recovering => "recovering",
            ErrorCode::StorageFault => "storage-fault",
            ErrorCode::StorageUnavailable => "storage-unavailable",
            ErrorCode::PluginTrapped => "plugin-trapped",
            ErrorCode::AccessDenied => "access-denied",
            ErrorCode::AdminTokenRequired => "admin-token-required",
            ErrorCode::UpstreamUnavailable => "upstream-unavailable",
        }
    }
}

/// An error answer before it is encoded: its code and the full `detail` text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Which error.
    pub code: ErrorCode,
    /// The full `detail` text.
    pub detail: String,
}

impl Failure {
    /// The code's template followed by the specific reason in parentheses.
    pub fn because(code: ErrorCode, reason: impl Display) -> Failure {
        Failure { code, detail: format!("{} ({reason})", code.template()) }
    }

    /// The code's template with placeholders filled: each `(name, value)` replaces `{name}`.
    pub fn filled(code: ErrorCode, values: &[(&str, &dyn Display)]) -> Failure {
        let mut detail = code.template().to_string();
        for (name, value) in values {
            detail = detail.replace(&format!("{{{name}}}"), &value.to_string());
        }
        Failure { code, detail }
    }

    /// [`Failure::filled`] plus a reason in parentheses.
    pub fn filled_because(code: ErrorCode, values: &[(&str, &dyn Display)], reason: impl Display) -> Failure {
        let mut e = Failure::filled(code, values);
        e.detail = format!("{} ({reason})", e.detail);
        e
    }

    /// `Rank {rank} not initialized`, the peer's words.
    pub fn rank_not_initialized(rank: u32) -> Failure {
        Failure::filled(ErrorCode::RankNotInitialized, &[("rank", &rank)])
    }

    /// The answer: the code's status and `{"detail": ...}`.
    pub fn answer(self) -> Answer {
        #[derive(serde::Serialize)]
        struct Body<'a> {
            detail: &'a str,
        }
        let body = serde_json::to_vec(&Body { detail: &self.detail }).expect("a string serializes");
        Answer { status: self.code.status(), body, code: Some(self.code) }
    }
}

impl Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exhaustive: a new variant fails to compile here until it is listed, and the test then
    /// checks that `ALL` and the docs have it too.
    fn listed(c: ErrorCode) -> usize {
        match c {
            ErrorCode::InitializeInvalid => 0,
            ErrorCode::KeysRequestInvalid => 1,
            ErrorCode::ConfirmRequestInvalid => 2,
            ErrorCode::ExistsRequestInvalid => 3,
            ErrorCode::RankNotInitialized => 4,
            ErrorCode::RankOutsideWorld => 5,
            ErrorCode::NothingConfirmed => 6,
            ErrorCode::DeleteRequestInvalid => 7,
            ErrorCode::SglangRequestInvalid => 8,
            ErrorCode::SglangRankNotInitialized => 9,
            ErrorCode::KeyInvalid => 10,
            ErrorCode::ImportInvalid => 11,
            ErrorCode::ImportConflict => 12,
            ErrorCode::KeyNotFound => 13,
            ErrorCode::RouteNotFound => 14,
            ErrorCode::MethodNotAllowed => 15,
            ErrorCode::BodyTooLarge => 16,
            ErrorCode::BodyUnreadable => 17,
            ErrorCode::BodyTimeout => 18,
            ErrorCode::Timeout => 19,
            ErrorCode::EngineFault => 20,
            ErrorCode::Recovering => 21,
            ErrorCode::StorageFault => 22,
            ErrorCode::StorageUnavailable => 23,
            ErrorCode::PluginTrapped => 24,
            ErrorCode::AccessDenied => 25,
            ErrorCode::AdminTokenRequired => 26,
            ErrorCode::UpstreamUnavailable => 27,
        }
    }

    #[test]
    fn every_error_is_documented() {
        let docs = include_str!("../../../docs/errors.md");
        for (i, code) in ErrorCode::ALL.iter().enumerate() {
            assert_eq!(listed(*code), i, "ErrorCode::ALL is out of order or incomplete");
            let heading = format!("\n## {}\n", code.name());
            let at =
                docs.find(&heading).unwrap_or_else(|| panic!("docs/errors.md lacks the heading `## {}`", code.name()));
            let section = &docs[at + heading.len()..];
            let section = &section[..section.find("\n## ").unwrap_or(section.len())];
            let status = format!("`{}`", code.status());
            assert!(section.contains(&status), "docs for {} do not give status {status}", code.name());
            let template = format!("**`{}`**", code.template());
            assert!(section.contains(&template), "docs for {} do not quote the detail {template}", code.name());
        }
        let documented = docs.matches("\n## ").count();
        assert_eq!(documented, ErrorCode::ALL.len(), "docs/errors.md documents codes the server does not have");
    }

    #[test]
    fn details_keep_the_peer_text_first() {
        let e = Failure::because(ErrorCode::KeysRequestInvalid, "keys[3]: bad");
        assert_eq!(e.detail, "Invalid request format: need 'rank' and 'keys' (keys[3]: bad)");
        assert_eq!(Failure::rank_not_initialized(5).detail, "Rank 5 not initialized");
        let e = Failure::filled(ErrorCode::RankOutsideWorld, &[("rank", &4), ("n", &4)]);
        assert_eq!(e.detail, "Rank 4 is outside the TP world of 4 ranks (--world-size)");
        let a = Failure::filled_because(ErrorCode::SglangRequestInvalid, &[("op", &"exists")], "x").answer();
        assert_eq!((a.status, a.code), (400, Some(ErrorCode::SglangRequestInvalid)));
        assert_eq!(a.body, br#"{"detail":"Invalid exists request (x)"}"#);
        assert_eq!(a.detail().as_deref(), Some("Invalid exists request (x)"));
    }
}

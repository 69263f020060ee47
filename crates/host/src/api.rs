//! Error answers and JSON responses of the server's own routes.
//!
//! The catalogue itself — every [`ErrorCode`] with its status and `detail` template, checked
//! against `docs/errors.md` — is `kvpages_wire`'s, shared with the browser simulator;
//! answers of the core's routes arrive as [`Answer`]s and leave through [`answer_response`].

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
pub use kvpages_wire::ErrorCode;
use kvpages_wire::{Answer, Failure};

/// The HTTP status of `code`.
pub fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.status()).expect("the catalogue holds valid statuses")
}

/// An error answer: a status and a `{"detail": ...}` body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// Which error.
    pub code: ErrorCode,
    /// The full `detail` text.
    pub detail: String,
}

impl ApiError {
    /// The code's template followed by the specific reason in parentheses.
    pub fn because(code: ErrorCode, reason: impl std::fmt::Display) -> ApiError {
        Failure::because(code, reason).into()
    }

    /// The code's template with placeholders filled: `fill` maps a placeholder name to its value.
    pub fn filled(code: ErrorCode, values: &[(&str, &dyn std::fmt::Display)]) -> ApiError {
        Failure::filled(code, values).into()
    }

    /// [`ApiError::filled`] plus a reason in parentheses.
    pub fn filled_because(
        code: ErrorCode,
        values: &[(&str, &dyn std::fmt::Display)],
        reason: impl std::fmt::Display,
    ) -> ApiError {
        Failure::filled_because(code, values, reason).into()
    }

    /// `Rank {rank} not initialized`, the peer's words.
    pub fn rank_not_initialized(rank: u32) -> ApiError {
        Failure::rank_not_initialized(rank).into()
    }
}

impl From<Failure> for ApiError {
    fn from(f: Failure) -> ApiError {
        ApiError { code: f.code, detail: f.detail }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        answer_response(Failure { code: self.code, detail: self.detail }.answer())
    }
}

/// An answer of `kvpages_wire` as a response: JSON, or a bare 204.
pub fn answer_response(answer: Answer) -> Response {
    let status = StatusCode::from_u16(answer.status).expect("wire answers carry valid statuses");
    if answer.body.is_empty() && status == StatusCode::NO_CONTENT {
        return status.into_response();
    }
    json_bytes(status, answer.body)
}

/// A compact JSON body with `Content-Type: application/json`, as the peers send.
pub fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    let mut resp = (status, body).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// `value` as a compact JSON body with status 200.
pub fn json_ok<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => json_bytes(StatusCode::OK, body),
        Err(e) => {
            ApiError::because(ErrorCode::EngineFault, format_args!("reply could not be encoded: {e}")).into_response()
        }
    }
}

/// 204 with an empty body.
pub fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

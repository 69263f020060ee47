//! `/simulator/`: the browser simulator's page and its wasm module, embedded at build time
//! (see `build.rs`). Static files only; the simulation runs in the browser.

use axum::extract::Path;
use axum::http::header;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{MethodRouter, get};

use crate::api::{ApiError, ErrorCode};
use crate::app::App;

/// Every embedded file: path under `/simulator/`, bytes. Empty when built without the module.
static ASSETS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/simulator_assets.rs"));

/// Whether this binary carries the simulator.
pub(crate) fn embedded() -> bool {
    !ASSETS.is_empty()
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map_or("", |(_, ext)| ext) {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "wasm" => "application/wasm",
        "json" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        _ => "application/octet-stream",
    }
}

fn asset(path: &str) -> Response {
    if !embedded() {
        let why = "this kvpages was built without the browser simulator: run `cargo xtask simulator`, then rebuild (cargo build -p kvpages)";
        return ApiError::because(ErrorCode::RouteNotFound, why).into_response();
    }
    match ASSETS.iter().find(|(name, _)| *name == path) {
        Some((_, bytes)) => {
            ([(header::CONTENT_TYPE, content_type(path)), (header::CACHE_CONTROL, "no-cache")], *bytes).into_response()
        }
        None => ApiError::because(ErrorCode::RouteNotFound, format_args!("no simulator file '{path}'")).into_response(),
    }
}

/// The routes (`GET`, path, handler): `/simulator` redirects to `/simulator/`, which serves
/// `index.html`.
pub(crate) fn routes() -> [(&'static str, MethodRouter<App>); 3] {
    [
        ("/simulator", get(|| async { Redirect::permanent("/simulator/") })),
        ("/simulator/", get(|| async { asset("index.html") })),
        ("/simulator/{*path}", get(|Path(path): Path<String>| async move { asset(&path) })),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_file_is_a_catalogued_404() {
        let resp = asset("no/such.file");
        assert_eq!(resp.status(), axum::http::StatusCode::NOT_FOUND);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16).await.unwrap();
        let want = if embedded() {
            r#"{"detail":"Not Found (no simulator file 'no/such.file')"}"#
        } else {
            r#"{"detail":"Not Found (this kvpages was built without the browser simulator: run `cargo xtask simulator`, then rebuild (cargo build -p kvpages))"}"#
        };
        assert_eq!(std::str::from_utf8(&body).unwrap(), want);
    }

    #[test]
    fn content_types_cover_the_page() {
        assert_eq!(content_type("pkg/kvpages_wasm_bg.wasm"), "application/wasm");
        assert_eq!(content_type("app.js"), "text/javascript; charset=utf-8");
        assert_eq!(content_type("index.html"), "text/html; charset=utf-8");
        assert_eq!(content_type("README"), "application/octet-stream");
    }
}

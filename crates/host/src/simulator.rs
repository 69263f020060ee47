//! `/simulator/`: the browser simulator's page and its wasm module, embedded at build time
//! (see `build.rs`). Static files only; the simulation runs in the browser.

use axum::Router;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

use crate::server::App;

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
        let detail = "this kvpages was built without the browser simulator: run `cargo xtask simulator`, then rebuild (cargo build -p kvpages-host)";
        return (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::json!({ "detail": detail }).to_string(),
        )
            .into_response();
    }
    match ASSETS.iter().find(|(name, _)| *name == path) {
        Some((_, bytes)) => {
            ([(header::CONTENT_TYPE, content_type(path)), (header::CACHE_CONTROL, "no-cache")], *bytes).into_response()
        }
        None => {
            let detail = format!("no simulator file '{path}'");
            (
                StatusCode::NOT_FOUND,
                [(header::CONTENT_TYPE, "application/json")],
                serde_json::json!({ "detail": detail }).to_string(),
            )
                .into_response()
        }
    }
}

/// The routes: `/simulator` redirects to `/simulator/`, which serves `index.html`.
pub(crate) fn routes() -> Router<App> {
    Router::new()
        .route("/simulator", get(|| async { Redirect::permanent("/simulator/") }))
        .route("/simulator/", get(|| async { asset("index.html") }))
        .route("/simulator/{*path}", get(|Path(path): Path<String>| async move { asset(&path) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types_cover_the_page() {
        assert_eq!(content_type("pkg/kvpages_wasm_bg.wasm"), "application/wasm");
        assert_eq!(content_type("app.js"), "text/javascript; charset=utf-8");
        assert_eq!(content_type("index.html"), "text/html; charset=utf-8");
        assert_eq!(content_type("README"), "application/octet-stream");
    }
}

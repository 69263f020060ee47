//! The server: the router over the routes, the request log, the run loop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use kvpages_wire as wire;
use tokio::net::TcpListener;

use crate::api::answer_response;
use crate::app::{App, Handle};
use crate::config::ServeConfig;
use crate::engine::Engine;
pub use crate::routes::ExtraRoute;
use crate::routes::{admin, get_route, post_route};

/// The router with every route, the guard and the JSON fallbacks.
pub fn router(config: ServeConfig, engine: Box<dyn Engine>) -> Result<Router, String> {
    build(config, engine).map(|(router, _)| router)
}

/// The router and its handle (see [`build_with`]).
pub fn build(config: ServeConfig, engine: Box<dyn Engine>) -> Result<(Router, Handle), String> {
    build_with(config, engine, Vec::new())
}

/// The router and its handle, with `extra` routes (served behind the same guards; the load
/// generator's floor route). With durability configured the server starts not ready (503
/// `recovering`) until [`Handle::start`] has recovered the state.
pub fn build_with(
    config: ServeConfig,
    engine: Box<dyn Engine>,
    extra: Vec<ExtraRoute>,
) -> Result<(Router, Handle), String> {
    let app = App::new(config, engine)?;
    let handle = Handle::new(app.clone());
    let access = Arc::new(app.config.access.clone());
    let routes = extra.into_iter().fold(Router::new(), |r, e| r.route(e.path, e.method));
    Ok((
        routes
            // The routes of `kvpages_wire` (the browser simulator's too): vLLM's, SGLang's,
            // `/stats` and key inspection.
            .route("/rank/{rank}/initialize", post_route("initialize"))
            .route("/keys/batch_allocate", post_route("batch_allocate"))
            .route("/keys/confirm_write", post_route("confirm_write"))
            .route("/keys/batch_exists", post_route("batch_exists"))
            .route("/keys/get_locations", post_route("get_locations"))
            .route("/clear", post_route("clear"))
            .route("/keys/delete", post_route("delete"))
            .route("/health", get(admin::health))
            .route("/stats", get(admin::stats))
            .route("/metrics", get(admin::metrics))
            .route("/admin/keys/{key}", get_route("inspect"))
            .route("/admin/import/sglang", post(admin::import_sglang))
            .route("/admin/export/sglang", get(admin::export_sglang))
            // SGLang's `/{rank}/{op}`; the static routes above take precedence over it.
            .route("/{rank}/{op}", post_route("sglang"))
            .merge(crate::routes::simulator::routes())
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(app)
            .layer(middleware::from_fn_with_state(access, crate::access::guard))
            .layer(middleware::from_fn(guard)),
        handle,
    ))
}

/// Logs each request (debug) and counts it for `/metrics`. Time bounds live where the waiting
/// is: reading the body (408) and waiting for the engine (503), see `routes::handle_async`.
async fn guard(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let route =
        crate::telemetry::route_label(req.extensions().get::<axum::extract::MatchedPath>().map(|m| m.as_str()), &path);
    let start = Instant::now();
    let resp = next.run(req).await;
    crate::telemetry::record_request(&route, resp.status(), start.elapsed());
    tracing::debug!(%method, %path, status = resp.status().as_u16(), micros = start.elapsed().as_micros() as u64, "request");
    resp
}

async fn not_found(method: Method, req: Request<Body>) -> Response {
    answer_response(wire::not_found(method.as_str(), req.uri().path()))
}

async fn method_not_allowed(method: Method, req: Request<Body>) -> Response {
    let path = req.uri().path();
    let mut resp = answer_response(wire::method_not_allowed(method.as_str(), path));
    resp.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static(wire::allowed_method(path)));
    resp
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains open requests, with the
/// default connection limits (see [`run_with`]).
pub async fn run(
    listener: TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_with(listener, router, crate::connections::Limits::default(), shutdown).await
}

/// [`run`] within `limits`: header and idle time limits, and the connection cap.
pub async fn run_with(
    listener: TcpListener,
    router: Router,
    limits: crate::connections::Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!(
        max_connections = limits.max_connections,
        header_timeout = ?limits.header_timeout,
        idle_timeout = ?limits.idle_timeout,
        "kvpages listening on http://{addr}"
    );
    crate::connections::serve(listener, router, limits, shutdown).await
}

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
use axum::routing::{MethodRouter, get, post};
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
    let extra = extra.into_iter().map(|e| (e.path, e.method));
    let own = own_routes().into_iter().map(|(_, path, handler)| (path, handler));
    let routes = wire::ROUTES.iter().map(|r| (r.path, wire_route(r))).chain(own).chain(extra);
    // Static paths take precedence over `/{rank}/{op}` in the router, as in `wire::matches`.
    let router = routes.fold(Router::new(), |router, (path, method)| router.route(path, method));
    Ok((
        router
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(app)
            .layer(middleware::from_fn_with_state(access, crate::access::guard))
            .layer(middleware::from_fn(guard)),
        handle,
    ))
}

/// The handler of a route of the wire crate: `/stats` adds the host's figures, every other one
/// is [`crate::routes::serve`]'s.
fn wire_route(route: &'static wire::Route) -> MethodRouter<App> {
    match (route.method, route.name) {
        ("GET", "stats") => get(move |app| admin::stats(app, route)),
        ("GET", _) => get_route(route),
        _ => post_route(route),
    }
}

/// The server's own routes, beside the wire crate's: method (for a 405's `Allow`), path and
/// handler.
fn own_routes() -> Vec<(&'static str, &'static str, MethodRouter<App>)> {
    let mut own = vec![
        ("GET", "/health", get(admin::health)),
        ("GET", "/metrics", get(admin::metrics)),
        ("POST", "/admin/import/sglang", post(admin::import_sglang)),
        ("GET", "/admin/export/sglang", get(admin::export_sglang)),
    ];
    own.extend(crate::routes::simulator::routes().map(|(path, handler)| ("GET", path, handler)));
    own
}

/// The server's own routes (method, path template), beside the wire crate's [`wire::ROUTES`].
/// Built once: a 405 asks for it, and the handlers are not needed for that.
pub fn own_route_table() -> &'static [(&'static str, &'static str)] {
    static TABLE: std::sync::LazyLock<Vec<(&'static str, &'static str)>> =
        std::sync::LazyLock::new(|| own_routes().into_iter().map(|(method, path, _)| (method, path)).collect());
    &TABLE
}

/// The method the route `path` names takes (a route of the wire crate's or the server's own),
/// for a 405's `Allow`.
fn allowed_method(path: &str) -> &'static str {
    let own = own_route_table().iter().map(|&(method, path)| (path, method));
    let wire = wire::ROUTES.iter().map(|r| (r.path, r.method));
    wire::best_match(wire.chain(own), path).unwrap_or("GET")
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
    let allowed = allowed_method(path);
    let mut resp = answer_response(wire::method_not_allowed(method.as_str(), path, allowed));
    resp.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static(allowed));
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

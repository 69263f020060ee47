//! The server: router, request log, body reading with its bounds, engine access, run loop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvpages_core::{Command, Millis, Reply, Settings};
use tokio::net::TcpListener;

use crate::api::{ApiError, ErrorCode};
use crate::engine::{Engine, EngineError, EngineKind, NativeEngine};
use crate::routes::{admin, sglang, vllm};

/// Everything `kvpages serve` needs to know.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Which engine runs the core.
    pub engine: EngineKind,
    /// Largest accepted request body, in bytes.
    pub max_body: usize,
    /// Longest time a request may take before it is answered 503.
    pub request_timeout: Duration,
    /// The core's settings (world size, reservation TTL).
    pub settings: Settings,
    /// `--allow` and `--admin-token`: who may send what (default: everyone, everything).
    pub access: crate::access::Access,
    /// Serve the load generator's transport-only floor route (`kvpages bench`'s in-process
    /// server only; never set by `kvpages serve`).
    pub bench_floor: bool,
}

impl Default for ServeConfig {
    fn default() -> ServeConfig {
        ServeConfig {
            engine: EngineKind::Native,
            max_body: 16 * 1024 * 1024,
            request_timeout: Duration::from_secs(5),
            settings: Settings::default(),
            access: crate::access::Access::default(),
            bench_floor: false,
        }
    }
}

/// State shared by every request.
pub(crate) struct Shared {
    /// The one engine; locked only while it applies a command. An async lock, so a request
    /// that waits for it past its deadline is answered 503 instead of waiting forever.
    engine: tokio::sync::Mutex<Box<dyn Engine>>,
    /// What the engine is (kept outside the lock for `/health`).
    pub(crate) kind: EngineKind,
    /// Zero of the clock handed to the core, and of the uptime.
    pub(crate) started: Instant,
    pub(crate) config: ServeConfig,
}

/// A handle on the shared state, cloned into every handler.
#[derive(Clone)]
pub(crate) struct App(Arc<Shared>);

impl std::ops::Deref for App {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl App {
    fn now(&self) -> Millis {
        self.started.elapsed().as_millis() as Millis
    }

    /// Applies one command; the lock is held for this call only. Waiting for the lock past
    /// `deadline` gives up with [`EngineError::Busy`].
    pub(crate) async fn apply(&self, cmd: &Command, deadline: Instant) -> Result<Reply, EngineError> {
        let mut engine = tokio::time::timeout_at(deadline.into(), self.engine.lock())
            .await
            .map_err(|_| EngineError::Busy(self.config.request_timeout))?;
        engine.apply(self.now(), cmd)
    }

    /// Reads the whole body: 413 past `--max-body`, 408 if it has not arrived by `deadline`
    /// (a client that stalls is not the server's fault, so no 5xx), 400 if it is broken.
    pub(crate) async fn body(&self, req: Request, limit: usize, deadline: Instant) -> Result<Bytes, ApiError> {
        let too_large = || ApiError::filled(ErrorCode::BodyTooLarge, &[("limit", &limit)]);
        let declared =
            req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let read = axum::body::to_bytes(req.into_body(), limit);
        match tokio::time::timeout_at(deadline.into(), read).await {
            Err(_) => Err(ApiError::filled(
                ErrorCode::BodyTimeout,
                &[("seconds", &self.config.request_timeout.as_secs_f64())],
            )),
            Ok(Ok(body)) => Ok(body),
            Ok(Err(e)) => {
                let inner = e.into_inner();
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*inner);
                while let Some(c) = cause {
                    if c.is::<http_body_util::LengthLimitError>() {
                        return Err(too_large());
                    }
                    cause = c.source();
                }
                Err(ApiError::because(ErrorCode::BodyUnreadable, inner))
            }
        }
    }
}

/// Builds the engine the config names.
pub fn build_engine(config: &ServeConfig, seed: u64) -> Box<dyn Engine> {
    match config.engine {
        EngineKind::Native => Box::new(NativeEngine::new(seed, config.settings)),
    }
}

/// Loads SGLang's persistence file into `engine` before the server starts serving.
pub fn preload_sglang(engine: &mut dyn Engine, config: &ServeConfig, path: &std::path::Path) -> Result<(), String> {
    let start = Instant::now();
    let bytes = std::fs::read(path).map_err(|e| format!("--import-sglang {}: {e}", path.display()))?;
    tracing::info!(bytes = bytes.len(), "reading SGLang's persistence file {}", path.display());
    let pools = crate::routes::sglang_file::parse(&bytes)
        .map_err(|e| format!("--import-sglang {}: {e}; nothing was imported", path.display()))?;
    engine
        .apply(0, &Command::Configure(config.settings))
        .map_err(|e| format!("the engine refused its settings: {e:?}"))?;
    match engine.apply(0, &Command::ImportSglang { pools, replace: false }) {
        Ok(Reply::Imported { pools, keys, leaked_pages }) => {
            tracing::info!(
                pools,
                keys,
                leaked_pages,
                seconds = start.elapsed().as_secs_f64(),
                "imported SGLang's pools"
            );
            Ok(())
        }
        Ok(other) => Err(format!("unexpected reply {other:?}")),
        Err(EngineError::Domain(e)) => Err(format!("--import-sglang {}: {e}; nothing was imported", path.display())),
        Err(e) => Err(format!("--import-sglang {}: {e:?}; nothing was imported", path.display())),
    }
}

/// The router with every route, the guard and the JSON fallbacks.
pub fn router(config: ServeConfig, engine: Box<dyn Engine>) -> Result<Router, String> {
    let kind = engine.kind();
    let mut engine = engine;
    // Settings are a command, so a command log would replay them in order.
    engine
        .apply(0, &Command::Configure(config.settings))
        .map_err(|e| format!("the engine refused its settings: {e:?}"))?;
    let app = App(Arc::new(Shared { engine: tokio::sync::Mutex::new(engine), kind, started: Instant::now(), config }));
    let mut routes = Router::new();
    if app.config.bench_floor {
        routes = routes.route(crate::bench::FLOOR_PATH, post(crate::bench::floor));
    }
    Ok(routes
        .route("/rank/{rank}/initialize", post(vllm::initialize))
        .route("/keys/batch_allocate", post(vllm::batch_allocate))
        .route("/keys/confirm_write", post(vllm::confirm_write))
        .route("/keys/batch_exists", post(vllm::batch_exists))
        .route("/keys/get_locations", post(vllm::get_locations))
        .route("/clear", post(vllm::clear))
        .route("/keys/delete", post(vllm::delete))
        .route("/health", get(admin::health))
        .route("/stats", get(admin::stats))
        .route("/metrics", get(crate::metrics::handler))
        .route("/admin/keys/{key}", get(admin::inspect))
        .route("/admin/import/sglang", post(admin::import_sglang))
        .route("/admin/export/sglang", get(admin::export_sglang))
        // SGLang's `/{rank}/{op}`; the static routes above take precedence over it.
        .route("/{rank}/{op}", post(sglang::route))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::new(app.config.access.clone()), crate::access::guard))
        .layer(middleware::from_fn(guard))
        .with_state(app))
}

/// Logs each request (debug) and counts it for `/metrics`. Time bounds live where the waiting
/// is: reading the body (408) and waiting for the engine (503), see `routes::handle_async`.
async fn guard(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let route =
        crate::metrics::route_label(req.extensions().get::<axum::extract::MatchedPath>().map(|m| m.as_str()), &path);
    let start = Instant::now();
    let resp = next.run(req).await;
    crate::metrics::record_request(&route, resp.status(), start.elapsed());
    tracing::debug!(%method, %path, status = resp.status().as_u16(), micros = start.elapsed().as_micros() as u64, "request");
    resp
}

async fn not_found(method: Method, req: Request<Body>) -> Response {
    ApiError::because(ErrorCode::RouteNotFound, format_args!("no route {method} {}", req.uri().path())).into_response()
}

async fn method_not_allowed(method: Method, req: Request<Body>) -> Response {
    let path = req.uri().path();
    let allowed = if path == "/health" || path == "/stats" || path == "/metrics" || path.starts_with("/admin/") {
        "GET"
    } else {
        "POST"
    };
    let mut resp = ApiError::because(
        ErrorCode::MethodNotAllowed,
        format_args!("{} accepts {allowed}, not {method}", req.uri().path()),
    )
    .into_response();
    resp.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static(allowed));
    resp
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains open requests.
pub async fn run(
    listener: TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!("kvpages listening on http://{addr}");
    // With the client's address, for `--allow`.
    let service = router.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service).with_graceful_shutdown(shutdown).await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: finishing open requests");
}

//! The server: router, per-request guard (time bound and request log), health, run loop.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvpages_core::{Command, Millis, Reply, Settings, Space};
use tokio::net::TcpListener;

use crate::api::{ApiError, ErrorCode, json_ok};
use crate::engine::{Engine, EngineError, EngineKind, NativeEngine};
use crate::routes::vllm;

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
}

impl Default for ServeConfig {
    fn default() -> ServeConfig {
        ServeConfig {
            engine: EngineKind::Native,
            max_body: 16 * 1024 * 1024,
            request_timeout: Duration::from_secs(5),
            settings: Settings::default(),
        }
    }
}

/// State shared by every request.
pub(crate) struct Shared {
    /// The one engine; locked only while it applies a command.
    engine: Mutex<Box<dyn Engine>>,
    /// What the engine is (kept outside the lock for `/health`).
    kind: EngineKind,
    /// Zero of the clock handed to the core, and of the uptime.
    started: Instant,
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

    /// Applies one command; the lock is held for this call only.
    pub(crate) fn apply(&self, cmd: &Command) -> Result<Reply, EngineError> {
        let now = self.now();
        let mut engine = self
            .engine
            .lock()
            .map_err(|_| EngineError::Fault("the engine lock is poisoned by an earlier panic".into()))?;
        engine.apply(now, cmd)
    }

    /// Reads the whole body, refusing it past `--max-body`.
    pub(crate) async fn body(&self, req: Request) -> Result<Bytes, ApiError> {
        let limit = self.config.max_body;
        let too_large = || ApiError::filled(ErrorCode::BodyTooLarge, &[("limit", &limit)]);
        let declared =
            req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        axum::body::to_bytes(req.into_body(), limit).await.map_err(|_| too_large())
    }
}

/// Builds the engine the config names.
pub fn build_engine(config: &ServeConfig, seed: u64) -> Box<dyn Engine> {
    match config.engine {
        EngineKind::Native => Box::new(NativeEngine::new(seed, config.settings)),
    }
}

/// The router with every route, the guard and the JSON fallbacks.
pub fn router(config: ServeConfig, engine: Box<dyn Engine>) -> Result<Router, String> {
    let kind = engine.kind();
    let app = App(Arc::new(Shared { engine: Mutex::new(engine), kind, started: Instant::now(), config }));
    // Settings are a command, so a command log would replay them in order.
    app.apply(&Command::Configure(app.config.settings))
        .map_err(|e| format!("the engine refused its settings: {e:?}"))?;
    Ok(Router::new()
        .route("/rank/{rank}/initialize", post(vllm::initialize))
        .route("/keys/batch_allocate", post(vllm::batch_allocate))
        .route("/keys/confirm_write", post(vllm::confirm_write))
        .route("/keys/batch_exists", post(vllm::batch_exists))
        .route("/keys/get_locations", post(vllm::get_locations))
        .route("/clear", post(vllm::clear))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app))
}

/// Bounds each request's time and logs it.
async fn guard(State(app): State<App>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let start = Instant::now();
    let limit = app.config.request_timeout;
    let resp = match tokio::time::timeout(limit, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => {
            tracing::warn!(%method, %path, "request timed out after {limit:?}");
            ApiError::filled(ErrorCode::Timeout, &[("seconds", &limit.as_secs_f64())]).into_response()
        }
    };
    tracing::debug!(%method, %path, status = resp.status().as_u16(), micros = start.elapsed().as_micros() as u64, "request");
    resp
}

async fn not_found(method: Method, req: Request<Body>) -> Response {
    ApiError::because(ErrorCode::RouteNotFound, format_args!("no route {method} {}", req.uri().path())).into_response()
}

async fn method_not_allowed(method: Method, req: Request<Body>) -> Response {
    let allowed = if req.uri().path() == "/health" { "GET" } else { "POST" };
    let mut resp = ApiError::because(
        ErrorCode::MethodNotAllowed,
        format_args!("{} accepts {allowed}, not {method}", req.uri().path()),
    )
    .into_response();
    resp.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static(allowed));
    resp
}

/// `GET /health`: engine, uptime and page counts per rank.
async fn health(State(app): State<App>) -> Response {
    #[derive(serde::Serialize)]
    struct RankHealth {
        rank: u32,
        num_pages: u32,
        free: u32,
        reserved: u32,
        committed: u32,
    }
    #[derive(serde::Serialize)]
    struct Health {
        status: &'static str,
        engine: String,
        uptime_seconds: f64,
        world_size: u32,
        keys: u64,
        ranks: Vec<RankHealth>,
    }
    let stats = match app.apply(&Command::Stats) {
        Ok(Reply::Stats(s)) => s,
        Ok(other) => return crate::routes::unexpected(&other).into_response(),
        Err(e) => return crate::routes::fault(e).into_response(),
    };
    let vllm = stats.spaces.iter().find(|s| s.space == Space::Vllm);
    json_ok(&Health {
        status: "serving",
        engine: app.kind.to_string(),
        uptime_seconds: app.started.elapsed().as_secs_f64(),
        world_size: vllm.map_or(0, |s| s.world_size),
        keys: vllm.map_or(0, |s| s.keys),
        ranks: vllm
            .map(|s| {
                s.ranks
                    .iter()
                    .map(|r| RankHealth {
                        rank: r.rank,
                        num_pages: r.num_pages,
                        free: r.pages.free,
                        reserved: r.pages.reserved,
                        committed: r.pages.committed,
                    })
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains open requests.
pub async fn run(
    listener: TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!("kvpages listening on http://{addr}");
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
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

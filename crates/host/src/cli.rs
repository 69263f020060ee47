//! The `kvpages` command line: every flag also reads a `KVPAGES_*` environment variable.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kvpages_core::Settings;

use crate::engine::EngineKind;
use crate::server::{self, ServeConfig};

/// kvpages: a KV-cache page metadata server for vLLM's and SGLang's HF3FS connectors.
#[derive(Debug, Parser)]
#[command(name = "kvpages", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Cmd,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run the metadata server (vLLM's routes on port 18000 by default).
    Serve(ServeArgs),
}

/// Flags of `kvpages serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to bind. The default serves this host only; use 0.0.0.0 (or a NIC's address) to
    /// serve other nodes (the data routes carry no authentication, as in the peers' protocol).
    #[arg(long, env = "KVPAGES_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port. vLLM's connector always dials localhost:18000.
    #[arg(long, env = "KVPAGES_PORT", default_value_t = 18000)]
    pub port: u16,
    /// Engine that runs the core.
    #[arg(long, env = "KVPAGES_ENGINE", value_enum, default_value_t = EngineKind::Native)]
    pub engine: EngineKind,
    /// TP world size: a key is complete when ranks 0..N-1 all confirmed it, and ranks >= N are
    /// refused (409). Without it, the world is the set of initialized worker ranks.
    #[arg(long, env = "KVPAGES_WORLD_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub world_size: Option<u32>,
    /// Largest request body in bytes (larger ones get 413). A 1,250-key lookup is ~45 KB.
    #[arg(long, env = "KVPAGES_MAX_BODY", default_value_t = 16 * 1024 * 1024)]
    pub max_body: usize,
    /// Seconds a request may take before it is answered 503 (the peers' clients set no timeout).
    #[arg(long, env = "KVPAGES_REQUEST_TIMEOUT", default_value = "5", value_parser = parse_seconds)]
    pub request_timeout: Duration,
    /// Seconds an allocated page stays reserved without a confirm; then it is free again and a
    /// late confirm is refused.
    #[arg(long, env = "KVPAGES_RESERVATION_TTL", default_value = "60", value_parser = parse_seconds)]
    pub reservation_ttl: Duration,
    /// Log filter (tracing's env-filter syntax): error, warn, info, debug (one line per request).
    #[arg(long, env = "KVPAGES_LOG", default_value = "info")]
    pub log: String,
}

/// Parses seconds, fractions allowed (`0.5`), as a positive duration.
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s.parse().map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("'{s}' must be a positive number of seconds"));
    }
    Duration::try_from_secs_f64(v).map_err(|e| format!("'{s}': {e}"))
}

impl ServeArgs {
    /// The server configuration these flags describe.
    pub fn config(&self) -> ServeConfig {
        ServeConfig {
            engine: self.engine,
            max_body: self.max_body,
            request_timeout: self.request_timeout,
            settings: Settings {
                reservation_ttl: self.reservation_ttl.as_millis().max(1) as u64,
                world_size: self.world_size,
            },
        }
    }
}

fn init_logging(filter: &str) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| format!("--log '{filter}': {e}"))?;
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .map_err(|e| e.to_string())
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Serve(args) => serve(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvpages: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    init_logging(&args.log)?;
    let config = args.config();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", bracket_v6(&args.host), args.port)
            .parse()
            .map_err(|e| format!("--host {} --port {}: {e}", args.host, args.port))?;
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let seed = random_seed();
        let engine = server::build_engine(&config, seed);
        tracing::info!(
            engine = %config.engine,
            world_size = ?config.settings.world_size,
            max_body = config.max_body,
            request_timeout = ?config.request_timeout,
            reservation_ttl_ms = config.settings.reservation_ttl,
            "starting"
        );
        let router = server::router(config, engine)?;
        server::run(listener, router, server::shutdown_signal()).await.map_err(|e| e.to_string())
    })
}

fn bracket_v6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_owned() }
}

/// A seed for the core's hash tables (the core has no randomness of its own).
fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x006b_7670_6167_6573_u64)
}

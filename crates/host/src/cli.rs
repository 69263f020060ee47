//! The `kvpages` command line: every flag also reads a `KVPAGES_*` environment variable.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kvpages_core::{Eviction, Settings};

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
    /// Measure a server: the vLLM clients' workloads over keep-alive HTTP/1.1 on loopback,
    /// each beside a transport-only floor measured in the same run (or `--memory`).
    Bench(crate::bench::BenchArgs),
    /// Print a running server's `/stats` (pages by state per rank, keys, counters).
    Stats(QueryArgs),
    /// Print what a running server knows about one key (`/admin/keys/KEY`).
    Inspect(InspectArgs),
    /// Load SGLang's persistence file (its server's `--persistence-path`) into a running server,
    /// all or nothing, so a deployment switches without losing its cache.
    ImportSglang(ImportArgs),
    /// Write a running server's SGLang pools in SGLang's persistence format (for rollback).
    ExportSglang(ExportArgs),
    /// Forward a local port (vLLM dials localhost:18000) to the one metadata server of a
    /// multi-node deployment.
    Forward(crate::forward::ForwardArgs),
}

/// Flags of `kvpages import-sglang`.
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// SGLang's persistence JSON file.
    pub file: std::path::PathBuf,
    /// Drop the SGLang pools the server holds first (otherwise an import needs an empty state).
    #[arg(long)]
    pub replace: bool,
    #[command(flatten)]
    pub server: QueryArgs,
}

/// Flags of `kvpages export-sglang`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Where to write the file.
    pub file: std::path::PathBuf,
    #[command(flatten)]
    pub server: QueryArgs,
}

/// Where a running server is.
#[derive(Debug, Args)]
pub struct QueryArgs {
    /// The server's URL (loopback only).
    #[arg(long, env = "KVPAGES_URL", default_value = "http://127.0.0.1:18000")]
    pub url: String,
    /// The server's `--admin-token`, sent as `Authorization: Bearer TOKEN` (needed by inspect,
    /// import-sglang and export-sglang when the server has one).
    #[arg(long, env = "KVPAGES_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

impl QueryArgs {
    async fn connect(&self) -> Result<crate::client::Client, String> {
        let client = crate::client::Client::connect_url(&self.url).await.map_err(|e| format!("{}: {e}", self.url))?;
        client.bearer(self.admin_token.as_deref()).map_err(|e| format!("--admin-token: {e}"))
    }
}

/// Flags of `kvpages inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The key, exactly as the client sends it.
    pub key: String,
    #[command(flatten)]
    pub server: QueryArgs,
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
    /// Engine that runs the core: `wasm`, the core as a WebAssembly component in a wasmtime
    /// sandbox (a fault in it fails one request and is contained), or `native`, the core
    /// compiled into the server.
    #[arg(long, env = "KVPAGES_ENGINE", value_enum, default_value_t = EngineKind::Wasm)]
    pub engine: EngineKind,
    /// With `--engine wasm`: run this component instead of the embedded one. It must implement
    /// the WIT world kvpages:engine/plugin@0.2.0 (wit/kvpages.wit) and import nothing; checked at
    /// start-up.
    #[arg(long, env = "KVPAGES_PLUGIN")]
    pub plugin: Option<std::path::PathBuf>,
    /// Cap on the plugin's linear memory in MiB (a grow past it traps and is contained). The
    /// default is wasm32's maximum, so the plugin can hold any state the native engine can up to
    /// that size.
    #[arg(long, env = "KVPAGES_PLUGIN_MEMORY_MIB", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub plugin_memory_mib: u64,
    /// Seconds (wall-clock) one plugin call may run before it is stopped (a trap, contained), plus
    /// 0.1 ms per key of a batch, 20 ms per MiB of the guest's memory for calls that walk the
    /// whole state (snapshot, initialize, clear, reset, ...) and 100 ms per MiB of a snapshot
    /// being restored. Ordinary calls take microseconds; this only stops a runaway one.
    #[arg(long, env = "KVPAGES_PLUGIN_BUDGET", default_value = "1", value_parser = parse_seconds)]
    pub plugin_budget: Duration,
    /// How the server calls into the plugin: `auto`, through the direct entry point when the
    /// component's core module has one (kvpages' own plugin does: one plain call a command,
    /// the fastest way) and else through its WIT interface; `direct`, refuse a component
    /// without it; `wit`, always the WIT interface (as any other component-model host would).
    /// Same sandbox and limits either way.
    #[arg(long, env = "KVPAGES_PLUGIN_CALLS", value_enum, default_value_t = crate::plugin::Calls::Auto)]
    pub plugin_calls: crate::plugin::Calls,
    /// TP world size: a key is complete when ranks 0..N-1 all confirmed it, and ranks >= N are
    /// refused (409). Without it, the world is the set of initialized worker ranks.
    #[arg(long, env = "KVPAGES_WORLD_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub world_size: Option<u32>,
    /// Largest request body in bytes (larger ones get 413). A 1,250-key lookup is ~45 KB.
    #[arg(long, env = "KVPAGES_MAX_BODY", default_value_t = 16 * 1024 * 1024)]
    pub max_body: usize,
    /// Seconds a request may wait: for its body (then 408), for the engine or, when durable, for
    /// its log record (then 503). A plugin call already running is bounded by --plugin-budget.
    /// The peers' clients set no timeout.
    #[arg(long, env = "KVPAGES_REQUEST_TIMEOUT", default_value = "5", value_parser = parse_seconds)]
    pub request_timeout: Duration,
    /// Seconds an allocated page stays reserved without a confirm; then it is taken back
    /// (quarantined for --quarantine, free at once with --quarantine 0) and a late confirm is
    /// refused.
    #[arg(long, env = "KVPAGES_RESERVATION_TTL", default_value = "60", value_parser = parse_seconds)]
    pub reservation_ttl: Duration,
    /// Seconds a `get_locations` answer (and an allocate cache hit) protects the returned pages
    /// from eviction and reuse, so a reader never reads a page a new writer is overwriting.
    #[arg(long, env = "KVPAGES_READ_LEASE", default_value = "5", value_parser = parse_seconds_or_zero)]
    pub read_lease: Duration,
    /// Seconds a page taken back from an expired reservation stays out of use (a slow writer may
    /// still be writing into it). Default: the reservation TTL.
    #[arg(long, env = "KVPAGES_QUARANTINE", value_parser = parse_seconds_or_zero)]
    pub quarantine: Option<Duration>,
    /// What a full pool does: `lru` evicts least-recently-used keys that hold no lease (on every
    /// rank at once); `off` answers -1, exactly like vLLM's server.
    #[arg(long, env = "KVPAGES_EVICTION", value_enum, default_value_t = EvictionArg::Lru)]
    pub eviction: EvictionArg,
    /// Evict when a rank's used pages would pass this share of its pool...
    #[arg(long, env = "KVPAGES_EVICT_HIGH", default_value_t = 0.95, value_parser = parse_share)]
    pub evict_high: f64,
    /// ...down to this share.
    #[arg(long, env = "KVPAGES_EVICT_LOW", default_value_t = 0.90, value_parser = parse_share)]
    pub evict_low: f64,
    /// Where the state is kept (write-ahead log + snapshots); it survives restarts and crashes.
    #[arg(long, env = "KVPAGES_DATA_DIR", default_value = "./kvpages-data")]
    pub data_dir: std::path::PathBuf,
    /// Keep the state in memory only: a restart forgets every rank and key (as the peers do).
    #[arg(long, env = "KVPAGES_IN_MEMORY")]
    pub in_memory: bool,
    /// When a reply may be sent: `always` = after fsync (one fsync for every group of waiting
    /// requests; survives power loss), or `interval=MS` = once the OS has the record (survives a
    /// kvpages crash; a power loss loses up to MS of acknowledged changes).
    #[arg(long, env = "KVPAGES_FSYNC", default_value = "always")]
    pub fsync: crate::durable::FsyncMode,
    /// Take a snapshot (and drop older log segments) after this many log records...
    #[arg(long, env = "KVPAGES_SNAPSHOT_EVERY", default_value_t = 1_000_000)]
    pub snapshot_every: u64,
    /// ...or after this many seconds with any change.
    #[arg(long, env = "KVPAGES_SNAPSHOT_INTERVAL", default_value = "300", value_parser = parse_seconds)]
    pub snapshot_interval: Duration,
    /// Load SGLang's persistence file at start (all or nothing; the server does not start if it
    /// is refused).
    #[arg(long, env = "KVPAGES_IMPORT_SGLANG")]
    pub import_sglang: Option<std::path::PathBuf>,
    /// Serve only clients whose address is in one of these blocks (comma-separated CIDRs, e.g.
    /// 127.0.0.1/32,10.0.0.0/8); others get 403. Default: every client that reaches the port.
    #[arg(long, env = "KVPAGES_ALLOW", value_parser = crate::access::parse_allow)]
    pub allow: Option<crate::access::AllowList>,
    /// Require `Authorization: Bearer TOKEN` for /clear, /keys/delete, SGLang's clear and
    /// delete_keys, and /admin/* (401 without it). Prefer the environment variable: a flag's value
    /// is visible to every user in `ps`.
    #[arg(long, env = "KVPAGES_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Seconds a request's head (its request line and headers) may take to arrive, from its first
    /// byte; a client that sends it slower is disconnected (slowloris).
    #[arg(long, env = "KVPAGES_HEADER_TIMEOUT", default_value = "10", value_parser = parse_seconds)]
    pub header_timeout: Duration,
    /// Seconds a connection may stay open without a request; then the server closes it. The
    /// clients' pools notice and reconnect without an error.
    #[arg(long, env = "KVPAGES_IDLE_TIMEOUT", default_value = "75", value_parser = parse_seconds)]
    pub idle_timeout: Duration,
    /// Most client connections open at once. At the cap a new connection closes the oldest idle
    /// one, or is refused at once if every one is busy. Default: the descriptor limit
    /// (`ulimit -n`) less an eighth of it (at least 64), kept for the server's own files.
    #[arg(long, env = "KVPAGES_MAX_CONNECTIONS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,
    /// Worker threads serving HTTP. Default: half the CPUs, at least 1 — the clients on this
    /// host get the other half, and the engine runs one command at a time whatever the count.
    #[arg(long, env = "KVPAGES_THREADS", value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// Log filter (tracing's env-filter syntax): error, warn, info, debug (one line per request).
    #[arg(long, env = "KVPAGES_LOG", default_value = "info")]
    pub log: String,
}

/// `--eviction` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EvictionArg {
    /// Least recently used first, leased keys never.
    Lru,
    /// Never evict (the peer's behaviour).
    Off,
}

/// Parses a share of a pool in `(0, 1]`.
pub fn parse_share(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!("'{s}' must be a share of the pool in (0, 1]"));
    }
    Ok(v)
}

/// Parses seconds as a duration that may be 0 (0 turns the feature off).
pub fn parse_seconds_or_zero(s: &str) -> Result<Duration, String> {
    if s.parse::<f64>() == Ok(0.0) { Ok(Duration::ZERO) } else { parse_seconds(s) }
}

/// Parses a count of worker threads (at least 1).
pub fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("'{s}' is not a thread count (1 or more)")),
    }
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
    /// The connection limits these flags describe; a cap at or above the descriptor limit is
    /// kept (the operator's choice) with a warning, since accepting can then run out.
    fn connections(&self) -> crate::connections::Limits {
        let max_connections = match self.max_connections {
            Some(n) => {
                if let Some(limit) = crate::connections::descriptor_limit().filter(|&l| n >= l) {
                    tracing::warn!(
                        "--max-connections {n} is at or above the descriptor limit ({limit}, ulimit -n): the \
                         server may run out of descriptors before the cap; it then closes idle connections"
                    );
                }
                n.min(usize::MAX as u64) as usize
            }
            None => crate::connections::default_max_connections(),
        };
        crate::connections::Limits {
            header_timeout: self.header_timeout,
            idle_timeout: self.idle_timeout,
            max_connections,
        }
    }

    /// The server configuration these flags describe, or why they do not fit together.
    pub fn config(&self) -> Result<ServeConfig, String> {
        if self.evict_low > self.evict_high {
            return Err(format!("--evict-low {} is above --evict-high {}", self.evict_low, self.evict_high));
        }
        let ms = |d: Duration| d.as_millis().min(u128::from(u64::MAX)) as u64;
        let reservation_ttl = ms(self.reservation_ttl).max(1);
        let limits = crate::plugin::Limits {
            memory: self.plugin_memory_mib << 20,
            call: self.plugin_budget,
            ..crate::plugin::Limits::default()
        };
        if self.plugin.is_some() && self.engine != EngineKind::Wasm {
            return Err("--plugin needs --engine wasm".into());
        }
        let plugin = match &self.plugin {
            Some(path) => crate::server::PluginConfig::from_file(path, limits, self.plugin_calls)?,
            None => crate::server::PluginConfig { loaded: None, limits, calls: self.plugin_calls },
        };
        Ok(ServeConfig {
            engine: self.engine,
            plugin,
            max_body: self.max_body,
            request_timeout: self.request_timeout,
            settings: Settings {
                reservation_ttl,
                world_size: self.world_size,
                read_lease: ms(self.read_lease),
                quarantine: self.quarantine.map_or(reservation_ttl, ms),
                eviction: match self.eviction {
                    EvictionArg::Lru => Eviction::Lru,
                    EvictionArg::Off => Eviction::Off,
                },
                evict_high_permille: (self.evict_high * 1000.0).round() as u16,
                evict_low_permille: (self.evict_low * 1000.0).round() as u16,
            },
            durability: (!self.in_memory).then(|| crate::server::DurableConfig {
                dir: self.data_dir.clone(),
                fsync: self.fsync,
                snapshot_every: self.snapshot_every.max(1),
                snapshot_interval: self.snapshot_interval,
            }),
            access: crate::access::Access {
                allow: self.allow.clone(),
                admin_token: match self.admin_token.as_deref() {
                    Some("") => return Err("--admin-token is empty".into()),
                    t => t.map(Into::into),
                },
            },
            connections: self.connections(),
            bench_floor: false,
        })
    }
}

pub(crate) fn init_logging(filter: &str) -> Result<(), String> {
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
        Cmd::Bench(args) => crate::bench::main(args),
        Cmd::Stats(args) => query(&args, "/stats".to_owned()),
        Cmd::Inspect(args) => query(&args.server, format!("/admin/keys/{}", percent_encode(&args.key))),
        Cmd::ImportSglang(args) => import_sglang(&args),
        Cmd::ExportSglang(args) => export_sglang(&args),
        Cmd::Forward(args) => crate::forward::main(args),
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
    let config = args.config()?;
    let threads = args.threads.unwrap_or_else(server::default_threads);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(server::SERVER_THREAD)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", bracket_v6(&args.host), args.port)
            .parse()
            .map_err(|e| format!("--host {} --port {}: {e}", args.host, args.port))?;
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let seed = random_seed();
        let engine = server::try_build_engine(&config, seed)?;
        tracing::info!(
            engine = %config.engine,
            threads,
            world_size = ?config.settings.world_size,
            max_body = config.max_body,
            request_timeout = ?config.request_timeout,
            reservation_ttl_ms = config.settings.reservation_ttl,
            "starting"
        );
        let limits = config.connections;
        let (router, handle) = server::build(config, engine)?;
        // Serve at once (503 `recovering` until the state is back), recover meanwhile.
        let serving = tokio::spawn(server::run_with(listener, router, limits, server::shutdown_signal()));
        let started = match &args.import_sglang {
            Some(path) => match handle.start(seed).await {
                Ok(()) => handle.import_sglang(path).await,
                Err(e) => Err(e),
            },
            None => handle.start(seed).await,
        };
        if let Err(e) = started {
            serving.abort();
            return Err(e);
        }
        let result = serving.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string());
        handle.stop().await;
        result
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

/// `GET path` on a running server; prints the JSON body, fails on an error status.
fn query(args: &QueryArgs, path: String) -> Result<(), String> {
    let url = &args.url;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut client = args.connect().await?;
        let resp = client.get(&path).await.map_err(|e| format!("{url}{path}: {e}"))?;
        let text = String::from_utf8_lossy(&resp.body);
        let pretty = serde_json::from_slice::<serde_json::Value>(&resp.body)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| text.into_owned());
        if (200..300).contains(&resp.status) {
            println!("{pretty}");
            Ok(())
        } else {
            Err(format!("{url}{path} answered {}: {pretty}", resp.status))
        }
    })
}

/// Escapes everything but unreserved characters, for a key in a URL path.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn import_sglang(args: &ImportArgs) -> Result<(), String> {
    let body = std::fs::read(&args.file).map_err(|e| format!("{}: {e}", args.file.display()))?;
    eprintln!("kvpages: sending {} ({} bytes) to {}", args.file.display(), body.len(), args.server.url);
    let path = if args.replace { "/admin/import/sglang?replace=true" } else { "/admin/import/sglang" };
    let url = &args.server.url;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut client = args.server.connect().await?;
        let started = std::time::Instant::now();
        // The server does the work (its log shows the parsing progress); say every second that
        // it is still going, so a large import does not look hung.
        let post = client.post(path, body);
        tokio::pin!(post);
        let every = Duration::from_secs(1);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let resp = loop {
            tokio::select! {
                resp = &mut post => break resp,
                _ = tick.tick() => eprintln!(
                    "kvpages: import: the server is still importing, {:.0} s (its log shows the progress)",
                    started.elapsed().as_secs_f64()
                ),
            }
        };
        let resp = resp.map_err(|e| format!("{url}{path}: {e}"))?;
        let text = String::from_utf8_lossy(&resp.body);
        if (200..300).contains(&resp.status) {
            if let Some(line) = import_summary(&resp.body) {
                eprintln!("kvpages: {line}");
            }
            println!("{text}");
            Ok(())
        } else {
            Err(format!("{url}{path} answered {}: {text}", resp.status))
        }
    })
}

/// The final line of an import, from the server's reply
/// (`{"pools":P,"keys":K,"leaked_pages":L,"seconds":S}`).
fn import_summary(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let (pools, keys, leaked, secs) =
        (v["pools"].as_u64()?, v["keys"].as_u64()?, v["leaked_pages"].as_u64()?, v["seconds"].as_f64()?);
    Some(format!(
        "import: done, {keys} keys of {pools} pools in {secs:.2} s ({:.0} keys/s), {leaked} leaked pages made free",
        keys as f64 / secs.max(1e-9)
    ))
}

fn export_sglang(args: &ExportArgs) -> Result<(), String> {
    let url = &args.server.url;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let body = rt.block_on(async {
        let mut client = args.server.connect().await?;
        let resp = client.get("/admin/export/sglang").await.map_err(|e| format!("{url}: {e}"))?;
        if (200..300).contains(&resp.status) {
            Ok(resp.body)
        } else {
            Err(format!("{url}/admin/export/sglang answered {}: {}", resp.status, String::from_utf8_lossy(&resp.body)))
        }
    })?;
    // Written beside the target and renamed, so a crash never leaves half a file.
    let tmp = args.file.with_extension("tmp");
    std::fs::write(&tmp, &body)
        .and_then(|()| std::fs::rename(&tmp, &args.file))
        .map_err(|e| format!("{}: {e}", args.file.display()))?;
    eprintln!("kvpages: wrote {} ({} bytes)", args.file.display(), body.len());
    Ok(())
}

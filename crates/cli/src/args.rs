//! The `kvpages` command line: every flag also reads a `KVPAGES_*` environment variable. The
//! flags become the library's plain configurations here (`kvpages_host::config::ServeConfig`,
//! `kvpages_bench::Options`), so clap stays in the binary.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kvpages_bench::{Options, TargetSpec, Workload};
use kvpages_core::{Eviction, Settings};
use kvpages_host::config::{DurableConfig, PluginConfig, ServeConfig};
use kvpages_host::engine::EngineKind;
use kvpages_host::plugin::Calls;

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
    Bench(BenchArgs),
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
    Forward(ForwardArgs),
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
    pub async fn connect(&self) -> Result<kvpages_host::client::Client, String> {
        let client =
            kvpages_host::client::Client::connect_url(&self.url).await.map_err(|e| format!("{}: {e}", self.url))?;
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
    #[arg(long, env = "KVPAGES_ENGINE", value_enum, default_value_t = EngineArg::Wasm)]
    pub engine: EngineArg,
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
    #[arg(long, env = "KVPAGES_PLUGIN_CALLS", value_enum, default_value_t = CallsArg::Auto)]
    pub plugin_calls: CallsArg,
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
    #[arg(long, env = "KVPAGES_FSYNC", default_value_t = kvpages_host::durable::FsyncMode::default())]
    pub fsync: kvpages_host::durable::FsyncMode,
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
    #[arg(long, env = "KVPAGES_ALLOW", value_parser = kvpages_host::access::parse_allow)]
    pub allow: Option<kvpages_host::access::AllowList>,
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

/// `--engine` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineArg {
    /// `kvpages-core` compiled to a WebAssembly component, run in a wasmtime sandbox (a fault
    /// in the core is contained).
    Wasm,
    /// `kvpages-core` compiled into the server.
    Native,
}

impl From<EngineArg> for EngineKind {
    fn from(e: EngineArg) -> EngineKind {
        match e {
            EngineArg::Wasm => EngineKind::Wasm,
            EngineArg::Native => EngineKind::Native,
        }
    }
}

/// `--plugin-calls` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CallsArg {
    /// The direct entry point when the component's core module has it, else the WIT interface.
    Auto,
    /// The direct entry point; a component without it is refused.
    Direct,
    /// The WIT interface, always (what any other component-model host uses).
    Wit,
}

impl From<CallsArg> for Calls {
    fn from(c: CallsArg) -> Calls {
        match c {
            CallsArg::Auto => Calls::Auto,
            CallsArg::Direct => Calls::Direct,
            CallsArg::Wit => Calls::Wit,
        }
    }
}

/// Flags of `kvpages bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Measure the server at this loopback URL (http://127.0.0.1:PORT) instead of an
    /// in-process one. It is cleared (POST /clear) repeatedly: pass --wipe to allow that.
    #[arg(long)]
    pub url: Option<String>,
    /// Also measure this loopback server (e.g. vLLM's hf3fs_metadata_server.py) on the same
    /// workloads, right after kvpages, and print kvpages/peer ratios. Needs --wipe.
    #[arg(long)]
    pub peer: Option<String>,
    /// Name of the --peer server in the results.
    #[arg(long, default_value = "vllm-0.33.0-python")]
    pub peer_name: String,
    /// Allow the bench to clear the --url and --peer servers' state.
    #[arg(long)]
    pub wipe: bool,
    /// Workloads to run (comma-separated); all by default.
    #[arg(long, value_delimiter = ',', value_parser = workload_parser())]
    pub workload: Vec<Workload>,
    /// Concurrent connections (comma-separated list: one measurement each).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub concurrency: Vec<usize>,
    /// Seconds each run of a measurement lasts (after its warm-up).
    #[arg(long, default_value = "3", value_parser = parse_seconds)]
    pub duration: Duration,
    /// Seconds each --peer measurement runs (default: --duration).
    #[arg(long, value_parser = parse_seconds)]
    pub peer_duration: Option<Duration>,
    /// Warm-up seconds before each measurement (not counted; 0 for none).
    #[arg(long, default_value = "0.5", value_parser = parse_warmup)]
    pub warmup: Duration,
    /// Runs of each measurement; kvpages, floor and peer alternate run by run, and the runs
    /// are pooled (requests and seconds add up, latency samples merge).
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    /// Runs of each --peer measurement (default: --repeat).
    #[arg(long)]
    pub peer_repeat: Option<u32>,
    /// Stop each run after this many requests, if the duration has not ended it first.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Measure memory instead of load: the RSS growth per stored key when --keys 32-hex keys
    /// are stored on each of --ranks ranks, per engine of --engines (each in a process of its
    /// own), the peak RSS while a snapshot of that state is taken, and the time and RSS of
    /// initializing a 10^8-page rank.
    #[arg(long)]
    pub memory: bool,
    /// Keys stored by --memory (on every rank).
    #[arg(long, alias = "memory-keys", default_value_t = 1_000_000)]
    pub keys: u32,
    /// Ranks every key is stored on by --memory.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub ranks: u32,
    /// Engines --memory measures, comma-separated, each in a process of its own.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "native,wasm")]
    pub engines: Vec<EngineArg>,
    /// Worker threads of the in-process server, and as many for the generator (default: half
    /// the CPUs each, at least 1: the two sides split the machine instead of both competing
    /// for every core; `kvpages serve`'s default too).
    #[arg(long, value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// Log filter of the in-process server.
    #[arg(long, default_value = "error")]
    pub log: String,
    /// In-process servers to measure, comma-separated: `default` (what `kvpages serve` runs:
    /// the wasm plugin on a data directory with `--fsync always`), `ENGINE` (in memory) or
    /// `ENGINE/FSYNC` (durable, `--fsync FSYNC`), e.g. `default,native,wasm,native/always`. The
    /// first is the reference (`kvpages` in the results, compared with the floor and the peer);
    /// every other is also reported as a ratio to it. Runs alternate target by target. Default:
    /// `default`. Not with --url.
    #[arg(long, value_delimiter = ',')]
    pub targets: Vec<TargetSpec>,
    /// Where durable --targets keep their state: a fresh subdirectory each, emptied first and
    /// removed at the end.
    #[arg(long, default_value = "target/bench/data")]
    pub data_dir: PathBuf,
}

/// `--workload` values: the workloads' own names.
fn workload_parser() -> impl clap::builder::TypedValueParser<Value = Workload> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(Workload::ALL.map(Workload::name))
        .map(|name| name.parse::<Workload>().expect("a possible value"))
}

/// Seconds of warm-up: 0 for none, or a positive number.
fn parse_warmup(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" { Ok(Duration::ZERO) } else { parse_seconds(s) }
}

impl From<BenchArgs> for Options {
    fn from(a: BenchArgs) -> Options {
        Options {
            url: a.url,
            peer: a.peer,
            peer_name: a.peer_name,
            wipe: a.wipe,
            workload: a.workload,
            concurrency: a.concurrency,
            duration: a.duration,
            peer_duration: a.peer_duration,
            warmup: a.warmup,
            repeat: a.repeat,
            peer_repeat: a.peer_repeat,
            requests: a.requests,
            json: a.json,
            memory: a.memory,
            keys: a.keys,
            ranks: a.ranks,
            engines: a.engines.into_iter().map(EngineKind::from).collect(),
            threads: a.threads,
            log: a.log,
            targets: a.targets,
            data_dir: a.data_dir,
        }
    }
}

/// Flags of `kvpages forward`.
#[derive(Debug, Args)]
pub struct ForwardArgs {
    /// Address to listen on: vLLM's client dials localhost:18000.
    #[arg(long, env = "KVPAGES_FORWARD_LISTEN", default_value = "127.0.0.1:18000")]
    pub listen: SocketAddr,
    /// The metadata server, `http://HOST:PORT` (a name is resolved on every new connection).
    #[arg(long, env = "KVPAGES_FORWARD_TO")]
    pub to: String,
    /// Seconds to wait for the server to accept a connection before answering 502.
    #[arg(long, env = "KVPAGES_FORWARD_CONNECT_TIMEOUT", default_value = "3", value_parser = parse_seconds)]
    pub connect_timeout: Duration,
    /// Log filter: error, warn (server unreachable), info, debug (one line per connection).
    #[arg(long, env = "KVPAGES_LOG", default_value = "info")]
    pub log: String,
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
    pub fn connections(&self) -> kvpages_host::connections::Limits {
        let max_connections = match self.max_connections {
            Some(n) => {
                if let Some(limit) = kvpages_host::connections::descriptor_limit().filter(|&l| n >= l) {
                    tracing::warn!(
                        "--max-connections {n} is at or above the descriptor limit ({limit}, ulimit -n): the \
                         server may run out of descriptors before the cap; it then closes idle connections"
                    );
                }
                n.min(usize::MAX as u64) as usize
            }
            None => kvpages_host::connections::default_max_connections(),
        };
        kvpages_host::connections::Limits {
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
        let limits = kvpages_host::plugin::Limits {
            memory: self.plugin_memory_mib << 20,
            call: self.plugin_budget,
            ..kvpages_host::plugin::Limits::default()
        };
        let engine = self.engine.into();
        let calls = self.plugin_calls.into();
        if self.plugin.is_some() && engine != EngineKind::Wasm {
            return Err("--plugin needs --engine wasm".into());
        }
        let plugin = match &self.plugin {
            Some(path) => PluginConfig::from_file(path, limits, calls)?,
            None => PluginConfig { loaded: None, limits, calls },
        };
        Ok(ServeConfig {
            engine,
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
            durability: (!self.in_memory).then(|| DurableConfig {
                dir: self.data_dir.clone(),
                fsync: self.fsync,
                snapshot_every: self.snapshot_every.max(1),
                snapshot_interval: self.snapshot_interval,
            }),
            access: kvpages_host::access::Access {
                allow: self.allow.clone(),
                admin_token: match self.admin_token.as_deref() {
                    Some("") => return Err("--admin-token is empty".into()),
                    t => t.map(Into::into),
                },
            },
            connections: self.connections(),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use kvpages_host::access::parse_allow;

    use super::*;

    /// The flags as `kvpages serve` parses them (and their variables).
    #[test]
    fn serve_flags() {
        let cli = Cli::try_parse_from([
            "kvpages",
            "serve",
            "--in-memory",
            "--allow",
            "127.0.0.1/32,10.0.0.0/8",
            "--admin-token",
            "t0k",
        ])
        .unwrap();
        let Cmd::Serve(args) = cli.command else { panic!("not serve") };
        let access = args.config().unwrap().access;
        assert_eq!(access.allow, Some(parse_allow("127.0.0.1/32,10.0.0.0/8").unwrap()));
        assert_eq!(access.admin_token.as_deref(), Some("t0k"));
        let bad = Cli::try_parse_from(["kvpages", "serve", "--allow", "10.0.0.0/40"]);
        assert!(bad.unwrap_err().to_string().contains("prefix length"));
        let open = Cli::try_parse_from(["kvpages", "serve", "--in-memory"]).unwrap();
        let Cmd::Serve(args) = open.command else { panic!("not serve") };
        let from_env = ["KVPAGES_ALLOW", "KVPAGES_ADMIN_TOKEN"].iter().any(|v| std::env::var_os(v).is_some());
        assert!(args.config().unwrap().access.is_open() || from_env);
    }

    #[test]
    fn forward_flags() {
        let cli = Cli::try_parse_from(["kvpages", "forward", "--to", "http://10.0.0.5:18000"]).unwrap();
        let Cmd::Forward(args) = cli.command else { panic!("not forward") };
        if std::env::var_os("KVPAGES_FORWARD_LISTEN").is_none() {
            assert_eq!(args.listen, "127.0.0.1:18000".parse().unwrap(), "vLLM dials localhost:18000");
        }
        assert_eq!(args.to.parse::<kvpages_host::forward::Target>().unwrap().port, 18000);
    }
}

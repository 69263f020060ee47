//! `kvpages bench`: a load generator for vLLM's routes, and the transport-only floor it is
//! compared with.
//!
//! # How a run goes
//! An in-process server (the same router `kvpages serve` runs, on 127.0.0.1:0, with the floor
//! route switched on) is started on its own tokio runtime; the generator runs on another. For
//! each workload it sets the server up (`/clear`, rank 0, stored keys), then for each
//! concurrency runs N keep-alive connections against:
//! 1. kvpages (the in-process server, or `--url`),
//! 2. the floor: the same request bodies sent to [`FLOOR_PATH`], which reads the body through
//!    the same stack (guard, body limit) and answers a reply of the size the real route gave,
//!    without parsing or touching the engine,
//! 3. optionally a peer (`--peer`, e.g. vLLM's Python server).
//!
//! Every number is reported beside the floor measured at the same concurrency in the same run,
//! because the machine is small and shared and absolute numbers move from run to run.
//!
//! The allocating workloads never exhaust the 1,000,000-page pool: a round ends before its
//! pages run out, and the server is cleared and rank 0 re-initialized (rather than a
//! `/keys/delete` per iteration, which would add a request to what is measured); that pause is
//! not counted.
//!
//! - `workload`: the workloads, their server state and the per-connection loop.
//! - `memory`: `--memory`, RSS per stored key and the cost of a 10^8-page rank.

mod memory;
mod workload;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kvpages_core::Eviction;
use kvpages_host::api::{json_bytes, no_content};
use kvpages_host::app::try_build_engine;
use kvpages_host::client::{Client, loopback_addr};
use kvpages_host::config::{DurableConfig, ServeConfig};
use kvpages_host::durable::FsyncMode;
use kvpages_host::engine::EngineKind;
use kvpages_host::runtime::{SERVER_THREAD, default_threads, server_runtime};
use kvpages_host::server::{self, ExtraRoute};
use serde::Serialize;

pub use self::workload::Workload;
use self::workload::{Fixture, KeyGen, Mode, Run, Tally, Worker};

/// The floor route's path.
pub const FLOOR_PATH: &str = "/bench/floor";

/// The largest reply the floor sends.
const MAX_FLOOR_REPLY: usize = 16 * 1024 * 1024;

/// `POST /bench/floor?reply=N`: reads the body like every route, answers `N` bytes (204 when
/// `N` is 0) without looking at the body or the engine. The in-process server registers it
/// beside the real routes ([`server::build_with`]).
pub fn floor_route() -> ExtraRoute {
    ExtraRoute::post(FLOOR_PATH, "bench_floor", |query, _body| {
        let n = query.and_then(|q| q.strip_prefix("reply=")).and_then(|n| n.parse::<usize>().ok());
        let n = n.unwrap_or(0).min(MAX_FLOOR_REPLY);
        if n == 0 {
            return no_content();
        }
        // A JSON string of n bytes, so the reply is well-formed JSON like the real ones.
        let mut reply = vec![b'x'; n];
        reply[0] = b'"';
        reply[n - 1] = b'"';
        json_bytes(StatusCode::OK, reply)
    })
}

/// What `kvpages bench` measures and how (its flags; `kvpages bench --help` has the defaults).
#[derive(Debug, Clone)]
pub struct Options {
    /// Measure the server at this loopback URL (http://127.0.0.1:PORT) instead of an
    /// in-process one. It is cleared (POST /clear) repeatedly: pass --wipe to allow that.
    pub url: Option<String>,
    /// Also measure this loopback server (e.g. vLLM's hf3fs_metadata_server.py) on the same
    /// workloads, right after kvpages, and print kvpages/peer ratios. Needs --wipe.
    pub peer: Option<String>,
    /// Name of the --peer server in the results.
    pub peer_name: String,
    /// Allow the bench to clear the --url and --peer servers' state.
    pub wipe: bool,
    /// Workloads to run (comma-separated); all by default.
    pub workload: Vec<Workload>,
    /// Concurrent connections (comma-separated list: one measurement each).
    pub concurrency: Vec<usize>,
    /// Seconds each run of a measurement lasts (after its warm-up).
    pub duration: Duration,
    /// Seconds each --peer measurement runs (default: --duration).
    pub peer_duration: Option<Duration>,
    /// Warm-up seconds before each measurement (not counted; 0 for none).
    pub warmup: Duration,
    /// Runs of each measurement; kvpages, floor and peer alternate run by run, and the runs
    /// are pooled (requests and seconds add up, latency samples merge).
    pub repeat: u32,
    /// Runs of each --peer measurement (default: --repeat).
    pub peer_repeat: Option<u32>,
    /// Stop each run after this many requests, if the duration has not ended it first.
    pub requests: Option<u64>,
    /// Write the results as JSON to this file.
    pub json: Option<PathBuf>,
    /// Measure memory instead of load: the RSS growth per stored key when `keys` 32-hex keys
    /// are stored on each of `ranks` ranks, per engine of `engines` (each in a process of its
    /// own), the peak RSS while a snapshot of that state is taken, and the time and RSS of
    /// initializing a 10^8-page rank.
    pub memory: bool,
    /// Keys stored by --memory (on every rank).
    pub keys: u32,
    /// Ranks every key is stored on by --memory.
    pub ranks: u32,
    /// Engines --memory measures.
    pub engines: Vec<EngineKind>,
    /// Worker threads of the in-process server, and as many for the generator (default: half
    /// the CPUs each, at least 1: the two sides split the machine instead of both competing
    /// for every core; `kvpages serve`'s default too).
    pub threads: Option<usize>,
    /// Log filter of the in-process server.
    pub log: String,
    /// In-process servers to measure: see [`TargetSpec`]. The first is the reference (`kvpages`
    /// in the results, compared with the floor and the peer); every other is also reported as a
    /// ratio to it. Runs alternate target by target. Default: [`TargetSpec::serve_default`].
    /// Not with --url.
    pub targets: Vec<TargetSpec>,
    /// Where durable --targets keep their state: a fresh subdirectory each, emptied first and
    /// removed at the end.
    pub data_dir: PathBuf,
}

/// One in-process server of `--targets`: an engine, in memory or durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetSpec {
    /// The engine it runs.
    pub engine: EngineKind,
    /// `None`: in memory; `Some`: a data directory with this `--fsync` mode.
    pub fsync: Option<FsyncMode>,
}

impl TargetSpec {
    /// What `kvpages serve` runs with no flags: the default engine on a data directory with the
    /// default `--fsync` (`default` in `--targets`).
    pub fn serve_default() -> TargetSpec {
        TargetSpec { engine: ServeConfig::default().engine, fsync: Some(FsyncMode::default()) }
    }

    /// `memory`, `fsync-always` or `fsync-interval-MSms`: the durability label of the results.
    pub fn durability(&self) -> String {
        match self.fsync {
            None => "memory".into(),
            Some(FsyncMode::Always) => "fsync-always".into(),
            Some(FsyncMode::Interval(d)) => format!("fsync-interval-{}ms", d.as_millis()),
        }
    }
}

impl std::str::FromStr for TargetSpec {
    type Err = String;
    /// `default`, `ENGINE` (in memory) or `ENGINE/FSYNC` (durable, `--fsync FSYNC`).
    fn from_str(s: &str) -> Result<TargetSpec, String> {
        if s.trim() == "default" {
            return Ok(TargetSpec::serve_default());
        }
        let (engine, fsync) = match s.split_once('/') {
            Some((e, f)) => (e, Some(f.parse::<FsyncMode>()?)),
            None => (s, None),
        };
        let engine = engine.trim().parse::<EngineKind>().map_err(|e| format!("'{s}': {e}"))?;
        Ok(TargetSpec { engine, fsync })
    }
}

/// One measured server.
#[derive(Clone, Debug, Serialize)]
struct Target {
    /// `kvpages`, `floor` or the peer's name.
    name: String,
    /// Engine that answered (`native`; `none` for the floor; the peer's name).
    engine: String,
    /// Where the state lives: `memory`, `fsync-always`, `fsync-interval-MSms` (`unreported`
    /// for a --url server, whose /health does not say).
    durability: String,
    #[serde(skip)]
    addr: SocketAddr,
    /// Where `pool-full` runs: the in-process server has a second instance with eviction off.
    #[serde(skip)]
    pool_full_addr: SocketAddr,
    #[serde(skip)]
    duration: Duration,
    /// Runs in this process (its server CPU is measured).
    #[serde(skip)]
    in_process: bool,
}

impl Target {
    fn addr_for(&self, w: Workload) -> SocketAddr {
        if w == Workload::PoolFull { self.pool_full_addr } else { self.addr }
    }
}

/// Latency percentiles in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Latency {
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    mean_us: f64,
}

impl Latency {
    fn of(samples: &mut [u64]) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_unstable();
        let n = samples.len();
        let at = |q: f64| samples[((q * n as f64).ceil() as usize).clamp(1, n) - 1] as f64 / 1e3;
        Latency {
            p50_us: at(0.50),
            p99_us: at(0.99),
            p999_us: at(0.999),
            max_us: samples[n - 1] as f64 / 1e3,
            mean_us: samples.iter().sum::<u64>() as f64 / n as f64 / 1e3,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
struct StepResult {
    route: String,
    requests: u64,
    mean_body_bytes: u64,
    mean_reply_bytes: u64,
    latency: Latency,
}

/// One (target, workload, concurrency) measurement.
#[derive(Clone, Debug, Serialize)]
struct Measurement {
    target: String,
    engine: String,
    durability: String,
    workload: String,
    keys_per_iteration: usize,
    concurrency: usize,
    seconds: f64,
    requests: u64,
    iterations: u64,
    errors: u64,
    first_error: Option<String>,
    requests_per_s: f64,
    keys_per_s: f64,
    /// requests/s of each run alone.
    runs_requests_per_s: Vec<f64>,
    /// Every request of the workload, all steps together.
    latency: Latency,
    steps: Vec<StepResult>,
    /// Pool rounds ended (clear + re-initialize) during this measurement.
    pool_resets: u64,
    paused_s: f64,
    /// CPU time the in-process servers' threads ran per recorded request, in µs (pool resets
    /// left out); `None` for a server in another process (the peer, `--url`).
    server_cpu_us_per_request: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
struct Ratio {
    workload: String,
    concurrency: usize,
    /// kvpages requests/s ÷ floor requests/s.
    vs_floor: Option<f64>,
    /// kvpages requests/s ÷ peer requests/s.
    vs_peer: Option<f64>,
    /// kvpages p50 ÷ floor p50.
    p50_vs_floor: Option<f64>,
    /// `vs_floor` of each run alone (how much the machine's noise moves it).
    runs_vs_floor: Vec<f64>,
    /// The floor's server CPU per request ÷ kvpages': the share of the floor's throughput a
    /// busy server thread would keep. Steadier than `vs_floor` on a shared machine: time the
    /// machine gives to others is not counted.
    cpu_vs_floor: Option<f64>,
    /// The other `--targets` at this point, each against the reference (`kvpages`).
    others: Vec<OtherRatio>,
}

/// One non-reference target of `--targets` at one (workload, concurrency).
#[derive(Clone, Debug, Serialize)]
struct OtherRatio {
    target: String,
    engine: String,
    durability: String,
    requests_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// Its requests/s ÷ the floor's.
    vs_floor: Option<f64>,
    /// Its requests/s ÷ the reference's (`kvpages`).
    vs_reference: Option<f64>,
    /// `vs_reference` of each run alone (run i of both).
    runs_vs_reference: Vec<f64>,
    /// The reference's server CPU per request ÷ its own (see [`Ratio::cpu_vs_floor`]).
    cpu_vs_reference: Option<f64>,
}

#[derive(Debug, Serialize, serde::Deserialize)]
pub(crate) struct Machine {
    nproc: usize,
    cpu: String,
    mem_total_kib: u64,
}

impl Machine {
    pub(crate) fn read() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_total_kib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0);
        Machine { nproc: std::thread::available_parallelism().map_or(1, |n| n.get()), cpu, mem_total_kib }
    }
}

#[derive(Serialize)]
struct Report<'a> {
    kind: &'static str,
    machine: Machine,
    command: Vec<String>,
    pool: String,
    warmup_s: f64,
    targets: &'a [Target],
    results: &'a [Measurement],
    ratios: &'a [Ratio],
}

/// The in-process servers, on a runtime of their own so that the generator's tasks never share
/// a worker thread's queue with them. Per `--targets` entry, two: the default configuration, and
/// one with eviction off for `pool-full` (a full pool answers -1 there, as vLLM's server does; by
/// default it would evict). Only one is under load at a time.
struct InProcess {
    runtime: tokio::runtime::Runtime,
    /// Per `--targets` entry: it, its address, its `pool-full` server's address.
    servers: Vec<(TargetSpec, SocketAddr, SocketAddr)>,
    stop: Vec<tokio::sync::oneshot::Sender<()>>,
    /// Data directories to remove at the end.
    dirs: Vec<PathBuf>,
}

impl InProcess {
    fn start(threads: usize, specs: &[TargetSpec], data_dir: &std::path::Path) -> Result<InProcess, String> {
        let runtime = server_runtime(threads)?;
        let mut this = InProcess { runtime, servers: Vec::new(), stop: Vec::new(), dirs: Vec::new() };
        for (i, spec) in specs.iter().enumerate() {
            let mut addrs = Vec::new();
            for (j, eviction) in [Eviction::Lru, Eviction::Off].into_iter().enumerate() {
                let mut config = ServeConfig { engine: spec.engine, ..ServeConfig::default() };
                config.settings.eviction = eviction;
                if let Some(fsync) = spec.fsync {
                    let dir = data_dir.join(format!("{i}-{}-{}-{j}", spec.engine, spec.durability()));
                    if dir.exists() {
                        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                    }
                    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                    this.dirs.push(dir.clone());
                    config.durability = Some(DurableConfig {
                        dir,
                        fsync,
                        // `kvpages serve`'s defaults.
                        snapshot_every: 1_000_000,
                        snapshot_interval: Duration::from_secs(300),
                    });
                }
                addrs.push(this.serve(config)?);
            }
            this.servers.push((*spec, addrs[0], addrs[1]));
        }
        Ok(this)
    }

    /// Starts one server (recovering it first when durable) and returns its address.
    fn serve(&mut self, config: ServeConfig) -> Result<SocketAddr, String> {
        const SEED: u64 = 0x6b76_7061_6765_7321;
        let listener = self
            .runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .map_err(|e| format!("cannot listen on 127.0.0.1:0: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let (router, handle) =
            server::build_with(config.clone(), try_build_engine(&config, SEED)?, vec![floor_route()])?;
        self.runtime.block_on(handle.start(SEED))?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.stop.push(tx);
        self.runtime.spawn(async move {
            if let Err(e) = server::run(listener, router, async move {
                let _ = rx.await;
            })
            .await
            {
                tracing::error!("in-process server failed: {e}");
            }
        });
        Ok(addr)
    }

    fn stop(self) {
        for tx in self.stop {
            let _ = tx.send(());
        }
        self.runtime.shutdown_timeout(Duration::from_secs(2));
        for dir in self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Entry point of `kvpages bench`.
pub fn main(args: Options) -> Result<(), String> {
    kvpages_host::runtime::init_logging(&args.log)?;
    if args.memory {
        return memory::run(&args);
    }
    if (args.url.is_some() || args.peer.is_some()) && !args.wipe {
        return Err("the bench clears the servers it measures (POST /clear): add --wipe to allow it".into());
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        return Err("--concurrency needs numbers of at least 1".into());
    }
    if args.url.is_some() && !args.targets.is_empty() {
        return Err("--targets names in-process servers; --url measures another one: pick one of them".into());
    }
    let default = [TargetSpec::serve_default()];
    let specs = if args.targets.is_empty() { &default[..] } else { &args.targets[..] };
    let threads = args.threads.unwrap_or_else(default_threads);
    let server = InProcess::start(threads, specs, &args.data_dir)?;
    let generator = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("kvpages-bench")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let result = generator.block_on(load(&args, &server));
    drop(generator);
    server.stop();
    result
}

async fn describe(addr: SocketAddr, name: String, duration: Duration) -> Result<Target, String> {
    // kvpages answers /health with its engine; a server without it (the peer) is named by flag.
    let mut c = Client::connect(addr).await.map_err(|e| format!("{addr}: {e}"))?;
    let health = c.get("/health").await.map_err(|e| format!("{addr}: {e}"))?;
    let field = |v: &serde_json::Value, f: &str| v.get(f).and_then(|e| e.as_str()).map(str::to_owned);
    let parsed =
        (health.status == 200).then(|| serde_json::from_slice::<serde_json::Value>(&health.body).ok()).flatten();
    let engine = parsed.as_ref().and_then(|v| field(v, "engine")).unwrap_or_else(|| name.clone());
    let durability = parsed.as_ref().and_then(|v| field(v, "durability")).unwrap_or_else(|| "unreported".into());
    Ok(Target { name, engine, durability, addr, pool_full_addr: addr, duration, in_process: false })
}

/// The kvpages servers (the first is the reference, `kvpages`), the floor and the peer.
async fn targets(args: &Options, server: &InProcess) -> Result<(Vec<Target>, Target, Option<Target>), String> {
    // The kvpages servers: the first is the reference (`kvpages`).
    let kv: Vec<Target> = match &args.url {
        Some(url) => {
            vec![describe(loopback_addr(url).map_err(|e| e.to_string())?, "kvpages".into(), args.duration).await?]
        }
        None => server
            .servers
            .iter()
            .enumerate()
            .map(|(i, &(spec, addr, pool_full_addr))| Target {
                name: if i == 0 { "kvpages".into() } else { format!("kvpages-{}-{}", spec.engine, spec.durability()) },
                engine: spec.engine.to_string(),
                durability: spec.durability(),
                addr,
                pool_full_addr,
                duration: args.duration,
                in_process: true,
            })
            .collect(),
    };
    let (_, floor_addr, floor_pool_full_addr) = server.servers[0];
    let floor = Target {
        name: "floor".into(),
        engine: "none".into(),
        durability: "none".into(),
        addr: floor_addr,
        pool_full_addr: floor_pool_full_addr,
        duration: args.duration,
        in_process: true,
    };
    let peer = match &args.peer {
        Some(url) => Some(
            describe(
                loopback_addr(url).map_err(|e| e.to_string())?,
                args.peer_name.clone(),
                args.peer_duration.unwrap_or(args.duration),
            )
            .await?,
        ),
        None => None,
    };
    Ok((kv, floor, peer))
}

/// The floor's mode for `w`: each step answered with the mean reply size the real route gave
/// in `raw`.
fn floor_mode_of(w: Workload, raw: &Raw) -> Mode {
    let replies = (0..w.steps().len())
        .map(|i| {
            let n: usize = raw.tallies.iter().map(|t| t.samples[i].len()).sum();
            let bytes: u64 = raw.tallies.iter().map(|t| t.reply_bytes[i]).sum();
            format!("{FLOOR_PATH}?reply={}", bytes.checked_div(n as u64).unwrap_or(0))
        })
        .collect();
    Mode::floor(w, replies)
}

/// The reference's ratios at one point: to the floor, to the peer, and each other kvpages
/// target's to the reference.
fn ratio(
    w: Workload,
    c: usize,
    real: &Measurement,
    base: &Measurement,
    other: Option<&Measurement>,
    extra: &[Measurement],
) -> Ratio {
    let div = |a: f64, b: f64| (b > 0.0 && a > 0.0).then_some(a / b);
    let runs = |a: &[f64], b: &[f64]| a.iter().zip(b).filter_map(|(&a, &b)| div(a, b)).collect::<Vec<_>>();
    let others = extra
        .iter()
        .map(|m| OtherRatio {
            target: m.target.clone(),
            engine: m.engine.clone(),
            durability: m.durability.clone(),
            requests_per_s: m.requests_per_s,
            p50_us: m.latency.p50_us,
            p99_us: m.latency.p99_us,
            vs_floor: div(m.requests_per_s, base.requests_per_s),
            vs_reference: div(m.requests_per_s, real.requests_per_s),
            runs_vs_reference: runs(&m.runs_requests_per_s, &real.runs_requests_per_s),
            cpu_vs_reference: cpu_ratio(real, m),
        })
        .collect();
    Ratio {
        workload: w.name().into(),
        concurrency: c,
        vs_floor: div(real.requests_per_s, base.requests_per_s),
        vs_peer: other.and_then(|o| div(real.requests_per_s, o.requests_per_s)),
        p50_vs_floor: div(real.latency.p50_us, base.latency.p50_us),
        runs_vs_floor: runs(&real.runs_requests_per_s, &base.runs_requests_per_s),
        cpu_vs_floor: cpu_ratio(base, real),
        others,
    }
}

async fn load(args: &Options, server: &InProcess) -> Result<(), String> {
    let workloads = if args.workload.is_empty() { Workload::ALL.to_vec() } else { args.workload.clone() };
    let (kv, floor, peer) = targets(args, server).await?;
    let primary = kv[0].clone();
    let pool = format!(
        "rank 0 of {} pages; allocating workloads clear the server and re-initialize rank 0 before a round \
         would exhaust it (a /keys/delete per iteration would add a request to every iteration), pauses not counted; lookups hit {} stored keys; pool-full: {} pages, all confirmed",
        workload::POOL_PAGES,
        workload::STORED_KEYS,
        workload::FULL_POOL_PAGES
    );
    println!("kvpages bench: {} workload(s) × concurrency {:?}; {pool}", workloads.len(), args.concurrency);
    let mut targets = kv.clone();
    targets.push(floor.clone());
    targets.extend(peer.clone());
    for t in &targets {
        println!("  target {:<20} engine {:<20} durability {:<8} {}", t.name, t.engine, t.durability, t.addr);
    }
    let keys = Arc::new(KeyGen::new(seed()));
    let mut results: Vec<Measurement> = Vec::new();
    let mut ratios = Vec::new();
    let mut failed = Vec::new();
    for &w in &workloads {
        let set_up = |t: &Target| {
            let (addr, keys) = (t.addr_for(w), keys.clone());
            async move {
                let mut c = Client::connect(addr).await.map_err(|e| format!("{addr}: {e}"))?;
                Fixture::set_up(&mut c, w, keys).await.map(Arc::new)
            }
        };
        let mut fixtures = Vec::with_capacity(kv.len());
        for t in &kv {
            fixtures.push(set_up(t).await.map_err(|e| format!("{}: set-up on {}: {e}", w.name(), t.name))?);
        }
        let fixture = fixtures[0].clone();
        let peer_fixture = match &peer {
            Some(p) => Some(set_up(p).await.map_err(|e| format!("{}: set-up on {}: {e}", w.name(), p.name))?),
            None => None,
        };
        for &c in &args.concurrency {
            // kvpages, floor (and peer) alternate run by run, so that a burst of load from
            // elsewhere on the machine hits both sides of a ratio alike.
            let (mut real, mut base, mut other) = (Vec::new(), Vec::new(), Vec::new());
            let mut extra: Vec<Vec<Raw>> = (1..kv.len()).map(|_| Vec::new()).collect();
            let mut floor_mode = None;
            for rep in 0..args.repeat.max(1) {
                let tag = |t: &Target| format!("{} {} c={c} run {}/{}", t.name, w.name(), rep + 1, args.repeat.max(1));
                real.push(run_once(&primary, &fixture, &Mode::Real, c, args, &tag(&primary)).await?);
                for (i, t) in kv.iter().enumerate().skip(1) {
                    extra[i - 1].push(run_once(t, &fixtures[i], &Mode::Real, c, args, &tag(t)).await?);
                }
                // The floor answers each step with the mean reply size its real route gave.
                let mode = floor_mode.get_or_insert_with(|| floor_mode_of(w, &real[0]));
                base.push(run_once(&floor, &fixture, mode, c, args, &tag(&floor)).await?);
                if let (Some(p), Some(f)) = (&peer, &peer_fixture)
                    && rep < args.peer_repeat.unwrap_or(args.repeat).max(1)
                {
                    other.push(run_once(p, f, &Mode::Real, c, args, &tag(p)).await?);
                }
            }
            let real = summarise(&primary, w, c, real);
            let base = summarise(&floor, w, c, base);
            let other = peer.as_ref().filter(|_| !other.is_empty()).map(|p| summarise(p, w, c, other));
            let extra: Vec<Measurement> = kv[1..].iter().zip(extra).map(|(t, raws)| summarise(t, w, c, raws)).collect();
            for m in
                [Some(&real)].into_iter().chain(extra.iter().map(Some)).chain([Some(&base), other.as_ref()]).flatten()
            {
                print_measurement(m);
            }
            ratios.push(ratio(w, c, &real, &base, other.as_ref(), &extra));
            for m in
                [Some(&real), Some(&base)].into_iter().chain(extra.iter().map(Some)).chain([other.as_ref()]).flatten()
            {
                if m.errors > 0 && m.target != args.peer_name {
                    failed.push(format!(
                        "{} {} c={}: {}",
                        m.target,
                        m.workload,
                        c,
                        m.first_error.as_deref().unwrap_or("")
                    ));
                }
            }
            results.push(real);
            results.extend(extra);
            results.push(base);
            results.extend(other);
        }
    }
    print_tables(&results, &ratios, peer.as_ref());
    if let Some(path) = &args.json {
        let report = Report {
            kind: "load",
            machine: Machine::read(),
            command: command_line(),
            pool,
            warmup_s: args.warmup.as_secs_f64(),
            targets: &targets,
            results: &results,
            ratios: &ratios,
        };
        write_json(path, &report)?;
    }
    if failed.is_empty() { Ok(()) } else { Err(format!("requests failed:\n  {}", failed.join("\n  "))) }
}

/// The command line as a report records it: paths below the working directory relative to it,
/// so that a report names no machine's directories.
pub(crate) fn command_line() -> Vec<String> {
    let cwd = std::env::current_dir().ok().map(|d| format!("{}/", d.display()));
    std::env::args()
        .map(|a| match cwd.as_deref().and_then(|cwd| a.strip_prefix(cwd)) {
            Some(rest) => rest.to_owned(),
            None => a,
        })
        .collect()
}

pub(crate) fn write_json(path: &std::path::Path, value: &impl Serialize) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x6b65_7973_u64)
}

/// What one run of a measurement collected.
struct Raw {
    tallies: Vec<Tally>,
    seconds: f64,
    resets: u64,
    paused: Duration,
    /// CPU time of the in-process servers' threads from the end of the warm-up to the last
    /// answer, less the pool resets' (see [`server_cpu`]).
    server_cpu: Option<Duration>,
}

/// CPU time the in-process servers' threads have run so far: the sum of the first field of
/// Linux's `/proc/self/task/*/schedstat` (nanoseconds on a CPU) over the threads named
/// [`SERVER_THREAD`]. `None` where that is not readable or there are no such threads.
pub(crate) fn server_cpu() -> Option<Duration> {
    let mut total = 0u64;
    let mut found = false;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let dir = task.path();
        // A thread may end between the listing and these reads: skip it.
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else { continue };
        if comm.trim_end() != SERVER_THREAD {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(dir.join("schedstat")) else { continue };
        let Some(ns) = stat.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()) else { continue };
        total += ns;
        found = true;
    }
    found.then(|| Duration::from_nanos(total))
}

/// `a`'s server CPU per request ÷ `b`'s: `b`'s throughput relative to `a`'s when the server's
/// CPU is what limits both.
fn cpu_ratio(a: &Measurement, b: &Measurement) -> Option<f64> {
    match (a.server_cpu_us_per_request, b.server_cpu_us_per_request) {
        (Some(a), Some(b)) if a > 0.0 && b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// One run: `concurrency` connections for the target's duration after the warm-up.
async fn run_once(
    target: &Target,
    fixture: &Arc<Fixture>,
    mode: &Mode,
    concurrency: usize,
    args: &Options,
    label: &str,
) -> Result<Raw, String> {
    let workload = fixture.workload;
    let mut clients = Vec::with_capacity(concurrency);
    let addr = target.addr_for(workload);
    for _ in 0..concurrency {
        clients.push(Client::connect(addr).await.map_err(|e| format!("{addr}: {e}"))?);
    }
    let measure_from = Instant::now() + args.warmup;
    let run = Arc::new(Run {
        measure_from,
        deadline: measure_from + target.duration,
        max_requests: args.requests.unwrap_or(u64::MAX),
        started: Default::default(),
        done: Default::default(),
        errors: Default::default(),
    });
    fixture.start_measurement();
    let resets_before = fixture.rounds.as_ref().map_or(0, |r| r.resets.load(Ordering::Relaxed));
    let progress = tokio::spawn(progress(label.to_owned(), run.clone()));
    // Only the in-process servers' threads are counted: a server elsewhere has none here.
    let in_process = target.in_process;
    let cpu_start = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        if in_process { server_cpu() } else { None }
    });
    let workers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, c)| tokio::spawn(Worker::new(c, mode.clone(), fixture.clone(), run.clone(), i as u64 + 1).run()))
        .collect();
    let mut tallies = Vec::with_capacity(workers.len());
    for w in workers {
        tallies.push(w.await.map_err(|e| format!("{label}: a connection task failed: {e}"))?);
    }
    progress.abort();
    let _ = progress.await;
    let cpu_end = if in_process { server_cpu() } else { None };
    let server_cpu = match (cpu_start.await.ok().flatten(), cpu_end) {
        // A server thread that ended during the run (none should) takes its time with it.
        (Some(a), Some(b)) if b > a => Some((b - a).saturating_sub(fixture.paused_cpu())),
        _ => None,
    };
    let last = tallies.iter().filter_map(|t| t.last_done).max().unwrap_or(measure_from);
    let paused = fixture.paused();
    let seconds = last.saturating_duration_since(measure_from).saturating_sub(paused).as_secs_f64().max(1e-9);
    let resets = fixture.rounds.as_ref().map_or(0, |r| r.resets.load(Ordering::Relaxed)) - resets_before;
    Ok(Raw { tallies, seconds, resets, paused, server_cpu })
}

/// Pools the runs of one measurement: requests and seconds add up, latency samples merge.
fn summarise(target: &Target, workload: Workload, concurrency: usize, raws: Vec<Raw>) -> Measurement {
    let steps = workload.steps();
    let seconds: f64 = raws.iter().map(|r| r.seconds).sum();
    let runs_requests_per_s = raws
        .iter()
        .map(|r| {
            r.tallies.iter().map(|t| t.samples.iter().map(Vec::len).sum::<usize>()).sum::<usize>() as f64 / r.seconds
        })
        .collect();
    let tallies: Vec<&Tally> = raws.iter().flat_map(|r| r.tallies.iter()).collect();
    let mut all = Vec::new();
    let mut step_results = Vec::with_capacity(steps.len());
    for (i, (route, _)) in steps.iter().enumerate() {
        let mut samples: Vec<u64> = tallies.iter().flat_map(|t| t.samples[i].iter().copied()).collect();
        let n = samples.len() as u64;
        let body: u64 = tallies.iter().map(|t| t.body_bytes[i]).sum();
        let reply: u64 = tallies.iter().map(|t| t.reply_bytes[i]).sum();
        all.extend_from_slice(&samples);
        step_results.push(StepResult {
            route: route.to_string(),
            requests: n,
            mean_body_bytes: body.checked_div(n).unwrap_or(0),
            mean_reply_bytes: reply.checked_div(n).unwrap_or(0),
            latency: Latency::of(&mut samples),
        });
    }
    let requests = all.len() as u64;
    // Iterations whose requests were all recorded (those begun in the warm-up are not).
    let iterations = step_results.iter().map(|s| s.requests).min().unwrap_or(0);
    Measurement {
        target: target.name.clone(),
        engine: target.engine.clone(),
        durability: target.durability.clone(),
        workload: workload.name().into(),
        keys_per_iteration: workload.batch(),
        concurrency,
        seconds,
        requests,
        iterations,
        errors: tallies.iter().map(|t| t.errors).sum(),
        first_error: tallies.iter().find_map(|t| t.first_error.clone()),
        requests_per_s: requests as f64 / seconds,
        keys_per_s: (iterations * workload.batch() as u64) as f64 / seconds,
        runs_requests_per_s,
        latency: Latency::of(&mut all),
        steps: step_results,
        pool_resets: raws.iter().map(|r| r.resets).sum(),
        paused_s: raws.iter().map(|r| r.paused.as_secs_f64()).sum(),
        server_cpu_us_per_request: raws
            .iter()
            .map(|r| r.server_cpu)
            .sum::<Option<Duration>>()
            .filter(|_| requests > 0)
            .map(|cpu| cpu.as_secs_f64() * 1e6 / requests as f64),
    }
}

fn print_measurement(m: &Measurement) {
    eprintln!(
        "{:<44} {:>9.0} req/s {:>10.0} keys/s  p50 {:>8.1} µs  p99 {:>8.1} µs  p99.9 {:>8.1} µs  errors {}{}",
        format!("{} {} c={}", m.target, m.workload, m.concurrency),
        m.requests_per_s,
        m.keys_per_s,
        m.latency.p50_us,
        m.latency.p99_us,
        m.latency.p999_us,
        m.errors,
        m.first_error.as_deref().map(|e| format!(" (first: {e})")).unwrap_or_default()
    );
}

/// Prints a progress line every second while a measurement runs (overwritten on a terminal).
async fn progress(label: String, run: Arc<Run>) {
    let tty = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last = 0;
    loop {
        tick.tick().await;
        let done = run.done.load(Ordering::Relaxed);
        let now = Instant::now();
        let phase = if now < run.measure_from {
            "warm-up".to_string()
        } else {
            format!("{:.0}s", now.saturating_duration_since(run.measure_from).as_secs_f64())
        };
        let line = format!(
            "  … {label} {phase}: {done} requests, {} req/s in the last second, {} errors",
            done - last,
            run.errors.load(Ordering::Relaxed)
        );
        last = done;
        let mut err = std::io::stderr().lock();
        let _ = if tty { write!(err, "\r{line}\x1b[K") } else { writeln!(err, "{line}") };
        let _ = err.flush();
    }
}

/// The lowest and highest of several runs' ratios ("0.91–0.97"), or "-" for fewer than two.
fn spread(runs: &[f64]) -> String {
    match (runs.iter().copied().reduce(f64::min), runs.iter().copied().reduce(f64::max)) {
        (Some(lo), Some(hi)) if runs.len() > 1 => format!("{lo:.2}–{hi:.2}"),
        _ => "-".into(),
    }
}

fn print_tables(results: &[Measurement], ratios: &[Ratio], peer: Option<&Target>) {
    let find = |target: &str, w: &str, c: usize| {
        results.iter().find(|m| m.target == target && m.workload == w && m.concurrency == c)
    };
    let peer_name = peer.map(|p| p.name.as_str());
    println!();
    println!(
        "{:<22} {:>5} {:>10} {:>11} {:>9} {:>9} {:>9} {:>10} {:>7} {:>11} {:>7} {:>7} {:>10} {:>7}",
        "workload",
        "conc",
        "req/s",
        "keys/s",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "floor/s",
        "÷floor",
        "runs",
        "cpu µs",
        "cpu÷fl",
        "peer/s",
        "÷peer"
    );
    for r in ratios {
        let Some(m) = find("kvpages", &r.workload, r.concurrency) else { continue };
        let f = find("floor", &r.workload, r.concurrency);
        let p = peer_name.and_then(|n| find(n, &r.workload, r.concurrency));
        let opt = |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
        let spread = spread(&r.runs_vs_floor);
        println!(
            "{:<22} {:>5} {:>10.0} {:>11.0} {:>9.1} {:>9.1} {:>9.1} {:>10} {:>7} {:>11} {:>7} {:>7} {:>10} {:>7}",
            r.workload,
            r.concurrency,
            m.requests_per_s,
            m.keys_per_s,
            m.latency.p50_us,
            m.latency.p99_us,
            m.latency.p999_us,
            opt(f.map(|f| f.requests_per_s), 0),
            opt(r.vs_floor, 2),
            spread,
            opt(m.server_cpu_us_per_request, 1),
            opt(r.cpu_vs_floor, 2),
            opt(p.map(|p| p.requests_per_s), 0),
            opt(r.vs_peer, 1),
        );
    }
    if let Some(m) = results.first() {
        println!(
            "engine {}, durability {}; latency per request (all steps of a workload); cpu µs: the server's CPU \
             time per request, cpu÷fl: the floor's over it.",
            m.engine, m.durability
        );
    }
    if ratios.iter().all(|r| r.others.is_empty()) {
        return;
    }
    println!();
    println!(
        "{:<22} {:>5} {:<32} {:>10} {:>9} {:>9} {:>7} {:>8} {:>11} {:>7}",
        "workload", "conc", "target", "req/s", "p50 µs", "p99 µs", "÷floor", "÷kvpages", "runs", "cpu÷kv"
    );
    for r in ratios {
        for o in &r.others {
            let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            let spread = spread(&o.runs_vs_reference);
            println!(
                "{:<22} {:>5} {:<32} {:>10.0} {:>9.1} {:>9.1} {:>7} {:>8} {:>11} {:>7}",
                r.workload,
                r.concurrency,
                format!("{} {}", o.engine, o.durability),
                o.requests_per_s,
                o.p50_us,
                o.p99_us,
                opt(o.vs_floor),
                opt(o.vs_reference),
                spread,
                opt(o.cpu_vs_reference)
            );
        }
    }
    if let Some(m) = results.first() {
        println!(
            "÷kvpages: over the reference ({} {}) in the same run; cpu÷kv: its server CPU per request over \
             the target's.",
            m.engine, m.durability
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{EngineKind, FsyncMode, TargetSpec};

    #[test]
    fn targets_parse_to_engines_and_durability() {
        let ok = [
            ("default", EngineKind::Wasm, Some(FsyncMode::Always), "fsync-always"),
            ("native", EngineKind::Native, None, "memory"),
            ("wasm", EngineKind::Wasm, None, "memory"),
            ("native/always", EngineKind::Native, Some(FsyncMode::Always), "fsync-always"),
            (
                "wasm/interval=10",
                EngineKind::Wasm,
                Some(FsyncMode::Interval(Duration::from_millis(10))),
                "fsync-interval-10ms",
            ),
        ];
        for (text, engine, fsync, durability) in ok {
            let spec: TargetSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((spec.engine, spec.fsync, spec.durability().as_str()), (engine, fsync, durability), "{text}");
            // `--fsync` reads back what it prints.
            if let Some(f) = fsync {
                assert_eq!(f.to_string().parse::<FsyncMode>(), Ok(f), "{text}");
            }
        }
        assert_eq!(TargetSpec::serve_default(), "default".parse().unwrap());
        for bad in ["wasm/sometimes", "native/interval=0", "sparc", "default/always"] {
            assert!(bad.parse::<TargetSpec>().is_err(), "{bad}");
        }
    }

    /// Spins on a new thread named `name` for `d` of wall time, then reports `server_cpu()`
    /// before the spin and while the thread still lives.
    #[cfg(target_os = "linux")]
    fn spin_on(name: &str, d: Duration) -> (Option<Duration>, Option<Duration>) {
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let (ready, spun) = std::sync::mpsc::channel::<(Option<Duration>, Option<Duration>)>();
        let t = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let before = super::server_cpu();
                let start = Instant::now();
                let mut x = 0u64;
                while start.elapsed() < d {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                ready.send((before, super::server_cpu())).unwrap();
                let _ = wait.recv();
            })
            .unwrap();
        let r = spun.recv().unwrap();
        done.send(()).unwrap();
        t.join().unwrap();
        r
    }

    /// Linux only: elsewhere the bench reports no CPU figures (there is no `/proc/self/task`).
    #[cfg(target_os = "linux")]
    #[test]
    fn server_cpu_counts_the_server_threads_time_and_only_theirs() {
        // No server thread in a unit test process: nothing to count.
        assert_eq!(super::server_cpu(), None);
        // Another thread's spin is not counted. (It runs first: a joined thread's entry in
        // /proc/self/task can outlive the join for a moment, and would be counted here.)
        assert_eq!(spin_on("kvpages-other", Duration::from_millis(100)), (None, None));
        // A thread named like the servers' is counted: at least most of its 200 ms spin (the
        // machine may take some of the wall time away) and not more than its wall time.
        let (before, after) = spin_on(kvpages_host::runtime::SERVER_THREAD, Duration::from_millis(200));
        let (before, after) = (before.expect("the thread counts itself"), after.expect("still running"));
        let spent = after - before;
        assert!(spent >= Duration::from_millis(50) && spent <= Duration::from_millis(260), "{spent:?}");
    }
}

//! The server's figures and their Prometheus text exposition (version 0.0.4), served by
//! `GET /metrics` (`routes::admin::metrics`).
//!
//! Hand-written rather than built on a crate (`prometheus-client`, `metrics` + an exporter):
//! what kvpages exports is a handful of counters and three fixed-bucket histograms, plus gauges
//! read from the core's `Stats` at scrape time, so the whole exposition is a few atomics and a
//! `String` — no registry types to thread through the server, no new dependency to build and
//! audit, and nothing on the request path but an atomic add per request.
//!
//! Process-wide figures (requests, latencies, plugin traps and faults, fsync, log size) live in
//! one static [`Registry`], as in Prometheus' own client libraries: a process is one scrape
//! target. Other layers record into it through the free functions here — [`plugin_trapped`] and
//! [`plugin_faulted`] (the wasm engine), [`observe_fsync`] and [`set_log_bytes`] (the
//! durability layer) — so none of them needs a handle on the server. The core's figures (pages
//! by state, keys, event counters) are not copied anywhere: each scrape asks the engine for
//! `Command::Stats`, like `/stats`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use axum::http::StatusCode;
use kvpages_core::{Counters, Space, Stats};

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Upper bounds (seconds) of the request latency buckets: 50 µs (a small batch on loopback)
/// to the default `--request-timeout` and beyond.
const LATENCY_BUCKETS: [f64; 16] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// Upper bounds (seconds) of the fsync buckets: a page-cache write to a slow disk's stall.
const FSYNC_BUCKETS: [f64; 14] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// The `route` label of a request that matched no route (its path is not used: a scanner would
/// create one series per path it tries).
const UNMATCHED: &str = "unmatched";

/// A histogram with fixed buckets: per-bucket counts (made cumulative when rendered), the sum in
/// nanoseconds, and the count.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// `bounds.len() + 1` cells; the last one is `+Inf`.
    cells: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            cells: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.iter().position(|&b| secs <= b).unwrap_or(self.bounds.len());
        self.cells[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(d.as_nanos().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
    }

    /// Writes the `_bucket`, `_sum` and `_count` lines; `labels` is `""` or `k="v",...`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, cell) in self.cells.iter().enumerate() {
            cumulative += cell.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}");
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// One route's requests: a count per status code, and the latency histogram.
#[derive(Debug)]
struct RouteMetrics {
    /// Indexed by `status - 100` (hyper only sends 100..=599).
    statuses: Box<[AtomicU64]>,
    latency: Histogram,
}

impl RouteMetrics {
    fn new() -> RouteMetrics {
        RouteMetrics {
            statuses: (100..600).map(|_| AtomicU64::new(0)).collect(),
            latency: Histogram::new(&LATENCY_BUCKETS),
        }
    }
}

/// The process-wide figures.
#[derive(Debug)]
pub struct Registry {
    /// By route label; a route's entry is made on its first request.
    routes: RwLock<HashMap<Box<str>, Arc<RouteMetrics>>>,
    plugin_traps: AtomicU64,
    plugin_faults: AtomicU64,
    fsync: Histogram,
    log_bytes: AtomicU64,
    /// 0 while the write-ahead log cannot be written.
    storage_up: AtomicU64,
    storage_write_failures: AtomicU64,
    snapshots_skipped: AtomicU64,
    connections_open: AtomicU64,
    /// By [`ConnectionClosed`] reason.
    connections_closed: [AtomicU64; ConnectionClosed::ALL.len()],
}

/// Why the server closed a connection itself (`kvpages_connections_closed_total`'s `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionClosed {
    /// Idle past `--idle-timeout`.
    Idle,
    /// Its request head did not arrive within `--header-timeout` (slowloris).
    HeaderTimeout,
    /// Closed while idle to make room for a new connection at `--max-connections`.
    Evicted,
    /// Refused at `--max-connections` with every open connection busy.
    Refused,
}

impl ConnectionClosed {
    /// Every reason, in the order of the metric's lines.
    pub const ALL: [ConnectionClosed; 4] =
        [ConnectionClosed::Idle, ConnectionClosed::HeaderTimeout, ConnectionClosed::Evicted, ConnectionClosed::Refused];

    fn label(self) -> &'static str {
        match self {
            ConnectionClosed::Idle => "idle",
            ConnectionClosed::HeaderTimeout => "header-timeout",
            ConnectionClosed::Evicted => "evicted",
            ConnectionClosed::Refused => "refused",
        }
    }
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Registry {
    routes: RwLock::new(HashMap::new()),
    plugin_traps: AtomicU64::new(0),
    plugin_faults: AtomicU64::new(0),
    fsync: Histogram::new(&FSYNC_BUCKETS),
    log_bytes: AtomicU64::new(0),
    storage_up: AtomicU64::new(1),
    storage_write_failures: AtomicU64::new(0),
    snapshots_skipped: AtomicU64::new(0),
    connections_open: AtomicU64::new(0),
    connections_closed: [const { AtomicU64::new(0) }; ConnectionClosed::ALL.len()],
});

/// The `route` label for a request: the matched route template (`/keys/batch_allocate`,
/// `/rank/{rank}/initialize`), SGLang's `/{rank}/{op}` split by operation, or `unmatched`.
pub fn route_label(matched: Option<&str>, path: &str) -> String {
    match matched {
        None => UNMATCHED.to_owned(),
        Some("/{rank}/{op}") => {
            let op = path.rsplit('/').next().unwrap_or("");
            match kvpages_wire::SGLANG_OPS.iter().find(|&&o| o == op) {
                Some(op) => format!("/{{rank}}/{op}"),
                None => "/{rank}/{op}".to_owned(),
            }
        }
        Some(m) => m.to_owned(),
    }
}

/// Counts one answered request (called by the server's request guard).
pub fn record_request(route: &str, status: StatusCode, elapsed: Duration) {
    let entry = REGISTRY.routes.read().unwrap_or_else(|p| p.into_inner()).get(route).cloned();
    let entry = match entry {
        Some(e) => e,
        None => REGISTRY
            .routes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(route.into())
            .or_insert_with(|| Arc::new(RouteMetrics::new()))
            .clone(),
    };
    let code = status.as_u16().clamp(100, 599);
    entry.statuses[usize::from(code - 100)].fetch_add(1, Ordering::Relaxed);
    entry.latency.observe(elapsed);
}

/// Counts one trap of the wasm plugin (called by the plugin engine when it contains one).
pub fn plugin_trapped() {
    REGISTRY.plugin_traps.fetch_add(1, Ordering::Relaxed);
}

/// Counts one malformed answer of the wasm plugin (an engine fault; called by the plugin engine).
pub fn plugin_faulted() {
    REGISTRY.plugin_faults.fetch_add(1, Ordering::Relaxed);
}

/// Records how long one fsync of the write-ahead log took (called by the durability layer).
pub fn observe_fsync(elapsed: Duration) {
    REGISTRY.fsync.observe(elapsed);
}

/// Sets the write-ahead log's size on disk in bytes (called by the durability layer whenever it
/// grows or is truncated by a snapshot).
pub fn set_log_bytes(bytes: u64) {
    REGISTRY.log_bytes.store(bytes, Ordering::Relaxed);
}

/// Whether the write-ahead log writes (called by the durability layer when a fault starts and ends).
pub fn set_storage_up(up: bool) {
    REGISTRY.storage_up.store(u64::from(up), Ordering::Relaxed);
}

/// Counts one failed write or fsync of the write-ahead log (each try during a fault counts).
pub fn storage_write_failed() {
    REGISTRY.storage_write_failures.fetch_add(1, Ordering::Relaxed);
}

/// Counts one snapshot skipped because the disk had no room for it.
pub fn snapshot_skipped() {
    REGISTRY.snapshots_skipped.fetch_add(1, Ordering::Relaxed);
}

/// Moves the count of open client connections by `delta` (called by the connection layer).
pub fn connections_open(delta: i64) {
    let _ = REGISTRY
        .connections_open
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| Some((c as i64 + delta).max(0) as u64));
}

/// Counts one connection the server closed itself.
pub fn connection_closed(why: ConnectionClosed) {
    REGISTRY.connections_closed[why as usize].fetch_add(1, Ordering::Relaxed);
}

const PLUGIN_FAULTS_HELP: &str = "Malformed answers of the wasm plugin (each an engine fault; after one to a mutating command the instance is rebuilt).";

/// Escapes a label value (`\`, `"` and newlines), as the format requires.
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A space's labels: `family="vllm"`, or `family="sglang",rank="R",namespace="NS"`.
fn space_labels(space: &Space) -> String {
    match space {
        Space::Vllm => "family=\"vllm\"".to_owned(),
        Space::Sglang { rank, namespace } => {
            format!("family=\"sglang\",rank=\"{rank}\",namespace=\"{}\"", escape(namespace))
        }
    }
}

/// A rank's labels within its space (an SGLang space already names its rank).
fn rank_labels(space: &Space, rank: u32) -> String {
    match space {
        Space::Vllm => format!("family=\"vllm\",rank=\"{rank}\""),
        Space::Sglang { .. } => space_labels(space),
    }
}

/// Reads one of the core's counters.
type CounterField = fn(&Counters) -> u64;

/// The core's event counters that `/metrics` exports: name (without `kvpages_` and `_total`),
/// help, and the field.
const COUNTERS: [(&str, &str, CounterField); 15] = [
    ("reservations", "Keys given a fresh page by an allocate or reserve.", |c| c.reserved),
    ("cache_hits", "Keys an allocate or reserve answered with their existing page.", |c| c.cache_hits),
    ("misses", "Keys an allocate answered -1 (the pool could not cover the batch).", |c| c.misses),
    ("location_hits", "Keys a lookup (get_locations, get_page_indices) answered with a page.", |c| c.location_hits),
    ("location_misses", "Keys a lookup answered null.", |c| c.location_misses),
    ("commits", "Confirmations that committed a page.", |c| c.committed),
    ("refused_confirms", "Confirmations refused (page not reserved for that key on that rank).", |c| {
        c.refused_confirms
    }),
    ("superseded_confirms", "Confirmations whose page was freed because another writer won.", |c| c.superseded),
    ("releases", "Releases that freed a page.", |c| c.released),
    ("ignored_releases", "Releases ignored (page free, or holding a key).", |c| c.ignored_releases),
    ("expired_reservations", "Reservations that reached --reservation-ttl unconfirmed.", |c| c.expired_reservations),
    ("evictions", "Keys evicted to make room.", |c| c.evictions),
    ("deletes", "Keys deleted.", |c| c.deleted),
    ("dropped_keys", "Keys dropped because a rank was re-initialized with another size.", |c| c.dropped_keys),
    ("quarantined_pages", "Pages put into quarantine.", |c| c.quarantined_pages),
];

/// Writes the core's gauges and counters from `stats`.
fn render_core(out: &mut String, stats: &Stats) {
    header(out, "kvpages_pool_pages", "gauge", "Pages in a rank's pool (num_pages).");
    for s in &stats.spaces {
        for r in &s.ranks {
            let _ = writeln!(out, "kvpages_pool_pages{{{}}} {}", rank_labels(&s.space, r.rank), r.num_pages);
        }
    }
    header(
        out,
        "kvpages_pages",
        "gauge",
        "A rank's pages by state (leased is a subset of committed; the others add up to the pool).",
    );
    for s in &stats.spaces {
        for r in &s.ranks {
            let labels = rank_labels(&s.space, r.rank);
            let p = &r.pages;
            for (state, n) in p.by_state() {
                let _ = writeln!(out, "kvpages_pages{{{labels},state=\"{state}\"}} {n}");
            }
        }
    }
    header(out, "kvpages_keys", "gauge", "Keys with a committed page on some rank.");
    for s in &stats.spaces {
        let _ = writeln!(out, "kvpages_keys{{{}}} {}", space_labels(&s.space), s.keys);
    }
    header(out, "kvpages_pending_keys", "gauge", "Keys that only have pending reservations.");
    for s in &stats.spaces {
        let _ = writeln!(out, "kvpages_pending_keys{{{}}} {}", space_labels(&s.space), s.pending_keys);
    }
    for (name, help, field) in COUNTERS {
        let name = format!("kvpages_{name}_total");
        header(out, &name, "counter", help);
        for s in &stats.spaces {
            let _ = writeln!(out, "{name}{{{}}} {}", space_labels(&s.space), field(&s.counters));
        }
    }
}

/// Writes the process-wide figures; `engine_traps` is the engine's own count, when it answered.
fn render_process(out: &mut String, engine_traps: Option<u64>) {
    let routes = REGISTRY.routes.read().unwrap_or_else(|p| p.into_inner());
    let mut names: Vec<&Box<str>> = routes.keys().collect();
    names.sort();
    header(out, "kvpages_http_requests_total", "counter", "HTTP requests answered, by route and status.");
    for name in &names {
        let route = &routes[*name];
        for (i, n) in route.statuses.iter().enumerate() {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                let _ = writeln!(
                    out,
                    "kvpages_http_requests_total{{route=\"{}\",status=\"{}\"}} {n}",
                    escape(name),
                    i + 100
                );
            }
        }
    }
    header(out, "kvpages_http_request_duration_seconds", "histogram", "Time from request to response, by route.");
    for name in &names {
        routes[*name].latency.render(
            out,
            "kvpages_http_request_duration_seconds",
            &format!("route=\"{}\"", escape(name)),
        );
    }
    drop(routes);
    header(out, "kvpages_plugin_traps_total", "counter", "Traps of the wasm plugin engine (each contained).");
    // Two sources count the same events: the engine's own counter (`Engine::traps`) and the
    // hook [`plugin_trapped`]; whichever is wired up is right, so the larger one is.
    let traps = REGISTRY.plugin_traps.load(Ordering::Relaxed).max(engine_traps.unwrap_or(0));
    let _ = writeln!(out, "kvpages_plugin_traps_total {traps}");
    header(out, "kvpages_log_fsync_duration_seconds", "histogram", "Time one fsync of the write-ahead log took.");
    REGISTRY.fsync.render(out, "kvpages_log_fsync_duration_seconds", "");
    let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
    let singles: [(&str, &str, &str, u64); 6] = [
        ("kvpages_log_bytes", "gauge", "Size of the write-ahead log on disk, in bytes.", load(&REGISTRY.log_bytes)),
        (
            "kvpages_storage_up",
            "gauge",
            "1 while the write-ahead log writes (and always without a data directory), 0 during a storage fault.",
            load(&REGISTRY.storage_up),
        ),
        (
            "kvpages_storage_write_failures_total",
            "counter",
            "Failed writes or fsyncs of the write-ahead log (every try during a fault).",
            load(&REGISTRY.storage_write_failures),
        ),
        (
            "kvpages_snapshots_skipped_total",
            "counter",
            "Snapshots skipped: the disk had no room for them.",
            load(&REGISTRY.snapshots_skipped),
        ),
        ("kvpages_connections_open", "gauge", "Client connections open now.", load(&REGISTRY.connections_open)),
        ("kvpages_plugin_faults_total", "counter", PLUGIN_FAULTS_HELP, load(&REGISTRY.plugin_faults)),
    ];
    for (name, kind, help, value) in singles {
        header(out, name, kind, help);
        let _ = writeln!(out, "{name} {value}");
    }
    header(
        out,
        "kvpages_connections_closed_total",
        "counter",
        "Connections the server closed itself, by reason (idle, header-timeout, evicted, refused).",
    );
    for why in ConnectionClosed::ALL {
        let n = REGISTRY.connections_closed[why as usize].load(Ordering::Relaxed);
        let _ = writeln!(out, "kvpages_connections_closed_total{{reason=\"{}\"}} {n}", why.label());
    }
}

/// The whole exposition: process figures, then the core's when `stats` is there.
pub fn render(stats: Option<&Stats>, engine_traps: Option<u64>, engine: &str, uptime: Duration) -> String {
    let mut out = String::with_capacity(16 * 1024);
    header(&mut out, "kvpages_build_info", "gauge", "Always 1; the labels say what runs.");
    let _ = writeln!(out, "kvpages_build_info{{version=\"{}\",engine=\"{engine}\"}} 1", env!("CARGO_PKG_VERSION"));
    header(&mut out, "kvpages_uptime_seconds", "gauge", "Seconds since the server started.");
    let _ = writeln!(out, "kvpages_uptime_seconds {}", uptime.as_secs_f64());
    header(
        &mut out,
        "kvpages_engine_up",
        "gauge",
        "1 when the engine answered this scrape, 0 (recovering, busy, failed) if not.",
    );
    let _ = writeln!(out, "kvpages_engine_up {}", u8::from(stats.is_some()));
    render_process(&mut out, engine_traps);
    if let Some(stats) = stats {
        render_core(&mut out, stats);
    }
    out
}

#[cfg(test)]
mod tests {
    use kvpages_core::{Command, Reply};

    use super::*;

    #[test]
    fn route_labels_are_bounded() {
        assert_eq!(route_label(Some("/keys/batch_allocate"), "/keys/batch_allocate"), "/keys/batch_allocate");
        assert_eq!(route_label(Some("/{rank}/{op}"), "/3/exists"), "/{rank}/exists");
        assert_eq!(route_label(Some("/{rank}/{op}"), "/3/anything_else"), "/{rank}/{op}");
        assert_eq!(route_label(None, "/no/such/route"), "unmatched");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let mut out = String::new();
        h.render(&mut out, "x", "route=\"r\"");
        assert_eq!(
            out,
            "x_bucket{route=\"r\",le=\"0.001\"} 1\nx_bucket{route=\"r\",le=\"0.01\"} 3\n\
             x_bucket{route=\"r\",le=\"+Inf\"} 4\nx_sum{route=\"r\"} 1.0105\nx_count{route=\"r\"} 4\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        let s = Space::Sglang { rank: 2, namespace: "k\"v".into() };
        assert_eq!(space_labels(&s), "family=\"sglang\",rank=\"2\",namespace=\"k\\\"v\"");
        assert_eq!(rank_labels(&Space::Vllm, 7), "family=\"vllm\",rank=\"7\"");
    }

    /// Every sample line is `name{labels} value` or `name value` with a number, and every
    /// metric has HELP and TYPE before its samples.
    #[test]
    fn exposition_is_well_formed() {
        record_request("/keys/batch_exists", StatusCode::OK, Duration::from_micros(80));
        observe_fsync(Duration::from_micros(300));
        set_log_bytes(4096);
        plugin_trapped();
        let mut core = kvpages_core::Core::new(1, kvpages_core::Settings::default());
        core.apply(0, &Command::Configure(kvpages_core::Settings::default())).unwrap();
        core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 1, num_pages: 8 }).unwrap();
        let sglang = Space::Sglang { rank: 0, namespace: "kv".into() };
        core.apply(0, &Command::Initialize { space: sglang, rank: 0, num_pages: 4 }).unwrap();
        let stats = match core.apply(0, &Command::Stats).unwrap() {
            Reply::Stats(s) => s,
            other => panic!("{other:?}"),
        };
        let text = render(Some(&stats), Some(0), "native", Duration::from_secs(3));
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_owned());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect(line);
            assert!(value.parse::<f64>().is_ok(), "{line}");
            let name = series.split('{').next().unwrap();
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
            assert!(typed.contains(name) || typed.contains(base), "{line}: no TYPE before it");
        }
        assert!(text.contains("kvpages_engine_up 1\n"));
        assert!(text.contains("kvpages_log_bytes 4096\n"));
        assert!(text.contains("kvpages_http_requests_total{route=\"/keys/batch_exists\",status=\"200\"}"));
        assert!(text.contains("kvpages_pages{family=\"vllm\",rank=\"1\",state=\"free\"} 8\n"), "{text}");
        assert!(text.contains("kvpages_pages{family=\"sglang\",rank=\"0\",namespace=\"kv\",state=\"free\"} 4\n"));
        assert!(text.contains("kvpages_evictions_total{family=\"vllm\"} 0\n"));
    }
}

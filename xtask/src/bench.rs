//! `cargo xtask bench`: the whole performance report, measured on this machine.
//!
//! 1. builds the release binary;
//! 2. starts vLLM 0.33.0's own metadata server (fetched by `tests/python/peer.py`, never
//!    committed) as the peer, if it can be had;
//! 3. runs `kvpages bench` (every workload; concurrency 1, 4, 16, 64; kvpages, floor and peer
//!    alternating run by run), then `kvpages bench --memory` in a process of its own;
//! 4. runs the criterion benchmarks of the core, and the same pool-size groups through the plugin;
//! 5. writes `docs/bench/`: the JSON of every run, `results.md` (tables) and SVG plots.
//!
//! `--quick` shortens every run (two minutes or so in all) for trying the tooling out;
//! `--report-only` re-renders `docs/bench/` from the JSON of the last run in `target/bench/`.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use plotters::prelude::*;
use serde_json::Value;

use crate::{Result, cargo, root, run, step};

/// Concurrencies of the report.
const CONCURRENCY: &str = "1,4,16,64";

/// The in-process servers of the report, measured interleaved in one run: the default
/// configuration (what `kvpages serve` runs: the wasm plugin, `--fsync always`; the reference
/// the floor and the peer are compared with), both engines in memory, the native engine with
/// `--fsync always`, and the plugin with `--fsync interval=10`.
const TARGETS: &str = "default,native,wasm,native/always,wasm/interval=10";

struct Peer {
    child: Child,
    url: String,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Our own child: end it and reap it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// vLLM's server, through the parity tests' helper (download + extract on first use).
fn start_peer(out: &Path) -> Result<Peer> {
    let py = "import sys; sys.path.insert(0, 'tests/python'); import peer; peer.ensure_peer_deps(); print(peer.peer_source())";
    println!("+ python3 -c \"{py}\"");
    let o = Command::new("python3").current_dir(root()).args(["-c", py]).stderr(Stdio::inherit()).output();
    let o = o.map_err(|e| format!("python3: {e}"))?;
    if !o.status.success() {
        return Err(format!("tests/python/peer.py could not provide vLLM's server ({})", o.status));
    }
    let script = String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").trim().to_owned();
    let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let log = std::fs::File::create(out.join("peer.log")).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("python3");
    cmd.args([script.as_str(), "--host", "127.0.0.1", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log);
    println!("+ {}", crate::show(&cmd));
    let child = cmd.spawn().map_err(|e| format!("python3 {script}: {e}"))?;
    let mut peer = Peer { child, url: format!("http://127.0.0.1:{port}") };
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(status)) = peer.child.try_wait() {
            return Err(format!("vLLM's server exited with {status}; see {}", out.join("peer.log").display()));
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            println!("  vLLM's server is listening on {}", peer.url);
            return Ok(peer);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err("vLLM's server did not listen within 30 s".into())
}

pub(crate) fn bench(args: &[String]) -> Result<()> {
    let quick = args.iter().any(|a| a == "--quick");
    let out = root().join("target/bench");
    let docs = root().join("docs/bench");
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&docs).map_err(|e| e.to_string())?;
    if args.iter().any(|a| a == "--report-only") {
        return report(&out, &docs);
    }

    step("build the release binary");
    run(cargo().args(["build", "--release", "-p", "kvpages"]))?;
    let bin = root().join("target/release/kvpages");

    step("the peer: vLLM 0.33.0's hf3fs_metadata_server.py");
    let peer = match start_peer(&out) {
        Ok(p) => Some(p),
        Err(e) => {
            println!("  no peer comparison this time: {e}");
            None
        }
    };

    step("load: kvpages bench (kvpages, floor and peer alternate run by run)");
    let (duration, repeat, peer_duration) = if quick { ("0.5", "1", "0.5") } else { ("1", "3", "1") };
    let load_json = out.join("load.json");
    let mut cmd = Command::new(&bin);
    cmd.args(["bench", "--concurrency", CONCURRENCY, "--duration", duration, "--repeat", repeat, "--warmup", "0.3"]);
    cmd.args(["--targets", TARGETS]).arg("--data-dir").arg(out.join("data"));
    cmd.arg("--json").arg(&load_json);
    if let Some(p) = &peer {
        cmd.args(["--peer", &p.url, "--wipe", "--peer-duration", peer_duration, "--peer-repeat", "1"]);
    }
    run(&mut cmd)?;
    drop(peer);

    step("memory: kvpages bench --memory (a process of its own)");
    let memory_json = out.join("memory.json");
    // 10^7 keys on 2 ranks, both engines: the scale a large deployment stores.
    run(Command::new(&bin)
        .args(["bench", "--memory", "--keys", "10000000", "--ranks", "2", "--json"])
        .arg(&memory_json))?;

    step("core: criterion benchmarks, on the core and through the plugin");
    // The core's bench, then the same pool-size groups through the plugin engine (the host's
    // bench, filtered to them).
    let benches: [&[&str]; 2] = [
        &["-p", "kvpages-core", "--bench", "core", "--"],
        &["-p", "kvpages-host", "--bench", "plugin", "--", "^plugin_"],
    ];
    for bench in benches {
        let mut c = cargo();
        c.arg("bench").args(bench);
        if quick {
            c.args(["--warm-up-time", "0.2", "--measurement-time", "0.5"]);
        }
        run(&mut c)?;
    }

    report(&out, &docs)
}

/// docs/bench/ from the JSON in target/bench/ (alone: `cargo xtask bench --report-only`).
fn report(out: &Path, docs: &Path) -> Result<()> {
    step("report: docs/bench/");
    let core = read_criterion(&root().join("target/criterion"))?;
    std::fs::write(out.join("core.json"), serde_json::to_string_pretty(&core).map_err(|e| e.to_string())? + "\n")
        .map_err(|e| e.to_string())?;
    for name in ["load.json", "memory.json", "core.json"] {
        let (from, to) = (out.join(name), docs.join(name));
        std::fs::copy(&from, &to).map_err(|e| format!("{} -> {}: {e}", from.display(), to.display()))?;
    }
    let load = read_json(&out.join("load.json"))?;
    let memory = read_json(&out.join("memory.json"))?;
    plots(&load, &core, docs)?;
    let md = results_md(&load, &memory, &core);
    std::fs::write(docs.join("results.md"), md).map_err(|e| e.to_string())?;
    println!("  wrote {}", docs.display());
    let summary = root().join("docs/BENCHMARKS.md");
    splice(&summary, "load", &load_table(&load))?;
    splice(&summary, "engines", &engines_table(&load))?;
    splice(&summary, "core", &core_table(&core))?;
    splice(&summary, "wasm-ratios", &wasm_ratio_table(&load))?;
    splice(&summary, "memory", &memory_table(&memory))?;
    println!("  updated the tables of {}", summary.display());
    Ok(())
}

/// Replaces what lies between `<!-- generated: NAME -->` and the next `<!-- end generated -->`
/// in `path` by `table` (the prose around the tables is written by hand).
fn splice(path: &Path, name: &str, table: &str) -> Result<()> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let begin = format!("<!-- generated: {name} -->\n");
    let end = "<!-- end generated -->";
    let Some(start) = text.find(&begin).map(|i| i + begin.len()) else {
        return Err(format!("{}: no `{}` marker", path.display(), begin.trim_end()));
    };
    let Some(stop) = text[start..].find(end).map(|i| start + i) else {
        return Err(format!("{}: `{}` is not closed by `{end}`", path.display(), begin.trim_end()));
    };
    let spliced = format!("{}{table}{}", &text[..start], &text[stop..]);
    std::fs::write(path, spliced).map_err(|e| format!("{}: {e}", path.display()))
}

/// `12345.6` as `12,346`.
fn thousands(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let digits = format!("{v:.0}");
    let (sign, digits) = digits.strip_prefix('-').map_or(("", digits.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    format!("{sign}{out}")
}

/// `0.70–0.94`: the range of a ratio's runs (`runs_vs_*`), if there was more than one run.
fn runs_range(runs: &Value) -> Option<String> {
    let runs: Vec<f64> = runs.as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
    match (runs.iter().copied().reduce(f64::min), runs.iter().copied().reduce(f64::max)) {
        (Some(lo), Some(hi)) if runs.len() > 1 => Some(format!("{lo:.2}–{hi:.2}")),
        _ => None,
    }
}

/// A number with `digits` decimals, `-` when it is absent or not finite.
fn num(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite()).map_or("-".into(), |v| format!("{v:.digits$}"))
}

/// `0.81 (0.70–0.94)`: a pooled ratio and its runs' range.
fn ratio_runs(ratio: &Value, runs: &Value) -> String {
    let Some(r) = ratio.as_f64().filter(|r| r.is_finite()) else { return "-".into() };
    match runs_range(runs) {
        Some(range) => format!("{r:.2} ({range})"),
        None => format!("{r:.2}"),
    }
}

/// One measured point of load.json's `ratios`: its workload and concurrency, and the
/// reference's, the floor's and the peer's measurements there.
struct Point<'a> {
    ratio: &'a Value,
    workload: &'a str,
    conc: u64,
    kvpages: Row<'a>,
    floor: Option<Row<'a>>,
    peer: Option<Row<'a>>,
}

fn points(load: &Value) -> Vec<Point<'_>> {
    let peer = peer_name(load);
    let mut out = Vec::new();
    for ratio in load["ratios"].as_array().into_iter().flatten() {
        let workload = ratio["workload"].as_str().unwrap_or("");
        let conc = ratio["concurrency"].as_u64().unwrap_or(0);
        let Some(kvpages) = find(load, "kvpages", workload, conc) else { continue };
        let floor = find(load, "floor", workload, conc);
        let peer = peer.as_deref().and_then(|n| find(load, n, workload, conc));
        out.push(Point { ratio, workload, conc, kvpages, floor, peer });
    }
    out
}

/// A target measured beside the reference (`--targets` after the first).
struct Other {
    target: String,
    engine: String,
    durability: String,
}

/// The other targets, in the order the run measured them.
fn other_targets(load: &Value) -> Vec<Other> {
    let mut out: Vec<Other> = Vec::new();
    for r in load["ratios"].as_array().into_iter().flatten() {
        for o in r["others"].as_array().into_iter().flatten() {
            let target = o["target"].as_str().unwrap_or("");
            if !out.iter().any(|x| x.target == target) {
                let field = |k: &str| o[k].as_str().unwrap_or("?").to_owned();
                out.push(Other { target: target.to_owned(), engine: field("engine"), durability: field("durability") });
            }
        }
    }
    out
}

/// `target`'s entry among a point's `others`.
fn other_at<'a>(ratio: &'a Value, target: &str) -> Option<&'a Value> {
    ratio["others"].as_array().into_iter().flatten().find(|o| o["target"] == target)
}

/// BENCHMARKS.md's load table: kvpages (the reference target), the floor and the peer.
fn load_table(load: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| workload | conc | kvpages req/s | p50 µs | p99 µs | floor req/s | ÷floor (runs) | cpu ÷floor | peer req/s | ÷peer |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|");
    for Point { ratio: r, workload: w, conc: c, kvpages: k, floor, peer } in points(load) {
        let (vs_peer, cpu) = (num(r["vs_peer"].as_f64(), 1), num(r["cpu_vs_floor"].as_f64(), 2));
        let _ = writeln!(
            s,
            "| {w} | {c} | {} | {:.0} | {:.0} | {} | {} | {cpu} | {} | {vs_peer} |",
            thousands(k.f("requests_per_s")),
            k.lat("p50_us"),
            k.lat("p99_us"),
            thousands(floor.map_or(f64::NAN, |f| f.f("requests_per_s"))),
            ratio_runs(&r["vs_floor"], &r["runs_vs_floor"]),
            thousands(peer.map_or(f64::NAN, |p| p.f("requests_per_s"))),
        );
    }
    s
}

/// BENCHMARKS.md's criterion table: ns per key (initialize: per command) by pool size.
fn core_table(core: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::from("| pool pages |");
    for (_, title) in CRITERION_GROUPS {
        let _ = write!(s, " {title} |");
    }
    let _ = writeln!(s, "\n|---:|{}", "---:|".repeat(CRITERION_GROUPS.len()));
    for exp in 3..=8 {
        let size = 10u64.pow(exp).to_string();
        let _ = write!(s, "| 10^{exp} |");
        for (group, _) in CRITERION_GROUPS {
            let ns = core["groups"][group][&size]["ns"].as_f64().filter(|v| v.is_finite());
            let _ = write!(s, " {} |", ns.map_or("-".into(), |v| format!("{v:.1}")));
        }
        s.push('\n');
    }
    s
}

/// BENCHMARKS.md's table of the plugin's req/s over native's: workloads by concurrency.
fn wasm_ratio_table(load: &Value) -> String {
    use std::fmt::Write;
    let concs = concurrencies(load);
    let mut s = String::from("| workload |");
    for c in &concs {
        let _ = write!(s, " {c} |");
    }
    let _ = writeln!(s, "\n|---|{}", "---|".repeat(concs.len()));
    let in_memory = |engine: &str| {
        other_targets(load).into_iter().find(|o| o.engine == engine && o.durability == "memory").map(|o| o.target)
    };
    let (wasm, native) = (in_memory("wasm"), in_memory("native"));
    let ratios: Vec<&Value> = load["ratios"].as_array().into_iter().flatten().collect();
    for w in workloads(load) {
        let _ = write!(s, "| {w} |");
        for &c in &concs {
            let at = ratios.iter().find(|r| r["workload"] == w.as_str() && r["concurrency"].as_u64() == Some(c));
            let pair = at.and_then(|&r| Some((other_at(r, wasm.as_deref()?)?, other_at(r, native.as_deref()?)?)));
            let cell = pair.map_or("-".into(), |(wasm, native)| {
                // Both are measured against the same reference: their quotient is wasm ÷ native.
                let over = |k: &str| Some(wasm[k].as_f64()? / native[k].as_f64()?);
                let runs = |k: &str| -> Vec<f64> {
                    let side = |o: &Value| o[k].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
                    let (a, b): (Vec<f64>, Vec<f64>) = (side(wasm), side(native));
                    a.iter().zip(&b).map(|(a, b)| a / b).collect()
                };
                let ratio = ratio_runs(&over("vs_reference").into(), &runs("runs_vs_reference").into());
                match num(over("cpu_vs_reference"), 2).as_str() {
                    "-" => ratio,
                    cpu => format!("{ratio}, cpu {cpu}"),
                }
            });
            let _ = write!(s, " {cell} |");
        }
        s.push('\n');
    }
    s
}

/// BENCHMARKS.md's engines table: every other target beside the reference, run by run.
fn engines_table(load: &Value) -> String {
    use std::fmt::Write;
    let others = other_targets(load);
    let mut s = String::from("| workload | conc |");
    for o in &others {
        let _ = write!(s, " {}/{} req/s | ÷kvpages (runs) |", o.engine, o.durability);
    }
    let _ = writeln!(s, "\n|---|---:|{}", "---:|---|".repeat(others.len()));
    for r in load["ratios"].as_array().into_iter().flatten() {
        let _ = write!(s, "| {} | {} |", r["workload"].as_str().unwrap_or(""), r["concurrency"]);
        for other in &others {
            match other_at(r, &other.target) {
                Some(o) => {
                    let _ = write!(
                        s,
                        " {} | {} |",
                        thousands(o["requests_per_s"].as_f64().unwrap_or(f64::NAN)),
                        ratio_runs(&o["vs_reference"], &o["runs_vs_reference"])
                    );
                }
                None => s.push_str(" - | - |"),
            }
        }
        s.push('\n');
    }
    s
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The criterion groups of the report and their column titles in BENCHMARKS.md's table: the
/// core's (`crates/core/benches/core.rs`), each beside the same pool-size group through the
/// plugin (`crates/host/benches/plugin.rs`, `plugin_*`).
const CRITERION_GROUPS: [(&str, &str); 7] = [
    ("allocate_confirm_32", "allocate+confirm (32)"),
    ("plugin_allocate_confirm_32", "plugin"),
    ("exists_32", "exists (32, 50 % hits)"),
    ("plugin_exists_32", "plugin"),
    ("locations_32", "locations (32)"),
    ("plugin_locations_32", "plugin"),
    ("initialize", "initialize"),
];

/// `{group: {pool size: ns per key}}` from criterion's `new/estimates.json` files.
fn read_criterion(dir: &Path) -> Result<Value> {
    let mut groups = serde_json::Map::new();
    for (group, _) in CRITERION_GROUPS {
        let per = if group == "initialize" { 1.0 } else { 32.0 };
        let mut sizes = serde_json::Map::new();
        let gdir = dir.join(group);
        let entries = std::fs::read_dir(&gdir).map_err(|e| format!("{}: {e}", gdir.display()))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.parse::<u64>().is_err() {
                continue;
            }
            let est = read_json(&e.path().join("new/estimates.json"))?;
            let mean = est["mean"]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            let lo = est["mean"]["confidence_interval"]["lower_bound"].as_f64().unwrap_or(f64::NAN);
            let hi = est["mean"]["confidence_interval"]["upper_bound"].as_f64().unwrap_or(f64::NAN);
            sizes.insert(name, serde_json::json!({"ns": mean / per, "ns_low": lo / per, "ns_high": hi / per}));
        }
        groups.insert(group.into(), Value::Object(sizes));
    }
    Ok(serde_json::json!({
        "kind": "core",
        "unit": "ns per key (initialize: ns per command), criterion mean and 95 % interval",
        "groups": groups
    }))
}

/// One measurement of load.json.
struct Row<'a>(&'a Value);

impl Row<'_> {
    fn s(&self, k: &str) -> &str {
        self.0[k].as_str().unwrap_or("")
    }
    fn f(&self, k: &str) -> f64 {
        self.0[k].as_f64().unwrap_or(f64::NAN)
    }
    /// A field that may be absent or null (older JSON, a server in another process).
    fn opt(&self, k: &str) -> Option<f64> {
        self.0[k].as_f64()
    }
    fn conc(&self) -> u64 {
        self.0["concurrency"].as_u64().unwrap_or(0)
    }
    fn lat(&self, k: &str) -> f64 {
        self.0["latency"][k].as_f64().unwrap_or(f64::NAN)
    }
}

fn rows(load: &Value) -> Vec<Row<'_>> {
    load["results"].as_array().map(|a| a.iter().map(Row).collect()).unwrap_or_default()
}

fn workloads(load: &Value) -> Vec<String> {
    let mut seen = Vec::new();
    for r in rows(load) {
        if !seen.iter().any(|w| w == r.s("workload")) {
            seen.push(r.s("workload").to_owned());
        }
    }
    seen
}

fn find<'a>(load: &'a Value, target: &str, w: &str, c: u64) -> Option<Row<'a>> {
    rows(load).into_iter().find(|r| r.s("target") == target && r.s("workload") == w && r.conc() == c)
}

fn peer_name(load: &Value) -> Option<String> {
    rows(load).iter().map(|r| r.s("target").to_owned()).find(|t| !t.starts_with("kvpages") && t != "floor")
}

fn results_md(load: &Value, memory: &Value, core: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let m = &load["machine"];
    let _ = writeln!(s, "# Benchmark results (generated by `cargo xtask bench`; do not edit)\n");
    let _ = writeln!(
        s,
        "Machine: {} CPUs ({}), {:.1} GiB memory. Command: `{}`.\n",
        m["nproc"],
        m["cpu"].as_str().unwrap_or("?"),
        m["mem_total_kib"].as_f64().unwrap_or(0.0) / 1048576.0,
        command_of(load)
    );
    let _ = writeln!(s, "Pool: {}.\n", load["pool"].as_str().unwrap_or(""));
    let peer = peer_name(load);
    let reference = load["targets"].as_array().and_then(|t| t.first());
    let _ = writeln!(
        s,
        "## Load (HTTP/1.1 keep-alive on loopback; engine {}, durability {})\n",
        reference.and_then(|t| t["engine"].as_str()).unwrap_or("?"),
        reference.and_then(|t| t["durability"].as_str()).unwrap_or("?")
    );
    let _ = writeln!(
        s,
        "req/s and latency per request (every request of a workload); keys/s = iterations × keys per iteration / s. \
         ÷floor: kvpages req/s over the transport-only floor's at the same concurrency and body sizes, pooled over the \
         runs (range: each run alone). cpu µs: the server threads' CPU time per request (pool resets left out); \
         cpu ÷floor: the floor's cpu µs over kvpages' (the share of the floor's throughput a busy server thread \
         keeps; time the shared machine gives to others is not in it). ÷peer: kvpages req/s over {}'s.\n",
        peer.as_deref().unwrap_or("the peer (not measured)")
    );
    let _ = writeln!(
        s,
        "| workload | conc | req/s | keys/s | p50 µs | p99 µs | p99.9 µs | floor req/s | ÷floor | runs ÷floor | cpu µs | cpu ÷floor | peer req/s | peer p50 µs | ÷peer |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for Point { ratio: r, workload: w, conc: c, kvpages: k, floor: f, peer: p } in points(load) {
        let range = runs_range(&r["runs_vs_floor"]).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "| {w} | {c} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {range} | {} | {} | {} | {} | {} |",
            k.f("requests_per_s"),
            k.f("keys_per_s"),
            k.lat("p50_us"),
            k.lat("p99_us"),
            k.lat("p999_us"),
            num(f.as_ref().map(|f| f.f("requests_per_s")), 0),
            num(r["vs_floor"].as_f64(), 2),
            num(k.opt("server_cpu_us_per_request"), 1),
            num(r["cpu_vs_floor"].as_f64(), 2),
            num(p.as_ref().map(|p| p.f("requests_per_s")), 0),
            num(p.as_ref().map(|p| p.lat("p50_us")), 0),
            num(r["vs_peer"].as_f64(), 1),
        );
    }
    others_md(&mut s, load);
    memory_md(&mut s, memory);
    core_md(&mut s, core);
    s
}

/// A report's command line, paths relative to the repository.
fn command_of(report: &Value) -> String {
    report["command"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
        .replace(&format!("{}/", root().display()), "")
}

/// The memory section of results.md: the table of [`memory_table`].
fn memory_md(s: &mut String, memory: &Value) {
    use std::fmt::Write;
    let _ = writeln!(s, "\n## Memory (`kvpages bench --memory`)\n");
    s.push_str(&memory_table(memory));
}

/// RSS per stored key by engine, the peak while a snapshot is taken, and a huge rank's
/// initialization (in results.md and docs/BENCHMARKS.md).
fn memory_table(memory: &Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let s = &mut out;
    let _ = writeln!(
        s,
        "{} keys ({}) stored on {} rank(s) of {} pages each, by batches of 4,096 (allocate + confirm), each engine in a process of its own. Command: `{}`.\n",
        memory["keys"],
        memory["key_form"].as_str().unwrap_or(""),
        memory["ranks"],
        memory["pool_pages"],
        command_of(memory)
    );
    let _ = writeln!(
        s,
        "| engine | B per key (VmRSS growth) | VmRSS before → after | stored in | plugin linear memory | snapshot | peak VmRSS while taking it |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let mib = |kib: &Value| kib.as_u64().unwrap_or(0) as f64 / 1024.0;
    for e in memory["engines"].as_array().into_iter().flatten() {
        let mut linear =
            e["linear_memory_bytes"].as_u64().map_or("-".to_owned(), |b| format!("{:.0} MiB", b as f64 / 1048576.0));
        if let Some(traps) = e["traps"].as_u64().filter(|&t| t > 0) {
            linear.push_str(&format!(" ({traps} traps)"));
        }
        let over = e["snapshot_peak_rss_kib"].as_i64().unwrap_or(0) - e["rss_after_kib"].as_i64().unwrap_or(0);
        let snapshot = match e["snapshot_bytes"].as_u64() {
            Some(bytes) => {
                format!("{:.0} MB in {:.2} s", bytes as f64 / 1e6, e["snapshot_seconds"].as_f64().unwrap_or(f64::NAN))
            }
            None => format!("**failed**: {}", e["snapshot_error"].as_str().unwrap_or("?")),
        };
        let _ = writeln!(
            s,
            "| {} | **{:.1}** | {:.0} → {:.0} MiB | {:.1} s | {linear} | {snapshot} | {:.0} MiB ({:+.0} MiB over the state) |",
            e["engine"].as_str().unwrap_or("?"),
            e["rss_per_key_bytes"].as_f64().unwrap_or(f64::NAN),
            mib(&e["rss_before_kib"]),
            mib(&e["rss_after_kib"]),
            e["store_seconds"].as_f64().unwrap_or(f64::NAN),
            mib(&e["snapshot_peak_rss_kib"]),
            over as f64 / 1024.0,
        );
    }
    let _ = writeln!(
        s,
        "\nInitializing a {}-page rank (native): {:.1} µs, VmRSS {:+} KiB; the first allocate+confirm of 32 keys on it: {:.1} µs.",
        memory["huge_rank_pages"],
        memory["huge_rank_init_us"].as_f64().unwrap_or(f64::NAN),
        memory["huge_rank_rss_kib"].as_i64().unwrap_or(0),
        memory["huge_rank_first_allocate_confirm_us"].as_f64().unwrap_or(f64::NAN)
    );
    out
}

/// The core's criterion figures by pool size, natively and through the plugin.
fn core_md(s: &mut String, core: &Value) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n## Core alone and through the plugin (`plugin_*`; criterion; {})\n",
        core["unit"].as_str().unwrap_or("")
    );
    let groups = core["groups"].as_object().cloned().unwrap_or_default();
    let mut sizes: Vec<u64> = groups
        .values()
        .flat_map(|g| g.as_object().into_iter().flat_map(|o| o.keys()))
        .filter_map(|k| k.parse().ok())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let _ = write!(s, "| pool pages |");
    for g in groups.keys() {
        let _ = write!(s, " {g} |");
    }
    let _ = writeln!(s, "\n|---:|{}", "---:|".repeat(groups.len()));
    for size in sizes {
        let _ = write!(s, "| {size} |");
        for g in groups.values() {
            let v = &g[size.to_string()];
            let _ = write!(
                s,
                " {:.1} ({:.1}–{:.1}) |",
                v["ns"].as_f64().unwrap_or(f64::NAN),
                v["ns_low"].as_f64().unwrap_or(f64::NAN),
                v["ns_high"].as_f64().unwrap_or(f64::NAN)
            );
        }
        let _ = writeln!(s);
    }
}

/// The other `--targets` (engines, durable modes) beside the reference, one table each.
fn others_md(s: &mut String, load: &Value) {
    use std::fmt::Write;
    let ratios: Vec<&Value> = load["ratios"].as_array().into_iter().flatten().collect();
    let opt = |v: &Value| num(v.as_f64(), 2);
    for Other { target, engine, durability } in other_targets(load) {
        let _ = writeln!(
            s,
            "\n## Engine {engine}, durability {durability} (same run; ÷kvpages: over the reference's req/s; \
             cpu ÷kvpages: the reference's server CPU per request over this one's)\n"
        );
        let _ = writeln!(
            s,
            "| workload | conc | req/s | p50 µs | p99 µs | ÷floor | ÷kvpages | runs ÷kvpages | cpu ÷kvpages |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &ratios {
            let Some(o) = other_at(r, &target) else { continue };
            let range = runs_range(&o["runs_vs_reference"]).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {range} | {} |",
                r["workload"].as_str().unwrap_or(""),
                r["concurrency"],
                o["requests_per_s"].as_f64().unwrap_or(f64::NAN),
                o["p50_us"].as_f64().unwrap_or(f64::NAN),
                o["p99_us"].as_f64().unwrap_or(f64::NAN),
                opt(&o["vs_floor"]),
                opt(&o["vs_reference"]),
                opt(&o["cpu_vs_reference"]),
            );
        }
    }
}

type Plot = std::result::Result<(), Box<dyn std::error::Error>>;

fn plots(load: &Value, core: &Value, docs: &Path) -> Result<()> {
    let err = |what: &str, e: Box<dyn std::error::Error>| format!("plot {what}: {e}");
    throughput_vs_concurrency(load, &docs.join("throughput_vs_concurrency.svg")).map_err(|e| err("throughput", e))?;
    latency_vs_concurrency(load, &docs.join("latency_vs_concurrency.svg")).map_err(|e| err("latency", e))?;
    ratio_vs_concurrency(load, &docs.join("ratio_to_floor_vs_concurrency.svg")).map_err(|e| err("ratio", e))?;
    batch_size(load, &docs.join("batch_size.svg")).map_err(|e| err("batch size", e))?;
    core_pool_size(core, &docs.join("core_vs_pool_size.svg")).map_err(|e| err("core", e))?;
    peer_ratio_vs_concurrency(load, &docs.join("kvpages_vs_peer.svg")).map_err(|e| err("peer", e))?;
    Ok(())
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

fn concurrencies(load: &Value) -> Vec<u64> {
    let mut c: Vec<u64> = rows(load).iter().map(Row::conc).collect();
    c.sort_unstable();
    c.dedup();
    c
}

/// Lines over concurrency (log-2 x axis), one per (label, points) series; `log_y` for rates.
/// 1234 -> "1.2k", 3_400_000 -> "3.4M": readable log-axis labels.
fn si(v: &f64) -> String {
    let v = *v;
    let (d, unit) = match v.abs() {
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e3 => (1e3, "k"),
        _ => (1.0, ""),
    };
    let x = v / d;
    if (x - x.round()).abs() < 0.05 { format!("{x:.0}{unit}") } else { format!("{x:.1}{unit}") }
}

/// Side-by-side panels of lines over concurrency (log-2 x axis) sharing one y range;
/// `log_y` for rates and latencies, linear for ratios.
fn concurrency_chart(path: &Path, panels: Vec<(String, Vec<Series>)>, y_desc: &str, log_y: bool) -> Plot {
    let width = 960 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width.min(1800), 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let all: Vec<&Series> = panels.iter().flat_map(|p| p.1.iter()).collect();
    let xmax = all.iter().flat_map(|s| s.3.iter().map(|p| p.0)).max().unwrap_or(1).max(2) as f64;
    let ys: Vec<f64> = all.iter().flat_map(|s| s.3.iter().map(|p| p.1)).filter(|v| v.is_finite() && *v > 0.0).collect();
    let (ymin, ymax) = (ys.iter().copied().fold(f64::INFINITY, f64::min), ys.iter().copied().fold(0.0, f64::max));
    if !ymin.is_finite() {
        return Ok(());
    }
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, (title, series)) in areas.iter().zip(&panels) {
        let mut b = ChartBuilder::on(area);
        b.caption(title, ("sans-serif", 20)).margin(12).x_label_area_size(44).y_label_area_size(70);
        let x_range = (0.8f64..xmax * 1.25).log_scale();
        if log_y {
            let mut chart = b.build_cartesian_2d(x_range, (ymin * 0.5..ymax * 2.0).log_scale())?;
            chart
                .configure_mesh()
                .x_desc("concurrent connections")
                .y_desc(y_desc)
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_label_formatter(&si)
                .draw()?;
            draw_lines(&mut chart, series)?;
        } else {
            let mut chart = b.build_cartesian_2d(x_range, 0.0..(ymax * 1.15).max(1.2))?;
            chart
                .configure_mesh()
                .x_desc("concurrent connections")
                .y_desc(y_desc)
                .x_label_formatter(&|x| format!("{x:.0}"))
                .draw()?;
            draw_lines(&mut chart, series)?;
        }
    }
    root.present()?;
    Ok(())
}

type Series = (String, RGBColor, bool, Vec<(u64, f64)>);

fn draw_lines<'a, Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<LogCoord<f64>, Y>>,
    series: &[Series],
) -> Plot {
    for (label, col, dashed, points) in series {
        let pts = points.iter().filter(|p| p.1.is_finite() && p.1 > 0.0).map(|&(x, y)| (x as f64, y)).collect();
        draw_line(chart, label, *col, *dashed, if *dashed { 1 } else { 2 }, pts)?;
    }
    draw_legend(chart, SeriesLabelPosition::LowerRight)
}

/// One series: its line (dashed or solid, `width` wide), its legend entry unless `label` is
/// empty, and a circle at each point.
fn draw_line<'a, Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<LogCoord<f64>, Y>>,
    label: &str,
    col: RGBColor,
    dashed: bool,
    width: u32,
    pts: Vec<(f64, f64)>,
) -> Plot {
    let style = ShapeStyle { color: col.to_rgba(), filled: false, stroke_width: width };
    let s = if dashed {
        chart.draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))?
    } else {
        chart.draw_series(LineSeries::new(pts.clone(), style))?
    };
    if !label.is_empty() {
        s.label(label).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, col.filled())))?;
    Ok(())
}

fn draw_legend<'a, Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<LogCoord<f64>, Y>>,
    position: SeriesLabelPosition,
) -> Plot {
    chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).position(position).draw()?;
    Ok(())
}

fn throughput_vs_concurrency(load: &Value, path: &Path) -> Plot {
    let cs = concurrencies(load);
    let line = |target: &str, w: &str| -> Vec<(u64, f64)> {
        cs.iter().filter_map(|&c| find(load, target, w, c).map(|r| (c, r.f("requests_per_s")))).collect()
    };
    let ws = workloads(load);
    let mut panels = vec![(
        "kvpages requests/s (dashed: the floor)".to_string(),
        ws.iter()
            .enumerate()
            .flat_map(|(i, w)| {
                [(w.clone(), color(i), false, line("kvpages", w)), (String::new(), color(i), true, line("floor", w))]
            })
            .collect::<Vec<_>>(),
    )];
    if let Some(p) = peer_name(load) {
        let series = ws.iter().enumerate().map(|(i, w)| (w.clone(), color(i), false, line(&p, w))).collect();
        panels.push((format!("{p} requests/s (same scale)"), series));
    }
    concurrency_chart(path, panels, "requests/s", true)
}

/// Workload `w`'s ratio `field` (`vs_floor`, `vs_peer`) at each concurrency.
fn ratio_line(load: &Value, w: &str, field: &str) -> Vec<(u64, f64)> {
    load["ratios"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["workload"].as_str() == Some(w))
        .filter_map(|r| Some((r["concurrency"].as_u64()?, r[field].as_f64()?)))
        .collect()
}

fn peer_ratio_vs_concurrency(load: &Value, path: &Path) -> Plot {
    let Some(p) = peer_name(load) else { return Ok(()) };
    let series = workloads(load)
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), color(i), false, ratio_line(load, w, "vs_peer")))
        .collect();
    concurrency_chart(path, vec![(format!("kvpages requests/s ÷ {p}'s (same run)"), series)], "times faster", true)
}

fn latency_vs_concurrency(load: &Value, path: &Path) -> Plot {
    let cs = concurrencies(load);
    let mut series = Vec::new();
    for (i, w) in workloads(load).iter().enumerate() {
        for (k, dashed) in [("p50_us", false), ("p99_us", true)] {
            let pts = cs.iter().filter_map(|&c| find(load, "kvpages", w, c).map(|r| (c, r.lat(k)))).collect();
            series.push((format!("{w} {}", &k[..3]), color(i), dashed, pts));
        }
    }
    concurrency_chart(path, vec![("kvpages latency per request (solid p50, dashed p99)".into(), series)], "µs", true)
}

fn ratio_vs_concurrency(load: &Value, path: &Path) -> Plot {
    let mut series = Vec::new();
    for (i, w) in workloads(load).iter().enumerate() {
        series.push((w.clone(), color(i), false, ratio_line(load, w, "vs_floor")));
    }
    concurrency_chart(
        path,
        vec![("kvpages requests/s ÷ transport-only floor (same run, same bodies)".into(), series)],
        "ratio to floor",
        false,
    )
}

fn batch_size(load: &Value, path: &Path) -> Plot {
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    let families: [(&str, &[(u64, &str)]); 2] = [
        ("batch_exists", &[(32, "exists-32"), (256, "exists-256"), (1250, "exists-1250")]),
        ("allocate+confirm", &[(32, "allocate-confirm-32"), (128, "allocate-confirm-128")]),
    ];
    let cs = concurrencies(load);
    for (area, metric, desc) in [(&left, "keys_per_s", "keys/s"), (&right, "p50_us", "p50 µs per request")] {
        let value = |r: &Row<'_>| if metric == "keys_per_s" { r.f(metric) } else { r.lat(metric) };
        let mut all = Vec::new();
        for (_, members) in &families {
            for c in &cs {
                for (_, w) in members.iter() {
                    if let Some(r) = find(load, "kvpages", w, *c) {
                        all.push(value(&r));
                    }
                }
            }
        }
        let ymin = all.iter().copied().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
        let ymax = all.iter().copied().fold(0.0, f64::max);
        if !ymin.is_finite() {
            continue;
        }
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{desc} vs keys per request"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(80)
            .build_cartesian_2d((20f64..2000f64).log_scale(), (ymin * 0.7..ymax * 1.5).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("keys per request")
            .y_desc(desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&si)
            .draw()?;
        for (fi, (name, members)) in families.iter().enumerate() {
            for (ci, &c) in cs.iter().enumerate() {
                let pts: Vec<(f64, f64)> = members
                    .iter()
                    .filter_map(|(b, w)| find(load, "kvpages", w, c).map(|r| (*b as f64, value(&r))))
                    .filter(|p| p.1 > 0.0)
                    .collect();
                draw_line(&mut chart, &format!("{name} c={c}"), color(ci), fi != 0, 2, pts)?;
            }
        }
        draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    root.present()?;
    Ok(())
}

fn core_pool_size(core: &Value, path: &Path) -> Plot {
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let groups: BTreeMap<String, Vec<(f64, f64)>> = core["groups"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(g, sizes)| {
            let mut pts: Vec<(f64, f64)> = sizes
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.parse::<f64>().ok()?, v["ns"].as_f64()?)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (g.clone(), pts)
        })
        .collect();
    let ys: Vec<f64> = groups.values().flatten().map(|p| p.1).filter(|v| *v > 0.0).collect();
    let (ymin, ymax) = (ys.iter().copied().fold(f64::INFINITY, f64::min), ys.iter().copied().fold(0.0, f64::max));
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "the core natively and through the plugin (plugin_*): ns per key vs pool size (initialize: per command)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d((500f64..2e8).log_scale(), (ymin * 0.5..ymax * 3.0).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("pages in the pool")
        .y_desc("ns")
        .x_label_formatter(&|x| format!("{x:.0e}"))
        .draw()?;
    for (i, (g, pts)) in groups.iter().enumerate() {
        draw_line(&mut chart, g, color(i), false, 2, pts.clone())?;
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present()?;
    Ok(())
}

/// Where the smoke run of `cargo xtask test` writes its JSON (never docs/).
pub(crate) fn smoke_json() -> PathBuf {
    root().join("target/bench/smoke.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        let cases = [(0.0, "0"), (999.4, "999"), (1000.0, "1,000"), (12345.6, "12,346"), (1234567.0, "1,234,567")];
        for (v, want) in cases {
            assert_eq!(thousands(v), want);
        }
        assert_eq!(thousands(-4321.0), "-4,321");
        assert_eq!(thousands(f64::NAN), "-");
    }

    #[test]
    fn splice_replaces_only_between_the_markers() {
        let dir = std::env::temp_dir().join(format!("kvpages-splice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("doc.md");
        let doc = "intro\n<!-- generated: a -->\nold\n<!-- end generated -->\nmiddle\n<!-- generated: b -->\nold b\n<!-- end generated -->\nend\n";
        std::fs::write(&path, doc).unwrap();
        splice(&path, "a", "new a\n").unwrap();
        splice(&path, "b", "").unwrap();
        let got = std::fs::read_to_string(&path).unwrap();
        let want = "intro\n<!-- generated: a -->\nnew a\n<!-- end generated -->\nmiddle\n<!-- generated: b -->\n<!-- end generated -->\nend\n";
        assert_eq!(got, want);
        assert!(splice(&path, "c", "x").unwrap_err().contains("no `<!-- generated: c -->` marker"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The committed report's JSON renders every measured point, in the documented columns.
    #[test]
    fn the_tables_render_the_committed_results() {
        let docs = root().join("docs/bench");
        let load = read_json(&docs.join("load.json")).unwrap();
        let core = read_json(&docs.join("core.json")).unwrap();
        let points = load["ratios"].as_array().unwrap().len();
        // The full run's 8 workloads at 4 concurrencies: an empty report would pass the checks below.
        assert_eq!(points, 32, "the committed load.json has every point");
        let table = load_table(&load);
        assert_eq!(table.lines().count(), 2 + points);
        assert!(table.lines().skip(2).all(|l| l.matches('|').count() == 11), "{table}");
        // The committed run measured the server's CPU: every point has its CPU ratios.
        assert!(!table.lines().skip(2).any(|l| l.split('|').nth(8).is_some_and(|c| c.trim() == "-")), "{table}");
        let engines = engines_table(&load);
        assert_eq!(engines.lines().count(), 2 + points);
        assert!(!engines.contains("NaN"), "{engines}");
        let wasm = wasm_ratio_table(&load);
        assert_eq!(wasm.lines().count(), 2 + workloads(&load).len());
        assert!(!wasm.contains(" - |"), "every point has a wasm ratio: {wasm}");
        assert_eq!(wasm.matches(", cpu ").count(), points, "every point has a CPU ratio: {wasm}");
        let core_rows = core_table(&core);
        assert_eq!(core_rows.lines().count(), 2 + 6);
        let memory = read_json(&docs.join("memory.json")).unwrap();
        let engines: Vec<_> = memory_table(&memory)
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| engine"))
            .map(str::to_owned)
            .collect();
        assert_eq!(engines.len(), 2, "both engines measured: {engines:?}");
        assert!(engines.iter().all(|l| !l.contains("NaN") && l.matches('|').count() == 8), "{engines:?}");
        assert!(!core_rows.contains(" - |"), "every pool size has every group: {core_rows}");
    }

    /// BENCHMARKS.md keeps the markers `cargo xtask bench` writes its tables
    /// between, and hold the tables the committed JSON renders: a hand edit that drops a marker
    /// or changes a generated table fails here, not at the end of a 20-minute run.
    #[test]
    fn the_docs_hold_the_tables_of_the_committed_results() {
        let docs = root().join("docs/bench");
        let load = read_json(&docs.join("load.json")).unwrap();
        let core = read_json(&docs.join("core.json")).unwrap();
        let memory = read_json(&docs.join("memory.json")).unwrap();
        let dir = std::env::temp_dir().join(format!("kvpages-docs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tables = [
            ("docs/BENCHMARKS.md", "load", load_table(&load)),
            ("docs/BENCHMARKS.md", "engines", engines_table(&load)),
            ("docs/BENCHMARKS.md", "core", core_table(&core)),
            ("docs/BENCHMARKS.md", "wasm-ratios", wasm_ratio_table(&load)),
            ("docs/BENCHMARKS.md", "memory", memory_table(&memory)),
        ];
        for (file, name, table) in tables {
            let committed = std::fs::read_to_string(root().join(file)).unwrap();
            let copy = dir.join(name);
            std::fs::write(&copy, &committed).unwrap();
            splice(&copy, name, &table).unwrap_or_else(|e| panic!("{file}: {e}"));
            let rendered = std::fs::read_to_string(&copy).unwrap();
            assert!(rendered == committed, "{file}: the `{name}` table is not what docs/bench's JSON renders");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

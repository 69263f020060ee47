//! `cargo xtask`: what plain cargo can't do — set the machine up, run every test, serve.
//!
//! - `cargo xtask test`: installs what the tests need (Python's pytest and requests, a no_std
//!   Rust target), builds the workspace, runs every Rust and Python test, proves `kvpages-core`
//!   builds without std, and fails if any step fails or no test ran.
//! - `cargo xtask serve [FLAGS]`: builds the plugin and the release binary, runs `kvpages serve FLAGS`.
//! - `cargo xtask plugin`: builds the wasm plugin component the server embeds (see `plugin.rs`;
//!   `KVPAGES_WASM_ROUTE=rustup|debian` picks how the wasm32 compiler is obtained).
//! - `cargo xtask simulator`: builds the browser simulator's wasm module the server embeds and
//!   serves at `/simulator/` (see `simulator.rs`).
//! - `cargo xtask bench [--quick | --report-only]`: the performance report in `docs/bench/` (see `bench.rs`).
//! - `cargo xtask wheel [--profile NAME]`: the Python wheel carrying the binary (see `wheel.rs`).
//! - `cargo xtask image [--tag NAME]`: the container image (see `image.rs`).
//!
//! Every step prints what it runs. Set `KVPAGES_NOSTD_ROUTE=debian` to force the fallback
//! route for the no_std build (Debian's rustc-web with `-Zbuild-std`), as a fresh machine
//! without rustup downloads would take.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

mod bench;
mod image;
#[cfg(test)]
mod layers;
mod plugin;
mod simulator;
mod wheel;

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("serve") => serve(&args[1..]),
        Some("bench") => bench::bench(&args[1..]),
        Some("plugin") => plugin::build().map(|_| ()),
        Some("simulator") => plugin::choose_route().and_then(simulator::build),
        Some("wheel") => wheel::wheel(&args[1..]),
        Some("image") => image::image(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask test | cargo xtask serve [kvpages serve flags] | cargo xtask bench [--quick | --report-only] | cargo xtask plugin | cargo xtask simulator | cargo xtask wheel [--profile release|dev] | cargo xtask image [--tag NAME]"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Announces a step with the time since xtask started, so a log shows where a run's time goes.
fn step(what: &str) {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let since = START.get_or_init(Instant::now).elapsed().as_secs();
    println!("\n==> [{}:{:02}] {what}", since / 60, since % 60);
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// Runs `cmd`, streaming its output, and fails unless it exits 0.
fn run(cmd: &mut Command) -> Result<()> {
    println!("+ {}", show(cmd));
    let status = cmd.status().map_err(|e| format!("{}: {e}", show(cmd)))?;
    if status.success() { Ok(()) } else { Err(format!("`{}` exited with {status}", show(cmd))) }
}

/// Runs `cmd`, streaming and capturing stdout+stderr lines; fails unless it exits 0.
fn run_capture(cmd: &mut Command) -> Result<Vec<String>> {
    println!("+ {}", show(cmd));
    let mut child =
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| format!("{}: {e}", show(cmd)))?;
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
            eprintln!("{line}");
            lines.push(line);
        }
        lines
    });
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines().map_while(std::result::Result::ok) {
        println!("{line}");
        lines.push(line);
    }
    lines.extend(err_thread.join().unwrap_or_default());
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() { Ok(lines) } else { Err(format!("`{}` exited with {status}", show(cmd))) }
}

/// Runs `cmd` with a time limit; `Ok(false)` when it failed or timed out.
fn run_with_timeout(cmd: &mut Command, limit: Duration) -> bool {
    println!("+ {} (time limit {}s)", show(cmd), limit.as_secs());
    let Ok(mut child) = cmd.spawn() else { return false };
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status.success(),
            Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(200)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                println!("  timed out after {}s", limit.as_secs());
                return false;
            }
        }
    }
}

fn show(cmd: &Command) -> String {
    let mut s = String::new();
    // The variables a step sets itself (the route's compiler, the guest's flags), so the printed
    // line can be run as it is.
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            s.push_str(&format!("{}={:?} ", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    s.push_str(&cmd.get_program().to_string_lossy());
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

fn have(program: &str, arg: &str) -> bool {
    Command::new(program).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Tests that may be `#[ignore]`d: generators run by hand, not checks (matched by the last
/// segment of the test's path).
const ALLOWED_IGNORED: &[&str] = &["write_golden"];

/// Sums cargo's `test result: ok. N passed; M failed` lines. An ignored test other than
/// [`ALLOWED_IGNORED`] is an error: it would let the run pass without running it.
fn count_cargo(lines: &[String]) -> Result<(u64, u64)> {
    let (mut passed, mut failed, mut ignored) = (0, 0, 0);
    for l in lines {
        if let Some(rest) = l.strip_prefix("test result: ") {
            passed += number_before(rest, " passed");
            failed += number_before(rest, " failed");
            ignored += number_before(rest, " ignored");
        }
    }
    // `test path::name ... ignored[, reason]`, one line per ignored test.
    let named: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("test ")?.split_once(" ... ").filter(|(_, r)| r.starts_with("ignored")))
        .map(|(name, _)| name)
        .collect();
    let unexpected: Vec<&str> = named
        .iter()
        .copied()
        .filter(|name| !ALLOWED_IGNORED.contains(&name.rsplit("::").next().unwrap_or(name)))
        .collect();
    if !unexpected.is_empty() {
        return Err(format!("ignored tests would pass the run without running: {}", unexpected.join(", ")));
    }
    if ignored != named.len() as u64 {
        return Err(format!(
            "cargo reported {ignored} ignored tests but named {} (is the harness quiet, e.g. CARGO_TERM_QUIET? it must print a line a test)",
            named.len()
        ));
    }
    Ok((passed, failed))
}

/// Reads pytest's closing `N passed` / `N failed`. Skipped, deselected, xfailed or xpassed
/// tests, or errors, make it an error: each would let the run pass with a test not run.
fn count_pytest(lines: &[String]) -> Result<(u64, u64)> {
    let Some(last) = lines.iter().rev().find(|l| l.contains(" passed") || l.contains(" failed")) else {
        return Ok((0, 0));
    };
    for word in [" skipped", " deselected", " xfailed", " xpassed", " error"] {
        if number_before(last, word) > 0 {
            return Err(format!("pytest did not run every test: {last}"));
        }
    }
    Ok((number_before(last, " passed"), number_before(last, " failed")))
}

/// A suite's `(passed, failed)`, or an error naming `suite` when it passed nothing: a suite
/// that ran no test proves nothing.
fn ran_some(suite: &str, (passed, failed): (u64, u64)) -> Result<(u64, u64)> {
    if passed == 0 {
        return Err(format!("{suite} ran no test"));
    }
    Ok((passed, failed))
}

fn number_before(s: &str, word: &str) -> u64 {
    let Some(i) = s.find(word) else { return 0 };
    let digits: String = s[..i].chars().rev().take_while(char::is_ascii_digit).collect();
    digits.chars().rev().collect::<String>().parse().unwrap_or(0)
}

fn ensure_python() -> Result<()> {
    step(
        "Python test dependencies (pytest, requests; fastapi, uvicorn, orjson to run vLLM's own server beside kvpages; kubernetes-validate for the manifests)",
    );
    let ok = Command::new("python3")
        .args(["-c", "import pytest, requests, urllib3, fastapi, uvicorn, orjson, yaml, kubernetes_validate"])
        .status();
    if ok.is_ok_and(|s| s.success()) {
        println!("  already installed");
        return Ok(());
    }
    if !have("python3", "--version") {
        run(Command::new("apt-get").args(["install", "-y", "python3", "python3-pip"]))?;
    }
    let pip = |extra: &[&str]| {
        let mut c = Command::new("python3");
        c.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "pytest",
            "requests",
            "fastapi",
            "uvicorn",
            "orjson",
            "pyyaml",
            "kubernetes-validate",
        ])
        .args(extra);
        run(&mut c)
    };
    pip(&[]).or_else(|_| pip(&["--break-system-packages"]))
}

/// Builds kvpages-core for a target without std, proving `#![no_std]` holds.
fn nostd_build() -> Result<()> {
    step("no_std proof: build kvpages-core for a target that has no std");
    let forced_debian = std::env::var("KVPAGES_NOSTD_ROUTE").is_ok_and(|v| v == "debian");
    if !forced_debian {
        let installed = Command::new("rustup")
            .args(["target", "list", "--installed"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == "wasm32v1-none"));
        let ready = installed
            || run_with_timeout(
                Command::new("rustup").args(["target", "add", "wasm32v1-none"]),
                Duration::from_secs(300),
            );
        if ready {
            println!("  route: rustup target wasm32v1-none (core + alloc only, no std exists for it)");
            for features in ["", "serde"] {
                run(cargo().args([
                    "build",
                    "-p",
                    "kvpages-core",
                    "--target",
                    "wasm32v1-none",
                    "--features",
                    features,
                ]))?;
            }
            return Ok(());
        }
        println!("  rustup could not provide wasm32v1-none; falling back to Debian's rustc-web");
    }
    println!("  route: Debian rustc-web with -Zbuild-std=core,alloc (std is never built, so any use of it fails)");
    if !Path::new("/usr/bin/rustc").exists() || !Path::new("/usr/lib/llvm-19/bin/wasm-ld").exists() {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "rustc-web", "cargo-web", "rust-web-src", "lld-19"]))?;
    }
    for features in ["", "serde"] {
        run(plugin::debian_cargo()
            .args(["build", "-p", "kvpages-core", "--target", "wasm32-unknown-unknown", "--target-dir", "target/nostd"])
            .args(["-Zbuild-std=core,alloc", "--features", features]))?;
    }
    Ok(())
}

fn test() -> Result<()> {
    let start = Instant::now();
    // First: the host embeds the plugin, so nothing of the host builds without it.
    let route = plugin::build()?;
    // The server embeds the simulator's module too (it builds without it, but the browser test
    // needs it).
    simulator::build(route)?;
    ensure_python()?;
    nostd_build()?;

    step("Rust: build and test the workspace");
    // Every host build of this run selects the whole workspace with its tests (`--workspace`,
    // test targets), so cargo resolves one feature set and builds the dependencies once; a
    // `-p` build would resolve another set and build most of them again.
    run(cargo().args(["build", "--workspace", "--all-targets"]))?;
    let lines = run_capture(cargo().args(["test", "--workspace", "--no-fail-fast"]))?;
    let (rust_passed, rust_failed) = count_cargo(&lines)?;
    // The core alone, without the features the host turns on (what `cargo test -p kvpages-core`
    // builds): its unit tests must compile and pass there too.
    let lines = run_capture(cargo().args(["test", "-p", "kvpages-core", "--lib", "--no-fail-fast"]))?;
    let (core_passed, core_failed) = count_cargo(&lines)?;
    let (rust_passed, rust_failed) = (rust_passed + core_passed, rust_failed + core_failed);

    step("Python: vLLM's client against the real server");
    let bin = root().join("target/debug/kvpages");
    let lines = run_capture(Command::new("python3").current_dir(root()).env("KVPAGES_BIN", &bin).args([
        "-m",
        "pytest",
        "tests/python",
        "-q",
    ]))?;
    let (py_passed, py_failed) = count_pytest(&lines)?;

    // Suites this machine cannot run (only without rustup's wasm32 target), named in the summary.
    let mut skipped = Vec::new();
    let (other_passed, other_failed) = plugin::test_other_route(route)?.unwrap_or_else(|why| {
        skipped.push(why);
        (0, 0)
    });
    let (js_passed, js_failed) = plugin::portability()?;
    let (wbt_passed, wbt_failed) = simulator::unit_tests()?.unwrap_or_else(|why| {
        skipped.push(why);
        (0, 0)
    });
    let (web_passed, web_failed) = simulator::browser_test(&bin)?;
    let (rust_passed, rust_failed) = (rust_passed + other_passed + wbt_passed, rust_failed + other_failed + wbt_failed);
    let (js_passed, js_failed) = (js_passed + web_passed, js_failed + web_failed);
    bench_smoke(&bin)?;
    // After every test of the workspace's own build: maturin's build of the binary (its own rustc
    // flags) replaces target/debug/kvpages, which the image and the deploy/ checks then use.
    let (wheel_passed, wheel_failed) = wheel::test()?;
    let (image_passed, image_failed) = image::test(&bin)?;
    let (deploy_passed, deploy_failed) = deploy_checks(&bin)?;
    let (py_passed, py_failed) = (
        py_passed + wheel_passed + image_passed + deploy_passed,
        py_failed + wheel_failed + image_failed + deploy_failed,
    );

    let (passed, failed) = (rust_passed + py_passed + js_passed, rust_failed + py_failed + js_failed);
    println!(
        "\n==> summary: Rust {rust_passed} passed, Python {py_passed} passed, Node (the plugin in jco, the simulator in Chromium) {js_passed} passed, in {:.0?}",
        start.elapsed()
    );
    println!("{passed} passed, {failed} failed");
    for why in &skipped {
        println!("NOT RUN: {why}");
    }
    if rust_passed == 0 || py_passed == 0 {
        return Err("no tests ran (a suite reported 0 passed)".into());
    }
    if failed > 0 {
        return Err(format!("{failed} tests failed"));
    }
    if !skipped.is_empty() {
        if !std::env::var("KVPAGES_ALLOW_SKIP").is_ok_and(|v| v == "1") {
            return Err(format!(
                "{} suite(s) could not run on this machine (see NOT RUN above); set KVPAGES_ALLOW_SKIP=1 to accept that",
                skipped.len()
            ));
        }
        println!("KVPAGES_ALLOW_SKIP=1: accepting {} suite(s) not run", skipped.len());
    }
    Ok(())
}

/// The Kubernetes manifests (kubernetes-validate), the alert rules (promtool, from Debian's
/// prometheus package) and the Grafana dashboard, against the metrics `bin` exports.
fn deploy_checks(bin: &Path) -> Result<(u64, u64)> {
    step(
        "deploy/: Kubernetes manifests (kubernetes-validate), alert rules (promtool), dashboard (metrics a server exports)",
    );
    if !have("promtool", "--version") {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "--no-install-recommends", "prometheus"]))?;
    }
    let lines = run_capture(Command::new("python3").current_dir(root()).env("KVPAGES_BIN", bin).args([
        "-m",
        "pytest",
        "tests/deploy/test_kubernetes.py",
        "tests/deploy/test_monitoring.py",
        "-q",
    ]))?;
    ran_some("deploy/", count_pytest(&lines)?)
}

/// Keeps the benchmarks from rotting: every load workload for a moment against the debug
/// binary, and every criterion benchmark once (criterion's test mode, which `cargo test` runs, in
/// the test profile: no release build of the dependencies). No thresholds: numbers from a debug
/// build on a shared machine mean nothing; that they run, answer correctly and finish does.
fn bench_smoke(bin: &Path) -> Result<()> {
    step("bench smoke: every load workload briefly, every criterion benchmark once (no thresholds)");
    run(Command::new(bin)
        .args(["bench", "--duration", "0.1", "--warmup", "0", "--concurrency", "2", "--json"])
        .arg(bench::smoke_json()))?;
    // The core's, the wire crate's and the plugin's benches (the last: one command through both
    // engines, the canonical-ABI probe, and the core's pool-size groups through the plugin
    // engine); `--workspace` for the feature set the test step built.
    run(cargo().args(["test", "--workspace", "--bench", "core", "--bench", "wire", "--bench", "plugin"]))
}

fn serve(args: &[String]) -> Result<()> {
    let route = plugin::build()?;
    simulator::build(route)?;
    step("build the release binary");
    run(cargo().args(["build", "--release", "-p", "kvpages"]))?;
    step("kvpages serve");
    run(Command::new(root().join("target/release/kvpages")).arg("serve").args(args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn cargo_counts_add_up_and_only_allowed_tests_may_be_ignored() {
        let ok = lines(
            "test a::b ... ok\ntest result: ok. 3 passed; 1 failed; 0 ignored; 0 measured\n\
             test data_format::write_golden ... ignored, writes a golden directory\n\
             test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out",
        );
        assert_eq!(count_cargo(&ok), Ok((7, 1)));
        let stray = lines("test tests::slow_check ... ignored\ntest result: ok. 4 passed; 0 failed; 1 ignored");
        assert_eq!(
            count_cargo(&stray),
            Err("ignored tests would pass the run without running: tests::slow_check".to_owned())
        );
        // An ignored count with no line naming the test: the output is not what this reads.
        let unnamed = lines("test result: ok. 4 passed; 0 failed; 2 ignored");
        assert!(count_cargo(&unnamed).unwrap_err().contains("2 ignored tests but named 0"));
        assert_eq!(count_cargo(&[]), Ok((0, 0)));
    }

    #[test]
    fn pytest_counts_and_refuses_tests_not_run() {
        assert_eq!(count_pytest(&lines("....\n74 passed in 120.31s (0:02:00)")), Ok((74, 0)));
        assert_eq!(count_pytest(&lines("2 failed, 72 passed in 99.0s")), Ok((72, 2)));
        for last in [
            "72 passed, 2 skipped in 9.0s",
            "70 passed, 4 deselected in 9.0s",
            "73 passed, 1 xfailed in 9.0s",
            "73 passed, 1 xpassed in 9.0s",
            "73 passed, 1 error in 9.0s",
            "71 passed, 3 errors in 9.0s",
        ] {
            let counted = count_pytest(&lines(last));
            assert_eq!(counted, Err(format!("pytest did not run every test: {last}")), "{last}");
        }
        assert_eq!(count_pytest(&lines("no tests ran in 0.01s")), Ok((0, 0)));
    }
}

//! `cargo xtask simulator`: builds the browser simulator's wasm module, which
//! `crates/host/build.rs` embeds with the page (`web/`) and `kvpages serve` serves at
//! `/simulator/`.
//!
//! 1. `kvpages-wasm` (crates/wasm/browser, std) for `wasm32-unknown-unknown` with the
//!    `simulator` profile, by the same two routes as the plugin (rustup's target, or Debian's
//!    rustc-web with `-Zbuild-std=std,panic_abort`).
//! 2. `wasm-bindgen --target web` (the CLI must equal the crate's pinned 0.2.130; installed
//!    with `cargo install` when missing — without `--locked`, whose lockfile this registry
//!    cannot satisfy) into [`PKG`].
//! 3. `wasm-opt -O3` from npm's `binaryen` (Debian's binaryen 108 corrupts wasm-bindgen output).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::plugin::{Route, debian_cargo, debian_toolchain};
use crate::{Result, cargo, have, root, run, step};

/// Where the module goes; `crates/host/build.rs` reads the same path.
pub(crate) const PKG: &str = "target/simulator/pkg";
/// The wasm-bindgen CLI version; must equal `wasm-bindgen` in crates/wasm/browser/Cargo.toml.
const BINDGEN: &str = "0.2.130";
/// npm's binaryen (wasm-opt).
const BINARYEN: &str = "binaryen@132.0.0";
/// Where npm puts the build tools (git-ignored).
const TOOLS: &str = "target/tools";

fn compile(route: Route) -> Result<PathBuf> {
    let args = ["build", "-p", "kvpages-wasm", "--lib", "--target", "wasm32-unknown-unknown", "--profile", "simulator"];
    match route {
        Route::Rustup => {
            run(cargo().args(args))?;
            Ok(root().join("target/wasm32-unknown-unknown/simulator/kvpages_wasm.wasm"))
        }
        Route::Debian => {
            debian_toolchain()?;
            run(debian_cargo().args(args).args(["--target-dir", "target/wasm-debian", "-Zbuild-std=std,panic_abort"]))?;
            Ok(root().join("target/wasm-debian/wasm32-unknown-unknown/simulator/kvpages_wasm.wasm"))
        }
    }
}

/// The wasm-bindgen CLI of the pinned version (`cargo install` when missing); its directory.
pub(crate) fn bindgen_cli() -> Result<PathBuf> {
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cargo"));
    let bin = home.join("bin");
    let version = Command::new(bin.join("wasm-bindgen"))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    if version != format!("wasm-bindgen {BINDGEN}") {
        println!("  installing wasm-bindgen-cli {BINDGEN} (found: '{version}'), ~1.5 min");
        run(cargo().args(["install", "wasm-bindgen-cli", "--version", BINDGEN]))?;
    }
    Ok(bin)
}

/// npm's wasm-opt (installed under [`TOOLS`] when missing).
fn wasm_opt() -> Result<PathBuf> {
    let tools = root().join(TOOLS);
    let bin = tools.join("node_modules/.bin/wasm-opt");
    if !bin.exists() {
        if !have("npm", "--version") {
            run(Command::new("apt-get").arg("update"))?;
            run(Command::new("apt-get").args(["install", "-y", "nodejs", "npm"]))?;
        }
        std::fs::create_dir_all(&tools).map_err(|e| format!("{}: {e}", tools.display()))?;
        run(Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--no-save", "--prefix"])
            .arg(&tools)
            .arg(BINARYEN))?;
    }
    Ok(bin)
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Builds the module into [`PKG`] by `route`.
pub(crate) fn build(route: Route) -> Result<()> {
    step("browser simulator: kvpages-wasm for wasm32-unknown-unknown, wasm-bindgen --target web, wasm-opt");
    println!("  route: {}", route.name());
    let module = compile(route)?;
    let bin = bindgen_cli()?;
    let pkg = root().join(PKG);
    run(Command::new(bin.join("wasm-bindgen"))
        .args(["--target", "web", "--no-typescript", "--out-dir"])
        .arg(&pkg)
        .arg(&module))?;
    let wasm = pkg.join("kvpages_wasm_bg.wasm");
    let before = size(&wasm);
    let optimised = pkg.join("kvpages_wasm_bg.opt.wasm");
    run(Command::new(wasm_opt()?)
        .args([
            "-O3",
            "--strip-debug",
            "--strip-producers",
            "--enable-bulk-memory",
            "--enable-nontrapping-float-to-int",
            "--enable-sign-ext",
        ])
        .args(["--enable-mutable-globals", "--enable-reference-types", "--enable-multivalue"])
        .arg(&wasm)
        .arg("-o")
        .arg(&optimised))?;
    std::fs::rename(&optimised, &wasm).map_err(|e| format!("{}: {e}", wasm.display()))?;
    println!("  wrote {} ({} bytes; {before} before wasm-opt)", wasm.display(), size(&wasm));
    println!("  rebuild the server to embed it: cargo build -p kvpages");
    Ok(())
}

/// The wasm-bindgen-test unit tests of the JS-facing class, in Node. They need rustup's
/// wasm32 target (its test harness), whatever route built the module: `Ok(Err(why))` when
/// rustup cannot provide it. `Ok(Ok((passed, failed)))` otherwise.
pub(crate) fn unit_tests() -> Result<std::result::Result<(u64, u64), String>> {
    step("browser simulator: wasm-bindgen-test unit tests of the JS class (Node)");
    if !crate::plugin::rustup_target_ready() {
        println!("  not run: the wasm32 test harness needs rustup's wasm32-unknown-unknown target");
        return Ok(Err(
            "the simulator's wasm-bindgen-test unit tests (rustup cannot provide wasm32-unknown-unknown here)".into(),
        ));
    }
    let bin = bindgen_cli()?;
    let runner = bin.join("wasm-bindgen-test-runner");
    let lines = crate::run_capture(cargo().env("CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER", &runner).args([
        "test",
        "-p",
        "kvpages-wasm",
        "--target",
        "wasm32-unknown-unknown",
        "--test",
        "js",
    ]))?;
    Ok(Ok(crate::ran_some("the wasm-bindgen-test suite", crate::count_cargo(&lines)?)?))
}

/// The Playwright test of the page (`tests/browser/`): Debian's Chromium driven by
/// playwright-core against `kvpages serve`, compared with `kvpages-sim` natively.
/// (passed, failed) from its closing `N passed, M failed` line.
pub(crate) fn browser_test(kvpages: &Path) -> Result<(u64, u64)> {
    step("browser simulator: the page in headless Chromium (playwright-core), checked against the native core");
    if !Path::new("/usr/bin/chromium").exists() {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "chromium"]))?;
    }
    let dir = root().join("tests/browser");
    if !dir.join("node_modules/playwright-core").exists() {
        run(Command::new("npm").current_dir(&dir).args(["ci", "--no-audit", "--no-fund"]))?;
    }
    let lines = crate::run_capture(
        Command::new("node")
            .current_dir(&dir)
            .env("KVPAGES_BIN", kvpages)
            .env("KVPAGES_SIM_BIN", root().join("target/debug/kvpages-sim"))
            .arg("simulator.test.mjs"),
    )?;
    let last = lines.iter().rev().find(|l| l.contains(" passed, ")).cloned().unwrap_or_default();
    crate::ran_some(
        "the browser test",
        (crate::number_before(&last, " passed"), crate::number_before(&last, " failed")),
    )
}

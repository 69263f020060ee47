//! `cargo xtask plugin`: builds the wasm plugin component the server embeds.
//!
//! 1. `kvpages-plugin` (crates/wasm/plugin) is compiled for `wasm32-unknown-unknown` with the
//!    `plugin` profile, by one of two routes:
//!    - **rustup**: `rustup target add wasm32-unknown-unknown` (time-limited), then the usual
//!      `cargo build --target wasm32-unknown-unknown`;
//!    - **debian**: Debian's `rustc-web` 1.96 with `-Zbuild-std=core,alloc` (no download but
//!      Debian packages), for machines where rustup cannot fetch the target. Debian's compiler
//!      must build its own library sources, so it gets its own `--target-dir`.
//!
//!    `KVPAGES_WASM_ROUTE=rustup|debian` forces one; unset tries rustup, then falls back.
//! 2. The core module becomes a component with the `wit-component` crate (what
//!    `wasm-tools component new` does; no 2.5-minute `cargo install`), checked to import
//!    nothing, and is written to [`ARTIFACT`]. `crates/host/build.rs` embeds that file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{Result, cargo, root, run, run_with_timeout, step};

/// Where the component goes, relative to the workspace root (git-ignored, under `target/`).
/// `crates/host/build.rs` reads the same path.
pub(crate) const ARTIFACT: &str = "target/plugin/kvpages_plugin.wasm";

/// How the wasm32 compiler was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// rustup's wasm32-unknown-unknown target with the workspace's own toolchain.
    Rustup,
    /// Debian's rustc-web with std's sources (`-Zbuild-std`).
    Debian,
}

impl Route {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Rustup => "rustup",
            Route::Debian => "debian",
        }
    }

    pub(crate) fn other(self) -> Route {
        match self {
            Route::Rustup => Route::Debian,
            Route::Debian => Route::Rustup,
        }
    }
}

/// The route `KVPAGES_WASM_ROUTE` forces, if any.
fn forced_route() -> Result<Option<Route>> {
    match std::env::var("KVPAGES_WASM_ROUTE").as_deref() {
        Err(_) | Ok("") => Ok(None),
        Ok("rustup") => Ok(Some(Route::Rustup)),
        Ok("debian") => Ok(Some(Route::Debian)),
        Ok(other) => Err(format!("KVPAGES_WASM_ROUTE={other}: expected rustup or debian")),
    }
}

/// Whether rustup has (or could install within the time limit) wasm32-unknown-unknown.
pub(crate) fn rustup_target_ready() -> bool {
    // Asked up to three times a run (the route, the other route, the simulator's unit tests):
    // one try of up to 5 minutes, not three.
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        let installed = Command::new("rustup")
            .args(["target", "list", "--installed"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == "wasm32-unknown-unknown"));
        installed
            || run_with_timeout(
                Command::new("rustup").args(["target", "add", "wasm32-unknown-unknown"]),
                Duration::from_secs(300),
            )
    })
}

/// Installs Debian's rustc-web, its library sources and wasm-ld, if missing.
pub(crate) fn debian_toolchain() -> Result<()> {
    let have = Path::new("/usr/bin/rustc").exists()
        && Path::new("/usr/lib/llvm-19/bin/wasm-ld").exists()
        && Command::new("dpkg").args(["-s", "rust-web-src"]).output().is_ok_and(|o| o.status.success());
    if !have {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "rustc-web", "cargo-web", "rust-web-src", "lld-19"]))?;
    }
    Ok(())
}

/// Debian's cargo + rustc-web for wasm32-unknown-unknown (`-Zbuild-std` allowed).
pub(crate) fn debian_cargo() -> Command {
    let mut c = Command::new("/usr/bin/cargo");
    c.current_dir(root())
        .env("RUSTC", "/usr/bin/rustc")
        .env("RUSTDOC", "/usr/bin/rustdoc")
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER", "/usr/lib/llvm-19/bin/wasm-ld")
        // `cargo xtask` sets these for rustup's toolchain; Debian's cargo must not see them.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    c
}

/// Flags for the guest's wasm32 compile only (the browser module and native builds keep theirs).
///
/// LLVM inlines more than its -O3 default (225). Every wasm function call costs more under
/// Cranelift than natively: the callee checks the epoch deadline on entry, and a frame that
/// spills moves wasm's shadow stack pointer, a global kept in memory. A threshold of 1000 saves
/// ~8 % of the instructions of a save through the plugin (`crates/host/examples/instructions.rs`);
/// 500 gives little, 3000 no more at 2.5× the size.
///
/// LLVM also unrolls every loop it can by four, trip count unknown or not: Cranelift checks
/// the epoch deadline at each loop header, ~5 instructions a pass (19 % of the guest's
/// instructions on a 32-key save, measured with epochs switched off), and a per-key loop pays
/// it every key. Unrolling by four saves 3–8 % of the instructions (same example); by 2 gives
/// half of that, by 8 no more. The component grows to ~570 KB (Cranelift compiles it once at
/// start-up). Cargo lets a `RUSTFLAGS` in the environment
/// override target flags, so a build under one loses this (`KVPAGES_GUEST_RUSTFLAGS` adds flags
/// to these instead); on the Debian route `-Zbuild-std`
/// compiles `core` and `alloc` with it too (rustup's are prebuilt).
///
/// And the guest may use 128-bit SIMD (`simd128`, part of WebAssembly 2.0: wasmtime enables it
/// by default, Node's V8 — jco's host — has shipped it since 2021): LLVM compares and moves the
/// 16-byte keys as one vector: 1–4 % fewer instructions inside the plugin engine's `apply`.
const GUEST_RUSTFLAGS: &str = "-Cllvm-args=-inline-threshold=1000 -Cllvm-args=-unroll-runtime \
    -Cllvm-args=-unroll-count=4 -Cllvm-args=-unroll-allow-partial -Ctarget-feature=+simd128";

/// Compiles the guest by `route` with `features`; the core wasm module's path.
fn compile(route: Route, features: &str) -> Result<PathBuf> {
    let args = ["build", "-p", "kvpages-plugin", "--target", "wasm32-unknown-unknown", "--profile", "plugin"];
    let args = [&args[..], &["--features", features]].concat();
    const FLAGS: &str = "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS";
    // For experiments (flags to compare by instruction count): appended to the guest's flags.
    let extra = std::env::var("KVPAGES_GUEST_RUSTFLAGS").unwrap_or_default();
    let guest_flags = format!("{GUEST_RUSTFLAGS} {extra}");
    match route {
        Route::Rustup => {
            run(cargo().env(FLAGS, &guest_flags).args(&args))?;
            Ok(root().join("target/wasm32-unknown-unknown/plugin/kvpages_plugin.wasm"))
        }
        Route::Debian => {
            debian_toolchain()?;
            run(debian_cargo().env(FLAGS, &guest_flags).args(&args).args([
                "--target-dir",
                "target/wasm-debian",
                "-Zbuild-std=core,alloc",
            ]))?;
            Ok(root().join("target/wasm-debian/wasm32-unknown-unknown/plugin/kvpages_plugin.wasm"))
        }
    }
}

/// Turns a core module with wit-bindgen's component-type section into a component at `out`.
fn componentize(module: &Path, out: &Path) -> Result<()> {
    let bytes = std::fs::read(module).map_err(|e| format!("{}: {e}", module.display()))?;
    let component =
        wit_component::ComponentEncoder::default()
            .module(&bytes)
            .and_then(|e| e.validate(true).encode())
            .map_err(|e| format!("wit-component could not turn {} into a component: {e:#}", module.display()))?;
    // The sandbox grants nothing, so the component must ask for nothing.
    let decoded = wit_component::decode(&component).map_err(|e| format!("decoding the component: {e:#}"))?;
    let wit_component::DecodedWasm::Component(resolve, world) = decoded else {
        return Err("wit-component produced a WIT package, not a component".into());
    };
    let world = &resolve.worlds[world];
    if !world.imports.is_empty() {
        let names: Vec<String> = world.imports.keys().map(|k| resolve.name_world_key(k)).collect();
        return Err(format!("the plugin imports {names:?}; it must import nothing"));
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(out, &component).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("  wrote {} ({} bytes; core module {} bytes)", out.display(), component.len(), bytes.len());
    Ok(())
}

/// Builds, by `route`, the plugin into `dir/kvpages_plugin.wasm` and the hostile test plugin
/// (feature `chaos`, see crates/wasm/plugin/src/chaos.rs) into `dir/kvpages_plugin.chaos.wasm`.
pub(crate) fn build_with(route: Route, dir: &Path) -> Result<()> {
    println!("  route: {}", route.name());
    componentize(&compile(route, "")?, &dir.join("kvpages_plugin.wasm"))?;
    componentize(&compile(route, "chaos")?, &dir.join("kvpages_plugin.chaos.wasm"))
}

/// Builds the embedded component ([`ARTIFACT`]): the forced route, or rustup falling back to
/// Debian. Returns the route it used.
pub(crate) fn build() -> Result<Route> {
    step("wasm plugin: kvpages-plugin for wasm32-unknown-unknown, then a component (wit-component)");
    let route = choose_route()?;
    build_with(route, root().join(ARTIFACT).parent().expect("a directory"))?;
    println!("  plugin built by route {} (set KVPAGES_WASM_ROUTE=rustup|debian to choose)", route.name());
    Ok(route)
}

/// The forced route, or rustup when it can provide wasm32-unknown-unknown, else Debian.
pub(crate) fn choose_route() -> Result<Route> {
    Ok(match forced_route()? {
        Some(Route::Rustup) if !rustup_target_ready() => {
            return Err("KVPAGES_WASM_ROUTE=rustup, but rustup could not install wasm32-unknown-unknown".into());
        }
        Some(r) => r,
        None if rustup_target_ready() => Route::Rustup,
        None => {
            println!("  rustup could not provide wasm32-unknown-unknown; falling back to Debian's rustc-web");
            Route::Debian
        }
    })
}

/// Builds the components by the route [`build`] did not take, into `target/plugin/ROUTE/`, so
/// the plugin tests can run against them too. `None` when that route is not available here.
pub(crate) fn build_other(used: Route) -> Result<Option<PathBuf>> {
    let other = used.other();
    step(&format!("wasm plugin by the other route ({}), for the same plugin tests", other.name()));
    if other == Route::Rustup && !rustup_target_ready() {
        println!("  skipped: rustup cannot provide wasm32-unknown-unknown on this machine");
        return Ok(None);
    }
    let dir = root().join("target/plugin").join(other.name());
    build_with(other, &dir)?;
    Ok(Some(dir))
}

/// Runs the plugin tests (`crates/host/tests/plugin.rs`) against the components the other
/// route built: both routes' plugins must pass the same tests. `Ok(Ok((passed, failed)))`, or
/// `Ok(Err(why))` when the other route is not available here.
pub(crate) fn test_other_route(used: Route) -> Result<std::result::Result<(u64, u64), String>> {
    let Some(dir) = build_other(used)? else {
        return Ok(Err(format!(
            "the plugin tests against the {} route's components (rustup cannot provide wasm32-unknown-unknown here)",
            used.other().name()
        )));
    };
    step(&format!("plugin tests against the {} route's components", used.other().name()));
    // `--workspace`: the feature set the test step built (only the host has a `plugin` test).
    let lines = crate::run_capture(cargo().env("KVPAGES_TEST_PLUGIN_DIR", &dir).args([
        "test",
        "--workspace",
        "--test",
        "plugin",
    ]))?;
    let suite = format!("the plugin tests against the {} route's components", used.other().name());
    Ok(Ok(crate::ran_some(&suite, crate::count_cargo(&lines)?)?))
}

/// Loads the plugin in jco (Node.js), a component-model host not written in Rust, and runs an
/// allocate/confirm/exists cycle (`tests/portability/`). (passed, failed) of node's test runner.
pub(crate) fn portability() -> Result<(u64, u64)> {
    step("portability: the plugin component in jco on Node.js (a non-Rust component-model host)");
    if !crate::have("node", "--version") || !crate::have("npm", "--version") {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "nodejs", "npm"]))?;
    }
    let dir = root().join("tests/portability");
    if !dir.join("node_modules/@bytecodealliance/jco-transpile").exists() {
        run(Command::new("npm").current_dir(&dir).args(["ci", "--no-audit", "--no-fund"]))?;
    }
    let lines = crate::run_capture(
        Command::new("node").current_dir(&dir).env("KVPAGES_PLUGIN_WASM", root().join(ARTIFACT)).args(["--test"]),
    )?;
    let count = |word: &str| {
        lines.iter().filter_map(|l| l.strip_prefix(word)).filter_map(|n| n.trim().parse::<u64>().ok()).next_back()
    };
    crate::ran_some("the jco portability test", (count("# pass ").unwrap_or(0), count("# fail ").unwrap_or(0)))
}

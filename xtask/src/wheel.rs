//! `cargo xtask wheel`: the Python wheel that carries the `kvpages` binary, as ruff and uv ship
//! theirs. maturin's "bin" bindings (see `pyproject.toml`) put the executable into the wheel's
//! scripts, so `pip install` places it in the environment's `bin/`; the binary embeds the wasm
//! plugin and the browser simulator, which are built first.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Result, count_pytest, ran_some, root, run, run_capture, step};

/// maturin's major version the `pyproject.toml` build backend names.
const MATURIN: &str = "maturin>=1.9,<2";

/// Where the wheels go (`target/wheels/`, maturin's own default).
pub fn out_dir() -> PathBuf {
    root().join("target/wheels")
}

/// `cargo xtask wheel [--profile NAME]`: builds the plugin, the simulator and the wheel (release
/// profile unless told), and prints the wheel's path.
pub fn wheel(args: &[String]) -> Result<()> {
    let profile = match args {
        [] => "release".to_string(),
        [flag, name] if flag == "--profile" => name.clone(),
        _ => return Err("usage: cargo xtask wheel [--profile release|dev]".into()),
    };
    let route = crate::plugin::build()?;
    crate::simulator::build(route)?;
    let wheel = build(&profile)?;
    println!("wheel: {}\ninstall it with: pip install {}", wheel.display(), wheel.display());
    Ok(())
}

/// Builds the wheel with `profile` (the plugin and simulator must be built) and returns its path.
pub fn build(profile: &str) -> Result<PathBuf> {
    step(&format!("Python wheel: maturin build --profile {profile} (bindings = \"bin\")"));
    ensure_maturin()?;
    let out = out_dir();
    // A stale wheel of another version must not be the one found below.
    let _ = std::fs::remove_dir_all(&out);
    run(Command::new("python3")
        .current_dir(root())
        .args(["-m", "maturin", "build", "--profile", profile, "--out"])
        .arg(&out))?;
    let wheels: Vec<PathBuf> = std::fs::read_dir(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => Err(format!("expected one wheel in {}, found {}", out.display(), other.len())),
    }
}

fn ensure_maturin() -> Result<()> {
    let ok = Command::new("python3").args(["-m", "maturin", "--version"]).status();
    if ok.is_ok_and(|s| s.success()) {
        return Ok(());
    }
    let pip =
        |extra: &[&str]| run(Command::new("python3").args(["-m", "pip", "install", "--quiet", MATURIN]).args(extra));
    pip(&[]).or_else(|_| pip(&["--break-system-packages"]))
}

/// The test of the wheel a user installs: build it (in the test profile, so that no release build
/// of the dependencies is needed; the packaging is the same), install it into a fresh virtualenv,
/// and run vLLM's client tests against the `kvpages` the venv's `bin/` holds.
pub fn test() -> Result<(u64, u64)> {
    let wheel = build("dev")?;
    step("Python wheel: pip install into a fresh venv; vLLM's client against the venv's kvpages");
    let venv = root().join("target/wheel-venv");
    let _ = std::fs::remove_dir_all(&venv);
    if run(Command::new("python3").args(["-m", "venv"]).arg(&venv)).is_err() {
        // Debian's python3 keeps venv's ensurepip in a package of its own.
        run(Command::new("apt-get").args(["install", "-y", "python3-venv"]))?;
        let _ = std::fs::remove_dir_all(&venv);
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let pip = venv.join("bin/pip");
    // --no-index: the wheel must need nothing from the network.
    run(Command::new(&pip).args(["install", "--quiet", "--no-index"]).arg(&wheel))?;
    let bin = venv.join("bin/kvpages");
    check_version(&bin)?;
    let lines = run_capture(Command::new("python3").current_dir(root()).env("KVPAGES_BIN", &bin).args([
        "-m",
        "pytest",
        "tests/python/test_vllm_client.py",
        "-q",
    ]))?;
    ran_some("the installed wheel's kvpages under vLLM's client", count_pytest(&lines)?)
}

/// The installed command answers with the workspace's version.
fn check_version(bin: &Path) -> Result<()> {
    let out = Command::new(bin).arg("--version").output().map_err(|e| format!("{}: {e}", bin.display()))?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let want = format!("kvpages {}", env!("CARGO_PKG_VERSION"));
    if said == want {
        println!("  {} --version: {said}", bin.display());
        Ok(())
    } else {
        Err(format!("{} --version said {said:?}, expected {want:?}", bin.display()))
    }
}

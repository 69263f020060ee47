//! Embeds the wasm plugin: `cargo xtask plugin` writes the component to a fixed path, and this
//! script hands that path to `include_bytes!` (through `KVPAGES_PLUGIN_WASM`). Without the file
//! the build still succeeds (a plain `cargo build` of a fresh clone gives a server that runs
//! `--engine native`), with a warning; the wasm engine then refuses to start, naming the command.
//!
//! Also embeds the browser simulator served at `/simulator/`: the page's files from `web/` and
//! the wasm-bindgen module `cargo xtask simulator` writes to `target/simulator/pkg/`. Without
//! that module the server still builds, and `/simulator/` says how to get it.

use std::path::Path;

fn main() {
    simulator();
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    // Keep in step with xtask/src/plugin.rs (ARTIFACT).
    let artifact = Path::new(&manifest).join("../../target/plugin/kvpages_plugin.wasm");
    println!("cargo::rerun-if-changed={}", artifact.display());
    if !artifact.exists() {
        println!(
            "cargo::warning=the wasm plugin {} is missing: this build serves only `--engine native`; run `cargo xtask plugin` and rebuild to embed it (`cargo xtask test` / `cargo xtask serve` build it first)",
            artifact.display()
        );
        let empty = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("no-plugin.wasm");
        std::fs::write(&empty, b"").expect("OUT_DIR is writable");
        println!("cargo::rustc-env=KVPAGES_PLUGIN_WASM={}", empty.display());
        return;
    }
    let artifact = artifact.canonicalize().expect("the artifact exists");
    println!("cargo::rustc-env=KVPAGES_PLUGIN_WASM={}", artifact.display());
}

/// Writes `$OUT_DIR/simulator_assets.rs`: `&[(path, bytes)]` of every file under `web/` and
/// `target/simulator/pkg/` (as `pkg/...`), or an empty list when the module is not built.
fn simulator() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest).join("../..");
    let web = root.join("web");
    // Keep in step with xtask/src/simulator.rs (PKG).
    let pkg = root.join("target/simulator/pkg");
    println!("cargo::rerun-if-changed={}", web.display());
    println!("cargo::rerun-if-changed={}", pkg.display());
    let mut files = Vec::new();
    if pkg.join("kvpages_wasm_bg.wasm").exists() && web.join("index.html").exists() {
        collect(&web, "", &mut files);
        collect(&pkg, "pkg/", &mut files);
    } else {
        println!(
            "cargo::warning=the browser simulator is not built ({} is missing): /simulator/ will say so; run `cargo xtask simulator` and rebuild to embed it",
            pkg.join("kvpages_wasm_bg.wasm").display()
        );
    }
    files.sort();
    let mut out = String::from("&[\n");
    for (name, path) in &files {
        out.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", path.display().to_string()));
    }
    out.push_str("]\n");
    let dest = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("simulator_assets.rs");
    std::fs::write(dest, out).expect("OUT_DIR is writable");
}

fn collect(dir: &Path, prefix: &str, files: &mut Vec<(String, std::path::PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
        if path.is_dir() {
            collect(&path, &format!("{name}/"), files);
        } else if !name.ends_with(".d.ts") && !name.starts_with('.') {
            files.push((name, path.canonicalize().expect("the file exists")));
        }
    }
}

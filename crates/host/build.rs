//! Embeds the wasm plugin: `cargo xtask plugin` writes the component to a fixed path, and this
//! script hands that path to `include_bytes!` (through `KVPAGES_PLUGIN_WASM`), or stops the
//! build with the command to run when the file is missing.

use std::path::Path;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    // Keep in step with xtask/src/plugin.rs (ARTIFACT).
    let artifact = Path::new(&manifest).join("../../target/plugin/kvpages_plugin.wasm");
    println!("cargo::rerun-if-changed={}", artifact.display());
    if !artifact.exists() {
        println!(
            "cargo::error=the wasm plugin {} is missing: run `cargo xtask plugin` (or `cargo xtask test` / `cargo xtask serve`, which build it first)",
            artifact.display()
        );
        return;
    }
    let artifact = artifact.canonicalize().expect("the artifact exists");
    println!("cargo::rustc-env=KVPAGES_PLUGIN_WASM={}", artifact.display());
}

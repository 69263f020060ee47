//! Feature `chaos`: a hostile plugin for the host's containment tests. Built as its own artifact
//! (`target/plugin/kvpages_plugin.chaos.wasm`), never embedded in the server.
//!
//! An `allocate` whose batch holds one of these keys misbehaves; every other call is the real
//! plugin, so a test can check that the server keeps serving with its state intact:
//! - `chaos:loop`: spins forever (the host's epoch deadline must stop it);
//! - `chaos:bomb`: allocates 64 MiB blocks until memory runs out (the host's memory cap);
//! - `chaos:panic`: panics before applying anything (a Rust panic aborts: a trap);
//! - `chaos:after`: applies the allocation, then panics — the host must roll back the half-done
//!   call, not keep its effects.

use alloc::string::ToString;
use alloc::vec::Vec;

use kvpages_core::Key;

/// Acts on the keys before the command is applied; `true`: panic after applying it.
pub(crate) fn before(keys: &[Key]) -> bool {
    let mut after = false;
    for key in keys {
        match key.to_string().as_str() {
            "chaos:loop" => loop {
                core::hint::black_box(());
            },
            "chaos:bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(alloc::vec![1u8; 64 << 20]);
                    core::hint::black_box(&hoard);
                }
            }
            "chaos:panic" => panic!("chaos: a panic in the guest"),
            "chaos:after" => after = true,
            _ => {}
        }
    }
    after
}

/// Panics after the command was applied, if [`before`] said so.
pub(crate) fn after(after: bool) {
    if after {
        panic!("chaos: a panic after the state changed");
    }
}

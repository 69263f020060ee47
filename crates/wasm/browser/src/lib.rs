//! kvpages-wasm: `kvpages-core` as a wasm-bindgen module for the browser simulator.
//!
//! The page under `web/` (served by `kvpages serve` at `/simulator/`) drives a [`js::Simulator`]:
//! a core, a simulated clock, seeded workload generators and the scenario log. Every request
//! goes through the same wire rules as the server (`kvpages_wire`), so a command typed on
//! the page is accepted, refused and answered byte for byte as `kvpages serve` would; no
//! allocator rule lives in JavaScript.
//!
//! The simulation itself ([`sim::Sim`]) is plain Rust and runs natively too: the `kvpages-sim`
//! binary replays an exported scenario and prints the figures the page shows, which is how the
//! browser test checks the page against the core.
//!
//! This crate needs std (wasm-bindgen), which is why it is a crate of its own beside
//! `crates/wasm/plugin` (`kvpages-plugin`, the `no_std` WIT component).

pub mod js;
pub mod sim;
pub mod workload;

pub use sim::{Config, Scenario, Sim, SimError, SimStats};
pub use workload::WorkloadSpec;

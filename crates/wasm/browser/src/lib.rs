//! kvpages-wasm: the WebAssembly faces of `kvpages-core`.
//!
//! Placeholder: the component (WIT plugin) and the wasm-bindgen browser module arrive with
//! their own issues. Until then this crate only proves that the core links as a dependency
//! of a `no_std` crate.
#![no_std]

pub use kvpages_core::Core;

//! kvpages-wasm: `kvpages-core` as a wasm-bindgen module for the browser.
//!
//! Placeholder: the browser module arrives with its own issue. It will need std (wasm-bindgen),
//! which is why it is a crate of its own beside `crates/wasm/plugin` (`kvpages-plugin`, the
//! `no_std` WIT component). Until then this crate only proves that the core links as a
//! dependency of a `no_std` crate.
#![no_std]

pub use kvpages_core::Core;

//! kvpages-abi: the formats of the plugin boundary, the one copy that the guest
//! (`kvpages-plugin`) and the host (`kvpages-host`) both encode and decode with.
//!
//! # Layout
//! - [`keys`]: packed key batches (`packed-keys` in `wit/kvpages.wit`), pack and unpack.
//! - [`allocations`]: packed allocations (`packed-allocations`), an allocate's answer.
//! - [`direct`]: the direct entry point's exchange: request kinds, frames, statuses, replies.
//! - [`fits`]: whether a reply fits the command it answers (the host's check of a guest).
//!
//! `no_std` + alloc, so the guest compiles it for wasm32 as it is; nothing here keeps state.
#![no_std]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

extern crate alloc;

pub mod allocations;
pub mod direct;
mod fits;
pub mod keys;

pub use fits::{Seen, fits};

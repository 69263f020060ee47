//! kvpages-abi: the formats of the plugin boundary, the one copy that the guest
//! (`kvpages-plugin`) and the host (`kvpages-host`) both encode and decode with.
//!
//! # Layout
//! - [`keys`]: packed key batches (`packed-keys` in `wit/kvpages.wit`), pack and unpack.
//! - [`allocations`]: packed allocations (`packed-allocations`), an allocate's answer.
//! - [`direct`]: the direct entry point's exchange: request kinds, frames, statuses, replies.
//!
//! `no_std` + alloc, so the guest compiles it for wasm32 as it is; nothing here keeps state.
#![no_std]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

extern crate alloc;

pub mod allocations;
pub mod direct;
pub mod keys;

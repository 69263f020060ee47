//! kvpages-core: the deterministic state machine behind the kvpages page-metadata server.
//!
//! LLM servers offload KV-cache blocks to one file per tensor-parallel rank, cut into fixed-size
//! pages. This crate decides which page holds which block (keyed by a hash of its tokens),
//! records confirmed writes and answers which blocks exist and where. It does no IO, reads no
//! clock and draws no random numbers: the current time and a hasher seed arrive as arguments, so
//! the same `(now, Command)` sequence gives the same replies natively and in WebAssembly.
//!
//! # Layout
//! - [`command`]: [`Command`] in, [`Reply`] out, plus [`Settings`].
//! - [`error`]: the domain [`Error`]; a refused command changes nothing.
//! - `state`: [`Core::apply`], the rules (allocation, confirm/release, completeness, expiry).
//! - `pool`: one rank's pages: a lazily materialised free list and a per-page state table.
//! - `keys`: the key table: a slab of entries behind a seeded hash index of slots
//!   (`slot_index`: open addressing, one `u64` per bucket; `chunked`: the slab, grown by chunks
//!   so that growing never copies it).
//! - [`key`]: [`Key`], compact for 32-hex keys, echoed exactly as sent.
//! - `state/snapshot`: `Core::snapshot` / `Core::restore` (feature `serde`): the whole state as
//!   versioned, deterministic bytes.
//! - `state/view`: [`Core::page_map`] / [`Core::page_view`], read-only page views for viewers
//!   (the browser simulator's page map).
//!
//! The HTTP API's JSON (a request into a [`Command`], a [`Reply`] or [`Error`] into the answer's
//! bytes, the error catalogue) is the `kvpages-wire` crate's: this one knows no JSON and no HTTP.
//!
//! Every command costs O(batch): nothing scans or copies a free list or the key table.
#![no_std]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

extern crate alloc;

mod chunked;
pub mod command;
pub mod error;
pub mod key;
mod keys;
mod pool;
mod slot_index;
mod state;

pub use command::{
    Allocation, Command, ConfirmReport, Counters, Eviction, IgnoredRelease, InitOutcome, KeyInfo, Millis, RankStats,
    Refusal, Refused, Reply, Settings, SglangPool, Space, SpaceStats, Stats,
};
pub use error::{Error, PagePlace};
pub use key::{HexText, Key, KeyError, MAX_KEY_LEN};
pub use pool::{PageCounts, PoolOrder};
pub use state::Core;
#[cfg(feature = "serde")]
pub use state::snapshot::{SNAPSHOT_VERSION, SnapshotError};
pub use state::view::{PAGE_CLASSES, PageView};

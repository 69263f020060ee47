//! Durability: a write-ahead log of applied commands plus snapshots, in a data directory.
//!
//! The core is deterministic, so its state is a function of the commands applied to it and
//! their times: the log records `(seq, now, Command)` for every state-changing command that
//! the engine accepted, in apply order (it is appended under the engine lock). A reply waits
//! until its record — and, for a read, every record before it — is durable under the fsync
//! policy, so no client acts on state a crash could take back. Snapshots (the core's own
//! `snapshot()` bytes) bound the log; recovery is the newest snapshot plus the records after it.
//!
//! Layout of the data directory:
//! - `FORMAT`: `kvpages-data <version>`; a newer or unknown version is refused, an older one
//!   is upgraded in place through the steps of [`FORMATS`] (crash-safe, the old files kept in
//!   `format-<version>/`). `tests/data/format-1/` is a golden directory of version 1 that every
//!   later build must recover exactly.
//! - `snapshot-<seq>.bin`: `KVPSNAP1`, seq (u64 LE), length (u64 LE), crc32 (u32 LE), bytes.
//! - `wal-<first seq>.log`: records `[len u32 LE][crc32 u32 LE][postcard (seq, now, Command)]`.
//!   A torn or corrupt record ends the log: recovery truncates it there and says so.
//! - `LOCK`: the `flock` that keeps a second server out.
//!
//! By file: `format.rs` (the version table, file names, the record encoding), `upgrade.rs`
//! (opening a directory, upgrading older formats), `lock.rs`, `log.rs` (the log, its flusher
//! and `Writer`), `snapshot.rs` (snapshots, atomic writes, temporary files), `recovery.rs`.

mod format;
mod lock;
mod log;
mod recovery;
mod snapshot;
#[cfg(test)]
mod tests;
mod upgrade;

pub use self::format::{FORMAT_VERSION, FORMATS, Formats, Record, Upgrade};
pub use self::lock::{DirLock, LOCK_FILE, lock_dir};
pub use self::log::{FsyncMode, Log, NotDurable};
pub use self::recovery::{Recovered, recover};
pub use self::snapshot::{SNAPSHOT_HEADROOM, SnapshotError, available_bytes, remove_temp_files, write_snapshot};
pub use self::upgrade::{open_dir, open_dir_with};
pub use crate::progress::Progress;

//! Snapshots: the core's bytes in a checked file, written only when the disk has room for them
//! and the log's next writes; the log segments and older snapshots they make unnecessary are
//! removed. Also the atomic write they share with `FORMAT`, and the cleanup of what an
//! interrupted one left.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

use super::format::{names, numbered, snapshot_name, sync_dir};
use super::log::add_log_bytes;

/// Free space a snapshot leaves to the log: a snapshot is skipped unless the disk holds it and
/// this much more, so a snapshot never takes the space the log needs next.
pub const SNAPSHOT_HEADROOM: u64 = 256 << 10;

/// Why a snapshot was not written.
#[derive(Debug)]
pub enum SnapshotError {
    /// The disk has `available` bytes, fewer than the snapshot's `needed` (its size plus
    /// [`SNAPSHOT_HEADROOM`]): skipped, nothing written.
    NoRoom {
        /// Bytes the snapshot would take plus the headroom.
        needed: u64,
        /// Bytes free for kvpages on the data directory's file system.
        available: u64,
    },
    /// Writing it failed; its temporary file is removed and the log is untouched.
    Io(io::Error),
}

impl std::fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SnapshotError::NoRoom { needed, available } => write!(
                f,
                "the disk has {available} bytes free, the snapshot needs {needed} (its size and {SNAPSHOT_HEADROOM} \
                 bytes left for the log)"
            ),
            SnapshotError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Bytes free for an unprivileged writer on the file system holding `dir`.
pub fn available_bytes(dir: &Path) -> io::Result<u64> {
    let st = rustix::fs::statvfs(dir)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Writes a snapshot atomically (see [`write_snapshot_file`]) if the disk has room for it,
/// then removes older snapshots and the log segments it makes unnecessary.
pub fn write_snapshot(dir: &Path, seq: u64, core_bytes: &[u8]) -> Result<(), SnapshotError> {
    let needed = core_bytes.len() as u64 + 32 + SNAPSHOT_HEADROOM;
    let available = available_bytes(dir).map_err(SnapshotError::Io)?;
    if available < needed {
        return Err(SnapshotError::NoRoom { needed, available });
    }
    write_snapshot_file(dir, seq, core_bytes).map_err(SnapshotError::Io)?;
    drop_covered(dir, seq).map_err(SnapshotError::Io)
}

/// The first bytes of a snapshot file (its layout: the module overview in `durable.rs`).
const SNAPSHOT_MAGIC: &[u8; 8] = b"KVPSNAP1";

/// Writes a snapshot file atomically: a temporary file, fsync, rename, fsync of the directory.
/// A failure removes the temporary file, so a failed snapshot takes no space.
pub(super) fn write_snapshot_file(dir: &Path, seq: u64, core_bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("snapshot-{seq:020}{TEMP_SUFFIX}"));
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(SNAPSHOT_MAGIC)?;
        f.write_all(&seq.to_le_bytes())?;
        f.write_all(&(core_bytes.len() as u64).to_le_bytes())?;
        f.write_all(&crc32fast::hash(core_bytes).to_le_bytes())?;
        f.write_all(core_bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, dir.join(snapshot_name(seq)))
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

/// The core bytes of a snapshot file named for `seq`, or why they cannot be trusted.
pub(super) fn parse_snapshot(bytes: &[u8], seq: u64) -> Result<&[u8], String> {
    let rest = bytes.strip_prefix(&SNAPSHOT_MAGIC[..]).ok_or("not a kvpages snapshot file")?;
    if rest.len() < 20 {
        return Err("truncated header".into());
    }
    let stored_seq = u64::from_le_bytes(rest[0..8].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(rest[8..16].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(rest[16..20].try_into().expect("4 bytes"));
    let body = &rest[20..];
    if stored_seq != seq {
        return Err(format!("header says record {stored_seq}, the name says {seq}"));
    }
    if body.len() as u64 != len {
        return Err(format!("{} bytes of {len}", body.len()));
    }
    if crc32fast::hash(body) != crc {
        return Err("checksum mismatch".into());
    }
    Ok(body)
}

/// Removes the snapshots older than `seq` and the log segments whose records are all in it.
fn drop_covered(dir: &Path, seq: u64) -> io::Result<()> {
    for (s, path) in numbered(dir, "snapshot-", ".bin")? {
        if s < seq {
            fs::remove_file(path)?;
        }
    }
    // A segment can go once the next one starts at or before seq + 1: all its records are in
    // the snapshot. The newest segment always stays (it is being written).
    let segments = numbered(dir, "wal-", ".log")?;
    for pair in segments.windows(2) {
        if pair[1].0 <= seq + 1 {
            let len = fs::metadata(&pair[0].1).map_or(0, |m| m.len());
            fs::remove_file(&pair[0].1)?;
            add_log_bytes(-(len as i64));
        }
    }
    sync_dir(dir)
}

/// The ending of temporary files (snapshots being written, `FORMAT` being replaced).
const TEMP_SUFFIX: &str = ".tmp";

/// Writes `dir/name` through a temporary file, fsynced, renamed, with the directory fsynced.
pub(super) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{name}{TEMP_SUFFIX}"));
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// Removes what an interrupted write left behind: temporary snapshot files (a crash, or a
/// full disk, mid-snapshot), which would otherwise take space for good.
pub fn remove_temp_files(dir: &Path) -> Result<(), String> {
    let at = |e: io::Error| format!("{}: {e}", dir.display());
    let mut removed = 0;
    for name in names(dir).map_err(at)? {
        let Some(name) = name.to_str() else { continue };
        if name.starts_with("snapshot-") && name.ends_with(TEMP_SUFFIX) {
            let path = dir.join(name);
            fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            tracing::warn!("recovery: removed {}, a snapshot that was never finished", path.display());
            removed += 1;
        }
    }
    if removed > 0 {
        sync_dir(dir).map_err(at)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::tests::logged;
    use crate::durable::{FsyncMode, recover};

    #[test]
    fn a_failed_snapshot_leaves_no_temporary_file_and_the_log_untouched() {
        let d = logged("snap-fail", FsyncMode::Always, 1, |_| 1);
        // A directory where the snapshot goes: the rename fails after the file was written.
        fs::create_dir(d.join(snapshot_name(1))).unwrap();
        let err = write_snapshot(&d, 1, b"core bytes").unwrap_err();
        assert!(matches!(err, SnapshotError::Io(_)), "{err}");
        let left: Vec<_> = names(&d).unwrap().into_iter().filter(|n| n.to_string_lossy().ends_with(".tmp")).collect();
        assert!(left.is_empty(), "{left:?}");
        fs::remove_dir(d.join(snapshot_name(1))).unwrap();
        assert_eq!(recover(&d).unwrap().records.len(), 1, "the log is untouched");
        // (A snapshot the disk has no room for is skipped: `tests/faults.rs`, on a small tmpfs.)
        fs::remove_dir_all(&d).unwrap();
    }
}

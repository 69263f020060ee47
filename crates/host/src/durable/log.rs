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

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvpages_core::{Command, Millis};

use crate::progress::Progress;

/// The data directory format this build writes and reads (upgrading older ones: [`FORMATS`]).
pub const FORMAT_VERSION: u32 = 2;
const SNAPSHOT_MAGIC: &[u8; 8] = b"KVPSNAP1";
/// A segment is closed and a new one started past this size.
const SEGMENT_BYTES: u64 = 64 << 20;
/// No record is larger than this (a request body is at most `--max-body`).
const MAX_RECORD: u32 = 1 << 30;

/// Bytes of log segments on disk (for `/metrics`).
static LOG_BYTES: AtomicU64 = AtomicU64::new(0);

fn add_log_bytes(delta: i64) {
    let update = |cur: u64| Some((cur as i64 + delta).max(0) as u64);
    let old = LOG_BYTES.fetch_update(Ordering::Relaxed, Ordering::Relaxed, update).expect("always Some");
    crate::telemetry::set_log_bytes(update(old).expect("always Some"));
}

/// When a record counts as durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsyncMode {
    /// After `fsync` (one for every group of records waiting): survives power loss.
    Always,
    /// After `write` (the OS has it: survives a crash of kvpages, not of the machine); the log
    /// is fsynced every interval, so a power loss loses at most that much.
    Interval(Duration),
}

impl std::str::FromStr for FsyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<FsyncMode, String> {
        if s == "always" {
            return Ok(FsyncMode::Always);
        }
        let ms = s
            .strip_prefix("interval=")
            .and_then(|ms| ms.parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .ok_or_else(|| format!("'{s}': expected `always` or `interval=MS` (MS > 0)"))?;
        Ok(FsyncMode::Interval(Duration::from_millis(ms)))
    }
}

/// One logged command.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// Position in the log, from 1.
    pub seq: u64,
    /// The time it was applied at.
    pub now: Millis,
    /// The command.
    pub command: Command,
}

/// What recovery found in a data directory.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The newest snapshot's core bytes and the last seq it contains.
    pub snapshot: Option<(u64, Vec<u8>)>,
    /// Records after the snapshot, in order.
    pub records: Vec<Record>,
    /// What was dropped at a torn or corrupt tail, for the log line.
    pub dropped_tail: Option<String>,
}

impl Recovered {
    /// The last seq recovered (snapshot or records).
    pub fn last_seq(&self) -> u64 {
        self.records.last().map(|r| r.seq).or(self.snapshot.as_ref().map(|s| s.0)).unwrap_or(0)
    }

    /// The latest time recovered: the clock must not go back behind it.
    pub fn last_now(&self) -> Millis {
        self.records.last().map_or(0, |r| r.now)
    }
}

fn segment_name(first: u64) -> String {
    format!("wal-{first:020}.log")
}

fn snapshot_name(seq: u64) -> String {
    format!("snapshot-{seq:020}.bin")
}

/// Files named `prefix<number>suffix` in `dir`, sorted by number.
fn numbered(dir: &Path, prefix: &str, suffix: &str) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = name.strip_prefix(prefix).and_then(|r| r.strip_suffix(suffix)).and_then(|n| n.parse().ok()) {
            out.push((n, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// One step of the upgrade path: reads the files of format `from` in the data directory and
/// writes those of format `from + 1` into an empty staging directory. It must not touch the
/// data directory itself; [`open_dir`] makes the switch crash-safe around it.
#[derive(Clone, Copy, Debug)]
pub struct Upgrade {
    /// The version it reads.
    pub from: u32,
    /// `(data directory, staging directory)`.
    pub run: fn(&Path, &Path) -> Result<(), String>,
}

/// The formats a build knows: the one it writes, and a step from each older one it upgrades.
#[derive(Clone, Copy, Debug)]
pub struct Formats {
    /// The version this build writes and reads.
    pub current: u32,
    /// Steps from older versions, one per version.
    pub upgrades: &'static [Upgrade],
}

/// This build's version table: each format's step reads the previous one exactly as its golden
/// directory (`tests/data/format-<N>/`) holds it, and those directories' tests keep passing.
pub const FORMATS: Formats = Formats { current: FORMAT_VERSION, upgrades: &[Upgrade { from: 1, run: upgrade_from_1 }] };

/// Format 1 → 2. Only the snapshots' core bytes differ: format 2 holds the core's snapshot
/// format 2 (its key table and page tables as fixed-width records, ~3× faster to write through
/// the plugin; see `kvpages-core`'s `state/snapshot.rs`). Each snapshot is restored (the core
/// still reads its format 1) and written again; the log segments, and any other file, are
/// copied as they are. So is a snapshot that does not restore: recovery then refuses it with
/// its usual advice, as it did before the upgrade (the core reads both snapshot formats, so a
/// copied one is no less readable).
fn upgrade_from_1(dir: &Path, staging: &Path) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let snapshots = numbered(dir, "snapshot-", ".bin").map_err(|e| at(dir, e))?;
    for name in names(dir).map_err(|e| at(dir, e))? {
        let path = dir.join(&name);
        if name == "FORMAT" || name == STAGING || name == LOCK_FILE || path.is_dir() {
            continue;
        }
        if let Some(&(seq, _)) = snapshots.iter().find(|(_, p)| *p == path) {
            let bytes = fs::read(&path).map_err(|e| at(&path, e))?;
            let restored = parse_snapshot(&bytes, seq)
                .and_then(|body| kvpages_core::Core::restore(body).map_err(|e| e.to_string()));
            match restored {
                Ok(core) => {
                    write_snapshot_file(staging, seq, &core.snapshot()).map_err(|e| at(staging, e))?;
                    continue;
                }
                Err(why) => tracing::warn!("upgrade: {} does not restore ({why}); copied as it is", path.display()),
            }
        }
        fs::copy(&path, staging.join(&name)).map_err(|e| at(&path, e))?;
    }
    Ok(())
}

/// Where an upgrade writes the new format's files before the switch.
const STAGING: &str = "upgrade";

fn format_text(version: u32) -> String {
    format!("kvpages-data {version}\n")
}

fn parse_format(dir: &Path, text: &str) -> Result<u32, String> {
    text.strip_prefix("kvpages-data ")
        .and_then(|v| v.strip_suffix('\n'))
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) && !v.starts_with('0'))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            let shown: String = text.chars().take(40).collect();
            format!(
                "--data-dir {}: its FORMAT file reads {shown:?}, not \"kvpages-data N\": it is not a kvpages data \
                 directory, or a damaged one. kvpages will not guess; restore FORMAT from a backup or point \
                 --data-dir elsewhere",
                dir.display()
            )
        })
}

/// Opens (creating if needed) a data directory and checks its format version; an older
/// version is upgraded in place first (see [`open_dir_with`]).
pub fn open_dir(dir: &Path) -> Result<(), String> {
    open_dir_with(dir, &FORMATS, &mut |_| Ok(()))
}

/// [`open_dir`] with a version table, and a hook called before every change to the disk
/// (tests make it fail to stand in for a crash at that point).
///
/// An upgrade from version N is crash-safe in three phases, each resumable from what is on
/// disk: (1) the step writes N + 1's files into `upgrade/`, every file is fsynced, then
/// `upgrade/FORMAT` is written — from here on the upgrade only goes forward; (2) the files of
/// format N move into `format-N/` (a backup for going back to the older release), `FORMAT`
/// last; (3) the new files move into place and `upgrade/FORMAT` is renamed to `FORMAT`, the
/// atomic switch. A crash in phase 1 leaves format N as it was (the staging is discarded); a
/// crash in phases 2 and 3 is finished by the next start. A version newer than this build's,
/// or one without a step, is refused.
pub fn open_dir_with(
    dir: &Path,
    formats: &Formats,
    fault: &mut dyn FnMut(&str) -> io::Result<()>,
) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let format = dir.join("FORMAT");
    let staging = dir.join(STAGING);
    if !dir.exists() {
        fs::create_dir_all(dir).map_err(|e| format!("cannot create --data-dir {}: {e}", dir.display()))?;
    }
    loop {
        let version = match fs::read_to_string(&format) {
            Ok(text) => parse_format(dir, &text)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if staging.join("FORMAT").exists() {
                    // Phase 3 was interrupted: the old files are in their backup already.
                    finish_upgrade(dir, fault)
                        .map_err(|e| format!("finishing the upgrade of {}: {e}", dir.display()))?;
                    continue;
                }
                // A `FORMAT.tmp` alone is a first start that crashed before its FORMAT was in place.
                let stray = names(dir).map_err(|e| at(dir, e))?.iter().any(|n| n != "FORMAT.tmp" && n != LOCK_FILE);
                if stray {
                    return Err(format!(
                        "--data-dir {} is not empty and has no FORMAT file: it is not a kvpages data directory",
                        dir.display()
                    ));
                }
                fault("write FORMAT").map_err(|e| at(&format, e))?;
                return write_atomically(dir, "FORMAT", format_text(formats.current).as_bytes())
                    .map_err(|e| at(&format, e));
            }
            Err(e) => return Err(at(&format, e)),
        };
        if version == formats.current {
            if staging.exists() {
                // The switch happened; only the empty staging directory is left.
                fault("remove staging").map_err(|e| at(&staging, e))?;
                fs::remove_dir_all(&staging).and_then(|()| sync_dir(dir)).map_err(|e| at(&staging, e))?;
            }
            return Ok(());
        }
        if version > formats.current {
            return Err(format!(
                "--data-dir {} has format version {version}, written by a newer kvpages; this kvpages reads \
                 version {} (and upgrades older ones). Run the release that wrote it, or point --data-dir elsewhere",
                dir.display(),
                formats.current
            ));
        }
        let Some(step) = formats.upgrades.iter().find(|u| u.from == version) else {
            return Err(format!(
                "--data-dir {} has format version {version}, which this kvpages cannot upgrade (it reads version \
                 {} and upgrades from {}). Upgrade it with an intermediate release first",
                dir.display(),
                formats.current,
                if formats.upgrades.is_empty() {
                    "none".to_owned()
                } else {
                    formats.upgrades.iter().map(|u| u.from.to_string()).collect::<Vec<_>>().join(", ")
                }
            ));
        };
        tracing::info!("upgrading --data-dir {} from format {version} to {}", dir.display(), version + 1);
        let started = Instant::now();
        upgrade_step(dir, step, fault)
            .map_err(|e| format!("upgrading {} from format {version}: {e}; nothing was lost", dir.display()))?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "upgraded --data-dir {} to format {}; the format-{version} files are kept in {} (delete it once \
             you will not go back)",
            dir.display(),
            version + 1,
            dir.join(format!("format-{version}")).display()
        );
    }
}

/// The lock file of a data directory: one process at a time holds an `flock` on it.
pub const LOCK_FILE: &str = "LOCK";

/// A data directory's lock, held while this lives. It is an `flock`, so it dies with its
/// process: a server killed with `kill -9` leaves a file that blocks nobody.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Takes `dir`'s lock (creating the directory if needed), or says which process holds it.
pub fn lock_dir(dir: &Path) -> Result<DirLock, String> {
    use std::os::unix::fs::FileExt;
    fs::create_dir_all(dir).map_err(|e| format!("cannot create --data-dir {}: {e}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let at = |e: io::Error| format!("{}: {e}", path.display());
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(at)?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let holder = fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            let who = if holder.is_empty() { "another process".to_owned() } else { format!("pid {holder}") };
            return Err(format!(
                "data dir {} is in use by {who}: one kvpages server per data directory. Stop that one, or \
                 point --data-dir elsewhere",
                dir.display()
            ));
        }
        Err(e) => return Err(at(e.into())),
    }
    file.set_len(0).and_then(|()| file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)).map_err(at)?;
    Ok(DirLock { _file: file })
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

/// Writes `dir/name` through a temporary file, fsynced, renamed, with the directory fsynced.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{name}{TEMP_SUFFIX}"));
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// Names in `dir`, sorted.
fn names(dir: &Path) -> io::Result<Vec<std::ffi::OsString>> {
    let mut out = fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<Vec<_>>>()?;
    out.sort();
    Ok(out)
}

/// Phases 1 and 2 of an upgrade by one step (see [`open_dir_with`]), then phase 3.
fn upgrade_step(dir: &Path, step: &Upgrade, fault: &mut dyn FnMut(&str) -> io::Result<()>) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let staging = dir.join(STAGING);
    let backup_name = format!("format-{}", step.from);
    let backup = dir.join(&backup_name);
    if !staging.join("FORMAT").exists() {
        // Phase 1 (again, if a crash interrupted it: what it left is discarded).
        if backup.exists() {
            return Err(format!(
                "{} already exists (from an earlier upgrade?); move it out of the data directory first",
                backup.display()
            ));
        }
        if staging.exists() {
            fault("remove staging").map_err(|e| at(&staging, e))?;
            fs::remove_dir_all(&staging).map_err(|e| at(&staging, e))?;
        }
        fault("stage").map_err(|e| at(&staging, e))?;
        fs::create_dir(&staging).map_err(|e| at(&staging, e))?;
        (step.run)(dir, &staging)?;
        for name in names(&staging).map_err(|e| at(&staging, e))? {
            let path = staging.join(&name);
            File::open(&path).and_then(|f| f.sync_all()).map_err(|e| at(&path, e))?;
        }
        fault("write staged FORMAT").map_err(|e| at(&staging, e))?;
        write_atomically(&staging, "FORMAT", format_text(step.from + 1).as_bytes())
            .and_then(|()| sync_dir(dir))
            .map_err(|e| at(&staging, e))?;
    }
    // Phase 2: the old files into the backup, FORMAT last (its absence marks the phase done).
    if !backup.exists() {
        fault("create backup").map_err(|e| at(&backup, e))?;
        fs::create_dir(&backup).and_then(|()| sync_dir(dir)).map_err(|e| at(&backup, e))?;
    }
    for name in names(dir).map_err(|e| at(dir, e))? {
        let keep = name == STAGING
            || name == "FORMAT"
            || name == LOCK_FILE
            || name.to_str().is_some_and(|n| n.starts_with("format-") && dir.join(n).is_dir());
        if !keep {
            fault("move old file").map_err(|e| at(dir, e))?;
            fs::rename(dir.join(&name), backup.join(&name)).map_err(|e| at(&dir.join(&name), e))?;
        }
    }
    sync_dir(&backup).map_err(|e| at(&backup, e))?;
    fault("move old FORMAT").map_err(|e| at(dir, e))?;
    fs::rename(dir.join("FORMAT"), backup.join("FORMAT"))
        .and_then(|()| sync_dir(&backup))
        .and_then(|()| sync_dir(dir))
        .map_err(|e| at(dir, e))?;
    finish_upgrade(dir, fault).map_err(|e| at(dir, e))
}

/// Phase 3: the staged files into place, then the switch of `FORMAT`.
fn finish_upgrade(dir: &Path, fault: &mut dyn FnMut(&str) -> io::Result<()>) -> io::Result<()> {
    let staging = dir.join(STAGING);
    for name in names(&staging)? {
        if name != "FORMAT" {
            fault("move new file")?;
            fs::rename(staging.join(&name), dir.join(&name))?;
        }
    }
    sync_dir(dir)?;
    fault("switch FORMAT")?;
    fs::rename(staging.join("FORMAT"), dir.join("FORMAT"))?;
    sync_dir(&staging)?;
    sync_dir(dir)?;
    fault("remove staging")?;
    fs::remove_dir(&staging)?;
    sync_dir(dir)
}

/// Reads the newest snapshot and every record after it; truncates a torn tail.
pub fn recover(dir: &Path) -> Result<Recovered, String> {
    let mut out = Recovered::default();
    let snapshots = numbered(dir, "snapshot-", ".bin").map_err(|e| format!("{}: {e}", dir.display()))?;
    if let Some((seq, path)) = snapshots.last() {
        let bytes = fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let body = parse_snapshot(&bytes, *seq).map_err(|why| {
            format!(
                "snapshot {} is damaged ({why}); kvpages will not guess. Move it aside to recover from the \
                 previous snapshot and the log, or start with an empty --data-dir",
                path.display()
            )
        })?;
        out.snapshot = Some((*seq, body.to_vec()));
    }
    let after = out.snapshot.as_ref().map_or(0, |s| s.0);
    let segments = numbered(dir, "wal-", ".log").map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut expect = None::<u64>;
    let mut progress =
        Progress::new(format!("recovery: reading the log ({} segments)", segments.len()), "records", None);
    let mut read = 0u64;
    for (i, (_, path)) in segments.iter().enumerate() {
        let (records, torn) = read_segment(path, &mut expect, &mut progress, &mut read)?;
        out.records.extend(records.into_iter().filter(|r| r.seq > after));
        if let Some((offset, why)) = torn {
            let file = OpenOptions::new().write(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?;
            file.set_len(offset).and_then(|()| file.sync_all()).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut note = format!("{} at byte {offset}: {why}; the log ends there", path.display());
            for (_, later) in &segments[i + 1..] {
                let aside = later.with_extension("log.damaged");
                fs::rename(later, &aside).map_err(|e| format!("{}: {e}", later.display()))?;
                note.push_str(&format!("; later segment moved aside to {}", aside.display()));
            }
            out.dropped_tail = Some(note);
            break;
        }
    }
    progress.finish(read);
    if let Some(first) = out.records.first()
        && first.seq != after + 1
    {
        return Err(format!(
            "the log starts at record {} but the newest snapshot ends at {after}: records are missing",
            first.seq
        ));
    }
    Ok(out)
}

fn parse_snapshot(bytes: &[u8], seq: u64) -> Result<&[u8], String> {
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

/// Records of one segment, and where (and why) it is torn, if it is.
#[allow(clippy::type_complexity)]
fn read_segment(
    path: &Path,
    expect: &mut Option<u64>,
    progress: &mut Progress,
    read: &mut u64,
) -> Result<(Vec<Record>, Option<(u64, String)>), String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut records = Vec::new();
    let mut offset = 0u64;
    loop {
        let mut head = [0u8; 8];
        match read_full(&mut r, &mut head) {
            Ok(0) => return Ok((records, None)),
            Ok(8) => {}
            Ok(n) => return Ok((records, Some((offset, format!("a record header cut after {n} bytes"))))),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
        let len = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
        if len == 0 || len > MAX_RECORD {
            return Ok((records, Some((offset, format!("a record length of {len} bytes")))));
        }
        let mut payload = vec![0u8; len as usize];
        let got = read_full(&mut r, &mut payload).map_err(|e| format!("{}: {e}", path.display()))?;
        if got < payload.len() {
            return Ok((records, Some((offset, format!("a record cut after {got} of {len} bytes")))));
        }
        if crc32fast::hash(&payload) != crc {
            return Ok((records, Some((offset, "a record with a wrong checksum".into()))));
        }
        let record: Record = match postcard::from_bytes(&payload) {
            Ok(r) => r,
            Err(e) => return Ok((records, Some((offset, format!("a record that does not decode ({e})"))))),
        };
        if let Some(want) = *expect
            && record.seq != want
        {
            return Ok((records, Some((offset, format!("record {} where {want} was due", record.seq)))));
        }
        *expect = Some(record.seq + 1);
        offset += 8 + u64::from(len);
        records.push(record);
        *read += 1;
        progress.update(*read);
    }
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Writes a snapshot file atomically: a temporary file, fsync, rename, fsync of the directory.
/// A failure removes the temporary file, so a failed snapshot takes no space.
fn write_snapshot_file(dir: &Path, seq: u64, core_bytes: &[u8]) -> io::Result<()> {
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

/// The ending of temporary files (snapshots being written, `FORMAT` being replaced).
const TEMP_SUFFIX: &str = ".tmp";

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

/// Records waiting for the flusher.
struct Pending {
    buf: Vec<u8>,
    last_seq: u64,
    closing: bool,
}

/// What the flusher publishes: how far the log is durable, and the storage fault it is in.
#[derive(Clone, Debug, Default)]
struct Mark {
    durable: u64,
    /// `path: OS error` while the log cannot be written; `None` when it can.
    fault: Option<Arc<str>>,
}

struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
    mark: tokio::sync::watch::Sender<Mark>,
}

/// Why a record is not durable (see [`Log::wait`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotDurable {
    /// The data directory cannot be written now: the path and the OS error. The record is kept
    /// and written as soon as the disk takes it again.
    Fault(String),
    /// The record did not reach the disk by the deadline.
    Late,
    /// The log was closed.
    Stopped,
}

impl std::fmt::Display for NotDurable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotDurable::Fault(why) => f.write_str(why),
            NotDurable::Late => f.write_str("the log did not reach the disk in time"),
            NotDurable::Stopped => f.write_str("the log stopped"),
        }
    }
}

/// The write-ahead log: `append` under the engine lock, `wait` outside it.
pub struct Log {
    shared: Arc<Shared>,
    mark: tokio::sync::watch::Receiver<Mark>,
    flusher: Mutex<Option<std::thread::JoinHandle<()>>>,
    dir: PathBuf,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log").field("dir", &self.dir).finish()
    }
}

impl Log {
    /// Starts a log whose next record is `last_seq + 1`, in a new segment.
    pub fn start(dir: &Path, mode: FsyncMode, last_seq: u64) -> Result<Log, String> {
        let (tx, rx) = tokio::sync::watch::channel(Mark { durable: last_seq, fault: None });
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending { buf: Vec::new(), last_seq, closing: false }),
            wake: Condvar::new(),
            mark: tx,
        });
        let existing: u64 = numbered(dir, "wal-", ".log")
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .iter()
            .map(|(_, p)| fs::metadata(p).map_or(0, |m| m.len()))
            .sum();
        LOG_BYTES.store(0, Ordering::Relaxed);
        add_log_bytes(existing as i64);
        crate::telemetry::set_storage_up(true);
        let (files, len) = Files::open(dir, last_seq + 1).map_err(|e| format!("{}: {e}", dir.display()))?;
        let writer = Writer::new(files, mode, SEGMENT_BYTES, len, last_seq, add_log_bytes);
        let s = shared.clone();
        let flusher = std::thread::Builder::new()
            .name("kvpages-log".into())
            .spawn(move || flush_loop(&s, writer))
            .map_err(|e| e.to_string())?;
        Ok(Log { shared, mark: rx, flusher: Mutex::new(Some(flusher)), dir: dir.to_path_buf() })
    }

    /// Appends one record; returns its seq. Call with the engine lock held, so the log order is
    /// the apply order.
    pub fn append(&self, now: Millis, command: &Command) -> u64 {
        let mut p = self.shared.pending.lock().expect("log lock");
        let seq = p.last_seq + 1;
        encode_record(&mut p.buf, seq, now, command);
        p.last_seq = seq;
        drop(p);
        self.shared.wake.notify_one();
        seq
    }

    /// The seq of the last record appended.
    pub fn last_seq(&self) -> u64 {
        self.shared.pending.lock().expect("log lock").last_seq
    }

    /// The storage fault the log is in (`path: OS error`), or `None` while it writes.
    pub fn fault(&self) -> Option<String> {
        self.mark.borrow().fault.as_deref().map(str::to_owned)
    }

    /// Waits until record `seq` is durable, or `deadline` passes. While the log cannot write,
    /// a record not yet durable gives up at once with the fault.
    pub async fn wait(&self, seq: u64, deadline: Instant) -> Result<(), NotDurable> {
        let mut rx = self.mark.clone();
        let wait = rx.wait_for(|m| m.durable >= seq || m.fault.is_some());
        match tokio::time::timeout_at(deadline.into(), wait).await {
            Ok(Ok(m)) if m.durable >= seq => Ok(()),
            Ok(Ok(m)) => Err(NotDurable::Fault(m.fault.as_deref().unwrap_or_default().to_owned())),
            Ok(Err(_)) => Err(NotDurable::Stopped),
            Err(_) => Err(NotDurable::Late),
        }
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes what is pending and stops the flusher (on shutdown).
    pub fn close(&self) {
        self.shared.pending.lock().expect("log lock").closing = true;
        self.shared.wake.notify_one();
        if let Some(h) = self.flusher.lock().expect("flusher lock").take() {
            let _ = h.join();
        }
    }
}

/// Appends record `seq` to `buf` as a segment holds it: `[len][crc32][postcard (seq, now, command)]`.
fn encode_record(buf: &mut Vec<u8>, seq: u64, now: Millis, command: &Command) {
    let payload = postcard::to_allocvec(&RecordRef { seq, now, command }).expect("commands encode");
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    buf.extend_from_slice(&payload);
}

#[derive(serde::Serialize)]
struct RecordRef<'a> {
    seq: u64,
    now: Millis,
    command: &'a Command,
}

/// The open log segment as the flusher writes it: at offsets, so a fault can be rewound and
/// written again. A trait so the tests can fail any write or fsync (`tests::faults`).
trait SegmentIo: Send {
    /// Writes all of `bytes` at `offset`.
    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()>;
    /// `fdatasync`.
    fn sync(&mut self) -> io::Result<()>;
    /// Truncates (or extends) the segment to `len` bytes.
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    /// Leaves the segment (synced already) for a new, empty one whose first record is `first`.
    fn rotate(&mut self, first: u64) -> io::Result<()>;
    /// The segment's path, for errors.
    fn name(&self) -> String;
}

/// A segment file in the data directory.
struct Files {
    dir: PathBuf,
    path: PathBuf,
    file: File,
}

impl Files {
    /// Opens (creating) the segment whose first record is `first`; returns it and its length.
    fn open(dir: &Path, first: u64) -> io::Result<(Files, u64)> {
        let path = dir.join(segment_name(first));
        let file = OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
        sync_dir(dir)?;
        let len = file.metadata()?.len();
        Ok((Files { dir: dir.to_path_buf(), path, file }, len))
    }
}

impl SegmentIo for Files {
    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(bytes, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        let t = Instant::now();
        self.file.sync_data()?;
        crate::telemetry::observe_fsync(t.elapsed());
        Ok(())
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn rotate(&mut self, first: u64) -> io::Result<()> {
        *self = Files::open(&self.dir, first)?.0;
        Ok(())
    }
    fn name(&self) -> String {
        self.path.display().to_string()
    }
}

/// What the flusher knows about the open segment. The invariant that makes a fault harmless:
/// bytes past `synced` are only ever a prefix of `tail`, so a failed write or fsync is undone
/// by cutting the segment back and writing `tail` again, and nothing after a record is
/// durable before it.
struct Writer<S> {
    io: S,
    mode: FsyncMode,
    /// A segment is left for a new one once this many bytes are synced in it.
    segment_bytes: u64,
    /// Bytes of the segment known to be on disk (fsynced): a fault never cuts below this.
    synced: u64,
    /// Seq of the last record in `synced`.
    synced_last: u64,
    /// The records after `synced`, kept until they are synced: written again after a fault.
    tail: Vec<u8>,
    /// Seq of the last record in `tail`.
    tail_last: u64,
    /// Bytes of `tail` written since the last fault (0 after a failed fsync: the kernel may
    /// have dropped those pages, so they are written again).
    written: usize,
    /// Bytes of `tail` the segment has held whole: a failed write is cut back to here.
    extent: usize,
    /// A write failed part-way: cut the segment to `synced + extent` before writing again.
    cut: bool,
    /// Seq of the last record written whole at least once (`Interval` counts it durable).
    written_last: u64,
    /// Told how many bytes the log grew by (the `/metrics` gauge; the tests count nothing).
    grew: fn(i64),
}

impl<S: SegmentIo> Writer<S> {
    fn new(io: S, mode: FsyncMode, segment_bytes: u64, len: u64, last_seq: u64, grew: fn(i64)) -> Writer<S> {
        Writer {
            io,
            mode,
            segment_bytes,
            synced: len,
            synced_last: last_seq,
            tail: Vec::new(),
            tail_last: last_seq,
            written: 0,
            extent: 0,
            cut: false,
            written_last: last_seq,
            grew,
        }
    }

    /// Takes records (whole ones, `last` the seq of the last of them).
    fn push(&mut self, bytes: Vec<u8>, last: u64) {
        if bytes.is_empty() {
            return;
        }
        if self.tail.is_empty() {
            self.tail = bytes;
        } else {
            self.tail.extend_from_slice(&bytes);
        }
        self.tail_last = last;
    }

    /// Whether records wait for an fsync.
    fn unsynced(&self) -> bool {
        !self.tail.is_empty()
    }

    /// The last durable seq under the fsync mode.
    fn durable(&self) -> u64 {
        match self.mode {
            FsyncMode::Always => self.synced_last,
            // Every synced record was written whole first.
            FsyncMode::Interval(_) => self.written_last,
        }
    }

    /// Writes what is not written, fsyncs when `sync_due` (always under `Always`), and starts
    /// a new segment when this one is full. A failure leaves the writer ready to try again.
    fn flush(&mut self, sync_due: bool) -> io::Result<()> {
        if self.cut {
            self.io.set_len(self.synced + self.extent as u64)?;
            self.cut = false;
        }
        if self.written < self.tail.len() {
            let at = self.synced + self.written as u64;
            if let Err(e) = self.io.write_at(at, &self.tail[self.written..]) {
                self.cut = true;
                self.written = self.written.min(self.extent);
                return Err(e);
            }
            if self.tail.len() > self.extent {
                (self.grew)((self.tail.len() - self.extent) as i64);
                self.extent = self.tail.len();
            }
            self.written = self.tail.len();
            self.written_last = self.tail_last;
        }
        let full = self.synced + self.tail.len() as u64 >= self.segment_bytes;
        if !self.tail.is_empty() && (self.mode == FsyncMode::Always || sync_due || full) {
            if let Err(e) = self.io.sync() {
                self.written = 0;
                return Err(e);
            }
            self.synced += self.tail.len() as u64;
            self.synced_last = self.tail_last;
            self.tail.clear();
            (self.written, self.extent) = (0, 0);
        }
        if self.tail.is_empty() && self.synced >= self.segment_bytes {
            self.io.rotate(self.synced_last + 1)?;
            self.synced = 0;
        }
        Ok(())
    }
}

/// Backoff between tries while the log cannot write: the first retry soon, then at most this
/// far apart, so service is back well within a second of the disk taking writes again.
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_millis(200);
/// How long a shutdown keeps retrying a log that cannot write before it gives up on the records
/// (none of them was acknowledged).
const CLOSE_GRACE: Duration = Duration::from_secs(10);

/// One storage fault, from the first failed try to the first good one.
struct Episode {
    since: Instant,
    tries: u64,
    backoff: Duration,
}

fn flush_loop<S: SegmentIo>(shared: &Shared, mut w: Writer<S>) {
    let mut last_sync = Instant::now();
    let mut episode: Option<Episode> = None;
    let mut closing_since: Option<Instant> = None;
    loop {
        let (buf, last, closing) = {
            let mut p = shared.pending.lock().expect("log lock");
            loop {
                if !p.buf.is_empty() || p.closing {
                    break;
                }
                let timeout = match (&episode, w.mode) {
                    (Some(e), _) => e.backoff,
                    (None, FsyncMode::Interval(every)) if w.unsynced() => every.saturating_sub(last_sync.elapsed()),
                    _ => Duration::from_secs(3600),
                };
                let (guard, res) = shared.wake.wait_timeout(p, timeout).expect("log lock");
                p = guard;
                if res.timed_out() {
                    break;
                }
            }
            (std::mem::take(&mut p.buf), p.last_seq, p.closing)
        };
        w.push(buf, last);
        let sync_due = match w.mode {
            FsyncMode::Always => true,
            FsyncMode::Interval(every) => closing || last_sync.elapsed() >= every,
        };
        let was_unsynced = w.unsynced();
        match w.flush(sync_due) {
            Ok(()) => {
                if was_unsynced && !w.unsynced() {
                    last_sync = Instant::now();
                }
                if let Some(e) = episode.take() {
                    // A warning, as the start was an error: whoever saw one sees the other.
                    tracing::warn!(
                        "storage: the log in {} is written again after {:.1} s ({} failed tries); serving",
                        w.io.name(),
                        e.since.elapsed().as_secs_f64(),
                        e.tries
                    );
                    crate::telemetry::set_storage_up(true);
                }
                let durable = w.durable();
                shared.mark.send_if_modified(|m| {
                    let changed = m.durable != durable || m.fault.is_some();
                    (m.durable, m.fault) = (durable, None);
                    changed
                });
            }
            Err(err) => {
                crate::telemetry::storage_write_failed();
                let why: Arc<str> = format!("{}: {err}", w.io.name()).into();
                match &mut episode {
                    Some(e) => {
                        e.tries += 1;
                        e.backoff = (e.backoff * 2).min(RETRY_MAX);
                    }
                    None => {
                        tracing::error!(
                            "storage: writing the log failed ({why}); writes answer 503 storage-unavailable until \
                             it works again, retrying"
                        );
                        crate::telemetry::set_storage_up(false);
                        episode = Some(Episode { since: Instant::now(), tries: 1, backoff: RETRY_FIRST });
                    }
                }
                let durable = w.durable();
                shared.mark.send_modify(|m| (m.durable, m.fault) = (durable, Some(why.clone())));
            }
        }
        if closing {
            if !w.unsynced() && episode.is_none() {
                return;
            }
            let since = *closing_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= CLOSE_GRACE {
                tracing::error!(
                    "storage: shutting down with records {}..={} not written (the log cannot write); none of them \
                     was acknowledged",
                    w.durable() + 1,
                    last
                );
                return;
            }
            std::thread::sleep(episode.as_ref().map_or(RETRY_FIRST, |e| e.backoff));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpages_core::{Key, Space};

    fn cmd(i: u32) -> Command {
        Command::Allocate { space: Space::Vllm, rank: i, keys: vec![Key::parse("k").unwrap()] }
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvpages-durable-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    /// A new data directory `name` whose log holds `records`, each appended at `now(i)` and
    /// waited for.
    fn logged(name: &str, mode: FsyncMode, records: u32, now: fn(u32) -> Millis) -> PathBuf {
        let d = tmp(name);
        open_dir(&d).unwrap();
        let log = Log::start(&d, mode, 0).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for i in 0..records {
            let seq = log.append(now(i), &cmd(i));
            rt.block_on(log.wait(seq, Instant::now() + Duration::from_secs(5))).unwrap();
        }
        log.close();
        d
    }

    #[test]
    fn records_survive_a_restart_and_a_torn_tail_is_cut() {
        let d = logged("torn", FsyncMode::Always, 10, |i| u64::from(i) * 10);
        let rec = recover(&d).unwrap();
        assert_eq!(rec.records.len(), 10);
        assert_eq!((rec.last_seq(), rec.last_now()), (10, 90));
        assert!(rec.dropped_tail.is_none());
        // Tear the last record: recovery keeps 9 and truncates.
        let seg = numbered(&d, "wal-", ".log").unwrap()[0].1.clone();
        let len = fs::metadata(&seg).unwrap().len();
        OpenOptions::new().write(true).open(&seg).unwrap().set_len(len - 3).unwrap();
        let rec = recover(&d).unwrap();
        assert_eq!(rec.records.len(), 9);
        assert!(rec.dropped_tail.as_deref().unwrap().contains("a record cut after"), "{:?}", rec.dropped_tail);
        // Corrupt a byte in record 5: records 1..4 remain.
        let mut bytes = fs::read(&seg).unwrap();
        let mut off = 0;
        for _ in 0..4 {
            off += 8 + u32::from_le_bytes(bytes[off..off + 4].try_into().unwrap()) as usize;
        }
        bytes[off + 9] ^= 0xff;
        fs::write(&seg, &bytes).unwrap();
        let rec = recover(&d).unwrap();
        assert_eq!(rec.records.len(), 4);
        assert!(rec.dropped_tail.as_deref().unwrap().contains("wrong checksum"), "{:?}", rec.dropped_tail);
        fs::remove_dir_all(&d).unwrap();
    }

    /// A segment whose disk fails: once `budget` bytes are written, a write lands in part and
    /// fails with ENOSPC, and the next `fail_tries` tries fail too before the space is back; the
    /// fsync numbered `fail_sync` fails with EIO and loses what it should have made durable
    /// (zeroed, as a kernel that dropped the dirty pages), and the next one works.
    struct Faulty {
        files: Files,
        budget: Option<u64>,
        fail_tries: u32,
        fail_sync: Option<u32>,
        syncs: u32,
        /// Each segment's length at its last good fsync: what a power loss keeps.
        synced: std::collections::BTreeMap<PathBuf, u64>,
    }

    impl SegmentIo for Faulty {
        fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
            let full = || io::Error::from_raw_os_error(28);
            match self.budget {
                Some(0) if self.fail_tries > 0 => {
                    self.fail_tries -= 1;
                    Err(full())
                }
                Some(0) => {
                    self.budget = None;
                    self.files.write_at(offset, bytes)
                }
                Some(left) if (bytes.len() as u64) > left => {
                    self.files.write_at(offset, &bytes[..left as usize])?;
                    self.budget = Some(0);
                    Err(full())
                }
                Some(left) => {
                    self.budget = Some(left - bytes.len() as u64);
                    self.files.write_at(offset, bytes)
                }
                None => self.files.write_at(offset, bytes),
            }
        }
        fn sync(&mut self) -> io::Result<()> {
            self.syncs += 1;
            let len = self.files.file.metadata()?.len();
            if self.fail_sync == Some(self.syncs) {
                let from = self.synced.get(&self.files.path).copied().unwrap_or(0);
                self.files.write_at(from, &vec![0; (len - from) as usize])?;
                return Err(io::Error::from_raw_os_error(5));
            }
            self.files.sync()?;
            self.synced.insert(self.files.path.clone(), len);
            Ok(())
        }
        fn set_len(&mut self, len: u64) -> io::Result<()> {
            self.files.set_len(len)
        }
        fn rotate(&mut self, first: u64) -> io::Result<()> {
            self.files.rotate(first)?;
            self.synced.insert(self.files.path.clone(), 0);
            Ok(())
        }
        fn name(&self) -> String {
            self.files.name()
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Fault {
        /// The disk fills after this many bytes of the log.
        Full(u64),
        /// This fsync fails.
        Sync(u32),
    }

    /// The records the run appends: 14 batches of 1..=3 records.
    fn batches() -> Vec<Vec<(u64, Command)>> {
        let mut seq = 0;
        (0..14u32)
            .map(|b| {
                (0..1 + b % 3)
                    .map(|i| {
                        seq += 1;
                        (seq, cmd(b * 10 + i))
                    })
                    .collect()
            })
            .collect()
    }

    /// Copies the segments of `dir` (cut to what a power loss keeps, if `power_loss`) to a
    /// new directory, recovers it, and checks that it holds records 1..=n in order, exactly
    /// as appended, with every acknowledged one among them (`n >= acked`).
    fn check_recovery(dir: &Path, io: &Faulty, power_loss: bool, acked: u64, all: &[(u64, Command)], why: &str) {
        let copy = dir.with_extension("check");
        let _ = fs::remove_dir_all(&copy);
        fs::create_dir_all(&copy).unwrap();
        fs::write(copy.join("FORMAT"), format_text(FORMAT_VERSION)).unwrap();
        for (_, path) in numbered(dir, "wal-", ".log").unwrap() {
            let mut bytes = fs::read(&path).unwrap();
            if power_loss {
                bytes.truncate(io.synced.get(&path).copied().unwrap_or(0) as usize);
            }
            fs::write(copy.join(path.file_name().unwrap()), bytes).unwrap();
        }
        let rec = recover(&copy).unwrap_or_else(|e| panic!("{why}: {e}"));
        let got: Vec<u64> = rec.records.iter().map(|r| r.seq).collect();
        let n = got.len() as u64;
        assert_eq!(got, (1..=n).collect::<Vec<_>>(), "{why}");
        assert!(n >= acked, "{why}: {n} records recovered, {acked} were acknowledged ({:?})", rec.dropped_tail);
        for r in &rec.records {
            let want = &all[(r.seq - 1) as usize].1;
            assert_eq!(format!("{:?}", r.command), format!("{want:?}"), "{why}: record {}", r.seq);
        }
        fs::remove_dir_all(&copy).unwrap();
    }

    /// Writes [`batches`] through a [`Writer`] on a failing disk, trying each batch until it
    /// is written; checks recovery after the first failure and at the end. Returns the count of
    /// failed tries (0: the fault was never reached).
    fn run_with_fault(mode: FsyncMode, fault: Fault, name: &str) -> u32 {
        let d = tmp(name);
        open_dir(&d).unwrap();
        let (files, len) = Files::open(&d, 1).unwrap();
        let (budget, fail_sync) = match fault {
            Fault::Full(n) => (Some(n), None),
            Fault::Sync(k) => (None, Some(k)),
        };
        let io = Faulty { files, budget, fail_tries: 2, fail_sync, syncs: 0, synced: Default::default() };
        // Small segments, so faults meet rotations too.
        let mut w = Writer::new(io, mode, 120, len, 0, |_| {});
        let all: Vec<(u64, Command)> = batches().into_iter().flatten().collect();
        let (mut acked, mut failures) = (0u64, 0u32);
        let power_loss = mode == FsyncMode::Always;
        for (b, batch) in batches().into_iter().enumerate() {
            let mut buf = Vec::new();
            for (seq, c) in &batch {
                encode_record(&mut buf, *seq, 7, c);
            }
            w.push(buf, batch.last().unwrap().0);
            for attempt in 0.. {
                assert!(attempt < 10, "{fault:?}: batch {b} never written");
                let result = w.flush(b % 2 == 0);
                let durable = w.durable();
                assert!(durable >= acked, "{fault:?}: the durable mark went back");
                acked = durable;
                match result {
                    Ok(()) => break,
                    Err(_) => {
                        failures += 1;
                        if failures == 1 {
                            let why = format!("{mode:?} {fault:?}, at the first failure (batch {b})");
                            check_recovery(&d, &w.io, power_loss, acked, &all, &why);
                        }
                    }
                }
            }
        }
        while w.flush(true).is_err() {}
        acked = w.durable();
        assert_eq!(acked, all.len() as u64, "{fault:?}: every record durable at the end");
        check_recovery(&d, &w.io, power_loss, acked, &all, &format!("{mode:?} {fault:?}, at the end"));
        fs::remove_dir_all(&d).unwrap();
        failures
    }

    #[test]
    fn a_full_disk_at_any_byte_of_the_log_loses_no_acknowledged_record() {
        let mut total = Vec::new();
        for (i, c) in batches().into_iter().flatten() {
            encode_record(&mut total, i, 7, &c);
        }
        for mode in [FsyncMode::Always, FsyncMode::Interval(Duration::from_secs(3600))] {
            let mut faulted = 0;
            for n in 0..=total.len() as u64 {
                if run_with_fault(mode, Fault::Full(n), "full") > 0 {
                    faulted += 1;
                }
            }
            // Every budget short of the whole log met the fault.
            assert_eq!(faulted, total.len(), "{mode:?}");
        }
    }

    #[test]
    fn a_failed_fsync_at_any_point_loses_no_acknowledged_record() {
        let mut k = 1;
        loop {
            let failures = run_with_fault(FsyncMode::Always, Fault::Sync(k), "fsync");
            if failures == 0 {
                break;
            }
            k += 1;
        }
        assert!(k > 14, "only {k} fsyncs");
    }

    #[test]
    fn snapshots_bound_the_log_and_a_damaged_snapshot_stops_the_start() {
        let d = logged("snap", FsyncMode::Interval(Duration::from_millis(5)), 5, |_| 1);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        write_snapshot(&d, 5, b"core bytes").unwrap();
        let log = Log::start(&d, FsyncMode::Always, 5).unwrap();
        let seq = log.append(2, &cmd(9));
        rt.block_on(log.wait(seq, Instant::now() + Duration::from_secs(5))).unwrap();
        log.close();
        let rec = recover(&d).unwrap();
        assert_eq!(rec.snapshot, Some((5, b"core bytes".to_vec())));
        assert_eq!(rec.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![6]);
        let snap = d.join(snapshot_name(5));
        let mut bytes = fs::read(&snap).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        fs::write(&snap, bytes).unwrap();
        let err = recover(&d).unwrap_err();
        assert!(err.contains("is damaged (checksum mismatch)"), "{err}");
        fs::remove_dir_all(&d).unwrap();
    }

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

    #[test]
    fn an_unknown_format_is_refused() {
        let d = tmp("format");
        open_dir(&d).unwrap();
        assert_eq!(fs::read_to_string(d.join("FORMAT")).unwrap(), format_text(FORMAT_VERSION));
        open_dir(&d).unwrap();
        fs::write(d.join("FORMAT"), "kvpages-data 99\n").unwrap();
        let err = open_dir(&d).unwrap_err();
        assert!(
            err.contains(&format!(
                "has format version 99, written by a newer kvpages; this kvpages reads version {FORMAT_VERSION}"
            )),
            "{err}"
        );
        // Garbage, and near misses of the real text, are not guessed at.
        for text in [
            "",
            "hello\n",
            "kvpages-data\n",
            "kvpages-data 1",
            "kvpages-data 01\n",
            "kvpages-data -1\n",
            "kvpages-data 1 \n",
            "kvpages-data x\n",
        ] {
            fs::write(d.join("FORMAT"), text).unwrap();
            let err = open_dir(&d).unwrap_err();
            assert!(
                err.contains(&format!("its FORMAT file reads {text:?}, not \"kvpages-data N\"")),
                "{text:?}: {err}"
            );
        }
        // An older version with no step to upgrade it.
        fs::write(d.join("FORMAT"), "kvpages-data 1\n").unwrap();
        let table = Formats { current: 3, upgrades: &[Upgrade { from: 2, run: v2_to_v3 }] };
        let err = open_dir_with(&d, &table, &mut |_| Ok(())).unwrap_err();
        assert!(
            err.contains(
                "format version 1, which this kvpages cannot upgrade (it reads version 3 and upgrades from 2)"
            ),
            "{err}"
        );
        let e = tmp("stray");
        fs::create_dir_all(&e).unwrap();
        fs::write(e.join("x"), "").unwrap();
        assert!(open_dir(&e).unwrap_err().contains("not a kvpages data directory"));
        // A first start that crashed while writing FORMAT is not a stray file.
        fs::remove_file(e.join("x")).unwrap();
        fs::write(e.join("FORMAT.tmp"), "kvpages-").unwrap();
        open_dir(&e).unwrap();
        assert_eq!(names(&e).unwrap(), ["FORMAT"]);
        fs::remove_dir_all(&d).unwrap();
        fs::remove_dir_all(&e).unwrap();
    }

    // Two made-up formats for the upgrade machinery (the real step is tested on the golden
    // directory, `tests/data_format.rs`): format 2 prefixes every file with "v2:", format 3
    // renames `x` to `x.3`.
    fn v1_to_v2(dir: &Path, staging: &Path) -> Result<(), String> {
        for name in names(dir).unwrap() {
            let path = dir.join(&name);
            if path.is_file() && name != "FORMAT" {
                let mut bytes = b"v2:".to_vec();
                bytes.extend(fs::read(&path).unwrap());
                fs::write(staging.join(&name), bytes).unwrap();
            }
        }
        Ok(())
    }

    fn v2_to_v3(dir: &Path, staging: &Path) -> Result<(), String> {
        for name in names(dir).unwrap() {
            let path = dir.join(&name);
            if path.is_file() && name != "FORMAT" {
                fs::copy(&path, staging.join(format!("{}.3", name.to_str().unwrap()))).unwrap();
            }
        }
        Ok(())
    }

    const TEST_FORMATS: Formats =
        Formats { current: 3, upgrades: &[Upgrade { from: 1, run: v1_to_v2 }, Upgrade { from: 2, run: v2_to_v3 }] };

    /// Every file under `dir` with its bytes, by relative path.
    fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        for name in names(dir).unwrap() {
            let path = dir.join(&name);
            let name = name.to_str().unwrap().to_owned();
            if path.is_dir() {
                out.extend(tree(&path).into_iter().map(|(n, b)| (format!("{name}/{n}"), b)));
            } else {
                out.push((name, fs::read(&path).unwrap()));
            }
        }
        out
    }

    /// `v1_dir`'s files as an upgrade keeps them, by relative path.
    fn v1_backup() -> Vec<(String, Vec<u8>)> {
        [
            ("FORMAT", "kvpages-data 1\n"),
            ("snapshot-00000000000000000007.bin", "snap"),
            ("wal-00000000000000000001.log", "log"),
        ]
        .map(|(name, bytes)| (format!("format-1/{name}"), bytes.as_bytes().to_vec()))
        .to_vec()
    }

    fn v1_dir(name: &str) -> PathBuf {
        let d = tmp(name);
        open_dir_with(&d, &Formats { current: 1, upgrades: &[] }, &mut |_| Ok(())).unwrap();
        fs::write(d.join("wal-00000000000000000001.log"), b"log").unwrap();
        fs::write(d.join("snapshot-00000000000000000007.bin"), b"snap").unwrap();
        d
    }

    #[test]
    fn an_older_format_is_upgraded_step_by_step_and_kept_as_a_backup() {
        let d = v1_dir("upgrade");
        let mut points = Vec::new();
        open_dir_with(&d, &TEST_FORMATS, &mut |p| {
            points.push(p.to_owned());
            Ok(())
        })
        .unwrap();
        let t = |s: &str| s.as_bytes().to_vec();
        let want = [
            vec![("FORMAT".to_owned(), t("kvpages-data 3\n"))],
            v1_backup(),
            vec![
                ("format-2/FORMAT".into(), t("kvpages-data 2\n")),
                ("format-2/snapshot-00000000000000000007.bin".into(), t("v2:snap")),
                ("format-2/wal-00000000000000000001.log".into(), t("v2:log")),
                ("snapshot-00000000000000000007.bin.3".into(), t("v2:snap")),
                ("wal-00000000000000000001.log.3".into(), t("v2:log")),
            ],
        ]
        .concat();
        assert_eq!(tree(&d), want);
        // Two steps, each with the same points.
        let step = [
            "stage",
            "write staged FORMAT",
            "create backup",
            "move old file",
            "move old file",
            "move old FORMAT",
            "move new file",
            "move new file",
            "switch FORMAT",
            "remove staging",
        ];
        assert_eq!(points, [step, step].concat());
        // Opening again changes nothing; this build's own FORMAT 1 is now refused as newer.
        open_dir_with(&d, &TEST_FORMATS, &mut |_| panic!("no change expected")).unwrap();
        assert_eq!(tree(&d), want);
        assert!(open_dir(&d).unwrap_err().contains("format version 3, written by a newer kvpages"));
        // An upgrade refuses to overwrite an earlier backup.
        let e = v1_dir("upgrade-backup");
        fs::create_dir(e.join("format-1")).unwrap();
        let err = open_dir_with(&e, &TEST_FORMATS, &mut |_| Ok(())).unwrap_err();
        assert!(err.contains("format-1 already exists"), "{err}");
        assert_eq!(fs::read_to_string(e.join("FORMAT")).unwrap(), "kvpages-data 1\n");
        fs::remove_dir_all(&d).unwrap();
        fs::remove_dir_all(&e).unwrap();
    }

    #[test]
    fn the_step_from_format_1_copies_a_snapshot_that_does_not_restore() {
        // `v1_dir`'s snapshot is the bytes "snap": recovery must go on refusing it with its
        // advice, as format 1 did, instead of the upgrade failing on it.
        let d = v1_dir("upgrade-real");
        open_dir(&d).unwrap();
        let t = |s: &str| s.as_bytes().to_vec();
        let want = [
            vec![("FORMAT".to_owned(), format_text(FORMAT_VERSION).into_bytes())],
            v1_backup(),
            vec![
                ("snapshot-00000000000000000007.bin".into(), t("snap")),
                ("wal-00000000000000000001.log".into(), t("log")),
            ],
        ]
        .concat();
        assert_eq!(tree(&d), want);
        let err = recover(&d).unwrap_err();
        assert!(err.contains("is damaged (not a kvpages snapshot file)") && err.contains("Move it aside"), "{err}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_upgrade_interrupted_at_any_point_finishes_on_the_next_start() {
        let clean = v1_dir("upgrade-clean");
        open_dir_with(&clean, &TEST_FORMATS, &mut |_| Ok(())).unwrap();
        let want = tree(&clean);
        let mut crash_at = 0;
        loop {
            let d = v1_dir("upgrade-crash");
            let mut n = 0;
            let crashed = open_dir_with(&d, &TEST_FORMATS, &mut |p| {
                n += 1;
                if n == crash_at + 1 { Err(io::Error::other(format!("crash before {p}"))) } else { Ok(()) }
            });
            let Err(err) = crashed else {
                // Past the last point: every point was tried.
                assert_eq!(crash_at, 20, "two steps of 10 points");
                fs::remove_dir_all(&d).unwrap();
                break;
            };
            assert!(err.contains("crash before"), "{err}");
            // Before the first step's staged FORMAT, format 1 is untouched (bar the staging).
            if crash_at < 2 {
                assert_eq!(fs::read_to_string(d.join("FORMAT")).unwrap(), "kvpages-data 1\n");
            }
            open_dir_with(&d, &TEST_FORMATS, &mut |_| Ok(()))
                .unwrap_or_else(|e| panic!("after a crash at point {crash_at}: {e}"));
            assert_eq!(tree(&d), want, "after a crash at point {crash_at}");
            fs::remove_dir_all(&d).unwrap();
            crash_at += 1;
        }
        fs::remove_dir_all(&clean).unwrap();
    }
}

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
    crate::metrics::set_log_bytes(update(old).expect("always Some"));
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
        if name == "FORMAT" || name == STAGING || path.is_dir() {
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
                let stray = names(dir).map_err(|e| at(dir, e))?.iter().any(|n| n != "FORMAT.tmp");
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

/// Progress of long work (recovery, imports) for the operator: a line every [`Progress::EVERY`]
/// with the count so far and the rate, and a final line with the count, the time and the rate.
pub struct Progress {
    what: String,
    unit: &'static str,
    total: Option<u64>,
    clock: Box<dyn Fn() -> Duration + Send>,
    sink: Box<dyn FnMut(&str) + Send>,
    started: Duration,
    last: Duration,
    calls: u32,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress").field("what", &self.what).field("total", &self.total).finish()
    }
}

impl Progress {
    /// How often a line is printed while the work goes on.
    pub const EVERY: Duration = Duration::from_secs(1);

    /// Progress of `what`, counted in `unit`s (out of `total`, when known), to the log.
    pub fn new(what: impl Into<String>, unit: &'static str, total: Option<u64>) -> Progress {
        let zero = Instant::now();
        Progress::with(what, unit, total, Box::new(move || zero.elapsed()), Box::new(|line| tracing::info!("{line}")))
    }

    /// [`Progress::new`] with a clock (time since any fixed zero) and a sink for the lines.
    pub fn with(
        what: impl Into<String>,
        unit: &'static str,
        total: Option<u64>,
        clock: Box<dyn Fn() -> Duration + Send>,
        sink: Box<dyn FnMut(&str) + Send>,
    ) -> Progress {
        let started = clock();
        Progress { what: what.into(), unit, total, clock, sink, started, last: started, calls: 0 }
    }

    fn rate(&self, done: u64, now: Duration) -> String {
        let secs = (now - self.started).as_secs_f64();
        if secs <= 0.0 { "-".to_owned() } else { format!("{:.0}", done as f64 / secs) }
    }

    /// `done` units so far; prints a line when [`Progress::EVERY`] has passed since the last.
    /// Cheap enough to call for every unit (the clock is read every 256 calls).
    pub fn update(&mut self, done: u64) {
        self.calls = self.calls.wrapping_add(1);
        if !self.calls.is_multiple_of(256) {
            return;
        }
        let now = (self.clock)();
        if now - self.last < Progress::EVERY {
            return;
        }
        self.last = now;
        let rate = self.rate(done, now);
        let line = match self.total {
            Some(total) => format!(
                "{}: {done} of {total} {} ({:.0}%), {rate} {}/s",
                self.what,
                self.unit,
                done as f64 * 100.0 / total.max(1) as f64,
                self.unit
            ),
            None => format!("{}: {done} {}, {rate} {}/s", self.what, self.unit, self.unit),
        };
        (self.sink)(&line);
    }

    /// The final line: `done` units in how long, at what rate.
    pub fn finish(mut self, done: u64) {
        let now = (self.clock)();
        let rate = self.rate(done, now);
        let line = format!(
            "{}: done, {done} {} in {:.2} s ({rate} {}/s)",
            self.what,
            self.unit,
            (now - self.started).as_secs_f64(),
            self.unit
        );
        (self.sink)(&line);
    }
}

/// Writes `dir/name` through a temporary file, fsynced, renamed, with the directory fsynced.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
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
fn write_snapshot_file(dir: &Path, seq: u64, core_bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("snapshot-{seq:020}.tmp"));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(SNAPSHOT_MAGIC)?;
        f.write_all(&seq.to_le_bytes())?;
        f.write_all(&(core_bytes.len() as u64).to_le_bytes())?;
        f.write_all(&crc32fast::hash(core_bytes).to_le_bytes())?;
        f.write_all(core_bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(snapshot_name(seq)))?;
    sync_dir(dir)
}

/// Writes a snapshot atomically (see [`write_snapshot_file`]), then removes older snapshots
/// and the log segments it makes unnecessary.
pub fn write_snapshot(dir: &Path, seq: u64, core_bytes: &[u8]) -> io::Result<()> {
    write_snapshot_file(dir, seq, core_bytes)?;
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

/// Records waiting for the flusher, and what it has made durable.
struct Pending {
    buf: Vec<u8>,
    last_seq: u64,
    closing: bool,
    failed: Option<String>,
}

struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
    durable: tokio::sync::watch::Sender<u64>,
}

/// The write-ahead log: `append` under the engine lock, `wait` outside it.
pub struct Log {
    shared: Arc<Shared>,
    durable: tokio::sync::watch::Receiver<u64>,
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
        let (tx, rx) = tokio::sync::watch::channel(last_seq);
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending { buf: Vec::new(), last_seq, closing: false, failed: None }),
            wake: Condvar::new(),
            durable: tx,
        });
        let existing: u64 = numbered(dir, "wal-", ".log")
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .iter()
            .map(|(_, p)| fs::metadata(p).map_or(0, |m| m.len()))
            .sum();
        LOG_BYTES.store(0, Ordering::Relaxed);
        add_log_bytes(existing as i64);
        let segment = open_segment(dir, last_seq + 1).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (s, d) = (shared.clone(), dir.to_path_buf());
        let flusher = std::thread::Builder::new()
            .name("kvpages-log".into())
            .spawn(move || flush_loop(&s, &d, mode, segment, last_seq))
            .map_err(|e| e.to_string())?;
        Ok(Log { shared, durable: rx, flusher: Mutex::new(Some(flusher)), dir: dir.to_path_buf() })
    }

    /// Appends one record; returns its seq. Call with the engine lock held, so the log order is
    /// the apply order.
    pub fn append(&self, now: Millis, command: &Command) -> u64 {
        let mut p = self.shared.pending.lock().expect("log lock");
        let seq = p.last_seq + 1;
        let payload = postcard::to_allocvec(&RecordRef { seq, now, command }).expect("commands encode");
        p.buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        p.buf.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        p.buf.extend_from_slice(&payload);
        p.last_seq = seq;
        drop(p);
        self.shared.wake.notify_one();
        seq
    }

    /// The seq of the last record appended.
    pub fn last_seq(&self) -> u64 {
        self.shared.pending.lock().expect("log lock").last_seq
    }

    /// Waits until record `seq` is durable, or `deadline` passes, or the log failed.
    pub async fn wait(&self, seq: u64, deadline: Instant) -> Result<(), String> {
        let mut rx = self.durable.clone();
        let wait = rx.wait_for(|&d| d >= seq);
        match tokio::time::timeout_at(deadline.into(), wait).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err("the log stopped".into()),
            Err(_) => match self.shared.pending.lock().expect("log lock").failed.clone() {
                Some(why) => Err(why),
                None => Err("the log did not reach the disk in time".into()),
            },
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

#[derive(serde::Serialize)]
struct RecordRef<'a> {
    seq: u64,
    now: Millis,
    command: &'a Command,
}

fn open_segment(dir: &Path, first: u64) -> io::Result<(File, u64)> {
    let f = OpenOptions::new().create(true).append(true).open(dir.join(segment_name(first)))?;
    sync_dir(dir)?;
    let len = f.metadata()?.len();
    Ok((f, len))
}

fn flush_loop(shared: &Shared, dir: &Path, mode: FsyncMode, segment: (File, u64), mut durable: u64) {
    let (mut file, mut size) = segment;
    let mut last_sync = Instant::now();
    let mut unsynced = false;
    loop {
        let (buf, last, closing) = {
            let mut p = shared.pending.lock().expect("log lock");
            loop {
                if !p.buf.is_empty() || p.closing {
                    break;
                }
                let timeout = match mode {
                    FsyncMode::Interval(every) if unsynced => every.saturating_sub(last_sync.elapsed()),
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
        let result = (|| -> io::Result<()> {
            if !buf.is_empty() {
                file.write_all(&buf)?;
                size += buf.len() as u64;
                add_log_bytes(buf.len() as i64);
                unsynced = true;
            }
            let sync_now = match mode {
                FsyncMode::Always => unsynced,
                FsyncMode::Interval(every) => unsynced && (closing || last_sync.elapsed() >= every),
            };
            if sync_now {
                let t = Instant::now();
                file.sync_data()?;
                crate::metrics::observe_fsync(t.elapsed());
                last_sync = Instant::now();
                unsynced = false;
            }
            if size >= SEGMENT_BYTES {
                file.sync_data()?;
                let (f, s) = open_segment(dir, last + 1)?;
                file = f;
                size = s;
                unsynced = false;
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                // Always: durable once fsynced; Interval: once the OS has it.
                if last > durable && (mode != FsyncMode::Always || !unsynced) {
                    durable = last;
                    shared.durable.send_replace(durable);
                }
            }
            Err(e) => {
                let why = format!("writing the log in {} failed: {e}", dir.display());
                tracing::error!("{why}");
                shared.pending.lock().expect("log lock").failed = Some(why);
                // Retry later instead of spinning: the records stay unacknowledged.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        if closing && buf.is_empty() {
            return;
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

    #[test]
    fn records_survive_a_restart_and_a_torn_tail_is_cut() {
        let d = tmp("torn");
        open_dir(&d).unwrap();
        let log = Log::start(&d, FsyncMode::Always, 0).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for i in 0..10 {
            let seq = log.append(u64::from(i) * 10, &cmd(i));
            rt.block_on(log.wait(seq, Instant::now() + Duration::from_secs(5))).unwrap();
        }
        log.close();
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

    #[test]
    fn snapshots_bound_the_log_and_a_damaged_snapshot_stops_the_start() {
        let d = tmp("snap");
        open_dir(&d).unwrap();
        let log = Log::start(&d, FsyncMode::Interval(Duration::from_millis(5)), 0).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for i in 0..5 {
            let seq = log.append(1, &cmd(i));
            rt.block_on(log.wait(seq, Instant::now() + Duration::from_secs(5))).unwrap();
        }
        log.close();
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

    #[test]
    fn progress_prints_counts_and_rate_every_second_and_a_final_line() {
        // A clock that moves 0.5 s each time it is read; it is read at the start, every 256
        // updates, and at the end.
        let reads = Arc::new(AtomicU64::new(0));
        let r = reads.clone();
        let clock = Box::new(move || Duration::from_millis(500 * r.fetch_add(1, Ordering::Relaxed)));
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let l = lines.clone();
        let sink = Box::new(move |line: &str| l.lock().unwrap().push(line.to_owned()));
        let mut p = Progress::with("replaying", "records", Some(2048), clock, sink);
        for done in 1..=1024 {
            p.update(done);
        }
        p.finish(1024);
        assert_eq!(
            *lines.lock().unwrap(),
            [
                "replaying: 512 of 2048 records (25%), 512 records/s",
                "replaying: 1024 of 2048 records (50%), 512 records/s",
                "replaying: done, 1024 records in 2.50 s (410 records/s)",
            ]
        );
        assert_eq!(reads.load(Ordering::Relaxed), 6);
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let l = lines.clone();
        let mut p = Progress::with(
            "reading",
            "keys",
            None,
            Box::new(|| Duration::from_secs(3)),
            Box::new(move |line: &str| l.lock().unwrap().push(line.to_owned())),
        );
        for done in 1..=300 {
            p.update(done);
        }
        p.finish(300);
        assert_eq!(*lines.lock().unwrap(), ["reading: done, 300 keys in 0.00 s (- keys/s)"]);
    }
}

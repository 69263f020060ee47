//! The write-ahead log: records appended under the engine lock, a flusher thread that writes
//! and fsyncs them in groups, and its `Writer`, which keeps every record not yet fsynced so a
//! failed write or fsync is cut back and written again.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvpages_core::{Command, Millis};

use super::format::{encode_record, numbered, segment_name, sync_dir};

/// A segment is closed and a new one started past this size.
const SEGMENT_BYTES: u64 = 64 << 20;

/// Bytes of log segments on disk (for `/metrics`).
static LOG_BYTES: AtomicU64 = AtomicU64::new(0);

pub(super) fn add_log_bytes(delta: i64) {
    let update = |cur: u64| Some((cur as i64 + delta).max(0) as u64);
    let old = LOG_BYTES.fetch_update(Ordering::Relaxed, Ordering::Relaxed, update).expect("always Some");
    crate::telemetry::set_log_bytes(update(old).expect("always Some"));
}

/// When a record counts as durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FsyncMode {
    /// After `fsync` (one for every group of records waiting): survives power loss. The default.
    #[default]
    Always,
    /// After `write` (the OS has it: survives a crash of kvpages, not of the machine); the log
    /// is fsynced every interval, so a power loss loses at most that much.
    Interval(Duration),
}

/// The form `--fsync` takes: `always` or `interval=MS`.
impl std::fmt::Display for FsyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FsyncMode::Always => f.write_str("always"),
            FsyncMode::Interval(every) => write!(f, "interval={}", every.as_millis()),
        }
    }
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

/// Records waiting for the flusher.
struct Pending {
    buf: Vec<u8>,
    last_seq: u64,
    /// Seq of the last record whose command changes more than leases: what a reply waits for
    /// (with its own record, unless that one only changes leases).
    last_hard: u64,
    /// Seq of the last record the flusher took.
    taken: u64,
    /// When the oldest record still waiting that only changes leases arrived: such records wait
    /// for a record that changes more, or for [`LEASE_RECORDS_WAIT`].
    leases_since: Option<Instant>,
    closing: bool,
    /// The flusher waits on `wake` (an append must wake it; otherwise it comes back by itself).
    idle: bool,
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
    /// `mark.durable`, readable without the channel: a reply whose records are durable already
    /// goes without waiting.
    durable: AtomicU64,
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
            pending: Mutex::new(Pending {
                buf: Vec::new(),
                last_seq,
                last_hard: last_seq,
                taken: last_seq,
                leases_since: None,
                closing: false,
                idle: false,
            }),
            wake: Condvar::new(),
            mark: tx,
            durable: AtomicU64::new(last_seq),
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

    /// Appends one record; returns the seq its reply waits for ([`Log::wait`]): its own, or for
    /// a command that changes only leases ([`Command::changes_only_leases`]) the last record
    /// before it that changes more. Such a record reaches the disk in order with the others,
    /// but no reply waits for it, so it does not wake the flusher: it goes with the next record
    /// that changes more, or after [`LEASE_RECORDS_WAIT`]. Call with the engine lock held, so
    /// the log order is the apply order.
    pub fn append(&self, now: Millis, command: &Command) -> u64 {
        let mut p = self.shared.pending.lock().expect("log lock");
        let seq = p.last_seq + 1;
        encode_record(&mut p.buf, seq, now, command);
        p.last_seq = seq;
        let lease_only = command.changes_only_leases();
        if lease_only {
            p.leases_since.get_or_insert_with(Instant::now);
        } else {
            p.last_hard = seq;
        }
        let (wait_for, wake) = (p.last_hard, p.idle && !lease_only);
        drop(p);
        if wake {
            self.shared.wake.notify_one();
        }
        wait_for
    }

    /// The seq of the last record appended.
    pub fn last_seq(&self) -> u64 {
        self.shared.pending.lock().expect("log lock").last_seq
    }

    /// The seq a read waits for: the last record that changes more than leases (a read shows
    /// no state a crash could take back).
    pub fn barrier(&self) -> u64 {
        self.shared.pending.lock().expect("log lock").last_hard
    }

    /// The storage fault the log is in (`path: OS error`), or `None` while it writes.
    pub fn fault(&self) -> Option<String> {
        self.mark.borrow().fault.as_deref().map(str::to_owned)
    }

    /// Waits until record `seq` is durable, or `deadline` passes. While the log cannot write,
    /// a record not yet durable gives up at once with the fault.
    pub async fn wait(&self, seq: u64, deadline: Instant) -> Result<(), NotDurable> {
        if self.shared.durable.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
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

/// The open log segment as the flusher writes it: at offsets, so a fault can be rewound and
/// written again. A trait so the tests can fail any write or fsync (`Faulty`, in the tests below).
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
/// Longest a record that only changes leases waits for the flusher when no other record comes:
/// no reply waits for it, and a crash that loses it loses nothing (see
/// [`Command::changes_only_leases`]). Under a load of lookups alone, the log takes about ten
/// writes and fsyncs a second instead of one per batch of lookups.
pub(crate) const LEASE_RECORDS_WAIT: Duration = Duration::from_millis(100);

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
        let (buf, last, closing) = next_batch(shared, &w, episode.as_ref(), last_sync);
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
                mark_written(shared, &w, &mut episode);
            }
            Err(err) => mark_failed(shared, &w, &mut episode, &err),
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

/// Waits for records or a close, but no longer than until the next retry or interval fsync is
/// due; takes what is pending: `(records, seq of the last, closing)`.
fn next_batch<S: SegmentIo>(
    shared: &Shared,
    w: &Writer<S>,
    episode: Option<&Episode>,
    last_sync: Instant,
) -> (Vec<u8>, u64, bool) {
    let mut p = shared.pending.lock().expect("log lock");
    loop {
        let leases_due = p.leases_since.map(|since| LEASE_RECORDS_WAIT.saturating_sub(since.elapsed()));
        if p.last_hard > p.taken || leases_due == Some(Duration::ZERO) || p.closing {
            break;
        }
        let timeout = match (episode, w.mode) {
            (Some(e), _) => e.backoff,
            (None, FsyncMode::Interval(every)) if w.unsynced() => every.saturating_sub(last_sync.elapsed()),
            _ => Duration::from_secs(3600),
        };
        let timeout = leases_due.map_or(timeout, |due| due.min(timeout));
        p.idle = true;
        let (guard, res) = shared.wake.wait_timeout(p, timeout).expect("log lock");
        p = guard;
        p.idle = false;
        if res.timed_out() {
            break;
        }
    }
    (p.taken, p.leases_since) = (p.last_seq, None);
    (std::mem::take(&mut p.buf), p.last_seq, p.closing)
}

/// A flush worked: ends the fault episode, if one was on, and publishes the durable mark.
fn mark_written<S: SegmentIo>(shared: &Shared, w: &Writer<S>, episode: &mut Option<Episode>) {
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
    shared.durable.store(durable, Ordering::Release);
    shared.mark.send_if_modified(|m| {
        let changed = m.durable != durable || m.fault.is_some();
        (m.durable, m.fault) = (durable, None);
        changed
    });
}

/// A flush failed: starts the fault episode (said once, as an error) or backs off further, and
/// publishes the fault with the durable mark.
fn mark_failed<S: SegmentIo>(shared: &Shared, w: &Writer<S>, episode: &mut Option<Episode>, err: &io::Error) {
    crate::telemetry::storage_write_failed();
    let why: Arc<str> = format!("{}: {err}", w.io.name()).into();
    match episode {
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
            *episode = Some(Episode { since: Instant::now(), tries: 1, backoff: RETRY_FIRST });
        }
    }
    let durable = w.durable();
    shared.durable.store(durable, Ordering::Release);
    shared.mark.send_modify(|m| (m.durable, m.fault) = (durable, Some(why.clone())));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::format::{FORMAT_VERSION, format_text};
    use crate::durable::tests::{cmd, tmp};
    use crate::durable::{open_dir, recover};

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
}

//! What the data directory holds, byte for byte: its `FORMAT` text and the version table, the
//! names of its files, and the log's records (written, and read back with a torn one told
//! apart from the end).

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use kvpages_core::{Command, Millis};

use super::upgrade::upgrade_from_1;

/// The data directory format this build writes and reads (upgrading older ones: [`FORMATS`]).
pub const FORMAT_VERSION: u32 = 2;

/// One step of the upgrade path: reads the files of format `from` in the data directory and
/// writes those of format `from + 1` into an empty staging directory. It must not touch the
/// data directory itself; [`open_dir`](super::open_dir) makes the switch crash-safe around it.
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

pub(super) fn format_text(version: u32) -> String {
    format!("kvpages-data {version}\n")
}

pub(super) fn parse_format(dir: &Path, text: &str) -> Result<u32, String> {
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

pub(super) fn segment_name(first: u64) -> String {
    format!("wal-{first:020}.log")
}

pub(super) fn snapshot_name(seq: u64) -> String {
    format!("snapshot-{seq:020}.bin")
}

/// Files named `prefix<number>suffix` in `dir`, sorted by number.
pub(super) fn numbered(dir: &Path, prefix: &str, suffix: &str) -> io::Result<Vec<(u64, PathBuf)>> {
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

/// Names in `dir`, sorted.
pub(super) fn names(dir: &Path) -> io::Result<Vec<std::ffi::OsString>> {
    let mut out = fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<Vec<_>>>()?;
    out.sort();
    Ok(out)
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// No record is larger than this (a request body is at most `--max-body`).
const MAX_RECORD: u32 = 1 << 30;

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

/// Appends record `seq` to `buf` as a segment holds it: `[len][crc32][postcard (seq, now, command)]`.
pub(super) fn encode_record(buf: &mut Vec<u8>, seq: u64, now: Millis, command: &Command) {
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

/// What [`read_record`] found.
pub(super) enum Next {
    /// The segment ends here, between records.
    End,
    /// A whole record, and the bytes it took.
    Record(Record, u64),
    /// Bytes that are not a whole, intact record, and why.
    Torn(String),
}

/// Reads the record `r` is at, as [`encode_record`] wrote it; the error is the reader's own.
pub(super) fn read_record(r: &mut impl Read) -> io::Result<Next> {
    let mut head = [0u8; 8];
    match read_full(r, &mut head)? {
        0 => return Ok(Next::End),
        8 => {}
        n => return Ok(Next::Torn(format!("a record header cut after {n} bytes"))),
    }
    let len = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
    if len == 0 || len > MAX_RECORD {
        return Ok(Next::Torn(format!("a record length of {len} bytes")));
    }
    let mut payload = vec![0u8; len as usize];
    let got = read_full(r, &mut payload)?;
    if got < payload.len() {
        return Ok(Next::Torn(format!("a record cut after {got} of {len} bytes")));
    }
    if crc32fast::hash(&payload) != crc {
        return Ok(Next::Torn("a record with a wrong checksum".into()));
    }
    match postcard::from_bytes(&payload) {
        Ok(record) => Ok(Next::Record(record, 8 + u64::from(len))),
        Err(e) => Ok(Next::Torn(format!("a record that does not decode ({e})"))),
    }
}

/// Fills `buf` as far as `r` goes; fewer bytes than asked means `r` ended.
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

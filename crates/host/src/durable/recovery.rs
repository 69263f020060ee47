//! Recovery: the newest snapshot and the log records after it, a torn or corrupt tail cut off
//! (and said so), a damaged snapshot refused.

use std::fs::{self, File, OpenOptions};
use std::io::BufReader;
use std::path::{Path, PathBuf};

use kvpages_core::Millis;

use super::format::{Next, Record, numbered, read_record};
use super::snapshot::parse_snapshot;
use crate::progress::Progress;

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
            out.dropped_tail = Some(cut_torn_tail(path, offset, &why, &segments[i + 1..])?);
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

/// Cuts the segment at `path` back to `offset`, where it is torn (`why`), and moves the `later`
/// segments aside: a record after the tear could not be replayed in order. Returns the note
/// for the log line.
fn cut_torn_tail(path: &Path, offset: u64, why: &str, later: &[(u64, PathBuf)]) -> Result<String, String> {
    let file = OpenOptions::new().write(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    file.set_len(offset).and_then(|()| file.sync_all()).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut note = format!("{} at byte {offset}: {why}; the log ends there", path.display());
    for (_, segment) in later {
        let aside = segment.with_extension("log.damaged");
        fs::rename(segment, &aside).map_err(|e| format!("{}: {e}", segment.display()))?;
        note.push_str(&format!("; later segment moved aside to {}", aside.display()));
    }
    Ok(note)
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
        let (record, bytes) = match read_record(&mut r).map_err(|e| format!("{}: {e}", path.display()))? {
            Next::End => return Ok((records, None)),
            Next::Torn(why) => return Ok((records, Some((offset, why)))),
            Next::Record(record, bytes) => (record, bytes),
        };
        if let Some(want) = *expect
            && record.seq != want
        {
            return Ok((records, Some((offset, format!("record {} where {want} was due", record.seq)))));
        }
        *expect = Some(record.seq + 1);
        offset += bytes;
        records.push(record);
        *read += 1;
        progress.update(*read);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::FsyncMode;
    use crate::durable::tests::logged;

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
}

//! Helpers the durable tests share, and the tests that span the log, snapshots and recovery.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvpages_core::{Command, Key, Millis, Space};

use super::format::snapshot_name;
use super::{FsyncMode, Log, open_dir, recover, write_snapshot};

pub(super) fn cmd(i: u32) -> Command {
    Command::Allocate { space: Space::Vllm, rank: i, keys: vec![Key::parse("k").unwrap()] }
}

pub(super) fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvpages-durable-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

/// A new data directory `name` whose log holds `records`, each appended at `now(i)` and
/// waited for.
pub(super) fn logged(name: &str, mode: FsyncMode, records: u32, now: fn(u32) -> Millis) -> PathBuf {
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
fn a_lookup_waits_for_the_records_before_it_but_not_for_its_own_lease() {
    let d = tmp("lease-only");
    open_dir(&d).unwrap();
    let log = Log::start(&d, FsyncMode::Always, 0).unwrap();
    let lookup = Command::Locations { space: Space::Vllm, rank: 0, keys: vec![Key::parse("k").unwrap()] };
    // (command, what its reply waits for, the barrier a read meets after it)
    let steps = [(cmd(0), 1, 1), (lookup.clone(), 1, 1), (lookup.clone(), 1, 1), (cmd(1), 4, 4), (lookup, 4, 4)];
    for (i, (command, waits_for, barrier)) in steps.into_iter().enumerate() {
        assert_eq!(log.append(7, &command), waits_for, "step {i}");
        assert_eq!(log.barrier(), barrier, "step {i}");
        assert_eq!(log.last_seq(), i as u64 + 1, "step {i}: every command is logged");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(log.wait(5, Instant::now() + Duration::from_secs(5))).unwrap();
    log.close();
    // The lease records are in the log, in order, like every other record.
    let seqs: Vec<u64> = recover(&d).unwrap().records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    fs::remove_dir_all(&d).unwrap();
}

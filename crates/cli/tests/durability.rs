//! Durability with the real binary: restarts, `kill -9` under concurrent load, a torn log tail.
//! Every acknowledged confirm and delete must be there after the restart, and the page counts
//! must add up. Also the worker threads `kvpages serve` runs (`--threads`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpages_host::runtime::{SERVER_THREAD, default_threads};
use kvpages_rng::Rng;

mod process;
use process::*;

#[test]
fn a_restart_keeps_ranks_keys_and_pages() {
    let (dir, port, mut p) = started_with_two_ranks("restart", 64);
    let keys: Vec<String> = (0..20).map(|i| format!("{i:032x}")).collect();
    let saved: Vec<[i64; 2]> = keys.iter().map(|k| save(p.addr, k).unwrap()).collect();
    assert_eq!(post(p.addr, "/keys/delete", r#"{"keys":["00000000000000000000000000000003"]}"#).0, 200);
    // SIGTERM: a clean stop writes a snapshot.
    unsafe_term(&p.child);
    assert!(p.child.wait().unwrap().success());
    assert!(
        std::fs::read_dir(&dir).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with("snapshot-"))
    );
    let mut p = start(&dir, port, &[]);
    // vLLM's workers never initialize again: the ranks must still be there.
    for rank in 0..2u32 {
        let got = locations(p.addr, rank, &keys);
        for (i, page) in got.iter().enumerate() {
            let want = if i == 3 { None } else { Some(saved[i][rank as usize]) };
            assert_eq!(*page, want, "key {i} rank {rank}");
        }
    }
    assert_pages_add_up(p.addr);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kill_9_under_load_loses_nothing_acknowledged_native() {
    kill_9_under_load("native");
}

#[test]
fn kill_9_under_load_loses_nothing_acknowledged_wasm() {
    kill_9_under_load("wasm");
}

/// What a client was told about a key.
#[derive(Clone, Copy, Debug)]
enum Acked {
    /// Both ranks' confirms were answered 204.
    Saved([i64; 2]),
    /// A delete was sent but its reply never came (the kill): either outcome is right.
    Deleting([i64; 2]),
    /// The delete was answered 200.
    Deleted,
}

fn kill_9_under_load(engine: &str) {
    let dir = tmp(&format!("kill9-{engine}"));
    let port = free_port();
    let mut p = start_engine(engine, &dir, port, &["--snapshot-every", "300"]);
    init_two_ranks(p.addr, 100000);
    // Acknowledged state: key → pages (saved), and keys whose delete was acknowledged.
    let acked: Arc<Mutex<std::collections::BTreeMap<String, Acked>>> = Arc::default();
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15u64);
    let rounds = 20;
    for round in 0..rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..4)
            .map(|w| {
                let (stop, acked, addr) = (stop.clone(), acked.clone(), p.addr);
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let key = format!("{round:08x}{w:08x}{i:016x}");
                        i += 1;
                        if let Some(pages) = save(addr, &key) {
                            acked.lock().unwrap().insert(key.clone(), Acked::Saved(pages));
                            if i.is_multiple_of(5) {
                                // Until its reply arrives, a delete may or may not have happened.
                                acked.lock().unwrap().insert(key.clone(), Acked::Deleting(pages));
                                let (st, _) = post(addr, "/keys/delete", &format!(r#"{{"keys":["{key}"]}}"#));
                                if st == 200 {
                                    acked.lock().unwrap().insert(key, Acked::Deleted);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50 + rng.below(250)));
        p.child.kill().unwrap(); // SIGKILL: no clean shutdown, no final snapshot.
        p.child.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.join().unwrap();
        }
        p = start_engine(engine, &dir, port, &["--snapshot-every", "300"]);
        let acked = acked.lock().unwrap();
        let keys: Vec<String> = acked.keys().cloned().collect();
        for rank in 0..2u32 {
            let got = locations(p.addr, rank, &keys);
            for (k, page) in keys.iter().zip(got) {
                match acked[k] {
                    Acked::Saved(pages) => {
                        assert_eq!(page, Some(pages[rank as usize]), "round {round}: key {k} rank {rank}")
                    }
                    Acked::Deleted => assert_eq!(page, None, "round {round}: deleted key {k} on rank {rank}"),
                    Acked::Deleting(pages) => assert!(
                        page.is_none() || page == Some(pages[rank as usize]),
                        "round {round}: key {k} on rank {rank}: {page:?}"
                    ),
                }
            }
        }
        assert_pages_add_up(p.addr);
    }
    assert!(acked.lock().unwrap().len() > 100, "the load did something: {}", acked.lock().unwrap().len());
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A lookup's reply does not wait for its own lease record, only for the records before it.
/// Under a lookup-heavy load with eviction, killed with `kill -9` and restarted: every page a
/// reader was shown still holds its key (so no writer was given it), and no page has two keys.
#[test]
fn kill_9_under_lookups_keeps_every_reader_protected() {
    const POOL: u32 = 256;
    const LEASE: &str = "2";
    let dir = tmp("kill9-lookups");
    let port = free_port();
    let opts = ["--read-lease", LEASE, "--snapshot-every", "300"];
    let mut p = start_engine("wasm", &dir, port, &opts);
    init_two_ranks(p.addr, POOL);
    // Fills the pool past its eviction mark (95 %): every save evicts or finds room that an
    // eviction made. The readers' hot set is the first 64.
    let stored: Vec<String> = (0..250).map(|i| format!("{i:032x}")).collect();
    for key in &stored {
        save(p.addr, key).expect("a pool with room saves");
    }
    // Every key a writer began to save.
    let written: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut rng = Rng::new(0x2545_F491_4F6C_DD1Du64);
    let (mut shown_total, mut saves_total) = (0, 0);
    for round in 0..6u64 {
        let stop = Arc::new(AtomicBool::new(false));
        // (key, rank, page) of every hit a reader was answered in this round.
        let shown: Arc<Mutex<Vec<(String, u32, i64)>>> = Arc::default();
        let readers: Vec<_> = (0..3u64)
            .map(|r| {
                let (stop, shown, written, hot, addr) =
                    (stop.clone(), shown.clone(), written.clone(), stored[..64].to_vec(), p.addr);
                std::thread::spawn(move || {
                    let mut i = r;
                    while !stop.load(Ordering::Relaxed) {
                        let recent: Vec<String> = written.lock().unwrap().iter().rev().take(4).cloned().collect();
                        let keys: Vec<String> =
                            (0..4).map(|j| hot[((i * 7 + j * 13) % 64) as usize].clone()).chain(recent).collect();
                        let rank = (i % 2) as u32;
                        i += 1;
                        let body = serde_json::json!({"rank": rank, "keys": keys}).to_string();
                        let (st, body) = post(addr, "/keys/get_locations", &body);
                        if st != 200 {
                            continue; // the kill
                        }
                        let got = json(&body)["locations"].as_array().unwrap().clone();
                        let mut shown = shown.lock().unwrap();
                        for (k, page) in keys.iter().zip(got) {
                            if let Some(page) = page.as_i64() {
                                shown.push((k.clone(), rank, page));
                            }
                        }
                    }
                })
            })
            .collect();
        let writer = {
            let (stop, written, addr) = (stop.clone(), written.clone(), p.addr);
            std::thread::spawn(move || {
                let mut saves = 0;
                for i in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let key = format!("f{round:015x}{i:016x}"); // never one of `stored`
                    // Readers look the key up while it is being saved, too.
                    written.lock().unwrap().push(key.clone());
                    if save(addr, &key).is_some() {
                        saves += 1;
                    }
                }
                saves
            })
        };
        std::thread::sleep(Duration::from_millis(100 + rng.below(200)));
        p.child.kill().unwrap(); // SIGKILL: records not yet handed to the OS are lost.
        p.child.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        saves_total += writer.join().unwrap();
        p = start_engine("wasm", &dir, port, &opts);
        // No command ran since the restart: a page shown is still its key's, whatever the leases.
        let shown = shown.lock().unwrap();
        shown_total += shown.len();
        for (key, rank, page) in shown.iter() {
            let now = locations(p.addr, *rank, std::slice::from_ref(key));
            assert_eq!(now, [Some(*page)], "round {round}: a reader was shown {key} at page {page} on rank {rank}");
        }
        // No page holds two keys.
        let every: Vec<String> = stored.iter().chain(written.lock().unwrap().iter()).cloned().collect();
        for rank in 0..2u32 {
            let mut owner = std::collections::BTreeMap::new();
            for (key, page) in every.iter().zip(locations(p.addr, rank, &every)) {
                if let Some(other) = page.and_then(|page| owner.insert(page, key)) {
                    panic!("round {round}: page {page:?} of rank {rank} holds {other} and {key}");
                }
            }
        }
        assert_pages_add_up(p.addr);
        // Recovery leased every key for the read lease; once it ends, writers can evict again.
        std::thread::sleep(Duration::from_millis(2100));
    }
    assert!(shown_total > 200, "the readers were answered: {shown_total}");
    // At least 10 keys were evicted: more were saved than the pool holds.
    assert!(saves_total >= 16, "the writers saved: {saves_total} keys after the {} that fill the pool", stored.len());
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_torn_log_tail_is_cut_and_the_server_starts() {
    let dir = tmp("torn");
    let port = free_port();
    let mut p = start(&dir, port, &[]);
    assert_eq!(post(p.addr, "/rank/0/initialize", r#"{"num_pages":8}"#).0, 200);
    let (st, _) = post(p.addr, "/keys/batch_allocate", r#"{"rank":0,"keys":[["a",""]]}"#);
    assert_eq!(st, 200);
    assert_eq!(post(p.addr, "/keys/confirm_write", r#"{"rank":0,"confirmations":[["a",0]]}"#).0, 204);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    // Half a record of garbage at the end of the newest segment, as a crash mid-write leaves.
    let mut segs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    segs.sort();
    let last = segs.last().unwrap();
    std::fs::OpenOptions::new().append(true).open(last).unwrap().write_all(&[200, 0, 0, 0, 1, 2]).unwrap();
    let mut p = start(&dir, port, &[]);
    assert_eq!(post(p.addr, "/keys/batch_exists", r#"{"keys":["a"]}"#), (200, r#"{"exists":[true]}"#.into()));
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    // A FORMAT from the future is refused with a message.
    std::fs::write(dir.join("FORMAT"), "kvpages-data 9\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvpages"))
        .args(["serve", "--port", &free_port().to_string(), "--engine", "native", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has format version 9, written by a newer kvpages"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Waits until `path` (a server's stderr) contains `needle`; returns the whole text.
fn wait_for_line(path: &Path, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(Instant::now() < deadline, "no {needle:?} in the log:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn recovery_and_imports_log_counts_and_rates() {
    let (dir, port, mut p) = started_with_two_ranks("progress", 64);
    for i in 0..10 {
        save(p.addr, &format!("{i:032x}")).unwrap();
    }
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    // Records: the first start's Configure and LeaseAll, 2 initializes, 10 x 2 ranks x
    // (allocate + confirm).
    let records = 2 + 2 + 10 * 4;
    let file = dir.with_extension("sglang.json");
    std::fs::write(
        &file,
        r#"{"0:kv": {"num_pages": 8, "free_pages": [7, 6, 5], "key_to_index": [["a", 0], ["b", 1], ["c", 2]]},
            "1:kv": {"num_pages": 4, "free_pages": [3], "key_to_index": [["d", 0], ["e", 1]]}}"#,
    )
    .unwrap();
    let log = dir.with_extension("stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_kvpages"))
        .args(["serve", "--port", &port.to_string(), "--engine", "native", "--log", "info", "--data-dir"])
        .arg(&dir)
        .arg("--import-sglang")
        .arg(&file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let p = Proc { child, addr: format!("127.0.0.1:{port}").parse().unwrap() };
    let text = wait_for_line(&log, "import: done");
    let size = std::fs::metadata(&file).unwrap().len();
    for want in [
        format!("recovery: reading the log (1 segments): done, {records} records in "),
        format!("recovery: replaying the log: done, {records} records in "),
        "recovery done: serving".to_owned(),
        format!("import: parsing SGLang's persistence file ({size} bytes): done, 5 keys in "),
        "import: loading 5 keys of 2 pools (one logged command)".to_owned(),
        "import: done, 5 keys of 2 pools in ".to_owned(),
        "keys/s; loading and logging ".to_owned(),
        "3 leaked pages made free".to_owned(),
    ] {
        assert!(text.contains(&want), "no {want:?} in the log:\n{text}");
    }
    assert!(text.contains(" records/s)"), "{text}");
    // The command-line import ends with the count and the rate.
    let out = Command::new(env!("CARGO_BIN_EXE_kvpages"))
        .args(["import-sglang", "--replace", "--url", &format!("http://{}", p.addr)])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("kvpages: import: done, 5 keys of 2 pools in "), "{err}");
    assert!(err.contains(" keys/s), 3 leaked pages made free"), "{err}");
    let reply = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!((reply["pools"].as_u64(), reply["keys"].as_u64()), (Some(2), Some(5)), "{reply}");
    drop(p);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_file(&file).unwrap();
    std::fs::remove_file(&log).unwrap();
}

/// Threads of process `pid` named like the server's workers, once there are `want` of them: a
/// thread takes its name when it first runs, which may be after the server answers (polled
/// for up to 10 s; the last count otherwise).
fn server_threads(pid: u32, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("Linux's /proc");
        let named = |t: &std::fs::DirEntry| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == SERVER_THREAD)
        };
        let n = tasks.flatten().filter(named).count();
        if n == want || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_runs_the_worker_threads_it_is_told_or_half_the_cpus() {
    let dir = tmp("threads");
    let default = default_threads();
    let more = (default + 1).to_string();
    /// Flags, environment, worker threads wanted.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], usize);
    // In memory: recovery and snapshot writes run on the runtime's blocking threads, which
    // carry the same name.
    let cases: [Case; 3] = [
        (&["--in-memory", "--threads", &more], &[], default + 1),
        (&["--in-memory"], &[("KVPAGES_THREADS", &more)], default + 1),
        (&["--in-memory"], &[], default),
    ];
    for (extra, env, want) in cases {
        let p = start_with_env("native", &dir, free_port(), extra, env);
        assert_eq!(server_threads(p.child.id(), want), want, "{extra:?} {env:?}, default {default}");
        // They serve: a save goes through.
        init_two_ranks(p.addr, 4);
        assert!(save(p.addr, "0123456789abcdef0123456789abcdef").is_some());
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kvpages"))
        .args(["serve", "--in-memory", "--port", "0", "--threads", "0"])
        .output()
        .expect("kvpages runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("'0' is not a thread count (1 or more)"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The data directory across releases. `tests/data/format-N/` is a data directory written by
//! format N (a snapshot, then a log segment with every kind of command the log holds, in both
//! spaces, hex and verbatim keys); `tests/data/format-N.expected.json` is the state it holds.
//! Every later build must recover each of them to exactly that state, with both engines (the
//! older ones through the upgrade steps of `durable::FORMATS`): a change that breaks reading old
//! data directories fails here. Never regenerate them: a new format gets its own golden
//! directory and an upgrade step from the previous one; the old ones stay. Format 2 (session
//! 26) changed only the core's snapshot bytes inside `snapshot-*.bin`.
//!
//! `KVPAGES_WRITE_GOLDEN=DIR cargo test -p kvpages-host --test data_format -- --ignored` writes
//! the directory and its expected state with today's writer into DIR (how the committed ones
//! were made).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvpages_core::{Command, Eviction, Key, Millis, Settings, SglangPool, Space};
use kvpages_host::config::ServeConfig;
use kvpages_host::durable::{self, FsyncMode, Log};
use kvpages_host::engine::{Engine, EngineKind, NativeEngine};

const SEED: u64 = 0x6b76_7061_6765_7331;
/// The snapshot is taken after this many records.
const SNAPSHOT_AT: usize = 11;

fn key(s: &str) -> Key {
    Key::parse(s).unwrap()
}

fn hex(i: u32) -> Key {
    key(&format!("{i:032x}"))
}

fn sglang() -> Space {
    Space::Sglang { rank: 0, namespace: "kv".into() }
}

/// The commands the golden directory logs, with their times: every mutating variant.
fn script() -> Vec<(Millis, Command)> {
    let settings = Settings {
        reservation_ttl: 30_000,
        world_size: Some(2),
        read_lease: 4_000,
        quarantine: 20_000,
        eviction: Eviction::Lru,
        evict_high_permille: 950,
        evict_low_permille: 900,
    };
    let v = Space::Vllm;
    let text = key("layer-0/block 7");
    vec![
        (1_000, Command::Configure(settings)),
        (1_001, Command::Initialize { space: v.clone(), rank: 0, num_pages: 8 }),
        (1_002, Command::Allocate { space: v.clone(), rank: 0, keys: vec![hex(99)] }),
        (1_003, Command::Clear { space: v.clone() }),
        (1_010, Command::Initialize { space: v.clone(), rank: 0, num_pages: 16 }),
        (1_011, Command::Initialize { space: v.clone(), rank: 1, num_pages: 12 }),
        (1_012, Command::Initialize { space: v.clone(), rank: 1, num_pages: 16 }),
        (1_020, Command::Allocate { space: v.clone(), rank: 0, keys: vec![hex(1), hex(2), text.clone(), hex(3)] }),
        (1_021, Command::Allocate { space: v.clone(), rank: 1, keys: vec![hex(1), hex(2), text.clone(), hex(3)] }),
        (
            1_030,
            Command::Confirm {
                space: v.clone(),
                rank: 0,
                confirmations: vec![(hex(1), 0), (hex(2), 1), (text.clone(), 2)],
                releases: vec![3],
            },
        ),
        (
            1_031,
            Command::Confirm {
                space: v.clone(),
                rank: 1,
                confirmations: vec![(hex(1), 0), (hex(2), 1), (text.clone(), 2)],
                releases: vec![],
            },
        ),
        // The snapshot is here (seq 11); the rest is in the log after it.
        (2_000, Command::Locations { space: v.clone(), rank: 0, keys: vec![hex(1), text.clone(), hex(9)] }),
        (2_001, Command::Delete { space: v.clone(), keys: vec![hex(2)] }),
        (
            2_010,
            Command::ImportSglang {
                pools: vec![SglangPool {
                    rank: 0,
                    namespace: "kv".into(),
                    num_pages: 8,
                    free_pages: vec![7, 6, 5, 4],
                    keys: vec![(key("s-a"), 0), (hex(11), 1), (key("s-c"), 3)],
                }],
                replace: false,
            },
        ),
        (2_020, Command::Allocate { space: sglang(), rank: 0, keys: vec![key("s-d"), key("s-a")] }),
        (2_021, Command::Confirm { space: sglang(), rank: 0, confirmations: vec![(key("s-d"), 4)], releases: vec![] }),
        (2_030, Command::Reset { space: sglang() }),
        (
            2_040,
            Command::ImportSglang {
                pools: vec![SglangPool {
                    rank: 0,
                    namespace: "kv".into(),
                    num_pages: 4,
                    free_pages: vec![3, 2],
                    keys: vec![(key("s-e"), 0)],
                }],
                replace: true,
            },
        ),
        (2_050, Command::Allocate { space: v.clone(), rank: 0, keys: vec![hex(4), hex(5)] }),
        (2_051, Command::Allocate { space: v.clone(), rank: 1, keys: vec![hex(4)] }),
        (2_052, Command::Confirm { space: v.clone(), rank: 1, confirmations: vec![(hex(4), 4)], releases: vec![] }),
        (2_060, Command::LeaseAll),
        (2_070, Command::Initialize { space: v.clone(), rank: 1, num_pages: 16 }),
        (2_080, Command::Configure(Settings { read_lease: 0, ..settings })),
    ]
}

/// Writes the golden directory with today's writer: the engine applies each command (each
/// must succeed: only accepted commands are logged), the log records it.
fn write_dir(dir: &Path) {
    durable::open_dir(dir).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut engine = NativeEngine::new(SEED, Settings::default());
    let script = script();
    let mut log = Log::start(dir, FsyncMode::Always, 0).unwrap();
    for (i, (now, cmd)) in script.iter().enumerate() {
        assert!(cmd.is_mutating());
        engine.apply(*now, cmd).unwrap_or_else(|e| panic!("command {i} {cmd:?}: {e:?}"));
        let seq = log.append(*now, cmd);
        rt.block_on(log.wait(seq, Instant::now() + Duration::from_secs(5))).unwrap();
        if i + 1 == SNAPSHOT_AT {
            log.close();
            durable::write_snapshot(dir, seq, &engine.snapshot().unwrap()).unwrap();
            log = Log::start(dir, FsyncMode::Always, seq).unwrap();
        }
    }
    log.close();
}

/// The state an engine holds, as JSON: figures, SGLang pools, every key of the script, and the
/// replies of probes that show what the figures do not (free-list order, pending deadlines).
fn state(engine: &mut dyn Engine) -> String {
    let last = script().last().unwrap().0;
    let mut run = |now: Millis, cmd: Command| -> serde_json::Value {
        match engine.apply(now, &cmd) {
            Ok(reply) => serde_json::to_value(reply).unwrap(),
            Err(e) => serde_json::json!({ "error": format!("{e:?}") }),
        }
    };
    let mut out = serde_json::Map::new();
    let t = last + 1;
    out.insert("stats".into(), run(t, Command::Stats));
    out.insert("sglang_pools".into(), run(t, Command::ExportSglang));
    let vllm_keys = [hex(1), hex(2), hex(3), hex(4), hex(5), hex(99), key("layer-0/block 7")];
    let keys: Vec<_> =
        vllm_keys.iter().map(|k| run(t, Command::Inspect { space: Space::Vllm, key: k.clone() })).collect();
    out.insert("vllm_keys".into(), keys.into());
    let sg_keys = [key("s-a"), hex(11), key("s-c"), key("s-d"), key("s-e")];
    let keys: Vec<_> = sg_keys.iter().map(|k| run(t, Command::Inspect { space: sglang(), key: k.clone() })).collect();
    out.insert("sglang_keys".into(), keys.into());
    let fresh: Vec<Key> = (100..106).map(hex).collect();
    let probes = [
        ("allocate_rank_0", Command::Allocate { space: Space::Vllm, rank: 0, keys: fresh.clone() }),
        ("allocate_rank_1", Command::Allocate { space: Space::Vllm, rank: 1, keys: fresh.clone() }),
        ("locations_rank_0", Command::Locations { space: Space::Vllm, rank: 0, keys: vllm_keys.to_vec() }),
        ("allocate_sglang", Command::Allocate { space: sglang(), rank: 0, keys: vec![key("s-f"), key("s-e")] }),
    ];
    for (name, cmd) in probes {
        out.insert(name.into(), run(t + 1, cmd));
    }
    // Past every reservation, quarantine and lease: what the deadlines in the state did.
    out.insert("stats_later".into(), run(last + 100_000, Command::Stats));
    serde_json::to_string_pretty(&serde_json::Value::Object(out)).unwrap() + "\n"
}

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvpages-format-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every file of `dir` (not its directories) with its bytes, sorted by name.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_file())
        .map(|e| (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap()))
        .collect();
    out.sort();
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for (name, bytes) in files(from) {
        std::fs::write(to.join(name), bytes).unwrap();
    }
}

/// Opens and recovers `dir` as `kvpages serve` does, into an engine of `kind`.
fn recover(dir: &Path, kind: EngineKind) -> Box<dyn Engine> {
    durable::open_dir(dir).unwrap();
    let rec = durable::recover(dir).unwrap();
    assert_eq!(rec.dropped_tail, None);
    assert_eq!(rec.snapshot.as_ref().map(|s| s.0), Some(SNAPSHOT_AT as u64));
    assert_eq!(rec.records.len(), script().len() - SNAPSHOT_AT);
    assert_eq!(rec.last_seq(), script().len() as u64);
    let config = ServeConfig { engine: kind, ..ServeConfig::default() };
    let mut replayed = 0;
    let engine = kvpages_host::app::replay(&config, &rec, 1, &mut |n| replayed = n).unwrap();
    assert_eq!(replayed, rec.records.len() as u64);
    engine
}

/// The golden directory's file names (every format's so far).
const NAMES: [&str; 4] =
    ["FORMAT", "snapshot-00000000000000000011.bin", "wal-00000000000000000001.log", "wal-00000000000000000012.log"];

fn names(files: &[(String, Vec<u8>)]) -> Vec<&str> {
    files.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn the_current_golden_directory_recovers_to_exactly_its_state() {
    let current = format!("format-{}", durable::FORMAT_VERSION);
    let want = std::fs::read_to_string(golden().join(format!("{current}.expected.json"))).unwrap();
    let before = files(&golden().join(&current));
    assert_eq!(names(&before), NAMES);
    for kind in [EngineKind::Native, EngineKind::Wasm] {
        let dir = tmp(&format!("golden-{kind}"));
        copy_dir(&golden().join(&current), &dir);
        let mut engine = recover(&dir, kind);
        assert_eq!(state(&mut *engine), want, "{kind} engine");
        // Opening and recovering changed no file of it.
        assert_eq!(files(&dir), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn the_format_1_golden_directory_is_upgraded_and_recovers_to_exactly_its_state() {
    let want = std::fs::read_to_string(golden().join("format-1.expected.json")).unwrap();
    let before = files(&golden().join("format-1"));
    assert_eq!(names(&before), NAMES);
    let current = files(&golden().join(format!("format-{}", durable::FORMAT_VERSION)));
    for kind in [EngineKind::Native, EngineKind::Wasm] {
        let dir = tmp(&format!("golden-1-{kind}"));
        copy_dir(&golden().join("format-1"), &dir);
        let mut engine = recover(&dir, kind);
        assert_eq!(state(&mut *engine), want, "{kind} engine");
        // The upgraded directory is byte for byte what today's writer writes (its snapshot
        // rewritten in the core's current snapshot format, the log copied), and format 1's
        // files are kept as they were in `format-1/`.
        assert_eq!(files(&dir), current);
        assert_eq!(files(&dir.join("format-1")), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn todays_writer_writes_the_current_format_byte_for_byte() {
    // If this fails, what kvpages writes changed: bump `durable::FORMAT_VERSION`, add an upgrade
    // step from the current format and a golden directory of the new one; keep the old ones.
    let dir = tmp("writer");
    write_dir(&dir);
    let golden = files(&golden().join(format!("format-{}", durable::FORMAT_VERSION)));
    let written = files(&dir);
    for ((gn, gb), (wn, wb)) in golden.iter().zip(&written) {
        assert_eq!(gn, wn);
        assert!(
            gb == wb,
            "{gn}: today's writer writes other bytes than the golden ({} vs {} bytes)",
            wb.len(),
            gb.len()
        );
    }
    assert_eq!(golden.len(), written.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_golden_directory_from_the_future_or_with_a_garbage_format_is_refused() {
    for (text, want) in [
        ("kvpages-data 3\n", "has format version 3, written by a newer kvpages; this kvpages reads version 2"),
        ("kvpages-data two\n", "its FORMAT file reads \"kvpages-data two\\n\", not \"kvpages-data N\""),
        ("\u{0}\u{0}\u{0}", "not \"kvpages-data N\": it is not a kvpages data directory, or a damaged one"),
    ] {
        let dir = tmp("refused");
        copy_dir(&golden().join("format-1"), &dir);
        std::fs::write(dir.join("FORMAT"), text).unwrap();
        let before = files(&dir);
        let err = durable::open_dir(&dir).unwrap_err();
        assert!(err.contains(want), "{text:?}: {err}");
        assert_eq!(files(&dir), before, "a refused directory is left as it was");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
#[ignore = "writes a golden directory; run by hand with KVPAGES_WRITE_GOLDEN=DIR"]
fn write_golden() {
    let out = PathBuf::from(std::env::var("KVPAGES_WRITE_GOLDEN").expect("KVPAGES_WRITE_GOLDEN=DIR"));
    let dir = out.join(format!("format-{}", durable::FORMAT_VERSION));
    assert!(!dir.exists(), "{} exists: a golden directory is never rewritten", dir.display());
    write_dir(&dir);
    let mut engine = recover(&dir, EngineKind::Native);
    let expected = out.join(format!("format-{}.expected.json", durable::FORMAT_VERSION));
    std::fs::write(expected, state(&mut *engine)).unwrap();
}

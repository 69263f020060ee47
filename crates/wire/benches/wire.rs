//! Criterion benchmarks of the HTTP API as data (`kvpages_wire`): decoding the bodies the
//! vLLM connector sends, and a whole request (decode, apply, encode) without the transport.
//!
//! `decode/fast` bodies are what the clients send; the `decode/full` bodies are the same with one
//! unknown member added, which the fast path leaves to the full decoder (serde with the strict
//! checks), so the two columns compare both decoders on the same keys in the same run.
//! `cargo bench -p kvpages-wire --bench wire -- --test` runs each once (CI).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpages_core::{Core, Settings};
use kvpages_wire::{self as wire, Parsed};

#[path = "../../core/benches/common/mod.rs"]
mod common;

use common::key_text as key;

fn quoted(keys: impl Iterator<Item = String>) -> String {
    keys.map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(",")
}

fn allocate_body(keys: std::ops::Range<u64>, extra: &str) -> String {
    let pairs: Vec<String> = keys.map(|i| format!("[\"{}\",\"\"]", key(i))).collect();
    format!("{{\"rank\":0,\"keys\":[{}]{extra}}}", pairs.join(","))
}

fn exists_body(keys: std::ops::Range<u64>, extra: &str) -> String {
    format!("{{\"keys\":[{}]{extra}}}", quoted(keys.map(key)))
}

fn confirm_body(pairs: &[(String, i64)], extra: &str) -> String {
    let pairs: Vec<String> = pairs.iter().map(|(k, p)| format!("[\"{k}\",{p}]")).collect();
    format!("{{\"rank\":0,\"confirmations\":[{}],\"pages_to_release\":[]{extra}}}", pairs.join(","))
}

/// `n` confirmations: key `i` on page `i`.
fn pages(n: usize) -> Vec<(String, i64)> {
    (0..n as u64).map(|i| (key(i), i as i64)).collect()
}

/// The `[key, page]` pairs of a batch_allocate reply.
fn pairs_of(reply: &[u8]) -> Vec<(String, i64)> {
    let v: serde_json::Value = serde_json::from_slice(reply).expect("JSON");
    v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| (r[0].as_str().expect("key").to_owned(), r[1].as_i64().expect("page")))
        .collect()
}

fn parsed(path: &str, body: &[u8]) -> wire::Pending {
    match wire::parse("POST", path, body) {
        Parsed::Apply(p) => p,
        _ => panic!("{path} {}", String::from_utf8_lossy(body)),
    }
}

/// A body of n keys, with `extra` before its closing brace.
type BodyOf = fn(usize, &str) -> String;

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    let cases: [(&str, usize, BodyOf); 6] = [
        ("/keys/batch_exists", 32, |n, x| exists_body(0..n as u64, x)),
        ("/keys/batch_exists", 1250, |n, x| exists_body(0..n as u64, x)),
        ("/keys/batch_allocate", 32, |n, x| allocate_body(0..n as u64, x)),
        ("/keys/batch_allocate", 128, |n, x| allocate_body(0..n as u64, x)),
        ("/keys/confirm_write", 32, |n, x| confirm_body(&pages(n), x)),
        ("/keys/confirm_write", 128, |n, x| confirm_body(&pages(n), x)),
    ];
    for (path, n, body) in cases {
        g.throughput(Throughput::Elements(n as u64));
        let name = format!("{}-{n}", path.trim_start_matches("/keys/"));
        for (decoder, extra) in [("fast", ""), ("full", ",\"x\":0")] {
            let b = body(n, extra);
            g.bench_with_input(BenchmarkId::new(decoder, &name), b.as_bytes(), |bench, b| {
                bench.iter(|| black_box(parsed(path, b)))
            });
        }
    }
    g.finish();
}

/// One request at a time on a core whose rank has 10^6 pages and 16,384 stored keys: parse,
/// apply, encode the answer (what a route does besides the transport and the engine lock).
fn request(c: &mut Criterion) {
    let mut g = c.benchmark_group("request");
    let mut core = Core::new(7, Settings::default());
    let init = parsed("/rank/0/initialize", br#"{"num_pages":1000000}"#);
    let r = core.apply(0, init.command());
    assert_eq!(init.answer(r).status, 200);
    let mut next = 0u64;
    let mut now = 1u64;
    // Stores `n` fresh keys (allocate, then confirm); their `(key, page)` pairs.
    let mut store = |core: &mut Core, n: u64, now: u64| -> Vec<(String, i64)> {
        let p = parsed("/keys/batch_allocate", allocate_body(next..next + n, "").as_bytes());
        next += n;
        let r = core.apply(now, p.command());
        let pairs = pairs_of(&p.answer(r).body);
        let p = parsed("/keys/confirm_write", confirm_body(&pairs, "").as_bytes());
        let r = core.apply(now, p.command());
        assert_eq!(p.answer(r).status, 204);
        pairs
    };
    for _ in 0..128 {
        store(&mut core, 128, now);
        now += 1;
    }
    // The save/load cycle's first prompt: 16 stored blocks.
    let mut prev: Vec<String> = store(&mut core, 16, now).into_iter().map(|(k, _)| k).collect();
    // A save: allocate 32 fresh keys, confirm them, delete them (so the state stays the same).
    // Only the server's part is timed: writing the bodies and reading the allocate reply, as
    // the client does, happen outside.
    g.throughput(Throughput::Elements(32));
    g.bench_function("allocate-confirm-delete-32", |b| {
        b.iter_custom(|iters| {
            let mut spent = std::time::Duration::ZERO;
            for _ in 0..iters {
                now += 1;
                let body = allocate_body(next..next + 32, "");
                next += 32;
                let t = std::time::Instant::now();
                let p = parsed("/keys/batch_allocate", body.as_bytes());
                let r = core.apply(now, p.command());
                let answer = black_box(p.answer(r));
                spent += t.elapsed();
                let pairs = pairs_of(&answer.body);
                let confirm = confirm_body(&pairs, "");
                let delete = format!("{{\"keys\":[{}]}}", quoted(pairs.into_iter().map(|(k, _)| k)));
                let t = std::time::Instant::now();
                for (path, body) in [("/keys/confirm_write", confirm), ("/keys/delete", delete)] {
                    let p = parsed(path, body.as_bytes());
                    let r = core.apply(now, p.command());
                    black_box(p.answer(r));
                }
                spent += t.elapsed();
            }
            spent
        })
    });
    // The connector's save/load cycle (`kvpages bench --workload save-load-cycle`): exists of a
    // 32-block prompt whose first 16 blocks are stored, allocate + confirm of the 16 new ones,
    // locations of all 32. The 16 blocks stored one cycle earlier are deleted outside the
    // timing, so the state stays the same size.
    let mut older: Vec<String> = Vec::new();
    g.throughput(Throughput::Elements(4));
    g.bench_function("save-load-cycle", |b| {
        b.iter_custom(|iters| {
            let mut spent = std::time::Duration::ZERO;
            for _ in 0..iters {
                now += 1;
                let fresh: Vec<String> = (next..next + 16).map(key).collect();
                next += 16;
                let prompt = || quoted(prev.iter().chain(&fresh).cloned());
                let exists = format!("{{\"keys\":[{}]}}", prompt());
                let locations = format!("{{\"rank\":0,\"keys\":[{}]}}", prompt());
                let allocate = format!(
                    "{{\"rank\":0,\"keys\":[{}]}}",
                    fresh.iter().map(|k| format!("[\"{k}\",\"\"]")).collect::<Vec<_>>().join(",")
                );
                // One request: parse, apply, answer.
                let request = |core: &mut Core, path: &str, body: &str| {
                    let p = parsed(path, body.as_bytes());
                    let r = core.apply(now, p.command());
                    black_box(p.answer(r))
                };
                let t = std::time::Instant::now();
                let found = request(&mut core, "/keys/batch_exists", &exists);
                let allocated = request(&mut core, "/keys/batch_allocate", &allocate);
                spent += t.elapsed();
                let pairs = pairs_of(&allocated.body);
                let confirm = confirm_body(&pairs, "");
                let t = std::time::Instant::now();
                let confirmed = request(&mut core, "/keys/confirm_write", &confirm);
                let located = request(&mut core, "/keys/get_locations", &locations);
                spent += t.elapsed();
                // Untimed: the cycle did what it says (16 of 32 cached, 16 fresh pages, all 32 found).
                let hits = |body: &[u8], field: &str, hit: fn(&serde_json::Value) -> bool| {
                    let v: serde_json::Value = serde_json::from_slice(body).expect("JSON");
                    v[field].as_array().expect("list").iter().filter(|x| hit(x)).count()
                };
                assert_eq!(hits(&found.body, "exists", |x| x == true), 16);
                assert!(pairs.len() == 16 && pairs.iter().all(|&(_, page)| page >= 0));
                assert_eq!(confirmed.status, 204);
                assert_eq!(hits(&located.body, "locations", |x| x.is_i64()), 32);
                if !older.is_empty() {
                    let delete = format!("{{\"keys\":[{}]}}", quoted(older.drain(..)));
                    let p = parsed("/keys/delete", delete.as_bytes());
                    let r = core.apply(now, p.command());
                    assert_eq!(p.answer(r).status, 200);
                }
                older = std::mem::replace(&mut prev, fresh);
            }
            spent
        })
    });
    // A lookup of 1,250 keys, half of them stored.
    let keys = (0..1250u64).map(|i| if i % 2 == 0 { key(i * 7) } else { key((1 << 40) + i) });
    let body = format!("{{\"keys\":[{}]}}", quoted(keys));
    g.throughput(Throughput::Elements(1250));
    g.bench_function("exists-1250", |b| {
        b.iter(|| {
            let p = parsed("/keys/batch_exists", body.as_bytes());
            let r = core.apply(now, p.command());
            black_box(p.answer(r))
        })
    });
    g.finish();
}

criterion_group!(benches, decode, request);
criterion_main!(benches);

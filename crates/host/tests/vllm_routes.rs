//! vLLM's six routes and `/health` over real HTTP, on valid input: exact statuses, exact JSON
//! bytes, `Content-Type: application/json` on every JSON reply, and the peer's page numbers.
//! (Rules: `docs/protocol.md`, "vLLM's routes".)

mod common;

use std::time::{Duration, Instant};

use common::{Server, config};
use kvpages_core::Settings;

fn init_body(n: u32) -> String {
    format!(r#"{{"num_pages":{n}}}"#)
}

fn message(rank: u32, n: u32) -> String {
    format!(r#"{{"message":"Rank {rank} initialized with {n} pages"}}"#)
}

const SCHEDULER_MESSAGE: &str = r#"{"message":"Scheduler role does not require initialization"}"#;

#[test]
fn initialize_answers_the_peers_texts() {
    let s = Server::start_default();
    s.post("/rank/0/initialize", init_body(1024)).expect_json(200, &message(0, 1024));
    // role defaults to worker; an explicit worker is the same.
    s.post("/rank/1/initialize", r#"{"num_pages":1024,"role":"worker"}"#).expect_json(200, &message(1, 1024));
    // Leading zeros are plain decimal digits.
    s.post("/rank/007/initialize", init_body(3)).expect_json(200, &message(7, 3));
    assert_eq!(
        s.health_without_uptime(),
        r#"{"engine":"wasm","keys":0,"ranks":[{"committed":0,"free":1024,"num_pages":1024,"quarantined":0,"rank":0,"reserved":0},{"committed":0,"free":1024,"num_pages":1024,"quarantined":0,"rank":1,"reserved":0},{"committed":0,"free":3,"num_pages":3,"quarantined":0,"rank":7,"reserved":0}],"status":"serving","world_size":3}"#
    );
}

#[test]
fn a_scheduler_initialize_is_200_and_changes_nothing() {
    let s = Server::start_default();
    let before = s.health_without_uptime();
    // The real scheduler sends num_pages 0; the role is checked first.
    s.post("/rank/0/initialize", r#"{"num_pages":0,"role":"scheduler"}"#).expect_json(200, SCHEDULER_MESSAGE);
    s.post("/rank/0/initialize", r#"{"role":"scheduler"}"#).expect_json(200, SCHEDULER_MESSAGE);
    s.post("/rank/3/initialize", r#"{"role":"scheduler","num_pages":64}"#).expect_json(200, SCHEDULER_MESSAGE);
    assert_eq!(s.health_without_uptime(), before);
    // A worker rank initialized before stays as it was after a scheduler call on the same rank.
    s.init(0, 16);
    let before = s.fingerprint(&[0], &["a"]);
    s.post("/rank/0/initialize", r#"{"num_pages":0,"role":"scheduler"}"#).expect_json(200, SCHEDULER_MESSAGE);
    assert_eq!(s.fingerprint(&[0], &["a"]), before);
}

#[test]
fn one_rank_allocate_confirm_exists_locations() {
    let s = Server::start_default();
    s.post("/rank/0/initialize", r#"{"num_pages":1024}"#)
        .expect_json(200, r#"{"message":"Rank 0 initialized with 1024 pages"}"#);
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["k1",""],["k2",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["k1",0],["k2",1]]}"#);
    // Allocated, not confirmed: not there yet.
    s.post("/keys/batch_exists", r#"{"keys":["k1","k2"]}"#).expect_json(200, r#"{"exists":[false,false]}"#);
    s.post("/keys/get_locations", r#"{"rank":0,"keys":["k1","k2"]}"#).expect_json(200, r#"{"locations":[null,null]}"#);
    let r = s.post("/keys/confirm_write", r#"{"rank":0,"confirmations":[["k1",0]],"pages_to_release":[1]}"#);
    r.expect_no_content();
    assert_eq!(r.content_type, None, "a 204 has no Content-Type: {r:?}");
    s.post("/keys/batch_exists", r#"{"keys":["k1","k2"]}"#).expect_json(200, r#"{"exists":[true,false]}"#);
    s.post("/keys/get_locations", r#"{"rank":0,"keys":["k1","k2"]}"#).expect_json(200, r#"{"locations":[0,null]}"#);
    // The released page 1 went to the tail: the next fresh key gets 2.
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["k3",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["k3",2]]}"#);
    assert_eq!(
        s.health_without_uptime(),
        r#"{"engine":"wasm","keys":1,"ranks":[{"committed":1,"free":1022,"num_pages":1024,"quarantined":0,"rank":0,"reserved":1}],"status":"serving","world_size":1}"#
    );
    // `keys` counts every key the server holds a page for, reserved ones (k3) included.
}

#[test]
fn a_save_and_load_cycle_on_two_ranks() {
    let s = Server::start_default();
    // Start-up as vLLM does it: the scheduler, then every worker.
    s.post("/rank/0/initialize", r#"{"num_pages":0,"role":"scheduler"}"#).expect_json(200, SCHEDULER_MESSAGE);
    s.init(0, 1024);
    s.init(1, 1024);
    let keys =
        ["386b2d9cf5aa91ba3a4b42c35396c822", "9e107d9d372bb6826bd81d3542a419d6", "e4d909c290d0fb1ca068ffaddf22cbd0"];
    // Lookup: nothing yet.
    assert_eq!(s.exists(&keys), r#"{"exists":[false,false,false]}"#);
    // Save on each rank: allocate, write, confirm.
    for rank in 0..2 {
        let body = format!(r#"{{"rank":{rank},"keys":[["{}",""],["{}",""],["{}",""]]}}"#, keys[0], keys[1], keys[2]);
        s.post("/keys/batch_allocate", body).expect_json(
            200,
            &format!(r#"{{"rank":{rank},"results":[["{}",0],["{}",1],["{}",2]]}}"#, keys[0], keys[1], keys[2]),
        );
        if rank == 0 {
            // Rank 0 alone does not make a key complete in a 2-rank world.
            s.confirm_ok(0, &[(keys[0], 0), (keys[1], 1), (keys[2], 2)], &[]);
            assert_eq!(s.exists(&keys), r#"{"exists":[false,false,false]}"#);
            assert_eq!(s.locations(0, &keys), r#"{"locations":[null,null,null]}"#);
        }
    }
    // Rank 1's write of the last block failed: it confirms two and releases one.
    s.confirm_ok(1, &[(keys[0], 0), (keys[1], 1)], &[2]);
    assert_eq!(s.exists(&keys), r#"{"exists":[true,true,false]}"#);
    // Load on each rank.
    for rank in 0..2 {
        assert_eq!(s.locations(rank, &keys), r#"{"locations":[0,1,null]}"#);
    }
    // The next save of the same prompt: hits get their page, the missing block a fresh one.
    // Rank 1: pages 3,4,5 taken; 3,4 were for hits and go to the tail after the released 2.
    s.post(
        "/keys/batch_allocate",
        format!(r#"{{"rank":1,"keys":[["{}",""],["{}",""],["{}",""]]}}"#, keys[0], keys[1], keys[2]),
    )
    .expect_json(200, &format!(r#"{{"rank":1,"results":[["{}",0],["{}",1],["{}",5]]}}"#, keys[0], keys[1], keys[2]));
    s.confirm_ok(1, &[(keys[0], 0), (keys[1], 1), (keys[2], 5)], &[]);
    assert_eq!(s.exists(&keys), r#"{"exists":[true,true,true]}"#);
    assert_eq!(s.locations(0, &keys), r#"{"locations":[0,1,2]}"#);
    assert_eq!(s.locations(1, &keys), r#"{"locations":[0,1,5]}"#);
    assert_eq!(
        s.health_without_uptime(),
        r#"{"engine":"wasm","keys":3,"ranks":[{"committed":3,"free":1021,"num_pages":1024,"quarantined":0,"rank":0,"reserved":0},{"committed":3,"free":1021,"num_pages":1024,"quarantined":0,"rank":1,"reserved":0}],"status":"serving","world_size":2}"#
    );
}

#[test]
fn a_cache_hit_gets_its_page_back_and_the_page_taken_for_it_rotates_to_the_tail() {
    let s = Server::start_default();
    s.init(0, 8);
    assert_eq!(s.allocate(0, &["a"]), vec![("a".into(), 0)]);
    s.confirm_ok(0, &[("a", 0)], &[]);
    // Pages 1 and 2 are taken; 1 was for the hit `a` and goes back to the tail.
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["a",""],["b",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["a",0],["b",2]]}"#);
    // The connector confirms every pair it got, cache hits included: a no-op for `a`.
    s.confirm_ok(0, &[("a", 0), ("b", 2)], &[]);
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["c",""],["a",""],["d",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["c",3],["a",0],["d",5]]}"#);
    // Free list is now 6, 7, 1, 4.
    assert_eq!(
        s.allocate(0, &["e", "f", "g", "h"]),
        vec![("e".into(), 6), ("f".into(), 7), ("g".into(), 1), ("h".into(), 4)]
    );
    assert_eq!(s.locations(0, &["a", "b", "c"]), r#"{"locations":[0,2,null]}"#);
}

#[test]
fn an_exhausted_pool_answers_minus_one_and_takes_nothing() {
    let s = Server::start_default();
    s.init(0, 4);
    assert_eq!(s.allocate(0, &["a", "b", "c"]), vec![("a".into(), 0), ("b".into(), 1), ("c".into(), 2)]);
    s.confirm_ok(0, &[("a", 0), ("b", 1), ("c", 2)], &[]);
    let before = s.fingerprint(&[0], &["a", "b", "c", "d", "e"]);
    // Two keys, one free page: all-or-nothing, every miss is -1.
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["d",""],["e",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["d",-1],["e",-1]]}"#);
    assert_eq!(s.fingerprint(&[0], &["a", "b", "c", "d", "e"]), before);
    // A short pool still answers complete keys with their page, and takes nothing.
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["a",""],["x",""],["b",""],["y",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["a",0],["x",-1],["b",1],["y",-1]]}"#);
    assert_eq!(s.fingerprint(&[0], &["a", "b", "c", "d", "e"]), before);
    // A batch that fits still works: the last page.
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["d",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["d",3]]}"#);
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["e",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["e",-1]]}"#);
    // A released page comes back.
    s.confirm_ok(0, &[], &[3]);
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["e",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["e",3]]}"#);
}

#[test]
fn a_key_repeated_in_one_batch_counts_once() {
    let s = Server::start_default();
    s.init(0, 2);
    // [a, a, b] needs two pages, not three; one entry per distinct key, first position.
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[["a",""],["a",""],["b",""]]}"#)
        .expect_json(200, r#"{"rank":0,"results":[["a",0],["b",1]]}"#);
    s.post("/keys/confirm_write", r#"{"rank":0,"confirmations":[["a",0],["b",1]]}"#).expect_no_content();
    assert!(
        s.health_without_uptime()
            .contains(r#"{"committed":2,"free":0,"num_pages":2,"quarantined":0,"rank":0,"reserved":0}"#)
    );
    // Repeats in reads answer each position.
    s.post("/keys/batch_exists", r#"{"keys":["a","a","z","b"]}"#)
        .expect_json(200, r#"{"exists":[true,true,false,true]}"#);
    s.post("/keys/get_locations", r#"{"rank":0,"keys":["b","a","b"]}"#).expect_json(200, r#"{"locations":[1,0,1]}"#);
}

/// A server with ranks 0 and 1 of 8 pages, each holding `a` on page 0 and `b` on page 1.
fn two_ranks_holding_a_and_b() -> Server {
    let s = Server::start_default();
    s.init(0, 8);
    s.init(1, 8);
    for rank in 0..2 {
        s.allocate(rank, &["a", "b"]);
        s.confirm_ok(rank, &[("a", 0), ("b", 1)], &[]);
    }
    s
}

#[test]
fn initializing_again_with_the_same_size_changes_nothing() {
    let s = two_ranks_holding_a_and_b();
    s.allocate(0, &["pending"]);
    let before = s.fingerprint(&[0, 1], &["a", "b", "pending"]);
    s.post("/rank/0/initialize", init_body(8)).expect_json(200, &message(0, 8));
    s.post("/rank/1/initialize", r#"{"num_pages":8,"role":"worker"}"#).expect_json(200, &message(1, 8));
    assert_eq!(s.fingerprint(&[0, 1], &["a", "b", "pending"]), before);
    // The free list is untouched too: the next page on rank 0 is 3.
    assert_eq!(s.allocate(0, &["c"]), vec![("c".into(), 3)]);
}

#[test]
fn initializing_with_another_size_drops_the_keys_on_every_rank() {
    let s = two_ranks_holding_a_and_b();
    assert_eq!(s.exists(&["a", "b"]), r#"{"exists":[true,true]}"#);
    s.post("/rank/1/initialize", init_body(16)).expect_json(200, &message(1, 16));
    assert_eq!(s.exists(&["a", "b"]), r#"{"exists":[false,false]}"#);
    assert_eq!(s.locations(0, &["a", "b"]), r#"{"locations":[null,null]}"#);
    assert_eq!(s.locations(1, &["a", "b"]), r#"{"locations":[null,null]}"#);
    assert_eq!(
        s.health_without_uptime(),
        r#"{"engine":"wasm","keys":0,"ranks":[{"committed":0,"free":8,"num_pages":8,"quarantined":0,"rank":0,"reserved":0},{"committed":0,"free":16,"num_pages":16,"quarantined":0,"rank":1,"reserved":0}],"status":"serving","world_size":2}"#
    );
    // The re-created pool starts at page 0 again; rank 0's freed pages are handed out again.
    assert_eq!(s.allocate(1, &["c"]), vec![("c".into(), 0)]);
    assert_eq!(s.allocate(0, &["c", "d", "e", "f", "g", "h", "i", "j"]).len(), 8);
    // A smaller size makes old high pages out of range.
    s.post("/rank/1/initialize", init_body(2)).expect_json(200, &message(1, 2));
    s.confirm(1, &[], &[5]).expect_detail(
        400,
        "Invalid request format: need 'rank' and 'confirmations' (pages_to_release[0]: page 5 is out of range, rank 1 has 2 pages)",
    );
}

#[test]
fn a_world_size_refuses_ranks_outside_it_and_completeness_needs_all_of_it() {
    let s = Server::start(kvpages_host::config::ServeConfig {
        settings: Settings { world_size: Some(2), ..common::peer_settings() },
        ..config()
    });
    s.post("/rank/2/initialize", init_body(8))
        .expect_detail(409, "Rank 2 is outside the TP world of 2 ranks (--world-size)");
    s.post("/rank/4294967295/initialize", init_body(8))
        .expect_detail(409, "Rank 4294967295 is outside the TP world of 2 ranks (--world-size)");
    // The role is checked first: a scheduler on any rank is fine.
    s.post("/rank/9/initialize", r#"{"role":"scheduler","num_pages":0}"#).expect_json(200, SCHEDULER_MESSAGE);
    s.init(0, 8);
    let h = s.health_without_uptime();
    assert!(h.contains(r#""world_size":2"#), "{h}");
    // Only rank 0 is up, but the world is 2: a key confirmed on rank 0 is not complete.
    s.allocate(0, &["a"]);
    s.confirm_ok(0, &[("a", 0)], &[]);
    assert_eq!(s.exists(&["a"]), r#"{"exists":[false]}"#);
    s.init(1, 8);
    s.allocate(1, &["a"]);
    s.confirm_ok(1, &[("a", 0)], &[]);
    assert_eq!(s.exists(&["a"]), r#"{"exists":[true]}"#);
    // Still refused once the world is full; nothing changed.
    let before = s.fingerprint(&[0, 1], &["a"]);
    s.post("/rank/2/initialize", init_body(8))
        .expect_detail(409, "Rank 2 is outside the TP world of 2 ranks (--world-size)");
    assert_eq!(s.fingerprint(&[0, 1], &["a"]), before);
}

#[test]
fn health_has_its_shape() {
    let s = Server::start_default();
    let r = s.get("/health");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    let v = r.json();
    let obj = v.as_object().unwrap();
    let mut names: Vec<&str> = obj.keys().map(String::as_str).collect();
    names.sort();
    assert_eq!(names, ["engine", "keys", "ranks", "status", "uptime_seconds", "world_size"]);
    assert_eq!(v["status"], "serving");
    assert_eq!(v["engine"], "wasm");
    assert!(v["uptime_seconds"].as_f64().is_some_and(|u| u >= 0.0), "{v}");
    assert_eq!(v["world_size"], 0);
    assert_eq!(v["keys"], 0);
    assert_eq!(v["ranks"], serde_json::json!([]));
    // Compact JSON in the member order of the peer-facing docs.
    let text = r.text();
    assert!(text.starts_with(r#"{"status":"serving","engine":"wasm","uptime_seconds":"#), "{text}");
    assert!(text.ends_with(r#","world_size":0,"keys":0,"ranks":[]}"#), "{text}");
    assert!(!text.contains(' ') && !text.contains('\n'), "{text}");

    s.init(2, 10);
    s.allocate(2, &["a", "b", "c"]);
    s.confirm_ok(2, &[("a", 0)], &[2]);
    let v = s.get("/health").json();
    assert_eq!(
        v["ranks"],
        serde_json::json!([{"rank":2,"num_pages":10,"free":8,"reserved":1,"committed":1,"quarantined":0}])
    );
    // `keys` counts keys with a committed page: a (b is only reserved; c was released).
    assert_eq!((v["world_size"].as_u64(), v["keys"].as_u64()), (Some(1), Some(1)));
    // Uptime moves on.
    let u1 = s.get("/health").json()["uptime_seconds"].as_f64().unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let u2 = s.get("/health").json()["uptime_seconds"].as_f64().unwrap();
    assert!(u2 > u1, "{u1} {u2}");
    // HEAD is answered like GET, without a body.
    let r = s.request_with("HEAD", "/health", &[], b"");
    assert_eq!(r.status, 200);
}

#[test]
fn unknown_routes_are_404_with_a_json_detail() {
    let s = Server::start_default();
    for (method, path) in [
        ("POST", "/"),
        ("GET", "/"),
        ("POST", "/keys/batch_delete"),
        ("POST", "/keys/batch_allocate/"),
        ("POST", "/rank/0/initialize/"),
        ("POST", "/rank/0"),
        ("POST", "/Keys/batch_exists"),
        ("GET", "/healthz"),
        ("DELETE", "/keys"),
    ] {
        s.request(method, path, b"{}").expect_detail(404, &format!("Not Found (no route {method} {path})"));
    }
}

#[test]
fn wrong_methods_are_405_with_a_json_detail_and_allow() {
    let s = Server::start_default();
    let posts = [
        "/rank/0/initialize",
        "/keys/batch_allocate",
        "/keys/confirm_write",
        "/keys/batch_exists",
        "/keys/get_locations",
        "/clear",
    ];
    for path in posts {
        for method in ["GET", "PUT", "DELETE", "PATCH"] {
            let r = s.request(method, path, b"");
            r.expect_detail(405, &format!("Method Not Allowed ({path} accepts POST, not {method})"));
            assert_eq!(r.header("allow"), Some("POST"), "{method} {path}");
        }
    }
    for method in ["POST", "PUT", "DELETE"] {
        let r = s.request(method, "/health", b"{}");
        r.expect_detail(405, &format!("Method Not Allowed (/health accepts GET, not {method})"));
        assert_eq!(r.header("allow"), Some("GET"));
    }
}

#[test]
fn an_uninitialized_rank_is_404_on_every_route_that_names_one() {
    let s = Server::start_default();
    let cases = [
        ("/keys/batch_allocate", r#"{"rank":5,"keys":[["a",""]]}"#),
        ("/keys/batch_allocate", r#"{"rank":5,"keys":[]}"#),
        ("/keys/get_locations", r#"{"rank":5,"keys":["a"]}"#),
        ("/keys/get_locations", r#"{"rank":5}"#),
        ("/keys/confirm_write", r#"{"rank":5,"confirmations":[["a",0]],"pages_to_release":[]}"#),
        ("/keys/confirm_write", r#"{"rank":5,"confirmations":[],"pages_to_release":[1]}"#),
        ("/keys/confirm_write", r#"{"rank":5}"#),
    ];
    for (path, body) in cases {
        s.post(path, body).expect_detail(404, "Rank 5 not initialized");
    }
    // Also once other ranks exist.
    s.init(0, 4);
    let before = s.fingerprint(&[0], &["a"]);
    for (path, body) in cases {
        s.post(path, body).expect_detail(404, "Rank 5 not initialized");
    }
    assert_eq!(s.fingerprint(&[0], &["a"]), before);
    // batch_exists names no rank: it answers false.
    s.post("/keys/batch_exists", r#"{"keys":["a"]}"#).expect_json(200, r#"{"exists":[false]}"#);
}

#[test]
fn clear_drops_every_rank_and_key() {
    let s = Server::start_default();
    // On an empty server too.
    s.post("/clear", "").expect_no_content();
    s.init(0, 4);
    s.init(1, 4);
    for rank in 0..2 {
        s.allocate(rank, &["a"]);
        s.confirm_ok(rank, &[("a", 0)], &[]);
    }
    assert_eq!(s.exists(&["a"]), r#"{"exists":[true]}"#);
    // The body is ignored, whatever it is.
    let r = s.post("/clear", b"\xff not json at all");
    r.expect_no_content();
    assert_eq!(r.content_type, None);
    assert_eq!(s.health_without_uptime(), r#"{"engine":"wasm","keys":0,"ranks":[],"status":"serving","world_size":0}"#);
    assert_eq!(s.exists(&["a"]), r#"{"exists":[false]}"#);
    s.post("/keys/get_locations", r#"{"rank":0,"keys":["a"]}"#).expect_detail(404, "Rank 0 not initialized");
    s.post("/keys/batch_allocate", r#"{"rank":1,"keys":[["a",""]]}"#).expect_detail(404, "Rank 1 not initialized");
    // Workers can start again from page 0.
    s.init(0, 4);
    assert_eq!(s.allocate(0, &["b"]), vec![("b".into(), 0)]);
}

#[test]
fn empty_and_missing_batches_are_valid() {
    let s = Server::start_default();
    s.post("/keys/batch_exists", r#"{"keys":[]}"#).expect_json(200, r#"{"exists":[]}"#);
    s.post("/keys/batch_exists", "{}").expect_json(200, r#"{"exists":[]}"#);
    s.init(0, 4);
    let before = s.fingerprint(&[0], &["a"]);
    s.post("/keys/batch_allocate", r#"{"rank":0,"keys":[]}"#).expect_json(200, r#"{"rank":0,"results":[]}"#);
    s.post("/keys/batch_allocate", r#"{"rank":0}"#).expect_json(200, r#"{"rank":0,"results":[]}"#);
    s.post("/keys/get_locations", r#"{"rank":0,"keys":[]}"#).expect_json(200, r#"{"locations":[]}"#);
    s.post("/keys/get_locations", r#"{"rank":0}"#).expect_json(200, r#"{"locations":[]}"#);
    s.post("/keys/confirm_write", r#"{"rank":0,"confirmations":[],"pages_to_release":[]}"#).expect_no_content();
    s.post("/keys/confirm_write", r#"{"rank":0}"#).expect_no_content();
    assert_eq!(s.fingerprint(&[0], &["a"]), before);
}

#[test]
fn keys_are_stored_and_echoed_exactly_as_sent() {
    let s = Server::start_default();
    s.init(0, 8);
    let lower = "386b2d9cf5aa91ba3a4b42c35396c822";
    let upper = "386B2D9CF5AA91BA3A4B42C35396C822";
    let long = "k".repeat(1024);
    let body = serde_json::json!({"rank": 0, "keys": [[lower, ""], [upper, ""], ["ключ ✓", "prefix"], [long, "p".repeat(1024)], ["a\"b\\c", ""]]})
        .to_string();
    let want =
        serde_json::json!({"rank": 0, "results": [[lower, 0], [upper, 1], ["ключ ✓", 2], [long, 3], ["a\"b\\c", 4]]})
            .to_string();
    s.post("/keys/batch_allocate", body).expect_json(200, &want);
    s.confirm_ok(0, &[(lower, 0), (upper, 1), ("ключ ✓", 2), (&long, 3), ("a\"b\\c", 4)], &[]);
    assert_eq!(
        s.exists(&[lower, upper, "ключ ✓", &long, "a\"b\\c", "A\"b\\c"]),
        r#"{"exists":[true,true,true,true,true,false]}"#
    );
    assert_eq!(s.locations(0, &[upper, lower, "ключ ✓"]), r#"{"locations":[1,0,2]}"#);
    // Escaped member names and values are the same text as unescaped ones.
    s.post("/keys/get_locations", r#"{"r\u0061nk":0,"keys":["\u043a\u043b\u044e\u0447 \u2713"]}"#)
        .expect_json(200, r#"{"locations":[2]}"#);
}

#[test]
fn the_write_failure_path_releases_and_a_committed_page_is_never_freed() {
    let s = Server::start_default();
    s.init(0, 4);
    assert_eq!(s.allocate(0, &["a", "b"]), vec![("a".into(), 0), ("b".into(), 1)]);
    s.confirm_ok(0, &[("a", 0), ("b", 1)], &[]);
    // Next save: a is a hit (page 0), c is fresh (page 3; 2 went to the tail). The write fails
    // and the connector releases every page it got, the hit's included.
    assert_eq!(s.allocate(0, &["a", "c"]), vec![("a".into(), 0), ("c".into(), 3)]);
    s.post("/keys/confirm_write", r#"{"rank":0,"confirmations":[],"pages_to_release":[0,3]}"#).expect_no_content();
    // Page 0 still belongs to a; 3 is free again. Releasing a free page again is ignored.
    assert_eq!(s.locations(0, &["a", "b", "c"]), r#"{"locations":[0,1,null]}"#);
    s.post("/keys/confirm_write", r#"{"rank":0,"pages_to_release":[3,3,1]}"#).expect_no_content();
    assert_eq!(s.locations(0, &["a", "b"]), r#"{"locations":[0,1]}"#);
    assert!(
        s.health_without_uptime()
            .contains(r#"{"committed":2,"free":2,"num_pages":4,"quarantined":0,"rank":0,"reserved":0}"#)
    );
    // Only the two free pages are handed out, never a committed one.
    assert_eq!(s.allocate(0, &["d", "e"]), vec![("d".into(), 2), ("e".into(), 3)]);
    assert_eq!(s.allocate(0, &["f"]), vec![("f".into(), -1)]);
}

#[test]
fn refused_confirmations_are_refused_one_by_one_and_all_refused_is_409() {
    let s = Server::start_default();
    s.init(0, 8);
    assert_eq!(s.allocate(0, &["a", "b"]), vec![("a".into(), 0), ("b".into(), 1)]);
    // One good pair, one page never allocated (5), one reserved for another key: 204, a applies.
    s.confirm_ok(0, &[("a", 0), ("x", 5), ("y", 1)], &[]);
    assert_eq!(s.locations(0, &["a", "b", "x", "y"]), r#"{"locations":[0,null,null,null]}"#);
    // All refused: 409 with each pair, and nothing applied (the release of b's page neither).
    let before = s.fingerprint(&[0], &["a", "b", "x"]);
    s.confirm(0, &[("x", 5), ("b", 0)], &[1]).expect_detail(
        409,
        r#"No confirmation matched a reservation; nothing was applied (confirmations[0] ["x", 5]: page is not reserved (never allocated, released, or expired); confirmations[1] ["b", 0]: page holds another key)"#,
    );
    assert_eq!(s.fingerprint(&[0], &["a", "b", "x"]), before);
    s.confirm(0, &[("z", 1)], &[]).expect_detail(
        409,
        r#"No confirmation matched a reservation; nothing was applied (confirmations[0] ["z", 1]: page is reserved for another key)"#,
    );
    // b's reservation survived all that.
    s.confirm_ok(0, &[("b", 1)], &[]);
    assert_eq!(s.locations(0, &["a", "b"]), r#"{"locations":[0,1]}"#);
    // Confirming a page already committed to the same key is a no-op.
    let before = s.fingerprint(&[0], &["a", "b"]);
    s.confirm_ok(0, &[("b", 1)], &[]);
    assert_eq!(s.fingerprint(&[0], &["a", "b"]), before);
}

#[test]
fn of_two_writers_of_one_new_key_the_first_confirm_wins() {
    let s = Server::start_default();
    s.init(0, 4);
    assert_eq!(s.allocate(0, &["k"]), vec![("k".into(), 0)]);
    assert_eq!(s.allocate(0, &["k"]), vec![("k".into(), 1)]);
    s.confirm_ok(0, &[("k", 1)], &[]);
    // The second writer's page is freed and its confirm answered 204.
    s.confirm_ok(0, &[("k", 0)], &[]);
    assert_eq!(s.locations(0, &["k"]), r#"{"locations":[1]}"#);
    assert!(
        s.health_without_uptime()
            .contains(r#"{"committed":1,"free":3,"num_pages":4,"quarantined":0,"rank":0,"reserved":0}"#)
    );
}

#[test]
fn an_expired_reservation_is_refused() {
    let s = Server::start(kvpages_host::config::ServeConfig {
        settings: Settings { reservation_ttl: 100, ..common::peer_settings() },
        ..config()
    });
    s.init(0, 2);
    assert_eq!(s.allocate(0, &["a", "b"]), vec![("a".into(), 0), ("b".into(), 1)]);
    s.confirm_ok(0, &[("a", 0)], &[]);
    std::thread::sleep(Duration::from_millis(250));
    s.confirm(0, &[("b", 1)], &[]).expect_detail(
        409,
        r#"No confirmation matched a reservation; nothing was applied (confirmations[0] ["b", 1]: page is not reserved (never allocated, released, or expired))"#,
    );
    // Page 1 is free again: the pool does not leak.
    assert_eq!(s.allocate(0, &["c"]), vec![("c".into(), 1)]);
    assert_eq!(s.locations(0, &["a", "b"]), r#"{"locations":[0,null]}"#);
}

#[test]
fn bodies_are_json_whatever_the_content_type_and_unknown_members_are_ignored() {
    let s = Server::start_default();
    s.request_with("POST", "/rank/0/initialize", &[], br#"{"num_pages":4}"#).expect_json(200, &message(0, 4));
    s.request_with(
        "POST",
        "/keys/batch_allocate",
        &[("Content-Type", "text/plain")],
        br#"{"rank":0,"keys":[["a",""]]}"#,
    )
    .expect_json(200, r#"{"rank":0,"results":[["a",0]]}"#);
    s.request_with(
        "POST",
        "/keys/confirm_write",
        &[("Content-Type", "application/x-www-form-urlencoded")],
        b" \r\n\t{\"rank\":0,\"confirmations\":[[\"a\",0]],\"extra\":{\"nested\":[1,2.5,null,true,\"x\"]}}\n\n",
    )
    .expect_no_content();
    s.post("/keys/batch_exists", "{\"keys\":[\"a\"],\"trace_id\":\"abc\"}\n").expect_json(200, r#"{"exists":[true]}"#);
    s.post("/keys/get_locations", r#"{"keys":["a"],"rank":0,"rank_hint":-1.5}"#)
        .expect_json(200, r#"{"locations":[0]}"#);
    s.post("/rank/0/initialize", r#"{"num_pages":4,"file_size":1073741824,"role":"worker"}"#)
        .expect_json(200, &message(0, 4));
    // A chunked body is fine too.
    s.chunked("POST", "/keys/batch_exists", &[b"{\"ke".to_vec(), b"ys\":[\"a\",".to_vec(), b"\"b\"]}".to_vec()])
        .expect_json(200, r#"{"exists":[true,false]}"#);
}

#[test]
fn a_real_size_lookup_and_save_fit() {
    let s = Server::start_default();
    s.init(0, 100_000);
    s.init(1, 100_000);
    // A 20K-token prompt at block size 16: about 1,250 keys in one lookup.
    let keys: Vec<String> = (0..1250u32).map(|i| format!("{:032x}", u128::from(i) * 0x9e37_79b9_7f4a_7c15)).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let body = serde_json::json!({ "keys": refs }).to_string();
    assert!(body.len() > 40_000);
    let r = s.post("/keys/batch_exists", &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["exists"].as_array().unwrap().len(), 1250);
    // Saves go by 128 keys.
    for rank in 0..2 {
        for chunk in refs[..256].chunks(128) {
            let got = s.allocate(rank, chunk);
            assert!(got.iter().all(|(_, p)| *p >= 0));
            let conf: Vec<(&str, u32)> = got.iter().map(|(k, p)| (k.as_str(), *p as u32)).collect();
            s.confirm_ok(rank, &conf, &[]);
        }
    }
    let v = s.post("/keys/batch_exists", &body).json();
    let exists = v["exists"].as_array().unwrap();
    assert_eq!(exists.iter().take_while(|e| **e == true).count(), 256);
    assert!(exists[256..].iter().all(|e| *e == false));
    let v = s.post("/keys/get_locations", serde_json::json!({"rank": 1, "keys": &refs[..256]}).to_string()).json();
    let locs: Vec<u64> = v["locations"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap()).collect();
    assert_eq!(locs, (0..256).collect::<Vec<u64>>());
}

#[test]
fn a_pool_of_u32_max_pages_is_created_at_once() {
    let s = Server::start_default();
    let t = Instant::now();
    s.init(0, u32::MAX);
    assert_eq!(s.allocate(0, &["a", "b"]), vec![("a".into(), 0), ("b".into(), 1)]);
    s.confirm_ok(0, &[("a", 0)], &[1]);
    s.confirm(0, &[], &[u32::MAX - 1]).expect_no_content();
    assert!(t.elapsed() < Duration::from_secs(2), "a huge pool took {:?}", t.elapsed());
    assert!(
        s.health_without_uptime().contains(
            r#"{"committed":1,"free":4294967294,"num_pages":4294967295,"quarantined":0,"rank":0,"reserved":0}"#
        )
    );
}

#[test]
fn an_incomplete_key_is_no_cache_hit() {
    let s = Server::start_default();
    s.init(0, 8);
    s.init(1, 8);
    s.allocate(0, &["a"]);
    s.confirm_ok(0, &[("a", 0)], &[]);
    // Incomplete (rank 1 has not stored it): rank 0 gets a fresh page for it.
    assert_eq!(s.allocate(0, &["a"]), vec![("a".into(), 1)]);
    assert_eq!(s.locations(0, &["a"]), r#"{"locations":[null]}"#);
}

#[test]
fn concurrent_clients_get_distinct_pages() {
    let s = Server::start_default();
    s.init(0, 1000);
    let pages = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for t in 0..8 {
            let s = &s;
            let pages = &pages;
            scope.spawn(move || {
                for i in 0..10 {
                    let keys: Vec<String> = (0..5).map(|j| format!("t{t}-{i}-{j}")).collect();
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let got = s.allocate(0, &refs);
                    pages.lock().unwrap().extend(got.into_iter().map(|(_, p)| p));
                }
            });
        }
    });
    let mut pages = pages.into_inner().unwrap();
    pages.sort();
    assert_eq!(pages, (0..400).collect::<Vec<i64>>());
}

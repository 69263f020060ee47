//! kvpages' own routes and the cache rules over HTTP: `/keys/delete`, `/stats`,
//! `/admin/keys/{key}`, LRU eviction with the default settings, body time bounds.

mod common;

use std::time::{Duration, Instant};

use common::{Server, config};
use kvpages_host::config::ServeConfig;

fn default_server() -> Server {
    // The shipped defaults: LRU eviction, 5 s read leases, quarantine = TTL.
    Server::start(ServeConfig::default())
}

fn save(s: &Server, rank: u32, keys: &[&str]) -> Vec<i64> {
    let got = s.allocate(rank, keys);
    let pairs: Vec<(&str, u32)> =
        got.iter().map(|(k, p)| (keys.iter().find(|x| **x == k).copied().unwrap(), *p as u32)).collect();
    s.confirm_ok(rank, &pairs, &[]);
    got.into_iter().map(|(_, p)| p).collect()
}

#[test]
fn delete_frees_the_pages_on_every_rank_and_counts_what_it_deleted() {
    let s = Server::start(config());
    s.init(0, 4);
    s.init(1, 4);
    assert_eq!(save(&s, 0, &["a", "b"]), vec![0, 1]);
    assert_eq!(save(&s, 1, &["a", "b"]), vec![0, 1]);
    s.post("/keys/delete", r#"{"keys":["a","zz","a"]}"#).expect_json(200, r#"{"deleted":1}"#);
    assert_eq!(s.exists(&["a", "b"]), r#"{"exists":[false,true]}"#);
    s.post("/keys/delete", r#"{"keys":[]}"#).expect_json(200, r#"{"deleted":0}"#);
    // a's pages came back to the tail of both free lists (no reader held a lease).
    assert_eq!(s.allocate(0, &["c", "d", "e"]), vec![("c".into(), 2), ("d".into(), 3), ("e".into(), 0)]);
    assert_eq!(s.allocate(1, &["c"]), vec![("c".into(), 2)]);
    s.post("/keys/delete", r#"{"keys":"a"}"#)
        .expect_detail(400, "Invalid delete request: need 'keys' (keys: invalid type: string \"a\", expected a list)");
    s.request("GET", "/keys/delete", b"").expect_detail(405, "Method Not Allowed (/keys/delete accepts POST, not GET)");
}

#[test]
fn a_deleted_key_that_a_reader_holds_is_quarantined_until_the_lease_ends() {
    let mut cfg = config();
    cfg.settings.read_lease = 300;
    let s = Server::start(cfg);
    s.init(0, 2);
    assert_eq!(save(&s, 0, &["a"]), vec![0]);
    assert_eq!(s.locations(0, &["a"]), r#"{"locations":[0]}"#);
    s.post("/keys/delete", r#"{"keys":["a"]}"#).expect_json(200, r#"{"deleted":1}"#);
    let v = s.get("/stats").json();
    assert_eq!(v["spaces"][0]["ranks"][0]["quarantined"], 1, "{v}");
    // Page 0 is still being read: a new writer gets page 1, and nothing else is free.
    assert_eq!(s.allocate(0, &["b", "c"]), vec![("b".into(), -1), ("c".into(), -1)]);
    assert_eq!(s.allocate(0, &["b"]), vec![("b".into(), 1)]);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(s.allocate(0, &["c"]), vec![("c".into(), 0)]);
}

#[test]
fn the_default_settings_evict_the_least_recently_used_key() {
    let s = default_server();
    s.init(0, 10);
    // 10 pages, high and low watermarks at 9: the pool keeps one page of headroom.
    let keys: Vec<String> = (0..9).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    for k in &refs {
        save(&s, 0, &[k]);
    }
    // k0 is the oldest, but a lookup makes it the most recently used (and leases it).
    assert_eq!(s.locations(0, &["k0"]), r#"{"locations":[0]}"#);
    assert_eq!(save(&s, 0, &["new1"]), vec![9]);
    assert_eq!(s.exists(&["k0", "k1", "k2", "new1"]), r#"{"exists":[true,false,true,true]}"#);
    // batch_exists does not refresh recency: k2 goes next, and its page (2) comes after page 1.
    assert_eq!(s.exists(&["k2"]), r#"{"exists":[true]}"#);
    assert_eq!(save(&s, 0, &["new2"]), vec![1]);
    assert_eq!(s.exists(&["k2"]), r#"{"exists":[false]}"#);
    let v = s.get("/stats").json();
    let space = &v["spaces"][0];
    assert_eq!(space["counters"]["evictions"], 2, "{v}");
    assert_eq!(space["keys"], 9, "{v}");
    assert_eq!(v["settings"]["eviction"], "lru");
    assert_eq!(v["settings"]["evict_high"], 0.95);
}

#[test]
fn inspect_shows_one_key() {
    let s = Server::start(config());
    s.init(0, 4);
    s.init(1, 4);
    save(&s, 0, &["a/b c"]);
    let r = s.get("/admin/keys/a%2Fb%20c");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.json(),
        serde_json::json!({"key":"a/b c","complete":false,"pages":[{"rank":0,"page":0}],"reservations":0,
                           "lease_remaining_seconds":0.0,"evictable":false})
    );
    s.get("/admin/keys/nope").expect_detail(404, "Key not stored (\"nope\")");
    s.get("/admin/keys/%ZZ").expect_detail(400, "Invalid key (the path is not valid percent-encoded UTF-8)");
}

#[test]
fn a_body_that_never_arrives_is_a_408_not_a_5xx() {
    let mut cfg = config();
    cfg.request_timeout = Duration::from_millis(300);
    let s = Server::start(cfg);
    let start = Instant::now();
    let r = s.declared_length("POST", "/keys/batch_exists", 100);
    assert!(start.elapsed() >= Duration::from_millis(250), "{:?}", start.elapsed());
    r.expect_detail(408, "Request body not received within 0.3 s (--request-timeout)");
}

#[test]
fn a_broken_chunked_body_is_a_400_not_a_413() {
    let s = Server::start(config());
    let raw = format!(
        "POST /keys/batch_exists HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n",
        s.addr
    );
    let r = s.raw(raw.as_bytes());
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.detail().starts_with("Request body could not be read ("), "{r:?}");
}

//! The operator's surface over HTTP: `GET /metrics`, `--allow` (403) and `--admin-token` (401).

mod common;

use common::{Server, config};
use kvpages_host::access::{Access, parse_allow};
use kvpages_host::config::ServeConfig;

/// The value of the sample `series` (exact text before the value), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).map(|v| v.parse().unwrap()))
}

/// Request counters are process-wide and tests run in parallel, so this one test is the only
/// one in this file that reads them; everything else it checks belongs to its own server.
#[test]
fn metrics_count_requests_pages_keys_and_events() {
    let s = Server::start(config());
    let before = s.get("/metrics");
    assert_eq!(before.status, 200);
    assert_eq!(before.content_type.as_deref(), Some("text/plain; version=0.0.4; charset=utf-8"));
    let count = |text: &str, route: &str, status: u16| {
        sample(text, &format!("kvpages_http_requests_total{{route=\"{route}\",status=\"{status}\"}}")).unwrap_or(0.0)
    };
    let allocs_before = count(before.text(), "/keys/batch_allocate", 200);
    let bad_before = count(before.text(), "/keys/batch_allocate", 400);

    s.init(0, 16);
    s.init(1, 16);
    let pages = s.allocate(0, &["k1", "k2"]);
    s.confirm_ok(0, &[("k1", pages[0].1 as u32)], &[]);
    s.allocate(1, &["k1"]);
    s.confirm_ok(1, &[("k1", 0)], &[]);
    s.allocate(0, &["k1"]); // a cache hit
    assert_eq!(s.post("/keys/batch_allocate", "{").status, 400);
    // A refused request changes nothing, counters included: only the partial confirm counts.
    assert_eq!(s.confirm(0, &[("nope", 9)], &[]).status, 409);
    s.confirm_ok(0, &[("k2", pages[1].1 as u32), ("nope", 9)], &[]);
    s.allocate(0, &["k3"]);
    s.confirm_ok(0, &[], &[0]); // an ignored release: page 0 holds k1
    assert_eq!(s.get("/no/such/route/here").status, 404);
    assert_eq!(s.post("/0/initialize", r#"{"num_pages":4,"namespace":"kv"}"#).status, 204);
    assert_eq!(s.post("/0/exists", r#"{"keys":["a"],"namespace":"kv"}"#).status, 200);

    let r = s.get("/metrics");
    assert_eq!(r.status, 200);
    let m = r.text();
    // Requests by route and status (other tests of this binary do not touch these counters).
    assert_eq!(count(m, "/keys/batch_allocate", 200) - allocs_before, 4.0, "{m}");
    assert_eq!(count(m, "/keys/batch_allocate", 400) - bad_before, 1.0, "{m}");
    assert!(count(m, "/rank/{rank}/initialize", 200) >= 2.0, "{m}");
    assert!(count(m, "/keys/confirm_write", 409) >= 1.0, "{m}");
    assert!(count(m, "unmatched", 404) >= 1.0, "{m}");
    assert!(count(m, "/{rank}/initialize", 204) >= 1.0, "SGLang routes are labelled by op: {m}");
    assert!(count(m, "/{rank}/exists", 200) >= 1.0, "{m}");
    // Latency histograms per route: +Inf bucket = count.
    let inf = sample(m, "kvpages_http_request_duration_seconds_bucket{route=\"/keys/batch_allocate\",le=\"+Inf\"}");
    let n = sample(m, "kvpages_http_request_duration_seconds_count{route=\"/keys/batch_allocate\"}");
    assert!(inf.is_some() && inf == n, "{m}");
    // Pages by state per rank, from this server's engine: exact.
    let page = |rank: u32, state: &str| {
        sample(m, &format!("kvpages_pages{{family=\"vllm\",rank=\"{rank}\",state=\"{state}\"}}")).unwrap()
    };
    assert_eq!(
        [page(0, "free"), page(0, "reserved"), page(0, "committed"), page(0, "quarantined")],
        [13.0, 1.0, 2.0, 0.0],
        "{m}"
    );
    assert_eq!([page(1, "free"), page(1, "committed")], [15.0, 1.0]);
    assert!(page(0, "leased") <= page(0, "committed"), "leased pages are committed ones");
    assert_eq!(sample(m, "kvpages_pool_pages{family=\"vllm\",rank=\"0\"}"), Some(16.0));
    assert_eq!(sample(m, "kvpages_keys{family=\"vllm\"}"), Some(2.0));
    assert_eq!(sample(m, "kvpages_pending_keys{family=\"vllm\"}"), Some(1.0), "k3 is only reserved");
    assert_eq!(sample(m, "kvpages_cache_hits_total{family=\"vllm\"}"), Some(1.0));
    assert_eq!(sample(m, "kvpages_refused_confirms_total{family=\"vllm\"}"), Some(1.0));
    assert_eq!(sample(m, "kvpages_ignored_releases_total{family=\"vllm\"}"), Some(1.0));
    assert_eq!(sample(m, "kvpages_evictions_total{family=\"vllm\"}"), Some(0.0));
    assert_eq!(sample(m, "kvpages_expired_reservations_total{family=\"vllm\"}"), Some(0.0));
    assert_eq!(
        sample(m, "kvpages_pages{family=\"sglang\",rank=\"0\",namespace=\"kv\",state=\"free\"}"),
        Some(4.0),
        "{m}"
    );
    assert_eq!(sample(m, "kvpages_engine_up"), Some(1.0));
    for name in [
        "kvpages_plugin_traps_total",
        "kvpages_plugin_faults_total",
        "kvpages_log_bytes",
        "kvpages_log_fsync_duration_seconds_count",
    ] {
        assert!(sample(m, name).is_some(), "{name} missing: {m}");
    }
    assert_eq!(s.post("/metrics", "").status, 405);
}

fn allow(blocks: &str) -> Server {
    Server::start(ServeConfig {
        access: Access { allow: Some(parse_allow(blocks).unwrap()), admin_token: None },
        ..config()
    })
}

#[test]
fn allow_refuses_clients_outside_its_blocks_on_every_route() {
    let s = allow("10.0.0.0/8");
    let detail = "Forbidden: client address not allowed (--allow) (client address 127.0.0.1 is not in --allow)";
    s.post("/rank/0/initialize", r#"{"num_pages":4}"#).expect_detail(403, detail);
    s.post("/keys/batch_exists", r#"{"keys":[]}"#).expect_detail(403, detail);
    s.get("/health").expect_detail(403, detail);
    s.get("/metrics").expect_detail(403, detail);
    s.get("/no/such/route").expect_detail(403, detail);
    s.post("/0/exists", r#"{"keys":[],"namespace":"kv"}"#).expect_detail(403, detail);
}

#[test]
fn allow_serves_clients_inside_its_blocks() {
    let s = allow("10.0.0.0/8,127.0.0.0/8");
    s.init(0, 4);
    assert_eq!(s.exists(&["a"]), r#"{"exists":[false]}"#);
    assert_eq!(s.get("/health").status, 200);
    let s = allow("127.0.0.1");
    assert_eq!(s.get("/health").status, 200);
}

const TOKEN: &str = "s3cret-token";

fn with_token() -> Server {
    Server::start(ServeConfig { access: Access { allow: None, admin_token: Some(TOKEN.into()) }, ..config() })
}

/// Every guarded route: (method, path, body, success status with the token).
const GUARDED: [(&str, &str, &str, u16); 6] = [
    ("GET", "/admin/keys/a", "", 200),
    ("GET", "/admin/export/sglang", "", 200),
    ("POST", "/0/delete_keys", r#"{"keys":["a"],"namespace":"kv"}"#, 204),
    ("POST", "/0/clear", r#"{"namespace":"kv"}"#, 204),
    ("POST", "/keys/delete", r#"{"keys":["a"]}"#, 200),
    ("POST", "/clear", "", 204),
];

#[test]
fn admin_token_guards_clear_delete_and_admin_routes() {
    let s = with_token();
    s.init(0, 4);
    let p = s.allocate(0, &["a"])[0].1 as u32;
    s.confirm_ok(0, &[("a", p)], &[]);
    assert_eq!(s.post("/0/initialize", r#"{"num_pages":4,"namespace":"kv"}"#).status, 204);
    let fp = s.fingerprint(&[0], &["a"]);
    let missing = |path: &str| {
        format!(
            "Unauthorized: this route needs the admin token (--admin-token) ({path} needs the header 'Authorization: Bearer TOKEN')"
        )
    };
    let wrong = "Unauthorized: this route needs the admin token (--admin-token) (the token does not match)";
    for (method, path, body, _) in GUARDED {
        let r = s.request_with(method, path, &[], body.as_bytes());
        r.expect_detail(401, &missing(path));
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        s.request_with(method, path, &[("Authorization", "Bearer wrong")], body.as_bytes()).expect_detail(401, wrong);
        s.request_with(method, path, &[("Authorization", TOKEN)], body.as_bytes()).expect_detail(401, &missing(path));
        s.request_with(method, path, &[("Authorization", &format!("Bearer {TOKEN}x"))], body.as_bytes())
            .expect_detail(401, wrong);
    }
    assert_eq!(s.fingerprint(&[0], &["a"]), fp, "a refused request changed the state");
    // The data routes and the read-only operator routes need no token.
    assert_eq!(s.exists(&["a"]), r#"{"exists":[true]}"#);
    for path in ["/health", "/stats", "/metrics"] {
        assert_eq!(s.get(path).status, 200, "{path}");
    }
    // With the token, each guarded route does its work (in this order: /clear last).
    let auth = format!("Bearer {TOKEN}");
    for (method, path, body, ok) in GUARDED {
        let r = s.request_with(
            method,
            path,
            &[("Authorization", &auth), ("Content-Type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(r.status, ok, "{method} {path}: {r:?}");
    }
    assert_eq!(s.post("/keys/batch_exists", r#"{"keys":["a"]}"#).text(), r#"{"exists":[false]}"#);
}

#[test]
fn the_cli_client_sends_the_token() {
    let s = with_token();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = kvpages_host::client::Client::connect(s.addr).await.unwrap();
        let mut c = c.bearer(Some(TOKEN)).unwrap();
        assert_eq!(c.get("/admin/export/sglang").await.unwrap().status, 200);
        let mut bare = kvpages_host::client::Client::connect(s.addr).await.unwrap();
        assert_eq!(bare.get("/admin/export/sglang").await.unwrap().status, 401);
    });
}

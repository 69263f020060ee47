//! The HTTP API through `kvpages_wire` without a server: each request goes through
//! `wire::parse`, `Core::apply` and `Pending::answer`, and the exact status and bytes are
//! checked — the guarantee the browser simulator builds on (the server's own tests check the same
//! answers over HTTP, `crates/host/tests/wire_parity.rs` checks both agree).

use kvpages_core::{Command, Core, Eviction, Key, Reply, Settings, Space};
use kvpages_wire::{self as wire, ErrorCode, HostInfo, Parsed};

mod cases;

/// The peer's behaviour: no eviction, no quarantine (page numbers as vLLM's server gives them).
fn peer_settings() -> Settings {
    Settings { eviction: Eviction::Off, quarantine: 0, ..Settings::default() }
}

/// A core driven like the simulator drives it, at a fixed time.
struct Sim {
    core: Core,
    now: u64,
}

impl Sim {
    fn new() -> Sim {
        Sim { core: Core::new(7, peer_settings()), now: 1_000 }
    }

    /// Status, body and error code of one request.
    fn send(&mut self, method: &str, path: &str, body: &str) -> (u16, String, Option<ErrorCode>) {
        let answer = match wire::parse(method, path, body.as_bytes()) {
            Parsed::Answer(a) => a,
            Parsed::Apply(p) => {
                let result = self.core.apply(self.now, p.command());
                p.answer(result)
            }
        };
        let text = String::from_utf8(answer.body).expect("answers are UTF-8");
        (answer.status, text, answer.code)
    }

    /// `method path body` is answered `status` with exactly `want` (empty for a 204), and the
    /// invariants hold after it; `Err` says what differs.
    fn exchange(&mut self, method: &str, path: &str, body: &str, status: u16, want: &str) -> Result<(), String> {
        let label = format!("{method} {path} {body}");
        let (got_status, got, code) = self.send(method, path, body);
        if (got_status, got.as_str()) != (status, want) {
            return Err(format!("{label}\n    got {got_status} {got}\n   want {status} {want}"));
        }
        let want_code = (status >= 400).then_some(status);
        if code.map(ErrorCode::status) != want_code {
            return Err(format!("{label}: error code {code:?} for status {status}"));
        }
        self.core.check_invariants().map_err(|e| format!("{label}: invariants broken: {e}"))
    }

    /// Like [`Sim::exchange`] for an error: `{"detail": detail}`.
    fn refusal(&mut self, method: &str, path: &str, body: &str, status: u16, detail: &str) -> Result<(), String> {
        let want = format!("{{\"detail\":{}}}", json_string(detail));
        self.exchange(method, path, body, status, &want)
    }

    /// One exchange outside a table.
    fn check(&mut self, method: &str, path: &str, body: &str, status: u16, want: &str) {
        cases::check([()], |()| self.exchange(method, path, body, status, want));
    }

    /// One refusal outside a table.
    fn check_detail(&mut self, method: &str, path: &str, body: &str, status: u16, detail: &str) {
        cases::check([()], |()| self.refusal(method, path, body, status, detail));
    }
}

/// `s` as a JSON string literal (the details here hold quotes).
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

const KEYS: &str = "Invalid request format: need 'rank' and 'keys'";
const CONF: &str = "Invalid request format: need 'rank' and 'confirmations'";
const NOTHING: &str = "No confirmation matched a reservation; nothing was applied";

#[test]
fn vllm_routes_answer_the_peers_json() {
    let mut s = Sim::new();
    // (method, path, body, status, exact answer body), applied in order to one core.
    let table: &[(&str, &str, &str, u16, &str)] = &[
        ("POST", "/rank/0/initialize", r#"{"num_pages":4}"#, 200, r#"{"message":"Rank 0 initialized with 4 pages"}"#),
        (
            "POST",
            "/rank/1/initialize",
            r#"{"num_pages":0,"role":"scheduler"}"#,
            200,
            r#"{"message":"Scheduler role does not require initialization"}"#,
        ),
        (
            "POST",
            "/keys/batch_allocate",
            r#"{"rank":0,"keys":[["a",""],["b",""],["a",""]]}"#,
            200,
            r#"{"rank":0,"results":[["a",0],["b",1]]}"#,
        ),
        ("POST", "/keys/confirm_write", r#"{"rank":0,"confirmations":[["a",0]],"pages_to_release":[1]}"#, 204, ""),
        ("POST", "/keys/batch_exists", r#"{"keys":["a","b"]}"#, 200, r#"{"exists":[true,false]}"#),
        ("POST", "/keys/get_locations", r#"{"rank":0,"keys":["a","b"]}"#, 200, r#"{"locations":[0,null]}"#),
        // A cache hit keeps its page; as in the peer, every key takes a free page first (2, 3;
        // the released page 1 is at the back) and the hit gives its one back, so "c" gets 3.
        (
            "POST",
            "/keys/batch_allocate",
            r#"{"rank":0,"keys":[["a",""],["c",""]]}"#,
            200,
            r#"{"rank":0,"results":[["a",0],["c",3]]}"#,
        ),
        (
            "GET",
            "/admin/keys/a",
            "",
            200,
            r#"{"key":"a","complete":true,"pages":[{"rank":0,"page":0}],"reservations":0,"lease_remaining_seconds":5.0,"evictable":false}"#,
        ),
        // HEAD is GET (the server strips the body).
        (
            "HEAD",
            "/admin/keys/%61",
            "",
            200,
            r#"{"key":"a","complete":true,"pages":[{"rank":0,"page":0}],"reservations":0,"lease_remaining_seconds":5.0,"evictable":false}"#,
        ),
        ("POST", "/keys/delete", r#"{"keys":["a","never"]}"#, 200, r#"{"deleted":1}"#),
        ("POST", "/keys/batch_exists", r#"{"keys":["a"]}"#, 200, r#"{"exists":[false]}"#),
        ("POST", "/clear", "ignored", 204, ""),
    ];
    cases::check(table, |&(method, path, body, status, want)| s.exchange(method, path, body, status, want));
    s.check_detail("POST", "/keys/get_locations", r#"{"rank":0,"keys":[]}"#, 404, "Rank 0 not initialized");
}

#[test]
fn vllm_refusals_and_malformed_requests() {
    let mut s = Sim::new();
    s.check(
        "POST",
        "/rank/0/initialize",
        r#"{"num_pages":4}"#,
        200,
        r#"{"message":"Rank 0 initialized with 4 pages"}"#,
    );
    s.check(
        "POST",
        "/keys/batch_allocate",
        r#"{"rank":0,"keys":[["a",""]]}"#,
        200,
        r#"{"rank":0,"results":[["a",0]]}"#,
    );
    let init = "Invalid initialization parameters";
    // (path, body, status, detail)
    let table: &[(&str, &str, u16, String)] = &[
        ("/rank/x/initialize", "{}", 400, format!("{init} (path rank 'x' is not a decimal integer in u32 range)")),
        ("/rank//initialize", "{}", 400, format!("{init} (path rank '' is not a decimal integer in u32 range)")),
        ("/rank/0/initialize", r#"{"num_pages":0}"#, 400, format!("{init} (num_pages must be at least 1)")),
        ("/rank/0/initialize", r#"{"role":"worker"}"#, 400, format!("{init} (member 'num_pages' is missing)")),
        (
            "/rank/0/initialize",
            r#"{"num_pages":4,"role":"boss"}"#,
            400,
            format!("{init} (role: invalid value: string \"boss\", expected \"worker\" or \"scheduler\")"),
        ),
        ("/keys/batch_allocate", "", 400, format!("{KEYS} (body is empty, expected a JSON object)")),
        ("/keys/batch_allocate", "\u{feff}{}", 400, format!("{KEYS} (body starts with a byte order mark)")),
        ("/keys/batch_allocate", r#"{"keys":[]}"#, 400, format!("{KEYS} (member 'rank' is missing)")),
        ("/keys/batch_allocate", r#"{"rank":0,"rank":0}"#, 400, format!("{KEYS} (duplicate member 'rank')")),
        (
            "/keys/batch_allocate",
            r#"{"rank":0,"keys":["ab"]}"#,
            400,
            format!("{KEYS} (keys[0]: invalid type: string \"ab\", expected a [key, prefix_key] pair)"),
        ),
        (
            "/keys/batch_allocate",
            r#"{"rank":0} x"#,
            400,
            format!("{KEYS} (body has data after the JSON value (trailing characters))"),
        ),
        ("/keys/batch_allocate", r#"{"rank":5,"keys":[["a",""]]}"#, 404, "Rank 5 not initialized".into()),
        ("/keys/get_locations", r#"{"rank":0,"keys":[""]}"#, 400, format!("{KEYS} (keys[0]: key is empty)")),
        (
            "/keys/confirm_write",
            r#"{"rank":0,"confirmations":[["a",9]]}"#,
            400,
            format!("{CONF} (confirmations[0]: page 9 is out of range, rank 0 has 4 pages)"),
        ),
        (
            "/keys/confirm_write",
            r#"{"rank":0,"confirmations":[["b",1]]}"#,
            409,
            format!(
                "{NOTHING} (confirmations[0] [\"b\", 1]: page is not reserved (never allocated, released, or expired))"
            ),
        ),
        (
            "/keys/confirm_write",
            r#"{"rank":0,"confirmations":[["b",0]]}"#,
            409,
            format!("{NOTHING} (confirmations[0] [\"b\", 0]: page is reserved for another key)"),
        ),
        (
            "/keys/batch_exists",
            r#"{"keys":[1]}"#,
            400,
            "Invalid keys format (keys[0]: invalid type: integer `1`, expected a key (a non-empty string of at most 1024 bytes))"
                .into(),
        ),
        (
            "/keys/delete",
            r#"{"keys":"a"}"#,
            400,
            "Invalid delete request: need 'keys' (keys: invalid type: string \"a\", expected a list)".into(),
        ),
    ];
    cases::check(table, |(path, body, status, detail)| s.refusal("POST", path, body, *status, detail));
    // Nothing of the refused requests applied: "a" is still reserved on page 0, page 1 is next.
    s.check("POST", "/keys/confirm_write", r#"{"rank":0,"confirmations":[["a",0]]}"#, 204, "");
    s.check(
        "POST",
        "/keys/batch_allocate",
        r#"{"rank":0,"keys":[["b",""]]}"#,
        200,
        r#"{"rank":0,"results":[["b",1]]}"#,
    );
    s.check_detail("GET", "/admin/keys/%zz", "", 400, "Invalid key (the path is not valid percent-encoded UTF-8)");
    s.check_detail("GET", "/admin/keys/nope", "", 404, "Key not stored (\"nope\")");
}

#[test]
fn a_world_size_refuses_ranks_outside_it() {
    let mut s = Sim { core: Core::new(7, Settings { world_size: Some(2), ..peer_settings() }), now: 0 };
    s.check_detail(
        "POST",
        "/rank/2/initialize",
        r#"{"num_pages":4}"#,
        409,
        "Rank 2 is outside the TP world of 2 ranks (--world-size)",
    );
}

#[test]
fn sglang_routes_answer_the_peers_json() {
    let mut s = Sim::new();
    let table: &[(&str, &str, u16, &str)] = &[
        ("/0/initialize", r#"{"num_pages":4,"namespace":"kv"}"#, 204, ""),
        (
            "/0/reserve_and_allocate_page_indices",
            r#"{"keys":[["h1",""],["h2",""],["h1",""]]}"#,
            200,
            r#"{"indices":[[false,3],[false,2],[false,3]]}"#,
        ),
        ("/0/confirm_write", r#"{"written_keys_to_confirm":[["h1",3]],"pages_to_release":[2]}"#, 204, ""),
        ("/0/exists", r#"{"keys":["h1","h2"]}"#, 200, r#"{"exists":[true,false]}"#),
        ("/0/get_page_indices", r#"{"keys":["h1","h2"],"namespace":"kv"}"#, 200, r#"{"indices":[3,null]}"#),
        (
            "/0/reserve_and_allocate_page_indices",
            r#"{"keys":[["h1",""],["h3",""]]}"#,
            200,
            r#"{"indices":[[true,3],[false,2]]}"#,
        ),
        ("/0/delete_keys", r#"{"keys":["h1","nope"]}"#, 204, ""),
        ("/0/exists", r#"{"keys":["h1"]}"#, 200, r#"{"exists":[false]}"#),
        ("/0/clear", r#"{}"#, 204, ""),
        ("/0/reserve_and_allocate_page_indices", r#"{"keys":[["x",""]]}"#, 200, r#"{"indices":[[false,3]]}"#),
        // Another namespace is another pool.
        ("/0/initialize", r#"{"num_pages":2,"namespace":"mamba"}"#, 204, ""),
        (
            "/0/reserve_and_allocate_page_indices",
            r#"{"keys":[["x",""]],"namespace":"mamba"}"#,
            200,
            r#"{"indices":[[false,1]]}"#,
        ),
    ];
    cases::check(table, |&(path, body, status, want)| s.exchange("POST", path, body, status, want));
    // The vLLM space is its own.
    s.check_detail("POST", "/keys/batch_allocate", r#"{"rank":0,"keys":[]}"#, 404, "Rank 0 not initialized");
}

#[test]
fn sglang_refusals_and_malformed_requests() {
    let mut s = Sim::new();
    s.check("POST", cases::INIT.0, cases::INIT.1, 204, "");
    cases::check(cases::REFUSALS, |&(path, body, status, detail)| s.refusal("POST", path, body, status, detail));
}

#[test]
fn routes_methods_and_fallbacks_match_the_servers_router() {
    let mut s = Sim::new();
    // (method, path, status, detail): paths the router does not know, and known paths with
    // another method (each case was checked against the server's router).
    let table: &[(&str, &str, u16, &str)] = &[
        ("GET", "/keys/batch_allocate", 405, "Method Not Allowed (/keys/batch_allocate accepts POST, not GET)"),
        ("PUT", "/rank/0/initialize", 405, "Method Not Allowed (/rank/0/initialize accepts POST, not PUT)"),
        ("HEAD", "/clear", 405, "Method Not Allowed (/clear accepts POST, not HEAD)"),
        ("POST", "/stats", 405, "Method Not Allowed (/stats accepts GET, not POST)"),
        ("POST", "/admin/keys/a", 405, "Method Not Allowed (/admin/keys/a accepts GET, not POST)"),
        ("GET", "/0/exists", 405, "Method Not Allowed (/0/exists accepts POST, not GET)"),
        ("GET", "/keys/foo", 405, "Method Not Allowed (/keys/foo accepts POST, not GET)"),
        // `/{rank}/{op}` takes any two segments, the first one may be empty.
        ("DELETE", "//exists", 405, "Method Not Allowed (//exists accepts POST, not DELETE)"),
        ("POST", "//exists", 404, "Not Found (no route POST //exists)"),
        ("POST", "/admin/keys", 404, "Not Found (no route POST /admin/keys)"),
        ("POST", "/keys/batch_allocate/", 404, "Not Found (no route POST /keys/batch_allocate/)"),
        ("GET", "/admin/keys/", 404, "Not Found (no route GET /admin/keys/)"),
        ("GET", "/admin/keys/a/b", 404, "Not Found (no route GET /admin/keys/a/b)"),
        ("POST", "/0/", 404, "Not Found (no route POST /0/)"),
        ("POST", "/0//", 404, "Not Found (no route POST /0//)"),
        ("POST", "/rank/0/x", 404, "Not Found (no route POST /rank/0/x)"),
        ("POST", "/a/b/c/d", 404, "Not Found (no route POST /a/b/c/d)"),
        ("GET", "/", 404, "Not Found (no route GET /)"),
        ("GET", "", 404, "Not Found (no route GET )"),
        ("OPTIONS", "/x", 404, "Not Found (no route OPTIONS /x)"),
    ];
    cases::check(table, |&(method, path, status, detail)| s.refusal(method, path, "", status, detail));
    // The server's own routes are not the wire crate's: the simulator answers them 404 (the
    // server's answers to them are checked in crates/host/tests/wire_parity.rs).
    let own = [
        ("GET", "/health"),
        ("POST", "/health"),
        ("GET", "/metrics"),
        ("POST", "/admin/import/sglang"),
        ("GET", "/admin/import/sglang"),
        ("GET", "/admin/export/sglang"),
        ("GET", "/simulator"),
        ("GET", "/simulator/"),
    ];
    cases::check(own, |(method, path)| {
        s.refusal(method, path, "", 404, &format!("Not Found (no route {method} {path})"))
    });
    // Two segments are SGLang's `/{rank}/{op}` here; the server's router sends them to its
    // `/simulator/{*path}` first.
    s.check_detail("GET", "/simulator/app.js", "", 405, "Method Not Allowed (/simulator/app.js accepts POST, not GET)");
}

/// The route a path names, and how specifically a template matches, as axum's router does.
#[test]
fn paths_find_their_route_by_the_routers_rules() {
    let name = |path: &str| wire::Route::find(path).map(|r| r.name);
    let table: &[(&str, Option<&str>)] = &[
        ("/keys/batch_allocate", Some("batch_allocate")),
        ("/rank/0/initialize", Some("initialize")),
        ("/rank//initialize", Some("initialize")),
        ("/admin/keys/k", Some("inspect")),
        ("/stats", Some("stats")),
        ("/0/exists", Some("sglang")),
        ("//exists", Some("sglang")),
        ("/keys/foo", Some("sglang")),
        ("/stats/", None),
        ("/0/", None),
        ("/", None),
        ("", None),
        ("/health", None),
        ("/a/b/c", None),
    ];
    cases::check(table, |&(path, want)| {
        let got = name(path);
        if got == want { Ok(()) } else { Err(format!("{path:?}: route {got:?}, want {want:?}")) }
    });
    assert_eq!(wire::matches("/simulator/{*path}", "/simulator/a/b"), Some(1));
    assert_eq!(wire::matches("/simulator/{*path}", "/simulator/"), None);
    assert_eq!(wire::matches("/simulator/", "/simulator/"), Some(2));
    assert_eq!(wire::matches("/{rank}/{op}", "/keys/batch_allocate"), Some(0));
    assert_eq!(wire::matches("/keys/batch_allocate", "/keys/batch_allocate"), Some(2));
}

#[test]
fn each_route_builds_its_command_and_names_itself() {
    let key = |s: &str| Key::parse(s).unwrap();
    let sglang = |rank: u32, ns: &str| Space::Sglang { rank, namespace: ns.into() };
    let table: Vec<(&str, &str, &str, &str, Command)> = vec![
        (
            "POST",
            "/rank/3/initialize",
            r#"{"num_pages":9,"role":"worker"}"#,
            "initialize",
            Command::Initialize { space: Space::Vllm, rank: 3, num_pages: 9 },
        ),
        (
            "POST",
            "/keys/batch_allocate",
            r#"{"rank":1,"keys":[["a","p"]],"extra":[1]}"#,
            "batch_allocate",
            Command::Allocate { space: Space::Vllm, rank: 1, keys: vec![key("a")] },
        ),
        (
            "POST",
            "/keys/confirm_write",
            r#"{"rank":1,"confirmations":[["a",2]],"pages_to_release":[3]}"#,
            "confirm_write",
            Command::Confirm { space: Space::Vllm, rank: 1, confirmations: vec![(key("a"), 2)], releases: vec![3] },
        ),
        ("POST", "/keys/batch_exists", r#"{}"#, "batch_exists", Command::Exists { space: Space::Vllm, keys: vec![] }),
        (
            "POST",
            "/keys/get_locations",
            r#"{"rank":2,"keys":["a"]}"#,
            "get_locations",
            Command::Locations { space: Space::Vllm, rank: 2, keys: vec![key("a")] },
        ),
        ("POST", "/clear", "", "clear", Command::Clear { space: Space::Vllm }),
        (
            "POST",
            "/keys/delete",
            r#"{"keys":["a"]}"#,
            "delete",
            Command::Delete { space: Space::Vllm, keys: vec![key("a")] },
        ),
        ("GET", "/stats", "", "stats", Command::Stats),
        ("GET", "/admin/keys/a%2Fb", "", "inspect", Command::Inspect { space: Space::Vllm, key: key("a/b") }),
        (
            "POST",
            "/2/initialize",
            r#"{"num_pages":5,"namespace":"swa"}"#,
            "sglang",
            Command::Initialize { space: sglang(2, "swa"), rank: 2, num_pages: 5 },
        ),
        (
            "POST",
            "/2/exists",
            r#"{"keys":["a"]}"#,
            "sglang",
            Command::Exists { space: sglang(2, "kv"), keys: vec![key("a")] },
        ),
        (
            "POST",
            "/2/reserve_and_allocate_page_indices",
            r#"{"keys":[["a",""]]}"#,
            "sglang",
            Command::Allocate { space: sglang(2, "kv"), rank: 2, keys: vec![key("a")] },
        ),
        (
            "POST",
            "/2/confirm_write",
            r#"{"written_keys_to_confirm":[["a",1]],"pages_to_release":[0]}"#,
            "sglang",
            Command::Confirm { space: sglang(2, "kv"), rank: 2, confirmations: vec![(key("a"), 1)], releases: vec![0] },
        ),
        (
            "POST",
            "/2/delete_keys",
            r#"{"keys":["a"]}"#,
            "sglang",
            Command::Delete { space: sglang(2, "kv"), keys: vec![key("a")] },
        ),
        ("POST", "/2/clear", r#"{}"#, "sglang", Command::Reset { space: sglang(2, "kv") }),
        (
            "POST",
            "/2/get_page_indices",
            r#"{"keys":["a"]}"#,
            "sglang",
            Command::Locations { space: sglang(2, "kv"), rank: 2, keys: vec![key("a")] },
        ),
    ];
    cases::check(table, |(method, path, body, route, command)| {
        let label = format!("{method} {path} {body}");
        let Parsed::Apply(p) = wire::parse(method, path, body.as_bytes()) else {
            return Err(format!("{label}: answered without a command"));
        };
        if (p.route(), p.command()) == (route, &command) {
            Ok(())
        } else {
            Err(format!("{label}\n    got {} {:?}\n   want {route} {command:?}", p.route(), p.command()))
        }
    });
}

#[test]
fn stats_show_the_hosts_facts_and_every_space() {
    let mut core = Core::new(7, peer_settings());
    let Parsed::Apply(init) = wire::parse("POST", "/3/initialize", br#"{"num_pages":2}"#) else { panic!() };
    let r = core.apply(0, init.command());
    assert_eq!(init.answer(r).status, 204);
    let Parsed::Apply(p) = wire::parse("GET", "/stats", b"") else { panic!() };
    let result = core.apply(0, p.command());
    let host = HostInfo { engine: "sim", engine_traps: 2, uptime_seconds: 1.5 };
    let a = p.answer_with(result, &host);
    let counters = r#"{"reserved":0,"cache_hits":0,"misses":0,"committed":0,"refused_confirms":0,"superseded":0,"released":0,"ignored_releases":0,"expired_reservations":0,"dropped_keys":0,"evictions":0,"deleted":0,"quarantined_pages":0,"location_hits":0,"location_misses":0}"#;
    let want = format!(
        concat!(
            r#"{{"engine":"sim","engine_traps":2,"uptime_seconds":1.5,"settings":{{"reservation_ttl_seconds":60.0,"#,
            r#""read_lease_seconds":5.0,"quarantine_seconds":0.0,"eviction":"off","evict_high":0.95,"evict_low":0.9,"#,
            r#""world_size":null}},"spaces":[{{"space":"sglang","rank":3,"namespace":"kv","keys":0,"pending_keys":0,"#,
            r#""world_size":1,"ranks":[{{"rank":3,"num_pages":2,"free":2,"reserved":0,"committed":0,"leased":0,"#,
            r#""quarantined":0}}],"counters":{}}}]}}"#
        ),
        counters
    );
    assert_eq!((a.status, String::from_utf8(a.body).unwrap()), (200, want));
}

/// An engine that answers an allocation out of the batch's range, or leaves a key out (a
/// broken plugin: the core never does), gets the engine-fault answer, not a panic.
#[test]
fn an_allocation_reply_that_does_not_fit_the_batch_is_an_engine_fault() {
    let at = |index| kvpages_core::Allocation { index, page: Some(0), cached: false };
    for (method, path, body) in [
        ("POST", "/keys/batch_allocate", r#"{"rank":0,"keys":[["a",""],["b",""]]}"#),
        ("POST", "/0/reserve_and_allocate_page_indices", r#"{"keys":[["a",""],["b",""]]}"#),
    ] {
        for bad in [vec![at(0), at(2)], vec![at(5)]] {
            let Parsed::Apply(p) = wire::parse(method, path, body.as_bytes()) else { panic!("{path}") };
            let a = p.answer(Ok(Reply::Allocated(bad.clone())));
            assert_eq!((a.status, a.code), (503, Some(ErrorCode::EngineFault)), "{path} {bad:?}");
        }
    }
    // SGLang answers every position: a key left out is a fault there too.
    let Parsed::Apply(p) =
        wire::parse("POST", "/0/reserve_and_allocate_page_indices", br#"{"keys":[["a",""],["b",""]]}"#)
    else {
        panic!()
    };
    assert_eq!(p.answer(Ok(Reply::Allocated(vec![at(0)]))).status, 503);
}

#[test]
fn an_unexpected_reply_or_refusal_is_an_engine_fault() {
    let Parsed::Apply(p) = wire::parse("POST", "/keys/batch_exists", br#"{"keys":[]}"#) else { panic!() };
    let a = p.answer(Ok(Reply::Configured));
    assert_eq!((a.status, a.code), (503, Some(ErrorCode::EngineFault)));
    assert_eq!(a.detail().as_deref(), Some("Engine unavailable (unexpected reply Configured)"));
    let Parsed::Apply(p) = wire::parse("POST", "/clear", b"") else { panic!() };
    let a = p.answer(Err(kvpages_core::Error::SglangPoolsExist { pools: 1 }));
    assert_eq!(a.status, 503);
    assert_eq!(
        a.detail().as_deref(),
        Some(
            "Engine unavailable (unexpected refusal: kvpages already holds 1 SGLang pools (import with replace to drop them))"
        )
    );
}

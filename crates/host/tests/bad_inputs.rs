//! Bad input over real HTTP: a table of malformed or conflicting requests, each with its exact
//! status and `detail`, each checked to change nothing.
//!
//! Rules (`docs/protocol.md`, "Status codes and bad input"): every bad
//! request is a 400/404/405/409/413 with a JSON `{"detail": "..."}` that starts with the peer's text
//! where the peer has one; never a 5xx, never `text/plain`; nothing of it is applied.

#[path = "../../wire/tests/cases/mod.rs"]
#[allow(dead_code)] // its SGLang table is the parity test's
mod cases;
mod common;

use common::{Resp, Server};
use kvpages_host::config::ServeConfig;

const INIT: &str = "Invalid initialization parameters";
const KEYS: &str = "Invalid request format: need 'rank' and 'keys'";
const CONF: &str = "Invalid request format: need 'rank' and 'confirmations'";
const EXIST: &str = "Invalid keys format";
const NOTHING: &str = "No confirmation matched a reservation; nothing was applied";

const ALLOC: &str = "/keys/batch_allocate";
const CONFIRM: &str = "/keys/confirm_write";
const EXISTS: &str = "/keys/batch_exists";
const LOCS: &str = "/keys/get_locations";
const INIT0: &str = "/rank/0/initialize";

/// The body limit of the table's server.
const MAX_BODY: usize = 4096;

/// How a case's body travels.
#[derive(Clone)]
enum Send {
    /// With a `Content-Length`.
    Body(Vec<u8>),
    /// `Transfer-Encoding: chunked`, in these chunks.
    Chunked(Vec<Vec<u8>>),
    /// A `Content-Length` of this many bytes and no body at all.
    Declared(u64),
}

/// What `detail` must be.
#[derive(Clone)]
enum Want {
    /// Exactly this.
    Is(String),
    /// `{prefix} (` ... then `contains` somewhere after it (for parser texts with positions).
    Like(String, &'static str),
}

#[derive(Clone)]
struct Case {
    method: &'static str,
    path: String,
    send: Send,
    status: u16,
    want: Want,
}

impl Case {
    fn label(&self) -> String {
        let body = match &self.send {
            Send::Body(b) => {
                let t = String::from_utf8_lossy(b);
                if t.chars().count() > 120 {
                    format!("{}… ({} bytes)", t.chars().take(120).collect::<String>(), b.len())
                } else {
                    t.into_owned()
                }
            }
            Send::Chunked(c) => format!("<chunked, {} bytes>", c.iter().map(Vec::len).sum::<usize>()),
            Send::Declared(n) => format!("<Content-Length: {n}, no body>"),
        };
        format!("{} {} {body}", self.method, self.path)
    }
}

fn because(prefix: &str, reason: &str) -> String {
    format!("{prefix} ({reason})")
}

/// `method path body` answered `status` with exactly `{prefix} ({reason})`.
fn case(method: &'static str, path: &str, body: impl Into<Vec<u8>>, status: u16, prefix: &str, reason: &str) -> Case {
    Case { method, path: path.into(), send: Send::Body(body.into()), status, want: Want::Is(because(prefix, reason)) }
}

/// `POST path body` answered 400 with exactly `{prefix} ({reason})`.
fn bad(path: &str, body: impl Into<Vec<u8>>, prefix: &str, reason: &str) -> Case {
    case("POST", path, body, 400, prefix, reason)
}

/// `POST path body` answered 400 with `{prefix} (` and `contains` after it.
fn bad_like(path: &str, body: impl Into<Vec<u8>>, prefix: &str, contains: &'static str) -> Case {
    Case {
        method: "POST",
        path: path.into(),
        send: Send::Body(body.into()),
        status: 400,
        want: Want::Like(prefix.into(), contains),
    }
}

/// `POST path body` answered `status` with exactly `detail`.
fn exact(path: &str, body: impl Into<Vec<u8>>, status: u16, detail: &str) -> Case {
    Case { method: "POST", path: path.into(), send: Send::Body(body.into()), status, want: Want::Is(detail.into()) }
}

/// The peer's 400 text for a route, if it has one.
fn peer_text(path: &str) -> Option<&'static str> {
    match path {
        ALLOC | LOCS => Some(KEYS),
        CONFIRM => Some(CONF),
        EXISTS => Some(EXIST),
        p if p.starts_with("/rank/") && p.ends_with("/initialize") => Some(INIT),
        _ => None,
    }
}

const TOO_LARGE: &str = "Request body too large: the limit is 4096 bytes (--max-body)";

/// The five routes that read a JSON body, each with a body that would be valid, and would change
/// the state if applied, when nothing is appended to it.
fn routes() -> [(&'static str, &'static str, &'static str); 5] {
    [
        (INIT0, INIT, r#"{"num_pages":16}"#),
        (ALLOC, KEYS, r#"{"rank":0,"keys":[["new",""]]}"#),
        (CONFIRM, CONF, r#"{"rank":0,"confirmations":[["pending",2]]}"#),
        (EXISTS, EXIST, r#"{"keys":["k1"]}"#),
        (LOCS, KEYS, r#"{"rank":0,"keys":["k1"]}"#),
    ]
}

fn table() -> Vec<Case> {
    let mut t = Vec::new();
    let long = "k".repeat(1025);
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let deep_obj = |n: usize| format!("{}1{}", r#"{"a":"#.repeat(n), "}".repeat(n));

    // ---- Every body-reading route: not JSON, not UTF-8, not an object, ambiguous JSON. ----
    for (path, peer, valid) in routes() {
        let v = valid.trim_end_matches('}');
        t.push(bad(path, "", peer, "body is empty, expected a JSON object"));
        t.push(bad_like(path, "   \n", peer, "body is not valid JSON: EOF while parsing a value"));
        t.push(bad_like(path, "{", peer, "body is not valid JSON: EOF while parsing an object"));
        t.push(bad_like(path, &valid[..valid.len() - 1], peer, "body is not valid JSON: EOF while parsing an object"));
        t.push(bad_like(path, "{'rank': 0}", peer, "body is not valid JSON: key must be a string"));
        t.push(bad_like(path, format!("{v},}}"), peer, "body is not valid JSON: trailing comma"));
        t.push(bad_like(path, "rank=0&keys=a", peer, "body is not valid JSON: expected value"));
        t.push(bad(path, "[]", peer, "invalid type: sequence, expected a JSON object"));
        t.push(bad(path, format!("[{valid}]"), peer, "invalid type: sequence, expected a JSON object"));
        t.push(bad(path, r#""{}""#, peer, r#"invalid type: string "{}", expected a JSON object"#));
        t.push(bad(path, "1", peer, "invalid type: integer `1`, expected a JSON object"));
        t.push(bad(path, "0.5", peer, "invalid type: floating point `0.5`, expected a JSON object"));
        t.push(bad(path, "null", peer, "invalid type: null, expected a JSON object"));
        t.push(bad(path, "true", peer, "invalid type: boolean `true`, expected a JSON object"));
        t.push(bad(path, format!("\u{feff}{valid}"), peer, "body starts with a byte order mark"));
        t.push(bad(
            path,
            [valid.as_bytes(), b"\xff"].concat(),
            peer,
            &format!("body is not UTF-8 (invalid byte at offset {})", valid.len()),
        ));
        let latin1 = format!("{v},\"note\":\"caf");
        t.push(bad(
            path,
            [latin1.as_bytes(), b"\xe9\"}"].concat(),
            peer,
            &format!("body is not UTF-8 (invalid byte at offset {})", latin1.len()),
        ));
        t.push(bad(path, format!("{valid} x"), peer, "body has data after the JSON value (trailing characters)"));
        t.push(bad(path, format!("{valid}{valid}"), peer, "body has data after the JSON value (trailing characters)"));
        t.push(bad(path, format!("{valid}\n]"), peer, "body has data after the JSON value (trailing characters)"));
        t.push(bad_like(path, format!("{v},\"x\":NaN}}"), peer, "body is not valid JSON: expected value"));
        t.push(bad_like(path, format!("{v},\"x\":Infinity}}"), peer, "body is not valid JSON: expected value"));
        t.push(bad_like(path, format!("{v},\"x\":-Infinity}}"), peer, "body is not valid JSON: invalid number"));
        t.push(bad_like(path, format!("{v},\"x\":{}}}", deep(200)), peer, "recursion limit exceeded"));
        t.push(bad_like(path, format!("{v},\"x\":{}}}", deep_obj(200)), peer, "recursion limit exceeded"));
        t.push(bad(path, format!("{v},\"x\":{{\"a\":1,\"a\":1}}}}"), peer, "x: duplicate member 'a'"));
        t.push(bad(
            path,
            format!("{v},\"x\":[0,{{\"b\":[{{\"a\":1,\"a\":1}}]}}]}}"),
            peer,
            "x[1].b[0]: duplicate member 'a'",
        ));
        t.push(bad(path, format!("{v},\"y\":1,\"y\":1}}"), peer, "duplicate member 'y'"));
        // The same member twice, the second time spelled with an escape.
        let first = &valid[2..valid[2..].find('"').unwrap() + 2];
        let escaped = first.replacen(&first[..1], &format!("\\u{:04x}", first.as_bytes()[0]), 1);
        t.push(bad(path, format!("{v},\"{escaped}\":[]}}"), peer, &format!("duplicate member '{first}'")));
    }

    // ---- batch_allocate ----
    let rank_reasons: [(&str, &str); 12] = [
        ("0.0", "rank: invalid type: floating point `0.0`, expected an integer in u32 range"),
        ("1e0", "rank: invalid type: floating point `1.0`, expected an integer in u32 range"),
        ("false", "rank: invalid type: boolean `false`, expected an integer in u32 range"),
        ("true", "rank: invalid type: boolean `true`, expected an integer in u32 range"),
        (r#""0""#, r#"rank: invalid type: string "0", expected an integer in u32 range"#),
        ("-1", "rank: invalid value: integer `-1`, expected an integer in u32 range"),
        ("4294967296", "rank: invalid value: integer `4294967296`, expected an integer in u32 range"),
        (
            "18446744073709551615",
            "rank: invalid value: integer `18446744073709551615`, expected an integer in u32 range",
        ),
        (
            "-9223372036854775808",
            "rank: invalid value: integer `-9223372036854775808`, expected an integer in u32 range",
        ),
        ("null", "rank: invalid type: null, expected an integer in u32 range"),
        ("[0]", "rank: invalid type: sequence, expected an integer in u32 range"),
        ("{}", "rank: invalid type: map, expected an integer in u32 range"),
    ];
    for (rank, reason) in rank_reasons {
        t.push(bad(ALLOC, format!(r#"{{"rank":{rank},"keys":[["new",""]]}}"#), KEYS, reason));
        t.push(bad(LOCS, format!(r#"{{"rank":{rank},"keys":["k1"]}}"#), KEYS, reason));
        t.push(bad(CONFIRM, format!(r#"{{"rank":{rank},"confirmations":[["pending",2]]}}"#), CONF, reason));
    }
    // Beyond u64: serde_json reads it as a float.
    t.push(bad_like(ALLOC, r#"{"rank":18446744073709551616,"keys":[]}"#, KEYS, "rank: invalid type: floating point"));
    t.push(bad(ALLOC, r#"{"keys":[["new",""]]}"#, KEYS, "member 'rank' is missing"));
    t.push(bad(ALLOC, r#"{}"#, KEYS, "member 'rank' is missing"));
    t.push(bad(ALLOC, r#"{"Rank":0,"keys":[["new",""]]}"#, KEYS, "member 'rank' is missing"));
    t.push(bad(ALLOC, r#"{"rank":0,"keys":{"new":""}}"#, KEYS, "keys: invalid type: map, expected a list"));
    t.push(bad(ALLOC, r#"{"rank":0,"keys":"new"}"#, KEYS, r#"keys: invalid type: string "new", expected a list"#));
    t.push(bad(ALLOC, r#"{"rank":0,"keys":null}"#, KEYS, "keys: invalid type: null, expected a list"));
    t.push(bad(ALLOC, r#"{"rank":0,"keys":7}"#, KEYS, "keys: invalid type: integer `7`, expected a list"));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[["new"]]}"#,
        KEYS,
        "keys[0]: invalid length 1, expected a [key, prefix_key] pair",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[["new","",""]]}"#,
        KEYS,
        "keys[0]: invalid length 3, expected a [key, prefix_key] pair",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[[]]}"#,
        KEYS,
        "keys[0]: invalid length 0, expected a [key, prefix_key] pair",
    ));
    // The peer unpacks a 2-character string as a pair.
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":["ab"]}"#,
        KEYS,
        r#"keys[0]: invalid type: string "ab", expected a [key, prefix_key] pair"#,
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[["new",""],"ab"]}"#,
        KEYS,
        r#"keys[1]: invalid type: string "ab", expected a [key, prefix_key] pair"#,
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[null]}"#,
        KEYS,
        "keys[0]: invalid type: null, expected a [key, prefix_key] pair",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[{"key":"new","prefix_key":""}]}"#,
        KEYS,
        "keys[0]: invalid type: map, expected a [key, prefix_key] pair",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[[1,""]]}"#,
        KEYS,
        "keys[0][0]: invalid type: integer `1`, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[[null,""]]}"#,
        KEYS,
        "keys[0][0]: invalid type: null, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[[["new"],""]]}"#,
        KEYS,
        "keys[0][0]: invalid type: sequence, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[["new",0]]}"#,
        KEYS,
        "keys[0][1]: invalid type: integer `0`, expected a prefix key (a string of at most 1024 bytes)",
    ));
    t.push(bad(
        ALLOC,
        r#"{"rank":0,"keys":[["new",null]]}"#,
        KEYS,
        "keys[0][1]: invalid type: null, expected a prefix key (a string of at most 1024 bytes)",
    ));
    t.push(bad(ALLOC, r#"{"rank":0,"keys":[["",""]]}"#, KEYS, "keys[0][0]: key is empty"));
    t.push(bad(
        ALLOC,
        format!(r#"{{"rank":0,"keys":[["new",""],["{long}",""]]}}"#),
        KEYS,
        "keys[1][0]: key is 1025 bytes long, the limit is 1024",
    ));
    t.push(bad(
        ALLOC,
        format!(r#"{{"rank":0,"keys":[["new","{long}"]]}}"#),
        KEYS,
        "keys[0][1]: prefix key is 1025 bytes long, the limit is 1024",
    ));
    t.push(bad(
        ALLOC,
        format!(r#"{{"rank":0,"keys":[{}]}}"#, deep(300)),
        KEYS,
        "keys[0][0]: invalid type: sequence, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(exact(ALLOC, r#"{"rank":5,"keys":[["new",""]]}"#, 404, "Rank 5 not initialized"));
    t.push(exact(ALLOC, r#"{"rank":4294967295,"keys":[]}"#, 404, "Rank 4294967295 not initialized"));

    // ---- get_locations ----
    t.push(bad(LOCS, r#"{"keys":["k1"]}"#, KEYS, "member 'rank' is missing"));
    t.push(bad(LOCS, r#"{"rank":0,"keys":"k1"}"#, KEYS, r#"keys: invalid type: string "k1", expected a list"#));
    t.push(bad(LOCS, r#"{"rank":0,"keys":null}"#, KEYS, "keys: invalid type: null, expected a list"));
    t.push(bad(
        LOCS,
        r#"{"rank":0,"keys":[1]}"#,
        KEYS,
        "keys[0]: invalid type: integer `1`, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        LOCS,
        r#"{"rank":0,"keys":["k1",["k2",""]]}"#,
        KEYS,
        "keys[1]: invalid type: sequence, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(LOCS, r#"{"rank":0,"keys":[""]}"#, KEYS, "keys[0]: key is empty"));
    t.push(bad(
        LOCS,
        format!(r#"{{"rank":0,"keys":["{long}"]}}"#),
        KEYS,
        "keys[0]: key is 1025 bytes long, the limit is 1024",
    ));
    t.push(exact(LOCS, r#"{"rank":5,"keys":["k1"]}"#, 404, "Rank 5 not initialized"));

    // ---- batch_exists ----
    t.push(bad(EXISTS, r#"{"keys":"k1"}"#, EXIST, r#"keys: invalid type: string "k1", expected a list"#));
    t.push(bad(EXISTS, r#"{"keys":null}"#, EXIST, "keys: invalid type: null, expected a list"));
    t.push(bad(EXISTS, r#"{"keys":{"k1":true}}"#, EXIST, "keys: invalid type: map, expected a list"));
    t.push(bad(
        EXISTS,
        r#"{"keys":[1]}"#,
        EXIST,
        "keys[0]: invalid type: integer `1`, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        EXISTS,
        r#"{"keys":["k1",true]}"#,
        EXIST,
        "keys[1]: invalid type: boolean `true`, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        EXISTS,
        r#"{"keys":[null]}"#,
        EXIST,
        "keys[0]: invalid type: null, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(
        EXISTS,
        r#"{"keys":[["k1",""]]}"#,
        EXIST,
        "keys[0]: invalid type: sequence, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(EXISTS, r#"{"keys":[""]}"#, EXIST, "keys[0]: key is empty"));
    t.push(bad(
        EXISTS,
        format!(r#"{{"keys":["k1","{long}"]}}"#),
        EXIST,
        "keys[1]: key is 1025 bytes long, the limit is 1024",
    ));

    // ---- confirm_write ----
    t.push(bad(CONFIRM, r#"{"confirmations":[["pending",2]]}"#, CONF, "member 'rank' is missing"));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":{"pending":2}}"#,
        CONF,
        "confirmations: invalid type: map, expected a list",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":null}"#,
        CONF,
        "confirmations: invalid type: null, expected a list",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending"]]}"#,
        CONF,
        "confirmations[0]: invalid length 1, expected a [key, page] pair",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",2,2]]}"#,
        CONF,
        "confirmations[0]: invalid length 3, expected a [key, page] pair",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":["pending"]}"#,
        CONF,
        r#"confirmations[0]: invalid type: string "pending", expected a [key, page] pair"#,
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[[2,"pending"]]}"#,
        CONF,
        "confirmations[0][0]: invalid type: integer `2`, expected a key (a non-empty string of at most 1024 bytes)",
    ));
    t.push(bad(CONFIRM, r#"{"rank":0,"confirmations":[["",2]]}"#, CONF, "confirmations[0][0]: key is empty"));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",-1]]}"#,
        CONF,
        "confirmations[0][1]: invalid value: integer `-1`, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",2.0]]}"#,
        CONF,
        "confirmations[0][1]: invalid type: floating point `2.0`, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending","zz"]]}"#,
        CONF,
        r#"confirmations[0][1]: invalid type: string "zz", expected an integer in u32 range"#,
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",null]]}"#,
        CONF,
        "confirmations[0][1]: invalid type: null, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",true]]}"#,
        CONF,
        "confirmations[0][1]: invalid type: boolean `true`, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",4294967296]]}"#,
        CONF,
        "confirmations[0][1]: invalid value: integer `4294967296`, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",2]],"pages_to_release":[-1]}"#,
        CONF,
        "pages_to_release[0]: invalid value: integer `-1`, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",2]],"pages_to_release":["3"]}"#,
        CONF,
        r#"pages_to_release[0]: invalid type: string "3", expected an integer in u32 range"#,
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"pages_to_release":[3,3.5]}"#,
        CONF,
        "pages_to_release[1]: invalid type: floating point `3.5`, expected an integer in u32 range",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"pages_to_release":null}"#,
        CONF,
        "pages_to_release: invalid type: null, expected a list",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"pages_to_release":3}"#,
        CONF,
        "pages_to_release: invalid type: integer `3`, expected a list",
    ));
    // Pages beyond the pool: no server handed them out; the whole request is refused.
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",2],["x",8]]}"#,
        CONF,
        "confirmations[1]: page 8 is out of range, rank 0 has 8 pages",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["pending",2]],"pages_to_release":[3,8]}"#,
        CONF,
        "pages_to_release[1]: page 8 is out of range, rank 0 has 8 pages",
    ));
    t.push(bad(
        CONFIRM,
        r#"{"rank":1,"pages_to_release":[4294967295]}"#,
        CONF,
        "pages_to_release[0]: page 4294967295 is out of range, rank 1 has 8 pages",
    ));
    // Pages not reserved for that key: 409 when every confirmation is refused, releases not applied.
    t.push(exact(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["x",5]],"pages_to_release":[2]}"#,
        409,
        &because(NOTHING, r#"confirmations[0] ["x", 5]: page is not reserved (never allocated, released, or expired)"#),
    ));
    t.push(exact(
        CONFIRM,
        r#"{"rank":0,"confirmations":[["other",2]]}"#,
        409,
        &because(NOTHING, r#"confirmations[0] ["other", 2]: page is reserved for another key"#),
    ));
    t.push(exact(CONFIRM, r#"{"rank":0,"confirmations":[["other",0],["k1",1]]}"#, 409,
        &because(NOTHING, r#"confirmations[0] ["other", 0]: page holds another key; confirmations[1] ["k1", 1]: page holds another key"#)));
    // `pending` is reserved on rank 0, not on rank 1.
    t.push(exact(
        CONFIRM,
        r#"{"rank":1,"confirmations":[["pending",2]]}"#,
        409,
        &because(
            NOTHING,
            r#"confirmations[0] ["pending", 2]: page is not reserved (never allocated, released, or expired)"#,
        ),
    ));
    {
        let pairs: Vec<String> = (0..18).map(|i| format!(r#"["x{i}",5]"#)).collect();
        let shown: Vec<String> = (0..16)
            .map(|i| {
                format!(
                    r#"confirmations[{i}] ["x{i}", 5]: page is not reserved (never allocated, released, or expired)"#
                )
            })
            .collect();
        t.push(exact(
            CONFIRM,
            format!(r#"{{"rank":0,"confirmations":[{}]}}"#, pairs.join(",")),
            409,
            &because(NOTHING, &format!("{}; and 2 more", shown.join("; "))),
        ));
    }
    t.push(exact(CONFIRM, r#"{"rank":5,"confirmations":[["pending",2]]}"#, 404, "Rank 5 not initialized"));
    t.push(exact(CONFIRM, r#"{"rank":5,"pages_to_release":[0]}"#, 404, "Rank 5 not initialized"));

    // ---- initialize ----
    let rank3 = "/rank/3/initialize";
    t.push(bad(INIT0, r#"{"num_pages":0}"#, INIT, "num_pages must be at least 1"));
    t.push(bad(rank3, r#"{"num_pages":0,"role":"worker"}"#, INIT, "num_pages must be at least 1"));
    t.push(bad(rank3, r#"{}"#, INIT, "member 'num_pages' is missing"));
    t.push(bad(INIT0, r#"{"role":"worker"}"#, INIT, "member 'num_pages' is missing"));
    t.push(bad(rank3, r#"{"pages":8}"#, INIT, "member 'num_pages' is missing"));
    t.push(bad(
        INIT0,
        r#"{"num_pages":-1}"#,
        INIT,
        "num_pages: invalid value: integer `-1`, expected an integer in u32 range",
    ));
    t.push(bad(
        INIT0,
        r#"{"num_pages":4294967296}"#,
        INIT,
        "num_pages: invalid value: integer `4294967296`, expected an integer in u32 range",
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8.0}"#,
        INIT,
        "num_pages: invalid type: floating point `8.0`, expected an integer in u32 range",
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":1.5e3}"#,
        INIT,
        "num_pages: invalid type: floating point `1500.0`, expected an integer in u32 range",
    ));
    // The peer makes one page of `true`.
    t.push(bad(
        rank3,
        r#"{"num_pages":true}"#,
        INIT,
        "num_pages: invalid type: boolean `true`, expected an integer in u32 range",
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":"8"}"#,
        INIT,
        r#"num_pages: invalid type: string "8", expected an integer in u32 range"#,
    ));
    t.push(bad(
        INIT0,
        r#"{"num_pages":null}"#,
        INIT,
        "num_pages: invalid type: null, expected an integer in u32 range",
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8,"role":"admin"}"#,
        INIT,
        r#"role: invalid value: string "admin", expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8,"role":"Worker"}"#,
        INIT,
        r#"role: invalid value: string "Worker", expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        INIT0,
        r#"{"num_pages":0,"role":"SCHEDULER"}"#,
        INIT,
        r#"role: invalid value: string "SCHEDULER", expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8,"role":""}"#,
        INIT,
        r#"role: invalid value: string "", expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8,"role":null}"#,
        INIT,
        r#"role: invalid type: null, expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8,"role":1}"#,
        INIT,
        r#"role: invalid type: integer `1`, expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        rank3,
        r#"{"num_pages":8,"role":["worker"]}"#,
        INIT,
        r#"role: invalid type: sequence, expected "worker" or "scheduler""#,
    ));
    t.push(bad(
        INIT0,
        r#"{"num_pages":-1,"role":"scheduler"}"#,
        INIT,
        "num_pages: invalid value: integer `-1`, expected an integer in u32 range",
    ));
    // A re-size of rank 0 (which would drop k1, k2) inside an otherwise bad body.
    t.push(bad(INIT0, r#"{"num_pages":16,"meta":{"a":1,"a":2}}"#, INIT, "meta: duplicate member 'a'"));
    t.push(bad(INIT0, r#"{"num_pages":16,"num_pages":16}"#, INIT, "duplicate member 'num_pages'"));
    t.push(bad(INIT0, r#"{"num_pages":16,"role":"worker","role":"scheduler"}"#, INIT, "duplicate member 'role'"));
    // Path ranks that are not plain decimal digits in u32 range (the body would be valid).
    for seg in ["abc", "-1", "1.0", "+1", "0x1", "1e0", "%31", "4294967296", "99999999999999999999", "", "0_0", "%20"] {
        t.push(bad(
            &format!("/rank/{seg}/initialize"),
            r#"{"num_pages":8}"#,
            INIT,
            &format!("path rank '{seg}' is not a decimal integer in u32 range"),
        ));
    }

    // ---- Unknown routes and wrong methods: a JSON detail, nothing applied. ----
    for (method, path) in [
        ("POST", "/keys/batch_delete"),
        ("POST", "/keys/batch_allocate/"),
        ("POST", "/rank/0/initialize/"),
        ("POST", "/rank/0/init"),
        ("POST", "/"),
        ("POST", "/keys"),
        ("POST", "/KEYS/BATCH_EXISTS"),
        ("POST", "/clear/"),
        ("PUT", "/rank/0/initialize/x"),
    ] {
        t.push(case(
            method,
            path,
            r#"{"rank":0,"keys":[["new",""]]}"#,
            404,
            "Not Found",
            &format!("no route {method} {path}"),
        ));
    }
    for (method, path, body) in [
        ("GET", ALLOC, r#"{"rank":0,"keys":[["new",""]]}"#),
        ("PUT", ALLOC, r#"{"rank":0,"keys":[["new",""]]}"#),
        ("GET", CONFIRM, r#"{"rank":0,"confirmations":[["pending",2]]}"#),
        ("DELETE", CONFIRM, r#"{"rank":0,"confirmations":[["pending",2]]}"#),
        ("GET", INIT0, r#"{"num_pages":16}"#),
        ("PATCH", INIT0, r#"{"num_pages":16}"#),
        ("GET", EXISTS, r#"{"keys":["k1"]}"#),
        ("GET", LOCS, r#"{"rank":0,"keys":["k1"]}"#),
        ("GET", "/clear", ""),
        ("DELETE", "/clear", ""),
        ("OPTIONS", "/clear", ""),
    ] {
        t.push(case(method, path, body, 405, "Method Not Allowed", &format!("{path} accepts POST, not {method}")));
    }
    for method in ["POST", "PUT", "DELETE"] {
        t.push(case(method, "/health", "{}", 405, "Method Not Allowed", &format!("/health accepts GET, not {method}")));
    }

    // ---- Bodies over --max-body: 413, nothing applied (not even /clear, whose body is ignored). ----
    let pad = |body: &str, total: usize| {
        let v = body.trim_end_matches('}');
        let filler = total - v.len() - r#","pad":""}"#.len();
        format!(r#"{v},"pad":"{}"}}"#, "p".repeat(filler))
    };
    for (path, _, valid) in routes() {
        t.push(exact(path, pad(valid, MAX_BODY + 1), 413, TOO_LARGE));
        let big = pad(valid, 3 * MAX_BODY).into_bytes();
        let chunks = big.chunks(1000).map(<[u8]>::to_vec).collect();
        t.push(Case {
            method: "POST",
            path: path.into(),
            send: Send::Chunked(chunks),
            status: 413,
            want: Want::Is(TOO_LARGE.into()),
        });
    }
    t.push(exact("/clear", vec![b' '; MAX_BODY + 1], 413, TOO_LARGE));
    t.push(Case {
        method: "POST",
        path: "/clear".into(),
        send: Send::Chunked(vec![vec![b'x'; 3000], vec![b'x'; 3000]]),
        status: 413,
        want: Want::Is(TOO_LARGE.into()),
    });
    for (path, n) in [(ALLOC, 4097), (CONFIRM, 1 << 40), (EXISTS, 1 << 62), ("/clear", 1 << 30), (INIT0, 10_000_000)] {
        t.push(Case {
            method: "POST",
            path: path.into(),
            send: Send::Declared(n),
            status: 413,
            want: Want::Is(TOO_LARGE.into()),
        });
    }
    t
}

/// The table's server: ranks 0 and 1 with 8 pages each, `k1` (pages 0) and `k2` (page 1)
/// complete on both, `pending` reserved on rank 0 (page 2).
fn seeded() -> Server {
    let s = Server::start(ServeConfig { max_body: MAX_BODY, ..common::config() });
    s.init(0, 8);
    s.init(1, 8);
    for rank in 0..2 {
        assert_eq!(s.allocate(rank, &["k1", "k2"]), vec![("k1".into(), 0), ("k2".into(), 1)]);
        s.confirm_ok(rank, &[("k1", 0), ("k2", 1)], &[]);
    }
    assert_eq!(s.allocate(0, &["pending"]), vec![("pending".into(), 2)]);
    s
}

const RANKS: [u32; 3] = [0, 1, 3];
const KEYS_SEEN: [&str; 5] = ["k1", "k2", "pending", "new", "other"];

/// Judges one reply against its case; `Err` says what is wrong.
fn judge(c: &Case, r: &Resp) -> Result<(), String> {
    if r.status >= 500 {
        return Err(format!("a {} for bad input", r.status));
    }
    if r.status != c.status {
        return Err(format!("status {} instead of {}", r.status, c.status));
    }
    if r.content_type.as_deref() != Some("application/json") {
        return Err(format!("Content-Type {:?}", r.content_type));
    }
    let v: serde_json::Value = serde_json::from_slice(&r.body).map_err(|e| format!("body is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("body is not an object")?;
    if obj.len() != 1 {
        return Err("body has members other than detail".into());
    }
    let detail = obj.get("detail").and_then(|d| d.as_str()).ok_or("no string detail")?;
    // The peer's words first, where the peer has them.
    if c.status == 400 {
        let peer = peer_text(&c.path).ok_or("a 400 on a route without a peer text")?;
        if !detail.starts_with(&format!("{peer} (")) {
            return Err(format!("detail {detail:?} does not start with the peer's {peer:?}"));
        }
    }
    let (start, wanted) = match c.status {
        404 if c.want_text().starts_with("Rank ") => ("Rank ", "uninitialized rank"),
        404 => ("Not Found (", "unknown route"),
        405 => ("Method Not Allowed (", "wrong method"),
        409 if c.path == CONFIRM => (NOTHING, "nothing confirmed"),
        413 => ("Request body too large", "too large"),
        _ => ("", ""),
    };
    if !detail.starts_with(start) {
        return Err(format!("detail {detail:?} is not a {wanted} text"));
    }
    match &c.want {
        Want::Is(want) if detail != want => Err(format!("detail {detail:?}\n      instead of {want:?}")),
        Want::Like(prefix, contains) => {
            let head = format!("{prefix} (");
            if detail.starts_with(&head) && detail[head.len()..].contains(contains) {
                Ok(())
            } else {
                Err(format!("detail {detail:?}\n      is not {head:?}…{contains:?}…"))
            }
        }
        _ => Ok(()),
    }
}

impl Case {
    fn want_text(&self) -> &str {
        match &self.want {
            Want::Is(s) | Want::Like(s, _) => s,
        }
    }
}

fn send(s: &Server, c: &Case) -> Resp {
    match &c.send {
        Send::Body(b) => s.request(c.method, &c.path, b),
        Send::Chunked(chunks) => s.chunked(c.method, &c.path, chunks),
        Send::Declared(n) => s.declared_length(c.method, &c.path, *n),
    }
}

#[test]
fn the_table_has_at_least_40_cases_and_covers_every_status() {
    let t = table();
    assert!(t.len() >= 40, "{} cases", t.len());
    for status in [400, 404, 405, 409, 413] {
        assert!(t.iter().any(|c| c.status == status), "no case for {status}");
    }
    eprintln!("{} bad-input cases", t.len());
}

#[test]
fn every_bad_input_gets_its_status_and_detail_and_changes_nothing() {
    let s = seeded();
    let start = s.fingerprint(&RANKS, &KEYS_SEEN);
    // The seeded state, spelled out once so the fingerprint is known to mean something.
    assert!(start.contains(r#""keys":2"#), "{start}");
    assert!(
        start.contains(r#"{"committed":2,"free":5,"num_pages":8,"quarantined":0,"rank":0,"reserved":1}"#),
        "{start}"
    );
    assert!(start.contains(r#"exists 200 {"exists":[true,true,false,false,false]}"#), "{start}");
    assert!(start.contains(r#"locations[0] 200 {"locations":[0,1,null,null,null]}"#), "{start}");
    assert!(start.contains(r#"locations[3] 404 {"detail":"Rank 3 not initialized"}"#), "{start}");

    // Each case is judged against the state the case before it left, so a case that changes the
    // state is named once, not every case after it.
    let mut before = start;
    cases::check(&table(), |c| {
        let r = send(&s, c);
        let judged = judge(c, &r).map_err(|why| format!("{}\n    {why}\n    got {r:?}", c.label()));
        let now = s.fingerprint(&RANKS, &KEYS_SEEN);
        if now != before {
            let was = std::mem::replace(&mut before, now);
            return Err(format!("{}\n    changed the state:\n{was}\n  →\n{before}", c.label()));
        }
        judged
    });

    // The reservation is still usable: nothing above touched it.
    s.confirm_ok(0, &[("pending", 2)], &[]);
    let h = s.health_without_uptime();
    assert!(h.contains(r#"{"committed":3,"free":5,"num_pages":8,"quarantined":0,"rank":0,"reserved":0}"#), "{h}");
}

#[test]
fn the_fingerprint_sees_every_kind_of_change() {
    // So "unchanged" above means something: each state change below shows in the fingerprint.
    let s = seeded();
    let mut last = s.fingerprint(&RANKS, &KEYS_SEEN);
    let mut changed = |what: &str, s: &Server| {
        let now = s.fingerprint(&RANKS, &KEYS_SEEN);
        assert_ne!(now, last, "{what} did not show in the fingerprint");
        last = now;
    };
    assert_eq!(s.allocate(0, &["new"]), vec![("new".into(), 3)]);
    changed("a reservation", &s);
    s.confirm_ok(0, &[("new", 3)], &[]);
    changed("a commit on one rank of two", &s);
    s.confirm_ok(0, &[("pending", 2)], &[]);
    changed("a second commit", &s);
    assert_eq!(s.allocate(1, &["new"]), vec![("new".into(), 2)]);
    s.confirm_ok(1, &[("new", 2)], &[]);
    changed("a key becoming complete", &s);
    s.init(3, 4);
    changed("a new rank", &s);
    s.init(1, 16);
    changed("a re-sized rank", &s);
    s.post("/clear", "").expect_no_content();
    changed("clear", &s);
}

#[test]
fn the_body_limit_is_inclusive() {
    let s = seeded();
    let start = s.fingerprint(&RANKS, &KEYS_SEEN);
    let body = |n: usize| {
        let head = r#"{"keys":["k1","k2"],"pad":""#;
        format!("{head}{}\"}}", " ".repeat(n - head.len() - 2))
    };
    assert_eq!(body(MAX_BODY).len(), MAX_BODY);
    s.post(EXISTS, body(MAX_BODY)).expect_json(200, r#"{"exists":[true,true]}"#);
    s.post(EXISTS, body(MAX_BODY + 1)).expect_detail(413, TOO_LARGE);
    let chunks = |b: String| b.into_bytes().chunks(777).map(<[u8]>::to_vec).collect::<Vec<_>>();
    s.chunked("POST", EXISTS, &chunks(body(MAX_BODY))).expect_json(200, r#"{"exists":[true,true]}"#);
    s.chunked("POST", EXISTS, &chunks(body(MAX_BODY + 1))).expect_detail(413, TOO_LARGE);
    s.declared_length("POST", EXISTS, MAX_BODY as u64 + 1).expect_detail(413, TOO_LARGE);
    assert_eq!(s.fingerprint(&RANKS, &KEYS_SEEN), start);
}

#[test]
fn nesting_far_past_the_recursion_limit_is_refused_without_exhausting_the_stack() {
    let s = Server::start_default();
    s.init(0, 4);
    let start = s.fingerprint(&[0], &["a"]);
    let n = 200_000;
    let arrays = format!("{}{}", "[".repeat(n), "]".repeat(n));
    let objects = format!("{}1{}", r#"{"a":"#.repeat(n), "}".repeat(n));
    for (path, peer, valid) in routes() {
        let v = valid.trim_end_matches('}');
        for deep in [&arrays, &objects] {
            let r = s.post(path, format!("{v},\"x\":{deep}}}"));
            assert_eq!(r.status, 400, "{path}: {r:?}");
            let d = r.detail();
            assert!(d.starts_with(&format!("{peer} (body is not valid JSON: recursion limit exceeded")), "{path}: {d}");
            // The body itself at top level.
            let r = s.post(path, deep.as_bytes());
            assert_eq!(r.status, 400, "{path}: {r:?}");
            assert!(r.detail().starts_with(&format!("{peer} (")), "{path}: {r:?}");
        }
    }
    assert_eq!(s.fingerprint(&[0], &["a"]), start);
}

#[test]
fn broken_http_framing_is_a_client_error() {
    // These never reach a handler's JSON decoding: the framing itself is broken. Whoever answers
    // (hyper or the body reader), it is a 4xx, never a 5xx, never text/plain, and nothing applies.
    let s = seeded();
    let start = s.fingerprint(&RANKS, &KEYS_SEEN);
    let host = s.addr;
    let allocate = r#"{"rank":0,"keys":[["new",""]]}"#;
    let reqs: Vec<(&str, Vec<u8>)> = vec![
        (
            "a chunk size that is not hex",
            format!("POST {ALLOC} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{allocate}\r\n0\r\n\r\n").into_bytes(),
        ),
        (
            "a Content-Length beyond hyper's maximum",
            format!("POST {ALLOC} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n", u64::MAX).into_bytes(),
        ),
        (
            "a Content-Length that is not a number",
            format!("POST {ALLOC} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: abc\r\n\r\n{allocate}").into_bytes(),
        ),
        (
            "two different Content-Lengths",
            format!("POST {ALLOC} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 2\r\nContent-Length: {}\r\n\r\n{allocate}", allocate.len()).into_bytes(),
        ),
    ];
    for (what, raw) in reqs {
        let r = s.raw(&raw);
        assert!((400..500).contains(&r.status), "{what}: {r:?}");
        assert!(!r.content_type.as_deref().is_some_and(|t| t.starts_with("text/plain")), "{what}: {r:?}");
        if r.content_type.is_some() {
            // Answered by kvpages: a JSON detail.
            let _ = r.detail();
        }
        assert_eq!(s.fingerprint(&RANKS, &KEYS_SEEN), start, "{what} changed the state");
    }
}

//! The table checker every Rust test of requests uses ([`check`]), and SGLang's refusals and
//! malformed requests, each with its status and exact `detail`, sent after [`INIT`]. The wire
//! crate's tests check each answer; the server's parity test (`crates/host/tests/wire_parity.rs`)
//! sends the same requests to a real server and to the wire crate and requires the same bytes.

/// Checks every case of a table, in order, and fails once at the end, naming each case that
/// failed and why: one broken rule shows everything it breaks, not just the first case. Every
/// table of requests in the Rust tests (the wire crate's, the server's parity and bad-input tables)
/// goes through here. `one` returns `Err(what is wrong)`, starting with the case's label.
pub fn check<C>(cases: impl IntoIterator<Item = C>, mut one: impl FnMut(C) -> Result<(), String>) {
    let mut failures = Vec::new();
    let mut total = 0;
    for (i, case) in cases.into_iter().enumerate() {
        total += 1;
        if let Err(why) = one(case) {
            failures.push(format!("#{i} {why}"));
        }
    }
    assert!(total > 0, "an empty table checks nothing");
    assert!(failures.is_empty(), "{} of {total} cases failed:\n{}", failures.len(), failures.join("\n"));
}

/// The request before the table: rank 0's `kv` pool with 4 pages.
pub const INIT: (&str, &str) = ("/0/initialize", r#"{"num_pages":4}"#);

/// `POST path body` → status and `detail`.
pub const REFUSALS: &[(&str, &str, u16, &str)] = &[
    ("/0/initialize", r#"{"namespace":"kv"}"#, 400, "Invalid initialize request (member 'num_pages' is missing)"),
    ("/0/initialize", r#"{"num_pages":0}"#, 400, "Invalid initialize request (num_pages must be at least 1)"),
    ("/0/exists", r#"{"keys":"k"}"#, 400, "Invalid exists request (keys: invalid type: string \"k\", expected a list)"),
    (
        "/0/exists",
        r#"{"keys":[],"namespace":7}"#,
        400,
        "Invalid exists request (namespace: invalid type: integer `7`, expected a namespace (a string of at most 256 bytes))",
    ),
    (
        "/0/reserve_and_allocate_page_indices",
        r#"{"keys":["ab"]}"#,
        400,
        "Invalid reserve_and_allocate_page_indices request (keys[0]: invalid type: string \"ab\", expected a [key, prefix_key] pair)",
    ),
    (
        "/0/confirm_write",
        r#"{"written_keys_to_confirm":[["k",9]]}"#,
        400,
        "Invalid confirm_write request (written_keys_to_confirm[0]: page 9 is out of range, rank 0 has 4 pages)",
    ),
    (
        "/0/confirm_write",
        r#"{"pages_to_release":[4]}"#,
        400,
        "Invalid confirm_write request (pages_to_release[0]: page 4 is out of range, rank 0 has 4 pages)",
    ),
    (
        "/0/confirm_write",
        r#"{"written_keys_to_confirm":[["k",1]]}"#,
        409,
        "No confirmation matched a reservation; nothing was applied (written_keys_to_confirm[0] [\"k\", 1]: page is not reserved (never allocated, released, or expired))",
    ),
    ("/1/exists", r#"{"keys":[]}"#, 404, "Rank 1 namespace 'kv' not initialized. Please call /1/initialize first."),
    (
        "/0/get_page_indices",
        r#"{"keys":[],"namespace":"swa"}"#,
        404,
        "Rank 0 namespace 'swa' not initialized. Please call /0/initialize first.",
    ),
    ("/0/nope", "{}", 404, "Not Found (no route POST /0/nope)"),
    ("/x/exists", "{}", 404, "Not Found (no route POST /x/exists)"),
    ("/4294967296/exists", "{}", 404, "Not Found (no route POST /4294967296/exists)"),
    ("/0/exist%73", "{}", 404, "Not Found (no route POST /0/exist%73)"),
];

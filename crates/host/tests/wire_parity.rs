//! The server and `kvpages_wire` driven by hand (as the browser simulator drives it) give
//! the same answers: the same requests go to a real server over HTTP and through `wire::parse` +
//! `Core::apply` + `Pending::answer`, and status, body bytes and headers must agree — for valid
//! requests of every route, malformed ones, and paths and methods the router does not take
//! (the server's own routes are compared for the methods they do not take).

#[path = "../../wire/tests/cases/mod.rs"]
mod cases;
mod common;

use common::{Resp, SEED, Server, peer_settings};
use kvpages_core::{Core, Settings};
use kvpages_host::config::ServeConfig;
use kvpages_host::engine::EngineKind;
use kvpages_host::server;
use kvpages_wire::{self as wire, HostInfo, Parsed};

/// No read leases, so `/admin/keys/{key}` shows no time-dependent figure.
fn settings() -> Settings {
    Settings { read_lease: 0, ..peer_settings() }
}

/// The simulator's side: a core, applied at a fixed time (reservations last 60 s, far longer
/// than the test).
struct Sim(Core);

/// The route `path` names among the wire crate's and the server's own (as the router picks):
/// its method, and whether it is the server's own.
fn route_of(path: &str) -> Option<(&'static str, bool)> {
    let own = server::own_route_table().iter().map(|&(method, path)| (path, (method, true)));
    let wire = wire::ROUTES.iter().map(|r| (r.path, (r.method, false)));
    wire::best_match(wire.chain(own), path)
}

impl Sim {
    /// `None` for a request a route of the server's own serves (not the wire crate's business);
    /// another method on such a route is the same 405 as on a wire route.
    fn answer(&mut self, method: &str, path: &str, body: &[u8], uptime: f64) -> Option<wire::Answer> {
        if let Some((allowed, true)) = route_of(path) {
            let served = method == allowed || (allowed == "GET" && method == "HEAD");
            return (!served).then(|| wire::method_not_allowed(method, path, allowed));
        }
        match wire::parse(method, path, body) {
            Parsed::Answer(a) => Some(a),
            Parsed::Apply(p) => {
                let result = self.0.apply(0, p.command());
                let host = HostInfo { engine: "native", engine_traps: 0, uptime_seconds: uptime };
                Some(p.answer_with(result, &host))
            }
        }
    }
}

/// Sends one request both ways and compares: `Ok(false)` for the server's own routes (not
/// compared), `Err` naming what differs.
fn compare(server: &Server, sim: &mut Sim, method: &str, path: &str, body: &str) -> Result<bool, String> {
    let resp: Resp = server.request(method, path, body.as_bytes());
    let label = format!("{method} {path} {body}");
    // `/stats` carries the server's uptime; the simulator is told the same.
    let uptime = if path == "/stats" && resp.status == 200 && method == "GET" {
        resp.json()["uptime_seconds"].as_f64().ok_or(format!("{label}: no uptime"))?
    } else {
        0.0
    };
    let Some(want) = sim.answer(method, path, body.as_bytes(), uptime) else {
        return Ok(false);
    };
    // HEAD: the server sends no body, whatever the wire crate's answer holds.
    let got_text = resp.text();
    let want_text = if method == "HEAD" { String::new() } else { String::from_utf8_lossy(&want.body).into_owned() };
    if (resp.status, got_text) != (want.status, want_text.as_str()) {
        return Err(format!("{label}\n    server {} {got_text}\n      wire {} {want_text}", resp.status, want.status));
    }
    let content_type = if want.status == 204 { None } else { Some("application/json") };
    if resp.content_type.as_deref() != content_type {
        return Err(format!("{label}: Content-Type {:?}, want {content_type:?}", resp.content_type));
    }
    let allow = (want.status == 405).then(|| route_of(path).expect("a 405 names a route").0);
    if resp.header("allow") != allow {
        return Err(format!("{label}: Allow {:?}, want {allow:?}", resp.header("allow")));
    }
    Ok(true)
}

#[test]
fn the_server_answers_as_the_wire_module_does() {
    let server =
        Server::start(ServeConfig { engine: EngineKind::Native, settings: settings(), ..ServeConfig::default() });
    let mut sim = Sim(Core::new(SEED, settings()));
    let scenario: &[(&str, &str, &str)] = &[
        ("POST", "/rank/0/initialize", r#"{"num_pages":4}"#),
        ("POST", "/rank/1/initialize", r#"{"num_pages":4,"role":"worker"}"#),
        ("POST", "/rank/2/initialize", r#"{"role":"scheduler"}"#),
        ("POST", "/keys/batch_allocate", r#"{"rank":0,"keys":[["a",""],["b",""],["a",""]]}"#),
        ("POST", "/keys/batch_allocate", r#"{"rank":1,"keys":[["a",""]]}"#),
        ("POST", "/keys/confirm_write", r#"{"rank":0,"confirmations":[["a",0]],"pages_to_release":[1]}"#),
        ("POST", "/keys/confirm_write", r#"{"rank":1,"confirmations":[["a",0]]}"#),
        ("POST", "/keys/confirm_write", r#"{"rank":1,"confirmations":[["zz",3]]}"#),
        ("POST", "/keys/confirm_write", r#"{"rank":1,"confirmations":[["zz",9]]}"#),
        ("POST", "/keys/batch_exists", r#"{"keys":["a","b"]}"#),
        ("POST", "/keys/get_locations", r#"{"rank":1,"keys":["a","b"]}"#),
        ("GET", "/admin/keys/a", ""),
        ("HEAD", "/admin/keys/a", ""),
        ("GET", "/admin/keys/b", ""),
        ("GET", "/admin/keys/%ff", ""),
        ("GET", "/stats", ""),
        ("POST", "/0/initialize", r#"{"num_pages":4}"#),
        ("POST", "/0/reserve_and_allocate_page_indices", r#"{"keys":[["h1",""],["h2",""],["h1",""]]}"#),
        ("POST", "/0/confirm_write", r#"{"written_keys_to_confirm":[["h1",3]],"pages_to_release":[2]}"#),
        ("POST", "/0/confirm_write", r#"{"written_keys_to_confirm":[["h9",0]]}"#),
        ("POST", "/0/exists", r#"{"keys":["h1","h2"]}"#),
        ("POST", "/0/get_page_indices", r#"{"keys":["h1","h2"]}"#),
        ("POST", "/0/exists", r#"{"keys":[],"namespace":"mamba"}"#),
        ("POST", "/0/initialize", r#"{"num_pages":0}"#),
        ("POST", "/0/delete_keys", r#"{"keys":["h1"]}"#),
        ("POST", "/0/clear", "{}"),
        ("GET", "/stats", ""),
        ("POST", "/keys/delete", r#"{"keys":["a","b"]}"#),
        ("POST", "/keys/batch_allocate", r#"{"rank":0,"keys":"a"}"#),
        ("POST", "/keys/batch_allocate", "\u{feff}{}"),
        ("POST", "/clear", "anything"),
        ("POST", "/keys/get_locations", r#"{"rank":0,"keys":[]}"#),
    ];
    let mut compared = 0;
    cases::check(scenario, |&(method, path, body)| {
        compared += usize::from(compare(&server, &mut sim, method, path, body)?);
        Ok(())
    });
    let paths = [
        "/keys/batch_allocate",
        "/keys/batch_allocate/",
        "/keys/foo",
        "/keys",
        "/keys/",
        "/clear/",
        "/stats",
        "/stats/",
        "/health",
        "/metrics",
        "/admin/keys",
        "/admin/keys/",
        "/admin/keys/abc",
        "/admin/keys/abc/def",
        "/admin/foo",
        "/admin/import/sglang",
        "/admin/export/sglang",
        "/admin/export/x",
        "/rank/0/initialize",
        "/rank//initialize",
        "/rank/0/initialize/",
        "/rank/0",
        "/rank/x/initialize",
        "/rank/4294967296/initialize",
        "/0/exists",
        "/0/exists/",
        "//exists",
        "/0/",
        "/0//",
        "/a/b/c",
        "/a/b/c/d",
        "/",
        "/x",
        "/0/nope",
        "/health/x",
        "/keys/batch%5Fallocate",
        "/0/exist%73",
        "/admin/keys/a%20b",
        "/clear/x",
        "/rank/0/x",
        "/keys/delete",
        "/metrics/x",
        "/simulator",
        "/simulator/",
        "/simulator/app.js",
        "/simulator/a/b",
    ];
    let requests = paths.iter().flat_map(|path| ["GET", "POST", "HEAD", "PUT", "DELETE"].map(|method| (method, path)));
    cases::check(requests, |(method, path)| {
        // POST /admin/import/sglang would import; it is the server's own route anyway.
        let body = if method == "GET" || method == "HEAD" { "" } else { "{}" };
        compared += usize::from(compare(&server, &mut sim, method, path, body)?);
        Ok(())
    });
    // Everything but GET and HEAD of /health, /metrics, /admin/export/sglang and the four
    // simulator paths, and POST /admin/import/sglang: the server's own routes.
    assert_eq!(compared, scenario.len() + paths.len() * 5 - 15);
}

/// SGLang's refusals and malformed requests (the wire crate's table, whose exact answers its own
/// tests check): the server answers each with the same bytes.
#[test]
fn the_server_refuses_sglang_requests_as_the_wire_module_does() {
    let server =
        Server::start(ServeConfig { engine: EngineKind::Native, settings: settings(), ..ServeConfig::default() });
    let mut sim = Sim(Core::new(SEED, settings()));
    let requests = std::iter::once(cases::INIT).chain(cases::REFUSALS.iter().map(|&(path, body, _, _)| (path, body)));
    cases::check(requests, |(path, body)| match compare(&server, &mut sim, "POST", path, body)? {
        true => Ok(()),
        false => Err(format!("POST {path} is not compared, yet it is a wire route")),
    });
}

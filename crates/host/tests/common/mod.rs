//! Test harness: the real kvpages server in-process on `127.0.0.1:0`, and a small raw HTTP/1.1
//! client over `std::net::TcpStream` (so tests can send anything: a GET with a body, invalid
//! UTF-8, a huge `Content-Length` with no body, chunked bodies).
//!
//! Each [`Server`] runs on its own thread with its own tokio runtime and is shut down (gracefully,
//! through `run`'s shutdown future) when dropped. Set `KVPAGES_TEST_LOG=debug` to see the
//! server's log.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvpages_host::app::build_engine;
use kvpages_host::config::ServeConfig;
use kvpages_host::server::{router, run};

/// The hasher seed handed to the engine (replies never depend on it).
pub const SEED: u64 = 0x006b_7670_6167_6573;

/// How long the client waits for a reply before the test fails.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The peer's behaviour (`--eviction off`, no quarantine): what vLLM's server answers, page
/// numbers included. 16 MiB body limit, no world size, 60 s reservations.
pub fn config() -> ServeConfig {
    ServeConfig { settings: peer_settings(), ..ServeConfig::default() }
}

/// Core settings of `--eviction off --quarantine 0`.
pub fn peer_settings() -> kvpages_core::Settings {
    kvpages_core::Settings { eviction: kvpages_core::Eviction::Off, quarantine: 0, ..Default::default() }
}

fn init_logging() {
    if let Ok(filter) = std::env::var("KVPAGES_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}

impl Server {
    /// Starts a server with the default configuration.
    pub fn start_default() -> Server {
        Server::start(config())
    }

    /// Starts a server with `config`: `router(config, build_engine(&config, SEED))` served by `run`.
    pub fn start(config: ServeConfig) -> Server {
        init_logging();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvpages-test-server".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("tokio runtime");
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
                    let addr = listener.local_addr().expect("local addr");
                    let engine = build_engine(&config, SEED);
                    let app = router(config, engine).expect("router");
                    addr_tx.send(addr).expect("send addr");
                    run(listener, app, async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("server run");
                });
            })
            .expect("spawn server thread");
        let addr = addr_rx.recv_timeout(Duration::from_secs(10)).expect("server did not start");
        Server { addr, stop: Some(stop_tx), thread: Some(thread) }
    }

    /// Sends `raw` as is (one write) and reads the reply until the server closes the connection.
    pub fn raw(&self, raw: &[u8]) -> Resp {
        let out = self.exchange(raw);
        if raw.starts_with(b"HEAD ") { parse_head(&out) } else { parse(&out) }
    }

    fn exchange(&self, raw: &[u8]) -> Vec<u8> {
        let mut s = TcpStream::connect(self.addr).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_nodelay(true).unwrap();
        // The server may answer (413) before reading everything; a failed write is not the test's
        // concern, the reply is. Never half-close: hyper drops half-closed connections.
        let _ = s.write_all(raw);
        let mut out = Vec::new();
        let mut buf = [0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && !out.is_empty() => break,
                Err(e) => {
                    panic!("reading the reply: {e} (got {} bytes: {:?})", out.len(), String::from_utf8_lossy(&out))
                }
            }
        }
        out
    }

    /// `method path` with `body` and a `Content-Length` (also for GET), `Connection: close`.
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> Resp {
        self.request_with(method, path, &[("Content-Type", "application/json")], body)
    }

    /// Like [`Server::request`] with extra headers (no default `Content-Type`).
    pub fn request_with(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", self.addr);
        for (name, value) in headers {
            req.push_str(&format!("{name}: {value}\r\n"));
        }
        req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let mut bytes = req.into_bytes();
        bytes.extend_from_slice(body);
        self.raw(&bytes)
    }

    /// `method path` whose headers declare `Content-Length: length` but no body is sent.
    pub fn declared_length(&self, method: &str, path: &str, length: u64) -> Resp {
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n",
            self.addr
        );
        self.raw(req.as_bytes())
    }

    /// `method path` with a chunked body made of `chunks`.
    pub fn chunked(&self, method: &str, path: &str, chunks: &[Vec<u8>]) -> Resp {
        let mut bytes = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
            self.addr
        )
        .into_bytes();
        for c in chunks.iter().filter(|c| !c.is_empty()) {
            bytes.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            bytes.extend_from_slice(c);
            bytes.extend_from_slice(b"\r\n");
        }
        bytes.extend_from_slice(b"0\r\n\r\n");
        self.raw(&bytes)
    }

    /// `POST path` with `body`.
    pub fn post(&self, path: &str, body: impl AsRef<[u8]>) -> Resp {
        self.request("POST", path, body.as_ref())
    }

    /// `GET path` with no body.
    pub fn get(&self, path: &str) -> Resp {
        self.request_with("GET", path, &[], b"")
    }

    /// `GET /health` minus `uptime_seconds`, as compact JSON with sorted members.
    pub fn health_without_uptime(&self) -> String {
        let r = self.get("/health");
        assert_eq!(r.status, 200, "/health: {r:?}");
        let mut v = r.json();
        let obj = v.as_object_mut().expect("health is an object");
        assert!(obj.remove("uptime_seconds").is_some_and(|u| u.is_f64()), "uptime_seconds missing: {}", r.text());
        serde_json::to_string(&v).unwrap()
    }

    /// Everything the read-only routes show: `/health` (minus uptime), `batch_exists(keys)` and
    /// `get_locations(rank, keys)` for each of `ranks`. Reading never changes the state.
    pub fn fingerprint(&self, ranks: &[u32], keys: &[&str]) -> String {
        let keys_json = serde_json::to_string(keys).unwrap();
        let mut fp = self.health_without_uptime();
        let r = self.post("/keys/batch_exists", format!(r#"{{"keys":{keys_json}}}"#));
        fp.push_str(&format!("\nexists {} {}", r.status, r.text()));
        for rank in ranks {
            let r = self.post("/keys/get_locations", format!(r#"{{"rank":{rank},"keys":{keys_json}}}"#));
            fp.push_str(&format!("\nlocations[{rank}] {} {}", r.status, r.text()));
        }
        fp
    }

    /// `POST /rank/{rank}/initialize {"num_pages": n}`, asserting the 200.
    pub fn init(&self, rank: u32, num_pages: u32) {
        let r = self.post(&format!("/rank/{rank}/initialize"), format!(r#"{{"num_pages":{num_pages}}}"#));
        r.expect_json(200, &format!(r#"{{"message":"Rank {rank} initialized with {num_pages} pages"}}"#));
    }

    /// `batch_allocate(rank, keys)`: the `results` as (key, page).
    pub fn allocate(&self, rank: u32, keys: &[&str]) -> Vec<(String, i64)> {
        let pairs: Vec<(&str, &str)> = keys.iter().map(|k| (*k, "")).collect();
        let body = serde_json::json!({ "rank": rank, "keys": pairs }).to_string();
        let r = self.post("/keys/batch_allocate", body);
        assert_eq!(r.status, 200, "batch_allocate: {r:?}");
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        let v = r.json();
        assert_eq!(v["rank"], rank, "{}", r.text());
        v["results"]
            .as_array()
            .expect("results")
            .iter()
            .map(|p| (p[0].as_str().unwrap().to_owned(), p[1].as_i64().unwrap()))
            .collect()
    }

    /// `confirm_write(rank, confirmations, releases)`: the reply.
    pub fn confirm(&self, rank: u32, confirmations: &[(&str, u32)], releases: &[u32]) -> Resp {
        let body = serde_json::json!({ "rank": rank, "confirmations": confirmations, "pages_to_release": releases })
            .to_string();
        self.post("/keys/confirm_write", body)
    }

    /// `confirm_write`, asserting the 204.
    pub fn confirm_ok(&self, rank: u32, confirmations: &[(&str, u32)], releases: &[u32]) {
        self.confirm(rank, confirmations, releases).expect_no_content();
    }

    /// `batch_exists(keys)`: the reply body.
    pub fn exists(&self, keys: &[&str]) -> String {
        let r = self.post("/keys/batch_exists", serde_json::json!({ "keys": keys }).to_string());
        assert_eq!(r.status, 200, "batch_exists: {r:?}");
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        r.text().to_owned()
    }

    /// `get_locations(rank, keys)`: the reply body.
    pub fn locations(&self, rank: u32, keys: &[&str]) -> String {
        let r = self.post("/keys/get_locations", serde_json::json!({ "rank": rank, "keys": keys }).to_string());
        assert_eq!(r.status, 200, "get_locations: {r:?}");
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        r.text().to_owned()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            // A failing test may leave a connection open; do not hang it on the drain.
            if !std::thread::panicking() {
                t.join().expect("server thread panicked");
            }
        }
    }
}

/// A reply: status, `Content-Type`, every header (lower-case names) and the decoded body.
#[derive(Clone)]
pub struct Resp {
    pub status: u16,
    pub content_type: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl std::fmt::Debug for Resp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?} {}", self.status, self.content_type, String::from_utf8_lossy(&self.body))
    }
}

impl Resp {
    /// (status, content-type, body bytes).
    pub fn parts(&self) -> (u16, Option<&str>, &[u8]) {
        (self.status, self.content_type.as_deref(), &self.body)
    }

    /// The body as UTF-8.
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("reply body is UTF-8")
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("reply is not JSON ({e}): {self:?}"))
    }

    /// A header by (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Asserts `status`, `Content-Type: application/json` and the exact body bytes.
    pub fn expect_json(&self, status: u16, body: &str) {
        assert_eq!((self.status, self.text()), (status, body), "{self:?}");
        assert_eq!(self.content_type.as_deref(), Some("application/json"), "{self:?}");
        assert_eq!(self.header("content-length"), Some(body.len().to_string().as_str()), "{self:?}");
    }

    /// Asserts an error: `status`, JSON `{"detail": detail}` exactly (the body bytes too).
    pub fn expect_detail(&self, status: u16, detail: &str) {
        let body = serde_json::json!({ "detail": detail }).to_string();
        self.expect_json(status, &body);
    }

    /// The `detail` of a `{"detail": "..."}` body; panics on any other shape.
    pub fn detail(&self) -> String {
        assert_eq!(self.content_type.as_deref(), Some("application/json"), "{self:?}");
        let v = self.json();
        let obj = v.as_object().unwrap_or_else(|| panic!("error body is not an object: {self:?}"));
        assert_eq!(obj.len(), 1, "error body has other members than detail: {self:?}");
        obj["detail"].as_str().unwrap_or_else(|| panic!("detail is not a string: {self:?}")).to_owned()
    }

    /// Asserts 204 with an empty body.
    pub fn expect_no_content(&self) {
        assert_eq!(self.status, 204, "{self:?}");
        assert!(self.body.is_empty(), "{self:?}");
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Parses the reply to a HEAD request: a head and no body, whatever `Content-Length` says.
pub fn parse_head(raw: &[u8]) -> Resp {
    parse_reply(raw, true)
}

/// Parses one HTTP/1.1 reply (head, then a `Content-Length` or chunked body, or up to EOF).
pub fn parse(raw: &[u8]) -> Resp {
    parse_reply(raw, false)
}

fn parse_reply(raw: &[u8], head_only: bool) -> Resp {
    let end = find(raw, b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete reply head in {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..end]).expect("reply head is UTF-8");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    assert!(status_line.starts_with("HTTP/1.1 "), "status line {status_line:?}");
    let status: u16 = status_line[9..12].parse().expect("status code");
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap_or_else(|| panic!("header line {l:?}"));
            (n.trim().to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect();
    let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let rest = &raw[end + 4..];
    let body = if head_only {
        assert!(rest.is_empty(), "a reply to HEAD has a body: {:?}", String::from_utf8_lossy(rest));
        Vec::new()
    } else if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(rest)
    } else if let Some(len) = get("content-length") {
        let len: usize = len.parse().expect("content-length");
        assert!(rest.len() >= len, "reply body truncated: {} of {len} bytes", rest.len());
        rest[..len].to_vec()
    } else {
        rest.to_vec()
    };
    Resp { status, content_type: get("content-type"), headers, body }
}

fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = find(rest, b"\r\n").expect("chunk size line");
        let size_text = std::str::from_utf8(&rest[..eol]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).expect("chunk size");
        rest = &rest[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

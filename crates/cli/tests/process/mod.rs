//! The real `kvpages` binary as a child process, and a raw HTTP/1.1 client for it: what the
//! durability and fault tests drive (each request on its own connection, `Connection: close`).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Proc {
    // A failed assertion must not leave a server behind (it would hold the test's output pipe).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A native server on a fresh directory `tmp(name)` and a free port, with ranks 0 and 1 of
/// `pages` pages: the directory, the port and the server.
pub fn started_with_two_ranks(name: &str, pages: u32) -> (PathBuf, u16, Proc) {
    let dir = tmp(name);
    let port = free_port();
    let p = start(&dir, port, &[]);
    init_two_ranks(p.addr, pages);
    (dir, port, p)
}

pub fn start(dir: &Path, port: u16, extra: &[&str]) -> Proc {
    start_engine("native", dir, port, extra)
}

pub fn start_engine(engine: &str, dir: &Path, port: u16, extra: &[&str]) -> Proc {
    start_with_env(engine, dir, port, extra, &[])
}

/// [`start_engine`] with `env` set (and no `KVPAGES_THREADS` from the test's own environment).
pub fn start_with_env(engine: &str, dir: &Path, port: u16, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut cmd = serve_command(engine, Some(dir), port, extra);
    cmd.envs(env.iter().copied());
    wait_ready(cmd.spawn().expect("kvpages starts"), port)
}

/// `kvpages serve` on 127.0.0.1:`port` with `engine`, on `dir` (or in memory), logging warnings
/// to the test's stderr.
pub fn serve_command(engine: &str, dir: Option<&Path>, port: u16, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpages"));
    cmd.args(["serve", "--host", "127.0.0.1", "--port", &port.to_string(), "--log", "warn", "--engine", engine]);
    match dir {
        Some(dir) => cmd.arg("--data-dir").arg(dir),
        None => cmd.arg("--in-memory"),
    };
    cmd.args(extra).env_remove("KVPAGES_THREADS").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    cmd
}

/// Waits until `child` answers `GET /health` with 200 on `port`.
pub fn wait_ready(child: Child, port: u16) -> Proc {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut p = Proc { child, addr };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _)) = request(addr, "GET", "/health", "") {
            return p;
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            panic!("kvpages exited with {status} before it was ready on {addr}");
        }
        assert!(Instant::now() < deadline, "kvpages did not become ready on {addr}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One request on its own connection: (status, body).
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).ok_or_else(|| std::io::Error::other("no status"))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// Initializes vLLM ranks 0 and 1 with `pages` pages each.
pub fn init_two_ranks(addr: SocketAddr, pages: u32) {
    for rank in 0..2 {
        let (status, body) = post(addr, &format!("/rank/{rank}/initialize"), &format!(r#"{{"num_pages":{pages}}}"#));
        assert_eq!(status, 200, "initializing rank {rank}: {body}");
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    request(addr, "POST", path, body).unwrap_or((0, String::new()))
}

pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvpages-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// free + reserved + committed + quarantined = num_pages on every rank of every space.
pub fn assert_pages_add_up(addr: SocketAddr) {
    let (status, body) = request(addr, "GET", "/stats", "").unwrap();
    assert_eq!(status, 200, "{body}");
    for space in json(&body)["spaces"].as_array().unwrap() {
        for r in space["ranks"].as_array().unwrap() {
            let sum: u64 =
                ["free", "reserved", "committed", "quarantined"].iter().map(|k| r[k].as_u64().unwrap()).sum();
            assert_eq!(sum, r["num_pages"].as_u64().unwrap(), "{r}");
        }
    }
}

/// Saves `key` on both ranks as vLLM's workers do; `Some(pages)` when both confirms were acked.
pub fn save(addr: SocketAddr, key: &str) -> Option<[i64; 2]> {
    try_save(addr, key).ok()
}

/// [`save`], or the first reply that was not a success (an allocate's -1 counts as one).
pub fn try_save(addr: SocketAddr, key: &str) -> Result<[i64; 2], (u16, String)> {
    let mut pages = [0i64; 2];
    for (rank, slot) in pages.iter_mut().enumerate() {
        let (st, body) = post(addr, "/keys/batch_allocate", &format!(r#"{{"rank":{rank},"keys":[["{key}",""]]}}"#));
        // A cut connection (a kill) gives no body to read.
        let answer = serde_json::from_str::<serde_json::Value>(&body).ok();
        let page = answer.and_then(|a| a["results"][0][1].as_i64()).filter(|&p| st == 200 && p >= 0);
        let Some(page) = page else { return Err((st, body)) };
        let confirm = format!(r#"{{"rank":{rank},"confirmations":[["{key}",{page}]]}}"#);
        let (st, body) = post(addr, "/keys/confirm_write", &confirm);
        if st != 204 {
            return Err((st, body));
        }
        *slot = page;
    }
    Ok(pages)
}

pub fn locations(addr: SocketAddr, rank: u32, keys: &[String]) -> Vec<Option<i64>> {
    let (st, body) = post(addr, "/keys/get_locations", &serde_json::json!({"rank": rank, "keys": keys}).to_string());
    assert_eq!(st, 200, "{body}");
    json(&body)["locations"].as_array().unwrap().iter().map(|v| v.as_i64()).collect()
}

pub fn unsafe_term(child: &Child) {
    // std has no SIGTERM; the `kill` command sends it.
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
}

//! `kvpages forward` in front of a real server, all on loopback: a client on the forwarder sees
//! what a client on the server sees (keep-alive and concurrent connections included), and the
//! forwarder answers 502 while the server is down and serves again once it is back.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use kvpages_host::app::build_engine;
use kvpages_host::client::Client;
use kvpages_host::config::ServeConfig;
use kvpages_host::engine::EngineKind;
use kvpages_host::forward::{self, Target};
use kvpages_host::server::{router, run};

/// A thread with a tokio runtime running `fut`'s server until the handle is dropped.
struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        if let Some(t) = self.thread.take()
            && !std::thread::panicking()
        {
            t.join().expect("thread panicked");
        }
    }
}

fn server_config() -> ServeConfig {
    ServeConfig { engine: EngineKind::Native, ..common::config() }
}

/// A kvpages server on `addr` (port 0: any free port).
fn server_on(addr: SocketAddr) -> Running {
    spawn(addr, |listener, stop| async move {
        let config = server_config();
        let app = router(config.clone(), build_engine(&config, common::SEED)).expect("router");
        run(listener, app, async {
            let _ = stop.await;
        })
        .await
        .expect("server run");
    })
}

/// A forwarder on an ephemeral port to `to`.
fn forwarder_to(to: SocketAddr) -> Running {
    let target: Target = format!("http://{to}").parse().unwrap();
    spawn("127.0.0.1:0".parse().unwrap(), move |listener, stop| async move {
        forward::run(listener, target, Duration::from_secs(2), async {
            let _ = stop.await;
        })
        .await
        .expect("forwarder run");
    })
}

fn spawn<F, Fut>(addr: SocketAddr, f: F) -> Running
where
    F: FnOnce(tokio::net::TcpListener, tokio::sync::oneshot::Receiver<()>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind(addr).await.unwrap_or_else(|e| panic!("bind {addr}: {e}"));
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            f(listener, stop_rx).await;
        });
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(10)).expect("did not start");
    Running { addr, stop: Some(stop_tx), thread: Some(thread) }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap()
}

async fn post(c: &mut Client, path: &str, body: String) -> (u16, String) {
    let r = c.post(path, body).await.unwrap_or_else(|e| panic!("{path}: {e}"));
    (r.status, String::from_utf8(r.body.to_vec()).unwrap())
}

/// Saves `keys` on `rank` through `c`: allocate, then confirm every page.
async fn save(c: &mut Client, rank: u32, keys: &[String]) -> Vec<i64> {
    let pairs: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "")).collect();
    let (status, body) =
        post(c, "/keys/batch_allocate", serde_json::json!({ "rank": rank, "keys": pairs }).to_string()).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let results = v["results"].as_array().unwrap();
    let conf: Vec<(String, i64)> =
        results.iter().map(|p| (p[0].as_str().unwrap().to_owned(), p[1].as_i64().unwrap())).collect();
    assert!(conf.iter().all(|(_, p)| *p >= 0), "{body}");
    let body = serde_json::json!({ "rank": rank, "confirmations": conf, "pages_to_release": [] }).to_string();
    assert_eq!(post(c, "/keys/confirm_write", body).await.0, 204);
    conf.into_iter().map(|(_, p)| p).collect()
}

async fn lookups(c: &mut Client, rank: u32, keys: &[String]) -> String {
    let exists = post(c, "/keys/batch_exists", serde_json::json!({ "keys": keys }).to_string()).await;
    let locs = post(c, "/keys/get_locations", serde_json::json!({ "rank": rank, "keys": keys }).to_string()).await;
    format!("{exists:?} {locs:?}")
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[test]
fn a_client_on_the_forwarder_sees_the_servers_state() {
    let server = server_on("127.0.0.1:0".parse().unwrap());
    let fwd = forwarder_to(server.addr);
    rt().block_on(async {
        // One keep-alive connection each: every request below reuses it.
        let mut via = Client::connect(fwd.addr).await.unwrap();
        let mut direct = Client::connect(server.addr).await.unwrap();
        for rank in 0..2 {
            let (status, body) =
                post(&mut via, &format!("/rank/{rank}/initialize"), r#"{"num_pages":64}"#.into()).await;
            assert_eq!(status, 200, "{body}");
        }
        let a = keys("a", 10);
        let b = keys("b", 10);
        let pa = save(&mut via, 0, &a).await;
        let pb = save(&mut direct, 0, &b).await;
        assert_eq!(pa, (0..10).collect::<Vec<i64>>());
        assert_eq!(pb, (10..20).collect::<Vec<i64>>());
        save(&mut via, 1, &a).await;
        save(&mut direct, 1, &b).await;
        let all: Vec<String> = a.iter().chain(&b).cloned().chain(["missing".to_owned()]).collect();
        for rank in 0..2 {
            assert_eq!(lookups(&mut via, rank, &all).await, lookups(&mut direct, rank, &all).await);
        }
        let (_, seen) = post(&mut via, "/keys/batch_exists", serde_json::json!({ "keys": all }).to_string()).await;
        assert_eq!(seen, format!("{{\"exists\":[{}false]}}", "true,".repeat(20)));
        // Errors pass through unchanged too.
        let bad_via = post(&mut via, "/keys/batch_allocate", "{".into()).await;
        let bad_direct = post(&mut direct, "/keys/batch_allocate", "{".into()).await;
        assert_eq!((bad_via.0, &bad_via.1), (400, &bad_direct.1));
        let health = via.get("/health").await.unwrap();
        assert_eq!(health.status, 200);
    });
}

#[test]
fn concurrent_connections_through_the_forwarder() {
    let server = server_on("127.0.0.1:0".parse().unwrap());
    let fwd = forwarder_to(server.addr);
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 20;
    rt().block_on(async {
        let mut c = Client::connect(fwd.addr).await.unwrap();
        post(&mut c, "/rank/0/initialize", r#"{"num_pages":100000}"#.into()).await;
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|t| {
                let addr = fwd.addr;
                tokio::spawn(async move {
                    let mut c = Client::connect(addr).await.unwrap();
                    let mut pages = Vec::new();
                    for round in 0..ROUNDS {
                        pages.extend(save(&mut c, 0, &keys(&format!("t{t}-r{round}"), 4)).await);
                    }
                    pages
                })
            })
            .collect();
        let mut pages = Vec::new();
        for t in tasks {
            pages.extend(t.await.unwrap());
        }
        pages.sort();
        pages.dedup();
        assert_eq!(pages.len(), CLIENTS * ROUNDS * 4, "two keys got one page");
        let all: Vec<String> =
            (0..CLIENTS).flat_map(|t| (0..ROUNDS).flat_map(move |r| keys(&format!("t{t}-r{r}"), 4))).collect();
        let mut direct = Client::connect(server.addr).await.unwrap();
        let (_, body) = post(&mut direct, "/keys/batch_exists", serde_json::json!({ "keys": all }).to_string()).await;
        assert!(!body.contains("false"), "{body}");
    });
}

/// A free loopback port (bound, then released: nothing listens there).
fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

async fn health_via(addr: SocketAddr) -> (u16, String) {
    let mut c = Client::connect(addr).await.expect("the forwarder accepts");
    let r = c.get("/health").await.expect("the forwarder answers");
    (r.status, String::from_utf8(r.body.to_vec()).unwrap())
}

#[test]
fn the_forwarder_survives_the_server_being_down_and_reconnects() {
    let upstream = free_port();
    let fwd = forwarder_to(upstream);
    let rt = rt();
    rt.block_on(async {
        // Nothing listens: 502 with the catalogue's detail, connection closed; again and again.
        for _ in 0..3 {
            let (status, body) = health_via(fwd.addr).await;
            assert_eq!(status, 502, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            let detail = v["detail"].as_str().unwrap();
            assert!(
                detail.starts_with(&format!("kvpages forward: the metadata server is unreachable ({upstream}: ")),
                "{detail}"
            );
        }
        // A POST with a body gets its 502 too (the forwarder reads the request before answering).
        let mut c = Client::connect(fwd.addr).await.unwrap();
        let r = c.post("/keys/batch_exists", vec![b' '; 100_000]).await.unwrap();
        assert_eq!(r.status, 502);
    });
    // The server comes up: the same forwarder serves.
    let server = server_on(upstream);
    let mut kept = rt.block_on(async {
        let (status, body) = health_via(fwd.addr).await;
        assert_eq!(status, 200, "{body}");
        let mut c = Client::connect(fwd.addr).await.unwrap();
        assert_eq!(post(&mut c, "/rank/0/initialize", r#"{"num_pages":8}"#.into()).await.0, 200);
        c
    });
    // The server goes away: the kept connection is closed, new ones get 502.
    drop(server);
    rt.block_on(async {
        assert!(kept.get("/health").await.is_err(), "a connection to a stopped server stays open");
        assert_eq!(health_via(fwd.addr).await.0, 502);
    });
    // And back again (a new server: a fresh state).
    let _server = server_on(upstream);
    rt.block_on(async {
        let mut c = Client::connect(fwd.addr).await.unwrap();
        assert_eq!(post(&mut c, "/rank/0/initialize", r#"{"num_pages":8}"#.into()).await.0, 200);
        assert_eq!(post(&mut c, "/keys/batch_exists", r#"{"keys":["x"]}"#.into()).await.1, r#"{"exists":[false]}"#);
    });
}

//! Client connections: the accept loop, and the limits that keep any one client from locking the
//! others out — a time limit for a request's head to arrive (slowloris), one for idle keep-alive
//! connections, and a cap on open connections below the process's descriptor limit.
//!
//! At the cap, a new connection makes room by closing the oldest idle one (a keep-alive
//! connection waiting for its next request); when every open connection is busy, the new one is
//! closed at once. Running out of descriptors anyway (`EMFILE`, another process's share of
//! `ENFILE`) closes an idle connection too, and never spins: the loop waits a moment before it
//! accepts again. One sweeper task enforces the time limits for all connections.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::ConnectInfo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use crate::telemetry::ConnectionClosed;

/// The limits on client connections (`--header-timeout`, `--idle-timeout`, `--max-connections`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest time from a request head's first byte to its last: a client that sends it
    /// slower is disconnected.
    pub header_timeout: Duration,
    /// Longest time a connection may wait for its next request (or its first).
    pub idle_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

/// `--header-timeout`'s default: a request head is a few hundred bytes.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// `--idle-timeout`'s default. The clients' connection pools (urllib3 under vLLM's and
/// SGLang's `requests` clients) notice a closed idle connection before they reuse it, so any
/// value is safe for them (`tests/python`); this one keeps a busy server's connections open.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(75);

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            header_timeout: HEADER_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            max_connections: default_max_connections(),
        }
    }
}

/// Descriptors kept for everything but client connections: the log, snapshots, the listener,
/// the runtime's own.
const RESERVED_FDS: u64 = 64;

/// The process's descriptor limit (`RLIMIT_NOFILE`, soft), if it has one.
pub fn descriptor_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// `--max-connections`' default: below the descriptor limit by an eighth of it (at least 64),
/// so the server always has descriptors left for its own files and for accepting.
pub fn default_max_connections() -> usize {
    match descriptor_limit() {
        Some(n) => n.saturating_sub(RESERVED_FDS.max(n / 8)).max(1).min(usize::MAX as u64) as usize,
        None => 1 << 20,
    }
}

/// One connection as the accept loop and the sweeper see it.
#[derive(Debug)]
struct Conn {
    /// Requests being served on it (0: idle, or reading a head).
    busy: AtomicUsize,
    /// Milliseconds (since [`Table::epoch`]) when the current request head's first byte came;
    /// 0 when no head is being read.
    head_since: AtomicU64,
    /// Milliseconds when the connection last became idle (accepted, or a reply finished).
    idle_since: AtomicU64,
    /// Why the server closes it, set just before `close` is notified.
    closing: AtomicU8,
    close: Notify,
}

impl Conn {
    fn is_idle(&self) -> bool {
        self.busy.load(Ordering::Acquire) == 0
    }

    fn close_for(&self, why: ConnectionClosed) {
        self.closing.store(why as u8 + 1, Ordering::Release);
        self.close.notify_one();
    }
}

/// The open connections, by the order they were accepted.
#[derive(Debug)]
struct Table {
    epoch: Instant,
    open: Mutex<BTreeMap<u64, Arc<Conn>>>,
}

impl Table {
    fn now_ms(&self) -> u64 {
        // Never 0, which means "not set".
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    fn len(&self) -> usize {
        self.open.lock().expect("connection table").len()
    }

    /// Closes the oldest idle connection; `false` if every one is busy.
    fn evict_oldest_idle(&self) -> bool {
        let mut open = self.open.lock().expect("connection table");
        let Some(id) = open.iter().find(|(_, c)| c.is_idle()).map(|(&id, _)| id) else { return false };
        let conn = open.remove(&id).expect("found above");
        drop(open);
        conn.close_for(ConnectionClosed::Evicted);
        true
    }

    fn remove(&self, id: u64) {
        self.open.lock().expect("connection table").remove(&id);
    }

    /// Closes every connection past a time limit.
    fn sweep(&self, limits: &Limits) {
        let now = self.now_ms();
        let ms = |d: Duration| d.as_millis() as u64;
        let mut expired = Vec::new();
        for conn in self.open.lock().expect("connection table").values() {
            if !conn.is_idle() {
                continue;
            }
            let head = conn.head_since.load(Ordering::Acquire);
            if head != 0 {
                if now.saturating_sub(head) >= ms(limits.header_timeout) {
                    expired.push((conn.clone(), ConnectionClosed::HeaderTimeout));
                }
            } else if now.saturating_sub(conn.idle_since.load(Ordering::Acquire)) >= ms(limits.idle_timeout) {
                expired.push((conn.clone(), ConnectionClosed::Idle));
            }
        }
        for (conn, why) in expired {
            conn.close_for(why);
        }
    }
}

/// The client's stream, telling its [`Conn`] when a request head starts arriving.
struct Watched {
    stream: TcpStream,
    conn: Arc<Conn>,
    table: Arc<Table>,
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before && this.conn.is_idle() && this.conn.head_since.load(Ordering::Relaxed) == 0 {
            this.conn.head_since.store(this.table.now_ms(), Ordering::Release);
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Counts a request as in flight on its connection until dropped (answered, or cut off).
struct InFlight {
    conn: Arc<Conn>,
    table: Arc<Table>,
}

impl InFlight {
    fn begin(conn: Arc<Conn>, table: Arc<Table>) -> InFlight {
        conn.busy.fetch_add(1, Ordering::AcqRel);
        conn.head_since.store(0, Ordering::Release);
        InFlight { conn, table }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn.idle_since.store(self.table.now_ms(), Ordering::Release);
        self.conn.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether an accept error means this process (or the system) is out of descriptors.
fn out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error().map(rustix::io::Errno::from_raw_os_error),
        Some(
            rustix::io::Errno::MFILE | rustix::io::Errno::NFILE | rustix::io::Errno::NOBUFS | rustix::io::Errno::NOMEM
        )
    )
}

/// How often the sweeper looks: a quarter of the shorter time limit, within 10 ms..500 ms.
fn sweep_every(limits: &Limits) -> Duration {
    (limits.header_timeout.min(limits.idle_timeout) / 4).clamp(Duration::from_millis(10), Duration::from_millis(500))
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then lets open
/// requests finish (idle connections close at once).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let table = Arc::new(Table { epoch: Instant::now(), open: Mutex::new(BTreeMap::new()) });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Every connection task holds a sender; all of them gone means every connection closed.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
    let sweeper = {
        let table = table.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(sweep_every(&limits));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                table.sweep(&limits);
            }
        })
    };
    tokio::pin!(shutdown);
    let mut next_id = 0u64;
    let mut warned_fds = false;
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) if out_of_descriptors(&e) => {
                if !warned_fds {
                    tracing::warn!(
                        "out of file descriptors accepting a connection ({e}); closing idle connections to make room \
                         (lower --max-connections, now {}, or raise the limit: ulimit -n)",
                        limits.max_connections
                    );
                    warned_fds = true;
                }
                if !table.evict_oldest_idle() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            Err(e) => {
                // Aborted handshakes and the like: the next accept is unaffected.
                tracing::debug!("accept failed: {e}");
                continue;
            }
        };
        if table.len() >= limits.max_connections {
            if !table.evict_oldest_idle() {
                tracing::debug!(%peer, "refused a connection: {} open, every one busy", limits.max_connections);
                crate::telemetry::connection_closed(ConnectionClosed::Refused);
                drop(stream);
                continue;
            }
            // Let the evicted connection's task close its descriptor before the next accept.
            tokio::task::yield_now().await;
        }
        let _ = stream.set_nodelay(true);
        next_id += 1;
        let id = next_id;
        let now = table.now_ms();
        let conn = Arc::new(Conn {
            busy: AtomicUsize::new(0),
            head_since: AtomicU64::new(0),
            idle_since: AtomicU64::new(now),
            closing: AtomicU8::new(0),
            close: Notify::new(),
        });
        table.open.lock().expect("connection table").insert(id, conn.clone());
        crate::telemetry::connections_open(1);
        let task = Connection {
            id,
            peer,
            conn,
            table: table.clone(),
            router: router.clone(),
            stop: stop_rx.clone(),
            _done: done_tx.clone(),
        };
        tokio::spawn(task.run(stream));
    }
    // Open requests finish; idle connections close now; new ones are no longer accepted.
    drop(listener);
    let _ = stop_tx.send(true);
    drop(done_tx);
    let _ = done_rx.recv().await;
    sweeper.abort();
    Ok(())
}

/// One connection's task.
struct Connection {
    id: u64,
    peer: SocketAddr,
    conn: Arc<Conn>,
    table: Arc<Table>,
    router: Router,
    stop: tokio::sync::watch::Receiver<bool>,
    _done: tokio::sync::mpsc::Sender<()>,
}

impl Connection {
    async fn run(mut self, stream: TcpStream) {
        let io = hyper_util::rt::TokioIo::new(Watched { stream, conn: self.conn.clone(), table: self.table.clone() });
        let (conn, table, router, peer) = (self.conn.clone(), self.table.clone(), self.router.clone(), self.peer);
        let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ConnectInfo(peer));
            let in_flight = InFlight::begin(conn.clone(), table.clone());
            let mut router = router.clone();
            async move {
                let resp = tower_service::Service::call(&mut router, req).await;
                drop(in_flight);
                resp
            }
        });
        let http = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
        tokio::pin!(http);
        let mut draining = false;
        loop {
            tokio::select! {
                result = http.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(peer = %self.peer, "connection ended: {e}");
                    }
                    break;
                }
                () = self.conn.close.notified() => {
                    let why = self.conn.closing.load(Ordering::Acquire);
                    if let Some(&why) = why.checked_sub(1).and_then(|i| ConnectionClosed::ALL.get(usize::from(i))) {
                        crate::telemetry::connection_closed(why);
                        tracing::debug!(peer = %self.peer, ?why, "closing the connection");
                    }
                    break;
                }
                changed = self.stop.changed(), if !draining => {
                    draining = true;
                    if changed.is_ok() {
                        http.as_mut().graceful_shutdown();
                    }
                }
            }
        }
        self.table.remove(self.id);
        crate::telemetry::connections_open(-1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cap_leaves_descriptors_for_the_server() {
        let limit = descriptor_limit();
        let cap = default_max_connections() as u64;
        if let Some(n) = limit {
            assert!(cap < n, "cap {cap} under a limit of {n}");
            assert!(n - cap >= RESERVED_FDS.min(n - 1), "cap {cap} under a limit of {n}");
        }
    }

    fn conn(busy: usize, head_since: u64, idle_since: u64) -> Arc<Conn> {
        Arc::new(Conn {
            busy: AtomicUsize::new(busy),
            head_since: AtomicU64::new(head_since),
            idle_since: AtomicU64::new(idle_since),
            closing: AtomicU8::new(0),
            close: Notify::new(),
        })
    }

    fn closing(c: &Conn) -> Option<ConnectionClosed> {
        c.closing.load(Ordering::Acquire).checked_sub(1).map(|i| ConnectionClosed::ALL[usize::from(i)])
    }

    #[test]
    fn the_sweep_closes_slow_heads_and_idle_connections_but_never_a_busy_one() {
        let table = Table { epoch: Instant::now() - Duration::from_secs(100), open: Mutex::new(BTreeMap::new()) };
        let now = table.now_ms();
        let limits = Limits {
            header_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(10),
            max_connections: 8,
        };
        let cases = [
            ("busy for long", conn(1, 0, now - 50_000), None),
            ("busy, a head started long ago", conn(1, now - 50_000, now - 50_000), None),
            ("a head 3 s old", conn(0, now - 3_000, now - 3_500), Some(ConnectionClosed::HeaderTimeout)),
            ("a head 1 s old on a connection idle before", conn(0, now - 1_000, now - 60_000), None),
            ("idle 11 s", conn(0, 0, now - 11_000), Some(ConnectionClosed::Idle)),
            ("idle 9 s", conn(0, 0, now - 9_000), None),
        ];
        for (i, (_, c, _)) in cases.iter().enumerate() {
            table.open.lock().unwrap().insert(i as u64, c.clone());
        }
        table.sweep(&limits);
        for (what, c, want) in &cases {
            assert_eq!(closing(c), *want, "{what}");
        }
    }

    #[test]
    fn eviction_takes_the_oldest_idle_connection_and_refuses_when_all_are_busy() {
        let table = Table { epoch: Instant::now(), open: Mutex::new(BTreeMap::new()) };
        let (busy, idle_old, idle_new) = (conn(1, 0, 1), conn(0, 0, 1), conn(0, 0, 1));
        for (id, c) in [(1, &busy), (2, &idle_old), (3, &idle_new)] {
            table.open.lock().unwrap().insert(id, c.clone());
        }
        assert!(table.evict_oldest_idle());
        assert_eq!(
            (closing(&idle_old), closing(&idle_new), closing(&busy)),
            (Some(ConnectionClosed::Evicted), None, None)
        );
        assert!(table.evict_oldest_idle());
        assert_eq!(closing(&idle_new), Some(ConnectionClosed::Evicted));
        assert!(!table.evict_oldest_idle(), "the only one left is busy");
        assert_eq!(table.len(), 1);
    }
}

//! `kvpages forward`: a per-node TCP forwarder from `localhost:18000` to the one metadata server.
//!
//! vLLM's connector always dials `http://localhost:18000` (it reads its URL setting but never
//! uses it), so in a TP group spread over several nodes every node needs something on that port
//! that reaches the single server. This is that something, with no moving parts: each client
//! connection gets its own upstream connection and the bytes are copied both ways, so keep-alive,
//! pipelining and any body size work exactly as on the server, and nothing is buffered or parsed
//! on the way. A forwarder holds no state: restarting it, or the server, loses nothing.
//!
//! When the server cannot be reached, the client gets one HTTP answer, `502` with the JSON
//! `{"detail"}` of every kvpages error (`upstream-unavailable`; the peers' clients retry a 502
//! three times), and the connection is closed. Every new connection dials the server afresh (the
//! name is resolved each time), so the forwarder serves again as soon as the server is back; it
//! logs when the server becomes unreachable and when it is reachable again, not once per client.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::api::ErrorCode;

/// Where the forwarder sends connections: `HOST:PORT` of `http://HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// A name, an IPv4 address, or an IPv6 address without brackets.
    pub host: String,
    /// The server's port.
    pub port: u16,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl std::str::FromStr for Target {
    type Err = String;

    /// Parses `http://HOST:PORT[/]`; any host (this is for reaching other nodes).
    fn from_str(url: &str) -> Result<Target, String> {
        let bad = |why: &str| format!("--to '{url}': {why}");
        let rest = url.strip_prefix("http://").ok_or_else(|| bad("expected http://HOST:PORT (https is not spoken)"))?;
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains('/') || authority.contains('@') {
            return Err(bad("expected only http://HOST:PORT, no path or user"));
        }
        let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("the port is missing"))?;
        let port: u16 =
            port.parse().ok().filter(|&p| p != 0).ok_or_else(|| bad("the port is not a number in 1..65535"))?;
        let host = match host.strip_prefix('[') {
            Some(v6) => v6.strip_suffix(']').ok_or_else(|| bad("an IPv6 address needs its closing ']'"))?,
            None if host.contains(':') => return Err(bad("write an IPv6 address in brackets, [::1]:18000")),
            None => host,
        };
        if host.is_empty() {
            return Err(bad("the host is missing"));
        }
        Ok(Target { host: host.to_owned(), port })
    }
}

/// The forwarder's shared state: where to, and whether the server answered last time.
struct Forwarder {
    target: Target,
    connect_timeout: Duration,
    /// Whether the last connection attempt reached the server (to log changes, not every miss).
    reachable: AtomicBool,
    /// Connections refused with 502 since the server became unreachable.
    misses: AtomicU64,
}

/// The longest request head read before answering 502 (the answer does not depend on it; it is
/// read so the client is not reset before it has read the answer).
const HEAD_LIMIT: usize = 64 * 1024;

impl Forwarder {
    async fn serve(self: Arc<Self>, mut client: TcpStream, peer: SocketAddr) {
        let target = (self.target.host.as_str(), self.target.port);
        let dial = tokio::time::timeout(self.connect_timeout, TcpStream::connect(target)).await;
        let mut upstream = match dial {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return self.unreachable(client, peer, &e.to_string()).await,
            Err(_) => {
                let why = format!("no connection within {} s", self.connect_timeout.as_secs_f64());
                return self.unreachable(client, peer, &why).await;
            }
        };
        if !self.reachable.swap(true, Ordering::AcqRel) {
            let missed = self.misses.swap(0, Ordering::AcqRel);
            tracing::info!(target = %self.target, refused_meanwhile = missed, "the server is reachable");
        }
        // Small request/response pairs: never wait for Nagle on either leg.
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        tracing::debug!(%peer, "connection forwarded");
        match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            Ok((up, down)) => tracing::debug!(%peer, bytes_up = up, bytes_down = down, "connection closed"),
            Err(e) => tracing::debug!(%peer, "connection ended: {e}"),
        }
    }

    /// Answers the client's first request with 502 and closes the connection.
    async fn unreachable(&self, mut client: TcpStream, peer: SocketAddr, why: &str) {
        if self.reachable.swap(false, Ordering::AcqRel) {
            tracing::warn!(target = %self.target, "the server is unreachable ({why}); clients get 502 until it is back");
        } else {
            tracing::debug!(%peer, target = %self.target, "the server is still unreachable ({why})");
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let detail = format!("{} ({}: {why})", ErrorCode::UpstreamUnavailable.template(), self.target);
        let body = serde_json::to_vec(&serde_json::json!({ "detail": detail })).expect("a string serializes");
        let status = crate::api::status_of(ErrorCode::UpstreamUnavailable);
        let head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        );
        // Read the request head first: answering before the client has sent it, then closing with
        // its bytes unread, would make the kernel reset the connection under the answer.
        let mut buf = vec![0u8; 4096];
        let mut seen = Vec::new();
        let read_head = async {
            while seen.len() < HEAD_LIMIT && !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            true
        };
        if !tokio::time::timeout(Duration::from_secs(2), read_head).await.unwrap_or(false) {
            return;
        }
        if client.write_all(head.as_bytes()).await.is_err() || client.write_all(&body).await.is_err() {
            return;
        }
        let _ = client.shutdown().await;
        // Drain what is left of the request (a body) until the client closes, briefly.
        let drain = async { while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {} };
        let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
    }
}

/// Forwards every connection accepted on `listener` to `target` until `shutdown` resolves.
/// Open connections are dropped when the runtime ends.
pub async fn run(
    listener: TcpListener,
    target: Target,
    connect_timeout: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!("kvpages forward: {addr} -> http://{target}");
    let fwd =
        Arc::new(Forwarder { target, connect_timeout, reachable: AtomicBool::new(true), misses: AtomicU64::new(0) });
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    tokio::spawn(fwd.clone().serve(client, peer));
                }
                // Out of file descriptors and the like: the listener itself is fine, so wait a
                // little and go on rather than exit.
                Err(e) => {
                    tracing::error!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let t: Target = "http://10.0.0.5:18000".parse().unwrap();
        assert_eq!(t, Target { host: "10.0.0.5".into(), port: 18000 });
        let t: Target = "http://meta-server.cluster.local:18000/".parse().unwrap();
        assert_eq!(t.host, "meta-server.cluster.local");
        let t: Target = "http://[fd00::5]:9".parse().unwrap();
        assert_eq!((t.host.as_str(), t.port, t.to_string()), ("fd00::5", 9, "[fd00::5]:9".to_owned()));
        for bad in [
            "10.0.0.5:18000",
            "https://10.0.0.5:18000",
            "http://10.0.0.5",
            "http://10.0.0.5:0",
            "http://10.0.0.5:99999",
            "http://10.0.0.5:18000/keys",
            "http://:18000",
            "http://fd00::5:18000",
            "http://user@host:1",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
    }
}

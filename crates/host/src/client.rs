//! A small keep-alive HTTP/1.1 client for servers on this host (the load generator; later
//! `kvpages stats` and friends).
//!
//! Built on hyper's low-level connection API (`hyper::client::conn::http1`) rather than a
//! hand-written parser: hyper is already in the tree through axum (no new code to compile), it
//! gets framing right on every answer a server may give (chunked bodies, `Connection: close`,
//! early replies), and one `SendRequest` per TCP connection adds no pool, no DNS and no
//! redirect logic — the client spends its time on the socket, which is what a load generator
//! that shares two cores with the server needs.
//!
//! Only loopback addresses are accepted: nothing here is meant to send traffic off the host.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Why a request got no answer.
#[derive(Debug)]
pub enum ClientError {
    /// The URL is not `http://HOST:PORT` with a loopback host.
    Url(String),
    /// Connecting failed.
    Connect(std::io::Error),
    /// The connection failed while sending or receiving (it cannot be used again).
    Http(hyper::Error),
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Url(why) => f.write_str(why),
            ClientError::Connect(e) => write!(f, "cannot connect: {e}"),
            ClientError::Http(e) => write!(f, "connection failed: {e}"),
        }
    }
}

impl std::error::Error for ClientError {}

/// A server's answer: status and whole body.
#[derive(Debug, Clone)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// The body, read to the end.
    pub body: Bytes,
}

/// Parses `http://HOST:PORT[/]` into a socket address, refusing anything but loopback
/// (127.0.0.0/8, `[::1]`, `localhost`).
pub fn loopback_addr(url: &str) -> Result<SocketAddr, ClientError> {
    let bad = |why: &str| ClientError::Url(format!("'{url}': {why}"));
    let rest = url.strip_prefix("http://").ok_or_else(|| bad("expected http://HOST:PORT (https is not spoken)"))?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains('/') {
        return Err(bad("expected no path, only http://HOST:PORT"));
    }
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("the port is missing"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number in 1..65535"))?;
    let ip: IpAddr = match host {
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        h => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| bad("the host must be a loopback IP address or localhost"))?,
    };
    if !ip.is_loopback() {
        return Err(bad("only loopback servers (127.0.0.0/8, [::1], localhost) may be targeted"));
    }
    Ok(SocketAddr::new(ip, port))
}

/// One keep-alive HTTP/1.1 connection. Requests on it are sequential; open several clients
/// for concurrency.
pub struct Client {
    addr: SocketAddr,
    host: HeaderValue,
    /// `Authorization: Bearer TOKEN` for a server with `--admin-token`.
    auth: Option<HeaderValue>,
    sender: SendRequest<Full<Bytes>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Client {
    /// Opens a connection to a loopback address (others are refused).
    pub async fn connect(addr: SocketAddr) -> Result<Client, ClientError> {
        if !addr.ip().is_loopback() {
            return Err(ClientError::Url(format!("{addr}: only loopback servers may be targeted")));
        }
        let stream = TcpStream::connect(addr).await.map_err(ClientError::Connect)?;
        // Small request/response pairs: never wait for Nagle.
        stream.set_nodelay(true).map_err(ClientError::Connect)?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.map_err(ClientError::Http)?;
        // The connection task ends when the sender is dropped or the peer closes.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let host = HeaderValue::from_str(&addr.to_string()).expect("a socket address is a valid header value");
        Ok(Client { addr, host, auth: None, sender })
    }

    /// Sends `Authorization: Bearer TOKEN` with every request (`None`: no header).
    pub fn bearer(mut self, token: Option<&str>) -> Result<Client, ClientError> {
        self.auth = match token {
            None => None,
            Some(t) => Some(
                HeaderValue::from_str(&format!("Bearer {t}"))
                    .map_err(|_| ClientError::Url("the token is not a valid header value".into()))?,
            ),
        };
        Ok(self)
    }

    /// Opens a connection to `http://HOST:PORT` (loopback only).
    pub async fn connect_url(url: &str) -> Result<Client, ClientError> {
        Client::connect(loopback_addr(url)?).await
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `POST path` with a JSON body.
    pub async fn post(&mut self, path: &str, body: impl Into<Bytes>) -> Result<Response, ClientError> {
        self.send(Method::POST, path, body.into()).await
    }

    /// `GET path`.
    pub async fn get(&mut self, path: &str) -> Result<Response, ClientError> {
        self.send(Method::GET, path, Bytes::new()).await
    }

    async fn send(&mut self, method: Method, path: &str, body: Bytes) -> Result<Response, ClientError> {
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = method;
        *req.uri_mut() = path.parse().map_err(|e| ClientError::Url(format!("path '{path}': {e}")))?;
        req.headers_mut().insert(HOST, self.host.clone());
        req.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(auth) = &self.auth {
            req.headers_mut().insert(hyper::header::AUTHORIZATION, auth.clone());
        }
        self.sender.ready().await.map_err(ClientError::Http)?;
        let resp = self.sender.send_request(req).await.map_err(ClientError::Http)?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.map_err(ClientError::Http)?.to_bytes();
        Ok(Response { status, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_urls_are_accepted() {
        assert_eq!(loopback_addr("http://127.0.0.1:18000").unwrap(), "127.0.0.1:18000".parse().unwrap());
        assert_eq!(loopback_addr("http://127.1.2.3:80/").unwrap(), "127.1.2.3:80".parse().unwrap());
        assert_eq!(loopback_addr("http://localhost:5").unwrap(), "127.0.0.1:5".parse().unwrap());
        assert_eq!(loopback_addr("http://[::1]:7").unwrap(), "[::1]:7".parse().unwrap());
        for bad in [
            "http://10.0.0.1:18000",
            "http://0.0.0.0:18000",
            "http://example.com:80",
            "https://127.0.0.1:443",
            "127.0.0.1:18000",
            "http://127.0.0.1",
            "http://127.0.0.1:18000/keys",
            "http://[::2]:1",
        ] {
            assert!(loopback_addr(bad).is_err(), "{bad}");
        }
    }
}

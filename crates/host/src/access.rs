//! Who may talk to the server: the client address allowlist (`--allow CIDR,...`, 403) and the
//! operator's token (`--admin-token`, 401) for the routes that destroy or reveal the cache.
//!
//! The peers' protocol has no authentication at all, and their clients send no credentials, so
//! the data routes (initialize, allocate, confirm, exists, lookups) can only be protected by
//! where a request comes from. The token guards what only an operator should do:
//! - vLLM's `POST /clear` (drops every rank and key) and kvpages' `POST /keys/delete`;
//! - SGLang's `POST /{rank}/clear` and `POST /{rank}/delete_keys`;
//! - everything under `/admin/` (SGLang import and export, key inspection: they reveal or replace
//!   the whole cache).
//!
//! `/health`, `/stats` and `/metrics` stay open: they give aggregate figures only (no key), and
//! health checks and scrapers should not need the secret. Neither vLLM's nor SGLang's client calls
//! a guarded route while serving; SGLang's `flush_cache` (which calls `clear`) gets 401 while a
//! token is set, which is the point.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::{ApiError, ErrorCode};

/// An address block, `10.0.0.0/8`, `fd00::/8`, or a single address (`/32`, `/128` implied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` is in the block. IPv4-mapped IPv6 addresses (`::ffff:10.1.2.3`, what a
    /// dual-stack `[::]` listener reports for an IPv4 client) count as their IPv4 address.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("'{s}' is not an address block such as 10.0.0.0/8 or fd00::/8"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => return Err(format!("'{s}': the prefix length must be 0..={max}")),
            },
        };
        // An IPv4-mapped block is its IPv4 block (clients are compared in canonical form).
        match addr.to_canonical() {
            IpAddr::V4(v4) if max == 128 => match prefix.checked_sub(96) {
                Some(p) => Ok(Cidr { addr: IpAddr::V4(v4), prefix: p }),
                None => Err(format!("'{s}': an IPv4-mapped block needs a prefix length of at least 96")),
            },
            addr => Ok(Cidr { addr, prefix }),
        }
    }
}

/// The blocks of `--allow` (a type of its own, so clap takes the whole list as one value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowList(pub Vec<Cidr>);

impl AllowList {
    /// Whether `ip` is in one of the blocks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|b| b.contains(ip))
    }
}

/// Parses `--allow`: comma-separated blocks, at least one.
pub fn parse_allow(s: &str) -> Result<AllowList, String> {
    let blocks = s.split(',').filter(|p| !p.trim().is_empty()).map(str::parse).collect::<Result<Vec<Cidr>, _>>()?;
    if blocks.is_empty() {
        return Err("--allow needs at least one address block (e.g. 127.0.0.1/32,10.0.0.0/8)".into());
    }
    Ok(AllowList(blocks))
}

/// The access policy of a server. The default lets everyone in, as the peers do.
#[derive(Clone, Default)]
pub struct Access {
    /// `--allow`: when set, only clients in one of these blocks are served.
    pub allow: Option<AllowList>,
    /// `--admin-token`: when set, the guarded routes need `Authorization: Bearer TOKEN`.
    pub admin_token: Option<Arc<str>>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("Access")
            .field("allow", &self.allow)
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Access {
    /// Whether the policy checks anything (an open policy needs no middleware work).
    pub fn is_open(&self) -> bool {
        self.allow.is_none() && self.admin_token.is_none()
    }

    /// `Ok` if a client at `peer` may send this request, or the refusal to answer.
    pub fn check(&self, peer: Option<SocketAddr>, path: &str, authorization: Option<&[u8]>) -> Result<(), ApiError> {
        if let Some(blocks) = &self.allow {
            match peer {
                Some(p) if blocks.contains(p.ip()) => {}
                Some(p) => {
                    return Err(ApiError::because(
                        ErrorCode::AccessDenied,
                        format_args!("client address {} is not in --allow", p.ip().to_canonical()),
                    ));
                }
                None => return Err(ApiError::because(ErrorCode::AccessDenied, "the client address is unknown")),
            }
        }
        if let Some(token) = &self.admin_token
            && is_guarded(path)
        {
            let given = authorization.and_then(bearer_token);
            match given {
                None => {
                    return Err(ApiError::because(
                        ErrorCode::AdminTokenRequired,
                        format_args!("{path} needs the header 'Authorization: Bearer TOKEN'"),
                    ));
                }
                Some(g) if !constant_time_eq(g, token.as_bytes()) => {
                    return Err(ApiError::because(ErrorCode::AdminTokenRequired, "the token does not match"));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// The routes `--admin-token` guards (any method: a wrong method is refused after the token).
pub fn is_guarded(path: &str) -> bool {
    if path == "/clear" || path == "/keys/delete" || path.starts_with("/admin/") {
        return true;
    }
    // SGLang's `/{rank}/clear` and `/{rank}/delete_keys`: two segments.
    let mut segs = path.strip_prefix('/').unwrap_or(path).split('/');
    matches!((segs.next(), segs.next(), segs.next()), (Some(_), Some("clear" | "delete_keys"), None))
}

/// The token of an `Authorization: Bearer TOKEN` header: the scheme's name is matched without
/// regard to case (RFC 7235, section 2.1), the spaces around the token are not part of it.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"Bearer") || token.first().is_none_or(|&b| b != b' ') {
        return None;
    }
    Some(token.trim_ascii())
}

/// Compares without an early exit, so the answer's timing does not reveal how much of a guess
/// was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The middleware: refuses (403 / 401, JSON `{"detail"}`) before any route runs.
pub(crate) async fn guard(State(access): State<Arc<Access>>, req: Request, next: Next) -> Response {
    if access.is_open() {
        return next.run(req).await;
    }
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    let auth = req.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes());
    match access.check(peer, req.uri().path(), auth) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            tracing::warn!(peer = ?peer, path = req.uri().path(), detail = %e.detail, "request refused");
            let mut resp = e.clone().into_response();
            if e.code == ErrorCode::AdminTokenRequired {
                resp.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            }
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn blocks_contain_what_they_should() {
        let b: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(b.contains(ip("10.255.0.1")));
        assert!(!b.contains(ip("11.0.0.1")));
        assert!(!b.contains(ip("127.0.0.1")));
        assert!(b.contains(ip("::ffff:10.1.2.3")), "IPv4-mapped counts as IPv4");
        let one: Cidr = "127.0.0.1".parse().unwrap();
        assert!(one.contains(ip("127.0.0.1")) && !one.contains(ip("127.0.0.2")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("1.2.3.4")) && !all.contains(ip("::1")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        let lo6: Cidr = "[::1]".parse().unwrap();
        assert!(lo6.contains(ip("::1")));
        let mapped: Cidr = "::ffff:192.168.0.0/112".parse().unwrap();
        assert_eq!(mapped.to_string(), "192.168.0.0/16");
        assert!(mapped.contains(ip("192.168.9.9")));
    }

    #[test]
    fn bad_blocks_are_refused() {
        for bad in
            ["", "10.0.0.0/33", "fd00::/129", "10.0.0/8", "host.example", "10.0.0.0/x", "10.0.0.0/-1", "::ffff:0:0/8"]
        {
            assert!(parse_allow(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_allow("127.0.0.1/32, 10.0.0.0/8").unwrap().0.len(), 2);
    }

    #[test]
    fn guarded_routes() {
        for p in ["/clear", "/keys/delete", "/admin/keys/abc", "/admin/import/sglang", "/0/clear", "/7/delete_keys"] {
            assert!(is_guarded(p), "{p}");
        }
        for p in
            ["/health", "/stats", "/metrics", "/keys/batch_allocate", "/rank/0/initialize", "/0/exists", "/0/clear/x"]
        {
            assert!(!is_guarded(p), "{p}");
        }
    }

    #[test]
    fn token_and_allowlist() {
        let a = Access { allow: Some(parse_allow("10.0.0.0/8").unwrap()), admin_token: Some("s3cret".into()) };
        let inside: SocketAddr = "10.1.1.1:5000".parse().unwrap();
        let outside: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert_eq!(a.check(Some(outside), "/health", None).unwrap_err().code, ErrorCode::AccessDenied);
        assert_eq!(a.check(None, "/health", None).unwrap_err().code, ErrorCode::AccessDenied);
        assert!(a.check(Some(inside), "/keys/batch_exists", None).is_ok());
        assert_eq!(a.check(Some(inside), "/clear", None).unwrap_err().code, ErrorCode::AdminTokenRequired);
        assert_eq!(
            a.check(Some(inside), "/clear", Some(b"Bearer nope")).unwrap_err().code,
            ErrorCode::AdminTokenRequired
        );
        assert_eq!(a.check(Some(inside), "/clear", Some(b"s3cret")).unwrap_err().code, ErrorCode::AdminTokenRequired);
        assert!(a.check(Some(inside), "/clear", Some(b"Bearer s3cret")).is_ok());
        // The scheme is case-insensitive; the token is not, and the scheme needs its space.
        for ok in [&b"bearer s3cret"[..], b"BEARER s3cret", b"BeArEr   s3cret "] {
            assert!(a.check(Some(inside), "/clear", Some(ok)).is_ok(), "{}", String::from_utf8_lossy(ok));
        }
        for bad in [&b"Bearer S3CRET"[..], b"Bearers3cret", b"Basic s3cret", b"Bearer", b"bear s3cret"] {
            let e = a.check(Some(inside), "/clear", Some(bad)).unwrap_err();
            assert_eq!(e.code, ErrorCode::AdminTokenRequired, "{}", String::from_utf8_lossy(bad));
        }
        assert!(format!("{a:?}").contains("<set>") && !format!("{a:?}").contains("s3cret"));
    }
}

//! vLLM's HF3FS metadata routes: the peer's JSON shapes and texts, kvpages' rules for bad input.
//!
//! See `protocol-vllm.md` (in the project's notes) for the peer, and `docs/errors.md` for every
//! error answer.

use std::format;
use std::string::String;
use std::vec::Vec;

use serde::Serialize;
use serde::de::{self, MapAccess};

use super::fast;
use super::json::{KeyPage, KeyPair, KeyStr, List, Members, Object, U32, decode, missing, string_with, value};
use super::{Answer, ErrorCode, Failure, Parsed, Shape, apply, nothing_confirmed, unexpected, unexpected_refusal};
use kvpages_core::command::{Allocation, Command, Reply, Space};
use kvpages_core::error::Error;
use kvpages_core::key::Key;

const SPACE: Space = Space::Vllm;

/// vLLM's routes (and kvpages' `/keys/delete`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    Initialize,
    Allocate,
    Confirm,
    Exists,
    Locations,
    Clear,
    Delete,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Initialize => "initialize",
            Route::Allocate => "batch_allocate",
            Route::Confirm => "confirm_write",
            Route::Exists => "batch_exists",
            Route::Locations => "get_locations",
            Route::Clear => "clear",
            Route::Delete => "delete",
        }
    }

    /// The code of a malformed request to this route.
    fn malformed(self) -> ErrorCode {
        match self {
            Route::Initialize => ErrorCode::InitializeInvalid,
            Route::Allocate | Route::Locations | Route::Clear => ErrorCode::KeysRequestInvalid,
            Route::Confirm => ErrorCode::ConfirmRequestInvalid,
            Route::Exists => ErrorCode::ExistsRequestInvalid,
            Route::Delete => ErrorCode::DeleteRequestInvalid,
        }
    }
}

/// A request body of `route` into its command (or the scheduler's answer).
pub(super) fn parse(route: Route, path: &str, body: &[u8]) -> Result<Parsed, Failure> {
    let invalid = |why: String| Failure::because(route.malformed(), why);
    let command = match route {
        Route::Initialize => {
            let rank = rank_from_path(path)?;
            let Object(b) = decode::<Object<InitializeBody>>(body).map_err(invalid)?;
            if b.role == Some(Role::Scheduler) {
                let message = "Scheduler role does not require initialization";
                return Ok(Parsed::Answer(Answer::json(&Message { message: message.into() })));
            }
            let Some(U32(num_pages)) = b.num_pages else {
                return Err(Failure::because(ErrorCode::InitializeInvalid, "member 'num_pages' is missing"));
            };
            Command::Initialize { space: SPACE, rank, num_pages }
        }
        // The data routes try the fast path first; the full decoder has the last word.
        Route::Allocate => {
            let (rank, keys) = decode_with(body, fast::allocate, full_allocate).map_err(invalid)?;
            Command::Allocate { space: SPACE, rank, keys }
        }
        Route::Confirm => {
            let (rank, confirmations, releases) = decode_with(body, fast::confirm, full_confirm).map_err(invalid)?;
            Command::Confirm { space: SPACE, rank, confirmations, releases }
        }
        Route::Exists => {
            Command::Exists { space: SPACE, keys: decode_with(body, fast::keys, full_keys).map_err(invalid)? }
        }
        Route::Locations => {
            let (rank, keys) = decode_with(body, fast::locations, full_locations).map_err(invalid)?;
            Command::Locations { space: SPACE, rank, keys }
        }
        // The body is ignored, as in the peer.
        Route::Clear => Command::Clear { space: SPACE },
        Route::Delete => {
            Command::Delete { space: SPACE, keys: decode_with(body, fast::keys, full_keys).map_err(invalid)? }
        }
    };
    Ok(apply(route.name(), Shape::Vllm(route), command))
}

/// The answer of `route` to its command's result.
pub(super) fn answer(route: Route, command: Command, result: Result<Reply, Error>) -> Result<Answer, Failure> {
    let confirmations = match &command {
        Command::Confirm { confirmations, .. } => &confirmations[..],
        _ => &[],
    };
    let reply = match (route, result) {
        (_, Ok(reply)) => reply,
        (Route::Clear, Err(e)) => return Err(unexpected_refusal(&e)),
        (_, Err(e)) => return Err(refused(route.malformed(), e, confirmations)),
    };
    match (route, reply, &command) {
        (Route::Initialize, Reply::Initialized { .. }, &Command::Initialize { rank, num_pages, .. }) => {
            Ok(Answer::json(&Message { message: format!("Rank {rank} initialized with {num_pages} pages") }))
        }
        (Route::Allocate, Reply::Allocated(results), Command::Allocate { rank, keys, .. }) => {
            // An index out of the batch (a broken plugin: the core never answers one) is the
            // engine's fault, not a panic.
            match allocated_json(*rank, keys, &results) {
                Some(json) => Ok(Answer::ok(json)),
                None => Err(unexpected(&Reply::Allocated(results))),
            }
        }
        (Route::Confirm, Reply::Confirmed(_), _) => Ok(Answer::no_content()),
        (Route::Exists, Reply::Exists(exists), _) => Ok(Answer::ok(exists_json(&exists))),
        (Route::Locations, Reply::Locations(locations), _) => Ok(Answer::ok(locations_json(&locations))),
        (Route::Clear, Reply::Cleared { .. }, _) => Ok(Answer::no_content()),
        (Route::Delete, Reply::Deleted(deleted), _) => Ok(Answer::json(&DeletedReply { deleted })),
        (_, other, _) => Err(unexpected(&other)),
    }
}

/// Maps a core refusal to the answer of a route whose malformed-request code is `malformed`.
fn refused(malformed: ErrorCode, e: Error, confirmations: &[(Key, u32)]) -> Failure {
    match e {
        Error::RankNotInitialized { rank } => Failure::rank_not_initialized(rank),
        Error::ZeroPages { .. } => Failure::because(ErrorCode::InitializeInvalid, "num_pages must be at least 1"),
        Error::RankOutsideWorld { rank, world_size } => {
            Failure::filled(ErrorCode::RankOutsideWorld, &[("rank", &rank), ("n", &world_size)])
        }
        e @ Error::PageOutOfRange { .. } => Failure::because(malformed, e),
        Error::NothingConfirmed { refused } => nothing_confirmed(&refused, "confirmations", confirmations),
        // Answers to commands these routes never send.
        e @ (Error::SglangPoolsExist { .. } | Error::ImportRefused { .. }) => unexpected_refusal(&e),
    }
}

fn rank_from_path(path: &str) -> Result<u32, Failure> {
    let seg = path.strip_prefix("/rank/").and_then(|p| p.strip_suffix("/initialize")).unwrap_or("");
    let digits = !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit());
    match seg.parse::<u32>() {
        Ok(rank) if digits => Ok(rank),
        _ => Err(Failure::because(
            ErrorCode::InitializeInvalid,
            format_args!("path rank '{seg}' is not a decimal integer in u32 range"),
        )),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Worker,
    Scheduler,
}

impl<'de> serde::Deserialize<'de> for Role {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string_with(
            d,
            |f| f.write_str("\"worker\" or \"scheduler\""),
            |v| match v {
                "worker" => Ok(Role::Worker),
                "scheduler" => Ok(Role::Scheduler),
                _ => Err(None),
            },
        )
    }
}

#[derive(Default)]
struct InitializeBody {
    num_pages: Option<U32>,
    role: Option<Role>,
}

impl Members for InitializeBody {
    fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "num_pages" => value(map, &mut self.num_pages),
            "role" => value(map, &mut self.role),
            _ => Ok(false),
        }
    }
}

#[derive(Serialize)]
struct Message {
    message: String,
}

struct RankKeys<T> {
    rank: Option<U32>,
    keys: List<T>,
}

impl<T> Default for RankKeys<T> {
    fn default() -> Self {
        RankKeys { rank: None, keys: List::default() }
    }
}

impl<T: for<'de> serde::Deserialize<'de>> Members for RankKeys<T> {
    fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "rank" => value(map, &mut self.rank),
            "keys" => {
                self.keys = map.next_value()?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn finish<E: de::Error>(self) -> Result<Self, E> {
        if self.rank.is_none() {
            return Err(missing("rank"));
        }
        Ok(self)
    }
}

/// The fast path's value when it has one, else the full decoder's value or refusal.
fn decode_with<T>(
    body: &[u8],
    fast: fn(&[u8]) -> Option<T>,
    full: fn(&[u8]) -> Result<T, String>,
) -> Result<T, String> {
    fast(body).map_or_else(|| full(body), Ok)
}

// The full decoders of the data routes' bodies: the rules (see `json`), and the reference the
// fast path is tested against.

/// batch_allocate: rank and keys.
fn full_allocate(body: &[u8]) -> Result<(u32, Vec<Key>), String> {
    let (rank, List(pairs)) = decode_rank_keys::<KeyPair>(body)?;
    Ok((rank, pairs.into_iter().map(|p| p.0).collect()))
}

/// get_locations: rank and keys.
fn full_locations(body: &[u8]) -> Result<(u32, Vec<Key>), String> {
    let (rank, List(keys)) = decode_rank_keys::<KeyStr>(body)?;
    Ok((rank, keys.into_iter().map(|k| k.0).collect()))
}

/// confirm_write: rank, confirmations, releases.
fn full_confirm(body: &[u8]) -> Result<fast::Confirm, String> {
    let Object(b) = decode::<Object<ConfirmBody>>(body)?;
    Ok((
        b.rank.expect("checked in finish").0,
        b.confirmations.0.into_iter().map(|KeyPage(k, p)| (k, p)).collect(),
        b.pages_to_release.0.into_iter().map(|p| p.0).collect(),
    ))
}

/// batch_exists, delete: `{"keys": [...]}`.
fn full_keys(body: &[u8]) -> Result<Vec<Key>, String> {
    let Object(b) = decode::<Object<KeysBody>>(body)?;
    Ok(b.keys.0.into_iter().map(|k| k.0).collect())
}

fn decode_rank_keys<T: for<'de> serde::Deserialize<'de>>(body: &[u8]) -> Result<(u32, List<T>), String> {
    let Object(b) = decode::<Object<RankKeys<T>>>(body)?;
    Ok((b.rank.expect("checked in finish").0, b.keys))
}

/// batch_allocate's reply, `{"rank":R,"results":[[key,page],...]}` (page -1 when none), written
/// directly: the bytes serde_json would write (compact; keys escaped by serde_json itself unless
/// they are packed hex, which needs no escape), without a serializer call per key. `None` when
/// an allocation's index is outside `keys`.
fn allocated_json(rank: u32, keys: &[Key], results: &[Allocation]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(32 + results.len() * 44);
    out.extend_from_slice(b"{\"rank\":");
    push_u32(&mut out, rank);
    out.extend_from_slice(b",\"results\":[");
    for a in results {
        match keys.get(a.index as usize)? {
            Key::Hex(bytes) => {
                // `["<32 hex>",` in one copy of a fixed size (a push a piece cost ~25
                // instructions more a result).
                let mut item = [0u8; 36];
                item[..2].copy_from_slice(b"[\"");
                item[2..34].copy_from_slice(kvpages_core::HexText::new(bytes).as_bytes());
                item[34..].copy_from_slice(b"\",");
                out.extend_from_slice(&item);
            }
            Key::Text(text) => {
                out.push(b'[');
                // Writing to a Vec cannot fail.
                let _ = serde_json::to_writer(&mut out, &**text);
                out.push(b',');
            }
        }
        match a.page {
            Some(page) => push_u32(&mut out, page),
            None => out.extend_from_slice(b"-1"),
        }
        out.extend_from_slice(b"],");
    }
    end_list(&mut out);
    Some(out)
}

#[derive(Default)]
struct ConfirmBody {
    rank: Option<U32>,
    confirmations: List<KeyPage>,
    pages_to_release: List<U32>,
}

impl Members for ConfirmBody {
    fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "rank" => value(map, &mut self.rank),
            "confirmations" => {
                self.confirmations = map.next_value()?;
                Ok(true)
            }
            "pages_to_release" => {
                self.pages_to_release = map.next_value()?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn finish<E: de::Error>(self) -> Result<Self, E> {
        if self.rank.is_none() {
            return Err(missing("rank"));
        }
        Ok(self)
    }
}

#[derive(Default)]
struct KeysBody {
    keys: List<KeyStr>,
}

impl Members for KeysBody {
    fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "keys" => {
                self.keys = map.next_value()?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// batch_exists' reply, `{"exists":[true,false,...]}`, written directly (the bytes serde_json
/// writes for it): through serde a key's answer cost a serializer call, ~7 % of a 1,250-key
/// lookup's decode + apply + answer (`request/exists-1250`). Every write is of a constant
/// length, which the compiler turns into a few stores (a length picked at run time, `true`
/// or `false`, cost a `memcpy` call a key: slower than serde).
fn exists_json(exists: &[bool]) -> Vec<u8> {
    let mut out = Vec::with_capacity(14 + exists.len() * 6);
    out.extend_from_slice(b"{\"exists\":[");
    for &e in exists {
        if e {
            out.extend_from_slice(b"true,");
        } else {
            out.extend_from_slice(b"false,");
        }
    }
    end_list(&mut out);
    out
}

/// get_locations' reply, `{"locations":[page or null,...]}`, written directly like
/// [`exists_json`].
fn locations_json(locations: &[Option<u32>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(17 + locations.len() * 11);
    out.extend_from_slice(b"{\"locations\":[");
    for page in locations {
        match *page {
            Some(page) => push_u32(&mut out, page),
            None => out.extend_from_slice(b"null"),
        }
        out.push(b',');
    }
    end_list(&mut out);
    out
}

/// Closes a list written with a comma after each element (the last one dropped; an empty list
/// ends at its `[`), and the object around it. (One shared loop that wrote the commas itself,
/// between elements, made the 1,250-key `exists` answer ~8 % slower.)
fn end_list(out: &mut Vec<u8>) {
    if out.last() == Some(&b',') {
        out.pop();
    }
    out.extend_from_slice(b"]}");
}

/// `v` in decimal, as JSON writes an unsigned integer. Eight digits are worked out at once in
/// the bytes of a `u64` (split into halves of four digits, those into pairs, those into digits,
/// each by a multiply and a shift) and appended in one 8-byte store, then cut back past their
/// leading zeros. Digit by digit through a byte buffer, a 7-digit page cost ~100 instructions
/// with its comma (`get_locations` of 32 answered 3.3k instructions), and the buffer's bytes
/// were read back in one load that could not be forwarded from their stores.
#[inline(always)]
fn push_u32(out: &mut Vec<u8>, v: u32) {
    if v >= 100_000_000 {
        return push_long_u32(out, v);
    }
    let digits = eight_digits(v);
    // Leading zeros are the low bytes that hold '0' (a digit of 0); one digit stays for 0.
    let zeros = ((digits - ZEROS).trailing_zeros() / 8).min(7);
    let start = out.len();
    out.extend_from_slice(&(digits >> (8 * zeros)).to_le_bytes());
    out.truncate(start + 8 - zeros as usize);
}

/// [`push_u32`] of nine or ten digits (pages past 10^8): the leading one or two, then eight.
#[cold]
fn push_long_u32(out: &mut Vec<u8>, v: u32) {
    let top = v / 100_000_000;
    if top >= 10 {
        out.push(b'0' + (top / 10) as u8);
    }
    out.push(b'0' + (top % 10) as u8);
    out.extend_from_slice(&eight_digits(v % 100_000_000).to_le_bytes());
}

/// Eight '0' bytes.
const ZEROS: u64 = 0x3030_3030_3030_3030;

/// The eight decimal digits of `v` (below 10^8, with leading zeros) as ASCII bytes of a `u64`,
/// the first digit in the lowest byte (so `to_le_bytes` gives them in reading order).
fn eight_digits(v: u32) -> u64 {
    debug_assert!(v < 100_000_000);
    // Two 4-digit halves in 32-bit lanes, the high half first (lowest).
    let x = u64::from(v / 10_000) | (u64::from(v % 10_000) << 32);
    // Each lane / 100 (n * 5243 >> 19 is n / 100 for n < 10^4): pairs in 16-bit lanes.
    let hundreds = ((x * 5243) >> 19) & 0x0000_007f_0000_007f;
    let x = hundreds | ((x - hundreds * 100) << 16);
    // Each lane / 10 (n * 103 >> 10 is n / 10 for n < 100): digits in bytes.
    let tens = ((x * 103) >> 10) & 0x000f_000f_000f_000f;
    let x = tens | ((x - tens * 10) << 8);
    x + ZEROS
}

#[derive(Serialize)]
struct DeletedReply {
    deleted: u32,
}

#[cfg(test)]
mod tests {
    //! The fast path against the full decoder: whenever the fast path gives a value, the full
    //! decoder gives the same one; the bodies the clients send take the fast path.

    use std::string::ToString;
    use std::vec;

    use proptest::prelude::*;

    use super::*;
    use kvpages_core::key::MAX_KEY_LEN;

    /// Draws from proptest's own RNG, seeded by the case's seed.
    struct Gen(proptest::test_runner::TestRng);

    impl Gen {
        fn new(seed: u64) -> Gen {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            Gen(proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &bytes))
        }
        fn next(&mut self) -> u64 {
            self.0.next_u64()
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
            xs[self.below(xs.len() as u64) as usize]
        }
        /// Whitespace between tokens: none or JSON's four, sometimes (canonical: none or one space).
        fn ws(&mut self, canonical: bool) -> &'static str {
            if canonical {
                ["", " "][self.below(2) as usize]
            } else {
                ["", "", " ", "\n", "\t\r ", "  "][self.below(6) as usize]
            }
        }
        /// A key's JSON text: mostly the clients' 32 hex digits, sometimes anything.
        fn key(&mut self, canonical: bool) -> String {
            let hex = format!("{:016x}{:016x}", self.next(), self.next());
            if canonical || self.below(3) > 0 {
                return format!("\"{hex}\"");
            }
            let odd = [
                "\"ABCDEF0123456789abcdef0123456789\"",
                "\"k\"",
                "\"\"",
                "\"a\\\"b\"",
                "\"\\u0041\"",
                "\"é\"",
                "\"0123456789abcdef0123456789abcde\"",
                "\"0123456789abcdef0123456789abcdef0\"",
                "1",
                "null",
                "[\"k\",\"\"]",
            ];
            self.pick(&odd).to_string()
        }
        fn number(&mut self, canonical: bool) -> String {
            if canonical || self.below(3) > 0 {
                return [0u64, 1, 7, 4_294_967_295, self.below(1 << 32)][self.below(5) as usize].to_string();
            }
            self.pick(&["01", "-1", "-0", "1.0", "1e3", "4294967296", "99999999999", "\"1\"", "true", "0.5", "00"])
                .to_string()
        }
        fn list(&mut self, canonical: bool, mut elem: impl FnMut(&mut Gen) -> String) -> String {
            let n = [0, 1, 2, 5, 40][self.below(5) as usize];
            let mut s = String::from("[");
            for i in 0..n {
                if i > 0 {
                    s.push_str(self.ws(canonical));
                    s.push(',');
                }
                s.push_str(self.ws(canonical));
                s.push_str(&elem(self));
            }
            s.push_str(self.ws(canonical));
            s.push(']');
            s
        }
        fn pair(&mut self, canonical: bool, second: String) -> String {
            let key = self.key(canonical);
            let (a, b, c) = (self.ws(canonical), self.ws(canonical), self.ws(canonical));
            format!("[{a}{key},{b}{second}{c}]")
        }
        /// An object of these members (shuffled; sometimes one dropped, repeated or an extra).
        fn object(&mut self, canonical: bool, mut members: Vec<(&str, String)>) -> String {
            if !canonical {
                match self.below(6) {
                    0 if !members.is_empty() => {
                        let i = self.below(members.len() as u64) as usize;
                        members.remove(i);
                    }
                    1 if !members.is_empty() => {
                        let i = self.below(members.len() as u64) as usize;
                        members.push(members[i].clone());
                    }
                    2 => members.push(("extra", "{\"a\":[1,2.5]}".into())),
                    _ => {}
                }
            }
            for i in (1..members.len()).rev() {
                members.swap(i, self.below(i as u64 + 1) as usize);
            }
            let mut s = String::from(self.ws(canonical));
            s.push('{');
            for (i, (name, value)) in members.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                let (a, b, c) = (self.ws(canonical), self.ws(canonical), self.ws(canonical));
                s.push_str(&format!("{a}\"{name}\"{b}:{c}{value}"));
            }
            s.push_str(self.ws(canonical));
            s.push('}');
            s.push_str(self.ws(canonical));
            s
        }
        /// A body of `route`.
        fn body(&mut self, route: Route, canonical: bool) -> String {
            let c = canonical;
            let members = match route {
                Route::Allocate => {
                    let prefix = |g: &mut Gen| if c || g.below(4) > 0 { "\"\"".to_string() } else { g.key(false) };
                    let keys = self.list(c, |g| {
                        let p = prefix(g);
                        g.pair(c, p)
                    });
                    vec![("rank", self.number(c)), ("keys", keys)]
                }
                Route::Confirm => {
                    let confirmations = self.list(c, |g| {
                        let n = g.number(c);
                        g.pair(c, n)
                    });
                    vec![
                        ("rank", self.number(c)),
                        ("confirmations", confirmations),
                        ("pages_to_release", self.list(c, |g| g.number(c))),
                    ]
                }
                Route::Locations => vec![("rank", self.number(c)), ("keys", self.list(c, |g| g.key(c)))],
                _ => vec![("keys", self.list(c, |g| g.key(c)))],
            };
            self.object(c, members)
        }
    }

    /// A byte-level edit of `body` (`None`: unchanged).
    fn mutate(g: &mut Gen, body: &str) -> Vec<u8> {
        let mut b = body.as_bytes().to_vec();
        for _ in 0..g.below(3) {
            let i = g.below(b.len() as u64 + 1) as usize;
            let byte =
                *[b'"', b'\\', b',', b']', b'}', b'[', b'{', b'0', b'-', b'.', b'e', b' ', b'x', 0xff, 0x01, b':']
                    .get(g.below(16) as usize)
                    .unwrap_or(&b'x');
            match g.below(3) {
                0 if i < b.len() => b[i] = byte,
                1 if i < b.len() => {
                    b.remove(i);
                }
                _ => b.insert(i, byte),
            }
        }
        b
    }

    /// Whether the fast path agrees with the full decoder on `body`; true when it answered.
    fn agree(route: Route, body: &[u8]) -> bool {
        fn same<T: PartialEq + core::fmt::Debug>(body: &[u8], fast: Option<T>, full: Result<T, String>) -> bool {
            let Some(v) = fast else { return false };
            assert_eq!(Ok(&v), full.as_ref(), "fast path disagrees on {:?}", String::from_utf8_lossy(body));
            true
        }
        match route {
            Route::Allocate => same(body, fast::allocate(body), full_allocate(body)),
            Route::Confirm => same(body, fast::confirm(body), full_confirm(body)),
            Route::Locations => same(body, fast::locations(body), full_locations(body)),
            _ => same(body, fast::keys(body), full_keys(body)),
        }
    }

    #[test]
    fn numbers_are_written_as_json_writes_them() {
        let mut values: Vec<u32> = vec![0, u32::MAX, u32::MAX - 1];
        for p in 0..10 {
            let t = 10u32.pow(p);
            values.extend([t, t - 1, t + 1, t.saturating_mul(2) - 1, t / 2 * 3]);
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push((x >> (x % 32)) as u32);
        }
        let mut out = b"[".to_vec();
        let mut want = "[".to_string();
        for v in values {
            push_u32(&mut out, v);
            out.push(b',');
            want.push_str(&std::format!("{v},"));
        }
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    const ROUTES: [Route; 4] = [Route::Allocate, Route::Confirm, Route::Exists, Route::Locations];

    /// Whether the fast path must answer `body`: the full decoder accepts it, and it holds none
    /// of what fast.rs leaves to the full decoder even in a valid body (an escape, a non-ASCII
    /// byte, a member the route does not know). Everything else fast.rs gives up on (floats,
    /// signs, leading zeros, repeated members, keys `Key::parse` refuses, a missing rank) the
    /// full decoder refuses too.
    fn fast_must_answer(route: Route, body: &[u8]) -> bool {
        let members: &[&str] = match route {
            Route::Allocate | Route::Locations => &["rank", "keys"],
            Route::Confirm => &["rank", "confirmations", "pages_to_release"],
            _ => &["keys"],
        };
        if !full_accepts(route, body) || body.iter().any(|&b| b == b'\\' || !b.is_ascii()) {
            return false;
        }
        let value: serde_json::Value = serde_json::from_slice(body).expect("the full decoder accepted it");
        value.as_object().expect("an object").keys().all(|name| members.contains(&name.as_str()))
    }

    /// Whether the full decoder accepts `body` for `route`.
    fn full_accepts(route: Route, body: &[u8]) -> bool {
        match route {
            Route::Allocate => full_allocate(body).is_ok(),
            Route::Confirm => full_confirm(body).is_ok(),
            Route::Locations => full_locations(body).is_ok(),
            _ => full_keys(body).is_ok(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn the_clients_bodies_take_the_fast_path(seed in any::<u64>()) {
            let mut g = Gen::new(seed);
            for route in ROUTES {
                let body = g.body(route, true);
                prop_assert!(agree(route, body.as_bytes()), "{:?} body took the slow path: {}", route, body);
            }
        }

        /// On any body (the clients' kin, and byte-level edits of them) the fast path either
        /// agrees with the full decoder or gives up, and it gives up only on what it leaves to
        /// the full decoder: a fast path that declined everything would agree vacuously.
        #[test]
        fn the_fast_path_never_disagrees(seed in any::<u64>()) {
            let mut g = Gen::new(seed);
            for route in ROUTES {
                let body = g.body(route, false);
                let edited = mutate(&mut g, &body);
                for b in [body.as_bytes(), &edited] {
                    let answered = agree(route, b);
                    prop_assert!(
                        answered || !fast_must_answer(route, b),
                        "{:?}: the fast path gave up on a plain body the full decoder accepts: {}",
                        route,
                        String::from_utf8_lossy(b)
                    );
                }
            }
        }
    }

    /// What keeps the property above from passing vacuously, on a fixed set of seeds: most of the
    /// non-canonical bodies the full decoder accepts are plain, so "must answer" is checked on
    /// them, and the fast path answers them, odd whitespace and text keys included.
    #[test]
    fn the_fast_path_answers_most_non_canonical_bodies() {
        let (mut accepted, mut plain, mut answered, mut odd_space, mut text_key) = (0, 0, 0, 0, 0);
        // Keys `Gen::key` writes that are not packed hex and need no escape.
        let text_keys = ["\"k\"", "\"ABCDEF", "abcde\"", "abcdef0\""];
        for seed in 0..500 {
            let mut g = Gen::new(seed);
            for route in ROUTES {
                let body = g.body(route, false);
                let b = body.as_bytes();
                accepted += usize::from(full_accepts(route, b));
                plain += usize::from(fast_must_answer(route, b));
                if agree(route, b) {
                    answered += 1;
                    odd_space += usize::from(body.contains(['\n', '\t']));
                    text_key += usize::from(text_keys.iter().any(|k| body.contains(k)));
                }
            }
        }
        // At the time of writing: 696 accepted, 494 plain and answered, 456 with odd whitespace,
        // 53 with text keys.
        assert!(plain * 2 > accepted, "{plain} of the {accepted} bodies the full decoder accepts are plain");
        assert!(
            answered * 2 > accepted,
            "the fast path answered {answered} of {accepted} bodies the full decoder accepts"
        );
        assert!(odd_space * 2 > answered, "{odd_space} of {answered} answered bodies have newlines or tabs");
        assert!(text_key > 20, "{text_key} of {answered} answered bodies have a key that is not packed hex");
    }

    proptest! {
        #[test]
        fn the_lookup_replies_are_what_serde_json_writes(
            exists in proptest::collection::vec(any::<bool>(), 0..40),
            pages in proptest::collection::vec(
                proptest::option::of(prop_oneof![0u32..=10, 0u32..100_000, any::<u32>(), Just(u32::MAX)]),
                0..40,
            ),
        ) {
            let want = serde_json::json!({ "exists": exists });
            prop_assert_eq!(String::from_utf8(exists_json(&exists)).unwrap(), serde_json::to_string(&want).unwrap());
            let want = serde_json::json!({ "locations": pages });
            prop_assert_eq!(String::from_utf8(locations_json(&pages)).unwrap(), serde_json::to_string(&want).unwrap());
        }

        #[test]
        fn the_allocate_reply_is_what_serde_json_writes(
            rank in any::<u32>(),
            texts in proptest::collection::vec(
                prop_oneof![
                    "[0-9a-f]{32}",
                    "[0-9a-fA-F]{32}",
                    any::<String>().prop_filter("a key", |s| !s.is_empty() && s.len() <= MAX_KEY_LEN),
                ],
                0..12,
            ),
            pages in proptest::collection::vec(proptest::option::of(any::<u32>()), 12),
        ) {
            let keys: Vec<Key> = texts.iter().map(|t| Key::parse(t).unwrap()).collect();
            let results: Vec<Allocation> = (0..keys.len())
                .rev()
                .map(|i| Allocation { index: i as u32, page: pages[i], cached: false })
                .collect();
            let want = serde_json::json!({
                "rank": rank,
                "results": results
                    .iter()
                    .map(|a| serde_json::json!([texts[a.index as usize], a.page.map_or(-1, i64::from)]))
                    .collect::<Vec<_>>(),
            });
            let got = allocated_json(rank, &keys, &results).unwrap();
            prop_assert_eq!(String::from_utf8(got).unwrap(), serde_json::to_string(&want).unwrap());
        }
    }

    #[test]
    fn what_vllms_client_sends_takes_the_fast_path() {
        // Python's json.dumps separators (", " and ": ").
        let key = "0123456789abcdef0123456789abcdef";
        let cases = [
            (Route::Allocate, format!(r#"{{"rank": 3, "keys": [["{key}", ""], ["{key}", "{key}"]]}}"#)),
            (Route::Confirm, format!(r#"{{"rank": 0, "confirmations": [["{key}", 12]], "pages_to_release": [4, 5]}}"#)),
            (Route::Exists, format!(r#"{{"keys": ["{key}", "{key}"]}}"#)),
            (Route::Locations, format!(r#"{{"rank": 1, "keys": ["{key}"]}}"#)),
        ];
        for (route, body) in cases {
            assert!(agree(route, body.as_bytes()), "{route:?}: {body}");
        }
        // And what it must leave to the full decoder.
        for (route, body) in [
            (Route::Allocate, r#"{"rank": 1, "rank": 1, "keys": []}"#),
            (Route::Allocate, r#"{"keys": []}"#),
            (Route::Confirm, r#"{"rank": 01, "confirmations": []}"#),
            (Route::Exists, r#"{"keys": ["a\u0062"]}"#),
            (Route::Exists, r#"{"keys": [""]}"#),
            (Route::Exists, r#"{"keys": []} x"#),
            (Route::Locations, r#"{"rank": 0, "keys": [], "other": 1}"#),
        ] {
            assert!(!agree(route, body.as_bytes()), "{route:?} took the fast path: {body}");
        }
    }
}

//! The direct entry point's exchange: its exports' names, the request frames, the statuses and
//! the replies' encoding, one codec for the guest (`kvpages-plugin`'s `direct.rs`, which exports
//! the two functions) and the host.
//!
//! The direct entry point is two plain core-wasm exports beside the component's WIT interface,
//! through which kvpages' own host drives the same engine with one guest entry a command.
//!
//! A call through the component model enters the guest three times (`cabi_realloc` for the key
//! list, the export, its post-return) and spends ~3.5k host instructions a call in wasmtime's
//! component layer and the bindings (a 1-key `exists`: 5.3k instructions through the WIT
//! interface, 2.8k this way, 0.65k natively). The direct entry point is a byte exchange in a
//! buffer the guest keeps: the host writes a request there, calls [`CALL`] once, and reads the
//! reply where the guest's descriptor points. The WIT interface stays the plugin's contract (other hosts, and kvpages'
//! own host for a component without these exports, use it); this is an optional, faster way in
//! for a host that finds both exports in the component's core module. Both ways run the same
//! [`Core::apply`](kvpages_core::Core::apply) on the same state.
//!
//! # The exchange (version 1)
//! - [`BUFFER`]`(len: u32) -> u32`: a pointer to at least `len` writable bytes for the next
//!   request. The buffer stays where it is until the next `BUFFER` call, or until a request
//!   after which [`keeps_buffer`] says no (a [`RESTORE`], or any request over 1 MiB) has been
//!   handled: a host may reuse it while its requests fit and that rule says yes, and must ask
//!   again otherwise (writing to a dropped buffer would corrupt the guest's heap).
//! - [`CALL`]`(len: u32) -> u32`: handles the request in the buffer's first `len` bytes and
//!   returns a pointer to a 12-byte descriptor: `status u32le · ptr u32le · len u32le`, the reply
//!   being the `len` bytes at `ptr` (valid until the next call into the guest).
//!
//! A request is a kind byte, then its body:
//! - [`CREATE`]: `seed u64le · postcard(Settings)` ([`encode_create`]); replies nothing.
//! - [`APPLY`]: `now u64le · op u8 · header · packed keys` (see [`encode_apply`]); replies
//!   the core's reply ([`encode_reply`]).
//! - [`SNAPSHOT`]: nothing ([`encode_snapshot`]); replies the snapshot's bytes.
//! - [`RESTORE`]: the snapshot's bytes ([`encode_restore`]); replies nothing.
//!
//! The guest reads a request with [`decode_request`]; the host reads a reply with
//! [`decode_reply`], [`decode_done`] or [`decode_snapshot`].
//!
//! A status is [`OK`] (the reply above), [`REFUSED`] (`postcard(kvpages_core::Error)`: the
//! core refused the command, nothing applied) or [`FAULT`] (a UTF-8 message: a malformed
//! request, no engine created yet, a snapshot that does not restore — what the WIT interface
//! answers as `invalid-input`, `not-created`, `snapshot-invalid`).
//!
//! The hot commands (allocate, confirm, exists, locations, delete) carry their keys packed as
//! in the WIT interface's `packed-keys` ([`pack_keys`](crate::keys::pack_keys): 18 bytes a
//! 32-hex key), decoded by the same code, and get their replies as little-endian words and
//! bytes ([`encode_reply`]); every other command and reply is in postcard, the durable log's
//! encoding, where a key is its text (too slow for the hot path, fine for the rest: postcard
//! writes a value a few bytes at a time, and each of those copies is a `memory.copy` that
//! wasmtime runs as a call into the host, ~60 instructions).

use alloc::string::String;
use alloc::vec::Vec;

use kvpages_core::{Command, Millis, Reply, Settings, Space};

/// The export that hands out the request buffer.
pub const BUFFER: &str = "kvpages_direct_v1_buffer";
/// The export that handles a request.
pub const CALL: &str = "kvpages_direct_v1_call";

/// Request kind: create the engine.
pub const CREATE: u8 = 0;
/// Request kind: apply a command.
pub const APPLY: u8 = 1;
/// Request kind: take a snapshot.
pub const SNAPSHOT: u8 = 2;
/// Request kind: replace the state with a snapshot's.
pub const RESTORE: u8 = 3;

/// Status: done; the reply is the request kind's.
pub const OK: u32 = 0;
/// Status: the core refused the command; the reply is `postcard(kvpages_core::Error)`.
pub const REFUSED: u32 = 1;
/// Status: the request could not be handled; the reply is a UTF-8 message.
pub const FAULT: u32 = 2;

/// `APPLY` op: allocate, header `postcard((Space, rank))`.
pub const OP_ALLOCATE: u8 = 1;
/// `APPLY` op: confirm, header `postcard((Space, rank, releases))`, then the pages as a
/// `u32le` count and `u32le`s.
pub const OP_CONFIRM: u8 = 2;
/// `APPLY` op: exists, header `postcard(Space)`.
pub const OP_EXISTS: u8 = 3;
/// `APPLY` op: locations, header `postcard((Space, rank))`.
pub const OP_LOCATIONS: u8 = 4;
/// `APPLY` op: delete, header `postcard(Space)`.
pub const OP_DELETE: u8 = 5;
/// `APPLY` op: configure; this and the ops below carry their command's fields as a postcard
/// tuple (see [`encode_apply`]).
pub const OP_CONFIGURE: u8 = 6;
/// `APPLY` op: initialize.
pub const OP_INITIALIZE: u8 = 7;
/// `APPLY` op: inspect.
pub const OP_INSPECT: u8 = 8;
/// `APPLY` op: reset.
pub const OP_RESET: u8 = 9;
/// `APPLY` op: clear.
pub const OP_CLEAR: u8 = 10;
/// `APPLY` op: stats.
pub const OP_STATS: u8 = 11;
/// `APPLY` op: SGLang import.
pub const OP_IMPORT_SGLANG: u8 = 12;
/// `APPLY` op: SGLang export.
pub const OP_EXPORT_SGLANG: u8 = 13;
/// `APPLY` op: lease all.
pub const OP_LEASE_ALL: u8 = 14;

/// Appends an [`APPLY`] request for `cmd` at `now` to `out`; returns where its packed keys
/// start (they run to the end): the host's journal copies them from there.
pub fn encode_apply(out: &mut Vec<u8>, now: Millis, cmd: &Command) -> usize {
    out.push(APPLY);
    out.extend_from_slice(&now.to_le_bytes());
    let put = |out: &mut Vec<u8>, header: &dyn erased::Header| header.put(out);
    match cmd {
        Command::Allocate { space, rank, keys } => hot(out, OP_ALLOCATE, &(space, *rank), keys),
        Command::Confirm { space, rank, confirmations, releases } => {
            out.push(OP_CONFIRM);
            put(out, &(space, *rank, releases));
            out.reserve(4 + 4 * confirmations.len());
            out.extend_from_slice(&(confirmations.len() as u32).to_le_bytes());
            for (_, page) in confirmations {
                out.extend_from_slice(&page.to_le_bytes());
            }
            let start = out.len();
            crate::keys::pack_keys(out, confirmations.iter().map(|(k, _)| k));
            start
        }
        Command::Exists { space, keys } => hot(out, OP_EXISTS, space, keys),
        Command::Locations { space, rank, keys } => hot(out, OP_LOCATIONS, &(space, *rank), keys),
        Command::Delete { space, keys } => hot(out, OP_DELETE, space, keys),
        // The rest: each command's fields as a postcard tuple, no keys to pack (a serde derive
        // of the whole `Command` would put ~27 KB of decoder into the guest, see `cold`).
        Command::Configure(settings) => cold(out, OP_CONFIGURE, settings),
        Command::Initialize { space, rank, num_pages } => cold(out, OP_INITIALIZE, &(space, *rank, *num_pages)),
        Command::Inspect { space, key } => cold(out, OP_INSPECT, &(space, key)),
        Command::Reset { space } => cold(out, OP_RESET, space),
        Command::Clear { space } => cold(out, OP_CLEAR, space),
        Command::Stats => cold(out, OP_STATS, &()),
        Command::ImportSglang { pools, replace } => cold(out, OP_IMPORT_SGLANG, &(pools, *replace)),
        Command::ExportSglang => cold(out, OP_EXPORT_SGLANG, &()),
        Command::LeaseAll => cold(out, OP_LEASE_ALL, &()),
    }
}

/// Appends `op`, `header` and the packed `keys`; returns where the keys start.
fn hot(out: &mut Vec<u8>, op: u8, header: &dyn erased::Header, keys: &[kvpages_core::Key]) -> usize {
    out.push(op);
    header.put(out);
    let start = out.len();
    crate::keys::pack_keys(out, keys.iter());
    start
}

/// Appends `op` and `fields`: a command without keys to pack.
fn cold(out: &mut Vec<u8>, op: u8, fields: &dyn erased::Header) -> usize {
    out.push(op);
    fields.put(out);
    out.len()
}

/// Appends a [`CREATE`] request: a fresh engine of `seed` and `settings`.
pub fn encode_create(out: &mut Vec<u8>, seed: u64, settings: &Settings) {
    out.push(CREATE);
    out.extend_from_slice(&seed.to_le_bytes());
    erased::Header::put(settings, out);
}

/// Appends a [`SNAPSHOT`] request.
pub fn encode_snapshot(out: &mut Vec<u8>) {
    out.push(SNAPSHOT);
}

/// Appends a [`RESTORE`] request: the engine's state replaced by `snapshot`'s.
pub fn encode_restore(out: &mut Vec<u8>, snapshot: &[u8]) {
    out.reserve(1 + snapshot.len());
    out.push(RESTORE);
    out.extend_from_slice(snapshot);
}

/// The headers' encoding (postcard), behind one non-generic function so each header type does
/// not get its own copy of the encoder in the guest.
mod erased {
    use alloc::vec::Vec;

    pub(super) trait Header {
        fn put(&self, out: &mut Vec<u8>);
    }

    impl<T: serde::Serialize> Header for T {
        fn put(&self, out: &mut Vec<u8>) {
            // Writing to a `Vec` cannot fail; the types are the core's, which always encode.
            let bytes = core::mem::take(out);
            *out = postcard::to_extend(self, bytes).expect("a header encodes");
        }
    }
}

/// The rare commands' and replies' postcard, kept out of the hot paths. Each type is encoded on
/// its own (a command's fields, a reply's payload), never as the whole `Command` or `Reply`:
/// serde's derives of those two enums, inlined by the plugin's build, came to ~60 KB of guest
/// code, a component ~20 % bigger and a compilation at start-up ~50 % longer.
mod cold {
    use alloc::string::String;
    use alloc::vec::Vec;

    /// The whole of `bytes` as a `T`.
    #[inline(never)]
    pub(super) fn decode<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
        super::whole(bytes).map_err(|e| alloc::format!("malformed direct request: fields: {e}"))
    }

    #[inline(never)]
    pub(super) fn encode<T: serde::Serialize + ?Sized>(value: &T, out: Vec<u8>) -> postcard::Result<Vec<u8>> {
        postcard::to_extend(value, out)
    }
}

/// The whole of `bytes` as a `T` in postcard (which itself ignores what follows a value).
fn whole<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(alloc::format!("{} trailing bytes", rest.len())),
        Err(e) => Err(alloc::format!("{e}")),
    }
}

/// An [`APPLY`] request, decoded: the command, and whether every key came in the raw form (see
/// [`discard`](crate::keys::discard)).
#[derive(Debug)]
pub struct Applied {
    /// The request's time.
    pub now: Millis,
    /// The request's op (which command, hence which reply).
    pub op: u8,
    /// The command.
    pub cmd: Command,
    /// Every key of the batch was a raw 32-hex one.
    pub raw: bool,
}

/// Decodes an [`APPLY`] request's body (after the kind byte), refusing anything malformed with
/// a message (never a trap).
pub fn decode_apply(body: &[u8]) -> Result<Applied, String> {
    use crate::keys::unpack_batch;
    let bad = |what: &str| alloc::format!("malformed direct request: {what}");
    let (now, rest) = body.split_first_chunk::<8>().ok_or_else(|| bad("no time"))?;
    let now = u64::from_le_bytes(*now);
    let (&op, rest) = rest.split_first().ok_or_else(|| bad("no op"))?;
    fn header<'a, T: serde::Deserialize<'a>>(rest: &'a [u8]) -> Result<(T, &'a [u8]), String> {
        postcard::take_from_bytes(rest).map_err(|e| alloc::format!("malformed direct request: header: {e}"))
    }
    let keys = |rest: &[u8]| unpack_batch(rest, |_, key| key);
    let (cmd, raw) = match op {
        OP_ALLOCATE => {
            let ((space, rank), rest): ((Space, u32), _) = header(rest)?;
            let (keys, raw) = keys(rest)?;
            (Command::Allocate { space, rank, keys }, raw)
        }
        OP_CONFIRM => {
            let ((space, rank, releases), rest): ((Space, u32, Vec<u32>), _) = header(rest)?;
            let (n, rest) = rest.split_first_chunk::<4>().ok_or_else(|| bad("no page count"))?;
            let n = u32::from_le_bytes(*n) as usize;
            let bytes = n.checked_mul(4).filter(|&b| b <= rest.len()).ok_or_else(|| bad("pages cut off"))?;
            let (pages, rest) = rest.split_at(bytes);
            let (pages, _) = pages.as_chunks::<4>();
            let page = |i: usize| pages.get(i).map(|p| u32::from_le_bytes(*p));
            let (confirmations, raw) = crate::keys::confirmations(rest, n, page)?;
            (Command::Confirm { space, rank, confirmations, releases }, raw)
        }
        OP_EXISTS => {
            let (space, rest): (Space, _) = header(rest)?;
            let (keys, raw) = keys(rest)?;
            (Command::Exists { space, keys }, raw)
        }
        OP_LOCATIONS => {
            let ((space, rank), rest): ((Space, u32), _) = header(rest)?;
            let (keys, raw) = keys(rest)?;
            (Command::Locations { space, rank, keys }, raw)
        }
        OP_DELETE => {
            let (space, rest): (Space, _) = header(rest)?;
            let (keys, raw) = keys(rest)?;
            (Command::Delete { space, keys }, raw)
        }
        OP_CONFIGURE => (Command::Configure(cold::decode(rest)?), false),
        OP_INITIALIZE => {
            let (space, rank, num_pages) = cold::decode(rest)?;
            (Command::Initialize { space, rank, num_pages }, false)
        }
        OP_INSPECT => {
            let (space, key) = cold::decode(rest)?;
            (Command::Inspect { space, key }, false)
        }
        OP_RESET => (Command::Reset { space: cold::decode(rest)? }, false),
        OP_CLEAR => (Command::Clear { space: cold::decode(rest)? }, false),
        OP_STATS => cold::decode::<()>(rest).map(|()| (Command::Stats, false))?,
        OP_IMPORT_SGLANG => {
            let (pools, replace) = cold::decode(rest)?;
            (Command::ImportSglang { pools, replace }, false)
        }
        OP_EXPORT_SGLANG => cold::decode::<()>(rest).map(|()| (Command::ExportSglang, false))?,
        OP_LEASE_ALL => cold::decode::<()>(rest).map(|()| (Command::LeaseAll, false))?,
        other => return Err(bad(&alloc::format!("op {other}"))),
    };
    Ok(Applied { now, op, cmd, raw })
}

/// A request, decoded (by the guest).
#[derive(Debug)]
pub enum Request<'a> {
    /// [`CREATE`]: a fresh engine.
    Create {
        /// The hasher seed.
        seed: u64,
        /// The settings.
        settings: Settings,
    },
    /// [`APPLY`]: a command.
    Apply(Applied),
    /// [`SNAPSHOT`]: the state's bytes.
    Snapshot,
    /// [`RESTORE`]: the state replaced by these snapshot bytes.
    Restore(&'a [u8]),
}

/// Decodes a whole request (the kind byte first), refusing anything malformed with a message
/// (never a panic).
pub fn decode_request(request: &[u8]) -> Result<Request<'_>, String> {
    let Some((&kind, body)) = request.split_first() else { return Err("an empty direct request".into()) };
    match kind {
        CREATE => {
            let Some((seed, settings)) = body.split_first_chunk::<8>() else {
                return Err("malformed direct request: no seed".into());
            };
            Ok(Request::Create { seed: u64::from_le_bytes(*seed), settings: cold::decode(settings)? })
        }
        APPLY => decode_apply(body).map(Request::Apply),
        SNAPSHOT => Ok(Request::Snapshot),
        RESTORE => Ok(Request::Restore(body)),
        other => Err(alloc::format!("an unknown request kind {other}")),
    }
}

/// Appends `reply` to `out` for the host: the hot commands' replies as fixed-width fields, the
/// others' payloads in postcard (the host knows which command it sent, so no tag).
/// - `Allocated`: two `u32le` a distinct key, as WIT's `packed-allocations` (the index with
///   bit 31 for a cache hit, then the page or `u32::MAX` for none);
/// - `Exists`: a byte a key, 0 or 1;
/// - `Locations`: a `u32le` a key, the page or `u32::MAX` for none;
/// - `Deleted`: the count as `u32le`;
/// - `Confirmed`: `committed · unchanged · superseded · released · refusals · (index · page ·
///   reason)… · ignored · (page · reason)…`, all `u32le` (reasons as the words of `refusal_word` and `ignored_word`,
///   declare them).
pub fn encode_reply(out: &mut Vec<u8>, reply: &Reply) -> Result<(), postcard::Error> {
    match reply {
        Reply::Allocated(a) => words(out, a.iter().flat_map(crate::allocations::allocation_words), 2 * a.len()),
        Reply::Exists(e) => out.extend(e.iter().map(|&b| u8::from(b))),
        Reply::Locations(l) => words(out, l.iter().map(|p| p.unwrap_or(u32::MAX)), l.len()),
        Reply::Deleted(n) => out.extend_from_slice(&n.to_le_bytes()),
        Reply::Confirmed(r) => {
            let head = [r.committed, r.unchanged, r.superseded, r.released, r.refused.len() as u32];
            words(out, head.into_iter(), 5);
            words(out, r.refused.iter().flat_map(|f| [f.index, f.page, refusal_word(f.reason)]), 3 * r.refused.len());
            let ignored = &r.ignored_releases;
            words(out, core::iter::once(ignored.len() as u32), 1);
            words(out, ignored.iter().flat_map(|&(page, why)| [page, ignored_word(why)]), 2 * ignored.len());
        }
        // The rest: each reply's payload in postcard (the host knows which it asked for).
        Reply::Configured => {}
        Reply::Initialized { rank, num_pages, outcome } => put(out, &(rank, num_pages, outcome))?,
        Reply::Cleared { ranks, keys } => put(out, &(ranks, keys))?,
        Reply::Key(info) => put(out, &info.as_deref())?,
        Reply::Stats(stats) => put(out, &**stats)?,
        Reply::Imported { pools, keys, leaked_pages } => put(out, &(pools, keys, leaked_pages))?,
        Reply::SglangPools(pools) => put(out, pools)?,
        Reply::Leased(n) => put(out, n)?,
    }
    Ok(())
}

/// Appends `value` in postcard.
fn put<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), postcard::Error> {
    *out = cold::encode(value, core::mem::take(out))?;
    Ok(())
}

/// Every refusal reason, for the decoder.
const REFUSALS: [kvpages_core::Refusal; 3] = {
    use kvpages_core::Refusal::*;
    [NotReserved, ReservedForAnotherKey, CommittedToAnotherKey]
};

/// A refusal reason's word (the one table both sides read: not the enum's declaration order).
fn refusal_word(r: kvpages_core::Refusal) -> u32 {
    use kvpages_core::Refusal::*;
    match r {
        NotReserved => 0,
        ReservedForAnotherKey => 1,
        CommittedToAnotherKey => 2,
    }
}

/// Every reason a release is ignored, for the decoder.
const IGNORED: [kvpages_core::IgnoredRelease; 2] =
    [kvpages_core::IgnoredRelease::AlreadyFree, kvpages_core::IgnoredRelease::Committed];

/// An ignored release's reason as its word.
fn ignored_word(r: kvpages_core::IgnoredRelease) -> u32 {
    match r {
        kvpages_core::IgnoredRelease::AlreadyFree => 0,
        kvpages_core::IgnoredRelease::Committed => 1,
    }
}

/// A guest's fault message as the host keeps it: at most 1 KiB of it (a hostile guest could
/// point at its whole memory), lossy UTF-8.
pub fn fault_text(body: &[u8]) -> String {
    const MAX: usize = 1024;
    let mut text = String::from_utf8_lossy(&body[..body.len().min(MAX)]).into_owned();
    if body.len() > MAX {
        text.push_str(&alloc::format!("… ({} bytes)", body.len()));
    }
    text
}

/// Appends `n` words, little-endian (one capacity check; each word a fixed 4-byte store, not a
/// `memory.copy`).
fn words(out: &mut Vec<u8>, words: impl Iterator<Item = u32>, n: usize) {
    out.reserve(4 * n);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// A reply's `u32le` words, read in order.
struct Words<'a>(&'a [u8]);

impl Words<'_> {
    fn next(&mut self) -> Result<u32, String> {
        let (w, rest) = self.0.split_first_chunk::<4>().ok_or("a reply cut short")?;
        self.0 = rest;
        Ok(u32::from_le_bytes(*w))
    }

    /// The rest, which must be whole words.
    fn all(self) -> Result<impl Iterator<Item = u32>, String> {
        let (words, []) = self.0.as_chunks::<4>() else { return Err("a reply of a partial word".into()) };
        Ok(words.iter().map(|w| u32::from_le_bytes(*w)))
    }

    /// Nothing may follow.
    fn end(self, what: &str) -> Result<(), String> {
        if self.0.is_empty() { Ok(()) } else { Err(alloc::format!("{what} with trailing bytes")) }
    }
}

/// Decodes the reply to `cmd` ([`encode_reply`]'s forms) under the status the descriptor
/// named: the core's answer, or why there is none (the guest's fault message, or a malformed
/// reply).
pub fn decode_reply(cmd: &Command, status: u32, body: &[u8]) -> Result<Result<Reply, kvpages_core::Error>, String> {
    use kvpages_core::{ConfirmReport, Refused};
    match status {
        OK => {}
        REFUSED => return whole(body).map(Err).map_err(|e| alloc::format!("a malformed refusal: {e}")),
        FAULT => return Err(fault_text(body)),
        other => return Err(alloc::format!("an unknown status {other}")),
    }
    let reply = match cmd {
        Command::Allocate { .. } => {
            // Read straight from the body's 8-byte records (no vector of words in between).
            let _whole_words = Words(body).all()?;
            let (pairs, []) = body.as_chunks::<8>() else {
                return Err(crate::allocations::not_pairs(body.len() / 4));
            };
            let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            Reply::Allocated(
                pairs.iter().map(|p| crate::allocations::allocation_of(word(&p[..4]), word(&p[4..]))).collect(),
            )
        }
        Command::Exists { .. } => Reply::Exists(
            body.iter()
                .map(|&b| match b {
                    0 | 1 => Ok(b == 1),
                    _ => Err(alloc::format!("an exists byte {b}")),
                })
                .collect::<Result<_, _>>()?,
        ),
        Command::Locations { .. } => {
            Reply::Locations(Words(body).all()?.map(|p| (p != u32::MAX).then_some(p)).collect())
        }
        Command::Delete { .. } => {
            let mut w = Words(body);
            let n = w.next()?;
            w.end("a delete count")?;
            Reply::Deleted(n)
        }
        Command::Confirm { .. } => {
            let mut w = Words(body);
            let (committed, unchanged, superseded, released) = (w.next()?, w.next()?, w.next()?, w.next()?);
            let n = w.next()? as usize;
            let mut refused = Vec::with_capacity(n.min(body.len() / 12));
            for _ in 0..n {
                let (index, page) = (w.next()?, w.next()?);
                let word = w.next()?;
                let reason = REFUSALS
                    .into_iter()
                    .find(|&r| refusal_word(r) == word)
                    .ok_or_else(|| alloc::format!("a refusal reason {word}"))?;
                refused.push(Refused { index, page, reason });
            }
            let n = w.next()? as usize;
            let mut ignored_releases = Vec::with_capacity(n.min(body.len() / 8));
            for _ in 0..n {
                let page = w.next()?;
                let word = w.next()?;
                let why = IGNORED
                    .into_iter()
                    .find(|&r| ignored_word(r) == word)
                    .ok_or_else(|| alloc::format!("an ignored-release reason {word}"))?;
                ignored_releases.push((page, why));
            }
            w.end("a confirm report")?;
            Reply::Confirmed(ConfirmReport { committed, unchanged, superseded, refused, released, ignored_releases })
        }
        cold => {
            fn get<'a, T: serde::Deserialize<'a>>(body: &'a [u8]) -> Result<T, String> {
                whole(body).map_err(|e| alloc::format!("a malformed reply: {e}"))
            }
            match cold {
                Command::Configure(_) => get::<()>(body).map(|()| Reply::Configured)?,
                Command::Initialize { .. } => {
                    let (rank, num_pages, outcome) = get(body)?;
                    Reply::Initialized { rank, num_pages, outcome }
                }
                Command::Reset { .. } | Command::Clear { .. } => {
                    let (ranks, keys) = get(body)?;
                    Reply::Cleared { ranks, keys }
                }
                Command::Inspect { .. } => {
                    Reply::Key(get::<Option<kvpages_core::KeyInfo>>(body)?.map(alloc::boxed::Box::new))
                }
                Command::Stats => Reply::Stats(alloc::boxed::Box::new(get(body)?)),
                Command::ImportSglang { .. } => {
                    let (pools, keys, leaked_pages) = get(body)?;
                    Reply::Imported { pools, keys, leaked_pages }
                }
                Command::ExportSglang => Reply::SglangPools(get(body)?),
                Command::LeaseAll => Reply::Leased(get(body)?),
                Command::Allocate { .. }
                | Command::Confirm { .. }
                | Command::Exists { .. }
                | Command::Locations { .. }
                | Command::Delete { .. } => unreachable!("decoded above"),
            }
        }
    };
    Ok(Ok(reply))
}

/// Appends a refusal for the host: `postcard(Error)` (the reply of status [`REFUSED`]).
pub fn encode_refusal(out: &mut Vec<u8>, e: &kvpages_core::Error) -> Result<(), postcard::Error> {
    put(out, e)
}

/// Whether `reply` is the kind of reply a command of request op `op` gets (the guest checks the
/// core's answer before encoding it, since the host decodes by the command it sent).
pub fn answers(op: u8, reply: &Reply) -> bool {
    matches!(
        (op, reply),
        (OP_CONFIGURE, Reply::Configured)
            | (OP_INITIALIZE, Reply::Initialized { .. })
            | (OP_ALLOCATE, Reply::Allocated(_))
            | (OP_CONFIRM, Reply::Confirmed(_))
            | (OP_EXISTS, Reply::Exists(_))
            | (OP_LOCATIONS, Reply::Locations(_))
            | (OP_DELETE, Reply::Deleted(_))
            | (OP_INSPECT, Reply::Key(_))
            | (OP_RESET | OP_CLEAR, Reply::Cleared { .. })
            | (OP_STATS, Reply::Stats(_))
            | (OP_IMPORT_SGLANG, Reply::Imported { .. })
            | (OP_EXPORT_SGLANG, Reply::SglangPools(_))
            | (OP_LEASE_ALL, Reply::Leased(_))
    )
}

/// Decodes a reply's descriptor: `(status, ptr, len)`.
pub fn descriptor(bytes: [u8; 12]) -> (u32, u32, u32) {
    let word = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    (word(0), word(4), word(8))
}

/// Past this many bytes a buffer is not kept for the next call.
pub const BIG: usize = 1 << 20;

/// Whether the guest keeps its request buffer, in place, after handling `request`: not after a
/// restore, nor after any request over 1 MiB (a big import), so a rare big request does not
/// hold guest memory. The one rule both sides follow: the host asks for a buffer again when
/// this says no.
pub fn keeps_buffer(request: &[u8]) -> bool {
    request.len() <= BIG && request.first() != Some(&RESTORE)
}

/// Decodes the reply to a [`CREATE`] or [`RESTORE`], which carries nothing when it is [`OK`]:
/// why not, otherwise (the guest's fault message, capped by [`fault_text`]).
pub fn decode_done(status: u32, body: &[u8]) -> Result<(), String> {
    match status {
        OK => Ok(()),
        FAULT => Err(fault_text(body)),
        other => Err(alloc::format!("an unknown status {other}")),
    }
}

/// Decodes the reply to a [`SNAPSHOT`]: the snapshot's bytes, or why not.
pub fn decode_snapshot(status: u32, body: &[u8]) -> Result<&[u8], String> {
    decode_done(status, body).map(|()| body)
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use kvpages_core::{Allocation, Eviction, Key};

    use super::*;

    fn key(s: &str) -> Key {
        Key::parse(s).unwrap()
    }

    /// The frames decode as what was encoded: a command's keys raw when all are 32-hex, and
    /// a reply read back by the command it answers.
    #[test]
    fn frames_decode_as_they_were_encoded() {
        let settings = Settings { eviction: Eviction::Off, ..Settings::default() };
        let mut out = Vec::new();
        encode_create(&mut out, 7, &settings);
        assert!(matches!(decode_request(&out), Ok(Request::Create { seed: 7, settings: s }) if s == settings));
        let hex = key("386b2d9cf5aa91ba3a4b42c35396c822");
        for (cmd, raw) in [
            (Command::Allocate { space: Space::Vllm, rank: 2, keys: vec![hex.clone(), hex.clone()] }, true),
            (Command::Exists { space: Space::Vllm, keys: vec![hex.clone(), key("t")] }, false),
            (Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 4 }, false),
        ] {
            out.clear();
            let keys = encode_apply(&mut out, 9, &cmd);
            let mut packed = Vec::new();
            crate::keys::pack_keys_of(&mut packed, &cmd);
            assert_eq!(out[keys..], packed[..]);
            let Ok(Request::Apply(a)) = decode_request(&out) else { panic!("{out:?}") };
            assert_eq!((a.now, a.cmd, a.raw), (9, cmd, raw));
        }
        let cmd = Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex, key("t")] };
        let reply = Reply::Allocated(vec![
            Allocation { index: 0, page: Some(3), cached: true },
            Allocation { index: 1, page: None, cached: false },
        ]);
        out.clear();
        encode_reply(&mut out, &reply).unwrap();
        assert!(answers(OP_ALLOCATE, &reply) && !answers(OP_EXISTS, &reply));
        assert_eq!(decode_reply(&cmd, OK, &out), Ok(Ok(reply)));
        out.clear();
        encode_refusal(&mut out, &kvpages_core::Error::ZeroPages { rank: 1 }).unwrap();
        assert_eq!(decode_reply(&cmd, REFUSED, &out), Ok(Err(kvpages_core::Error::ZeroPages { rank: 1 })));
        out.clear();
        encode_snapshot(&mut out);
        assert!(matches!(decode_request(&out), Ok(Request::Snapshot)));
        out.clear();
        encode_restore(&mut out, &[1, 2]);
        assert!(matches!(decode_request(&out), Ok(Request::Restore([1, 2]))));
        assert_eq!(decode_done(OK, &[]), Ok(()));
        assert_eq!(decode_done(FAULT, b"why"), Err("why".into()));
        assert_eq!(decode_snapshot(REFUSED, &[]), Err("an unknown status 1".into()));
        assert_eq!(decode_snapshot(OK, &[5]), Ok(&[5][..]));
    }

    #[test]
    fn a_guests_texts_are_capped_at_1_kib() {
        assert_eq!(fault_text(b"short"), "short");
        let long = "é".repeat(1000); // 2,000 bytes; byte 1,024 ends a character
        let got = fault_text(long.as_bytes());
        assert!(got.starts_with(&"é".repeat(512)) && got.ends_with("… (2000 bytes)"), "{got}");
        // Cut inside a character: a replacement character, no panic.
        let odd = alloc::format!("x{long}");
        assert!(fault_text(odd.as_bytes()).contains('\u{fffd}'));
    }

    #[test]
    fn malformed_replies_are_refused_by_the_decoder() {
        let keys = vec![key("a")];
        let alloc = Command::Allocate { space: Space::Vllm, rank: 0, keys: keys.clone() };
        let exists = Command::Exists { space: Space::Vllm, keys: keys.clone() };
        let confirm = Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![], releases: vec![] };
        for (cmd, status, body, why) in [
            (&alloc, OK, &[0u8; 4][..], "1 allocation words"),
            (&alloc, OK, &[0u8; 5][..], "partial word"),
            (&exists, OK, &[2u8][..], "an exists byte 2"),
            (&confirm, OK, &[0u8; 20][..], "cut short"),
            (&confirm, OK, &[0u8; 28][..], "trailing bytes"),
            (&exists, 7, &[][..], "an unknown status 7"),
            (&exists, REFUSED, &[200][..], "a malformed refusal"),
            (&exists, FAULT, &b"why"[..], "why"),
            (&Command::Stats, OK, &[][..], "a malformed reply"),
            (&Command::LeaseAll, OK, &[5, 0][..], "1 trailing bytes"),
            (&exists, REFUSED, &[0, 0, 0][..], "trailing bytes"),
        ] {
            let e = decode_reply(cmd, status, body).unwrap_err();
            assert!(e.contains(why), "{cmd:?} {body:?}: {e}");
        }
        let mut body = vec![0u8; 20];
        body[16] = 1; // one refusal ...
        body.extend_from_slice(&[0; 8]);
        body.extend_from_slice(&9u32.to_le_bytes()); // ... with reason 9
        body.extend_from_slice(&[0; 4]);
        assert!(decode_reply(&confirm, OK, &body).unwrap_err().contains("a refusal reason 9"));
    }
}

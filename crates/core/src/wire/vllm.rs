//! vLLM's HF3FS metadata routes: the peer's JSON shapes and texts, kvpages' rules for bad input.
//!
//! See `protocol-vllm.md` (in the project's notes) for the peer, and `docs/errors.md` for every
//! error answer.

use std::format;
use std::string::String;
use std::vec::Vec;

use serde::Serialize;
use serde::de::{self, MapAccess};
use serde::ser::{SerializeSeq, SerializeStruct};

use super::json::{KeyPage, KeyPair, KeyStr, KeyText, List, Members, Object, U32, decode, missing, value};
use super::{Answer, ErrorCode, Failure, Parsed, Shape, apply, nothing_confirmed, unexpected, unexpected_refusal};
use crate::command::{Allocation, Command, Reply, Space};
use crate::error::Error;
use crate::key::Key;

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
        Route::Allocate => {
            let (rank, List(pairs)) = decode_rank_keys::<KeyPair>(body).map_err(invalid)?;
            Command::Allocate { space: SPACE, rank, keys: pairs.into_iter().map(|p| p.0).collect() }
        }
        Route::Confirm => {
            let Object(b) = decode::<Object<ConfirmBody>>(body).map_err(invalid)?;
            Command::Confirm {
                space: SPACE,
                rank: b.rank.expect("checked in finish").0,
                confirmations: b.confirmations.0.into_iter().map(|KeyPage(k, p)| (k, p)).collect(),
                releases: b.pages_to_release.0.into_iter().map(|p| p.0).collect(),
            }
        }
        Route::Exists => {
            let Object(b) = decode::<Object<KeysBody>>(body).map_err(invalid)?;
            Command::Exists { space: SPACE, keys: b.keys.0.into_iter().map(|k| k.0).collect() }
        }
        Route::Locations => {
            let (rank, List(keys)) = decode_rank_keys::<KeyStr>(body).map_err(invalid)?;
            Command::Locations { space: SPACE, rank, keys: keys.into_iter().map(|k| k.0).collect() }
        }
        // The body is ignored, as in the peer.
        Route::Clear => Command::Clear { space: SPACE },
        Route::Delete => {
            let Object(b) = decode::<Object<KeysBody>>(body).map_err(invalid)?;
            Command::Delete { space: SPACE, keys: b.keys.0.into_iter().map(|k| k.0).collect() }
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
            Ok(Answer::json(&Allocated { rank: *rank, keys, results: &results }))
        }
        (Route::Confirm, Reply::Confirmed(_), _) => Ok(Answer::no_content()),
        (Route::Exists, Reply::Exists(exists), _) => Ok(Answer::json(&ExistsReply { exists })),
        (Route::Locations, Reply::Locations(locations), _) => Ok(Answer::json(&LocationsReply { locations })),
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
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Role;
            fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str("\"worker\" or \"scheduler\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Role, E> {
                match v {
                    "worker" => Ok(Role::Worker),
                    "scheduler" => Ok(Role::Scheduler),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_str(V)
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

fn decode_rank_keys<T: for<'de> serde::Deserialize<'de>>(body: &[u8]) -> Result<(u32, List<T>), String> {
    let Object(b) = decode::<Object<RankKeys<T>>>(body)?;
    Ok((b.rank.expect("checked in finish").0, b.keys))
}

struct Allocated<'a> {
    rank: u32,
    keys: &'a [Key],
    results: &'a [Allocation],
}

impl Serialize for Allocated<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct Results<'a>(&'a Allocated<'a>);
        impl Serialize for Results<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(self.0.results.len()))?;
                for a in self.0.results {
                    let page = a.page.map_or(-1, i64::from);
                    seq.serialize_element(&(KeyText(&self.0.keys[a.index as usize]), page))?;
                }
                seq.end()
            }
        }
        let mut st = s.serialize_struct("Allocated", 2)?;
        st.serialize_field("rank", &self.rank)?;
        st.serialize_field("results", &Results(self))?;
        st.end()
    }
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

#[derive(Serialize)]
struct ExistsReply {
    exists: Vec<bool>,
}

#[derive(Serialize)]
struct LocationsReply {
    locations: Vec<Option<u32>>,
}

#[derive(Serialize)]
struct DeletedReply {
    deleted: u32,
}

//! vLLM's HF3FS metadata routes: the peer's JSON shapes and texts, kvpages' rules for bad input.
//!
//! See `../shared/notes/protocol-vllm.md` (in the project's notes) for the peer, and
//! `docs/errors.md` for every error answer.

use axum::extract::{Request, State};
use axum::response::Response;
use kvpages_core::{Command, Error, InitOutcome, Key, Reply, Space};
use serde::Serialize;
use serde::de::{self, MapAccess};
use serde::ser::{SerializeSeq, SerializeStruct};

use super::{Ctx, KeyText, fault, handle_async, unexpected};
use crate::api::{ApiError, ErrorCode, json_ok, no_content};
use crate::engine::EngineError;
use crate::server::App;
use crate::wire::{KeyPage, KeyPair, KeyStr, List, Members, Object, U32, decode, missing, value};

const SPACE: Space = Space::Vllm;

/// Maps a core refusal to the answer of a route whose malformed-request code is `malformed`.
fn refused(malformed: ErrorCode, e: EngineError, confirmations: &[(Key, u32)]) -> ApiError {
    let e = match e {
        EngineError::Domain(e) => e,
        other => return fault(other),
    };
    match e {
        Error::RankNotInitialized { rank } => ApiError::rank_not_initialized(rank),
        Error::ZeroPages { .. } => ApiError::because(ErrorCode::InitializeInvalid, "num_pages must be at least 1"),
        Error::RankOutsideWorld { rank, world_size } => {
            ApiError::filled(ErrorCode::RankOutsideWorld, &[("rank", &rank), ("n", &world_size)])
        }
        e @ Error::PageOutOfRange { .. } => ApiError::because(malformed, e),
        Error::NothingConfirmed { refused } => super::nothing_confirmed(&refused, "confirmations", confirmations),
        // Answers to commands these routes never send.
        e @ (Error::SglangPoolsExist { .. } | Error::ImportRefused { .. }) => fault(EngineError::Domain(e)),
    }
}

fn rank_from_path(path: &str) -> Result<u32, ApiError> {
    let seg = path.strip_prefix("/rank/").and_then(|p| p.strip_suffix("/initialize")).unwrap_or("");
    let digits = !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit());
    match seg.parse::<u32>() {
        Ok(rank) if digits => Ok(rank),
        _ => Err(ApiError::because(
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
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
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

/// `POST /rank/{rank}/initialize` `{"num_pages": N, "role": "worker"|"scheduler"}`.
pub(crate) async fn initialize(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "initialize", req, async |cx: Ctx<'_>| {
        let (path, body) = (cx.path, cx.body);
        let rank = rank_from_path(path)?;
        let Object(b) = decode::<Object<InitializeBody>>(body)
            .map_err(|why| ApiError::because(ErrorCode::InitializeInvalid, why))?;
        if b.role == Some(Role::Scheduler) {
            return Ok(json_ok(&Message { message: "Scheduler role does not require initialization".into() }));
        }
        let Some(U32(num_pages)) = b.num_pages else {
            return Err(ApiError::because(ErrorCode::InitializeInvalid, "member 'num_pages' is missing"));
        };
        let reply = cx.apply(&Command::Initialize { space: SPACE, rank, num_pages }).await
            .map_err(|e| refused(ErrorCode::InitializeInvalid, e, &[]))?;
        match reply {
            Reply::Initialized { outcome, .. } => match outcome {
                InitOutcome::Created { joined_after_keys: true } => tracing::warn!(
                    rank,
                    "rank {rank} joined after keys were confirmed: those keys are incomplete until rank {rank} stores them"
                ),
                InitOutcome::Created { .. } => tracing::info!(rank, num_pages, "rank initialized"),
                InitOutcome::Unchanged => tracing::debug!(rank, num_pages, "rank already initialized with this size"),
                InitOutcome::Recreated { old_num_pages, dropped_keys } => tracing::warn!(
                    rank,
                    old_num_pages,
                    num_pages,
                    dropped_keys,
                    "rank re-initialized with another size: pool re-created, keys with pages on it dropped"
                ),
            },
            other => return Err(unexpected(&other)),
        }
        Ok(json_ok(&Message { message: format!("Rank {rank} initialized with {num_pages} pages") }))
    })
    .await
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

fn decode_rank_keys<T: for<'de> serde::Deserialize<'de>>(body: &[u8]) -> Result<(u32, List<T>), ApiError> {
    let Object(b) =
        decode::<Object<RankKeys<T>>>(body).map_err(|why| ApiError::because(ErrorCode::KeysRequestInvalid, why))?;
    Ok((b.rank.expect("checked in finish").0, b.keys))
}

struct Allocated<'a> {
    rank: u32,
    keys: &'a [Key],
    results: &'a [kvpages_core::Allocation],
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

/// `POST /keys/batch_allocate` `{"rank": R, "keys": [[key, prefix_key], ...]}`.
pub(crate) async fn batch_allocate(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "batch_allocate", req, async |cx: Ctx<'_>| {
        let body = cx.body;
        let (rank, List(pairs)) = decode_rank_keys::<KeyPair>(body)?;
        let cmd = Command::Allocate { space: SPACE, rank, keys: pairs.into_iter().map(|p| p.0).collect() };
        let results = match cx.apply(&cmd).await.map_err(|e| refused(ErrorCode::KeysRequestInvalid, e, &[]))? {
            Reply::Allocated(r) => r,
            other => return Err(unexpected(&other)),
        };
        let Command::Allocate { keys, .. } = &cmd else { unreachable!("built above") };
        Ok(json_ok(&Allocated { rank, keys, results: &results }))
    })
    .await
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

/// `POST /keys/confirm_write` `{"rank": R, "confirmations": [[key, page]...], "pages_to_release": [page...]}`.
pub(crate) async fn confirm_write(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "confirm_write", req, async |cx: Ctx<'_>| {
        let body = cx.body;
        let Object(b) = decode::<Object<ConfirmBody>>(body)
            .map_err(|why| ApiError::because(ErrorCode::ConfirmRequestInvalid, why))?;
        let rank = b.rank.expect("checked in finish").0;
        let cmd = Command::Confirm {
            space: SPACE,
            rank,
            confirmations: b.confirmations.0.into_iter().map(|KeyPage(k, p)| (k, p)).collect(),
            releases: b.pages_to_release.0.into_iter().map(|p| p.0).collect(),
        };
        let Command::Confirm { confirmations, .. } = &cmd else { unreachable!("built above") };
        match cx.apply(&cmd).await.map_err(|e| refused(ErrorCode::ConfirmRequestInvalid, e, confirmations))? {
            Reply::Confirmed(report) => {
                if !report.refused.is_empty() || !report.ignored_releases.is_empty() || report.superseded > 0 {
                    tracing::info!(
                        rank,
                        committed = report.committed,
                        refused = report.refused.len(),
                        superseded = report.superseded,
                        ignored_releases = report.ignored_releases.len(),
                        "confirm applied in part"
                    );
                }
            }
            other => return Err(unexpected(&other)),
        }
        Ok(no_content())
    })
    .await
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

/// `POST /keys/batch_exists` `{"keys": [key, ...]}`: a pure read.
pub(crate) async fn batch_exists(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "batch_exists", req, async |cx: Ctx<'_>| {
        let body = cx.body;
        let Object(b) =
            decode::<Object<KeysBody>>(body).map_err(|why| ApiError::because(ErrorCode::ExistsRequestInvalid, why))?;
        let cmd = Command::Exists { space: SPACE, keys: b.keys.0.into_iter().map(|k| k.0).collect() };
        match cx.apply(&cmd).await.map_err(|e| refused(ErrorCode::ExistsRequestInvalid, e, &[]))? {
            Reply::Exists(exists) => Ok(json_ok(&ExistsReply { exists })),
            other => Err(unexpected(&other)),
        }
    })
    .await
}

#[derive(Serialize)]
struct LocationsReply {
    locations: Vec<Option<u32>>,
}

/// `POST /keys/get_locations` `{"rank": R, "keys": [key, ...]}`.
pub(crate) async fn get_locations(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "get_locations", req, async |cx: Ctx<'_>| {
        let body = cx.body;
        let (rank, List(keys)) = decode_rank_keys::<KeyStr>(body)?;
        let cmd = Command::Locations { space: SPACE, rank, keys: keys.into_iter().map(|k| k.0).collect() };
        match cx.apply(&cmd).await.map_err(|e| refused(ErrorCode::KeysRequestInvalid, e, &[]))? {
            Reply::Locations(locations) => Ok(json_ok(&LocationsReply { locations })),
            other => Err(unexpected(&other)),
        }
    })
    .await
}

/// `POST /clear`: drops every vLLM rank and key; the body is ignored.
pub(crate) async fn clear(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "clear", req, async |cx: Ctx<'_>| match cx.apply(&Command::Clear { space: SPACE }).await {
        Ok(Reply::Cleared { ranks, keys }) => {
            tracing::info!(ranks, keys, "cleared the vLLM space");
            Ok(no_content())
        }
        Ok(other) => Err(unexpected(&other)),
        Err(e) => Err(fault(e)),
    })
    .await
}

#[derive(Serialize)]
struct DeletedReply {
    deleted: u32,
}

/// `POST /keys/delete` `{"keys": [key, ...]}`: drops the keys on every rank (kvpages' own route;
/// the peer has no delete). Pages a reader still holds a lease on are quarantined until it ends.
pub(crate) async fn delete(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "delete", req, async |cx: Ctx<'_>| {
        let Object(b) = decode::<Object<KeysBody>>(cx.body)
            .map_err(|why| ApiError::because(ErrorCode::DeleteRequestInvalid, why))?;
        let cmd = Command::Delete { space: SPACE, keys: b.keys.0.into_iter().map(|k| k.0).collect() };
        match cx.apply(&cmd).await.map_err(|e| refused(ErrorCode::DeleteRequestInvalid, e, &[]))? {
            Reply::Deleted(deleted) => {
                tracing::info!(deleted, "keys deleted");
                Ok(json_ok(&DeletedReply { deleted }))
            }
            other => Err(unexpected(&other)),
        }
    })
    .await
}

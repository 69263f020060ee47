//! SGLang HiCache's HF3FS metadata routes, `POST /{rank}/{op}`: the peer's JSON shapes, kvpages'
//! rules for bad input. Each `rank:namespace` is a space of its own in the core.
//!
//! See `../shared/notes/protocol-sglang.md` (in the project's notes) for the peer.

use std::collections::HashMap;

use axum::extract::{Request, State};
use axum::response::Response;
use kvpages_core::{Command, Error, Key, Reply, Space};
use serde::Serialize;
use serde::de::{self, MapAccess};

use super::{Ctx, fault, handle_async, unexpected};
use crate::api::{ApiError, ErrorCode, json_ok, no_content};
use crate::engine::EngineError;
use crate::server::App;
use crate::wire::{KeyPage, KeyPair, KeyStr, List, Members, Object, U32, decode, missing, value};

/// The longest namespace accepted, in bytes (SGLang's are words like `kv`, `mamba`, `swa`).
pub const MAX_NAMESPACE_LEN: usize = 256;

/// The operations of `/{rank}/{op}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Initialize,
    Exists,
    Reserve,
    Confirm,
    Delete,
    Clear,
    Locations,
}

impl Op {
    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "initialize" => Op::Initialize,
            "exists" => Op::Exists,
            "reserve_and_allocate_page_indices" => Op::Reserve,
            "confirm_write" => Op::Confirm,
            "delete_keys" => Op::Delete,
            "clear" => Op::Clear,
            "get_page_indices" => Op::Locations,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Op::Initialize => "initialize",
            Op::Exists => "exists",
            Op::Reserve => "reserve_and_allocate_page_indices",
            Op::Confirm => "confirm_write",
            Op::Delete => "delete_keys",
            Op::Clear => "clear",
            Op::Locations => "get_page_indices",
        }
    }
}

/// A namespace string, `"kv"` when absent.
struct Namespace(Box<str>);

impl<'de> serde::Deserialize<'de> for Namespace {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Namespace;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "a namespace (a string of at most {MAX_NAMESPACE_LEN} bytes)")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Namespace, E> {
                if v.len() > MAX_NAMESPACE_LEN {
                    return Err(E::custom(format_args!(
                        "namespace is {} bytes long, the limit is {MAX_NAMESPACE_LEN}",
                        v.len()
                    )));
                }
                Ok(Namespace(v.into()))
            }
        }
        d.deserialize_str(V)
    }
}

/// What a body can carry; each op reads only its own members (unknown ones are ignored, as in
/// the peer).
#[derive(Default)]
struct Body {
    namespace: Option<Namespace>,
    num_pages: Option<U32>,
    keys: Option<List<KeyStr>>,
    pairs: Option<List<KeyPair>>,
    confirmations: List<KeyPage>,
    releases: List<U32>,
}

macro_rules! op_body {
    ($name:ident { $($member:literal => $field:ident),* } $(requires $required:literal => $req_field:ident)?) => {
        #[derive(Default)]
        struct $name(Body);
        impl Members for $name {
            fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
                match name {
                    "namespace" => value(map, &mut self.0.namespace),
                    $($member => {
                        self.0.$field = map.next_value()?;
                        Ok(true)
                    })*
                    _ => Ok(false),
                }
            }
            fn finish<E: de::Error>(self) -> Result<Self, E> {
                $(if self.0.$req_field.is_none() {
                    return Err(missing($required));
                })?
                Ok(self)
            }
        }
    };
}

op_body!(InitializeBody { "num_pages" => num_pages } requires "num_pages" => num_pages);
op_body!(KeysBody { "keys" => keys });
op_body!(PairsBody { "keys" => pairs });
op_body!(ConfirmBody { "written_keys_to_confirm" => confirmations, "pages_to_release" => releases });
op_body!(NamespaceBody {});

fn decode_for(op: Op, body: &[u8]) -> Result<Body, String> {
    match op {
        Op::Initialize => decode::<Object<InitializeBody>>(body).map(|Object(b)| b.0),
        Op::Exists | Op::Delete | Op::Locations => decode::<Object<KeysBody>>(body).map(|Object(b)| b.0),
        Op::Reserve => decode::<Object<PairsBody>>(body).map(|Object(b)| b.0),
        Op::Confirm => decode::<Object<ConfirmBody>>(body).map(|Object(b)| b.0),
        Op::Clear => decode::<Object<NamespaceBody>>(body).map(|Object(b)| b.0),
    }
}

fn invalid(op: Op, why: impl std::fmt::Display) -> ApiError {
    ApiError::filled_because(ErrorCode::SglangRequestInvalid, &[("op", &op.name())], why)
}

fn not_initialized(rank: u32, namespace: &str) -> ApiError {
    ApiError::filled(ErrorCode::SglangRankNotInitialized, &[("rank", &rank), ("namespace", &namespace)])
}

/// Maps a core refusal to SGLang's answer.
fn refused(op: Op, rank: u32, namespace: &str, e: EngineError, confirmations: &[(Key, u32)]) -> ApiError {
    match e {
        EngineError::Domain(Error::RankNotInitialized { .. }) => not_initialized(rank, namespace),
        EngineError::Domain(Error::ZeroPages { .. }) => invalid(op, "num_pages must be at least 1"),
        EngineError::Domain(Error::PageOutOfRange { rank, page, num_pages, place }) => {
            let (field, i) = match place {
                kvpages_core::PagePlace::Confirmation(i) => ("written_keys_to_confirm", i),
                kvpages_core::PagePlace::Release(i) => ("pages_to_release", i),
            };
            invalid(op, format_args!("{field}[{i}]: page {page} is out of range, rank {rank} has {num_pages} pages"))
        }
        EngineError::Domain(Error::NothingConfirmed { refused }) => {
            super::nothing_confirmed(&refused, "written_keys_to_confirm", confirmations)
        }
        EngineError::Domain(e) => fault(EngineError::Domain(e)),
        other => fault(other),
    }
}

#[derive(Serialize)]
struct ExistsReply {
    exists: Vec<bool>,
}

#[derive(Serialize)]
struct ReserveReply {
    indices: Vec<(bool, i64)>,
}

#[derive(Serialize)]
struct PagesReply {
    indices: Vec<Option<u32>>,
}

/// `POST /{rank}/{op}`: one handler for SGLang's seven operations.
pub(crate) async fn route(State(app): State<App>, req: Request) -> Response {
    handle_async(app, "sglang", req, async |cx: Ctx<'_>| {
        let mut parts = cx.path.trim_start_matches('/').splitn(2, '/');
        let (rank_s, op_s) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let rank = (!rank_s.is_empty() && rank_s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| rank_s.parse::<u32>().ok())
            .flatten();
        let (Some(rank), Some(op)) = (rank, Op::parse(op_s)) else {
            return Err(ApiError::because(ErrorCode::RouteNotFound, format_args!("no route POST {}", cx.path)));
        };
        let body = decode_for(op, cx.body).map_err(|why| invalid(op, why))?;
        let namespace = body.namespace.map_or_else(|| Box::from("kv"), |n| n.0);
        let space = Space::Sglang { rank, namespace: namespace.clone() };
        let keys = |b: Option<List<KeyStr>>| b.map_or_else(Vec::new, |l| l.0.into_iter().map(|k| k.0).collect());
        let fail = |e: EngineError| refused(op, rank, &namespace, e, &[]);
        match op {
            Op::Initialize => {
                let num_pages = body.num_pages.expect("checked in finish").0;
                match cx.apply(&Command::Initialize { space, rank, num_pages }).await.map_err(fail)? {
                    Reply::Initialized { .. } => Ok(no_content()),
                    other => Err(unexpected(&other)),
                }
            }
            Op::Exists => match cx.apply(&Command::Exists { space, keys: keys(body.keys) }).await.map_err(fail)? {
                Reply::Exists(exists) => Ok(json_ok(&ExistsReply { exists })),
                other => Err(unexpected(&other)),
            },
            Op::Reserve => {
                let keys: Vec<Key> = body.pairs.map_or_else(Vec::new, |l| l.0.into_iter().map(|p| p.0).collect());
                let cmd = Command::Allocate { space, rank, keys };
                let results = match cx.apply(&cmd).await.map_err(fail)? {
                    Reply::Allocated(r) => r,
                    other => return Err(unexpected(&other)),
                };
                let Command::Allocate { keys, .. } = &cmd else { unreachable!("built above") };
                // The core answers once per distinct key; the peer answers every position.
                let by_key: HashMap<&Key, (bool, i64)> = results
                    .iter()
                    .map(|a| (&keys[a.index as usize], (a.cached, a.page.map_or(-1, i64::from))))
                    .collect();
                let indices = keys.iter().map(|k| by_key[k]).collect();
                Ok(json_ok(&ReserveReply { indices }))
            }
            Op::Confirm => {
                let cmd = Command::Confirm {
                    space,
                    rank,
                    confirmations: body.confirmations.0.into_iter().map(|KeyPage(k, p)| (k, p)).collect(),
                    releases: body.releases.0.into_iter().map(|p| p.0).collect(),
                };
                let Command::Confirm { confirmations, .. } = &cmd else { unreachable!("built above") };
                match cx.apply(&cmd).await.map_err(|e| refused(op, rank, &namespace, e, confirmations))? {
                    Reply::Confirmed(_) => Ok(no_content()),
                    other => Err(unexpected(&other)),
                }
            }
            Op::Delete => match cx.apply(&Command::Delete { space, keys: keys(body.keys) }).await.map_err(fail)? {
                Reply::Deleted(_) => Ok(no_content()),
                other => Err(unexpected(&other)),
            },
            Op::Clear => match cx.apply(&Command::Reset { space }).await.map_err(fail)? {
                Reply::Cleared { .. } => Ok(no_content()),
                other => Err(unexpected(&other)),
            },
            Op::Locations => {
                match cx.apply(&Command::Locations { space, rank, keys: keys(body.keys) }).await.map_err(fail)? {
                    Reply::Locations(indices) => Ok(json_ok(&PagesReply { indices })),
                    other => Err(unexpected(&other)),
                }
            }
        }
    })
    .await
}

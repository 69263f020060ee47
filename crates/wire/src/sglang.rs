//! SGLang HiCache's HF3FS metadata routes, `POST /{rank}/{op}`: the peer's JSON shapes, kvpages'
//! rules for bad input. Each `rank:namespace` is a space of its own in the core.
//!
//! See `protocol-sglang.md` (in the project's notes) for the peer.

use std::boxed::Box;
use std::collections::HashMap;
use std::fmt::Display;
use std::vec::Vec;

use serde::Serialize;
use serde::de::{self, MapAccess};

use super::json::{KeyPage, KeyPair, KeyStr, List, Members, Object, U32, at_most, decode, missing, string_with, value};
use super::{Answer, ErrorCode, Failure, Parsed, Shape, apply, nothing_confirmed, unexpected, unexpected_refusal};
use kvpages_core::command::{Command, Reply, Space};
use kvpages_core::error::{Error, PagePlace};
use kvpages_core::key::Key;

/// The longest namespace accepted, in bytes (SGLang's are words like `kv`, `mamba`, `swa`).
pub const MAX_NAMESPACE_LEN: usize = 256;

/// The operations of `/{rank}/{op}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Initialize,
    Exists,
    Reserve,
    Confirm,
    Delete,
    Clear,
    Locations,
}

/// The names of SGLang's operations, the `{op}` of `/{rank}/{op}` (the server's metrics label
/// requests by them).
pub const SGLANG_OPS: [&str; 7] = {
    let mut names = [""; 7];
    let mut i = 0;
    while i < Op::ALL.len() {
        names[i] = Op::ALL[i].name();
        i += 1;
    }
    names
};

impl Op {
    const ALL: [Op; 7] = [Op::Initialize, Op::Exists, Op::Reserve, Op::Confirm, Op::Delete, Op::Clear, Op::Locations];

    fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == s)
    }

    const fn name(self) -> &'static str {
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
        string_with(
            d,
            |f| write!(f, "a namespace (a string of at most {MAX_NAMESPACE_LEN} bytes)"),
            |v| at_most(v, MAX_NAMESPACE_LEN, "namespace").map(|v| Namespace(v.into())),
        )
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

fn decode_for(op: Op, body: &[u8]) -> Result<Body, std::string::String> {
    match op {
        Op::Initialize => decode::<Object<InitializeBody>>(body).map(|Object(b)| b.0),
        Op::Exists | Op::Delete | Op::Locations => decode::<Object<KeysBody>>(body).map(|Object(b)| b.0),
        Op::Reserve => decode::<Object<PairsBody>>(body).map(|Object(b)| b.0),
        Op::Confirm => decode::<Object<ConfirmBody>>(body).map(|Object(b)| b.0),
        Op::Clear => decode::<Object<NamespaceBody>>(body).map(|Object(b)| b.0),
    }
}

fn invalid(op: Op, why: impl Display) -> Failure {
    Failure::filled_because(ErrorCode::SglangRequestInvalid, &[("op", &op.name())], why)
}

/// `POST /{rank}/{op}` into its command; 404 for a rank that is not plain decimal digits in u32
/// range or an unknown op.
pub(super) fn parse(path: &str, body: &[u8]) -> Result<Parsed, Failure> {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (rank_s, op_s) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let rank = (!rank_s.is_empty() && rank_s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| rank_s.parse::<u32>().ok())
        .flatten();
    let (Some(rank), Some(op)) = (rank, Op::parse(op_s)) else {
        return Err(Failure::because(ErrorCode::RouteNotFound, format_args!("no route POST {path}")));
    };
    let body = decode_for(op, body).map_err(|why| invalid(op, why))?;
    let namespace = body.namespace.map_or_else(|| Box::from("kv"), |n| n.0);
    let space = Space::Sglang { rank, namespace };
    let keys = |b: Option<List<KeyStr>>| b.map_or_else(Vec::new, |l| l.0.into_iter().map(|k| k.0).collect());
    let command = match op {
        Op::Initialize => Command::Initialize { space, rank, num_pages: body.num_pages.expect("checked in finish").0 },
        Op::Exists => Command::Exists { space, keys: keys(body.keys) },
        Op::Reserve => {
            let keys = body.pairs.map_or_else(Vec::new, |l| l.0.into_iter().map(|p| p.0).collect());
            Command::Allocate { space, rank, keys }
        }
        Op::Confirm => Command::Confirm {
            space,
            rank,
            confirmations: body.confirmations.0.into_iter().map(|KeyPage(k, p)| (k, p)).collect(),
            releases: body.releases.0.into_iter().map(|p| p.0).collect(),
        },
        Op::Delete => Command::Delete { space, keys: keys(body.keys) },
        Op::Clear => Command::Reset { space },
        Op::Locations => Command::Locations { space, rank, keys: keys(body.keys) },
    };
    Ok(apply("sglang", Shape::Sglang(op), command))
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

/// The answer of `op` to its command's result.
pub(super) fn answer(op: Op, command: Command, result: Result<Reply, Error>) -> Result<Answer, Failure> {
    let reply = match result {
        Ok(reply) => reply,
        Err(e) => return Err(refused(op, &command, e)),
    };
    match (op, reply) {
        (Op::Initialize, Reply::Initialized { .. })
        | (Op::Confirm, Reply::Confirmed(_))
        | (Op::Delete, Reply::Deleted(_))
        | (Op::Clear, Reply::Cleared { .. }) => Ok(Answer::no_content()),
        (Op::Exists, Reply::Exists(exists)) => Ok(Answer::json(&ExistsReply { exists })),
        (Op::Reserve, Reply::Allocated(results)) => {
            let Command::Allocate { keys, .. } = &command else { unreachable!("built by parse") };
            // The core answers once per distinct key; the peer answers every position.
            // An engine that answered an index out of range or left a key out (a broken plugin:
            // the core never does) gets the engine-fault answer, not a panic.
            let by_key: Option<HashMap<&Key, (bool, i64)>> = results
                .iter()
                .map(|a| Some((keys.get(a.index as usize)?, (a.cached, a.page.map_or(-1, i64::from)))))
                .collect();
            let indices: Option<Vec<_>> =
                by_key.and_then(|by_key| keys.iter().map(|k| by_key.get(k).copied()).collect());
            match indices {
                Some(indices) => Ok(Answer::json(&ReserveReply { indices })),
                None => Err(unexpected(&Reply::Allocated(results))),
            }
        }
        (Op::Locations, Reply::Locations(indices)) => Ok(Answer::json(&PagesReply { indices })),
        (_, other) => Err(unexpected(&other)),
    }
}

/// Maps a core refusal to SGLang's answer.
fn refused(op: Op, command: &Command, e: Error) -> Failure {
    let space = match command {
        Command::Initialize { space, .. }
        | Command::Allocate { space, .. }
        | Command::Confirm { space, .. }
        | Command::Exists { space, .. }
        | Command::Locations { space, .. }
        | Command::Delete { space, .. }
        | Command::Reset { space } => space,
        _ => unreachable!("built by parse"),
    };
    let Space::Sglang { rank, namespace } = space else { unreachable!("built by parse") };
    match e {
        Error::RankNotInitialized { .. } => {
            Failure::filled(ErrorCode::SglangRankNotInitialized, &[("rank", rank), ("namespace", namespace)])
        }
        Error::ZeroPages { .. } => invalid(op, "num_pages must be at least 1"),
        Error::PageOutOfRange { rank, page, num_pages, place } => {
            let (field, i) = match place {
                PagePlace::Confirmation(i) => ("written_keys_to_confirm", i),
                PagePlace::Release(i) => ("pages_to_release", i),
            };
            invalid(op, format_args!("{field}[{i}]: page {page} is out of range, rank {rank} has {num_pages} pages"))
        }
        Error::NothingConfirmed { refused } => {
            let confirmations = match command {
                Command::Confirm { confirmations, .. } => &confirmations[..],
                _ => &[],
            };
            nothing_confirmed(&refused, "written_keys_to_confirm", confirmations)
        }
        e => unexpected_refusal(&e),
    }
}

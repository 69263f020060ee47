//! TEMPORARY stand-in for `kvpages_core::wire` (being moved out of the host); deleted when it lands.
#![allow(dead_code)]
use kvpages_core::{Command, Error, Key, Reply, Space};
use serde_json::{Value, json};

pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) body: Vec<u8>,
}
pub(crate) struct Pending {
    cmd: Command,
}
pub(crate) enum Parsed {
    Answer(Answer),
    Apply(Pending),
}
fn bad(why: &str) -> Parsed {
    Parsed::Answer(Answer { status: 400, body: json!({ "detail": why }).to_string().into_bytes() })
}
fn keys(v: &Value) -> Option<Vec<Key>> {
    v.as_array()?.iter().map(|k| k.as_str().and_then(|s| Key::parse(s).ok())).collect()
}
pub(crate) fn parse(_method: &str, path: &str, body: &[u8]) -> Parsed {
    let Ok(v) = serde_json::from_slice::<Value>(body) else { return bad("body is not valid JSON") };
    let rank = v.get("rank").and_then(Value::as_u64).map(|r| r as u32);
    let space = Space::Vllm;
    let cmd = if let Some(r) = path.strip_prefix("/rank/").and_then(|p| p.strip_suffix("/initialize")) {
        Command::Initialize { space, rank: r.parse().unwrap(), num_pages: v["num_pages"].as_u64().unwrap() as u32 }
    } else {
        match path {
            "/keys/batch_exists" => match keys(&v["keys"]) {
                Some(keys) => Command::Exists { space, keys },
                None => return bad("keys"),
            },
            "/keys/delete" => Command::Delete { space, keys: keys(&v["keys"]).unwrap() },
            "/keys/get_locations" => Command::Locations { space, rank: rank.unwrap(), keys: keys(&v["keys"]).unwrap() },
            "/keys/batch_allocate" => Command::Allocate {
                space,
                rank: rank.unwrap(),
                keys: v["keys"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| Key::parse(p[0].as_str().unwrap()).unwrap())
                    .collect(),
            },
            "/keys/confirm_write" => Command::Confirm {
                space,
                rank: rank.unwrap(),
                confirmations: v["confirmations"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| (Key::parse(p[0].as_str().unwrap()).unwrap(), p[1].as_u64().unwrap() as u32))
                    .collect(),
                releases: Vec::new(),
            },
            _ => return Parsed::Answer(Answer { status: 404, body: b"{\"detail\":\"Not Found\"}".to_vec() }),
        }
    };
    Parsed::Apply(Pending { cmd })
}
impl Pending {
    pub(crate) fn command(&self) -> &Command {
        &self.cmd
    }
    pub(crate) fn answer(self, r: Result<Reply, Error>) -> Answer {
        let v = match r {
            Ok(Reply::Allocated(a)) => {
                let Command::Allocate { rank, keys, .. } = &self.cmd else { unreachable!() };
                let res: Vec<Value> = a
                    .iter()
                    .map(|a| json!([keys[a.index as usize].to_string(), a.page.map_or(-1, i64::from)]))
                    .collect();
                json!({"rank": rank, "results": res})
            }
            Ok(Reply::Exists(e)) => json!({ "exists": e }),
            Ok(Reply::Locations(l)) => json!({ "locations": l }),
            Ok(Reply::Deleted(d)) => json!({ "deleted": d }),
            Ok(Reply::Confirmed(_)) => return Answer { status: 204, body: Vec::new() },
            Ok(_) => json!({"message": "ok"}),
            Err(e) => {
                return Answer { status: 400, body: json!({ "detail": format!("{e:?}") }).to_string().into_bytes() };
            }
        };
        Answer { status: 200, body: v.to_string().into_bytes() }
    }
}

//! SGLang's persistence file (`--persistence-path` of its metadata server), read and written:
//! `{"0:kv": {"num_pages": 3, "free_pages": [0], "key_to_index": [["a", 2]]}}` — free pages in
//! stack order (the last is handed out first), keys least recently used first. A pool name
//! without `:` means namespace `kv`, as in the peer.

use std::fmt;

use kvpages_core::{Key, SglangPool};
use serde::de::{self, MapAccess, Visitor};
use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Deserialize, Serialize};

use kvpages_wire::MAX_NAMESPACE_LEN;
use kvpages_wire::json::{KeyPage, List, Members, Object, U32, decode, missing, value};

#[derive(Default)]
struct PoolFile {
    num_pages: Option<U32>,
    free_pages: Option<List<U32>>,
    key_to_index: Option<CountedKeys>,
}

thread_local! {
    /// The progress of the [`parse`] running on this thread (a `Deserialize` impl has no other
    /// way to reach it) and the keys read so far.
    static PARSING: std::cell::RefCell<Option<(crate::progress::Progress, u64)>> = const { std::cell::RefCell::new(None) };
}

/// `key_to_index`: a list of `[key, page]` that counts its keys into [`PARSING`].
struct CountedKeys(Vec<KeyPage>);

impl<'de> Deserialize<'de> for CountedKeys {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CountedKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<CountedKeys, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(x) = seq.next_element::<KeyPage>()? {
                    v.push(x);
                    PARSING.with_borrow_mut(|p| {
                        if let Some((progress, keys)) = p {
                            *keys += 1;
                            progress.update(*keys);
                        }
                    });
                }
                Ok(CountedKeys(v))
            }
        }
        d.deserialize_seq(V)
    }
}

impl Members for PoolFile {
    fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
        match name {
            "num_pages" => value(map, &mut self.num_pages),
            "free_pages" => value(map, &mut self.free_pages),
            "key_to_index" => value(map, &mut self.key_to_index),
            _ => Ok(false),
        }
    }
    fn finish<E: de::Error>(self) -> Result<Self, E> {
        for (name, present) in [
            ("num_pages", self.num_pages.is_some()),
            ("free_pages", self.free_pages.is_some()),
            ("key_to_index", self.key_to_index.is_some()),
        ] {
            if !present {
                return Err(missing(name));
            }
        }
        Ok(self)
    }
}

/// The whole file: pool name → pool, names unique.
struct PoolsFile(Vec<SglangPool>);

fn pool_name(name: &str) -> Result<(u32, Box<str>), String> {
    let (rank, namespace) = name.split_once(':').unwrap_or((name, "kv"));
    let rank = (!rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()))
        .then(|| rank.parse::<u32>().ok())
        .flatten()
        .ok_or_else(|| format!("pool name \"{name}\" does not start with a rank (\"RANK:NAMESPACE\")"))?;
    if namespace.len() > MAX_NAMESPACE_LEN {
        return Err(format!("pool name \"{name}\": the namespace is over {MAX_NAMESPACE_LEN} bytes"));
    }
    Ok((rank, namespace.into()))
}

impl<'de> Deserialize<'de> for PoolsFile {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PoolsFile;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of pools by \"RANK:NAMESPACE\"")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PoolsFile, A::Error> {
                let mut pools: Vec<SglangPool> = Vec::new();
                let mut names = std::collections::HashSet::new();
                while let Some(name) = map.next_key::<String>()? {
                    if !names.insert(name.clone()) {
                        return Err(de::Error::custom(format_args!("pool \"{name}\" appears twice")));
                    }
                    let (rank, namespace) = pool_name(&name).map_err(de::Error::custom)?;
                    let Object(p) = map.next_value::<Object<PoolFile>>()?;
                    pools.push(SglangPool {
                        rank,
                        namespace,
                        num_pages: p.num_pages.expect("checked in finish").0,
                        free_pages: p.free_pages.expect("checked in finish").0.into_iter().map(|p| p.0).collect(),
                        keys: p
                            .key_to_index
                            .expect("checked in finish")
                            .0
                            .into_iter()
                            .map(|KeyPage(k, p)| (k, p))
                            .collect(),
                    });
                }
                Ok(PoolsFile(pools))
            }
        }
        d.deserialize_map(V)
    }
}

/// Parses a persistence file, or says precisely where it is wrong. Progress (keys read, rate)
/// goes to the log while it runs, and a final line when it is done.
pub(crate) fn parse(bytes: &[u8]) -> Result<Vec<SglangPool>, String> {
    let progress = crate::progress::Progress::new(
        format!("import: parsing SGLang's persistence file ({} bytes)", bytes.len()),
        "keys",
        None,
    );
    parse_with(bytes, progress)
}

/// [`parse`] reporting to `progress`.
pub(crate) fn parse_with(bytes: &[u8], progress: crate::progress::Progress) -> Result<Vec<SglangPool>, String> {
    PARSING.set(Some((progress, 0)));
    let parsed = decode::<PoolsFile>(bytes).map(|f| f.0);
    if let Some((progress, keys)) = PARSING.take()
        && parsed.is_ok()
    {
        progress.finish(keys);
    }
    parsed
}

/// Writes pools in the peer's format.
pub(crate) fn render(pools: &[SglangPool]) -> Vec<u8> {
    struct File<'a>(&'a [SglangPool]);
    struct PoolOut<'a>(&'a SglangPool);
    struct Keys<'a>(&'a [(Key, u32)]);
    impl Serialize for Keys<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_seq(self.0.iter().map(|(k, p)| (k, p)))
        }
    }
    impl Serialize for PoolOut<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut st = s.serialize_struct("Pool", 3)?;
            st.serialize_field("num_pages", &self.0.num_pages)?;
            st.serialize_field("free_pages", &self.0.free_pages)?;
            st.serialize_field("key_to_index", &Keys(&self.0.keys))?;
            st.end()
        }
    }
    impl Serialize for File<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut m = s.serialize_map(Some(self.0.len()))?;
            for p in self.0 {
                m.serialize_entry(&format!("{}:{}", p.rank, p.namespace), &PoolOut(p))?;
            }
            m.end()
        }
    }
    serde_json::to_vec_pretty(&File(pools)).expect("pools serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_peers_file_and_writes_it_back() {
        let text = br#"{"0:kv": {"num_pages": 3, "free_pages": [0], "key_to_index": [["a", 2]]}, "1": {"num_pages": 1, "free_pages": [], "key_to_index": []}}"#;
        let pools = parse(text).unwrap();
        assert_eq!(pools.len(), 2);
        assert_eq!((pools[0].rank, &*pools[0].namespace, pools[0].num_pages), (0, "kv", 3));
        assert_eq!(pools[0].free_pages, vec![0]);
        assert_eq!(pools[0].keys, vec![(Key::parse("a").unwrap(), 2)]);
        assert_eq!((pools[1].rank, &*pools[1].namespace), (1, "kv"));
        assert_eq!(parse(&render(&pools)).unwrap(), pools);
    }

    #[test]
    fn parsing_reports_keys_read_and_rate() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::{Arc, Mutex};
        use std::time::Duration;
        let keys: Vec<String> = (0..1024).map(|i| format!(r#"["{i:032x}", {i}]"#)).collect();
        let text =
            format!(r#"{{"0:kv": {{"num_pages": 1024, "free_pages": [], "key_to_index": [{}]}}}}"#, keys.join(","));
        // The clock moves 0.5 s per read: at the start, every 256 keys, at the end.
        let reads = Arc::new(AtomicU64::new(0));
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let (r, l) = (reads.clone(), lines.clone());
        let progress = crate::progress::Progress::with(
            "parsing",
            "keys",
            None,
            Box::new(move || Duration::from_millis(500 * r.fetch_add(1, Ordering::Relaxed))),
            Box::new(move |line: &str| l.lock().unwrap().push(line.to_owned())),
        );
        let pools = parse_with(text.as_bytes(), progress).unwrap();
        assert_eq!(pools[0].keys.len(), 1024);
        assert_eq!(
            *lines.lock().unwrap(),
            [
                "parsing: 512 keys, 512 keys/s",
                "parsing: 1024 keys, 512 keys/s",
                "parsing: done, 1024 keys in 2.50 s (410 keys/s)"
            ]
        );
        // A refused file prints no final line, and leaves nothing behind for the next parse.
        let l = lines.clone();
        let progress = crate::progress::Progress::with(
            "parsing",
            "keys",
            None,
            Box::new(|| Duration::ZERO),
            Box::new(move |line: &str| l.lock().unwrap().push(line.to_owned())),
        );
        assert!(parse_with(br#"{"0:kv": {"num_pages": 1}}"#, progress).is_err());
        assert_eq!(lines.lock().unwrap().len(), 3);
        assert!(PARSING.with_borrow(|p| p.is_none()));
    }

    #[test]
    fn names_the_place_of_each_problem() {
        let cases: [(&[u8], &str); 6] = [
            (br#"{"0:kv": {"num_pages": 3, "free_pages": [0]}}"#, "0:kv: member 'key_to_index' is missing"),
            (br#"{"0:kv": {"num_pages": 3, "free_pages": ["x"], "key_to_index": []}}"#, "0:kv.free_pages[0]: invalid type: string \"x\", expected an integer in u32 range"),
            (br#"{"0:kv": {"num_pages": 3, "free_pages": [], "key_to_index": [["a"]]}}"#, "0:kv.key_to_index[0]: invalid length 1, expected a [key, page] pair"),
            (br#"{"x:kv": {"num_pages": 3, "free_pages": [], "key_to_index": []}}"#, "pool name \"x:kv\" does not start with a rank (\"RANK:NAMESPACE\")"),
            (br#"{"0:kv": {"num_pages": 1, "free_pages": [], "key_to_index": []}, "0:kv": {"num_pages": 1, "free_pages": [], "key_to_index": []}}"#, "pool \"0:kv\" appears twice"),
            (br#"[]"#, "invalid type: sequence, expected a JSON object of pools by \"RANK:NAMESPACE\""),
        ];
        for (text, want) in cases {
            assert_eq!(parse(text).unwrap_err(), want, "{}", String::from_utf8_lossy(text));
        }
    }
}

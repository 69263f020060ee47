//! Strict JSON decoding shared by every route family (and by the host's SGLang file format).
//!
//! The peers accept almost anything (`0.0` or `false` as rank 0, a 2-character string as a pair);
//! kvpages refuses it with a reason that names the place: `keys[3]: invalid type: string "ab",
//! expected a [key, prefix_key] pair`. Rules: the body is UTF-8 JSON with nothing after the
//! value; objects have no duplicate member names at any depth; numbers that name ranks, pages
//! and counts are JSON integers in u32 range; keys are non-empty strings of at most
//! [`MAX_KEY_LEN`] bytes; pairs are 2-element arrays. Unknown members are accepted and ignored.
//!
//! Decoding streams from the borrowed body: member names are borrowed unless escaped, keys go
//! straight into [`Key`]s, no intermediate `serde_json::Value` is built.

use core::fmt;
use core::marker::PhantomData;
use std::borrow::{Cow, ToOwned};
use std::format;
use std::string::{String, ToString};
use std::vec::Vec;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

use kvpages_core::key::{Key, MAX_KEY_LEN};

/// Decodes a whole request body, or says precisely why not.
pub fn decode<T>(body: &[u8]) -> Result<T, String>
where
    T: for<'de> Deserialize<'de>,
{
    if body.is_empty() {
        return Err("body is empty, expected a JSON object".into());
    }
    if body.starts_with(&[0xEF, 0xBB, 0xBF]) {
        return Err("body starts with a byte order mark".into());
    }
    let text = core::str::from_utf8(body)
        .map_err(|e| format!("body is not UTF-8 (invalid byte at offset {})", e.valid_up_to()))?;
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        describe(&path, &inner)
    })?;
    de.end().map_err(|e| format!("body has data after the JSON value ({})", strip_position(&e)))?;
    Ok(value)
}

fn describe(path: &str, e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => format!("body is not valid JSON: {e}"),
        Category::Data if path == "." => strip_position(e),
        Category::Data => format!("{path}: {}", strip_position(e)),
    }
}

fn strip_position(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

/// A request body: an object whose members are handed to `T` one by one.
pub trait Members: Default {
    /// Deserializes the member `name` if `T` knows it; `Ok(false)` for unknown members.
    fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error>;
    /// Checks required members once the object ended.
    fn finish<E: de::Error>(self) -> Result<Self, E> {
        Ok(self)
    }
}

/// Decodes a JSON object into `T` through [`Members`], refusing duplicate member names.
#[derive(Debug)]
pub struct Object<T>(pub T);

impl<'de, T: Members> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Members> Visitor<'de> for V<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut t = T::default();
                let mut seen: Vec<Cow<'de, str>> = Vec::new();
                while let Some(name) = next_name(&mut map, &mut seen)? {
                    if !t.member(name, &mut map)? {
                        map.next_value::<Strict>()?;
                    }
                }
                t.finish().map(Object)
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

/// The next member name of an object, refused if `seen` already holds it.
fn next_name<'de, 's, A: MapAccess<'de>>(
    map: &mut A,
    seen: &'s mut Vec<Cow<'de, str>>,
) -> Result<Option<&'s str>, A::Error> {
    let Some(Name(name)) = map.next_key::<Name<'de>>()? else { return Ok(None) };
    if seen.contains(&name) {
        return Err(de::Error::custom(format_args!("duplicate member '{name}'")));
    }
    seen.push(name);
    Ok(seen.last().map(|n| &**n))
}

/// A member name, borrowed from the body when it has no escapes.
struct Name<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Any JSON value, checked only for duplicate member names (used for unknown members).
struct Strict;

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strict;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_str<E>(self, _: &str) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_unit<E>(self) -> Result<Strict, E> {
                Ok(Strict)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
                while seq.next_element::<Strict>()?.is_some() {}
                Ok(Strict)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
                let mut seen: Vec<Cow<'de, str>> = Vec::new();
                while next_name(&mut map, &mut seen)?.is_some() {
                    map.next_value::<Strict>()?;
                }
                Ok(Strict)
            }
        }
        d.deserialize_any(V)
    }
}

/// A JSON integer in u32 range (ranks, pages, page counts). Floats, booleans, strings,
/// negatives and null are refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct U32(pub u32);

impl<'de> Deserialize<'de> for U32 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = U32;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer in u32 range")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<U32, E> {
                u32::try_from(v).map(U32).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<U32, E> {
                u32::try_from(v).map(U32).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// A key: a non-empty string of at most [`MAX_KEY_LEN`] bytes.
#[derive(Debug)]
#[repr(transparent)]
pub struct KeyStr(pub Key);

impl<'de> Deserialize<'de> for KeyStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string_with(
            d,
            |f| write!(f, "a key (a non-empty string of at most {MAX_KEY_LEN} bytes)"),
            |v| Key::parse(v).map(KeyStr).map_err(|e| Some(e.to_string())),
        )
    }
}

/// A prefix key: a string of at most [`MAX_KEY_LEN`] bytes (empty allowed); its value is unused,
/// as in the peers.
struct PrefixStr;

impl<'de> Deserialize<'de> for PrefixStr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string_with(
            d,
            |f| write!(f, "a prefix key (a string of at most {MAX_KEY_LEN} bytes)"),
            |v| at_most(v, MAX_KEY_LEN, "prefix key").map(|_| PrefixStr),
        )
    }
}

/// A string read by `parse`, whose error is the refusal's text, or `None` for serde's "invalid
/// value: string ..., expected {expecting}". No allocation unless refused.
pub(crate) fn string_with<'de, D: Deserializer<'de>, T>(
    d: D,
    expecting: fn(&mut fmt::Formatter<'_>) -> fmt::Result,
    parse: impl FnOnce(&str) -> Result<T, Option<String>>,
) -> Result<T, D::Error> {
    struct V<F> {
        expecting: fn(&mut fmt::Formatter<'_>) -> fmt::Result,
        parse: F,
    }
    impl<T, F: FnOnce(&str) -> Result<T, Option<String>>> Visitor<'_> for V<F> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            (self.expecting)(f)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
            struct Expecting(fn(&mut fmt::Formatter<'_>) -> fmt::Result);
            impl de::Expected for Expecting {
                fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    (self.0)(f)
                }
            }
            let expecting = Expecting(self.expecting);
            (self.parse)(v).map_err(|refusal| match refusal {
                Some(text) => E::custom(text),
                None => E::invalid_value(de::Unexpected::Str(v), &expecting),
            })
        }
    }
    d.deserialize_str(V { expecting, parse })
}

/// `v` if it is at most `limit` bytes long, else the refusal naming `what`.
pub(crate) fn at_most<'v>(v: &'v str, limit: usize, what: &str) -> Result<&'v str, Option<String>> {
    if v.len() > limit {
        return Err(Some(format!("{what} is {} bytes long, the limit is {limit}", v.len())));
    }
    Ok(v)
}

/// Reads the elements of a 2-element array; refuses shorter and longer ones.
fn pair<'de, A, X, Y>(mut seq: A, exp: &dyn de::Expected) -> Result<(X, Y), A::Error>
where
    A: SeqAccess<'de>,
    X: Deserialize<'de>,
    Y: Deserialize<'de>,
{
    let x = seq.next_element::<X>()?.ok_or_else(|| de::Error::invalid_length(0, exp))?;
    let y = seq.next_element::<Y>()?.ok_or_else(|| de::Error::invalid_length(1, exp))?;
    let mut extra = 0;
    while seq.next_element::<Strict>()?.is_some() {
        extra += 1;
    }
    if extra > 0 {
        return Err(de::Error::invalid_length(2 + extra, exp));
    }
    Ok((x, y))
}

/// `[key, prefix_key]`, as in `batch_allocate`.
#[derive(Debug)]
#[repr(transparent)]
pub struct KeyPair(pub Key);

impl<'de> Deserialize<'de> for KeyPair {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyPair;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a [key, prefix_key] pair")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<KeyPair, A::Error> {
                let (KeyStr(k), PrefixStr) = pair(seq, &self)?;
                Ok(KeyPair(k))
            }
        }
        d.deserialize_seq(V)
    }
}

/// `[key, page]`, as in `confirm_write`.
#[derive(Debug)]
pub struct KeyPage(pub Key, pub u32);

impl<'de> Deserialize<'de> for KeyPage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyPage;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a [key, page] pair")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<KeyPage, A::Error> {
                let (KeyStr(k), U32(p)) = pair(seq, &self)?;
                Ok(KeyPage(k, p))
            }
        }
        d.deserialize_seq(V)
    }
}

/// A JSON array of `T`.
#[derive(Debug)]
pub struct List<T>(pub Vec<T>);

impl<T> Default for List<T> {
    fn default() -> Self {
        List(Vec::new())
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = List<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List<T>, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(x) = seq.next_element::<T>()? {
                    v.push(x);
                }
                Ok(List(v))
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
}

/// Deserializes the current member's value into `slot`.
pub fn value<'de, A, T>(map: &mut A, slot: &mut Option<T>) -> Result<bool, A::Error>
where
    A: MapAccess<'de>,
    T: Deserialize<'de>,
{
    *slot = Some(map.next_value::<T>()?);
    Ok(true)
}

/// `member 'name' is missing`.
pub fn missing<E: de::Error>(name: &str) -> E {
    E::custom(format_args!("member '{name}' is missing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Body {
        rank: Option<U32>,
        keys: Option<List<KeyPair>>,
    }
    impl Members for Body {
        fn member<'de, A: MapAccess<'de>>(&mut self, name: &str, map: &mut A) -> Result<bool, A::Error> {
            match name {
                "rank" => value(map, &mut self.rank),
                "keys" => value(map, &mut self.keys),
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

    fn check(body: &str) -> Result<(u32, usize), String> {
        decode::<Object<Body>>(body.as_bytes()).map(|Object(b)| (b.rank.unwrap().0, b.keys.map_or(0, |k| k.0.len())))
    }

    #[test]
    fn accepts_valid_bodies_and_ignores_unknown_members() {
        assert_eq!(check(r#"{"rank":3,"keys":[["a",""],["b","x"]],"extra":{"y":[1,2.5]}}"#), Ok((3, 2)));
        assert_eq!(check(r#" {"rank":0} "#), Ok((0, 0)));
    }

    #[test]
    fn names_the_place_and_the_reason() {
        let cases = [
            (
                r#"{"rank":0,"keys":[["a",""],"ab"]}"#,
                "keys[1]: invalid type: string \"ab\", expected a [key, prefix_key] pair",
            ),
            (r#"{"rank":0,"keys":[["a"]]}"#, "keys[0]: invalid length 1, expected a [key, prefix_key] pair"),
            (r#"{"rank":0,"keys":[["a","",""]]}"#, "keys[0]: invalid length 3, expected a [key, prefix_key] pair"),
            (r#"{"rank":0.0}"#, "rank: invalid type: floating point `0.0`, expected an integer in u32 range"),
            (r#"{"rank":false}"#, "rank: invalid type: boolean `false`, expected an integer in u32 range"),
            (r#"{"rank":-1}"#, "rank: invalid value: integer `-1`, expected an integer in u32 range"),
            (r#"{"rank":4294967296}"#, "rank: invalid value: integer `4294967296`, expected an integer in u32 range"),
            (r#"{"rank":null}"#, "rank: invalid type: null, expected an integer in u32 range"),
            (r#"{"keys":[]}"#, "member 'rank' is missing"),
            (r#"{"rank":1,"rank":2}"#, "duplicate member 'rank'"),
            (r#"{"rank":1,"x":{"a":1,"a":2}}"#, "x: duplicate member 'a'"),
            (r#"{"rank":0,"keys":[["",""]]}"#, "keys[0][0]: key is empty"),
            (r#"[1]"#, "invalid type: sequence, expected a JSON object"),
            (r#"{"rank":0} x"#, "body has data after the JSON value (trailing characters)"),
            ("", "body is empty, expected a JSON object"),
            ("\u{feff}{}", "body starts with a byte order mark"),
        ];
        for (body, want) in cases {
            assert_eq!(check(body), Err(want.to_string()), "{body}");
        }
        assert!(check("{").unwrap_err().starts_with("body is not valid JSON: EOF while parsing"));
        assert!(check(r#"{"rank":NaN}"#).unwrap_err().starts_with("body is not valid JSON"));
        assert_eq!(
            check_bytes(b"{\"rank\":0,\"k\":\"\xff\"}"),
            Err("body is not UTF-8 (invalid byte at offset 15)".into())
        );
        let deep = format!("{{\"rank\":0,\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(check(&deep).unwrap_err().contains("recursion limit exceeded"), "{}", check(&deep).unwrap_err());
    }

    fn check_bytes(body: &[u8]) -> Result<(u32, usize), String> {
        decode::<Object<Body>>(body).map(|Object(b)| (b.rank.unwrap().0, 0))
    }
}

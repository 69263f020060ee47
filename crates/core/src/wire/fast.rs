//! The fast path of request decoding: the bodies the clients actually send, read in one pass.
//!
//! vLLM's connector sends `{"rank": 0, "keys": [["<32 hex>", ""], ...]}` and its kin: plain
//! ASCII strings without escapes, small integers, no unknown members. Decoding those through
//! serde (with [`super::json`]'s strictness checks and error paths) costs ~45 ns per key; this
//! scanner reads them in a few ns per key.
//!
//! It decides nothing: it accepts only a subset of what [`super::json`] accepts, and gives up
//! (`None`) at the first byte it is not sure about — an escape, a non-ASCII byte, a float, an
//! unknown or repeated member, a key [`Key::parse`] refuses, a missing required member. The
//! caller then decodes the body through [`super::json`], which accepts it or says why not. So
//! the rules, and every error text, live in one place; the tests in `vllm.rs` check that
//! whenever this path answers, the full decoder gives the same value, and the tests here that
//! the key-list loop ([`Scan::hex_items`]) reads what the general list reader reads.

use std::vec::Vec;

use crate::key::{Key, MAX_KEY_LEN};

/// A cursor over a request body.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    /// Skips whitespace, then takes `c`.
    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    /// Skips whitespace, then takes `c` if it is next.
    fn try_eat(&mut self, c: u8) -> bool {
        self.eat(c).is_some()
    }

    /// A string of printable ASCII without escapes.
    fn string(&mut self) -> Option<&'a str> {
        // Printable ASCII: always UTF-8.
        core::str::from_utf8(self.string_bytes()?).ok()
    }

    /// [`Scan::string`]'s bytes, for a string whose text is not needed (batch_allocate's
    /// prefix key: only its length is checked; `from_utf8` of it cost ~60 instructions).
    #[inline(always)]
    fn string_bytes(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.i;
        loop {
            match *self.b.get(self.i)? {
                b'"' => break,
                b'\\' | 0..=0x1f | 0x80..=0xff => return None,
                _ => self.i += 1,
            }
        }
        let s = &self.b[start..self.i];
        self.i += 1;
        Some(s)
    }

    /// A JSON integer in u32 range, written without sign, fraction or exponent.
    fn u32(&mut self) -> Option<u32> {
        self.ws();
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(&d @ b'0'..=b'9') = self.b.get(self.i) {
            v = v * 10 + u64::from(d - b'0');
            self.i += 1;
            if self.i - start > 10 {
                return None;
            }
        }
        let digits = self.i - start;
        let leading_zero = digits > 1 && self.b[start] == b'0';
        let more = matches!(self.b.get(self.i), Some(b'.' | b'e' | b'E'));
        if digits == 0 || leading_zero || more {
            return None;
        }
        u32::try_from(v).ok()
    }

    /// `[a, b, ...]`, each element read by `elem`.
    fn list<T>(&mut self, mut elem: impl FnMut(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        self.list_into(|s, out| {
            out.push(elem(s)?);
            Some(())
        })
    }

    /// [`Scan::list`] whose `elem` pushes each element itself.
    fn list_into<T>(&mut self, mut elem: impl FnMut(&mut Self, &mut Vec<T>) -> Option<()>) -> Option<Vec<T>> {
        self.eat(b'[')?;
        // Room for every element of a key list: a 32-hex key takes at least 35 bytes with its
        // separator (`"…",`), and the body ends in at least one more byte than the list's
        // last element has. (At 36 a compactly written list of n keys got n - 1 and grew
        // once: a realloc and a copy a request.)
        let mut out = Vec::with_capacity(((self.b.len() - self.i) / 35).min(4096));
        if self.try_eat(b']') {
            return Some(out);
        }
        loop {
            elem(self, &mut out)?;
            // One look past the element's whitespace for what comes next.
            self.ws();
            match self.b.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }

    /// A list of items that each hold a 32-hex key, written as the clients write it: plain keys
    /// `["<32 hex>", ...]`, or with `pair` set `[["<32 hex>", rest], ...]`, `rest` read by `pair`
    /// (batch_allocate's prefix key, confirm_write's page) from a scanner over the same body;
    /// `,` or `, ` between items. One tight loop over a local copy of the cursor, each key
    /// packed where the list keeps it (`blank` is a new item; `key` finds its key's bytes).
    /// `None`, the cursor past whitespace only, at the first byte of any other shape:
    /// [`Scan::list_into`] then reads the list from there. (Through `list_into` alone each key
    /// went through two whitespace skips and separator checks that kept the cursor in memory:
    /// ~75 instructions a key besides its packing.)
    #[inline(always)]
    fn hex_items<T: Clone>(
        &mut self,
        blank: T,
        key: impl Fn(&mut T) -> &mut Key,
        mut pair: Option<impl FnMut(&mut Scan<'a>, &mut T) -> Option<()>>,
    ) -> Option<Vec<T>> {
        self.ws();
        let b = self.b;
        let mut i = self.i;
        if b.get(i) != Some(&b'[') {
            return None;
        }
        i += 1;
        // As in `list_into`: room for every item.
        let mut out = Vec::with_capacity(((b.len() - i) / 35).min(4096));
        if b.get(i) == Some(&b']') {
            self.i = i + 1;
            return Some(out);
        }
        loop {
            if pair.is_some() {
                if b.get(i) != Some(&b'[') {
                    return None;
                }
                i += 1;
            }
            let Some([b'"', hex @ .., b'"']) = b.get(i..i + 34) else { return None };
            out.push(blank.clone());
            let item = out.last_mut()?;
            let (Ok(hex), Key::Hex(dest)) = (<&[u8; 32]>::try_from(hex), key(item)) else { return None };
            if !Key::pack_hex_into(hex, dest) {
                return None;
            }
            i += 34;
            if let Some(rest) = &mut pair {
                let mut s = Scan { b, i };
                s.eat(b',')?;
                rest(&mut s, item)?;
                s.eat(b']')?;
                i = s.i;
            }
            match b.get(i) {
                Some(b',') => i += 1 + usize::from(b.get(i + 1) == Some(&b' ')),
                Some(b']') => {
                    self.i = i + 1;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }

    /// `{"name": value, ...}`: `member` reads the value of each name it knows, and must give up
    /// on a name it does not know or has already seen.
    fn object(&mut self, mut member: impl FnMut(&[u8], &mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.try_eat(b'}') {
            return Some(());
        }
        loop {
            let name = self.string_bytes()?;
            self.eat(b':')?;
            member(name, self)?;
            if self.try_eat(b'}') {
                return Some(());
            }
            self.eat(b',')?;
        }
    }

    /// Nothing but whitespace is left.
    fn end(&mut self) -> Option<()> {
        self.ws();
        (self.i == self.b.len()).then_some(())
    }
}

/// Sets `slot` once; a second value for the same member gives up.
fn once<T>(slot: &mut Option<T>, v: Option<T>) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(v?);
    Some(())
}

/// One body: an object read by `member`, then the end of the input.
fn body(b: &[u8], member: impl FnMut(&[u8], &mut Scan<'_>) -> Option<()>) -> Option<()> {
    let mut s = Scan { b, i: 0 };
    s.object(member)?;
    s.end()
}

/// A quoted key of 32 lowercase hex digits (the clients' keys), packed straight from the body
/// into `dest`; `false`, having moved the cursor past whitespace only (and `dest` unspecified),
/// for any other value.
#[inline(always)]
fn hex_key_into(s: &mut Scan<'_>, dest: &mut [u8; 16]) -> bool {
    s.ws();
    if let Some([b'"', hex @ .., b'"']) = s.b.get(s.i..s.i + 34)
        && let Ok(hex) = <&[u8; 32]>::try_from(hex)
        && Key::pack_hex_into(hex, dest)
    {
        s.i += 34;
        return true;
    }
    false
}

/// Any other key string, as [`Key::parse`] takes it.
#[inline(never)]
fn text_key(s: &mut Scan<'_>) -> Option<Key> {
    Key::parse(s.string()?).ok()
}

/// A key string into `key`, where its list keeps it: a 32-hex key is packed in place (built
/// elsewhere and moved in, it went through the stack and back in pieces the CPU could not
/// forward from the store: `batch_exists` of 1,250 keys decoded in 14.6 µs instead of 10.4 in
/// session 20, and again at the packed bytes in session 29, see [`Key::pack_hex_into`]).
#[inline(always)]
fn key_in_place(s: &mut Scan<'_>, key: &mut Key) -> Option<()> {
    if let Key::Hex(dest) = key
        && hex_key_into(s, dest)
    {
        return Some(());
    }
    *key = text_key(s)?;
    Some(())
}

/// A key string, pushed onto `out`. (A failed element fails the whole fast decode, so what is
/// left in `out` then does not matter.)
#[inline(always)]
fn key_into(s: &mut Scan<'_>, out: &mut Vec<Key>) -> Option<()> {
    out.push(Key::Hex([0; 16]));
    key_in_place(s, out.last_mut()?)
}

/// `[key, prefix_key]` (batch_allocate's element), its key pushed onto `out`.
fn key_pair_into(s: &mut Scan<'_>, out: &mut Vec<Key>) -> Option<()> {
    s.eat(b'[')?;
    key_into(s, out)?;
    s.eat(b',')?;
    prefix_key(s)?;
    s.eat(b']')
}

/// batch_allocate's prefix key: unused but bounded.
#[inline(always)]
fn prefix_key(s: &mut Scan<'_>) -> Option<()> {
    (s.string_bytes()?.len() <= MAX_KEY_LEN).then_some(())
}

/// `[key, page]` (confirm_write's element), pushed onto `out`.
fn key_page_into(s: &mut Scan<'_>, out: &mut Vec<(Key, u32)>) -> Option<()> {
    s.eat(b'[')?;
    out.push((Key::Hex([0; 16]), 0));
    let pair = out.last_mut()?;
    key_in_place(s, &mut pair.0)?;
    s.eat(b',')?;
    pair.1 = s.u32()?;
    s.eat(b']')
}

/// `{"rank": N, "keys": [...]}` with `keys` optional (empty): batch_allocate with pairs,
/// get_locations with plain keys.
fn rank_keys(b: &[u8], pairs: bool) -> Option<(u32, Vec<Key>)> {
    let elem = if pairs { key_pair_into } else { key_into };
    let prefix = pairs.then_some(|s: &mut Scan<'_>, _: &mut Key| prefix_key(s));
    let (mut rank, mut keys) = (None, None);
    body(b, |name, s| match name {
        b"rank" => once(&mut rank, s.u32()),
        b"keys" => once(&mut keys, s.hex_items(Key::Hex([0; 16]), |k| k, prefix).or_else(|| s.list_into(elem))),
        _ => None,
    })?;
    Some((rank?, keys.unwrap_or_default()))
}

/// batch_allocate: `{"rank": N, "keys": [[key, prefix], ...]}`.
pub(super) fn allocate(b: &[u8]) -> Option<(u32, Vec<Key>)> {
    rank_keys(b, true)
}

/// get_locations: `{"rank": N, "keys": [key, ...]}`.
pub(super) fn locations(b: &[u8]) -> Option<(u32, Vec<Key>)> {
    rank_keys(b, false)
}

/// A plain key list (no pairs) through [`Scan::hex_items`], else through [`Scan::list_into`].
fn key_list(s: &mut Scan<'_>) -> Option<Vec<Key>> {
    let no_pair: Option<fn(&mut Scan<'_>, &mut Key) -> Option<()>> = None;
    s.hex_items(Key::Hex([0; 16]), |k| k, no_pair).or_else(|| s.list_into(key_into))
}

/// batch_exists and delete: `{"keys": [key, ...]}` (`keys` optional: empty).
pub(super) fn keys(b: &[u8]) -> Option<Vec<Key>> {
    let mut keys = None;
    body(b, |name, s| match name {
        b"keys" => once(&mut keys, key_list(s)),
        _ => None,
    })?;
    Some(keys.unwrap_or_default())
}

/// What confirm_write asks: rank, confirmations, pages to release.
pub(super) type Confirm = (u32, Vec<(Key, u32)>, Vec<u32>);

/// confirm_write's `[[key, page], ...]` through [`Scan::hex_items`], else through
/// [`Scan::list_into`].
fn confirmations_list(s: &mut Scan<'_>) -> Option<Vec<(Key, u32)>> {
    let page = |s: &mut Scan<'_>, pair: &mut (Key, u32)| {
        pair.1 = s.u32()?;
        Some(())
    };
    s.hex_items((Key::Hex([0; 16]), 0), |pair| &mut pair.0, Some(page)).or_else(|| s.list_into(key_page_into))
}

/// confirm_write: `{"rank": N, "confirmations": [[key, page], ...], "pages_to_release": [page, ...]}`.
pub(super) fn confirm(b: &[u8]) -> Option<Confirm> {
    let (mut rank, mut confirmations, mut releases) = (None, None, None);
    body(b, |name, s| match name {
        b"rank" => once(&mut rank, s.u32()),
        b"confirmations" => once(&mut confirmations, confirmations_list(s)),
        b"pages_to_release" => once(&mut releases, s.list(Scan::u32)),
        _ => None,
    })?;
    Some((rank?, confirmations.unwrap_or_default(), releases.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::String;

    /// The three list shapes `hex_items` reads.
    #[derive(Clone, Copy, Debug)]
    enum Shape {
        Keys,
        Pairs,
        Pages,
    }

    /// What [`read`] gives: the items (a plain key's page is 0), where the cursor ends, and
    /// whether `hex_items` answered.
    type Read = (Vec<(Key, u32)>, usize, bool);

    /// `list` read as `shape` the way the decoders read it (`hex_items`, else `list_into`):
    /// its keys (and pages), where the cursor ends and whether `hex_items` answered, checked
    /// against `list_into` alone.
    fn read(list: &str, shape: Shape) -> Option<Read> {
        let body = alloc::format!("{list} }}");
        let mut s = Scan { b: body.as_bytes(), i: 0 };
        let mut general = Scan { b: body.as_bytes(), i: 0 };
        let keys = |v: Vec<Key>| v.into_iter().map(|k| (k, 0)).collect::<Vec<_>>();
        let no_pair: Option<fn(&mut Scan<'_>, &mut Key) -> Option<()>> = None;
        let page = |s: &mut Scan<'_>, p: &mut (Key, u32)| {
            p.1 = s.u32()?;
            Some(())
        };
        let fast = match shape {
            Shape::Keys => s.hex_items(Key::Hex([0; 16]), |k| k, no_pair).map(keys),
            Shape::Pairs => {
                s.hex_items(Key::Hex([0; 16]), |k| k, Some(|s: &mut Scan<'_>, _: &mut Key| prefix_key(s))).map(keys)
            }
            Shape::Pages => s.hex_items((Key::Hex([0; 16]), 0), |p| &mut p.0, Some(page)),
        };
        let answered = fast.is_some();
        if !answered {
            // Given up having moved past whitespace only; the decoders read on from there.
            assert_eq!(body[..s.i].trim(), "", "{list}");
        }
        let got = fast.or_else(|| match shape {
            Shape::Keys => s.list_into(key_into).map(keys),
            Shape::Pairs => s.list_into(key_pair_into).map(keys),
            Shape::Pages => s.list_into(key_page_into),
        });
        let want = match shape {
            Shape::Keys => general.list_into(key_into).map(keys),
            Shape::Pairs => general.list_into(key_pair_into).map(keys),
            Shape::Pages => general.list_into(key_page_into),
        };
        assert_eq!(got, want, "{list}");
        let items = got?;
        assert_eq!(s.i, general.i, "{list}");
        Some((items, s.i, answered))
    }

    fn hex(n: u32) -> String {
        alloc::format!("{n:032x}")
    }

    #[test]
    fn hex_items_reads_the_clients_lists_as_the_general_reader_does() {
        let (a, b) = (hex(1), hex(0xabcdef));
        let key = |n: u32| Key::parse(&hex(n)).unwrap();
        // The clients' spellings: compact (the bench's) and Python's `, ` (vLLM's).
        for (list, shape, want) in [
            (alloc::format!("[\"{a}\",\"{b}\"]"), Shape::Keys, [0, 0]),
            (alloc::format!(" [\"{a}\", \"{b}\"]"), Shape::Keys, [0, 0]),
            (alloc::format!("[[\"{a}\",\"\"],[\"{b}\",\"\"]]"), Shape::Pairs, [0, 0]),
            (alloc::format!("[[\"{a}\", \"\"], [\"{b}\", \"\"]]"), Shape::Pairs, [0, 0]),
            (alloc::format!("[[\"{a}\",\"{b}\"],[\"{b}\", \"k\" ]]"), Shape::Pairs, [0, 0]),
            (alloc::format!("[[\"{a}\",7],[\"{b}\",4294967295]]"), Shape::Pages, [7, u32::MAX]),
            (alloc::format!("[[\"{a}\", 0], [\"{b}\", 12]]"), Shape::Pages, [0, 12]),
        ] {
            let (got, after, answered) = read(&list, shape).expect(&list);
            assert!(answered, "the key-list loop gave up on {list}");
            assert_eq!(got, [(key(1), want[0]), (key(0xabcdef), want[1])], "{list}");
            assert_eq!(after, list.len(), "{list}");
        }
        for shape in [Shape::Keys, Shape::Pairs, Shape::Pages] {
            assert_eq!(read("[]", shape), Some((Vec::new(), 2, true)));
        }
        // Long lists in both spellings, read to their end by the loop.
        for sep in [",", ", "] {
            let n: Vec<u32> = (0..300).map(|i| i * 7_919 + 1).collect();
            let item = |i: u32, shape: Shape| match shape {
                Shape::Keys => alloc::format!("\"{}\"", hex(i)),
                Shape::Pairs => alloc::format!("[\"{}\"{sep}\"\"]", hex(i)),
                Shape::Pages => alloc::format!("[\"{}\"{sep}{i}]", hex(i)),
            };
            for shape in [Shape::Keys, Shape::Pairs, Shape::Pages] {
                let items: Vec<String> = n.iter().map(|&i| item(i, shape)).collect();
                let list = alloc::format!("[{}]", items.join(sep));
                let (got, after, answered) = read(&list, shape).expect(&list);
                assert!(answered, "{shape:?} with {sep:?}");
                let page = |i: u32| if matches!(shape, Shape::Pages) { i } else { 0 };
                assert_eq!(got, n.iter().map(|&i| (key(i), page(i))).collect::<Vec<_>>());
                assert_eq!(after, list.len());
            }
        }
        // Other shapes are the general reader's, which takes some of them.
        let upper = hex(0xabcdef).to_uppercase();
        let mut taken = 0;
        for (list, shape) in [
            (alloc::format!("[ \"{a}\"]"), Shape::Keys),
            (alloc::format!("[\"{a}\" ,\"{b}\"]"), Shape::Keys),
            (alloc::format!("[\"{a}\",\n\"{b}\"]"), Shape::Keys),
            (alloc::format!("[\"{a}\",  \"{b}\"]"), Shape::Keys),
            (alloc::format!("[\"{upper}\"]"), Shape::Keys),
            ("[\"k\"]".into(), Shape::Keys),
            (alloc::format!("[\"{a}\"]"), Shape::Pairs),
            (alloc::format!("[[\"{a}\",\"\"] ]"), Shape::Pairs),
            (alloc::format!("[[\"{a}\",07]]"), Shape::Pages),
            (alloc::format!("[[\"{a}\",4294967296]]"), Shape::Pages),
            (alloc::format!("[[\"{a}\",1.5]]"), Shape::Pages),
            (alloc::format!("[\"{a}\",]"), Shape::Keys),
            (alloc::format!("[\"{a}\""), Shape::Keys),
            (alloc::format!("\"{a}\""), Shape::Keys),
        ] {
            let read = read(&list, shape);
            assert!(read.as_ref().is_none_or(|r| !r.2), "{shape:?} {list}: the loop answered");
            taken += usize::from(read.is_some());
        }
        // Odd whitespace (4 lists), uppercase and text keys: the general reader's.
        assert_eq!(taken, 7);
    }
}

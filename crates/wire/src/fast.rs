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

use kvpages_core::key::{Key, MAX_KEY_LEN};

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

    /// A list of items that each hold a key: plain keys `[key, ...]`, or with `rest` set
    /// `[[key, rest], ...]`, `rest` read by `rest` (batch_allocate's prefix key, confirm_write's
    /// page); `blank` is a new item, `key` finds its key. The list as the clients write it —
    /// 32-hex keys, `,` or `, ` between items — is read by [`Scan::hex_items`]; any other
    /// shape from where that gave up by [`Scan::list_into`], an item at a time ([`item_into`]).
    #[inline(always)]
    fn key_items<T: Clone>(
        &mut self,
        blank: T,
        key: impl Fn(&mut T) -> &mut Key,
        mut rest: Option<impl FnMut(&mut Scan<'a>, &mut T) -> Option<()>>,
    ) -> Option<Vec<T>> {
        self.hex_items(&blank, &key, &mut rest)
            .or_else(|| self.list_into(|s, out| item_into(s, out, &blank, &key, &mut rest)))
    }

    /// [`Scan::key_items`]' loop for the lists the clients write: one tight loop over a local
    /// copy of the cursor, each key packed where the list keeps it. `None`, the cursor past
    /// whitespace only, at the first byte of any other shape. (Through `list_into` alone each
    /// key went through two whitespace skips and separator checks that kept the cursor in
    /// memory: ~75 instructions a key besides its packing.)
    #[inline(always)]
    fn hex_items<T: Clone>(
        &mut self,
        blank: &T,
        key: &impl Fn(&mut T) -> &mut Key,
        rest: &mut Option<impl FnMut(&mut Scan<'a>, &mut T) -> Option<()>>,
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
            if rest.is_some() {
                if b.get(i) != Some(&b'[') {
                    return None;
                }
                i += 1;
            }
            out.push(blank.clone());
            let item = out.last_mut()?;
            let Key::Hex(dest) = key(item) else { return None };
            if !hex_key_at(b, i, dest) {
                return None;
            }
            i += 34;
            if let Some(rest) = rest {
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

/// Whether `b[i..]` starts with a quoted key of 32 lowercase hex digits (the clients' keys),
/// packed straight from the body into `dest` (unspecified when not).
#[inline(always)]
fn hex_key_at(b: &[u8], i: usize, dest: &mut [u8; 16]) -> bool {
    match b.get(i..i + 34) {
        Some([b'"', hex @ .., b'"']) => <&[u8; 32]>::try_from(hex).is_ok_and(|hex| Key::pack_hex_into(hex, dest)),
        _ => false,
    }
}

/// [`hex_key_at`] at the cursor past whitespace, moving past the key; `false`, having moved the
/// cursor past whitespace only, for any other value.
#[inline(always)]
fn hex_key_into(s: &mut Scan<'_>, dest: &mut [u8; 16]) -> bool {
    s.ws();
    if hex_key_at(s.b, s.i, dest) {
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
/// elsewhere and moved in, it goes through the stack and back in pieces the CPU cannot
/// forward from the store, ~40 % slower: criterion `decode/batch_exists-1250` in
/// `benches/wire.rs`; see [`Key::pack_hex_into`]).
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

/// One item of a key list read the general way, pushed onto `out` (a failed item fails the
/// whole fast decode, so what is left in `out` then does not matter): its key, or with `rest`
/// set `[key, rest]` (see [`Scan::key_items`]).
#[inline(always)]
fn item_into<'a, T: Clone>(
    s: &mut Scan<'a>,
    out: &mut Vec<T>,
    blank: &T,
    key: &impl Fn(&mut T) -> &mut Key,
    rest: &mut Option<impl FnMut(&mut Scan<'a>, &mut T) -> Option<()>>,
) -> Option<()> {
    if rest.is_some() {
        s.eat(b'[')?;
    }
    out.push(blank.clone());
    let item = out.last_mut()?;
    key_in_place(s, key(item))?;
    if let Some(rest) = rest {
        s.eat(b',')?;
        rest(s, item)?;
        s.eat(b']')?;
    }
    Some(())
}

/// No `rest`: a list of plain keys.
const PLAIN: Option<fn(&mut Scan<'_>, &mut Key) -> Option<()>> = None;

/// batch_allocate's prefix key, the rest of its `[key, prefix_key]` items: unused but bounded.
#[inline(always)]
fn prefix_key(s: &mut Scan<'_>, _: &mut Key) -> Option<()> {
    (s.string_bytes()?.len() <= MAX_KEY_LEN).then_some(())
}

/// confirm_write's page, the rest of its `[key, page]` items.
#[inline(always)]
fn page(s: &mut Scan<'_>, pair: &mut (Key, u32)) -> Option<()> {
    pair.1 = s.u32()?;
    Some(())
}

/// A plain key list.
fn key_list(s: &mut Scan<'_>) -> Option<Vec<Key>> {
    s.key_items(Key::Hex([0; 16]), |k| k, PLAIN)
}

/// batch_allocate's `[[key, prefix_key], ...]`, its keys.
fn key_pairs(s: &mut Scan<'_>) -> Option<Vec<Key>> {
    s.key_items(Key::Hex([0; 16]), |k| k, Some(prefix_key))
}

/// confirm_write's `[[key, page], ...]`.
fn confirmations_list(s: &mut Scan<'_>) -> Option<Vec<(Key, u32)>> {
    s.key_items((Key::Hex([0; 16]), 0), |pair| &mut pair.0, Some(page))
}

/// `{"rank": N, "keys": [...]}` with `keys` optional (empty), read by `list`: batch_allocate
/// with pairs, get_locations with plain keys.
fn rank_keys(b: &[u8], list: fn(&mut Scan<'_>) -> Option<Vec<Key>>) -> Option<(u32, Vec<Key>)> {
    let (mut rank, mut keys) = (None, None);
    body(b, |name, s| match name {
        b"rank" => once(&mut rank, s.u32()),
        b"keys" => once(&mut keys, list(s)),
        _ => None,
    })?;
    Some((rank?, keys.unwrap_or_default()))
}

/// batch_allocate: `{"rank": N, "keys": [[key, prefix], ...]}`.
pub(super) fn allocate(b: &[u8]) -> Option<(u32, Vec<Key>)> {
    rank_keys(b, key_pairs)
}

/// get_locations: `{"rank": N, "keys": [key, ...]}`.
pub(super) fn locations(b: &[u8]) -> Option<(u32, Vec<Key>)> {
    rank_keys(b, key_list)
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
    use std::string::String;

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

    /// One list read both ways (see [`ways`]).
    struct Ways<T> {
        /// Whether `hex_items` answered, and where it left the cursor.
        answered: bool,
        stopped: usize,
        /// What `key_items` read (`hex_items`, else `list_into` from where it gave up), and
        /// where it ended.
        got: Option<Vec<T>>,
        at: usize,
        /// What `list_into` alone read from the start, and where it ended.
        want: Option<Vec<T>>,
        general_at: usize,
    }

    impl<T> Ways<T> {
        fn map<U>(self, f: impl Fn(T) -> U) -> Ways<U> {
            let all = |v: Option<Vec<T>>| v.map(|v| v.into_iter().map(&f).collect());
            let Ways { answered, stopped, got, at, want, general_at } = self;
            Ways { answered, stopped, got: all(got), at, want: all(want), general_at }
        }
    }

    /// `b` read as `key_items` reads it, and by `list_into` alone, for one shape of item.
    fn ways<'a, T: Clone>(
        b: &'a [u8],
        blank: T,
        key: impl Fn(&mut T) -> &mut Key,
        mut rest: Option<impl FnMut(&mut Scan<'a>, &mut T) -> Option<()>>,
    ) -> Ways<T> {
        let mut s = Scan { b, i: 0 };
        let fast = s.hex_items(&blank, &key, &mut rest);
        let (answered, stopped) = (fast.is_some(), s.i);
        let got = fast.or_else(|| s.list_into(|s, out| item_into(s, out, &blank, &key, &mut rest)));
        let mut general = Scan { b, i: 0 };
        let want = general.list_into(|s, out| item_into(s, out, &blank, &key, &mut rest));
        Ways { answered, stopped, got, at: s.i, want, general_at: general.i }
    }

    /// `list` read as `shape` the way the decoders read it (`hex_items`, else `list_into`):
    /// its keys (and pages), where the cursor ends and whether `hex_items` answered, checked
    /// against `list_into` alone.
    fn read(list: &str, shape: Shape) -> Option<Read> {
        let body = std::format!("{list} }}");
        let b = body.as_bytes();
        let plain = |k: Key| (k, 0);
        let w = match shape {
            Shape::Keys => ways(b, Key::Hex([0; 16]), |k| k, PLAIN).map(plain),
            Shape::Pairs => ways(b, Key::Hex([0; 16]), |k| k, Some(prefix_key)).map(plain),
            Shape::Pages => ways(b, (Key::Hex([0; 16]), 0), |p| &mut p.0, Some(page)),
        };
        if !w.answered {
            // Given up having moved past whitespace only; the decoders read on from there.
            assert_eq!(body[..w.stopped].trim(), "", "{list}");
        }
        assert_eq!(w.got, w.want, "{list}");
        let items = w.got?;
        assert_eq!(w.at, w.general_at, "{list}");
        Some((items, w.at, w.answered))
    }

    fn hex(n: u32) -> String {
        std::format!("{n:032x}")
    }

    #[test]
    fn hex_items_reads_the_clients_lists_as_the_general_reader_does() {
        let (a, b) = (hex(1), hex(0xabcdef));
        let key = |n: u32| Key::parse(&hex(n)).unwrap();
        // The clients' spellings: compact (the bench's) and Python's `, ` (vLLM's).
        for (list, shape, want) in [
            (std::format!("[\"{a}\",\"{b}\"]"), Shape::Keys, [0, 0]),
            (std::format!(" [\"{a}\", \"{b}\"]"), Shape::Keys, [0, 0]),
            (std::format!("[[\"{a}\",\"\"],[\"{b}\",\"\"]]"), Shape::Pairs, [0, 0]),
            (std::format!("[[\"{a}\", \"\"], [\"{b}\", \"\"]]"), Shape::Pairs, [0, 0]),
            (std::format!("[[\"{a}\",\"{b}\"],[\"{b}\", \"k\" ]]"), Shape::Pairs, [0, 0]),
            (std::format!("[[\"{a}\",7],[\"{b}\",4294967295]]"), Shape::Pages, [7, u32::MAX]),
            (std::format!("[[\"{a}\", 0], [\"{b}\", 12]]"), Shape::Pages, [0, 12]),
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
                Shape::Keys => std::format!("\"{}\"", hex(i)),
                Shape::Pairs => std::format!("[\"{}\"{sep}\"\"]", hex(i)),
                Shape::Pages => std::format!("[\"{}\"{sep}{i}]", hex(i)),
            };
            for shape in [Shape::Keys, Shape::Pairs, Shape::Pages] {
                let items: Vec<String> = n.iter().map(|&i| item(i, shape)).collect();
                let list = std::format!("[{}]", items.join(sep));
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
            (std::format!("[ \"{a}\"]"), Shape::Keys),
            (std::format!("[\"{a}\" ,\"{b}\"]"), Shape::Keys),
            (std::format!("[\"{a}\",\n\"{b}\"]"), Shape::Keys),
            (std::format!("[\"{a}\",  \"{b}\"]"), Shape::Keys),
            (std::format!("[\"{upper}\"]"), Shape::Keys),
            ("[\"k\"]".into(), Shape::Keys),
            (std::format!("[\"{a}\"]"), Shape::Pairs),
            (std::format!("[[\"{a}\",\"\"] ]"), Shape::Pairs),
            (std::format!("[[\"{a}\",07]]"), Shape::Pages),
            (std::format!("[[\"{a}\",4294967296]]"), Shape::Pages),
            (std::format!("[[\"{a}\",1.5]]"), Shape::Pages),
            (std::format!("[\"{a}\",]"), Shape::Keys),
            (std::format!("[\"{a}\""), Shape::Keys),
            (std::format!("\"{a}\""), Shape::Keys),
        ] {
            let read = read(&list, shape);
            assert!(read.as_ref().is_none_or(|r| !r.2), "{shape:?} {list}: the loop answered");
            taken += usize::from(read.is_some());
        }
        // Odd whitespace (4 lists), uppercase and text keys: the general reader's.
        assert_eq!(taken, 7);
    }
}

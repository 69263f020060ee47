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
//! the rules, and every error text, live in one place; the tests here check that whenever this
//! path answers, the full decoder gives the same value.

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
        // Printable ASCII: always UTF-8.
        core::str::from_utf8(s).ok()
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
        // A guess that saves most regrowth: an element of a key list takes ~35 bytes.
        let mut out = Vec::with_capacity(((self.b.len() - self.i) / 36).min(4096));
        if self.try_eat(b']') {
            return Some(out);
        }
        loop {
            elem(self, &mut out)?;
            if self.try_eat(b']') {
                return Some(out);
            }
            self.eat(b',')?;
        }
    }

    /// `{"name": value, ...}`: `member` reads the value of each name it knows, and must give up
    /// on a name it does not know or has already seen.
    fn object(&mut self, mut member: impl FnMut(&str, &mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.try_eat(b'}') {
            return Some(());
        }
        loop {
            let name = self.string()?;
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
fn body(b: &[u8], member: impl FnMut(&str, &mut Scan<'_>) -> Option<()>) -> Option<()> {
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
#[inline(never)]
fn key_into(s: &mut Scan<'_>, out: &mut Vec<Key>) -> Option<()> {
    out.push(Key::Hex([0; 16]));
    key_in_place(s, out.last_mut()?)
}

/// `[key, prefix_key]` (batch_allocate's element), its key pushed onto `out`; the prefix is
/// unused but bounded.
fn key_pair_into(s: &mut Scan<'_>, out: &mut Vec<Key>) -> Option<()> {
    s.eat(b'[')?;
    key_into(s, out)?;
    s.eat(b',')?;
    if s.string()?.len() > MAX_KEY_LEN {
        return None;
    }
    s.eat(b']')
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
fn rank_keys(b: &[u8], elem: fn(&mut Scan<'_>, &mut Vec<Key>) -> Option<()>) -> Option<(u32, Vec<Key>)> {
    let (mut rank, mut keys) = (None, None);
    body(b, |name, s| match name {
        "rank" => once(&mut rank, s.u32()),
        "keys" => once(&mut keys, s.list_into(elem)),
        _ => None,
    })?;
    Some((rank?, keys.unwrap_or_default()))
}

/// batch_allocate: `{"rank": N, "keys": [[key, prefix], ...]}`.
pub(super) fn allocate(b: &[u8]) -> Option<(u32, Vec<Key>)> {
    rank_keys(b, key_pair_into)
}

/// get_locations: `{"rank": N, "keys": [key, ...]}`.
pub(super) fn locations(b: &[u8]) -> Option<(u32, Vec<Key>)> {
    rank_keys(b, key_into)
}

/// batch_exists and delete: `{"keys": [key, ...]}` (`keys` optional: empty).
pub(super) fn keys(b: &[u8]) -> Option<Vec<Key>> {
    let mut keys = None;
    body(b, |name, s| match name {
        "keys" => once(&mut keys, s.list_into(key_into)),
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
        "rank" => once(&mut rank, s.u32()),
        "confirmations" => once(&mut confirmations, s.list_into(key_page_into)),
        "pages_to_release" => once(&mut releases, s.list(Scan::u32)),
        _ => None,
    })?;
    Some((rank?, confirmations.unwrap_or_default(), releases.unwrap_or_default()))
}

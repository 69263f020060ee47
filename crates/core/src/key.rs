//! Cache keys: stored compactly, echoed exactly as the client sent them.

use alloc::boxed::Box;
use core::fmt;

/// The longest key (and prefix key) kvpages accepts, in bytes.
///
/// Real keys are 32-character MD5 hex strings; SGLang's zero-copy mode appends `-k`/`-v`.
/// 1024 bytes leaves room for any naming scheme while bounding memory per key.
pub const MAX_KEY_LEN: usize = 1024;

/// A cache key.
///
/// A 32-character lowercase hex key (what vLLM and SGLang send) is stored as its 16 bytes;
/// anything else is kept as the exact string. The two forms never describe the same text,
/// so equality and hashing stay exact, and [`fmt::Display`] gives back the text that was sent.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    /// 32 lowercase hex characters, packed.
    Hex([u8; 16]),
    /// Any other key, verbatim.
    Text(Box<str>),
}

/// A packed key is hashed as one 128-bit number (one multiply in foldhash, which the key
/// table's hasher uses on wasm32; natively it mixes a packed key's halves itself, see
/// `keys::Hasher`), any other key as its text. Equal keys are the same variant with the same
/// content, so they hash alike.
impl core::hash::Hash for Key {
    fn hash<H: core::hash::Hasher>(&self, state: &mut H) {
        match self {
            Key::Hex(bytes) => state.write_u128(u128::from_le_bytes(*bytes)),
            Key::Text(s) => s.hash(state),
        }
    }
}

/// Why a string is not a valid key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum KeyError {
    /// The empty string.
    Empty,
    /// Longer than [`MAX_KEY_LEN`] bytes.
    TooLong {
        /// Length of the rejected key in bytes.
        len: usize,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("key is empty"),
            KeyError::TooLong { len } => {
                write!(f, "key is {len} bytes long, the limit is {MAX_KEY_LEN}")
            }
        }
    }
}

impl Key {
    /// Parses a key as sent on the wire.
    pub fn parse(s: &str) -> Result<Key, KeyError> {
        if s.is_empty() {
            return Err(KeyError::Empty);
        }
        if s.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: s.len() });
        }
        if let Some(packed) = Self::pack_hex(s.as_bytes()) {
            return Ok(Key::Hex(packed));
        }
        Ok(Key::Text(Box::from(s)))
    }

    /// The 16 bytes of a 32-character lowercase hex string; `None` for any other input.
    pub fn pack_hex(b: &[u8]) -> Option<[u8; 16]> {
        let b: &[u8; 32] = b.try_into().ok()?;
        let mut out = [0u8; 16];
        Self::pack_hex_into(b, &mut out).then_some(out)
    }

    /// [`Key::pack_hex`] written into `out` (its bytes unspecified when this answers `false`,
    /// the input not being lowercase hex). The decoder packs a key straight into the list that
    /// keeps it: reading a returned array back from the stack, in the pieces the list's `Key`
    /// layout wants, stalled on the array's one 16-byte store (`perf annotate`: ~60 % of
    /// `key_into`'s samples on that reload).
    #[inline(always)]
    pub fn pack_hex_into(b: &[u8; 32], out: &mut [u8; 16]) -> bool {
        // Branch-free arithmetic over all 32 bytes (the compiler vectorizes it), one check at
        // the end: a byte that is neither '0'..='9' nor 'a'..='f' sets `bad`.
        let mut val = [0u8; 32];
        let mut bad = false;
        for (v, &c) in val.iter_mut().zip(b) {
            let digit = c.wrapping_sub(b'0');
            let letter = c.wrapping_sub(b'a');
            let (is_digit, is_letter) = (digit < 10, letter < 6);
            bad |= !(is_digit | is_letter);
            *v = if is_digit { digit } else { letter.wrapping_add(10) };
        }
        for (o, pair) in out.iter_mut().zip(val.chunks_exact(2)) {
            *o = (pair[0] << 4) | (pair[1] & 0xf);
        }
        !bad
    }

    /// Length of the key's text in bytes.
    pub fn text_len(&self) -> usize {
        match self {
            Key::Hex(_) => 32,
            Key::Text(s) => s.len(),
        }
    }
}

/// The 32 lowercase hex digits of a packed key (for writers of keys as text: `Display`,
/// snapshots, the wire's answers).
#[derive(Clone, Copy, Debug)]
pub struct HexText([u8; 32]);

impl HexText {
    /// Four bytes at a time in a `u64` (no table lookups: on wasm each was a load, a bounds
    /// check and a store; snapshots write every stored key this way).
    #[inline(always)]
    pub fn new(bytes: &[u8; 16]) -> HexText {
        const LOW: u64 = 0x000f_000f_000f_000f;
        const ONES: u64 = 0x0101_0101_0101_0101;
        let mut buf = [0u8; 32];
        for (out, four) in buf.chunks_exact_mut(8).zip(bytes.chunks_exact(4)) {
            // Each byte into its own 16-bit lane, in order.
            let mut t = u64::from(u32::from_le_bytes(four.try_into().expect("4 bytes")));
            t = (t | (t << 16)) & 0x0000_ffff_0000_ffff;
            t = (t | (t << 8)) & 0x00ff_00ff_00ff_00ff;
            // A lane's first byte (written first) is the high nibble, its second the low one.
            let nibbles = ((t >> 4) & LOW) | ((t & LOW) << 8);
            // '0' + n, plus 'a' - '0' - 10 = 39 where n > 9 (n + 6 carries into bit 4).
            let letters = ((nibbles + 6 * ONES) >> 4) & ONES;
            let digits = nibbles + b'0' as u64 * ONES + letters * 39;
            out.copy_from_slice(&digits.to_le_bytes());
        }
        HexText(buf)
    }

    /// The digits as bytes (no UTF-8 check: for writers of JSON).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digits as text.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits: always UTF-8.
        core::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Hex(bytes) => f.write_str(HexText::new(bytes).as_str()),
            Key::Text(s) => f.write_str(s),
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", alloc::format!("{self}"))
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Key {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // The key's text, as a string (not `collect_str`: no formatting machinery per key in
        // snapshots).
        match self {
            Key::Hex(bytes) => s.serialize_str(HexText::new(bytes).as_str()),
            Key::Text(t) => s.serialize_str(t),
        }
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <alloc::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        Key::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn lowercase_hex_is_packed_and_round_trips() {
        let s = "386b2d9cf5aa91ba3a4b42c35396c822";
        let k = Key::parse(s).unwrap();
        assert!(matches!(k, Key::Hex(_)));
        assert_eq!(k.to_string(), s);
    }

    #[test]
    fn uppercase_and_other_keys_are_kept_verbatim() {
        for s in ["386B2D9CF5AA91BA3A4B42C35396C822", "h1", "K-k", "386b2d9cf5aa91ba3a4b42c35396c82"] {
            let k = Key::parse(s).unwrap();
            assert!(matches!(k, Key::Text(_)), "{s}");
            assert_eq!(k.to_string(), s);
        }
    }

    #[test]
    fn exactly_the_lowercase_hex_digits_are_packed_at_every_position() {
        let base = *b"0123456789abcdef0123456789abcdef";
        for pos in 0..32 {
            for byte in 0..=255u8 {
                let mut b = base;
                b[pos] = byte;
                let Ok(text) = core::str::from_utf8(&b) else { continue };
                let k = Key::parse(text).unwrap();
                let digit = byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte);
                assert_eq!(matches!(k, Key::Hex(_)), digit, "byte {byte:#x} at {pos}");
                assert_eq!(k.to_string(), text);
            }
        }
    }

    #[test]
    fn every_byte_at_every_position_is_written_as_two_lowercase_digits() {
        for pos in 0..16 {
            for byte in 0..=255u8 {
                let mut b = [0x5au8; 16];
                b[pos] = byte;
                let want: alloc::string::String = b.iter().map(|x| alloc::format!("{x:02x}")).collect();
                assert_eq!(HexText::new(&b).as_str(), want, "byte {byte:#x} at {pos}");
            }
        }
    }

    #[test]
    fn empty_and_too_long_are_refused() {
        assert_eq!(Key::parse(""), Err(KeyError::Empty));
        let long = "a".repeat(MAX_KEY_LEN + 1);
        assert_eq!(Key::parse(&long), Err(KeyError::TooLong { len: MAX_KEY_LEN + 1 }));
        assert!(Key::parse(&long[..MAX_KEY_LEN]).is_ok());
    }
}

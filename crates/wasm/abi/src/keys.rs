//! Packed key batches (`packed-keys` in `wit/kvpages.wit`): how a batch of keys crosses the
//! plugin boundary by either way in, and the one decoder of them.
//!
//! Each key is a little-endian `u16` length, then its UTF-8 bytes; a 32-char lowercase hex key
//! may instead be [`RAW_HEX`] and the 16 bytes it spells, which the guest takes as they are.

use alloc::string::String;
use alloc::vec::Vec;

use kvpages_core::{Command, Key, SglangPool};

/// The prefix of a key sent as its 16 raw bytes (`0x8000 | 16`): a 32-char lowercase hex key,
/// which needs no parsing.
pub const RAW_HEX: u16 = 0x8000 | 16;

/// Appends one key in the text form: its length as a little-endian u16, then its bytes. (Keys
/// longer than u16 are the caller's bug.)
pub fn pack_key(out: &mut Vec<u8>, key: &str) {
    let len = u16::try_from(key.len()).expect("keys are at most 1024 bytes");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

/// Appends one key in the shortest form: [`RAW_HEX`] and 16 bytes for a 32-hex key, else its
/// text (see [`pack_key`]).
pub fn pack_core_key(out: &mut Vec<u8>, key: &Key) {
    pack_keys(out, core::iter::once(key));
}

/// Appends `keys` as a packed batch, each in the shortest form ([`pack_core_key`]). kvpages'
/// host packs its calls' keys with this, for both ways in (the WIT interface and `direct`).
pub fn pack_keys<'a>(out: &mut Vec<u8>, keys: impl ExactSizeIterator<Item = &'a Key>) {
    // 18 bytes a key in the common case; text keys grow it as needed.
    out.reserve(keys.len() * 18);
    for key in keys {
        match key {
            Key::Hex(bytes) => {
                // One 18-byte record, one capacity check (two `extend_from_slice` calls cost
                // ~24 instructions a key, this ~half).
                let mut record = [0; 18];
                let (prefix, raw) = record.split_at_mut(2);
                prefix.copy_from_slice(&RAW_HEX.to_le_bytes());
                raw.copy_from_slice(bytes);
                out.extend_from_slice(&record);
            }
            Key::Text(text) => pack_key(out, text),
        }
    }
}

/// The keys `cmd` carries into its call, packed into `out` (emptied first; left empty for a
/// command without a key batch).
pub fn pack_keys_of(out: &mut Vec<u8>, cmd: &Command) {
    out.clear();
    match cmd {
        Command::Allocate { keys, .. }
        | Command::Exists { keys, .. }
        | Command::Locations { keys, .. }
        | Command::Delete { keys, .. } => pack_keys(out, keys.iter()),
        Command::Confirm { confirmations, .. } => pack_keys(out, confirmations.iter().map(|(k, _)| k)),
        _ => {}
    }
}

/// Decodes a packed batch, refusing (never panicking on) anything malformed; `keys[i]: why`
/// names the culprit the way the host's JSON errors do.
pub fn unpack_keys(bytes: &[u8]) -> Result<Vec<Key>, String> {
    unpack_batch(bytes, |_, key| key).map(|(keys, _)| keys)
}

/// [`unpack_keys`], each key `i` handed to `item` as it is decoded (`confirm` pairs keys with
/// their pages without a vector of keys in between), and whether every key came in the raw
/// form (then [`discard`] may free the items without visiting them).
pub fn unpack_batch<T: KeyItem>(bytes: &[u8], mut item: impl FnMut(usize, Key) -> T) -> Result<(Vec<T>, bool), String> {
    match unpack_raw(bytes, &mut item) {
        Some(items) => Ok((items, true)),
        None => unpack_any(bytes, item).map(|items| (items, false)),
    }
}

/// A confirm's batch: each key paired with its page as it is decoded (`page(i)` is page `i`,
/// if there is one), refused unless there is exactly one page per key. Both ways in decode a
/// confirm with this.
pub fn confirmations(
    bytes: &[u8],
    pages: usize,
    page: impl Fn(usize) -> Option<u32>,
) -> Result<(Vec<(Key, u32)>, bool), String> {
    let (confirmations, raw) = unpack_batch(bytes, |i, key| (key, page(i).unwrap_or(u32::MAX)))?;
    if confirmations.len() != pages {
        return Err(alloc::format!(
            "{} keys but {pages} pages: confirmations need one page per key",
            confirmations.len()
        ));
    }
    Ok((confirmations, raw))
}

/// An SGLang pool as it crosses the boundary (its keys packed, their pages beside them), put
/// back together; refused unless the keys decode and there is one page per key. The host
/// reads an export with this, the guest an import.
pub fn sglang_pool(
    rank: u32,
    namespace: String,
    num_pages: u32,
    free_pages: Vec<u32>,
    packed_keys: &[u8],
    pages: Vec<u32>,
) -> Result<SglangPool, String> {
    let keys = unpack_keys(packed_keys)?;
    if keys.len() != pages.len() {
        return Err(alloc::format!("{} keys but {} pages", keys.len(), pages.len()));
    }
    let keys = keys.into_iter().zip(pages).collect();
    Ok(SglangPool { rank, namespace: namespace.into_boxed_str(), num_pages, free_pages, keys })
}

/// What a batch decodes into: a key, or a key with its page. Dropping one whose key is a
/// [`Key::Hex`] frees nothing (the key is 16 bytes in place, a page a `u32`).
pub trait KeyItem {}
impl KeyItem for Key {}
impl KeyItem for (Key, u32) {}

/// Frees a decoded batch. When every key came in the raw form (`raw` from [`unpack_batch`]),
/// the vector's buffer is freed without a drop of each item, which would find nothing to free
/// (a loop that cost ~19 instructions a key under Cranelift: ~1.2k a 32-key save).
pub fn discard<T: KeyItem>(mut items: Vec<T>, raw: bool) {
    if raw {
        // SAFETY: `raw` means every item's key is a `Key::Hex` (the core only reads the batch),
        // so no item owns heap memory: not running their drops leaks nothing. `set_len(0)`
        // exposes no uninitialised item (and were `raw` ever wrong, a text key would leak, no
        // more).
        unsafe { items.set_len(0) };
    }
}

/// The common batch, every key in the raw form (vLLM's and SGLang's 32-hex keys): its 18-byte
/// records are checked in one tight pass and copied in another, with no per-key length or
/// bounds checks; `None` for any other batch.
fn unpack_raw<T>(bytes: &[u8], item: &mut impl FnMut(usize, Key) -> T) -> Option<Vec<T>> {
    let (keys, []) = bytes.as_chunks::<18>() else { return None };
    if !keys.iter().all(|[lo, hi, ..]| u16::from_le_bytes([*lo, *hi]) == RAW_HEX) {
        return None;
    }
    Some(keys.iter().enumerate().map(|(i, [_, _, raw @ ..])| item(i, Key::Hex(*raw))).collect())
}

/// Any batch: raw and text keys mixed, or malformed (refused with the culprit's index).
fn unpack_any<T>(mut bytes: &[u8], mut item: impl FnMut(usize, Key) -> T) -> Result<Vec<T>, String> {
    let bad = |i: usize, why: &str| alloc::format!("keys[{i}]: {why}");
    // Sized for raw hex keys (18 bytes each, the common form); text keys grow it as needed.
    let mut items = Vec::with_capacity(bytes.len() / 18 + 1);
    while !bytes.is_empty() {
        let i = items.len();
        let [lo, hi, rest @ ..] = bytes else { return Err(bad(i, "the length prefix is cut off")) };
        let prefix = u16::from_le_bytes([*lo, *hi]);
        if prefix & 0x8000 != 0 {
            if prefix != RAW_HEX {
                return Err(bad(i, &alloc::format!("prefix {prefix:#06x}: the only raw form is 0x8010")));
            }
            let Some((raw, tail)) = rest.split_first_chunk::<16>() else {
                return Err(bad(i, &alloc::format!("16 raw bytes announced, {} left", rest.len())));
            };
            items.push(item(i, Key::Hex(*raw)));
            bytes = tail;
            continue;
        }
        let len = usize::from(prefix);
        if rest.len() < len {
            return Err(bad(i, &alloc::format!("{len} bytes announced, {} left", rest.len())));
        }
        let text = core::str::from_utf8(&rest[..len]).map_err(|_| bad(i, "the key is not UTF-8"))?;
        items.push(item(i, parse_key(text, i)?));
        bytes = &rest[len..];
    }
    Ok(items)
}

/// One key of a batch's position `index`, checked as the core's parser checks it.
pub fn parse_key(text: &str, index: usize) -> Result<Key, String> {
    Key::parse(text).map_err(|e| alloc::format!("keys[{index}]: {e}"))
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use super::*;

    fn packed(keys: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for k in keys {
            pack_key(&mut out, k);
        }
        out
    }

    #[test]
    fn packed_keys_are_raw_hex_or_their_text_with_a_length() {
        let keys: Vec<Key> = ["386b2d9cf5aa91ba3a4b42c35396c822", "k", "386B2D9CF5AA91BA3A4B42C35396C822"]
            .map(|k| Key::parse(k).unwrap())
            .into();
        let mut bytes = Vec::new();
        pack_keys(&mut bytes, keys.iter());
        assert_eq!(&bytes[..2], &[0x10, 0x80]);
        assert_eq!(
            &bytes[2..18],
            &[0x38, 0x6b, 0x2d, 0x9c, 0xf5, 0xaa, 0x91, 0xba, 0x3a, 0x4b, 0x42, 0xc3, 0x53, 0x96, 0xc8, 0x22]
        );
        assert_eq!(&bytes[18..21], &[1, 0, b'k']);
        // Upper-case hex is not the canonical form: a text key.
        assert_eq!(&bytes[21..23], &[32, 0]);
        assert_eq!(&bytes[23..], b"386B2D9CF5AA91BA3A4B42C35396C822");
        assert_eq!(unpack_keys(&bytes).unwrap(), keys);
        // The text form of a hex key is the same key.
        assert_eq!(unpack_keys(&packed(&["386b2d9cf5aa91ba3a4b42c35396c822"])).unwrap(), keys[..1]);
        assert!(unpack_keys(&[0x10, 0x80, 1, 2]).is_err());
        // A command's batch is its keys, or its confirmations' keys.
        let mut of = vec![9];
        pack_keys_of(&mut of, &Command::Exists { space: kvpages_core::Space::Vllm, keys: keys.clone() });
        assert_eq!(of, bytes);
        let confirmations = keys.iter().cloned().map(|k| (k, 0)).collect();
        let confirm = Command::Confirm { space: kvpages_core::Space::Vllm, rank: 0, confirmations, releases: vec![] };
        pack_keys_of(&mut of, &confirm);
        assert_eq!(of, bytes);
        pack_keys_of(&mut of, &Command::Stats);
        assert!(of.is_empty());
    }

    #[test]
    fn a_batch_decodes_alike_by_the_raw_fast_path_and_the_general_one() {
        let hex = [
            "386b2d9cf5aa91ba3a4b42c35396c822",
            "00000000000000000000000000000000",
            "ffffffffffffffffffffffffffffffff",
        ];
        let keys: Vec<Key> = hex.iter().map(|k| Key::parse(k).unwrap()).collect();
        let mut raw = Vec::new();
        for k in &keys {
            pack_core_key(&mut raw, k);
        }
        // All raw: the fast path, the same keys as the text form gives.
        assert_eq!(unpack_batch(&raw, |_, k| k).unwrap(), (keys.clone(), true));
        assert_eq!(unpack_batch(&packed(&hex), |_, k| k).unwrap(), (keys.clone(), false));
        assert_eq!(unpack_keys(&[]).unwrap(), Vec::<Key>::new());
        // A 16-byte text key is an 18-byte record too, but not a raw one: the general path.
        let mut mixed = raw.clone();
        pack_key(&mut mixed, "sixteen-byte-key");
        assert_eq!(mixed.len(), 4 * 18);
        let got = unpack_keys(&mixed).unwrap();
        assert_eq!(got[..3], keys[..]);
        assert_eq!(got[3], Key::Text("sixteen-byte-key".into()));
        // Malformed after good raw keys: refused, naming the culprit.
        let mut cut = raw.clone();
        cut.extend_from_slice(&[0x10, 0x80, 1]);
        assert_eq!(unpack_keys(&cut).unwrap_err(), "keys[3]: 16 raw bytes announced, 1 left");
        let mut odd = raw;
        odd.extend_from_slice(&[0x11, 0x80]);
        odd.extend_from_slice(&[7; 16]);
        assert_eq!(unpack_keys(&odd).unwrap_err(), "keys[3]: prefix 0x8011: the only raw form is 0x8010");
        // A confirm's batch: a page a key.
        let pages = [4, 5];
        let (pairs, raw) = confirmations(&packed(&["a", "b"]), 2, |i| pages.get(i).copied()).unwrap();
        assert_eq!((pairs, raw), (vec![(Key::parse("a").unwrap(), 4), (Key::parse("b").unwrap(), 5)], false));
        let why = confirmations(&packed(&["a"]), 0, |_| None).unwrap_err();
        assert_eq!(why, "1 keys but 0 pages: confirmations need one page per key");
    }
}

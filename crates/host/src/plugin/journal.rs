//! The plugin engine's recovery journal: the state-changing commands applied since the last
//! snapshot, back to back in one byte buffer.
//!
//! One buffer rather than a `Vec` of cloned commands: each clone's keys were a heap block kept
//! alive until the next snapshot among the requests' short-lived allocations, and glibc's
//! allocator then spent ~7 % of the server thread merging fragmented free chunks
//! (`unlink_chunk`, `malloc_consolidate`; `perf` of the plugin's save/load cycle).
//!
//! An entry is a tag byte, then:
//! - [`FAST_ALLOCATE`], [`FAST_CONFIRM`], [`FAST_LOCATIONS`]: the clients' hot commands on the
//!   vLLM space with 32-hex keys only, as fixed-width little-endian fields (`now` u64, `rank`
//!   u32, a u32 count, then the keys exactly as the plugin call took them (`packed-keys`:
//!   `0x8010` and 16 bytes a key, copied in one piece from the call's buffer), and for a
//!   confirm the pages as u32s, then the releases as a u32 count and u32s).
//! - [`GENERAL`]: any other command, `(now, command)` in postcard (the durable log's encoding;
//!   a key serializes as its text there, which costs ~300 instructions a 32-hex key — too slow
//!   for the hot path: it added ~21k instructions to a 32-key save).
//!
//! The buffer lives in the host process and is read back only by [`Journal::entries`] during a
//! recovery; its capacity is kept across snapshots.

use kvpages_core::{Command, Key, Millis, Space};

const GENERAL: u8 = 0;
const FAST_ALLOCATE: u8 = 1;
const FAST_CONFIRM: u8 = 2;
const FAST_LOCATIONS: u8 = 3;

/// Applied state-changing commands, in order.
#[derive(Debug, Default)]
pub(super) struct Journal {
    buf: Vec<u8>,
}

/// Whether every key is a 32-hex one (kept as its 16 bytes).
fn all_hex<'a>(mut keys: impl Iterator<Item = &'a Key>) -> bool {
    keys.all(|k| matches!(k, Key::Hex(_)))
}

impl Journal {
    /// Commands recorded.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries().count()
    }

    /// Drops every entry, keeping the buffer's capacity.
    pub(super) fn clear(&mut self) {
        self.buf.clear();
    }

    /// Records `cmd`, applied at `now`; `packed` is its keys as the plugin call took them
    /// (`packed-keys`, see `kvpages_abi::keys`; any bytes for a command without keys).
    pub(super) fn push(&mut self, now: Millis, cmd: &Command, packed: &[u8]) {
        let b = &mut self.buf;
        // All 32-hex keys: `packed` is 18 bytes each, the fast forms' key records. Each part
        // goes in whole (a header array, the keys, the pages as one block): field by field and
        // page by page, the capacity checks cost ~200 instructions more a save
        // (`examples/instructions.rs`).
        match cmd {
            Command::Allocate { space: Space::Vllm, rank, keys }
            | Command::Locations { space: Space::Vllm, rank, keys }
                if all_hex(keys.iter()) =>
            {
                debug_assert_eq!(packed.len(), keys.len() * 18);
                let tag = if matches!(cmd, Command::Allocate { .. }) { FAST_ALLOCATE } else { FAST_LOCATIONS };
                b.reserve(HEAD + packed.len());
                b.extend_from_slice(&head(tag, now, *rank, keys.len()));
                b.extend_from_slice(packed);
            }
            Command::Confirm { space: Space::Vllm, rank, confirmations, releases }
                if all_hex(confirmations.iter().map(|(k, _)| k)) =>
            {
                debug_assert_eq!(packed.len(), confirmations.len() * 18);
                b.reserve(HEAD + packed.len() + confirmations.len() * 4 + 4 + releases.len() * 4);
                b.extend_from_slice(&head(FAST_CONFIRM, now, *rank, confirmations.len()));
                b.extend_from_slice(packed);
                words(b, confirmations.iter().map(|&(_, page)| page));
                b.extend_from_slice(&(releases.len() as u32).to_le_bytes());
                words(b, releases.iter().copied());
            }
            _ => {
                b.push(GENERAL);
                self.buf = postcard::to_extend(&(now, cmd), std::mem::take(&mut self.buf)).expect("commands encode");
            }
        }
    }

    /// The recorded commands, in order; an `Err` (a bug: the buffer is only written by
    /// [`Journal::push`]) names the entry that does not decode, and ends the sequence.
    pub(super) fn entries(&self) -> impl Iterator<Item = Result<(Millis, Command), String>> + '_ {
        let mut rest = &self.buf[..];
        (0..).map_while(move |i| {
            if rest.is_empty() {
                return None;
            }
            let entry = decode(&mut rest).map_err(|e| format!("journal entry {i} does not decode: {e}"));
            if entry.is_err() {
                rest = &[]; // nothing after a damaged entry can be found
            }
            Some(entry)
        })
    }
}

/// A fast entry's header: tag, `now`, rank and count.
const HEAD: usize = 17;

fn head(tag: u8, now: Millis, rank: u32, n: usize) -> [u8; HEAD] {
    let mut h = [0; HEAD];
    h[0] = tag;
    h[1..9].copy_from_slice(&now.to_le_bytes());
    h[9..13].copy_from_slice(&rank.to_le_bytes());
    h[13..].copy_from_slice(&(n as u32).to_le_bytes());
    h
}

/// Appends `words` as little-endian u32s.
fn words(b: &mut Vec<u8>, words: impl ExactSizeIterator<Item = u32>) {
    let start = b.len();
    b.resize(start + words.len() * 4, 0);
    for (slot, w) in b[start..].as_chunks_mut::<4>().0.iter_mut().zip(words) {
        *slot = w.to_le_bytes();
    }
}

/// Takes `n` bytes off the front of `rest`.
fn take<'a>(rest: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if rest.len() < n {
        return Err(format!("{n} bytes announced, {} left", rest.len()));
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Ok(head)
}

fn u32_le(rest: &mut &[u8]) -> Result<u32, String> {
    Ok(u32::from_le_bytes(take(rest, 4)?.try_into().expect("4 bytes")))
}

/// The `n` keys of a fast entry, `0x8010` and 16 bytes each (`packed-keys` in the raw form),
/// read by the boundary's one decoder of packed keys.
fn keys(rest: &mut &[u8], n: usize) -> Result<Vec<Key>, String> {
    match kvpages_abi::keys::unpack_batch(take(rest, n.saturating_mul(18))?, |_, key| key) {
        Ok((keys, true)) => Ok(keys),
        Ok(_) => Err("a fast entry's keys are not all in the raw form".into()),
        Err(why) => Err(format!("a fast entry's keys: {why}")),
    }
}

/// One entry off the front of `rest`.
fn decode(rest: &mut &[u8]) -> Result<(Millis, Command), String> {
    let tag = take(rest, 1)?[0];
    if tag == GENERAL {
        let (entry, tail) = postcard::take_from_bytes::<(Millis, Command)>(rest).map_err(|e| e.to_string())?;
        *rest = tail;
        return Ok(entry);
    }
    let now = Millis::from_le_bytes(take(rest, 8)?.try_into().expect("8 bytes"));
    let rank = u32_le(rest)?;
    let n = u32_le(rest)? as usize;
    let cmd = match tag {
        FAST_ALLOCATE | FAST_LOCATIONS => {
            let keys = keys(rest, n)?;
            if tag == FAST_ALLOCATE {
                Command::Allocate { space: Space::Vllm, rank, keys }
            } else {
                Command::Locations { space: Space::Vllm, rank, keys }
            }
        }
        FAST_CONFIRM => {
            let keys = keys(rest, n)?;
            let confirmations = keys.into_iter().map(|k| Ok((k, u32_le(rest)?))).collect::<Result<Vec<_>, String>>()?;
            let m = u32_le(rest)? as usize;
            let releases = (0..m).map(|_| u32_le(rest)).collect::<Result<Vec<_>, _>>()?;
            Command::Confirm { space: Space::Vllm, rank, confirmations, releases }
        }
        other => return Err(format!("unknown tag {other}")),
    };
    Ok((now, cmd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpages_abi::keys::pack_keys_of;

    /// Records `cmd` the way the engine does: with its keys as the call took them.
    fn push(j: &mut Journal, now: Millis, cmd: &Command) {
        let mut keys = Vec::new();
        pack_keys_of(&mut keys, cmd);
        j.push(now, cmd, &keys);
    }

    fn hex(i: u64) -> Key {
        Key::parse(&format!("{i:032x}")).unwrap()
    }

    fn text(s: &str) -> Key {
        Key::parse(s).unwrap()
    }

    /// Every form of entry reads back as the command that was recorded, in order, and
    /// `clear` empties the journal.
    #[test]
    fn entries_read_back_exactly() {
        let sglang = Space::Sglang { rank: 3, namespace: "kv".into() };
        let cmds = vec![
            (1, Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 1024 }),
            (2, Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex(1), hex(2), hex(1)] }),
            (
                3,
                Command::Confirm {
                    space: Space::Vllm,
                    rank: 7,
                    confirmations: vec![(hex(1), 5), (hex(2), 9)],
                    releases: vec![4, 8],
                },
            ),
            (4, Command::Locations { space: Space::Vllm, rank: 0, keys: vec![hex(2)] }),
            // A text key anywhere in a batch takes the general form.
            (5, Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex(3), text("chunk-a")] }),
            (
                6,
                Command::Confirm {
                    space: Space::Vllm,
                    rank: 0,
                    confirmations: vec![(text("chunk-a"), 1)],
                    releases: vec![],
                },
            ),
            (7, Command::Locations { space: Space::Vllm, rank: 1, keys: vec![text("chunk-a")] }),
            // Another space takes the general form too.
            (8, Command::Allocate { space: sglang.clone(), rank: 3, keys: vec![hex(4)] }),
            (9, Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![] }),
            (10, Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![], releases: vec![1, 2, 3] }),
            (u64::MAX, Command::Clear { space: Space::Vllm }),
        ];
        let mut j = Journal::default();
        for (now, cmd) in &cmds {
            push(&mut j, *now, cmd);
        }
        assert_eq!(j.len(), cmds.len());
        let back: Vec<(Millis, Command)> = j.entries().collect::<Result<_, _>>().unwrap();
        assert_eq!(back, cmds);
        // The fast forms are what the clients' commands take: the call's 18 bytes a key.
        let mut fast = Journal::default();
        push(&mut fast, 1, &Command::Allocate { space: Space::Vllm, rank: 0, keys: (0..32).map(hex).collect() });
        assert_eq!(fast.buf.len(), 1 + 8 + 4 + 4 + 32 * 18);
        j.clear();
        assert_eq!((j.len(), j.entries().count()), (0, 0));
    }

    /// A damaged buffer (which only a bug could make) is reported, not misread.
    #[test]
    fn a_truncated_entry_is_an_error() {
        let mut j = Journal::default();
        push(&mut j, 1, &Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex(1), hex(2)] });
        push(&mut j, 2, &Command::Clear { space: Space::Vllm });
        j.buf.truncate(1 + 8 + 4 + 4 + 20);
        let got: Vec<_> = j.entries().collect();
        assert_eq!(got.len(), 1);
        assert!(got[0].as_ref().unwrap_err().contains("journal entry 0 does not decode"), "{got:?}");
        // A fast key without the raw prefix.
        let mut j = Journal::default();
        push(&mut j, 1, &Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex(1)] });
        j.buf[17] = 0;
        let got: Vec<_> = j.entries().collect();
        assert!(got[0].as_ref().unwrap_err().contains("the only raw form is 0x8010"), "{got:?}");
    }
}

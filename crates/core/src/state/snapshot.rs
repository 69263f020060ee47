//! Snapshots: the whole state as bytes, and back — for plugin trap recovery, durability and
//! the browser's scenarios.
//!
//! The format is an explicit image of the state (not the in-memory layout): a magic number, a
//! format version, then the image's fields in order. The key table's hash index is not stored;
//! it is rebuilt on restore. Encoding is deterministic, so equal states give equal bytes on
//! every target, which is what the native-vs-plugin differential test compares.
//!
//! Version 2 writes the two parts that grow with the state — the key table's slots and each
//! pool's page states — as fixed-width little-endian records (a 32-hex key as its 16 bytes),
//! and every other field in postcard, as version 1 wrote the whole image: about 2-3× faster to
//! write through the plugin for 5 % more bytes (criterion's `take-snapshot` in `benches/core.rs`).
//! Version 1 (a 32-hex key as its text, every number a varint) is still read.

use alloc::collections::{BTreeMap, VecDeque};
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use serde::{Deserialize, Serialize};

use super::{Core, Deadlines, Leases, PageDeadline, SpaceState};
use crate::command::{Counters, Settings, Space};
use crate::key::Key;
use crate::keys::{Entry, KeyTable, RankPages};
use crate::pool::{PageCounts, PageState, Pool, PoolOrder};

/// First bytes of every snapshot.
const MAGIC: [u8; 8] = *b"kvpages\0";
/// The format version written; bumped whenever the image below changes shape.
pub const SNAPSHOT_VERSION: u32 = 2;
/// The first format: the whole [`Image`] in postcard. Still read.
const V1: u32 = 1;

/// Why bytes are not a snapshot this build can restore.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SnapshotError {
    /// The bytes do not start with the snapshot magic.
    NotASnapshot,
    /// Written by a format version this build does not read.
    UnknownVersion(u32),
    /// The bytes do not decode.
    Malformed(String),
    /// They decode, but the state breaks an invariant.
    Inconsistent(String),
}

impl fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapshotError::NotASnapshot => f.write_str("not a kvpages snapshot"),
            SnapshotError::UnknownVersion(v) => {
                write!(
                    f,
                    "snapshot format version {v} is unknown (this build reads versions {V1} to {SNAPSHOT_VERSION})"
                )
            }
            SnapshotError::Malformed(e) => write!(f, "snapshot does not decode: {e}"),
            SnapshotError::Inconsistent(e) => write!(f, "snapshot state is inconsistent: {e}"),
        }
    }
}

#[cfg(feature = "std")]
extern crate std;

#[cfg(feature = "std")]
impl std::error::Error for SnapshotError {}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct Image {
    seed: u64,
    settings: Settings,
    spaces: Vec<(Space, SpaceImage)>,
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct SpaceImage {
    order: PoolOrder,
    ranks: Vec<(u32, PoolImage)>,
    slots: Vec<Option<EntryImage>>,
    vacant: Vec<u32>,
    newest: u32,
    oldest: u32,
    reservations: Vec<DeadlineImage>,
    expired: Vec<DeadlineImage>,
    held: Vec<DeadlineImage>,
    leases: Vec<(u64, u32)>,
    next_generation: u64,
    counters: Counters,
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct PoolImage {
    num_pages: u32,
    table: Vec<u64>,
    returned: Vec<u32>,
    counts: PageCounts,
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct EntryImage {
    key: Key,
    pages: Vec<(u32, u32)>,
    reservations: u32,
    older: u32,
    newer: u32,
    since_s: u32,
    lease_until: u64,
}

#[derive(Serialize, Deserialize)]
struct DeadlineImage {
    at: u64,
    rank: u32,
    page: u32,
    generation: u64,
}

fn deadlines_in(v: Vec<DeadlineImage>) -> Deadlines {
    Deadlines(
        v.into_iter()
            .map(|d| PageDeadline { at: d.at, rank: d.rank, page: d.page, generation: d.generation })
            .collect(),
    )
}

/// A sequence written from an iterator of exactly `len` items (cloned to be walked, as
/// `serialize` takes `&self`): the bytes of the `Vec` the image holds there, without the `Vec`.
struct Seq<I> {
    len: usize,
    items: I,
}

impl<I> Seq<I> {
    fn new(len: usize, items: I) -> Seq<I> {
        Seq { len, items }
    }
}

impl<I> Serialize for Seq<I>
where
    I: Iterator + Clone,
    I::Item: Serialize,
{
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.len))?;
        let mut n = 0;
        for item in self.items.clone() {
            seq.serialize_element(&item)?;
            n += 1;
        }
        debug_assert_eq!(n, self.len, "a sequence's length is written before its items");
        seq.end()
    }
}

/// A deadline queue as the image's `Vec<DeadlineImage>`.
fn deadlines_seq(q: &Deadlines) -> Seq<impl Iterator<Item = DeadlineImage> + Clone + '_> {
    let image = |d: &PageDeadline| DeadlineImage { at: d.at, rank: d.rank, page: d.page, generation: d.generation };
    Seq::new(q.0.len(), q.0.iter().map(image))
}

/// Slot tags of version 2: a vacant slot, an entry with a 32-hex key (its 16 bytes follow), an
/// entry with any other key (a u16 length and its UTF-8 bytes follow).
const VACANT: u8 = 0;
const HEX: u8 = 1;
const TEXT: u8 = 2;

/// Appends `value` in postcard (the same bytes as that field of a version-1 image).
fn put<T: Serialize + ?Sized>(out: Vec<u8>, value: &T) -> Vec<u8> {
    postcard::to_extend(value, out).expect("writing to a Vec cannot fail")
}

/// Appends one space: its fields in [`SpaceImage`]'s order, `ranks`' page tables and `slots`
/// as fixed-width records (the layout [`read_space`] reads).
fn write_space(mut out: Vec<u8>, sp: &SpaceState) -> Vec<u8> {
    out = put(out, &(sp.order, sp.ranks.len()));
    for (&rank, p) in &sp.ranks {
        out = put(out, &(rank, p.num_pages, p.table.len()));
        // Reserve first, so the loop's pushes never reallocate: LLVM turns it into plain stores.
        out.reserve(p.table.len() * 8);
        for state in &p.table {
            out.extend_from_slice(&state.0.to_le_bytes());
        }
        out = put(out, &(&p.returned, &p.counts));
    }
    let slots = &sp.keys.slots;
    out = put(out, &slots.len());
    for (slot, e) in slots.iter().enumerate() {
        let Some(e) = e else {
            out.push(VACANT);
            continue;
        };
        match &e.key {
            Key::Hex(bytes) => {
                let mut head = [HEX; 17];
                head[1..].copy_from_slice(bytes);
                out.extend_from_slice(&head);
            }
            Key::Text(text) => {
                let len = u16::try_from(text.len()).expect("keys are at most MAX_KEY_LEN bytes");
                out.push(TEXT);
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(text.as_bytes());
            }
        }
        let mut fixed = [0u8; 28];
        fixed[0..4].copy_from_slice(&(e.pages.len() as u32).to_le_bytes());
        fixed[4..8].copy_from_slice(&e.reservations.to_le_bytes());
        fixed[8..12].copy_from_slice(&e.older.to_le_bytes());
        fixed[12..16].copy_from_slice(&e.newer.to_le_bytes());
        fixed[16..20].copy_from_slice(&e.since_s.to_le_bytes());
        fixed[20..28].copy_from_slice(&sp.leases.until(slot as u32).to_le_bytes());
        out.extend_from_slice(&fixed);
        for (rank, page) in e.pages.iter() {
            let mut pair = [0u8; 8];
            pair[..4].copy_from_slice(&rank.to_le_bytes());
            pair[4..].copy_from_slice(&page.to_le_bytes());
            out.extend_from_slice(&pair);
        }
    }
    // The live lease ends (one per running lease), sorted: stale ones change nothing.
    let mut leases: Vec<(u64, u32)> = sp.leases.live().collect();
    leases.sort_unstable();
    put(
        out,
        &(
            &sp.keys.vacant,
            sp.keys.newest,
            sp.keys.oldest,
            deadlines_seq(&sp.reservations),
            deadlines_seq(&sp.expired),
            deadlines_seq(&sp.held),
            &leases,
            sp.next_generation,
            &sp.counters,
        ),
    )
}

/// The bytes of a version-2 snapshot after its version, read front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// A postcard value.
    fn take<T: Deserialize<'a>>(&mut self) -> Result<T, String> {
        let (value, rest) = postcard::take_from_bytes(self.0).map_err(|e| alloc::format!("{e}"))?;
        self.0 = rest;
        Ok(value)
    }

    /// The next `n` bytes.
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], String> {
        let (head, rest) = self.0.split_at_checked(n).ok_or("the bytes end inside a record")?;
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.bytes(N)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    /// A count of records of at least `min` bytes each, refused if the rest cannot hold them
    /// (so a forged count cannot make the reader allocate for records that are not there).
    fn count(&mut self, min: usize) -> Result<usize, String> {
        let n: usize = self.take()?;
        self.fits(n, min)?;
        Ok(n)
    }

    /// Whether `n` records of at least `min` bytes each can be in the rest.
    fn fits(&self, n: usize, min: usize) -> Result<(), String> {
        if n.checked_mul(min).is_none_or(|bytes| bytes > self.0.len()) {
            return Err(alloc::format!("{n} records of {min}+ bytes do not fit in the {} bytes left", self.0.len()));
        }
        Ok(())
    }
}

/// One space as [`write_space`] wrote it.
fn read_space(r: &mut Reader<'_>) -> Result<SpaceImage, String> {
    let order: PoolOrder = r.take()?;
    let mut ranks = Vec::new();
    for _ in 0..r.count(1)? {
        let (rank, num_pages): (u32, u32) = r.take()?;
        let n = r.count(8)?;
        let table = r.bytes(n * 8)?.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8"))).collect();
        let (returned, counts) = r.take()?;
        ranks.push((rank, PoolImage { num_pages, table, returned, counts }));
    }
    let n = r.count(1)?;
    let mut slots = Vec::with_capacity(n);
    for slot in 0..n {
        let key = match r.array::<1>()?[0] {
            VACANT => {
                slots.push(None);
                continue;
            }
            HEX => Key::Hex(r.array()?),
            TEXT => {
                let len = u16::from_le_bytes(r.array()?);
                let text =
                    core::str::from_utf8(r.bytes(len.into())?).map_err(|e| alloc::format!("slot {slot}: {e}"))?;
                Key::parse(text).map_err(|e| alloc::format!("slot {slot}: {e:?}"))?
            }
            tag => return Err(alloc::format!("slot {slot}: unknown tag {tag}")),
        };
        let pages = r.u32()?;
        let (reservations, older, newer, since_s) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let lease_until = u64::from_le_bytes(r.array()?);
        r.fits(pages as usize, 8).map_err(|e| alloc::format!("slot {slot}: {e}"))?;
        let pages = (0..pages).map(|_| Ok((r.u32()?, r.u32()?))).collect::<Result<_, String>>()?;
        slots.push(Some(EntryImage { key, pages, reservations, older, newer, since_s, lease_until }));
    }
    let (vacant, newest, oldest, reservations, expired, held, leases, next_generation, counters) = r.take()?;
    Ok(SpaceImage {
        order,
        ranks,
        slots,
        vacant,
        newest,
        oldest,
        reservations,
        expired,
        held,
        leases,
        next_generation,
        counters,
    })
}

/// A version-2 snapshot's [`Image`] (`body`: the bytes after the version).
fn read_v2(body: &[u8]) -> Result<Image, String> {
    let mut r = Reader(body);
    let (seed, settings): (u64, Settings) = r.take()?;
    let mut spaces = Vec::new();
    for _ in 0..r.count(1)? {
        let space: Space = r.take()?;
        spaces.push((space, read_space(&mut r)?));
    }
    if !r.0.is_empty() {
        return Err(alloc::format!("{} bytes follow the image", r.0.len()));
    }
    Ok(Image { seed, settings, spaces })
}

impl Core {
    /// The whole state as bytes (format [`SNAPSHOT_VERSION`]); `Core::restore` gives back an
    /// identical core.
    ///
    /// Written straight from the state, with no intermediate image: an owned image cost an
    /// allocation per key (its pages) and a copy of the whole state before a byte was written.
    pub fn snapshot(&self) -> Vec<u8> {
        // Room for the image, so the buffer is not copied as it grows: a stored 32-hex key
        // takes 53 bytes (with one page), a vacant slot 1, a page's state 8 (61 MB at 10^6 keys
        // on a rank of 10^6 pages handed out). Live keys, not slots: after many deletes the
        // guest would otherwise grow its memory, which never shrinks, for bytes never written.
        let hint: usize = self
            .spaces
            .values()
            .map(|sp| {
                sp.keys.len() * 53 + sp.keys.slots.len() + sp.ranks.values().map(|p| p.table.len() * 8).sum::<usize>()
            })
            .sum();
        let mut out = Vec::with_capacity(MAGIC.len() + 4 + 64 + hint);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        out = put(out, &(self.seed, &self.settings, self.spaces.len()));
        for (space, sp) in &self.spaces {
            out = put(out, space);
            out = write_space(out, sp);
        }
        out
    }

    /// A core from [`Core::snapshot`]'s bytes (format version 1 or 2), checked against every
    /// invariant.
    pub fn restore(bytes: &[u8]) -> Result<Core, SnapshotError> {
        let rest = bytes.strip_prefix(&MAGIC[..]).ok_or(SnapshotError::NotASnapshot)?;
        let (version, body) = rest.split_at_checked(4).ok_or(SnapshotError::NotASnapshot)?;
        let image = match u32::from_le_bytes(version.try_into().expect("4 bytes")) {
            V1 => postcard::from_bytes(body).map_err(|e| alloc::format!("{e}")),
            SNAPSHOT_VERSION => read_v2(body),
            version => return Err(SnapshotError::UnknownVersion(version)),
        };
        let image: Image = image.map_err(SnapshotError::Malformed)?;
        let mut spaces = BTreeMap::new();
        for (space, sp) in image.spaces {
            let sp = space_in(sp, image.seed).map_err(SnapshotError::Inconsistent)?;
            if spaces.insert(space.clone(), sp).is_some() {
                return Err(SnapshotError::Inconsistent(alloc::format!("space {space:?} appears twice")));
            }
        }
        let core = Core { seed: image.seed, settings: image.settings, spaces, spare: Default::default() };
        core.check_invariants().map_err(SnapshotError::Inconsistent)?;
        Ok(core)
    }
}

fn space_in(img: SpaceImage, seed: u64) -> Result<SpaceState, String> {
    use alloc::format;
    let mut ranks = BTreeMap::new();
    for (rank, p) in img.ranks {
        if p.table.len() > p.num_pages as usize {
            return Err(format!("rank {rank}: {} page states for {} pages", p.table.len(), p.num_pages));
        }
        let pool = Pool {
            num_pages: p.num_pages,
            order: img.order,
            table: p.table.into_iter().map(PageState).collect(),
            returned: VecDeque::from(p.returned),
            counts: p.counts,
        };
        if ranks.insert(rank, pool).is_some() {
            return Err(format!("rank {rank} appears twice"));
        }
    }
    let mut keys = KeyTable::new(seed);
    let mut leases = Leases::default();
    for (slot, e) in img.slots.iter().enumerate() {
        if let Some(e) = e.as_ref().filter(|e| e.lease_until > 0) {
            leases.set_until(slot as u32, e.lease_until);
        }
    }
    let entry = |slot: usize, e: EntryImage| -> Result<Entry, String> {
        // Ranks strictly increasing, as every writer lists them: a repeated rank would make a
        // key look committed on more ranks than it is (and `insert` panics on it in debug
        // builds), and inserting out of order costs a shift each (quadratic in forged bytes).
        if e.pages.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(format!("slot {slot}: its pages' ranks are not strictly increasing"));
        }
        let mut pages = RankPages::None;
        for (rank, page) in e.pages {
            pages.insert(rank, page);
        }
        Ok(Entry {
            key: e.key,
            pages,
            reservations: e.reservations,
            older: e.older,
            newer: e.newer,
            cand_older: crate::keys::NIL,
            cand_newer: crate::keys::NIL,
            since_s: e.since_s,
        })
    };
    keys.slots = img
        .slots
        .into_iter()
        .enumerate()
        .map(|(slot, e)| e.map(|e| entry(slot, e)).transpose())
        .collect::<Result<_, _>>()?;
    keys.vacant = img.vacant;
    keys.newest = img.newest;
    keys.oldest = img.oldest;
    keys.rebuild_index(|slot| leases.until(slot) > 0)?;
    // Each running lease's live end: its latest queued end not past `lease_until` (images of
    // older writers queued one entry per extension, the live one at exactly `lease_until`).
    let mut live: BTreeMap<u32, u64> = BTreeMap::new();
    for (at, slot) in img.leases {
        let until = leases.until(slot);
        if until > 0 && at <= until {
            let best = live.entry(slot).or_insert(at);
            *best = (*best).max(at);
        }
    }
    for (slot, at) in live {
        leases.start(at, slot);
    }
    Ok(SpaceState {
        order: img.order,
        ranks,
        keys,
        reservations: deadlines_in(img.reservations),
        expired: deadlines_in(img.expired),
        held: deadlines_in(img.held),
        leases,
        next_generation: img.next_generation,
        counters: img.counters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Command, Eviction, Reply};

    fn key(i: u64) -> Key {
        if i.is_multiple_of(3) {
            Key::parse(&alloc::format!("{:032x}", i * 0x9E37_79B9)).unwrap()
        } else {
            Key::parse(&alloc::format!("key-{i}")).unwrap()
        }
    }

    /// `count` of each rank's pages, summed over `ranks`.
    fn page_total(ranks: &[crate::command::RankStats], count: fn(&PageCounts) -> u32) -> u32 {
        ranks.iter().map(|r| count(&r.pages)).sum()
    }

    /// A core with every kind of state: committed, partial, reserved, leased, quarantined keys.
    fn busy_core() -> (Core, u64) {
        let settings = Settings { read_lease: 50, quarantine: 30, reservation_ttl: 20, ..Settings::default() };
        let mut core = Core::new(42, settings);
        let mut now = 0;
        for rank in 0..2 {
            core.apply(now, &Command::Initialize { space: Space::Vllm, rank, num_pages: 12 }).unwrap();
        }
        let mut x: u64 = 7;
        for step in 0..400u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            now += x % 7;
            let rank = (x >> 8) as u32 % 2;
            let keys: Vec<Key> = (0..1 + x % 4).map(|i| key((x >> 16).wrapping_add(i) % 30)).collect();
            match step % 5 {
                0 | 1 => {
                    // Both ranks are initialized, so an allocation always answers (-1 included).
                    let got = core.apply(now, &Command::Allocate { space: Space::Vllm, rank, keys: keys.clone() });
                    let Ok(Reply::Allocated(a)) = got else { panic!("step {step}: allocate answered {got:?}") };
                    let confirmations = a
                        .iter()
                        .filter(|a| !a.cached && !x.is_multiple_of(3))
                        .filter_map(|a| Some((keys[a.index as usize].clone(), a.page?)))
                        .collect();
                    let _ = core.apply(
                        now,
                        &Command::Confirm { space: Space::Vllm, rank, confirmations, releases: Vec::new() },
                    );
                }
                2 => {
                    let _ = core.apply(now, &Command::Locations { space: Space::Vllm, rank, keys });
                }
                3 => {
                    let _ = core.apply(now, &Command::Delete { space: Space::Vllm, keys });
                }
                _ => {
                    let _ = core.apply(now, &Command::Exists { space: Space::Vllm, keys });
                }
            }
        }
        // The walk leaves committed, partial and quarantined pages, but it need not leave a key
        // complete on both ranks (only those take read leases), and its last reservations may all
        // have run out by `now`: end with a complete key under a lease, and a reservation still
        // pending on each rank. (The walk's keys are `key(0..30)`, so these three are fresh.)
        let (space, done) = (Space::Vllm, key(1001));
        for rank in 0..2 {
            let got =
                core.apply(now, &Command::Allocate { space: space.clone(), rank, keys: alloc::vec![done.clone()] });
            let Ok(Reply::Allocated(a)) = got else { panic!("rank {rank}: allocate answered {got:?}") };
            let page = a[0].page.expect("a page for a fresh key");
            let confirm = Command::Confirm {
                space: space.clone(),
                rank,
                confirmations: alloc::vec![(done.clone(), page)],
                releases: Vec::new(),
            };
            core.apply(now, &confirm).unwrap();
        }
        core.apply(now, &Command::Locations { space: space.clone(), rank: 0, keys: alloc::vec![done] }).unwrap();
        for (rank, k) in [(0, 999), (1, 1000)] {
            let got = core.apply(now, &Command::Allocate { space: space.clone(), rank, keys: alloc::vec![key(k)] });
            assert!(matches!(got, Ok(Reply::Allocated(_))), "rank {rank}: allocate answered {got:?}");
        }
        // The tests below are only as good as this state: check it has every kind the comment
        // promises, so a change to the walk (or to the rules it runs into) cannot quietly leave
        // a kind out of what the snapshot is tested on.
        let stats = core.stats();
        let ranks = &stats.spaces[0].ranks;
        let total = |count| page_total(ranks, count);
        assert!(total(|c| c.committed) > 0, "no committed page: {ranks:?}");
        assert!(total(|c| c.reserved) > 0, "no reserved page: {ranks:?}");
        assert!(total(|c| c.leased) > 0, "no leased page: {ranks:?}");
        assert!(total(|c| c.quarantined) > 0, "no quarantined page: {ranks:?}");
        // Partial: committed on one rank of the two only.
        let sp = &core.spaces[&space];
        assert!(sp.keys.entries().any(|(_, e)| e.pages.len() == 1), "no key is committed on one rank only");
        (core, now)
    }

    /// A core's image, built from the state independently of `snapshot`'s writer.
    fn image_of(core: &Core) -> Image {
        Image {
            seed: core.seed,
            settings: core.settings,
            spaces: core.spaces.iter().map(|(space, sp)| (space.clone(), space_out(sp))).collect(),
        }
    }

    /// `image` as a version-1 snapshot: the whole image in postcard.
    fn v1_bytes(image: &Image) -> Vec<u8> {
        let mut out = Vec::from(MAGIC);
        out.extend_from_slice(&V1.to_le_bytes());
        postcard::to_extend(image, out).unwrap()
    }

    fn space_out(sp: &SpaceState) -> SpaceImage {
        SpaceImage {
            order: sp.order,
            ranks: sp
                .ranks
                .iter()
                .map(|(&rank, p)| {
                    let image = PoolImage {
                        num_pages: p.num_pages,
                        table: p.table.iter().map(|s| s.0).collect(),
                        returned: p.returned.iter().copied().collect(),
                        counts: p.counts,
                    };
                    (rank, image)
                })
                .collect(),
            slots: sp
                .keys
                .slots
                .iter()
                .enumerate()
                .map(|(slot, e)| {
                    e.as_ref().map(|e| EntryImage {
                        key: e.key.clone(),
                        pages: e.pages.iter().collect(),
                        reservations: e.reservations,
                        older: e.older,
                        newer: e.newer,
                        since_s: e.since_s,
                        lease_until: sp.leases.until(slot as u32),
                    })
                })
                .collect(),
            vacant: sp.keys.vacant.clone(),
            newest: sp.keys.newest,
            oldest: sp.keys.oldest,
            reservations: deadlines_out(&sp.reservations),
            expired: deadlines_out(&sp.expired),
            held: deadlines_out(&sp.held),
            leases: {
                // The live entries (one per running lease), sorted: stale ones change nothing.
                let mut ends: Vec<(u64, u32)> = sp.leases.live().collect();
                ends.sort_unstable();
                ends
            },
            next_generation: sp.next_generation,
            counters: sp.counters,
        }
    }

    fn deadlines_out(q: &Deadlines) -> Vec<DeadlineImage> {
        q.0.iter().map(|d| DeadlineImage { at: d.at, rank: d.rank, page: d.page, generation: d.generation }).collect()
    }

    /// What `snapshot` wrote decodes to the image built from the state field by field, and
    /// the version-1 bytes of that image restore to a core that snapshots to the same bytes.
    fn check_both_versions(core: &Core) {
        let bytes = core.snapshot();
        assert_eq!(bytes[8..12], SNAPSHOT_VERSION.to_le_bytes());
        let image = image_of(core);
        let decoded = read_v2(&bytes[12..]).unwrap();
        assert_eq!(postcard::to_allocvec(&decoded).unwrap(), postcard::to_allocvec(&image).unwrap());
        assert_eq!(Core::restore(&v1_bytes(&image)).unwrap().snapshot(), bytes, "version 1 reads back the same");
    }

    #[test]
    fn the_snapshot_holds_the_image_and_version_1_still_restores() {
        let (core, _) = busy_core();
        check_both_versions(&core);
        // Empty, and two spaces with several ranks, leases and queued deadlines.
        let mut core = Core::new(9, Settings { read_lease: 40, ..Settings::default() });
        check_both_versions(&core);
        let sglang = Space::Sglang { rank: 1, namespace: "ns".into() };
        for (i, space) in [Space::Vllm, sglang].iter().enumerate() {
            for rank in 0..3 {
                core.apply(1, &Command::Initialize { space: space.clone(), rank, num_pages: 64 }).unwrap();
            }
            let keys: Vec<Key> = (0..40).map(|k| key(k + 100 * i as u64)).collect();
            // Every other key committed on every rank (complete: a lookup leases it), the rest
            // left reserved.
            for rank in 0..3 {
                let got = core.apply(2, &Command::Allocate { space: space.clone(), rank, keys: keys.clone() });
                let Ok(Reply::Allocated(a)) = got else { panic!("{space:?}: allocate answered {got:?}") };
                let confirmations =
                    a.iter().step_by(2).filter_map(|a| Some((keys[a.index as usize].clone(), a.page?))).collect();
                core.apply(3, &Command::Confirm { space: space.clone(), rank, confirmations, releases: Vec::new() })
                    .unwrap();
            }
            core.apply(4, &Command::Locations { space: space.clone(), rank: 1, keys }).unwrap();
        }
        for sp in &core.stats().spaces {
            let total = |count| page_total(&sp.ranks, count);
            assert_eq!((total(|c| c.leased), total(|c| c.reserved)), (60, 60), "{sp:?}");
        }
        check_both_versions(&core);
    }

    #[test]
    fn a_restored_core_is_the_same_core() {
        let (mut core, now) = busy_core();
        let bytes = core.snapshot();
        let mut back = Core::restore(&bytes).unwrap();
        assert_eq!(back.snapshot(), bytes, "snapshot → restore → snapshot is the identity");
        assert_eq!(back.stats(), core.stats());
        // Both go on identically, through expiry, leases and eviction.
        for step in 0..200u64 {
            let t = now + step * 3;
            let keys: Vec<Key> = (0..3).map(|i| key((step * 7 + i) % 40)).collect();
            let cmd = match step % 3 {
                0 => Command::Allocate { space: Space::Vllm, rank: (step % 2) as u32, keys },
                1 => Command::Locations { space: Space::Vllm, rank: 0, keys },
                _ => Command::Delete { space: Space::Vllm, keys },
            };
            assert_eq!(core.apply(t, &cmd), back.apply(t, &cmd), "step {step}");
        }
        assert_eq!(core.snapshot(), back.snapshot());
    }

    #[test]
    fn bad_bytes_are_refused_with_a_reason() {
        let (core, _) = busy_core();
        let bytes = core.snapshot();
        assert_eq!(Core::restore(b"nope").unwrap_err(), SnapshotError::NotASnapshot);
        let mut future = bytes.clone();
        future[8] = 99;
        assert_eq!(Core::restore(&future).unwrap_err(), SnapshotError::UnknownVersion(99));
        assert!(matches!(Core::restore(&bytes[..bytes.len() / 2]), Err(SnapshotError::Malformed(_))));
        // Settings survive, eviction policy included.
        let off = Core::new(1, Settings { eviction: Eviction::Off, ..Settings::default() });
        assert_eq!(Core::restore(&off.snapshot()).unwrap().settings().eviction, Eviction::Off);
    }

    #[test]
    fn a_snapshot_that_breaks_an_invariant_is_refused() {
        let mut core = Core::new(3, Settings::default());
        core.apply(0, &Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 4 }).unwrap();
        core.apply(0, &Command::Allocate { space: Space::Vllm, rank: 0, keys: alloc::vec![key(1)] }).unwrap();
        // Forge the page count in the image: free + reserved no longer adds up.
        let mut image = read_v2(&core.snapshot()[12..]).unwrap();
        image.spaces[0].1.ranks[0].1.counts.free += 1;
        assert!(matches!(Core::restore(&v1_bytes(&image)), Err(SnapshotError::Inconsistent(_))));
        // In version 2: one more reservation than the key's reserved pages.
        let mut forged = core.snapshot();
        let mut at = first_slot(&forged);
        while forged[at] == VACANT {
            at += 1;
        }
        assert_eq!(forged[at], TEXT, "key(1) is a text key");
        let reservations = at + 3 + usize::from(u16::from_le_bytes([forged[at + 1], forged[at + 2]])) + 4;
        assert_eq!(forged[reservations..reservations + 4], 1u32.to_le_bytes(), "the allocation reserved one page");
        forged[reservations] = 2;
        assert!(matches!(Core::restore(&forged), Err(SnapshotError::Inconsistent(_))));
    }

    /// Where the first space's slot records begin in a version-2 snapshot (after their count).
    fn first_slot(bytes: &[u8]) -> usize {
        let mut r = Reader(&bytes[12..]);
        let _: (u64, Settings) = r.take().unwrap();
        r.count(1).unwrap();
        let _: (Space, PoolOrder) = r.take().unwrap();
        for _ in 0..r.count(1).unwrap() {
            let _: (u32, u32) = r.take().unwrap();
            let n = r.count(8).unwrap();
            r.bytes(n * 8).unwrap();
            let _: (Vec<u32>, PageCounts) = r.take().unwrap();
        }
        r.count(1).unwrap();
        bytes.len() - r.0.len()
    }

    #[test]
    fn version_2_refuses_bytes_that_are_not_its_records() {
        let (core, _) = busy_core();
        let bytes = core.snapshot();
        let malformed = |b: &[u8]| matches!(Core::restore(b), Err(SnapshotError::Malformed(_)));
        // Cut anywhere: each cut ends inside a record or leaves the image incomplete.
        for cut in (12..bytes.len()).step_by(7) {
            assert!(malformed(&bytes[..cut]), "cut at {cut} of {}", bytes.len());
        }
        // Anything after the image.
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(malformed(&longer));
        // A slot count no bytes could hold is refused before anything is allocated for it.
        let slots = first_slot(&bytes);
        let count_at =
            slots - postcard::to_allocvec(&read_v2(&bytes[12..]).unwrap().spaces[0].1.slots.len()).unwrap().len();
        let mut huge = bytes[..count_at].to_vec();
        huge.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]); // u32::MAX slots
        huge.extend_from_slice(&bytes[slots..]);
        let err = Core::restore(&huge).unwrap_err();
        assert!(matches!(&err, SnapshotError::Malformed(m) if m.contains("do not fit")), "{err:?}");
    }

    #[test]
    fn a_key_whose_ranks_repeat_or_go_backwards_is_refused() {
        // Committed on ranks 0 and 1 of a 2-rank world, then its pairs forged: (0,1) repeated,
        // and (1,0) reversed. Either would restore a key that looks committed on ranks it is not.
        let mut core = Core::new(5, Settings::default());
        let k = key(3);
        for rank in 0..2 {
            core.apply(0, &Command::Initialize { space: Space::Vllm, rank, num_pages: 4 }).unwrap();
            let Ok(Reply::Allocated(a)) =
                core.apply(1, &Command::Allocate { space: Space::Vllm, rank, keys: alloc::vec![k.clone()] })
            else {
                panic!("allocate")
            };
            let confirmations = alloc::vec![(k.clone(), a[0].page.unwrap())];
            core.apply(2, &Command::Confirm { space: Space::Vllm, rank, confirmations, releases: Vec::new() }).unwrap();
        }
        let image = read_v2(&core.snapshot()[12..]).unwrap();
        let pages = &image.spaces[0].1.slots[0].as_ref().unwrap().pages;
        assert_eq!(pages.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
        for forged in [alloc::vec![pages[0], pages[0]], alloc::vec![pages[1], pages[0]]] {
            let mut image = read_v2(&core.snapshot()[12..]).unwrap();
            image.spaces[0].1.slots[0].as_mut().unwrap().pages = forged;
            let err = Core::restore(&v1_bytes(&image)).unwrap_err();
            assert!(matches!(&err, SnapshotError::Inconsistent(m) if m.contains("not strictly increasing")), "{err:?}");
        }
    }
}

//! Snapshots: the whole state as bytes, and back — for plugin trap recovery, durability and
//! the browser's scenarios.
//!
//! The format is an explicit image of the state (not the in-memory layout): a magic number, a
//! format version, then postcard. The key table's hash index is not stored; it is rebuilt on
//! restore. Encoding is deterministic, so equal states give equal bytes on every target, which
//! is what the native-vs-plugin differential test compares.

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
/// Bumped whenever the image below changes shape.
pub const SNAPSHOT_VERSION: u32 = 1;

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
                write!(f, "snapshot format version {v} is unknown (this build reads {SNAPSHOT_VERSION})")
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

/// [`Image`], borrowed from the core (same fields, same order: same bytes).
#[derive(Serialize)]
#[serde(bound(serialize = "Seq<F>: Serialize"))]
struct ImageOut<'a, F> {
    seed: u64,
    settings: &'a Settings,
    spaces: Seq<F>,
}

/// [`SpaceImage`] of a space's state.
struct SpaceOut<'a>(&'a SpaceState);

impl Serialize for SpaceOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let sp = self.0;
        // The live lease ends (one per running lease), sorted: stale ones change nothing.
        let mut leases: Vec<(u64, u32)> = sp.leases.live().collect();
        leases.sort_unstable();
        let slots = &sp.keys.slots;
        SpaceImageOut {
            order: sp.order,
            ranks: Seq::new(
                sp.ranks.len(),
                sp.ranks.iter().map(|(&rank, p)| {
                    let pool = PoolImageOut {
                        num_pages: p.num_pages,
                        table: Seq::new(p.table.len(), p.table.iter().map(|s| s.0)),
                        returned: &p.returned,
                        counts: &p.counts,
                    };
                    (rank, pool)
                }),
            ),
            slots: Seq::new(
                slots.len(),
                slots.iter().enumerate().map(|(slot, e)| {
                    e.as_ref().map(|e| EntryImageOut {
                        key: &e.key,
                        pages: Seq::new(e.pages.len(), e.pages.iter()),
                        reservations: e.reservations,
                        older: e.older,
                        newer: e.newer,
                        since_s: e.since_s,
                        lease_until: sp.leases.until(slot as u32),
                    })
                }),
            ),
            vacant: &sp.keys.vacant,
            newest: sp.keys.newest,
            oldest: sp.keys.oldest,
            reservations: deadlines_seq(&sp.reservations),
            expired: deadlines_seq(&sp.expired),
            held: deadlines_seq(&sp.held),
            leases: &leases,
            next_generation: sp.next_generation,
            counters: &sp.counters,
        }
        .serialize(s)
    }
}

/// [`SpaceImage`], borrowed.
#[derive(Serialize)]
#[serde(bound(serialize = "Seq<R>: Serialize, Seq<E>: Serialize, Seq<D>: Serialize"))]
struct SpaceImageOut<'a, R, E, D> {
    order: PoolOrder,
    ranks: Seq<R>,
    slots: Seq<E>,
    vacant: &'a Vec<u32>,
    newest: u32,
    oldest: u32,
    reservations: Seq<D>,
    expired: Seq<D>,
    held: Seq<D>,
    leases: &'a Vec<(u64, u32)>,
    next_generation: u64,
    counters: &'a Counters,
}

/// [`PoolImage`], borrowed.
#[derive(Serialize)]
#[serde(bound(serialize = "Seq<T>: Serialize"))]
struct PoolImageOut<'a, T> {
    num_pages: u32,
    table: Seq<T>,
    returned: &'a VecDeque<u32>,
    counts: &'a PageCounts,
}

/// [`EntryImage`], borrowed.
#[derive(Serialize)]
#[serde(bound(serialize = "Seq<P>: Serialize"))]
struct EntryImageOut<'a, P> {
    key: &'a Key,
    pages: Seq<P>,
    reservations: u32,
    older: u32,
    newer: u32,
    since_s: u32,
    lease_until: u64,
}

/// A deadline queue as the image's `Vec<DeadlineImage>`.
fn deadlines_seq(q: &Deadlines) -> Seq<impl Iterator<Item = DeadlineImage> + Clone + '_> {
    let image = |d: &PageDeadline| DeadlineImage { at: d.at, rank: d.rank, page: d.page, generation: d.generation };
    Seq::new(q.0.len(), q.0.iter().map(image))
}

impl Core {
    /// The whole state as bytes; `Core::restore` gives back an identical core.
    ///
    /// Written straight from the state: the bytes of an `Image` (what `restore` reads), but
    /// without building one. An owned image cost an allocation per key (its pages) and a copy
    /// of the whole state before a byte was written: at 10^6 keys ~60 % of a snapshot's time.
    pub fn snapshot(&self) -> Vec<u8> {
        let image = ImageOut {
            seed: self.seed,
            settings: &self.settings,
            spaces: Seq::new(self.spaces.len(), self.spaces.iter().map(|(space, sp)| (space, SpaceOut(sp)))),
        };
        // Room for a typical image, so the buffer is not copied as it grows: a stored 32-hex
        // key takes ~50 bytes, a vacant slot 1, a page's state up to 10 (58.0 MB at 10^6 keys
        // on a rank of 10^6 pages handed out). Live keys, not slots: after many deletes the
        // guest would otherwise grow its memory, which never shrinks, for bytes never written.
        let hint: usize = self
            .spaces
            .values()
            .map(|sp| {
                sp.keys.len() * 50 + sp.keys.slots.len() + sp.ranks.values().map(|p| p.table.len() * 10).sum::<usize>()
            })
            .sum();
        let mut out = Vec::with_capacity(MAGIC.len() + 4 + hint);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        postcard::to_extend(&image, out).expect("writing to a Vec cannot fail")
    }

    /// A core from [`Core::snapshot`]'s bytes, checked against every invariant.
    pub fn restore(bytes: &[u8]) -> Result<Core, SnapshotError> {
        let rest = bytes.strip_prefix(&MAGIC[..]).ok_or(SnapshotError::NotASnapshot)?;
        let (version, body) = rest.split_at_checked(4).ok_or(SnapshotError::NotASnapshot)?;
        let version = u32::from_le_bytes(version.try_into().expect("4 bytes"));
        if version != SNAPSHOT_VERSION {
            return Err(SnapshotError::UnknownVersion(version));
        }
        let image: Image = postcard::from_bytes(body).map_err(|e| SnapshotError::Malformed(alloc::format!("{e}")))?;
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
    keys.slots = img
        .slots
        .into_iter()
        .map(|e| {
            e.map(|e| {
                let mut pages = RankPages::None;
                for (rank, page) in e.pages {
                    pages.insert(rank, page);
                }
                Entry {
                    key: e.key,
                    pages,
                    reservations: e.reservations,
                    older: e.older,
                    newer: e.newer,
                    cand_older: crate::keys::NIL,
                    cand_newer: crate::keys::NIL,
                    since_s: e.since_s,
                }
            })
        })
        .collect();
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

    /// The owned image of a core, built as `snapshot` did before it wrote straight from the
    /// state: the oracle for "the borrowed encoder writes an `Image`'s bytes".
    fn owned_image(core: &Core) -> Vec<u8> {
        let image = Image {
            seed: core.seed,
            settings: core.settings,
            spaces: core.spaces.iter().map(|(space, sp)| (space.clone(), space_out(sp))).collect(),
        };
        let mut out = Vec::from(MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        postcard::to_extend(&image, out).unwrap()
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

    #[test]
    fn the_snapshot_is_the_bytes_of_the_owned_image() {
        let (core, _) = busy_core();
        assert_eq!(core.snapshot(), owned_image(&core));
        // Empty, and two spaces with several ranks, leases and queued deadlines.
        let mut core = Core::new(9, Settings { read_lease: 40, ..Settings::default() });
        assert_eq!(core.snapshot(), owned_image(&core));
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
        assert_eq!(core.snapshot(), owned_image(&core));
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
        let mut image: Image = postcard::from_bytes(&core.snapshot()[12..]).unwrap();
        image.spaces[0].1.ranks[0].1.counts.free += 1;
        let mut forged = Vec::from(MAGIC);
        forged.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        let forged = postcard::to_extend(&image, forged).unwrap();
        assert!(matches!(Core::restore(&forged), Err(SnapshotError::Inconsistent(_))));
    }
}

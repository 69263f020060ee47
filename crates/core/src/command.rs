//! The commands the core understands and the replies it gives.
//!
//! Commands are plain data: the host builds one from each wire request, the command log stores
//! them, and replaying the same `(now, Command)` sequence gives the same replies on every target.

use alloc::boxed::Box;
use alloc::vec::Vec;

use crate::key::Key;
use crate::pool::PageCounts;

/// Milliseconds on the host's clock. The core never reads a clock; every command comes with one.
pub type Millis = u64;

/// A set of pools and keys that shares nothing with any other space.
///
/// vLLM's routes use [`Space::Vllm`]: one key table whose keys span every TP rank, FIFO pools,
/// all-or-nothing allocation. Each SGLang `rank:namespace` pool is a [`Space::Sglang`] of its
/// own, so no SGLang namespace string can ever name the vLLM space.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Space {
    /// The vLLM HF3FS connector's pools and keys.
    Vllm,
    /// One SGLang HiCache `rank:namespace` pool and its keys: stack (LIFO) page order, a key
    /// lives on this one rank, each new key of a reserve takes a page while any is free.
    Sglang {
        /// The rank (SGLang's URL path `/{rank}/...`).
        rank: u32,
        /// The namespace (`"kv"` by default; `"mamba"`, `"swa"`, ... for hybrid models).
        namespace: Box<str>,
    },
}

/// What happens when an allocation does not fit in the free pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Eviction {
    /// Evict least-recently-used keys that hold no lease (on all ranks at once) until the batch
    /// fits and usage is back under the low watermark.
    Lru,
    /// Never evict: a full pool answers -1, exactly as vLLM's server does.
    Off,
}

/// Settings that change how later commands behave. They are a command themselves, so a
/// command log replays old records under the settings they were applied with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Settings {
    /// How long an allocated page stays reserved for its key without a confirm. Reservations
    /// expire in the order they were made, so after lowering it, reservations made under the
    /// old value still run their old course.
    pub reservation_ttl: Millis,
    /// `Some(n)`: a key is complete when ranks `0..n` have all confirmed it, and ranks `>= n`
    /// are refused. `None`: the TP world is the set of initialized ranks.
    pub world_size: Option<u32>,
    /// How long `get_locations` and allocate's cache hits protect the pages they return from
    /// eviction and reuse.
    pub read_lease: Millis,
    /// How long a page taken back from an expired reservation stays out of use, so a slow
    /// writer still writing into it cannot corrupt the next owner's data.
    pub quarantine: Millis,
    /// Eviction policy.
    pub eviction: Eviction,
    /// Evict when reserved + committed + quarantined pages would exceed this share of a rank's
    /// pool (per mille).
    pub evict_high_permille: u16,
    /// ... down to this share (per mille).
    pub evict_low_permille: u16,
}

/// A `$to::Settings` literal with every setting copied from `$from`, a `$from_mod::Settings`
/// (`copy_settings!(kv => wit, s)`: the plugin boundary's two `Settings` have the same
/// fields and the same `Eviction` variants, so a setting missing here does not compile).
#[macro_export]
macro_rules! copy_settings {
    ($from_mod:ident => $to:ident, $from:expr) => {{
        let s: $from_mod::Settings = $from;
        $to::Settings {
            reservation_ttl: s.reservation_ttl,
            world_size: s.world_size,
            read_lease: s.read_lease,
            quarantine: s.quarantine,
            eviction: match s.eviction {
                $from_mod::Eviction::Lru => $to::Eviction::Lru,
                $from_mod::Eviction::Off => $to::Eviction::Off,
            },
            evict_high_permille: s.evict_high_permille,
            evict_low_permille: s.evict_low_permille,
        }
    }};
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            reservation_ttl: 60_000,
            world_size: None,
            read_lease: 5_000,
            quarantine: 60_000,
            eviction: Eviction::Lru,
            evict_high_permille: 950,
            evict_low_permille: 900,
        }
    }
}

/// A typed request to the core.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Command {
    /// Replace the settings. Refused (`RankOutsideWorld`) if `world_size` would leave an
    /// initialized rank outside the world.
    Configure(Settings),
    /// Create a rank's pool (or re-create it with another size, dropping the keys on it).
    Initialize {
        /// Which space.
        space: Space,
        /// The rank.
        rank: u32,
        /// Pages in the rank's file; at least 1.
        num_pages: u32,
    },
    /// Reserve one page per distinct key on a rank (all or nothing); complete keys get
    /// their existing page back.
    Allocate {
        /// Which space.
        space: Space,
        /// The rank.
        rank: u32,
        /// Keys in request order; duplicates count once.
        keys: Vec<Key>,
    },
    /// Commit written pages and release failed ones.
    Confirm {
        /// Which space.
        space: Space,
        /// The rank.
        rank: u32,
        /// `(key, page)` pairs the writer finished.
        confirmations: Vec<(Key, u32)>,
        /// Pages the writer gives back unwritten.
        releases: Vec<u32>,
    },
    /// Which keys are complete (a pure read).
    Exists {
        /// Which space.
        space: Space,
        /// Keys to look up.
        keys: Vec<Key>,
    },
    /// The page of each complete key on one rank; each hit takes a read lease and becomes the
    /// most recently used key.
    Locations {
        /// Which space.
        space: Space,
        /// The rank.
        rank: u32,
        /// Keys to look up.
        keys: Vec<Key>,
    },
    /// Drop keys on every rank (their pages are quarantined while a reader holds a lease).
    Delete {
        /// Which space.
        space: Space,
        /// Keys to drop; unknown keys are ignored.
        keys: Vec<Key>,
    },
    /// Everything known about one key (a pure read).
    Inspect {
        /// Which space.
        space: Space,
        /// The key.
        key: Key,
    },
    /// Drop every key of a space and make all its pages free, keeping its ranks (SGLang's
    /// `/{rank}/clear`).
    Reset {
        /// Which space.
        space: Space,
    },
    /// Drop every rank and key of a space (vLLM's `/clear`).
    Clear {
        /// Which space.
        space: Space,
    },
    /// Counts of everything (a pure read).
    Stats,
    /// Load SGLang pools as SGLang's own server persists them, all or nothing. Refused while
    /// SGLang pools exist, unless `replace` (which drops them first). The vLLM space is untouched.
    ImportSglang {
        /// The pools.
        pools: Vec<SglangPool>,
        /// Drop the SGLang pools kvpages holds first.
        replace: bool,
    },
    /// Every SGLang pool in the format of [`Command::ImportSglang`] (a pure read).
    ExportSglang,
    /// After recovery: every committed key takes a full read lease, so a reader whose lease
    /// record never reached the disk stays protected. O(keys).
    LeaseAll,
}

impl Command {
    /// Whether applying this command can change the state (what a command log must record).
    pub fn is_mutating(&self) -> bool {
        !matches!(self, Command::Exists { .. } | Command::Inspect { .. } | Command::Stats | Command::ExportSglang)
    }

    /// Whether the command changes nothing a crash must keep: only read leases, recency,
    /// counters, and what time alone ends (reservations and quarantines past their deadline).
    /// A command log still records it, but its reply need not wait for its own record: if the
    /// record is lost, recovery's blanket read lease ([`Command::LeaseAll`]) protects every
    /// reader for longer, and any later change that depends on it is logged after it.
    pub fn changes_only_leases(&self) -> bool {
        matches!(self, Command::Locations { .. })
    }

    /// The command's name, for logs and messages (the WIT interface's function name).
    pub fn name(&self) -> &'static str {
        match self {
            Command::Configure(_) => "configure",
            Command::Initialize { .. } => "initialize",
            Command::Allocate { .. } => "allocate",
            Command::Confirm { .. } => "confirm",
            Command::Exists { .. } => "exists",
            Command::Locations { .. } => "locations",
            Command::Delete { .. } => "delete",
            Command::Inspect { .. } => "inspect",
            Command::Reset { .. } => "reset",
            Command::Clear { .. } => "clear",
            Command::Stats => "stats",
            Command::ImportSglang { .. } => "import-sglang",
            Command::ExportSglang => "export-sglang",
            Command::LeaseAll => "lease-all",
        }
    }

    /// The keys (and pages) the command carries: what the work of applying it grows with,
    /// beside the state it touches.
    pub fn keys_in(&self) -> usize {
        match self {
            Command::Allocate { keys, .. }
            | Command::Exists { keys, .. }
            | Command::Locations { keys, .. }
            | Command::Delete { keys, .. } => keys.len(),
            Command::Confirm { confirmations, releases, .. } => confirmations.len() + releases.len(),
            Command::ImportSglang { pools, .. } => pools.iter().map(|p| p.keys.len() + p.free_pages.len()).sum(),
            Command::Configure(_)
            | Command::Initialize { .. }
            | Command::Inspect { .. }
            | Command::Reset { .. }
            | Command::Clear { .. }
            | Command::Stats
            | Command::ExportSglang
            | Command::LeaseAll => 0,
        }
    }
}

/// What [`Command::Initialize`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum InitOutcome {
    /// A new pool. `joined_after_keys`: keys were already committed in this space, and
    /// they are incomplete until this rank stores them too.
    Created {
        /// Whether committed keys existed before this rank joined.
        joined_after_keys: bool,
    },
    /// The rank existed with this size; nothing changed.
    Unchanged,
    /// The rank existed with another size: its pool was re-created and every key that had a
    /// page on it was dropped on all ranks.
    Recreated {
        /// The size the rank had.
        old_num_pages: u32,
        /// Keys dropped.
        dropped_keys: u32,
    },
}

/// The answer for one distinct key of an [`Command::Allocate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Allocation {
    /// Position of the key's first occurrence in the request.
    pub index: u32,
    /// The page, or `None` (the wire's -1) when the pool could not cover the batch.
    pub page: Option<u32>,
    /// The key was complete already and `page` is its existing page.
    pub cached: bool,
}

/// Why a confirmation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Refusal {
    /// The page is free: never allocated, released, or its reservation expired.
    NotReserved,
    /// The page is reserved for another key.
    ReservedForAnotherKey,
    /// The page holds another key.
    CommittedToAnotherKey,
}

/// A refused `(key, page)` pair of a confirm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Refused {
    /// Position in the request's confirmations.
    pub index: u32,
    /// The page named.
    pub page: u32,
    /// Why.
    pub reason: Refusal,
}

/// Why a release was ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum IgnoredRelease {
    /// The page is already free.
    AlreadyFree,
    /// The page holds a key; releasing it would hand a live key's page to another.
    Committed,
}

/// What a [`Command::Confirm`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ConfirmReport {
    /// Pairs that committed a reserved page.
    pub committed: u32,
    /// Pairs whose page was already committed to that key (no-op).
    pub unchanged: u32,
    /// Pairs for a key another writer had committed on this rank first: the page was freed.
    pub superseded: u32,
    /// Pairs refused (the rest applied).
    pub refused: Vec<Refused>,
    /// Reserved pages released.
    pub released: u32,
    /// Releases ignored, with the page and why.
    pub ignored_releases: Vec<(u32, IgnoredRelease)>,
}

/// One rank's figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RankStats {
    /// The rank.
    pub rank: u32,
    /// Its pool size.
    pub num_pages: u32,
    /// Its pages by state.
    pub pages: PageCounts,
}

/// Event counters of a space since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Counters {
    /// Distinct keys given a fresh page.
    pub reserved: u64,
    /// Distinct keys answered with their existing page.
    pub cache_hits: u64,
    /// Distinct keys answered -1 (pool could not cover the batch).
    pub misses: u64,
    /// Confirmations that committed a page.
    pub committed: u64,
    /// Confirmations refused.
    pub refused_confirms: u64,
    /// Confirmations whose page was freed because another writer won.
    pub superseded: u64,
    /// Releases that freed a page.
    pub released: u64,
    /// Releases ignored.
    pub ignored_releases: u64,
    /// Reservations that reached their deadline unconfirmed.
    pub expired_reservations: u64,
    /// Keys dropped because a rank was re-initialized with another size.
    pub dropped_keys: u64,
    /// Keys evicted to make room.
    pub evictions: u64,
    /// Keys deleted.
    pub deleted: u64,
    /// Pages quarantined (expired reservations, deleted keys a reader still held).
    pub quarantined_pages: u64,
    /// `get_locations` keys answered with a page.
    pub location_hits: u64,
    /// `get_locations` keys answered null.
    pub location_misses: u64,
}

/// Calls the macro at path `$callback` with `$arg;` and the name of every [`Counters`] field, in
/// declaration order: code that must name every counter (the plugin boundary's conversions)
/// builds its struct literal from this list, so a counter missing here, or there, does not
/// compile.
#[macro_export]
macro_rules! for_each_counter {
    ($callback:path; $($arg:tt)*) => {{
        $callback! {
            $($arg)*; reserved, cache_hits, misses, committed, refused_confirms, superseded, released,
            ignored_releases, expired_reservations, dropped_keys, evictions, deleted, quarantined_pages,
            location_hits, location_misses
        }
    }};
}

/// With [`for_each_counter`]: a `$to` struct literal with every counter copied from `$from`
/// (`for_each_counter!(kvpages_core::copy_counters; wit::Counters, c)`, for a struct with the same
/// fields).
#[macro_export]
macro_rules! copy_counters {
    ($to:path, $from:expr; $($field:ident),*) => {{
        let from = $from;
        $to { $($field: from.$field),* }
    }};
}

/// A `$to::$stats_type` literal copied from `$stats` (a `$from_mod` stats tree),
/// every space's through `$space` (given a reference to the space): the plugin boundary's two
/// `Stats` trees have the same fields, so a figure missing here does not compile.
#[macro_export]
macro_rules! copy_stats {
    ($from_mod:ident => $to:ident :: $stats_type:ident, $stats:expr, $space:expr) => {{
        let s = &$stats;
        #[allow(clippy::clone_on_copy)]
        let settings = s.settings.clone();
        $to::$stats_type {
            settings: $crate::copy_settings!($from_mod => $to, settings),
            spaces: s
                .spaces
                .iter()
                .map(|sp| $to::SpaceStats {
                    space: ($space)(&sp.space),
                    keys: sp.keys,
                    pending_keys: sp.pending_keys,
                    world_size: sp.world_size,
                    ranks: sp
                        .ranks
                        .iter()
                        .map(|r| $to::RankStats {
                            rank: r.rank,
                            num_pages: r.num_pages,
                            pages: $to::PageCounts {
                                free: r.pages.free,
                                reserved: r.pages.reserved,
                                committed: r.pages.committed,
                                leased: r.pages.leased,
                                quarantined: r.pages.quarantined,
                            },
                        })
                        .collect(),
                    counters: $crate::for_each_counter!($crate::copy_counters; $to::Counters, &sp.counters),
                })
                .collect(),
        }
    }};
}

macro_rules! named_counters {
    ($c:expr; $($field:ident),*) => {
        [$((stringify!($field), $c.$field)),*]
    };
}

macro_rules! add_counters {
    ($to:expr, $from:expr; $($field:ident),*) => {
        $($to.$field += $from.$field;)*
    };
}

impl Counters {
    /// Every counter with its field name, in declaration order.
    pub fn named(&self) -> [(&'static str, u64); 15] {
        for_each_counter!(named_counters; self)
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Counters) {
        for_each_counter!(add_counters; self, other);
    }
}

/// A space's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SpaceStats {
    /// Which space.
    pub space: Space,
    /// Keys with a committed page on some rank.
    pub keys: u64,
    /// Keys that only have pending reservations.
    pub pending_keys: u64,
    /// Keys complete across the TP world.
    pub world_size: u32,
    /// Per rank, in rank order.
    pub ranks: Vec<RankStats>,
    /// Event counters.
    pub counters: Counters,
}

/// The whole core's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Stats {
    /// The settings in force.
    pub settings: Settings,
    /// Each space, in space order.
    pub spaces: Vec<SpaceStats>,
}

/// A successful answer to a [`Command`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Reply {
    /// Settings replaced.
    Configured,
    /// A rank was initialized.
    Initialized {
        /// The rank.
        rank: u32,
        /// The size asked for.
        num_pages: u32,
        /// What happened.
        outcome: InitOutcome,
    },
    /// One entry per distinct key, in order of first occurrence.
    Allocated(Vec<Allocation>),
    /// What the confirm did.
    Confirmed(ConfirmReport),
    /// One flag per key, in request order.
    Exists(Vec<bool>),
    /// One page or `None` per key, in request order.
    Locations(Vec<Option<u32>>),
    /// A space was dropped.
    Cleared {
        /// Ranks dropped.
        ranks: u32,
        /// Keys dropped.
        keys: u64,
    },
    /// Keys deleted (those that had a committed page).
    Deleted(u32),
    /// One key, or `None` if it is not stored.
    Key(Option<Box<KeyInfo>>),
    /// Figures.
    Stats(Box<Stats>),
    /// What an import loaded.
    Imported {
        /// Pools created.
        pools: u32,
        /// Keys loaded.
        keys: u64,
        /// Pages in neither list of the file (the peer's leaks), made free.
        leaked_pages: u64,
    },
    /// The SGLang pools.
    SglangPools(Vec<SglangPool>),
    /// Keys that took a read lease ([`Command::LeaseAll`]).
    Leased(u64),
}

/// One SGLang `rank:namespace` pool as SGLang's server persists it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SglangPool {
    /// The rank.
    pub rank: u32,
    /// The namespace.
    pub namespace: Box<str>,
    /// Pages in the pool.
    pub num_pages: u32,
    /// Free pages in stack order: the last is handed out first.
    pub free_pages: Vec<u32>,
    /// Keys and their pages, least recently used first.
    pub keys: Vec<(Key, u32)>,
}

/// Everything known about one key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct KeyInfo {
    /// The key.
    pub key: Key,
    /// `(rank, page)` of every committed page, in rank order.
    pub pages: Vec<(u32, u32)>,
    /// Committed on every rank of the TP world (what `exists` answers).
    pub complete: bool,
    /// Pages reserved for it and not yet confirmed.
    pub reservations: u32,
    /// Milliseconds left on its read lease (0: none).
    pub lease_remaining: Millis,
    /// Whether eviction may take it now.
    pub evictable: bool,
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use super::*;

    #[test]
    fn a_commands_keys_in_counts_its_keys_and_pages() {
        let key = |s: &str| Key::parse(s).unwrap();
        let pool = SglangPool {
            rank: 0,
            namespace: "kv".into(),
            num_pages: 8,
            free_pages: vec![5, 6, 7],
            keys: vec![(key("a"), 0), (key("b"), 1)],
        };
        for (cmd, name, keys) in [
            (Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![key("a"), key("a")] }, "allocate", 2),
            (
                Command::Confirm {
                    space: Space::Vllm,
                    rank: 0,
                    confirmations: vec![(key("a"), 0)],
                    releases: vec![1, 2],
                },
                "confirm",
                3,
            ),
            (Command::ImportSglang { pools: vec![pool.clone(), pool], replace: false }, "import-sglang", 10),
            (Command::Inspect { space: Space::Vllm, key: key("a") }, "inspect", 0),
            (Command::LeaseAll, "lease-all", 0),
        ] {
            assert_eq!((cmd.name(), cmd.keys_in()), (name, keys), "{cmd:?}");
        }
    }
}

//! The core's domain errors: a command that is refused changes nothing.

use alloc::vec::Vec;
use core::fmt;

use crate::command::Refused;

/// Where a page number appeared in a confirm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PagePlace {
    /// `confirmations[i]`.
    Confirmation(u32),
    /// `pages_to_release[i]`.
    Release(u32),
}

/// Why a command was refused. Nothing of a refused command is applied.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Error {
    /// The rank has no pool in this space.
    RankNotInitialized {
        /// The rank.
        rank: u32,
    },
    /// A pool needs at least one page.
    ZeroPages {
        /// The rank.
        rank: u32,
    },
    /// `world_size` is set and the rank is not below it.
    RankOutsideWorld {
        /// The rank.
        rank: u32,
        /// The configured TP world size.
        world_size: u32,
    },
    /// A page number at or beyond the rank's pool size (no server handed it out).
    PageOutOfRange {
        /// The rank.
        rank: u32,
        /// The page named.
        page: u32,
        /// The rank's pool size.
        num_pages: u32,
        /// Where it appeared.
        place: PagePlace,
    },
    /// An SGLang import into a state that already holds SGLang pools, without `replace`.
    SglangPoolsExist {
        /// How many.
        pools: u32,
    },
    /// An SGLang import was refused; nothing was loaded.
    ImportRefused {
        /// What is wrong, naming the pool and the field.
        reason: alloc::string::String,
    },
    /// Every confirmation of the request was refused; nothing was applied (releases neither).
    NothingConfirmed {
        /// Each pair and why.
        refused: Vec<Refused>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::RankNotInitialized { rank } => write!(f, "rank {rank} not initialized"),
            Error::ZeroPages { rank } => write!(f, "rank {rank}: num_pages must be at least 1"),
            Error::RankOutsideWorld { rank, world_size } => {
                write!(f, "rank {rank} is outside the TP world of {world_size} ranks")
            }
            Error::PageOutOfRange { rank, page, num_pages, place } => {
                let (name, i) = match place {
                    PagePlace::Confirmation(i) => ("confirmations", i),
                    PagePlace::Release(i) => ("pages_to_release", i),
                };
                write!(f, "{name}[{i}]: page {page} is out of range, rank {rank} has {num_pages} pages")
            }
            Error::ImportRefused { reason } => write!(f, "import refused: {reason}"),
            Error::SglangPoolsExist { pools } => {
                write!(f, "kvpages already holds {pools} SGLang pools (import with replace to drop them)")
            }
            Error::NothingConfirmed { refused } => {
                write!(f, "none of the {} confirmations matched a reservation", refused.len())
            }
        }
    }
}

#[cfg(feature = "std")]
extern crate std;

#[cfg(feature = "std")]
impl std::error::Error for Error {}

//! Durability: a write-ahead log of applied commands plus snapshots, in a data directory.

mod log;

pub use self::log::*;
pub use crate::progress::Progress;

//! Packed allocations (`packed-allocations` in `wit/kvpages.wit`): an allocate's answer as two
//! `u32` words a distinct key, by either way in.
//!
//! Word 0 is the key's index, with bit 31 set for a cache hit; word 1 is its page, or
//! `0xffffffff` for none.

use alloc::string::String;
use alloc::vec::Vec;

use kvpages_core::Allocation;

/// The flag of a cache hit, on word 0. An index is below the batch's length, under 2^31: a
/// packed key takes at least 3 bytes, and a wasm32 memory holds 4 GiB.
const CACHED: u32 = 1 << 31;
/// Word 1 when the key got no page (a page is below the pool's size).
const NO_PAGE: u32 = u32::MAX;

/// One allocation as its two words.
pub fn allocation_words(a: &Allocation) -> [u32; 2] {
    [a.index | if a.cached { CACHED } else { 0 }, a.page.unwrap_or(NO_PAGE)]
}

/// The allocation of two words ([`allocation_words`]' inverse).
pub fn allocation_of(index: u32, page: u32) -> Allocation {
    Allocation { index: index & !CACHED, page: (page != NO_PAGE).then_some(page), cached: index & CACHED != 0 }
}

/// `allocations` packed, two words each.
pub fn pack_allocations(allocations: &[Allocation]) -> Vec<u32> {
    let mut out = Vec::with_capacity(allocations.len() * 2);
    for a in allocations {
        out.extend_from_slice(&allocation_words(a));
    }
    out
}

/// Decodes packed allocations: two words a distinct key, or why not.
pub fn unpack_allocations(words: &[u32]) -> Result<Vec<Allocation>, String> {
    let (pairs, []) = words.as_chunks::<2>() else { return Err(not_pairs(words.len())) };
    Ok(pairs.iter().map(|&[index, page]| allocation_of(index, page)).collect())
}

/// Why `words` words are no allocations.
pub(crate) fn not_pairs(words: usize) -> String {
    alloc::format!("{words} allocation words, not pairs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_allocations_decode_with_the_hit_flag_and_the_no_page_word() {
        let got = unpack_allocations(&[0, 7, 1 | 1 << 31, 3, 5, u32::MAX]).unwrap();
        let want = [(0, Some(7), false), (1, Some(3), true), (5, None, false)]
            .map(|(index, page, cached)| Allocation { index, page, cached });
        assert_eq!(got, want);
        assert_eq!(pack_allocations(&want), [0, 7, 1 | 1 << 31, 3, 5, u32::MAX]);
        assert_eq!(unpack_allocations(&[]).unwrap(), []);
        assert_eq!(unpack_allocations(&[0, 1, 2]).unwrap_err(), "3 allocation words, not pairs");
    }
}

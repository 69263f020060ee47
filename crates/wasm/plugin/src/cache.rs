//! A front cache for the guest's allocator, like glibc's per-thread cache (tcache) in front of
//! its malloc: freed small and medium blocks wait in per-size-class lists and the next
//! allocation of that class takes one back in a few instructions.
//!
//! Why: every call allocates and frees the same handful of temporaries (the argument buffer,
//! the keys, the core's per-batch vectors, the answer), 256 B–4 KiB for 32–128 keys. dlmalloc
//! serves anything ≥ 256 B from its tree bins: ~150–600 instructions a `malloc` and ~165 a
//! `free` under Cranelift, ~5.7k a 32-key save. The native engine's glibc malloc takes the same
//! blocks from its tcache.
//!
//! Rules:
//! - A block is cached only if its layout asks for alignment ≤ [`ALIGN`] and at most [`MAX`]
//!   bytes; every size is rounded up to its class (≤ 25 % more; 16-byte steps up to 128 B,
//!   then four classes a doubling) and taken from the inner allocator at that size, so any
//!   block of a class fits any request of the class.
//! - The lists hold at most [`BUDGET`] bytes in all; a free past that goes to the inner
//!   allocator. Nothing else is kept.
//! - No locks: the cache is for a single-threaded guest. `Cached` is `Sync` (so it can be a
//!   `static`) only on wasm32 without the threads proposal.
//!
//! No reply or state depends on addresses, so the cache changes nothing the host can observe
//! but the time a call takes.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::ptr;

/// Largest cached request, in bytes.
pub const MAX: usize = 64 * 1024;
/// Largest alignment a cached layout may ask for: dlmalloc's own on wasm32 (two words), so a
/// class block costs it no aligned-allocation path. Every class size is a multiple of it.
pub const ALIGN: usize = 8;
/// Most bytes the lists hold in all.
pub const BUDGET: usize = 1024 * 1024;
/// Number of size classes: 8 of 16-byte steps up to 128 B, then 4 a doubling up to [`MAX`].
const CLASSES: usize = 8 + 4 * 9;

/// The class of a request of `size` bytes (`size` ≤ [`MAX`]).
#[inline]
fn class(size: usize) -> usize {
    let s = size.max(1) - 1;
    if s < 128 {
        return s >> 4;
    }
    let bits = (usize::BITS - 1 - s.leading_zeros()) as usize; // ⌊log2 s⌋, 7..=15
    8 + (bits - 7) * 4 + ((s >> (bits - 2)) & 3)
}

/// The bytes every block of class `c` has.
#[inline]
fn class_size(c: usize) -> usize {
    if c < 8 {
        return (c + 1) * 16;
    }
    let bits = 7 + (c - 8) / 4;
    (4 + (c - 8) % 4 + 1) << (bits - 2)
}

/// A freed block, linked through its own first word.
struct Node {
    next: *mut Node,
}

struct Lists {
    heads: [*mut Node; CLASSES],
    /// Bytes the lists hold.
    held: usize,
}

/// `inner` behind per-class lists of freed blocks.
pub struct Cached<A> {
    inner: A,
    lists: UnsafeCell<Lists>,
}

// SAFETY: see the module docs: one thread only. Only where that holds (wasm32 without the
// threads proposal), so no safe code elsewhere can share one between threads; the native tests
// use a local instance each.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl<A: Sync> Sync for Cached<A> {}

impl<A> core::fmt::Debug for Cached<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Cached").finish_non_exhaustive()
    }
}

impl<A> Cached<A> {
    /// `inner` with empty lists.
    pub const fn new(inner: A) -> Cached<A> {
        Cached { inner, lists: UnsafeCell::new(Lists { heads: [ptr::null_mut(); CLASSES], held: 0 }) }
    }

    /// Bytes the lists hold (for tests).
    pub fn held(&self) -> usize {
        // SAFETY: single-threaded (module docs); no reference into the lists is alive.
        unsafe { (*self.lists.get()).held }
    }
}

/// The class of `layout` if it is cached.
#[inline]
fn cached_class(layout: &Layout) -> Option<usize> {
    (layout.size() <= MAX && layout.align() <= ALIGN).then(|| class(layout.size()))
}

/// The layout blocks of class `c` have in the inner allocator.
#[inline]
fn class_layout(c: usize) -> Layout {
    // SAFETY: class sizes are non-zero multiples of ALIGN (a power of two), far below isize::MAX.
    unsafe { Layout::from_size_align_unchecked(class_size(c), ALIGN) }
}

unsafe impl<A: GlobalAlloc> GlobalAlloc for Cached<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = cached_class(&layout) else {
            // SAFETY: forwarded with the caller's layout.
            return unsafe { self.inner.alloc(layout) };
        };
        // SAFETY: single-threaded (module docs); the reference ends before any other access.
        let lists = unsafe { &mut *self.lists.get() };
        let head = lists.heads[c];
        if head.is_null() {
            // SAFETY: a valid, non-zero layout.
            return unsafe { self.inner.alloc(class_layout(c)) };
        }
        // SAFETY: a listed block is a free block of class `c` whose first word links the next.
        lists.heads[c] = unsafe { (*head).next };
        lists.held -= class_size(c);
        head.cast()
    }

    #[inline]
    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let Some(c) = cached_class(&layout) else {
            // SAFETY: allocated by the inner allocator with this layout (see `alloc`).
            return unsafe { self.inner.dealloc(block, layout) };
        };
        // SAFETY: single-threaded (module docs).
        let lists = unsafe { &mut *self.lists.get() };
        let size = class_size(c);
        if lists.held + size > BUDGET {
            // SAFETY: blocks of class `c` come from the inner allocator at `class_layout(c)`.
            return unsafe { self.inner.dealloc(block, class_layout(c)) };
        }
        let node = block.cast::<Node>();
        // SAFETY: the block is ours now, at least 16 bytes and 8-aligned: room for a link.
        unsafe { node.write(Node { next: lists.heads[c] }) };
        lists.heads[c] = node;
        lists.held += size;
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if cached_class(&layout).is_none() {
            // SAFETY: forwarded with the caller's layout (dlmalloc skips zeroing fresh pages).
            return unsafe { self.inner.alloc_zeroed(layout) };
        }
        // SAFETY: as `alloc`; a non-null block has at least `layout.size()` bytes.
        unsafe {
            let block = self.alloc(layout);
            if !block.is_null() {
                ptr::write_bytes(block, 0, layout.size());
            }
            block
        }
    }

    #[inline]
    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = cached_class(&layout);
        // SAFETY: the caller's alignment with a size it promises is valid for it.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let new = cached_class(&new_layout);
        match (old, new) {
            // The same class: the block already has the room.
            (Some(a), Some(b)) if a == b => block,
            // SAFETY: neither side cached: the inner allocator's own block and layout.
            (None, None) => unsafe { self.inner.realloc(block, layout, new_size) },
            _ => {
                // SAFETY: a fresh block for the new layout, the common bytes copied, the old
                // block freed the way it was allocated.
                unsafe {
                    let moved = self.alloc(new_layout);
                    if !moved.is_null() {
                        ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                    moved
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use alloc::vec::Vec;
    use std::alloc::System;

    #[test]
    fn classes_cover_every_size_with_at_most_a_quarter_more() {
        let mut last = 0;
        for size in 1..=MAX {
            let c = class(size);
            assert!(c < CLASSES, "size {size}");
            let cap = class_size(c);
            assert!(cap >= size && cap.is_multiple_of(ALIGN), "size {size}: class {c} of {cap} bytes");
            assert!(cap * 4 <= size * 5 || cap - size < 16, "size {size}: class of {cap} bytes wastes too much");
            // Classes rise with the size, and the smallest size of a class is one past the last.
            assert!(c == last || c == last + 1, "size {size}: class {c} after {last}");
            if c > 0 && c != last {
                assert_eq!(class_size(c - 1), size - 1, "class {c} starts at {size}");
            }
            last = c;
        }
        assert_eq!(last, CLASSES - 1);
        assert_eq!(class_size(CLASSES - 1), MAX);
    }

    #[test]
    fn a_freed_block_is_handed_out_again_for_its_class_only() {
        let a = Cached::new(System);
        let l300 = Layout::from_size_align(300, 8).unwrap();
        let l310 = Layout::from_size_align(310, 4).unwrap();
        let l400 = Layout::from_size_align(400, 8).unwrap();
        unsafe {
            let p = a.alloc(l300);
            assert!(!p.is_null());
            ptr::write_bytes(p, 0xab, 300);
            a.dealloc(p, l300);
            assert_eq!(a.held(), class_size(class(300)));
            // 310 bytes share 300's class (257..=320): the same block.
            assert_eq!(a.alloc(l310), p);
            assert_eq!(a.held(), 0);
            a.dealloc(p, l310);
            // 400 bytes are another class: a fresh block.
            let q = a.alloc(l400);
            assert_ne!(q, p);
            a.dealloc(q, l400);
            // Zeroed even when reused.
            let z = a.alloc_zeroed(l300);
            assert_eq!(z, p);
            assert!(std::slice::from_raw_parts(z, 300).iter().all(|&b| b == 0));
            a.dealloc(z, l300);
        }
    }

    #[test]
    fn big_or_overaligned_blocks_pass_through_and_the_budget_holds() {
        let a = Cached::new(System);
        unsafe {
            let big = Layout::from_size_align(MAX + 1, 8).unwrap();
            let p = a.alloc(big);
            a.dealloc(p, big);
            let aligned = Layout::from_size_align(64, 64).unwrap();
            let q = a.alloc(aligned);
            assert_eq!(q as usize % 64, 0);
            a.dealloc(q, aligned);
            assert_eq!(a.held(), 0);
            // Fill past the budget: the lists stop at it.
            let l = Layout::from_size_align(MAX, 8).unwrap();
            let blocks: Vec<*mut u8> = (0..BUDGET / MAX + 4).map(|_| a.alloc(l)).collect();
            for b in blocks {
                a.dealloc(b, l);
            }
            assert_eq!(a.held(), BUDGET);
        }
    }

    #[test]
    fn vectors_grown_and_shrunk_through_it_keep_their_contents() {
        // A seeded walk of allocations, reallocations and frees, every live block filled with
        // its own byte and checked before it is touched again.
        let a = Cached::new(System);
        let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let check = |p: *mut u8, l: Layout, fill: u8| unsafe {
            assert!(std::slice::from_raw_parts(p, l.size()).iter().all(|&b| b == fill), "block of {l:?} overwritten");
        };
        for step in 0..20_000u32 {
            let r = next();
            let size = match r % 4 {
                0 => (r >> 8) as usize % 128 + 1,
                1 => (r >> 8) as usize % 4096 + 1,
                2 => (r >> 8) as usize % MAX + 1,
                _ => (r >> 8) as usize % (2 * MAX) + 1,
            };
            let align = 1usize << ((r >> 40) % 6);
            let fill = step as u8;
            unsafe {
                if live.len() < 64 && (r >> 50) % 3 != 0 {
                    let l = Layout::from_size_align(size, align).unwrap();
                    let p = a.alloc(l);
                    assert_eq!(p as usize % align, 0);
                    ptr::write_bytes(p, fill, size);
                    live.push((p, l, fill));
                } else if !live.is_empty() {
                    let i = (r >> 20) as usize % live.len();
                    let (p, l, f) = live.swap_remove(i);
                    check(p, l, f);
                    if (r >> 56) % 2 == 0 {
                        a.dealloc(p, l);
                    } else {
                        let q = a.realloc(p, l, size);
                        let kept = l.size().min(size);
                        assert!(std::slice::from_raw_parts(q, kept).iter().all(|&b| b == f));
                        let nl = Layout::from_size_align(size, l.align()).unwrap();
                        ptr::write_bytes(q, fill, size);
                        live.push((q, nl, fill));
                    }
                }
            }
            assert!(a.held() <= BUDGET);
        }
        for (p, l, f) in live {
            check(p, l, f);
            unsafe { a.dealloc(p, l) };
        }
    }
}

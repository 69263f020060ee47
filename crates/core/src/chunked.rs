//! A vector that grows by whole chunks, so that growing never moves what it holds.
//!
//! A `Vec` grows by doubling: it allocates twice its size, copies everything over and frees the
//! old buffer, so a table of 10^7 entries briefly needs its old and new buffers at once, and in
//! the wasm plugin, whose linear memory never shrinks, the freed buffer stays. [`Chunked`] keeps
//! chunks of [`CHUNK`] elements; a new chunk is allocated at its full size when the last is full,
//! and nothing already stored moves. Only the first chunk grows by doubling, up to [`CHUNK`], so
//! that a small table stays small. Element `i` lives in chunk `i / CHUNK` at `i % CHUNK`.

use alloc::vec::Vec;

const SHIFT: u32 = 14;
/// Elements a chunk holds: 16,384 (1 MiB of 64-byte key entries).
pub(crate) const CHUNK: usize = 1 << SHIFT;
const MASK: usize = CHUNK - 1;

#[derive(Default)]
pub(crate) struct Chunked<T> {
    /// Full chunks, then the last one; every chunk but the first has a capacity of `CHUNK`.
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Chunked<T> {
    pub(crate) const fn new() -> Chunked<T> {
        Chunked { chunks: Vec::new(), len: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Elements it holds before it allocates again.
    pub(crate) fn capacity(&self) -> usize {
        match self.chunks.len() {
            0 => 0,
            1 => self.chunks[0].capacity(),
            n => (n - 1) * CHUNK + self.chunks[n - 1].capacity(),
        }
    }

    pub(crate) fn push(&mut self, value: T) {
        let c = self.len >> SHIFT;
        if c == self.chunks.len() {
            // The first chunk starts small; every later one is allocated whole.
            self.chunks.push(Vec::with_capacity(if c == 0 { 4 } else { CHUNK }));
        }
        let chunk = &mut self.chunks[c];
        if chunk.len() == chunk.capacity() {
            // Only the first chunk ever gets here (the others are allocated with room for all).
            let room = chunk.capacity().min(CHUNK - chunk.len());
            chunk.reserve_exact(room);
        }
        chunk.push(value);
        self.len += 1;
    }

    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i >> SHIFT)?.get(i & MASK)
    }

    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.chunks.get_mut(i >> SHIFT)?.get_mut(i & MASK)
    }

    /// Where element `i` is or will be (for a prefetch: never dereferenced here), or null.
    pub(crate) fn ptr(&self, i: usize) -> *const T {
        self.chunks.get(i >> SHIFT).map_or(core::ptr::null(), |c| c.as_ptr().wrapping_add(i & MASK))
    }

    /// Removes every element and keeps the chunks, so that filling it again allocates nothing.
    pub(crate) fn clear(&mut self) {
        for chunk in &mut self.chunks {
            chunk.clear();
        }
        self.len = 0;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flatten()
    }
}

impl<T: Clone> Clone for Chunked<T> {
    fn clone(&self) -> Chunked<T> {
        let mut out = Chunked::new();
        out.extend(self.iter().cloned());
        out
    }
}

impl<T> Extend<T> for Chunked<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, items: I) {
        for item in items {
            self.push(item);
        }
    }
}

impl<T> FromIterator<T> for Chunked<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Chunked<T> {
        let mut out = Chunked::new();
        out.extend(items);
        out
    }
}

impl<T> core::ops::Index<usize> for Chunked<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> SHIFT][i & MASK]
    }
}

impl<T> core::ops::IndexMut<usize> for Chunked<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i >> SHIFT][i & MASK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_holds_what_a_vec_holds_across_chunks_and_never_moves_a_full_chunk() {
        let n = 3 * CHUNK + 17;
        let mut c = Chunked::new();
        let mut v = Vec::new();
        let mut first_of_second = core::ptr::null();
        for i in 0..n {
            c.push(i as u64 * 7);
            v.push(i as u64 * 7);
            if i == CHUNK {
                first_of_second = &c[CHUNK] as *const u64;
            }
            assert_eq!(c.len(), v.len());
        }
        assert_eq!(&c[CHUNK] as *const u64, first_of_second, "a later push moved a chunk");
        assert!(c.iter().eq(v.iter()));
        for i in [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 5, n - 1] {
            assert_eq!(c[i], v[i]);
            assert_eq!(c.get(i), Some(&v[i]));
        }
        assert_eq!(c.get(n), None);
        assert_eq!(c.capacity(), 4 * CHUNK);
        *c.get_mut(CHUNK + 1).unwrap() = 5;
        c[2] = 9;
        assert_eq!((c[CHUNK + 1], c[2]), (5, 9));
        let d = c.clone();
        assert!(d.iter().eq(c.iter()));
        c.clear();
        assert_eq!((c.len(), c.capacity(), c.iter().count()), (0, 4 * CHUNK, 0));
        c.extend(0..5u64);
        assert!(c.iter().copied().eq(0..5u64));
    }

    #[test]
    fn a_small_one_stays_small() {
        let mut c = Chunked::new();
        c.extend(0..10u8);
        assert!(c.capacity() < 32, "{}", c.capacity());
        let big: Chunked<u8> = (0..CHUNK as u32 + 1).map(|i| i as u8).collect();
        assert_eq!(big.capacity(), 2 * CHUNK, "the first chunk stops at CHUNK");
        assert_eq!(big.ptr(0), &big[0] as *const u8);
        assert!(big.ptr(5 * CHUNK).is_null());
    }
}

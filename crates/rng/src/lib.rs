//! The one seeded generator of kvpages' tests, load generator and browser simulator
//! (SplitMix64): a scenario must replay exactly from its seed on every target, and needs
//! nothing stronger. The core itself draws nothing: its hash seed comes in as an argument.
#![no_std]
#![warn(missing_docs, missing_debug_implementations)]

/// SplitMix64's increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// A seeded SplitMix64 stream.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// The stream of `seed`; nearby seeds give unrelated streams.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6a09_e667_f3bc_c908)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift (bias < n / 2^64).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// [`Rng::below`] for a `u32` bound.
    pub fn below_u32(&mut self, n: u32) -> u32 {
        self.below(u64::from(n)) as u32
    }

    /// An index into a slice of `len` elements (`len > 0`).
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// One of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }

    /// `items` in a uniformly random order (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.index(i + 1);
            items.swap(i, j);
        }
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// SplitMix64's finalizer: a bijective mix of 64 bits (distinct inputs give distinct outputs,
/// so a counter mixed gives unique keys).
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_reproducible_and_in_range() {
        let (mut a, mut b) = (Rng::new(5), Rng::new(5));
        let mut seen = [false; 7];
        for _ in 0..100 {
            let x = a.below(7);
            assert_eq!(x, b.below(7));
            seen[x as usize] = true;
        }
        // Every value shows up in 100 draws of 7.
        assert!(seen.iter().all(|&s| s));
        assert_ne!(Rng::new(6).next_u64(), Rng::new(5).next_u64());
        let u = Rng::new(1).unit();
        assert!((0.0..1.0).contains(&u));
        assert!(!Rng::new(2).chance(0) && Rng::new(2).chance(100));
    }

    /// SplitMix64's published first output for state 0 after one increment.
    #[test]
    fn is_splitmix64() {
        assert_eq!(mix(GAMMA), 0xe220_a839_7b1d_cdaf);
    }
}

//! A small seeded generator (SplitMix64): the workloads must be reproducible from their seed on
//! every target, and need nothing stronger.

#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6a09_e667_f3bc_c908)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift (bias < n / 2^64).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// SplitMix64's finalizer: a bijective mix of 64 bits.
pub(crate) fn mix(mut z: u64) -> u64 {
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
        let xs: Vec<u64> = (0..100).map(|_| a.below(7)).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.below(7)).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|&x| x < 7));
        // Every value shows up in 100 draws of 7.
        assert!((0..7).all(|v| xs.contains(&v)));
        assert_ne!(Rng::new(6).next_u64(), Rng::new(5).next_u64());
        let u = Rng::new(1).unit();
        assert!((0.0..1.0).contains(&u));
    }
}

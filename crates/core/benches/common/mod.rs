//! What the core and wire benchmarks share.

/// The text of the `i`-th distinct 32-hex key.
pub fn key_text(i: u64) -> String {
    let a = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let b = a.rotate_left(29).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    format!("{a:016x}{b:016x}")
}

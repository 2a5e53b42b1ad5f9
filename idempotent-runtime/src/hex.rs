//! Lowercase hex, written into fixed-size arrays (owner tokens, fingerprints) without `fmt`.

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// The lowercase hex of `bytes`: `N` bytes give `2 * N` digits, in `M` (which must be `2 * N`).
pub(crate) fn encode<const N: usize, const M: usize>(bytes: &[u8; N]) -> [u8; M] {
    const { assert!(M == 2 * N, "hex of N bytes takes 2 * N digits") };
    let mut out = [0u8; M];
    for (i, byte) in bytes.iter().enumerate() {
        out[2 * i] = DIGITS[usize::from(byte >> 4)];
        out[2 * i + 1] = DIGITS[usize::from(byte & 0x0f)];
    }
    out
}

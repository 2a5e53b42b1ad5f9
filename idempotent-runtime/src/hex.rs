//! Lowercase hex, written into fixed-size arrays (owner tokens, fingerprints) without `fmt`, and
//! counted up in place (a process-local store's owner tokens).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// The two digits of every byte value, so a byte costs one lookup.
const PAIRS: [[u8; 2]; 256] = {
    let mut pairs = [[0u8; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0x0f]];
        byte += 1;
    }
    pairs
};

/// The lowercase hex of `bytes`: `N` bytes give `2 * N` digits, in `M` (which must be `2 * N`).
pub(crate) fn encode<const N: usize, const M: usize>(bytes: &[u8; N]) -> [u8; M] {
    const { assert!(M == 2 * N, "hex of N bytes takes 2 * N digits") };
    let mut out = [0u8; M];
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&PAIRS[usize::from(*byte)]);
    }
    out
}

/// The bytes that lowercase hex digits spell: `M` digits give `N` bytes (`M` must be `2 * N`). Only
/// for digits this crate wrote (any other byte reads as 0).
pub(crate) fn decode<const M: usize, const N: usize>(digits: &[u8; M]) -> [u8; N] {
    const { assert!(M == 2 * N, "2 * N hex digits make N bytes") };
    let value = |digit: u8| match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => 0,
    };
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (value(pair[0]) << 4) | value(pair[1]);
    }
    out
}

/// Adds one to the number that lowercase hex `digits` spell, in place (all `f`s wrap to all `0`s).
/// The last digit is usually the only one that changes.
pub(crate) fn plus_one<const M: usize>(digits: &mut [u8; M]) {
    for digit in digits.iter_mut().rev() {
        match *digit {
            b'f' => *digit = b'0',
            b'9' => {
                *digit = b'a';
                break;
            }
            _ => {
                *digit += 1;
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn memory_hex_plus_one_counts_up() {
        let number = |digits: [u8; 32]| u128::from_be_bytes(super::decode(&digits));
        for start in [0, 9, 15, 0xff, 0x19f, 0x0fff_ffff_ffff_ffff, u128::MAX - 1, u128::MAX] {
            let mut digits = super::encode(&u128::to_be_bytes(start));
            super::plus_one(&mut digits);
            assert_eq!(number(digits), start.wrapping_add(1), "{start:#x}");
        }
    }

    #[test]
    fn memory_hex_is_lowercase_and_complete() {
        let bytes: [u8; 4] = [0x00, 0x0f, 0xa5, 0xff];
        assert_eq!(&super::encode::<4, 8>(&bytes), b"000fa5ff");
        let all: [u8; 256] = std::array::from_fn(|i| u8::try_from(i).unwrap());
        let hex: [u8; 512] = super::encode(&all);
        let expected = (0..=255u8).fold(String::new(), |mut all, b| {
            use std::fmt::Write as _;
            let _ = write!(all, "{b:02x}");
            all
        });
        assert_eq!(std::str::from_utf8(&hex).unwrap(), expected);
        assert_eq!(super::decode::<512, 256>(&hex), all, "decoding gives the bytes back");
    }
}

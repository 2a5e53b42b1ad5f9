//! The simulation's seeded random numbers: `SplitMix64`, a few lines of our own.
//!
//! Every choice of a history (its callers, their timing, the faults) is drawn from one seed, so a
//! seed replays its history exactly. `SplitMix64` is enough for choosing schedules (it passes
//! `BigCrush`, needs one `u64` of state and no crate), and a generator we own cannot change its
//! sequence under us in a dependency update, which would silently change every recorded seed.

/// A `SplitMix64` generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose sequence is fixed by `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// A duration of `0..=max` whole milliseconds.
    pub fn millis(&mut self, max: u64) -> std::time::Duration {
        std::time::Duration::from_millis(self.below(max + 1))
    }

    /// `true` with `percent` % probability.
    pub fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < u64::from(percent)
    }

    /// One of `items`, uniformly.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[usize::try_from(self.below(items.len() as u64)).unwrap_or(0)]
    }

    /// A generator of its own for a sub-part of the history, so that part's draws do not depend on
    /// how many draws the others made.
    #[must_use]
    pub fn fork(&mut self) -> Self {
        SplitMix64(self.next_u64())
    }
}

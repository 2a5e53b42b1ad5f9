//! What the outbound retries share, over HTTP (`client::IdempotentRetry`, feature `reqwest`) and
//! gRPC (`grpc::GrpcRetryLayer`, feature `tonic`): the attempt and time bounds, exponential
//! back-off with seeded jitter, and what a returned answer notes about its attempts.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt as _, SeedableRng as _};

/// How an outbound retry spaces and bounds its attempts: [`IdempotentRetry`](crate::client::IdempotentRetry)
/// for reqwest, [`GrpcRetryLayer`](crate::grpc::GrpcRetryLayer) for tonic channels.
///
/// The wait before retry `n` (1 for the first retry) is drawn uniformly from
/// `[b/2, b]` with `b = min(max_backoff, initial_backoff × 2ⁿ⁻¹)` ("equal jitter": spread out so
/// that many clients do not retry in step, yet never shorter than half the back-off). An answer
/// that says how long to wait (HTTP's `Retry-After`, gRPC's `grpc-retry-pushback-ms`) is waited
/// for as asked instead. Retrying stops after `max_attempts` attempts in all, or when the next
/// wait would end past `max_elapsed` since the first attempt (so a server's wait longer than the
/// budget left ends the retries at once, whatever its size).
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::client::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(8)
///     .backoff(Duration::from_millis(100), Duration::from_secs(5))
///     .max_elapsed(Duration::from_secs(60))
///     .jitter_seed(42); // the same waits in every run: for tests
/// assert_eq!(policy.attempts(), 8);
/// ```
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    max_elapsed: Duration,
    jitter: Arc<Jitter>,
}

/// The default number of attempts (the first one included).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// The default wait before the first retry (before jitter).
pub const DEFAULT_INITIAL_BACKOFF: Duration = Duration::from_millis(200);
/// The default longest back-off between two attempts.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(10);
/// The default time budget from the first attempt on.
pub const DEFAULT_MAX_ELAPSED: Duration = Duration::from_secs(30);

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            initial_backoff: DEFAULT_INITIAL_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
            max_elapsed: DEFAULT_MAX_ELAPSED,
            jitter: Arc::new(Jitter::random()),
        }
    }
}

impl RetryPolicy {
    /// At most `attempts` attempts in all, the first one included (default
    /// [`DEFAULT_MAX_ATTEMPTS`]); `1` never retries. `0` counts as `1`.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The back-off before the first retry, doubled for each later one up to `max` (defaults
    /// [`DEFAULT_INITIAL_BACKOFF`] and [`DEFAULT_MAX_BACKOFF`]).
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// No retry starts later than `budget` after the first attempt began (default
    /// [`DEFAULT_MAX_ELAPSED`]). A wait that would end past it is not begun: the last outcome is
    /// returned instead.
    #[must_use]
    pub fn max_elapsed(mut self, budget: Duration) -> Self {
        self.max_elapsed = budget;
        self
    }

    /// Draws the jitter from a generator seeded with `seed`, so that the same sequence of retries
    /// waits the same in every run (the default seed is random per policy).
    #[must_use]
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.jitter = Arc::new(Jitter::seeded(seed));
        self
    }

    /// The most attempts this policy makes.
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The time budget from the first attempt on.
    #[must_use]
    pub fn budget(&self) -> Duration {
        self.max_elapsed
    }

    /// The shortest and longest wait before retry `retry` (1 for the first retry), before
    /// `Retry-After` and the time budget are considered.
    #[must_use]
    pub fn backoff_range(&self, retry: u32) -> (Duration, Duration) {
        let doublings = retry.saturating_sub(1).min(31);
        let full = self.initial_backoff.saturating_mul(1 << doublings).min(self.max_backoff);
        (full / 2, full)
    }

    /// The wait before retry `retry`: a draw from [`backoff_range`](Self::backoff_range).
    pub(crate) fn next_backoff(&self, retry: u32) -> Duration {
        let (low, high) = self.backoff_range(retry);
        self.jitter.between(low, high)
    }

    /// The wait before the attempt after attempt `count`, begun `elapsed` after the first: the
    /// server's `asked` wait if it named one, else a back-off; or why no attempt follows. A
    /// server's wait can be anything up to `u64::MAX` seconds: it is bounded by the budget, and
    /// added without overflow.
    pub(crate) fn next_wait(
        &self,
        count: u32,
        asked: Option<Duration>,
        elapsed: Duration,
    ) -> Result<Duration, Stopped> {
        let wait = asked.unwrap_or_else(|| self.next_backoff(count)).min(self.max_elapsed);
        if count >= self.max_attempts {
            Err(Stopped::AttemptsExhausted)
        } else if elapsed.saturating_add(wait) > self.max_elapsed {
            Err(Stopped::TimeBudgetExhausted)
        } else {
            Ok(wait)
        }
    }
}

/// The jitter's generator: `rand`'s Xoshiro256++, whose output for a seed is fixed across `rand`
/// releases (a "portable" generator), behind a lock that each draw holds for a few nanoseconds.
#[derive(Debug)]
struct Jitter(Mutex<Xoshiro256PlusPlus>);

impl Jitter {
    fn seeded(seed: u64) -> Self {
        Jitter(Mutex::new(Xoshiro256PlusPlus::seed_from_u64(seed)))
    }

    fn random() -> Self {
        Jitter(Mutex::new(Xoshiro256PlusPlus::from_rng(&mut rand::rng())))
    }

    /// A uniform draw from `[low, high]`, to the nanosecond (durations past 584 years count as that).
    fn between(&self, low: Duration, high: Duration) -> Duration {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let (low, high) = (nanos(low), nanos(high).max(nanos(low)));
        let mut rng = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        Duration::from_nanos(rng.random_range(low..=high))
    }
}

/// What an outbound retry did for an answer it returns: found in the answer's extensions (a
/// `reqwest::Response`'s, or a `tonic::Response`'s behind [`GrpcRetryLayer`](crate::grpc::GrpcRetryLayer)).
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotent_runtime::client::Attempts;
///
/// let response = client.post("https://api.example/payments").body("{}").send().await?;
/// if let Some(attempts) = response.extensions().get::<Attempts>() {
///     println!("key {} took {} attempt(s)", attempts.key, attempts.count);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempts {
    /// The idempotency key every attempt carried.
    pub key: String,
    /// How many attempts were sent, this response's included.
    pub count: u32,
    /// Set when this answer asked for a retry (HTTP `409`, `429`, `5xx`; a gRPC code in the
    /// retried set) but none was made.
    pub stopped: Option<Stopped>,
}

/// Why a retryable response was returned instead of retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Stopped {
    /// The policy's attempts were all used.
    #[error("all attempts were used")]
    AttemptsExhausted,
    /// The next wait (back-off, `Retry-After` or pushback) would have ended past the time budget.
    #[error("the next wait would have ended past the time budget")]
    TimeBudgetExhausted,
    /// The body is a stream, which cannot be sent twice.
    #[error("the request body is a stream, which cannot be sent twice")]
    BodyNotReplayable,
    /// The answer is the server's recorded one (`Idempotent-Replayed: true`): the request ran
    /// and this is its outcome, which another attempt with this key would get again.
    #[error("the server replayed its recorded response for this key; another attempt would get it again")]
    Replayed,
    /// The gRPC answer carried a negative `grpc-retry-pushback-ms`: the server asks not to retry
    /// (gRFC A6).
    #[error("the server's pushback asked not to retry")]
    ServerRefusedRetries,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_jitter_stays_in_the_upper_half() {
        let policy = RetryPolicy::default().backoff(ms(100), ms(1000)).jitter_seed(7);
        let expected = [(50, 100), (100, 200), (200, 400), (400, 800), (500, 1000), (500, 1000)];
        for (retry, (low, high)) in (1..).zip(expected) {
            assert_eq!(policy.backoff_range(retry), (ms(low), ms(high)), "retry {retry}");
            for _ in 0..200 {
                let wait = policy.next_backoff(retry);
                assert!(wait >= ms(low) && wait <= ms(high), "retry {retry}: {wait:?}");
            }
        }
        assert_eq!(policy.backoff_range(u32::MAX), (ms(500), ms(1000)), "no overflow");
    }

    #[test]
    fn the_same_seed_gives_the_same_waits_and_another_seed_other_waits() {
        let waits = |seed| {
            let policy = RetryPolicy::default().jitter_seed(seed);
            (1..=6).map(|retry| policy.next_backoff(retry)).collect::<Vec<_>>()
        };
        assert_eq!(waits(1), waits(1));
        assert_ne!(waits(1), waits(2));
    }

    #[test]
    fn jitter_spreads_over_its_range() {
        let jitter = Jitter::seeded(3);
        let draws: Vec<f64> = (0..10_000).map(|_| jitter.between(ms(1000), ms(2000)).as_secs_f64() - 1.0).collect();
        assert!(draws.iter().all(|u| (0.0..=1.0).contains(u)));
        let mean = draws.iter().sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        assert!(draws.iter().any(|u| *u < 0.01) && draws.iter().any(|u| *u > 0.99));
        assert_eq!(jitter.between(ms(5), ms(5)), ms(5));
        assert_eq!(jitter.between(ms(5), ms(1)), ms(5), "an empty range is its lower end");
        let far = Duration::MAX;
        assert!(jitter.between(far, far) >= Duration::from_secs(584 * 365 * 86_400), "no overflow");
    }
}

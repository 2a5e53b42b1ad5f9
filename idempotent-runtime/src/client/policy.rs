//! When to retry and how long to wait: the attempt and time bounds, exponential back-off with
//! seeded jitter, and `Retry-After`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt as _, SeedableRng as _};

/// How [`IdempotentRetry`](super::IdempotentRetry) spaces and bounds its attempts.
///
/// The wait before retry `n` (1 for the first retry) is drawn uniformly from
/// `[b/2, b]` with `b = min(max_backoff, initial_backoff × 2ⁿ⁻¹)` ("equal jitter": spread out so
/// that many clients do not retry in step, yet never shorter than half the back-off). A response
/// with `Retry-After` is waited for as asked instead. Retrying stops after `max_attempts`
/// attempts in all, or when the next wait would end past `max_elapsed` since the first attempt
/// (so a `Retry-After` longer than the budget left ends the retries at once, whatever its size).
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
    pub(super) fn next_backoff(&self, retry: u32) -> Duration {
        let (low, high) = self.backoff_range(retry);
        self.jitter.between(low, high)
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

/// Whether an HTTP status is worth retrying with the same key: `409` (the first request with
/// this key is still running), `429` and every `5xx`. No other `4xx` is: the same request
/// would get the same answer.
#[must_use]
pub fn is_retryable_status(status: StatusCode) -> bool {
    status == StatusCode::CONFLICT || status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
}

/// The wait a `Retry-After` header asks for: delay-seconds, or an HTTP date (a date in the past
/// means "now"). `None` without the header or when it is unreadable (not a number that fits in a
/// `u64`, nor a date). The value is returned as the server sent it, up to `u64::MAX` seconds:
/// [`IdempotentRetry`](super::IdempotentRetry) bounds it by its time budget.
#[must_use]
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO))
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

    #[test]
    fn retryable_statuses_are_409_429_and_5xx_only() {
        for code in [409, 429, 500, 502, 503, 504, 599] {
            assert!(is_retryable_status(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [200, 201, 204, 301, 400, 401, 403, 404, 408, 410, 412, 413, 422, 425] {
            assert!(!is_retryable_status(StatusCode::from_u16(code).unwrap()), "{code}");
        }
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert(header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        headers.insert(header::RETRY_AFTER, "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::ZERO), "a past date means now");
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        headers.insert(header::RETRY_AFTER, later.parse().unwrap());
        let wait = retry_after(&headers).unwrap();
        assert!(wait > Duration::from_secs(100) && wait <= Duration::from_secs(120), "{wait:?}");
        headers.insert(header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&headers), None);
        headers.insert(header::RETRY_AFTER, "18446744073709551615".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(u64::MAX)), "as sent: the caller bounds it");
        for unreadable in ["18446744073709551616", "-1", "1.5", "0x10", "", "3, 4"] {
            headers.insert(header::RETRY_AFTER, unreadable.parse().unwrap());
            assert_eq!(retry_after(&headers), None, "{unreadable:?}");
        }
    }
}

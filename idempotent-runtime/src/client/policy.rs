//! Which HTTP answers are worth retrying, and how long `Retry-After` asks to wait.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};

/// Whether an HTTP status is worth retrying with the same key: `408` (the server, or a timeout
/// in front of its handler, stopped waiting; the handler may still be running, as it is behind
/// [`IdempotencyLayer`](crate::http::IdempotencyLayer)), `409` (the first request with this key
/// is still running), `429` and every `5xx`. No other `4xx` is: the same request would get the
/// same answer.
#[must_use]
pub fn is_retryable_status(status: StatusCode) -> bool {
    matches!(status, StatusCode::REQUEST_TIMEOUT | StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS)
        || status.is_server_error()
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

    #[test]
    fn retryable_statuses_are_408_409_429_and_5xx_only() {
        for code in [408, 409, 429, 500, 502, 503, 504, 599] {
            assert!(is_retryable_status(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [200, 201, 204, 301, 400, 401, 403, 404, 410, 412, 413, 422, 425] {
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

//! What the store asks of the Redis server, checked when it connects: a version with `SET ... NX
//! GET`, and a memory policy that does not evict records.

use redis::aio::ConnectionLike;

use crate::StoreError;

/// The oldest Redis the store works with: 7.0 added `SET ... NX GET`, the one-command claim.
pub const MIN_REDIS_VERSION: (u32, u32) = (7, 0);

/// Reads the server's `INFO` and refuses a server older than [`MIN_REDIS_VERSION`]; warns (under
/// the target `idempotent`) when its `maxmemory-policy` lets it evict keys, which would lose
/// records or even live claims (a duplicate then runs the body again).
pub(super) async fn check(connection: &mut (impl ConnectionLike + Send), server: &str) -> Result<(), StoreError> {
    let info: String = redis::cmd("INFO").query_async(connection).await.map_err(super::backend)?;
    let found = judge(&info).map_err(|reason| StoreError::rejected("redis", format!("{server}: {reason}")))?;
    if let Some(policy) = found.evicting_policy {
        tracing::warn!(
            target: "idempotent", server, policy,
            "this Redis server may evict keys under memory pressure (maxmemory-policy {policy}): an evicted \
             record makes its key run again, and an evicted claim lets a duplicate run while the first call \
             still runs; set `maxmemory-policy noeviction` for the idempotency records"
        );
    }
    Ok(())
}

/// What the checks found in an `INFO` reply.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Found {
    pub version: (u32, u32),
    /// The `maxmemory_policy`, when it is not `noeviction`.
    pub evicting_policy: Option<String>,
}

/// Judges an `INFO` reply: an error naming the problem and the fix for a server too old.
pub(super) fn judge(info: &str) -> Result<Found, String> {
    let field = |name: &str| {
        info.lines().find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(':'))).map(str::trim)
    };
    let text = field("redis_version").ok_or("its INFO reply has no redis_version; is it a Redis server?")?;
    let mut parts = text.split('.').map(|part| part.parse::<u32>().ok());
    let version = match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor),
        _ => return Err(format!("cannot read its redis_version {text:?}")),
    };
    if version < MIN_REDIS_VERSION {
        return Err(format!(
            "Redis {text} is too old: the idempotency store needs Redis {}.{} or newer (it claims keys with \
             `SET ... NX GET`); upgrade the server",
            MIN_REDIS_VERSION.0, MIN_REDIS_VERSION.1
        ));
    }
    let evicting_policy = field("maxmemory_policy").filter(|policy| *policy != "noeviction").map(str::to_owned);
    Ok(Found { version, evicting_policy })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_servers_are_judged_by_version_and_memory_policy() {
        let info = |version: &str, policy: &str| {
            format!(
                "# Server\r\nredis_version:{version}\r\nredis_mode:standalone\r\n# Memory\r\nmaxmemory_policy:{policy}\r\n"
            )
        };
        assert_eq!(judge(&info("7.0.15", "noeviction")), Ok(Found { version: (7, 0), evicting_policy: None }));
        assert_eq!(judge(&info("8.2.3", "noeviction")).unwrap().version, (8, 2));
        assert_eq!(judge(&info("7.2.4", "allkeys-lru")).unwrap().evicting_policy.as_deref(), Some("allkeys-lru"));
        assert_eq!(judge(&info("7.2.4", "volatile-ttl")).unwrap().evicting_policy.as_deref(), Some("volatile-ttl"));
        let old = judge(&info("6.2.14", "noeviction")).unwrap_err();
        assert!(old.contains("6.2.14 is too old") && old.contains("7.0 or newer"), "{old}");
        assert!(judge("# Server\r\n").unwrap_err().contains("no redis_version"));
        assert!(judge(&info("seven", "noeviction")).unwrap_err().contains("cannot read"));
    }
}

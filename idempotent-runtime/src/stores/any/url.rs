//! Opening a store from a URL: one arm per scheme, each behind its feature.

use super::AnyStore;
use crate::{MemoryStore, StoreError};

/// Why [`AnyStore::from_url`] could not open a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreUrlError {
    /// The text is not a store URL of a known shape.
    #[error("malformed store URL {url:?}: {reason}; expected {EXPECTED}")]
    Malformed {
        /// The URL, its password hidden.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// No store has this scheme.
    #[error("unknown store URL scheme {scheme:?} in {url:?}; expected {EXPECTED}")]
    UnknownScheme {
        /// The scheme, as written.
        scheme: String,
        /// The URL, its password hidden.
        url: String,
    },

    /// The scheme's store is behind a feature this build of idempotent-runtime does not have.
    #[error(
        "the store URL {url:?} needs the `{feature}` feature of idempotent-runtime, which this build does not \
         have: enable the `{feature}` feature of idempotent-runtime (features = [\"{feature}\"] in Cargo.toml)"
    )]
    FeatureDisabled {
        /// The URL, its password hidden.
        url: String,
        /// The feature to enable.
        feature: &'static str,
    },

    /// The URL is well formed but the store could not be opened (server unreachable, file not
    /// writable, table not creatable).
    #[error("could not open the store at {url:?}: {source}")]
    Connect {
        /// The URL, its password hidden.
        url: String,
        /// What the store reported.
        #[source]
        source: StoreError,
    },
}

const EXPECTED: &str = "memory://, sqlite://PATH, redis://HOST[:PORT][/DB], rediss://..., \
                        redis+cluster://HOST:PORT[,HOST:PORT...], postgres://USER@HOST[:PORT]/DB or \
                        mysql://USER@HOST[:PORT]/DB";

/// The stores a URL can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Memory,
    Sqlite,
    Redis,
    RedisCluster,
    Postgres,
    MySql,
}

impl Scheme {
    /// The feature of idempotent-runtime this scheme's store needs.
    fn feature(self) -> Option<&'static str> {
        match self {
            Scheme::Memory => None,
            Scheme::Sqlite => Some("sqlite"),
            Scheme::Redis => Some("redis"),
            Scheme::RedisCluster => Some("redis-cluster"),
            Scheme::Postgres => Some("postgres"),
            Scheme::MySql => Some("mysql"),
        }
    }
}

/// Whether this build has `feature`.
#[allow(clippy::match_like_matches_macro, reason = "which arms are true depends on the build's features")]
fn built_with(feature: &str) -> bool {
    match feature {
        "sqlite" => cfg!(feature = "sqlite"),
        "redis" => cfg!(feature = "redis"),
        "redis-cluster" => cfg!(feature = "redis-cluster"),
        "postgres" => cfg!(feature = "postgres"),
        "mysql" => cfg!(feature = "mysql"),
        _ => false,
    }
}

fn scheme(name: &str) -> Option<Scheme> {
    Some(match name {
        "memory" => Scheme::Memory,
        "sqlite" => Scheme::Sqlite,
        "redis" | "rediss" => Scheme::Redis,
        "redis+cluster" => Scheme::RedisCluster,
        "postgres" | "postgresql" => Scheme::Postgres,
        "mysql" | "mariadb" => Scheme::MySql,
        _ => return None,
    })
}

/// Opens the store `url` names; see [`AnyStore::from_url`].
pub(super) async fn open(url: &str) -> Result<AnyStore, StoreUrlError> {
    let shown = redact(url);
    let malformed = |reason| StoreUrlError::Malformed { url: shown.clone(), reason };
    let Some((name, rest)) = url.split_once("://") else {
        return Err(malformed("it has no `scheme://`"));
    };
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) {
        return Err(malformed("the scheme must be letters, digits, `+`, `-` or `.`"));
    }
    let scheme = scheme(&name.to_ascii_lowercase())
        .ok_or_else(|| StoreUrlError::UnknownScheme { scheme: name.to_owned(), url: shown.clone() })?;
    if let Some(feature) = scheme.feature().filter(|feature| !built_with(feature)) {
        return Err(StoreUrlError::FeatureDisabled { url: shown, feature });
    }
    match scheme {
        Scheme::Memory => {
            if !rest.is_empty() {
                return Err(malformed("memory:// takes nothing after the scheme"));
            }
            Ok(AnyStore::with_admin(MemoryStore::new()))
        }
        Scheme::Sqlite => {
            let path = rest.split_once('?').map_or(rest, |(path, _)| path);
            if path.is_empty() {
                return Err(malformed("sqlite:// needs a file path, such as sqlite://data/idempotency.db"));
            }
            // SQLite gives each connection of the pool an in-memory database of its own: the
            // table would be in one of them, and records in each apart from the others.
            if matches!(path, ":memory:" | "file::memory:") {
                return Err(malformed(
                    "an in-memory SQLite database is one per connection of the store's pool, not one store; \
                     use memory:// for a store in this process's memory",
                ));
            }
            open_sqlite(path, &shown).await
        }
        Scheme::Redis => {
            if host(rest).is_empty() {
                return Err(malformed("redis:// needs a host, such as redis://127.0.0.1:6379"));
            }
            open_redis(url, &shown).await
        }
        Scheme::RedisCluster => {
            // One URL names every seed node: redis+cluster://user:pass@host1:7000,host2:7001
            let (user_info, hosts) = rest.rsplit_once('@').map_or(("", rest), |(u, h)| (u, h));
            let hosts = hosts.split(['/', '?', '#']).next().unwrap_or("");
            if hosts.split(',').any(str::is_empty) {
                return Err(malformed(
                    "redis+cluster:// needs one or more seed nodes, such as redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
                ));
            }
            let at = if user_info.is_empty() { String::new() } else { format!("{user_info}@") };
            let nodes: Vec<String> = hosts.split(',').map(|node| format!("redis://{at}{node}")).collect();
            open_redis_cluster(&nodes, &shown).await
        }
        Scheme::Postgres => {
            if host(rest).is_empty() {
                return Err(malformed("postgres:// needs a host, such as postgres://app@127.0.0.1/app"));
            }
            open_postgres(url, &shown).await
        }
        Scheme::MySql => {
            if host(rest).is_empty() {
                return Err(malformed("mysql:// needs a host, such as mysql://app@127.0.0.1/app"));
            }
            open_mysql(url, &shown).await
        }
    }
}

/// The host of `user:password@host:port/path?query` (`rest` is what follows `://`).
fn host(rest: &str) -> &str {
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    if host_port.starts_with('[') {
        return host_port.split_once(']').map_or("", |(host, _)| host.trim_start_matches('['));
    }
    host_port.split(':').next().unwrap_or("")
}

/// The URL with its password, if any, replaced by `***`, for error messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn connect_error(
    shown: &str,
    backend: &'static str,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> StoreUrlError {
    StoreUrlError::Connect { url: shown.to_owned(), source: StoreError::backend(backend, source) }
}

#[cfg(feature = "sqlite")]
async fn open_sqlite(path: &str, shown: &str) -> Result<AnyStore, StoreUrlError> {
    let store = crate::stores::sql::SqliteStore::open(path).await.map_err(|e| connect_error(shown, "sqlite", e))?;
    Ok(AnyStore::with_admin(store))
}

#[cfg(feature = "redis")]
async fn open_redis(url: &str, shown: &str) -> Result<AnyStore, StoreUrlError> {
    let store = crate::RedisStore::connect(url)
        .await
        .map_err(|source| StoreUrlError::Connect { url: shown.to_owned(), source })?;
    Ok(AnyStore::with_admin(store))
}

#[cfg(feature = "redis-cluster")]
async fn open_redis_cluster(nodes: &[String], shown: &str) -> Result<AnyStore, StoreUrlError> {
    let store = crate::stores::redis::RedisClusterStore::connect_cluster(nodes)
        .await
        .map_err(|source| StoreUrlError::Connect { url: shown.to_owned(), source })?;
    Ok(AnyStore::with_admin(store))
}

#[cfg(feature = "postgres")]
async fn open_postgres(url: &str, shown: &str) -> Result<AnyStore, StoreUrlError> {
    // No ping before each step: the store sends a step again on a connection found closed.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| connect_error(shown, "postgres", e))?;
    let store = crate::stores::sql::PostgresStore::new(pool);
    store.create_table().await.map_err(|e| connect_error(shown, "postgres", e))?;
    Ok(AnyStore::with_admin(store))
}

#[cfg(feature = "mysql")]
async fn open_mysql(url: &str, shown: &str) -> Result<AnyStore, StoreUrlError> {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| connect_error(shown, "mysql", e))?;
    let store = crate::stores::sql::MySqlStore::new(pool);
    store.create_table().await.map_err(|e| connect_error(shown, "mysql", e))?;
    Ok(AnyStore::with_admin(store))
}

/// The openers of the stores this build leaves out (`open` refuses their schemes before).
macro_rules! disabled {
    ($($feature:literal => $name:ident;)*) => {$(
        #[cfg(not(feature = $feature))]
        #[allow(clippy::unused_async, reason = "the same signature as with the feature")]
        async fn $name<T: ?Sized>(_: &T, shown: &str) -> Result<AnyStore, StoreUrlError> {
            Err(StoreUrlError::FeatureDisabled { url: shown.to_owned(), feature: $feature })
        }
    )*};
}

disabled! {
    "sqlite" => open_sqlite;
    "redis" => open_redis;
    "redis-cluster" => open_redis_cluster;
    "postgres" => open_postgres;
    "mysql" => open_mysql;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_found_with_or_without_user_port_and_path() {
        assert_eq!(host("127.0.0.1:6379"), "127.0.0.1");
        assert_eq!(host("app:secret@db.internal:5432/app?sslmode=disable"), "db.internal");
        assert_eq!(host("root@[::1]:3306/test"), "::1");
        assert_eq!(host("/db"), "");
        assert_eq!(host(""), "");
        assert_eq!(host("user@/db"), "");
    }

    #[test]
    fn passwords_never_reach_error_messages() {
        assert_eq!(redact("postgres://app:hunter2@db/app"), "postgres://app:***@db/app");
        assert_eq!(redact("redis://:hunter2@cache:6379/0"), "redis://:***@cache:6379/0");
        assert_eq!(redact("mysql://root@db/test"), "mysql://root@db/test");
        assert_eq!(redact("sqlite://data/a@b.db"), "sqlite://data/a@b.db");
        assert_eq!(redact("nonsense"), "nonsense");
    }

    #[test]
    fn every_scheme_but_memory_names_its_feature() {
        let cases = [
            ("memory", None),
            ("sqlite", Some("sqlite")),
            ("redis", Some("redis")),
            ("rediss", Some("redis")),
            ("postgres", Some("postgres")),
            ("postgresql", Some("postgres")),
            ("mysql", Some("mysql")),
            ("mariadb", Some("mysql")),
        ];
        for (name, feature) in cases {
            assert_eq!(scheme(name).map(Scheme::feature), Some(feature), "{name}");
        }
        assert_eq!(scheme("mongodb"), None);
        assert!(!built_with("no-such-feature"));
    }

    #[test]
    fn a_disabled_feature_is_named_with_the_fix() {
        let error = StoreUrlError::FeatureDisabled { url: "postgres://db/app".into(), feature: "postgres" };
        let message = error.to_string();
        assert!(message.contains("enable the `postgres` feature of idempotent-runtime"), "{message}");
    }

    /// Only in a build without the feature (`cargo test -p idempotent-runtime --lib`).
    #[cfg(not(feature = "postgres"))]
    #[tokio::test]
    async fn a_url_of_a_store_left_out_of_the_build_is_refused_with_the_fix() {
        let error = AnyStore::from_url("postgres://app@127.0.0.1/app").await.unwrap_err();
        assert!(matches!(error, StoreUrlError::FeatureDisabled { feature: "postgres", .. }), "{error}");
    }
}

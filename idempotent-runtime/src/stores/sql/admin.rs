//! The pooled SQL stores' operator view ([`Admin`]): indexed queries, one page at a time.
//!
//! A listing is a keyset page of the primary key, `WHERE idempotency_key > <cursor> ... ORDER BY
//! idempotency_key LIMIT <page + 1>`, so each page reads about as many rows as it returns; its
//! cursor is the last key returned. A scope is matched with `LIKE 'scope:%'` (on SQLite, whose
//! `LIKE` ignores the case of ASCII letters, with `GLOB 'scope:*'`). `stats` groups the whole table
//! on the server (one aggregate, no rows sent) and finds the running claim closest to its end
//! through the `expires_at` index. Every time is the database's own clock.
//!
//! Each method's statements are bounded by the store's timeout
//! ([`with_timeout`](SqlStore::with_timeout)), as a call's steps are, and fail with
//! [`TimedOut`](super::TimedOut) past it: a release whose `DELETE` waits on a row that an open
//! transaction holds (a transactional call took the key over) would otherwise wait as long as that
//! transaction, on PostgreSQL without a `lock_timeout` for ever. A release that timed out may
//! still take effect on the server once the lock is free (fenced as inspected): inspect the key
//! again.

use std::fmt::Write as _;
use std::time::Duration;

use sqlx::Row as _;

use super::SqlStore;
use super::dialect::{COMPLETED, IN_PROGRESS};
use crate::admin::{Admin, Entry, ListQuery, Page, Released, State, Stats};
use crate::{Key, StoreError};

/// What differs between the backends in the admin queries.
struct Sql {
    /// The statement clock.
    now: &'static str,
    /// Microseconds until `expires_at`, as a BIGINT.
    remaining: &'static str,
    /// The scope part of `idempotency_key`.
    scope: &'static str,
    /// `idempotency_key` as text (MySQL keeps it as VARBINARY).
    key: &'static str,
    /// `$n` placeholders (PostgreSQL) rather than `?`.
    numbered: bool,
    /// How a scope's keys are matched: SQLite's `LIKE` ignores the case of ASCII letters, and
    /// scopes are case-sensitive, so it matches with `GLOB` instead.
    glob: bool,
}

impl Sql {
    /// `sql` with its `?` placeholders numbered when the backend wants `$1`, `$2`, ...
    fn placeholders(&self, sql: &str) -> String {
        if !self.numbered {
            return sql.to_owned();
        }
        let mut out = String::with_capacity(sql.len() + 8);
        let mut n = 0;
        for ch in sql.chars() {
            if ch == '?' {
                n += 1;
                out.push('$');
                out.push_str(&n.to_string());
            } else {
                out.push(ch);
            }
        }
        out
    }

    /// The condition a row in `state` meets now.
    fn state_condition(&self, state: State) -> String {
        let now = self.now;
        match state {
            State::Running => format!("state = '{IN_PROGRESS}' AND expires_at > {now}"),
            State::Done => format!("state = '{COMPLETED}' AND expires_at > {now}"),
            State::Expired => format!("expires_at <= {now}"),
        }
    }

    fn inspect(&self, table: &str) -> String {
        self.placeholders(&format!(
            "SELECT {key}, state, token, fingerprint, {rem}, outcome FROM {table} WHERE idempotency_key = ?",
            key = self.key,
            rem = self.remaining
        ))
    }

    fn list(&self, table: &str, query: &ListQuery) -> String {
        let mut sql = format!(
            "SELECT {key}, state, token, fingerprint, {rem} FROM {table} WHERE idempotency_key > ?",
            key = self.key,
            rem = self.remaining
        );
        if query.scope.is_some() {
            sql.push_str(if self.glob {
                " AND idempotency_key GLOB ?"
            } else {
                " AND idempotency_key LIKE ? ESCAPE '!'"
            });
        }
        if let Some(state) = query.state {
            let _ = write!(sql, " AND {}", self.state_condition(state));
        }
        if query.expiring_within.is_some() {
            let _ = write!(sql, " AND {} <= ?", self.remaining);
        }
        sql.push_str(" ORDER BY idempotency_key LIMIT ?");
        self.placeholders(&sql)
    }

    fn release(&self, table: &str, state: State) -> String {
        let condition = self.state_condition(state);
        self.placeholders(&format!("DELETE FROM {table} WHERE idempotency_key = ? AND token = ? AND {condition}"))
    }

    fn counts(&self, table: &str) -> String {
        format!(
            "SELECT {scope}, CASE WHEN expires_at <= {now} THEN 'expired' WHEN state = '{IN_PROGRESS}' THEN 'running' \
             ELSE 'done' END, COUNT(*) FROM {table} GROUP BY 1, 2",
            scope = self.scope,
            now = self.now
        )
    }

    fn soonest(&self, table: &str) -> String {
        format!(
            "SELECT {key}, {rem} FROM {table} WHERE {running} ORDER BY expires_at LIMIT 1",
            key = self.key,
            rem = self.remaining,
            running = self.state_condition(State::Running)
        )
    }
}

impl Sql {
    /// The pattern matching the keys of `scope`, for `LIKE` or `GLOB` as the backend uses.
    fn scope_pattern(&self, scope: &str) -> String {
        if self.glob { scope_glob(scope) } else { scope_pattern(scope) }
    }
}

/// `scope:*` for SQLite's `GLOB` (case-sensitive), its `*`, `?` and `[` each in brackets.
fn scope_glob(scope: &str) -> String {
    let mut pattern = String::with_capacity(scope.len() + 2);
    for ch in scope.chars() {
        match ch {
            '*' | '?' | '[' => {
                pattern.push('[');
                pattern.push(ch);
                pattern.push(']');
            }
            _ => pattern.push(ch),
        }
    }
    pattern.push_str(":*");
    pattern
}

/// `scope:%` for `LIKE ... ESCAPE '!'`.
fn scope_pattern(scope: &str) -> String {
    let mut pattern = String::with_capacity(scope.len() + 2);
    for ch in scope.chars() {
        if matches!(ch, '!' | '%' | '_') {
            pattern.push('!');
        }
        pattern.push(ch);
    }
    pattern.push_str(":%");
    pattern
}

/// An entry from the columns key, state, token, fingerprint, remaining microseconds.
fn entry(
    key: String,
    stored: &str,
    token: String,
    fingerprint: Option<String>,
    micros: i64,
    outcome: Option<String>,
) -> Result<Entry, StoreError> {
    let state = match stored {
        _ if micros <= 0 => State::Expired,
        IN_PROGRESS => State::Running,
        COMPLETED => State::Done,
        other => return Err(StoreError::Corrupt(format!("unknown state {other:?} in the row of {key:?}"))),
    };
    let remaining = (micros > 0).then(|| Duration::from_micros(micros.unsigned_abs()));
    let outcome = outcome.filter(|_| state != State::Running).map(|o| bytes::Bytes::from(o.into_bytes()));
    Ok(Entry { key, state, token, fingerprint, remaining, outcome })
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

macro_rules! sql_admin {
    ($($feature:literal, $dialect:ty, $db:ty, $sql:expr;)*) => {$(
        #[cfg(feature = $feature)]
        impl Admin for SqlStore<$dialect> {
            async fn inspect(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
                let fail = super::steps::backend::<$dialect>;
                let sql = $sql.inspect(self.table());
                let row = self
                    .step("inspect", async |s| {
                        sqlx::query::<$db>(sqlx::AssertSqlSafe(sql))
                            .bind(key.as_str())
                            .fetch_optional(&mut *s.conn)
                            .await
                            .map_err(fail)
                    })
                    .await?;
                let Some(row) = row else { return Ok(None) };
                let stored: String = row.try_get(1).map_err(fail)?;
                Ok(Some(entry(
                    row.try_get(0).map_err(fail)?,
                    &stored,
                    row.try_get(2).map_err(fail)?,
                    row.try_get(3).map_err(fail)?,
                    row.try_get(4).map_err(fail)?,
                    row.try_get(5).map_err(fail)?,
                )?))
            }

            async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
                let fail = super::steps::backend::<$dialect>;
                let size = query.page_size();
                let sql = $sql.list(self.table(), query);
                let mut q = sqlx::query::<$db>(sqlx::AssertSqlSafe(sql)).bind(query.cursor.clone().unwrap_or_default());
                if let Some(scope) = &query.scope {
                    q = q.bind($sql.scope_pattern(scope));
                }
                if let Some(within) = query.expiring_within {
                    q = q.bind(micros(within));
                }
                let q = q.bind(i64::try_from(size + 1).unwrap_or(i64::MAX));
                let rows = self.step("list", async |s| q.fetch_all(&mut *s.conn).await.map_err(fail)).await?;
                let mut entries = Vec::with_capacity(rows.len());
                for row in rows.iter().take(size) {
                    let stored: String = row.try_get(1).map_err(fail)?;
                    entries.push(entry(
                        row.try_get(0).map_err(fail)?,
                        &stored,
                        row.try_get(2).map_err(fail)?,
                        row.try_get(3).map_err(fail)?,
                        row.try_get(4).map_err(fail)?,
                        None,
                    )?);
                }
                let next = (rows.len() > size).then(|| entries.last().map(|e| e.key.clone())).flatten();
                Ok(Page { entries, next })
            }

            async fn release(&self, key: &Key, seen: &Entry) -> Result<Released, StoreError> {
                let sql = $sql.release(self.table(), seen.state);
                let done = self
                    .step("release", async |s| {
                        sqlx::query::<$db>(sqlx::AssertSqlSafe(sql))
                            .bind(key.as_str())
                            .bind(seen.token.as_str())
                            .execute(&mut *s.conn)
                            .await
                            .map_err(super::steps::backend::<$dialect>)
                    })
                    .await?;
                Ok(if done.rows_affected() == 1 { Released::Deleted } else { Released::Changed })
            }

            async fn stats(&self) -> Result<Stats, StoreError> {
                let fail = super::steps::backend::<$dialect>;
                let (counts_sql, soonest_sql) = ($sql.counts(self.table()), $sql.soonest(self.table()));
                let (rows, soonest) = self
                    .step("stats", async |s| {
                        let rows = sqlx::query::<$db>(sqlx::AssertSqlSafe(counts_sql))
                            .fetch_all(&mut *s.conn)
                            .await
                            .map_err(fail)?;
                        let soonest = sqlx::query::<$db>(sqlx::AssertSqlSafe(soonest_sql))
                            .fetch_optional(&mut *s.conn)
                            .await
                            .map_err(fail)?;
                        Ok((rows, soonest))
                    })
                    .await?;
                let mut counts = std::collections::BTreeMap::new();
                for row in rows {
                    let scope: String = row.try_get(0).map_err(fail)?;
                    let state: String = row.try_get(1).map_err(fail)?;
                    let count: i64 = row.try_get(2).map_err(fail)?;
                    let state = State::parse(&state).unwrap_or(State::Expired);
                    *counts.entry((scope, state)).or_default() += count.unsigned_abs();
                }
                let next = match soonest {
                    Some(row) => {
                        let key: String = row.try_get(0).map_err(fail)?;
                        let left: i64 = row.try_get(1).map_err(fail)?;
                        Some((key, Duration::from_micros(left.max(0).unsigned_abs())))
                    }
                    None => None,
                };
                Ok(crate::admin::stats_of(counts, next))
            }
        }
    )*};
}

sql_admin! {
    "postgres", super::PostgresDialect, sqlx::Postgres, Sql {
        now: "clock_timestamp()",
        remaining: "CAST(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000000 AS BIGINT)",
        scope: "split_part(idempotency_key, ':', 1)",
        key: "idempotency_key",
        numbered: true,
        glob: false,
    };
    "mysql", super::MySqlDialect, sqlx::MySql, Sql {
        now: "UTC_TIMESTAMP(6)",
        remaining: "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)",
        scope: "CONVERT(SUBSTRING_INDEX(idempotency_key, ':', 1) USING utf8mb4)",
        key: "CONVERT(idempotency_key USING utf8mb4)",
        numbered: false,
        glob: false,
    };
    "sqlite", super::SqliteDialect, sqlx::Sqlite, Sql {
        now: "strftime('%Y-%m-%d %H:%M:%f', 'now')",
        remaining: "CAST((julianday(expires_at) - julianday('now')) * 86400000000.0 AS INTEGER)",
        scope: "substr(idempotency_key, 1, instr(idempotency_key, ':') - 1)",
        key: "idempotency_key",
        numbered: false,
        glob: true,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_admin_scopes_are_escaped_for_like() {
        assert_eq!(scope_pattern("pay"), "pay:%");
        assert_eq!(scope_pattern("a_b%c!"), "a!_b!%c!!:%");
        assert_eq!(scope_glob("pay"), "pay:*");
        assert_eq!(scope_glob("a*b?c[d]"), "a[*]b[?]c[[]d]:*");
    }

    #[test]
    fn sql_admin_placeholders_are_numbered_for_postgres() {
        let sql = Sql { now: "n()", remaining: "r", scope: "s", key: "k", numbered: true, glob: false };
        assert_eq!(sql.placeholders("a = ? AND b = ?"), "a = $1 AND b = $2");
        let q = sql.list("t", &ListQuery::new(5).scope("s").state(State::Running));
        assert!(q.contains("idempotency_key > $1 AND idempotency_key LIKE $2") && q.ends_with("LIMIT $3"), "{q}");
    }
}

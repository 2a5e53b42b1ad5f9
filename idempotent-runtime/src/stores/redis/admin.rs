//! The Redis store's operator view ([`Admin`]): `SCAN` under the prefix, never `KEYS`.
//!
//! A listing walks the keyspace with `SCAN <cursor> MATCH <prefix><scope>:* COUNT 1000` and
//! reads each key it returns with the store's probe script (value and `PTTL` at one instant). On
//! a cluster it scans each master in turn (from `CLUSTER NODES`, sorted by address). Its cursor is
//! `<node>/<scan cursor>/<keys of that batch already returned>`, so a page that fills up in the
//! middle of a batch resumes there. A page that has scanned for 2 s ends short, with a cursor,
//! so a keyspace of millions of other keys pages instead of timing out. Values under the prefix that this store did not write
//! are skipped by listings and reported as [`StoreError::Corrupt`] by `inspect`.

use std::future::Future;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Cmd, RedisResult, Value};

use super::{KeyArg, PROBE, RELEASE, RedisConnection, RedisStore, backend, record};
use crate::admin::{Admin, Entry, ListQuery, Page, Released, State, Stats};
use crate::{Key, StoreError};

/// How many keys one `SCAN` call walks at least (its `COUNT`): the server filters by `MATCH`
/// after walking, so small batches over a large keyspace cost a round trip for few matches.
const SCAN_COUNT: usize = 1000;

/// How long one page keeps scanning before it is returned with fewer entries than asked for
/// (and a cursor): well under the store's step timeout (10 s by default).
const PAGE_BUDGET: Duration = Duration::from_secs(2);

/// A node to scan: `None` for the one server, a master's host and port on a cluster.
type Node = Option<(String, u16)>;

/// How a connection reaches every node holding keys.
trait Nodes: RedisConnection {
    /// The nodes to scan, in a stable order.
    fn nodes(&mut self) -> impl Future<Output = RedisResult<Vec<Node>>> + Send;
    /// Sends `cmd` to `node`.
    fn send(&mut self, node: &Node, cmd: Cmd) -> impl Future<Output = RedisResult<Value>> + Send;
}

impl Nodes for ConnectionManager {
    async fn nodes(&mut self) -> RedisResult<Vec<Node>> {
        Ok(vec![None])
    }

    async fn send(&mut self, _: &Node, cmd: Cmd) -> RedisResult<Value> {
        cmd.query_async(self).await
    }
}

#[cfg(feature = "redis-cluster")]
impl Nodes for redis::cluster_async::ClusterConnection {
    async fn nodes(&mut self) -> RedisResult<Vec<Node>> {
        let text: String = redis::cmd("CLUSTER").arg("NODES").query_async(self).await?;
        Ok(masters(&text).into_iter().map(Some).collect())
    }

    async fn send(&mut self, node: &Node, cmd: Cmd) -> RedisResult<Value> {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let Some((host, port)) = node.clone() else { return cmd.query_async(self).await };
        self.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port })).await
    }
}

/// The live masters of a `CLUSTER NODES` reply, sorted.
#[cfg_attr(not(feature = "redis-cluster"), allow(dead_code))]
fn masters(text: &str) -> Vec<(String, u16)> {
    let mut found: Vec<(String, u16)> = text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let address = fields.nth(1)?;
            let flags = fields.next()?;
            let is_master = flags.split(',').any(|f| f == "master") && !flags.contains("fail");
            let (host, port) = address.split('@').next()?.rsplit_once(':')?;
            is_master.then(|| Some((host.to_owned(), port.parse().ok()?))).flatten()
        })
        .collect();
    found.sort();
    found
}

#[allow(private_bounds, reason = "`Nodes` is implemented for both connection types of the crate")]
impl<C: Nodes> Admin for RedisStore<C> {
    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        self.bounded("inspect", async {
            let name = self.redis_key(key);
            let Some((value, pttl)) = self.probe(&name).await? else { return Ok(None) };
            entry(&name[self.prefix.len()..], value, pttl, true).map(Some)
        })
        .await
    }

    async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        self.bounded("list", self.list_now(query)).await
    }

    async fn release(&self, key: &Key, seen: &Entry) -> Result<Released, StoreError> {
        let state = match seen.state {
            State::Running => record::RUNNING,
            State::Done => record::DONE,
            // Redis deletes expired keys itself: nothing is left to release.
            State::Expired => return Ok(Released::Changed),
        };
        let owned = record::Owned { state, token: seen.token.as_bytes() };
        let key = self.key_arg(key);
        self.bounded("release", async {
            // The store's own release script: it deletes the record only if its header still starts
            // with `idempotent/1 <state> <token> ` as inspected.
            let sent = self
                .eval_sent(&RELEASE, &key, |cmd| {
                    cmd.arg(&owned);
                })
                .await;
            match sent.reply.map_err(backend)? {
                Value::Int(1) => Ok(Released::Deleted),
                // Sent again after its connection was lost: the first send may have deleted it.
                _ if sent.lost => Err(StoreError::backend(
                    "redis",
                    "the connection was lost with the release in flight, and the record is no longer as \
                     inspected: that release deleted it, or another caller changed it; inspect the key again",
                )),
                _ => Ok(Released::Changed),
            }
        })
        .await
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let (mut counts, mut next) = (std::collections::BTreeMap::new(), None);
        let mut cursor = Some(ListQuery::new(crate::admin::MAX_PAGE));
        while let Some(query) = cursor {
            let page = self.list(&query).await?;
            for entry in &page.entries {
                crate::admin::tally(&mut counts, &mut next, entry);
            }
            cursor = page.next.map(|next| query.clone().after(next));
        }
        Ok(crate::admin::stats_of(counts, next))
    }
}

#[allow(private_bounds, reason = "`Nodes` is implemented for both connection types of the crate")]
impl<C: Nodes> RedisStore<C> {
    /// The value and `PTTL` of the Redis key `name`, read together, or `None` if it is gone.
    async fn probe(&self, name: &str) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
        let arg = KeyArg { prefix: "", key: name.as_bytes() };
        let reply = self.eval(&PROBE, &arg, |_| {}).await.map_err(backend)?;
        let Value::Array(items) = reply else {
            return Err(StoreError::Corrupt(format!("unexpected reply from the Redis probe: {reply:?}")));
        };
        match <[Value; 2]>::try_from(items) {
            Ok([Value::BulkString(value), Value::Int(pttl)]) => Ok(Some((value, pttl))),
            Ok([Value::Nil | Value::Boolean(false), _]) => Ok(None),
            other => Err(StoreError::Corrupt(format!("unexpected reply from the Redis probe: {other:?}"))),
        }
    }

    async fn list_now(&self, query: &ListQuery) -> Result<Page, StoreError> {
        let size = query.page_size();
        let scope = query.scope.as_deref().map_or(String::new(), |s| glob_escape(&format!("{s}:")));
        let pattern = format!("{}{scope}*", glob_escape(&self.prefix));
        let (mut node, mut cursor, mut skip) = parse_cursor(query.cursor.as_deref())?;
        let mut entries = Vec::new();
        let mut connection = self.connection();
        let nodes = connection.nodes().await.map_err(backend)?;
        let started = tokio::time::Instant::now();
        while let Some(at) = nodes.get(node) {
            // A keyspace full of other keys yields few matches per batch: past the time budget,
            // the page ends short, with a cursor to go on from, instead of running into the
            // step timeout.
            if started.elapsed() >= PAGE_BUDGET {
                return Ok(Page { entries, next: Some(format!("{node}/{cursor}/0")) });
            }
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(size.max(SCAN_COUNT));
            let (after, names): (u64, Vec<Vec<u8>>) =
                redis::from_redis_value(connection.send(at, scan).await.map_err(backend)?)
                    .map_err(|e| StoreError::Corrupt(format!("unexpected reply to SCAN: {e}")))?;
            for (index, name) in names.iter().enumerate().skip(skip) {
                if entries.len() == size {
                    return Ok(Page { entries, next: Some(format!("{node}/{cursor}/{index}")) });
                }
                let Ok(name) = std::str::from_utf8(name) else { continue };
                let Some((value, pttl)) = self.probe(name).await? else { continue };
                // Another program's value under the prefix is not listed.
                let Ok(found) = entry(&name[self.prefix.len()..], value, pttl, false) else { continue };
                if query.matches(&found) {
                    entries.push(found);
                }
            }
            skip = 0;
            if after == 0 {
                node += 1;
            }
            cursor = after;
            if entries.len() == size {
                let next = (node < nodes.len()).then(|| format!("{node}/{cursor}/0"));
                return Ok(Page { entries, next });
            }
        }
        Ok(Page { entries, next: None })
    }
}

/// The record of `key` (without the prefix) from its stored value and `PTTL`.
fn entry(key: &str, value: Vec<u8>, pttl: i64, with_outcome: bool) -> Result<Entry, StoreError> {
    let header_end = value.iter().position(|&b| b == b'\n').unwrap_or(value.len());
    let token =
        std::str::from_utf8(&value[..header_end]).ok().and_then(|h| h.split(' ').nth(2)).unwrap_or("").to_owned();
    let remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
    Ok(match record::parse(value, || key.as_bytes().to_vec())? {
        record::Parsed::Running { fingerprint, .. } => Entry {
            key: key.to_owned(),
            state: State::Running,
            token,
            fingerprint: fingerprint.map(|fp| fp.as_str().to_owned()),
            remaining,
            outcome: None,
        },
        record::Parsed::Done(record) => Entry {
            key: key.to_owned(),
            state: State::Done,
            token,
            fingerprint: record.fingerprint.map(|fp| fp.as_str().to_owned()),
            remaining,
            outcome: with_outcome.then_some(record.outcome),
        },
    })
}

/// `<node>/<scan cursor>/<skip>`, or the start.
fn parse_cursor(cursor: Option<&str>) -> Result<(usize, u64, usize), StoreError> {
    let Some(cursor) = cursor else { return Ok((0, 0, 0)) };
    let mut parts = cursor.split('/').map(str::parse::<u64>);
    let parsed = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(Ok(node)), Some(Ok(scan)), Some(Ok(skip)), None) => {
            usize::try_from(node).ok().zip(usize::try_from(skip).ok()).map(|(node, skip)| (node, scan, skip))
        }
        _ => None,
    };
    parsed.ok_or_else(|| StoreError::rejected("redis", format!("{cursor:?} is not a cursor of a Redis listing")))
}

/// `text` with the characters `SCAN MATCH` gives a meaning escaped.
fn glob_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for ch in text.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(ch);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_admin_escapes_globs_and_reads_cursors() {
        assert_eq!(glob_escape("app:{x}*[a]?\\"), "app:{x}\\*\\[a\\]\\?\\\\");
        assert_eq!(parse_cursor(None).unwrap(), (0, 0, 0));
        assert_eq!(parse_cursor(Some("2/1234/7")).unwrap(), (2, 1234, 7));
        assert!(parse_cursor(Some("nope")).is_err() && parse_cursor(Some("1/2")).is_err());
    }

    #[test]
    fn redis_admin_reads_the_masters_of_cluster_nodes() {
        let nodes = "a1 127.0.0.1:7101@17101 master - 0 0 2 connected 5461-10922\n\
                     b2 127.0.0.1:7103@17103 slave a1 0 0 2 connected\n\
                     c3 127.0.0.1:7100@17100 myself,master - 0 0 1 connected 0-5460\n\
                     d4 127.0.0.1:7102@17102 master,fail - 0 0 3 connected\n";
        assert_eq!(masters(nodes), [("127.0.0.1".to_owned(), 7100), ("127.0.0.1".to_owned(), 7101)]);
    }

    #[test]
    fn redis_admin_entries_keep_the_token_of_done_records() {
        let token = "0123456789abcdef0123456789abcdef";
        let done = format!("idempotent/1 done {token} -\n{{\"Ok\":1}}").into_bytes();
        let e = entry("s:k", done, 5000, true).unwrap();
        assert_eq!((e.state, e.token.as_str(), e.remaining), (State::Done, token, Some(Duration::from_secs(5))));
        assert_eq!(e.outcome.as_deref(), Some(&b"{\"Ok\":1}"[..]));
        assert!(entry("s:k", b"junk".to_vec(), 1, false).is_err());
    }
}

//! The operator's view of a store: inspect a key, list keys page by page, release a stuck claim,
//! count what the store holds.
//!
//! [`Admin`] is separate from [`Store`](crate::Store): the protocol never needs it, so a store
//! written outside this crate need not implement it. Every built-in pooled store does
//! ([`MemoryStore`](crate::MemoryStore), `RedisStore`, `RedisClusterStore`, the pooled SQL stores) and so does an
//! [`AnyStore`](crate::AnyStore) opened by [`AnyStore::from_url`](crate::AnyStore::from_url).
//! The `idempotent` command-line tool (crate `idempotent-cli`) is built on it.
//!
//! Listing is paged and cheap on the server: Redis walks its keys with `SCAN` under the store's
//! prefix (never `KEYS`), the SQL stores read one page of the primary-key index per call. No
//! method loads the whole store into memory, except on the memory store, which is in memory.
//!
//! No store records when a key was claimed, only when its lease or retention ends: so a listing
//! can be filtered by the time *left* ([`ListQuery::expiring_within`]), not by age.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use crate::{Key, StoreError};

/// The largest page [`Admin::list`] returns, whatever [`ListQuery::limit`] asks for.
pub const MAX_PAGE: usize = 1000;

/// What a record is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum State {
    /// A live claim: a call is running, or crashed less than one lease ago.
    Running,
    /// A completed call whose outcome is replayed.
    Done,
    /// A claim or record whose lease or retention has ended, not yet deleted (SQL and memory
    /// stores keep them until purged; Redis deletes them by itself).
    Expired,
}

impl State {
    /// `running`, `done` or `expired`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Done => "done",
            State::Expired => "expired",
        }
    }

    /// Parses `running`, `done` or `expired`.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "running" => Some(State::Running),
            "done" => Some(State::Done),
            "expired" => Some(State::Expired),
            _ => None,
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One record as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Entry {
    /// `scope:key`, as the store indexes it.
    pub key: String,
    /// What the record is now.
    pub state: State,
    /// The owner token of the call that claimed (and, if done, completed) the key.
    pub token: String,
    /// The request's fingerprint, if the call had one.
    pub fingerprint: Option<String>,
    /// How long the lease (running) or the retention (done) still lasts; `None` when expired or
    /// unknown.
    pub remaining: Option<Duration>,
    /// The encoded outcome of a completed record (only from [`Admin::inspect`]; a listing leaves
    /// it out).
    pub outcome: Option<Bytes>,
}

impl Entry {
    /// The scope part of [`key`](Self::key).
    #[must_use]
    pub fn scope(&self) -> &str {
        self.key.split_once(':').map_or(&*self.key, |(scope, _)| scope)
    }

    /// The caller's key part of [`key`](Self::key).
    #[must_use]
    pub fn user_key(&self) -> &str {
        self.key.split_once(':').map_or("", |(_, key)| key)
    }
}

/// Which records [`Admin::list`] returns, and from where.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListQuery {
    /// Only this scope.
    pub scope: Option<String>,
    /// Only records in this state.
    pub state: Option<State>,
    /// Only records whose lease or retention ends within this time (expired ones included).
    pub expiring_within: Option<Duration>,
    /// At most this many entries (capped at [`MAX_PAGE`]; 0 means the cap).
    pub limit: usize,
    /// Where the previous page ended ([`Page::next`]); `None` for the first page.
    pub cursor: Option<String>,
}

impl ListQuery {
    /// The first page of every record, at most `limit` entries.
    #[must_use]
    pub fn new(limit: usize) -> Self {
        ListQuery { limit, ..ListQuery::default() }
    }

    /// Only `scope`.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Only records in `state`.
    #[must_use]
    pub fn state(mut self, state: State) -> Self {
        self.state = Some(state);
        self
    }

    /// Only records ending within `within`.
    #[must_use]
    pub fn expiring_within(mut self, within: Duration) -> Self {
        self.expiring_within = Some(within);
        self
    }

    /// The page after the one that returned `cursor`.
    #[must_use]
    pub fn after(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }

    /// The page size asked for, within `1..=MAX_PAGE`.
    #[must_use]
    pub fn page_size(&self) -> usize {
        if self.limit == 0 { MAX_PAGE } else { self.limit.min(MAX_PAGE) }
    }

    /// `true` if `entry` passes the filters (used by stores that filter on the client side).
    #[must_use]
    pub fn matches(&self, entry: &Entry) -> bool {
        self.scope.as_deref().is_none_or(|scope| entry.scope() == scope)
            && self.state.is_none_or(|state| entry.state == state)
            && self.expiring_within.is_none_or(|within| entry.remaining.is_none_or(|left| left <= within))
    }
}

/// One page of a listing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The entries, without outcomes.
    pub entries: Vec<Entry>,
    /// Pass it to [`ListQuery::after`] for the next page; `None` when this was the last. A page
    /// may hold fewer entries than asked for and still have a next one (Redis ends a page after
    /// scanning for 2 s, so a large keyspace pages instead of timing out).
    pub next: Option<String>,
}

/// Counts of one scope's records in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Count {
    /// The scope.
    pub scope: String,
    /// The state.
    pub state: State,
    /// How many records.
    pub count: u64,
}

/// What [`Admin::stats`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Records per scope and state, sorted by scope then state.
    pub counts: Vec<Count>,
    /// The running claim whose lease ends first (the likeliest to be stuck), and its time left.
    pub next_to_expire: Option<(String, Duration)>,
}

/// What [`Admin::release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Released {
    /// The record was deleted: the next call with the key runs its body.
    Deleted,
    /// The record is not the one seen (another token, another state, or gone): nothing changed.
    Changed,
}

/// The operator's methods of a store. See the [module docs](self).
pub trait Admin: Send + Sync {
    /// The record of `key`, with its outcome, or `None` if the store holds none.
    fn inspect(&self, key: &Key) -> impl Future<Output = Result<Option<Entry>, StoreError>> + Send;

    /// One page of records, ordered by key where the store can (SQL, memory), in `SCAN` order on
    /// Redis. A page may hold fewer entries than asked for and still have a next one.
    fn list(&self, query: &ListQuery) -> impl Future<Output = Result<Page, StoreError>> + Send;

    /// Deletes `key`'s record if it still is `seen`: the same token in the same state
    /// ([`State::Running`] or [`State::Done`]), so a claim taken or completed since it was
    /// inspected is left alone. Releasing a running claim whose call is in fact alive lets a
    /// duplicate run; that call then gets [`Error::LeaseLost`](crate::Error::LeaseLost).
    ///
    /// Fails when the store cannot tell what happened: for example, on Redis, a release sent
    /// again after its connection was lost in flight that finds the record gone
    /// ([`StoreError::Backend`], which says to inspect the key again).
    fn release(&self, key: &Key, seen: &Entry) -> impl Future<Output = Result<Released, StoreError>> + Send;

    /// Counts per scope and state, and the running claim closest to its lease's end.
    fn stats(&self) -> impl Future<Output = Result<Stats, StoreError>> + Send;
}

/// Adds `entry` to `stats` (for stores that count on the client side).
pub(crate) fn tally(
    counts: &mut std::collections::BTreeMap<(String, State), u64>,
    next: &mut Option<(String, Duration)>,
    entry: &Entry,
) {
    *counts.entry((entry.scope().to_owned(), entry.state)).or_default() += 1;
    if entry.state == State::Running
        && let Some(left) = entry.remaining
        && next.as_ref().is_none_or(|(_, soonest)| left < *soonest)
    {
        *next = Some((entry.key.clone(), left));
    }
}

/// The [`Stats`] of a finished tally.
pub(crate) fn stats_of(
    counts: std::collections::BTreeMap<(String, State), u64>,
    next: Option<(String, Duration)>,
) -> Stats {
    Stats {
        counts: counts.into_iter().map(|((scope, state), count)| Count { scope, state, count }).collect(),
        next_to_expire: next,
    }
}

/// Forwards every method of `Admin` through a pointer type.
macro_rules! forward_admin {
    ($([$($generics:tt)*] $pointer:ty;)*) => {$(
        impl<$($generics)*> Admin for $pointer {
            fn inspect(&self, key: &Key) -> impl Future<Output = Result<Option<Entry>, StoreError>> + Send {
                (**self).inspect(key)
            }

            fn list(&self, query: &ListQuery) -> impl Future<Output = Result<Page, StoreError>> + Send {
                (**self).list(query)
            }

            fn release(&self, key: &Key, seen: &Entry) -> impl Future<Output = Result<Released, StoreError>> + Send {
                (**self).release(key, seen)
            }

            fn stats(&self) -> impl Future<Output = Result<Stats, StoreError>> + Send {
                (**self).stats()
            }
        }
    )*};
}

forward_admin! {
    [A: Admin + ?Sized] &A;
    [A: Admin + ?Sized] Box<A>;
    [A: Admin + ?Sized] std::sync::Arc<A>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, state: State, left: Option<u64>) -> Entry {
        Entry {
            key: key.into(),
            state,
            token: "0a".into(),
            fingerprint: None,
            remaining: left.map(Duration::from_secs),
            outcome: None,
        }
    }

    #[test]
    fn admin_queries_filter_by_scope_state_and_time_left() {
        let running = entry("pay:1", State::Running, Some(10));
        let done = entry("ship:1", State::Done, Some(3600));
        let q = ListQuery::new(10).scope("pay");
        assert!(q.matches(&running) && !q.matches(&done));
        let q = ListQuery::new(10).state(State::Done);
        assert!(!q.matches(&running) && q.matches(&done));
        let q = ListQuery::new(10).expiring_within(Duration::from_secs(60));
        assert!(q.matches(&running) && !q.matches(&done));
        assert_eq!(ListQuery::new(0).page_size(), MAX_PAGE);
        assert_eq!(ListQuery::new(5000).page_size(), MAX_PAGE);
        assert_eq!((running.scope(), running.user_key()), ("pay", "1"));
    }

    #[tokio::test]
    async fn admin_memory_store_lists_releases_fenced_and_counts() {
        use crate::{Claim, ClaimRequest, Completion, MemoryStore, Store, Token};
        let store = MemoryStore::new();
        let lease = Duration::from_secs(60);
        let (a, b) = (Key::new("pay", &"a").unwrap(), Key::new("pay", &"b").unwrap());
        let (ta, tb) = (Token::new(), Token::new());
        assert_eq!(store.claim(&ClaimRequest::new(&a, &ta, None, lease)).await.unwrap(), Claim::Claimed);
        store.claim(&ClaimRequest::new(&b, &tb, None, lease)).await.unwrap();
        store.complete(&Completion::new(&b, &tb, None, b"{\"Ok\":1}", lease)).await.unwrap();
        let first = store.list(&ListQuery::new(1).scope("pay")).await.unwrap();
        assert_eq!(first.entries.len(), 1);
        let rest = store.list(&ListQuery::new(1).scope("pay").after(first.next.clone().unwrap())).await.unwrap();
        assert_eq!((first.entries[0].key.as_str(), rest.entries[0].key.as_str(), rest.next), ("pay:a", "pay:b", None));
        let running = store.list(&ListQuery::new(10).state(State::Running)).await.unwrap();
        assert_eq!(running.entries.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["pay:a"]);
        let done = store.inspect(&b).await.unwrap().unwrap();
        assert_eq!(done.outcome.as_deref(), Some(&b"{\"Ok\":1}"[..]));
        // Seen running, then completed: the release is refused.
        let seen = store.inspect(&a).await.unwrap().unwrap();
        store.complete(&Completion::new(&a, &ta, None, b"{}", lease)).await.unwrap();
        assert_eq!(Admin::release(&store, &a, &seen).await.unwrap(), Released::Changed);
        let now_done = store.inspect(&a).await.unwrap().unwrap();
        assert_eq!(Admin::release(&store, &a, &now_done).await.unwrap(), Released::Deleted);
        assert_eq!(store.inspect(&a).await.unwrap(), None);
        let stats = store.stats().await.unwrap();
        assert_eq!(stats.counts, [Count { scope: "pay".into(), state: State::Done, count: 1 }]);
    }

    #[test]
    fn admin_stats_count_per_scope_and_state() {
        let (mut counts, mut next) = (std::collections::BTreeMap::new(), None);
        for e in [
            entry("a:1", State::Running, Some(30)),
            entry("a:2", State::Running, Some(5)),
            entry("a:3", State::Done, Some(5)),
            entry("b:1", State::Expired, None),
        ] {
            tally(&mut counts, &mut next, &e);
        }
        let stats = stats_of(counts, next);
        let shown: Vec<_> = stats.counts.iter().map(|c| (c.scope.as_str(), c.state, c.count)).collect();
        assert_eq!(shown, [("a", State::Running, 2), ("a", State::Done, 1), ("b", State::Expired, 1)]);
        assert_eq!(stats.next_to_expire, Some(("a:2".to_owned(), Duration::from_secs(5))));
    }
}

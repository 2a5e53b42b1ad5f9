//! A local replay cache in front of any store (feature `cache`): completed records are replayed
//! from this process's memory, with no round trip to the store.
//!
//! ```
//! use idempotent_runtime::stores::cache::CachedStore;
//! use idempotent_runtime::{idempotent, Error, MemoryStore};
//!
//! #[idempotent(key = id, store = store)]
//! async fn charge(store: &CachedStore<MemoryStore>, id: &str) -> Result<u64, Error> {
//!     Ok(100)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = CachedStore::new(MemoryStore::new()).with_max_entries(100_000).with_max_bytes(64 << 20);
//! charge(&store, "req-1").await.unwrap(); // claim + complete in the store; the record is cached
//! charge(&store, "req-1").await.unwrap(); // replayed from the cache
//! assert_eq!(store.stats().hits, 1);
//! # }
//! ```
//!
//! # What is cached, and for how long
//!
//! - **Records this process completed**, from the moment the store confirms the completion until
//!   their retention ends. The retention is counted from *before* the completion was sent, so the
//!   cached copy never outlives the store's record.
//! - **Completed records the store returned to a claim** (written by another process, or before
//!   this one started), for at most [`with_learned_ttl`](CachedStore::with_learned_ttl) (default 10 s): the
//!   store does not say how much of their retention is left, so such a record can be replayed from
//!   the cache up to that long after its retention ended in the store. Set it to zero to cache
//!   only this process's own records.
//! - **Never a claim in progress**: a running claim always goes to the store, so mutual exclusion
//!   is exactly the store's.
//!
//! A hit returns the record as the store would (`Claim::Completed`), and the protocol checks the
//! request's fingerprint against the record's on every replay, cached or not: a reused key with
//! another request is refused either way.
//!
//! The cache is bounded by entries and by bytes ([`with_max_entries`](CachedStore::with_max_entries),
//! [`with_max_bytes`](CachedStore::with_max_bytes)); past either bound, the least useful entries are evicted
//! (by the `TinyLFU` policy of [`moka`]) and simply read from the store again.
//!
//! # Deleting a record by hand
//!
//! An operator who deletes a record in the store (to let a request run again) changes nothing for
//! the processes that cached it: each keeps replaying its copy until the copy expires (the
//! record's retention end, or `learned_ttl` for a record it found in the store). Only processes
//! without a copy run the request again. To make a manual delete take effect at once, call
//! [`invalidate`](CachedStore::invalidate) (or [`invalidate_all`](CachedStore::invalidate_all)) in
//! every process, or restart them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use moka::Expiry;
use moka::sync::Cache;

use crate::store::forward_store;
use crate::{Claim, ClaimRequest, Completion, Fingerprint, Key, Record, Store, StoreError};

/// The default bound on cached records: 10,000.
pub const DEFAULT_MAX_ENTRIES: u64 = 10_000;
/// The default bound on the bytes the cached records take (keys, fingerprints and outcomes): 64 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 64 << 20;
/// How long a completed record found in the store is cached by default: 10 s.
pub const DEFAULT_LEARNED_TTL: Duration = Duration::from_secs(10);

/// The bytes an entry is charged beyond its key and outcome (bookkeeping, fingerprint).
const ENTRY_OVERHEAD: usize = 128;

/// A store with a local cache of completed records in front: replays without a round trip.
///
/// It implements [`Store`] by forwarding every step to the wrapped store, except a claim on a key
/// whose completed record is in the cache, which returns that record at once. See the
/// [module docs](self) for what is cached, for how long, and what a manual delete means.
/// Cloning gives another handle to the same cache.
pub struct CachedStore<S> {
    inner: S,
    shared: Arc<Shared>,
}

struct Shared {
    records: Cache<Box<str>, Arc<Cached>>,
    limits: Limits,
    /// `cache+<the inner store's name>`, made once.
    name: OnceLock<&'static str>,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// What a cache is built with: its two bounds and how long a record found in the store is kept.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_entries: u64,
    max_bytes: u64,
    learned_ttl: Duration,
}

struct Cached {
    fingerprint: Option<Fingerprint>,
    outcome: Bytes,
    /// When the copy stops being replayed, on Tokio's clock (moka's own expiry, on the system
    /// clock, only evicts it from memory).
    expires: Instant,
}

/// Counters of a [`CachedStore`]'s lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Claims answered from the cache.
    pub hits: u64,
    /// Claims sent to the store.
    pub misses: u64,
    /// Records cached now (approximately: evictions are applied in batches).
    pub entries: u64,
}

struct UntilExpiry;

impl UntilExpiry {
    #[allow(clippy::unnecessary_wraps)] // what `Expiry` returns
    fn left(expires: Instant) -> Option<Duration> {
        Some(expires.saturating_duration_since(Instant::now()))
    }
}

impl Expiry<Box<str>, Arc<Cached>> for UntilExpiry {
    fn expire_after_create(&self, _: &Box<str>, value: &Arc<Cached>, _: std::time::Instant) -> Option<Duration> {
        Self::left(value.expires)
    }

    fn expire_after_update(
        &self,
        _: &Box<str>,
        value: &Arc<Cached>,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Self::left(value.expires)
    }
}

impl Shared {
    #[allow(clippy::borrowed_box)] // the weigher's signature is moka's
    fn new(limits: Limits) -> Self {
        let limits = Limits { max_entries: limits.max_entries.max(1), max_bytes: limits.max_bytes.max(1), ..limits };
        let Limits { max_entries, max_bytes, .. } = limits;
        // One weighted capacity enforces both bounds: every entry weighs at least
        // `max_bytes / max_entries`, so no more than `max_entries` fit, and at least its size in
        // bytes, so they never take more than `max_bytes`.
        let floor = max_bytes / max_entries;
        let records = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(move |key: &Box<str>, value: &Arc<Cached>| {
                let bytes = (key.len() + value.outcome.len() + ENTRY_OVERHEAD) as u64;
                u32::try_from(bytes.max(floor)).unwrap_or(u32::MAX)
            })
            .expire_after(UntilExpiry)
            .build();
        Shared { records, limits, name: OnceLock::new(), hits: AtomicU64::new(0), misses: AtomicU64::new(0) }
    }
}

impl<S> CachedStore<S> {
    /// `inner` with a cache of at most [`DEFAULT_MAX_ENTRIES`] records and [`DEFAULT_MAX_BYTES`]
    /// bytes, caching records found in the store for [`DEFAULT_LEARNED_TTL`].
    pub fn new(inner: S) -> Self {
        CachedStore {
            inner,
            shared: Arc::new(Shared::new(Limits {
                max_entries: DEFAULT_MAX_ENTRIES,
                max_bytes: DEFAULT_MAX_BYTES,
                learned_ttl: DEFAULT_LEARNED_TTL,
            })),
        }
    }

    /// Caches at most `entries` records (default [`DEFAULT_MAX_ENTRIES`]). Starts an empty cache:
    /// set the limits when building the store.
    #[must_use]
    pub fn with_max_entries(self, entries: u64) -> Self {
        self.rebuild(|limits| Limits { max_entries: entries, ..limits })
    }

    /// Caches records taking at most `bytes` in all (keys and outcomes, plus a small overhead per
    /// entry; default [`DEFAULT_MAX_BYTES`]). Starts an empty cache.
    #[must_use]
    pub fn with_max_bytes(self, bytes: u64) -> Self {
        self.rebuild(|limits| Limits { max_bytes: bytes, ..limits })
    }

    /// How long a completed record returned by the store (not completed by this process) is
    /// cached (default [`DEFAULT_LEARNED_TTL`]; zero: never). It may be replayed from the cache
    /// up to this long after its retention ended in the store. Starts an empty cache.
    #[must_use]
    pub fn with_learned_ttl(self, ttl: Duration) -> Self {
        self.rebuild(|limits| Limits { learned_ttl: ttl, ..limits })
    }

    /// This store with a new, empty cache, built with its limits changed by `change`.
    fn rebuild(self, change: impl FnOnce(Limits) -> Limits) -> Self {
        let limits = change(self.shared.limits);
        CachedStore { inner: self.inner, shared: Arc::new(Shared::new(limits)) }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Forgets the cached record of `key` in this process, so the next claim asks the store (after
    /// a manual delete in the store, for instance).
    pub fn invalidate(&self, key: &Key) {
        self.shared.records.invalidate(key.as_str());
    }

    /// Forgets every cached record in this process.
    pub fn invalidate_all(&self) {
        self.shared.records.invalidate_all();
    }

    /// Hits, misses and the number of cached records.
    #[must_use]
    pub fn stats(&self) -> CacheStats {
        self.shared.records.run_pending_tasks();
        CacheStats {
            hits: self.shared.hits.load(Ordering::Relaxed),
            misses: self.shared.misses.load(Ordering::Relaxed),
            entries: self.shared.records.entry_count(),
        }
    }

    fn cached(&self, key: &Key, now: Instant) -> Option<Arc<Cached>> {
        let cached = self.shared.records.get(key.as_str())?;
        if cached.expires > now {
            return Some(cached);
        }
        self.shared.records.invalidate(key.as_str());
        None
    }

    fn cache(&self, key: &Key, cached: Cached) {
        if cached.expires > Instant::now() {
            self.shared.records.insert(key.as_str().into(), Arc::new(cached));
        }
    }
}

impl<S: Clone> Clone for CachedStore<S> {
    fn clone(&self) -> Self {
        CachedStore { inner: self.inner.clone(), shared: Arc::clone(&self.shared) }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("inner", &self.inner)
            .field("limits", &self.shared.limits)
            .finish_non_exhaustive()
    }
}

impl<S: Store> CachedStore<S> {
    /// The cached record of `request`'s key, as a claim's answer, if it was live at `now`.
    fn hit(&self, request: &ClaimRequest<'_>, now: Instant) -> Option<Claim> {
        let Some(cached) = self.cached(request.key, now) else {
            self.shared.misses.fetch_add(1, Ordering::Relaxed);
            crate::observe::cache_lookup(false);
            return None;
        };
        self.shared.hits.fetch_add(1, Ordering::Relaxed);
        crate::observe::cache_lookup(true);
        Some(Claim::Completed(Record::new(cached.fingerprint.clone(), cached.outcome.clone())))
    }

    /// Keeps a record the store answered `request` with, counted from `now`.
    fn learn(&self, request: &ClaimRequest<'_>, now: Instant, claim: &Claim) {
        if let Claim::Completed(record) = claim
            && let Some(expires) = now.checked_add(self.shared.limits.learned_ttl)
        {
            let cached = Cached { fingerprint: record.fingerprint.clone(), outcome: record.outcome.clone(), expires };
            self.cache(request.key, cached);
        }
    }

    /// Keeps the record `completion` wrote, counted from `sent`, before the store was asked.
    fn recorded(&self, completion: &Completion<'_>, sent: Instant) {
        if let Some(expires) = sent.checked_add(completion.retention) {
            let cached = Cached {
                fingerprint: completion.fingerprint.cloned(),
                outcome: Bytes::copy_from_slice(completion.outcome),
                expires,
            };
            self.cache(completion.key, cached);
        }
    }
}

impl<S: Store> Store for CachedStore<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // The caller's reading, taken just before it called (`sent_at`): a copy is replayed if it
        // was live then, and a learned one expires counted from then, never later.
        let now = request.sent.unwrap_or_else(Instant::now);
        if let Some(hit) = self.hit(request, now) {
            return Ok(hit);
        }
        let claim = self.inner.claim(request).await?;
        self.learn(request, now, &claim);
        Ok(claim)
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        // Counted from before the request: the cached copy never outlives the store's record.
        let sent = Instant::now();
        self.inner.complete(completion).await?;
        self.recorded(completion, sent);
        Ok(())
    }

    /// The cached records answered here, the other requests in one batch of the store's.
    async fn claim_many(&self, requests: &[ClaimRequest<'_>]) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let now = Instant::now();
        let mut answers = Vec::with_capacity(requests.len());
        let mut misses = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            let hit = self.hit(request, request.sent.unwrap_or(now));
            if hit.is_none() {
                misses.push(i);
            }
            answers.push(hit.map(Ok));
        }
        if !misses.is_empty() {
            let asked: Vec<ClaimRequest<'_>> = misses.iter().map(|&i| requests[i]).collect();
            let replies = self.inner.claim_many(&asked).await?;
            for (&i, reply) in misses.iter().zip(replies) {
                if let Ok(claim) = &reply {
                    self.learn(&requests[i], requests[i].sent.unwrap_or(now), claim);
                }
                answers[i] = Some(reply);
            }
        }
        let missing = || StoreError::Corrupt("the store answered fewer claims than it was asked".into());
        answers.into_iter().map(|answer| answer.ok_or_else(missing)).collect()
    }

    /// The store's batch; each record it wrote is kept.
    async fn complete_many(&self, completions: &[Completion<'_>]) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let sent = Instant::now();
        let recorded = self.inner.complete_many(completions).await?;
        for (completion, result) in completions.iter().zip(&recorded) {
            if result.is_ok() {
                self.recorded(completion, sent);
            }
        }
        Ok(recorded)
    }

    forward_store!(direct CachedStore::inner; release extend detach max_record_bytes process_local);

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.shared.records.run_pending_tasks();
        self.inner.purge_expired().await
    }

    fn name(&self) -> &'static str {
        self.shared.name.get_or_init(|| intern(&format!("cache+{}", self.inner.name())))
    }
}

/// `name` as a `&'static str` for metric labels, leaked once per distinct text (store names are
/// few: one per store type in a process).
fn intern(name: &str) -> &'static str {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let names = names.get_or_insert_with(HashSet::new);
    if let Some(known) = names.get(name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.insert(leaked);
    leaked
}

#[cfg(test)]
mod tests {
    use super::CachedStore;
    use crate::store::forward_store;
    use crate::{Call, Error, MemoryStore, Store};

    /// The memory store, as a store shared with other processes: calls on it draw their owner
    /// tokens from the operating system.
    struct Shared(MemoryStore);

    impl Shared {
        fn inner(&self) -> &MemoryStore {
            &self.0
        }
    }

    impl Store for Shared {
        forward_store!(direct Shared::inner; claim complete release extend detach max_record_bytes);
    }

    /// A replay answered from the cache never sends its owner token, so it draws none: on this
    /// machine the draw, a system call, cost about half a microsecond.
    #[tokio::test]
    async fn memory_cache_hits_draw_no_owner_token() {
        let draws = || crate::random::DRAWS.with(std::cell::Cell::get);
        let store = CachedStore::new(Shared(MemoryStore::new()));
        assert!(!store.process_local());
        let call = || Call::new("cache-tokens", "k").run(&store, async { Ok::<_, Error>(7) });
        let before = draws();
        assert_eq!(call().await.unwrap(), 7);
        assert_eq!(draws(), before + 1, "the first execution claims with a drawn token");
        for _ in 0..10 {
            assert_eq!(call().await.unwrap(), 7);
        }
        assert_eq!(store.stats().hits, 10);
        assert_eq!(draws(), before + 1, "ten replays from the cache drew no token");
    }
}

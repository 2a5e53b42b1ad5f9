//! The in-memory store: sharded, lease- and TTL-expiring, purged as it goes.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Detached, Fingerprint, Key, Record, Store, StoreError, Token};

const SHARDS: usize = 64;
/// A shard sweeps out expired entries after this many inserts, or after as many inserts as half
/// its size if that is more: sweeping costs O(1) per insert, amortised.
const MIN_INSERTS_BETWEEN_SWEEPS: usize = 64;

/// A store in this process's memory: the embedded default, and the store for tests.
///
/// Records vanish when the process exits, so it makes calls idempotent only within one process.
/// The map is split into 64 independently locked shards (no global lock on the hot path); expired
/// claims and records are swept out as new keys arrive, so memory follows what is live.
/// Cloning gives another handle to the same records.
///
/// ```
/// use idempotent_runtime::{idempotent, Error, MemoryStore};
///
/// #[idempotent(key = order, store = store)]
/// async fn ship(store: &MemoryStore, order: u64) -> Result<String, Error> {
///     Ok(format!("shipped {order}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = MemoryStore::new();
/// assert_eq!(ship(&store, 7).await.unwrap(), "shipped 7");
/// assert_eq!(store.len(), 1);
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: std::hash::RandomState,
    max_record_bytes: usize,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<Box<str>, Entry>,
    inserts_since_sweep: usize,
}

struct Entry {
    fingerprint: Option<Fingerprint>,
    expires: Instant,
    state: State,
}

enum State {
    InProgress(Token),
    /// The outcome, and the token of the call that recorded it (a repeated completion by that
    /// token succeeds).
    Completed(Token, Arc<[u8]>),
}

impl MemoryStore {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        Self::with_max_record_bytes(DEFAULT_MAX_RECORD_BYTES)
    }

    /// An empty store that records outcomes of at most `limit` encoded bytes.
    #[must_use]
    pub fn with_max_record_bytes(limit: usize) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        MemoryStore {
            inner: Arc::new(Inner { shards, hasher: std::hash::RandomState::new(), max_record_bytes: limit }),
        }
    }

    /// How many entries (claims and records, live or expired but not yet swept) the store holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).entries.len()).sum()
    }

    /// `true` when the store holds no entries.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &Key) -> MutexGuard<'_, Shard> {
        let hash = self.inner.hasher.hash_one(key.as_str());
        // The shard count is a power of two; the low bits of the hash pick one.
        #[allow(clippy::cast_possible_truncation)]
        let index = (hash as usize) & (SHARDS - 1);
        lock(&self.inner.shards[index])
    }

    fn release_now(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        match shard.entries.get(key.as_str()) {
            Some(entry) if entry.claimed_by(token, now) => {
                shard.entries.remove(key.as_str());
                Ok(())
            }
            _ => Err(StoreError::NotOwner),
        }
    }

    fn complete_now(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        match shard.entries.get_mut(key.as_str()) {
            Some(entry) if entry.claimed_by(token, now) => {
                entry.state = State::Completed(token.clone(), outcome.into());
                entry.expires = now + retention;
                Ok(())
            }
            Some(Entry { state: State::Completed(recorder, _), expires, .. })
                if recorder == token && *expires > now =>
            {
                Ok(())
            }
            _ => Err(StoreError::NotOwner),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").field("entries", &self.len()).finish_non_exhaustive()
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while a shard was locked cannot leave an entry half-written: every critical section
    // is a single map operation. Carry on with the data as it is.
    shard.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shard {
    fn sweep(&mut self, now: Instant) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, entry| entry.expires > now);
        self.inserts_since_sweep = 0;
        before - self.entries.len()
    }

    fn note_insert(&mut self, now: Instant) {
        self.inserts_since_sweep += 1;
        if self.inserts_since_sweep >= MIN_INSERTS_BETWEEN_SWEEPS.max(self.entries.len() / 2) {
            self.sweep(now);
        }
    }
}

impl Store for MemoryStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(request.key);
        if let Some(entry) = shard.entries.get_mut(request.key.as_str()) {
            if entry.expires > now {
                return Ok(match &entry.state {
                    State::Completed(_, outcome) => {
                        Claim::Completed(Record { fingerprint: entry.fingerprint.clone(), outcome: outcome.to_vec() })
                    }
                    State::InProgress(_) => Claim::InProgress {
                        fingerprint: entry.fingerprint.clone(),
                        lease_remaining: Some(entry.expires - now),
                    },
                });
            }
            // Expired: take it over in place.
            *entry = Entry::claimed(request, now);
            return Ok(Claim::Claimed);
        }
        shard.entries.insert(request.key.as_str().into(), Entry::claimed(request, now));
        shard.note_insert(now);
        Ok(Claim::Claimed)
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        self.complete_now(key, token, outcome, retention)
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.release_now(key, token)
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        match shard.entries.get_mut(key.as_str()) {
            Some(entry) if entry.claimed_by(token, now) => {
                entry.expires = now + lease;
                Ok(())
            }
            _ => Err(StoreError::NotOwner),
        }
    }

    fn detach(&self, step: Detached) {
        // Every step is a map operation: do it now, no runtime needed.
        let result = match &step {
            Detached::Release { key, token } => self.release_now(key, token),
            Detached::Complete { key, token, outcome, retention, .. } => {
                self.complete_now(key, token, outcome, *retention)
            }
        };
        if let Err(e) = result {
            tracing::debug!(target: "idempotent", scope = step.key().scope(), error = %e, "detached step refused");
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = Instant::now();
        Ok(self.inner.shards.iter().map(|s| lock(s).sweep(now) as u64).sum())
    }

    fn max_record_bytes(&self) -> usize {
        self.inner.max_record_bytes
    }
}

impl Entry {
    /// The entry is a live claim of `token`.
    fn claimed_by(&self, token: &Token, now: Instant) -> bool {
        self.expires > now && matches!(&self.state, State::InProgress(owner) if owner == token)
    }

    fn claimed(request: &ClaimRequest<'_>, now: Instant) -> Self {
        Entry {
            fingerprint: request.fingerprint.cloned(),
            expires: now + request.lease,
            state: State::InProgress(request.token.clone()),
        }
    }
}

//! The in-memory store: sharded, lease- and TTL-expiring, purged as it goes.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Completion, Detached, Fingerprint, Key, Record, Store, StoreError, Token};

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
    Completed(Token, Bytes),
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

    fn complete_now(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        let now = Instant::now();
        // Computed before anything changes: an entry is never left half-written.
        let expires = expiry(now, completion.retention)?;
        let mut shard = self.shard(completion.key);
        let entry = shard.entries.get_mut(completion.key.as_str());
        match entry {
            // Another caller holds the key (its claim or its record is live): refused.
            Some(entry) if entry.expires > now && entry.token() != completion.token => Err(StoreError::NotOwner),
            // This token completed it already (an earlier attempt whose reply was lost).
            Some(Entry { state: State::Completed(..), expires: until, .. }) if *until > now => Ok(()),
            // Ours, live or lapsed: record, keeping the fingerprint it was claimed with.
            Some(entry) if entry.token() == completion.token => {
                let fingerprint = entry.fingerprint.take();
                *entry = Entry { fingerprint, ..Entry::completed(completion, expires) };
                Ok(())
            }
            // An expired entry of another token: nobody holds the key, record.
            Some(entry) => {
                *entry = Entry::completed(completion, expires);
                Ok(())
            }
            // Gone (swept after its lease ended): nobody holds it, record.
            None => {
                shard.entries.insert(completion.key.as_str().into(), Entry::completed(completion, expires));
                shard.note_insert(now);
                Ok(())
            }
        }
    }
}

/// `now + duration`, or a refusal when that cannot be represented.
fn expiry(now: Instant, duration: Duration) -> Result<Instant, StoreError> {
    now.checked_add(duration).ok_or_else(|| {
        StoreError::rejected("memory", format!("a lease or retention of {duration:?} is too long to be represented"))
    })
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
    // computes what it writes (expiries included) before it changes the map, then makes one map
    // operation. Carry on with the data as it is.
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
        let expires = expiry(now, request.lease)?;
        let mut shard = self.shard(request.key);
        if let Some(entry) = shard.entries.get_mut(request.key.as_str()) {
            if entry.expires > now {
                return Ok(match &entry.state {
                    State::Completed(_, outcome) => {
                        Claim::Completed(Record::new(entry.fingerprint.clone(), outcome.clone()))
                    }
                    // Our own claim, asked for again: it is ours.
                    State::InProgress(owner) if owner == request.token => Claim::Claimed,
                    State::InProgress(_) => Claim::InProgress {
                        fingerprint: entry.fingerprint.clone(),
                        lease_remaining: Some(entry.expires - now),
                    },
                });
            }
            // Expired: take it over in place.
            *entry = Entry::claimed(request, expires);
            return Ok(Claim::Claimed);
        }
        shard.entries.insert(request.key.as_str().into(), Entry::claimed(request, expires));
        shard.note_insert(now);
        Ok(Claim::Claimed)
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        self.complete_now(completion)
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.release_now(key, token)
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        let now = Instant::now();
        let expires = expiry(now, lease)?;
        let mut shard = self.shard(key);
        match shard.entries.get_mut(key.as_str()) {
            Some(entry) if entry.claimed_by(token, now) => {
                entry.expires = expires;
                Ok(())
            }
            _ => Err(StoreError::NotOwner),
        }
    }

    fn detach(&self, step: Detached) {
        // Every step is a map operation: do it now, no runtime needed.
        let result = match &step {
            Detached::Release { key, token } => self.release_now(key, token),
            Detached::Complete { .. } => step.completion().map_or(Ok(()), |completion| self.complete_now(&completion)),
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

    fn name(&self) -> &'static str {
        "memory"
    }
}

impl Entry {
    /// The entry is a live claim of `token`.
    fn claimed_by(&self, token: &Token, now: Instant) -> bool {
        self.expires > now && matches!(&self.state, State::InProgress(owner) if owner == token)
    }

    /// The token that claimed or completed the entry.
    fn token(&self) -> &Token {
        match &self.state {
            State::InProgress(token) | State::Completed(token, _) => token,
        }
    }

    fn claimed(request: &ClaimRequest<'_>, expires: Instant) -> Self {
        Entry { fingerprint: request.fingerprint.cloned(), expires, state: State::InProgress(request.token.clone()) }
    }

    fn completed(completion: &Completion<'_>, expires: Instant) -> Self {
        Entry {
            fingerprint: completion.fingerprint.cloned(),
            expires,
            state: State::Completed(completion.token.clone(), Bytes::copy_from_slice(completion.outcome)),
        }
    }
}

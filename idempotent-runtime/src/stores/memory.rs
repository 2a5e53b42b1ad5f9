//! The in-memory store: sharded, lease- and TTL-expiring, purged as it goes, bounded.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::setters::setters;
use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Completion, Detached, Fingerprint, Key, Record, Store, StoreError, Token};

const SHARDS: usize = 64;
/// A shard sweeps out expired entries after this many inserts, or after as many inserts as half
/// its size if that is more: sweeping costs O(1) per insert, amortised.
const MIN_INSERTS_BETWEEN_SWEEPS: usize = 64;
/// The bytes an entry is charged beyond its key and outcome: its map slot (208 bytes: the hash,
/// the 72-byte inline key and the 128-byte entry), the table's free slots, and the outcome's
/// allocation. `load --rss-keys 1000000` measured about 477 bytes of resident memory per
/// completed key (keys of about 17 bytes, outcomes of about 12), table growth and the allocator
/// included: the charge is a fixed estimate, about a tenth below that.
const ENTRY_OVERHEAD: usize = 400;

/// The default bound on entries (claims and records): 1,000,000.
pub const DEFAULT_MAX_ENTRIES: usize = 1_000_000;
/// The default bound on the bytes entries are charged (keys, outcomes and a fixed overhead per
/// entry): 64 MiB.
pub const DEFAULT_MAX_BYTES: usize = 64 << 20;

/// A store in this process's memory: the embedded default, and the store for tests.
///
/// Records vanish when the process exits, so it makes calls idempotent only within one process.
/// The map is split into 64 independently locked shards (no global lock on the hot path); expired
/// claims and records are swept out as new keys arrive, so memory follows what is live.
/// Cloning gives another handle to the same records.
///
/// # Bounded
///
/// The store holds at most [`MemoryLimits::max_entries`] entries and charges them at most
/// [`MemoryLimits::max_bytes`] (each entry is charged its key, its outcome and a fixed 400 bytes
/// for its bookkeeping); the defaults are [`DEFAULT_MAX_ENTRIES`] and [`DEFAULT_MAX_BYTES`].
/// A client that sends a fresh key with every request can therefore not exhaust the process's
/// memory. When a new key would pass a bound, the store first sweeps out what has expired, then
/// applies [`MemoryLimits::when_full`]:
///
/// - [`WhenFull::Refuse`] (the default): the claim fails with [`StoreError::Full`] (the caller
///   gets [`Error::Store`](crate::Error::Store), the HTTP layer answers 503), and nothing that
///   is stored is forgotten. Keys already claimed or recorded keep working.
/// - [`WhenFull::EvictOldestCompleted`]: completed records are dropped to make room, those that
///   expire first first (within each of the store's 64 shards, starting with the new key's). A retry of an evicted key
///   runs its body again, so choose it only where that is acceptable. Claims in progress are
///   never evicted.
///
/// A completion is never refused for room: its key was admitted when it was claimed, and its
/// result must not be lost. So the bytes charged can pass `max_bytes` by the outcomes of the
/// calls in flight; new keys are refused (or make room) until they are back under it.
///
/// ```
/// use idempotent_runtime::{idempotent, Error, MemoryStore};
/// use idempotent_runtime::stores::memory::{MemoryLimits, WhenFull};
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
///
/// let small = MemoryStore::with_limits(MemoryLimits::default().max_entries(1));
/// ship(&small, 1).await.unwrap();
/// assert!(matches!(ship(&small, 2).await, Err(Error::Store { .. }))); // full: refused, not forgotten
/// assert_eq!(ship(&small, 1).await.unwrap(), "shipped 1"); // the record is still replayed
///
/// let evicting = MemoryStore::with_limits(MemoryLimits::default().max_entries(1).when_full(WhenFull::EvictOldestCompleted));
/// ship(&evicting, 1).await.unwrap();
/// assert_eq!(ship(&evicting, 2).await.unwrap(), "shipped 2"); // order 1's record made room
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// The bounds of a [`MemoryStore`] and what it does at them (see [Bounded](MemoryStore#bounded)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryLimits {
    /// The most entries (claims and records) held at once.
    pub max_entries: usize,
    /// The most bytes charged to entries at once (keys, outcomes, 400 bytes each).
    pub max_bytes: usize,
    /// The largest encoded outcome recorded; larger results replay as
    /// [`Error::Unrecordable`](crate::Error::Unrecordable).
    pub max_record_bytes: usize,
    /// What a new key gets when a bound is reached.
    pub when_full: WhenFull,
}

/// What a full [`MemoryStore`] does with a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WhenFull {
    /// Refuse its claim with [`StoreError::Full`]; forget nothing.
    #[default]
    Refuse,
    /// Drop the completed records that expire first (their keys would run again) to make room.
    EvictOldestCompleted,
}

impl Default for MemoryLimits {
    fn default() -> Self {
        MemoryLimits {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            when_full: WhenFull::Refuse,
        }
    }
}

impl MemoryLimits {
    /// At most `entries` entries (at least 1).
    #[must_use]
    pub fn max_entries(mut self, entries: usize) -> Self {
        self.max_entries = entries.max(1);
        self
    }

    setters! {
        /// At most `max_bytes` charged in all.
        pub fn max_bytes(max_bytes: usize);
        /// Outcomes of at most `max_record_bytes` are recorded.
        pub fn max_record_bytes(max_record_bytes: usize);
        /// What a new key gets when a bound is reached.
        pub fn when_full(when_full: WhenFull);
    }
}

struct Inner {
    shards: Box<[Padded<Mutex<Shard>>]>,
    hasher: std::hash::RandomState,
    limits: MemoryLimits,
    /// Written by every new key: kept off the line of the fields above, which every step reads.
    counts: Padded<Counts>,
}

/// Entries held, and the bytes they are charged, over all shards (changed under the lock of the
/// shard whose entry changes).
#[derive(Default)]
struct Counts {
    entries: AtomicUsize,
    bytes: AtomicUsize,
}

/// `T` alone on its cache lines (128 bytes: x86 prefetches lines in pairs), so that threads
/// working on neighbouring shards, or counting entries, do not take each other's lines away.
#[derive(Default)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

#[derive(Default)]
struct Shard {
    entries: Entries,
    inserts_since_sweep: usize,
    /// No entry of the shard expires before this (a lower bound): sweeping earlier finds nothing.
    earliest_expiry: Option<Instant>,
}

/// A claim or a record. Kept small, since the map's slots hold it inline and every slot is
/// moved when a shard's table grows: 128 bytes (a test pins it).
struct Entry {
    expires: Instant,
    /// The token that claimed the key, or that recorded the outcome (a repeated completion by
    /// that token succeeds).
    token: Token,
    /// The fingerprint's 32 bytes (its hex text takes 64).
    fingerprint: Option<[u8; 32]>,
    /// The recorded outcome; `None` while the claim is in progress.
    outcome: Option<Bytes>,
}

/// A key and its hash, computed once per store step: the shard and the map both use it.
#[derive(Clone, Copy)]
struct Hashed<'a> {
    key: &'a Key,
    hash: u64,
}

impl Hashed<'_> {
    fn len(&self) -> usize {
        self.key.as_bytes().len()
    }
}

/// One shard's entries, looked up by a [`Hashed`] key: a step hashes its key once (`SipHash`,
/// seeded per store: keys come from clients, so collisions must not be cheap to make), however
/// many lookups it makes. Each slot keeps its key's hash, so growing the table hashes nothing,
/// and the key itself (held inline up to 69 bytes: see [`Key`]).
#[derive(Default)]
struct Entries(hashbrown::HashTable<Slot>);

struct Slot {
    hash: u64,
    key: Key,
    entry: Entry,
}

impl Entries {
    fn get(&self, key: Hashed<'_>) -> Option<&Entry> {
        self.0.find(key.hash, |slot| slot.key.as_bytes() == key.key.as_bytes()).map(|slot| &slot.entry)
    }

    fn get_mut(&mut self, key: Hashed<'_>) -> Option<&mut Entry> {
        self.0.find_mut(key.hash, |slot| slot.key.as_bytes() == key.key.as_bytes()).map(|slot| &mut slot.entry)
    }

    /// Inserts an entry for a key it does not hold.
    fn insert_new(&mut self, key: Hashed<'_>, entry: Entry) {
        self.0.insert_unique(key.hash, Slot { hash: key.hash, key: key.key.clone(), entry }, |slot| slot.hash);
    }

    fn remove(&mut self, key: Hashed<'_>) -> Option<Entry> {
        let found = self.0.find_entry(key.hash, |slot| slot.key.as_bytes() == key.key.as_bytes()).ok()?;
        Some(found.remove().0.entry)
    }

    fn retain(&mut self, mut keep: impl FnMut(&Key, &Entry) -> bool) {
        self.0.retain(|slot| keep(&slot.key, &slot.entry));
    }

    fn iter(&self) -> impl Iterator<Item = (&Key, &Entry)> {
        self.0.iter().map(|slot| (&slot.key, &slot.entry))
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

impl MemoryStore {
    /// An empty store with the default [`MemoryLimits`].
    #[must_use]
    pub fn new() -> Self {
        Self::with_limits(MemoryLimits::default())
    }

    /// An empty store that records outcomes of at most `limit` encoded bytes.
    #[must_use]
    pub fn with_max_record_bytes(limit: usize) -> Self {
        Self::with_limits(MemoryLimits::default().max_record_bytes(limit))
    }

    /// An empty store with these bounds.
    #[must_use]
    pub fn with_limits(limits: MemoryLimits) -> Self {
        let shards = (0..SHARDS).map(|_| Padded::default()).collect();
        let inner = Inner { shards, hasher: std::hash::RandomState::new(), limits, counts: Padded::default() };
        MemoryStore { inner: Arc::new(inner) }
    }

    /// How many entries (claims and records, live or expired but not yet swept) the store holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.counts.entries.load(Ordering::Relaxed)
    }

    /// `true` when the store holds no entries.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the entries are charged (see [Bounded](MemoryStore#bounded)).
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.inner.counts.bytes.load(Ordering::Relaxed)
    }

    /// The store's bounds.
    #[must_use]
    pub fn limits(&self) -> MemoryLimits {
        self.inner.limits
    }

    /// `key` hashed, and the index of its shard.
    fn hashed<'a>(&self, key: &'a Key) -> (Hashed<'a>, usize) {
        let hashed = self.inner.hashed(key);
        // Bits of the hash that the table does not use for its buckets or tags pick the shard
        // (64 of them, a power of two).
        #[allow(clippy::cast_possible_truncation)]
        let index = ((hashed.hash >> 32) as usize) & (SHARDS - 1);
        (hashed, index)
    }

    fn release_now(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let now = Instant::now();
        let (key, index) = self.hashed(key);
        let mut shard = lock(&self.inner.shards[index]);
        match shard.entries.get(key) {
            Some(entry) if entry.claimed_by(token, now) => {
                shard.remove(key, &self.inner);
                Ok(())
            }
            _ => Err(StoreError::NotOwner),
        }
    }

    fn complete_now(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        let now = Instant::now();
        // Computed before anything changes: an entry is never left half-written. The outcome is
        // copied before the lock is taken.
        let expires = expiry(now, completion.retention)?;
        let outcome = Bytes::copy_from_slice(completion.outcome);
        let (key, index) = self.hashed(completion.key);
        let mut guard = lock(&self.inner.shards[index]);
        let shard = &mut *guard;
        let inserted = match shard.entries.get_mut(key) {
            // Another caller holds the key (its claim or its record is live): refused.
            Some(entry) if entry.expires > now && entry.token != *completion.token => {
                return Err(StoreError::NotOwner);
            }
            // This token completed it already (an earlier attempt whose reply was lost).
            Some(Entry { outcome: Some(_), expires: until, .. }) if *until > now => return Ok(()),
            Some(entry) => {
                // Ours, live or lapsed: record, keeping the fingerprint it was claimed with.
                // Expired and another token's: nobody holds the key, record with ours.
                let before = weight(key.len(), entry);
                if entry.token != *completion.token {
                    entry.fingerprint = packed(completion.fingerprint);
                    entry.token = completion.token.clone();
                }
                entry.expires = expires;
                entry.outcome = Some(outcome);
                self.inner.recharge(before, weight(key.len(), entry));
                false
            }
            // Gone (swept after its lease ended): nobody holds the key, record. A completion is
            // never refused for room (see "Bounded").
            None => {
                shard.insert(key, Entry::completed(completion, expires, outcome), &self.inner);
                true
            }
        };
        shard.note_expiry(expires);
        if self.inner.over(0) && self.inner.limits.when_full == WhenFull::EvictOldestCompleted {
            shard.evict_completed(0, &self.inner, Some(key.key));
        }
        if inserted {
            shard.note_insert(now, &self.inner);
        }
        Ok(())
    }
}

/// An entry's copy of a fingerprint.
fn packed(fingerprint: Option<&Fingerprint>) -> Option<[u8; 32]> {
    fingerprint.map(Fingerprint::digest)
}

/// `now + duration`, or a refusal when that cannot be represented.
fn expiry(now: Instant, duration: Duration) -> Result<Instant, StoreError> {
    now.checked_add(duration).ok_or_else(|| {
        StoreError::rejected("memory", format!("a lease or retention of {duration:?} is too long to be represented"))
    })
}

impl Inner {
    fn hashed<'a>(&self, key: &'a Key) -> Hashed<'a> {
        // One write of the bytes (no length prefix: the hash covers nothing else).
        let mut hasher = self.hasher.build_hasher();
        hasher.write(key.as_bytes());
        Hashed { key, hash: hasher.finish() }
    }

    /// Charges an entry that was charged `before` bytes `after` bytes instead.
    fn recharge(&self, before: usize, after: usize) {
        if after >= before {
            self.counts.bytes.fetch_add(after - before, Ordering::Relaxed);
        } else {
            self.counts.bytes.fetch_sub(before - after, Ordering::Relaxed);
        }
    }

    /// Makes room for one more entry charged `weight`, or fails with [`StoreError::Full`]: sweeps
    /// out what has expired in every shard (a shard whose entries cannot have expired yet costs a
    /// lock and a comparison), then, if the limits say so, drops the completed records that
    /// expire first, shard by shard from `first`. Called with no shard locked.
    fn make_room(&self, now: Instant, weight: usize, first: usize) -> Result<(), StoreError> {
        if !self.over(weight) {
            return Ok(());
        }
        for shard in &self.shards {
            lock(shard).sweep(now, self);
        }
        if self.over(weight) && self.limits.when_full == WhenFull::EvictOldestCompleted {
            for index in (0..SHARDS).map(|i| (first + i) % SHARDS) {
                if !self.over(weight) {
                    break;
                }
                lock(&self.shards[index]).evict_completed(weight, self, None);
            }
        }
        if self.over(weight) { Err(self.full()) } else { Ok(()) }
    }

    /// Whether one more entry charged `weight` would pass a bound (`weight` 0: whether a bound is
    /// passed now).
    fn over(&self, weight: usize) -> bool {
        let entries = self.counts.entries.load(Ordering::Relaxed) + usize::from(weight > 0);
        let bytes = self.counts.bytes.load(Ordering::Relaxed).saturating_add(weight);
        entries > self.limits.max_entries || bytes > self.limits.max_bytes
    }

    fn full(&self) -> StoreError {
        StoreError::Full(format!(
            "{} entries charged {} bytes, limits {} entries and {} bytes",
            self.counts.entries.load(Ordering::Relaxed),
            self.counts.bytes.load(Ordering::Relaxed),
            self.limits.max_entries,
            self.limits.max_bytes
        ))
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("entries", &self.len())
            .field("bytes", &self.bytes())
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while a shard was locked cannot leave an entry half-written: every critical section
    // computes what it writes (expiries included) before it changes the map, then changes the
    // map and the counters together. Carry on with the data as it is.
    shard.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What an entry with a key of `key_len` bytes is charged against `max_bytes`.
fn weight(key_len: usize, entry: &Entry) -> usize {
    key_len + entry.outcome.as_ref().map_or(0, Bytes::len) + ENTRY_OVERHEAD
}

impl Shard {
    /// Inserts an entry for a key the shard does not hold, keeping the counters right (the
    /// caller notes its expiry).
    fn insert(&mut self, key: Hashed<'_>, entry: Entry, inner: &Inner) {
        let added = weight(key.len(), &entry);
        self.entries.insert_new(key, entry);
        inner.counts.entries.fetch_add(1, Ordering::Relaxed);
        inner.counts.bytes.fetch_add(added, Ordering::Relaxed);
    }

    /// Notes that an entry of the shard expires at `expires`.
    fn note_expiry(&mut self, expires: Instant) {
        self.earliest_expiry = Some(self.earliest_expiry.map_or(expires, |e| e.min(expires)));
    }

    fn remove(&mut self, key: Hashed<'_>, inner: &Inner) {
        if let Some(old) = self.entries.remove(key) {
            inner.counts.entries.fetch_sub(1, Ordering::Relaxed);
            inner.counts.bytes.fetch_sub(weight(key.len(), &old), Ordering::Relaxed);
        }
    }

    /// Removes the expired entries (only when one can have expired); returns how many.
    fn sweep(&mut self, now: Instant, inner: &Inner) -> usize {
        self.inserts_since_sweep = 0;
        if self.earliest_expiry.is_none_or(|earliest| earliest > now) {
            return 0;
        }
        let (mut removed, mut freed, mut earliest) = (0, 0, None::<Instant>);
        self.entries.retain(|key, entry| {
            if entry.expires > now {
                earliest = Some(earliest.map_or(entry.expires, |e| e.min(entry.expires)));
                true
            } else {
                removed += 1;
                freed += weight(key.as_bytes().len(), entry);
                false
            }
        });
        self.earliest_expiry = earliest;
        inner.counts.entries.fetch_sub(removed, Ordering::Relaxed);
        inner.counts.bytes.fetch_sub(freed, Ordering::Relaxed);
        removed
    }

    fn note_insert(&mut self, now: Instant, inner: &Inner) {
        self.inserts_since_sweep += 1;
        if self.inserts_since_sweep >= MIN_INSERTS_BETWEEN_SWEEPS.max(self.entries.len() / 2) {
            self.sweep(now, inner);
        }
    }

    /// Drops this shard's completed records, those that expire first first, until one more entry
    /// charged `weight` fits, plus a sixteenth of the rest so that the next keys find room
    /// without another pass.
    fn evict_completed(&mut self, weight: usize, inner: &Inner, keep: Option<&Key>) {
        let mut completed: Vec<(Instant, Key)> = self
            .entries
            .iter()
            .filter(|(key, entry)| entry.outcome.is_some() && Some(*key) != keep)
            .map(|(key, entry)| (entry.expires, key.clone()))
            .collect();
        completed.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.as_bytes().cmp(b.1.as_bytes())));
        let spare = completed.len() / 16;
        let mut extra = 0;
        for (_, key) in completed {
            if inner.over(weight) {
                self.remove(inner.hashed(&key), inner);
            } else if extra < spare {
                self.remove(inner.hashed(&key), inner);
                extra += 1;
            } else {
                break;
            }
        }
    }
}

impl Store for MemoryStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // The caller's clock reading, taken just before it called (`sent_at`): the lease is
        // counted as the caller counts it, and the clock is read once per replay, not twice.
        let now = request.sent.unwrap_or_else(Instant::now);
        let expires = expiry(now, request.lease)?;
        let (key, index) = self.hashed(request.key);
        let mut made_room = false;
        loop {
            let mut guard = lock(&self.inner.shards[index]);
            let shard = &mut *guard;
            if let Some(entry) = shard.entries.get_mut(key) {
                if entry.expires > now {
                    return Ok(match &entry.outcome {
                        Some(outcome) => Claim::Completed(Record::new(entry.fingerprint(), outcome.clone())),
                        // Our own claim, asked for again: it is ours.
                        None if entry.token == *request.token => Claim::Claimed,
                        None => Claim::InProgress {
                            fingerprint: entry.fingerprint(),
                            lease_remaining: Some(entry.expires - now),
                        },
                    });
                }
                // Expired: taken over in place (it was admitted when it was made).
                let before = weight(key.len(), entry);
                *entry = Entry::claimed(request, expires);
                self.inner.recharge(before, weight(key.len(), entry));
                shard.note_expiry(expires);
                return Ok(Claim::Claimed);
            }
            // A new key is admitted only if it fits. Making room locks every shard, so it runs
            // with this one unlocked, and the claim then starts over: the key may have been
            // claimed meanwhile.
            let weight = key.len() + ENTRY_OVERHEAD;
            if self.inner.over(weight) {
                if made_room {
                    return Err(self.inner.full());
                }
                drop(guard);
                self.inner.make_room(now, weight, index)?;
                made_room = true;
                continue;
            }
            shard.insert(key, Entry::claimed(request, expires), &self.inner);
            shard.note_expiry(expires);
            shard.note_insert(now, &self.inner);
            return Ok(Claim::Claimed);
        }
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
        let (key, index) = self.hashed(key);
        let mut shard = lock(&self.inner.shards[index]);
        match shard.entries.get_mut(key) {
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
        Ok(self.inner.shards.iter().map(|s| lock(s).sweep(now, &self.inner) as u64).sum())
    }

    fn max_record_bytes(&self) -> usize {
        self.inner.limits.max_record_bytes
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn process_local(&self) -> bool {
        true
    }
}

impl Entry {
    /// The entry is a live claim of `token`.
    fn claimed_by(&self, token: &Token, now: Instant) -> bool {
        self.expires > now && self.outcome.is_none() && self.token == *token
    }

    /// The fingerprint, as a claim or a record reports it.
    fn fingerprint(&self) -> Option<Fingerprint> {
        self.fingerprint.as_ref().map(Fingerprint::from_digest_bytes)
    }

    fn claimed(request: &ClaimRequest<'_>, expires: Instant) -> Self {
        Entry { expires, token: request.token.clone(), fingerprint: packed(request.fingerprint), outcome: None }
    }

    fn completed(completion: &Completion<'_>, expires: Instant, outcome: Bytes) -> Self {
        Entry {
            expires,
            token: completion.token.clone(),
            fingerprint: packed(completion.fingerprint),
            outcome: Some(outcome),
        }
    }
}

impl Entry {
    /// This entry as an operator sees it at `now`.
    fn to_admin(&self, key: &Key, now: Instant, with_outcome: bool) -> crate::admin::Entry {
        use crate::admin::State as Seen;
        let live = self.expires > now;
        let (state, outcome) = match &self.outcome {
            _ if !live => (Seen::Expired, None),
            None => (Seen::Running, None),
            Some(outcome) => (Seen::Done, with_outcome.then(|| outcome.clone())),
        };
        crate::admin::Entry {
            key: key.as_str().to_owned(),
            state,
            token: self.token.as_str().to_owned(),
            fingerprint: self.fingerprint().map(|fp| fp.as_str().to_owned()),
            remaining: live.then(|| self.expires - now),
            outcome,
        }
    }
}

/// The memory store's operator view: every method reads the shards under their locks.
impl crate::admin::Admin for MemoryStore {
    async fn inspect(&self, key: &Key) -> Result<Option<crate::admin::Entry>, StoreError> {
        let now = Instant::now();
        let (hashed, index) = self.hashed(key);
        let shard = lock(&self.inner.shards[index]);
        Ok(shard.entries.get(hashed).map(|entry| entry.to_admin(key, now, true)))
    }

    async fn list(&self, query: &crate::admin::ListQuery) -> Result<crate::admin::Page, StoreError> {
        // In memory already: gather what matches after the cursor, in key order.
        let now = Instant::now();
        let mut found: Vec<crate::admin::Entry> = Vec::new();
        for shard in &self.inner.shards {
            let shard = lock(shard);
            found.extend(
                shard
                    .entries
                    .iter()
                    .filter(|(key, _)| query.cursor.as_deref().is_none_or(|after| key.as_str() > after))
                    .map(|(key, entry)| entry.to_admin(key, now, false))
                    .filter(|entry| query.matches(entry)),
            );
        }
        found.sort_by(|a, b| a.key.cmp(&b.key));
        let size = query.page_size();
        let next = (found.len() > size).then(|| found[size - 1].key.clone());
        found.truncate(size);
        Ok(crate::admin::Page { entries: found, next })
    }

    async fn release(&self, key: &Key, seen: &crate::admin::Entry) -> Result<crate::admin::Released, StoreError> {
        let now = Instant::now();
        let (hashed, index) = self.hashed(key);
        let mut shard = lock(&self.inner.shards[index]);
        let same = shard.entries.get(hashed).is_some_and(|entry| {
            let now_seen = entry.to_admin(key, now, false);
            now_seen.token == seen.token && now_seen.state == seen.state
        });
        if !same {
            return Ok(crate::admin::Released::Changed);
        }
        shard.remove(hashed, &self.inner);
        Ok(crate::admin::Released::Deleted)
    }

    async fn stats(&self) -> Result<crate::admin::Stats, StoreError> {
        let now = Instant::now();
        let (mut counts, mut next) = (std::collections::BTreeMap::new(), None);
        for shard in &self.inner.shards {
            let shard = lock(shard);
            for (key, entry) in shard.entries.iter() {
                crate::admin::tally(&mut counts, &mut next, &entry.to_admin(key, now, false));
            }
        }
        Ok(crate::admin::stats_of(counts, next))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn memory_entries_stay_small() {
        // Every slot is moved when its shard's table grows; a larger entry showed up in the
        // `overhead` bench as page faults and copies.
        assert!(size_of::<super::Entry>() <= 128, "{}", size_of::<super::Entry>());
    }
}

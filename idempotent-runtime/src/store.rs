//! The store trait: the atomic steps every backend implements.

use std::future::Future;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use bytes::Bytes;

use crate::{Detached, Fingerprint, Key, StoreError};

/// The largest encoded result a store records by default (1 MiB).
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1024 * 1024;

/// Where idempotency records live.
///
/// A store implements four steps, **each one atomic on the backend** (one command or script, one
/// SQL statement, one locked map operation), so no interleaving of concurrent callers can make two
/// of them own a key at once:
///
/// 1. [`claim`](Store::claim): take the key for this caller's [`Token`] with a lease, unless a live
///    record exists, in which case return it (completed: for replay; in progress: to wait or fail).
///    An expired lease or an expired completed record counts as absent. A claim that finds the
///    key already claimed by *its own* token (a resent request whose first reply was lost) is
///    [`Claim::Claimed`]; its lease need not be renewed by that (a call renews a claim answered
///    late with `extend` before it counts on it).
/// 2. [`extend`](Store::extend): the lease heartbeat. If the key is still claimed by this token
///    and its lease has not ended, the lease now ends `lease` from now.
/// 3. [`complete`](Store::complete): store the encoded outcome and make the record live for the
///    retention, **unless another token holds a live claim or record on the key**. So a
///    completion is accepted when the key still carries this token (its lease may have ended:
///    nobody took the key over), when the key is gone or expired (nobody holds it now), and, without
///    changing anything, when this token already completed it (a retried completion whose first
///    reply was lost). It is refused only when another caller took the key over.
/// 4. [`release`](Store::release): if the key is still claimed by this token and its lease has not
///    ended, delete it, so a retry may run.
///
/// [`claim_many`](Store::claim_many) and [`complete_many`](Store::complete_many) are the first
/// and third steps for several keys at once, each key answered as its single step would answer
/// it, and [`claim_and_complete_many`](Store::claim_and_complete_many) is both batches at once; a
/// store that can batch them overrides their defaults.
///
/// Refused steps fail with [`StoreError::NotOwner`] and change nothing. Renewal and release are
/// fenced by the lease: once it has ended, even if nobody has claimed the key since, its owner can
/// no longer renew or release it. Completion is fenced only by other owners, because refusing a
/// finished body's result that nobody contested would make the next retry run the body again.
/// Every expiry is decided by the store's own clock (the database's or Redis's, or Tokio's for
/// in-process stores), never the caller's.
///
/// Implementations for `&S`, `Box<S>`, `Arc<S>` and `LazyLock<S>` forward to `S`, so the attribute's
/// `store = ...` accepts a store, a reference to one, an `Arc`, or a `static` `LazyLock`. To hold
/// any store chosen at run time, use [`AnyStore`](crate::AnyStore).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "`store = ...` must name a store",
    note = "use `MemoryStore`, a Redis or SQL store of `idempotent_runtime::stores`, or implement `Store`"
)]
pub trait Store: Send + Sync {
    /// Claims `request.key` for `request.token`, or returns the live record that prevents it.
    fn claim(&self, request: &ClaimRequest<'_>) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Records `completion.outcome` for its key, live for `completion.retention`, unless another
    /// token holds the key (see the trait docs for the rule).
    fn complete(&self, completion: &Completion<'_>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Claims the keys of several requests at once, and returns each request's answer in the
    /// requests' order: what its own [`claim`](Store::claim) would have answered, had the
    /// requests' claims been sent concurrently.
    ///
    /// For callers that hold many keys at once ([`BatchingStore`](crate::stores::batching::BatchingStore),
    /// which gathers the claims of concurrent calls): a store that can claim them together
    /// overrides it (the PostgreSQL store: one statement;
    /// the Redis store on one server: one pipeline; `CachedStore`: the keys it has no record of,
    /// as one batch of its store's). The default sends each request's `claim`, concurrently, and
    /// never fails as a whole.
    ///
    /// Of several requests for one key, one at most is [`Claim::Claimed`] (which one is not
    /// specified), unless they share their token: a token's second request for a key it holds is
    /// `Claimed` too, as its single `claim` is. An error of one request (a corrupt record, say)
    /// is that request's; the outer error says the batch failed as a whole (its connection, its
    /// statement). As after a failed `claim`, its keys may then be held by claims whose answers
    /// were lost, until their leases end.
    fn claim_many(
        &self,
        requests: &[ClaimRequest<'_>],
    ) -> impl Future<Output = Result<Vec<Result<Claim, StoreError>>, StoreError>> + Send {
        async move { Ok(claim_each(self, requests).await) }
    }

    /// Records several completions at once, and returns each one's answer in their order: what
    /// its own [`complete`](Store::complete) would have answered, had they been sent
    /// concurrently.
    ///
    /// The default sends each completion's `complete`, concurrently, and never fails as a whole;
    /// a store that can record them together overrides it. The outer error says the batch
    /// failed as a whole; like a failed `complete`, it may have recorded some of them, and
    /// sending them again (the same tokens) records the rest and changes nothing of those.
    fn complete_many(
        &self,
        completions: &[Completion<'_>],
    ) -> impl Future<Output = Result<Vec<Result<(), StoreError>>, StoreError>> + Send {
        async move { Ok(complete_each(self, completions).await) }
    }

    /// Claims the keys of `requests` and records `completions` as one batch, and returns the
    /// claims' answers and the completions' answers: each half what
    /// [`claim_many`](Store::claim_many) and [`complete_many`](Store::complete_many) would have
    /// answered, had the two been sent concurrently.
    ///
    /// For [`BatchingStore`](crate::stores::batching::BatchingStore), which sends the claims and
    /// the completions of concurrent calls together. The default sends the two halves
    /// concurrently (an empty half is not sent); the PostgreSQL store sends them as one statement
    /// (one commit), unless a key is in both halves. Each half's outer error is its failure as a
    /// whole, with the meaning it has for `claim_many` and `complete_many`; a store that sends
    /// both in one statement fails both halves when that statement fails.
    fn claim_and_complete_many(
        &self,
        requests: &[ClaimRequest<'_>],
        completions: &[Completion<'_>],
    ) -> impl Future<Output = (BatchAnswers<Claim>, BatchAnswers<()>)> + Send {
        claim_and_complete_each(self, requests, completions)
    }

    /// Deletes the claim this token holds, so that a retry may run the body.
    fn release(&self, key: &Key, token: &Token) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Makes the lease of a claim this token holds end `lease` from now (the heartbeat that keeps a
    /// long body's claim alive).
    ///
    /// Stores whose claim cannot expire while its owner lives (the transactional SQL stores, whose
    /// claim is a row of an open transaction) succeed without doing anything.
    fn extend(&self, key: &Key, token: &Token, lease: Duration) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Finishes a step from a destructor: the caller's future was dropped (or its body panicked)
    /// while it released or recorded.
    ///
    /// It cannot wait: in-memory stores finish the step at once, remote stores spawn it on the
    /// current Tokio runtime with [`spawn_detached`](crate::stores::spawn_detached), and a store
    /// whose claims live in a transaction that rolls back when dropped does nothing. There is no
    /// default: a store that dropped the step would lose a result that was meant to be recorded
    /// in the background.
    fn detach(&self, step: Detached);

    /// Deletes expired claims and records now and returns how many it deleted.
    ///
    /// Stores whose backend expires entries by itself (Redis) keep the default, which deletes
    /// nothing and returns 0.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send {
        std::future::ready(Ok(0))
    }

    /// The largest encoded outcome this store records; larger results are not recorded and their
    /// replays get [`Error::Unrecordable`](crate::Error::Unrecordable).
    fn max_record_bytes(&self) -> usize {
        DEFAULT_MAX_RECORD_BYTES
    }

    /// A short name for the store in metrics and logs, such as `memory`, `redis` or `postgres`
    /// (the `store` label of `idempotent_store_step_seconds`). The default is `custom`.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Whether every caller of this store runs in this process: `true` for
    /// [`MemoryStore`](crate::MemoryStore), whose records live in this process's memory. The
    /// default is `false`, for a store that other processes or machines share.
    ///
    /// A call's owner [`Token`] must be unique among the callers that share its store. For a
    /// shared store each call draws its token from the operating system, as [`Token::new`] does
    /// (when the store first reads it: a replay from a local cache draws none), so that two
    /// copies of one process never make the same one: a process and its `fork` child,
    /// or two virtual machines restored from one snapshot, hold the same memory, and a token
    /// counted from it would repeat in both; the store would then take the second copy's claim
    /// for a resend of the first's, and both would run the body. For a process-local store the
    /// call counts its tokens up from per-thread randomness instead, which is cheaper, and
    /// unique within the process, which is all such a store needs.
    fn process_local(&self) -> bool {
        false
    }
}

/// The default of [`Store::claim_many`]: each request's `claim`, concurrently.
pub(crate) async fn claim_each<S: Store + ?Sized>(
    store: &S,
    requests: &[ClaimRequest<'_>],
) -> Vec<Result<Claim, StoreError>> {
    futures_util::future::join_all(requests.iter().map(|request| store.claim(request))).await
}

/// The default of [`Store::complete_many`]: each completion's `complete`, concurrently.
pub(crate) async fn complete_each<S: Store + ?Sized>(
    store: &S,
    completions: &[Completion<'_>],
) -> Vec<Result<(), StoreError>> {
    futures_util::future::join_all(completions.iter().map(|completion| store.complete(completion))).await
}

/// The default of [`Store::claim_and_complete_many`]: the two halves' batches, concurrently.
pub(crate) async fn claim_and_complete_each<S: Store + ?Sized>(
    store: &S,
    requests: &[ClaimRequest<'_>],
    completions: &[Completion<'_>],
) -> (BatchAnswers<Claim>, BatchAnswers<()>) {
    let claims = async { if requests.is_empty() { Ok(Vec::new()) } else { store.claim_many(requests).await } };
    let records =
        async { if completions.is_empty() { Ok(Vec::new()) } else { store.complete_many(completions).await } };
    futures_util::future::join(claims, records).await
}

/// The answers of a batch of one step ([`Store::claim_many`], [`Store::complete_many`]): each
/// request's answer, in the requests' order, or the batch's failure as a whole.
pub type BatchAnswers<T> = Result<Vec<Result<T, StoreError>>, StoreError>;

/// Whose claim on which key, for which request: what [`ClaimRequest`] and [`Completion`] both
/// carry. Each of them dereferences to its claimant, so `request.key`, `completion.token` and
/// `completion.fingerprint` read its fields directly.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Claimant<'a> {
    /// The key.
    pub key: &'a Key,
    /// The owner token of the claim.
    pub token: &'a Token,
    /// The request's fingerprint, stored with the claim and, when the store no longer holds the
    /// claim at completion, written with the record, so that a reused key with another request
    /// is still refused.
    pub fingerprint: Option<&'a Fingerprint>,
}

/// The arguments of [`Store::claim`]: the [`Claimant`] (reached through `Deref`), the lease, and
/// when the caller sent the claim.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ClaimRequest<'a> {
    /// Who claims which key, for which request.
    pub claimant: Claimant<'a>,
    /// How long the claim lasts if the caller neither completes nor releases it.
    pub lease: Duration,
    /// The caller's clock just before it sent this claim, if it read it (see
    /// [`sent_at`](ClaimRequest::sent_at)).
    pub sent: Option<tokio::time::Instant>,
}

impl<'a> ClaimRequest<'a> {
    /// A claim of `key` for `token`, with `fingerprint`, lasting `lease` unless renewed.
    #[must_use]
    pub fn new(key: &'a Key, token: &'a Token, fingerprint: Option<&'a Fingerprint>, lease: Duration) -> Self {
        ClaimRequest { claimant: Claimant { key, token, fingerprint }, lease, sent: None }
    }

    /// Says when the caller sent the claim: `sent` was read from Tokio's clock just before.
    ///
    /// The caller counts its lease from that moment, so a store in the caller's process, with
    /// nothing between the two, may take it as the moment of the claim instead of reading the
    /// clock again: the memory store does. Its claim then ends exactly when the caller expects,
    /// never later. An entry that ended between `sent` and the store's step still counts as live
    /// for that step, the cautious side. Stores in other processes count leases on their own
    /// clocks and ignore it, as should a wrapper that can hold a claim on its way to the store.
    #[must_use]
    pub fn sent_at(mut self, sent: tokio::time::Instant) -> Self {
        self.sent = Some(sent);
        self
    }
}

impl<'a> std::ops::Deref for ClaimRequest<'a> {
    type Target = Claimant<'a>;

    fn deref(&self) -> &Claimant<'a> {
        &self.claimant
    }
}

/// The arguments of [`Store::complete`]: the [`Claimant`] whose body produced the outcome
/// (reached through `Deref`), the outcome and its retention.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Completion<'a> {
    /// The claim whose body produced the outcome, with the request's fingerprint as claimed.
    pub claimant: Claimant<'a>,
    /// The encoded outcome.
    pub outcome: &'a [u8],
    /// How long the record is replayed.
    pub retention: Duration,
}

impl<'a> std::ops::Deref for Completion<'a> {
    type Target = Claimant<'a>;

    fn deref(&self) -> &Claimant<'a> {
        &self.claimant
    }
}

impl<'a> Completion<'a> {
    /// The completion of `token`'s claim on `key` with `outcome`, replayed for `retention`.
    #[must_use]
    pub fn new(
        key: &'a Key,
        token: &'a Token,
        fingerprint: Option<&'a Fingerprint>,
        outcome: &'a [u8],
        retention: Duration,
    ) -> Self {
        Completion { claimant: Claimant { key, token, fingerprint }, outcome, retention }
    }
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The key is now this caller's: run the body.
    Claimed,
    /// A call with this key has finished: replay its outcome.
    Completed(Record),
    /// Another caller holds a live claim.
    InProgress {
        /// The fingerprint the running call was claimed with.
        fingerprint: Option<Fingerprint>,
        /// How long its lease still lasts, if the store knows.
        lease_remaining: Option<Duration>,
    },
}

/// A completed call, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The fingerprint of the request that produced it.
    pub fingerprint: Option<Fingerprint>,
    /// The encoded outcome (JSON: see the crate docs for its shape). Shared, not copied, by the
    /// in-process stores' replays.
    pub outcome: Bytes,
}

impl Record {
    /// A record of `outcome`, produced by a request with `fingerprint`.
    #[must_use]
    pub fn new(fingerprint: Option<Fingerprint>, outcome: impl Into<Bytes>) -> Self {
        Record { fingerprint, outcome: outcome.into() }
    }
}

/// The owner token of one claim: random, unique per call; completion and release are fenced by it.
///
/// A token made by [`Token::new`] is held inline (32 bytes, no allocation).
pub struct Token(Repr);

enum Repr {
    /// 32 lowercase hex digits, as [`Token::new`] makes them (and stores give them back).
    Hex([u8; 32]),
    /// Any other text read back from a store.
    Text(Box<str>),
    /// 32 hex digits drawn as [`Token::new`] draws them, but only when first read: a call
    /// answered without its token (from a local replay cache) costs no system call.
    Deferred(OnceLock<[u8; 32]>),
}

impl Token {
    /// A fresh token: 128 bits from the operating system's random source, as 32 hex digits.
    ///
    /// A token fences one claim, so it must never repeat among the callers of one store; it need
    /// not be unpredictable (stores only compare it). It is drawn from the operating system for
    /// each token, not from state in this process's memory, which a `fork` child or a virtual
    /// machine restored twice from one snapshot would continue from: two such copies claiming one
    /// key with the same token would each take the other's claim for their own. This costs a
    /// system call per token where glibc is older than 2.41 (0.22 to 0.55 µs with Debian 12's
    /// 2.36, on the machines it was measured on), less where `getrandom` is served by the vDSO.
    /// Should the source fail, the token is counted as a process-local store's calls count
    /// theirs, and a warning is logged.
    #[must_use]
    pub fn new() -> Self {
        Token(Repr::Hex(Self::drawn()))
    }

    /// A token like [`Token::new`]'s, drawn when a store first reads it (or when it is cloned),
    /// not before: a call's token, which a call answered from a cache never sends.
    pub(crate) fn deferred() -> Self {
        Token(Repr::Deferred(OnceLock::new()))
    }

    /// The digits of a [`Token::new`].
    fn drawn() -> [u8; 32] {
        match crate::random::os_bytes() {
            Some(bytes) => crate::hex::encode(&bytes),
            None => Self::counted_digits(),
        }
    }

    /// A token counted up from 128 random bits drawn once per thread, in its hex digits: no
    /// system call. Unique within this process, which is what a
    /// [process-local](Store::process_local) store's calls need, and what they use.
    pub(crate) fn counted() -> Self {
        Token(Repr::Hex(Self::counted_digits()))
    }

    fn counted_digits() -> [u8; 32] {
        thread_local! {
            // The digits of this thread's next token, counted up in place: the last digit is
            // usually the only one that changes, where encoding a counter wrote all 32.
            static NEXT: std::cell::RefCell<[u8; 32]> =
                std::cell::RefCell::new(crate::hex::encode(&uuid::Uuid::new_v4().as_u128().to_be_bytes()));
        }
        NEXT.with_borrow_mut(|next| {
            let digits = *next;
            crate::hex::plus_one(next);
            digits
        })
    }

    /// Takes a token read back from a store.
    #[must_use]
    pub fn from_stored(text: impl AsRef<str>) -> Self {
        let text = text.as_ref();
        match <[u8; 32]>::try_from(text.as_bytes()) {
            Ok(hex) if hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => Token(Repr::Hex(hex)),
            _ => Token(Repr::Text(text.into())),
        }
    }

    /// Whether the token is 32 lowercase hex digits, as [`Token::new`] makes them: known from its
    /// form, without reading the digits.
    #[cfg(feature = "redis")]
    pub(crate) fn is_hex32(&self) -> bool {
        matches!(self.0, Repr::Hex(_) | Repr::Deferred(_))
    }

    /// The text stores keep.
    #[must_use]
    pub fn as_str(&self) -> &str {
        // Only lowercase hex digits, or text: always UTF-8.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }

    /// The text's bytes, without the UTF-8 check `as_str` makes of an inline token (for writing it
    /// into a command, comparing and hashing). Draws a deferred token.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Hex(hex) => hex,
            Repr::Text(text) => text.as_bytes(),
            Repr::Deferred(cell) => cell.get_or_init(Self::drawn),
        }
    }
}

impl Clone for Token {
    /// A deferred token is drawn first, so the clone and the original are one token.
    fn clone(&self) -> Self {
        match &self.0 {
            Repr::Hex(hex) => Token(Repr::Hex(*hex)),
            Repr::Text(text) => Token(Repr::Text(text.clone())),
            Repr::Deferred(cell) => Token(Repr::Hex(*cell.get_or_init(Self::drawn))),
        }
    }
}

impl PartialEq for Token {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Token {}

impl std::hash::Hash for Token {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Token").field(&self.as_str()).finish()
    }
}

impl Default for Token {
    fn default() -> Self {
        Self::new()
    }
}

/// Writes `Store` methods that forward to another store: `$target(self)` names it.
///
/// `forward_store!(direct $target; claim complete ...)` returns the target's futures as they are
/// (for pointer types, whose target is a `Store` too); `awaited` wraps each in an `async` block,
/// for a target whose futures borrow `self` and the arguments for one lifetime (`AnyStore`'s
/// boxed futures), which the trait's signatures cannot name. Each method listed is written once
/// here, so a wrapper names what it forwards and writes only what it changes.
///
/// Exported, hidden, for the test crate's store wrappers (a store that drops a step, delays a
/// reply, watches a release), which forward everything else unchanged:
///
/// ```
/// use idempotent_runtime::{MemoryStore, Store};
///
/// struct Watched(MemoryStore);
///
/// impl Watched {
///     fn inner(&self) -> &MemoryStore {
///         &self.0
///     }
/// }
///
/// impl Store for Watched {
///     idempotent_runtime::forward_store!(direct Watched::inner; claim complete release extend detach);
/// }
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! forward_store {
    ($mode:ident $target:path; $($method:ident)+) => {$(
        $crate::forward_store!(@$method $mode $target);
    )+};
    (@claim $mode:ident $target:path) => {
        fn claim(&self, request: &$crate::ClaimRequest<'_>) -> impl ::core::future::Future<Output = Result<$crate::Claim, $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).claim(request))
        }
    };
    (@complete $mode:ident $target:path) => {
        fn complete(&self, completion: &$crate::Completion<'_>) -> impl ::core::future::Future<Output = Result<(), $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).complete(completion))
        }
    };
    (@claim_many $mode:ident $target:path) => {
        fn claim_many(&self, requests: &[$crate::ClaimRequest<'_>]) -> impl ::core::future::Future<Output = Result<Vec<Result<$crate::Claim, $crate::StoreError>>, $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).claim_many(requests))
        }
    };
    (@complete_many $mode:ident $target:path) => {
        fn complete_many(&self, completions: &[$crate::Completion<'_>]) -> impl ::core::future::Future<Output = Result<Vec<Result<(), $crate::StoreError>>, $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).complete_many(completions))
        }
    };
    (@claim_and_complete_many $mode:ident $target:path) => {
        fn claim_and_complete_many(&self, requests: &[$crate::ClaimRequest<'_>], completions: &[$crate::Completion<'_>]) -> impl ::core::future::Future<Output = ($crate::BatchAnswers<$crate::Claim>, $crate::BatchAnswers<()>)> + Send {
            $crate::forward_store!(@future $mode $target(self).claim_and_complete_many(requests, completions))
        }
    };
    (@release $mode:ident $target:path) => {
        fn release(&self, key: &$crate::Key, token: &$crate::Token) -> impl ::core::future::Future<Output = Result<(), $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).release(key, token))
        }
    };
    (@extend $mode:ident $target:path) => {
        fn extend(&self, key: &$crate::Key, token: &$crate::Token, lease: ::core::time::Duration) -> impl ::core::future::Future<Output = Result<(), $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).extend(key, token, lease))
        }
    };
    (@purge_expired $mode:ident $target:path) => {
        fn purge_expired(&self) -> impl ::core::future::Future<Output = Result<u64, $crate::StoreError>> + Send {
            $crate::forward_store!(@future $mode $target(self).purge_expired())
        }
    };
    (@detach $mode:ident $target:path) => {
        fn detach(&self, step: $crate::Detached) {
            $target(self).detach(step);
        }
    };
    (@max_record_bytes $mode:ident $target:path) => {
        fn max_record_bytes(&self) -> usize {
            $target(self).max_record_bytes()
        }
    };
    (@name $mode:ident $target:path) => {
        fn name(&self) -> &'static str {
            $target(self).name()
        }
    };
    (@process_local $mode:ident $target:path) => {
        fn process_local(&self) -> bool {
            $target(self).process_local()
        }
    };
    (@future direct $future:expr) => { $future };
    (@future awaited $future:expr) => { async move { $future.await } };
}
pub(crate) use crate::forward_store;

/// Every method of `Store`, through a pointer type, to the store it points to.
macro_rules! forward_through_pointers {
    ($([$($generics:tt)*] $pointer:ty;)*) => {$(
        impl<$($generics)*> Store for $pointer {
            forward_store!(direct std::ops::Deref::deref;
                claim complete claim_many complete_many claim_and_complete_many release extend detach purge_expired
                max_record_bytes name process_local);
        }
    )*};
}

forward_through_pointers! {
    [S: Store + ?Sized] &S;
    [S: Store + ?Sized] Box<S>;
    [S: Store + ?Sized] Arc<S>;
    // A `static STORE: LazyLock<MemoryStore>` works as `store = STORE`.
    [S: Store, F: FnOnce() -> S + Send] LazyLock<S, F>;
}

#[cfg(test)]
mod tests {
    use super::Token;

    /// The draws of this thread's `Token`s from the operating system.
    fn draws() -> u64 {
        crate::random::DRAWS.with(std::cell::Cell::get)
    }

    #[test]
    fn memory_deferred_tokens_draw_once_when_first_read() {
        let before = draws();
        let (a, b) = (Token::deferred(), Token::deferred());
        assert_eq!(draws(), before, "nothing drawn before a read");
        #[cfg(feature = "redis")]
        {
            assert!(a.is_hex32());
            assert_eq!(draws(), before, "its form is known without a draw");
        }
        let text = a.as_str().to_owned();
        assert_eq!(draws(), before + 1);
        assert_eq!(text.len(), 32);
        assert!(text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{text}");
        assert_eq!(a.as_str(), text, "drawn once, then kept");
        // A clone is the same token: drawn first if it was not yet.
        assert_eq!(a.clone(), a);
        let c = b.clone();
        assert_eq!(draws(), before + 2);
        assert_eq!(c.as_str(), b.as_str());
        assert_ne!(a, b);
        assert_eq!(Token::from_stored(&text), a, "equal to the same digits read back from a store");
        assert_eq!(draws(), before + 2);
    }

    #[test]
    fn memory_counted_tokens_count_up_in_hex() {
        let number = |digits: [u8; 32]| u128::from_be_bytes(crate::hex::decode(&digits));
        // A thread's tokens are successive numbers (the increment itself: `hex`'s tests).
        let (a, b) = (Token::counted(), Token::counted());
        let digits = |token: &Token| <[u8; 32]>::try_from(token.as_bytes()).unwrap();
        assert_eq!(number(digits(&b)), number(digits(&a)).wrapping_add(1));
    }

    #[test]
    fn memory_tokens_are_32_hex_digits_and_distinct_across_threads() {
        let made = || (0..1000).map(|_| Token::new().as_str().to_owned()).collect::<Vec<_>>();
        let other = std::thread::spawn(made).join().unwrap();
        let tokens: std::collections::HashSet<String> = made().into_iter().chain(other).collect();
        assert_eq!(tokens.len(), 2000);
        for token in &tokens {
            assert_eq!(token.len(), 32);
            assert!(token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{token}");
            assert_eq!(Token::from_stored(token).as_str(), token, "read back as it was written");
        }
    }
}

//! The fault injector: a `Store` in front of the store under test that, at any step, fails it,
//! applies it and loses the reply, or delays it (past the lease, typically: on its way to the
//! store, on its way back, or, where the timing asks for it, split between the two), and logs
//! every step to the history.
//!
//! Steps that a dropped call leaves to finish ([`Store::detach`]) go through the same wrapper, so
//! the log sees them too, and draw faults as well where the history's rates say so
//! ([`FaultRates::background`]): a step that ends on its first poll (the memory store's, without
//! a fault) ends in place, any other in a task that [`FaultStore::background_ended`] waits for.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use idempotent_runtime::{Claim, ClaimRequest, Completion, Detached, Key, Store, StoreError, Token};

use super::bugs::Planted;
use super::callers::CALLER;
use super::history::{Event, Fault, History, Op, Reply, Step};
use super::rng::SplitMix64;

/// How often each fault strikes, in percent of the steps, for one history.
#[derive(Debug, Clone, Copy)]
pub struct FaultRates {
    /// A step fails before reaching the store.
    pub fail: u32,
    /// A step is applied and its reply lost.
    pub lose_reply: u32,
    /// A step is delayed past the lease (before or after the store applies it).
    pub delay: u32,
    /// A renewal fails while its owner lives (on top of `fail`).
    pub extend_fail: u32,
    /// Steps finished in the background (a dropped call's completion and its renewals, a
    /// release) draw faults too; without it they have none.
    pub background: bool,
}

impl FaultRates {
    /// No faults.
    pub const NONE: FaultRates = FaultRates { fail: 0, lose_reply: 0, delay: 0, extend_fail: 0, background: false };
}

/// The store the callers use: faults and logging in front of a [`Planted`] store.
#[derive(Debug)]
pub struct FaultStore<S> {
    shared: Arc<Shared<S>>,
    /// This handle finishes detached steps (faults only under [`FaultRates::background`]).
    detached: bool,
}

#[derive(Debug)]
struct Shared<S> {
    store: Planted<S>,
    history: History,
    rates: FaultRates,
    rng: Mutex<SplitMix64>,
    /// Draws the faults of detached steps: a generator of their own, so that the other steps'
    /// faults stay those the seed drew before detached steps had any.
    background_rng: Mutex<SplitMix64>,
    /// Draws which delays are split, and where: a generator of its own, so that a history drawn
    /// without split delays is the one its seed drew before they existed.
    split_rng: Mutex<SplitMix64>,
    /// Percent of the delayed steps whose delay is split around the store's application.
    split: u32,
    lease: Duration,
    /// The tasks finishing detached steps.
    background: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl<S> Clone for FaultStore<S> {
    fn clone(&self) -> Self {
        FaultStore { shared: Arc::clone(&self.shared), detached: self.detached }
    }
}

/// The number of a simulation key (`<prefix>-<n>`).
fn key_number(key: &Key) -> usize {
    key.key().rsplit('-').next().and_then(|n| n.parse().ok()).unwrap_or(usize::MAX)
}

fn injected() -> StoreError {
    StoreError::Backend { backend: "sim", source: "injected fault: the store could not be reached".into() }
}

fn reply_of<T>(result: &Result<T, StoreError>, ok: impl FnOnce(&T) -> Reply) -> Reply {
    match result {
        Ok(value) => ok(value),
        Err(StoreError::NotOwner) => Reply::NotOwner,
        Err(e) => Reply::Failed(e.to_string()),
    }
}

fn claim_reply(claim: &Claim) -> Reply {
    match claim {
        Claim::Claimed => Reply::Claimed,
        Claim::Completed(record) => Reply::Completed(record.outcome.to_vec()),
        _ => Reply::InProgress,
    }
}

impl<S: Store + 'static> FaultStore<S> {
    /// `store` behind faults drawn at `rates` from `rng`, logging to `history`; `lease` is the
    /// lease the history's calls use (how long a delay must be to outlast it), and `split` the
    /// percent of delayed steps whose delay is split around the store's application.
    pub fn new(
        store: Planted<S>,
        history: History,
        rates: FaultRates,
        rng: SplitMix64,
        lease: Duration,
        split: u32,
    ) -> Self {
        let background_rng = Mutex::new(SplitMix64::new(rng.clone().next_u64() ^ 0xBAC6_D00D_5EED));
        let split_rng = Mutex::new(SplitMix64::new(rng.clone().next_u64() ^ 0x5B11_7DE1_A7ED));
        let (rng, background) = (Mutex::new(rng), Mutex::default());
        let shared = Shared { store, history, rates, rng, background_rng, split_rng, split, lease, background };
        FaultStore { shared: Arc::new(shared), detached: false }
    }

    /// Waits until every detached step handed to this store so far has ended.
    pub async fn background_ended(&self) {
        loop {
            let tasks = std::mem::take(&mut *self.shared.background.lock().unwrap_or_else(PoisonError::into_inner));
            if tasks.is_empty() {
                return;
            }
            for task in tasks {
                let _ = task.await;
            }
        }
    }

    /// The store under test, without faults or logging (for the end-of-history probe).
    #[must_use]
    pub fn inner(&self) -> &Planted<S> {
        &self.shared.store
    }

    fn draw(&self, op: Op) -> Fault {
        let rates = self.shared.rates;
        if self.detached && !rates.background {
            return Fault::None;
        }
        let rng = if self.detached { &self.shared.background_rng } else { &self.shared.rng };
        let mut rng = rng.lock().unwrap_or_else(PoisonError::into_inner);
        let roll = rng.below(100);
        let extend_fail = if op == Op::Extend { rates.extend_fail } else { 0 };
        let fail = u64::from(rates.fail + extend_fail);
        let lose = fail + u64::from(rates.lose_reply);
        let delay = lose + u64::from(rates.delay);
        let lease = self.shared.lease;
        let long = lease + lease * u32::try_from(rng.below(50)).unwrap_or(0) / 100;
        if roll < fail {
            Fault::Fail
        } else if roll < lose {
            Fault::LoseReply
        } else if roll < delay {
            let whole = if rng.chance(50) { Fault::DelayBefore(long) } else { Fault::DelayAfter(long) };
            self.split(whole, long)
        } else {
            Fault::None
        }
    }

    /// A delay of `long` drawn whole (`whole`), or split where the history splits delays: from
    /// 10 % to 90 % of it on the way to the store, the rest on the way back. A claim so split
    /// reaches the store well before its reply comes back late, so the lease the store started
    /// may be nearly over when the caller hears of it (RELIABILITY.md, row 42).
    fn split(&self, whole: Fault, long: Duration) -> Fault {
        if self.shared.split == 0 {
            return whole;
        }
        let mut rng = self.shared.split_rng.lock().unwrap_or_else(PoisonError::into_inner);
        if !rng.chance(self.shared.split) {
            return whole;
        }
        let before = long * (10 + u32::try_from(rng.below(81)).unwrap_or(0)) / 100;
        Fault::DelaySplit(before, long.saturating_sub(before))
    }

    /// Runs one step through the fault drawn for it and logs it.
    #[allow(clippy::too_many_arguments)]
    async fn step<T>(
        &self,
        op: Op,
        key: &Key,
        token: &Token,
        lease: Duration,
        outcome: Option<&[u8]>,
        run: impl Future<Output = Result<T, StoreError>>,
        reply: impl Fn(&Result<T, StoreError>) -> Reply,
    ) -> Result<T, StoreError> {
        let history = &self.shared.history;
        let fault = self.draw(op);
        let caller = CALLER.try_with(|c| *c).ok();
        let token_id = history.token_id(token);
        let log = |sent, replied, store: Reply, delivered: Reply| {
            history.log(Event::Step(Step {
                op,
                key: key_number(key),
                token: token_id,
                caller,
                detached: self.detached,
                fault,
                lease,
                outcome: outcome.map(<[u8]>::to_vec),
                sent,
                replied,
                store,
                delivered,
            }));
        };
        let mut sent = history.stamp();
        if fault == Fault::Fail {
            log(sent, sent, Reply::NotSent, Reply::Failed("injected".into()));
            return Err(injected());
        }
        if fault.before() > Duration::ZERO {
            // Logged now (the store is unreachable for this step), and again if it arrives.
            log(sent, sent, Reply::NotSent, Reply::Failed("delayed".into()));
            tokio::time::sleep(fault.before()).await;
            sent = history.stamp();
        }
        // Dropped while the store has the request (the caller was cancelled): logged as sent with
        // no answer, since the store may still apply it.
        let mut unanswered = OnDrop(Some(|| log(sent, history.stamp(), Reply::Unknown, Reply::Unknown)));
        let result = run.await;
        unanswered.0 = None;
        let replied = history.stamp();
        let store = reply(&result);
        // Logged as soon as the store has answered: a caller dropped during a delayed reply
        // never sees it, but the store has applied the step.
        if fault == Fault::LoseReply {
            log(sent, replied, store, Reply::Failed("injected".into()));
            return Err(injected());
        }
        log(sent, replied, store.clone(), store);
        if fault.after() > Duration::ZERO {
            tokio::time::sleep(fault.after()).await;
        }
        result
    }
}

impl<S: Store + 'static> Store for FaultStore<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // The store counts the lease from when the claim reaches it, as a store behind a network
        // does: the simulated network may hold a claim, and only a store with nothing between it
        // and the caller may take the caller's clock reading for the claim's moment (`sent_at`).
        let run = async {
            let request = request.sent_at(tokio::time::Instant::now());
            self.shared.store.claim(&request).await
        };
        self.step(Op::Claim, request.key, request.token, request.lease, None, run, |r| reply_of(r, claim_reply)).await
    }

    async fn complete(&self, c: &Completion<'_>) -> Result<(), StoreError> {
        let run = self.shared.store.complete(c);
        let lease = self.shared.lease;
        self.step(Op::Complete, c.key, c.token, lease, Some(c.outcome), run, |r| reply_of(r, |()| Reply::Ok)).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let run = self.shared.store.release(key, token);
        self.step(Op::Release, key, token, self.shared.lease, None, run, |r| reply_of(r, |()| Reply::Ok)).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        let run = self.shared.store.extend(key, token, lease);
        self.step(Op::Extend, key, token, lease, None, run, |r| reply_of(r, |()| Reply::Ok)).await
    }

    fn detach(&self, step: Detached) {
        let store = FaultStore { shared: Arc::clone(&self.shared), detached: true };
        let mut task = Box::pin(async move {
            let _ = step.finish(&store).await;
        });
        // The memory store finishes at once; a remote store's step, or one that met a fault,
        // goes on in a task.
        if task.as_mut().poll(&mut Context::from_waker(Waker::noop())) == Poll::Pending {
            let task = tokio::spawn(task);
            self.shared.background.lock().unwrap_or_else(PoisonError::into_inner).push(task);
        }
    }

    fn max_record_bytes(&self) -> usize {
        self.shared.store.max_record_bytes()
    }

    fn name(&self) -> &'static str {
        "sim"
    }

    /// As the memory store it wraps: its calls count their tokens up from per-thread randomness
    /// instead of asking the operating system for each, as calls on a memory store do.
    fn process_local(&self) -> bool {
        self.shared.store.process_local()
    }
}

/// Runs its closure when dropped, unless it was taken out first.
struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

//! The judgement: what the ledger, the answers the server sent and those the callers got show,
//! and the probe after the history.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

use super::Verdict;
use super::clients::{Ended, Final, RETRIED, RETRY_BUDGET, Tried, backoff, received};
use super::plan::{Ending, MessageForm, Plan, message};
use super::server::{Answer, Run, Seen, Server};
use crate::grpc::{PayRequest, PaymentsClient};

/// What the callers saw and the ledger says, per user and key. With store faults (`faulted`), a
/// run may follow another's recorded answer, by the limits README names (a record that could not
/// be written, a claim whose lease ran out while the store was unreachable): those are counted,
/// not judged. Then each caller's attempts ([`check_attempts`]).
pub(super) fn judge(
    server: &Server,
    plan: &Plan,
    ended: &[Ended],
    key_of: &(dyn Fn(usize) -> String + Sync),
    faulted: bool,
    verdict: &mut Verdict,
) {
    let runs = server.runs().clone();
    let sent = server.sent().clone();
    for &slot in plan.behaviours.keys() {
        let mine: Vec<&Run> = runs.iter().filter(|r| r.slot == slot).collect();
        let overlaps = mine.windows(2).filter(|p| p[1].started < p[0].ended.unwrap_or(p[0].started)).count();
        let recorded = mine.iter().filter(|r| r.ending.recorded()).count();
        let after_recorded = mine.iter().position(|r| r.ending.recorded()).map_or(0, |i| mine.len() - i - 1);
        if faulted {
            verdict.reruns_under_store_faults += (overlaps + after_recorded) as u64;
            continue;
        }
        if overlaps > 0 {
            verdict.violations.push(format!("{slot:?}: {overlaps} runs overlap the one before"));
        }
        if recorded > 1 || after_recorded > 0 {
            verdict.violations.push(format!(
                "{slot:?}: a run followed a recorded answer (runs {:?})",
                mine.iter().map(|r| r.ending).collect::<Vec<_>>()
            ));
        }
        let paid = mine.iter().filter(|r| r.paid).count();
        if paid > 1 {
            verdict.violations.push(format!("{slot:?}: paid {paid} times"));
        }
    }
    // One record per key: every replay of a key, the probe's too, is the same answer.
    let mut replays: BTreeMap<(usize, usize), &Seen> = BTreeMap::new();
    for s in sent.iter().filter(|s| s.replayed) {
        let Some((user, key, _)) = s.answer.tag() else { continue };
        let first = *replays.entry((user, key)).or_insert(s);
        if first.answer != s.answer {
            verdict.violations.push(format!(
                "{:?}: two different answers replayed: {:?} and {:?}",
                (user, key),
                first.answer,
                s.answer
            ));
        }
    }
    // Each run's own answer is sent once, after it ended; replays only after it ended too.
    for run in &runs {
        let tag = (run.slot.0, run.slot.1, run.n);
        let carrying = || sent.iter().filter(|s| s.answer.tag() == Some(tag));
        let fresh = carrying().filter(|s| !s.replayed).count();
        if fresh > 1 {
            verdict.violations.push(format!("run {tag:?}: its answer was sent {fresh} times unmarked as a replay"));
        }
        if carrying().any(|s| run.ended.is_none_or(|ended| s.at < ended)) {
            verdict.violations.push(format!("run {tag:?}: its answer was sent before it ended"));
        }
    }
    let answers =
        sent.iter().map(|s| ("sent", s)).chain(ended.iter().filter_map(|e| e.last.as_ref().ok()).map(|s| ("got", s)));
    for (how, s) in answers {
        check_answer(plan, &runs, key_of, how, s, faulted, verdict);
    }
    check_attempts(server, plan, ended, key_of, verdict);
}

/// Whether a caller of this kind retries after `outcome`: after no answer, or an answer with a
/// retried code and no negative pushback that is, for a layered caller, not a replay.
fn retried_after(layered: bool, outcome: &Final) -> bool {
    let Ok(seen) = outcome else { return true };
    let negative = seen.pushback.as_deref().is_some_and(|p| p.parse::<i64>().map_or(layered, |ms| ms < 0));
    RETRIED.contains(&seen.answer.code) && !negative && !(layered && seen.replayed)
}

/// The sequence of each caller's attempts, from its side (the hand loop's own notes, or the tap
/// under the layer) and from the server's log of the attempts that reached it (`x-caller`,
/// `x-attempt`, the `idempotency-key` metadata):
/// - each answer an attempt got is one the server sent that attempt;
/// - every attempt that reached the server carried the caller's key (plans keyed by metadata), or
///   one key for all of the call's attempts (plans keyed by message, where the layer sets one);
/// - no attempt reached the server past those its caller made, nor past the caller's attempts;
/// - an attempt follows only one that got no answer, or a retried code without a negative
///   pushback, and for a layered caller not a replay: a caller stops at a final answer;
/// - the pause before an attempt is at least the server's positive pushback (capped by the
///   budget), or else the lower end of the back-off;
/// - a caller that stopped at an answer inviting another attempt used up its attempts or its
///   budget: its time so far and the wait it would have had end past the budget;
/// - a layered caller gets its last attempt's answer, as it came.
fn check_attempts(
    server: &Server,
    plan: &Plan,
    ended: &[Ended],
    key_of: &(dyn Fn(usize) -> String + Sync),
    verdict: &mut Verdict,
) {
    let arrived = server.arrived().clone();
    for (i, (caller, e)) in plan.callers.iter().zip(ended).enumerate() {
        let kind = if caller.layered { "layered caller" } else { "caller" };
        let mine: Vec<_> = arrived.iter().filter(|a| a.caller == i).collect();
        let keys: Vec<Option<&str>> = mine.iter().map(|a| a.key.as_deref()).collect();
        let own = key_of(caller.key);
        let keyed = if plan.keyed_by_message {
            keys.windows(2).all(|w| w[0] == w[1])
        } else {
            keys.iter().all(|k| *k == Some(own.as_str()))
        };
        if !keyed {
            verdict.violations.push(format!(
                "{kind} {i}: its attempts reached the server with keys {keys:?}, not all {}",
                if plan.keyed_by_message { "one key".to_owned() } else { format!("{own:?}") }
            ));
        }
        let made = e.tried.len();
        if made > caller.attempts as usize {
            verdict.violations.push(format!("{kind} {i}: {made} attempts, of {} at most", caller.attempts));
        }
        if let Some(a) = mine.iter().find(|a| a.attempt == 0 || a.attempt > made) {
            verdict
                .violations
                .push(format!("{kind} {i}: its attempt {} reached the server, but it made {made}", a.attempt));
        }
        // What the caller's side saw of each attempt is what the server sent that attempt, but
        // for the `CANCELLED` tonic's server answers (outside the log) when the attempt's deadline
        // passed.
        let sent = server.sent();
        for (n, tried) in e.tried.iter().enumerate() {
            let Ok(got) = &tried.outcome else { continue };
            let by_tonic = got.answer.code == Code::Cancelled && got.answer.tag().is_none();
            let logged = sent.iter().any(|s| (s.caller, s.attempt) == (i, n + 1) && s.says_the_same(got));
            if !logged && !by_tonic {
                verdict
                    .violations
                    .push(format!("{kind} {i}: its attempt {} got {got:?}, which the server did not send it", n + 1));
            }
        }
        drop(sent);
        check_pauses(kind, i, caller.layered, &e.tried, verdict);
        let Some(last) = e.tried.last() else {
            verdict.violations.push(format!("{kind} {i}: no attempt made ({:?})", e.last));
            continue;
        };
        if made < caller.attempts as usize && retried_after(caller.layered, &last.outcome) {
            let pushback = positive_pushback(&last.outcome);
            let most =
                pushback.map_or(backoff(u32::try_from(made).unwrap_or(5)), Duration::from_millis).min(RETRY_BUDGET);
            let taken = e.returned.saturating_duration_since(e.called);
            if taken + most < RETRY_BUDGET {
                verdict.violations.push(format!(
                    "{kind} {i}: stopped after {made} of {} attempts at {:?}, {taken:?} into a budget of \
                     {RETRY_BUDGET:?}, with a wait of at most {most:?} to go",
                    caller.attempts, last.outcome
                ));
            }
        }
        if caller.layered {
            let same = match (&last.outcome, &e.last) {
                (Ok(tried), Ok(got)) => tried.says_the_same(got),
                (Err(_), Err(_)) => true,
                // An answer cut off comes back as the layer's UNAVAILABLE.
                (Err(reason), Ok(got)) => reason.starts_with("cut off") && got.answer.code == Code::Unavailable,
                (Ok(_), Err(_)) => false,
            };
            if !same {
                verdict
                    .violations
                    .push(format!("{kind} {i}: its last attempt got {:?}, and it got {:?}", last.outcome, e.last));
            }
        }
    }
}

/// A caller's pauses: an attempt follows only one that invited it, and no sooner than the
/// server's positive pushback (capped by the budget) or the lower end of the back-off.
fn check_pauses(kind: &str, i: usize, layered: bool, tried: &[Tried], verdict: &mut Verdict) {
    for (n, pair) in tried.windows(2).enumerate() {
        let (before, after): (&Tried, &Tried) = (&pair[0], &pair[1]);
        if !retried_after(layered, &before.outcome) {
            verdict.violations.push(format!(
                "{kind} {i}: attempt {} followed attempt {}, which got a final answer: {:?}",
                n + 2,
                n + 1,
                before.outcome
            ));
            continue;
        }
        let pushback = positive_pushback(&before.outcome);
        let least = pushback
            .map_or(backoff(u32::try_from(n + 1).unwrap_or(5)) / 2, |ms| Duration::from_millis(ms).min(RETRY_BUDGET));
        let pause = before.done.map(|done| after.sent.saturating_duration_since(done));
        if pause.is_none_or(|pause| pause + Duration::from_millis(1) < least) {
            verdict.violations.push(format!(
                "{kind} {i}: attempt {} was sent {pause:?} after attempt {} ended, before the least wait \
                 {least:?} (pushback {pushback:?})",
                n + 2,
                n + 1
            ));
        }
    }
}

/// The positive pushback an outcome carries, in milliseconds.
fn positive_pushback(outcome: &Final) -> Option<u64> {
    outcome.as_ref().ok().and_then(|s| s.pushback.as_deref()?.parse::<u64>().ok())
}

/// The message caller `c` sends.
fn message_of(plan: &Plan, key_of: &(dyn Fn(usize) -> String + Sync), c: usize) -> Option<PayRequest> {
    let caller = plan.callers.get(c)?;
    Some(message(plan, caller.key, &key_of(caller.key), caller.message))
}

/// One answer, against the runs of its caller's user and key.
fn check_answer(
    plan: &Plan,
    runs: &[Run],
    key_of: &(dyn Fn(usize) -> String + Sync),
    how: &str,
    s: &Seen,
    faulted: bool,
    verdict: &mut Verdict,
) {
    let (Some(caller), Some(request)) = (plan.callers.get(s.caller), message_of(plan, key_of, s.caller)) else {
        return; // the probe's
    };
    let slot = (caller.user, caller.key);
    let what = format!(
        "caller {} {how} {:?} {:?} {:?}{}",
        s.caller,
        s.answer.code,
        s.answer.message,
        s.answer.receipt,
        if s.replayed { " (replayed)" } else { "" }
    );
    let pushback = s.pushback.as_deref().map(|p| p.parse::<i64>().map_err(|_| p.to_owned()));
    let Some((user, key, n)) = s.answer.tag() else {
        if s.answer.code == Code::Ok {
            verdict.violations.push(format!("{what}: an OK that no run answered"));
        }
        if s.answer.code == Code::Aborted && !matches!(pushback, Some(Ok(1..))) {
            verdict.violations.push(format!("{what}: ABORTED without a positive pushback ({:?})", s.pushback));
        }
        let others = plan.callers.iter().enumerate().filter(|(_, c)| (c.user, c.key) == slot);
        if s.answer.code == Code::FailedPrecondition
            && others.into_iter().all(|(i, _)| message_of(plan, key_of, i).as_ref() == Some(&request))
        {
            verdict
                .violations
                .push(format!("{what}: FAILED_PRECONDITION, but every caller of the key sent this message"));
        }
        if s.replayed && !faulted {
            verdict.violations.push(format!("{what}: a replay that no run answered"));
        }
        return;
    };
    let Some(run) = runs.iter().find(|r| r.slot == (user, key) && r.n == n) else {
        verdict.violations.push(format!("{what}: no such run"));
        return;
    };
    if run.slot != slot {
        verdict.violations.push(format!("{what}: the answer of another user's or key's run {:?}", run.slot));
    }
    if run.answer.as_ref() != Some(&s.answer) {
        verdict.violations.push(format!("{what}: not what run {} answered ({:?})", run.n, run.answer));
    }
    if run.request != request {
        verdict.violations.push(format!("{what}: the answer of a call with another message ({:?})", run.request));
    }
    if s.replayed && !run.ending.recorded() {
        verdict.violations.push(format!("{what}: replays an answer that is not recorded ({:?})", run.ending));
    }
    if !s.replayed && run.caller != s.caller {
        verdict
            .violations
            .push(format!("{what}: run {} was caller {}'s, and this is not marked replayed", run.n, run.caller));
    }
    match (s.replayed, s.answer.code, &pushback) {
        (true, Code::Ok, None) | (false, _, None) | (true, _, Some(Ok(..0))) => {}
        (true, Code::Ok, Some(_)) | (false, _, Some(_)) => {
            verdict.violations.push(format!("{what}: a pushback it should not carry ({:?})", s.pushback));
        }
        (true, _, _) => {
            verdict.violations.push(format!("{what}: a replayed error without a negative pushback ({:?})", s.pushback));
        }
    }
}

/// The `x-caller` of the probe's calls.
const PROBE: usize = usize::MAX;

/// After the history, on a server of its own over the store itself (no proxy, no store faults):
/// each key replays its recorded answer, or runs once now. Without store faults, each key is then
/// paid exactly once (none if it was declined); with them, the probe replays what was replayed
/// before, if anything was.
pub(super) async fn probe(
    server: &Server,
    plan: &Plan,
    addr: SocketAddr,
    key_of: &(dyn Fn(usize) -> String + Sync),
    faulted: bool,
    verdict: &mut Verdict,
) {
    let channel = Channel::from_shared(format!("http://{addr}")).expect("the probe's address").connect_lazy();
    let client = PaymentsClient::new(channel);
    for &slot in plan.behaviours.keys() {
        let runs: Vec<Run> = server.runs().iter().filter(|r| r.slot == slot).cloned().collect();
        // The run whose answer was replayed, if one was.
        let replayed = server
            .sent()
            .iter()
            .filter(|s| s.replayed)
            .find_map(|s| s.answer.tag().filter(|t| (t.0, t.1) == slot))
            .and_then(|t| runs.iter().find(|r| r.n == t.2).cloned());
        let messages = probe_messages(plan, slot, &key_of(slot.1), replayed.as_ref(), &runs);
        // A completion that failed keeps its claim for its lease.
        let blocked_until = Instant::now() + plan.lease * if faulted { 3 } else { 1 } + Duration::from_secs(3);
        let ask = |request: PayRequest| ask(client.clone(), plan, slot, key_of(slot.1), request);
        let (answer, asked) = match probe_key(ask, &messages, blocked_until, faulted).await {
            Ok(probed) => probed,
            Err(e) => {
                verdict.violations.push(format!("{slot:?}: the probe failed: {e}"));
                return;
            }
        };
        let runs: Vec<Run> = server.runs().iter().filter(|r| r.slot == slot).cloned().collect();
        let probe_run = runs.iter().find(|r| r.caller == PROBE);
        let first_recorded = runs.iter().find(|r| r.ending.recorded());
        let answered = |run: &Run| run.answer.as_ref() == Some(&answer.answer);
        let fine = match (faulted, &replayed, probe_run) {
            // Without store faults the first recorded answer is the record.
            (false, _, Some(run)) => {
                first_recorded.is_some_and(|first| first.n == run.n) && !answer.replayed && answered(run)
            }
            (false, _, None) => answer.replayed && first_recorded.is_some_and(answered),
            (true, Some(before), None) => answer.replayed && answered(before),
            (true, Some(_), Some(_)) => false,
            (true, None, Some(run)) => !answer.replayed && answered(run),
            (true, None, None) => answer.replayed && runs.iter().any(|r| r.ending.recorded() && answered(r)),
        };
        if !fine {
            verdict.violations.push(format!(
                "{slot:?}: the probe got {answer:?} after {asked} call(s); the key's runs: {:?}",
                runs.iter().map(|r| (r.caller, r.ending, r.answer.clone())).collect::<Vec<_>>()
            ));
        }
        // A declined call is final, and pays nothing.
        let declined = runs.iter().any(|r| r.ending == Ending::Declined);
        let paid = runs.iter().filter(|r| r.paid).count();
        if !faulted && paid != usize::from(!declined) {
            verdict.violations.push(format!("{slot:?}: paid {paid} times after the probe (declined: {declined})"));
        }
    }
}

/// The messages the probe tries for `slot`: the recorded call's first, so the probe is the same
/// call; then the other messages the key was sent with (a claim left by a failed release or a
/// lost reply holds its message's fingerprint until its lease ends); then the key's own.
fn probe_messages(
    plan: &Plan,
    slot: (usize, usize),
    key_text: &str,
    replayed: Option<&Run>,
    runs: &[Run],
) -> Vec<PayRequest> {
    let sent_with =
        plan.callers.iter().filter(|c| (c.user, c.key) == slot).map(|c| message(plan, c.key, key_text, c.message));
    let mut messages: Vec<PayRequest> = Vec::new();
    for request in replayed
        .into_iter()
        .chain(runs.iter().filter(|r| r.ending.recorded()))
        .map(|r| r.request.clone())
        .chain(sent_with)
        .chain([message(plan, slot.1, key_text, MessageForm::Same)])
    {
        if !messages.contains(&request) {
            messages.push(request);
        }
    }
    messages
}

/// Whether `answer` is the layer saying the key is busy: `ABORTED` (a claim runs), or a
/// `FAILED_PRECONDITION` of its own (a claim or record of another message), not the handler's.
fn busy(answer: &Answer) -> bool {
    answer.code == Code::Aborted || (answer.code == Code::FailedPrecondition && answer.tag().is_none())
}

/// Asks with each of `messages` until an answer is not [`busy`]; when every message met a claim
/// (`ABORTED`), or under store faults a claim of another message, asks again until
/// `blocked_until`, since a claim ends with its lease. Without store faults, a
/// `FAILED_PRECONDITION` for every message the key was sent with is final. Returns the last answer
/// and how many calls it took.
async fn probe_key<F: Future<Output = Result<Seen, String>>>(
    ask: impl Fn(PayRequest) -> F,
    messages: &[PayRequest],
    blocked_until: Instant,
    faulted: bool,
) -> Result<(Seen, u32), String> {
    let mut asked = 0;
    loop {
        let (mut last, mut aborted) = (None, false);
        for request in messages {
            let got = ask(request.clone()).await?;
            asked += 1;
            if !busy(&got.answer) {
                return Ok((got, asked));
            }
            aborted |= got.answer.code == Code::Aborted;
            last = Some(got);
        }
        if Instant::now() >= blocked_until || !(aborted || faulted) {
            return Ok((last.expect("at least the key's own message was tried"), asked));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One call of the probe, straight to the probe's server.
async fn ask(
    mut client: PaymentsClient<Channel>,
    plan: &Plan,
    slot: (usize, usize),
    key: String,
    request: PayRequest,
) -> Result<Seen, String> {
    let mut request = tonic::Request::new(request);
    let metadata = request.metadata_mut();
    if !plan.keyed_by_message {
        metadata.insert("idempotency-key", key.parse().map_err(|e| format!("{e}"))?);
    }
    metadata.insert("x-user", slot.0.into());
    metadata.insert("x-key", slot.1.into());
    metadata.insert("x-caller", PROBE.into());
    metadata.insert("x-probe", tonic::metadata::MetadataValue::from_static("1"));
    let result = client.pay(request).await;
    if let Err(status) = &result
        && std::error::Error::source(status).is_some()
    {
        return Err(format!("{:?} in the transport: {}", status.code(), status.message()));
    }
    Ok(received(PROBE, &result))
}

//! The judgement: what the ledger and the responses show, and the probe after the history.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use idempotent_runtime::http::IDEMPOTENCY_KEY;
use tokio::time::Instant;

use super::Verdict;
use super::clients::Final;
use super::plan::{BodyForm, Ending, Plan, request_body, same_request};
use super::server::{Downstream, Run, Seen, Server, seen};

/// What the callers saw and the ledger says, per user and key. With store faults (`faulted`), a
/// run may follow another's recorded answer, by the limits README names (a record that could not
/// be written, a claim whose lease ran out while the store was unreachable): those are counted,
/// not judged.
pub(super) fn judge(
    server: &Server,
    plan: &Plan,
    finals: &[Final],
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
        let charges = mine.iter().filter(|r| r.charged).count();
        if charges > 1 {
            verdict.violations.push(format!("{slot:?}: charged {charges} times"));
        }
    }
    // One record per key: every replay of a key, the probe's too, is the same answer.
    let mut replays: BTreeMap<(usize, usize), &Seen> = BTreeMap::new();
    for s in sent.iter().filter(|s| s.replayed) {
        let Some((user, key, _)) = tag_of(&s.body) else { continue };
        let first = *replays.entry((user, key)).or_insert(s);
        if (first.status, &first.body) != (s.status, &s.body) {
            verdict.violations.push(format!(
                "{:?}: two different answers replayed: {} {} and {} {}",
                (user, key),
                first.status,
                String::from_utf8_lossy(&first.body),
                s.status,
                String::from_utf8_lossy(&s.body)
            ));
        }
    }
    if let Some(bank) = &server.downstream {
        judge_downstream(bank, verdict);
    }
    let responses =
        sent.iter().map(|s| ("sent", s)).chain(finals.iter().filter_map(|f| f.as_ref().ok()).map(|s| ("got", s)));
    for (how, s) in responses {
        check_response(plan, &runs, key_of, how, s, verdict);
    }
}

/// Every upstream key that called the downstream service ran it exactly once, under a key of its
/// own: however often the handler ran for that key (a panic or a not-processed answer released
/// it, store faults let a duplicate take it over), each run derived the same downstream key. This
/// holds under store faults too: the downstream service has its own store.
fn judge_downstream(bank: &Downstream, verdict: &mut Verdict) {
    let mut called = bank.called();
    called.sort_unstable();
    called.dedup();
    let runs = bank.runs();
    for slot in called {
        let keys: Vec<&String> = runs.iter().filter(|(s, _)| *s == slot).map(|(_, key)| key).collect();
        if keys.len() != 1 {
            verdict.violations.push(format!(
                "{slot:?}: the handler called the downstream service, which ran {} times (keys {keys:?})",
                keys.len()
            ));
        }
    }
    let mut keys: Vec<&String> = runs.iter().map(|(_, key)| key).collect();
    keys.sort_unstable();
    if keys.windows(2).any(|pair| pair[0] == pair[1]) {
        verdict.violations.push(format!("two upstream keys derived the same downstream key: {runs:?}"));
    }
}

/// One response, against the runs of its caller's user and key.
fn check_response(
    plan: &Plan,
    runs: &[Run],
    key_of: &(dyn Fn(usize) -> String + Sync),
    how: &str,
    s: &Seen,
    verdict: &mut Verdict,
) {
    let Some(caller) = plan.callers.get(s.caller) else {
        return; // the probe's
    };
    let slot = (caller.user, caller.key);
    let body = request_body(caller.key, caller.body);
    let what = format!("caller {} {how} {} {}", s.caller, s.status, String::from_utf8_lossy(&s.body));
    if s.key_echo != Some(key_of(caller.key)) {
        verdict.violations.push(format!("{what}: the key echoed back is {:?}", s.key_echo));
    }
    let Some((user, key, n)) = tag_of(&s.body) else {
        if (200..300).contains(&s.status) {
            verdict.violations.push(format!("{what}: a 2xx that no run answered"));
        }
        let others = plan.callers.iter().filter(|c| (c.user, c.key) == slot);
        if s.status == 422 && others.into_iter().all(|c| same_request(plan, &request_body(c.key, c.body), &body)) {
            verdict.violations.push(format!("{what}: 422, but every caller of the key sent this request's body"));
        }
        return;
    };
    let run = runs.iter().find(|r| r.slot == (user, key) && r.n == n);
    let Some(run) = run else {
        verdict.violations.push(format!("{what}: no such run"));
        return;
    };
    if run.slot != slot {
        verdict.violations.push(format!("{what}: the answer of another user's or key's run {:?}", run.slot));
    }
    if run.answer.as_ref() != Some(&(s.status, s.body.clone())) {
        verdict.violations.push(format!("{what}: not what run {} answered ({:?})", run.n, run.answer));
    }
    if !same_request(plan, &run.body, &body) {
        verdict.violations.push(format!("{what}: the answer of a request with another body"));
    }
    if s.replayed && !run.ending.recorded() {
        verdict.violations.push(format!("{what}: replays an answer that is not recorded ({:?})", run.ending));
    }
    if !s.replayed && run.caller != s.caller {
        verdict
            .violations
            .push(format!("{what}: run {} was caller {}'s, and this is not marked replayed", run.n, run.caller));
    }
}

/// The `x-caller` of the probe's requests.
const PROBE: usize = usize::MAX;

/// The run a response's body names: (user, key, run).
fn tag_of(body: &[u8]) -> Option<(usize, usize, usize)> {
    let value = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    let number = |field: &str| value.get(field)?.as_u64().and_then(|n| usize::try_from(n).ok());
    Some((number("user")?, number("key")?, number("run")?))
}

/// After the history, on a server of its own without store faults: each key replays its
/// recorded answer, or runs once now. Without store faults, each key is then charged exactly
/// once (none if its request was declined); with them, the probe replays what was replayed
/// before, if anything was.
pub(super) async fn probe(
    server: &Server,
    plan: &Plan,
    addr: SocketAddr,
    key_of: &(dyn Fn(usize) -> String + Sync),
    faulted: bool,
    verdict: &mut Verdict,
) {
    let client = reqwest::Client::new();
    for &slot in plan.behaviours.keys() {
        let runs: Vec<Run> = server.runs().iter().filter(|r| r.slot == slot).cloned().collect();
        // The run whose answer was replayed, if one was.
        let replayed = server
            .sent()
            .iter()
            .filter(|s| s.replayed)
            .find_map(|s| tag_of(&s.body).filter(|t| (t.0, t.1) == slot))
            .and_then(|t| runs.iter().find(|r| r.n == t.2).cloned());
        let bodies = probe_bodies(plan, slot, replayed.as_ref(), &runs);
        // A completion that failed keeps its claim for its lease.
        let blocked_until = Instant::now() + plan.lease * if faulted { 3 } else { 1 } + Duration::from_secs(3);
        let ask = |body: Bytes| ask(&client, addr, slot, key_of(slot.1), body);
        let (answer, asked) = match probe_key(ask, &bodies, blocked_until, faulted).await {
            Ok(probed) => probed,
            Err(e) => {
                verdict.violations.push(format!("{slot:?}: the probe failed: {e}"));
                return;
            }
        };
        let runs: Vec<Run> = server.runs().iter().filter(|r| r.slot == slot).cloned().collect();
        let probe_run = runs.iter().find(|r| r.caller == PROBE);
        let first_recorded = runs.iter().find(|r| r.ending.recorded());
        let answered = |run: &Run| run.answer == Some((answer.status, answer.body.clone()));
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
                "{slot:?}: the probe got {answer:?} after {asked} request(s); the key's runs: {:?}",
                runs.iter().map(|r| (r.caller, r.ending, r.answer.clone())).collect::<Vec<_>>()
            ));
        }
        // A declined request is final, and charges nothing.
        let declined = runs.iter().any(|r| r.ending == Ending::Declined);
        let charges = runs.iter().filter(|r| r.charged).count();
        if !faulted && charges != usize::from(!declined) {
            verdict
                .violations
                .push(format!("{slot:?}: charged {charges} times after the probe (declined: {declined})"));
        }
    }
}

/// The bodies the probe tries for `slot`: the recorded request's first, so the probe is the same
/// request; then the other bodies the key was sent with (a claim left by a failed release or a
/// lost reply holds its request's fingerprint until its lease ends); then the canonical one.
fn probe_bodies(plan: &Plan, slot: (usize, usize), replayed: Option<&Run>, runs: &[Run]) -> Vec<Bytes> {
    let sent_with = plan.callers.iter().filter(|c| (c.user, c.key) == slot).map(|c| request_body(c.key, c.body));
    let mut bodies: Vec<Bytes> = Vec::new();
    for body in replayed
        .into_iter()
        .chain(runs.iter().filter(|r| r.ending.recorded()))
        .map(|r| r.body.clone())
        .chain(sent_with)
        .chain([request_body(slot.1, BodyForm::Canonical)])
    {
        if !bodies.contains(&body) {
            bodies.push(body);
        }
    }
    bodies
}

/// Asks with each of `bodies` until an answer is neither `409` nor `422`; when every body met a
/// claim (`409`), or under store faults a claim of another request (`422`), asks again until
/// `blocked_until`, since a claim ends with its lease. Without store faults, a `422` for every
/// body the key was sent with is final. Returns the last answer and how many requests it took.
async fn probe_key<F: Future<Output = Result<Seen, String>>>(
    ask: impl Fn(Bytes) -> F,
    bodies: &[Bytes],
    blocked_until: Instant,
    faulted: bool,
) -> Result<(Seen, u32), String> {
    let mut asked = 0;
    loop {
        let (mut last, mut busy) = (None, false);
        for body in bodies {
            let got = ask(body.clone()).await?;
            asked += 1;
            if got.status != 409 && got.status != 422 {
                return Ok((got, asked));
            }
            busy |= got.status == 409;
            last = Some(got);
        }
        if Instant::now() >= blocked_until || !(busy || faulted) {
            return Ok((last.expect("at least the canonical body was tried"), asked));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One request of the probe, straight to the server.
async fn ask(
    client: &reqwest::Client,
    addr: SocketAddr,
    slot: (usize, usize),
    key: String,
    body: Bytes,
) -> Result<Seen, String> {
    let response = client
        .post(format!("http://{addr}/charge"))
        .header(IDEMPOTENCY_KEY, key)
        .header("x-user", slot.0.to_string())
        .header("x-key", slot.1.to_string())
        .header("x-caller", PROBE.to_string())
        .header("x-probe", "1")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let (status, headers) = (response.status(), response.headers().clone());
    let bytes = response.bytes().await.unwrap_or_default();
    Ok(seen(PROBE, status, &headers, &bytes))
}

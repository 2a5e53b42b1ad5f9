//! The batched steps (`claim_many`, `complete_many`): each request answered as its own step would
//! answer it, in the requests' order, with one winner per key.

use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::{Claim, ClaimRequest, Completion, Fingerprint, Key, Record, Store, StoreError, Token};

use super::{Expiry, claim_request, unique};
use crate::StoreSteps;

const LEASE_MS: u64 = 30_000;
const RETENTION: Duration = Duration::from_secs(60);

/// The keys `k0`, `k1`, ... of a fresh scope.
fn keys(name: &str, count: usize) -> Vec<Key> {
    let scope = unique(name);
    (0..count).map(|i| Key::new(&scope, &format!("k{i}")).unwrap()).collect()
}

/// The answers of a batch that must not fail as a whole.
async fn claimed<S: Store>(store: &S, requests: &[ClaimRequest<'_>]) -> Vec<Result<Claim, StoreError>> {
    let answers = store.claim_many(requests).await.expect("the batch of claims failed as a whole");
    assert_eq!(answers.len(), requests.len(), "one answer per request");
    answers
}

async fn completed<S: Store>(store: &S, completions: &[Completion<'_>]) -> Vec<Result<(), StoreError>> {
    let answers = store.complete_many(completions).await.expect("the batch of completions failed as a whole");
    assert_eq!(answers.len(), completions.len(), "one answer per completion");
    answers
}

/// A completion refused because another token holds the key: `NotOwner`, which a transactional
/// store reports as the transaction's `Aborted` (its work can no longer commit).
fn is_refused(answer: &Result<(), StoreError>) -> bool {
    match answer {
        Err(StoreError::NotOwner) => true,
        Err(StoreError::Aborted { source, .. }) => matches!(source.downcast_ref(), Some(StoreError::NotOwner)),
        _ => false,
    }
}

fn is_claimed(answer: &Result<Claim, StoreError>) -> bool {
    matches!(answer, Ok(Claim::Claimed))
}

/// Running with `fingerprint`: what a claim of a key another token holds answers.
fn assert_running(answer: &Result<Claim, StoreError>, fingerprint: Option<&Fingerprint>, what: &str) {
    match answer {
        Ok(Claim::InProgress { fingerprint: found, .. }) => assert_eq!(found.as_ref(), fingerprint, "{what}"),
        other => panic!("{what}: expected InProgress, got {other:?}"),
    }
}

/// A batch mixing every state a key can be in: new keys, a completed one (replayed), one another
/// token holds, one this request's token holds already, one asked for twice by two tokens (one
/// wins) and one asked for twice by one token (both hold it). Then the batch's claims are real:
/// single steps see them, and only their owners complete them.
pub async fn batched_claims_answer_as_single_claims<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let k = keys("batched-claims", 7);
    let (new, done, running, mine, contested, new2, same) = (&k[0], &k[1], &k[2], &k[3], &k[4], &k[5], &k[6]);
    let tokens: Vec<Token> = (0..8).map(|_| Token::new()).collect();
    let [owner, t1, t2, t3, ta, tb, tc, other] = <[&Token; 8]>::try_from(tokens.iter().collect::<Vec<_>>()).unwrap();
    let fp = Fingerprint::of(&("alice", 100)).unwrap();
    let running_fp = Fingerprint::of(&"running").unwrap();

    assert_eq!(store.claim(&claim_request(done, owner, Some(&fp), LEASE_MS)).await.unwrap(), Claim::Claimed);
    store.complete(&Completion::new(done, owner, Some(&fp), br#"{"Ok":"done"}"#, RETENTION)).await.unwrap();
    assert_eq!(store.claim(&claim_request(running, owner, Some(&running_fp), LEASE_MS)).await.unwrap(), Claim::Claimed);
    assert_eq!(store.claim(&claim_request(mine, t1, None, LEASE_MS)).await.unwrap(), Claim::Claimed);

    let requests = [
        claim_request(new, t1, Some(&fp), LEASE_MS),
        claim_request(done, t2, Some(&fp), LEASE_MS),
        claim_request(running, t3, None, LEASE_MS),
        claim_request(mine, t1, None, LEASE_MS),
        claim_request(contested, ta, Some(&fp), LEASE_MS),
        claim_request(new2, t2, None, LEASE_MS),
        claim_request(contested, tb, Some(&fp), LEASE_MS),
        claim_request(same, tc, None, LEASE_MS),
        claim_request(same, tc, None, LEASE_MS),
    ];
    let answers = claimed(&*store, &requests).await;
    assert!(is_claimed(&answers[0]), "a new key: {:?}", answers[0]);
    let record = Claim::Completed(Record::new(Some(fp.clone()), br#"{"Ok":"done"}"#.to_vec()));
    assert_eq!(answers[1].as_ref().ok(), Some(&record), "a completed key is replayed");
    assert_running(&answers[2], Some(&running_fp), "a key another token holds");
    // With the running call's remaining lease, when the store's single claim reports it.
    let single = store.claim(&claim_request(running, t3, None, LEASE_MS)).await.unwrap();
    let lease_of = |claim: &Claim| matches!(claim, Claim::InProgress { lease_remaining: Some(_), .. });
    assert_eq!(lease_of(answers[2].as_ref().unwrap()), lease_of(&single), "{:?} against {single:?}", answers[2]);
    assert!(is_claimed(&answers[3]), "a key this token holds already: {:?}", answers[3]);
    assert!(is_claimed(&answers[5]), "a new key after the others: {:?}", answers[5]);
    assert!(is_claimed(&answers[7]) && is_claimed(&answers[8]), "one token twice: {:?}", &answers[7..]);
    let (winner, loser) = match (is_claimed(&answers[4]), is_claimed(&answers[6])) {
        (true, false) => ((ta, 4), 6),
        (false, true) => ((tb, 6), 4),
        both => panic!("one of two tokens must win a key, not {both:?}: {:?} and {:?}", answers[4], answers[6]),
    };
    assert_running(&answers[loser], Some(&fp), "the contested key's second request");

    // The batch's claims hold against single steps.
    for held in [new, mine, contested, new2, same] {
        assert!(
            matches!(store.claim(&claim_request(held, other, None, LEASE_MS)).await, Ok(Claim::InProgress { .. })),
            "{held:?} was claimed by the batch"
        );
    }
    let loser_token = if loser == 4 { ta } else { tb };
    assert!(is_refused(&store.complete_as(contested, loser_token, b"{}", RETENTION).await), "the contest's loser");
    store.complete_as(contested, winner.0, br#"{"Ok":1}"#, RETENTION).await.unwrap();
    store.complete_as(new, t1, br#"{"Ok":2}"#, RETENTION).await.unwrap();
    store.release(same, tc).await.unwrap();
    assert_eq!(store.claim(&claim_request(same, other, None, LEASE_MS)).await.unwrap(), Claim::Claimed);
}

/// Completions in one batch: the owners' are recorded, a key another token took is refused and
/// left alone, a completion repeated by its own token (in a later batch or twice in one) succeeds
/// and changes nothing.
pub async fn batched_completions_answer_as_single_completions<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let k = keys("batched-completions", 4);
    let tokens: Vec<Token> = (0..5).map(|_| Token::new()).collect();
    let fp = Fingerprint::of(&"request").unwrap();
    for (key, token) in k.iter().zip(&tokens) {
        assert_eq!(store.claim(&claim_request(key, token, Some(&fp), LEASE_MS)).await.unwrap(), Claim::Claimed);
    }
    let intruder = &tokens[4];
    let completions = [
        Completion::new(&k[0], &tokens[0], Some(&fp), br#"{"Ok":0}"#, RETENTION),
        Completion::new(&k[1], &tokens[1], Some(&fp), br#"{"Ok":1}"#, RETENTION),
        Completion::new(&k[2], intruder, None, br#"{"Ok":"intruder"}"#, RETENTION),
        Completion::new(&k[3], &tokens[3], Some(&fp), br#"{"Ok":3}"#, RETENTION),
        Completion::new(&k[3], &tokens[3], Some(&fp), br#"{"Ok":3}"#, RETENTION),
    ];
    let answers = completed(&*store, &completions).await;
    assert!(answers[0].is_ok() && answers[1].is_ok() && answers[3].is_ok() && answers[4].is_ok(), "{answers:?}");
    assert!(is_refused(&answers[2]), "another token's key: {:?}", answers[2]);

    // Sent again (a batch whose reply was lost): every owner's completion succeeds, unchanged.
    let again = completed(&*store, &completions[..2]).await;
    assert!(again.iter().all(Result::is_ok), "{again:?}");

    let reader = Token::new();
    for (i, key) in [(0, &k[0]), (1, &k[1]), (3, &k[3])] {
        let record = Claim::Completed(Record::new(Some(fp.clone()), format!(r#"{{"Ok":{i}}}"#).into_bytes()));
        assert_eq!(store.claim(&claim_request(key, &reader, None, LEASE_MS)).await.unwrap(), record, "k{i}");
    }
    assert_running(&store.claim(&claim_request(&k[2], &reader, None, LEASE_MS)).await, Some(&fp), "untouched");
    store.complete_as(&k[2], &tokens[2], br#"{"Ok":2}"#, RETENTION).await.unwrap();
}

/// A batch of many keys: every answer lands on its own request (the order is kept), and the
/// completions' outcomes on their own keys.
pub async fn batched_steps_keep_each_answer_on_its_request<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    const COUNT: usize = 200;
    let k = keys("batched-order", COUNT);
    let tokens: Vec<Token> = (0..COUNT).map(|_| Token::new()).collect();
    // Every third key is completed beforehand with its index; the batch claims all of them.
    for i in (0..COUNT).step_by(3) {
        assert_eq!(store.claim(&claim_request(&k[i], &tokens[i], None, LEASE_MS)).await.unwrap(), Claim::Claimed);
        store.complete_as(&k[i], &tokens[i], format!(r#"{{"Ok":{i}}}"#).as_bytes(), RETENTION).await.unwrap();
    }
    let fresh: Vec<Token> = (0..COUNT).map(|_| Token::new()).collect();
    let requests: Vec<ClaimRequest<'_>> = (0..COUNT).map(|i| claim_request(&k[i], &fresh[i], None, LEASE_MS)).collect();
    let answers = claimed(&*store, &requests).await;
    for (i, answer) in answers.iter().enumerate() {
        if i % 3 == 0 {
            let record = Claim::Completed(Record::new(None, format!(r#"{{"Ok":{i}}}"#).into_bytes()));
            assert_eq!(answer.as_ref().ok(), Some(&record), "k{i}");
        } else {
            assert!(is_claimed(answer), "k{i}: {answer:?}");
        }
    }
    let outcomes: Vec<String> = (0..COUNT).map(|i| format!(r#"{{"Ok":"batch {i}"}}"#)).collect();
    let completions: Vec<Completion<'_>> = (1..COUNT)
        .filter(|i| i % 3 != 0)
        .map(|i| Completion::new(&k[i], &fresh[i], None, outcomes[i].as_bytes(), RETENTION))
        .collect();
    let answers = completed(&*store, &completions).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let readers: Vec<Token> = (0..COUNT).map(|_| Token::new()).collect();
    let reads: Vec<ClaimRequest<'_>> = (0..COUNT).map(|i| claim_request(&k[i], &readers[i], None, LEASE_MS)).collect();
    for (i, answer) in claimed(&*store, &reads).await.into_iter().enumerate() {
        let outcome = if i % 3 == 0 { format!(r#"{{"Ok":{i}}}"#) } else { outcomes[i].clone() };
        assert_eq!(answer.ok(), Some(Claim::Completed(Record::new(None, outcome.into_bytes()))), "k{i}");
    }
}

/// Leases and retentions end for batches as for single steps: a lapsed claim and an expired record
/// are claimed by a batch and their former owner is fenced off; a completion whose lease lapsed,
/// or whose key is gone, with nobody holding it, is recorded.
pub async fn batched_steps_follow_leases_and_retentions<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let k = keys("batched-expiry", 4);
    let (first, second) = (Token::new(), Token::new());
    assert_eq!(store.claim(&claim_request(&k[0], &first, None, 100)).await.unwrap(), Claim::Claimed);
    assert_eq!(store.claim(&claim_request(&k[1], &first, None, LEASE_MS)).await.unwrap(), Claim::Claimed);
    store.complete_as(&k[1], &first, b"{}", Duration::from_millis(100)).await.unwrap();
    assert_eq!(store.claim(&claim_request(&k[2], &first, None, 100)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(250)).await;

    let requests = [claim_request(&k[0], &second, None, LEASE_MS), claim_request(&k[1], &second, None, LEASE_MS)];
    let answers = claimed(&*store, &requests).await;
    assert!(answers.iter().all(is_claimed), "a lapsed claim and an expired record are free: {answers:?}");
    assert!(matches!(store.complete_as(&k[0], &first, b"{}", RETENTION).await, Err(StoreError::NotOwner)));

    let late = [
        Completion::new(&k[2], &first, None, br#"{"Ok":"late"}"#, RETENTION),
        Completion::new(&k[3], &first, None, br#"{"Ok":"never claimed"}"#, RETENTION),
    ];
    let answers = completed(&*store, &late).await;
    assert!(answers.iter().all(Result::is_ok), "nobody holds these keys: {answers:?}");
    let reader = Token::new();
    let record = Claim::Completed(Record::new(None, br#"{"Ok":"late"}"#.to_vec()));
    assert_eq!(store.claim(&claim_request(&k[2], &reader, None, LEASE_MS)).await.unwrap(), record);
}

/// The answers of a batch of both steps, each half checked for one answer per step.
async fn claimed_and_completed<S: Store>(
    store: &S,
    requests: &[ClaimRequest<'_>],
    completions: &[Completion<'_>],
) -> (Vec<Result<Claim, StoreError>>, Vec<Result<(), StoreError>>) {
    let (claims, records) = store.claim_and_complete_many(requests, completions).await;
    let claims = claims.expect("the claims of a batch of both failed as a whole");
    let records = records.expect("the completions of a batch of both failed as a whole");
    assert_eq!((claims.len(), records.len()), (requests.len(), completions.len()), "one answer per step");
    (claims, records)
}

/// Claims and completions in one batch (`claim_and_complete_many`): each answered as its single
/// step, the claims' answers on the claims and the completions' on the completions, over many keys
/// (a store that answers both halves from one statement must route each row to its half).
pub async fn batched_claims_and_completions_answer_as_single_steps<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    const COUNT: usize = 120;
    let k = keys("batched-both", COUNT + 3);
    let (done, running, taken) = (&k[COUNT], &k[COUNT + 1], &k[COUNT + 2]);
    let tokens: Vec<Token> = (0..COUNT).map(|_| Token::new()).collect();
    let (owner, other, intruder) = (Token::new(), Token::new(), Token::new());
    let fp = Fingerprint::of(&"both").unwrap();
    // The even keys are claimed beforehand, to be completed by the batch; the odd ones are new.
    for i in (0..COUNT).step_by(2) {
        assert_eq!(store.claim(&claim_request(&k[i], &tokens[i], Some(&fp), LEASE_MS)).await.unwrap(), Claim::Claimed);
    }
    assert_eq!(store.claim(&claim_request(done, &owner, None, LEASE_MS)).await.unwrap(), Claim::Claimed);
    store.complete_as(done, &owner, br#"{"Ok":"done"}"#, RETENTION).await.unwrap();
    assert_eq!(store.claim(&claim_request(running, &owner, None, LEASE_MS)).await.unwrap(), Claim::Claimed);
    assert_eq!(store.claim(&claim_request(taken, &owner, None, LEASE_MS)).await.unwrap(), Claim::Claimed);

    let outcomes: Vec<String> = (0..COUNT).map(|i| format!(r#"{{"Ok":"both {i}"}}"#)).collect();
    let mut requests: Vec<ClaimRequest<'_>> =
        (1..COUNT).step_by(2).map(|i| claim_request(&k[i], &tokens[i], Some(&fp), LEASE_MS)).collect();
    requests.push(claim_request(done, &other, None, LEASE_MS));
    requests.push(claim_request(running, &other, None, LEASE_MS));
    let mut completions: Vec<Completion<'_>> = (0..COUNT)
        .step_by(2)
        .map(|i| Completion::new(&k[i], &tokens[i], Some(&fp), outcomes[i].as_bytes(), RETENTION))
        .collect();
    completions.push(Completion::new(taken, &intruder, None, br#"{"Ok":"intruder"}"#, RETENTION));
    let (claims, records) = claimed_and_completed(&*store, &requests, &completions).await;

    let new = COUNT / 2;
    assert!(claims[..new].iter().all(is_claimed), "new keys: {:?}", &claims[..new]);
    let record = Claim::Completed(Record::new(None, br#"{"Ok":"done"}"#.to_vec()));
    assert_eq!(claims[new].as_ref().ok(), Some(&record), "a completed key is replayed");
    assert_running(&claims[new + 1], None, "a key another token holds");
    assert!(records[..new].iter().all(Result::is_ok), "the owners' completions: {:?}", &records[..new]);
    assert!(is_refused(&records[new]), "another token's key: {:?}", records[new]);

    // The claims hold, the completions are on their own keys, the refused one changed nothing.
    let reader = Token::new();
    for i in 0..COUNT {
        let answer = store.claim(&claim_request(&k[i], &reader, None, LEASE_MS)).await.unwrap();
        if i % 2 == 0 {
            let record = Claim::Completed(Record::new(Some(fp.clone()), outcomes[i].clone().into_bytes()));
            assert_eq!(answer, record, "k{i}");
        } else {
            assert!(matches!(answer, Claim::InProgress { .. }), "k{i} was claimed by the batch: {answer:?}");
            store.complete_as(&k[i], &tokens[i], br#"{"Ok":"later"}"#, RETENTION).await.unwrap();
        }
    }
    assert_running(&store.claim(&claim_request(taken, &reader, None, LEASE_MS)).await, None, "untouched");
    store.complete_as(taken, &owner, b"{}", RETENTION).await.unwrap();
}

/// A key in both halves of one batch: the claim is answered as if sent just before the
/// completion or just after it, never both ways at once. A key its owner completes while another
/// token claims it: the claim finds the claim running or the record, never wins the key, and the
/// owner's outcome is what later callers are replayed. A key nobody holds (its owner completes it
/// late, after the row is gone) while another token claims it: the claim wins and the completion
/// is refused, or the completion is recorded and the claim finds it.
pub async fn a_key_in_both_halves_of_a_batch_answers_in_one_order<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let k = keys("batched-both-one-key", 3);
    let (owner, other, fresh, late) = (Token::new(), Token::new(), Token::new(), Token::new());
    assert_eq!(store.claim(&claim_request(&k[0], &owner, None, LEASE_MS)).await.unwrap(), Claim::Claimed);
    let requests = [
        claim_request(&k[0], &other, None, LEASE_MS),
        claim_request(&k[1], &fresh, None, LEASE_MS),
        claim_request(&k[2], &other, None, LEASE_MS),
    ];
    let completions = [
        Completion::new(&k[0], &owner, None, br#"{"Ok":"owner"}"#, RETENTION),
        Completion::new(&k[2], &late, None, br#"{"Ok":"late"}"#, RETENTION),
    ];
    let (claims, records) = claimed_and_completed(&*store, &requests, &completions).await;
    let record = Claim::Completed(Record::new(None, br#"{"Ok":"owner"}"#.to_vec()));
    match &claims[0] {
        Ok(Claim::InProgress { .. }) => {}
        Ok(found) => assert_eq!(found, &record, "the claim found the record"),
        Err(error) => panic!("the claim failed: {error}"),
    }
    assert!(records[0].is_ok(), "the owner's completion: {:?}", records[0]);
    assert!(is_claimed(&claims[1]), "the other key: {:?}", claims[1]);
    let reader = Token::new();
    assert_eq!(store.claim(&claim_request(&k[0], &reader, None, LEASE_MS)).await.unwrap(), record);
    store.complete_as(&k[1], &fresh, b"{}", RETENTION).await.unwrap();

    let late_record = Claim::Completed(Record::new(None, br#"{"Ok":"late"}"#.to_vec()));
    let now = store.claim(&claim_request(&k[2], &reader, None, LEASE_MS)).await.unwrap();
    match (&claims[2], &records[1]) {
        (Ok(Claim::Claimed), refused) if is_refused(refused) => {
            assert!(matches!(now, Claim::InProgress { .. }), "the claim holds the key: {now:?}");
            store.complete_as(&k[2], &other, b"{}", RETENTION).await.unwrap();
        }
        (Ok(found), Ok(())) => {
            assert_eq!(found, &late_record, "the claim after the completion finds its record");
            assert_eq!(now, late_record, "the late completion is recorded");
        }
        both => panic!("the claim and the completion of a free key answered in no one order: {both:?}"),
    }
}

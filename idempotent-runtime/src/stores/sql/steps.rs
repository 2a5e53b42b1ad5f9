//! The protocol steps, once for every dialect and for both the pooled and the transactional
//! store: each runs on a connection it is given.

use std::time::Duration;

use sqlx::Database;

use super::CLAIM_ATTEMPTS;
use super::dialect::Verdict;
use super::dialect::{Arrays, Backend, BatchRows, ClaimReport, Found, Params, Ran, Statement, Statements};
use crate::{Claim, ClaimRequest, Completion, Fingerprint, Key, StoreError, Token};

type Conn<D> = <<D as Backend>::Db as Database>::Connection;

/// A connection the steps run on, and whether its statements autocommit (the pooled store) or
/// belong to a transaction of the caller's (the transactional store).
pub struct Session<'c, D: Backend> {
    pub conn: &'c mut Conn<D>,
    /// In autocommit mode a deadlock victim's statement may simply run again; in a transaction
    /// the server rolled the whole transaction back, so the error goes to the caller.
    pub autocommit: bool,
}

/// The `StoreError` of a failed statement: [`StoreError::Rejected`] when the same statement
/// cannot succeed if sent again ([`Backend::refused`]), else [`StoreError::Backend`].
pub fn backend<D: Backend>(error: sqlx::Error) -> StoreError {
    if D::refused(&error) { StoreError::rejected(D::NAME, error) } else { StoreError::backend(D::NAME, error) }
}

async fn run<D: Backend>(
    session: &mut Session<'_, D>,
    statement: &Statement,
    params: &Params<'_>,
) -> Result<Ran, StoreError> {
    let mut retried = 0;
    loop {
        match D::run(session.conn, statement, params).await {
            Err(e) if session.autocommit && retried < RETRIES && D::retryable(&e) => retried += 1,
            result => return result.map_err(backend::<D>),
        }
    }
}

/// How often an autocommit statement runs again after the server chose it as a deadlock victim.
const RETRIES: u32 = 3;

/// Claims the key, or returns the live row that stops it.
pub async fn claim<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    request: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    let params = Params {
        key: request.key.as_str(),
        token: request.token.as_str(),
        fingerprint: request.fingerprint.map(Fingerprint::as_str),
        duration: Some(D::duration(request.lease)),
        ..Params::default()
    };
    let read = Params { key: request.key.as_str(), ..Params::default() };
    let mut last_seen = None;
    for _ in 0..CLAIM_ATTEMPTS {
        let ran = run::<D>(session, &sql.claim, &params).await?;
        let won = ran.won();
        let row = match (D::CLAIM, ran.row, &sql.read) {
            (ClaimReport::Affected, _, _) if won => return Ok(Claim::Claimed),
            (ClaimReport::Row, Some(row), _) => row,
            // PostgreSQL: the live row committed after this statement's snapshot. Again.
            (_, _, None) => continue,
            (_, _, Some(statement)) => match run::<D>(session, statement, &read).await?.row {
                Some(row) => row,
                None => continue, // released or purged since: claim again
            },
        };
        let found = row.map_err(StoreError::Corrupt)?;
        last_seen.clone_from(&found.fingerprint);
        match found.verdict(request.token)? {
            Verdict::Mine => return Ok(Claim::Claimed),
            Verdict::Live(claim) => return Ok(claim),
            Verdict::Expired => {}
        }
    }
    // The row kept changing under us: report it as busy, to be retried.
    Ok(Claim::InProgress { fingerprint: last_seen.map(Fingerprint::parse).transpose()?, lease_remaining: None })
}

/// Records the outcome unless another token holds the key: the row still carries this token (in
/// progress, its lease live or lapsed: one `UPDATE`), or, in autocommit mode only, it is gone or
/// expired (then one upsert writes the record). `Ok` too when this token completed the row
/// already (an earlier attempt whose reply was lost); the row is left as it is.
pub async fn complete<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    completion: &Completion<'_>,
) -> Result<(), StoreError> {
    let params = Params {
        key: completion.key.as_str(),
        token: completion.token.as_str(),
        fingerprint: completion.fingerprint.map(Fingerprint::as_str),
        outcome: super::outcome_text(completion.outcome)?,
        duration: Some(D::duration(completion.retention)),
        ..Params::default()
    };
    if run::<D>(session, &sql.fenced.complete, &params).await?.affected == 1 {
        return Ok(());
    }
    // Not this token's row. Inside a transaction the claim is a row it holds locked, so that
    // cannot be a lapsed lease; outside, the row may be gone (purged) or expired: adopt it.
    if session.autocommit && run::<D>(session, &sql.fenced.adopt, &params).await?.won() {
        return Ok(());
    }
    Err(StoreError::NotOwner)
}

/// Moves the end of the live lease `token` holds on `key` to `lease` from now.
pub async fn extend<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    key: &Key,
    token: &Token,
    lease: Duration,
) -> Result<(), StoreError> {
    let params =
        Params { key: key.as_str(), token: token.as_str(), duration: Some(D::duration(lease)), ..Params::default() };
    owned(&run::<D>(session, &sql.fenced.extend, &params).await?)
}

/// Deletes the live claim `token` holds on `key`.
pub async fn release<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    key: &Key,
    token: &Token,
) -> Result<(), StoreError> {
    let params = Params { key: key.as_str(), token: token.as_str(), ..Params::default() };
    let statement = if session.autocommit { &sql.fenced.release } else { &sql.fenced.release_in_tx };
    owned(&run::<D>(session, statement, &params).await?)
}

fn owned(ran: &Ran) -> Result<(), StoreError> {
    if ran.affected == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

/// Claims the keys of `requests` with the dialect's batched statement (`batched`): the first
/// request for each key in the statement, every other one after it by a single [`claim`], in
/// order: a key asked for again, a key whose row the statement did not return (committed after
/// its snapshot), a lease that ended under it.
pub async fn claim_many<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    batched: &Statement,
    requests: &[ClaimRequest<'_>],
) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
    let mut claims = Claims::of(requests);
    let rows = run_batch::<D>(session, batched, &claims.arrays(), None).await?;
    for (key, row) in rows {
        claims.answer(&key, row)?;
    }
    Ok(claims.rest(session, sql).await)
}

/// Records `completions` with the dialect's batched statement (`batched`, autocommit mode only):
/// the first completion of each key in the statement, every other one after it by a single
/// [`complete`], in order: a key completed again, a key another token holds (refused). An outcome
/// that is not text is refused at once.
pub async fn complete_many<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    batched: &Statement,
    completions: &[Completion<'_>],
) -> Result<Vec<Result<(), StoreError>>, StoreError> {
    let mut records = Records::of(completions);
    if !records.firsts.is_empty() {
        for (key, _) in run_batch::<D>(session, batched, &records.arrays(), None).await? {
            records.answer(&key)?;
        }
    }
    Ok(records.rest(session, sql).await)
}

/// Claims the keys of `requests` and records `completions` with the dialect's statement of both
/// (`both`, autocommit mode only), each half as [`claim_many`] and [`complete_many`] do. No key
/// may be in both halves (one statement cannot write a row twice).
pub async fn claim_and_complete_many<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    both: &Statement,
    requests: &[ClaimRequest<'_>],
    completions: &[Completion<'_>],
) -> Result<(Vec<Result<Claim, StoreError>>, Vec<Result<(), StoreError>>), StoreError> {
    let mut claims = Claims::of(requests);
    let mut records = Records::of(completions);
    for (key, row) in run_batch::<D>(session, both, &claims.arrays(), Some(&records.arrays())).await? {
        match row {
            Some(row) => claims.answer(&key, Some(row))?,
            None => records.answer(&key)?,
        }
    }
    Ok((claims.rest(session, sql).await, records.rest(session, sql).await))
}

/// The claims of a batch: the first request of each key goes to the batched statement, and
/// each request's answer, once known.
struct Claims<'r, 'a> {
    requests: &'r [ClaimRequest<'a>],
    firsts: Firsts<'r>,
    /// `None`: left to a single claim.
    answers: Vec<Option<Result<Claim, StoreError>>>,
}

impl<'r, 'a> Claims<'r, 'a> {
    fn of(requests: &'r [ClaimRequest<'a>]) -> Self {
        let firsts = Firsts::of(requests.iter().map(|request| Some(request.key.as_str())));
        Claims { requests, firsts, answers: requests.iter().map(|_| None).collect() }
    }

    fn arrays(&self) -> Arrays<'r> {
        let requests = self.requests;
        Arrays {
            keys: self.firsts.each(|i| requests[i].key.as_str()),
            tokens: self.firsts.each(|i| requests[i].token.as_str()),
            fingerprints: self.firsts.each(|i| requests[i].fingerprint.map(Fingerprint::as_str)),
            micros: self.firsts.each(|i| super::micros(requests[i].lease)),
            outcomes: Vec::new(),
        }
    }

    /// The statement's row for `key` (`None`: a statement that answered without one).
    fn answer(&mut self, key: &str, row: Option<Result<Found, String>>) -> Result<(), StoreError> {
        let i = self.firsts.request(key)?;
        let Some(row) = row else { return Ok(()) };
        self.answers[i] = match row.map_err(StoreError::Corrupt).and_then(|found| found.verdict(self.requests[i].token))
        {
            Ok(Verdict::Mine) => Some(Ok(Claim::Claimed)),
            Ok(Verdict::Live(claim)) => Some(Ok(claim)),
            Ok(Verdict::Expired) => None,
            Err(error) => Some(Err(error)),
        };
        Ok(())
    }

    /// Every request's answer, those the statement left by a single claim each.
    async fn rest<D: Backend>(self, session: &mut Session<'_, D>, sql: &Statements) -> Vec<Result<Claim, StoreError>> {
        let mut claims = Vec::with_capacity(self.requests.len());
        for (request, answer) in self.requests.iter().zip(self.answers) {
            claims.push(match answer {
                Some(answer) => answer,
                None => claim::<D>(session, sql, request).await,
            });
        }
        claims
    }
}

/// The completions of a batch: the first completion of each key whose outcome is text goes to
/// the batched statement, and which of them it recorded.
struct Records<'r, 'a> {
    completions: &'r [Completion<'a>],
    texts: Vec<Result<&'r str, StoreError>>,
    firsts: Firsts<'r>,
    done: Vec<bool>,
}

impl<'r, 'a> Records<'r, 'a> {
    fn of(completions: &'r [Completion<'a>]) -> Self {
        let texts: Vec<_> = completions.iter().map(|completion| super::outcome_text(completion.outcome)).collect();
        let firsts = Firsts::of(completions.iter().zip(&texts).map(|(c, text)| text.is_ok().then(|| c.key.as_str())));
        Records { completions, texts, firsts, done: vec![false; completions.len()] }
    }

    fn arrays(&self) -> Arrays<'_> {
        let completions = self.completions;
        Arrays {
            keys: self.firsts.each(|i| completions[i].key.as_str()),
            tokens: self.firsts.each(|i| completions[i].token.as_str()),
            fingerprints: self.firsts.each(|i| completions[i].fingerprint.map(Fingerprint::as_str)),
            micros: self.firsts.each(|i| super::micros(completions[i].retention)),
            outcomes: self.firsts.each(|i| self.texts[i].as_ref().map_or("", |text| *text)),
        }
    }

    /// The statement recorded `key`.
    fn answer(&mut self, key: &str) -> Result<(), StoreError> {
        self.done[self.firsts.request(key)?] = true;
        Ok(())
    }

    /// Every completion's answer, those the statement did not record by a single completion
    /// each (which refuses a key another token holds).
    async fn rest<D: Backend>(self, session: &mut Session<'_, D>, sql: &Statements) -> Vec<Result<(), StoreError>> {
        let mut recorded = Vec::with_capacity(self.completions.len());
        for ((completion, text), done) in self.completions.iter().zip(self.texts).zip(self.done) {
            recorded.push(match text {
                Err(error) => Err(error),
                Ok(_) if done => Ok(()),
                Ok(_) => complete::<D>(session, sql, completion).await,
            });
        }
        recorded
    }
}

/// The first request for each key of a batch: what its statement is sent.
struct Firsts<'a> {
    /// The requests' positions, in order.
    positions: Vec<usize>,
    /// Each key's request.
    by_key: std::collections::HashMap<&'a str, usize>,
}

impl<'a> Firsts<'a> {
    /// The first request of each key (`None`: a request left out).
    fn of(keys: impl Iterator<Item = Option<&'a str>>) -> Self {
        let mut firsts = Firsts { positions: Vec::new(), by_key: std::collections::HashMap::new() };
        for (i, key) in keys.enumerate() {
            if let Some(key) = key
                && let std::collections::hash_map::Entry::Vacant(entry) = firsts.by_key.entry(key)
            {
                entry.insert(i);
                firsts.positions.push(i);
            }
        }
        firsts
    }

    fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// `column` of each first request, in order.
    fn each<T>(&self, column: impl Fn(usize) -> T) -> Vec<T> {
        self.positions.iter().map(|&i| column(i)).collect()
    }

    /// The request a statement's row for `key` answers.
    fn request(&self, key: &str) -> Result<usize, StoreError> {
        self.by_key.get(key).copied().ok_or_else(|| {
            StoreError::Corrupt(format!("a batched statement answered for the key {key:?}, which it was not asked"))
        })
    }
}

/// Runs a batched statement with `arrays`, or the statement of both with the claims' `arrays`
/// and the completions' `completions`.
async fn run_batch<D: Backend>(
    session: &mut Session<'_, D>,
    statement: &Statement,
    arrays: &Arrays<'_>,
    completions: Option<&Arrays<'_>>,
) -> Result<BatchRows, StoreError> {
    let mut retried = 0;
    loop {
        let rows = match completions {
            None => D::run_batch(session.conn, statement, arrays).await,
            Some(completions) => D::run_both(session.conn, statement, arrays, completions).await,
        };
        match rows {
            Err(e) if session.autocommit && retried < RETRIES && D::retryable(&e) => retried += 1,
            result => return result.map_err(backend::<D>),
        }
    }
}

/// Deletes at most `limit` expired rows; returns how many it deleted.
pub async fn purge_batch<D: Backend>(
    session: &mut Session<'_, D>,
    sql: &Statements,
    limit: u32,
) -> Result<u64, StoreError> {
    let params = Params { limit: i64::from(limit), ..Params::default() };
    let mut deleted = 0;
    for statement in &sql.purge {
        deleted = run::<D>(session, statement, &params).await?.affected;
    }
    Ok(deleted)
}

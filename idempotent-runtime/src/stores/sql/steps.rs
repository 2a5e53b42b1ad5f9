//! The protocol steps, once for every dialect and for both the pooled and the transactional
//! store: each runs on a connection it is given.

use std::time::Duration;

use sqlx::Database;

use super::CLAIM_ATTEMPTS;
use super::dialect::Verdict;
use super::dialect::{Backend, ClaimReport, Params, Ran, Statement, Statements};
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

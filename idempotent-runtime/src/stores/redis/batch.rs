//! The batched steps on one server: a batch's commands in one pipeline, one round trip.
//!
//! Each command is the single step's own (the claim's `SET ... NX PX ... GET`, the completion's
//! `SET ... IFEQ ... GET` or its script), so each key is answered as its single step would answer
//! it. Redis runs a pipeline's commands in order, so of two claims of one key in a batch the first
//! wins. A claim that finds another call running asks for that call's remaining lease as a single
//! claim does, with a step of its own, and a completion the native command does not decide is
//! finished by the script as a single completion is, also with a step of its own. A pipeline
//! whose connection was refused or lost is sent once more, whole: with the same tokens, each
//! command meets its own first send and answers as that would have.

use futures_util::future::join_all;
use redis::{Pipeline, RedisResult, Value};

use super::{
    COMPLETE, RedisConnection, RedisStore, backend, claim_cmd, completed, is_noscript, native_complete_cmd,
    parse_claim, record, replicas_have_it, resend, script_cmd,
};
use crate::{Claim, ClaimRequest, Completion, StoreError};

impl<C: RedisConnection> RedisStore<C> {
    pub(super) async fn claim_many_now(
        &self,
        requests: &[ClaimRequest<'_>],
    ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let checked: Vec<Result<(), StoreError>> = requests.iter().map(|r| record::check_token(r.token)).collect();
        let mut pipeline = redis::pipe();
        pipeline.ignore_errors();
        for (request, _) in requests.iter().zip(&checked).filter(|(_, checked)| checked.is_ok()) {
            pipeline.add_command(claim_cmd(&self.key_arg(request.key), request));
        }
        let mut replies = self.send(&pipeline).await.map_err(backend)?.into_iter();
        let mut answers = Vec::with_capacity(requests.len());
        for (request, checked) in requests.iter().zip(checked) {
            answers.push(match checked {
                Ok(()) => {
                    let reply = replies.next().ok_or_else(|| fewer("claims"))?;
                    parse_claim(reply, &self.key_arg(request.key), request.token)
                }
                Err(error) => Err(error),
            });
        }
        // Another call is running: its remaining lease, as a single claim reports it.
        let claims = requests.iter().zip(answers).map(async |(request, answer)| match answer {
            Ok(claim @ Claim::InProgress { .. }) => self.lease_of_running(request, claim).await,
            answer => answer,
        });
        Ok(join_all(claims).await)
    }

    pub(super) async fn complete_many_now(
        &self,
        completions: &[Completion<'_>],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let args: Vec<_> = completions.iter().map(|completion| self.complete_args(completion)).collect();
        if self.completes_natively() {
            return self.complete_many_natively(completions, args).await;
        }
        let pipeline = |eval: bool| {
            let mut pipeline = redis::pipe();
            pipeline.ignore_errors();
            for (completion, args) in completions.iter().zip(&args) {
                if let Ok(args) = args {
                    let key = self.key_arg(completion.key);
                    pipeline.add_command(script_cmd(&COMPLETE, eval, &key, &|cmd| args.write(cmd)));
                }
            }
            if let Some(acks) = self.replica_acks {
                // After every write of the batch, on the connection that made them.
                pipeline.cmd("WAIT").arg(acks.replicas).arg(acks.timeout_ms);
            }
            pipeline
        };
        let mut replies = self.send(&pipeline(false)).await.map_err(backend)?;
        if replies.iter().any(|reply| reply.as_ref().is_err_and(is_noscript)) {
            replies = self.send(&pipeline(true)).await.map_err(backend)?;
        }
        let waited = self.replica_acks.map(|acks| (acks, replies.pop()));
        let mut replies = replies.into_iter();
        let mut recorded = Vec::with_capacity(completions.len());
        for (completion, args) in completions.iter().zip(args) {
            recorded.push(match args {
                Ok(_) => {
                    let reply = replies.next().ok_or_else(|| fewer("completions"))?;
                    let answer =
                        reply.map_err(backend).and_then(|reply| completed(reply, &self.key_arg(completion.key)));
                    answer.and_then(|()| match &waited {
                        Some((acks, reply)) => replicas_have_it(*acks, reply.as_ref()),
                        None => Ok(()),
                    })
                }
                Err(error) => Err(error),
            });
        }
        Ok(recorded)
    }

    /// The batch's completions as native `SET ... IFEQ ... GET` commands in one pipeline; those
    /// the command does not decide then go to the script, concurrently.
    async fn complete_many_natively(
        &self,
        completions: &[Completion<'_>],
        args: Vec<Result<super::CompleteArgs<'_>, StoreError>>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut pipeline = redis::pipe();
        pipeline.ignore_errors();
        for (completion, args) in completions.iter().zip(&args) {
            if let Ok(args) = args {
                pipeline.add_command(native_complete_cmd(&self.key_arg(completion.key), args));
            }
        }
        if let Some(acks) = self.replica_acks {
            pipeline.cmd("WAIT").arg(acks.replicas).arg(acks.timeout_ms);
        }
        let mut replies = self.send(&pipeline).await.map_err(backend)?;
        let waited = self.replica_acks.map(|acks| (acks, replies.pop()));
        let mut replies = replies.into_iter();
        // Each completion's answer, or its arguments for the script.
        let mut decided = Vec::with_capacity(completions.len());
        for args in args {
            decided.push(match args {
                Ok(args) => {
                    let reply = replies.next().ok_or_else(|| fewer("completions"))?;
                    match self.natively_completed(reply, &args) {
                        Some(answer) => Ok(answer.and_then(|()| match &waited {
                            Some((acks, reply)) => replicas_have_it(*acks, reply.as_ref()),
                            None => Ok(()),
                        })),
                        None => Err(args),
                    }
                }
                Err(error) => Ok(Err(error)),
            });
        }
        let finished = completions.iter().zip(decided).map(async |(completion, decided)| match decided {
            Ok(answer) => answer,
            Err(args) => self.complete_by_script(&self.key_arg(completion.key), &args).await,
        });
        Ok(join_all(finished).await)
    }

    /// Sends `pipeline`, and once more if the connection failed under it ([`resend`]).
    async fn send(&self, pipeline: &Pipeline) -> RedisResult<Vec<RedisResult<Value>>> {
        let mut connection = self.connection.get();
        match pipeline.query_async(&mut connection).await {
            Err(e) if resend::<C>(&e).is_some() => pipeline.query_async(&mut connection).await,
            result => result,
        }
    }
}

/// A pipeline that got fewer replies than the `steps` it held.
fn fewer(steps: &str) -> StoreError {
    StoreError::Corrupt(format!("a pipeline of {steps} got fewer replies than {steps}"))
}

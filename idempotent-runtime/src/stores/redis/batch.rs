//! The batched steps on one server: a batch's commands in one pipeline, one round trip.
//!
//! Each command is the single step's own (the claim's `SET ... NX PX ... GET`, the completion
//! script), so each key is answered as its single step would answer it; Redis runs a pipeline's
//! commands in order, so of two claims of one key in a batch the first wins. A claim that finds
//! another call running asks for that call's remaining lease as a single claim does, with a step
//! of its own. A pipeline whose connection was refused or lost is sent once more, whole: with the
//! same tokens, each command meets its own first send and answers as that would have.

use futures_util::future::join_all;
use redis::{Pipeline, RedisResult, Value};

use super::{
    COMPLETE, RedisConnection, RedisStore, ReplicaAcks, ReplicasMissing, backend, claim_cmd, completed, is_noscript,
    parse_claim, record, resend, script_cmd,
};
use crate::{Claim, ClaimRequest, Completion, StoreError};

impl<C: RedisConnection> RedisStore<C> {
    pub(super) async fn claim_many_now(
        &self,
        requests: &[ClaimRequest<'_>],
    ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let mut pipeline = redis::pipe();
        pipeline.ignore_errors();
        let mut answers: Vec<Option<Result<Claim, StoreError>>> = Vec::with_capacity(requests.len());
        for request in requests {
            match record::check_token(request.token) {
                Ok(()) => {
                    let running = record::Header {
                        state: record::RUNNING,
                        token: request.token.as_bytes(),
                        fingerprint: request.fingerprint.map(crate::Fingerprint::as_bytes),
                    };
                    pipeline.add_command(claim_cmd(&self.key_arg(request.key), &running, request.lease));
                    answers.push(None);
                }
                Err(error) => answers.push(Some(Err(error))),
            }
        }
        let mut replies = self.send(&pipeline).await.map_err(backend)?.into_iter();
        let answers = requests.iter().zip(answers).map(|(request, answer)| match answer {
            Some(answer) => Ok(answer),
            None => match replies.next() {
                Some(reply) => Ok(parse_claim(reply, &self.key_arg(request.key), request.token)),
                None => Err(StoreError::Corrupt("a pipeline of claims got fewer replies than claims".into())),
            },
        });
        let answers = answers.collect::<Result<Vec<_>, _>>()?;
        // Another call is running: its remaining lease, as a single claim reports it.
        let claims = requests.iter().zip(answers).map(async |(request, answer)| match answer {
            Ok(Claim::InProgress { .. }) => self.claim_now(request).await,
            answer => answer,
        });
        Ok(join_all(claims).await)
    }

    pub(super) async fn complete_many_now(
        &self,
        completions: &[Completion<'_>],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut args = Vec::with_capacity(completions.len());
        let mut answers: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(completions.len());
        for completion in completions {
            match self.complete_args(completion) {
                Ok(arg) => (args.push(Some(arg)), answers.push(None)),
                Err(error) => (args.push(None), answers.push(Some(Err(error)))),
            };
        }
        let pipeline = |eval: bool| {
            let mut pipeline = redis::pipe();
            pipeline.ignore_errors();
            for (completion, args) in completions.iter().zip(&args) {
                if let Some(args) = args {
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
        for (completion, answer) in completions.iter().zip(answers) {
            if let Some(answer) = answer {
                recorded.push(answer);
                continue;
            }
            let reply = replies.next().ok_or_else(|| {
                StoreError::Corrupt("a pipeline of completions got fewer replies than completions".into())
            })?;
            let key = self.key_arg(completion.key);
            let answer = reply.map_err(backend).and_then(|reply| completed(reply, &key));
            recorded.push(answer.and_then(|()| match &waited {
                Some((acks, reply)) => replicas_have_it(*acks, reply.as_ref()),
                None => Ok(()),
            }));
        }
        Ok(recorded)
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

/// Whether `WAIT`'s reply says enough replicas acknowledged the batch's records.
fn replicas_have_it(acks: ReplicaAcks, waited: Option<&RedisResult<Value>>) -> Result<(), StoreError> {
    match waited {
        Some(Ok(Value::Int(n))) if *n >= i64::from(acks.replicas) => Ok(()),
        Some(Ok(Value::Int(acknowledged))) => Err(StoreError::backend(
            "redis",
            ReplicasMissing { acknowledged: *acknowledged, wanted: acks.replicas, timeout_ms: acks.timeout_ms },
        )),
        other => Err(StoreError::backend("redis", format!("unexpected reply to WAIT: {other:?}"))),
    }
}

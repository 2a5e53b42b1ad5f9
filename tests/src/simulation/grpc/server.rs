//! A history's server: the handler and its ledger, the tonic server behind
//! [`GrpcIdempotencyLayer`], and the log of every answer it sends (a tower layer outside the
//! idempotency layer, so replays and the layer's own refusals are logged too).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt as _, Full};
use idempotent_runtime::Store;
use idempotent_runtime::grpc::{GrpcIdempotencyLayer, not_processed};
use prost::Message as _;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Request, Response, Status};

use super::plan::{Behaviour, Ending, Plan};
use super::{ConfigBug, SCOPE};
use crate::grpc::{PAY, PayRequest, Payments, PaymentsServer, Receipt, request_id};
use crate::simulation::callers::BODY_PANIC;

/// The trailing metadata of gRFC A6 that tells a retrying client how long to wait (negative: do
/// not retry).
pub(super) const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// What an answer says: its code, its message, and its receipt if it is `OK`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Answer {
    pub(super) code: Code,
    pub(super) message: String,
    pub(super) receipt: Option<Receipt>,
}

impl Answer {
    /// The answer of a handler's (or a client's) result.
    pub(super) fn of(result: &Result<Receipt, Status>) -> Self {
        match result {
            Ok(receipt) => Answer { code: Code::Ok, message: String::new(), receipt: Some(receipt.clone()) },
            Err(status) => Answer { code: status.code(), message: status.message().to_owned(), receipt: None },
        }
    }

    /// The run whose outcome this answer carries, `(user, key, run)`: the `(run u/k/n)` the
    /// handler writes in its receipt's `user` field, or in its error's message. Answers of the
    /// layer's own (`ABORTED`, `FAILED_PRECONDITION` for a reused key, `INTERNAL` after a panic)
    /// carry none.
    pub(super) fn tag(&self) -> Option<(usize, usize, usize)> {
        let text = match (&self.receipt, self.code) {
            (Some(receipt), Code::Ok) => receipt.user.as_str(),
            _ => self.message.as_str(),
        };
        let (_, rest) = text.split_once("(run ")?;
        let (tag, _) = rest.split_once(')')?;
        let mut numbers = tag.split('/').map(|n| n.parse::<usize>().ok());
        let tag = (numbers.next()??, numbers.next()??, numbers.next()??);
        numbers.next().is_none().then_some(tag)
    }
}

/// One run of the handler, as it happened.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub(super) slot: (usize, usize),
    pub(super) n: usize,
    pub(super) caller: usize,
    pub(super) request: PayRequest,
    pub(super) ending: Ending,
    pub(super) started: Instant,
    pub(super) ended: Option<Instant>,
    pub(super) paid: bool,
    /// Its answer (none after a panic).
    pub(super) answer: Option<Answer>,
}

/// An answer the server sent (seen outside the layer), or one a caller received.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub(super) caller: usize,
    /// The caller's attempt it answers (`x-attempt`), or `usize::MAX` where unknown (the probe's,
    /// a caller's last outcome).
    pub(super) attempt: usize,
    pub(super) answer: Answer,
    /// `idempotent-replayed: true` in its initial metadata.
    pub(super) replayed: bool,
    /// Its `grpc-retry-pushback-ms`, if any.
    pub(super) pushback: Option<String>,
    /// When it was sent or received.
    pub(super) at: Instant,
}

impl Seen {
    /// The same answer, marks and pushback as `other`, whoever saw it and when.
    pub(super) fn says_the_same(&self, other: &Seen) -> bool {
        self.answer == other.answer && self.replayed == other.replayed && self.pushback == other.pushback
    }
}

/// An attempt of a call as it reached the server (seen outside the layer, before it).
#[derive(Debug, Clone)]
pub(super) struct Arrival {
    /// Its `x-caller`.
    pub(super) caller: usize,
    /// Its `x-attempt`: the caller's count of its attempts, 1 for the first.
    pub(super) attempt: usize,
    /// Its `idempotency-key` metadata, if it had one.
    pub(super) key: Option<String>,
}

/// The server's side of a history.
#[derive(Debug)]
pub(super) struct Server {
    pub(super) plan: Plan,
    pub(super) runs: Mutex<Vec<Run>>,
    pub(super) sent: Mutex<Vec<Seen>>,
    /// Every attempt that reached the server, answered or not.
    pub(super) arrived: Mutex<Vec<Arrival>>,
    /// Calls that reached the server and have not been answered, nor given up by their client.
    pub(super) in_flight: AtomicUsize,
}

impl Server {
    /// The ledger: every run so far.
    pub(super) fn runs(&self) -> std::sync::MutexGuard<'_, Vec<Run>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs going now.
    pub(super) fn running(&self) -> usize {
        self.runs().iter().filter(|r| r.ended.is_none()).count()
    }

    /// Every answer sent so far.
    pub(super) fn sent(&self) -> std::sync::MutexGuard<'_, Vec<Seen>> {
        self.sent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every attempt that reached the server so far.
    pub(super) fn arrived(&self) -> std::sync::MutexGuard<'_, Vec<Arrival>> {
        self.arrived.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The number in header `name` (the test's own `x-user`, `x-key`, `x-caller`), or `usize::MAX`.
fn number(headers: &HeaderMap, name: &str) -> usize {
    headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(usize::MAX)
}

/// Marks its run ended when dropped, a panic's unwinding included.
struct Ends(Arc<Server>, usize);

impl Drop for Ends {
    fn drop(&mut self) {
        let mut runs = self.0.runs();
        runs[self.1].ended.get_or_insert_with(Instant::now);
    }
}

/// The handler of `payments.Payments/Pay`: each run as the plan says.
struct Teller(Arc<Server>);

#[tonic::async_trait]
impl Payments for Teller {
    async fn pay(&self, request: Request<PayRequest>) -> Result<Response<Receipt>, Status> {
        let headers = request.metadata().clone().into_headers();
        let (user, key, caller) = (number(&headers, "x-user"), number(&headers, "x-key"), number(&headers, "x-caller"));
        let (ending, result) =
            perform(&self.0, (user, key), caller, headers.contains_key("x-probe"), request.into_inner()).await;
        match result {
            Ok(receipt) => Ok(Response::new(receipt)),
            Err(status) if ending == Ending::NotProcessed => Err(not_processed(status)),
            Err(status) => Err(status),
        }
    }
}

/// One run of the handler, as the plan says: registers the run, works, then pays or not and
/// answers (or panics). Every answer names its run, `(run user/key/n)`.
async fn perform(
    server: &Arc<Server>,
    slot: (usize, usize),
    caller: usize,
    probe: bool,
    request: PayRequest,
) -> (Ending, Result<Receipt, Status>) {
    let (index, n, behaviour) = {
        let mut runs = server.runs();
        let n = runs.iter().filter(|r| r.slot == slot).count();
        let planned = server.plan.behaviours.get(&slot).and_then(|b| b.get(n)).copied();
        let behaviour = match planned {
            Some(planned) if !probe => planned,
            _ => Behaviour { work: Duration::ZERO, ending: Ending::Paid },
        };
        runs.push(Run {
            slot,
            n,
            caller,
            request: request.clone(),
            ending: behaviour.ending,
            started: Instant::now(),
            ended: None,
            paid: false,
            answer: None,
        });
        (runs.len() - 1, n, behaviour)
    };
    let ends = Ends(Arc::clone(server), index);
    tokio::time::sleep(behaviour.work).await;
    let tag = format!("(run {}/{}/{n})", slot.0, slot.1);
    let result = match behaviour.ending {
        Ending::Paid => Ok(Receipt { user: tag, amount: request.amount, seq: index as u64 + 1 }),
        Ending::PaidThenFailed(code) => Err(Status::new(code, format!("paid, then the receipt service failed {tag}"))),
        Ending::Declined => Err(Status::failed_precondition(format!("card declined, nothing paid {tag}"))),
        Ending::NotProcessed => Err(Status::unavailable(format!("not processed, nothing paid {tag}"))),
        Ending::Panic => panic!("{BODY_PANIC}"),
    };
    {
        let mut runs = server.runs();
        let run = &mut runs[index];
        run.paid = behaviour.ending.pays();
        run.answer = Some(Answer::of(&result));
        run.ended = Some(Instant::now());
    }
    drop(ends);
    (behaviour.ending, result)
}

/// Counts a call in flight until its answer is logged or its client leaves.
struct InFlight(Arc<Server>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Outside the idempotency layer: logs every answer the server sends (after breaking the
/// replays' marks as a planted [`ConfigBug`] says, as if the layer sent them so).
#[derive(Clone)]
struct LogSentLayer(Arc<Server>, Option<ConfigBug>);

impl<S> tower::Layer<S> for LogSentLayer {
    type Service = LogSent<S>;

    fn layer(&self, inner: S) -> LogSent<S> {
        LogSent { inner, server: Arc::clone(&self.0), bug: self.1 }
    }
}

/// The service of [`LogSentLayer`]: reads each answer whole (a unary call's), logs it, and sends
/// it on frame for frame.
#[derive(Clone)]
struct LogSent<S> {
    inner: S,
    server: Arc<Server>,
    bug: Option<ConfigBug>,
}

/// Breaks a replay's marks as `bug` says: drops `idempotent-replayed`, or turns the negative
/// pushback of a replayed error into one that invites retries.
fn tamper(bug: Option<ConfigBug>, headers: &mut HeaderMap, trailers: Option<&mut HeaderMap>) {
    match bug {
        Some(ConfigBug::ReplaysUnmarked) => {
            headers.remove("idempotent-replayed");
        }
        Some(ConfigBug::ReplayedErrorsInviteRetries) => {
            for map in std::iter::once(headers).chain(trailers) {
                if map.get(PUSHBACK).is_some_and(|v| v == "-1") {
                    map.insert(PUSHBACK, http::HeaderValue::from_static("0"));
                }
            }
        }
        _ => {}
    }
}

/// A boxed future of a service's answer.
type Boxed<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S> tower::Service<http::Request<Body>> for LogSent<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Boxed<http::Response<Body>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let server = Arc::clone(&self.server);
        let (caller, attempt, bug) =
            (number(request.headers(), "x-caller"), number(request.headers(), "x-attempt"), self.bug);
        let key = request.headers().get("idempotency-key").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        server.arrived().push(Arrival { caller, attempt, key });
        Box::pin(async move {
            server.in_flight.fetch_add(1, Ordering::Relaxed);
            let in_flight = InFlight(Arc::clone(&server));
            let (mut parts, body) = inner.call(request).await?.into_parts();
            let (data, mut trailers) = match body.collect().await {
                Ok(collected) => {
                    let trailers = collected.trailers().cloned();
                    (collected.to_bytes(), trailers)
                }
                Err(status) => {
                    let failed = Status::internal(format!("the answer's body failed: {status}"));
                    server.sent().push(Seen {
                        caller,
                        attempt,
                        answer: Answer::of(&Err(failed.clone())),
                        replayed: false,
                        pushback: None,
                        at: Instant::now(),
                    });
                    return Ok(failed.into_http());
                }
            };
            tamper(bug, &mut parts.headers, trailers.as_mut());
            server.sent().push(Seen { attempt, ..seen(caller, &parts.headers, &data, trailers.as_ref()) });
            drop(in_flight);
            // A trailers-only answer stays one: no data frame before its end.
            let body = match trailers {
                Some(trailers) => Body::new(Full::new(data).with_trailers(async move { Some(Ok(trailers)) })),
                None if data.is_empty() => Body::empty(),
                None => Body::new(Full::new(data)),
            };
            Ok(http::Response::from_parts(parts, body))
        })
    }
}

/// An answer as the server sends it (or a caller's channel receives it): its status from its
/// trailers (or, trailers-only, its headers), its receipt from its one length-prefixed message.
pub(super) fn seen(caller: usize, headers: &HeaderMap, data: &Bytes, trailers: Option<&HeaderMap>) -> Seen {
    let status = trailers.and_then(Status::from_header_map).or_else(|| Status::from_header_map(headers));
    let (code, message) =
        status.map_or((Code::Unknown, "no grpc-status".to_owned()), |s| (s.code(), s.message().to_owned()));
    let receipt = data.get(5..).and_then(|message| Receipt::decode(message).ok()).filter(|_| code == Code::Ok);
    let pushback = trailers.and_then(|t| t.get(PUSHBACK)).or_else(|| headers.get(PUSHBACK));
    Seen {
        caller,
        attempt: usize::MAX,
        answer: Answer { code, message, receipt },
        replayed: headers.get("idempotent-replayed").is_some_and(|v| v == "true"),
        pushback: pushback.and_then(|v| v.to_str().ok()).map(str::to_owned),
        at: Instant::now(),
    }
}

/// Starts the history's server over `store` on a loopback port of its own: the handler behind
/// the layer as the plan configures it (with `bug` planted), behind the log of what it sends.
pub(super) async fn serve<St: Store + 'static>(
    server: &Arc<Server>,
    store: St,
    bug: Option<ConfigBug>,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let plan = &server.plan;
    let mut layer = GrpcIdempotencyLayer::new(store).scope(SCOPE).lease(plan.lease);
    layer = if bug == Some(ConfigBug::KeysSharedByAllCallers) {
        layer.keys_shared_by_all_callers()
    } else {
        layer.caller(|parts| parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned())
    };
    layer = if plan.keyed_by_message { layer.method_keyed_by(PAY, request_id) } else { layer.method(PAY) };
    if let Some(wait) = plan.wait {
        layer = layer.wait(wait);
    }
    if bug == Some(ConfigBug::ReleaseServerErrors) {
        layer = layer.record_code(|code| !matches!(code, Code::Unavailable | Code::Internal));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a history's server");
    let addr = listener.local_addr().expect("the server's address");
    // The first layer is the outermost: it sees every answer, the idempotency layer's included.
    let router = tonic::transport::Server::builder()
        .layer(LogSentLayer(Arc::clone(server), bug))
        .layer(layer)
        .add_service(PaymentsServer::new(Teller(Arc::clone(server))));
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    (addr, tokio::spawn(async move { router.serve_with_incoming(incoming).await.expect("a history's server") }))
}

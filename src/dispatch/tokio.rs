//! The tokio dispatcher: worker tasks for async engines. Database work never blocks a
//! runtime thread that other tasks need: it runs under `block_in_place` on a
//! multi-thread runtime and on the blocking pool (`spawn_blocking`) on a current-thread
//! one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::Instrument;

use super::builder::{DispatcherBuilder, ShutdownReport};
use super::{Core, DispatchStats, Run, Shared, keep_leases};
use crate::claim::Claim;
use crate::enqueue::{Enqueued, NewDelivery};
use crate::error::Result;
use crate::health::Health;
use crate::outbox::Outbox;
use crate::outcome::Outcome;
use crate::settle::{PossiblySent, Settlement};
use crate::store::connections::on_blocking_pool;

/// Claims admitted to be sent now, each with its adapter.
type Admitted = Vec<(Claim, Arc<dyn AsyncChannelAdapter>)>;

/// A boxed, sendable future: what [`AsyncChannelAdapter::send`] returns.
pub type SendFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The async counterpart of [`ChannelAdapter`](crate::ChannelAdapter).
///
/// Its channel's rules (replay, pacing, retries) are stored in the outbox file, as for
/// the blocking trait.
///
/// ```
/// use chunked_outbox::{AsyncChannelAdapter, Claim, Outcome};
/// use chunked_outbox::dispatch::SendFuture;
///
/// struct Discord;
///
/// impl AsyncChannelAdapter for Discord {
///     fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
///         Box::pin(async move {
///             // POST /channels/{claim.chat_id}/messages with
///             // {"nonce": claim.compact_key(), "enforce_nonce": true} (the full key
///             // is longer than Discord's 25-character nonce allows) ...
///             Outcome::delivered(None)
///         })
///     }
/// }
/// ```
pub trait AsyncChannelAdapter: Send + Sync + 'static {
    /// Sends one chunk and says what happened. Bound the I/O with a timeout.
    fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome>;

    /// Asks the platform about a part that may have reached it (see
    /// [`ChannelAdapter::settle`](crate::ChannelAdapter::settle)). Bound the I/O with a
    /// timeout. The default cannot ask: it holds the part for a person.
    fn settle<'a>(&'a self, part: &'a PossiblySent) -> SendFuture<'a, Settlement> {
        Box::pin(std::future::ready(super::cannot_ask(part)))
    }
}

/// An adapter shared with the rest of the application serves as one too.
impl<T: AsyncChannelAdapter + ?Sized> AsyncChannelAdapter for Arc<T> {
    fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
        (**self).send(claim)
    }

    fn settle<'a>(&'a self, part: &'a PossiblySent) -> SendFuture<'a, Settlement> {
        (**self).settle(part)
    }
}

/// Every `Outbox` call blocks the thread: it waits for SQLite's writer lock (up to the
/// busy timeout) and for the disk. In async code, run them on tokio's blocking pool.
impl Outbox {
    /// Runs `f` with this outbox on tokio's blocking pool, so the calling task's worker
    /// thread is not blocked. A panic in `f` resumes in the caller.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), chunked_outbox::Error> {
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let reply = NewDelivery::single("telegram", "42", "hi");
    /// let id = outbox.run_blocking(move |o| o.enqueue(&reply)).await?.id;
    /// let view = outbox.run_blocking(move |o| o.delivery(id)).await?;
    /// assert!(view.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn run_blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Outbox) -> T + Send + 'static,
    ) -> T {
        let outbox = self.clone();
        match tokio::task::spawn_blocking(move || on_blocking_pool(|| f(&outbox))).await {
            Ok(value) => value,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }

    /// [`enqueue`](Outbox::enqueue) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Outbox::enqueue).
    pub async fn enqueue_async(&self, delivery: NewDelivery) -> Result<Enqueued> {
        self.run_blocking(move |o| o.enqueue(&delivery)).await
    }

    /// [`health`](Outbox::health) on the blocking pool.
    ///
    /// # Errors
    ///
    /// As [`health`](Outbox::health).
    pub async fn health_async(&self) -> Result<Health> {
        self.run_blocking(Outbox::health).await
    }
}

/// Builds an [`AsyncDispatcher`]; the settings are those of
/// [`DispatcherBuilder`](crate::dispatch::DispatcherBuilder).
pub type AsyncDispatcherBuilder = DispatcherBuilder<dyn AsyncChannelAdapter>;

impl DispatcherBuilder<dyn AsyncChannelAdapter> {
    /// Serves `channel` with `adapter`.
    pub fn adapter(
        mut self,
        channel: impl Into<String>,
        adapter: impl AsyncChannelAdapter,
    ) -> Self {
        self.adapters.insert(channel.into(), Arc::new(adapter));
        self
    }

    /// Returns the dispatcher.
    ///
    /// # Errors
    ///
    /// As [`DispatcherBuilder::build`](crate::dispatch::DispatcherBuilder::build).
    pub fn build(self) -> Result<AsyncDispatcher> {
        let shared = self.into_shared()?;
        Ok(AsyncDispatcher { shared })
    }
}

/// Moves due chunks to the platforms through async adapters, on a tokio runtime.
///
/// Same guarantees as [`Dispatcher`](crate::Dispatcher): batched claims, wake-up on
/// enqueue and at the next due time, other processes' commits noticed within the poll
/// interval, graceful shutdown that finishes sends in flight and releases the rest.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::{AsyncChannelAdapter, AsyncDispatcher, Claim, NewDelivery, Outbox, OutboxOptions, Outcome};
/// use chunked_outbox::dispatch::SendFuture;
///
/// struct Matrix;
/// impl AsyncChannelAdapter for Matrix {
///     fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
///         // PUT /rooms/{claim.chat_id}/send/m.room.message/{claim.idempotency_key} ...
///         Box::pin(async move { Outcome::delivered(Some("$event".into())) })
///     }
/// }
///
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), chunked_outbox::Error> {
/// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
/// let running = AsyncDispatcher::builder(outbox.clone()).adapter("matrix", Matrix).build()?.start()?;
/// outbox.enqueue_async(NewDelivery::single("matrix", "!room:example.org", "hi")).await?;
/// while outbox.health_async().await?.totals.finalized_total == 0 {
///     tokio::time::sleep(Duration::from_millis(10)).await;
/// }
/// let report = running.shutdown(Duration::from_secs(5)).await;
/// assert!(report.clean);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct AsyncDispatcher {
    shared: Arc<Shared<dyn AsyncChannelAdapter>>,
}

impl std::fmt::Debug for AsyncDispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDispatcher")
            .field("channels", &self.shared.core.channel_names())
            .finish_non_exhaustive()
    }
}

impl AsyncDispatcher {
    /// A builder for a dispatcher on `outbox`.
    pub fn builder(outbox: Outbox) -> AsyncDispatcherBuilder {
        DispatcherBuilder::new(outbox)
    }

    /// What this dispatcher has done so far, over all its runs.
    pub fn stats(&self) -> DispatchStats {
        self.shared.core.stats()
    }

    /// Runs `f` with the shared state where blocking is allowed: on this worker thread
    /// (`block_in_place`, which moves the thread's other tasks elsewhere) on a
    /// multi-thread runtime, on the blocking pool on a current-thread one.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Shared<dyn AsyncChannelAdapter>) -> T + Send + 'static,
    ) -> T {
        if tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread
        {
            return tokio::task::block_in_place(|| f(&self.shared));
        }
        let shared = self.shared.clone();
        match tokio::task::spawn_blocking(move || on_blocking_pool(|| f(&shared))).await {
            Ok(value) => value,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }

    /// Records `done`, claims up to `limit` chunks (see [`Core::step`]) and admits them
    /// (see [`Shared::admit`]), in one blocking call; returns how many were
    /// claimed and the sends to make.
    async fn step(
        &self,
        run: &Arc<Run>,
        mut done: Vec<(Claim, Outcome)>,
        limit: usize,
    ) -> Result<(usize, Admitted)> {
        let run = run.clone();
        self.blocking(move |s| {
            let claims = s.core.step(&run, &mut done, limit)?;
            Ok((claims.len(), s.admit(&run, claims)))
        })
        .await
    }

    /// One round: claims up to [`batch_size`](DispatcherBuilder::batch_size) due
    /// chunks, sends them concurrently and records their outcomes; returns how many were
    /// claimed. No lease is renewed meanwhile.
    ///
    /// # Errors
    ///
    /// Errors of the claim. Errors recording single outcomes are logged and counted.
    pub async fn run_once(&self) -> Result<usize> {
        let run = Arc::new(Run::default());
        let (n, admitted) = self
            .step(&run, Vec::new(), self.shared.core.settings.batch)
            .await?;
        let done = self.send_all(admitted).await;
        self.step(&run, done, 0).await?;
        Ok(n)
    }

    /// Sends freshly claimed chunks concurrently — one on this task, more as a task
    /// each — within the send timeout if one is set, and returns their outcomes. A panic
    /// comes back as an ambiguous outcome rather than taking the worker down.
    async fn send_all(&self, mut admitted: Admitted) -> Vec<(Claim, Outcome)> {
        let core = &self.shared.core;
        let timeout = core.settings.send_timeout;
        if admitted.len() == 1 {
            let (claim, adapter) = admitted.remove(0);
            let span = Core::span(&claim);
            span.in_scope(|| core.before_send(&claim));
            let send = CatchUnwind(adapter.send(&claim)).instrument(span);
            let outcome = match timeout {
                Some(t) => tokio::time::timeout(t, send)
                    .await
                    .unwrap_or_else(|_| Ok(core.timed_out(t))),
                None => send.await,
            }
            .unwrap_or_else(|payload| core.panicked(payload));
            return vec![(claim, outcome)];
        }
        let sends: Vec<_> = admitted
            .into_iter()
            .map(|(claim, adapter)| {
                let span = Core::span(&claim);
                span.in_scope(|| core.before_send(&claim));
                let c = claim.clone();
                let task = tokio::spawn(async move { adapter.send(&c).await }.instrument(span));
                (claim, task)
            })
            .collect();
        let deadline = timeout.map(|t| (t, tokio::time::Instant::now() + t));
        let mut done = Vec::with_capacity(sends.len());
        for (claim, mut task) in sends {
            let joined = match deadline {
                Some((timeout, at)) => match tokio::time::timeout_at(at, &mut task).await {
                    Ok(joined) => joined,
                    Err(_) => {
                        task.abort();
                        done.push((claim, core.timed_out(timeout)));
                        continue;
                    }
                },
                None => task.await,
            };
            let outcome = joined.unwrap_or_else(|e| {
                if e.is_panic() {
                    core.panicked(e.into_panic())
                } else {
                    Outcome::Ambiguous {
                        error: "the send task was cancelled (runtime shutting down)".into(),
                    }
                }
            });
            done.push((claim, outcome));
        }
        done
    }

    /// One round of asking the platforms (see
    /// [`Dispatcher::settle_once`](crate::Dispatcher::settle_once)): each part held
    /// uncertain on a served channel whose stored replay policy is
    /// [`Ask`](crate::rules::ReplayPolicy::Ask), not asked about yet, goes to its
    /// adapter's [`settle`](AsyncChannelAdapter::settle), one at a time, and the answer
    /// is recorded. Returns how many answers were recorded. A started dispatcher does
    /// this every [`settle_interval`](DispatcherBuilder::settle_interval).
    pub async fn settle_once(&self) -> usize {
        let parts = self.blocking(|s| s.core.unasked()).await;
        let mut recorded = 0;
        for part in parts {
            let Some(adapter) = self.shared.adapters.get(&part.claim.channel).cloned() else {
                continue;
            };
            if !self.shared.core.may_ask(&part.claim.channel) {
                continue; // a wait its platform asked for began this round
            }
            let settlement = CatchUnwind(adapter.settle(&part))
                .await
                .unwrap_or_else(|_| super::adapter_panicked());
            recorded += usize::from(
                self.blocking(move |s| s.core.settled(&part, settlement))
                    .await,
            );
        }
        recorded
    }

    /// Asks the platforms until the run stops: every settle interval while a round
    /// finds something to ask about or the outbox is written, backing off to
    /// `SETTLE_BACKOFF` intervals while neither, and at once when the run records a
    /// part as uncertain.
    async fn settle_every(&self, run: &Run) {
        let interval = self.shared.core.settings.settle_interval;
        let notifier = self.shared.core.outbox.notifier();
        let mut seen = notifier.generation();
        let mut wait = interval;
        while !run.stopping() {
            let asked = self.settle_once().await > 0;
            let before = std::mem::replace(&mut seen, notifier.generation());
            // Busy while a round asks something or the outbox is written.
            wait = if asked || before != seen {
                interval
            } else {
                (wait * 2).min(interval * super::SETTLE_BACKOFF)
            };
            tokio::select! {
                _ = run.settle_now.notified() => wait = interval,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Spawns the worker tasks on the current tokio runtime, and a thread that renews
    /// their leases.
    ///
    /// # Errors
    ///
    /// Database errors opening the connections that watch for other processes' commits;
    /// [`Error::Io`](crate::Error::Io) if the lease keeper's thread cannot start.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn start(&self) -> Result<RunningAsyncDispatcher> {
        let run = Arc::new(Run::default());
        let mut tasks = Vec::new();
        let watcher = self.shared.core.outbox.change_watcher()?;
        let guards: Vec<_> = (0..self.shared.core.settings.workers)
            .map(|_| run.enter())
            .collect();
        let spawn_error = |source| crate::Error::Io {
            path: "dispatcher thread".into(),
            source,
        };
        let (me, keeper_run) = (self.clone(), run.clone());
        std::thread::Builder::new()
            .name("outbox-lease-keeper".into())
            .spawn(move || keep_leases(&me.shared.core, &keeper_run))
            .map_err(spawn_error)?;
        let (me, watch_run) = (self.clone(), run.clone());
        std::thread::Builder::new()
            .name("outbox-watch".into())
            .spawn(move || super::watch_others(&me.shared.core, &watch_run, watcher))
            .map_err(spawn_error)?;
        for guard in guards {
            let (me, run) = (self.clone(), run.clone());
            tasks.push(tokio::spawn(async move {
                // Counts the worker out of its run however the task ends.
                let _live = guard;
                me.work(&run).await
            }));
        }
        let (me, settler_run) = (self.clone(), run.clone());
        let settler = tokio::spawn(async move { me.settle_every(&settler_run).await });
        Ok(RunningAsyncDispatcher {
            dispatcher: self.clone(),
            run,
            tasks,
            settler,
        })
    }

    /// Runs the workers until `shutdown` completes, then shuts down gracefully (waiting
    /// up to `grace` for sends in flight). `shutdown` may be any future; its output is
    /// ignored, so `tokio::signal::ctrl_c()` can be passed as it is.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn run_until<F: Future>(
        &self,
        shutdown: F,
        grace: Duration,
    ) -> Result<ShutdownReport> {
        let running = self.start()?;
        shutdown.await;
        Ok(running.shutdown(grace).await)
    }

    async fn work(&self, run: &Arc<Run>) {
        let core = &self.shared.core;
        let notifier = core.outbox.notifier();
        let mut seen = notifier.generation();
        let mut done = Vec::new();
        loop {
            let limit = if run.stopping() {
                0
            } else {
                core.settings.batch
            };
            let (claimed, admitted) = match self.step(run, std::mem::take(&mut done), limit).await {
                Ok(step) => {
                    core.claim_worked();
                    step
                }
                Err(e) => {
                    core.claim_failed(&e);
                    if limit == 0 {
                        return;
                    }
                    // However much is due, the next try waits a poll interval (or a
                    // commit of this process, which says the store takes writes again).
                    let notified = notifier.async_changed.notified();
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep(core.settings.poll_interval) => {}
                    }
                    seen = notifier.generation();
                    continue;
                }
            };
            if limit == 0 {
                return;
            }
            if claimed > 0 {
                done = self.send_all(admitted).await;
                continue;
            }
            let gate = run.clone();
            let mut next_due = self.blocking(move |s| s.core.next_due_in(&gate)).await;
            while let Some(wait) = core.sleep_for(next_due) {
                if run.stopping() {
                    break;
                }
                let notified = notifier.async_changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                // A commit by another process wakes it through the notifier too (the
                // run's watcher sees it).
                let mut changed = notifier.generation() != seen;
                if !changed {
                    tokio::select! {
                        _ = &mut notified => changed = true,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                if changed {
                    seen = notifier.generation();
                    let gate = run.clone();
                    next_due = self.blocking(move |s| s.core.next_due_in(&gate)).await;
                }
            }
        }
    }
}

/// An adapter's future with its panics caught: a panic while polling it ends it with
/// the panic's payload.
struct CatchUnwind<'a, T>(SendFuture<'a, T>);

impl<T> Future for CatchUnwind<'_, T> {
    type Output = std::thread::Result<T>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let send = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| send.as_mut().poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(outcome)) => std::task::Poll::Ready(Ok(outcome)),
            Err(payload) => std::task::Poll::Ready(Err(payload)),
        }
    }
}

/// An async dispatcher whose worker tasks are running. Dropping it asks them to stop:
/// each finishes and records the send it is in, then ends (call
/// [`shutdown`](Self::shutdown) to wait for that).
#[must_use = "dropping a running dispatcher stops it; call shutdown to wait for it"]
pub struct RunningAsyncDispatcher {
    dispatcher: AsyncDispatcher,
    run: Arc<Run>,
    tasks: Vec<JoinHandle<()>>,
    /// Asks the platforms about uncertain parts; stopped with the workers.
    settler: JoinHandle<()>,
}

impl RunningAsyncDispatcher {
    /// What the dispatcher has done so far.
    pub fn stats(&self) -> DispatchStats {
        self.dispatcher.stats()
    }

    /// Asks the workers to stop without waiting for them; [`shutdown`](Self::shutdown)
    /// then waits.
    pub fn request_shutdown(&self) {
        self.run.stop();
        self.dispatcher.shared.core.outbox.wake();
    }

    /// Stops the workers: sends in flight finish and are recorded. Waits up to
    /// `timeout`.
    pub async fn shutdown(mut self, timeout: Duration) -> ShutdownReport {
        self.request_shutdown();
        let deadline = tokio::time::Instant::now() + timeout;
        let (mut still_sending, mut lost) = (0, 0);
        for task in &mut self.tasks {
            // A finished task answers even once the deadline has passed.
            match tokio::time::timeout_at(deadline, task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => lost += usize::from(e.is_panic()),
                Err(_) => still_sending += 1,
            }
        }
        // A question in progress is dropped unanswered: the part is asked about again.
        self.settler.abort();
        ShutdownReport {
            clean: still_sending == 0 && lost == 0,
            still_sending,
            workers_lost: lost,
            stats: self.dispatcher.stats(),
        }
    }
}

impl Drop for RunningAsyncDispatcher {
    fn drop(&mut self) {
        self.settler.abort();
        self.request_shutdown();
    }
}

//! The tokio dispatcher: worker tasks for async engines. Database work runs on tokio's
//! blocking pool (`spawn_blocking`), never on the async worker threads.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::{Instrument, warn};

use super::{Core, DispatchStats, DispatcherBuilder, Pacing, Shared, ShutdownReport, Unrecorded};
use crate::outbox::ChangeWatcher;
use crate::{Claim, Outbox, Outcome, ReplayPolicy, Result};

/// A boxed, sendable future: what [`AsyncChannelAdapter::send`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The async counterpart of [`ChannelAdapter`](crate::ChannelAdapter).
///
/// ```
/// use chunked_outbox::{AsyncChannelAdapter, BoxFuture, Claim, Outcome, ReplayPolicy};
///
/// struct Discord;
///
/// impl AsyncChannelAdapter for Discord {
///     fn send<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Outcome> {
///         Box::pin(async move {
///             // POST /channels/{claim.chat_id}/messages with nonce = claim.idempotency_key
///             Outcome::delivered(None)
///         })
///     }
///     fn replay(&self) -> ReplayPolicy {
///         ReplayPolicy::Replay // Discord deduplicates by nonce
///     }
/// }
/// ```
pub trait AsyncChannelAdapter: Send + Sync + 'static {
    /// Sends one chunk and says what happened. Bound the I/O with a timeout.
    fn send<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Outcome>;

    /// Whether a possibly-sent chunk may be replayed. Default: hold it.
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Hold
    }

    /// How fast this platform may be sent to. Default: no pacing.
    fn pacing(&self) -> Pacing {
        Pacing::default()
    }
}

/// Builds an [`AsyncDispatcher`]; the settings are those of
/// [`DispatcherBuilder`](crate::DispatcherBuilder).
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

    /// Registers the adapters' declarations with the outbox and returns the dispatcher.
    ///
    /// # Errors
    ///
    /// As [`DispatcherBuilder::build`](crate::DispatcherBuilder::build).
    pub fn build(self) -> Result<AsyncDispatcher> {
        let shared = self.into_shared(|a| (a.replay(), a.pacing()))?;
        Ok(AsyncDispatcher { shared })
    }
}

/// Moves due chunks to the platforms through async adapters, on a tokio runtime.
///
/// Same guarantees as [`Dispatcher`](crate::Dispatcher): batched claims, wake-up on
/// enqueue and at the next due time, other processes' commits noticed within the poll
/// interval, graceful shutdown that finishes sends in flight and releases the rest.
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

    /// What this dispatcher has done so far.
    pub fn stats(&self) -> DispatchStats {
        self.shared.core.stats()
    }

    /// Runs `f` with the shared state on tokio's blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Shared<dyn AsyncChannelAdapter>) -> T + Send + 'static,
    ) -> T {
        let shared = self.shared.clone();
        match tokio::task::spawn_blocking(move || f(&shared)).await {
            Ok(value) => value,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }

    /// One claim-send-record round; returns how many chunks were claimed.
    ///
    /// # Errors
    ///
    /// Errors of the claim. Errors recording single outcomes are logged and counted.
    pub async fn run_once(&self) -> Result<usize> {
        let claims = self.blocking(|s| s.core.claim()).await?;
        let n = claims.len();
        let mut unrecorded = Unrecorded::new(self.shared.core.settings.group_window);
        for claim in claims {
            let span = Core::span(&claim);
            if let Some(outcome) = self.send(&claim).instrument(span).await
                && let Some(batch) = unrecorded.push(claim, outcome)
            {
                self.blocking(move |s| s.core.record_all(&batch)).await;
            }
        }
        let rest = unrecorded.take();
        self.blocking(move |s| s.core.record_all(&rest)).await;
        Ok(n)
    }

    /// Sends one claim, or releases it (stopping, rate slot taken, no adapter).
    async fn send(&self, claim: &Claim) -> Option<Outcome> {
        match self.shared.admit(claim) {
            Ok(adapter) => {
                let adapter = adapter.clone();
                self.shared.core.before_send(claim);
                Some(adapter.send(claim).await)
            }
            Err(delay) => {
                let claim = claim.clone();
                self.blocking(move |s| s.core.release(&claim, delay)).await;
                None
            }
        }
    }

    /// Spawns the worker tasks on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// Database errors opening the connections that watch for other processes' commits.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn start(&self) -> Result<RunningAsyncDispatcher> {
        let mut tasks = Vec::new();
        for _ in 0..self.shared.core.settings.workers {
            let watcher = Arc::new(Mutex::new(self.shared.core.outbox.change_watcher()?));
            let me = self.clone();
            tasks.push(tokio::spawn(async move { me.work(watcher).await }));
        }
        Ok(RunningAsyncDispatcher {
            dispatcher: self.clone(),
            tasks,
        })
    }

    /// Runs the workers until `shutdown` completes, then shuts down gracefully (waiting
    /// up to `grace` for sends in flight).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn run_until(
        &self,
        shutdown: impl Future<Output = ()>,
        grace: Duration,
    ) -> Result<ShutdownReport> {
        let running = self.start()?;
        shutdown.await;
        Ok(running.shutdown(grace).await)
    }

    async fn work(self, watcher: Arc<Mutex<ChangeWatcher>>) {
        let core = &self.shared.core;
        let notifier = core.outbox.notifier();
        let mut seen = notifier.generation();
        while !core.stopping() {
            match self.run_once().await {
                Ok(0) => {}
                Ok(_) => continue,
                Err(e) => {
                    core.note_error();
                    warn!(error = %e, "claim failed; retrying after the poll interval");
                }
            }
            let mut next_due = self.blocking(|s| s.core.next_due()).await;
            while let Some(wait) = core.sleep_for(next_due) {
                if core.stopping() {
                    return;
                }
                let notified = notifier.async_changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let mut changed = notifier.generation() != seen;
                if !changed {
                    tokio::select! {
                        _ = &mut notified => changed = true,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                if !changed {
                    let watcher = watcher.clone();
                    changed = self
                        .blocking(move |_| {
                            let mut w = watcher.lock().unwrap_or_else(|e| e.into_inner());
                            w.changed().unwrap_or(true)
                        })
                        .await;
                }
                if changed {
                    seen = notifier.generation();
                    next_due = self.blocking(|s| s.core.next_due()).await;
                }
            }
        }
    }
}

/// An async dispatcher whose worker tasks are running.
#[must_use = "call shutdown to stop the workers gracefully"]
pub struct RunningAsyncDispatcher {
    dispatcher: AsyncDispatcher,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningAsyncDispatcher {
    /// What the dispatcher has done so far.
    pub fn stats(&self) -> DispatchStats {
        self.dispatcher.stats()
    }

    /// Asks the workers to stop without waiting for them; [`shutdown`](Self::shutdown)
    /// then waits.
    pub fn request_shutdown(&self) {
        self.dispatcher.shared.core.stop();
    }

    /// Stops the workers: sends in flight finish and are recorded, unstarted claims are
    /// released. Waits up to `timeout`.
    pub async fn shutdown(self, timeout: Duration) -> ShutdownReport {
        self.dispatcher.shared.core.stop();
        let mut tasks = self.tasks;
        let _ = tokio::time::timeout(timeout, async {
            for task in &mut tasks {
                let _ = task.await;
            }
        })
        .await;
        let still_sending = tasks.iter().filter(|t| !t.is_finished()).count();
        ShutdownReport {
            clean: still_sending == 0,
            still_sending,
            stats: self.dispatcher.stats(),
        }
    }
}

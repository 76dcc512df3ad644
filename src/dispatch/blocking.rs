//! The blocking dispatcher: worker threads for CLI agents and simple bots.

use std::collections::HashMap;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::warn;

use super::{ChannelAdapter, Core, DispatchStats, Settings, Shared, Unrecorded};
use crate::{Claim, Outbox, Result};

/// Builds a [`Dispatcher`] (or, as
/// [`AsyncDispatcherBuilder`](crate::AsyncDispatcherBuilder), an async one): register
/// one adapter per channel, then `build`.
pub struct DispatcherBuilder<A: ?Sized = dyn ChannelAdapter> {
    pub(crate) outbox: Outbox,
    pub(crate) settings: Settings,
    pub(crate) adapters: HashMap<String, Arc<A>>,
}

impl<A: ?Sized> DispatcherBuilder<A> {
    pub(crate) fn new(outbox: Outbox) -> Self {
        DispatcherBuilder {
            outbox,
            settings: Settings::default(),
            adapters: HashMap::new(),
        }
    }

    /// Worker threads (tasks, for the async flavour), each claiming and sending its own
    /// batches. Default 2.
    pub fn workers(mut self, workers: usize) -> Self {
        self.settings.workers = workers;
        self
    }

    /// Chunks claimed per transaction. Default 16.
    pub fn batch_size(mut self, batch: usize) -> Self {
        self.settings.batch = batch;
        self
    }

    /// The longest an idle worker sleeps before checking for commits from other
    /// processes (and so the bound on how late it notices them). Enqueues in this
    /// process wake workers at once. Default 50 ms.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// Outcomes that arrive within this window of the first unrecorded one are recorded
    /// in one transaction (group commit). A send slower than the window is recorded on
    /// its own right after it returns, so with real network sends every outcome is
    /// committed at once; with very fast adapters a crash can leave up to one batch of
    /// sent-but-unrecorded chunks, which recovery treats as possibly sent. Zero records
    /// each outcome on its own. Default 2 ms.
    pub fn group_commit_window(mut self, window: Duration) -> Self {
        self.settings.group_window = window;
        self
    }
}

impl DispatcherBuilder<dyn ChannelAdapter> {
    /// Serves `channel` with `adapter`. Registering a channel again replaces its adapter.
    pub fn adapter(mut self, channel: impl Into<String>, adapter: impl ChannelAdapter) -> Self {
        self.adapters.insert(channel.into(), Arc::new(adapter));
        self
    }

    /// Registers the adapters' replay and pacing declarations with the outbox and
    /// returns the dispatcher.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for no adapters, zero
    /// workers, a batch size outside `1..=MAX_CLAIM_BATCH` or a zero poll interval.
    pub fn build(self) -> Result<Dispatcher> {
        let shared = self.into_shared(|a| (a.replay(), a.pacing()))?;
        Ok(Dispatcher { shared })
    }
}

/// Moves due chunks from the outbox to the platforms through blocking adapters.
///
/// [`start`](Self::start) runs it on worker threads; [`run_once`](Self::run_once) runs
/// one claim-send-record round on the calling thread (deterministic, for tests with a
/// [`ManualClock`](crate::ManualClock)).
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome};
///
/// struct Console;
/// impl ChannelAdapter for Console {
///     fn send(&self, claim: &Claim) -> Outcome {
///         println!("to {}: {}", claim.chat_id, claim.text);
///         Outcome::delivered(None)
///     }
/// }
///
/// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
/// let running = Dispatcher::builder(outbox.clone()).adapter("console", Console).build()?.start()?;
/// let id = outbox.enqueue(&NewDelivery::single("console", "me", "hello"))?.id;
/// // ... the worker wakes at once and sends it.
/// # while outbox.health()?.totals.delivered_deliveries == 0 { std::thread::sleep(Duration::from_millis(1)); }
/// let report = running.shutdown(Duration::from_secs(5));
/// assert!(report.clean);
/// # Ok::<(), chunked_outbox::Error>(())
/// ```
#[derive(Clone)]
pub struct Dispatcher {
    shared: Arc<Shared<dyn ChannelAdapter>>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("channels", &self.shared.core.channel_names())
            .field("settings", &self.shared.core.settings)
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    /// A builder for a dispatcher on `outbox`.
    pub fn builder(outbox: Outbox) -> DispatcherBuilder {
        DispatcherBuilder::new(outbox)
    }

    /// Claims one batch of due chunks of the registered channels, sends each through
    /// its adapter in order and records the outcomes. Returns how many were claimed.
    ///
    /// # Errors
    ///
    /// Errors of the claim ([`Error::Busy`](crate::Error::Busy), ...). Errors recording
    /// single outcomes are logged and counted in [`stats`](Self::stats) instead.
    pub fn run_once(&self) -> Result<usize> {
        let claims = self.shared.core.claim()?;
        let n = claims.len();
        self.process(claims);
        Ok(n)
    }

    /// What this dispatcher has done so far.
    pub fn stats(&self) -> DispatchStats {
        self.shared.core.stats()
    }

    /// Starts the worker threads.
    ///
    /// Each worker claims a batch, sends it, records the outcomes, and when nothing is
    /// due sleeps until the next due time; an enqueue in this process wakes it at once,
    /// and a commit by another process within the poll interval.
    ///
    /// # Errors
    ///
    /// Database errors opening the connections that watch for other processes' commits.
    pub fn start(&self) -> Result<RunningDispatcher> {
        let mut workers = Vec::with_capacity(self.shared.core.settings.workers);
        let (finished, done) = mpsc::channel();
        for n in 0..self.shared.core.settings.workers {
            let watcher = self.shared.core.outbox.change_watcher()?;
            let me = self.clone();
            let finished = finished.clone();
            let thread = std::thread::Builder::new()
                .name(format!("outbox-worker-{n}"))
                .spawn(move || {
                    me.work(watcher);
                    let _ = finished.send(());
                })
                .map_err(|source| crate::Error::Io {
                    path: "worker thread".into(),
                    source,
                })?;
            workers.push(thread);
        }
        Ok(RunningDispatcher {
            dispatcher: self.clone(),
            workers,
            done,
        })
    }

    fn work(&self, mut watcher: crate::outbox::ChangeWatcher) {
        let core = &self.shared.core;
        let notifier = core.outbox.notifier();
        let mut seen = notifier.generation();
        while !core.stopping() {
            match self.run_once() {
                Ok(0) => {}
                Ok(_) => continue,
                Err(e) => {
                    core.note_error();
                    warn!(error = %e, "claim failed; retrying after the poll interval");
                }
            }
            // Idle: sleep until something of ours is due, an enqueue in this process,
            // or a commit by another connection (seen by the watcher at each poll).
            // Only those make it worth reading the next due time again.
            let mut next_due = core.next_due();
            while let Some(wait) = core.sleep_for(next_due) {
                if core.stopping() {
                    return;
                }
                let now = notifier.wait(seen, wait);
                if now != seen || watcher.changed().unwrap_or(true) {
                    seen = now;
                    next_due = core.next_due();
                }
            }
        }
    }

    /// Sends a batch in order. Outcomes are recorded together when they come within the
    /// group-commit window of each other (fast sends), or one by one (slow sends). Once
    /// stopping, the unstarted rest is released.
    fn process(&self, claims: Vec<Claim>) {
        let core = &self.shared.core;
        let mut unrecorded = Unrecorded::new(core.settings.group_window);
        for claim in claims {
            match self.shared.admit(&claim) {
                Ok(adapter) => {
                    let outcome = {
                        let _entered = Core::span(&claim).entered();
                        core.before_send(&claim);
                        adapter.send(&claim)
                    };
                    if let Some(batch) = unrecorded.push(claim, outcome) {
                        core.record_all(&batch);
                    }
                }
                Err(delay) => core.release(&claim, delay),
            }
        }
        core.record_all(&unrecorded.take());
    }
}

/// A dispatcher whose workers are running. Dropping it stops them and waits for them.
#[must_use = "dropping a running dispatcher stops it at once"]
pub struct RunningDispatcher {
    dispatcher: Dispatcher,
    workers: Vec<JoinHandle<()>>,
    /// One message per worker that has finished.
    done: mpsc::Receiver<()>,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ShutdownReport {
    /// Every worker finished within the timeout.
    pub clean: bool,
    /// Workers still inside an adapter's `send` when the timeout passed. They record
    /// their outcome when it returns.
    pub still_sending: usize,
    /// What the dispatcher did over its life.
    pub stats: DispatchStats,
}

impl RunningDispatcher {
    /// What the dispatcher has done so far.
    pub fn stats(&self) -> DispatchStats {
        self.dispatcher.stats()
    }

    /// Asks the workers to stop without waiting for them (for a signal handler, say):
    /// each finishes the send it is in, releases the rest of its batch and exits.
    /// [`shutdown`](Self::shutdown) then waits.
    pub fn request_shutdown(&self) {
        self.dispatcher.shared.core.stop();
    }

    /// Stops the workers: sends in flight finish and are recorded, claimed chunks not
    /// yet started are released, idle workers wake and exit. Waits up to `timeout` for
    /// them; nothing is left `sending` unless an adapter is still inside `send` then.
    pub fn shutdown(mut self, timeout: Duration) -> ShutdownReport {
        self.stop(timeout)
    }

    fn stop(&mut self, timeout: Duration) -> ShutdownReport {
        self.dispatcher.shared.core.stop();
        let deadline = Instant::now() + timeout;
        let mut finished = 0;
        while finished < self.workers.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.done.recv_timeout(left).is_err() {
                break;
            }
            finished += 1;
        }
        let still_sending = self.workers.len() - finished;
        for worker in self.workers.drain(..) {
            if still_sending == 0 {
                // Each has sent its last message; joining only waits for it to return.
                let _ = worker.join();
            }
            // Otherwise the handle is dropped: a worker stuck in `send` is detached and
            // records its outcome when `send` returns.
        }
        ShutdownReport {
            clean: still_sending == 0,
            still_sending,
            stats: self.dispatcher.stats(),
        }
    }
}

impl Drop for RunningDispatcher {
    fn drop(&mut self) {
        if !self.workers.is_empty() {
            let _ = self.stop(Duration::from_secs(30));
        }
    }
}

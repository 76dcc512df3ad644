//! The blocking dispatcher: worker threads for CLI agents and simple bots.

use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::warn;

use super::builder::{DispatcherBuilder, ShutdownReport};
use super::{ChannelAdapter, Core, DispatchStats, Run, Shared, guarded, keep_leases};
use crate::claim::Claim;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::outcome::Outcome;

impl DispatcherBuilder<dyn ChannelAdapter> {
    /// Serves `channel` with `adapter`. Registering a channel again replaces its adapter.
    pub fn adapter(mut self, channel: impl Into<String>, adapter: impl ChannelAdapter) -> Self {
        self.adapters.insert(channel.into(), Arc::new(adapter));
        self
    }

    /// Returns the dispatcher.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for no adapters, zero
    /// workers, a batch size outside `1..=1024`, a zero poll interval or a zero send
    /// timeout.
    pub fn build(self) -> Result<Dispatcher> {
        let shared = self.into_shared()?;
        Ok(Dispatcher { shared })
    }
}

/// Moves due chunks from the outbox to the platforms through blocking adapters.
///
/// [`start`](Self::start) runs it on worker threads; [`run_once`](Self::run_once) runs
/// one claim-send-record round on the calling thread (deterministic, for tests with a
/// [`ManualClock`](crate::clock::ManualClock)). A dispatcher can be started again after a
/// shutdown.
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

    /// One round on the calling thread: claims up to [`batch_size`](DispatcherBuilder::batch_size)
    /// due chunks of the registered channels, sends them and records their outcomes.
    /// Returns how many were claimed. No lease is renewed meanwhile: a send must return
    /// within the lease.
    ///
    /// # Errors
    ///
    /// Errors of the claim ([`Error::Busy`](crate::Error::Busy), ...). An outcome is never
    /// dropped: recording it is retried while the database is busy or full, and errors
    /// recording single outcomes are logged and counted in
    /// [`stats`](Self::stats).
    pub fn run_once(&self) -> Result<usize> {
        let (core, run) = (&self.shared.core, Run::default());
        let claims = core.step(&run, &mut Vec::new(), core.settings.batch)?;
        let n = claims.len();
        let mut done = self.send_all(&run, &mut SendThreads::new(self.clone()), claims);
        core.step(&run, &mut done, 0)?;
        Ok(n)
    }

    /// What this dispatcher has done so far, over all its runs.
    pub fn stats(&self) -> DispatchStats {
        self.shared.core.stats()
    }

    /// One round of asking the platforms on the calling thread: each part held
    /// uncertain on a served channel whose stored replay policy is
    /// [`Ask`](crate::rules::ReplayPolicy::Ask), not asked about yet (up to 16 per
    /// channel), goes to its adapter's [`settle`](ChannelAdapter::settle) and the
    /// answer is recorded (see [`settle`](crate::settle)). Returns how many answers were
    /// recorded. A started dispatcher does this every
    /// [`settle_interval`](DispatcherBuilder::settle_interval).
    pub fn settle_once(&self) -> usize {
        let core = &self.shared.core;
        let mut recorded = 0;
        for part in core.unasked() {
            let Some(adapter) = self.shared.adapters.get(&part.claim.channel) else {
                continue;
            };
            if !core.may_ask(&part.claim.channel) {
                continue; // a wait its platform asked for began this round
            }
            let settlement = super::settle_guarded(|| adapter.settle(&part));
            recorded += usize::from(core.settled(&part, settlement));
        }
        recorded
    }

    /// Starts the worker threads, the thread that renews their leases, the one that
    /// asks the platforms about uncertain parts and the one that watches for other
    /// processes' commits.
    ///
    /// Each worker claims what it sends, sends it, and records the outcome together with
    /// its next claim; when nothing is due it sleeps until the next due time; an enqueue
    /// in this process wakes it at once, and a commit by another process within the poll
    /// interval while commits come, within a second after a quiet spell (see
    /// [`poll_interval`](DispatcherBuilder::poll_interval)). An idle dispatcher wakes
    /// about once a second in all.
    ///
    /// # Errors
    ///
    /// Database errors opening the connections that watch for other processes' commits,
    /// and [`Error::Io`](crate::Error::Io) if a thread cannot be started (any started
    /// already are stopped).
    pub fn start(&self) -> Result<RunningDispatcher> {
        let run = Arc::new(Run::default());
        let (finished, done) = mpsc::channel();
        let mut running = RunningDispatcher {
            dispatcher: self.clone(),
            run: run.clone(),
            workers: Vec::new(),
            keeper: None,
            settler: None,
            watch: None,
            done,
        };
        let spawn_error = |source| crate::Error::Io {
            path: "dispatcher thread".into(),
            source,
        };
        let watcher = self.shared.core.outbox.change_watcher()?;
        for n in 0..self.shared.core.settings.workers {
            let (me, run) = (self.clone(), run.clone());
            let finished = Finished {
                tx: finished.clone(),
                _live: run.enter(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("outbox-worker-{n}"))
                .spawn(move || {
                    // Reports the worker's end, by returning or by panicking.
                    let _finished = finished;
                    me.work(&run);
                })
                .map_err(spawn_error)?;
            running.workers.push(thread);
        }
        let (me, keeper_run) = (self.clone(), run.clone());
        running.keeper = Some(
            std::thread::Builder::new()
                .name("outbox-lease-keeper".into())
                .spawn(move || keep_leases(&me.shared.core, &keeper_run))
                .map_err(spawn_error)?,
        );
        let (me, settler_run) = (self.clone(), run.clone());
        let interval = self.shared.core.settings.settle_interval;
        running.settler = Some(
            std::thread::Builder::new()
                .name("outbox-settler".into())
                .spawn(move || {
                    // Busy while a round asks something or the outbox is written.
                    let notifier = me.shared.core.outbox.notifier();
                    let mut seen = notifier.generation();
                    super::settle_while_live(&settler_run, interval, || {
                        let asked = !settler_run.stopping() && me.settle_once() > 0;
                        let before = std::mem::replace(&mut seen, notifier.generation());
                        asked || before != seen
                    })
                })
                .map_err(spawn_error)?,
        );
        let (me, watch_run) = (self.clone(), run.clone());
        running.watch = Some(
            std::thread::Builder::new()
                .name("outbox-watch".into())
                .spawn(move || super::watch_others(&me.shared.core, &watch_run, watcher))
                .map_err(spawn_error)?,
        );
        Ok(running)
    }

    fn work(&self, run: &Run) {
        let core = &self.shared.core;
        let notifier = core.outbox.notifier();
        let mut seen = notifier.generation();
        let mut done = Vec::new();
        let mut threads = SendThreads::new(self.clone());
        loop {
            let limit = if run.stopping() {
                0
            } else if crate::sabotage::planted("max_uncertain_per_kill") {
                core.settings.batch * 4
            } else {
                core.settings.batch
            };
            let claims = match core.step(run, &mut done, limit) {
                Ok(claims) => {
                    core.claim_worked();
                    claims
                }
                Err(e) if limit == 0 => {
                    core.claim_failed(&e);
                    return;
                }
                Err(e) => {
                    // However much is due, the next try waits a poll interval (or a
                    // commit of this process, which says the store takes writes again).
                    core.claim_failed(&e);
                    seen = notifier.wait(notifier.generation(), core.settings.poll_interval);
                    continue;
                }
            };
            if limit == 0 {
                return;
            }
            if !claims.is_empty() {
                done = self.send_all(run, &mut threads, claims);
                continue;
            }
            // Idle: sleep until something of ours is due, an enqueue in this process,
            // or a commit by another connection (which the run's watcher sees and
            // wakes the workers for). Only those make it worth reading the next due
            // time again.
            let mut next_due = core.next_due_in(run);
            while let Some(wait) = core.sleep_for(next_due) {
                if run.stopping() {
                    break;
                }
                let now = notifier.wait(seen, wait);
                if now != seen {
                    seen = now;
                    next_due = core.next_due_in(run);
                }
            }
        }
    }

    /// Sends freshly claimed chunks at once — on this thread for one, on the worker's
    /// send threads for more, or with a send timeout — and returns their outcomes.
    /// Chunks that may not be sent now are given back first (see [`Shared::admit`]).
    fn send_all(
        &self,
        run: &Run,
        threads: &mut SendThreads,
        claims: Vec<Claim>,
    ) -> Vec<(Claim, Outcome)> {
        let admitted = self.shared.admit(run, claims);
        match (admitted.len(), self.shared.core.settings.send_timeout) {
            (0, _) => Vec::new(),
            (1, None) => admitted
                .into_iter()
                .map(|(claim, adapter)| {
                    let outcome = self.send_one(&adapter, &claim);
                    (claim, outcome)
                })
                .collect(),
            (_, timeout) => threads.send(admitted, timeout),
        }
    }

    fn send_one(&self, adapter: &Arc<dyn ChannelAdapter>, claim: &Claim) -> Outcome {
        let core = &self.shared.core;
        let _entered = Core::span(claim).entered();
        core.before_send(claim);
        guarded(core, || adapter.send(claim))
    }
}

/// One send of a round, waiting for a thread to start it.
struct Job {
    round: u64,
    slot: usize,
    adapter: Arc<dyn ChannelAdapter>,
    claim: Claim,
}

/// A worker's round of sends, shared with its send threads.
#[derive(Default)]
struct Round {
    number: u64,
    /// Sends not started yet.
    queue: std::collections::VecDeque<Job>,
    /// The round's outcomes by slot, filled in as sends return.
    outcomes: Vec<Option<Outcome>>,
    /// Sends of the round that have not returned.
    waiting: usize,
    /// Send threads inside a send (of this round or, stuck past a timeout, an earlier
    /// one), and send threads alive.
    busy: usize,
    threads: usize,
    /// Threads asleep, and those woken that have not come for a send yet: a couple on
    /// their way at a time is enough, as each takes a send and wakes more while sends
    /// are left.
    sleeping: usize,
    woken: usize,
    /// The worker is gone: threads end once idle.
    closed: bool,
}

/// A worker's send threads, kept for the worker's life.
///
/// Every send of a round starts at once, whatever the others do, yet a fast platform
/// does not cost a thread wake-up per send: the worker wakes a thread, and each thread
/// that takes a send first makes sure up to two more are on their way while sends are
/// left, so the wake-ups spread as a tree over a slow round.
/// Threads that find the queue empty go back to sleep; sends that return at once are
/// all taken by the threads already awake (the worker too, without a send timeout).
/// A thread stuck in a send past the timeout stays busy; the round is recorded
/// without it, its late answer is dropped, and more threads are started as needed.
struct SendThreads {
    dispatcher: Dispatcher,
    shared: Arc<(Mutex<Round>, Condvar, Condvar)>,
}

impl SendThreads {
    fn new(dispatcher: Dispatcher) -> Self {
        SendThreads {
            dispatcher,
            // The round, "a send is waiting", "the round is done".
            shared: Arc::new((Mutex::new(Round::default()), Condvar::new(), Condvar::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Round> {
        lock(&self.shared.0)
    }

    fn spawn(&self) -> std::io::Result<()> {
        let (shared, me) = (self.shared.clone(), self.dispatcher.clone());
        std::thread::Builder::new()
            .name("outbox-send".into())
            .spawn(move || {
                let (round, work, done) = &*shared;
                let mut state = lock(round);
                loop {
                    if let Some(job) = take(&mut state, work) {
                        drop(state);
                        let outcome = me.send_one(&job.adapter, &job.claim);
                        state = lock(round);
                        answer(&mut state, done, job, outcome);
                    } else if state.closed {
                        state.threads -= 1;
                        return;
                    } else {
                        state.sleeping += 1;
                        state = work.wait(state).unwrap_or_else(|e| e.into_inner());
                        state.sleeping -= 1;
                        state.woken = state.woken.saturating_sub(1);
                    }
                }
            })?;
        Ok(())
    }

    /// Sends a round concurrently and waits for every answer, or until `timeout`.
    fn send(
        &mut self,
        round: Vec<(Claim, Arc<dyn ChannelAdapter>)>,
        timeout: Option<Duration>,
    ) -> Vec<(Claim, Outcome)> {
        let started = Instant::now();
        let n = round.len();
        // Enough idle threads for every send of the round, whatever is stuck.
        let missing = {
            let state = self.lock();
            n.saturating_sub(state.threads - state.busy)
        };
        for _ in 0..missing {
            match self.spawn() {
                Ok(()) => self.lock().threads += 1,
                Err(e) => warn!(error = %e, "could not start a send thread"),
            }
        }
        let mut claims = Vec::with_capacity(n);
        let (_, work, done) = &*self.shared;
        let mut state = self.lock();
        state.number += 1;
        state.outcomes = vec![None; n];
        state.waiting = n;
        let number = state.number;
        for (slot, (claim, adapter)) in round.into_iter().enumerate() {
            state.queue.push_back(Job {
                round: number,
                slot,
                adapter,
                claim: claim.clone(),
            });
            claims.push(claim);
        }
        wake_one(&mut state, work);
        // Without a timeout the worker sends too; with one it must stay free to keep it.
        // With no thread at all (none could be started) it sends everything itself.
        while timeout.is_none() || state.threads == 0 {
            let Some(job) = take(&mut state, work) else {
                break;
            };
            drop(state);
            let outcome = self.dispatcher.send_one(&job.adapter, &job.claim);
            state = self.lock();
            answer(&mut state, done, job, outcome);
        }
        while state.waiting > 0 {
            state = match timeout {
                // `send_one` catches panics, so every send returns.
                None => done.wait(state).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let left = t.saturating_sub(started.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    done.wait_timeout(state, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
        // Sends still out belong to an abandoned round from now on. One that no thread
        // could start (every thread stuck, and no new one) is sent here, late, rather
        // than reported as possibly sent.
        state.number += 1;
        let mut outcomes = std::mem::take(&mut state.outcomes);
        let unstarted: Vec<Job> = state.queue.drain(..).collect();
        drop(state);
        for job in unstarted {
            outcomes[job.slot] = Some(self.dispatcher.send_one(&job.adapter, &job.claim));
        }
        claims
            .into_iter()
            .zip(outcomes)
            .map(|(claim, outcome)| {
                let outcome = outcome.unwrap_or_else(|| {
                    self.dispatcher
                        .shared
                        .core
                        .timed_out(timeout.unwrap_or_default())
                });
                (claim, outcome)
            })
            .collect()
    }
}

impl Drop for SendThreads {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.1.notify_all();
    }
}

/// The round, also after a send thread panicked holding it (sends are guarded, so
/// only the bookkeeping between them could have).
fn lock(round: &Mutex<Round>) -> std::sync::MutexGuard<'_, Round> {
    round.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes the next send of the round, making sure another thread is on its way for the
/// rest first.
fn take(state: &mut Round, work: &Condvar) -> Option<Job> {
    let job = state.queue.pop_front()?;
    state.busy += 1;
    if !state.queue.is_empty() {
        wake_one(state, work);
    }
    Some(job)
}

/// Wakes a sleeping send thread unless two are already on their way (two, so that the
/// sends of a long round start in a widening tree of wake-ups rather than a chain).
fn wake_one(state: &mut Round, work: &Condvar) {
    if state.woken < 2.min(state.queue.len()) && state.sleeping > state.woken {
        state.woken += 1;
        work.notify_one();
    }
}

/// Files a returned send's outcome, if its round is still waiting for it.
fn answer(state: &mut Round, done: &Condvar, job: Job, outcome: Outcome) {
    state.busy -= 1;
    if state.number == job.round {
        state.outcomes[job.slot] = Some(outcome);
        state.waiting -= 1;
        if state.waiting == 0 {
            done.notify_one();
        }
    }
}

/// Tells a run's owner that one worker ended (and whether by a panic), then counts it
/// out of the run.
struct Finished {
    tx: mpsc::Sender<bool>,
    _live: super::WorkerGuard,
}

impl Drop for Finished {
    fn drop(&mut self) {
        let _ = self.tx.send(std::thread::panicking());
    }
}

/// A dispatcher whose workers are running. Dropping it stops them and waits for them
/// (up to 30 s).
#[must_use = "dropping a running dispatcher stops it at once"]
pub struct RunningDispatcher {
    dispatcher: Dispatcher,
    run: Arc<Run>,
    workers: Vec<JoinHandle<()>>,
    keeper: Option<JoinHandle<()>>,
    /// Asks the platforms about uncertain parts (see [`Dispatcher::settle_once`]).
    settler: Option<JoinHandle<()>>,
    /// The run's look at other processes' commits (see `watch_others`).
    watch: Option<JoinHandle<()>>,
    /// One message per worker that has ended: whether it panicked.
    done: mpsc::Receiver<bool>,
}

impl RunningDispatcher {
    /// What the dispatcher has done so far.
    pub fn stats(&self) -> DispatchStats {
        self.dispatcher.stats()
    }

    /// Asks the workers to stop without waiting for them (for a signal handler, say):
    /// each finishes the send it is in, records it and exits.
    /// [`shutdown`](Self::shutdown) then waits.
    pub fn request_shutdown(&self) {
        self.run.stop();
        self.dispatcher.shared.core.outbox.wake();
    }

    /// Stops the workers: sends in flight finish and are recorded, idle workers wake and
    /// exit. Waits up to `timeout` for them; nothing is left `sending` unless an adapter
    /// is still inside `send` then.
    pub fn shutdown(mut self, timeout: Duration) -> ShutdownReport {
        self.stop(timeout)
    }

    fn stop(&mut self, timeout: Duration) -> ShutdownReport {
        self.request_shutdown();
        let deadline = Instant::now() + timeout;
        let (mut finished, mut lost) = (0, 0);
        while finished < self.workers.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(panicked) => {
                    finished += 1;
                    lost += usize::from(panicked);
                }
                Err(_) => break,
            }
        }
        let still_sending = self.workers.len() - finished;
        for worker in self.workers.drain(..) {
            if still_sending == 0 {
                // Each has ended; joining only waits for it to return.
                let _ = worker.join();
            }
            // Otherwise the handle is dropped: a worker stuck in `send` is detached and
            // records its outcome when `send` returns.
        }
        if let Some(keeper) = self.keeper.take()
            && still_sending == 0
        {
            // The last worker to end woke it; it returns at once.
            let _ = keeper.join();
        }
        if let Some(settler) = self.settler.take()
            && still_sending == 0
        {
            // Woken as the keeper is; it returns once a question in progress is answered.
            let _ = settler.join();
        }
        if let Some(watch) = self.watch.take() {
            // Woken by the stop; it returns at once (or after a look in progress).
            let _ = watch.join();
        }
        if lost > 0 {
            warn!(workers = lost, "dispatcher workers ended by a panic");
        }
        ShutdownReport {
            clean: still_sending == 0 && lost == 0,
            still_sending,
            workers_lost: lost,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::tests::Accept;

    /// Round 1 with `sends` queued and `sleeping` idle threads.
    fn round(sends: usize, sleeping: usize) -> Round {
        let adapter: Arc<dyn ChannelAdapter> = Arc::new(Accept);
        Round {
            number: 1,
            queue: (0..sends)
                .map(|slot| Job {
                    round: 1,
                    slot,
                    adapter: adapter.clone(),
                    claim: Claim::for_testing("c", slot.to_string(), "t"),
                })
                .collect(),
            outcomes: vec![None; sends],
            waiting: sends,
            threads: sleeping,
            sleeping,
            ..Round::default()
        }
    }

    #[test]
    fn each_take_wakes_a_thread_while_sends_are_left_two_on_their_way_at_most() {
        let work = Condvar::new();
        let mut state = round(5, 8);
        let mut woken = Vec::new();
        while take(&mut state, &work).is_some() {
            woken.push(state.woken);
        }
        // Nobody came for the sends here, so the woken stay on their way: one per take
        // up to two, and none once a single send is left for the two.
        assert_eq!(woken, [1, 2, 2, 2, 2]);
        assert_eq!(state.busy, 5);
    }

    #[test]
    fn no_more_threads_are_woken_than_are_asleep() {
        let work = Condvar::new();
        let mut state = round(5, 1);
        while take(&mut state, &work).is_some() {}
        assert_eq!(state.woken, 1);
        let mut state = round(5, 0);
        while take(&mut state, &work).is_some() {}
        assert_eq!(state.woken, 0);
    }

    #[test]
    fn an_answer_is_filed_for_its_round_only() {
        let done = Condvar::new();
        let mut state = round(2, 2);
        let first = take(&mut state, &Condvar::new()).unwrap();
        let second = take(&mut state, &Condvar::new()).unwrap();
        answer(&mut state, &done, first, Outcome::delivered(None));
        assert_eq!((state.busy, state.waiting), (1, 1));
        assert!(state.outcomes[0].is_some() && state.outcomes[1].is_none());
        // The round was given up meanwhile: the late answer frees its thread, no more.
        state.number += 1;
        answer(&mut state, &done, second, Outcome::delivered(None));
        assert_eq!((state.busy, state.waiting), (0, 1));
        assert!(state.outcomes[1].is_none());
    }
}

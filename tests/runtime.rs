//! The dispatcher's runtime promises, each attacked the way it used to break:
//!
//! * a crash or a hung send holds only the sends that were in flight (a worker claims
//!   exactly what it sends at once), and nothing else is charged an attempt — a chunk
//!   that kills its process every time becomes a dead letter alone;
//! * a known outcome is durable before the next send starts, and survives a busy or
//!   full database (it is retried, not dropped);
//! * an adapter's panic is an ambiguous send, and the worker goes on;
//! * a dispatcher can be started again, and dropping a running async one stops it;
//! * a wake-up after the caller's commit reaches a dispatcher sleeping on a long poll.
//!
//! Real threads and processes; waits are bounded and poll a condition, never a clock.

mod common;

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use chunked_outbox::clock::ManualClock;
use chunked_outbox::dispatch::{DispatchStats, DispatcherBuilder, ShutdownReport};
use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::rules::{Backoff, ChannelPolicy, RetryPolicy};
use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome, Result,
};

type Script = dyn Fn(&Claim) -> Outcome + Send + Sync;

/// A platform answering from a script, for both flavours. Clones share everything.
#[derive(Clone)]
struct Scripted {
    script: Arc<Script>,
}

impl Scripted {
    fn new(script: impl Fn(&Claim) -> Outcome + Send + Sync + 'static) -> Self {
        Scripted {
            script: Arc::new(script),
        }
    }
}

impl ChannelAdapter for Scripted {
    fn send(&self, claim: &Claim) -> Outcome {
        (self.script)(claim)
    }
}

#[cfg(feature = "tokio")]
impl chunked_outbox::AsyncChannelAdapter for Scripted {
    fn send<'a>(&'a self, claim: &'a Claim) -> chunked_outbox::dispatch::SendFuture<'a, Outcome> {
        // The scripts block (gates, sleeps): keep them off the runtime's own threads.
        Box::pin(async move { tokio::task::block_in_place(|| (self.script)(claim)) })
    }
}

/// A gate sends wait at until it opens, counting the sends that reached it.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<(usize, bool)>, Condvar)>);

/// Opens its gate when dropped, so a test that fails while a send waits at the gate
/// does not leave that send (and the runtime that waits for it) stuck forever.
struct OpenOnDrop(Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl Gate {
    /// A gate, and the guard that opens it at the end of the test, however it ends.
    fn new() -> (Gate, OpenOnDrop) {
        let gate = Gate::default();
        (gate.clone(), OpenOnDrop(gate))
    }

    /// Waits at the gate until it opens — at most a minute, so that a failing test
    /// (whose runtime waits for this thread when it is dropped) cannot hang the run.
    fn pass(&self) {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        s.0 += 1;
        cv.notify_all();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !s.1 {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "the gate never opened");
            s = cv
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn wait_arrived(&self, n: usize) {
        let (lock, cv) = &*self.0;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "only {} of {n} sends reached the gate",
                s.0
            );
            s = cv
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn open(&self) {
        let (lock, cv) = &*self.0;
        lock.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        cv.notify_all();
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[derive(Clone, Copy, Debug)]
enum Flavour {
    Blocking,
    #[cfg(feature = "tokio")]
    Tokio,
}

/// Settings a test gives its dispatcher; `None` keeps the dispatcher's default (the
/// scenarios run on the defaults unless they need otherwise).
#[derive(Clone, Copy, Default)]
struct Tuning {
    workers: Option<usize>,
    batch: Option<usize>,
    poll: Option<Duration>,
    send_timeout: Option<Duration>,
}

impl Tuning {
    fn one_worker() -> Self {
        Tuning {
            workers: Some(1),
            ..Tuning::default()
        }
    }
}

fn tuned<A: ?Sized>(mut b: DispatcherBuilder<A>, t: Tuning) -> DispatcherBuilder<A> {
    if let Some(n) = t.workers {
        b = b.workers(n);
    }
    if let Some(n) = t.batch {
        b = b.batch_size(n);
    }
    b.poll_interval(t.poll.unwrap_or(Duration::from_millis(20)))
        .send_timeout(t.send_timeout)
}

/// A built dispatcher of either flavour, which can be started (again).
enum Built {
    Blocking(Dispatcher),
    #[cfg(feature = "tokio")]
    Tokio(
        chunked_outbox::AsyncDispatcher,
        Arc<tokio::runtime::Runtime>,
    ),
}

impl Built {
    fn new(flavour: Flavour, outbox: &Outbox, channel: &str, adapter: Scripted, t: Tuning) -> Self {
        match flavour {
            Flavour::Blocking => Built::Blocking(
                tuned(
                    Dispatcher::builder(outbox.clone()).adapter(channel, adapter),
                    t,
                )
                .build()
                .unwrap(),
            ),
            #[cfg(feature = "tokio")]
            Flavour::Tokio => {
                let builder = chunked_outbox::AsyncDispatcher::builder(outbox.clone());
                let dispatcher = tuned(builder.adapter(channel, adapter), t).build().unwrap();
                Built::Tokio(dispatcher, Arc::new(runtime()))
            }
        }
    }

    fn start(&self) -> Running {
        match self {
            Built::Blocking(d) => Running::Blocking(d.start().unwrap()),
            #[cfg(feature = "tokio")]
            Built::Tokio(d, rt) => {
                Running::Tokio(rt.block_on(async { d.start() }).unwrap(), rt.clone())
            }
        }
    }
}

/// A started dispatcher of either flavour.
enum Running {
    Blocking(chunked_outbox::dispatch::RunningDispatcher),
    #[cfg(feature = "tokio")]
    Tokio(
        chunked_outbox::dispatch::RunningAsyncDispatcher,
        Arc<tokio::runtime::Runtime>,
    ),
}

impl Running {
    fn start(
        flavour: Flavour,
        outbox: &Outbox,
        channel: &str,
        adapter: Scripted,
        t: Tuning,
    ) -> Self {
        Built::new(flavour, outbox, channel, adapter, t).start()
    }

    fn stats(&self) -> DispatchStats {
        match self {
            Running::Blocking(r) => r.stats(),
            #[cfg(feature = "tokio")]
            Running::Tokio(r, _) => r.stats(),
        }
    }

    fn shutdown(self) -> ShutdownReport {
        self.shutdown_within(Duration::from_secs(30))
    }

    /// The async flavour's runtime, to keep it alive (nothing for the blocking one).
    fn runtime(&self) -> Box<dyn std::any::Any> {
        match self {
            Running::Blocking(_) => Box::new(()),
            #[cfg(feature = "tokio")]
            Running::Tokio(_, rt) => Box::new(rt.clone()),
        }
    }

    fn shutdown_within(self, grace: Duration) -> ShutdownReport {
        match self {
            Running::Blocking(r) => r.shutdown(grace),
            #[cfg(feature = "tokio")]
            Running::Tokio(r, rt) => rt.block_on(r.shutdown(grace)),
        }
    }
}

#[cfg(feature = "tokio")]
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(3)
        .enable_all()
        .build()
        .unwrap()
}

fn file_db() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    (dir, path)
}

fn replies(outbox: &Outbox, channel: &str, n: usize) -> Vec<chunked_outbox::DeliveryId> {
    (0..n)
        .map(|i| {
            outbox
                .enqueue(&NewDelivery::single(
                    channel,
                    format!("chat-{i}"),
                    format!("reply {i}"),
                ))
                .unwrap()
                .id
        })
        .collect()
}

fn status(outbox: &Outbox, id: chunked_outbox::DeliveryId) -> DeliveryStatus {
    outbox.delivery(id).unwrap().unwrap().status
}

macro_rules! both_flavours {
    ($($scenario:ident),* $(,)?) => {
        mod blocking_flavour {
            $(#[test] fn $scenario() -> chunked_outbox::Result<()> { super::$scenario(super::Flavour::Blocking) })*
        }
        #[cfg(feature = "tokio")]
        mod tokio_flavour {
            $(#[test] fn $scenario() -> chunked_outbox::Result<()> { super::$scenario(super::Flavour::Tokio) })*
        }
    };
}

both_flavours!(
    a_send_slower_than_its_lease_keeps_it,
    a_hung_send_holds_only_its_own_chat,
    a_known_outcome_is_recorded_before_the_next_send_starts,
    a_busy_database_delays_an_outcome_but_never_drops_it,
    an_adapter_panic_is_an_ambiguous_send_and_the_worker_goes_on,
    a_replayed_poison_panic_fails_alone_and_every_other_chat_is_served,
    a_dispatcher_can_be_started_again_after_shutdown,
    a_wake_after_the_callers_commit_reaches_a_sleeping_dispatcher,
    crash_mid_send_leaves_only_that_send_uncertain,
    an_innocent_reply_in_flight_beside_a_poison_one_is_delivered,
    a_shutdown_that_outlasts_its_timeout_reports_the_stuck_send,
    a_worker_ended_by_a_panic_is_reported_at_shutdown,
);

/// Finding 1: one worker's hung send used to pin its whole claimed batch (up to 15 other
/// chats) in `sending` until the lease ended.
fn a_hung_send_holds_only_its_own_chat(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    replies(&outbox, "telegram", 8);
    let (gate, _open) = Gate::new();
    let g = gate.clone();
    let adapter = Scripted::new(move |_| {
        g.pass();
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::one_worker());
    gate.wait_arrived(1);
    let h = outbox.health()?;
    assert_eq!(
        (h.totals.sending_chunks, h.totals.due_chunks),
        (1, 7),
        "the hung send holds its own chat only; the others stay due for other workers"
    );
    gate.open();
    wait_until("all delivered", || {
        outbox.health().unwrap().totals.delivered_deliveries == 8
    });
    assert!(running.shutdown().clean);
    Ok(())
}

/// A live dispatcher keeps the leases of what it sends alive: a send that takes longer
/// than the lease is never recovered or claimed by anyone else meanwhile.
fn a_send_slower_than_its_lease_keeps_it(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let options = || OutboxOptions::default().with_lease(Duration::from_secs(2));
    let outbox = Outbox::open(&path, options())?;
    let other = Outbox::open(&path, options())?; // another process watching the file
    let ids = replies(&outbox, "telegram", 1);
    let adapter = Scripted::new(|_| {
        std::thread::sleep(Duration::from_secs(5));
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::one_worker());
    wait_until("the send started", || {
        outbox.health().unwrap().totals.sending_chunks == 1
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while status(&outbox, ids[0]) != DeliveryStatus::Delivered {
        assert!(
            Instant::now() < deadline,
            "the slow send was never recorded"
        );
        let r = other.recover(RecoverScope::ExpiredLeases)?;
        assert_eq!((r.retried, r.held_uncertain, r.failed), (0, 0, 0), "{r:?}");
        assert!(
            other.claim(10)?.is_empty(),
            "taken over while still being sent"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = running.shutdown();
    assert!(report.stats.renewed >= 2, "{:?}", report.stats);
    assert_eq!(report.stats.delivered, 1);
    Ok(())
}

/// Finding 2: group commit held a slow send's outcome until the next send returned, so
/// a crash during send k+1 lost the known outcome of send k.
fn a_known_outcome_is_recorded_before_the_next_send_starts(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let ids = replies(&outbox, "telegram", 2);
    let (gate, _open) = Gate::new();
    let g = gate.clone();
    let adapter = Scripted::new(move |claim| {
        if claim.chat_id == "chat-0" {
            std::thread::sleep(Duration::from_millis(20)); // a real round trip
        } else {
            g.pass();
        }
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::one_worker());
    gate.wait_arrived(1);
    assert_eq!(
        status(&outbox, ids[0]),
        DeliveryStatus::Delivered,
        "the first outcome is durable while the second send is still in flight"
    );
    gate.open();
    wait_until("the second delivered", || {
        status(&outbox, ids[1]) == DeliveryStatus::Delivered
    });
    assert!(running.shutdown().clean);
    Ok(())
}

/// Finding 3: `Busy` while recording dropped a known outcome ("its lease will settle
/// it"), so a chunk the platform accepted ended `uncertain`.
fn a_busy_database_delays_an_outcome_but_never_drops_it(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let options = || {
        OutboxOptions::default()
            .with_busy_timeout(Duration::from_millis(20))
            .with_lease(Duration::from_secs(5))
    };
    let outbox = Outbox::open(&path, options())?;
    let ids = replies(&outbox, "telegram", 1);
    let (gate, _open) = Gate::new();
    let g = gate.clone();
    let adapter = Scripted::new(move |_| {
        g.pass();
        Outcome::delivered(Some("m-1".into()))
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::default());
    gate.wait_arrived(1);
    // Another process takes the write lock while the send is in flight.
    let blocker = common::raw(&path);
    blocker.execute_batch("BEGIN IMMEDIATE")?;
    gate.open();
    wait_until("the record to meet the lock", || {
        running.stats().record_retries >= 2
    });
    blocker.execute_batch("COMMIT")?;
    wait_until("the outcome recorded", || {
        status(&outbox, ids[0]) == DeliveryStatus::Delivered
    });
    let report = running.shutdown();
    assert!(report.clean);
    assert_eq!((report.stats.delivered, report.stats.dropped), (1, 0));
    let view = outbox.delivery(ids[0])?.unwrap();
    assert_eq!(view.chunks[0].platform_message_id.as_deref(), Some("m-1"));
    assert_eq!(outbox.health()?.totals.uncertain_chunks, 0);
    Ok(())
}

/// Finding 3, the full disk: the record fails with `DiskFull` until room is made, and
/// the outcome is recorded then.
#[test]
fn a_full_database_delays_an_outcome_but_never_drops_it() -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(
        &path,
        OutboxOptions::default().with_max_size(Some(160 * 1024)),
    )?;
    // Two long replies: the first finalized fills `outbound_messages`' first page, so the
    // second one's history row needs a page of its own.
    let long = "lorem ipsum ".repeat(250);
    let ids: Vec<_> = (0..2)
        .map(|i| {
            let reply = NewDelivery::single("telegram", format!("chat-{i}"), format!("{i} {long}"));
            outbox.enqueue(&reply).unwrap().id
        })
        .collect();
    let (gate, _open) = Gate::new();
    let g = gate.clone();
    let adapter = Scripted::new(move |claim| {
        if claim.chat_id == "chat-1" {
            g.pass();
        }
        Outcome::delivered(None)
    });
    let running = Running::start(
        Flavour::Blocking,
        &outbox,
        "telegram",
        adapter,
        Tuning::one_worker(),
    );
    gate.wait_arrived(1);
    assert_eq!(status(&outbox, ids[0]), DeliveryStatus::Delivered);
    // Fill the file with replies to a channel nobody serves, until the cap refuses.
    for n in 0.. {
        match outbox.enqueue(&NewDelivery::single(
            "filler",
            format!("f{n}"),
            long.as_str(),
        )) {
            Ok(_) => {}
            Err(chunked_outbox::Error::DiskFull) => break,
            Err(e) => panic!("{e:?}"),
        }
    }
    gate.open();
    wait_until("the record to hit the full file", || {
        running.stats().record_retries >= 2
    });
    assert_eq!(status(&outbox, ids[1]), DeliveryStatus::Pending);
    // Room again: drop the filler (freed pages are reused at once).
    common::raw(&path).execute_batch(
        "DELETE FROM outbound_delivery_chunks WHERE delivery_id IN
             (SELECT id FROM outbound_deliveries WHERE channel = 'filler');
         DELETE FROM outbound_deliveries WHERE channel = 'filler';",
    )?;
    wait_until("the outcome recorded", || {
        status(&outbox, ids[1]) == DeliveryStatus::Delivered
    });
    let report = running.shutdown();
    assert!(report.clean);
    assert_eq!((report.stats.delivered, report.stats.dropped), (2, 0));
    Ok(())
}

fn fast_retries(max_attempts: u32) -> OutboxOptions {
    OutboxOptions::default().with_retry(
        RetryPolicy::default()
            .with_backoff(Backoff::Schedule(vec![Duration::from_millis(1)]))
            .with_max_attempts(max_attempts)
            .with_jitter(0.0),
    )
}

/// Finding 4: a panicking adapter killed its worker silently. Under `Hold`, the panicked
/// send is held `uncertain` (it may have been sent) and the worker serves the others.
fn an_adapter_panic_is_an_ambiguous_send_and_the_worker_goes_on(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, fast_retries(3))?;
    let ids = replies(&outbox, "telegram", 6);
    let adapter = Scripted::new(|claim| {
        if claim.chat_id == "chat-0" {
            panic!("adapter bug on {}", claim.chat_id);
        }
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::default());
    // Both, not only the others: on a loaded machine the worker holding chat-0 may not
    // have sent it yet when the others are done, and a shutdown gives it back unsent.
    wait_until("the other chats served and the panic recorded", || {
        outbox.health().unwrap().totals.delivered_deliveries == 5
            && status(&outbox, ids[0]) == DeliveryStatus::Uncertain
    });
    let report = running.shutdown();
    assert!(report.clean, "{report:?}");
    assert_eq!(report.workers_lost, 0);
    assert_eq!(report.stats.panics, 1);
    let view = outbox.delivery(ids[0])?.unwrap();
    assert_eq!(view.chunks[0].status, ChunkStatus::Uncertain);
    assert!(
        view.chunks[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("adapter bug on chat-0"),
        "{:?}",
        view.chunks[0].last_error
    );
    Ok(())
}

/// Finding 4 on a `Replay` channel: one poison message used to kill every worker in
/// turn. Now each panic is a retried ambiguous send until its attempts run out, and
/// both workers go on serving the other chats.
fn a_replayed_poison_panic_fails_alone_and_every_other_chat_is_served(
    flavour: Flavour,
) -> Result<()> {
    let (_dir, path) = file_db();
    let options = fast_retries(3).with_channel("discord", ChannelPolicy::replayable());
    let outbox = Outbox::open(&path, options)?;
    let ids = replies(&outbox, "discord", 12);
    let adapter = Scripted::new(|claim| {
        if claim.chat_id == "chat-3" {
            panic!("poison");
        }
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "discord", adapter, Tuning::default());
    wait_until("everything settled", || {
        let t = outbox.health().unwrap().totals;
        t.delivered_deliveries == 11 && t.failed_deliveries == 1
    });
    let report = running.shutdown();
    assert!(report.clean, "{report:?}");
    assert_eq!(
        report.stats.panics, 3,
        "one per attempt of the poison chunk"
    );
    let poison = outbox.delivery(ids[3])?.unwrap();
    assert_eq!(
        (poison.status, poison.chunks[0].attempts),
        (DeliveryStatus::Failed, 3)
    );
    Ok(())
}

/// Finding 7: a dispatcher could not be started again after `shutdown`.
fn a_dispatcher_can_be_started_again_after_shutdown(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let adapter = Scripted::new(|_| Outcome::delivered(None));
    let dispatcher = Built::new(flavour, &outbox, "telegram", adapter, Tuning::default());
    for round in 1..=3 {
        let running = dispatcher.start();
        let id = outbox
            .enqueue(&NewDelivery::single(
                "telegram",
                "c",
                format!("round {round}"),
            ))?
            .id;
        wait_until("the reply of this round", || {
            status(&outbox, id) == DeliveryStatus::Delivered
        });
        assert!(running.shutdown().clean);
    }
    Ok(())
}

/// A shutdown waits at most its timeout: a send still inside the adapter then is
/// reported, not waited for, and its worker records the outcome once `send` returns.
fn a_shutdown_that_outlasts_its_timeout_reports_the_stuck_send(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let id = replies(&outbox, "telegram", 1)[0];
    let (gate, _open) = Gate::new();
    let g = gate.clone();
    let adapter = Scripted::new(move |_| {
        g.pass();
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::one_worker());
    gate.wait_arrived(1);
    // The async worker lives on in its runtime after the shutdown gave up on it.
    let _runtime = running.runtime();
    let report = running.shutdown_within(Duration::from_millis(50));
    assert_eq!(
        (report.clean, report.still_sending, report.workers_lost),
        (false, 1, 0),
        "{report:?}"
    );
    gate.open();
    wait_until("the late outcome recorded", || {
        status(&outbox, id) == DeliveryStatus::Delivered
    });
    Ok(())
}

/// A send that outlives the send timeout is recorded as ambiguous and the worker goes
/// on; when that send returns at last, its answer is not taken for the next send's.
/// (Blocking only: an async send past its timeout is dropped, so it never answers; see
/// `tests/dispatch.rs`.)
#[test]
fn a_send_past_its_timeout_is_ambiguous_and_its_late_answer_is_ignored() -> Result<()> {
    let flavour = Flavour::Blocking;
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let ids = replies(&outbox, "telegram", 2);
    let (gate, _open) = Gate::new();
    let returned = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (g, r, late) = (gate.clone(), returned.clone(), ids[0]);
    let adapter = Scripted::new(move |claim| {
        if claim.delivery_id == late {
            // Hangs past its timeout, then is accepted after all: too late to count.
            g.pass();
            r.store(true, std::sync::atomic::Ordering::SeqCst);
            Outcome::delivered(None)
        } else {
            // The next send answers only once the late one has returned.
            g.open();
            wait_until("the late send's return", || {
                r.load(std::sync::atomic::Ordering::SeqCst)
            });
            Outcome::Permanent {
                error: "chat not found".into(),
            }
        }
    });
    let tuning = Tuning {
        send_timeout: Some(Duration::from_secs(1)),
        ..Tuning::one_worker()
    };
    let running = Running::start(flavour, &outbox, "telegram", adapter, tuning);
    wait_until("both settled", || {
        status(&outbox, ids[1]) == DeliveryStatus::Failed
            || status(&outbox, ids[1]) == DeliveryStatus::Delivered
    });
    assert_eq!(
        (status(&outbox, ids[0]), status(&outbox, ids[1])),
        (DeliveryStatus::Uncertain, DeliveryStatus::Failed),
        "the timed-out send is held uncertain; the next keeps its own answer"
    );
    let report = running.shutdown();
    assert_eq!(report.stats.timed_out, 1, "{report:?}");
    assert!(report.clean, "{report:?}");
    Ok(())
}

/// A clock that panics once armed: the one user code a worker calls outside `send`.
#[derive(Debug, Default)]
struct ArmedClock(std::sync::atomic::AtomicBool);

impl chunked_outbox::clock::Clock for ArmedClock {
    fn now_ms(&self) -> i64 {
        if self.0.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("the clock broke");
        }
        chunked_outbox::clock::SystemClock.now_ms()
    }
}

/// A worker killed by a panic outside the adapter (here, in the application's clock)
/// is not a clean shutdown: the report counts it.
fn a_worker_ended_by_a_panic_is_reported_at_shutdown(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let clock = Arc::new(ArmedClock::default());
    let outbox = Outbox::open(&path, OutboxOptions::default().with_clock(clock.clone()))?;
    let (gate, _open) = Gate::new();
    let g = gate.clone();
    let adapter = Scripted::new(move |_| {
        g.pass();
        Outcome::delivered(None)
    });
    let running = Running::start(flavour, &outbox, "telegram", adapter, Tuning::one_worker());
    replies(&outbox, "telegram", 1);
    gate.wait_arrived(1);
    // Armed while the worker is inside `send`: recording the outcome panics, whether or
    // not the shutdown has begun by then.
    clock.0.store(true, std::sync::atomic::Ordering::SeqCst);
    gate.open();
    let report = running.shutdown();
    clock.0.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        (report.clean, report.still_sending, report.workers_lost),
        (false, 0, 1),
        "{report:?}"
    );
    Ok(())
}

/// Finding 8: `enqueue_in` woke the dispatcher before the caller committed, so the
/// wake-up found nothing and the reply waited for the next poll. `Outbox::wake` after
/// the commit reaches a dispatcher that sleeps on an hour-long poll.
fn a_wake_after_the_callers_commit_reaches_a_sleeping_dispatcher(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let adapter = Scripted::new(|_| Outcome::delivered(None));
    let tuning = Tuning {
        poll: Some(Duration::from_secs(3600)),
        ..Tuning::default()
    };
    let running = Running::start(flavour, &outbox, "telegram", adapter, tuning);
    let mut app = common::raw(&path);
    for n in 0..5 {
        let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let id = outbox
            .enqueue_in(&tx, &NewDelivery::single("telegram", format!("c{n}"), "hi"))?
            .id;
        tx.commit()?;
        outbox.wake();
        wait_until("the committed reply sent", || {
            status(&outbox, id) == DeliveryStatus::Delivered
        });
    }
    assert!(running.shutdown().clean);
    Ok(())
}

// ---- Crashes: a real child process is killed mid-send ----

/// Set in a child process: the outbox file, the flavour, and the file the child
/// creates once its second send is in flight.
const CHILD_DB: &str = "CHUNKED_OUTBOX_RUNTIME_DB";
const CHILD_FLAVOUR: &str = "CHUNKED_OUTBOX_RUNTIME_FLAVOUR";
const CHILD_MARK: &str = "CHUNKED_OUTBOX_RUNTIME_MARK";
const CHILD_MODE: &str = "CHUNKED_OUTBOX_RUNTIME_MODE";

/// Runs this test binary's `child_process` test as a child with `env`.
fn spawn_child(env: &[(&str, &str)]) -> std::process::Child {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "child_process", "--nocapture"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(std::process::Stdio::null());
    cmd.spawn().expect("spawn child")
}

/// The child side of the crash tests (see `CHILD_MODE`):
/// * `hang`: delivers its first send, marks the second as started and hangs in it;
/// * `poison`: recovers what a killed predecessor left, then dispatches until nothing
///   is due; sending to chat `poison` aborts the process, like a crash in the adapter.
/// * `beside`: as `poison`, with two workers and other sends that take 200 ms.
#[test]
#[ignore = "run as a child process by the crash tests"]
fn child_process() {
    let Ok(db) = std::env::var(CHILD_DB) else {
        return;
    };
    let flavour = match std::env::var(CHILD_FLAVOUR).as_deref() {
        #[cfg(feature = "tokio")]
        Ok("tokio") => Flavour::Tokio,
        _ => Flavour::Blocking,
    };
    let mode = std::env::var(CHILD_MODE).unwrap();
    let outbox = Outbox::open(&db, child_options(&mode)).unwrap();
    let adapter = if mode == "hang" {
        let mark = std::env::var(CHILD_MARK).unwrap();
        let sends = Arc::new(Mutex::new(0));
        Scripted::new(move |_| {
            let mut n = sends.lock().unwrap();
            *n += 1;
            if *n >= 2 {
                std::fs::write(&mark, b"in flight").unwrap();
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            Outcome::delivered(None)
        })
    } else {
        outbox.recover(RecoverScope::AllSending).unwrap();
        // `beside`: the other replies take 200 ms, so one is in flight when the poison
        // send starts on the other worker.
        let slow = mode == "beside";
        Scripted::new(move |claim| {
            if claim.chat_id == "poison" {
                std::process::abort();
            }
            if slow {
                std::thread::sleep(Duration::from_millis(200));
            }
            Outcome::delivered(None)
        })
    };
    let tuning = if mode == "beside" {
        Tuning::default() // two workers, one send each
    } else {
        Tuning::one_worker()
    };
    let running = Running::start(flavour, &outbox, "telegram", adapter, tuning);
    wait_until("nothing left to send", || {
        let t = outbox.health().unwrap().totals;
        t.pending_chunks + t.retry_chunks + t.sending_chunks == 0
    });
    assert!(running.shutdown().clean);
}

/// The rules of a crash test's file, which the test creates and its child opens: in
/// `poison` mode Telegram replays (so the poison chunk is retried until its attempts run
/// out), in `hang` mode it holds (so a possibly-sent chunk is held `uncertain`).
fn child_options(mode: &str) -> OutboxOptions {
    let options = fast_retries(3);
    if mode == "poison" || mode == "beside" {
        options.with_channel("telegram", ChannelPolicy::replayable())
    } else {
        options
    }
}

fn flavour_name(flavour: Flavour) -> &'static str {
    match flavour {
        Flavour::Blocking => "blocking",
        #[cfg(feature = "tokio")]
        Flavour::Tokio => "tokio",
    }
}

/// An outbox handle on `path` whose clock stands an hour ahead, so every lease the
/// killed child held has run out.
fn after_the_leases(path: &Path) -> Outbox {
    let ahead = chrono::Utc::now().timestamp_millis() + 3_600_000;
    Outbox::open(
        path,
        OutboxOptions::default().with_clock(Arc::new(ManualClock::new(ahead))),
    )
    .unwrap()
}

/// Findings 1 and 2: a crash during the first send of a batch left the whole batch
/// `uncertain` under `Hold` (8 chats held for 1 send that started), and the known
/// outcome of the previous send was lost with it. Now exactly the send in flight is
/// held, the one before it is delivered, and the six never claimed are due.
fn crash_mid_send_leaves_only_that_send_uncertain(flavour: Flavour) -> Result<()> {
    let (dir, path) = file_db();
    let outbox = Outbox::open(&path, child_options("hang"))?;
    replies(&outbox, "telegram", 8);
    let mark = dir.path().join("in-flight");
    let mut child = spawn_child(&[
        (CHILD_DB, path.to_str().unwrap()),
        (CHILD_FLAVOUR, flavour_name(flavour)),
        (CHILD_MARK, mark.to_str().unwrap()),
        (CHILD_MODE, "hang"),
    ]);
    wait_until("the child's second send", || mark.exists());
    child.kill().unwrap(); // SIGKILL: no chance to record or release anything
    child.wait().unwrap();

    let later = after_the_leases(&path);
    let report = later.recover(RecoverScope::ExpiredLeases)?;
    assert_eq!(report.held_uncertain, 1, "{report:?}");
    let t = later.health()?.totals;
    assert_eq!(
        (t.delivered_deliveries, t.uncertain_chunks, t.due_chunks),
        (1, 1, 6)
    );
    Ok(())
}

/// Finding 5: a chunk that crashes its worker every time also turned the unstarted
/// chunks claimed with it into dead letters (3 of 3 innocent replies in a batch of 4).
/// Now only the chunk whose send was in progress is charged: it fails after its three
/// attempts (three crashes), and the innocent replies are delivered.
#[test]
fn a_poison_chunk_that_kills_its_process_fails_alone() -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, child_options("poison"))?;
    let poison = outbox
        .enqueue(&NewDelivery::single(
            "telegram",
            "poison",
            "kills the adapter",
        ))?
        .id;
    let innocent = replies(&outbox, "telegram", 3);
    let mut crashes = 0;
    for _ in 0..10 {
        let status = spawn_child(&[(CHILD_DB, path.to_str().unwrap()), (CHILD_MODE, "poison")])
            .wait()
            .unwrap();
        if status.success() {
            break;
        }
        crashes += 1;
    }
    assert_eq!(crashes, 3, "one crash per attempt of the poison chunk");
    let v = outbox.delivery(poison)?.unwrap();
    assert_eq!(
        (v.status, v.chunks[0].attempts),
        (DeliveryStatus::Failed, 3)
    );
    for id in innocent {
        let v = outbox.delivery(id)?.unwrap();
        assert_eq!(
            (v.status, v.chunks[0].attempts),
            (DeliveryStatus::Delivered, 1),
            "an innocent reply is charged only its own send"
        );
    }
    Ok(())
}

/// Item 8 of the review: with two workers, an innocent reply in flight when a poison
/// send crashed the process was re-claimed beside the poison after every restart and
/// charged at every crash, until it was a dead letter although it never crashed
/// anything. A chunk whose lease ran out is now sent alone: the innocent reply is
/// delivered, and only the poison chunk, in flight at every crash, runs out.
fn an_innocent_reply_in_flight_beside_a_poison_one_is_delivered(flavour: Flavour) -> Result<()> {
    let (_dir, path) = file_db();
    let outbox = Outbox::open(&path, child_options("beside"))?;
    let innocent = outbox
        .enqueue(&NewDelivery::single("telegram", "chat-0", "innocent"))?
        .id;
    let poison = outbox
        .enqueue(&NewDelivery::single(
            "telegram",
            "poison",
            "kills the adapter",
        ))?
        .id;
    let mut crashes = 0;
    for _ in 0..10 {
        let status = spawn_child(&[
            (CHILD_DB, path.to_str().unwrap()),
            (CHILD_FLAVOUR, flavour_name(flavour)),
            (CHILD_MODE, "beside"),
        ])
        .wait()
        .unwrap();
        if status.success() {
            break;
        }
        crashes += 1;
    }
    let v = outbox.delivery(innocent)?.unwrap();
    assert_eq!(v.status, DeliveryStatus::Delivered, "{v:?}");
    assert!(v.chunks[0].attempts <= 2, "{v:?}");
    let v = outbox.delivery(poison)?.unwrap();
    assert_eq!(
        (v.status, v.chunks[0].attempts),
        (DeliveryStatus::Failed, 3)
    );
    assert_eq!(crashes, 3, "one crash per attempt of the poison chunk");
    Ok(())
}

// ---- Dropping a running async dispatcher ----

mod dropped {
    use super::*;

    /// Signals when the dispatcher lets go of its adapter: after its last task ended.
    struct Dropped(std::sync::mpsc::Sender<()>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    struct Tracked(Scripted, #[allow(dead_code)] Dropped);

    #[cfg(feature = "tokio")]
    impl chunked_outbox::AsyncChannelAdapter for Tracked {
        fn send<'a>(
            &'a self,
            claim: &'a Claim,
        ) -> chunked_outbox::dispatch::SendFuture<'a, Outcome> {
            chunked_outbox::AsyncChannelAdapter::send(&self.0, claim)
        }
    }

    impl ChannelAdapter for Tracked {
        fn send(&self, claim: &Claim) -> Outcome {
            ChannelAdapter::send(&self.0, claim)
        }
    }

    /// An adapter whose sends wait at a gate and deliver, and the receiver that hears
    /// when the dispatcher has let go of it.
    fn gated_and_tracked() -> (Gate, OpenOnDrop, Tracked, std::sync::mpsc::Receiver<()>) {
        let (gate, open) = Gate::new();
        let g = gate.clone();
        let (tx, released) = std::sync::mpsc::channel();
        let adapter = Tracked(
            Scripted::new(move |_| {
                g.pass();
                Outcome::delivered(None)
            }),
            Dropped(tx),
        );
        (gate, open, adapter, released)
    }

    /// Dropping a running blocking dispatcher stops it as `shutdown` does: the send in
    /// flight finishes and is recorded, and the workers end (letting go of the adapter).
    /// The drop waits for the send, so the gate opens beside it, possibly before the
    /// workers are told to stop: how many replies went out by then is not checked.
    #[test]
    fn dropping_a_running_dispatcher_stops_its_workers() -> Result<()> {
        let (_dir, path) = file_db();
        let outbox = Outbox::open(&path, OutboxOptions::default())?;
        replies(&outbox, "telegram", 3);
        let (gate, _open, adapter, released) = gated_and_tracked();
        let dispatcher = Dispatcher::builder(outbox.clone())
            .adapter("telegram", adapter)
            .workers(1)
            .build()?;
        let running = dispatcher.start()?;
        gate.wait_arrived(1);
        let dropping = std::thread::spawn(move || drop(running));
        gate.open();
        dropping.join().unwrap();
        drop(dispatcher);
        released
            .recv_timeout(Duration::from_secs(60))
            .expect("the workers ended and let go of the adapter");
        assert_eq!(outbox.health()?.totals.sending_chunks, 0);
        Ok(())
    }

    /// Finding 7: dropping a running async dispatcher left its tasks running. Dropping
    /// it now stops them: the send in flight finishes and is recorded, the tasks end
    /// (and let go of the adapter), and nothing else is sent.
    #[test]
    #[cfg(feature = "tokio")]
    fn dropping_a_running_async_dispatcher_stops_its_tasks() -> Result<()> {
        let (_dir, path) = file_db();
        let outbox = Outbox::open(&path, OutboxOptions::default())?;
        let ids = replies(&outbox, "telegram", 3);
        let (gate, _open, adapter, released) = gated_and_tracked();
        let rt = runtime();
        let dispatcher = chunked_outbox::AsyncDispatcher::builder(outbox.clone())
            .adapter("telegram", adapter)
            .workers(1)
            .build()?;
        let running = rt.block_on(async { dispatcher.start() })?;
        gate.wait_arrived(1);
        drop(running);
        drop(dispatcher);
        gate.open();
        released
            .recv_timeout(Duration::from_secs(60))
            .expect("the dispatcher's tasks ended and let go of the adapter");
        let delivered: Vec<_> = ids
            .iter()
            .filter(|id| status(&outbox, **id) == DeliveryStatus::Delivered)
            .collect();
        assert_eq!(
            delivered.len(),
            1,
            "the send in flight, and nothing after it"
        );
        assert_eq!(outbox.health()?.totals.sending_chunks, 0);
        Ok(())
    }
}

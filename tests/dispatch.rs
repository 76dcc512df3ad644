//! The dispatchers against a fake platform that records what it received: lane order
//! under random transient failures, dead letters without further attempts, ambiguous
//! sends per replay policy, rate limits that pause only their lane, pacing checked on
//! the injected clock, graceful shutdown, unregistered channels, and two dispatchers —
//! threads and processes — on one file never sending a chunk twice.
//!
//! Every behavioural scenario runs against the blocking [`Dispatcher`] and, with the
//! `tokio` feature, the [`AsyncDispatcher`], through the same `Flavour` interface.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::dispatch::{DispatchEvent, DispatchStats};
use chunked_outbox::rules::ChannelPolicy;
use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome, Result,
};
use common::*;

/// What the fake platform received: one entry per send it accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Received {
    channel: String,
    chat: String,
    text: String,
    key: String,
    at_ms: i64,
}

type Script = dyn Fn(&Claim) -> Outcome + Send + Sync;

/// A platform whose answers come from a script; it logs every send attempt and every
/// accepted chunk, stamped with the outbox's (manual) clock.
#[derive(Clone)]
struct Platform {
    clock: chunked_outbox::clock::ManualClock,
    script: Arc<Script>,
    attempts: Arc<Mutex<Vec<String>>>,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Platform {
    fn new(db: &TestDb, script: impl Fn(&Claim) -> Outcome + Send + Sync + 'static) -> Self {
        Platform {
            clock: db.clock.clone(),
            script: Arc::new(script),
            attempts: Arc::default(),
            received: Arc::default(),
        }
    }

    fn always_ok(db: &TestDb) -> Self {
        Platform::new(db, |_| Outcome::delivered(None))
    }

    fn answer(&self, claim: &Claim) -> Outcome {
        self.attempts
            .lock()
            .unwrap()
            .push(claim.idempotency_key.clone());
        let outcome = (self.script)(claim);
        if matches!(outcome, Outcome::Delivered { .. }) {
            self.received.lock().unwrap().push(Received {
                channel: claim.channel.clone(),
                chat: claim.chat_id.clone(),
                text: claim.text.clone(),
                key: claim.idempotency_key.clone(),
                at_ms: chunked_outbox::clock::Clock::now_ms(&self.clock),
            });
        }
        outcome
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    fn attempts_for(&self, key: &str) -> usize {
        self.attempts
            .lock()
            .unwrap()
            .iter()
            .filter(|k| *k == key)
            .count()
    }
}

impl ChannelAdapter for Platform {
    fn send(&self, claim: &Claim) -> Outcome {
        self.answer(claim)
    }
}

#[cfg(feature = "tokio")]
impl chunked_outbox::AsyncChannelAdapter for Platform {
    fn send<'a>(&'a self, claim: &'a Claim) -> chunked_outbox::dispatch::SendFuture<'a, Outcome> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.answer(claim)
        })
    }
}

/// One dispatcher flavour, driven one round at a time.
trait Flavour: Sized {
    fn build(outbox: Outbox, adapters: Vec<(&str, Platform)>) -> Self {
        Self::build_reporting(outbox, adapters, None)
    }
    fn build_reporting(
        outbox: Outbox,
        adapters: Vec<(&str, Platform)>,
        events: Option<Events>,
    ) -> Self;
    fn run_once(&self) -> usize;
    fn stats(&self) -> DispatchStats;
    fn debug(&self) -> String;
}

struct Blocking(Dispatcher);

/// The events a dispatcher reported, in order.
type Events = Arc<Mutex<Vec<DispatchEvent>>>;

fn record_into(events: Events) -> impl Fn(&DispatchEvent) + Send + Sync + 'static {
    move |e| events.lock().unwrap().push(e.clone())
}

impl Flavour for Blocking {
    fn build_reporting(
        outbox: Outbox,
        adapters: Vec<(&str, Platform)>,
        events: Option<Events>,
    ) -> Self {
        let mut b = Dispatcher::builder(outbox).batch_size(8);
        for (name, p) in adapters {
            b = b.adapter(name, p);
        }
        if let Some(events) = events {
            b = b.on_event(record_into(events));
        }
        Blocking(b.build().expect("build dispatcher"))
    }
    fn run_once(&self) -> usize {
        self.0.run_once().expect("run_once")
    }
    fn stats(&self) -> DispatchStats {
        self.0.stats()
    }
    fn debug(&self) -> String {
        format!("{:?}", self.0)
    }
}

#[cfg(feature = "tokio")]
struct Async(chunked_outbox::AsyncDispatcher, tokio::runtime::Runtime);

#[cfg(feature = "tokio")]
impl Flavour for Async {
    fn build_reporting(
        outbox: Outbox,
        adapters: Vec<(&str, Platform)>,
        events: Option<Events>,
    ) -> Self {
        let mut b = chunked_outbox::AsyncDispatcher::builder(outbox).batch_size(8);
        for (name, p) in adapters {
            b = b.adapter(name, p);
        }
        if let Some(events) = events {
            b = b.on_event(record_into(events));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Async(b.build().expect("build dispatcher"), rt)
    }
    fn run_once(&self) -> usize {
        self.1.block_on(self.0.run_once()).expect("run_once")
    }
    fn stats(&self) -> DispatchStats {
        self.0.stats()
    }
    fn debug(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// Runs rounds, moving the manual clock 1 s whenever nothing is due, until `rounds` idle
/// seconds passed in a row.
fn drain(db: &TestDb, d: &impl Flavour, idle_limit: u32) {
    let mut idle = 0;
    while idle < idle_limit {
        if d.run_once() == 0 {
            idle += 1;
            db.advance(Duration::from_secs(1));
        } else {
            idle = 0;
        }
    }
}

fn lane_order_under_random_transient_failures<F: Flavour>() -> Result<()> {
    // Enough attempts that 30 % failures never exhaust a chunk (that would be a dead
    // letter, and the lane would rightly move on without it).
    let db = TestDb::new(
        OutboxOptions::default()
            .with_retry(chunked_outbox::rules::RetryPolicy::default().with_max_attempts(100)),
    );
    let rng = Mutex::new(fastrand::Rng::with_seed(42));
    let platform = Platform::new(&db, move |_| {
        if rng.lock().unwrap().u8(0..100) < 30 {
            Outcome::Transient {
                error: "HTTP 503".into(),
            }
        } else {
            Outcome::delivered(None)
        }
    });
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for n in 0..60 {
        let chat = format!("chat-{}", n % 4);
        let parts: Vec<String> = (0..3).map(|i| format!("m{n}.{i}")).collect();
        expected
            .entry(chat.clone())
            .or_default()
            .extend(parts.clone());
        let _ = db.outbox.enqueue(&NewDelivery::chunked(
            "telegram",
            chat,
            parts.join(" "),
            parts,
        ))?;
    }
    let d = F::build(db.outbox.clone(), vec![("telegram", platform.clone())]);
    drain(&db, &d, 700);
    assert_eq!(db.outbox.health()?.totals.failed_deliveries, 0);
    let mut got: HashMap<String, Vec<String>> = HashMap::new();
    for r in platform.received() {
        got.entry(r.chat).or_default().push(r.text);
    }
    assert_eq!(got, expected, "every chunk arrived once, in lane order");
    assert_eq!(db.outbox.health()?.totals.delivered_deliveries, 60);
    Ok(())
}

fn permanent_failure_is_a_dead_letter_without_more_attempts<F: Flavour>() -> Result<()> {
    let db = TestDb::default();
    let platform = Platform::new(&db, |c| {
        if c.chat_id == "gone" {
            Outcome::Permanent {
                error: "Forbidden: bot was blocked by the user".into(),
            }
        } else {
            Outcome::delivered(None)
        }
    });
    let dead = enqueue(&db.outbox, "gone", &["hello?"]);
    let _ = enqueue(&db.outbox, "here", &["hi"]);
    let d = F::build(db.outbox.clone(), vec![("telegram", platform.clone())]);
    drain(&db, &d, 900);
    assert_eq!(platform.attempts_for(&format!("{dead}:1")), 1);
    let h = db.outbox.health()?;
    assert_eq!(
        (h.totals.failed_deliveries, h.totals.delivered_deliveries),
        (1, 1)
    );
    Ok(())
}

fn ambiguous_holds_or_replays_by_policy<F: Flavour>() -> Result<()> {
    let db =
        TestDb::new(OutboxOptions::default().with_channel("matrix", ChannelPolicy::replayable()));
    let first_try = |c: &Claim| {
        if c.attempt == 1 {
            Outcome::Ambiguous {
                error: "timeout after the request was written".into(),
            }
        } else {
            Outcome::delivered(None)
        }
    };
    let telegram = Platform::new(&db, first_try);
    let matrix = Platform::new(&db, first_try);
    let held = enqueue(&db.outbox, "t", &["x"]);
    let replayed = db
        .outbox
        .enqueue(&NewDelivery::single("matrix", "!r", "y"))?
        .id;
    let d = F::build(
        db.outbox.clone(),
        vec![("telegram", telegram.clone()), ("matrix", matrix.clone())],
    );
    drain(&db, &d, 60);
    assert_eq!(
        telegram.attempts_for(&format!("{held}:1")),
        1,
        "no blind replay"
    );
    assert_eq!(
        view(&db.outbox, held).chunks[0].status,
        chunked_outbox::monitoring::ChunkStatus::Uncertain
    );
    assert_eq!(
        matrix.attempts_for(&format!("{replayed}:1")),
        2,
        "replayed with the same key"
    );
    assert_eq!(
        view(&db.outbox, replayed).status,
        chunked_outbox::monitoring::DeliveryStatus::Delivered
    );
    Ok(())
}

fn rate_limit_pauses_only_its_lane<F: Flavour>() -> Result<()> {
    let db = TestDb::default();
    let limited = Arc::new(Mutex::new(false));
    let flag = limited.clone();
    let platform = Platform::new(&db, move |c| {
        let mut done = flag.lock().unwrap();
        if c.chat_id == "slow" && !*done {
            *done = true;
            Outcome::RateLimited {
                retry_after: Duration::from_secs(30),
                error: "429".into(),
            }
        } else {
            Outcome::delivered(None)
        }
    });
    let _ = enqueue(&db.outbox, "slow", &["s1", "s2"]);
    for i in 0..5 {
        let _ = enqueue(&db.outbox, "fast", &[&format!("f{i}")]);
    }
    let d = F::build(db.outbox.clone(), vec![("telegram", platform.clone())]);
    drain(&db, &d, 60);
    let received = platform.received();
    let fast_done = received
        .iter()
        .filter(|r| r.chat == "fast")
        .map(|r| r.at_ms)
        .max()
        .unwrap();
    let slow: Vec<_> = received.iter().filter(|r| r.chat == "slow").collect();
    assert_eq!(slow.len(), 2);
    assert!(
        fast_done < T0 + 30_000,
        "the other lane kept flowing during the pause"
    );
    assert!(
        slow[0].at_ms >= T0 + 30_000,
        "the paused lane waited for retry_after"
    );
    Ok(())
}

fn pacing_holds_at_every_chunk_boundary<F: Flavour>() -> Result<()> {
    let rules = ChannelPolicy::default()
        .with_lane_interval(Duration::from_secs(2))
        .with_channel_interval(Duration::from_secs(1));
    let db = TestDb::new(OutboxOptions::default().with_channel("telegram", rules));
    let rng = Mutex::new(fastrand::Rng::with_seed(3));
    let platform = Platform::new(&db, move |_| {
        if rng.lock().unwrap().u8(0..100) < 25 {
            Outcome::Transient {
                error: "503".into(),
            }
        } else {
            Outcome::delivered(None)
        }
    });
    for n in 0..6 {
        let _ = enqueue(&db.outbox, &format!("c{}", n % 2), &["a", "b"]);
    }
    let d = F::build(db.outbox.clone(), vec![("telegram", platform.clone())]);
    // Smaller clock steps, so a violation could show.
    let mut idle = 0;
    while idle < 2_000 {
        if d.run_once() == 0 {
            idle += 1;
            db.advance(Duration::from_millis(250));
        } else {
            idle = 0;
        }
    }
    let received = platform.received();
    assert_eq!(received.len(), 12);
    let mut by_chat: HashMap<&str, Vec<i64>> = HashMap::new();
    for r in &received {
        by_chat.entry(&r.chat).or_default().push(r.at_ms);
    }
    for times in by_chat.values() {
        assert!(
            times.windows(2).all(|w| w[1] - w[0] >= 2_000),
            "lane interval broken: {times:?}"
        );
    }
    let all: Vec<i64> = received.iter().map(|r| r.at_ms).collect();
    assert!(
        all.windows(2).all(|w| w[1] - w[0] >= 1_000),
        "channel interval broken: {all:?}"
    );
    Ok(())
}

fn unregistered_channel_stays_due<F: Flavour>() -> Result<()> {
    let db = TestDb::default();
    let _ = db
        .outbox
        .enqueue(&NewDelivery::single("irc", "#chan", "hello"))?;
    let d = F::build(
        db.outbox.clone(),
        vec![("telegram", Platform::always_ok(&db))],
    );
    assert_eq!(d.run_once(), 0);
    let h = db.outbox.health()?;
    assert_eq!(h.channels["irc"].due_chunks, 1);
    assert_eq!(h.channels["irc"].sending_chunks, 0);
    Ok(())
}

macro_rules! both_flavours {
    ($($scenario:ident),* $(,)?) => {
        mod blocking_flavour {
            $(#[test] fn $scenario() -> chunked_outbox::Result<()> { super::$scenario::<super::Blocking>() })*
        }
        #[cfg(feature = "tokio")]
        mod tokio_flavour {
            $(#[test] fn $scenario() -> chunked_outbox::Result<()> { super::$scenario::<super::Async>() })*
        }
    };
}

/// A platform that answers by chat: "gone" fails for good, "unsure" is ambiguous,
/// "flaky" fails once and then delivers, and every other chat gets message id
/// `p-{index}`.
fn mixed_platform(db: &TestDb) -> Platform {
    let flaky = Arc::new(std::sync::atomic::AtomicBool::new(true));
    Platform::new(db, move |c| match c.chat_id.as_str() {
        "gone" => Outcome::Permanent {
            error: "Forbidden: bot was blocked by the user".into(),
        },
        "unsure" => Outcome::Ambiguous {
            error: "connection reset".into(),
        },
        "flaky" if flaky.swap(false, std::sync::atomic::Ordering::SeqCst) => Outcome::Transient {
            error: "502".into(),
        },
        _ => Outcome::delivered(Some(format!("p-{}", c.index))),
    })
}

fn stats_count_every_send_and_outcome<F: Flavour>() -> Result<()> {
    let db = TestDb::default();
    let platform = mixed_platform(&db);
    enqueue(&db.outbox, "ok", &["one", "two"]);
    for chat in ["gone", "unsure", "flaky"] {
        enqueue(&db.outbox, chat, &["x"]);
    }
    let d = F::build(db.outbox.clone(), vec![("telegram", platform.clone())]);
    drain(&db, &d, 900);
    let s = d.stats();
    let counted = (
        s.sent,
        s.delivered,
        s.finalized,
        s.retried,
        s.failed,
        s.uncertain,
    );
    assert_eq!(counted, (6, 3, 2, 1, 1, 1), "{s:?}");
    assert_eq!((s.released, s.errors, s.dropped, s.panics), (0, 0, 0, 0));
    assert!(d.debug().contains("telegram"), "{}", d.debug());
    Ok(())
}

/// The events a dispatcher of flavour `F` on `platform` reports while it drains `db`.
fn drained_events<F: Flavour>(db: &TestDb, platform: Platform) -> Vec<DispatchEvent> {
    let events = Events::default();
    let d = F::build_reporting(
        db.outbox.clone(),
        vec![("telegram", platform)],
        Some(events.clone()),
    );
    drain(db, &d, 900);
    events.lock().unwrap().clone()
}

fn events_report_each_finalized_reply_and_each_dead_letter_once<F: Flavour>() -> Result<()> {
    let db = TestDb::default();
    let platform = mixed_platform(&db);
    let ok = enqueue(&db.outbox, "ok", &["one", "two"]);
    let gone = enqueue(&db.outbox, "gone", &["x"]);
    let flaky_id = enqueue(&db.outbox, "flaky", &["y"]);
    let events = drained_events::<F>(&db, platform);
    assert_eq!(events.len(), 3, "{events:?}");
    let finalized = |id| {
        events.iter().find_map(|e| match e {
            DispatchEvent::Finalized {
                delivery_id,
                platform_message_ids,
                ..
            } if *delivery_id == id => Some(platform_message_ids.clone()),
            _ => None,
        })
    };
    assert_eq!(
        finalized(ok),
        Some(vec![Some("p-0".to_string()), Some("p-1".to_string())])
    );
    assert_eq!(finalized(flaky_id), Some(vec![Some("p-0".to_string())]));
    assert!(
        events.iter().any(|e| matches!(e,
            DispatchEvent::DeadLetter { delivery_id, chat_id, error, .. }
                if *delivery_id == gone && chat_id == "gone" && error.contains("blocked"))),
        "{events:?}"
    );
    Ok(())
}

/// A reply whose parts were all delivered but whose history row the application's
/// statement refused is reported once, as `Unfinalized`, with the statement's error and
/// the platform's ids; the reply the statement takes is `Finalized`.
fn events_report_a_reply_the_history_refuses<F: Flavour>() -> Result<()> {
    let db = TestDb::default();
    db.exec(
        "CREATE TABLE app_history (
             id   TEXT PRIMARY KEY,
             chat TEXT NOT NULL CHECK (chat <> 'archived'))",
    );
    db.outbox.set_finalization(Some(
        "INSERT INTO app_history (id, chat) VALUES (:delivery_id, :chat_id)",
    ))?;
    let platform = mixed_platform(&db);
    let refused = enqueue(&db.outbox, "archived", &["one", "two"]);
    let taken = enqueue(&db.outbox, "ok", &["x"]);
    let events = drained_events::<F>(&db, platform);
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        events.iter().any(|e| matches!(e,
            DispatchEvent::Unfinalized { delivery_id, chat_id, platform_message_ids, error, .. }
                if *delivery_id == refused
                    && chat_id == "archived"
                    && *platform_message_ids == [Some("p-0".to_string()), Some("p-1".to_string())]
                    && error.to_lowercase().contains("check"))),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| matches!(e,
            DispatchEvent::Finalized { delivery_id, .. } if *delivery_id == taken)),
        "{events:?}"
    );
    Ok(())
}

/// Item 5 of the review: the dead letters a dispatcher's own claim makes reach
/// `on_event` once each too: a reply older than the maximum age, and a chunk whose
/// lease ran out on its last attempt (the poison chunk that crashed its worker).
fn events_report_the_dead_letters_the_claim_makes<F: Flavour>() -> Result<()> {
    let retry = chunked_outbox::rules::RetryPolicy::default()
        .with_max_attempts(1)
        .with_max_age(Some(Duration::from_secs(60)));
    let db = TestDb::new(OutboxOptions::default().with_retry(retry));
    let poison = enqueue(&db.outbox, "poison", &["x"]);
    let crashed = db.outbox.claim(1)?.remove(0); // its worker dies mid-send
    assert_eq!(crashed.delivery_id, poison);
    let old = enqueue(&db.outbox, "old", &["y"]);
    db.advance(Duration::from_secs(61)); // past the lease, and "old" is 61 s old
    let events = Events::default();
    let d = F::build_reporting(
        db.outbox.clone(),
        vec![("telegram", Platform::always_ok(&db))],
        Some(events.clone()),
    );
    assert_eq!(d.run_once(), 0, "nothing left to send");
    let events = events.lock().unwrap().clone();
    let dead = |id, what: &str| {
        events
            .iter()
            .filter(|e| {
                matches!(e, DispatchEvent::DeadLetter { delivery_id, error, .. }
                    if *delivery_id == id && error.contains(what))
            })
            .count()
    };
    assert_eq!(dead(poison, "lease expired"), 1, "{events:?}");
    assert_eq!(dead(old, "maximum age"), 1, "{events:?}");
    assert_eq!(events.len(), 2, "{events:?}");
    Ok(())
}

both_flavours!(
    events_report_a_reply_the_history_refuses,
    events_report_the_dead_letters_the_claim_makes,
    events_report_each_finalized_reply_and_each_dead_letter_once,
    stats_count_every_send_and_outcome,
    lane_order_under_random_transient_failures,
    permanent_failure_is_a_dead_letter_without_more_attempts,
    ambiguous_holds_or_replays_by_policy,
    rate_limit_pauses_only_its_lane,
    pacing_holds_at_every_chunk_boundary,
    unregistered_channel_stays_due,
);

// ---- Threads, processes and shutdown (real time; waits are bounded, never timed) ----

/// An adapter that appends every key it sends to a shared list.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl ChannelAdapter for Recorder {
    fn send(&self, claim: &Claim) -> Outcome {
        // A network round trip's worth of latency, so concurrent dispatchers overlap.
        std::thread::sleep(Duration::from_micros(300));
        self.0.lock().unwrap().push(claim.idempotency_key.clone());
        Outcome::delivered(None)
    }
}

fn real_time_db() -> Place {
    Place::new()
}

/// A gate every send waits at until it opens, so a test can hold sends in flight.
#[derive(Clone, Default)]
struct Gate {
    /// (sends started, open)
    state: Arc<(Mutex<(usize, bool)>, std::sync::Condvar)>,
}

impl Gate {
    fn wait_started(&self, n: usize) {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        while s.0 < n {
            s = cv.wait(s).unwrap();
        }
    }

    fn open(&self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap().1 = true;
        cv.notify_all();
    }
}

impl ChannelAdapter for Gate {
    fn send(&self, _claim: &Claim) -> Outcome {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        s.0 += 1;
        cv.notify_all();
        while !s.1 {
            s = cv.wait(s).unwrap();
        }
        Outcome::delivered(None)
    }
}

#[cfg(feature = "tokio")]
mod tokio_running {
    use super::*;
    use chunked_outbox::AsyncChannelAdapter;
    use chunked_outbox::AsyncDispatcher;
    use chunked_outbox::dispatch::SendFuture;

    /// Holds every send until released, like a slow platform.
    #[derive(Clone)]
    struct AsyncGate {
        /// One permit per send started.
        started: Arc<tokio::sync::Semaphore>,
        proceed: Arc<tokio::sync::Semaphore>,
        sent: Arc<Mutex<Vec<String>>>,
    }

    impl Default for AsyncGate {
        fn default() -> Self {
            AsyncGate {
                started: Arc::new(tokio::sync::Semaphore::new(0)),
                proceed: Arc::new(tokio::sync::Semaphore::new(0)),
                sent: Arc::default(),
            }
        }
    }

    impl AsyncChannelAdapter for AsyncGate {
        fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
            Box::pin(async move {
                self.started.add_permits(1);
                self.proceed.acquire().await.unwrap().forget();
                self.sent
                    .lock()
                    .unwrap()
                    .push(claim.idempotency_key.clone());
                Outcome::delivered(None)
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_finishes_sends_in_flight_and_leaves_nothing_sending() -> Result<()> {
        let place = real_time_db();
        let outbox = place.open(OutboxOptions::default())?;
        for n in 0..20 {
            let _ = outbox.enqueue(&NewDelivery::single("telegram", format!("c{n}"), "x"))?;
        }
        let gate = AsyncGate::default();
        let dispatcher = AsyncDispatcher::builder(outbox.clone())
            .adapter("telegram", gate.clone())
            .workers(1)
            .batch_size(4)
            .build()?;
        let running = dispatcher.start()?;
        gate.started.acquire_many(4).await.unwrap().forget();
        assert_eq!(
            outbox.health()?.totals.sending_chunks,
            4,
            "one round in flight"
        );
        running.request_shutdown();
        gate.proceed.add_permits(4);
        let report = running.shutdown(Duration::from_secs(30)).await;
        assert!(report.clean);
        assert_eq!(
            report.stats.delivered, 4,
            "the sends in flight finished and were recorded"
        );
        assert_eq!(report.stats.released, 0, "nothing was held unstarted");
        let h = outbox.health()?;
        assert_eq!((h.totals.sending_chunks, h.totals.due_chunks), (0, 16));
        Ok(())
    }

    /// Never answers (a request lost on the way), except for chat "ok".
    struct Silent;

    impl AsyncChannelAdapter for Silent {
        fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
            Box::pin(async move {
                if claim.chat_id != "ok" {
                    std::future::pending::<()>().await;
                }
                Outcome::delivered(None)
            })
        }
    }

    /// An async send past the send timeout is dropped and recorded as ambiguous (held
    /// `uncertain` on a channel that must not replay); the worker goes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_past_its_timeout_is_ambiguous_and_the_worker_goes_on() -> Result<()> {
        // One send at a time, and two at once (the lost one beside one that answers).
        for batch in [1, 2] {
            let place = real_time_db();
            let outbox = place.open(OutboxOptions::default())?;
            let lost = outbox
                .enqueue(&NewDelivery::single("telegram", "lost", "x"))?
                .id;
            let ok = outbox
                .enqueue(&NewDelivery::single("telegram", "ok", "y"))?
                .id;
            let running = AsyncDispatcher::builder(outbox.clone())
                .adapter("telegram", Silent)
                .workers(1)
                .batch_size(batch)
                .send_timeout(Some(Duration::from_millis(200)))
                .build()?
                .start()?;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            let status = |id| outbox.delivery(id).map(|d| d.map(|d| d.status));
            while status(ok)? != Some(chunked_outbox::monitoring::DeliveryStatus::Delivered) {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "batch {batch}: the send that answers was never recorded"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            while status(lost)? != Some(chunked_outbox::monitoring::DeliveryStatus::Uncertain) {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "batch {batch}: the lost send was not held uncertain"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let report = running.shutdown(Duration::from_secs(10)).await;
            assert_eq!(report.stats.timed_out, 1, "batch {batch}: {report:?}");
            assert!(report.clean, "batch {batch}: {report:?}");
        }
        Ok(())
    }

    /// On a current-thread runtime the database work goes to the blocking pool (there
    /// is no other thread to hand the runtime to), and the dispatcher works the same.
    #[tokio::test(flavor = "current_thread")]
    async fn a_current_thread_runtime_is_served_too() -> Result<()> {
        let place = real_time_db();
        let outbox = place.open(OutboxOptions::default())?;
        let gate = AsyncGate::default();
        gate.proceed.add_permits(100);
        let running = AsyncDispatcher::builder(outbox.clone())
            .adapter("telegram", gate.clone())
            .batch_size(2)
            .build()?
            .start()?;
        for n in 0..6 {
            let _ = outbox.enqueue(&NewDelivery::single("telegram", format!("c{n}"), "x"))?;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while gate.sent.lock().unwrap().len() < 6 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "sends did not happen"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(running.shutdown(Duration::from_secs(10)).await.clean);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn enqueue_wakes_an_idle_dispatcher_and_other_connections_are_noticed() -> Result<()> {
        let place = real_time_db();
        let outbox = place.open(OutboxOptions::default())?;
        let other = place.open(OutboxOptions::default())?;
        let gate = AsyncGate::default();
        gate.proceed.add_permits(100);
        let running = AsyncDispatcher::builder(outbox.clone())
            .adapter("telegram", gate.clone())
            .poll_interval(Duration::from_millis(20))
            .build()?
            .start()?;
        // Each reply is enqueued once the one before it is recorded, when the worker has
        // gone back to sleep with nothing due: only the wake-up, or noticing another
        // connection's commit, gets it going again.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        for (n, by) in [&outbox, &other, &outbox, &other].into_iter().enumerate() {
            let _ = by.enqueue(&NewDelivery::single("telegram", "1", "x"))?;
            while outbox.health()?.totals.delivered_deliveries < n as u64 + 1 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "send {n} did not happen"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert_eq!(gate.sent.lock().unwrap().len(), 4);
        assert!(running.shutdown(Duration::from_secs(10)).await.clean);
        Ok(())
    }
}

/// Sends that meet only when all of a round's are in flight at once: each waits (up
/// to 5 s) until `round` sends more have started since the round before it.
struct Rendezvous {
    round: usize,
    started: Mutex<usize>,
    all_in: std::sync::Condvar,
    met: std::sync::atomic::AtomicUsize,
}

impl ChannelAdapter for Rendezvous {
    fn send(&self, _claim: &Claim) -> Outcome {
        let mut started = self.started.lock().unwrap();
        *started += 1;
        let target = (*started).div_ceil(self.round) * self.round;
        self.all_in.notify_all();
        let (started, _) = self
            .all_in
            .wait_timeout_while(started, Duration::from_secs(5), |n| *n < target)
            .unwrap();
        if *started >= target {
            self.met.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Outcome::delivered(None)
    }
}

/// The child side of the two-process test: dispatches from the file named in the
/// environment until nothing is left, writing every key it sent to its own file.
#[ignore = "run as a child process by two_dispatcher_processes_never_send_a_chunk_twice"]
#[test]
fn child_dispatcher_process() -> Result<()> {
    let Ok(db) = std::env::var("CHUNKED_OUTBOX_CHILD_DB") else {
        return Ok(());
    };
    let out = std::env::var("CHUNKED_OUTBOX_CHILD_OUT").expect("output path");
    let outbox = open_target(&db, OutboxOptions::default())?;
    let recorder = Recorder::default();
    let running = Dispatcher::builder(outbox.clone())
        .adapter("telegram", recorder.clone())
        .workers(2)
        .batch_size(4)
        .build()?
        .start()?;
    wait_until("the backlog to drain", || {
        let h = outbox.health().unwrap();
        h.totals.pending_chunks + h.totals.retry_chunks + h.totals.sending_chunks == 0
    });
    assert!(running.shutdown(Duration::from_secs(10)).clean);
    std::fs::write(out, recorder.0.lock().unwrap().join("\n")).unwrap();
    Ok(())
}

stores! {
    fn two_dispatcher_processes_never_send_a_chunk_twice() -> Result<()> {
        let place = real_time_db();
        let producer = place.open(OutboxOptions::default())?;
        let total = 600;
        for n in 0..total {
            let _ = producer.enqueue(&NewDelivery::chunked(
                "telegram",
                format!("c{}", n % 13),
                "a b",
                ["a", "b"],
            ))?;
        }
        let children: Vec<_> = (0..2)
            .map(|i| {
                let out = place.dir.path().join(format!("child-{i}.txt"));
                let child = std::process::Command::new(std::env::current_exe().unwrap())
                    .args([
                        "--ignored",
                        "--exact",
                        "child_dispatcher_process",
                        "--nocapture",
                    ])
                    .env("CHUNKED_OUTBOX_CHILD_DB", place.target())
                    .env("CHUNKED_OUTBOX_CHILD_OUT", &out)
                    .spawn()
                    .expect("spawn child");
                (child, out)
            })
            .collect();
        let mut seen = HashSet::new();
        let mut per_child = Vec::new();
        for (mut child, out) in children {
            assert!(child.wait().unwrap().success(), "child failed");
            let keys = std::fs::read_to_string(out).unwrap();
            let keys: Vec<&str> = keys.lines().collect();
            per_child.push(keys.len());
            for key in keys {
                assert!(seen.insert(key.to_owned()), "{key} sent twice");
            }
        }
        assert_eq!(seen.len(), 2 * total);
        assert_eq!(producer.health()?.totals.delivered_deliveries, total as u64);
        println!("chunks sent per process: {per_child:?}");
        Ok(())
    }


    fn two_dispatchers_in_two_threads_never_send_a_chunk_twice() -> Result<()> {
        let place = real_time_db();
        let producer = place.open(OutboxOptions::default())?;
        let recorders = [Recorder::default(), Recorder::default()];
        let running: Vec<_> = recorders
            .iter()
            .map(|r| {
                let ob = place.open(OutboxOptions::default()).unwrap();
                Dispatcher::builder(ob)
                    .adapter("telegram", r.clone())
                    .workers(2)
                    .build()
                    .unwrap()
                    .start()
                    .unwrap()
            })
            .collect();
        let total = 400;
        for n in 0..total {
            let _ = producer.enqueue(&NewDelivery::chunked(
                "telegram",
                format!("c{}", n % 9),
                "a b",
                ["a", "b"],
            ))?;
        }
        wait_until("all delivered", || {
            producer.health().unwrap().totals.delivered_deliveries == total
        });
        for r in running {
            assert!(r.shutdown(Duration::from_secs(10)).clean);
        }
        let mut seen = HashSet::new();
        for r in &recorders {
            for key in r.0.lock().unwrap().iter() {
                assert!(seen.insert(key.clone()), "{key} sent twice");
            }
        }
        // Which dispatcher took how much is up to the scheduler; only duplicates matter.
        assert_eq!(seen.len(), 2 * total as usize);
        Ok(())
    }

    fn shutdown_finishes_sends_in_flight_and_leaves_nothing_sending() -> Result<()> {
        let place = real_time_db();
        let outbox = place.open(OutboxOptions::default())?;
        for n in 0..20 {
            let _ = outbox.enqueue(&NewDelivery::single("telegram", format!("c{n}"), "x"))?;
        }
        let gate = Gate::default();
        let running = Dispatcher::builder(outbox.clone())
            .adapter("telegram", gate.clone())
            .workers(2)
            .batch_size(3)
            .build()?
            .start()?;
        gate.wait_started(6);
        assert_eq!(
            outbox.health()?.totals.sending_chunks,
            6,
            "two workers with three sends each in flight, and nothing else held"
        );
        running.request_shutdown();
        gate.open();
        let report = running.shutdown(Duration::from_secs(30));
        assert!(report.clean);
        assert_eq!(
            report.stats.delivered, 6,
            "the sends in flight finished and were recorded"
        );
        assert_eq!(report.stats.released, 0, "nothing was held unstarted");
        let h = outbox.health()?;
        assert_eq!(h.totals.sending_chunks, 0);
        assert_eq!(h.totals.due_chunks, 14);
        Ok(())
    }

    fn enqueue_in_this_process_wakes_an_idle_dispatcher() -> Result<()> {
        let place = real_time_db();
        let outbox = place.open(OutboxOptions::default())?;
        let recorder = Recorder::default();
        // A poll interval far beyond the wait bound: only the in-process wake-up can pass.
        let running = Dispatcher::builder(outbox.clone())
            .adapter("telegram", recorder.clone())
            .poll_interval(Duration::from_secs(3600))
            .build()?
            .start()?;
        // Each reply arrives after the previous one was delivered, when the worker has
        // nothing due and sleeps on the hour-long poll: only a wake-up gets it sent.
        for n in 1..=20 {
            let _ = outbox.enqueue(&NewDelivery::single("telegram", format!("c{n}"), "wake up"))?;
            wait_until("the send", || {
                outbox.health().unwrap().totals.delivered_deliveries == n
            });
        }
        assert!(running.shutdown(Duration::from_secs(10)).clean);
        Ok(())
    }

    fn commits_from_another_connection_are_noticed() -> Result<()> {
        let place = real_time_db();
        let dispatching = place.open(OutboxOptions::default())?;
        let other = place.open(OutboxOptions::default())?; // its own notifier, like another process
        let recorder = Recorder::default();
        let running = Dispatcher::builder(dispatching)
            .adapter("telegram", recorder.clone())
            .poll_interval(Duration::from_millis(20))
            .build()?
            .start()?;
        // Each reply is enqueued once the one before it is recorded, when the worker has
        // gone back to sleep with nothing due: only noticing the commit wakes it.
        for n in 1..=3 {
            let _ = other.enqueue(&NewDelivery::single("telegram", "1", "from elsewhere"))?;
            wait_until("the send recorded", || {
                other
                    .health()
                    .is_ok_and(|h| h.totals.delivered_deliveries == n)
            });
        }
        assert_eq!(recorder.0.lock().unwrap().len(), 3);
        assert!(running.shutdown(Duration::from_secs(10)).clean);
        Ok(())
    }

    /// A panicking event handler loses its event, not the worker: every reply goes out.
    fn a_panicking_event_handler_does_not_stop_the_dispatcher() -> Result<()> {
        let db = TestDb::default();
        for chat in ["a", "b", "c"] {
            enqueue(&db.outbox, chat, &["x"]);
        }
        let d = Blocking(
            Dispatcher::builder(db.outbox.clone())
                .adapter("telegram", Platform::always_ok(&db))
                .on_event(|_| panic!("a bug in the application's handler"))
                .build()?,
        );
        drain(&db, &d, 3);
        assert_eq!(db.outbox.health()?.totals.delivered_deliveries, 3);
        Ok(())
    }

    /// "A claim is a send in flight": every send of a blocking worker's round is under way
    /// at once — in later rounds too, when its send threads sleep between rounds — with a
    /// send timeout (the worker only waits) and without one (the worker sends too).
    fn every_send_of_a_round_is_in_flight_at_once() -> Result<()> {
        for timeout in [None, Some(Duration::from_secs(20))] {
            let db = TestDb::default();
            let adapter = Arc::new(Rendezvous {
                round: 6,
                started: Mutex::new(0),
                all_in: std::sync::Condvar::new(),
                met: std::sync::atomic::AtomicUsize::new(0),
            });
            let running = Dispatcher::builder(db.outbox.clone())
                .adapter("telegram", adapter.clone())
                .workers(1)
                .batch_size(6)
                .send_timeout(timeout)
                .build()?
                .start()?;
            for wave in 0..3 {
                // In one transaction, so that a round claims the whole wave.
                let replies: Vec<NewDelivery> = (0..6)
                    .map(|n| NewDelivery::single("telegram", format!("c{wave}-{n}"), "x"))
                    .collect();
                db.outbox.enqueue_batch(&replies)?;
                wait_until("the wave sent", || {
                    running.stats().finalized == 6 * (wave + 1)
                });
            }
            running.shutdown(Duration::from_secs(5));
            assert_eq!(
                adapter.met.load(std::sync::atomic::Ordering::SeqCst),
                18,
                "every send of each round in flight together (send timeout {timeout:?})"
            );
        }
        Ok(())
    }
}

//! PostgreSQL through a failover: a primary with a synchronous hot standby of its own
//! (`scripts/pg-pair`), the outbox pointed at both with
//! `target_session_attrs=read-write`, and the primary crashed, stopped or fenced
//! read-only while the outbox works.
//!
//! What each test checks is read as a real party could: the outbox's answers, its
//! rows as the promoted server holds them, what the platform was sent, the
//! dispatcher's counters.
#![cfg(feature = "postgres")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, Error, NewDelivery, Outbox, OutboxOptions, Outcome,
};
use common::pair::Pair;

/// What became of an enqueue whose `COMMIT` was under way when its primary crashed.
#[derive(Debug)]
enum LostEnqueue {
    /// The outbox could not tell: the application enqueues again by its key.
    Unknown,
    /// It answered `Ok`, and the reply is there on the promoted server.
    Kept,
    /// It answered `Ok` for a reply the promoted server does not have.
    OkWithoutRow,
    /// Any other error (shown by the verdict's `Debug`).
    Other(#[allow(dead_code)] String),
}

/// The lost commit of a failover: the standby's walsender stopped (a synchronous
/// commit then waits for it), an enqueue sent into `COMMIT`, the primary killed with
/// every process of it, the standby promoted, and transactions committed on it until it
/// has handed out again the transaction id of the lost one. The busy timeout (how long
/// a lost commit is looked up) is 30 s.
fn lost_commit() -> Option<LostEnqueue> {
    let pair = Pair::new()?;
    let options = OutboxOptions::default().with_busy_timeout(Duration::from_secs(30));
    let outbox = Outbox::connect(&pair.url, options).unwrap();
    outbox
        .enqueue(&NewDelivery::single("t", "c1", "before"))
        .unwrap();
    pair.act(&["pause-walsender"]);
    let enqueue = {
        let outbox = outbox.clone();
        std::thread::spawn(move || {
            outbox.enqueue(&NewDelivery::single("t", "c1", "lost").with_idempotency_key("k-lost"))
        })
    };
    let mut primary = pair.admin(0);
    let until = Instant::now() + Duration::from_secs(30);
    while primary
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(Instant::now() < until, "the enqueue never waited in COMMIT");
        std::thread::sleep(Duration::from_millis(10));
    }
    pair.act(&["crash-primary"]);
    pair.act(&["promote"]);
    // The promoted server hands out the ids the lost transaction had: each of these
    // takes one and commits.
    let mut promoted = pair.admin(1);
    for _ in 0..500 {
        promoted.batch_execute("SELECT txid_current()").unwrap();
    }
    let answer = enqueue.join().unwrap();
    let kept: i64 = promoted
        .query_one(
            "SELECT count(*) FROM outbound_deliveries WHERE idempotency_key = 'k-lost'",
            &[],
        )
        .unwrap()
        .get(0);
    Some(match answer {
        Err(Error::CommitUnknown { .. }) => LostEnqueue::Unknown,
        Ok(_) if kept == 1 => LostEnqueue::Kept,
        Ok(_) => LostEnqueue::OkWithoutRow,
        Err(e) => LostEnqueue::Other(e.to_string()),
    })
}

/// Item 1: a commit lost in a failover is looked up only on the server it ran on; the
/// promoted standby, which reuses its transaction id, is never asked, and the enqueue
/// never answers `Ok` for a reply that does not exist.
#[test]
fn a_commit_lost_in_a_failover_is_not_looked_up_on_the_promoted_standby() {
    let Some(verdict) = lost_commit() else {
        return;
    };
    assert!(
        matches!(verdict, LostEnqueue::Unknown | LostEnqueue::Kept),
        "{verdict:?}"
    );
}

/// The lost-commit run alone, printing its verdict: run by the test below with the
/// identity check removed (a planted fault).
#[test]
#[ignore = "run by lost_commit_fails_without_the_identity_check"]
fn lost_commit_probe() {
    if let Some(verdict) = lost_commit() {
        println!("VERDICT {verdict:?}");
    }
}

/// The lost-commit test can fail: with the lookup asking whichever server answers
/// (the fault `lost_commit_asked_anywhere`), the promoted standby's answer about its
/// own transaction makes the enqueue answer `Ok` for a reply that does not exist.
#[cfg(feature = "sabotage")]
#[test]
fn lost_commit_fails_without_the_identity_check() {
    if Pair::new().is_none() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "lost_commit_probe", "--nocapture"])
        .env("OUTBOX_SABOTAGE", "lost_commit_asked_anywhere")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("VERDICT OkWithoutRow"),
        "the planted fault went unseen: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Item 5: a call that meets a connection the server ended names the hosts of the
/// connection string and the one that answered, not nobody (`no connection to : …`):
/// a read on a pooled connection ended under it, a write after the primary crashed.
#[test]
fn an_error_after_a_crash_names_the_hosts() {
    let Some(pair) = Pair::new() else {
        return;
    };
    let outbox = Outbox::connect(&pair.url, OutboxOptions::default().with_readers(0)).unwrap();
    outbox
        .enqueue(&NewDelivery::single("t", "c1", "before"))
        .unwrap();
    // (used again at once: the pool hands it out unchecked)
    pair.admin(0)
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .unwrap();
    let read = outbox.health().map(|_| ());
    pair.act(&["crash-primary"]);
    let write = outbox
        .enqueue(&NewDelivery::single("t", "c1", "after"))
        .map(|_| ());
    for failed in [read, write] {
        match failed {
            Err(Error::Connection { target, .. } | Error::CommitUnknown { target, .. }) => {
                assert!(target.contains(&format!("{}/a", pair.dir)), "{target:?}");
            }
            other => panic!("a call after the crash: {other:?}"),
        }
    }
}

/// An adapter that records what it sends, and can hold a send until told.
#[derive(Clone, Default)]
struct Platform {
    sent: Arc<Mutex<Vec<(String, Instant)>>>,
    hold: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Platform {
    fn holding() -> Platform {
        let p = Platform::default();
        *p.hold.0.lock().unwrap() = true;
        p
    }

    fn release(&self) {
        *self.hold.0.lock().unwrap() = false;
        self.hold.1.notify_all();
    }

    fn sent(&self) -> Vec<String> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn wait_sent(&self, n: usize, within: Duration) -> Instant {
        let until = Instant::now() + within;
        loop {
            if let Some((_, at)) = self.sent.lock().unwrap().get(n - 1) {
                return *at;
            }
            assert!(
                Instant::now() < until,
                "{n} sends never came: {:?}",
                self.sent()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl ChannelAdapter for Platform {
    fn send(&self, claim: &Claim) -> Outcome {
        self.sent
            .lock()
            .unwrap()
            .push((claim.idempotency_key.clone(), Instant::now()));
        let (lock, cv) = &*self.hold;
        let mut held = lock.lock().unwrap();
        while *held {
            held = cv.wait(held).unwrap();
        }
        Outcome::delivered(None)
    }
}

/// Items 3 and 4: a primary fenced read-only for a few seconds. A due reply's claims
/// wait the poll interval each time (no hot loop); an outcome reached while fenced is
/// recorded once the fence lifts (none dropped, nothing sent twice); an enqueue
/// answers a connection error, which the application retries, not `ReadOnly`, which
/// reads as permanent.
#[test]
fn a_fenced_primary_is_waited_out() {
    let Some(pair) = Pair::new() else {
        return;
    };
    let outbox = Outbox::connect(&pair.url, OutboxOptions::default()).unwrap();
    let platform = Platform::holding();
    let poll = Duration::from_millis(50);
    let dispatcher = Dispatcher::builder(outbox.clone())
        .adapter("t", platform.clone())
        .poll_interval(poll)
        .build()
        .unwrap();
    let first = outbox
        .enqueue(&NewDelivery::single("t", "c1", "in flight"))
        .unwrap()
        .id;
    let second = outbox
        .enqueue(&NewDelivery::single("t", "c2", "due while fenced"))
        .unwrap()
        .id;
    let running = dispatcher.start().unwrap();
    // Both sends start; the first is held until the fence is up.
    platform.wait_sent(1, Duration::from_secs(30));
    pair.act(&["fence", "on"]);
    let errors_before = running.stats().errors;
    platform.release();
    let fenced = Duration::from_secs(3);
    std::thread::sleep(fenced);
    let failed_claims = running.stats().errors - errors_before;
    let refused = outbox.enqueue(&NewDelivery::single("t", "c3", "refused"));
    pair.act(&["fence", "off"]);
    let until = Instant::now() + Duration::from_secs(60);
    while [first, second].iter().any(|id| {
        outbox.delivery(*id).ok().flatten().map(|v| v.status)
            != Some(chunked_outbox::monitoring::DeliveryStatus::Delivered)
    }) {
        assert!(Instant::now() < until, "the replies were never delivered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = running.shutdown(Duration::from_secs(10));
    let stats = report.stats;
    // A worker waits a poll interval after each failed claim: about 60 in 3 s, where
    // a hot loop makes thousands. (A slow machine makes fewer, never more.)
    let most = 2 * (fenced.as_millis() / poll.as_millis()) as u64 + 10;
    assert!(
        failed_claims <= most,
        "{failed_claims} failed claims in {fenced:?} (at most {most})"
    );
    assert_eq!(stats.dropped, 0, "an outcome was dropped: {stats:?}");
    // Item 5: the error names the server that refused, with its reason.
    match refused {
        Err(Error::Connection { target, message }) => {
            // (refused at connect, or by the server an open connection reached)
            let a = format!("{}/a", pair.dir);
            assert!(
                target.contains(&format!("answered by {a}"))
                    || target.contains(&format!("host={a},{}/b", pair.dir)),
                "{target}"
            );
            assert!(message.contains("writes"), "{message}");
        }
        other => panic!("an enqueue on a fenced primary: {other:?}"),
    }
    let mut sent = platform.sent();
    sent.sort();
    sent.dedup();
    assert_eq!(
        sent.len(),
        platform.sent().len(),
        "a part was sent twice: {:?}",
        platform.sent()
    );
}

/// Item 7: a snapshot read from the standby says so, with how far behind it is; one
/// read from the primary does not. Item 2: the `outbox` tool takes the key-value
/// connection string of the standby and reads it as PostgreSQL.
#[test]
fn health_read_from_a_standby_says_so() {
    let Some(pair) = Pair::new() else {
        return;
    };
    let outbox = Outbox::connect(&pair.url, OutboxOptions::default()).unwrap();
    for chat in ["c1", "c2"] {
        outbox
            .enqueue(&NewDelivery::single("t", chat, "hello"))
            .unwrap();
    }
    assert_eq!(
        outbox.health().unwrap().replica,
        None,
        "read from the primary"
    );
    // A handle opened to read only is refused a write for good, on any server: that is
    // its own refusal, not a server's passing state.
    let reader = Outbox::connect_read_only(&pair.url, OutboxOptions::default()).unwrap();
    let refused = reader.enqueue(&NewDelivery::single("t", "c9", "no"));
    assert!(matches!(refused, Err(Error::ReadOnly(_))), "{refused:?}");
    // (A synchronous commit waits for the standby to keep it, not to replay it: the
    // tables and the replies show there a moment later.)
    let until = Instant::now() + Duration::from_secs(30);
    let standby = loop {
        match Outbox::connect_read_only(&pair.nodes[1], OutboxOptions::default()) {
            Ok(standby) => break standby,
            Err(e) => assert!(
                Instant::now() < until,
                "the standby never had the tables: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let health = loop {
        let health = standby.health().unwrap();
        if health.totals.pending_chunks == 2 {
            break health;
        }
        assert!(
            Instant::now() < until,
            "the standby never replayed the replies"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let replica = health.replica.clone().expect("read from the standby");
    assert!(replica.replay_lag_ms.is_some(), "{replica:?}");
    assert!(
        health
            .to_prometheus()
            .contains("outbox_read_from_replica 1"),
        "{}",
        health.to_prometheus()
    );
    #[cfg(feature = "cli")]
    {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(["health", "--db", &pair.nodes[1]])
            .env_remove("OUTBOX_DB")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("read from a standby"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The torture through two failovers (synchronous replication; each crashes the
/// primary with every process of it, promotes the standby and makes the old primary
/// its new standby), beside SIGKILLed processes and ended connections: nothing lost,
/// out of order or finalized twice, every duplicate explained.
#[cfg(feature = "cli")]
#[test]
fn torture_holds_through_two_failovers() {
    let Some(pair) = Pair::new() else {
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-lab"))
        .args(["--db", &pair.url])
        .env_remove("OUTBOX_DB")
        .args([
            "torture",
            "--kills",
            "12",
            "--seed",
            "7",
            "--connection-kills",
            "4",
            "--server-restarts",
            "2",
            "--restart-command",
            &pair.command("failover"),
        ])
        .output()
        .unwrap();
    let verdict = common::clean_torture_verdict(&out);
    eprintln!("torture through two failovers: {verdict}");
    assert_eq!(verdict["server_restarts"], 2, "{verdict}");
    assert_eq!(
        pair.primary(),
        0,
        "two failovers bring node a back as the primary"
    );
    assert!(verdict["deliveries"].as_u64().unwrap() > 0, "{verdict}");
}

/// How a primary is taken out of service.
#[derive(Debug, Clone, Copy)]
enum Outage {
    /// Stopped cleanly, the standby promoted.
    Stopped,
    /// Crashed with every process of it, the standby promoted.
    Crashed,
    /// Fenced read-only for 3 s, then writable again (no promotion).
    Fenced,
}

/// A failover under load, for each kind of outage: a producer enqueues a reply every
/// 20 ms (retrying what fails, as an application does) while a dispatcher sends. Every
/// acknowledged enqueue is delivered, once; prints how long after the new primary took
/// writes the first enqueue was acknowledged and the first part sent.
#[test]
fn a_failover_under_load_loses_nothing_acknowledged() {
    for outage in [Outage::Stopped, Outage::Crashed, Outage::Fenced] {
        let Some(pair) = Pair::new() else {
            return;
        };
        // (A claim whose commit was under way in the crash is unknown: its chunks wait
        // for their lease, 10 s here, and are then held as possibly sent.)
        let options = OutboxOptions::default().with_lease(Duration::from_secs(10));
        let outbox = Outbox::connect(&pair.url, options).unwrap();
        let platform = Platform::default();
        let running = Dispatcher::builder(outbox.clone())
            .adapter("t", platform.clone())
            .build()
            .unwrap()
            .start()
            .unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let producer = {
            let (outbox, stop) = (outbox.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut acknowledged = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let reply = NewDelivery::single("t", format!("c{}", n % 5), format!("r{n}"))
                        .with_idempotency_key(format!("r{n}"));
                    match outbox.enqueue(&reply) {
                        Ok(receipt) => {
                            acknowledged.push((receipt.id, Instant::now()));
                            n += 1;
                        }
                        // Retried by its key, as the application would.
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                acknowledged
            })
        };
        platform.wait_sent(5, Duration::from_secs(30));
        let writable = match outage {
            Outage::Stopped | Outage::Crashed => {
                pair.act(&[match outage {
                    Outage::Stopped => "stop-primary",
                    _ => "crash-primary",
                }]);
                pair.act(&["promote"]);
                Instant::now()
            }
            Outage::Fenced => {
                pair.act(&["fence", "on"]);
                std::thread::sleep(Duration::from_secs(3));
                pair.act(&["fence", "off"]);
                Instant::now()
            }
        };
        std::thread::sleep(Duration::from_secs(5));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let acknowledged = producer.join().unwrap();
        let until = Instant::now() + Duration::from_secs(120);
        // Every acknowledged reply is delivered — or, when a claim of it was lost in
        // the crash (its commit's answer lost, so nothing was sent), held as possibly
        // sent by its lease, and then the platform never saw it.
        let mut held_unsent = 0;
        for (id, _) in &acknowledged {
            loop {
                let status = outbox.delivery(*id).ok().flatten().map(|v| v.status);
                let seen = || {
                    let prefix = format!("{id}:");
                    platform.sent().iter().any(|k| k.starts_with(&prefix))
                };
                match status {
                    Some(chunked_outbox::monitoring::DeliveryStatus::Delivered) => break,
                    Some(chunked_outbox::monitoring::DeliveryStatus::Uncertain) if !seen() => {
                        held_unsent += 1;
                        break;
                    }
                    _ => {}
                }
                assert!(
                    Instant::now() < until,
                    "{outage:?}: acknowledged reply {id} is {status:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let report = running.shutdown(Duration::from_secs(10));
        let sent = platform.sent.lock().unwrap().clone();
        let mut keys: Vec<&String> = sent.iter().map(|(k, _)| k).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), sent.len(), "{outage:?}: a part sent twice");
        assert_eq!(report.stats.dropped, 0, "{outage:?}: {:?}", report.stats);
        let first_ack = acknowledged
            .iter()
            .map(|(_, at)| *at)
            .find(|at| *at > writable);
        let first_send = sent.iter().map(|(_, at)| *at).find(|at| *at > writable);
        eprintln!(
            "{outage:?}: {} acknowledged, {held_unsent} held unsent by a claim lost in the crash, the others delivered once; after writes were allowed, the first enqueue acknowledged in {:?}, the first part sent in {:?}",
            acknowledged.len(),
            first_ack.map(|at| at - writable),
            first_send.map(|at| at - writable)
        );
        assert!(first_ack.is_some() && first_send.is_some(), "{outage:?}");
    }
}

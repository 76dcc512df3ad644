//! The lane hammer: several processes, each with several threads, enqueue, claim, ack,
//! fail and cancel replies of a few chats at once, on one outbox. What the platform saw
//! (each send, appended to one log as it happens) and what the outbox reports must show:
//!
//! - **per-chat order**: a chat's sends never go back to an earlier reply, and a reply's
//!   chunks go out in order (FIFO lanes: one reply of a chat at a time);
//! - **no double claim**: no chunk is sent as delivered twice, and every ack of a live
//!   claim is taken (leases here never run out);
//! - **exactly-once finalization**: each delivered reply is in the application's own
//!   table once (a table without a unique key, so a second finalization would show),
//!   a dead letter or a cancelled reply not at all;
//! - a cancelled reply was never sent.
//!
//! On PostgreSQL the writers really run at once, so this is what checks the lock
//! protocol: a forgotten lock shows as out-of-order sends (`no_lane_locks` plants one,
//! and the hammer must catch it). On SQLite the same run checks the same promises.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use chunked_outbox::clock::SkewedClock;
use chunked_outbox::monitoring::DeliveryStatus;
use chunked_outbox::rules::{Backoff, LaneFailurePolicy, LaneOrder, RetryPolicy};
use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions, Outcome};
use common::*;

const CHATS: usize = 10;
/// The chats' channels: a worker's round may finalize replies of both.
const CHANNELS: [&str; 2] = ["hammer-a", "hammer-b"];
const PROCESSES: usize = 2;
const WORKERS: usize = 3;
const MAX_ATTEMPTS: u32 = 3;
/// How often each producer enqueues a reply.
const TICK: Duration = Duration::from_millis(100);
/// The first chats are quiet: a reply per second from each process, at the same
/// instants, so that their lanes are idle when two replies arrive at once, even on a
/// machine too busy to keep the other lanes drained (where a missing lane lock shows).
const QUIET_CHATS: usize = 2;
const QUIET_TICK: Duration = Duration::from_secs(1);

/// The rules every process follows: FIFO lanes that skip a dead letter, quick retries.
fn options() -> OutboxOptions {
    OutboxOptions::default()
        .with_lane_order(LaneOrder::Fifo)
        .with_lane_failure(LaneFailurePolicy::Skip)
        .with_lease(Duration::from_secs(600))
        .with_retry(
            RetryPolicy::default()
                .with_backoff(Backoff::Schedule(vec![Duration::from_millis(1)]))
                .with_max_attempts(MAX_ATTEMPTS)
                .with_jitter(0.0),
        )
}

/// The application's own history, without a unique key.
const APP_TABLE: &str = "CREATE TABLE app_history (delivery_id TEXT, content TEXT)";
const INTO_APP: &str = "INSERT INTO app_history VALUES (:delivery_id, :content)";

/// One line of the platform's log, appended (one `write`) as each event happens.
fn log(file: &mut std::fs::File, line: &str) {
    let line = line.replace('\n', " ");
    file.write_all(format!("{line}\n").as_bytes())
        .expect("append to the log");
}

/// One hammering process: its producer threads enqueue (and sometimes cancel) replies
/// of the chats this process owns, numbered in order per chat; its workers claim and
/// send (log, then ack, fail for a retry, or fail for good) until the time is up.
fn hammer(outbox: &Outbox, process: usize, log_path: &Path, seconds: u64) {
    let until = Instant::now() + Duration::from_secs(seconds);
    std::thread::scope(|scope| {
        for chat in 0..CHATS {
            let mut file = open_log(log_path);
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed((process * 100 + chat) as u64);
                let mut seq = 0u32;
                let tick = if chat < QUIET_CHATS { QUIET_TICK } else { TICK };
                // The producers of a chat (one per process) enqueue at the same instants:
                // the ticks of the system clock.
                std::thread::sleep(until_next_tick(tick));
                while Instant::now() < until {
                    let chunks = rng.usize(1..=3);
                    let parts: Vec<String> = (0..chunks)
                        .map(|i| format!("c{chat}-p{process}-{seq}-{i}-{chunks}"))
                        .collect();
                    let reply = NewDelivery::chunked(
                        CHANNELS[chat % CHANNELS.len()],
                        format!("c{chat}"),
                        parts.join(" "),
                        parts.iter().map(String::as_str),
                    );
                    seq += 1;
                    let id = match outbox.enqueue(&reply) {
                        Ok(enqueued) => enqueued.id,
                        Err(e) => {
                            log(&mut file, &format!("refused enqueue: {e}"));
                            continue;
                        }
                    };
                    log(&mut file, &format!("enqueued {id}"));
                    if rng.u8(..10) == 0 {
                        match outbox.cancel(id) {
                            Ok(()) => log(&mut file, &format!("cancelled {id}")),
                            Err(Error::CancelTooLate { .. } | Error::DeliveryState { .. }) => {}
                            Err(e) => log(&mut file, &format!("refused cancel: {e}")),
                        }
                    }
                    std::thread::sleep(until_next_tick(tick));
                }
            });
        }
        for worker in 0..WORKERS {
            let mut file = open_log(log_path);
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed((process * 100 + worker) as u64);
                while Instant::now() < until {
                    let claims = match outbox.claim(rng.usize(1..=4)) {
                        Ok(claims) => claims,
                        Err(e) => {
                            log(&mut file, &format!("refused claim: {e}"));
                            continue;
                        }
                    };
                    if claims.is_empty() {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    // The round's outcomes are recorded in one transaction, as the
                    // dispatcher records them: its lanes and channels all at once.
                    let mut outcomes = Vec::with_capacity(claims.len());
                    for claim in &claims {
                        // What the platform received: the reply's chunk text names its
                        // chat, number and index.
                        let roll = rng.u8(..20);
                        let outcome = match roll {
                            0 => Outcome::Permanent {
                                error: "blocked".into(),
                            },
                            1..=2 => Outcome::Transient {
                                error: "flaky".into(),
                            },
                            _ => Outcome::delivered(None),
                        };
                        // A failure on the last attempt the rules allow is for good.
                        let kind = match roll {
                            0 => "failed",
                            1..=2 if claim.attempt >= MAX_ATTEMPTS => "failed",
                            1..=2 => "retry",
                            _ => "delivered",
                        };
                        log(
                            &mut file,
                            &format!(
                                "sent {} {} {}",
                                claim.text.replace(' ', "+"),
                                kind,
                                claim.delivery_id
                            ),
                        );
                        outcomes.push((claim, outcome));
                    }
                    match outbox.record_batch(outcomes) {
                        Ok(results) => {
                            for (claim, result) in claims.iter().zip(results) {
                                match result {
                                    Ok(_) => {}
                                    // Another claim holds the chunk: the harness
                                    // reports it.
                                    Err(Error::StaleClaim { .. }) => {
                                        // Spaces written as `+`, as in `sent`: a
                                        // planted fault can hand a claim a whole
                                        // reply's text.
                                        log(
                                            &mut file,
                                            &format!("stale {}", claim.text.replace(' ', "+")),
                                        )
                                    }
                                    Err(e) => log(&mut file, &format!("refused record: {e}")),
                                }
                            }
                        }
                        Err(e) => log(&mut file, &format!("refused record: {e}")),
                    }
                }
            });
        }
    });
}

/// The time to the next multiple of `TICK` on the system clock.
fn until_next_tick(tick: Duration) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let tick = tick.as_nanos();
    Duration::from_nanos((tick - now.as_nanos() % tick) as u64)
}

fn open_log(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open the log")
}

/// What the log and the outbox show that breaks a promise.
#[derive(Debug, Default, PartialEq, Eq)]
struct Findings {
    /// A producer's replies to a chat sent out of the order it enqueued them, or a
    /// reply's chunks out of order.
    out_of_order: usize,
    /// A send of a chat's reply while another reply of the chat was unfinished.
    interleaved: usize,
    /// A chunk sent as delivered twice, or an ack refused because another claim held
    /// the chunk.
    double_claims: usize,
    cancelled_but_sent: usize,
    /// A delivered reply not in the crate's history and the application's table exactly
    /// once, or a dead letter or cancelled reply in either.
    finalized_not_once: usize,
    /// A reply neither delivered, a dead letter nor cancelled after the final drain.
    not_settled: usize,
    /// A chunk sent with another text than its own.
    wrong_text: usize,
    /// An enqueue, claim, record or cancel refused (a deadlock reported as busy, say):
    /// the lock protocol allows none.
    refused: usize,
}

/// A chunk's text: chat, producer, the producer's number of the reply, chunk index,
/// chunks in the reply.
fn parse(chunk: &str) -> (String, String, u32, u32, u32) {
    let [chat, producer, seq, index, total] = chunk.split('-').collect::<Vec<_>>()[..] else {
        panic!("{chunk}")
    };
    let n = |s: &str| s.parse::<u32>().unwrap();
    (chat.into(), producer.into(), n(seq), n(index), n(total))
}

/// Reads the log and the outbox after the hammer and a final drain.
fn verify(db: &TestDb, log_path: &Path) -> (Findings, BTreeMap<&'static str, usize>) {
    let text = std::fs::read_to_string(log_path).unwrap();
    let mut f = Findings::default();
    let mut counts = BTreeMap::new();
    // Per (chat, producer): the last (reply number, chunk index) sent.
    let mut last_sent: HashMap<(String, String), (u32, u32)> = HashMap::new();
    // Per chat: the reply under way (its id) until its last chunk is delivered or it
    // fails for good.
    let mut under_way: HashMap<String, String> = HashMap::new();
    let mut delivered_chunks = HashSet::new();
    let mut sent_deliveries = HashSet::new();
    let mut cancelled = HashSet::new();
    let mut enqueued = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["enqueued", id] => enqueued.push(id.to_owned()),
            ["cancelled", id] => {
                cancelled.insert(id.to_owned());
            }
            ["stale", _] => f.double_claims += 1,
            ["refused", ..] => f.refused += 1,
            ["sent", text, kind, id] => {
                *counts.entry("sends").or_default() += 1;
                let (chunk, rest) = text.split_once('+').unwrap_or((text, ""));
                if !rest.is_empty() {
                    f.wrong_text += 1;
                }
                let (chat, producer, seq, index, total) = parse(chunk);
                if let Some(before) = last_sent.insert((chat.clone(), producer), (seq, index))
                    && (seq, index) < before
                {
                    f.out_of_order += 1;
                }
                match under_way.get(&chat) {
                    Some(current) if current != id => f.interleaved += 1,
                    _ => {}
                }
                let finished = kind == "failed" || (kind == "delivered" && index + 1 == total);
                if finished {
                    under_way.remove(&chat);
                } else {
                    under_way.insert(chat, id.to_owned());
                }
                if kind == "delivered" && !delivered_chunks.insert(chunk.to_owned()) {
                    f.double_claims += 1;
                }
                sent_deliveries.insert(id.to_owned());
            }
            _ => panic!("unreadable log line {line:?}"),
        }
    }
    counts.insert("replies", enqueued.len());
    counts.insert("cancelled", cancelled.len());
    f.cancelled_but_sent = cancelled.intersection(&sent_deliveries).count();
    for id in &enqueued {
        let view = db.outbox.delivery(id.parse().unwrap()).unwrap().unwrap();
        let in_app = db
            .strings("SELECT content FROM app_history WHERE delivery_id = $1", id)
            .len();
        let in_history = db.messages_for(view.id).unwrap().len();
        let expected = match view.status {
            DeliveryStatus::Delivered => 1,
            DeliveryStatus::Failed | DeliveryStatus::Cancelled => 0,
            _ => {
                f.not_settled += 1;
                0
            }
        };
        *counts
            .entry(match view.status {
                DeliveryStatus::Delivered => "delivered",
                DeliveryStatus::Failed => "dead letters",
                _ => "other",
            })
            .or_default() += 1;
        if (in_app, in_history) != (expected, expected) {
            f.finalized_not_once += 1;
        }
    }
    (f, counts)
}

/// Sends everything left (as delivered), as an operator's last drain would.
fn drain(outbox: &Outbox, log_path: &Path) -> usize {
    let mut file = open_log(log_path);
    let mut sent = 0;
    let mut idle = 0;
    while idle < 3 {
        let claims = outbox.claim(64).unwrap();
        if claims.is_empty() {
            // A retry may be due a moment from now.
            idle += 1;
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        idle = 0;
        for claim in claims {
            log(
                &mut file,
                &format!(
                    "sent {} delivered {}",
                    claim.text.replace(' ', "+"),
                    claim.delivery_id
                ),
            );
            outbox.ack(&claim, None).unwrap();
            sent += 1;
        }
    }
    sent
}

/// Runs the hammer in `PROCESSES` child processes on `db` for `seconds`, with `fault`
/// planted in them (if any), drains, and verifies.
fn run(db: &TestDb, seconds: u64, fault: Option<&str>) -> Findings {
    run_skewed(db, seconds, fault, None)
}

/// As [`run`], with the second process's clock `skew_ms` off (ahead if positive).
fn run_skewed(db: &TestDb, seconds: u64, fault: Option<&str>, skew_ms: Option<i64>) -> Findings {
    db.exec(APP_TABLE);
    db.outbox.set_finalization(Some(INTO_APP)).unwrap();
    let log_path = db.dir.path().join("platform.log");
    let target = db
        .url
        .clone()
        .unwrap_or_else(|| db.path().display().to_string());
    let children: Vec<_> = (0..PROCESSES)
        .map(|process| {
            let mut child = Command::new(std::env::current_exe().unwrap());
            child
                .args(["--ignored", "--exact", "hammer_process", "--nocapture"])
                .env("HAMMER_DB", &target)
                .env("HAMMER_LOG", &log_path)
                .env("HAMMER_PROCESS", process.to_string())
                .env("HAMMER_SECONDS", seconds.to_string())
                .env_remove("OUTBOX_SABOTAGE");
            if let Some(fault) = fault {
                child.env("OUTBOX_SABOTAGE", fault);
            }
            if let Some(ms) = skew_ms.filter(|_| process == 1) {
                child.env("HAMMER_SKEW_MS", ms.to_string());
            }
            child.spawn().expect("spawn a hammering process")
        })
        .collect();
    for mut child in children {
        assert!(
            child.wait().unwrap().success(),
            "a hammering process failed"
        );
    }
    let drained = drain(&db.outbox, &log_path);
    let (findings, mut counts) = verify(db, &log_path);
    counts.insert("drained", drained);
    println!(
        "lane hammer ({:?}): {counts:?} {findings:?}",
        current_store()
    );
    assert!(counts["sends"] > 100, "the hammer did little: {counts:?}");
    findings
}

/// The child side: hammers the outbox named in the environment.
#[test]
#[ignore = "run as a child process by the lane hammer"]
fn hammer_process() {
    let Ok(target) = std::env::var("HAMMER_DB") else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap();
    let options = match std::env::var("HAMMER_SKEW_MS").map(|ms| ms.parse::<i64>().unwrap()) {
        Ok(ms) if ms < 0 => options().with_clock(std::sync::Arc::new(SkewedClock::behind(
            Duration::from_millis(ms.unsigned_abs()),
        ))),
        Ok(ms) => options().with_clock(std::sync::Arc::new(SkewedClock::ahead(
            Duration::from_millis(ms as u64),
        ))),
        Err(_) => options(),
    };
    let outbox = open_target(&target, options).unwrap();
    hammer(
        &outbox,
        var("HAMMER_PROCESS").parse().unwrap(),
        Path::new(&var("HAMMER_LOG")),
        var("HAMMER_SECONDS").parse().unwrap(),
    );
}

/// Seconds of hammering (`HAMMER_SECONDS`, default 4).
fn seconds() -> u64 {
    std::env::var("HAMMER_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4)
}

stores! {
    fn the_lane_hammer_keeps_every_promise() {
        let db = TestDb::on_system_clock(options());
        assert_eq!(run(&db, seconds(), None), Findings::default());
    }
}

/// On PostgreSQL, hosts whose clocks disagree act on the server's: the hammer keeps
/// every promise with one process's clock 2 minutes ahead, and with it 2 minutes behind.
#[cfg(feature = "postgres")]
#[test]
fn the_lane_hammer_keeps_every_promise_with_a_host_two_minutes_off() {
    on_store(Store::Postgres, || {
        for skew_ms in [120_000, -120_000] {
            let db = TestDb::on_system_clock(options());
            let findings = run_skewed(&db, seconds(), None, Some(skew_ms));
            assert_eq!(findings, Findings::default(), "skew {skew_ms} ms");
        }
    });
}

/// Each verdict of the hammer can fail: with a lock of the PostgreSQL store planted
/// away, or the crate's history skipped, the run must report it (within three runs).
///
/// - `no_lane_locks`: an enqueue decides its lane's head alone, so two producers of an
///   idle chat both start their replies, whose chunks then interleave;
/// - `no_claim_locks`: two claims read the same due chunk, both send it;
/// - `missing_finalizations`: a delivered reply never reaches the crate's history.
#[cfg(all(feature = "postgres", feature = "sabotage"))]
#[test]
fn the_lane_hammer_catches_each_planted_fault() {
    type Verdict = fn(&Findings) -> usize;
    let faults: [(&str, Verdict); 3] = [
        ("no_lane_locks", |f| f.interleaved + f.out_of_order),
        ("no_claim_locks", |f| f.double_claims),
        ("missing_finalizations", |f| f.finalized_not_once),
    ];
    on_store(Store::Postgres, || {
        for (fault, verdict) in faults {
            // A race planted in is a race: on a busy machine one run may miss it, so
            // it must be caught within a few.
            let mut runs = Vec::new();
            while runs.len() < 3 {
                let db = TestDb::on_system_clock(options());
                let findings = run(&db, seconds(), Some(fault));
                let caught = verdict(&findings) > 0;
                runs.push(findings);
                if caught {
                    break;
                }
            }
            let last = runs.last().unwrap();
            assert!(
                verdict(last) > 0,
                "{fault} went unnoticed in {} runs: {runs:?}",
                runs.len()
            );
        }
    });
}

//! chunked-outbox on PostgreSQL, in the peer harness: the harness's workloads through
//! the crate's public API with every guarantee on — lanes (1000 chats, FIFO), fenced
//! leases, the stable key per chunk, finalization into the history in the ack's
//! transaction, per-channel stats. Every reply is `NewDelivery::single("bench",
//! "chat-{i % 1000}", payload)`.
//!
//! A fresh database per measurement, the crate's own migrations (`Outbox::connect`),
//! prefill untimed (`enqueue_batch`), then `ANALYZE` and `CHECKPOINT`; checks after the
//! clock stops: every reply finalized once (`health()` totals, `count(*)` of the
//! history), and in the concurrent drains each chat's replies finalized in enqueue order.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome};
use peers_pg_bench_common::{self as common, progress, Args, Pg, Record, Timer};
use postgres::{Client, NoTls};

const SYSTEM: &str = "chunked-outbox";
const CHATS: usize = 1000;

fn reply(i: usize) -> NewDelivery {
    NewDelivery::single(
        "bench",
        format!("chat-{}", i % CHATS),
        common::payload_string(i),
    )
}

fn open(pg: &Pg, db: &str) -> Outbox {
    Outbox::connect(&pg.conninfo(db), OutboxOptions::default()).expect("connect the outbox")
}

fn prefill(outbox: &Outbox, n: usize) {
    let mut i = 0;
    while i < n {
        let end = (i + 1000).min(n);
        let batch: Vec<NewDelivery> = (i..end).map(reply).collect();
        outbox.enqueue_batch(&batch).unwrap();
        i = end;
    }
}

fn settle(admin: &mut Client) {
    admin.batch_execute(common::ANALYZE_SQL).unwrap();
    admin.batch_execute(common::CHECKPOINT_SQL).unwrap();
}

/// Every one of `n` replies delivered and in the history once.
fn assert_finalized(outbox: &Outbox, admin: &mut Client, n: usize) {
    let t = outbox.health().unwrap().totals;
    assert_eq!(t.delivered_deliveries as usize, n, "delivered replies");
    let history: i64 = admin
        .query_one(
            "SELECT count(DISTINCT delivery_id) FROM outbound_messages",
            &[],
        )
        .unwrap()
        .get(0);
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM outbound_messages", &[])
        .unwrap()
        .get(0);
    assert_eq!((history as usize, rows as usize), (n, n), "history rows");
}

/// Each chat's replies reached the history in enqueue order (the payload starts
/// with the reply's number).
fn assert_chat_order(admin: &mut Client) {
    let rows = admin
        .query(
            "SELECT chat_id, content FROM outbound_messages ORDER BY id",
            &[],
        )
        .unwrap();
    let mut last = std::collections::HashMap::<String, usize>::new();
    for r in rows {
        let chat: String = r.get(0);
        let content: String = r.get(1);
        let n: usize = content.trim_end_matches('x').parse().unwrap();
        if let Some(prev) = last.insert(chat.clone(), n) {
            assert!(prev < n, "chat {chat}: {n} finalized after {prev}");
        }
    }
}

fn drain_one_by_one(outbox: &Outbox) -> usize {
    let mut done = 0;
    loop {
        let claims = outbox.claim(1).unwrap();
        let Some(claim) = claims.first() else {
            return done;
        };
        outbox.record(claim, Outcome::delivered(None)).unwrap();
        done += 1;
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Insert1,
    InsertBatch,
    InsertBatchAppTx,
    ClaimAck1,
    ClaimAckBatch64,
    Cycle,
    EnqueueThenDrain,
    Concurrent(usize),
    Dispatch(usize),
}

/// An adapter whose platform accepts everything at once.
struct Accept;

impl ChannelAdapter for Accept {
    fn send(&self, _claim: &Claim) -> Outcome {
        Outcome::delivered(None)
    }
}

fn run(pg: &Pg, db: &str, kind: Kind, n: usize) -> (f64, String) {
    let mut admin = Client::connect(&pg.conninfo(db), NoTls).unwrap();
    let outbox = open(pg, db);
    let mut notes = String::new();
    let ops = match kind {
        Kind::Insert1 => {
            settle(&mut admin);
            let t = Timer::start();
            for i in 0..n {
                outbox.enqueue(&reply(i)).unwrap();
            }
            let s = t.secs();
            assert_eq!(outbox.health().unwrap().totals.pending_chunks as usize, n);
            n as f64 / s
        }
        Kind::InsertBatch => {
            settle(&mut admin);
            let t = Timer::start();
            let mut i = 0;
            while i < n {
                let end = (i + 100).min(n);
                let batch: Vec<NewDelivery> = (i..end).map(reply).collect();
                outbox.enqueue_batch(&batch).unwrap();
                i = end;
            }
            let s = t.secs();
            assert_eq!(outbox.health().unwrap().totals.pending_chunks as usize, n);
            n as f64 / s
        }
        Kind::InsertBatchAppTx => {
            settle(&mut admin);
            let mut app = Client::connect(&pg.conninfo(db), NoTls).unwrap();
            let t = Timer::start();
            let mut i = 0;
            while i < n {
                let end = (i + 100).min(n);
                let mut tx = app.transaction().unwrap();
                for j in i..end {
                    outbox.enqueue_in_pg(&mut tx, &reply(j)).unwrap();
                }
                tx.commit().unwrap();
                i = end;
            }
            let s = t.secs();
            let staged: i64 = admin
                .query_one("SELECT count(*) FROM outbound_deliveries", &[])
                .unwrap()
                .get(0);
            assert_eq!(staged as usize, n);
            n as f64 / s
        }
        Kind::ClaimAck1 => {
            prefill(&outbox, n);
            settle(&mut admin);
            let t = Timer::start();
            for _ in 0..n {
                let claims = outbox.claim(1).unwrap();
                assert_eq!(claims.len(), 1);
                outbox.record(&claims[0], Outcome::delivered(None)).unwrap();
            }
            let s = t.secs();
            assert_finalized(&outbox, &mut admin, n);
            n as f64 / s
        }
        Kind::ClaimAckBatch64 => {
            prefill(&outbox, n);
            settle(&mut admin);
            let t = Timer::start();
            let mut done = 0;
            while done < n {
                let claims = outbox.claim(64).unwrap();
                assert!(!claims.is_empty());
                let outcomes = claims.iter().map(|c| (c, Outcome::delivered(None)));
                for r in outbox.record_batch(outcomes).unwrap() {
                    r.unwrap();
                }
                done += claims.len();
            }
            let s = t.secs();
            assert_finalized(&outbox, &mut admin, n);
            n as f64 / s
        }
        Kind::Cycle => {
            settle(&mut admin);
            let t = Timer::start();
            for i in 0..n {
                let id = outbox.enqueue(&reply(i)).unwrap().id;
                let claims = outbox.claim(1).unwrap();
                assert_eq!(claims[0].delivery_id, id);
                outbox.record(&claims[0], Outcome::delivered(None)).unwrap();
            }
            let s = t.secs();
            assert_finalized(&outbox, &mut admin, n);
            n as f64 / s
        }
        Kind::EnqueueThenDrain => {
            settle(&mut admin);
            let t = Timer::start();
            for i in 0..n {
                outbox.enqueue(&reply(i)).unwrap();
            }
            assert_eq!(drain_one_by_one(&outbox), n);
            let s = t.secs();
            assert_finalized(&outbox, &mut admin, n);
            n as f64 / s
        }
        Kind::Concurrent(workers) => {
            prefill(&outbox, n);
            settle(&mut admin);
            let barrier = Arc::new(Barrier::new(workers + 1));
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    let handle = open(pg, db);
                    let b = barrier.clone();
                    std::thread::spawn(move || {
                        b.wait();
                        drain_one_by_one(&handle)
                    })
                })
                .collect();
            barrier.wait();
            let t = Timer::start();
            let counts: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let s = t.secs();
            assert_eq!(counts.iter().sum::<usize>(), n, "every reply claimed once");
            assert_finalized(&outbox, &mut admin, n);
            assert_chat_order(&mut admin);
            notes = format!("an Outbox handle each; rep 0: {}", common::spread(&counts));
            n as f64 / s
        }
        Kind::Dispatch(workers) => {
            prefill(&outbox, n);
            settle(&mut admin);
            let t = Timer::start();
            let running = Dispatcher::builder(outbox.clone())
                .adapter("bench", Accept)
                .workers(workers)
                .batch_size(64)
                .build()
                .unwrap()
                .start()
                .unwrap();
            while (outbox.health().unwrap().totals.delivered_deliveries as usize) < n {
                std::thread::sleep(Duration::from_millis(5));
            }
            let s = t.secs();
            running.shutdown(Duration::from_secs(10));
            assert_finalized(&outbox, &mut admin, n);
            assert_chat_order(&mut admin);
            n as f64 / s
        }
    };
    (ops, notes)
}

struct Workload {
    name: &'static str,
    default_n: usize,
    unit: &'static str,
    kind: Kind,
    note: &'static str,
}

fn main() {
    let args = Args::parse();
    use Kind::*;
    let w = |name, default_n, unit, kind, note| Workload {
        name,
        default_n,
        unit,
        kind,
        note,
    };
    let workloads = [
        w(
            "insert_1_per_txn",
            1_000,
            "rows/s",
            Insert1,
            "enqueue (1 crate txn each)",
        ),
        w(
            "insert_batch100_per_txn",
            10_000,
            "rows/s",
            InsertBatch,
            "enqueue_batch of 100",
        ),
        w(
            "insert_batch100_per_txn/app_tx",
            10_000,
            "rows/s",
            InsertBatchAppTx,
            "BEGIN on the application's connection + 100 x enqueue_in_pg + COMMIT (staged)",
        ),
        w(
            "claim_ack_1_per_txn",
            500,
            "msgs/s",
            ClaimAck1,
            "prefilled; claim(1) + record",
        ),
        w(
            "claim_ack_batch64",
            10_000,
            "msgs/s",
            ClaimAckBatch64,
            "prefilled; claim(64) + record_batch",
        ),
        w(
            "cycle_enqueue_claim_ack_3txn",
            300,
            "msgs/s",
            Cycle,
            "enqueue + claim(1) + record",
        ),
        w(
            "enqueue_then_drain_1_per_txn",
            300,
            "msgs/s",
            EnqueueThenDrain,
            "N x enqueue, then claim(1) + record until empty; both timed",
        ),
        w(
            "concurrent_drain_4workers",
            1_000,
            "msgs/s",
            Concurrent(4),
            "prefilled; 4 threads, claim(1) + record until empty; per-chat order checked",
        ),
        w(
            "concurrent_drain_16workers",
            2_000,
            "msgs/s",
            Concurrent(16),
            "prefilled; 16 threads, claim(1) + record until empty; per-chat order checked",
        ),
        w(
            "dispatch_4workers",
            2_000,
            "msgs/s",
            Dispatch(4),
            "prefilled; Dispatcher, 4 workers, batch 64, an adapter that accepts at once",
        ),
    ];
    if args.listed(workloads.iter().map(|w| w.name)) {
        return;
    }
    let pg = Pg::from_env();
    let mut admin = Client::connect(&pg.conninfo(common::ADMIN_DB), NoTls).unwrap();
    let settings: String = admin.query_one(common::SETTINGS_SQL, &[]).unwrap().get(0);
    let server: String = admin.query_one(common::VERSION_SQL, &[]).unwrap().get(0);
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock"))
        .unwrap_or_default();
    let versions = common::versions(&lock, &["chunked-outbox", "postgres", "tokio-postgres"]);
    for wl in workloads.iter().filter(|w| args.wants(w.name)) {
        let n = args.n(wl.default_n);
        let mut runs = Vec::new();
        let mut extra = String::new();
        for rep in 0..args.reps {
            let db = common::fresh_db_name(wl.name);
            admin.batch_execute(&common::create_db_sql(&db)).unwrap();
            let (ops, notes) = run(&pg, &db, wl.kind, n);
            admin.batch_execute(&common::drop_db_sql(&db)).unwrap();
            progress(SYSTEM, wl.name, rep + 1, ops, n);
            runs.push(ops);
            extra = notes;
        }
        Record {
            system: SYSTEM,
            workload: wl.name,
            n,
            runs,
            unit: wl.unit,
            versions: versions.clone(),
            server: server.clone(),
            settings: settings.clone(),
            notes: format!(
                "{}; pool: readers + 1 connections per handle, lease 60 s, FIFO lanes over {CHATS} chats{}{}",
                wl.note,
                if extra.is_empty() { "" } else { "; " },
                extra
            ),
        }
        .emit();
    }
}

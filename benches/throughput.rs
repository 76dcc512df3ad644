//! The throughput report: raw rusqlite floors, a hand-written raw-SQL model of the
//! crate's semantics, and the crate doing the same work, measured side by side in one
//! run, on the same disk, with the same pragmas (WAL, `synchronous=NORMAL` unless
//! stated). Ratios against the floors and the models are what to compare across
//! machines; absolute figures drift with the machine's load.
//!
//! Run: `cargo bench --features tokio --bench throughput -- [--quick]`
//!
//! The last line is one JSON object.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chunked_outbox::dispatch::SendFuture;
use chunked_outbox::store::sqlite::Synchronous;
use chunked_outbox::{
    AsyncChannelAdapter, AsyncDispatcher, ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox,
    OutboxOptions, Outcome,
};
use rusqlite::{Connection, TransactionBehavior, params};

struct Sizes {
    floor_ops: u64,
    enqueues: u64,
    dispatch_backlog: u64,
    big: u64,
    big_drain: u64,
    latency_samples: usize,
}

const FULL: Sizes = Sizes {
    floor_ops: 20_000,
    enqueues: 20_000,
    dispatch_backlog: 100_000,
    big: 1_000_000,
    big_drain: 100_000,
    latency_samples: 1_000,
};

const QUICK: Sizes = Sizes {
    floor_ops: 5_000,
    enqueues: 5_000,
    dispatch_backlog: 20_000,
    big: 100_000,
    big_drain: 20_000,
    latency_samples: 300,
};

fn temp_db(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("outbox-throughput-")
        .tempdir()
        .expect("temp dir");
    let path = dir.path().join(name);
    (dir, path)
}

fn raw(path: &std::path::Path, sync: Synchronous) -> Connection {
    let conn = Connection::open(path).expect("open");
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0))
        .unwrap();
    let level = if sync == Synchronous::Full {
        "FULL"
    } else {
        "NORMAL"
    };
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {level}; PRAGMA foreign_keys = ON;"
    ))
    .unwrap();
    conn
}

/// Checkpoints a setup's bulk load, so its checkpoint work does not fall into the
/// measurement that follows (every drain in the report starts this way).
fn settle(conn: &Connection) {
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
}

fn per_s(n: u64, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64()
}

/// Floor 1: one single-row insert per transaction.
fn floor_insert(n: u64) -> f64 {
    let (_dir, path) = temp_db("floor.db");
    let mut conn = raw(&path, Synchronous::Normal);
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        .unwrap();
    let start = Instant::now();
    for i in 0..n {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        tx.execute("INSERT INTO t (v) VALUES (?1)", [format!("reply {i}")])
            .unwrap();
        tx.commit().unwrap();
    }
    per_s(n, start.elapsed())
}

/// Floors 2 and 3: claim `batch` due jobs in one transaction, ack them in another.
fn floor_claim_ack(n: u64, batch: u64) -> f64 {
    let (_dir, path) = temp_db("floor.db");
    let mut conn = raw(&path, Synchronous::Normal);
    conn.execute_batch(
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY, status INTEGER NOT NULL, due INTEGER, body TEXT NOT NULL);
         CREATE INDEX jobs_due ON jobs (due) WHERE due IS NOT NULL;",
    )
    .unwrap();
    {
        let tx = conn.transaction().unwrap();
        let mut insert = tx
            .prepare("INSERT INTO jobs (status, due, body) VALUES (0, ?1, ?2)")
            .unwrap();
        for i in 0..n {
            insert
                .execute(params![i as i64, format!("reply {i}")])
                .unwrap();
        }
        drop(insert);
        tx.commit().unwrap();
    }
    settle(&conn);
    let start = Instant::now();
    let mut done = 0;
    while done < n {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let ids: Vec<i64> = {
            let mut pick = tx
                .prepare_cached(
                    "SELECT id FROM jobs WHERE due IS NOT NULL AND due <= ?1 ORDER BY due LIMIT ?2",
                )
                .unwrap();
            let rows = pick
                .query_map(params![i64::MAX, batch as i64], |r| r.get(0))
                .unwrap();
            rows.map(Result::unwrap).collect()
        };
        for id in &ids {
            tx.prepare_cached("UPDATE jobs SET status = 1, due = ?2 WHERE id = ?1")
                .unwrap()
                .execute(params![id, 1_i64 << 50])
                .unwrap();
        }
        tx.commit().unwrap();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        for id in &ids {
            tx.prepare_cached("UPDATE jobs SET status = 2, due = NULL WHERE id = ?1")
                .unwrap()
                .execute([id])
                .unwrap();
        }
        tx.commit().unwrap();
        done += ids.len() as u64;
    }
    per_s(n, start.elapsed())
}

/// The models: the crate's semantics written by hand in raw SQL on the leanest schema
/// that keeps them — one row per 1-chunk reply (no separate chunk row), a lane index, a
/// claim index, `messages` with its unique key, lane pauses, a per-channel counter. What
/// any implementation of these semantics pays before its own overhead.
const MODEL_SCHEMA: &str = "
    CREATE TABLE d (id INTEGER PRIMARY KEY, uid TEXT NOT NULL, channel TEXT NOT NULL,
        chat_id TEXT NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        due_at INTEGER, token INTEGER, created_at INTEGER NOT NULL, finished_at INTEGER,
        text TEXT NOT NULL);
    CREATE INDEX d_lane ON d (channel, chat_id, status, id) WHERE status <> 'delivered';
    CREATE INDEX d_due ON d (due_at) WHERE due_at IS NOT NULL;
    CREATE TABLE messages (id INTEGER PRIMARY KEY, delivery_id TEXT NOT NULL UNIQUE,
        channel TEXT NOT NULL, chat_id TEXT NOT NULL, content TEXT NOT NULL,
        delivered_at INTEGER NOT NULL);
    CREATE TABLE pauses (channel TEXT, chat_id TEXT, until INTEGER NOT NULL,
        PRIMARY KEY (channel, chat_id)) WITHOUT ROWID;
    CREATE TABLE stats (channel TEXT PRIMARY KEY, delivered INTEGER NOT NULL) WITHOUT ROWID;";

/// Model of (a): per transaction, is the chat's lane busy, is it paused, and the row
/// (due at once if the lane is free).
fn model_enqueue(n: u64) -> f64 {
    let (_dir, path) = temp_db("model.db");
    let mut conn = raw(&path, Synchronous::Normal);
    conn.execute_batch(MODEL_SCHEMA).unwrap();
    let chats = n / PER_CHAT;
    let start = Instant::now();
    for i in 0..n {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let chat = format!("chat-{}", i % chats);
        let busy = tx
            .prepare_cached(
                "SELECT 1 FROM d WHERE channel = 'bench' AND chat_id = ?1
                   AND status IN ('pending', 'sending') AND status <> 'delivered' LIMIT 1",
            )
            .unwrap()
            .exists([&chat])
            .unwrap();
        let paused: Option<i64> = tx
            .prepare_cached("SELECT until FROM pauses WHERE channel = 'bench' AND chat_id = ?1")
            .unwrap()
            .query_row([&chat], |r| r.get(0))
            .ok();
        let due = (!busy).then(|| paused.unwrap_or(0).max(i as i64));
        tx.prepare_cached(
            "INSERT INTO d (uid, channel, chat_id, status, due_at, created_at, text)
             VALUES (?1, 'bench', ?2, ?3, ?4, ?5, ?6)",
        )
        .unwrap()
        .execute(params![
            format!("{:032x}", fastrand::u128(..)),
            chat,
            if busy { "queued" } else { "pending" },
            due,
            i as i64,
            format!("reply {i}")
        ])
        .unwrap();
        tx.commit().unwrap();
    }
    per_s(n, start.elapsed())
}

/// Model of (b), draining the same lane shape: claim 64 with lease and token, then per
/// chunk an ack fenced by the token, the `messages` row, and the chat's next queued
/// reply made due; one counter update per batch.
fn model_dispatch(n: u64) -> f64 {
    let (_dir, path) = temp_db("model.db");
    let mut conn = raw(&path, Synchronous::Normal);
    conn.execute_batch(MODEL_SCHEMA).unwrap();
    let chats = (n / PER_CHAT) as i64;
    {
        let tx = conn.transaction().unwrap();
        for i in 0..n as i64 {
            let active = i < chats;
            tx.execute(
                "INSERT INTO d (uid, channel, chat_id, status, due_at, created_at, text)
                 VALUES (?1, 'bench', ?2, ?3, ?4, 0, ?5)",
                params![
                    format!("{i:032x}"),
                    format!("chat-{}", i % chats),
                    if active { "pending" } else { "queued" },
                    active.then_some(i),
                    format!("reply {i}")
                ],
            )
            .unwrap();
        }
        tx.commit().unwrap();
    }
    settle(&conn);
    let start = Instant::now();
    let (mut done, mut now) = (0, n as i64);
    while done < n {
        now += 1;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        // What a worker is handed: the id and everything needed to send.
        let due: Vec<(i64, String, String, String)> = tx
            .prepare_cached(
                "SELECT id, channel, chat_id, text FROM d
                 WHERE due_at IS NOT NULL AND due_at <= ?1 ORDER BY due_at LIMIT 64",
            )
            .unwrap()
            .query_map([now], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let claimed: Vec<(i64, i64)> = due
            .into_iter()
            .map(|(id, ..)| {
                let token = fastrand::i64(..);
                tx.prepare_cached(
                    "UPDATE d SET status = 'sending', attempts = attempts + 1, due_at = ?2,
                     token = ?3 WHERE id = ?1",
                )
                .unwrap()
                .execute(params![id, now + 30_000, token])
                .unwrap();
                (id, token)
            })
            .collect();
        tx.commit().unwrap();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        for (id, token) in &claimed {
            let (channel, chat): (String, String) = tx
                .prepare_cached(
                    "UPDATE d SET status = 'delivered', due_at = NULL, token = NULL, finished_at = ?3
                     WHERE id = ?1 AND token = ?2 AND status = 'sending' RETURNING channel, chat_id",
                )
                .unwrap()
                .query_row(params![id, token, now], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap();
            tx.prepare_cached(
                "INSERT INTO messages (delivery_id, channel, chat_id, content, delivered_at)
                 SELECT uid, channel, chat_id, text, ?2 FROM d WHERE id = ?1",
            )
            .unwrap()
            .execute(params![id, now])
            .unwrap();
            tx.prepare_cached(
                "UPDATE d SET status = 'pending', due_at = ?3 WHERE id = (
                     SELECT id FROM d WHERE channel = ?1 AND chat_id = ?2 AND status = 'queued'
                       AND status <> 'delivered' ORDER BY id LIMIT 1)",
            )
            .unwrap()
            .execute(params![channel, chat, now])
            .unwrap();
        }
        tx.prepare_cached(
            "INSERT INTO stats (channel, delivered) VALUES ('bench', ?1)
             ON CONFLICT (channel) DO UPDATE SET delivered = delivered + excluded.delivered",
        )
        .unwrap()
        .execute([claimed.len() as i64])
        .unwrap();
        tx.commit().unwrap();
        done += claimed.len() as u64;
    }
    per_s(n, start.elapsed())
}

fn options(sync: Synchronous) -> OutboxOptions {
    OutboxOptions::default().with_synchronous(sync)
}

/// Queue depth per chat in every setup: the same lane shape at every size, so the
/// scaling ratios compare sizes, not shapes (a deeper queue means more lane activations
/// per chunk).
const PER_CHAT: u64 = 10;

fn reply(n: u64, chats: u64) -> NewDelivery {
    let chat = format!("chat-{}", n % chats.max(1));
    NewDelivery::single("bench", chat, format!("reply {n}"))
}

/// (a) 1-chunk deliveries, one `enqueue` (one transaction) each.
fn crate_enqueue(n: u64, sync: Synchronous) -> f64 {
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(sync)).unwrap();
    let start = Instant::now();
    for i in 0..n {
        outbox.enqueue(&reply(i, n / PER_CHAT)).unwrap();
    }
    per_s(n, start.elapsed())
}

/// Enqueues `n` replies quickly, `PER_CHAT` to a chat: many per transaction through
/// `enqueue_in` (setup only).
fn bulk_enqueue(path: &std::path::Path, outbox: &Outbox, from: u64, n: u64) {
    let mut conn = raw(path, Synchronous::Normal);
    let mut i = from;
    while i < from + n {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        for j in i..(i + 10_000).min(from + n) {
            outbox.enqueue_in(&tx, &reply(j, n / PER_CHAT)).unwrap();
        }
        tx.commit().unwrap();
        i += 10_000;
    }
}

/// A no-op platform that counts what it was handed.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicU64>);

impl ChannelAdapter for Counter {
    fn send(&self, _claim: &Claim) -> Outcome {
        self.0.fetch_add(1, Ordering::Relaxed);
        Outcome::delivered(None)
    }
}

/// Sends a worker has in flight at once in the dispatch measures: each round claims 64,
/// sends them concurrently and records them with the next claim, as a fast platform
/// allows.
const BATCH: usize = 64;

/// Runs a dispatcher until `n` more deliveries are finalized; chunks per second.
fn drain(outbox: &Outbox, n: u64) -> f64 {
    drain_with(outbox, n, BATCH)
}

/// As [`drain`], with `batch` sends in flight per round.
fn drain_with(outbox: &Outbox, n: u64, batch: usize) -> f64 {
    let running = Dispatcher::builder(outbox.clone())
        .adapter("bench", Counter::default())
        .workers(1)
        .batch_size(batch)
        .build()
        .unwrap()
        .start()
        .unwrap();
    let elapsed = time_until(n, || running.stats().finalized);
    running.shutdown(Duration::from_secs(10));
    per_s(n, elapsed)
}

/// The time until `finalized()` reaches `n`, looked at every millisecond.
fn time_until(n: u64, finalized: impl Fn() -> u64) -> Duration {
    let start = Instant::now();
    while finalized() < n {
        std::thread::sleep(Duration::from_millis(1));
    }
    start.elapsed()
}

/// (b) end to end through the dispatcher, draining a backlog.
fn crate_dispatch(backlog: u64, sync: Synchronous) -> f64 {
    crate_dispatch_with(backlog, sync, BATCH)
}

fn crate_dispatch_with(backlog: u64, sync: Synchronous, batch: usize) -> f64 {
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(sync)).unwrap();
    bulk_enqueue(&path, &outbox, 0, backlog);
    let _ = outbox.checkpoint();
    drain_with(&outbox, backlog, batch)
}

/// The peer harness's message shape (`../shared/peers`): a 100-byte text to chat
/// `i % 1000`, one chunk.
fn peer_reply(i: u64) -> NewDelivery {
    let text: String = format!("{i:>10}")
        .chars()
        .chain("x".repeat(90).chars())
        .collect();
    NewDelivery::single("bench", format!("chat-{}", i % 1000), text)
}

/// (h) The peer harness's `insert_1_per_txn` and `insert_batch100_per_txn` through the
/// crate's API: `enqueue` each, and `enqueue_batch` of 100.
fn peer_inserts(n: u64) -> (f64, f64) {
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
    let start = Instant::now();
    for i in 0..n {
        outbox.enqueue(&peer_reply(i)).unwrap();
    }
    let one = per_s(n, start.elapsed());
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
    let start = Instant::now();
    for from in (0..n).step_by(100) {
        let batch: Vec<NewDelivery> = (from..(from + 100).min(n)).map(peer_reply).collect();
        outbox.enqueue_batch(&batch).unwrap();
    }
    (one, per_s(n, start.elapsed()))
}

/// (h) The peer harness's `claim_ack_batch64` through the crate's API: a prefilled
/// backlog, `claim(64)` then `record_batch` of 64 acks, until drained.
fn peer_claim_ack_batch64(n: u64) -> f64 {
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
    for from in (0..n).step_by(1000) {
        let batch: Vec<NewDelivery> = (from..(from + 1000).min(n)).map(peer_reply).collect();
        outbox.enqueue_batch(&batch).unwrap();
    }
    let _ = outbox.checkpoint();
    let start = Instant::now();
    let mut done = 0;
    while done < n {
        let claims = outbox.claim(64).unwrap();
        assert!(!claims.is_empty());
        let results = outbox
            .record_batch(claims.iter().map(|c| (c, Outcome::delivered(None))))
            .unwrap();
        done += results.len() as u64;
    }
    per_s(n, start.elapsed())
}

/// (b2) What marking sends as started costs the dispatcher: the same drain as (b) —
/// claim 64, send, record — by a plain loop on the crate's API that calls the adapter
/// for each claim in turn, as a dispatcher that did not keep "a claim is a send in
/// flight" would (no concurrent sends, no lease check, no keeper, outcomes in their own
/// transaction). Chunks per second.
fn unmarked_dispatch(backlog: u64) -> f64 {
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
    bulk_enqueue(&path, &outbox, 0, backlog);
    let _ = outbox.checkpoint();
    let adapter = Counter::default();
    let start = Instant::now();
    let mut done = 0;
    while done < backlog {
        let claims = outbox.claim(BATCH).unwrap();
        let outcomes: Vec<_> = claims.iter().map(|c| (c, adapter.send(c))).collect();
        done += outbox.record_batch(outcomes).unwrap().len() as u64;
    }
    per_s(backlog, start.elapsed())
}

/// A send's simulated network round trip in (i).
const ROUND_TRIP: Duration = Duration::from_millis(50);

/// A platform that takes [`ROUND_TRIP`] to answer each send (blocking).
#[derive(Clone, Default)]
struct Distant;

impl ChannelAdapter for Distant {
    fn send(&self, _claim: &Claim) -> Outcome {
        std::thread::sleep(ROUND_TRIP);
        Outcome::delivered(None)
    }
}

/// The same platform for the async dispatcher.
struct DistantAsync;

impl AsyncChannelAdapter for DistantAsync {
    fn send<'a>(&'a self, _claim: &'a Claim) -> SendFuture<'a, Outcome> {
        Box::pin(async {
            tokio::time::sleep(ROUND_TRIP).await;
            Outcome::delivered(None)
        })
    }
}

/// (i) Sends that each take [`ROUND_TRIP`], to 1,000 chats, `concurrency` in flight
/// (workers × batch): achieved sends/s ÷ (concurrency ÷ round trip). Enough work for
/// `seconds` at the ideal rate.
fn latency_bound(concurrency: usize, asynchronous: bool, seconds: f64) -> f64 {
    let ideal = concurrency as f64 / ROUND_TRIP.as_secs_f64();
    let n = (ideal * seconds) as u64;
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
    for from in (0..n).step_by(1000) {
        let batch: Vec<NewDelivery> = (from..(from + 1000).min(n)).map(peer_reply).collect();
        outbox.enqueue_batch(&batch).unwrap();
    }
    let _ = outbox.checkpoint();
    // Rounds of at most 16 sends: each round of a worker waits for that worker's own
    // record-and-claim transaction, which grows with the round, before its sends
    // start. Rounds of 32 ran 256 in flight at 0.87–0.92 of the ideal, rounds of 16 at
    // 0.93–0.95, in runs side by side.
    let workers = concurrency.div_ceil(16);
    let batch = concurrency / workers;
    let elapsed = if asynchronous {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let _guard = runtime.enter();
        let running = AsyncDispatcher::builder(outbox.clone())
            .adapter("bench", DistantAsync)
            .workers(workers)
            .batch_size(batch)
            .build()
            .unwrap()
            .start()
            .unwrap();
        let elapsed = time_until(n, || running.stats().finalized);
        runtime.block_on(running.shutdown(Duration::from_secs(10)));
        elapsed
    } else {
        let running = Dispatcher::builder(outbox.clone())
            .adapter("bench", Distant)
            .workers(workers)
            .batch_size(batch)
            .build()
            .unwrap()
            .start()
            .unwrap();
        let elapsed = time_until(n, || running.stats().finalized);
        running.shutdown(Duration::from_secs(10));
        elapsed
    };
    per_s(n, elapsed) / ideal
}

/// (j) The platform's limits, as [Telegram's](https://core.telegram.org/bots/faq#my-bot-is-hitting-limits-how-do-i-avoid-this)
/// are shaped, with the channel-wide one scaled up: at most `RATE` messages a second
/// per bot and one a second per chat, each enforced as a generic cell rate algorithm
/// (GCRA) on arrival times with a tolerance of [`TOLERANCE`] for network jitter. A
/// message beyond either is refused with 429 and not counted.
const PLATFORM_RATE: f64 = 200.0;
const CHAT_INTERVAL: Duration = Duration::from_secs(1);
const TOLERANCE: Duration = Duration::from_millis(50);

/// One GCRA: the theoretical arrival time of the next conforming message.
#[derive(Default)]
struct Gcra(Option<Instant>);

impl Gcra {
    fn conforms(&self, at: Instant) -> bool {
        self.0.is_none_or(|tat| at + TOLERANCE >= tat)
    }

    fn count(&mut self, at: Instant, interval: Duration) {
        let tat = self.0.map_or(at, |tat| tat.max(at));
        self.0 = Some(tat + interval);
    }
}

/// The simulated platform's books: the bot's limiter, one per chat, what it accepted
/// (arrival times) and how many it refused.
#[derive(Default)]
struct Books {
    bot: Gcra,
    chats: std::collections::HashMap<String, Gcra>,
    accepted: Vec<Instant>,
    refused: u64,
}

/// Serves the platform on 127.0.0.1 for the rest of the process's life; each answer
/// takes [`ROUND_TRIP`], judged at arrival. Returns its address and the books.
fn serve_platform() -> (String, Arc<std::sync::Mutex<Books>>) {
    let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
    let addr = server.server_addr().to_ip().unwrap().to_string();
    let books = Arc::new(std::sync::Mutex::new(Books::default()));
    let interval = Duration::from_secs_f64(1.0 / PLATFORM_RATE);
    for _ in 0..48 {
        let (server, books) = (server.clone(), books.clone());
        std::thread::spawn(move || {
            while let Ok(mut request) = server.recv() {
                let at = Instant::now();
                let mut chat = String::new();
                let _ = std::io::Read::read_to_string(request.as_reader(), &mut chat);
                let accepted = {
                    let mut b = books.lock().unwrap();
                    let b = &mut *b;
                    let lane = b.chats.entry(chat).or_default();
                    let ok = b.bot.conforms(at) && lane.conforms(at);
                    if ok {
                        b.bot.count(at, interval);
                        lane.count(at, CHAT_INTERVAL);
                        b.accepted.push(at);
                    } else {
                        b.refused += 1;
                    }
                    ok
                };
                std::thread::sleep(ROUND_TRIP.saturating_sub(at.elapsed()));
                let (status, body) = if accepted {
                    (200, r#"{"ok":true,"result":{"message_id":1}}"#)
                } else {
                    (
                        429,
                        r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 1","parameters":{"retry_after":1}}"#,
                    )
                };
                let _ = request
                    .respond(tiny_http::Response::from_string(body).with_status_code(status));
            }
        });
    }
    (addr, books)
}

/// A Telegram-shaped adapter that posts each chunk's chat to the simulated platform
/// and maps its answer with the crate's Telegram mapping.
struct Platform {
    url: String,
    client: reqwest::blocking::Client,
}

impl ChannelAdapter for Platform {
    fn send(&self, claim: &Claim) -> Outcome {
        match self
            .client
            .post(&self.url)
            .body(claim.chat_id.clone())
            .send()
        {
            Ok(reply) => {
                let status = reply.status().as_u16();
                let body = reply.text().unwrap_or_default();
                chunked_outbox::platforms::telegram::outcome(
                    &chunked_outbox::platforms::HttpReply::new(status, &body),
                )
            }
            Err(e) => Outcome::Ambiguous {
                error: e.to_string(),
            },
        }
    }
}

/// Workers per dispatcher process in (j): with one send per claim on a paced channel
/// and [`ROUND_TRIP`] per send, 2 × 8 in flight allow 320/s, above the limit.
const DRAIN_WORKERS: usize = 8;

/// A dispatcher process of (j): serves `db` against the platform at `addr` until
/// nothing is left to send.
fn drain_child(db: &str, addr: &str) {
    let outbox = open_target(db);
    let adapter = Platform {
        url: format!("http://{addr}/send"),
        client: reqwest::blocking::Client::builder()
            .pool_max_idle_per_host(DRAIN_WORKERS)
            .build()
            .unwrap(),
    };
    let running = Dispatcher::builder(outbox.clone())
        .adapter("telegram", adapter)
        .workers(DRAIN_WORKERS)
        .build()
        .unwrap()
        .start()
        .unwrap();
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let t = outbox.health().unwrap().totals;
        if t.pending_chunks + t.retry_chunks + t.sending_chunks == 0 {
            break;
        }
    }
    running.shutdown(Duration::from_secs(10));
}

/// The outbox of (j) at `target`: a file, or (feature `postgres`) a PostgreSQL URL.
fn open_target(target: &str) -> Outbox {
    #[cfg(feature = "postgres")]
    if target.starts_with("postgres") {
        return Outbox::connect(target, options(Synchronous::Normal)).unwrap();
    }
    Outbox::open(target, options(Synchronous::Normal)).unwrap()
}

/// (j) `replies` replies to `chats` chats drained by two dispatcher processes sharing
/// the outbox — a file, or with `server` a fresh schema of that PostgreSQL database —
/// under the platform's limits, with the limits stored as the channel's rules
/// (`PLATFORM_RATE` a second, one a second per chat). Returns the accepted messages a
/// second over the span from the first to the last ÷ `PLATFORM_RATE`, and the number
/// of 429 answers.
fn platform_drain(replies: u64, chats: u64, server: Option<&str>) -> (f64, u64) {
    let (_dir, path) = temp_db("outbox.db");
    let target = match server {
        #[cfg(not(feature = "postgres"))]
        Some(_) => unreachable!("a PostgreSQL drain needs the postgres feature"),
        #[cfg(feature = "postgres")]
        Some(url) => {
            let schema = format!("throughput_drain_{}", std::process::id());
            let mut admin = postgres::Client::connect(url, postgres::NoTls).unwrap();
            admin
                .batch_execute(&format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
                ))
                .unwrap();
            let sep = if url.contains('?') { '&' } else { '?' };
            format!("{url}{sep}options=-c%20search_path%3D{schema}")
        }
        None => path.to_str().unwrap().to_owned(),
    };
    let outbox = open_target(&target);
    let rules = chunked_outbox::rules::ChannelPolicy::default()
        .with_lane_interval(CHAT_INTERVAL)
        .with_rate_per_second(PLATFORM_RATE);
    outbox.set_channel_policy("telegram", Some(rules)).unwrap();
    for from in (0..replies).step_by(1000) {
        let batch: Vec<NewDelivery> = (from..(from + 1000).min(replies))
            .map(|i| NewDelivery::single("telegram", format!("{}", i % chats), "hi"))
            .collect();
        outbox.enqueue_batch(&batch).unwrap();
    }
    let (addr, books) = serve_platform();
    let children: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--drain-child", &target, &addr])
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        assert!(
            child.wait().unwrap().success(),
            "a dispatcher process failed"
        );
    }
    let t = outbox.health().unwrap().totals;
    assert_eq!(t.delivered_deliveries, replies, "every reply delivered");
    let b = books.lock().unwrap();
    assert_eq!(b.accepted.len() as u64, replies, "each accepted once");
    let span = *b.accepted.last().unwrap() - b.accepted[0];
    // n messages span n - 1 intervals.
    let rate = (replies - 1) as f64 / span.as_secs_f64();
    (rate / PLATFORM_RATE, b.refused)
}

/// (g) A claim filtered by channel, and `next_due`, beside `backlog` chunks of another
/// channel that are all due: the µs each takes with that backlog and without it. The
/// claim index is searched per channel, so the other backlog should cost nothing.
fn filtered_claim(backlog: u64, claims: u64) -> (f64, f64, f64, f64) {
    let measure = |other: u64| {
        let (_dir, path) = temp_db("outbox.db");
        let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
        let mut conn = raw(&path, Synchronous::Normal);
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        for n in 0..other {
            let chat = format!("chat-{n}"); // one reply per chat: every one is due
            outbox
                .enqueue_in(&tx, &NewDelivery::single("other", chat, "waiting"))
                .unwrap();
        }
        for n in 0..claims {
            let chat = format!("chat-{n}");
            outbox
                .enqueue_in(&tx, &NewDelivery::single("telegram", chat, "hi"))
                .unwrap();
        }
        tx.commit().unwrap();
        settle(&conn);
        let start = Instant::now();
        for _ in 0..claims {
            let claim = outbox
                .claim_channels(&["telegram"], 1)
                .unwrap()
                .pop()
                .unwrap();
            outbox.release(&claim).unwrap();
        }
        let claim_us = start.elapsed().as_secs_f64() * 1e6 / claims as f64;
        let start = Instant::now();
        for _ in 0..claims {
            outbox.next_due(Some(&["telegram"])).unwrap();
        }
        let next_us = start.elapsed().as_secs_f64() * 1e6 / claims as f64;
        (claim_us, next_us)
    };
    let (quiet_claim, quiet_next) = measure(0);
    let (busy_claim, busy_next) = measure(backlog);
    (quiet_claim, busy_claim, quiet_next, busy_next)
}

/// What (c) and (d) measured.
struct Scaling {
    /// Dispatch with the big history and backlog ÷ with 1k of each, every drain charged
    /// with its write-back (the checkpoint after it).
    backlog_ratio: f64,
    /// The same without the write-back.
    drain_only_ratio: f64,
    /// Health with the big history ÷ with 1k, in time.
    health_ratio: f64,
    /// Dispatch rates with write-back, 1k and big.
    small_rate: f64,
    big_rate: f64,
}

/// (c) and (d): history and backlog of `size` against 1k of each.
fn scaling(size: u64, drained: u64) -> Scaling {
    let setup = |history: u64| {
        let (dir, path) = temp_db("outbox.db");
        let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
        bulk_enqueue(&path, &outbox, 0, history);
        drain(&outbox, history);
        (dir, path, outbox)
    };
    let (_small_dir, small_path, small) = setup(1_000);
    let (_big_dir, big_path, big) = setup(size);
    // Health with history only (it reads unfinished work, which a backlog is), both
    // checkpointed, calls alternating between the two; median of 101 each.
    let _ = (small.checkpoint(), big.checkpoint());
    let time = |outbox: &Outbox| {
        let start = Instant::now();
        outbox.health().unwrap();
        start.elapsed()
    };
    let (mut small_times, mut big_times): (Vec<_>, Vec<_>) =
        (0..101).map(|_| (time(&small), time(&big))).unzip();
    small_times.sort();
    big_times.sort();
    let (small_health, big_health) = (small_times[50], big_times[50]);
    bulk_enqueue(&big_path, &big, size, size);
    // Dispatch, alternating so both see the same machine. A round drains a fresh 1k
    // backlog of the small one `SMALL_DRAINS` times (one 1k drain takes some 30 ms,
    // too short to time alone on a shared machine), then a fifth of `drained` from the
    // big backlog. Each drain starts from a checkpointed WAL, so a setup's bulk load
    // does not leave its checkpoint work to the measurement. A first, shorter round
    // (a twentieth of `drained` from the big one) warms both writers' page caches,
    // which the bulk loads (on another connection) emptied, as a running dispatcher's
    // never is; it is not counted. Then nine rounds, medians (with five, two slow
    // rounds of either file decided a run).
    //
    // Each drain is charged with copying what it wrote into the database file: the
    // checkpoint after it is timed. A 1k drain never fills the WAL to SQLite's
    // checkpoint bound, while a long one pays for its checkpoints as it goes, so
    // leaving the last one out charged the big file alone for getting its writes home.
    // The ratio without it is reported beside.
    let timed_drain = |outbox: &Outbox, n: u64| {
        let draining = Duration::from_secs_f64(n as f64 / drain(outbox, n));
        let start = Instant::now();
        let _ = outbox.checkpoint();
        (draining, draining + start.elapsed())
    };
    const SMALL_DRAINS: u64 = 4;
    // Rates per round: (drain only, with write-back), small and big.
    let (mut small_rates, mut big_rates) = (Vec::new(), Vec::new());
    let mut loaded = 1_000;
    for round in 0..10 {
        let mut small_times = (Duration::ZERO, Duration::ZERO);
        for _ in 0..SMALL_DRAINS {
            bulk_enqueue(&small_path, &small, loaded, 1_000);
            loaded += 1_000;
            let _ = small.checkpoint();
            let (draining, total) = timed_drain(&small, 1_000);
            small_times = (small_times.0 + draining, small_times.1 + total);
        }
        let _ = big.checkpoint();
        let n = drained / if round == 0 { 20 } else { 5 };
        let (draining, total) = timed_drain(&big, n);
        if round > 0 {
            let small_n = 1_000 * SMALL_DRAINS;
            small_rates.push((per_s(small_n, small_times.0), per_s(small_n, small_times.1)));
            big_rates.push((per_s(n, draining), per_s(n, total)));
        }
    }
    let middle = |rates: &[(f64, f64)], pick: fn(&(f64, f64)) -> f64| {
        let mut rates: Vec<f64> = rates.iter().map(pick).collect();
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    };
    let (small_rate, big_rate) = (middle(&small_rates, |r| r.1), middle(&big_rates, |r| r.1));
    Scaling {
        backlog_ratio: big_rate / small_rate,
        drain_only_ratio: middle(&big_rates, |r| r.0) / middle(&small_rates, |r| r.0),
        health_ratio: big_health.as_secs_f64() / small_health.as_secs_f64(),
        small_rate,
        big_rate,
    }
}

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// (e) enqueue → send latency with an idle dispatcher in the same process.
fn latency(samples: usize) -> (u128, u128) {
    #[derive(Clone, Default)]
    struct Stopwatch(Arc<std::sync::Mutex<Vec<u128>>>);
    impl ChannelAdapter for Stopwatch {
        fn send(&self, claim: &Claim) -> Outcome {
            let sent: u128 = claim.text.parse().unwrap();
            self.0.lock().unwrap().push(now_us() - sent);
            Outcome::delivered(None)
        }
    }
    let (_dir, path) = temp_db("outbox.db");
    let outbox = Outbox::open(&path, options(Synchronous::Normal)).unwrap();
    let stopwatch = Stopwatch::default();
    let running = Dispatcher::builder(outbox.clone())
        .adapter("bench", stopwatch.clone())
        .workers(1)
        .build()
        .unwrap()
        .start()
        .unwrap();
    for i in 0..samples {
        outbox
            .enqueue(&NewDelivery::single(
                "bench",
                format!("c{i}"),
                now_us().to_string(),
            ))
            .unwrap();
        std::thread::sleep(Duration::from_millis(2)); // let it go idle again
    }
    while stopwatch.0.lock().unwrap().len() < samples {
        std::thread::sleep(Duration::from_millis(1));
    }
    running.shutdown(Duration::from_secs(10));
    let mut l = stopwatch.0.lock().unwrap().clone();
    l.sort_unstable();
    (l[l.len() / 2], l[(l.len() * 99 / 100).min(l.len() - 1)])
}

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let s = if quick { QUICK } else { FULL };
    // For profiling: `--only enqueue` or `--only dispatch` runs just that part.
    let only: Option<String> = std::env::args().skip_while(|a| a != "--only").nth(1);
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, db, addr] = &args[..]
        && flag == "--drain-child"
    {
        return drain_child(db, addr);
    }
    match only.as_deref() {
        Some("enqueue") => {
            return println!(
                "enqueue {:.0} /s",
                crate_enqueue(s.enqueues * 4, Synchronous::Normal)
            );
        }
        Some("dispatch") => {
            return println!(
                "dispatch {:.0} /s",
                crate_dispatch(s.dispatch_backlog * 5, Synchronous::Normal)
            );
        }
        Some("filtered") => {
            let (quiet, busy, quiet_next, busy_next) = filtered_claim(100_000, 1_000);
            return println!(
                "filtered claim {quiet:.1} µs alone, {busy:.1} µs beside 100k; next_due {quiet_next:.1} / {busy_next:.1} µs"
            );
        }
        Some("peers") => {
            let (one, batch) = peer_inserts(s.enqueues * 4);
            let claim_ack = peer_claim_ack_batch64(s.enqueues * 4);
            return println!(
                "insert_1 {one:.0} /s, insert_batch100 {batch:.0} /s, claim_ack_batch64 {claim_ack:.0} /s"
            );
        }
        Some("claim_ack64") => {
            return println!(
                "claim_ack_batch64 {:.0} /s",
                peer_claim_ack_batch64(s.enqueues * 10)
            );
        }
        Some("insert1") => {
            return println!("insert_1 {:.0} /s", peer_inserts(s.enqueues * 10).0);
        }
        Some("marking") => {
            for _ in 0..3 {
                let marked = crate_dispatch(s.dispatch_backlog, Synchronous::Normal);
                let unmarked = unmarked_dispatch(s.dispatch_backlog);
                println!(
                    "dispatcher {marked:.0} /s, unmarked loop {unmarked:.0} /s: cost {:.3}",
                    1.0 - marked / unmarked
                );
            }
            return;
        }
        Some("scaling") => {
            let c = scaling(s.big, s.big_drain);
            return println!(
                "dispatch {:.0} /s vs {:.0} /s: ratio {:.3} ({:.3} without write-back); health ratio {:.3}",
                c.big_rate, c.small_rate, c.backlog_ratio, c.drain_only_ratio, c.health_ratio
            );
        }
        Some("latency") => {
            for asynchronous in [false, true] {
                for c in [1, 16, 64, 256] {
                    let e = latency_bound(c, asynchronous, 2.0);
                    println!("latency-bound, concurrency {c}, async {asynchronous}: {e:.3}");
                }
            }
            return;
        }
        Some("drain") => {
            let (e, refused) = platform_drain(2_000, 200, None);
            println!("platform drain, SQLite file: {e:.3} of the limit, {refused} answers 429");
            #[cfg(feature = "postgres")]
            if let Ok(url) = std::env::var("DATABASE_URL") {
                let (e, refused) = platform_drain(2_000, 200, Some(&url));
                println!("platform drain, PostgreSQL: {e:.3} of the limit, {refused} answers 429");
            }
            return;
        }
        Some("dispatch1") => {
            return println!(
                "dispatch, one send in flight {:.0} /s",
                crate_dispatch_with(s.dispatch_backlog, Synchronous::Normal, 1)
            );
        }
        _ => {}
    }
    println!(
        "throughput report ({}), WAL, synchronous=NORMAL unless noted, temp dir on the local disk",
        if quick { "--quick" } else { "full" }
    );

    let f_insert = floor_insert(s.floor_ops);
    let f_single = floor_claim_ack(s.floor_ops, 1);
    let f_batch = floor_claim_ack(s.floor_ops * 5, 64);
    let model_in = model_enqueue(s.enqueues);
    let model = model_dispatch(s.dispatch_backlog);
    println!("floor: single-row insert per transaction       {f_insert:>10.0} /s");
    println!("floor: claim 1 + ack 1 per transaction          {f_single:>10.0} /s");
    println!("floor: claim 64 + ack 64 per transaction        {f_batch:>10.0} /s");
    println!(
        "model: enqueue semantics by hand, raw SQL        {model_in:>10.0} /s   {:.2} of floor",
        model_in / f_insert
    );
    println!(
        "model: dispatch semantics by hand, raw SQL       {model:>10.0} /s   {:.2} of floor",
        model / f_batch
    );

    let enqueue = crate_enqueue(s.enqueues, Synchronous::Normal);
    println!(
        "(a) enqueue, 1 chunk, one per transaction       {enqueue:>10.0} /s   {:.2} of floor",
        enqueue / f_insert
    );
    println!("    {:.2} of the hand-written model", enqueue / model_in);
    let dispatch = crate_dispatch(s.dispatch_backlog, Synchronous::Normal);
    println!(
        "(b) dispatch {}-chunk backlog, 1 worker, batch 64 {dispatch:>10.0} /s   {:.2} of floor",
        s.dispatch_backlog,
        dispatch / f_batch
    );
    println!("    {:.2} of the hand-written model", dispatch / model);
    // What "a crash leaves at most one possibly-sent chunk per send in flight" costs a
    // worker that sends one chunk at a time: a commit per send.
    let one = crate_dispatch_with(s.dispatch_backlog / 4, Synchronous::Normal, 1);
    println!(
        "(b1) the same, one send in flight (batch 1)      {one:>10.0} /s   {:.2} of (b)",
        one / dispatch
    );
    let unmarked = unmarked_dispatch(s.dispatch_backlog);
    let marking_cost = 1.0 - dispatch / unmarked;
    println!(
        "(b2) the same drain by a loop that sends each claim in turn, nothing marked {unmarked:>10.0} /s: marking sends as started costs {:.1} % of it",
        marking_cost * 100.0
    );
    let (peer_one, peer_batch) = peer_inserts(s.enqueues);
    let peer_claim_ack = peer_claim_ack_batch64(s.enqueues);
    println!(
        "(h) the peer harness's shapes: enqueue {peer_one:.0} /s, enqueue_batch of 100 {peer_batch:.0} /s, claim(64) + record_batch {peer_claim_ack:.0} /s"
    );
    let seconds = if quick { 2.0 } else { 3.0 };
    let mut latency_cases = Vec::new();
    for asynchronous in [false, true] {
        for c in [1, 16, 64, 256] {
            latency_cases.push((asynchronous, c, latency_bound(c, asynchronous, seconds)));
        }
    }
    let latency_efficiency = latency_cases
        .iter()
        .map(|c| c.2)
        .fold(f64::INFINITY, f64::min);
    for (asynchronous, c, e) in &latency_cases {
        println!(
            "(i) sends of {} ms, {c:>3} in flight, {}: {e:.3} of concurrency ÷ round trip",
            ROUND_TRIP.as_millis(),
            if *asynchronous {
                "async   "
            } else {
                "blocking"
            }
        );
    }
    let (replies, chats) = if quick { (2_000, 200) } else { (6_000, 600) };
    let (platform_efficiency, platform_429s) = platform_drain(replies, chats, None);
    println!(
        "(j) {replies} replies to {chats} chats, two dispatcher processes, platform limits {PLATFORM_RATE}/s and 1/s per chat: {platform_efficiency:.3} of the limit, {platform_429s} answers 429"
    );
    let Scaling {
        backlog_ratio,
        drain_only_ratio,
        health_ratio,
        small_rate,
        big_rate,
    } = scaling(s.big, s.big_drain);
    println!(
        "(c) dispatch with {} history + backlog: {big_rate:.0} /s vs {small_rate:.0} /s with 1k, each drain with its write-back: ratio {backlog_ratio:.2} ({drain_only_ratio:.2} without)",
        s.big
    );
    println!(
        "(d) health with {} vs 1k rows of history: time ratio {health_ratio:.2}",
        s.big
    );
    let (quiet_claim, busy_claim, quiet_next, busy_next) = filtered_claim(100_000, 1_000);
    println!(
        "(g) claim of one channel (claim + release): {quiet_claim:.1} µs alone, {busy_claim:.1} µs beside 100k due chunks of another channel; next_due {quiet_next:.1} µs / {busy_next:.1} µs"
    );
    let (p50, p99) = latency(s.latency_samples);
    println!("(e) enqueue → send latency, idle dispatcher: p50 {p50} µs, p99 {p99} µs");
    let full_enqueue = crate_enqueue(s.enqueues / 4, Synchronous::Full);
    let full_dispatch = crate_dispatch(s.dispatch_backlog / 4, Synchronous::Full);
    println!("(f) synchronous=FULL: enqueue {full_enqueue:.0} /s, dispatch {full_dispatch:.0} /s");
    let rss = peak_rss_mb();
    println!("peak RSS {rss:.0} MB");
    println!(
        "{{\"latency_bound_efficiency\":{latency_efficiency:.3},\"latency_bound_cases\":[{}],\"platform_limit_efficiency\":{platform_efficiency:.3},\"platform_429s\":{platform_429s},\"unmarked_dispatch_per_s\":{unmarked:.0},\"start_marking_cost\":{marking_cost:.3},\"peer_insert_1_per_s\":{peer_one:.0},\"peer_enqueue_batch100_per_s\":{peer_batch:.0},\"peer_claim_ack_batch64_per_s\":{peer_claim_ack:.0},\"enqueue_per_s\":{enqueue:.0},\"enqueue_vs_floor\":{:.3},\"dispatch_per_s\":{dispatch:.0},\"dispatch_vs_floor\":{:.3},\"dispatch_one_in_flight_per_s\":{one:.0},\"one_in_flight_vs_batch\":{:.3},\"filtered_claim_us\":{quiet_claim:.1},\"filtered_claim_beside_100k_us\":{busy_claim:.1},\"next_due_us\":{quiet_next:.1},\"next_due_beside_100k_us\":{busy_next:.1},\"backlog_1m_vs_1k\":{backlog_ratio:.3},\"backlog_1m_vs_1k_drain_only\":{drain_only_ratio:.3},\"health_1m_vs_1k\":{health_ratio:.3},\"latency_p50_us\":{p50},\"latency_p99_us\":{p99},\"full_enqueue_per_s\":{full_enqueue:.0},\"full_dispatch_per_s\":{full_dispatch:.0},\"peak_rss_mb\":{rss:.0},\"floor_insert_per_s\":{f_insert:.0},\"floor_claim_ack_1_per_s\":{f_single:.0},\"floor_claim_ack_64_per_s\":{f_batch:.0},\"model_enqueue_per_s\":{model_in:.0},\"enqueue_vs_model\":{:.3},\"model_dispatch_per_s\":{model:.0},\"dispatch_vs_model\":{:.3},\"quick\":{quick}}}",
        latency_cases
            .iter()
            .map(|(a, c, e)| format!("{{\"concurrency\":{c},\"async\":{a},\"efficiency\":{e:.3}}}"))
            .collect::<Vec<_>>()
            .join(","),
        enqueue / f_insert,
        dispatch / f_batch,
        one / dispatch,
        enqueue / model_in,
        dispatch / model
    );
}

//! The console's pages, `/metrics` and the health snapshot beside 1M rows of delivered
//! history and 200k dead letters, against 1k of each: each one's median time, and the
//! ratio, on SQLite and (with the `postgres` feature and `DATABASE_URL`) on PostgreSQL.
//! The history and the dead letters (users who blocked the bot) are made through the
//! API, a thousand replies at a time, spread over the last 30 days (the day's chart
//! reads a thirtieth of them); beside them a few held chats, uncertain parts and dead
//! letters with a reply queued behind, as the pages list them.
//!
//! ```text
//! cargo run --release --features console --example console_scale
//! scripts/with-postgres cargo run --release --features console,postgres --example console_scale
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use chunked_outbox::clock::ManualClock;
use chunked_outbox::console::{Console, Request};
use chunked_outbox::monitoring::{Endpoint, Thresholds};
use chunked_outbox::rules::LaneFailurePolicy;
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

const RUNS: usize = 25;
const DAY_MS: i64 = 86_400_000;
/// Replies enqueued, sent and acknowledged together while filling.
const BATCH: usize = 1_000;

/// An outbox opened by `open` with `history` delivered replies and `dead` dead letters
/// spread over the last 30 days, then the held chats, uncertain parts and dead letters
/// of a bad afternoon.
fn filled(open: impl Fn(OutboxOptions) -> Outbox, history: usize, dead: usize) -> Outbox {
    let now = chrono::Utc::now().timestamp_millis();
    let clock = ManualClock::new(now - 30 * DAY_MS);
    let outbox = open(OutboxOptions::default().with_clock(Arc::new(clock.clone())));
    let mut rules = outbox.rules().unwrap();
    rules.lane_failure = LaneFailurePolicy::Block;
    outbox.set_rules(rules).unwrap();
    let batches = history.div_ceil(BATCH);
    let step = 30 * DAY_MS / batches as i64;
    for b in 0..batches {
        clock.set(now - 30 * DAY_MS + b as i64 * step);
        // Every reply has a caller key, as an engine's turn id: the console finds the
        // oldest by it.
        let replies: Vec<NewDelivery> = (0..BATCH.min(history - b * BATCH))
            .map(|i| {
                NewDelivery::single("telegram", format!("c{i}"), format!("answer {b}/{i}"))
                    .with_idempotency_key(format!("turn-{b}-{i}"))
            })
            .collect();
        outbox.enqueue_batch(&replies).unwrap();
        clock.set(now - 30 * DAY_MS + b as i64 * step + 800);
        let claims = outbox.claim(BATCH).unwrap();
        let acks = claims.iter().map(|c| (c, Outcome::delivered(None)));
        for recorded in outbox.record_batch(acks).unwrap() {
            recorded.unwrap();
        }
        // This stretch's users who blocked the bot: their replies are dead letters.
        let gone = dead / batches + usize::from(b < dead % batches);
        let replies: Vec<NewDelivery> = (0..gone)
            .map(|i| NewDelivery::single("telegram", format!("blocked-{b}-{i}"), "hello?"))
            .collect();
        outbox.enqueue_batch(&replies).unwrap();
        let claims = outbox.claim(gone).unwrap();
        let refused = claims.iter().map(|c| {
            let error = "Forbidden: bot was blocked by the user".to_owned();
            (c, Outcome::Permanent { error })
        });
        for recorded in outbox.record_batch(refused).unwrap() {
            recorded.unwrap();
        }
    }
    clock.set(now);
    for i in 0..20 {
        let send = |channel: &str, outcome: Outcome| {
            let claim = outbox.claim_channels(&[channel], 1).unwrap().remove(0);
            outbox.record(&claim, outcome).unwrap();
        };
        outbox
            .enqueue(&NewDelivery::single("slack", format!("held-{i}"), "first"))
            .unwrap();
        send(
            "slack",
            Outcome::Ambiguous {
                error: "read timeout".into(),
            },
        );
        outbox
            .enqueue(&NewDelivery::single(
                "discord",
                format!("gone-{i}"),
                "first",
            ))
            .unwrap();
        send("discord", Outcome::from_error_text("Missing Access"));
        for (channel, chat) in [("slack", "held"), ("discord", "gone")] {
            let behind = NewDelivery::single(channel, format!("{chat}-{i}"), "second");
            outbox.enqueue(&behind).unwrap();
        }
    }
    outbox
}

/// The median time of `answer`, after one answer to warm plans and caches.
fn median_ms(answer: impl Fn()) -> f64 {
    answer();
    let mut samples: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let started = Instant::now();
            answer();
            started.elapsed()
        })
        .collect();
    samples.sort();
    samples[RUNS / 2].as_secs_f64() * 1e3
}

fn page(console: &Console, target: &str) {
    let page = console.respond(&Request::get(target).from_owner());
    assert!(
        matches!(page.status, 200 | 303),
        "{target}: {}",
        page.status
    );
}

/// Every page, `/metrics` and the snapshot, timed beside 1k delivered replies and 1k
/// dead letters, and beside 1M and 200k.
fn measure(store: &str, open: impl Fn(OutboxOptions, usize) -> Outbox) {
    let mut results = Vec::new();
    for (history, dead) in [(1_000, 1_000), (1_000_000, 200_000)] {
        let started = Instant::now();
        let outbox = filled(|options| open(options, history), history, dead);
        eprintln!(
            "{store}: {history} replies of history and {dead} dead letters made in {:.0?}",
            started.elapsed()
        );
        let dead = outbox
            .list(
                &chunked_outbox::monitoring::ListFilter::default()
                    .status(chunked_outbox::monitoring::DeliveryStatus::Failed),
            )
            .unwrap()
            .remove(0)
            .id;
        let console = Console::new(outbox.clone());
        let endpoint = Endpoint::new(outbox.clone(), Thresholds::default());
        let pages = [
            ("overview (health, charts)", "/console".to_owned()),
            ("held chats", "/console/chats".to_owned()),
            ("uncertain", "/console/uncertain".to_owned()),
            ("dead letters", "/console/dead-letters".to_owned()),
            (
                "dead letters of a channel",
                "/console/dead-letters?channel=discord".to_owned(),
            ),
            (
                "dead letters, by error",
                "/console/dead-letters?error=missing".to_owned(),
            ),
            ("a reply's story", format!("/console/deliveries/{dead}")),
            (
                "the oldest, by caller key",
                "/console/deliveries?id=turn-0-0".to_owned(),
            ),
            (
                "the newest, by caller key",
                format!("/console/deliveries?id=turn-{}-0", history / BATCH - 1),
            ),
            ("rules", "/console/rules".to_owned()),
        ];
        let mut timed: Vec<(&str, f64)> = pages
            .iter()
            .map(|(name, target)| (*name, median_ms(|| page(&console, target))))
            .collect();
        timed.push((
            "/metrics",
            median_ms(|| assert_eq!(endpoint.respond("/metrics").status, 200)),
        ));
        timed.push((
            "health snapshot",
            median_ms(|| drop(outbox.health().unwrap())),
        ));
        results.push(timed);
    }
    for (small, large) in results[0].iter().zip(&results[1]) {
        println!(
            "{store:>10} {:>26}: 1k/1k {:>7.2} ms, 1M/200k {:>7.2} ms, {:>5.2}x",
            small.0,
            small.1,
            large.1,
            large.1 / small.1
        );
    }
}

fn main() {
    println!(
        "median of {RUNS} answers per page; delivered replies / dead letters spread over 30 days"
    );
    let dir = tempfile::tempdir().unwrap();
    measure("SQLite", |options, history| {
        Outbox::open(dir.path().join(format!("outbox-{history}.db")), options).unwrap()
    });
    #[cfg(feature = "postgres")]
    match std::env::var("DATABASE_URL") {
        Ok(url) => measure("PostgreSQL", |options, history| {
            let mut admin = postgres::Client::connect(&url, postgres::NoTls).unwrap();
            let schema = format!("console_scale_{history}");
            admin
                .batch_execute(&format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
                ))
                .unwrap();
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = format!("{url}{sep}options=-c%20search_path%3D{schema}");
            Outbox::connect(&url, options).unwrap()
        }),
        Err(_) => {
            eprintln!("PostgreSQL: set DATABASE_URL (scripts/with-postgres) to measure it too")
        }
    }
}

//! The console's pages beside 1M rows of delivered history, against 1k: each page's
//! median time, on SQLite and (with the `postgres` feature and `DATABASE_URL`) on
//! PostgreSQL. The history is made through the API, a thousand replies at a time,
//! spread over the last 30 days (the day's chart reads a thirtieth of it); beside it a
//! few held chats, uncertain parts and dead letters, as the pages list them.
//!
//! ```text
//! cargo run --release --features console --example console_scale
//! scripts/with-postgres cargo run --release --features console,postgres --example console_scale
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use chunked_outbox::clock::ManualClock;
use chunked_outbox::console::{Console, Request};
use chunked_outbox::rules::LaneFailurePolicy;
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

const RUNS: usize = 25;
const DAY_MS: i64 = 86_400_000;
/// Replies enqueued, sent and acknowledged together while filling.
const BATCH: usize = 1_000;

/// An outbox opened by `open` with `history` delivered replies spread over the last 30
/// days, then the held chats, uncertain parts and dead letters of a bad afternoon.
fn filled(open: impl Fn(OutboxOptions) -> Outbox, history: usize) -> Outbox {
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

fn median_ms(console: &Console, target: &str) -> f64 {
    let page = console.respond(&Request::get(target)); // warm: plans and caches
    assert!(
        matches!(page.status, 200 | 303),
        "{target}: {}",
        page.status
    );
    let mut samples: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let started = Instant::now();
            console.respond(&Request::get(target));
            started.elapsed()
        })
        .collect();
    samples.sort();
    samples[RUNS / 2].as_secs_f64() * 1e3
}

/// Every page, timed beside 1k and beside 1M rows of history.
fn measure(store: &str, open: impl Fn(OutboxOptions, usize) -> Outbox) {
    let mut results = Vec::new();
    for history in [1_000, 1_000_000] {
        let started = Instant::now();
        let outbox = filled(|options| open(options, history), history);
        eprintln!(
            "{store}: {history} replies of history made in {:.0?}",
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
        let console = Console::new(outbox);
        let pages = [
            ("overview (health, charts)", "/console".to_owned()),
            ("held chats", "/console/chats".to_owned()),
            ("uncertain", "/console/uncertain".to_owned()),
            ("dead letters", "/console/dead-letters".to_owned()),
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
        results.push(
            pages
                .iter()
                .map(|(name, target)| (*name, median_ms(&console, target)))
                .collect::<Vec<_>>(),
        );
    }
    for (small, large) in results[0].iter().zip(&results[1]) {
        println!(
            "{store:>10} {:>26}: 1k {:>7.2} ms, 1M {:>7.2} ms",
            small.0, small.1, large.1
        );
    }
}

fn main() {
    println!("median of {RUNS} answers per page; history spread over 30 days");
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

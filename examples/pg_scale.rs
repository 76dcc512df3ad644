//! Health, listing and purge on PostgreSQL cost the same beside 1M rows of history as
//! beside 1k: each reads the maintained counters and the unfinished rows, never the
//! history. Prints each operation's median time at both sizes and the ratio, with fresh
//! planner statistics (ANALYZE after the fill) and with stale ones (the fill unseen by
//! the planner, autovacuum off).
//!
//! ```text
//! scripts/with-postgres cargo run --release --features postgres --example pg_scale
//! ```

use std::time::{Duration, Instant};

use chrono::Utc;
use chunked_outbox::monitoring::ListFilter;
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};

/// Unfinished replies beside the history: some pending, some sending.
const OPEN: usize = 200;
/// Finished replies a month old, which a purge of what is older than a week removes.
const OLD: i64 = 1_000;
const RUNS: usize = 25;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn time(mut f: impl FnMut()) -> Duration {
    f(); // warm: plans and caches
    median(
        (0..RUNS)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect(),
    )
}

/// An outbox in a fresh schema `name` with `OLD` month-old and `history` recent
/// finalized replies (with their chunks and history rows) and `OPEN` unfinished ones;
/// ANALYZEd if `fresh`.
fn filled(url: &str, name: &str, history: i64, fresh: bool) -> Outbox {
    let mut admin = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    admin
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {name} CASCADE; CREATE SCHEMA {name}"
        ))
        .unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    let schema_url = format!("{url}{sep}options=-c%20search_path%3D{name}");
    let outbox = Outbox::connect(&schema_url, OutboxOptions::default()).expect("connect outbox");
    let mut conn = postgres::Client::connect(&schema_url, postgres::NoTls).unwrap();
    if !fresh {
        conn.batch_execute(
            "ALTER TABLE outbound_deliveries SET (autovacuum_enabled = off);
             ALTER TABLE outbound_delivery_chunks SET (autovacuum_enabled = off);
             ALTER TABLE outbound_messages SET (autovacuum_enabled = off);
             ANALYZE",
        )
        .unwrap();
    }
    outbox
        .enqueue(&NewDelivery::single("t", "first", "x"))
        .unwrap();
    let now = Utc::now().timestamp_millis();
    let month_ago = now - 30 * 86_400_000;
    for (count, at) in [(OLD, month_ago), (history, now)] {
        fill(&mut conn, count, at);
    }
    conn.execute(
        "UPDATE outbound_channel_stats SET delivered = delivered + $1 WHERE channel = 't'",
        &[&(history + OLD)],
    )
    .unwrap();
    for i in 0..OPEN {
        outbox
            .enqueue(&NewDelivery::single("t", format!("open-{i}"), "x"))
            .unwrap();
    }
    outbox.claim(OPEN / 2).unwrap();
    if fresh {
        conn.batch_execute("ANALYZE").unwrap();
    }
    outbox
}

/// `count` replies finalized at `at`: delivery, chunk and history rows.
fn fill(conn: &mut postgres::Client, count: i64, at: i64) {
    conn.execute(
        "WITH d AS (
             INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
                 delivered_count, created_at, updated_at, finished_at, text)
             SELECT nextval('outbound_deliveries_id_seq'), gen_random_uuid()::text, 't',
                    'c' || (i % 1000), 'delivered', 1, 1, $2, $2, $2, 'history ' || i
             FROM generate_series(1, $1::bigint) AS i
             RETURNING id, uid, chat_id, text),
         c AS (
             INSERT INTO outbound_delivery_chunks (delivery_id, chunk_index, status,
                 attempts, delivered_at, channel_id)
             SELECT id, 0, 'delivered', 1, $2, (SELECT id FROM outbound_channels WHERE name = 't')
             FROM d)
         INSERT INTO outbound_messages (delivery_id, channel, chat_id, content, chunk_count,
             created_at, delivered_at)
         SELECT uid, 't', chat_id, text, 1, $2, $2 FROM d",
        &[&count, &at],
    )
    .unwrap();
}

fn main() {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!(
            "set DATABASE_URL, or run: scripts/with-postgres cargo run --release \
             --features postgres --example pg_scale"
        );
        std::process::exit(2);
    };
    let week_ago = Utc::now() - chrono::Duration::days(7);
    println!(
        "{OPEN} unfinished and {OLD} month-old replies beside the history; medians of {RUNS} \
         runs (the purge of the {OLD} old ones: one run)"
    );
    for fresh in [true, false] {
        let stats = if fresh { "fresh" } else { "stale" };
        let mut rows = Vec::new();
        for history in [1_000_i64, 1_000_000] {
            let outbox = filled(&url, &format!("scale_{history}"), history, fresh);
            let health = time(|| {
                outbox.health().unwrap();
            });
            let list = time(|| {
                assert_eq!(outbox.list(&ListFilter::default()).unwrap().len(), 100);
            });
            let pending = time(|| {
                outbox
                    .list(
                        &ListFilter::default()
                            .status(chunked_outbox::monitoring::DeliveryStatus::Pending),
                    )
                    .unwrap();
            });
            let preview = time(|| {
                assert_eq!(
                    outbox.purge_preview(week_ago).unwrap().deliveries,
                    OLD as u64
                );
            });
            // Removes the month-old replies: once.
            let started = Instant::now();
            assert_eq!(outbox.purge(week_ago).unwrap().deliveries, OLD as u64);
            let purge = started.elapsed();
            rows.push([health, list, pending, preview, purge]);
        }
        let names = ["health", "list", "list pending", "purge preview", "purge"];
        for (i, name) in names.iter().enumerate() {
            let (small, large) = (rows[0][i], rows[1][i]);
            println!(
                "{stats} statistics, {name:>13}: 1k {:>8.2} ms, 1M {:>8.2} ms, ratio {:.2}",
                small.as_secs_f64() * 1e3,
                large.as_secs_f64() * 1e3,
                large.as_secs_f64() / small.as_secs_f64()
            );
        }
    }
}

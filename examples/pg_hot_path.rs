//! The hot path on PostgreSQL, one operation per transaction through the public API:
//! `N` one-reply enqueues to 1,000 chats, then `N` times `claim(1)` + `record`. Prints
//! the wall time per operation. Run it against builds of two commits in turn, on one
//! server, to compare them side by side (the figures in docs/PERFORMANCE.md).
//!
//! ```text
//! scripts/with-postgres cargo run --release --features postgres --example pg_hot_path
//! ```
//!
//! `N` (default 1,000) sets the count. The test server of `scripts/with-postgres` runs
//! with fsync off; for durable commits, point `DATABASE_URL` at a server with fsync on.

use std::time::Instant;

use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

const CHATS: usize = 1_000;

fn main() {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!(
            "set DATABASE_URL, or run: scripts/with-postgres cargo run --release \
             --features postgres --example pg_hot_path"
        );
        std::process::exit(2);
    };
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
    admin
        .batch_execute("DROP SCHEMA IF EXISTS hot_path CASCADE; CREATE SCHEMA hot_path")
        .expect("a fresh schema");
    let sep = if url.contains('?') { '&' } else { '?' };
    let schema_url = format!("{url}{sep}options=-c%20search_path%3Dhot_path");
    let outbox = Outbox::connect(&schema_url, OutboxOptions::default()).expect("connect outbox");
    let reply = |i: usize| NewDelivery::single("bench", format!("chat-{}", i % CHATS), "x");
    // Warm: every statement prepared on the connections the loops use.
    for i in 0..50 {
        outbox.enqueue(&reply(i)).unwrap();
    }
    for _ in 0..50 {
        let claim = outbox.claim(1).unwrap().remove(0);
        outbox.record(&claim, Outcome::delivered(None)).unwrap();
    }

    let started = Instant::now();
    for i in 0..n {
        outbox.enqueue(&reply(i)).unwrap();
    }
    let enqueue = started.elapsed();
    let (mut claim, mut record) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    for _ in 0..n {
        let t = Instant::now();
        let claimed = outbox.claim(1).unwrap().remove(0);
        claim += t.elapsed();
        let t = Instant::now();
        outbox.record(&claimed, Outcome::delivered(None)).unwrap();
        record += t.elapsed();
    }
    let per = |d: std::time::Duration| d.as_secs_f64() * 1e3 / n as f64;
    println!(
        "enqueue {:.3} ms, claim(1) {:.3} ms, record {:.3} ms (per operation, n = {n})",
        per(enqueue),
        per(claim),
        per(record)
    );
}

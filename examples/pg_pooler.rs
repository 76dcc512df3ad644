//! Enqueue and drain throughput on PostgreSQL through PgBouncer in transaction mode,
//! beside a direct connection to the same server, in one run: each database is fresh,
//! the two ways alternate, and each figure is the median of the repetitions.
//!
//! - enqueue: one thread, one single-chunk reply per transaction;
//! - drain: one thread claiming 64 at a time and recording them as delivered in one
//!   batch (each reply finalized into the history table).
//!
//! ```text
//! scripts/with-postgres scripts/with-pgbouncer \
//!     cargo run --release --features postgres --example pg_pooler
//! ```

use std::time::Instant;

use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

const REPLIES: usize = 2_000;
const REPS: usize = 3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = std::env::var("DATABASE_URL")
        .map_err(|_| "no DATABASE_URL: run it under scripts/with-postgres")?;
    let dir = std::env::var("PGBOUNCER_DIR")
        .map_err(|_| "no PGBOUNCER_DIR: run it under scripts/with-pgbouncer")?;
    let port = std::env::var("PGBOUNCER_PORT")?;
    let mut admin = postgres::Client::connect(&server, postgres::NoTls)?;
    let mut figures: Vec<(&str, Vec<f64>, Vec<f64>)> = vec![
        ("direct", Vec::new(), Vec::new()),
        ("PgBouncer", Vec::new(), Vec::new()),
    ];
    for rep in 0..REPS {
        for (way, enqueues, drains) in figures.iter_mut() {
            let name = format!("pooler_bench_{}_{rep}_{}", std::process::id(), way.len());
            admin.batch_execute(&format!("CREATE DATABASE {name}"))?;
            let direct = server.replacen("/postgres?", &format!("/{name}?"), 1);
            // The schema is made on a direct connection either way, as a deploy does.
            drop(Outbox::connect(&direct, OutboxOptions::default())?);
            let outbox = if *way == "direct" {
                Outbox::connect(&direct, OutboxOptions::default())?
            } else {
                let url = format!("postgresql:///{name}?host={dir}&port={port}&user=postgres");
                Outbox::connect(&url, OutboxOptions::default().with_transaction_pooler(true))?
            };
            let started = Instant::now();
            for i in 0..REPLIES {
                let chat = format!("chat-{}", i % 50);
                outbox.enqueue(&NewDelivery::single("telegram", chat, format!("reply {i}")))?;
            }
            enqueues.push(REPLIES as f64 / started.elapsed().as_secs_f64());
            let started = Instant::now();
            let mut drained = 0;
            while drained < REPLIES {
                let claims = outbox.claim(64)?;
                if claims.is_empty() {
                    return Err(format!("{way}: only {drained} of {REPLIES} due").into());
                }
                drained += claims.len();
                for r in
                    outbox.record_batch(claims.iter().map(|c| (c, Outcome::delivered(None))))?
                {
                    r?;
                }
            }
            drains.push(REPLIES as f64 / started.elapsed().as_secs_f64());
            drop(outbox);
            admin.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))?;
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("{REPLIES} replies, {REPS} repetitions, medians (replies/s):");
    println!("| connection | enqueue, 1 per transaction | drain, claim 64 + batch ack |");
    println!("|---|--:|--:|");
    for (way, enqueues, drains) in &figures {
        println!(
            "| {way} | {:.0} | {:.0} |",
            median(enqueues),
            median(drains)
        );
    }
    Ok(())
}

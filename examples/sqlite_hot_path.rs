//! The SQLite hot path through the public API, shaped like the peer harness's workloads:
//! `N` one-reply enqueues to 1,000 chats (one transaction each), then the backlog drained
//! by `claim(64)` + `record_batch`. Prints the wall time per message of each phase.
//!
//! ```text
//! cargo run --release --example sqlite_hot_path
//! ```
//!
//! `N` (default 20,000) sets the count and `DIR` the directory of the database file
//! (default: a temporary directory). `PHASE=enqueue` runs only the enqueues,
//! `PHASE=drain` fills the backlog by `enqueue_batch` and runs only the drain: under
//! callgrind, instruction counts per message do not depend on the machine's noise.
//! `CHECKPOINT_MS` sets the background checkpoints' interval (default: the crate's;
//! 0 leaves checkpoints to SQLite's own).

use std::time::{Duration, Instant};

use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

const CHATS: usize = 1_000;

fn main() {
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let phase = std::env::var("PHASE").unwrap_or_default();
    let dir = match std::env::var("DIR") {
        Ok(d) => tempfile::Builder::new().tempdir_in(d),
        Err(_) => tempfile::tempdir(),
    }
    .expect("a temporary directory");
    let mut options = OutboxOptions::default();
    if let Some(ms) = std::env::var("CHECKPOINT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        options = options.with_background_checkpoints((ms > 0).then(|| Duration::from_millis(ms)));
    }
    let outbox = Outbox::open(dir.path().join("outbox.db"), options).expect("open the outbox");
    let text = "x".repeat(100);
    let reply = |i: usize| NewDelivery::single("bench", format!("chat-{}", i % CHATS), &text);

    if phase == "drain" {
        for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
            let batch: Vec<_> = chunk.iter().map(|&i| reply(i)).collect();
            outbox.enqueue_batch(&batch).unwrap();
        }
    } else {
        let started = Instant::now();
        for i in 0..n {
            outbox.enqueue(&reply(i)).unwrap();
        }
        report("enqueue", started, n);
        if phase == "enqueue" {
            return;
        }
    }
    let started = Instant::now();
    let mut drained = 0;
    loop {
        let claims = outbox.claim(64).unwrap();
        if claims.is_empty() {
            break;
        }
        outbox
            .record_batch(claims.iter().map(|c| (c, Outcome::delivered(None))))
            .unwrap();
        drained += claims.len();
    }
    assert_eq!(drained, n, "every reply claimed once");
    report("claim(64) + record_batch", started, n);
}

fn report(what: &str, started: Instant, n: usize) {
    let elapsed = started.elapsed();
    println!(
        "{what}: {:.1} µs a message, {:.0} /s",
        elapsed.as_secs_f64() * 1e6 / n as f64,
        n as f64 / elapsed.as_secs_f64()
    );
}

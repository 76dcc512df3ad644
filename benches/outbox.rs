//! Criterion benchmarks of the core operations on a file database (WAL,
//! `synchronous=NORMAL`) in a temp dir, and of the splitter. Setup (filling the backlog) is outside the timed
//! part. Run: `cargo bench --bench outbox`.

use std::time::Duration;

use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome, Splitter};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

fn open() -> (tempfile::TempDir, Outbox) {
    let dir = tempfile::tempdir().expect("temp dir");
    let outbox = Outbox::open(dir.path().join("bench.db"), OutboxOptions::default()).expect("open");
    (dir, outbox)
}

fn delivery(n: usize, chunks: usize) -> NewDelivery {
    let parts: Vec<String> = (0..chunks)
        .map(|i| format!("reply {n} part {i} {}", "x".repeat(200)))
        .collect();
    NewDelivery::chunked(
        "telegram",
        format!("chat-{}", n % 1000),
        parts.join("\n"),
        parts,
    )
}

fn enqueue(c: &mut Criterion) {
    let mut group = c.benchmark_group("enqueue");
    for chunks in [1, 8] {
        let (_dir, outbox) = open();
        let mut n = 0;
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("{chunks}_chunk_delivery"), |b| {
            b.iter(|| {
                n += 1;
                outbox.enqueue(&delivery(n, chunks)).expect("enqueue")
            })
        });
    }
    group.finish();
}

fn claim_ack(c: &mut Criterion) {
    let mut group = c.benchmark_group("claim_ack");
    group.measurement_time(Duration::from_secs(5));
    for batch in [1_usize, 16, 64] {
        let (_dir, outbox) = open();
        let mut n = 0;
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(format!("batch_{batch}"), |b| {
            b.iter_batched(
                || {
                    for _ in 0..batch {
                        n += 1;
                        let _ = outbox.enqueue(&delivery(n, 1)).expect("enqueue");
                    }
                },
                |()| {
                    // One claim transaction and one group-committed ack transaction;
                    // every ack finalizes its 1-chunk delivery into `outbound_messages`.
                    let claims = outbox.claim(batch).expect("claim");
                    let acks = claims.iter().map(|c| (c, Outcome::delivered(None)));
                    outbox.record_batch(acks).expect("ack").len()
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

fn health(c: &mut Criterion) {
    let (_dir, outbox) = open();
    for n in 0..10_000 {
        let _ = outbox.enqueue(&delivery(n, 1)).expect("enqueue");
    }
    loop {
        let claims = outbox.claim(500).expect("claim");
        if claims.is_empty() {
            break;
        }
        for claim in &claims {
            outbox.record(claim, Outcome::delivered(None)).expect("ack");
        }
    }
    for n in 0..100 {
        let _ = outbox.enqueue(&delivery(n, 2)).expect("enqueue");
    }
    c.bench_function("health_10k_history_100_open", |b| {
        b.iter(|| outbox.health().expect("health"))
    });
}

fn split(c: &mut Criterion) {
    let text = "A paragraph of an answer, with a few sentences. Another one follows here.\n\n"
        .repeat(1_400); // about 100 KB
    let mut group = c.benchmark_group("split_100kb");
    group.throughput(Throughput::Bytes(text.len() as u64));
    for (name, splitter) in [
        ("telegram", Splitter::telegram()),
        ("wecom_bytes", Splitter::wecom()),
    ] {
        group.bench_function(name, |b| b.iter(|| splitter.split(&text).expect("split")));
    }
    group.finish();
}

criterion_group!(benches, enqueue, claim_ack, health, split);
criterion_main!(benches);

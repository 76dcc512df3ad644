//! PostgreSQL behind PgBouncer in transaction mode (`scripts/with-pgbouncer`): each
//! transaction may run on another server connection, and a server connection serves
//! other clients between our transactions. What must hold: every operation works (no
//! statement or setting kept on a server connection beyond one transaction), nothing
//! leaks to the pooler's other clients (settings, advisory locks), connects never hang,
//! and a handle through the pooler never migrates (a direct connection does).
#![cfg(feature = "postgres")]

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use chunked_outbox::rules::{Backoff, RetryPolicy};
use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions, Outcome};
use common::postgres::server_url;

/// The pooler's socket folder and port, from `scripts/with-pgbouncer`. Without it the
/// tests are skipped (and say so), unless a server is required (as in CI): then they
/// fail.
fn bouncer() -> Option<(String, String)> {
    match (
        std::env::var("PGBOUNCER_DIR"),
        std::env::var("PGBOUNCER_PORT"),
    ) {
        (Ok(dir), Ok(port)) => Some((dir, port)),
        _ => {
            let message = "PgBouncer tests need scripts/with-pgbouncer \
                           (scripts/with-postgres scripts/with-pgbouncer cargo test)";
            assert!(
                std::env::var_os("OUTBOX_REQUIRE_POSTGRES").is_none(),
                "{message}"
            );
            eprintln!("*** SKIPPED: {message}");
            None
        }
    }
}

/// A new database: its URL through the pooler and its direct URL.
struct Place {
    pooled: String,
    direct: String,
}

impl Place {
    fn new() -> Option<Place> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let (dir, port) = bouncer()?;
        let server = server_url().expect("the PostgreSQL test server");
        let name = format!(
            "b_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = postgres::Client::connect(&server, postgres::NoTls).unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        let direct = server.replacen("/postgres?", &format!("/{name}?"), 1);
        assert_ne!(direct, server, "a database name in {server}");
        Some(Place {
            pooled: format!("postgresql:///{name}?host={dir}&port={port}&user=postgres"),
            direct,
        })
    }

    /// The schema made (migrated) once, on a direct connection, as a deploy does.
    fn migrated(self) -> Place {
        drop(Outbox::connect(&self.direct, options()).unwrap());
        self
    }

    fn through_pooler(&self) -> Outbox {
        Outbox::connect(&self.pooled, pooled()).unwrap()
    }
}

/// Quick retries, so that a failed send is sent again within the test.
fn options() -> OutboxOptions {
    OutboxOptions::default().with_retry(
        RetryPolicy::default()
            .with_backoff(Backoff::Schedule(vec![Duration::from_millis(1)]))
            .with_jitter(0.0),
    )
}

fn pooled() -> OutboxOptions {
    options().with_transaction_pooler(true)
}

/// Everything a bot does, from several handles and threads at once through the pooler:
/// enqueue (one and many), claim, ack, retry, read health and views; each reply
/// delivered and finalized once.
#[test]
fn an_outbox_works_through_a_transaction_pooler() {
    let Some(place) = Place::new() else { return };
    let place = place.migrated();
    let handles: Vec<Outbox> = (0..3).map(|_| place.through_pooler()).collect();
    std::thread::scope(|s| {
        for (h, outbox) in handles.iter().enumerate() {
            s.spawn(move || {
                for i in 0..30 {
                    let chat = format!("c{}", i % 5);
                    outbox
                        .enqueue(&NewDelivery::chunked(
                            "t",
                            chat,
                            format!("a{h}-{i} b{h}-{i}"),
                            [format!("a{h}-{i}"), format!("b{h}-{i}")],
                        ))
                        .unwrap();
                }
            });
        }
    });
    let mut delivered = 0;
    let until = Instant::now() + Duration::from_secs(60);
    while delivered < 180 {
        assert!(
            Instant::now() < until,
            "only {delivered} of 180 sent: {:?}",
            handles[0].health().unwrap().totals
        );
        for outbox in &handles {
            let claims = outbox.claim(8).unwrap();
            let outcomes = claims.iter().map(|c| {
                // Every tenth send fails once, to take the retry path too.
                if c.attempt == 1 && c.text.ends_with('0') {
                    (
                        c,
                        Outcome::Transient {
                            error: "503".into(),
                        },
                    )
                } else {
                    (c, Outcome::delivered(None))
                }
            });
            for recorded in outbox.record_batch(outcomes).unwrap() {
                if recorded.unwrap().status == chunked_outbox::monitoring::ChunkStatus::Delivered {
                    delivered += 1;
                }
            }
            if claims.is_empty() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    let health = handles[0].health().unwrap();
    assert_eq!(health.totals.delivered_deliveries, 90);
    let mut direct = postgres::Client::connect(&place.direct, postgres::NoTls).unwrap();
    let finalized: i64 = direct
        .query_one(
            "SELECT count(DISTINCT delivery_id) FROM outbound_messages HAVING count(*) = count(DISTINCT delivery_id)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(finalized, 90, "each reply finalized once");
}

/// Nothing of ours stays on the pooler's server connections: another client of the
/// pooler sees the server's own settings, no advisory lock is left held, and many
/// handles connecting at once all connect.
#[test]
fn nothing_leaks_to_the_poolers_other_clients() {
    let Some(place) = Place::new() else { return };
    let place = place.migrated();
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..40 {
            let place = &place;
            s.spawn(move || {
                let outbox = place.through_pooler();
                outbox
                    .enqueue(&NewDelivery::single("t", "c", "hello"))
                    .unwrap();
                outbox.health().unwrap();
            });
        }
    });
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "40 connects took {:?}",
        started.elapsed()
    );
    let mut direct = postgres::Client::connect(&place.direct, postgres::NoTls).unwrap();
    let jit: String = direct.query_one("SHOW jit", &[]).unwrap().get(0);
    let mut other = postgres::Client::connect(&place.pooled, postgres::NoTls).unwrap();
    for _ in 0..20 {
        let seen: String = other
            .simple_query("SHOW jit")
            .unwrap()
            .iter()
            .find_map(|m| match m {
                postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .unwrap();
        assert_eq!(
            seen, jit,
            "a setting of the outbox's reached another client"
        );
    }
    // A lock left by a session stays for good; one of a transaction just ending goes.
    let held = |direct: &mut postgres::Client| -> i64 {
        direct
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE l.locktype = 'advisory' AND a.state = 'idle'
                   AND a.datname = current_database()",
                &[],
            )
            .unwrap()
            .get(0)
    };
    let until = Instant::now() + Duration::from_secs(5);
    while held(&mut direct) > 0 {
        assert!(
            Instant::now() < until,
            "an idle server connection holds an advisory lock"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A handle through the pooler never migrates: a new database is refused with a
/// message that says what to do, and a direct connection migrates it.
#[test]
fn the_schema_is_made_on_a_direct_connection_only() {
    let Some(place) = Place::new() else { return };
    let err = Outbox::connect(&place.pooled, pooled()).unwrap_err();
    assert!(matches!(err, Error::NotAnOutbox { .. }), "{err:?}");
    let place = place.migrated();
    place
        .through_pooler()
        .enqueue(&NewDelivery::single("t", "c", "after the migration"))
        .unwrap();
}

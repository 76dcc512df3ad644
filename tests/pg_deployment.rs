//! PostgreSQL as a real deployment meets it: several hosts whose clocks disagree, text
//! the server cannot store, replies staged by other services, waits that must end,
//! addresses that are wrong, and async code.
//!
//! Each test is one thing a multi-host deployment brings that a single process never
//! shows, checked through what a real party could see: the outbox's views and claims.
#![cfg(feature = "postgres")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chunked_outbox::clock::{Clock, SkewedClock, SystemClock};
use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::ChunkStatus;
use chunked_outbox::rules::{ChannelPolicy, RetryPolicy};
use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, Error, NewDelivery, Outbox, OutboxOptions, Outcome,
};
use common::postgres::{fresh_schema, fresh_schema_url, server_url, with_search_path};
use common::proxy::{Cut, Proxy};

/// A host on schema `url` whose clock is `clock`.
fn host(url: &str, clock: impl Clock + 'static, options: OutboxOptions) -> Outbox {
    Outbox::connect(url, options.with_clock(Arc::new(clock))).expect("connect")
}

fn url() -> String {
    fresh_schema_url().expect("the PostgreSQL test server")
}

/// A host whose clock is 90 s ahead takes over no chunk under another host's live 60 s
/// lease, and the holder's ack stands.
#[test]
fn a_host_ahead_takes_over_no_live_lease() {
    let url = url();
    // A channel that may replay: a host that thinks the lease ended claims the chunk
    // again (on one that holds ambiguous sends it would be made uncertain).
    let lease = OutboxOptions::default()
        .with_lease(Duration::from_secs(60))
        .with_channel("t", ChannelPolicy::replayable());
    let a = host(&url, SystemClock, lease.clone());
    let b = host(&url, SkewedClock::ahead(Duration::from_secs(90)), lease);

    let id = a.enqueue(&NewDelivery::single("t", "c", "one")).unwrap().id;
    let claim = a.claim(1).unwrap().remove(0);
    assert!(
        b.claim(1).unwrap().is_empty(),
        "the host 90 s ahead claimed a chunk under a live lease"
    );
    b.recover(RecoverScope::ExpiredLeases).unwrap();
    a.ack(&claim, Some("m1"))
        .expect("the lease holder's ack was refused");
    let view = a.delivery(id).unwrap().unwrap();
    assert_eq!(view.chunks[0].status, ChunkStatus::Delivered);
    assert_eq!(view.chunks[0].attempts, 1, "sent twice");
}

/// A reply enqueued by a host 2 minutes behind is not dead-lettered for its age (60 s
/// allowed) by a host on time; a host 90 s behind finds work that is due at once.
#[test]
fn a_host_behind_neither_ages_replies_nor_waits_for_work() {
    let url = url();
    let options = OutboxOptions::default()
        .with_retry(RetryPolicy::default().with_max_age(Some(Duration::from_secs(60))));
    let a = host(&url, SystemClock, options.clone());
    let b = host(&url, SkewedClock::behind(Duration::from_secs(120)), options);

    let id = b.enqueue(&NewDelivery::single("t", "c1", "hi")).unwrap().id;
    let claims = a.claim(1).unwrap();
    assert_eq!(
        claims.len(),
        1,
        "a fresh reply from a host behind was not claimed: {:?}",
        a.delivery(id).unwrap().unwrap().chunks[0]
    );
    a.ack(&claims[0], None).unwrap();

    let c = host(
        &url,
        SkewedClock::behind(Duration::from_secs(90)),
        OutboxOptions::default(),
    );
    a.enqueue(&NewDelivery::single("t", "c2", "fresh")).unwrap();
    let claims = c.claim(1).unwrap();
    assert_eq!(
        claims.len(),
        1,
        "a host 90 s behind did not see work that is due"
    );
    c.ack(&claims[0], None).unwrap();
}

/// Purge cutoffs given on the outbox's time ([`Outbox::now`]) mean the same on every
/// host: one an hour ahead keeping ten minutes keeps what just finished, and one an
/// hour behind purging what finished by now purges it.
#[test]
fn purge_cutoffs_on_the_outbox_time_agree_across_hosts() {
    let url = url();
    let a = host(&url, SystemClock, OutboxOptions::default());
    for chat in ["c1", "c2", "c3"] {
        a.enqueue(&NewDelivery::single("t", chat, "hi")).unwrap();
    }
    for claim in a.claim(10).unwrap() {
        a.ack(&claim, None).unwrap();
    }
    let hour = Duration::from_secs(3600);
    let ahead = host(&url, SkewedClock::ahead(hour), OutboxOptions::default());
    let kept = ahead
        .purge(ahead.now() - chrono::Duration::minutes(10))
        .unwrap();
    assert_eq!(kept.deliveries, 0, "a host ahead purged what just finished");
    let behind = host(&url, SkewedClock::behind(hour), OutboxOptions::default());
    let purged = behind
        .purge(behind.now() + chrono::Duration::seconds(5))
        .unwrap();
    assert_eq!(purged.deliveries, 2, "all but the newest");
}

/// The platform of [`a_round_keeps_every_outcome_the_store_can_hold`]: its answer per
/// chat.
struct Answers;

impl ChannelAdapter for Answers {
    fn send(&self, claim: &Claim) -> Outcome {
        match claim.chat_id.as_str() {
            "nul-id" => Outcome::delivered(Some("id\0x".into())),
            "nul-error" => Outcome::Transient {
                error: "bad\0gateway".into(),
            },
            "poison" => Outcome::delivered(Some("poison".into())),
            _ => Outcome::delivered(Some("fine".into())),
        }
    }
}

/// A NUL in an outcome's platform id or error text (PostgreSQL's text cannot hold one)
/// is stored as U+FFFD; and an outcome the store refuses (here a trigger of the
/// application's refuses one id) costs only that outcome, never the others of its round.
#[test]
fn a_round_keeps_every_outcome_the_store_can_hold() {
    let url = url();
    let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
    let mut admin = admin(&url);
    admin
        .batch_execute(
            "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.platform_message_id = 'poison' THEN
                     RAISE EXCEPTION 'the application refuses this id';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_poison BEFORE UPDATE ON outbound_delivery_chunks
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
        )
        .unwrap();
    let chats = ["nul-id", "nul-error", "poison", "plain"];
    let ids: Vec<_> = chats
        .iter()
        .map(|chat| {
            outbox
                .enqueue(&NewDelivery::single("t", *chat, "hello"))
                .unwrap()
                .id
        })
        .collect();
    let dispatcher = Dispatcher::builder(outbox.clone())
        .batch_size(8)
        .adapter("t", Answers)
        .build()
        .unwrap();
    assert_eq!(dispatcher.run_once().unwrap(), 4);

    let chunk = |i: usize| outbox.delivery(ids[i]).unwrap().unwrap().chunks.remove(0);
    let nul_id = chunk(0);
    assert_eq!(nul_id.status, ChunkStatus::Delivered);
    assert_eq!(nul_id.platform_message_id.as_deref(), Some("id\u{FFFD}x"));
    let nul_error = chunk(1);
    assert_eq!(nul_error.status, ChunkStatus::Retry);
    assert_eq!(nul_error.last_error.as_deref(), Some("bad\u{FFFD}gateway"));
    assert_eq!(
        chunk(2).status,
        ChunkStatus::Sending,
        "the refused outcome is left to its lease"
    );
    assert_eq!(chunk(3).status, ChunkStatus::Delivered);
    assert_eq!(dispatcher.stats().dropped, 1);
}

/// A direct connection to the schema of `url`.
fn admin(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).unwrap()
}

/// A write to a chat whose lane another session holds fails with `Error::Busy` after
/// the busy timeout, instead of waiting without limit.
#[test]
fn the_busy_timeout_bounds_a_wait_for_a_lane() {
    let url = url();
    let options = OutboxOptions::default().with_busy_timeout(Duration::from_millis(300));
    let outbox = Outbox::connect(&url, options).unwrap();
    outbox
        .enqueue(&NewDelivery::single("t", "held", "first"))
        .unwrap();
    let mut holder = admin(&url);
    let mut tx = holder.transaction().unwrap();
    tx.execute(
        "SELECT 1 FROM outbound_lanes WHERE channel = 't' AND chat_id = 'held' FOR UPDATE",
        &[],
    )
    .unwrap();
    let (done, waited) = std::sync::mpsc::channel();
    let writer = outbox.clone();
    let started = Instant::now();
    std::thread::spawn(move || {
        let _ = done.send(writer.enqueue(&NewDelivery::single("t", "held", "second")));
    });
    let result = waited
        .recv_timeout(Duration::from_secs(20))
        .expect("the write still waited for the lane after 20 s");
    assert!(matches!(result, Err(Error::Busy)), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    tx.rollback().unwrap();
    // The lane is free again: the write goes through.
    outbox
        .enqueue(&NewDelivery::single("t", "held", "second"))
        .unwrap();
}

/// A host whose network is cut in the middle of a transaction (its commit falls into a
/// hole, and nothing says so) holds its lane for seconds, not until TCP notices: the
/// server ends the session left idle inside the transaction, another host's write to
/// the lane goes through, and the cut host is told the transaction did not happen.
#[test]
fn a_transaction_cut_off_by_the_network_frees_its_lane_in_seconds() {
    let proxy = Proxy::start().expect("the PostgreSQL test server");
    let schema = fresh_schema().unwrap();
    let options = OutboxOptions::default().with_busy_timeout(Duration::from_millis(500));
    let cut = Outbox::connect(&proxy.url(&schema, "cut-host"), options).unwrap();
    let direct_url = with_search_path(&server_url().unwrap(), &schema);
    let other = Outbox::connect(&direct_url, OutboxOptions::default()).unwrap();
    other
        .enqueue(&NewDelivery::single("t", "c", "first"))
        .unwrap();

    proxy.cut_next_commit(Cut::SwallowCommit);
    let (told, cut_result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = told.send(cut.enqueue(&NewDelivery::single("t", "c", "lost")));
    });
    // Wait until the commit fell into the hole: the lane is held from then on.
    let started = Instant::now();
    while !proxy.commit_cut() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no commit came"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (done, other_result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(other.enqueue(&NewDelivery::single("t", "c", "after")));
    });
    let after = other_result
        .recv_timeout(Duration::from_secs(30))
        .expect("the lane was still held 30 s after the network cut");
    after.expect("the other host's write, once the lane was freed");
    let lost = cut_result
        .recv_timeout(Duration::from_secs(30))
        .expect("the cut host still waited 30 s after the cut");
    assert!(
        matches!(lost, Err(Error::Connection { .. })),
        "the cut host is told its transaction did not happen: {lost:?}"
    );
}

/// `outbox migrate` prints where the outbox is without the password, given either way.
#[test]
fn the_tool_prints_no_password() {
    let url = url();
    for (url, secret) in [
        (format!("{url}&password=hunter2-param"), "hunter2-param"),
        (
            url.replacen("postgresql://", "postgresql://postgres:hunter2-user@", 1),
            "hunter2-user",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(["--db", &url, "migrate"])
            .output()
            .unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{printed}");
        assert!(printed.contains("***"), "{printed}");
        assert!(
            !printed.contains(secret),
            "the password was printed: {printed}"
        );
    }
}

/// A server that cannot be reached fails at once, with the OS's reason and the target
/// as given, not after the pool's whole timeout with "error connecting to server".
#[test]
fn a_wrong_address_fails_at_once_and_says_why() {
    let options = OutboxOptions::default().with_busy_timeout(Duration::from_secs(30));
    for (url, target, reason) in [
        (
            "postgresql://127.0.0.1:1/x",
            "postgres://127.0.0.1:1/x",
            "refused",
        ),
        (
            "postgresql:///x?host=/nowhere",
            "postgres:///x?host=/nowhere&port=5432",
            "No such file or directory",
        ),
    ] {
        let started = Instant::now();
        let err = Outbox::connect(url, options.clone()).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{url}: failed after {:?}",
            started.elapsed()
        );
        let Error::Connection {
            target: shown,
            message,
        } = &err
        else {
            panic!("{url}: {err:?}");
        };
        assert_eq!(shown, target);
        assert!(message.contains(reason), "{url}: {message}");
    }
}

/// What an async bot does with the outbox on a runtime's thread: connect, call it, and
/// drop the last handle.
fn used_from_async_code(url: String) {
    let outbox = Outbox::connect(&url, OutboxOptions::default()).expect("connect");
    let id = outbox
        .enqueue(&NewDelivery::single("t", "c", "hello"))
        .unwrap()
        .id;
    assert!(outbox.delivery(id).unwrap().is_some());
    assert_eq!(outbox.health().unwrap().totals.pending_chunks, 1);
    drop(outbox);
}

/// On a current-thread runtime (`#[tokio::main(flavor = "current_thread")]`).
#[test]
fn an_async_bot_connects_uses_and_drops_the_outbox_on_one_thread() {
    let url = url();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move { used_from_async_code(url) });
}

/// On a multi-thread runtime (`#[tokio::main]`), and through the async calls.
#[test]
fn an_async_bot_connects_uses_and_drops_the_outbox_on_many_threads() {
    let url = url();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            used_from_async_code(url.clone());
            let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
            let reply = NewDelivery::single("t", "c2", "async");
            assert!(outbox.enqueue_async(reply).await.unwrap().created);
        });
}

/// Rolling deploys: a process that keeps running while a newer build migrates the
/// schema keeps writing as long as the schema accepts it (an expand step), and writes
/// nothing more once a contract step took that away: each write fails with
/// `SchemaTooNew`, naming the release to upgrade to, and changes nothing, while it can
/// still read. docs/OPERATING.md "Upgrades" says what to do.
#[test]
fn an_older_process_writes_on_until_a_contract_step() {
    let url = url();
    let older = Outbox::connect(&url, OutboxOptions::default()).unwrap();
    older
        .enqueue(&NewDelivery::single("t", "c", "before"))
        .unwrap();
    // A newer build's expand migration, as it records itself.
    admin(&url)
        .batch_execute(
            "INSERT INTO outbound_schema_history (version, name, applied_on, checksum)
             VALUES (99, 'from_a_newer_build', now()::text, '0')",
        )
        .unwrap();
    older
        .enqueue(&NewDelivery::single("t", "c2", "during"))
        .unwrap();
    let claim = older.claim(1).unwrap().remove(0);
    older.ack(&claim, None).unwrap();
    drop(Outbox::connect(&url, OutboxOptions::default()).unwrap());
    // Its contract step.
    admin(&url)
        .batch_execute(
            "UPDATE outbound_policy SET writable_from = 99;
             UPDATE outbound_meta SET migrated_by = 'chunked-outbox 9.9.9 (schema 99)'",
        )
        .unwrap();
    for err in [
        older
            .enqueue(&NewDelivery::single("t", "c", "after"))
            .map(|_| ())
            .unwrap_err(),
        older.claim(1).map(|_| ()).unwrap_err(),
    ] {
        assert!(
            matches!(
                err,
                Error::SchemaTooNew {
                    writable_from: 99,
                    ..
                }
            ),
            "{err:?}"
        );
    }
    let all = older
        .list(&chunked_outbox::monitoring::ListFilter::default())
        .unwrap();
    assert_eq!(all.len(), 2, "the refused write changed nothing");
    // An older handle connecting now is refused at once, told what to upgrade to.
    let refused = Outbox::connect(&url, OutboxOptions::default()).map(drop);
    assert!(
        matches!(&refused, Err(Error::SchemaTooNew { found: 99, upgrade_to, .. })
            if upgrade_to == "chunked-outbox 9.9.9 (schema 99)"),
        "{refused:?}"
    );
}

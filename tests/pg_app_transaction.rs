//! PostgreSQL: replies enqueued inside the application's own transaction, with each
//! client the crate accepts (`postgres`, `tokio-postgres`, `sqlx`).
//!
//! What must hold: the reply exists exactly when the application's transaction
//! commits (a rollback leaves nothing); the commit wakes a dispatcher of another
//! handle (whose poll is too slow to explain it); the application's transaction holds
//! no lock of the outbox beyond its row (a busy lane does not hold up its commit, and
//! an open one does not hold up the lane); a caller key used by two transactions at
//! once resolves to one reply; lane order is commit order; and each isolation level
//! behaves as `chunked_outbox::store::postgres` documents.
#![cfg(feature = "postgres")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::DeliveryStatus;
use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, Enqueued, Error, NewDelivery, Outbox, OutboxOptions, Outcome,
};
use common::postgres::{fresh_schema, server_url, with_search_path};

struct Place {
    url: String,
}

impl Place {
    fn new() -> Option<Place> {
        let schema = fresh_schema()?;
        Some(Place {
            url: with_search_path(&server_url().unwrap(), &schema),
        })
    }

    fn outbox(&self) -> Outbox {
        Outbox::connect(&self.url, OutboxOptions::default()).unwrap()
    }

    /// The application's own connection, with a table of its own.
    fn app(&self) -> postgres::Client {
        let mut client = postgres::Client::connect(&self.url, postgres::NoTls).unwrap();
        client
            .batch_execute("CREATE TABLE IF NOT EXISTS answers (id serial PRIMARY KEY, body text)")
            .unwrap();
        // A statement that waits for a lock of ours fails instead of hanging the test.
        client
            .batch_execute("SET statement_timeout = 20000")
            .unwrap();
        client
    }
}

fn reply(chat: &str, text: &str) -> NewDelivery {
    NewDelivery::single("t", chat, text)
}

/// Sends every claim it gets, recording the texts.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl ChannelAdapter for Recorder {
    fn send(&self, claim: &Claim) -> Outcome {
        self.0.lock().unwrap().push(claim.text.clone());
        Outcome::delivered(None)
    }
}

impl Recorder {
    fn wait_for(&self, n: usize) -> Vec<String> {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let sent = self.0.lock().unwrap().clone();
            if sent.len() >= n {
                return sent;
            }
            assert!(Instant::now() < until, "only {sent:?} sent");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Stages `r` in a transaction of the application's connection that commits.
fn committed(outbox: &Outbox, app: &mut postgres::Client, r: &NewDelivery) -> Enqueued {
    let mut tx = app.transaction().unwrap();
    let enqueued = outbox.enqueue_in_pg(&mut tx, r).unwrap();
    tx.commit().unwrap();
    enqueued
}

/// Claims and delivers everything due, one at a time; the texts in order.
fn drain(outbox: &Outbox) -> Vec<String> {
    let mut sent = Vec::new();
    loop {
        let claims = outbox.claim(1).unwrap();
        let Some(claim) = claims.first() else {
            return sent;
        };
        sent.push(claim.text.clone());
        outbox.record(claim, Outcome::delivered(None)).unwrap();
    }
}

#[test]
fn a_committed_reply_wakes_another_handles_dispatcher_and_is_delivered_once() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let recorder = Recorder::default();
    // A poll this slow cannot explain a send within the test: the commit's
    // notification must wake it.
    let running = Dispatcher::builder(place.outbox())
        .adapter("t", recorder.clone())
        .poll_interval(Duration::from_secs(600))
        .build()
        .unwrap()
        .start()
        .unwrap();
    let mut app = place.app();
    let mut tx = app.transaction().unwrap();
    tx.execute("INSERT INTO answers (body) VALUES ('42')", &[])
        .unwrap();
    let enqueued = outbox
        .enqueue_in_pg(&mut tx, &reply("c1", "the answer is 42"))
        .unwrap();
    assert!(enqueued.created);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        recorder.0.lock().unwrap().is_empty(),
        "sent before the commit"
    );
    assert!(
        outbox.delivery(enqueued.id).unwrap().is_none(),
        "visible before the commit"
    );
    tx.commit().unwrap();
    assert_eq!(recorder.wait_for(1), ["the answer is 42"]);
    running.shutdown(Duration::from_secs(10));
    // The uid the application was given names the delivery it became.
    let view = outbox.delivery(enqueued.id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Delivered);
    let mut admin = place.app();
    let history: i64 = admin
        .query_one(
            "SELECT count(*) FROM outbound_messages WHERE delivery_id = $1",
            &[&enqueued.id.to_string()],
        )
        .unwrap()
        .get(0);
    assert_eq!(history, 1);
}

#[test]
fn a_rolled_back_reply_leaves_nothing() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let mut app = place.app();
    let mut tx = app.transaction().unwrap();
    let enqueued = outbox
        .enqueue_in_pg(&mut tx, &reply("c1", "never"))
        .unwrap();
    tx.rollback().unwrap();
    outbox.recover(RecoverScope::ExpiredLeases).unwrap();
    assert!(outbox.delivery(enqueued.id).unwrap().is_none());
    assert!(drain(&outbox).is_empty());
    let rows: i64 = app
        .query_one("SELECT count(*) FROM outbound_deliveries", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
}

#[test]
fn a_staged_reply_shows_as_queued_and_can_be_cancelled_before_it_starts() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let mut app = place.app();
    let id = committed(&outbox, &mut app, &reply("c1", "withdrawn")).id;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Queued
    );
    outbox.cancel(id).unwrap();
    assert!(
        drain(&outbox).is_empty(),
        "a cancelled staged reply is never sent"
    );
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Cancelled
    );
}

#[test]
fn a_purge_forgets_the_row_a_staged_reply_had() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let mut app = place.app();
    let staged = committed(&outbox, &mut app, &reply("c1", "old")).id;
    outbox.enqueue(&reply("c1", "newest")).unwrap(); // a purge keeps the newest row
    assert_eq!(drain(&outbox), ["old", "newest"]);
    let renumbered = |app: &mut postgres::Client| -> i64 {
        app.query_one("SELECT count(*) FROM outbound_renumbered", &[])
            .unwrap()
            .get(0)
    };
    assert_eq!(renumbered(&mut app), 1);
    let report = outbox
        .purge(chrono::Utc::now() + chrono::Duration::days(1))
        .unwrap();
    assert_eq!(report.deliveries, 1);
    assert!(outbox.delivery(staged).unwrap().is_none());
    assert_eq!(renumbered(&mut app), 0);
}

#[test]
fn lane_order_is_commit_order() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    outbox.enqueue(&reply("c1", "first")).unwrap();
    let mut app = place.app();
    let mut tx = app.transaction().unwrap();
    outbox
        .enqueue_in_pg(&mut tx, &reply("c1", "third"))
        .unwrap();
    // Committed while the application's transaction is still open: it goes before.
    outbox.enqueue(&reply("c1", "second")).unwrap();
    tx.commit().unwrap();
    outbox.enqueue(&reply("c1", "fourth")).unwrap();
    assert_eq!(drain(&outbox), ["first", "second", "third", "fourth"]);
}

#[test]
fn a_busy_lane_does_not_hold_the_applications_commit_nor_an_open_one_the_lane() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    outbox.enqueue(&reply("c1", "before")).unwrap();
    // Another transaction holds the lane's row (as an ack of that chat would).
    let mut holder = place.app();
    holder.batch_execute("BEGIN").unwrap();
    holder
        .batch_execute("SELECT 1 FROM outbound_lanes WHERE chat_id = 'c1' FOR UPDATE")
        .unwrap();
    let mut app = place.app();
    app.batch_execute("SET lock_timeout = 2000").unwrap();
    committed(&outbox, &mut app, &reply("c1", "staged"));
    holder.batch_execute("ROLLBACK").unwrap();

    // An open application transaction with a staged reply: the lane goes on.
    let mut tx = app.transaction().unwrap();
    outbox.enqueue_in_pg(&mut tx, &reply("c1", "open")).unwrap();
    assert_eq!(drain(&outbox), ["before", "staged"]);
    outbox.enqueue(&reply("c1", "after")).unwrap();
    assert_eq!(drain(&outbox), ["after"]);
    tx.commit().unwrap();
    // Started by the next claim after the commit's notification, or by a maintenance
    // pass: here the latter, so the test does not wait for the former.
    outbox.recover(RecoverScope::ExpiredLeases).unwrap();
    assert_eq!(drain(&outbox), ["open"]);
}

/// A claim never waits for a lane: a staged reply whose lane another transaction
/// holds stays staged until the lane is free, then starts.
#[test]
fn a_staged_reply_whose_lane_is_held_waits_for_the_next_claim() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    outbox.enqueue(&reply("c1", "first")).unwrap();
    assert_eq!(drain(&outbox), ["first"]);
    let mut app = place.app();
    committed(&outbox, &mut app, &reply("c1", "held"));
    let mut holder = place.app();
    holder.batch_execute("BEGIN").unwrap();
    holder
        .batch_execute("SELECT 1 FROM outbound_lanes WHERE chat_id = 'c1' FOR UPDATE")
        .unwrap();
    outbox.recover(RecoverScope::ExpiredLeases).unwrap();
    let staged = |app: &mut postgres::Client| -> i64 {
        app.query_one(
            "SELECT count(*) FROM outbound_deliveries WHERE status = 'new'",
            &[],
        )
        .unwrap()
        .get(0)
    };
    assert!(
        outbox.claim(1).unwrap().is_empty(),
        "started in a held lane"
    );
    assert_eq!(staged(&mut app), 1);
    holder.batch_execute("ROLLBACK").unwrap();
    assert_eq!(drain(&outbox), ["held"]);
    assert_eq!(staged(&mut app), 0);
}

#[test]
fn a_claim_loop_hears_of_a_committed_staged_reply() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    assert!(drain(&outbox).is_empty()); // the loop runs (and listens)
    let mut app = place.app();
    committed(&outbox, &mut app, &reply("c1", "heard"));
    assert_eq!(first_sent(&outbox, Duration::from_secs(30)), ["heard"]);
}

/// What a claim loop first sends, within `limit` (the test fails after it).
fn first_sent(outbox: &Outbox, limit: Duration) -> Vec<String> {
    let until = Instant::now() + limit;
    loop {
        let sent = drain(outbox);
        if !sent.is_empty() {
            return sent;
        }
        assert!(
            Instant::now() < until,
            "the claim loop never started the staged reply"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn one_caller_key_in_two_transactions_at_once_is_one_reply() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let keyed = |text: &str| reply("c1", text).with_idempotency_key("k1");
    let (mut first, mut second) = (place.app(), place.app());
    let mut tx1 = first.transaction().unwrap();
    let made = outbox.enqueue_in_pg(&mut tx1, &keyed("once")).unwrap();
    assert!(made.created);
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let mut tx2 = second.transaction().unwrap();
            let found = outbox.enqueue_in_pg(&mut tx2, &keyed("once"));
            tx2.commit().unwrap();
            found
        });
        // The second waits for the first's key: it has not returned yet.
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            !waiting.is_finished(),
            "the second did not wait for the key"
        );
        tx1.commit().unwrap();
        let found = waiting.join().unwrap().unwrap();
        assert_eq!((found.id, found.created), (made.id, false));
    });
    // The crate's own enqueue with that key finds it too; other content is refused.
    let again = outbox.enqueue(&keyed("once")).unwrap();
    assert_eq!((again.id, again.created), (made.id, false));
    let mut third = place.app();
    let mut tx3 = third.transaction().unwrap();
    assert!(matches!(
        outbox.enqueue_in_pg(&mut tx3, &keyed("other")),
        Err(Error::IdempotencyConflict { existing, .. }) if existing == made.id
    ));
    drop(tx3);
    assert_eq!(drain(&outbox), ["once"]);
}

#[test]
fn a_key_whose_first_transaction_rolls_back_is_made_by_the_second() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let keyed = reply("c1", "kept").with_idempotency_key("k1");
    let (mut first, mut second) = (place.app(), place.app());
    let mut tx1 = first.transaction().unwrap();
    outbox.enqueue_in_pg(&mut tx1, &keyed).unwrap();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let mut tx2 = second.transaction().unwrap();
            let made = outbox.enqueue_in_pg(&mut tx2, &keyed);
            tx2.commit().unwrap();
            made
        });
        std::thread::sleep(Duration::from_millis(100));
        tx1.rollback().unwrap();
        assert!(waiting.join().unwrap().unwrap().created);
    });
    assert_eq!(drain(&outbox), ["kept"]);
}

#[test]
fn the_crates_own_enqueue_waits_for_an_application_transaction_with_its_key() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let keyed = reply("c1", "one").with_idempotency_key("k1");
    let mut app = place.app();
    let mut tx = app.transaction().unwrap();
    let staged = outbox.enqueue_in_pg(&mut tx, &keyed).unwrap();
    std::thread::scope(|s| {
        let plain = s.spawn(|| outbox.enqueue(&keyed));
        std::thread::sleep(Duration::from_millis(100));
        tx.commit().unwrap();
        let found = plain.join().unwrap().unwrap();
        assert_eq!((found.id, found.created), (staged.id, false));
    });
    assert_eq!(drain(&outbox), ["one"]);
}

/// REPEATABLE READ and SERIALIZABLE: a key taken after the snapshot is a serialization
/// failure (the application retries); one taken before it is found.
#[test]
fn snapshot_isolation_levels_refuse_a_key_taken_after_their_snapshot() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let key = format!("k-{level}");
        let keyed = reply("c1", "r").with_idempotency_key(key.clone());
        let mut app = place.app();
        let mut tx = app
            .build_transaction()
            .isolation_level(if level == "SERIALIZABLE" {
                postgres::IsolationLevel::Serializable
            } else {
                postgres::IsolationLevel::RepeatableRead
            })
            .start()
            .unwrap();
        tx.execute("SELECT 1", &[]).unwrap(); // the snapshot is taken
        let taken = outbox.enqueue(&keyed).unwrap();
        assert!(
            matches!(outbox.enqueue_in_pg(&mut tx, &keyed), Err(Error::Busy)),
            "{level}"
        );
        drop(tx);
        // Retried, the transaction's new snapshot sees the reply.
        let mut tx = app
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .start()
            .unwrap();
        let found = outbox.enqueue_in_pg(&mut tx, &keyed).unwrap();
        assert_eq!((found.id, found.created), (taken.id, false), "{level}");
        tx.commit().unwrap();
    }
}

#[test]
fn an_sqlite_outbox_refuses_a_postgresql_transaction() {
    let Some(place) = Place::new() else {
        return;
    };
    let file = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
    let mut app = place.app();
    let mut tx = app.transaction().unwrap();
    assert!(matches!(
        file.enqueue_in_pg(&mut tx, &reply("c1", "x")),
        Err(Error::Unsupported { .. })
    ));
    // Bad input is refused before anything runs.
    let outbox = place.outbox();
    assert!(matches!(
        outbox.enqueue_in_pg(&mut tx, &reply("", "x")),
        Err(Error::InvalidInput { .. })
    ));
    tx.commit().unwrap();
}

/// Runs `f` on a runtime of its own (the outbox's own calls block, so they stay
/// outside it).
#[cfg(any(feature = "tokio-postgres", feature = "sqlx"))]
fn on_runtime<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[cfg(feature = "tokio-postgres")]
#[test]
fn tokio_postgres_transactions_commit_and_roll_back_their_reply() {
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let (kept, dropped, first, same) = on_runtime(async {
        let (mut client, connection) = tokio_postgres::connect(&place.url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let tx = client.transaction().await.unwrap();
        let kept = outbox
            .enqueue_in_tokio_pg(&tx, &reply("c1", "kept"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let dropped = outbox
            .enqueue_in_tokio_pg(&tx, &reply("c1", "dropped"))
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let keyed = reply("c2", "k").with_idempotency_key("k");
        let first = outbox.enqueue_in_tokio_pg(&tx, &keyed).await.unwrap();
        let same = outbox.enqueue_in_tokio_pg(&tx, &keyed).await.unwrap();
        tx.commit().await.unwrap();
        (kept, dropped, first, same)
    });
    assert_eq!((same.id, same.created), (first.id, false));
    assert_eq!(drain(&outbox), ["kept", "k"]);
    assert!(outbox.delivery(dropped.id).unwrap().is_none());
    assert_eq!(
        outbox.delivery(kept.id).unwrap().unwrap().status,
        DeliveryStatus::Delivered
    );
}

#[cfg(feature = "sqlx")]
#[test]
fn sqlx_transactions_commit_and_roll_back_their_reply() {
    use sqlx::Connection;
    let Some(place) = Place::new() else {
        return;
    };
    let outbox = place.outbox();
    let (kept, dropped, first, same) = on_runtime(async {
        let mut conn = sqlx::PgConnection::connect(&place.url).await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let kept = outbox
            .enqueue_in_sqlx(&mut tx, &reply("c1", "kept"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let dropped = outbox
            .enqueue_in_sqlx(&mut tx, &reply("c1", "dropped"))
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let keyed = reply("c2", "k").with_idempotency_key("k");
        let first = outbox.enqueue_in_sqlx(&mut tx, &keyed).await.unwrap();
        let same = outbox.enqueue_in_sqlx(&mut tx, &keyed).await.unwrap();
        let other = reply("c2", "other").with_idempotency_key("k");
        assert!(matches!(
            outbox.enqueue_in_sqlx(&mut tx, &other).await,
            Err(Error::IdempotencyConflict { .. })
        ));
        tx.commit().await.unwrap();
        (kept, dropped, first, same)
    });
    assert_eq!((same.id, same.created), (first.id, false));
    assert_eq!(drain(&outbox), ["kept", "k"]);
    assert!(outbox.delivery(dropped.id).unwrap().is_none());
    assert_eq!(
        outbox.delivery(kept.id).unwrap().unwrap().status,
        DeliveryStatus::Delivered
    );
}

/// Without notifications (`with_listen(false)`, as behind PgBouncer), a claim loop
/// still starts a reply staged after its first claim, within a poll interval.
#[test]
fn a_claim_loop_without_notifications_starts_a_staged_reply() {
    let place = Place::new().expect("the PostgreSQL test server");
    let outbox = Outbox::connect(&place.url, OutboxOptions::default().with_listen(false)).unwrap();
    assert!(drain(&outbox).is_empty());
    let mut app = place.app();
    committed(&outbox, &mut app, &reply("c1", "staged"));
    assert_eq!(first_sent(&outbox, Duration::from_secs(10)), ["staged"]);
}

/// Two transactions that stage replies to one chat have them sent in the order they
/// committed, not the order they called the function.
#[test]
fn staged_replies_of_one_chat_go_out_in_commit_order() {
    let place = Place::new().expect("the PostgreSQL test server");
    let outbox = place.outbox();
    let mut first_caller = place.app();
    let mut second_caller = place.app();
    let mut called_first = first_caller.transaction().unwrap();
    outbox
        .enqueue_in_pg(&mut called_first, &reply("c1", "committed second"))
        .unwrap();
    let mut called_second = second_caller.transaction().unwrap();
    outbox
        .enqueue_in_pg(&mut called_second, &reply("c1", "committed first"))
        .unwrap();
    called_second.commit().unwrap();
    called_first.commit().unwrap();
    assert_eq!(drain(&outbox), ["committed first", "committed second"]);
}

/// `outbound_enqueue` called by any client refuses what the crate's validation
/// refuses, with SQLSTATE 22023 and the reason, and leaves nothing; a staged row that
/// still cannot be started (written around the function) is set aside once, visible
/// in health and the list, and every other reply goes out.
#[test]
fn a_staged_reply_the_crate_refuses_never_stops_the_others() {
    let place = Place::new().expect("the PostgreSQL test server");
    let outbox = place.outbox();
    let mut app = place.app();
    let call =
        "SELECT * FROM outbound_enqueue('t', 'c1', NULL, NULL, 'x', $1, NULL, NULL, 0, 0, 0)";
    let too_many: Vec<String> = vec!["x".into(); 20_000];
    let blank: Vec<String> = vec!["x".into(), "  ".into()];
    let none: Vec<String> = Vec::new();
    for (chunks, reason) in [
        (&too_many, "20000 chunks"),
        (&blank, "empty or whitespace"),
        (&none, "at least one chunk"),
    ] {
        let err = app.query(call, &[chunks]).unwrap_err();
        let db = err.as_db_error().expect("the server's refusal");
        assert_eq!(db.code().code(), "22023");
        assert!(db.message().contains(reason), "{}", db.message());
    }
    // Written around the function: a row no claim can start.
    app.batch_execute(
        "INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
             created_at, updated_at, text, new_chunks)
         SELECT nextval('outbound_deliveries_id_seq'), '00000000-0000-7000-8000-000000000001',
                't', 'c2', 'new', 20000, 0, 0, 'x', array_fill('x'::text, ARRAY[20000])",
    )
    .unwrap();
    outbox.enqueue(&reply("c3", "fine")).unwrap();
    assert_eq!(drain(&outbox), ["fine"]);
    assert_eq!(
        drain(&outbox),
        Vec::<String>::new(),
        "retried at every claim"
    );
    let health = outbox.health().unwrap();
    assert_eq!(health.totals.corrupt_deliveries, 1);
    let corrupt = outbox.corrupt_rows().unwrap();
    assert_eq!(corrupt.len(), 1);
    assert!(
        corrupt[0].reason.contains("cannot be started"),
        "{corrupt:?}"
    );
    let failed = outbox
        .list(&chunked_outbox::monitoring::ListFilter::default().status(DeliveryStatus::Failed))
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].chat_id, "c2");
}

/// `list` filtered by `queued` shows the staged replies an unfiltered list shows as
/// queued.
#[test]
fn a_queued_filter_lists_staged_replies() {
    let place = Place::new().expect("the PostgreSQL test server");
    let outbox = place.outbox();
    let mut app = place.app();
    let staged = committed(&outbox, &mut app, &reply("c1", "staged")).id;
    let all = outbox
        .list(&chunked_outbox::monitoring::ListFilter::default())
        .unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].status, DeliveryStatus::Queued);
    let queued = outbox
        .list(&chunked_outbox::monitoring::ListFilter::default().status(DeliveryStatus::Queued))
        .unwrap();
    assert_eq!(queued.iter().map(|v| v.id).collect::<Vec<_>>(), [staged]);
    // Found by its caller key too, on a channel no reply of the crate's named yet.
    let keyed = NewDelivery::single("never-seen", "c9", "keyed").with_idempotency_key("turn-7");
    let keyed = committed(&outbox, &mut app, &keyed).id;
    let found = outbox
        .list(&chunked_outbox::monitoring::ListFilter::default().idempotency_key("turn-7"))
        .unwrap();
    assert_eq!(found.iter().map(|v| v.id).collect::<Vec<_>>(), [keyed]);
}

/// The SQL function and the crate refuse the same replies: each limit the crate
/// states (`chunked_outbox::limits`) holds in `outbound_enqueue` too, at one byte or
/// one chunk past it, and what is exactly at it is accepted by both. The limits are
/// written twice (Rust and the V4 migration); this ties them.
#[test]
fn the_function_and_the_crate_refuse_the_same_replies() {
    use chunked_outbox::limits::{
        MAX_CHANNEL_BYTES, MAX_CHAT_ID_BYTES, MAX_CHUNKS, MAX_KEY_BYTES, MAX_METADATA_BYTES,
    };
    let place = Place::new().expect("the PostgreSQL test server");
    let outbox = place.outbox();
    // The function's calls in a schema of their own: the crate's rows never meet them.
    let elsewhere = Place::new().unwrap();
    drop(elsewhere.outbox());
    let mut app = elsewhere.app();
    let call = "SELECT * FROM outbound_enqueue($1, $2, NULL, $3, $4, $5, $6, NULL, 0, 0, 0)";
    let at = |n: usize| "x".repeat(n);
    // (what, channel, chat, key, chunks, metadata) at a limit, then one past it. Only
    // the key case gives a key: replies without one are never taken for each other.
    type Case = (
        &'static str,
        String,
        String,
        Option<String>,
        Vec<String>,
        Option<String>,
    );
    let base = |what| -> Case { (what, "t".into(), "c".into(), None, vec!["x".into()], None) };
    let mut cases: Vec<(Case, Case)> = Vec::new();
    for n in [
        MAX_CHANNEL_BYTES,
        MAX_CHAT_ID_BYTES,
        MAX_KEY_BYTES,
        MAX_METADATA_BYTES,
    ] {
        let (mut ok, mut over) = (base("limit"), base("limit"));
        match n {
            _ if n == MAX_CHANNEL_BYTES => (ok.1, over.1) = (at(n), at(n + 1)),
            _ if n == MAX_CHAT_ID_BYTES => (ok.2, over.2) = (at(n), at(n + 1)),
            _ if n == MAX_KEY_BYTES => (ok.3, over.3) = (Some(at(n)), Some(at(n + 1))),
            _ => (ok.5, over.5) = (Some(at(n)), Some(at(n + 1))),
        }
        cases.push((ok, over));
    }
    let (mut ok, mut over) = (base("chunks"), base("chunks"));
    (ok.4, over.4) = (
        vec!["x".into(); MAX_CHUNKS],
        vec!["x".into(); MAX_CHUNKS + 1],
    );
    cases.push((ok, over));
    for (i, (ok, over)) in cases.into_iter().enumerate() {
        for (case, accepted) in [(ok, true), (over, false)] {
            let (_, channel, chat, key, chunks, metadata) = case;
            let mut d = NewDelivery::chunked(&channel, &chat, chunks.join(" "), chunks.iter());
            if let Some(k) = &key {
                d = d.with_idempotency_key(k);
            }
            if let Some(m) = &metadata {
                d = d.with_metadata(m);
            }
            let crate_says = outbox.enqueue(&d);
            let sql_says = app.query(
                call,
                &[&channel, &chat, &key, &chunks.join(" "), &chunks, &metadata],
            );
            assert_eq!(
                crate_says.is_ok(),
                accepted,
                "crate, case {i}: {crate_says:?}"
            );
            match sql_says {
                Ok(_) => assert!(accepted, "the function accepted case {i} the crate refuses"),
                Err(e) => {
                    assert!(!accepted, "the function refused case {i}: {e}");
                    assert_eq!(e.as_db_error().map(|d| d.code().code()), Some("22023"));
                }
            }
        }
    }
}

//! PostgreSQL: what a lost connection does to each kind of transaction, against a
//! real server.
//!
//! - A loopback proxy (`common::proxy`) cuts the connection right after a `COMMIT`
//!   reached the server (it committed; its answer is lost) or right before (it rolls
//!   back): the outbox asks the server which, and reports what really happened.
//! - `pg_terminate_backend` ends the outbox's connection while its transaction waits
//!   for a lock the test holds: in the middle of a claim, an ack, and a finalization
//!   into the application's table. Nothing is half-applied, and a retry completes it.
//!
//! What each test checks afterwards is read as a real party could: the chunk's row
//! through the outbox's own views, and the history tables by their keys.
#![cfg(feature = "postgres")]

mod common;

use std::time::{Duration, Instant};

use chunked_outbox::monitoring::ChunkStatus;
use chunked_outbox::{Claim, DeliveryId, Error, NewDelivery, Outbox, OutboxOptions, Outcome};
use common::postgres::{fresh_schema, server_url, with_search_path};
use common::proxy::{Cut, Proxy};

/// A direct connection to the test server whose session uses `schema`.
fn admin(schema: &str) -> postgres::Client {
    let url = with_search_path(&server_url().unwrap(), schema);
    postgres::Client::connect(&url, postgres::NoTls).unwrap()
}

/// One reply to chat `c1`, claimed.
fn claimed(outbox: &Outbox) -> (DeliveryId, Claim) {
    let id = outbox
        .enqueue(&NewDelivery::single("t", "c1", "hello"))
        .unwrap()
        .id;
    let mut claims = outbox.claim(1).unwrap();
    assert_eq!(claims.len(), 1);
    (id, claims.remove(0))
}

/// The chunk's status and attempts, as the outbox shows them.
fn chunk_state(outbox: &Outbox, id: DeliveryId) -> (ChunkStatus, u32) {
    let view = outbox.delivery(id).unwrap().unwrap();
    (view.chunks[0].status, view.chunks[0].attempts)
}

/// Rows of the crate's history for `id`.
fn history(admin: &mut postgres::Client, id: DeliveryId) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM outbound_messages WHERE delivery_id = $1",
            &[&id.to_string()],
        )
        .unwrap()
        .get(0)
}

fn delivered() -> Outcome {
    Outcome::delivered(Some("m1".into()))
}

struct ViaProxy {
    proxy: Proxy,
    outbox: Outbox,
    admin: postgres::Client,
}

fn via_proxy(options: OutboxOptions) -> Option<ViaProxy> {
    let proxy = Proxy::start()?;
    let schema = fresh_schema()?;
    let outbox = Outbox::connect(&proxy.url(&schema, "outbox"), options).unwrap();
    Some(ViaProxy {
        proxy,
        outbox,
        admin: admin(&schema),
    })
}

#[test]
fn an_ack_whose_commit_answer_is_lost_is_recorded_once() {
    let Some(mut t) = via_proxy(OutboxOptions::default()) else {
        return;
    };
    let (id, claim) = claimed(&t.outbox);
    t.proxy.cut_next_commit(Cut::AfterCommit);
    let recorded = t.outbox.record(&claim, delivered());
    assert!(t.proxy.commit_cut(), "the ack's commit passed the proxy");
    assert_eq!(t.proxy.cuts(), 1);
    // The commit happened: the outbox asked the server, and says so.
    assert_eq!(recorded.unwrap().status, ChunkStatus::Delivered);
    assert_eq!(chunk_state(&t.outbox, id).0, ChunkStatus::Delivered);
    assert_eq!(history(&mut t.admin, id), 1);
    // Recording it again changes nothing.
    assert!(matches!(
        t.outbox.record(&claim, delivered()),
        Err(Error::StaleClaim { .. })
    ));
    assert_eq!(history(&mut t.admin, id), 1);
}

#[test]
fn an_ack_whose_commit_never_arrived_changes_nothing_and_is_retried() {
    let Some(mut t) = via_proxy(OutboxOptions::default()) else {
        return;
    };
    let (id, claim) = claimed(&t.outbox);
    t.proxy.cut_next_commit(Cut::BeforeCommit);
    let lost = t.outbox.record(&claim, delivered());
    assert!(t.proxy.commit_cut());
    assert!(
        matches!(lost, Err(Error::Connection { .. })),
        "rolled back, so a plain lost connection: {lost:?}"
    );
    assert_eq!(chunk_state(&t.outbox, id), (ChunkStatus::Sending, 1));
    assert_eq!(history(&mut t.admin, id), 0);
    assert_eq!(
        t.outbox.record(&claim, delivered()).unwrap().status,
        ChunkStatus::Delivered
    );
    assert_eq!(history(&mut t.admin, id), 1);
}

#[test]
fn a_claim_whose_commit_answer_is_lost_is_held_by_its_claimer() {
    let Some(mut t) = via_proxy(OutboxOptions::default()) else {
        return;
    };
    let id = t
        .outbox
        .enqueue(&NewDelivery::single("t", "c1", "hello"))
        .unwrap()
        .id;
    // Lost after the commit: the claim happened, and the claimer holds it.
    t.proxy.cut_next_commit(Cut::AfterCommit);
    let claims = t.outbox.claim(1).unwrap();
    assert!(t.proxy.commit_cut());
    assert_eq!(claims.len(), 1, "the claim committed and is returned");
    assert_eq!(chunk_state(&t.outbox, id), (ChunkStatus::Sending, 1));
    t.outbox.record(&claims[0], delivered()).unwrap();
    assert_eq!(history(&mut t.admin, id), 1);

    // Lost before the commit: nothing was claimed, no attempt spent.
    let id = t
        .outbox
        .enqueue(&NewDelivery::single("t", "c2", "again"))
        .unwrap()
        .id;
    t.proxy.cut_next_commit(Cut::BeforeCommit);
    assert!(matches!(t.outbox.claim(1), Err(Error::Connection { .. })));
    assert_eq!(chunk_state(&t.outbox, id), (ChunkStatus::Pending, 0));
    let claims = t.outbox.claim(1).unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].attempt, 1);
}

#[test]
fn a_commit_nobody_can_confirm_is_unknown_and_a_retry_is_safe() {
    let options = OutboxOptions::default().with_busy_timeout(Duration::from_millis(300));
    let Some(mut t) = via_proxy(options) else {
        return;
    };
    let (id, claim) = claimed(&t.outbox);
    // The commit happens, its answer is lost, and the network stays down.
    t.proxy.cut_next_commit(Cut::AfterCommit);
    t.proxy.refuse(true);
    let unknown = t.outbox.record(&claim, delivered());
    assert!(
        matches!(unknown, Err(Error::CommitUnknown { .. })),
        "{unknown:?}"
    );
    t.proxy.refuse(false);
    // It had committed: the retry finds the chunk settled, and changes nothing.
    assert!(matches!(
        t.outbox.record(&claim, delivered()),
        Err(Error::StaleClaim { .. })
    ));
    assert_eq!(chunk_state(&t.outbox, id).0, ChunkStatus::Delivered);
    assert_eq!(history(&mut t.admin, id), 1);
}

#[test]
fn a_commit_confirmed_once_the_network_is_back_is_a_success() {
    // Asked for up to the busy timeout (5 s by default): an outage shorter than that
    // ends with the answer.
    let Some(mut t) = via_proxy(OutboxOptions::default()) else {
        return;
    };
    let (id, claim) = claimed(&t.outbox);
    t.proxy.cut_next_commit(Cut::AfterCommit);
    t.proxy.refuse(true);
    let recorded = std::thread::scope(|s| {
        let recording = s.spawn(|| t.outbox.record(&claim, delivered()));
        // The outage: until the commit was cut, and a moment more.
        while !t.proxy.commit_cut() {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(200));
        t.proxy.refuse(false);
        recording.join().unwrap()
    });
    assert_eq!(recorded.unwrap().status, ChunkStatus::Delivered);
    assert_eq!(history(&mut t.admin, id), 1);
}

/// A commit the server answers with a refusal did not happen: the caller gets the
/// server's error, not a lost connection, and nothing is stored.
#[test]
fn a_commit_the_server_refuses_is_its_error_and_stores_nothing() {
    let Some(schema) = fresh_schema() else {
        return;
    };
    let outbox = direct(&schema, "refused_commit");
    let mut admin = admin(&schema);
    admin
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$;
             CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON outbound_deliveries
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .unwrap();
    let refused = outbox.enqueue(&NewDelivery::single("t", "c1", "hello"));
    match refused {
        Err(Error::Postgres(e)) => assert!(
            e.to_string().contains("refused at commit")
                || format!("{e:?}").contains("refused at commit"),
            "{e:?}"
        ),
        other => panic!("{other:?}"),
    }
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM outbound_deliveries", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
}

/// A direct outbox whose connections carry `application`, so the test finds them.
fn direct(schema: &str, application: &str) -> Outbox {
    let url = format!(
        "{}&application_name={application}",
        with_search_path(&server_url().unwrap(), schema)
    );
    Outbox::connect(&url, OutboxOptions::default()).unwrap()
}

/// Ends the backend of `application` once it waits for a lock; panics if it never
/// does.
fn terminate_when_waiting(admin: &mut postgres::Client, application: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let ended = admin
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&application],
            )
            .unwrap();
        if !ended.is_empty() {
            return;
        }
        assert!(
            Instant::now() < until,
            "{application} never waited for the lock"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `call` on another thread while `holder` holds a lock it needs; ends the
/// call's connection while it waits, then lets the lock go. Returns what `call` said.
fn terminated_mid_call<T: Send>(
    schema: &str,
    application: &str,
    hold: &str,
    call: impl FnOnce() -> chunked_outbox::Result<T> + Send,
) -> chunked_outbox::Result<T> {
    let mut holder = admin(schema);
    let mut watcher = admin(schema);
    holder.batch_execute("BEGIN").unwrap();
    holder.batch_execute(hold).unwrap();
    let result = std::thread::scope(|s| {
        let running = s.spawn(call);
        terminate_when_waiting(&mut watcher, application);
        running.join().unwrap()
    });
    holder.batch_execute("ROLLBACK").unwrap();
    result
}

#[test]
fn a_claim_ended_by_the_server_claims_nothing_and_a_retry_claims() {
    let Some(schema) = fresh_schema() else {
        return;
    };
    let outbox = direct(&schema, "victim_claim");
    let id = outbox
        .enqueue(&NewDelivery::single("t", "c1", "hello"))
        .unwrap()
        .id;
    // Every write takes the rules shared first: held exclusively, the claim waits.
    let ended = terminated_mid_call(
        &schema,
        "victim_claim",
        "SELECT pg_advisory_xact_lock(hashtextextended(current_schema() || '/rules', 0))",
        || outbox.claim(1),
    );
    assert!(matches!(ended, Err(Error::Connection { .. })), "{ended:?}");
    assert_eq!(chunk_state(&outbox, id), (ChunkStatus::Pending, 0));
    let claims = outbox.claim(1).unwrap();
    assert_eq!((claims.len(), claims[0].attempt), (1, 1));
}

#[test]
fn an_ack_ended_by_the_server_applies_nothing_and_a_retry_records_it_once() {
    let Some(schema) = fresh_schema() else {
        return;
    };
    let outbox = direct(&schema, "victim_ack");
    let (id, claim) = claimed(&outbox);
    // An ack locks its lane first.
    let ended = terminated_mid_call(
        &schema,
        "victim_ack",
        "SELECT 1 FROM outbound_lanes WHERE channel = 't' AND chat_id = 'c1' FOR UPDATE",
        || outbox.record(&claim, delivered()),
    );
    assert!(matches!(ended, Err(Error::Connection { .. })), "{ended:?}");
    assert_eq!(chunk_state(&outbox, id), (ChunkStatus::Sending, 1));
    let mut admin = admin(&schema);
    assert_eq!(history(&mut admin, id), 0);
    outbox.record(&claim, delivered()).unwrap();
    assert_eq!(chunk_state(&outbox, id).0, ChunkStatus::Delivered);
    assert_eq!(history(&mut admin, id), 1);
}

#[test]
fn a_finalization_ended_by_the_server_writes_neither_history_and_a_retry_writes_both_once() {
    let Some(schema) = fresh_schema() else {
        return;
    };
    let outbox = direct(&schema, "victim_final");
    let mut admin = admin(&schema);
    admin
        .batch_execute("CREATE TABLE app_messages (id text PRIMARY KEY, chat text, body text)")
        .unwrap();
    outbox
        .set_finalization(Some(
            "INSERT INTO app_messages (id, chat, body) VALUES (:delivery_id, :chat_id, :content)",
        ))
        .unwrap();
    let (id, claim) = claimed(&outbox);
    // The ack's finalization writes the application's table last: locked, it waits
    // there, with the chunk and the crate's history already written in its transaction.
    let ended = terminated_mid_call(
        &schema,
        "victim_final",
        "LOCK TABLE app_messages IN ACCESS EXCLUSIVE MODE",
        || outbox.record(&claim, delivered()),
    );
    assert!(matches!(ended, Err(Error::Connection { .. })), "{ended:?}");
    let app = |admin: &mut postgres::Client| -> i64 {
        admin
            .query_one(
                "SELECT count(*) FROM app_messages WHERE id = $1",
                &[&id.to_string()],
            )
            .unwrap()
            .get(0)
    };
    assert_eq!(chunk_state(&outbox, id), (ChunkStatus::Sending, 1));
    assert_eq!((history(&mut admin, id), app(&mut admin)), (0, 0));
    outbox.record(&claim, delivered()).unwrap();
    assert_eq!((history(&mut admin, id), app(&mut admin)), (1, 1));
}

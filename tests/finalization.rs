//! Finalization into the application's own history: a statement stored in the file,
//! checked when it is set, run with bound values in the transaction of the last ack,
//! exactly once whatever the application's table allows, and by every process.

mod common;

use chunked_outbox::{
    ChunkStatus, Error, NewDelivery, Outbox, OutboxOptions, Outcome, RecoverScope, Resolution,
    Result,
};
use common::*;

/// The application's history as in `APP_HISTORY`, written from a finalized delivery.
const INTO_APP: &str =
    "INSERT INTO messages (id, chat_id, sender_name, content, is_from_bot, timestamp)
     VALUES (:delivery_id, :chat_id, coalesce(:sender, 'bot'), :content, 1, :delivered_at_rfc3339)";

/// An outbox in a chat application's database, finalizing into its `messages`.
fn app_db() -> TestDb {
    let db = TestDb::default();
    db.raw().execute_batch(APP_HISTORY).unwrap();
    db.outbox.set_finalization(Some(INTO_APP)).unwrap();
    db
}

fn app_rows(db: &TestDb, id: chunked_outbox::DeliveryId) -> Vec<(String, String, String)> {
    let conn = db.raw();
    let mut stmt = conn
        .prepare("SELECT content, sender_name, timestamp FROM messages WHERE id = ?1")
        .unwrap();
    stmt.query_map([id.to_string()], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

#[test]
fn a_statement_that_cannot_run_is_refused_when_it_is_set() {
    let db = TestDb::default();
    db.raw().execute_batch(APP_HISTORY).unwrap();
    for (sql, why) in [
        ("INSERT INTO messages (id) VALUES (:delivery_id", "prepare"),
        ("INSERT INTO nowhere (id) VALUES (:delivery_id)", "prepare"),
        (
            "INSERT INTO messages (id) VALUES (:delivery_id); DELETE FROM messages",
            "more than one",
        ),
        ("SELECT :content", "does not write"),
        ("INSERT INTO messages (id) VALUES (:user_id)", ":user_id"),
        ("INSERT INTO messages (id) VALUES (?)", "no name"),
    ] {
        match db.outbox.set_finalization(Some(sql)) {
            Err(Error::InvalidInput { reason, .. }) => {
                assert!(reason.contains(why), "{sql}: {reason}")
            }
            other => panic!("{sql}: {other:?}"),
        }
        assert_eq!(db.outbox.finalization().unwrap(), None, "nothing stored");
    }
}

#[test]
fn a_reply_enters_the_applications_history_once_with_bound_values() -> Result<()> {
    let db = app_db();
    let id = db
        .outbox
        .enqueue(
            &NewDelivery::chunked(
                "telegram",
                "77",
                "first second third",
                ["first", "second", "third"],
            )
            .with_sender("bot-name"),
        )?
        .id;
    for n in 0..3 {
        let claim = claim_one(&db.outbox);
        let recorded = db.outbox.ack(&claim, Some(&format!("tg-{n}")))?;
        assert_eq!(recorded.finalized, n == 2);
        assert_eq!(app_rows(&db, id).len(), usize::from(n == 2));
    }
    let rows = app_rows(&db, id);
    assert_eq!(rows[0].0, "first second third");
    assert_eq!(rows[0].1, "bot-name");
    assert!(
        rows[0].2.starts_with("2026-01-01T") && rows[0].2.ends_with('Z'),
        "{rows:?}"
    );
    // A second finalization of the same delivery (the recovery sweep) writes nothing.
    db.outbox.recover(RecoverScope::ExpiredLeases)?;
    assert_eq!(app_rows(&db, id).len(), 1);
    Ok(())
}

#[test]
fn every_parameter_is_bound_from_the_delivery() -> Result<()> {
    let db = TestDb::default();
    db.raw().execute_batch(
        "CREATE TABLE app (delivery_id, channel, chat_id, sender, content, chunk_count,
                           created_at, delivered_at, delivered_at_rfc3339, platform_message_ids, metadata)",
    )?;
    db.outbox.set_finalization(Some(
        "INSERT INTO app VALUES (:delivery_id, :channel, :chat_id, :sender, :content,
             :chunk_count, :created_at, @delivered_at, $delivered_at_rfc3339, :platform_message_ids,
             :metadata)",
    ))?;
    let id = db
        .outbox
        .enqueue(&NewDelivery::chunked("telegram", "c1", "a\n\nb", ["a", "b"]).with_metadata("m"))?
        .id;
    let first = claim_one(&db.outbox);
    db.outbox.ack(&first, Some("p1"))?;
    db.advance(std::time::Duration::from_millis(1500));
    let second = claim_one(&db.outbox);
    db.outbox.ack(&second, None)?;
    use rusqlite::types::Value::{Integer, Null, Text};
    let row: Vec<rusqlite::types::Value> = db.raw().query_row("SELECT * FROM app", [], |r| {
        (0..11).map(|i| r.get(i)).collect()
    })?;
    let text = |s: &str| Text(s.to_owned());
    assert_eq!(
        row,
        vec![
            text(&id.to_string()),
            text("telegram"),
            text("c1"),
            Null,
            text("a\n\nb"),
            Integer(2),
            Integer(T0),
            Integer(T0 + 1500),
            text("2026-01-01T00:00:01.500Z"),
            text(r#"["p1",null]"#),
            text("m"),
        ]
    );
    Ok(())
}

/// Another process on the file — here the operator settling an uncertain chunk with a
/// handle opened on defaults — finalizes into the application's table too.
#[test]
fn every_process_runs_the_stored_statement() -> Result<()> {
    let db = app_db();
    let id = enqueue(&db.outbox, "77", &["only"]);
    let claim = claim_one(&db.outbox);
    db.outbox.record(
        &claim,
        Outcome::Ambiguous {
            error: "timeout after sending".into(),
        },
    )?;
    let operator = db.reopen(OutboxOptions::default());
    assert_eq!(operator.finalization()?.as_deref(), Some(INTO_APP));
    let recorded = operator.resolve_uncertain(
        claim.chunk_id,
        Resolution::Delivered {
            platform_message_id: None,
        },
    )?;
    assert!(recorded.finalized);
    assert_eq!(app_rows(&db, id).len(), 1);
    Ok(())
}

/// A statement the application's table refuses when it runs fails the ack whole:
/// nothing is written, the claim stays valid, and once the statement is fixed (here:
/// removed) the same ack goes through.
#[test]
fn a_refused_insert_fails_the_ack_and_changes_nothing() -> Result<()> {
    let db = TestDb::default();
    db.raw()
        .execute_batch("CREATE TABLE app (content TEXT CHECK (length(content) < 3))")?;
    let outbox: &Outbox = &db.outbox;
    outbox.set_finalization(Some("INSERT INTO app VALUES (:content)"))?;
    let id = enqueue(outbox, "c", &["too long"]);
    let claim = claim_one(outbox);
    assert!(outbox.ack(&claim, None).is_err());
    let v = view(outbox, id);
    assert_eq!(v.chunks[0].status, ChunkStatus::Sending);
    let ours: i64 = db
        .raw()
        .query_row("SELECT count(*) FROM outbound_messages", [], |r| r.get(0))?;
    assert_eq!(ours, 0);
    outbox.set_finalization(None)?;
    assert!(outbox.ack(&claim, None)?.finalized);
    Ok(())
}

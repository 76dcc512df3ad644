//! Finalization into the application's own history: a statement stored in the file,
//! checked when it is set, run with bound values in the transaction of the last ack,
//! exactly once whatever the application's table allows, and by every process.

mod common;

use chunked_outbox::maintenance::{RecoverScope, Resolution};
use chunked_outbox::monitoring::ChunkStatus;
use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions, Outcome, Result};
use common::*;

/// The application's history as in `APP_HISTORY`, written from a finalized delivery.
const INTO_APP: &str =
    "INSERT INTO messages (id, chat_id, sender_name, content, is_from_bot, timestamp)
     VALUES (:delivery_id, :chat_id, coalesce(:sender, 'bot'), :content, 1, :delivered_at_rfc3339)";

/// An outbox in a chat application's database, finalizing into its `messages`.
fn app_db() -> TestDb {
    let db = TestDb::default();
    db.exec(APP_HISTORY);
    db.outbox.set_finalization(Some(INTO_APP)).unwrap();
    db
}

fn app_rows(db: &TestDb, id: chunked_outbox::DeliveryId) -> Vec<(String, String, String)> {
    db.strings(
        "SELECT content || '|' || sender_name || '|' || timestamp FROM messages WHERE id = $1",
        &id.to_string(),
    )
    .iter()
    .map(|row| {
        let [content, sender, at] = row.split('|').collect::<Vec<_>>()[..] else {
            panic!("{row}")
        };
        (content.into(), sender.into(), at.into())
    })
    .collect()
}

/// A trigger of the application's that raises `ROLLBACK` ends the whole transaction of
/// the ack: nothing of it is recorded, and the error is the trigger's, not a failure of
/// the outbox's own clean-up.
/// SQLite only: RAISE(ROLLBACK) is SQLite's trigger syntax.
#[test]
fn a_trigger_that_rolls_back_fails_the_ack_with_its_own_message() -> Result<()> {
    let db = app_db();
    db.raw()
        .execute_batch(
            "CREATE TRIGGER app_rolls_back BEFORE INSERT ON messages
             BEGIN SELECT RAISE(ROLLBACK, 'history is read-only today'); END;",
        )
        .unwrap();
    let ob = &db.outbox;
    let id = enqueue(ob, "77", &["a"]);
    let claim = claim_one(ob);
    let err = ob.ack(&claim, None).unwrap_err();
    assert!(
        err.to_string().contains("history is read-only today"),
        "{err}"
    );
    assert_eq!(view(ob, id).chunks[0].status, ChunkStatus::Sending);
    Ok(())
}

/// SQLite only: untyped columns and the @name, $name sigils are SQLite's (PostgreSQL: every_value_is_bound_as_the_columns_type).
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

stores! {
    /// A statement stored by hand with a parameter that is not one of ours (the check at
    /// `set_finalization` bypassed) refuses its reply alone, naming the parameter.
    fn a_stored_statement_with_an_unknown_parameter_refuses_its_reply() -> Result<()> {
        let db = TestDb::default();
        db.exec(
            "CREATE TABLE app (content TEXT);
             UPDATE outbound_policy
             SET finalize_sql = 'INSERT INTO app VALUES (:nope)', version = version + 1",
        );
        let id = enqueue(&db.outbox, "1", &["a"]);
        let recorded = db.outbox.ack(&claim_one(&db.outbox), None)?;
        let refusal = recorded.finalize_error.expect("refused");
        assert!(refusal.contains(":nope"), "{refusal}");
        assert_eq!(
            view(&db.outbox, id).status,
            chunked_outbox::monitoring::DeliveryStatus::Unfinalized
        );
        Ok(())
    }


    fn a_statement_that_cannot_run_is_refused_when_it_is_set() {
        let db = TestDb::default();
        db.exec(APP_HISTORY);
        // A positional parameter as each database writes it.
        let positional = match current_store() {
            Store::Sqlite => "INSERT INTO messages (id) VALUES (?)",
            Store::Postgres => "INSERT INTO messages (id) VALUES ($1)",
        };
        for (sql, why) in [
            ("INSERT INTO messages (id) VALUES (:delivery_id", "prepare"),
            ("INSERT INTO nowhere (id) VALUES (:delivery_id)", "prepare"),
            (
                "INSERT INTO messages (id) VALUES (:delivery_id); DELETE FROM messages",
                "more than one",
            ),
            ("SELECT :content", "does not write"),
            ("INSERT INTO messages (id) VALUES (:user_id)", ":user_id"),
            (positional, "no name"),
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

    /// Another process on the file — here the operator settling an uncertain chunk with a
    /// handle opened on defaults — finalizes into the application's table too.
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

    /// A statement the application's table refuses when it runs leaves the ack standing:
    /// the chunk is delivered, nothing of the finalization is written, the reply is
    /// `unfinalized`; once the statement is fixed (here: removed) recovery finalizes it.
    fn a_refused_insert_leaves_the_reply_unfinalized_until_the_statement_takes_it() -> Result<()> {
        let db = TestDb::default();
        db.exec("CREATE TABLE app (content TEXT CHECK (length(content) < 3))");
        let outbox: &Outbox = &db.outbox;
        outbox.set_finalization(Some("INSERT INTO app VALUES (:content)"))?;
        let id = enqueue(outbox, "c", &["too long"]);
        let claim = claim_one(outbox);
        let recorded = outbox.ack(&claim, None)?;
        assert!(!recorded.finalized);
        let refusal = recorded.finalize_error.unwrap();
        assert!(refusal.to_lowercase().contains("check"), "{refusal}");
        let v = view(outbox, id);
        assert_eq!(v.chunks[0].status, ChunkStatus::Delivered);
        assert_eq!(v.status, chunked_outbox::monitoring::DeliveryStatus::Unfinalized);
        let ours = || -> Result<i64> { Ok(db.int("SELECT count(*) FROM outbound_messages")) };
        assert_eq!(ours()?, 0);
        assert!(matches!(
            outbox.ack(&claim, None),
            Err(Error::StaleClaim { .. })
        ));
        outbox.set_finalization(None)?;
        assert_eq!(outbox.recover(RecoverScope::ExpiredLeases)?.finalized, 1);
        assert_eq!(ours()?, 1);
        Ok(())
    }

    /// Item 1 of the review: a reply the application's statement refuses (here a trigger
    /// of the application's) is set aside alone. Every other outcome recorded with it in
    /// one transaction stands; its own chunks stay delivered; it is `unfinalized` with the
    /// statement's message, counted in health, its lane moves on; once the application
    /// fixes its table, recovery finalizes it, exactly once.
    fn a_reply_the_statement_refuses_is_set_aside_alone() -> Result<()> {
        use chunked_outbox::monitoring::DeliveryStatus;
        let db = app_db();
        db.exec(match current_store() {
            Store::Sqlite => {
                "CREATE TABLE app_refused (chat_id TEXT);
                 CREATE TRIGGER app_refuses BEFORE INSERT ON messages
                 WHEN new.chat_id IN (SELECT chat_id FROM app_refused)
                 BEGIN SELECT RAISE(ABORT, 'chat is archived'); END;
                 INSERT INTO app_refused VALUES ('66');"
            }
            Store::Postgres => {
                "CREATE TABLE app_refused (chat_id TEXT);
                 CREATE FUNCTION app_refuses() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                     IF NEW.chat_id::text IN (SELECT chat_id FROM app_refused) THEN
                         RAISE EXCEPTION 'chat is archived';
                     END IF;
                     RETURN NEW;
                 END $$;
                 CREATE TRIGGER app_refuses BEFORE INSERT ON messages
                     FOR EACH ROW EXECUTE FUNCTION app_refuses();
                 INSERT INTO app_refused VALUES ('66');"
            }
        });
        let ob = &db.outbox;
        let refused = enqueue(ob, "66", &["a"]);
        let next_in_lane = enqueue(ob, "66", &["b"]);
        let fine = enqueue(ob, "77", &["c"]);
        let second = enqueue(ob, "77", &["d", "e"]);
        let claims = claim_all(ob);
        assert_eq!(claims.len(), 2);
        let results = ob.record_batch(
            claims
                .iter()
                .map(|c| (c, Outcome::delivered(Some("p".into())))),
        )?;
        let recorded: Vec<_> = results.into_iter().collect::<Result<_>>()?;
        let of = |chat: &str| &recorded[claims.iter().position(|c| c.chat_id == chat).unwrap()];
        assert!(of("77").finalized);
        let refusal = of("66").finalize_error.clone().expect("refused");
        assert!(refusal.contains("chat is archived"), "{refusal}");
        assert!(!of("66").finalized);
        assert_eq!(of("66").status, ChunkStatus::Delivered);

        let v = view(ob, refused);
        assert_eq!(v.status, DeliveryStatus::Unfinalized);
        assert_eq!(v.delivered_count, 1);
        assert_eq!(v.chunks[0].status, ChunkStatus::Delivered);
        assert!(v.finalize_error.unwrap().contains("chat is archived"));
        assert_eq!(view(ob, fine).status, DeliveryStatus::Delivered);
        assert!(app_rows(&db, refused).is_empty(), "nothing of it written");
        assert!(db.messages_for(refused)?.is_empty());
        let h = ob.health()?;
        assert_eq!(h.totals.unfinalized_deliveries, 1);
        assert_eq!(h.totals.awaiting_decision, 1);
        // Both lanes moved on: the next reply of each chat is sent.
        let next: Vec<_> = claim_all(ob).into_iter().map(|c| c.delivery_id).collect();
        assert!(
            next.contains(&next_in_lane) && next.contains(&second),
            "{next:?}"
        );

        // Refused again while the table still refuses: a typed error, nothing changes.
        assert!(matches!(
            ob.finalize_again(refused),
            Err(Error::FinalizationRefused { delivery, .. }) if delivery == refused
        ));
        assert_eq!(ob.recover(RecoverScope::ExpiredLeases)?.finalized, 0);
        assert_eq!(view(ob, refused).status, DeliveryStatus::Unfinalized);
        // The application fixes its table: recovery finalizes it, once.
        db.exec("DELETE FROM app_refused");
        assert_eq!(ob.recover(RecoverScope::ExpiredLeases)?.finalized, 1);
        assert_eq!(view(ob, refused).status, DeliveryStatus::Delivered);
        assert_eq!(view(ob, refused).finalize_error, None);
        assert_eq!(app_rows(&db, refused).len(), 1);
        assert_eq!(db.messages_for(refused)?.len(), 1);
        assert_eq!(ob.recover(RecoverScope::ExpiredLeases)?.finalized, 0);
        assert_eq!(ob.health()?.totals.unfinalized_deliveries, 0);
        Ok(())
    }

    /// Item 1: a reply whose id the application's table holds already (a primary key
    /// conflict) is resolved as delivered by the operator without failing: it lands
    /// `unfinalized`, and `finalize_again` writes it once the row is gone.
    fn resolving_a_reply_the_statement_refuses_leaves_it_unfinalized() -> Result<()> {
        use chunked_outbox::monitoring::DeliveryStatus;
        let db = app_db();
        let ob = &db.outbox;
        let id = enqueue(ob, "77", &["a"]);
        db.exec(&format!(
            "INSERT INTO messages VALUES ('{id}', 77, 'x', 'taken', 1, 't')"
        ));
        let claim = claim_one(ob);
        ob.record(
            &claim,
            Outcome::Ambiguous {
                error: "timeout".into(),
            },
        )?;
        let recorded = ob.resolve_uncertain(
            claim.chunk_id,
            Resolution::Delivered {
                platform_message_id: None,
            },
        )?;
        let refusal = recorded.finalize_error.unwrap();
        assert!(refusal.to_lowercase().contains("unique"), "{refusal}");
        assert_eq!(view(ob, id).status, DeliveryStatus::Unfinalized);
        assert!(matches!(
            ob.finalize_again(enqueue(ob, "78", &["b"])),
            Err(Error::DeliveryState { .. })
        ));
        db.exec(&format!("DELETE FROM messages WHERE id = '{id}'"));
        ob.finalize_again(id)?;
        assert_eq!(view(ob, id).status, DeliveryStatus::Delivered);
        assert_eq!(app_rows(&db, id).len(), 1);
        Ok(())
    }

}

/// On PostgreSQL each value is bound as the type the server infers for its column: the
/// uid as a `uuid`, a numeric chat id as an integer, times as `timestamptz` (from the
/// milliseconds and from the RFC 3339 text alike), the platform ids as `jsonb`.
#[cfg(feature = "postgres")]
#[test]
fn every_value_is_bound_as_the_columns_type() {
    on_store(Store::Postgres, || {
        let db = TestDb::default();
        db.exec(
            "CREATE TABLE app (id uuid PRIMARY KEY, channel text, chat bigint, sender text,
                 content varchar(100), chunks integer, created timestamptz, delivered bigint,
                 at timestamptz, ids jsonb, metadata json)",
        );
        db.outbox
            .set_finalization(Some(
                "INSERT INTO app VALUES (:delivery_id, :channel, :chat_id, :sender, :content,
                     :chunk_count, :created_at, :delivered_at, :delivered_at_rfc3339,
                     :platform_message_ids, :metadata)",
            ))
            .unwrap();
        let id = db
            .outbox
            .enqueue(
                &NewDelivery::chunked("telegram", "77", "a\n\nb", ["a", "b"])
                    .with_metadata(r#"{"k":1}"#),
            )
            .unwrap()
            .id;
        let first = claim_one(&db.outbox);
        db.outbox.ack(&first, Some("p1")).unwrap();
        db.advance(std::time::Duration::from_millis(1500));
        let second = claim_one(&db.outbox);
        db.outbox.ack(&second, None).unwrap();
        let row = db.strings(
            "SELECT concat_ws('|', id, channel, chat, coalesce(sender, 'NULL'), content, chunks,
                 (extract(epoch FROM created) * 1000)::bigint, delivered,
                 (extract(epoch FROM at) * 1000)::bigint, ids, metadata)
             FROM app",
            "",
        );
        let done = T0 + 1500;
        assert_eq!(
            row,
            [format!(
                "{id}|telegram|77|NULL|a\n\nb|2|{T0}|{done}|{done}|[\"p1\", null]|{{\"k\":1}}"
            )]
        );
    });
}

//! Enqueue: idempotency on the caller's key (same content → same id, nothing written;
//! different content → conflict), the transactional-outbox entry point that commits or
//! rolls back with the caller, and invalid input refused before any write.

mod common;

use chunked_outbox::{Error, NewDelivery, OutboxOptions, Result};
use common::*;

/// Row counts of every table, to prove that a refused call wrote nothing.
fn row_counts(db: &TestDb) -> Vec<i64> {
    [
        "outbound_deliveries",
        "outbound_delivery_chunks",
        "outbound_messages",
        "outbound_channel_stats",
        "outbound_lanes",
        "outbound_channels",
        "outbound_policy",
    ]
    .iter()
    .map(|t| db.int(&format!("SELECT count(*) FROM {t}")))
    .collect()
}

/// The chunk rows of delivery `id`: index, status, and whether it is due.
fn chunk_rows(db: &TestDb, id: chunked_outbox::DeliveryId) -> Vec<(i64, String, bool)> {
    db.strings(
        "SELECT c.chunk_index || ' ' || c.status || ' '
                || CASE WHEN c.due_at IS NULL THEN 'idle' ELSE 'due' END
         FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id
         WHERE d.uid = $1 ORDER BY c.chunk_index",
        &id.to_string(),
    )
    .iter()
    .map(|row| {
        let [index, status, due] = row.split(' ').collect::<Vec<_>>()[..] else {
            panic!("{row}")
        };
        (index.parse().unwrap(), status.to_owned(), due == "due")
    })
    .collect()
}

/// SQLite only: enqueue_in takes an SQLite connection's transaction.
#[test]
fn enqueue_in_commits_and_rolls_back_with_the_caller() -> Result<()> {
    let db = TestDb::default();
    let mut app = db.raw();
    app.execute_batch("CREATE TABLE app_state (v TEXT)")?;

    // Rolled back: neither the application's row nor the delivery exists.
    {
        let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        tx.execute("INSERT INTO app_state VALUES ('rolled back')", [])?;
        let id = db
            .outbox
            .enqueue_in(&tx, &NewDelivery::single("telegram", "1", "ghost"))?
            .id;
        tx.rollback()?;
        assert!(db.outbox.delivery(id)?.is_none());
    }
    assert!(claim_all(&db.outbox).is_empty());
    assert_eq!(db.outbox.health()?.totals.total_deliveries, 0);

    // Committed: both land together and the chunk is claimable.
    let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute("INSERT INTO app_state VALUES ('committed')", [])?;
    let id = db
        .outbox
        .enqueue_in(&tx, &NewDelivery::single("telegram", "1", "real"))?
        .id;
    tx.commit()?;
    let claim = claim_one(&db.outbox);
    assert_eq!((claim.delivery_id, claim.text.as_str()), (id, "real"));

    // Outside a transaction it is refused.
    let err = db
        .outbox
        .enqueue_in(&app, &NewDelivery::single("telegram", "1", "x"))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                what: "connection",
                ..
            }
        ),
        "{err:?}"
    );
    Ok(())
}

/// SQLite only: enqueue_in takes an SQLite connection's transaction.
#[test]
fn failed_enqueue_in_leaves_the_callers_transaction_usable() -> Result<()> {
    let db = TestDb::default();
    let mut app = db.raw();
    let d = NewDelivery::single("telegram", "1", "x").with_idempotency_key("k");
    let _ = db.outbox.enqueue(&d)?;
    let tx = app.transaction()?;
    let conflicting = NewDelivery::single("telegram", "1", "y").with_idempotency_key("k");
    assert!(db.outbox.enqueue_in(&tx, &conflicting).is_err());
    let _ = db
        .outbox
        .enqueue_in(&tx, &NewDelivery::single("telegram", "2", "z"))?;
    tx.commit()?;
    assert_eq!(db.outbox.health()?.totals.total_deliveries, 2);
    Ok(())
}

stores! {

    fn same_key_same_content_returns_the_same_delivery_and_writes_nothing() -> Result<()> {
        let db = TestDb::default();
        let d = NewDelivery::chunked("telegram", "1", "a b", ["a", "b"]).with_idempotency_key("k");
        let first = db.outbox.enqueue(&d)?;
        let before = row_counts(&db);
        let again = db.outbox.enqueue(&d)?;
        assert_eq!(again.id, first.id);
        assert!(first.created);
        assert!(!again.created);
        assert_eq!(row_counts(&db), before);
        assert_eq!(db.outbox.health()?.totals.total_deliveries, 1);
        Ok(())
    }

    fn same_key_different_content_is_a_conflict() -> Result<()> {
        let db = TestDb::default();
        let base =
            || NewDelivery::chunked("telegram", "1", "a b", ["a", "b"]).with_idempotency_key("k");
        let first = db.outbox.enqueue(&base())?;
        let before = row_counts(&db);
        for changed in [
            NewDelivery::chunked("telegram", "2", "a b", ["a", "b"]).with_idempotency_key("k"),
            NewDelivery::chunked("telegram", "1", "a  b", ["a", "b"]).with_idempotency_key("k"),
            NewDelivery::chunked("telegram", "1", "a b", ["a b"]).with_idempotency_key("k"),
            base().with_sender("bot"),
        ] {
            let err = db.outbox.enqueue(&changed).unwrap_err();
            assert!(
                matches!(&err, Error::IdempotencyConflict { key, existing } if key == "k" && *existing == first.id),
                "{err:?}"
            );
        }
        assert_eq!(row_counts(&db), before);
        Ok(())
    }

    /// Found: caller keys were global, so Telegram update 9001 and Slack event 9001 —
    /// different replies — collided. Keys are scoped per channel.
    fn caller_keys_are_scoped_per_channel() -> Result<()> {
        let db = TestDb::default();
        let reply = |channel: &str| NewDelivery::single(channel, "1", "a").with_idempotency_key("9001");
        let telegram = db.outbox.enqueue(&reply("telegram"))?;
        let slack = db.outbox.enqueue(&reply("slack"))?;
        assert!(telegram.created && slack.created);
        assert_ne!(telegram.id, slack.id);
        let again = db.outbox.enqueue(&reply("slack"))?;
        assert_eq!((again.created, again.id), (false, slack.id));
        assert_eq!(db.outbox.health()?.totals.total_deliveries, 2);
        Ok(())
    }

    fn invalid_input_is_refused_before_any_write() -> Result<()> {
        let db = TestDb::default();
        let before = row_counts(&db);
        let none: [&str; 0] = [];
        let cases: Vec<(NewDelivery, &str)> = vec![
            (NewDelivery::chunked("telegram", "1", "x", none), "chunks"),
            (
                NewDelivery::chunked("telegram", "1", "x", ["x", ""]),
                "chunks",
            ),
            (
                NewDelivery::chunked("telegram", "1", "x", [" \n\t "]),
                "chunks",
            ),
            (NewDelivery::single("", "1", "x"), "channel"),
            (NewDelivery::single("   ", "1", "x"), "channel"),
            (NewDelivery::single("tele\ngram", "1", "x"), "channel"),
            (NewDelivery::single("x".repeat(129), "1", "x"), "channel"),
            (NewDelivery::single("telegram", "", "x"), "chat id"),
            (NewDelivery::single("telegram", "1", " "), "text"),
            (
                NewDelivery::single("telegram", "1", "x").with_idempotency_key(""),
                "idempotency key",
            ),
            (
                NewDelivery::single("telegram", "1", "x").with_idempotency_key("k".repeat(10 * 1024)),
                "idempotency key",
            ),
            (
                NewDelivery::single("telegram", "1", "x").with_sender(""),
                "sender",
            ),
            (
                NewDelivery::single("telegram", "1", "x".repeat(9 * 1024 * 1024)),
                "text",
            ),
            (
                NewDelivery::chunked("telegram", "1", "x", vec!["x"; 10_001]),
                "chunks",
            ),
        ];
        for (delivery, field) in cases {
            match db.outbox.enqueue(&delivery) {
                Err(Error::InvalidInput { what, .. }) => assert_eq!(what, field),
                other => panic!("{field}: expected InvalidInput, got {other:?}"),
            }
        }
        assert_eq!(row_counts(&db), before);
        Ok(())
    }

    fn awkward_but_valid_input_round_trips_exactly() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default());
        let channel = "tg'; DROP TABLE messages; --\"";
        let chat = i64::MIN.to_string();
        let mut text = "nul\0byte and emoji 👩‍👩‍👧 and ' \" quotes";
        let mut key = "k\0'\"";
        if current_store() == Store::Postgres {
            // PostgreSQL's text holds no NUL: refused, with nothing stored.
            for d in [
                NewDelivery::single(channel, chat.clone(), text),
                NewDelivery::single(channel, chat.clone(), "x").with_idempotency_key(key),
            ] {
                let refused = db.outbox.enqueue(&d).unwrap_err();
                assert!(refused.to_string().contains("NUL"), "{refused}");
            }
            assert!(db.outbox.list(&Default::default())?.is_empty());
            (text, key) = ("no nul, emoji 👩‍👩‍👧 and ' \" quotes", "k'\"");
        }
        let id = db
            .outbox
            .enqueue(&NewDelivery::single(channel, chat.clone(), text).with_idempotency_key(key))?
            .id;
        let claim = claim_one(&db.outbox);
        assert_eq!(
            (
                claim.channel.as_str(),
                claim.chat_id.as_str(),
                claim.text.as_str()
            ),
            (channel, chat.as_str(), text)
        );
        db.outbox.ack(&claim, None)?;
        assert_eq!(db.messages_for(id)?, [text]);
        Ok(())
    }

    /// A reply sent as one chunk is stored once: the chunk row points at the delivery's
    /// text, and every reader (claim, inspection, the idempotency check) sees it whole.
    fn a_reply_sent_as_one_chunk_stores_its_text_once() -> Result<()> {
        let db = TestDb::default();
        let text = "long reply ".repeat(300);
        let single = || NewDelivery::single("telegram", "1", text.clone()).with_idempotency_key("k");
        let id = db.outbox.enqueue(&single())?.id;
        let stored = db.strings(
            "SELECT coalesce(c.text, 'NULL') || ' ' || length(d.text)
             FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id",
            "",
        );
        assert_eq!(stored, [format!("NULL {}", text.len())]);

        assert!(!db.outbox.enqueue(&single())?.created);
        let split = NewDelivery::chunked("telegram", "1", text.clone(), [&text[..9], &text[9..]])
            .with_idempotency_key("k");
        assert!(matches!(
            db.outbox.enqueue(&split),
            Err(Error::IdempotencyConflict { .. })
        ));

        assert_eq!(view(&db.outbox, id).chunks[0].text, text);
        let claim = claim_one(&db.outbox);
        assert_eq!(claim.text, text);
        db.outbox.ack(&claim, None)?;
        assert_eq!(db.messages_for(id)?, [text]);
        Ok(())
    }

    /// Per-reply metadata reaches the adapter with every claim of every chunk — a retry
    /// included — and is shown with the delivery; a reply without has none.
    fn metadata_travels_with_every_claim_of_every_chunk() -> Result<()> {
        let db = TestDb::default();
        let meta = r#"{"reply_to_message_id":1234,"parse_mode":"HTML"}"#;
        let id = db
            .outbox
            .enqueue(
                &chunked_outbox::NewDelivery::chunked("telegram", "42", "a\n\nb", ["a", "b"])
                    .with_metadata(meta),
            )?
            .id;
        let plain = enqueue(&db.outbox, "43", &["no metadata"]);
        let mut seen = Vec::new();
        for round in 0..4 {
            for claim in claim_all(&db.outbox) {
                seen.push((claim.delivery_id, claim.index, claim.metadata.clone()));
                if round == 0 && claim.delivery_id == id {
                    db.outbox.record(
                        &claim,
                        chunked_outbox::Outcome::Transient {
                            error: "502".into(),
                        },
                    )?;
                } else {
                    db.outbox.ack(&claim, None)?;
                }
            }
            db.advance(std::time::Duration::from_secs(3600));
        }
        let ours: Vec<_> = seen.iter().filter(|s| s.0 == id).collect();
        assert_eq!(
            ours.len(),
            3,
            "chunk 1 twice (a retry), chunk 2 once: {seen:?}"
        );
        assert!(
            ours.iter().all(|s| s.2.as_deref() == Some(meta)),
            "{seen:?}"
        );
        assert!(seen.iter().filter(|s| s.0 == plain).all(|s| s.2.is_none()));
        assert_eq!(view(&db.outbox, id).metadata.as_deref(), Some(meta));
        Ok(())
    }

    fn metadata_beyond_the_limit_is_refused_and_nothing_is_written() -> Result<()> {
        let db = TestDb::default();
        let big = "x".repeat(chunked_outbox::limits::MAX_METADATA_BYTES + 1);
        let err = db
            .outbox
            .enqueue(&chunked_outbox::NewDelivery::single("telegram", "42", "hi").with_metadata(big))
            .unwrap_err();
        assert!(
            matches!(
                &err,
                chunked_outbox::Error::InvalidInput {
                    what: "metadata",
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(db.outbox.health()?.totals.total_deliveries, 0);
        let at_limit = "x".repeat(chunked_outbox::limits::MAX_METADATA_BYTES);
        db.outbox.enqueue(
            &chunked_outbox::NewDelivery::single("telegram", "42", "hi").with_metadata(at_limit),
        )?;
        Ok(())
    }

    /// A caller key enqueued again with other metadata is a different reply: a conflict.
    fn a_caller_key_with_other_metadata_is_a_conflict() -> Result<()> {
        let db = TestDb::default();
        let reply = |meta: &str| {
            chunked_outbox::NewDelivery::single("telegram", "42", "hi")
                .with_idempotency_key("k")
                .with_metadata(meta)
        };
        db.outbox.enqueue(&reply("a"))?;
        assert!(!db.outbox.enqueue(&reply("a"))?.created);
        assert!(matches!(
            db.outbox.enqueue(&reply("b")),
            Err(chunked_outbox::Error::IdempotencyConflict { .. })
        ));
        Ok(())
    }

    fn a_batch_is_stored_as_its_enqueues_would_be_in_one_transaction() -> Result<()> {
        let db = TestDb::default();
        let batch = [
            NewDelivery::chunked("telegram", "1", "a b", ["a", "b"]),
            NewDelivery::single("telegram", "1", "second reply to chat 1"),
            NewDelivery::single("discord", "2", "chat 2"),
        ];
        let stored = db.outbox.enqueue_batch(&batch)?;
        assert_eq!(stored.len(), 3);
        assert!(stored.iter().all(|e| e.created));
        let views: Vec<_> = stored.iter().map(|e| view(&db.outbox, e.id)).collect();
        assert_eq!(
            views[1].text, "second reply to chat 1",
            "results in the order given"
        );
        // Lanes as for three enqueues: chat 1's second reply waits behind its first.
        let t = db.outbox.health()?.totals;
        assert_eq!(
            (t.total_deliveries, t.pending_chunks, t.due_chunks),
            (3, 4, 2)
        );
        let order: Vec<String> = std::iter::from_fn(|| {
            let claim = db.outbox.claim_channels(&["telegram"], 1).unwrap().pop()?;
            db.outbox.ack(&claim, None).unwrap();
            Some(claim.text)
        })
        .collect();
        assert_eq!(order, ["a", "b", "second reply to chat 1"]);
        assert!(db.outbox.enqueue_batch(&[])?.is_empty());
        Ok(())
    }

    fn a_batch_with_one_refused_delivery_writes_nothing() -> Result<()> {
        let db = TestDb::default();
        db.outbox
            .enqueue(&NewDelivery::single("telegram", "1", "original").with_idempotency_key("k"))?;
        let before = row_counts(&db);
        let conflicting = [
            NewDelivery::single("telegram", "2", "fine"),
            NewDelivery::single("telegram", "1", "other text").with_idempotency_key("k"),
        ];
        assert!(matches!(
            db.outbox.enqueue_batch(&conflicting),
            Err(Error::IdempotencyConflict { .. })
        ));
        let invalid = [
            NewDelivery::single("telegram", "2", "fine"),
            NewDelivery::single("", "3", "no channel"),
        ];
        assert!(matches!(
            db.outbox.enqueue_batch(&invalid),
            Err(Error::InvalidInput {
                what: "channel",
                ..
            })
        ));
        let max = chunked_outbox::limits::MAX_ENQUEUE_BATCH;
        let too_many = vec![NewDelivery::single("telegram", "2", "fine"); max + 1];
        assert!(matches!(
            db.outbox.enqueue_batch(&too_many),
            Err(Error::InvalidInput {
                what: "deliveries",
                ..
            })
        ));
        assert_eq!(row_counts(&db), before);
        Ok(())
    }

    fn a_key_repeated_within_a_batch_names_its_first_delivery() -> Result<()> {
        let db = TestDb::default();
        let d = NewDelivery::single("telegram", "1", "once").with_idempotency_key("u-1");
        let stored = db.outbox.enqueue_batch([&d, &d])?;
        assert_eq!(stored[0].id, stored[1].id);
        assert_eq!((stored[0].created, stored[1].created), (true, false));
        assert_eq!(db.outbox.health()?.totals.total_deliveries, 1);
        Ok(())
    }

    fn a_batch_of_the_largest_size_is_stored() -> Result<()> {
        let db = TestDb::default();
        let max = chunked_outbox::limits::MAX_ENQUEUE_BATCH;
        let batch: Vec<NewDelivery> = (0..max)
            .map(|n| NewDelivery::single("telegram", n.to_string(), "hi"))
            .collect();
        assert_eq!(db.outbox.enqueue_batch(&batch)?.len(), max);
        assert_eq!(db.outbox.health()?.totals.total_deliveries, max as u64);
        Ok(())
    }

    /// A reply queued behind another, sent as one chunk of its whole text, writes no chunk
    /// row until its lane reaches it (one b-tree page less per enqueue), yet every reader
    /// sees its chunk: inspection, health, the idempotency check, the operator calls, and
    /// the claim once the head is delivered.
    fn a_queued_reply_of_one_chunk_stores_its_chunk_when_its_lane_reaches_it() -> Result<()> {
        use chunked_outbox::monitoring::ChunkStatus;
        use chunked_outbox::monitoring::DeliveryStatus;
        use chunked_outbox::maintenance::Resolution;
        let db = TestDb::default();
        let reply = |text: &str| NewDelivery::single("telegram", "1", text).with_idempotency_key(text);
        let head = db.outbox.enqueue(&reply("first"))?.id;
        let queued = db.outbox.enqueue(&reply("second"))?.id;
        assert_eq!(chunk_rows(&db, head), [(0, "pending".into(), true)]);
        assert_eq!(chunk_rows(&db, queued), []);

        let shown = view(&db.outbox, queued);
        assert_eq!(shown.status, DeliveryStatus::Queued);
        let [chunk] = shown.chunks.as_slice() else {
            panic!("one chunk: {:?}", shown.chunks)
        };
        assert_eq!(
            (chunk.index, chunk.status, chunk.attempts),
            (0, ChunkStatus::Pending, 0)
        );
        assert_eq!(chunk.text, "second");
        assert_eq!(chunk.next_attempt_at, None);
        let totals = db.outbox.health()?.totals;
        assert_eq!((totals.pending_chunks, totals.due_chunks), (2, 1));

        assert!(!db.outbox.enqueue(&reply("second"))?.created);
        let other = NewDelivery::chunked("telegram", "1", "second", ["sec", "ond"])
            .with_idempotency_key("second");
        assert!(matches!(
            db.outbox.enqueue(&other),
            Err(Error::IdempotencyConflict { .. })
        ));
        for refused in [
            db.outbox.requeue_chunk(chunk.id),
            db.outbox
                .resolve_uncertain(chunk.id, Resolution::Resend)
                .map(drop),
        ] {
            assert!(
                matches!(refused, Err(Error::InvalidState { chunk: c, status: ChunkStatus::Pending, .. }) if c == chunk.id),
                "{refused:?}"
            );
        }
        let refused = db.outbox.requeue_delivery(queued);
        assert!(
            matches!(refused, Err(Error::DeliveryState { delivery, status: DeliveryStatus::Queued, .. }) if delivery == queued),
            "{refused:?}"
        );
        // Recovery finalizes what is wholly delivered; no chunk row is not that.
        assert_eq!(
            db.outbox
                .recover(chunked_outbox::maintenance::RecoverScope::AllSending)?
                .finalized,
            0
        );
        assert_eq!(chunk_rows(&db, queued), []);

        let first = claim_one(&db.outbox);
        assert_eq!(first.delivery_id, head);
        db.outbox.ack(&first, None)?;
        assert_eq!(chunk_rows(&db, queued), [(0, "pending".into(), true)]);
        let second = claim_one(&db.outbox);
        assert_eq!((second.delivery_id, second.chunk_id), (queued, chunk.id));
        assert_eq!(second.text, "second");
        assert_eq!(second.idempotency_key, chunk.idempotency_key);
        db.outbox.ack(&second, None)?;
        assert_eq!(db.messages_for(queued)?, ["second"]);
        Ok(())
    }

    /// Queued replies with something of their own to store in chunk rows — several chunks,
    /// or one chunk that is not the whole text — store them at enqueue, and their lane
    /// activates them in place.
    fn a_queued_reply_with_chunk_texts_stores_its_rows_at_once() -> Result<()> {
        let db = TestDb::default();
        db.outbox
            .enqueue(&NewDelivery::single("telegram", "1", "head"))?;
        let split_reply =
            || NewDelivery::chunked("telegram", "1", "a b", ["a", "b"]).with_idempotency_key("k");
        let split = db.outbox.enqueue(&split_reply())?.id;
        let reworded = db
            .outbox
            .enqueue(&NewDelivery::chunked("telegram", "1", "*bold*", ["bold"]))?
            .id;
        let idle = (0, "pending".to_string(), false);
        assert_eq!(
            chunk_rows(&db, split),
            [idle.clone(), (1, "pending".into(), false)]
        );
        assert_eq!(chunk_rows(&db, reworded), [idle]);
        let again = db.outbox.enqueue(&split_reply())?;
        assert_eq!((again.id, again.created), (split, false));

        let mut sent = Vec::new();
        while let Some(claim) = db.outbox.claim(1)?.pop() {
            sent.push(claim.text.clone());
            db.outbox.ack(&claim, None)?;
        }
        assert_eq!(sent, ["head", "a", "b", "bold"]);
        assert_eq!(db.messages_for(reworded)?, ["*bold*"]);
        Ok(())
    }
}

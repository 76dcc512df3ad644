//! The edges that newer features opened: each test here failed on 52b9491 and names the
//! item of the review it reproduces.

mod common;

use std::time::Duration;

use chunked_outbox::rules::{Backoff, ChannelPolicy, RetryPolicy};
use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions};
use common::*;

/// Has `db`'s handle, its copy of the rules current, register a channel inside the
/// application's transaction, which then rolls back; returns another handle on the
/// file, as another process would have.
fn roll_back_a_registration(db: &TestDb) -> chunked_outbox::Result<Outbox> {
    let ob = &db.outbox;
    enqueue(ob, "1", &["warm"]);
    let mut app = db.raw();
    let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    // The first registers the channel (a new version of the rules, in this
    // transaction only); the second reads the rules at that version.
    ob.enqueue_in(&tx, &NewDelivery::single("matrix", "!room", "never"))?;
    ob.enqueue_in(&tx, &NewDelivery::single("matrix", "!other", "never"))?;
    tx.rollback()?;
    Ok(db.reopen(OutboxOptions::default()))
}

/// Item 2: `enqueue_in` follows the rules as the file stores them when the handle's
/// copy is behind: another process switched the lanes to parallel, and both replies to
/// one chat enqueued in the application's transaction start at once.
/// SQLite only: enqueue_in takes an SQLite connection's transaction.
#[test]
fn enqueue_in_follows_rules_changed_by_another_process() -> chunked_outbox::Result<()> {
    use chunked_outbox::monitoring::DeliveryStatus;
    use chunked_outbox::rules::LaneOrder;
    let db = TestDb::default();
    let ob = &db.outbox;
    enqueue(ob, "warm", &["x"]); // the handle's copy: FIFO
    let other = db.reopen(OutboxOptions::default());
    let mut policy = other.rules()?;
    policy.lane_order = LaneOrder::Parallel;
    other.set_rules(policy)?;
    let mut app = db.raw();
    let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let first = ob
        .enqueue_in(&tx, &NewDelivery::single("telegram", "1", "a"))?
        .id;
    let second = ob
        .enqueue_in(&tx, &NewDelivery::single("telegram", "1", "b"))?
        .id;
    tx.commit()?;
    for id in [first, second] {
        assert_eq!(view(ob, id).status, DeliveryStatus::Pending);
    }
    Ok(())
}

/// Item 2: rules read inside the application's transaction never enter the handle's
/// shared copy. A channel registered by an `enqueue_in` that was rolled back never
/// existed: once another process brings the file to the same version with another
/// channel under that number, this handle still stamps each reply with its own
/// channel's number.
/// SQLite only: enqueue_in takes an SQLite connection's transaction.
#[test]
fn a_rolled_back_enqueue_in_leaves_no_rules_behind() -> chunked_outbox::Result<()> {
    let db = TestDb::default();
    let ob = &db.outbox;
    let other = roll_back_a_registration(&db)?;
    other.enqueue(&NewDelivery::single("slack", "C1", "s"))?;
    ob.enqueue(&NewDelivery::single("matrix", "!room", "m"))?;
    let matrix = other.claim_channels(&["matrix"], 10)?;
    assert_eq!(matrix.len(), 1, "the Matrix reply is Matrix's");
    assert_eq!(matrix[0].text, "m");
    let slack = other.claim_channels(&["slack"], 10)?;
    assert_eq!(
        slack.iter().map(|c| c.text.as_str()).collect::<Vec<_>>(),
        ["s"]
    );
    Ok(())
}

/// Item 2: a change of the lane rules by another process is seen by a handle whose
/// `enqueue_in` was rolled back, even when that brings the file to the version the
/// rolled-back transaction had.
/// SQLite only: enqueue_in takes an SQLite connection's transaction.
#[test]
fn a_rule_change_is_seen_after_a_rolled_back_enqueue_in() -> chunked_outbox::Result<()> {
    use chunked_outbox::monitoring::DeliveryStatus;
    use chunked_outbox::rules::LaneOrder;
    let db = TestDb::default();
    let ob = &db.outbox;
    let other = roll_back_a_registration(&db)?;
    let mut policy = other.rules()?;
    policy.lane_order = LaneOrder::Parallel;
    other.set_rules(policy)?;
    let second = enqueue(ob, "1", &["second"]);
    assert_eq!(
        view(ob, second).status,
        DeliveryStatus::Pending,
        "parallel lanes: the second reply of the chat starts at once"
    );
    Ok(())
}

stores! {

    /// Item 6: a channel named twice in one claim is one channel; its chunk is handed out
    /// once, charged one attempt.
    fn a_channel_named_twice_is_claimed_once() -> chunked_outbox::Result<()> {
        let db = TestDb::default();
        enqueue(&db.outbox, "1", &["x"]);
        let claims = db.outbox.claim_channels(&["telegram", "telegram"], 10)?;
        assert_eq!(claims.len(), 1, "{claims:?}");
        assert_eq!(claims[0].attempt, 1);
        let mixed = db
            .outbox
            .claim_channels(&["slack", "telegram", "slack"], 10)?;
        assert!(mixed.is_empty(), "the one chunk is claimed already");
        Ok(())
    }

    /// Item 9: a maximum age under a millisecond is stored rounded up, so the file stays
    /// readable by every process and the same options reopen it.
    fn a_maximum_age_under_a_millisecond_is_stored_rounded_up() -> chunked_outbox::Result<()> {
        let retry = RetryPolicy::default().with_max_age(Some(Duration::from_micros(500)));
        let db = TestDb::new(OutboxOptions::default().with_retry(retry.clone()));
        let stored = db.outbox.rules()?.retry;
        assert_eq!(stored.max_age, Some(Duration::from_millis(1)));
        // Every write still works, and so does another handle with the same options.
        enqueue(&db.outbox, "1", &["x"]);
        let again = db.reopen(OutboxOptions::default().with_retry(retry.with_jitter(0.0)));
        again.enqueue(&NewDelivery::single("telegram", "2", "y"))?;
        // Set on a running outbox, the same.
        let mut policy = db.outbox.rules()?;
        policy.retry = policy.retry.with_max_age(Some(Duration::from_nanos(1)));
        db.outbox.set_rules(policy)?;
        assert_eq!(
            again.rules()?.retry.max_age,
            Some(Duration::from_millis(1))
        );
        enqueue(&again, "3", &["z"]);
        Ok(())
    }

    /// Item 10: a jitter that is no short decimal reads back exactly, so identical options
    /// always reopen the file.
    fn any_jitter_reopens_with_identical_options() -> chunked_outbox::Result<()> {
        let dir = tempfile::tempdir().unwrap();
        for n in 1..60u32 {
            let path = dir.path().join(format!("{n}.db"));
            let jitter = 1.0 / f64::from(n + 1) + f64::from(n) * 1e-9;
            let options =
                || OutboxOptions::default().with_retry(RetryPolicy::default().with_jitter(jitter));
            drop(Outbox::open(&path, options())?);
            let reopened = Outbox::open(&path, options())?;
            assert_eq!(reopened.rules()?.retry.jitter, jitter);
        }
        Ok(())
    }

    /// Item 11: a statement that returns rows is refused when it is set, not at every
    /// last ack.
    fn a_finalization_statement_that_returns_rows_is_refused() -> chunked_outbox::Result<()> {
        let db = TestDb::default();
        db.exec("CREATE TABLE app (content TEXT)");
        let err = db
            .outbox
            .set_finalization(Some(
                "INSERT INTO app (content) VALUES (:content) RETURNING content",
            ))
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidInput { reason, .. } if reason.contains("returns rows")),
            "{err}"
        );
        assert_eq!(db.outbox.finalization()?, None, "nothing stored");
        Ok(())
    }

    /// Item 4: default channel rules carrying a retry policy are refused at open with a
    /// clear error and nothing is written, instead of being ignored and then a conflict
    /// with themselves on the next open.
    fn a_retry_policy_in_the_default_channel_rules_is_refused() -> chunked_outbox::Result<()> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.db");
        let retry = RetryPolicy::default()
            .with_backoff(Backoff::Schedule(vec![Duration::from_secs(1)]))
            .with_max_attempts(2);
        let options =
            OutboxOptions::default().with_default_channel(ChannelPolicy::default().with_retry(retry));
        let err = Outbox::open(&path, options.clone()).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidInput { what, reason } if *what == "default channel rules" && reason.contains("with_retry")),
            "{err}"
        );
        assert!(!path.exists(), "nothing on disk");
        // Through set_policy on an open outbox, the same.
        let outbox = Outbox::open(&path, OutboxOptions::default())?;
        let mut policy = outbox.rules()?;
        policy.default_channel = policy
            .default_channel
            .with_retry(RetryPolicy::default().with_max_attempts(2));
        assert!(matches!(
            outbox.set_rules(policy),
            Err(Error::InvalidInput { .. })
        ));
        assert_eq!(outbox.rules()?.retry_for("any").max_attempts, 5);
        Ok(())
    }

    /// Item 15: a rate limit of the whole channel (Discord's global one) holds every chat
    /// of the channel, for every handle on the file, until it ends; the attempt is given
    /// back. Other channels go on.
    fn a_channel_wide_rate_limit_holds_every_chat_of_the_channel() -> chunked_outbox::Result<()> {
        use chunked_outbox::Outcome;
        use chunked_outbox::platforms::{HttpReply, discord};
        let db = TestDb::default();
        let ob = &db.outbox;
        for chat in ["a", "b"] {
            ob.enqueue(&NewDelivery::single("discord", chat, "x"))?;
        }
        ob.enqueue(&NewDelivery::single("slack", "c", "y"))?;
        let first = ob.claim_channels(&["discord"], 1)?.remove(0);
        let global = discord::outcome(&HttpReply::new(
            429,
            r#"{"message": "You are being rate limited.", "retry_after": 30, "global": true}"#,
        ));
        assert!(matches!(global, Outcome::ChannelRateLimited { .. }));
        ob.record(&first, global)?;
        let other = db.reopen(OutboxOptions::default());
        assert!(
            other.claim_channels(&["discord"], 10)?.is_empty(),
            "no chat of the channel may send during the pause"
        );
        assert_eq!(other.claim_channels(&["slack"], 10)?.len(), 1);
        assert_eq!(
            other
                .next_due(Some(&["discord"]))?
                .map(|t| t.timestamp_millis()),
            Some(db.now_ms() + 30_000)
        );
        db.advance(Duration::from_secs(30));
        let after = other.claim_channels(&["discord"], 10)?;
        assert_eq!(after.len(), 2, "both chats go on once it ends");
        let again = after.iter().find(|c| c.chat_id == first.chat_id).unwrap();
        assert_eq!(again.attempt, 1, "the attempt was given back");
        Ok(())
    }

    /// Item 15: a limit of one chat (Discord without `global`) pauses that chat only.
    fn a_chat_rate_limit_pauses_the_chat_only() -> chunked_outbox::Result<()> {
        use chunked_outbox::platforms::{HttpReply, discord};
        let db = TestDb::default();
        let ob = &db.outbox;
        for chat in ["a", "b"] {
            ob.enqueue(&NewDelivery::single("discord", chat, "x"))?;
        }
        let first = ob.claim(1)?.remove(0);
        ob.record(
            &first,
            discord::outcome(&HttpReply::new(
                429,
                r#"{"message": "You are being rate limited.", "retry_after": 30, "global": false}"#,
            )),
        )?;
        let rest = ob.claim(10)?;
        assert_eq!(rest.len(), 1);
        assert_ne!(rest[0].chat_id, first.chat_id);
        Ok(())
    }

    /// Item 3: a reply whose first chunk may have reached the chat cannot be cancelled,
    /// even after an operator's resend or requeue gave the chunk a fresh attempt budget.
    fn a_possibly_sent_reply_is_not_cancelled_after_a_resend_or_requeue() -> chunked_outbox::Result<()>
    {
        use chunked_outbox::Outcome;
        use chunked_outbox::maintenance::Resolution;
        let db = TestDb::default();
        let ob = &db.outbox;
        let held = enqueue(ob, "1", &["a", "b"]);
        let claim = claim_one(ob);
        ob.record(
            &claim,
            Outcome::Ambiguous {
                error: "timeout".into(),
            },
        )?;
        ob.resolve_uncertain(claim.chunk_id, Resolution::Resend)?;
        assert!(
            matches!(ob.cancel(held), Err(Error::CancelTooLate { .. })),
            "the resent chunk may be in the chat already"
        );
        let dead = enqueue(ob, "2", &["c", "d"]);
        let mut claims = claim_all(ob);
        let at = claims.iter().position(|c| c.chat_id == "2").unwrap();
        let claim = claims.remove(at);
        for unsent in claims {
            ob.release(&unsent)?; // refunds the attempt; the earlier send still counts
        }
        assert!(matches!(ob.cancel(held), Err(Error::CancelTooLate { .. })));
        ob.record(
            &claim,
            Outcome::Ambiguous {
                error: "timeout".into(),
            },
        )?;
        ob.requeue_delivery(dead)?;
        assert!(matches!(ob.cancel(dead), Err(Error::CancelTooLate { .. })));
        // A reply that never left is still cancelled.
        let fresh = enqueue(ob, "3", &["e"]);
        ob.cancel(fresh)?;
        Ok(())
    }

    /// Item 1: "awaiting a decision" adds up every kind of reply that waits for a human:
    /// an uncertain chunk, a dead letter nobody acknowledged, an unfinalized reply.
    fn awaiting_a_decision_counts_each_kind_once() -> chunked_outbox::Result<()> {
        use chunked_outbox::Outcome;
        let db = TestDb::default();
        db.exec("CREATE TABLE app (content TEXT CHECK (content <> 'no'))");
        let ob = &db.outbox;
        ob.set_finalization(Some("INSERT INTO app VALUES (:content)"))?;
        for chat in ["unsure", "gone", "refused"] {
            ob.enqueue(&NewDelivery::single(
                "telegram",
                chat,
                if chat == "refused" { "no" } else { "x" },
            ))?;
        }
        for claim in claim_all(ob) {
            let outcome = match claim.chat_id.as_str() {
                "unsure" => Outcome::Ambiguous {
                    error: "timeout".into(),
                },
                "gone" => Outcome::Permanent {
                    error: "chat not found".into(),
                },
                _ => Outcome::delivered(None),
            };
            ob.record(&claim, outcome)?;
        }
        let t = ob.health()?.totals;
        assert_eq!(
            (
                t.uncertain_chunks,
                t.unacknowledged_dead_letters,
                t.unfinalized_deliveries
            ),
            (1, 1, 1)
        );
        assert_eq!(t.awaiting_decision, 3);
        Ok(())
    }
}

//! The edges that newer features opened: each test here failed on 52b9491 and names the
//! item of the review it reproduces.

mod common;

use std::time::Duration;

use chunked_outbox::{
    Backoff, ChannelPolicy, Error, NewDelivery, Outbox, OutboxOptions, RetryPolicy,
};
use common::*;

/// Item 6: a channel named twice in one claim is one channel; its chunk is handed out
/// once, charged one attempt.
#[test]
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
#[test]
fn a_maximum_age_under_a_millisecond_is_stored_rounded_up() -> chunked_outbox::Result<()> {
    let retry = RetryPolicy::default().with_max_age(Some(Duration::from_micros(500)));
    let db = TestDb::new(OutboxOptions::default().with_retry(retry.clone()));
    let stored = db.outbox.policy()?.retry;
    assert_eq!(stored.max_age, Some(Duration::from_millis(1)));
    // Every write still works, and so does another handle with the same options.
    enqueue(&db.outbox, "1", &["x"]);
    let again = db.reopen(OutboxOptions::default().with_retry(retry.with_jitter(0.0)));
    again.enqueue(&NewDelivery::single("telegram", "2", "y"))?;
    // Set on a running outbox, the same.
    let mut policy = db.outbox.policy()?;
    policy.retry = policy.retry.with_max_age(Some(Duration::from_nanos(1)));
    db.outbox.set_policy(policy)?;
    assert_eq!(
        again.policy()?.retry.max_age,
        Some(Duration::from_millis(1))
    );
    enqueue(&again, "3", &["z"]);
    Ok(())
}

/// Item 10: a jitter that is no short decimal reads back exactly, so identical options
/// always reopen the file.
#[test]
fn any_jitter_reopens_with_identical_options() -> chunked_outbox::Result<()> {
    let dir = tempfile::tempdir().unwrap();
    for n in 1..60u32 {
        let path = dir.path().join(format!("{n}.db"));
        let jitter = 1.0 / f64::from(n + 1) + f64::from(n) * 1e-9;
        let options =
            || OutboxOptions::default().with_retry(RetryPolicy::default().with_jitter(jitter));
        drop(Outbox::open(&path, options())?);
        let reopened = Outbox::open(&path, options())?;
        assert_eq!(reopened.policy()?.retry.jitter, jitter);
    }
    Ok(())
}

/// Item 11: a statement that returns rows is refused when it is set, not at every
/// last ack.
#[test]
fn a_finalization_statement_that_returns_rows_is_refused() -> chunked_outbox::Result<()> {
    let db = TestDb::default();
    db.raw()
        .execute_batch("CREATE TABLE app (content TEXT)")
        .unwrap();
    let err = db
        .outbox
        .set_finalization(Some(
            "INSERT INTO app (content) VALUES (:content) RETURNING rowid",
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
#[test]
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
    let mut policy = outbox.policy()?;
    policy.default_channel = policy
        .default_channel
        .with_retry(RetryPolicy::default().with_max_attempts(2));
    assert!(matches!(
        outbox.set_policy(policy),
        Err(Error::InvalidInput { .. })
    ));
    assert_eq!(outbox.policy()?.retry_for("any").max_attempts, 5);
    Ok(())
}

/// Item 15: a rate limit of the whole channel (Discord's global one) holds every chat
/// of the channel, for every handle on the file, until it ends; the attempt is given
/// back. Other channels go on.
#[test]
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
#[test]
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

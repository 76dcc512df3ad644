//! The scenario this crate exists for, end to end: a chat engine keeps its conversation
//! history in its own `messages` table, and a reply must enter that history exactly
//! once — and only once it really reached the chat.
//!
//! A three-chunk reply to chat 77 ("first", "second", "third"): the first send fails
//! and is retried, and the process that sends the last chunk is killed between the send
//! and its ack (a real child process, `abort()`ed). Recovery finds the abandoned claim
//! and holds the chunk `uncertain` (Telegram may or may not have it, and cannot be
//! asked); the operator's policy resends it; its ack finalizes the reply — into the
//! crate's own `outbound_messages` and, through the statement stored in the file, into
//! the application's `messages`. The recovery sweep then runs again and must write
//! nothing more. The example checks itself and prints one JSON line.
//!
//! Run: `cargo run --example app_history`

use std::path::{Path, PathBuf};
use std::time::Duration;

use chunked_outbox::clock::{Clock, ManualClock};
use chunked_outbox::maintenance::{RecoverScope, Resolution};
use chunked_outbox::monitoring::ChunkStatus;
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The application's history table, as the engine already has it.
const APP_SCHEMA: &str = "
    CREATE TABLE messages (
        id          TEXT NOT NULL,
        chat_id     INTEGER NOT NULL,
        sender_name TEXT NOT NULL,
        content     TEXT NOT NULL,
        is_from_bot INTEGER NOT NULL DEFAULT 0,
        timestamp   TEXT NOT NULL,
        PRIMARY KEY (id, chat_id)
    );
    INSERT INTO messages VALUES ('u-1', 77, 'alice', 'tell me three things', 0,
                                 '2026-12-01T09:00:00.000Z');";

/// How a finalized reply enters that history: stored in the outbox file, values bound.
const INTO_HISTORY: &str = "
    INSERT INTO messages (id, chat_id, sender_name, content, is_from_bot, timestamp)
    VALUES (:delivery_id, CAST(:chat_id AS INTEGER), coalesce(:sender, 'bot'), :content, 1,
            :delivered_at_rfc3339)";

/// Set for the child process: the database, and the time its clock starts at.
const CHILD_DB: &str = "APP_HISTORY_CHILD_DB";
const CHILD_NOW: &str = "APP_HISTORY_CHILD_NOW";

fn options(clock: &ManualClock) -> OutboxOptions {
    OutboxOptions::default().with_clock(std::sync::Arc::new(clock.clone()))
}

/// What the simulated platform (Telegram) received, one line per send.
fn platform_log(db: &Path) -> PathBuf {
    db.with_extension("platform.log")
}

fn send(db: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(platform_log(db))?;
    writeln!(log, "{text}")?;
    Ok(())
}

/// The child: claims the last chunk, sends it, and dies before it can record the ack.
fn crash_after_sending(db: &Path, now: i64) -> Result<()> {
    let clock = ManualClock::new(now);
    let outbox = Outbox::open(db, options(&clock))?;
    let claim = outbox.claim(1)?.pop().ok_or("nothing to claim")?;
    send(db, &claim.text)?;
    std::process::abort();
}

fn main() -> Result<()> {
    if let (Some(db), Some(now)) = (std::env::var_os(CHILD_DB), std::env::var_os(CHILD_NOW)) {
        let now = now.to_str().ok_or("time")?.parse()?;
        return crash_after_sending(Path::new(&db), now);
    }
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("app.db");
    rusqlite::Connection::open(&db)?.execute_batch(APP_SCHEMA)?;

    let clock = ManualClock::new(1_796_115_600_000); // 2026-12-01T09:00:00Z
    let outbox = Outbox::open(&db, options(&clock))?;
    outbox.set_finalization(Some(INTO_HISTORY))?;
    let reply = NewDelivery::chunked(
        "telegram",
        "77",
        "first second third",
        ["first", "second", "third"],
    );
    let id = outbox.enqueue(&reply)?.id;

    // "first": the platform answers 502 once; the retry goes through.
    let claim = outbox.claim(1)?.pop().ok_or("first")?;
    outbox.record(
        &claim,
        Outcome::Transient {
            error: "502 Bad Gateway".into(),
        },
    )?;
    clock.advance(Duration::from_secs(60));
    let claim = outbox.claim(1)?.pop().ok_or("first, again")?;
    send(&db, &claim.text)?;
    outbox.ack(&claim, Some("tg-1"))?;
    // "second".
    let claim = outbox.claim(1)?.pop().ok_or("second")?;
    send(&db, &claim.text)?;
    outbox.ack(&claim, Some("tg-2"))?;

    // "third": sent by a process killed before its ack.
    let status = std::process::Command::new(std::env::current_exe()?)
        .env(CHILD_DB, &db)
        .env(CHILD_NOW, clock.now_ms().to_string())
        .status()?;
    assert!(!status.success(), "the child was meant to die");

    // Start-up after the crash: the lease ran out; Telegram cannot be asked whether the
    // chunk arrived, so it is held `uncertain` until the operator decides. The policy
    // here: resend (a duplicate "third" in the chat is possible, a missing one is not).
    clock.advance(Duration::from_secs(3600));
    let recovered = outbox.recover(RecoverScope::ExpiredLeases)?;
    let view = outbox.delivery(id)?.ok_or("delivery")?;
    let third = &view.chunks[2];
    assert_eq!(third.status, ChunkStatus::Uncertain, "{recovered:?}");
    outbox.resolve_uncertain(third.id, Resolution::Resend)?;
    let claim = outbox.claim(1)?.pop().ok_or("third, resent")?;
    send(&db, &claim.text)?;
    let recorded = outbox.ack(&claim, Some("tg-3"))?;
    assert!(recorded.finalized);
    // The recovery sweep, as every start-up runs it: nothing more to write.
    outbox.recover(RecoverScope::AllSending)?;

    let app = rusqlite::Connection::open(&db)?;
    let rows: Vec<String> = app
        .prepare("SELECT content FROM messages WHERE id = ?1 AND chat_id = 77 AND is_from_bot = 1")?
        .query_map([id.to_string()], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let app_rows = rows.iter().filter(|c| *c == "first second third").count();
    let deliveries = 1;
    let duplicates = rows.len().saturating_sub(1);
    let missing = deliveries - app_rows.min(deliveries);
    let sends = std::fs::read_to_string(platform_log(&db))?.lines().count();
    let user_rows: i64 = app.query_row(
        "SELECT count(*) FROM messages WHERE is_from_bot = 0",
        [],
        |r| r.get(0),
    )?;
    println!(
        "{{\"deliveries\":{deliveries},\"app_rows\":{app_rows},\"duplicates\":{duplicates},\"missing\":{missing},\"platform_sends\":{sends},\"user_rows_untouched\":{}}}",
        user_rows == 1
    );
    if app_rows != deliveries || duplicates != 0 || missing != 0 || user_rows != 1 {
        return Err("the application's history does not hold the reply exactly once".into());
    }
    Ok(())
}

//! Shared test helpers: a database in its own temp dir, a manual clock, shortcuts.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "tokio")]
pub mod emulator;

use chunked_outbox::{
    Claim, DeliveryId, DeliveryView, ManualClock, NewDelivery, Outbox, OutboxOptions, Result,
};

/// 2026-01-01T00:00:00Z, a fixed start so failures reproduce.
pub const T0: i64 = 1_767_225_600_000;

/// An outbox file in a temp dir that lives as long as this value, with a manual clock.
pub struct TestDb {
    pub dir: tempfile::TempDir,
    pub clock: ManualClock,
    pub outbox: Outbox,
}

impl TestDb {
    /// A new database with `options` and jitter off, so due times are exact.
    pub fn new(options: OutboxOptions) -> TestDb {
        let dir = tempfile::tempdir().expect("temp dir");
        let clock = ManualClock::new(T0);
        let outbox = Outbox::open(
            dir.path().join("outbox.db"),
            Self::with_clock(options, &clock),
        )
        .expect("open outbox");
        TestDb { dir, clock, outbox }
    }

    pub fn default() -> TestDb {
        TestDb::new(OutboxOptions::default())
    }

    /// The options of a new test file: a manual clock, and no jitter so due times are
    /// exact (the retry policy is stored in the file, so reopening keeps it).
    fn with_clock(options: OutboxOptions, clock: &ManualClock) -> OutboxOptions {
        let retry = options
            .retry_policy()
            .cloned()
            .unwrap_or_default()
            .with_jitter(0.0);
        options
            .with_retry(retry)
            .with_clock(Arc::new(clock.clone()))
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("outbox.db")
    }

    /// A second handle on the same file (another "process" for locking purposes is
    /// emulated by separate connections).
    pub fn reopen(&self, options: OutboxOptions) -> Outbox {
        let options = options.with_clock(Arc::new(self.clock.clone()));
        Outbox::open(self.path(), options).expect("reopen")
    }

    pub fn now_ms(&self) -> i64 {
        chunked_outbox::Clock::now_ms(&self.clock)
    }

    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// A raw connection for checks the public API does not expose.
    pub fn raw(&self) -> rusqlite::Connection {
        raw(&self.path())
    }
}

pub fn raw(path: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open(path).expect("raw connection")
}

pub fn enqueue(outbox: &Outbox, chat: &str, chunks: &[&str]) -> DeliveryId {
    let text = chunks.join("\n\n");
    outbox
        .enqueue(&NewDelivery::chunked(
            "telegram",
            chat,
            text,
            chunks.iter().copied(),
        ))
        .expect("enqueue")
        .id
}

/// Claims everything due (up to 100).
pub fn claim_all(outbox: &Outbox) -> Vec<Claim> {
    outbox.claim(100).expect("claim")
}

/// Claims exactly one due chunk, failing the test if there is not exactly one.
pub fn claim_one(outbox: &Outbox) -> Claim {
    let mut claims = claim_all(outbox);
    assert_eq!(
        claims.len(),
        1,
        "expected exactly one due chunk, got {claims:?}"
    );
    claims.pop().unwrap()
}

pub fn view(outbox: &Outbox, id: DeliveryId) -> DeliveryView {
    outbox.delivery(id).expect("read").expect("delivery exists")
}

pub fn messages_for(conn: &rusqlite::Connection, id: DeliveryId) -> Result<Vec<String>> {
    let mut stmt = conn.prepare("SELECT content FROM outbound_messages WHERE delivery_id = ?1")?;
    let rows = stmt.query_map([id.to_string()], |r| r.get(0))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// A chat engine's own history table, shaped as in the outbox this crate generalises.
pub const APP_HISTORY: &str = "
    CREATE TABLE messages (
        id          TEXT NOT NULL,
        chat_id     INTEGER NOT NULL,
        sender_name TEXT NOT NULL,
        content     TEXT NOT NULL,
        is_from_bot INTEGER NOT NULL DEFAULT 0,
        timestamp   TEXT NOT NULL,
        PRIMARY KEY (id, chat_id)
    );
    INSERT INTO messages VALUES ('m1', 77, 'alice', 'hi bot', 0, '2026-01-01T00:00:00Z'),
                                ('m2', 77, 'bot', 'hi alice', 1, '2026-01-01T00:00:01Z');";

/// The application's table as SQL and rows, to compare before and after.
pub fn app_history(conn: &rusqlite::Connection) -> (String, Vec<(String, String)>) {
    let sql = conn
        .query_row(
            "SELECT sql FROM sqlite_master WHERE name = 'messages'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let mut stmt = conn
        .prepare("SELECT id, content FROM messages ORDER BY id")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    (sql, rows)
}

/// Waits for another thread's progress (a dispatcher's sends), failing the test after a
/// minute. It waits for work to happen, not for time to pass: every check is of state.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

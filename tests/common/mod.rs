//! Shared test helpers: a database in its own temp dir, a manual clock, shortcuts.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "tokio")]
pub mod emulator;
#[cfg(feature = "postgres")]
pub mod pair;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "postgres")]
pub mod proxy;
#[cfg(feature = "cli")]
pub mod serve;

use chunked_outbox::clock::ManualClock;
use chunked_outbox::monitoring::DeliveryView;
use chunked_outbox::{Claim, DeliveryId, NewDelivery, Outbox, OutboxOptions, Result};

/// 2026-01-01T00:00:00Z, a fixed start so failures reproduce.
pub const T0: i64 = 1_767_225_600_000;

/// The store a test's [`TestDb`]s are made on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// A file in a temp dir.
    Sqlite,
    /// A fresh schema on the test server (see `postgres`).
    Postgres,
}

thread_local! {
    static STORE: std::cell::Cell<Store> = const { std::cell::Cell::new(Store::Sqlite) };
}

/// The store of this test thread's [`TestDb`]s (SQLite unless [`stores!`] says).
pub fn current_store() -> Store {
    STORE.with(|b| b.get())
}

/// Runs `test` with its [`TestDb`]s on `store`; on PostgreSQL without a server, the
/// test is skipped (and says so once, on the terminal) unless a server is required.
pub fn on_store(store: Store, test: impl FnOnce()) {
    if store == Store::Postgres && !postgres_available() {
        return;
    }
    STORE.with(|b| b.set(store));
    test();
}

#[cfg(feature = "postgres")]
fn postgres_available() -> bool {
    postgres::server_url().is_some()
}

#[cfg(not(feature = "postgres"))]
fn postgres_available() -> bool {
    false
}

/// One test of each `fn` per store: `name::sqlite` and, with the `postgres` feature,
/// `name::postgres` (the macro adds `#[test]`; other attributes, docs included, apply
/// to both). The bodies make their outboxes with [`TestDb`], which follows the store.
#[allow(unused_macros)]
macro_rules! stores {
    ($( $(#[$meta:meta])* fn $name:ident() $(-> $ret:ty)? $body:block )*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                fn body() $(-> $ret)? $body

                // One line per store: the test's name, the store, when it is built.
                $crate::common::store_test!(sqlite, Sqlite, all(), $(#[$meta])*);
                $crate::common::store_test!(postgres, Postgres, feature = "postgres", $(#[$meta])*);
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use stores;

/// The test `$test` of the `body` beside it, on `$store`, built when `$when` holds.
#[allow(unused_macros)]
macro_rules! store_test {
    ($test:ident, $store:ident, $($when:meta)?, $(#[$meta:meta])*) => {
        #[cfg($($when)?)]
        #[test]
        $(#[$meta])*
        fn $test() {
            $crate::common::on_store($crate::common::Store::$store, || {
                #[allow(clippy::let_unit_value)]
                let outcome = body();
                $crate::common::Succeeds::succeeds(outcome);
            });
        }
    };
}
#[allow(unused_imports)]
pub(crate) use store_test;

/// What a test body returns: nothing, or a result that must be `Ok`.
pub trait Succeeds {
    fn succeeds(self);
}

impl Succeeds for () {
    fn succeeds(self) {}
}

impl<E: std::fmt::Debug> Succeeds for std::result::Result<(), E> {
    fn succeeds(self) {
        self.expect("the test body returned an error");
    }
}

/// An outbox that lives as long as this value, with a manual clock: a file in a temp
/// dir, or a fresh schema on the PostgreSQL test server (see [`current_store`]).
pub struct TestDb {
    pub dir: tempfile::TempDir,
    pub clock: ManualClock,
    pub outbox: Outbox,
    /// The PostgreSQL URL of its schema, on that store.
    pub url: Option<String>,
}

impl TestDb {
    /// A new database with `options` and jitter off, so due times are exact.
    pub fn new(options: OutboxOptions) -> TestDb {
        let clock = ManualClock::new(T0);
        let options = Self::with_clock(options, &clock);
        Self::create(options, clock)
    }

    /// A new database on the system's clock, as other processes on it run (`clock` is
    /// then not the outbox's).
    pub fn on_system_clock(options: OutboxOptions) -> TestDb {
        Self::create(options, ManualClock::new(T0))
    }

    fn create(options: OutboxOptions, clock: ManualClock) -> TestDb {
        let dir = tempfile::tempdir().expect("temp dir");
        let (outbox, url) = match current_store() {
            Store::Sqlite => (
                Outbox::open(dir.path().join("outbox.db"), options).expect("open outbox"),
                None,
            ),
            Store::Postgres => {
                let url = Self::fresh_url();
                (connect(&url, options).expect("connect outbox"), Some(url))
            }
        };
        TestDb {
            dir,
            clock,
            outbox,
            url,
        }
    }

    #[cfg(feature = "postgres")]
    fn fresh_url() -> String {
        postgres::fresh_schema_url().expect("the PostgreSQL test server")
    }

    #[cfg(not(feature = "postgres"))]
    fn fresh_url() -> String {
        unreachable!("PostgreSQL tests need the postgres feature")
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
        match &self.url {
            Some(url) => connect(url, options).expect("reconnect"),
            None => Outbox::open(self.path(), options).expect("reopen"),
        }
    }

    /// The contents of the history rows of delivery `id` (one, or none if it was not
    /// finalized).
    pub fn messages_for(&self, id: DeliveryId) -> Result<Vec<String>> {
        Ok(self.strings(
            "SELECT content FROM outbound_messages WHERE delivery_id = $1",
            &id.to_string(),
        ))
    }

    /// The first column of the rows of `sql` (with `$1` bound to `param`, if it names
    /// it) as text, on either store.
    pub fn strings(&self, sql: &str, param: &str) -> Vec<String> {
        match &self.url {
            None => {
                let conn = self.raw();
                let mut stmt = conn.prepare(&sql.replace("$1", "?1")).unwrap();
                let params: &[&dyn rusqlite::ToSql] =
                    if sql.contains("$1") { &[&param] } else { &[] };
                stmt.query_map(params, |r| r.get(0))
                    .unwrap()
                    .collect::<rusqlite::Result<_>>()
                    .unwrap()
            }
            Some(url) => pg_strings(url, sql, param),
        }
    }

    /// One integer from `sql` (no parameters), on either store.
    pub fn int(&self, sql: &str) -> i64 {
        match &self.url {
            None => self.raw().query_row(sql, [], |r| r.get(0)).unwrap(),
            Some(url) => pg_int(url, sql),
        }
    }

    /// Runs `sql` (statements without parameters) on either store.
    pub fn exec(&self, sql: &str) {
        self.try_exec(sql).unwrap()
    }

    /// Runs `sql` (statements without parameters) on either store, or says why the
    /// database refused it.
    pub fn try_exec(&self, sql: &str) -> std::result::Result<(), String> {
        match &self.url {
            None => self.raw().execute_batch(sql).map_err(|e| e.to_string()),
            Some(url) => pg_exec(url, sql),
        }
    }

    pub fn now_ms(&self) -> i64 {
        chunked_outbox::clock::Clock::now_ms(&self.clock)
    }

    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// A raw connection for checks the public API does not expose (SQLite only).
    pub fn raw(&self) -> rusqlite::Connection {
        assert!(
            self.url.is_none(),
            "raw() is SQLite's file; use strings/int/exec"
        );
        raw(&self.path())
    }
}

#[cfg(feature = "postgres")]
fn connect(url: &str, options: OutboxOptions) -> Result<Outbox> {
    Outbox::connect(url, options)
}

#[cfg(feature = "postgres")]
fn pg_client(url: &str) -> ::postgres::Client {
    ::postgres::Client::connect(url, ::postgres::NoTls).expect("connect to the test server")
}

#[cfg(feature = "postgres")]
fn pg_strings(url: &str, sql: &str, param: &str) -> Vec<String> {
    let params: Vec<&(dyn ::postgres::types::ToSql + Sync)> = if sql.contains("$1") {
        vec![&param]
    } else {
        vec![]
    };
    pg_client(url)
        .query(sql, &params)
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[cfg(feature = "postgres")]
fn pg_int(url: &str, sql: &str) -> i64 {
    pg_client(url).query_one(sql, &[]).unwrap().get(0)
}

#[cfg(feature = "postgres")]
fn pg_exec(url: &str, sql: &str) -> std::result::Result<(), String> {
    pg_client(url)
        .batch_execute(sql)
        .map_err(|e| match e.as_db_error() {
            Some(db) => db.message().to_owned(),
            None => e.to_string(),
        })
}

#[cfg(not(feature = "postgres"))]
fn connect(_: &str, _: OutboxOptions) -> Result<Outbox> {
    unreachable!("PostgreSQL tests need the postgres feature")
}

#[cfg(not(feature = "postgres"))]
fn pg_strings(_: &str, _: &str, _: &str) -> Vec<String> {
    unreachable!()
}

#[cfg(not(feature = "postgres"))]
fn pg_int(_: &str, _: &str) -> i64 {
    unreachable!()
}

#[cfg(not(feature = "postgres"))]
fn pg_exec(_: &str, _: &str) -> std::result::Result<(), String> {
    unreachable!()
}

/// A place for outboxes on the test's store, opened with the options given (their
/// own clock, if any): a file in a temp dir, or a fresh schema on the test server.
pub struct Place {
    pub dir: tempfile::TempDir,
    pub url: Option<String>,
}

impl Place {
    pub fn new() -> Place {
        Place {
            dir: tempfile::tempdir().expect("temp dir"),
            url: (current_store() == Store::Postgres).then(TestDb::fresh_url),
        }
    }

    /// The file, on SQLite.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("outbox.db")
    }

    /// A handle on the outbox here (another one each call, as another process would).
    pub fn open(&self, options: OutboxOptions) -> Result<Outbox> {
        open_target(&self.target(), options)
    }

    /// Where the outbox is, for another process: the URL or the file's path.
    pub fn target(&self) -> String {
        self.url
            .clone()
            .unwrap_or_else(|| self.path().display().to_string())
    }
}

/// The outbox at `target` (as [`Place::target`] gives it).
pub fn open_target(target: &str, options: OutboxOptions) -> Result<Outbox> {
    if target.starts_with("postgres") {
        connect(target, options)
    } else {
        Outbox::open(target, options)
    }
}

/// An outbox on the test's store that leaves no file behind: in memory on SQLite, a
/// fresh schema on PostgreSQL.
pub fn fresh_outbox(options: OutboxOptions) -> Outbox {
    match current_store() {
        Store::Sqlite => Outbox::open_in_memory(options).expect("open in memory"),
        Store::Postgres => connect(&TestDb::fresh_url(), options).expect("connect outbox"),
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

/// The verdict of an `outbox-lab torture` run (its last line, JSON), after checking the
/// run exited 0 and that every promise held: nothing lost, out of order, finalized
/// wrongly or not at all, no unexplained duplicate or dead letter, nothing left
/// uncertain.
pub fn clean_torture_verdict(out: &std::process::Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    let verdict: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "no verdict ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(out.status.code(), Some(0), "{verdict}");
    for field in [
        "lost",
        "out_of_order",
        "missing_finalizations",
        "wrong_finalizations",
        "unexplained_duplicates",
        "unexpected_dead_letters",
        "uncertain_left",
    ] {
        assert_eq!(verdict[field], 0, "{field}: {verdict}");
    }
    verdict
}

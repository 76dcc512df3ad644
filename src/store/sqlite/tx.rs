//! The connection a unit of work runs on, holding each statement it has used until
//! the work is done.
//!
//! rusqlite's statement cache looks a statement up by its SQL text: it trims, hashes
//! and compares the text and copies it into a fresh allocation on every
//! `prepare_cached`, and hashes it again when the statement goes back. A batch of 64
//! acks runs about ten statements per ack, mostly the same ten, and that bookkeeping
//! was about a tenth of its time. [`Tx`] takes each statement from rusqlite's cache
//! once and keeps it for the rest of the work, found again by the address of its text.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use rusqlite::{CachedStatement, Connection, Statement};

/// A connection inside a transaction — one it began ([`begin`](Self::begin)) or the
/// caller's ([`new`](Self::new)) — with the statements used on it so far.
/// Dereferences to the [`Connection`]; its own
/// [`prepare_cached`](Self::prepare_cached) finds a statement used before without
/// going through rusqlite's cache. When it is dropped, every statement it holds goes
/// back to that cache.
pub(crate) struct Tx<'c> {
    conn: &'c Connection,
    held: RefCell<Vec<Held<'c>>>,
    /// Whether this `Tx` began the transaction it runs in, and so ends it: rolled back
    /// when dropped without [`commit`](Self::commit).
    owns_transaction: bool,
    /// The deliveries this work made dead letters, with the chunk's error: whoever
    /// made them (an outcome, a claim that found a chunk out of attempts or age, an
    /// expired lease, a row set aside as unreadable), the dispatcher reports each once.
    dead_letters: RefCell<Vec<(i64, String)>>,
}

/// Room for the statements of most units of work (an enqueue uses about eight, an ack
/// about ten), so the list of kept statements is not grown again and again.
const HELD_AT_START: usize = 16;

/// A statement kept by a [`Tx`], by its SQL text; `None` while it is in use.
struct Held<'c> {
    sql: *const u8,
    len: usize,
    stmt: Option<CachedStatement<'c>>,
}

impl<'c> Tx<'c> {
    /// Work in whatever transaction `conn` is in (the caller's).
    pub(crate) fn new(conn: &'c Connection) -> Self {
        Tx {
            conn,
            held: RefCell::new(Vec::with_capacity(HELD_AT_START)),
            owns_transaction: false,
            dead_letters: RefCell::new(Vec::new()),
        }
    }

    /// Begins a transaction on `conn` with `begin` (`BEGIN IMMEDIATE`, or `BEGIN` for a
    /// read), to be committed with [`commit`](Self::commit) or else rolled back when the
    /// `Tx` is dropped, as rusqlite's `Transaction` does. Unlike `Transaction`, which
    /// compiles its `BEGIN` and `COMMIT` anew each time, it runs cached statements:
    /// compiling the two was about 3 % of the instructions of a one-reply enqueue.
    pub(crate) fn begin(conn: &'c Connection, begin: &'static str) -> rusqlite::Result<Self> {
        conn.prepare_cached(begin)?.execute([])?;
        Ok(Tx {
            conn,
            held: RefCell::new(Vec::with_capacity(HELD_AT_START)),
            owns_transaction: true,
            dead_letters: RefCell::new(Vec::new()),
        })
    }

    /// Notes that this work made delivery row `delivery` a dead letter, for `error`.
    pub(crate) fn note_dead_letter(&self, delivery: i64, error: &str) {
        self.dead_letters
            .borrow_mut()
            .push((delivery, error.to_owned()));
    }

    /// The dead letters this work made so far (see [`note_dead_letter`](Self::note_dead_letter)).
    pub(crate) fn take_dead_letters(&self) -> Vec<(i64, String)> {
        std::mem::take(&mut self.dead_letters.borrow_mut())
    }

    /// Commits the transaction this `Tx` began; if the commit fails, the transaction
    /// is rolled back.
    pub(crate) fn commit(mut self) -> rusqlite::Result<()> {
        self.prepare_cached("COMMIT")?.execute([])?;
        self.owns_transaction = false;
        Ok(())
    }

    /// The statement for `sql`: the one this `Tx` used before for the same text, or
    /// one from the connection's cache. Only texts compiled into the crate are kept:
    /// a `'static` text is never freed, so its address and length name it for good.
    /// Statements stay as rusqlite's `prepare_cached` leaves them: reset after use, and
    /// rebound by every caller.
    pub(crate) fn prepare_cached<'t>(
        &'t self,
        sql: &'static str,
    ) -> rusqlite::Result<Stmt<'t, 'c>> {
        let key = (sql.as_ptr(), sql.len());
        let kept = self
            .held
            .borrow_mut()
            .iter_mut()
            .find(|h| (h.sql, h.len) == key)
            .and_then(|h| h.stmt.take());
        let stmt = match kept {
            Some(stmt) => stmt,
            None => self.conn.prepare_cached(sql)?,
        };
        Ok(Stmt {
            tx: self,
            key,
            stmt: Some(stmt),
        })
    }

    fn put_back(&self, (sql, len): (*const u8, usize), stmt: CachedStatement<'c>) {
        let mut held = self.held.borrow_mut();
        match held.iter_mut().find(|h| (h.sql, h.len) == (sql, len)) {
            // A second use of the same text while the first was out (nested use):
            // the first one back keeps the slot, the other returns to rusqlite's cache.
            Some(h) if h.stmt.is_some() => drop(stmt),
            Some(h) => h.stmt = Some(stmt),
            None => held.push(Held {
                sql,
                len,
                stmt: Some(stmt),
            }),
        }
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if self.owns_transaction && !self.conn.is_autocommit() {
            // As rusqlite's `Transaction` on drop: a failed rollback leaves nothing to
            // do here, and SQLite ends the transaction when the connection closes.
            let _ = self
                .conn
                .prepare_cached("ROLLBACK")
                .and_then(|mut rollback| rollback.execute([]));
        }
    }
}

impl<'c> Deref for Tx<'c> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// A statement in use, lent by a [`Tx`]; it goes back to the `Tx` when dropped.
pub(crate) struct Stmt<'t, 'c> {
    tx: &'t Tx<'c>,
    key: (*const u8, usize),
    stmt: Option<CachedStatement<'c>>,
}

impl<'c> Deref for Stmt<'_, 'c> {
    type Target = Statement<'c>;

    fn deref(&self) -> &Statement<'c> {
        self.stmt
            .as_ref()
            .expect("a lent statement is held until dropped")
    }
}

impl DerefMut for Stmt<'_, '_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.stmt
            .as_mut()
            .expect("a lent statement is held until dropped")
    }
}

impl Drop for Stmt<'_, '_> {
    fn drop(&mut self) {
        if let Some(stmt) = self.stmt.take() {
            self.tx.put_back(self.key, stmt);
        }
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::{Connection, StatementStatus};

    use super::Tx;

    const ONE: &str = "SELECT ?1 + 1";
    const TWO: &str = "SELECT ?1 + 2";

    /// How many times the statement object has been run: a statement used again is the
    /// same object, one prepared anew starts at 0.
    fn runs(stmt: &rusqlite::Statement<'_>) -> i32 {
        stmt.get_status(StatementStatus::Run)
    }

    fn value(tx: &Tx<'_>, sql: &'static str, x: i64) -> (i64, i32) {
        let mut stmt = tx.prepare_cached(sql).unwrap();
        let before = runs(&stmt);
        (stmt.query_row([x], |r| r.get(0)).unwrap(), before)
    }

    #[test]
    fn a_statement_is_kept_for_the_rest_of_the_work_and_then_given_back() {
        let conn = Connection::open_in_memory().unwrap();
        let tx = Tx::new(&conn);
        assert_eq!(value(&tx, ONE, 1), (2, 0));
        assert_eq!(value(&tx, TWO, 1), (3, 0));
        assert_eq!(value(&tx, ONE, 5), (6, 1), "the same statement again");
        assert_eq!(value(&tx, TWO, 5), (7, 1));
        // While the Tx keeps it, the connection's cache does not have it.
        assert_eq!(runs(&conn.prepare_cached(ONE).unwrap()), 0);
        drop(tx);
        // Given back: the one the Tx kept, run twice, is the connection's again.
        let kept = conn.prepare_cached(TWO).unwrap();
        assert_eq!(runs(&kept), 2);
    }

    #[test]
    fn the_same_text_in_use_twice_at_once_gets_two_statements() {
        let conn = Connection::open_in_memory().unwrap();
        let tx = Tx::new(&conn);
        assert_eq!(value(&tx, ONE, 0), (1, 0));
        let mut outer = tx.prepare_cached(ONE).unwrap();
        assert_eq!(runs(&outer), 1);
        let mut rows = outer.query([10]).unwrap();
        let row = rows.next().unwrap().unwrap();
        // `outer` is mid-query: a nested use of the text gets a statement of its own.
        let (inner, inner_runs) = value(&tx, ONE, 20);
        assert_eq!(
            (row.get::<_, i64>(0).unwrap(), inner, inner_runs),
            (11, 21, 0)
        );
        drop(rows);
        drop(outer);
        // The first one back (the nested one, run once) keeps the slot; the other one
        // went back to the connection's cache.
        assert_eq!(value(&tx, ONE, 0), (1, 1));
        assert_eq!(runs(&conn.prepare_cached(ONE).unwrap()), 2);
    }

    fn count(conn: &Connection) -> i64 {
        conn.query_row("SELECT count(*) FROM c", [], |r| r.get(0))
            .unwrap()
    }

    /// A table whose foreign key is checked at commit, so that a commit can fail.
    fn checked_at_commit() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "PRAGMA foreign_keys = ON;
             CREATE TABLE p (id INTEGER PRIMARY KEY);
             CREATE TABLE c (p INTEGER REFERENCES p (id) DEFERRABLE INITIALLY DEFERRED);
             INSERT INTO p VALUES (1);",
        )
        .unwrap();
        conn
    }

    #[test]
    fn a_transaction_it_began_is_committed_or_else_rolled_back() {
        let conn = checked_at_commit();
        let tx = Tx::begin(&conn, "BEGIN IMMEDIATE").unwrap();
        assert!(!tx.is_autocommit());
        tx.execute("INSERT INTO c VALUES (1)", []).unwrap();
        tx.commit().unwrap();
        assert!(conn.is_autocommit());
        assert_eq!(count(&conn), 1);

        let tx = Tx::begin(&conn, "BEGIN IMMEDIATE").unwrap();
        tx.execute("INSERT INTO c VALUES (1)", []).unwrap();
        drop(tx);
        assert!(conn.is_autocommit(), "dropped without commit: rolled back");
        assert_eq!(count(&conn), 1);

        // A commit that fails (a foreign key checked at commit) leaves nothing behind.
        let tx = Tx::begin(&conn, "BEGIN").unwrap();
        tx.execute("INSERT INTO c VALUES (2)", []).unwrap();
        let refused = tx.commit().unwrap_err();
        assert!(refused.to_string().contains("FOREIGN KEY"), "{refused}");
        assert!(conn.is_autocommit());
        assert_eq!(count(&conn), 1);
    }

    #[test]
    fn work_in_the_callers_transaction_leaves_it_to_the_caller() {
        let conn = checked_at_commit();
        conn.execute_batch("BEGIN").unwrap();
        let tx = Tx::new(&conn);
        tx.execute("INSERT INTO c VALUES (1)", []).unwrap();
        drop(tx);
        assert!(!conn.is_autocommit(), "still the caller's to end");
        conn.execute_batch("COMMIT").unwrap();
        assert_eq!(count(&conn), 1);
    }
}

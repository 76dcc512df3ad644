//! One transaction on a connection of the pool ([`PgTx`]): what it holds, the
//! statements the area files run on it, and the primitives of the seam that belong to
//! the transaction itself.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use postgres::Row;
use postgres::types::{ToSql, Type};

use super::begin::{Begin, Begins, OPENING_SQL, STATE_SQL};
use super::client::{self, simple_column};
use super::pipeline::{Deferred, Params, Prepared, owned, requests_of, typed, unasked, values_of};
use super::pool::{PgConn, PgStore};
use super::runtime;
use super::schema;
use crate::clock::ServerTime;
use crate::error::{Error, Result};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::LaneRef;

/// One transaction on a connection: every primitive of the seam.
///
/// Its `BEGIN` and the statements whose answers the rules do not read (locks, and
/// writes such as an activation or a keyless insert) are kept back and sent with the
/// next statement that must be answered, or with the `COMMIT`, in one round trip (see
/// [`client`]).
pub(crate) struct PgTx<'c> {
    pub(super) conn: RefCell<&'c mut PgConn>,
    /// Kept back, in order: the `BEGIN` (until the first round trip), then statements
    /// whose answers the rules do not read.
    pub(super) deferred: RefCell<Vec<Deferred<'c>>>,
    /// The handle's time, which each `BEGIN`'s reading of the server's clock corrects.
    pub(super) time: &'c ServerTime,
    /// Set when the rules taken on trust turn out to have changed (see
    /// [`PgStore::transaction_trusting`]); `None`: nothing is taken on trust.
    pub(super) moved: Option<&'c std::sync::atomic::AtomicBool>,
    /// The rules' version taken on trust, which the `BEGIN`'s answer must confirm.
    pub(super) assumed_rules: Cell<Option<i64>>,
    /// Whether the transaction is still to be ended (rolled back when dropped).
    pub(super) open: Cell<bool>,
    /// The rules' lock its `BEGIN` took (exclusively?), if any.
    pub(super) rules_locked: Cell<Option<bool>>,
    /// The rules' version its `BEGIN` read under that lock, until it is asked for.
    pub(super) rules_version: Cell<Option<i64>>,
    /// Its transaction id, once a write returned it (see [`PgTx::note_xid`]).
    pub(super) xid: Cell<Option<i64>>,
    /// How many statements kept back from its start make up its `BEGIN` (see
    /// [`OPENING_SQL`]).
    pub(super) opening: usize,
    /// Lanes (channel, chat) whose rows it locked while it read their due chunks, so
    /// that trying them costs no round trip (see `due_in_channels`).
    pub(super) held_lanes: RefCell<Vec<(String, String)>>,
    /// What it adds to the counts of the minutes its replies finished in: written as the
    /// last statement before its `COMMIT`, so that a transaction waiting for a minute's
    /// row (shared with other connections) holds nothing another one waits for.
    pub(super) activity: RefCell<Vec<crate::store::ActivityRow>>,
    /// How many of those there were when its nested transaction began.
    pub(super) activity_mark: Cell<usize>,
    pub(super) dead_letters: RefCell<Vec<(i64, String)>>,
    /// Whether it stored a reply at the head of its lane or activated one that waited
    /// (see [`Announce::IfMadeDue`]).
    pub(super) made_due: Cell<bool>,
}

impl PgStore {
    /// Runs `f` on a transaction begun as `kind` on a connection of the pool.
    pub(crate) fn transaction<T: Send>(
        &self,
        kind: Begin,
        f: impl FnOnce(PgTx<'_>) -> Result<T> + Send,
    ) -> Result<T> {
        self.transaction_trusting(kind, None, f)
    }

    /// As [`transaction`](Self::transaction); with `moved`, the transaction may take the
    /// handle's copy of the rules on trust (`RuleStore::rules_version_or`) and sets
    /// `moved` if its `BEGIN` then finds them changed (it has failed, and nothing it
    /// did counts).
    pub(crate) fn transaction_trusting<T: Send>(
        &self,
        kind: Begin,
        moved: Option<&std::sync::atomic::AtomicBool>,
        f: impl FnOnce(PgTx<'_>) -> Result<T> + Send,
    ) -> Result<T> {
        runtime::off_runtime(|| {
            let mut conn = self.connection()?;
            PgTx::begin(&mut conn, kind, &self.begins, &self.time, moved)
                .and_then(f)
                .map_err(|e| self.located(&mut conn, kind, e))
        })
    }

    /// `e` as the caller should read it. A server that refuses a write of a handle
    /// opened for writing is a standby (reached through `target_session_attrs=any`, or
    /// just demoted) or a primary fenced read-only for a failover: a state that
    /// passes, like a lost connection, and not the handle's own refusal
    /// ([`Error::ReadOnly`]); the connection is dropped, so the next one looks for a
    /// server that takes writes. A lost connection is named by the server it reached.
    fn located(&self, conn: &mut PgConn, kind: Begin, e: Error) -> Error {
        match e {
            Error::ReadOnly(message) if matches!(kind, Begin::Write { .. }) => {
                conn.refused_writes = true;
                Error::Connection {
                    target: self.answered_by(&conn.server),
                    message: format!(
                        "the server takes no writes (a standby, or a primary fenced for a failover): {message}"
                    ),
                }
            }
            Error::Connection { target, message } if target.is_empty() => Error::Connection {
                target: self.answered_by(&conn.server),
                message,
            },
            e => e,
        }
    }
}

impl<'c> PgTx<'c> {
    /// A write transaction (READ COMMITTED, with the rules' locks; READ ONLY for a
    /// read-only handle, so the server refuses its writes), or a read transaction that
    /// sees one snapshot throughout (REPEATABLE READ, READ ONLY), begun by one simple
    /// query (see [`Begins`]) sent with its first statement.
    pub(crate) fn begin(
        conn: &'c mut PgConn,
        kind: Begin,
        begins: &'c Begins,
        time: &'c ServerTime,
        moved: Option<&'c std::sync::atomic::AtomicBool>,
    ) -> Result<Self> {
        let (rules_locked, read_only) = match kind {
            Begin::Write { change_rules } => (Some(change_rules), false),
            Begin::WriteRefused { change_rules } => (Some(change_rules), true),
            Begin::Read => (None, true),
        };
        let opening = match rules_locked {
            // A write on a connection of its own opens with prepared statements.
            Some(exclusive) if !conn.pooled => Some(exclusive),
            _ => None,
        };
        let tx = PgTx {
            deferred: RefCell::new(vec![Deferred::Begin {
                sql: match opening {
                    Some(_) => begins.bare[usize::from(read_only)],
                    None => begins.sql(kind),
                },
                state: opening.is_none(),
            }]),
            opening: if opening.is_some() { 3 } else { 1 },
            time,
            moved,
            assumed_rules: Cell::new(None),
            open: Cell::new(true),
            rules_locked: Cell::new(rules_locked),
            rules_version: Cell::new(None),
            xid: Cell::new(None),
            held_lanes: RefCell::new(Vec::new()),
            activity: RefCell::new(Vec::new()),
            activity_mark: Cell::new(0),
            dead_letters: RefCell::new(Vec::new()),
            made_due: Cell::new(false),
            conn: RefCell::new(conn),
        };
        if let Some(exclusive) = opening {
            let values = vec![
                owned(begins.lock_ms.clone()),
                owned(begins.idle_ms.clone()),
                owned(exclusive),
            ];
            tx.defer(OPENING_SQL, values, None)?;
            let state = Deferred::State(tx.statement(STATE_SQL)?);
            tx.deferred.borrow_mut().push(state);
        }
        Ok(tx)
    }

    /// Whether the `BEGIN` is still kept back (nothing was sent yet).
    pub(super) fn unsent(&self) -> bool {
        matches!(self.deferred.borrow().first(), Some(Deferred::Begin { .. }))
    }

    /// Keeps `sql` back until the next round trip: a statement whose answer the rules
    /// do not read (with `xid`, the column of its row that holds the transaction's id).
    pub(super) fn defer(
        &self,
        sql: &'static str,
        values: Vec<Box<dyn ToSql + Sync + Send>>,
        xid: Option<usize>,
    ) -> Result<()> {
        self.defer_checked(sql, values, xid, None)
    }

    /// [`defer`](Self::defer) a statement that checks its own answer, failing as
    /// [`CHECK_FAILED`] says with `refusal` when the check fails.
    pub(super) fn defer_checked(
        &self,
        sql: &'static str,
        values: Vec<Box<dyn ToSql + Sync + Send>>,
        xid: Option<usize>,
        refusal: Option<fn() -> Error>,
    ) -> Result<()> {
        let prepared = self.statement(sql)?;
        self.deferred.borrow_mut().push(Deferred::Statement {
            sql,
            prepared,
            values,
            xid,
            refusal,
        });
        Ok(())
    }

    /// Sends what was kept back, if anything, and reads its answers.
    pub(super) fn flush(&self) -> Result<()> {
        if self.deferred.borrow().is_empty() {
            return Ok(());
        }
        self.send(None).map(drop)
    }

    /// Sends `last` after what was kept back, in one round trip, and answers `last`'s
    /// answer; the first error is the answer (after a failed statement, every later one
    /// of the transaction fails too).
    pub(super) fn send(&self, last: Option<client::Request<'_>>) -> Result<Option<client::Answer>> {
        let deferred = self.deferred.take();
        let values = values_of(&deferred);
        let mut requests = requests_of(&deferred, &values);
        requests.extend(last);
        let before = self.time.local_ms();
        let mut answers = self.conn.borrow_mut().client.pipeline(&requests)?;
        let after = self.time.local_ms();
        let last = (answers.len() > deferred.len())
            .then(|| answers.pop())
            .flatten();
        for (d, answer) in deferred.iter().zip(answers) {
            self.settle(d, answer.map_err(|e| d.error(e))?, before, after)?;
        }
        Ok(last.transpose()?)
    }

    /// Runs one statement (after what was kept back) for the answer `want` asks for.
    pub(super) fn run(
        &self,
        sql: &'static str,
        params: Params<'_>,
        want: client::Want,
    ) -> Result<client::Answer> {
        let prepared = self.statement(sql)?;
        let sql = match &prepared {
            Prepared::Named(stmt) => client::Sql::Prepared(stmt, params.to_vec()),
            Prepared::Unnamed(types) => client::Sql::Unnamed(sql, typed(params, types)),
        };
        match self.send(Some(client::Request { sql, want }))? {
            Some(answer) => Ok(answer),
            None => unasked(None),
        }
    }

    /// Takes in the answer to a statement that was kept back.
    pub(super) fn settle(
        &self,
        sent: &Deferred<'_>,
        answer: client::Answer,
        before: i64,
        after: i64,
    ) -> Result<()> {
        match (sent, answer) {
            (Deferred::Begin { state: true, .. }, client::Answer::Simple(answer)) => {
                let column = |i: usize| simple_column(&answer, i).and_then(|v| v.parse().ok());
                self.begun([column(0), column(1), column(2)], before, after)?;
            }
            (Deferred::State(_), client::Answer::Rows(rows)) => {
                let column = |i: usize| -> Result<Option<i64>> {
                    Ok(match rows.first() {
                        Some(row) => row.try_get(i)?,
                        None => None,
                    })
                };
                self.begun([column(0)?, column(1)?, column(2)?], before, after)?;
            }
            (Deferred::Statement { xid: Some(i), .. }, client::Answer::Rows(rows)) => {
                if let Some(row) = rows.first() {
                    self.note_xid(row, *i)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// How `sql` runs on this connection: its prepared statement, or behind a
    /// transaction pooler its parameter types (see [`PgConn::types`]).
    pub(super) fn statement(&self, sql: &'static str) -> Result<Prepared> {
        let mut conn = self.conn.borrow_mut();
        let key = (sql.as_ptr() as usize, sql.len());
        if conn.pooled {
            if let Some(types) = conn.types.get(&key) {
                return Ok(Prepared::Unnamed(types.clone()));
            }
            // Closed when dropped: the message goes out with the next statement, on
            // this transaction's server connection.
            let types: Arc<[Type]> = conn.client.prepare(sql)?.params().into();
            conn.types.insert(key, types.clone());
            return Ok(Prepared::Unnamed(types));
        }
        if let Some(stmt) = conn.statements.get(&key) {
            return Ok(Prepared::Named(stmt.clone()));
        }
        let stmt = conn.client.prepare(sql)?;
        conn.statements.insert(key, stmt.clone());
        Ok(Prepared::Named(stmt))
    }

    /// Notes that the transaction holds lane (`channel`, `chat`)'s row.
    pub(crate) fn hold_lane(&self, channel: String, chat: String) {
        self.held_lanes.borrow_mut().push((channel, chat));
    }

    /// Whether the transaction holds `lane`'s row, as [`hold_lane`](Self::hold_lane)
    /// noted.
    pub(super) fn holds_lane(&self, lane: LaneRef<'_>) -> bool {
        self.held_lanes
            .borrow()
            .iter()
            .any(|(channel, chat)| channel == lane.channel && chat == lane.chat_id)
    }

    /// Takes in what the opening of the transaction read (`[rules' version, server's
    /// clock, oldest writer the schema accepts]`, each `None` when there was no row), between the
    /// local times `before` and `after`.
    pub(super) fn begun(
        &self,
        [version, server, schema]: [Option<i64>; 3],
        before: i64,
        after: i64,
    ) -> Result<()> {
        // A newer build's contract step, while this process ran, dropped what its
        // statements rely on: it writes nothing more (an expand step leaves it be).
        if let Some(writable_from) = schema.filter(|v| *v > schema::latest_version()) {
            return Err(schema::too_new(writable_from, writable_from, ""));
        }
        if let Some(server) = server {
            self.time.observe(server, before, after);
        }
        // Without it (a read, or no row 1), `rules_version` asks again and reports what
        // it finds.
        if self.assumed_rules.get().is_some_and(|a| version != Some(a)) {
            if let Some(moved) = self.moved {
                moved.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            return Err(Error::Busy);
        }
        self.rules_version.set(version);
        Ok(())
    }

    /// Keeps the transaction id a write returned in column `i` (its
    /// `txid_current_if_assigned()`), which saves [`commit_or_lose`](Self::commit_or_lose)
    /// a round trip. Every write of a transaction has the same id.
    pub(crate) fn note_xid(&self, row: &Row, i: usize) -> Result<()> {
        if let Some(xid) = row.try_get::<_, Option<i64>>(i)? {
            self.xid.set(Some(xid));
        }
        Ok(())
    }

    /// The rules' version read by `BEGIN`, once (the `BEGIN` is sent now if it was
    /// kept back).
    pub(crate) fn version_read_at_begin(&self) -> Result<Option<i64>> {
        self.flush()?;
        Ok(self.rules_version.take())
    }

    /// `cached` taken on trust as the rules' version when the `BEGIN` is still kept
    /// back and the transaction may be run again: its answer confirms it, or sets
    /// `moved` and fails the transaction (see [`PgStore::transaction_trusting`]).
    pub(crate) fn assume_rules_version(&self, cached: i64) -> bool {
        // (One version on trust per transaction: another is read.)
        if self.moved.is_none()
            || !self.unsent()
            || self.assumed_rules.get().is_some_and(|a| a != cached)
        {
            return false;
        }
        self.assumed_rules.set(Some(cached));
        true
    }

    pub(crate) fn query(&self, sql: &'static str, params: Params<'_>) -> Result<Vec<Row>> {
        match self.run(sql, params, client::Want::Rows)? {
            client::Answer::Rows(rows) => Ok(rows),
            other => unasked(Some(other)),
        }
    }

    pub(crate) fn query_opt(&self, sql: &'static str, params: Params<'_>) -> Result<Option<Row>> {
        match self.run(sql, params, client::Want::Opt)? {
            client::Answer::Opt(row) => Ok(row),
            other => unasked(Some(other)),
        }
    }

    pub(crate) fn query_one(&self, sql: &'static str, params: Params<'_>) -> Result<Row> {
        match self.run(sql, params, client::Want::One)? {
            client::Answer::One(row) => Ok(row),
            other => unasked(Some(other)),
        }
    }

    pub(crate) fn execute(&self, sql: &'static str, params: Params<'_>) -> Result<u64> {
        match self.run(sql, params, client::Want::Count)? {
            client::Answer::Count(n) => Ok(n),
            other => unasked(Some(other)),
        }
    }

    /// A statement made at run time (a listing's filters, the application's text):
    /// prepared for this use only.
    pub(crate) fn query_dynamic(&self, sql: &str, params: Params<'_>) -> Result<Vec<Row>> {
        let request = client::Request {
            sql: client::Sql::Text(sql, params.to_vec()),
            want: client::Want::Rows,
        };
        match self.send(Some(request))? {
            Some(client::Answer::Rows(rows)) => Ok(rows),
            other => unasked(other),
        }
    }

    /// Runs `f` on the client itself, once what was kept back is sent.
    pub(crate) fn with_client<T>(&self, f: impl FnOnce(&mut client::Client) -> T) -> Result<T> {
        self.flush()?;
        Ok(f(&mut self.conn.borrow_mut().client))
    }

    /// Runs `f` with plans that read whole tables priced out (sequential scans, and
    /// merge or hash joins, which read all of the inner side): a read of the unfinished
    /// rows must go through their index and look up each one's chunks, even when the
    /// planner's statistics are stale (a table that grew by a million delivered rows
    /// since it was last analyzed still looks as if most of it were unfinished).
    ///
    /// In a write, which prices them out throughout (`write_planning!`), the statement
    /// is planned for its values instead of run with its generic plan: these are the
    /// maintenance statements (a purge's batch, the finalization sweep, requeues), whose
    /// cutoffs and limits decide which index pays (a purge's generic plan took twice as
    /// long beside 1M delivered rows, `examples/pg_scale`).
    pub(crate) fn on_indexes<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let write = self.rules_locked.get().is_some();
        self.batch(if write {
            "SET LOCAL plan_cache_mode = auto"
        } else {
            "SET LOCAL enable_seqscan = off; SET LOCAL enable_mergejoin = off;
             SET LOCAL enable_hashjoin = off"
        })?;
        let value = f()?;
        self.batch(if write {
            "SET LOCAL plan_cache_mode = force_generic_plan"
        } else {
            "SET LOCAL enable_seqscan TO DEFAULT; SET LOCAL enable_mergejoin TO DEFAULT;
             SET LOCAL enable_hashjoin TO DEFAULT"
        })?;
        Ok(value)
    }

    pub(crate) fn batch(&self, sql: &str) -> Result<()> {
        let request = client::Request {
            sql: client::Sql::Simple(sql),
            want: client::Want::Rows,
        };
        self.send(Some(request)).map(drop)
    }
}

impl Drop for PgTx<'_> {
    fn drop(&mut self) {
        // (Nothing was sent if the `BEGIN` was kept back: there is nothing to end.)
        if self.open.get() && !self.unsent() {
            let mut conn = self.conn.borrow_mut();
            // A failed rollback leaves a broken connection, which the pool drops.
            let _ = conn.client.batch_execute("ROLLBACK");
        }
    }
}

/// The key of chunk `id`: its delivery row and index.
pub(crate) fn chunk_key(id: i64) -> (i64, i64) {
    (
        id.div_euclid(crate::ids::CHUNK_STRIDE),
        id.rem_euclid(crate::ids::CHUNK_STRIDE),
    )
}

pub(crate) fn chunk_status(row: &Row, i: usize) -> Result<ChunkStatus> {
    row.try_get::<_, &str>(i)?.parse()
}

/// A delivery's status in column `i`.
pub(crate) fn delivery_status(row: &Row, i: usize) -> Result<DeliveryStatus> {
    status_of(row.try_get(i)?)
}

/// A stored delivery status; a reply staged by an application's transaction (`new`,
/// not yet in its lane) shows as queued.
pub(crate) fn status_of(stored: &str) -> Result<DeliveryStatus> {
    match stored {
        "new" => Ok(DeliveryStatus::Queued),
        status => status.parse(),
    }
}

/// A non-negative count column.
pub(crate) fn count(row: &Row, i: usize) -> Result<u64> {
    Ok(row.try_get::<_, Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
}

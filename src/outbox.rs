//! The [`Outbox`] handle: opening, and the one writer / pooled readers discipline.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{Connection, OpenFlags};

use crate::error::{Error, Result};
use crate::finalize;
use crate::ids::{ClaimantId, DeliveryId};
use crate::lane;
use crate::options::OutboxOptions;
use crate::rules::{self, ChannelPolicy, FileRules, RetryPolicy, Rules, Stored};
use crate::store::sqlite::checkpoint::Checkpointer;
use crate::store::sqlite::connection::{self, StorageSettings};
use crate::store::sqlite::schema;
use crate::store::sqlite::tx::Tx;
use crate::store::{RuleStore, StoreTx};

/// How often a claim of a handle that hears no notification looks for replies staged
/// by applications' transactions unasked (PostgreSQL; see
/// [`Outbox::take_staged_hint`]): the dispatchers' default poll interval.
#[cfg(feature = "postgres")]
pub(crate) const STAGED_LOOK: std::time::Duration = std::time::Duration::from_secs(1);

/// A durable outbox on one SQLite database ([`open`](Self::open)) or, with the feature
/// `postgres`, in a PostgreSQL database ([`connect`](Self::connect)). Cheap to clone;
/// `Send + Sync`.
///
/// On SQLite all writes of one `Outbox` go through a single connection behind a mutex,
/// in `BEGIN IMMEDIATE` transactions: SQLite has one writer, and more writer
/// connections only add lock contention. Reads (inspection, health) use a small pool of
/// read-only connections, which WAL mode lets run beside the writer. Other processes
/// may open the same file; SQLite's locking and the busy timeout serialise their writes
/// with ours. On PostgreSQL writes and reads share a pool of connections, and writers
/// of every process and host run at once under the locks of the rules
/// (ARCHITECTURE.md, "The PostgreSQL store").
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Backend,
    notifier: Arc<Notifier>,
    /// PostgreSQL: whether replies staged by applications' transactions may be waiting
    /// to join their lanes (see [`activate_staged`](crate::enqueue::activate_staged)):
    /// set when a notification or a poll says so, taken by the next claim.
    staged_hint: Arc<std::sync::atomic::AtomicBool>,
    /// PostgreSQL: the thread listening for other processes' commits, started by the
    /// first dispatcher or claim of this handle.
    #[cfg(feature = "postgres")]
    listener: std::sync::OnceLock<Option<crate::store::postgres::listen::Listener>>,
    /// PostgreSQL: when a claim of this handle last looked for staged replies unasked
    /// (ms after `opened`; see [`Outbox::take_staged_hint`]).
    #[cfg(feature = "postgres")]
    staged_looked: std::sync::atomic::AtomicI64,
    #[cfg(feature = "postgres")]
    opened: std::time::Instant,
    options: OutboxOptions,
    /// This database's salt for delivery uids (see [`DeliveryId::for_row`]).
    id_salt: i64,
    /// The high half of every fencing token this handle hands out.
    claimant: ClaimantId,
    /// The low half: a counter, so two claims of this handle never share a token.
    claims: AtomicU32,
    /// The stored rules as last read, with the version they were read at.
    stored: Mutex<Arc<Stored>>,
}

/// Where the outbox keeps its rows.
enum Backend {
    Sqlite(Sqlite),
    #[cfg(feature = "postgres")]
    Postgres(crate::store::postgres::PgStore),
}

/// An SQLite file (or memory): one writer connection, pooled readers.
struct Sqlite {
    writer: Mutex<Connection>,
    readers: Option<r2d2::Pool<SqliteConnectionManager>>,
    path: Option<PathBuf>,
    /// Stops (and is joined) when the last clone of the outbox is dropped.
    checkpointer: Option<Checkpointer>,
}

impl Sqlite {
    fn writer(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave the connection inside a
        // transaction: a `Tx` that began one rolls it back on drop. So the poison is harmless.
        self.writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_struct("Outbox");
        match &self.inner.backend {
            Backend::Sqlite(sqlite) => debug.field("path", &sqlite.path),
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => debug.field("database", &pg.target),
        };
        debug.finish_non_exhaustive()
    }
}

impl Outbox {
    /// Opens (creating if allowed) the outbox database at `path` and brings its schema
    /// up to date.
    ///
    /// A new file is created with mode 0600 (owner only): it holds private
    /// conversations. SQLite gives its `-wal` and `-shm` files the same mode. The file is
    /// switched to WAL only once its schema is in place, so a file whose upgrade fails
    /// keeps its journal mode.
    ///
    /// The stored rules ([`Rules`]) given in `options` are stored where the file has
    /// none yet (nobody declared them) and checked against the file's otherwise.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for options out of range (a zero lease, no attempts, an
    /// empty backoff schedule, a jitter outside `0.0..=1.0`; see
    /// [`OutboxOptions`]), before anything is touched on disk;
    /// [`Error::PolicyConflict`] if a stored rule given in `options` differs from the
    /// file's; [`Error::DatabaseMissing`] if the file is missing and creation is off;
    /// [`Error::NotADatabase`] if the file is not an SQLite database and
    /// [`Error::Corrupt`] if it is a damaged one (either is left untouched);
    /// [`Error::SchemaTooNew`] if a newer version of this crate wrote it;
    /// [`Error::SchemaTooOld`] or [`Error::NotAnOutbox`] if upgrades are off
    /// ([`OutboxOptions::with_schema_upgrade`]) and the file needs one;
    /// [`Error::CannotOpen`] if the file or its `-wal`/`-shm` companions cannot be
    /// opened (a read-only directory); [`Error::PragmaNotApplied`] if WAL mode or
    /// another pragma could not be set; [`Error::Migration`] if the schema could not be
    /// added (the file is left as it was); [`Error::Io`] if the file could not be
    /// created.
    pub fn open(path: impl AsRef<Path>, options: OutboxOptions) -> Result<Outbox> {
        options.validate()?;
        let path = path.as_ref().to_owned();
        create_private_file(&path, options.create_if_missing)?;
        connection::check_file(&path)?;
        let mut writer =
            Connection::open(&path).map_err(|e| connection::name_path(Error::from(e), &path))?;
        let mut setup = || -> Result<()> {
            connection::configure(&writer, &options, false)?;
            schema::refuse_newer(&writer)?;
            if !options.upgrade_schema {
                schema::refuse_upgrade(&writer, &path)?;
            }
            schema::migrate(&mut writer)?;
            connection::enable_wal(&writer, &options)
        };
        setup().map_err(|e| connection::name_path(e, &path))?;

        let readers = reader_pool(&path, &options, OpenFlags::default())?;
        let checkpointer = options
            .checkpoint_every
            .map(|every| Checkpointer::start(&path, &options, every))
            .transpose()?;
        let outbox = Outbox::from_sqlite(
            writer,
            Some(readers),
            options,
            Some(path.clone()),
            checkpointer,
        )?;
        outbox
            .reconcile()
            .map_err(|e| connection::name_path(e, &path))?;
        Ok(outbox)
    }

    /// Opens an existing outbox file for reading only: health, inspection and the
    /// stored rules, never a write. Nothing is created, migrated or switched: the file
    /// must be an outbox at this build's schema version. Writes through the returned
    /// handle fail with [`Error::ReadOnly`]. This is how the `outbox` tool opens a file
    /// for `health`, `list`, `show` and `config show`.
    ///
    /// # Errors
    ///
    /// [`Error::DatabaseMissing`], [`Error::NotADatabase`], [`Error::Corrupt`],
    /// [`Error::NotAnOutbox`], [`Error::SchemaTooOld`], [`Error::SchemaTooNew`], each
    /// naming the path, with the file left as it was; [`Error::CannotOpen`].
    pub fn open_read_only(path: impl AsRef<Path>, options: OutboxOptions) -> Result<Outbox> {
        options.validate()?;
        let path = path.as_ref().to_owned();
        if !path.exists() {
            return Err(Error::DatabaseMissing { path });
        }
        connection::check_file(&path)?;
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&path, flags)
            .map_err(|e| connection::name_path(Error::from(e), &path))?;
        let setup = || -> Result<()> {
            connection::configure_reader(&conn, &options)?;
            schema::refuse_newer(&conn)?;
            schema::refuse_upgrade(&conn, &path)
        };
        setup().map_err(|e| connection::name_path(e, &path))?;
        let readers = reader_pool(&path, &options, flags)?;
        let options = options.with_background_checkpoints(None);
        Outbox::from_sqlite(conn, Some(readers), options, Some(path), None)
    }

    /// Opens a private in-memory outbox: nothing reaches disk, everything is gone when
    /// the last clone is dropped. Meant for tests and examples.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for options out of range (as [`open`](Self::open));
    /// otherwise only if SQLite itself fails to start.
    pub fn open_in_memory(options: OutboxOptions) -> Result<Outbox> {
        options.validate()?;
        let mut writer = Connection::open_in_memory()?;
        connection::configure(&writer, &options, true)?;
        schema::migrate(&mut writer)?;
        let outbox = Outbox::from_sqlite(writer, None, options, None, None)?;
        outbox.reconcile()?;
        Ok(outbox)
    }

    /// Connects to an outbox in a PostgreSQL database (feature `postgres`), creating
    /// its tables (or bringing them up to date) in the first schema of the connection's
    /// `search_path` — `public` unless the URL sets another, such as
    /// `postgres://app@db/chat?options=-c%20search_path%3Doutbox`. Every process and
    /// host that connects to the same database and schema shares the outbox: its rows,
    /// its stored rules, each lane's order, each channel's rate.
    ///
    /// The handle keeps a pool of up to `options.readers + 1` connections (see
    /// [`OutboxOptions::with_readers`]) for writes and reads alike.
    ///
    /// ```no_run
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// // Every server of the application connects to the same database and schema.
    /// let outbox = Outbox::connect(
    ///     "postgres://bot@db.internal/chat?options=-c%20search_path%3Doutbox",
    ///     OutboxOptions::default(),
    /// )?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for options out of range or a URL that does not parse;
    /// [`Error::Connection`] if the server cannot be reached or refuses the login;
    /// [`Error::PolicyConflict`] as [`open`](Self::open); [`Error::SchemaTooNew`] if a
    /// newer build of this crate wrote the tables; [`Error::SchemaTooOld`] or
    /// [`Error::NotAnOutbox`] if upgrades are off and the schema needs one;
    /// [`Error::Migration`] if the tables could not be made (nothing of them is then
    /// left behind).
    #[cfg(feature = "postgres")]
    pub fn connect(url: &str, options: OutboxOptions) -> Result<Outbox> {
        Outbox::connect_postgres(url, options, false)
    }

    /// Connects to an outbox in a PostgreSQL database for reading only (feature
    /// `postgres`), as [`open_read_only`](Self::open_read_only) opens a file: nothing is
    /// created or migrated, and writes fail with [`Error::ReadOnly`].
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect); [`Error::NotAnOutbox`], [`Error::SchemaTooOld`]
    /// or [`Error::SchemaTooNew`] unless the schema holds an outbox of this build's
    /// version.
    #[cfg(feature = "postgres")]
    pub fn connect_read_only(url: &str, options: OutboxOptions) -> Result<Outbox> {
        Outbox::connect_postgres(url, options, true)
    }

    /// [`connect`](Self::connect), or with `read_only` [`connect_read_only`](Self::connect_read_only).
    ///
    /// Called from async code, it runs off the runtime's worker (see
    /// `store::postgres::runtime`), as every call of the PostgreSQL store does.
    #[cfg(feature = "postgres")]
    fn connect_postgres(url: &str, options: OutboxOptions, read_only: bool) -> Result<Outbox> {
        crate::store::postgres::runtime::off_runtime(|| {
            Outbox::connect_postgres_here(url, options, read_only)
        })
    }

    #[cfg(feature = "postgres")]
    fn connect_postgres_here(url: &str, options: OutboxOptions, read_only: bool) -> Result<Outbox> {
        use crate::store::postgres::{Begin, PgStore, PgTx, schema as pg_schema};
        options.validate()?;
        // Every time the rules store or compare is the server's (see `ServerTime`).
        let time = Arc::new(crate::clock::ServerTime::new(options.clock.clone()));
        let store = PgStore::connect(
            url,
            options.readers + 1,
            options.busy_timeout,
            read_only,
            options.transaction_pooler,
            time.clone(),
        )?;
        let mut options = options;
        options.clock = time;
        let (id_salt, stored) = {
            let mut conn = store.connection()?;
            let salt = if read_only || options.transaction_pooler {
                // Behind a transaction pooler: checked in one transaction, so its
                // statements meet one server connection; never migrated (see
                // `OutboxOptions::with_transaction_pooler`).
                conn.client.batch_execute("BEGIN")?;
                let checked = pg_schema::require_current(&mut conn)
                    .and_then(|()| pg_schema::id_salt(&mut conn));
                conn.client.batch_execute("ROLLBACK")?;
                checked?
            } else {
                pg_schema::migrate(&mut conn, options.upgrade_schema)?;
                pg_schema::id_salt(&mut conn)?
            };
            let tx = PgTx::begin(&mut conn, Begin::Read, &store.begins)?;
            (salt, tx.load_rules()?)
        };
        let options = options.with_background_checkpoints(None);
        let outbox = Outbox::from_backend(Backend::Postgres(store), options, id_salt, stored);
        if !read_only {
            outbox.reconcile()?;
        }
        Ok(outbox)
    }

    /// The rules stored in the file (see [`Rules`]), as every process on it follows
    /// them.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn rules(&self) -> Result<Rules> {
        self.read(|tx| Ok(tx.load_rules()?.policy))
    }

    /// The old name of [`rules`](Self::rules).
    ///
    /// # Errors
    ///
    /// As [`rules`](Self::rules).
    #[deprecated(since = "0.2.0", note = "renamed: use Outbox::rules")]
    pub fn policy(&self) -> Result<Rules> {
        self.rules()
    }

    /// The old name of [`set_rules`](Self::set_rules).
    ///
    /// # Errors
    ///
    /// As [`set_rules`](Self::set_rules).
    #[deprecated(since = "0.2.0", note = "renamed: use Outbox::set_rules")]
    pub fn set_policy(&self, rules: Rules) -> Result<()> {
        self.set_rules(rules)
    }

    /// Replaces the file-wide stored rules — lane order, lane failure policy, retry
    /// policy, default channel rules — and the rules of every channel named in
    /// `policy.channels` (a channel left out keeps its own). Every process on the file
    /// follows them from its next write on. Rows already stored move with the change: a
    /// switch to [`LaneOrder::Parallel`](crate::rules::LaneOrder::Parallel) starts every reply
    /// that was queued behind another, and a switch to
    /// [`LaneFailurePolicy::Skip`](crate::rules::LaneFailurePolicy::Skip) lets lanes blocked by
    /// a held head move on. (A switch to FIFO lets the replies already under way in a
    /// chat finish; new ones queue.)
    ///
    /// A file-wide rule is stored (declared, so that options giving another are a
    /// [`PolicyConflict`](Error::PolicyConflict)) when `policy` changes it or the file
    /// stores it already; one nobody declared that `policy` leaves as it reads stays
    /// undeclared, free for the first process that gives it.
    ///
    /// ```
    /// use chunked_outbox::{Outbox, OutboxOptions};
    /// use chunked_outbox::rules::LaneOrder;
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let mut rules = outbox.rules()?;
    /// rules.lane_order = LaneOrder::Parallel;
    /// outbox.set_rules(rules)?;
    /// assert_eq!(outbox.rules()?.lane_order, LaneOrder::Parallel);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an invalid retry policy; database errors (nothing is
    /// changed then).
    pub fn set_rules(&self, policy: Rules) -> Result<()> {
        policy.retry.validate()?;
        rules::check_default_channel(&policy.default_channel)?;
        for rules in policy.channels.values() {
            rules.validate()?;
        }
        self.change_rules(|tx, before| {
            let (had, was) = (&before.policy, before.declared);
            let changed = FileRules {
                lane_order: was.lane_order || policy.lane_order != had.lane_order,
                lane_failure: was.lane_failure || policy.lane_failure != had.lane_failure,
                retry: was.retry || policy.retry.stored_form() != had.retry,
                default_channel: was.default_channel
                    || policy.default_channel.stored_form() != had.default_channel,
            };
            if changed.any() {
                tx.store_file_rules(&policy, changed)?;
            }
            for (channel, rules) in &policy.channels {
                tx.store_channel_rules(channel, Some(rules))?;
            }
            let now = self.options().now_ms();
            lane::follow_rule_change(tx, &before.policy, &policy, now)
        })
    }

    /// Gives one channel stored rules of its own (`Some`), or lets it follow the file's
    /// default channel rules (`None`). Every process on the file follows them from its
    /// next write on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an empty channel name or an invalid retry policy;
    /// database errors.
    pub fn set_channel_policy(&self, channel: &str, rules: Option<ChannelPolicy>) -> Result<()> {
        if channel.trim().is_empty() {
            return Err(Error::invalid("channel", "must not be empty or whitespace"));
        }
        if let Some(rules) = &rules {
            rules.validate()?;
        }
        self.change_rules(|tx, _| tx.store_channel_rules(channel, rules.as_ref()))
    }

    /// The application's statement that finalization runs, if the file stores one (see
    /// [`set_finalization`](Self::set_finalization)).
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn finalization(&self) -> Result<Option<String>> {
        self.read(|tx| tx.finalization_statement())
    }

    /// Stores the statement that writes a finalized delivery into the application's
    /// own history (`Some`), or stops running one (`None`). It runs in the transaction
    /// of the delivery's last ack, after the delivery's row in `outbound_messages`,
    /// whose UNIQUE key keeps a delivery from being finalized twice: the application's
    /// table receives each delivery exactly once, whatever its own constraints. Every
    /// process that may finalize — dispatchers, [`resolve_uncertain`](Self::resolve_uncertain),
    /// [`recover`](Self::recover), the `outbox` tool — runs the same statement.
    ///
    /// Values are bound by name, never interpolated; the names are
    /// [`FINALIZE_PARAMETERS`](crate::rules::FINALIZE_PARAMETERS). The statement is checked
    /// against the file's schema when it is set. If the application's table refuses a
    /// reply when it runs (a constraint, a trigger, a row with that id already), that
    /// reply alone is set aside: its chunks stay delivered, nothing of its finalization
    /// is written, it becomes [`Unfinalized`](crate::monitoring::DeliveryStatus::Unfinalized) with
    /// the statement's message ([`Recorded::finalize_error`](crate::Recorded::finalize_error),
    /// health, `outbox show`), its chat moves on, and every other outcome of the same
    /// transaction is recorded. [`recover`](Self::recover) or
    /// [`finalize_again`](Self::finalize_again) finalizes it once the table takes it.
    /// (A trigger that raises `ROLLBACK` ends the whole transaction, so nothing of the
    /// ack is recorded; raise `ABORT` to refuse one row.)
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("app.db");
    /// rusqlite::Connection::open(&path).unwrap().execute_batch(
    ///     "CREATE TABLE messages (id TEXT PRIMARY KEY, chat_id TEXT, content TEXT, timestamp TEXT)",
    /// ).unwrap();
    /// let outbox = Outbox::open(&path, OutboxOptions::default())?;
    /// outbox.set_finalization(Some(
    ///     "INSERT INTO messages (id, chat_id, content, timestamp)
    ///      VALUES (:delivery_id, :chat_id, :content, :delivered_at_rfc3339)",
    /// ))?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "77", "hello"))?;
    /// let claim = outbox.claim(1)?.pop().unwrap();
    /// outbox.ack(&claim, None)?;
    /// let app = rusqlite::Connection::open(&path).unwrap();
    /// let content: String = app.query_row("SELECT content FROM messages", [], |r| r.get(0)).unwrap();
    /// assert_eq!(content, "hello");
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] if the statement does not prepare against the file's
    /// schema, holds more than one statement, writes nothing, or uses a parameter that
    /// is positional or not one of the names (nothing is stored then); database errors.
    pub fn set_finalization(&self, sql: Option<&str>) -> Result<()> {
        self.transact(true, false, |tx, _| {
            if let Some(sql) = sql {
                finalize::validate_statement(tx, sql)?;
            }
            tx.store_finalization_statement(sql)
        })
    }

    /// Wakes this process's dispatchers to look for due work now.
    ///
    /// Every write of this handle that can make work due does this itself. Call it after
    /// committing a transaction in which you used [`enqueue_in`](Self::enqueue_in): the
    /// reply becomes visible only at your commit, so a wake-up before it would find
    /// nothing. Without the call, a dispatcher still notices the commit within its poll
    /// interval.
    pub fn wake(&self) {
        self.inner.notifier.notify();
    }

    /// The claimant id this handle stamps on its claims (see [`ClaimantId`]).
    pub fn claimant(&self) -> ClaimantId {
        self.inner.claimant
    }

    /// A fencing token no other claim of this handle has, naming this handle.
    pub(crate) fn next_token(&self) -> i64 {
        let seq = self.inner.claims.fetch_add(1, Ordering::Relaxed);
        self.inner.claimant.token(seq)
    }

    /// Whether staged replies may be waiting, cleared (see `staged_hint`): said by a
    /// notification, or — on PostgreSQL, when this handle hears none (notifications
    /// off behind a transaction pooler, or its listener down) — once a
    /// [`STAGED_LOOK`] has passed since a claim last looked, so every claim loop finds
    /// staged replies within it.
    pub(crate) fn take_staged_hint(&self) -> bool {
        self.inner.staged_hint.swap(false, Ordering::AcqRel) || self.staged_look_due()
    }

    /// Whether a claim of this handle, which hears no notification, should look for
    /// staged replies now (see [`take_staged_hint`](Self::take_staged_hint)).
    fn staged_look_due(&self) -> bool {
        #[cfg(feature = "postgres")]
        if let Backend::Postgres(_) = &self.inner.backend {
            let heard = self
                .inner
                .listener
                .get()
                .and_then(|l| l.as_ref())
                .is_some_and(|l| l.state.healthy());
            if heard {
                return false;
            }
            let now = crate::clock::duration_ms(self.inner.opened.elapsed());
            let last = self.inner.staged_looked.load(Ordering::Acquire);
            return now - last >= crate::clock::duration_ms(STAGED_LOOK)
                && self
                    .inner
                    .staged_looked
                    .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok();
        }
        false
    }

    /// Whether staged replies may be waiting (the next claim should look).
    pub(crate) fn staged_hinted(&self) -> bool {
        self.inner.staged_hint.load(Ordering::Acquire)
    }

    /// Says that staged replies may be waiting.
    pub(crate) fn hint_staged(&self) {
        self.inner.staged_hint.store(true, Ordering::Release);
    }

    pub(crate) fn notifier(&self) -> &Notifier {
        &self.inner.notifier
    }

    /// Watches the database for commits by any connection, including other
    /// processes': on SQLite a connection of its own reads the file's data version;
    /// on PostgreSQL the handle's listener (started here, once) hears them.
    ///
    /// # Errors
    ///
    /// Database errors opening the watching connection; [`Error::Io`] if the
    /// listener's thread cannot be started.
    pub(crate) fn change_watcher(&self) -> Result<ChangeWatcher> {
        let source = match &self.inner.backend {
            Backend::Sqlite(Sqlite {
                path: Some(path), ..
            }) => {
                let conn = Connection::open(path)?;
                connection::configure_reader(&conn, &self.inner.options)?;
                WatchSource::File { conn, last: 0 }
            }
            Backend::Sqlite(_) => WatchSource::Memory,
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => WatchSource::Server {
                listener: self.listener(pg)?,
                resynced: std::time::Instant::now(),
                staged: self.inner.staged_hint.clone(),
            },
        };
        let mut watcher = ChangeWatcher { source };
        watcher.changed()?;
        Ok(watcher)
    }

    /// Starts this handle's listener if it has none (PostgreSQL; a failure to start
    /// it leaves the handle without, as with notifications off).
    pub(crate) fn listen_for_staged(&self) {
        #[cfg(feature = "postgres")]
        if let Backend::Postgres(pg) = &self.inner.backend
            && self.inner.listener.get().is_none()
        {
            let _ = self.listener(pg);
        }
    }

    /// The state of this handle's listener, started on first use; `None` when
    /// wake-ups by notification are off ([`OutboxOptions::with_listen`]).
    #[cfg(feature = "postgres")]
    fn listener(
        &self,
        pg: &crate::store::postgres::PgStore,
    ) -> Result<Option<Arc<crate::store::postgres::listen::ListenState>>> {
        use crate::store::postgres::listen;
        if !self.inner.options.listen || self.inner.options.transaction_pooler {
            return Ok(None);
        }
        if let Some(running) = self.inner.listener.get() {
            return Ok(running.as_ref().map(|l| l.state.clone()));
        }
        let started = listen::start(
            pg.config.clone(),
            self.inner.notifier.clone(),
            self.inner.staged_hint.clone(),
        )
        .map_err(|source| Error::Io {
            path: "listener thread".into(),
            source,
        })?;
        let state = started.state.clone();
        if self.inner.listener.set(Some(started)).is_err() {
            // Another dispatcher of this handle started one first: ours stops.
            return Ok(self
                .inner
                .listener
                .get()
                .and_then(|l| l.as_ref())
                .map(|l| l.state.clone()));
        }
        Ok(Some(state))
    }

    /// The pragmas the writer connection runs with, read back from SQLite.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn writer_settings(&self) -> Result<StorageSettings> {
        connection::read_settings(&self.sqlite("writer_settings")?.writer())
    }

    /// The pragmas a pooled read connection runs with (the writer's, in memory).
    ///
    /// # Errors
    ///
    /// Database and pool errors.
    pub fn reader_settings(&self) -> Result<StorageSettings> {
        self.read_sqlite("reader_settings", |tx| connection::read_settings(tx))
    }

    fn from_sqlite(
        writer: Connection,
        readers: Option<r2d2::Pool<SqliteConnectionManager>>,
        options: OutboxOptions,
        path: Option<PathBuf>,
        checkpointer: Option<Checkpointer>,
    ) -> Result<Outbox> {
        let id_salt = schema::id_salt(&writer)?;
        let stored = Tx::new(&writer).load_rules()?;
        let sqlite = Sqlite {
            writer: Mutex::new(writer),
            readers,
            path,
            checkpointer,
        };
        Ok(Outbox::from_backend(
            Backend::Sqlite(sqlite),
            options,
            id_salt,
            stored,
        ))
    }

    fn from_backend(
        backend: Backend,
        options: OutboxOptions,
        id_salt: i64,
        stored: Stored,
    ) -> Outbox {
        let on_server = !matches!(backend, Backend::Sqlite(_));
        Outbox {
            inner: Arc::new(Inner {
                backend,
                staged_hint: Arc::new(std::sync::atomic::AtomicBool::new(on_server)),
                notifier: Arc::default(),
                #[cfg(feature = "postgres")]
                listener: std::sync::OnceLock::new(),
                #[cfg(feature = "postgres")]
                staged_looked: std::sync::atomic::AtomicI64::new(0),
                #[cfg(feature = "postgres")]
                opened: std::time::Instant::now(),
                options,
                id_salt,
                claimant: ClaimantId::random(),
                claims: AtomicU32::new(0),
                stored: Mutex::new(Arc::new(stored)),
            }),
        }
    }

    /// The SQLite backend, or [`Error::Unsupported`] naming `what` on another.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    fn sqlite(&self, what: &'static str) -> Result<&Sqlite> {
        match &self.inner.backend {
            Backend::Sqlite(sqlite) => Ok(sqlite),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => Err(Error::Unsupported {
                what,
                backend: "PostgreSQL",
            }),
        }
    }

    /// The schema of a PostgreSQL outbox, quoted as an identifier, or
    /// [`Error::Unsupported`] naming `what` on another backend.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres_schema(&self, what: &'static str) -> Result<&str> {
        match &self.inner.backend {
            Backend::Postgres(pg) => Ok(&pg.quoted_schema),
            Backend::Sqlite(_) => Err(Error::Unsupported {
                what,
                backend: "SQLite",
            }),
        }
    }

    /// The SQLite writer connection, for what only a file has (its checkpoint, its
    /// pragmas); [`Error::Unsupported`] naming `what` on another backend.
    pub(crate) fn sqlite_writer(&self, what: &'static str) -> Result<MutexGuard<'_, Connection>> {
        Ok(self.sqlite(what)?.writer())
    }

    /// Whether this outbox lives in a PostgreSQL database.
    pub fn is_postgres(&self) -> bool {
        !matches!(self.inner.backend, Backend::Sqlite(_))
    }

    /// The uid of a new delivery in row `rowid`.
    pub(crate) fn new_delivery_id(&self, rowid: i64, created_ms: i64) -> DeliveryId {
        DeliveryId::for_row(rowid, self.inner.id_salt, created_ms)
    }

    /// The row of delivery `id` in this database, if it is one of ours (callers also
    /// match the stored uid).
    pub(crate) fn delivery_rowid(&self, id: DeliveryId) -> i64 {
        id.rowid(self.inner.id_salt)
    }

    /// The database file, or `None` for an in-memory outbox and one in PostgreSQL.
    pub fn path(&self) -> Option<&Path> {
        match &self.inner.backend {
            Backend::Sqlite(sqlite) => sqlite.path.as_deref(),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => None,
        }
    }

    /// The outbox's time: what its rules store and compare (due times, leases, ages).
    /// On PostgreSQL that is the server's clock — this handle's clock corrected by its
    /// offset to the server's, measured at every write — so every host agrees on it; on
    /// SQLite, this handle's clock. Give cutoffs on it rather than on the host's own
    /// clock, which may be minutes off:
    ///
    /// ```
    /// use chunked_outbox::{Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let report = outbox.purge(outbox.now() - chrono::Duration::days(7))?;
    /// assert_eq!(report.deliveries, 0);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        crate::clock::to_datetime(self.options().now_ms())
    }

    /// The options this outbox was opened with.
    pub fn options(&self) -> &OutboxOptions {
        &self.inner.options
    }

    /// Keeps this outbox's background checkpoints from running while the guard lives.
    pub(crate) fn pause_background_checkpoints(&self) -> Option<MutexGuard<'_, ()>> {
        match &self.inner.backend {
            Backend::Sqlite(sqlite) => sqlite.checkpointer.as_ref().map(Checkpointer::exclusive),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => None,
        }
    }

    /// Runs `f` in one write transaction — `BEGIN IMMEDIATE` on SQLite's writer
    /// connection, READ COMMITTED on a PostgreSQL connection of the pool — with the
    /// stored rules as they stand in that transaction; commits if it returns `Ok`, rolls
    /// back otherwise.
    pub(crate) fn write<T: Send>(
        &self,
        f: impl FnOnce(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        self.transact(false, false, f)
    }

    /// As [`write`](Self::write) for a change of the stored rules: the rules held
    /// exclusively, so no other write acts on the rules it replaces; then wakes this
    /// process's dispatchers.
    fn change_rules(
        &self,
        f: impl FnOnce(&dyn StoreTx, &Stored) -> Result<()> + Send,
    ) -> Result<()> {
        self.transact(true, true, f)?;
        self.wake();
        Ok(())
    }

    /// One write transaction: the rules locked (shared, or exclusive for a change of
    /// them) and read as they stand in it, `f`, then the commit — on PostgreSQL with a
    /// notification to every listening process if `announce`.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    fn transact<T: Send>(
        &self,
        change_rules: bool,
        announce: bool,
        f: impl FnOnce(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        let within = |tx: &dyn StoreTx| -> Result<T> {
            tx.lock_rules(change_rules)?;
            let rules = self.current_rules(tx)?;
            f(tx, &rules)
        };
        match &self.inner.backend {
            Backend::Sqlite(sqlite) => {
                let conn = sqlite.writer();
                let tx = Tx::begin(&conn, "BEGIN IMMEDIATE")?;
                let value = within(&tx)?;
                tx.commit()?;
                Ok(value)
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => {
                use crate::store::postgres::Begin;
                let kind = if pg.read_only {
                    Begin::WriteRefused { change_rules }
                } else {
                    Begin::Write { change_rules }
                };
                let result = pg.transaction(kind, |tx| {
                    let value = within(&tx)?;
                    pg.commit(tx, announce, self.inner.options.busy_timeout)?;
                    Ok(value)
                });
                if result.is_err() {
                    // Staged replies it made deliveries of may be staged again.
                    self.hint_staged();
                }
                result
            }
        }
    }

    /// The stored rules as the caller's own transaction sees them (`enqueue_in`): the
    /// handle's copy when it is of the same version, else read here and **not** kept.
    /// That transaction may yet roll back (a channel it registered, a version it
    /// bumped, would then never have existed), so nothing read inside it may enter the
    /// copy every clone of this handle shares.
    pub(crate) fn rules_uncached(&self, tx: &dyn StoreTx) -> Result<Arc<Stored>> {
        let version = tx.rules_version()?;
        let cached = self
            .inner
            .stored
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if cached.version == version {
            return Ok(cached);
        }
        Ok(Arc::new(tx.load_rules()?))
    }

    /// The stored rules, read again if another handle (or process) changed them since
    /// this handle last read them: one single-row read per transaction otherwise.
    fn current_rules(&self, tx: &dyn StoreTx) -> Result<Arc<Stored>> {
        let version = tx.rules_version()?;
        let mut cached = self.inner.stored.lock().unwrap_or_else(|e| e.into_inner());
        if cached.version != version {
            *cached = Arc::new(tx.load_rules()?);
        }
        Ok(cached.clone())
    }

    /// As [`write`](Self::write), then wakes the idle dispatchers of this process
    /// and (on PostgreSQL, by a notification sent with the commit) of every other
    /// process on the outbox: for writes that can make work due.
    pub(crate) fn write_and_wake<T: Send>(
        &self,
        f: impl FnOnce(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        let value = self.transact(false, true, f)?;
        self.wake();
        Ok(value)
    }

    /// As [`write_and_wake`](Self::write_and_wake), waking this process's dispatchers
    /// only: for a dispatcher's own round, whose claim in the same transaction takes
    /// what its outcomes made due (other hosts find the rest when they next look).
    pub(crate) fn write_and_wake_here<T: Send>(
        &self,
        f: impl FnOnce(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        let value = self.write(f)?;
        self.wake();
        Ok(value)
    }

    /// Runs `f` on a read-only connection (the writer, for an in-memory outbox), inside
    /// one read transaction so that everything `f` reads is one consistent snapshot.
    pub(crate) fn read<T: Send>(
        &self,
        f: impl FnOnce(&dyn StoreTx) -> Result<T> + Send,
    ) -> Result<T> {
        match &self.inner.backend {
            Backend::Sqlite(_) => self.read_sqlite("read", |tx| f(tx)),
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => {
                pg.transaction(crate::store::postgres::Begin::Read, |tx| f(&tx))
            }
        }
    }

    /// As [`read`](Self::read), on the SQLite connection itself (its pragmas).
    fn read_sqlite<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Tx<'_>) -> Result<T>,
    ) -> Result<T> {
        let sqlite = self.sqlite(what)?;
        match &sqlite.readers {
            Some(pool) => {
                let conn = pool.get()?;
                f(&Tx::begin(&conn, "BEGIN")?)
            }
            None => {
                let conn = sqlite.writer();
                f(&Tx::begin(&conn, "BEGIN")?)
            }
        }
    }

    /// Makes the stored rules agree with those the options declare (see
    /// [`reconcile`]), holding the rules exclusively.
    fn reconcile(&self) -> Result<()> {
        if !self.options().declares_rules() {
            return Ok(());
        }
        self.transact(true, true, |tx, _| reconcile(tx, self.options()))
    }
}

/// The pool of read connections on `path`. Every pool of the process shares one
/// scheduler thread for its upkeep.
fn reader_pool(
    path: &Path,
    options: &OutboxOptions,
    flags: OpenFlags,
) -> Result<r2d2::Pool<SqliteConnectionManager>> {
    let reader_options = options.clone();
    let manager = SqliteConnectionManager::file(path)
        .with_flags(flags)
        .with_init(move |c| connection::configure_reader(c, &reader_options));
    Ok(r2d2::Pool::builder()
        .max_size(options.readers)
        .min_idle(Some(0))
        .thread_pool(pool_upkeep())
        .build(manager)?)
}

/// The one scheduler thread every connection pool of the process runs its upkeep on.
pub(crate) fn pool_upkeep() -> Arc<scheduled_thread_pool::ScheduledThreadPool> {
    static UPKEEP: std::sync::OnceLock<Arc<scheduled_thread_pool::ScheduledThreadPool>> =
        std::sync::OnceLock::new();
    UPKEEP
        .get_or_init(|| {
            Arc::new(
                scheduled_thread_pool::ScheduledThreadPool::builder()
                    .num_threads(1)
                    .thread_name_pattern("outbox-pool-upkeep")
                    .build(),
            )
        })
        .clone()
}

/// Makes the stored rules agree with those `options` declares, in a transaction holding
/// the rules exclusively (so processes opening one outbox at once see each other's
/// declarations): a rule nobody declared yet is stored as given; a declared rule that
/// differs is [`Error::PolicyConflict`] unless the options say to update. A channel
/// with no rules of its own takes the rules given for it.
fn reconcile(tx: &dyn StoreTx, options: &OutboxOptions) -> Result<()> {
    // Compared as the file would store them (whole milliseconds), or a rule given in
    // finer units would differ from itself once stored.
    let retry = options.retry.as_ref().map(RetryPolicy::stored_form);
    let default_channel = options
        .default_channel
        .as_ref()
        .map(ChannelPolicy::stored_form);
    let Stored {
        policy: stored,
        declared,
        ..
    } = tx.load_rules()?;
    let mut wanted = stored.clone();
    let update = options.policy_update;
    let store = FileRules {
        lane_order: declare(
            "lane order",
            options.lane_order,
            declared.lane_order,
            &mut wanted.lane_order,
            |o| rules::lane_order_str(*o).into(),
            update,
        )?,
        lane_failure: declare(
            "lane failure policy",
            options.lane_failure,
            declared.lane_failure,
            &mut wanted.lane_failure,
            |f| rules::lane_failure_str(*f).into(),
            update,
        )?,
        retry: declare(
            "retry policy",
            retry,
            declared.retry,
            &mut wanted.retry,
            rules::retry_to_json,
            update,
        )?,
        default_channel: declare(
            "default channel rules",
            default_channel,
            declared.default_channel,
            &mut wanted.default_channel,
            |c| format!("{c:?}"),
            update,
        )?,
    };
    let mut channels = Vec::new();
    for (name, given) in &options.channels {
        let mut have = stored.channels.get(name).cloned();
        let declared = have.is_some();
        let given = Some(Some(given.stored_form()));
        if declare(
            &format!("rules of channel {name:?}"),
            given,
            declared,
            &mut have,
            |c| c.as_ref().map(|c| format!("{c:?}")).unwrap_or_default(),
            update,
        )? {
            channels.push((name, have));
        }
    }
    if store.any() {
        tx.store_file_rules(&wanted, store)?;
        lane::follow_rule_change(tx, &stored, &wanted, options.now_ms())?;
    }
    for (name, rules) in channels {
        tx.store_channel_rules(name, rules.as_ref())?;
    }
    Ok(())
}

/// Declares one stored rule: `Ok(true)` to store `given` (nobody declared the rule, or
/// the options update it), `Ok(false)` if nothing is given or the same is stored,
/// [`Error::PolicyConflict`] if another is stored. `wanted` becomes `given`.
fn declare<T: PartialEq>(
    rule: &str,
    given: Option<T>,
    declared: bool,
    wanted: &mut T,
    show: impl Fn(&T) -> String,
    update: bool,
) -> Result<bool> {
    let Some(given) = given else {
        return Ok(false);
    };
    let store = if declared && given == *wanted {
        false
    } else if !declared || update {
        true
    } else {
        return Err(Error::PolicyConflict {
            rule: rule.into(),
            stored: show(wanted),
            given: show(&given),
        });
    };
    *wanted = given;
    Ok(store)
}

/// Creates `path` with mode 0600 if it does not exist, so that SQLite never creates it
/// with the process umask.
fn create_private_file(path: &Path, create: bool) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    if !create {
        return Err(Error::DatabaseMissing {
            path: path.to_owned(),
        });
    }
    let mut open = OpenOptions::new();
    open.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    match open.open(path) {
        Ok(_) => Ok(()),
        // Another process created it between our check and our create: fine.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(Error::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

/// A generation counter that writers bump and idle dispatchers wait on, so an enqueue
/// in this process wakes them at once instead of at their next poll.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    generation: Mutex<u64>,
    changed: Condvar,
    #[cfg(feature = "tokio")]
    pub(crate) async_changed: tokio::sync::Notify,
}

impl Notifier {
    pub(crate) fn notify(&self) {
        *self.generation.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.changed.notify_all();
        #[cfg(feature = "tokio")]
        self.async_changed.notify_waiters();
    }

    pub(crate) fn generation(&self) -> u64 {
        *self.generation.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the generation differs from `seen` or `timeout` passes; returns the
    /// generation then.
    pub(crate) fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        let guard = self.generation.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |g| *g == seen)
            .unwrap_or_else(|e| e.into_inner());
        *guard
    }
}

/// Notices commits to the database by other connections, asked at each poll of an
/// idle dispatcher.
pub(crate) struct ChangeWatcher {
    source: WatchSource,
}

enum WatchSource {
    /// An SQLite file: `PRAGMA data_version` on a connection of its own changes when
    /// another connection commits.
    File { conn: Connection, last: i64 },
    /// In memory: no other connection can write.
    Memory,
    /// PostgreSQL: the handle's listener wakes the dispatchers itself; while it is
    /// down (or off), every poll looks again.
    #[cfg(feature = "postgres")]
    Server {
        listener: Option<Arc<crate::store::postgres::listen::ListenState>>,
        resynced: std::time::Instant,
        /// The handle's staged-replies hint: a look at the due times looks for them too.
        staged: Arc<std::sync::atomic::AtomicBool>,
    },
}

impl ChangeWatcher {
    /// Whether anything may have been committed since the last call that the
    /// dispatchers were not woken for.
    pub(crate) fn changed(&mut self) -> Result<bool> {
        match &mut self.source {
            WatchSource::File { conn, last } => {
                let version: i64 = conn.query_row("PRAGMA data_version", [], |r| r.get(0))?;
                let changed = version != *last;
                *last = version;
                Ok(changed)
            }
            WatchSource::Memory => Ok(false),
            #[cfg(feature = "postgres")]
            WatchSource::Server {
                listener,
                resynced,
                staged,
            } => {
                let heard = listener.as_ref().is_some_and(|l| l.healthy());
                if heard && resynced.elapsed() < crate::store::postgres::listen::RESYNC {
                    return Ok(false);
                }
                *resynced = std::time::Instant::now();
                staged.store(true, Ordering::Release);
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enqueue::NewDelivery;
    use crate::options::OutboxOptions;

    #[test]
    fn change_watcher_sees_other_connections_commits_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.db");
        let watched = Outbox::open(&path, OutboxOptions::default()).unwrap();
        let mut watcher = watched.change_watcher().unwrap();
        assert!(!watcher.changed().unwrap(), "nothing committed yet");
        let other = Outbox::open(&path, OutboxOptions::default()).unwrap();
        let _ = other.enqueue(&NewDelivery::single("t", "1", "x")).unwrap();
        assert!(watcher.changed().unwrap(), "another connection committed");
        assert!(!watcher.changed().unwrap(), "and nothing since");
        let _ = watched.health().unwrap(); // reads do not count
        assert!(!watcher.changed().unwrap());
    }

    #[test]
    fn the_file_or_the_server_is_named_never_a_password() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.db");
        let file = Outbox::open(&path, OutboxOptions::default()).unwrap();
        assert_eq!(file.path(), Some(path.as_path()));
        let shown = format!("{file:?}");
        assert!(shown.starts_with("Outbox { path:"), "{shown}");
        assert!(shown.contains("d.db"), "{shown}");
        #[cfg(feature = "postgres")]
        if let Some(url) = crate::store::test_server::fresh_schema_url() {
            let server = Outbox::connect(&url, OutboxOptions::default()).unwrap();
            assert_eq!(server.path(), None);
            let shown = format!("{server:?}");
            assert!(
                shown.starts_with("Outbox { database: \"postgres://"),
                "{shown}"
            );
        }
    }

    /// On PostgreSQL a dispatcher reads the due times again at a poll only while
    /// nobody listens (notifications off, or the listener's connection down), and
    /// otherwise once per resync interval.
    #[cfg(feature = "postgres")]
    #[test]
    fn a_server_watcher_polls_only_while_nobody_listens() {
        use crate::store::postgres::listen::{ListenState, RESYNC};
        let state = Arc::new(ListenState::default());
        let mut watcher = ChangeWatcher {
            source: WatchSource::Server {
                listener: Some(state.clone()),
                resynced: std::time::Instant::now(),
                staged: Arc::default(),
            },
        };
        assert!(watcher.changed().unwrap(), "listener down: poll");
        assert!(watcher.changed().unwrap(), "still down: poll again");
        state.set_healthy(true);
        assert!(!watcher.changed().unwrap(), "listening: wait to be woken");
        if let WatchSource::Server { resynced, .. } = &mut watcher.source {
            *resynced -= RESYNC;
        }
        assert!(watcher.changed().unwrap(), "a resync is due");
        assert!(!watcher.changed().unwrap(), "and then not again at once");
        let mut off = ChangeWatcher {
            source: WatchSource::Server {
                listener: None,
                resynced: std::time::Instant::now(),
                staged: Arc::default(),
            },
        };
        assert!(
            off.changed().unwrap(),
            "notifications off: every poll looks"
        );
    }

    /// Another handle's commit wakes this handle's dispatchers through the listener;
    /// a listener whose connection is killed reconnects and wakes them once (what was
    /// committed meanwhile was not announced to it).
    #[cfg(feature = "postgres")]
    #[test]
    fn the_listener_wakes_on_other_handles_commits_and_comes_back() {
        let Some(url) = crate::store::test_server::fresh_schema_url() else {
            return;
        };
        let deadline = || std::time::Instant::now() + Duration::from_secs(30);
        let watched = Outbox::connect(&url, OutboxOptions::default()).unwrap();
        let _watcher = watched.change_watcher().unwrap();
        let state = watched
            .inner
            .listener
            .get()
            .unwrap()
            .as_ref()
            .unwrap()
            .state
            .clone();
        let until = deadline();
        while !state.healthy() {
            assert!(
                std::time::Instant::now() < until,
                "the listener never connected"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let notifier = watched.notifier();
        let other = Outbox::connect(&url, OutboxOptions::default()).unwrap();
        let seen = notifier.generation();
        let _ = other.enqueue(&NewDelivery::single("t", "1", "x")).unwrap();
        assert_ne!(
            notifier.wait(seen, Duration::from_secs(30)),
            seen,
            "the other handle's enqueue woke nobody here"
        );

        let connects = state.connects();
        let seen = notifier.generation();
        let mut admin = postgres::Client::connect(
            &crate::store::test_server::server_url().unwrap(),
            postgres::NoTls,
        )
        .unwrap();
        let killed = admin
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE application_name = $1",
                &[&crate::store::postgres::listen::APPLICATION_NAME],
            )
            .unwrap();
        assert!(!killed.is_empty(), "no listening connection to kill");
        let until = deadline();
        while state.connects() == connects {
            assert!(
                std::time::Instant::now() < until,
                "the listener never came back"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_ne!(
            notifier.generation(),
            seen,
            "a reconnect wakes the dispatchers"
        );
    }

    #[test]
    fn notifier_wakes_waiters_and_times_out_otherwise() {
        let n = Arc::new(Notifier::default());
        let seen = n.generation();
        assert_eq!(
            n.wait(seen, Duration::from_millis(1)),
            seen,
            "no notify: timeout"
        );
        let waker = {
            let n = n.clone();
            std::thread::spawn(move || n.notify())
        };
        assert_eq!(n.wait(seen, Duration::from_secs(60)), seen + 1);
        waker.join().unwrap();
    }
}

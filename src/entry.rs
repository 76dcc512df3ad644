//! Where an application meets a store: opening each one, what only one store has, and
//! enqueueing inside the application's own transaction on each. The rules (every other
//! module) hold a [`Store`](crate::store::connections::Store) and never ask which it
//! is; this is the one module that names each store, one section per store.

use std::path::Path;

use crate::enqueue::{Enqueued, NewDelivery};
use crate::error::{Error, Result};
use crate::options::OutboxOptions;
use crate::outbox::Outbox;
use crate::store::sqlite::StorageSettings;
use crate::store::sqlite::file::SqliteStore;
use crate::store::sqlite::tx::Tx;

/// SQLite: a file, or memory.
impl Outbox {
    /// Opens (creating if allowed) the outbox database at `path` and brings its schema
    /// up to date.
    ///
    /// A new file is created with mode 0600 (owner only): it holds private
    /// conversations. SQLite gives its `-wal` and `-shm` files the same mode. The file is
    /// switched to WAL only once its schema is in place, so a file whose upgrade fails
    /// keeps its journal mode.
    ///
    /// The stored rules ([`Rules`](crate::rules::Rules)) given in `options` are stored
    /// where the file has none yet (nobody declared them) and checked against the
    /// file's otherwise.
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
    /// [`Error::SchemaTooNew`] if a newer version of this crate migrated it past what
    /// this build may write (a contract step; a newer schema that still accepts this
    /// build is written as it is, see docs/OPERATING.md "Upgrades");
    /// [`Error::SchemaTooOld`] or [`Error::NotAnOutbox`] if upgrades are off
    /// ([`OutboxOptions::with_schema_upgrade`]) and the file needs one;
    /// [`Error::CannotOpen`] if the file or its `-wal`/`-shm` companions cannot be
    /// opened (a read-only directory); [`Error::PragmaNotApplied`] if WAL mode or
    /// another pragma could not be set; [`Error::Migration`] if the schema could not be
    /// added (the file is left as it was); [`Error::Io`] if the file could not be
    /// created.
    pub fn open(path: impl AsRef<Path>, options: OutboxOptions) -> Result<Outbox> {
        options.validate()?;
        let store = SqliteStore::open(path.as_ref(), &options)?;
        Outbox::from_store(Box::new(store), options, false)
    }

    /// Opens an existing outbox file for reading only: health, inspection and the
    /// stored rules, never a write. Nothing is created, migrated or switched: the file
    /// must be an outbox at this build's schema version (or a newer one that still
    /// accepts it). Writes through the returned handle fail with [`Error::ReadOnly`].
    /// This is how the `outbox` tool opens a file for `health`, `list`, `show` and
    /// `config show`.
    ///
    /// # Errors
    ///
    /// [`Error::DatabaseMissing`], [`Error::NotADatabase`], [`Error::Corrupt`],
    /// [`Error::NotAnOutbox`], [`Error::SchemaTooOld`], [`Error::SchemaTooNew`], each
    /// naming the path, with the file left as it was; [`Error::CannotOpen`].
    pub fn open_read_only(path: impl AsRef<Path>, options: OutboxOptions) -> Result<Outbox> {
        options.validate()?;
        let store = SqliteStore::open_read_only(path.as_ref(), &options)?;
        let options = options.with_background_checkpoints(None);
        Outbox::from_store(Box::new(store), options, true)
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
        let store = SqliteStore::open_in_memory(&options)?;
        Outbox::from_store(Box::new(store), options, false)
    }

    /// The pragmas the writer connection runs with, read back from SQLite.
    ///
    /// # Errors
    ///
    /// Database errors; [`Error::Unsupported`] on another store.
    pub fn writer_settings(&self) -> Result<StorageSettings> {
        self.sqlite("writer_settings")?.writer_settings()
    }

    /// The pragmas a pooled read connection runs with (the writer's, in memory).
    ///
    /// # Errors
    ///
    /// Database and pool errors; [`Error::Unsupported`] on another store.
    pub fn reader_settings(&self) -> Result<StorageSettings> {
        self.sqlite("reader_settings")?.reader_settings()
    }

    /// Copies the WAL back into the database file and truncates it. The outbox already
    /// checkpoints in the background
    /// ([`with_background_checkpoints`](crate::OutboxOptions::with_background_checkpoints));
    /// call this after a large purge or in quiet periods to shrink the `-wal` file.
    ///
    /// # Errors
    ///
    /// Database errors; [`Error::Busy`](crate::Error::Busy) if readers, or a checkpoint
    /// by another process, kept it from completing. (This outbox's own background
    /// checkpoints wait while it runs.)
    pub fn checkpoint(&self) -> Result<()> {
        if self.sqlite("checkpoint")?.checkpoint()? {
            Ok(())
        } else {
            Err(Error::Busy)
        }
    }

    /// Enqueues inside a transaction the caller already holds on the same database file
    /// (the transactional-outbox pattern): the delivery exists exactly if the caller's
    /// transaction commits.
    ///
    /// `conn` must be a connection to the file this outbox was opened on (which applied
    /// the schema), inside an open transaction — typically a
    /// [`rusqlite::Transaction`], which dereferences to a connection. Start it with
    /// `BEGIN IMMEDIATE` to avoid lock upgrades failing under contention.
    ///
    /// **Call [`wake`](Self::wake) after your commit.** The reply exists only from
    /// your commit on, and this crate cannot see that commit on your connection (a
    /// commit hook would replace one the application may have set). Without the call a
    /// dispatcher of this process still finds the reply, at its next
    /// [poll](crate::dispatch::DispatcherBuilder::poll_interval) (50 ms by default); a dispatcher
    /// of another process notices the commit the same way.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let path = dir.path().join("app.db");
    /// let outbox = Outbox::open(&path, OutboxOptions::default())?;
    /// let mut app = rusqlite::Connection::open(&path)?;
    /// app.execute_batch("CREATE TABLE IF NOT EXISTS replies_sent (n INTEGER)")?;
    ///
    /// let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    /// tx.execute("INSERT INTO replies_sent VALUES (1)", [])?;
    /// outbox.enqueue_in(&tx, &NewDelivery::single("telegram", "42", "hi"))?;
    /// tx.commit()?; // the reply and the application's own row land together
    /// outbox.wake(); // this process's dispatchers look for it now
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue), and [`Error::InvalidInput`] if `conn` is not inside
    /// a transaction.
    pub fn enqueue_in(
        &self,
        conn: &rusqlite::Connection,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        delivery.validate()?;
        self.sqlite("enqueue_in with an SQLite connection")?;
        if conn.is_autocommit() {
            return Err(Error::invalid(
                "connection",
                "enqueue_in needs an open transaction on the caller's connection",
            ));
        }
        self.enqueue_on(&Tx::new(conn), delivery)
    }

    /// The SQLite store, or [`Error::Unsupported`] naming `what` on another.
    pub(crate) fn sqlite(&self, what: &'static str) -> Result<&SqliteStore> {
        let store = self.store();
        store
            .as_any()
            .downcast_ref()
            .ok_or_else(|| store.unsupported(what))
    }
}

/// PostgreSQL (feature `postgres`): a schema shared by every host.
#[cfg(feature = "postgres")]
impl Outbox {
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
    /// `url` is a URL or a key-value connection string, as libpq reads them. With a
    /// primary and standbys, name every node and ask for the writable one —
    /// `host=db-a,db-b port=5432,5432 dbname=chat target_session_attrs=read-write` — and
    /// the handle follows a failover by itself (see docs/OPERATING.md, "High
    /// availability").
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
    /// newer build of this crate took a contract step past this one (a newer schema
    /// that still accepts it is written as it is); [`Error::SchemaTooOld`] or
    /// [`Error::NotAnOutbox`] if upgrades are off and the schema needs one;
    /// [`Error::Migration`] if the tables could not be made (nothing of them is then
    /// left behind).
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
    /// version, or a newer one that still accepts this build.
    pub fn connect_read_only(url: &str, options: OutboxOptions) -> Result<Outbox> {
        Outbox::connect_postgres(url, options, true)
    }

    fn connect_postgres(url: &str, mut options: OutboxOptions, read_only: bool) -> Result<Outbox> {
        options.validate()?;
        let store = crate::store::postgres::PgStore::open(url, &mut options, read_only)?;
        let options = options.with_background_checkpoints(None);
        Outbox::from_store(Box::new(store), options, read_only)
    }

    /// The statement an application's transaction runs, and its arguments: `delivery`
    /// checked as an enqueue checks it, its uid's random parts drawn.
    fn staging<'a>(
        &self,
        what: &'static str,
        delivery: &'a NewDelivery,
    ) -> Result<(String, crate::store::postgres::application::Call<'a>)> {
        let sql =
            crate::store::postgres::application::statement(self.store().application_schema(what)?);
        delivery.validate()?;
        self.storable(delivery)?;
        let now = self.options().now_ms();
        let (uid_high, uid_spare) = crate::ids::DeliveryId::parts(now);
        let call = crate::store::postgres::application::Call {
            delivery,
            now,
            uid_high,
            uid_spare,
        };
        Ok((sql, call))
    }

    /// The answer of an enqueue from what `outbound_enqueue` returned.
    fn answer(
        &self,
        delivery: &NewDelivery,
        parts: crate::store::postgres::application::Parts,
    ) -> Result<Enqueued> {
        let r = crate::store::postgres::application::returned(parts)?;
        let id = r.uid.parse()?;
        if !r.created {
            return crate::enqueue::found_by_key(delivery, id, r.found);
        }
        crate::telemetry::enqueued(&delivery.channel);
        Ok(Enqueued { id, created: true })
    }

    /// Enqueues `delivery` inside the application's own transaction on the outbox's
    /// database, with the blocking [`postgres`] client: it is stored if and when that
    /// transaction commits, and the commit wakes the dispatchers of every process.
    /// See [the module](crate::store::postgres) for what the transaction holds and how
    /// each isolation level behaves.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let url = "postgres://app@db/chat";
    /// let outbox = Outbox::connect(url, OutboxOptions::default())?;
    /// let mut client = postgres::Client::connect(url, postgres::NoTls)?;
    /// let mut tx = client.transaction()?;
    /// tx.execute("INSERT INTO answers (question, body) VALUES ($1, $2)", &[&9001_i64, &"42"])?;
    /// let reply = NewDelivery::single("telegram", "42", "42").with_idempotency_key("answer-9001");
    /// outbox.enqueue_in_pg(&mut tx, &reply)?;
    /// tx.commit()?; // the answer and its reply land together, or neither does
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Outbox::enqueue) for the reply itself (nothing is written then);
    /// [`Error::Unsupported`] on an SQLite outbox (use
    /// [`enqueue_in`](Outbox::enqueue_in)); [`Error::Busy`] for a serialization
    /// failure (retry the transaction); [`Error::Postgres`] if the statement fails in
    /// the application's transaction (the transaction is then aborted, as PostgreSQL
    /// aborts it for any failed statement).
    pub fn enqueue_in_pg(
        &self,
        client: &mut impl postgres::GenericClient,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        let (sql, call) = self.staging("enqueue_in_pg", delivery)?;
        let row = client.query_one(sql.as_str(), &call.params())?;
        self.answer(delivery, crate::store::postgres::application::parts(&row)?)
    }

    /// As [`enqueue_in_pg`](Self::enqueue_in_pg), with the application's
    /// [`tokio_postgres`] client or transaction (feature `tokio-postgres`).
    ///
    /// # Errors
    ///
    /// As [`enqueue_in_pg`](Self::enqueue_in_pg).
    #[cfg(feature = "tokio-postgres")]
    pub async fn enqueue_in_tokio_pg(
        &self,
        client: &impl tokio_postgres::GenericClient,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        let (sql, call) = self.staging("enqueue_in_tokio_pg", delivery)?;
        let row = client.query_one(sql.as_str(), &call.params()).await?;
        self.answer(delivery, crate::store::postgres::application::parts(&row)?)
    }

    /// As [`enqueue_in_pg`](Self::enqueue_in_pg), on the application's [`sqlx`]
    /// connection (feature `sqlx`); for a transaction, pass `&mut *tx`.
    ///
    /// # Errors
    ///
    /// As [`enqueue_in_pg`](Self::enqueue_in_pg), with [`Error::Sqlx`] for a failed
    /// statement.
    #[cfg(feature = "sqlx")]
    pub async fn enqueue_in_sqlx(
        &self,
        conn: &mut sqlx::PgConnection,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        let (sql, call) = self.staging("enqueue_in_sqlx", delivery)?;
        let d = call.delivery;
        let parts = sqlx::query_as(&sql)
            .bind(&d.channel)
            .bind(&d.chat_id)
            .bind(&d.sender)
            .bind(&d.idempotency_key)
            .bind(&d.text)
            .bind(&d.chunks)
            .bind(&d.metadata)
            .bind(d.not_before)
            .bind(call.now)
            .bind(call.uid_high)
            .bind(call.uid_spare)
            .fetch_one(conn)
            .await
            .map_err(crate::store::postgres::application::sqlx_error)?;
        self.answer(delivery, parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

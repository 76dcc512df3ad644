//! The SQLite store's connections: the file (created owner-only), one writer behind a
//! mutex, a pool of read-only connections, background checkpoints, and a watcher of
//! other processes' commits.
//!
//! All writes of one handle go through the single writer connection, in
//! `BEGIN IMMEDIATE` transactions: SQLite has one writer, and more writer connections
//! only add lock contention. Reads use the pool, which WAL mode lets run beside the
//! writer. Other processes may open the same file; SQLite's locking and the busy
//! timeout serialise their writes with ours.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{Connection, OpenFlags};

use crate::error::{Error, Result};
use crate::options::OutboxOptions;
use crate::store::StoreTx;
use crate::store::connections::{
    Capabilities, ChangeWatch, Store, Unwatched, Wakeups, Write, pool_upkeep,
};
use crate::store::sqlite::checkpoint::{self, Checkpointer};
use crate::store::sqlite::connection::{self, StorageSettings};
use crate::store::sqlite::schema;
use crate::store::sqlite::tx::Tx;

/// An SQLite file (or memory): one writer connection, pooled readers.
pub(crate) struct SqliteStore {
    writer: Mutex<Connection>,
    readers: Option<r2d2::Pool<SqliteConnectionManager>>,
    path: Option<PathBuf>,
    id_salt: i64,
    /// Stops (and is joined) when the store is dropped.
    checkpointer: Option<Checkpointer>,
    /// The options the readers and the watchers are configured with.
    options: OutboxOptions,
}

impl SqliteStore {
    /// Opens (creating if allowed) the file at `path` and brings its schema up to date
    /// (see [`Outbox::open`](crate::Outbox::open)).
    pub(crate) fn open(path: &Path, options: &OutboxOptions) -> Result<Self> {
        create_private_file(path, options.create_if_missing)?;
        connection::check_file(path)?;
        let mut writer =
            Connection::open(path).map_err(|e| connection::name_path(Error::from(e), path))?;
        let mut setup = || -> Result<()> {
            connection::configure(&writer, options, false)?;
            schema::refuse_newer(&writer)?;
            if !options.upgrade_schema {
                schema::refuse_upgrade(&writer, path)?;
            }
            schema::migrate(&mut writer)?;
            connection::enable_wal(&writer, options)
        };
        setup().map_err(|e| connection::name_path(e, path))?;
        let readers = reader_pool(path, options, OpenFlags::default())?;
        let checkpointer = options
            .checkpoint_every
            .map(|every| Checkpointer::start(path, options, every))
            .transpose()?;
        SqliteStore::new(writer, Some(readers), options, Some(path), checkpointer)
    }

    /// Opens an existing outbox file for reading only (see
    /// [`Outbox::open_read_only`](crate::Outbox::open_read_only)).
    pub(crate) fn open_read_only(path: &Path, options: &OutboxOptions) -> Result<Self> {
        if !path.exists() {
            return Err(Error::DatabaseMissing {
                path: path.to_owned(),
            });
        }
        connection::check_file(path)?;
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags)
            .map_err(|e| connection::name_path(Error::from(e), path))?;
        let setup = || -> Result<()> {
            connection::configure_reader(&conn, options)?;
            schema::refuse_newer(&conn)?;
            schema::refuse_upgrade(&conn, path)
        };
        setup().map_err(|e| connection::name_path(e, path))?;
        let readers = reader_pool(path, options, flags)?;
        SqliteStore::new(conn, Some(readers), options, Some(path), None)
    }

    /// A private database in memory.
    pub(crate) fn open_in_memory(options: &OutboxOptions) -> Result<Self> {
        let mut writer = Connection::open_in_memory()?;
        connection::configure(&writer, options, true)?;
        schema::migrate(&mut writer)?;
        SqliteStore::new(writer, None, options, None, None)
    }

    fn new(
        writer: Connection,
        readers: Option<r2d2::Pool<SqliteConnectionManager>>,
        options: &OutboxOptions,
        path: Option<&Path>,
        checkpointer: Option<Checkpointer>,
    ) -> Result<Self> {
        Ok(SqliteStore {
            id_salt: schema::id_salt(&writer)?,
            writer: Mutex::new(writer),
            readers,
            path: path.map(Path::to_owned),
            checkpointer,
            options: options.clone(),
        })
    }

    /// The writer connection.
    pub(crate) fn writer(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave the connection inside a
        // transaction: a `Tx` that began one rolls it back on drop. So the poison is harmless.
        self.writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The pragmas the writer connection runs with, read back from SQLite.
    pub(crate) fn writer_settings(&self) -> Result<StorageSettings> {
        connection::read_settings(&self.writer())
    }

    /// The pragmas a pooled read connection runs with (the writer's, in memory).
    pub(crate) fn reader_settings(&self) -> Result<StorageSettings> {
        self.on_reader(|tx| connection::read_settings(tx))
    }

    /// Copies the WAL back into the file and truncates it (see
    /// [`Outbox::checkpoint`](crate::Outbox::checkpoint)); `false` if readers, or a
    /// checkpoint by another process, kept it from completing.
    pub(crate) fn checkpoint(&self) -> Result<bool> {
        let _background = self.checkpointer.as_ref().map(Checkpointer::exclusive);
        checkpoint::truncate(&self.writer())
    }

    /// `f` in a read transaction on a pooled reader (the writer, in memory).
    fn on_reader<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        match &self.readers {
            Some(pool) => {
                let conn = pool.get()?;
                f(&Tx::begin(&conn, "BEGIN")?)
            }
            None => f(&Tx::begin(&self.writer(), "BEGIN")?),
        }
    }
}

impl Store for SqliteStore {
    fn name(&self) -> &'static str {
        "SQLite"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            nul_in_text: true,
            staged_replies: false,
            shared: self.path.is_some(),
        }
    }

    fn schema_version(&self) -> i64 {
        schema::SCHEMA_VERSION
    }

    fn writable_from(&self) -> i64 {
        schema::WRITABLE_FROM
    }

    fn id_salt(&self) -> i64 {
        self.id_salt
    }

    fn write(
        &self,
        _how: Write,
        work: &mut (dyn FnMut(&dyn StoreTx) -> Result<()> + Send),
    ) -> Result<()> {
        // One writer: `BEGIN IMMEDIATE` holds the rules (and everything else) for the
        // whole transaction, whatever it changes.
        let conn = self.writer();
        let tx = Tx::begin(&conn, "BEGIN IMMEDIATE")?;
        work(&tx)?;
        tx.commit()?;
        if let Some(checkpointer) = &self.checkpointer {
            checkpointer.note_write();
        }
        Ok(())
    }

    fn read(&self, work: &mut (dyn FnMut(&dyn StoreTx) -> Result<()> + Send)) -> Result<()> {
        self.on_reader(|tx| work(tx))
    }

    fn watch(&self, _wake: &Wakeups) -> Result<Box<dyn ChangeWatch>> {
        let Some(path) = &self.path else {
            return Ok(Box::new(Unwatched));
        };
        let conn = Connection::open(path)?;
        connection::configure_reader(&conn, &self.options)?;
        let mut watch = FileWatch { conn, last: 0 };
        watch.changed()?;
        Ok(Box::new(watch))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn describe(&self, out: &mut std::fmt::DebugStruct<'_, '_>) {
        out.field("path", &self.path);
    }

    fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    fn locate(&self, error: Error) -> Error {
        match &self.path {
            Some(path) => connection::name_path(error, path),
            None => error,
        }
    }
}

/// A file's watcher: `PRAGMA data_version` on a connection of its own changes when
/// another connection commits.
struct FileWatch {
    conn: Connection,
    last: i64,
}

impl ChangeWatch for FileWatch {
    fn changed(&mut self) -> Result<bool> {
        let version: i64 = self
            .conn
            .query_row("PRAGMA data_version", [], |r| r.get(0))?;
        let changed = version != self.last;
        self.last = version;
        Ok(changed)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_watcher_sees_other_connections_commits_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.db");
        let options = OutboxOptions::default();
        let watched = SqliteStore::open(&path, &options).unwrap();
        let mut watcher = watched.watch(&Wakeups::default()).unwrap();
        assert!(!watcher.changed().unwrap(), "nothing committed yet");
        let other = SqliteStore::open(&path, &options).unwrap();
        other
            .writer()
            .execute_batch("INSERT INTO outbound_channels (name) VALUES ('watched')")
            .unwrap();
        assert!(watcher.changed().unwrap(), "another connection committed");
        assert!(!watcher.changed().unwrap(), "and nothing since");
        watched
            .read(&mut |tx| tx.rules_version().map(drop))
            .unwrap(); // reads do not count
        assert!(!watcher.changed().unwrap());
    }
}

//! The crate's error type.

use std::path::PathBuf;

use crate::ids::{ChunkId, DeliveryId};
use crate::status::ChunkStatus;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the outbox.
///
/// Every variant says what happened; the docs of each say what to do about it. An
/// operation that returns an error has changed nothing: each one runs in a single
/// transaction that is rolled back on failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Input was refused before anything was written (empty chunk, empty channel, a
    /// limit out of range, ...). Fix the input; retrying the same call fails again.
    #[error("invalid {what}: {reason}")]
    InvalidInput {
        /// Which argument or field was refused.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// The caller's idempotency key already names a delivery with different content.
    /// Use a new key for new content, or resend exactly the original content.
    #[error("idempotency key {key:?} already names delivery {existing} with different content")]
    IdempotencyConflict {
        /// The key that was reused.
        key: String,
        /// The delivery the key already belongs to.
        existing: DeliveryId,
    },

    /// The claim no longer owns its chunk: its lease expired and the chunk was recovered
    /// or claimed again, or an outcome was already recorded. Drop the claim; the chunk is
    /// in someone else's hands (or already settled).
    #[error(
        "claim on chunk {chunk} is stale: its lease expired or its outcome was already recorded"
    )]
    StaleClaim {
        /// The chunk the claim was for.
        chunk: ChunkId,
    },

    /// No delivery with this id exists (it may have been purged).
    #[error("delivery {0} not found")]
    DeliveryNotFound(DeliveryId),

    /// No chunk with this id exists (it may have been purged).
    #[error("chunk {0} not found")]
    ChunkNotFound(ChunkId),

    /// An operator action does not apply to the chunk's current status, e.g. resolving a
    /// chunk that is not `uncertain`.
    #[error("chunk {chunk} is {status}; {action} needs {expected}")]
    InvalidState {
        /// The chunk acted on.
        chunk: ChunkId,
        /// Its current status.
        status: ChunkStatus,
        /// The action that was refused.
        action: &'static str,
        /// The status(es) the action needs.
        expected: &'static str,
    },

    /// An operator action does not apply to the delivery's current status, e.g.
    /// requeueing a delivery that was delivered.
    #[error("delivery {delivery} is {status}; {action} needs a {expected} delivery")]
    DeliveryState {
        /// The delivery acted on.
        delivery: DeliveryId,
        /// Its current status.
        status: crate::status::DeliveryStatus,
        /// The action that was refused.
        action: &'static str,
        /// The status(es) the action needs.
        expected: &'static str,
    },

    /// [`Outbox::cancel`](crate::Outbox::cancel) came too late: a send of the delivery
    /// has started, so part of the reply may already be in the chat. A started reply is
    /// finished rather than cut short (the chat would show a fragment that the history
    /// never records); nothing was changed. Let it finish, or, if the reply must not
    /// stand, remove it on the platform once it is delivered.
    #[error(
        "delivery {delivery} cannot be cancelled: its chunk {delivery}:{number} is {status} after {attempts} send attempt(s), so part of the reply may already be in the chat; a started reply is finished, not cut short",
        number = .index + 1
    )]
    CancelTooLate {
        /// The delivery.
        delivery: DeliveryId,
        /// Its chunk whose send has started.
        chunk: ChunkId,
        /// That chunk's place in the delivery, from 0 (the error message counts from 1,
        /// as chunk keys and `outbox show` do).
        index: u32,
        /// That chunk's status.
        status: ChunkStatus,
        /// Its send attempts so far.
        attempts: u32,
    },

    /// The application's finalization statement
    /// ([`Outbox::set_finalization`](crate::Outbox::set_finalization)) refused a reply
    /// whose chunks all reached the chat: a constraint, trigger or type of the
    /// application's table. The reply stays
    /// [`Unfinalized`](crate::monitoring::DeliveryStatus::Unfinalized); fix the table (or the
    /// statement), then finalize it again.
    #[error(
        "the application's finalization statement refused delivery {delivery}: {message}; every chunk reached the chat, and the reply stays unfinalized until the statement takes it"
    )]
    FinalizationRefused {
        /// The reply.
        delivery: DeliveryId,
        /// What the statement met, in SQLite's words.
        message: String,
    },

    /// The database was migrated by a newer version of this crate to a schema that no
    /// longer accepts this build as a writer (a contract step dropped what it relies
    /// on). Upgrade to the release named; nothing was changed.
    #[error(
        "database schema version {found} no longer accepts writes from this build (schema {supported}): it takes builds of schema {writable_from} or later; upgrade to {upgrade_to} (nothing was changed)"
    )]
    SchemaTooNew {
        /// The schema version found in the database.
        found: i64,
        /// The newest schema version this build knows.
        supported: i64,
        /// The oldest schema version whose build the database still accepts as a
        /// writer (a schema before version 14 on SQLite, 9 on PostgreSQL, accepts only
        /// its own): a newer schema that is still at or below `supported` here is
        /// written as usual.
        writable_from: i64,
        /// The release to upgrade to: the one that migrated the database, or a
        /// description of any build of schema `writable_from` or later.
        upgrade_to: String,
    },

    /// The database was written by an older version of this crate and this handle was
    /// opened without schema upgrades (as the `outbox` tool opens files). Run `outbox
    /// migrate` (or open it once with [`OutboxOptions::with_schema_upgrade`](crate::OutboxOptions::with_schema_upgrade));
    /// nothing was changed in the file.
    #[error(
        "{} is at outbox schema version {found}, older than this build's {current}; run `outbox migrate` first (nothing was changed)", path.display()
    )]
    SchemaTooOld {
        /// The database file.
        path: PathBuf,
        /// The schema version found in the file.
        found: i64,
        /// The version this build writes.
        current: i64,
    },

    /// The file is an SQLite database (or the PostgreSQL schema a database), but not an outbox (it has tables of its own and
    /// none of the outbox's), and this handle may not add them. It was left as it was.
    #[error("{} is a database but not an outbox (no outbox tables); it was left untouched", path.display())]
    NotAnOutbox {
        /// The database file.
        path: PathBuf,
    },

    /// A stored rule (see [`Rules`](crate::rules::Rules)) differs from the one given in the
    /// options: each process on a file follows the file's rules, so a different one is
    /// refused rather than followed by one process only. Change the stored rule
    /// ([`Outbox::set_rules`](crate::Outbox::set_rules),
    /// [`Outbox::set_channel_policy`](crate::Outbox::set_channel_policy), `outbox config
    /// set`), drop it from the options, or open with
    /// [`OutboxOptions::with_policy_update`](crate::OutboxOptions::with_policy_update).
    #[error(
        "the file stores {rule} = {stored}, but these options give {given}; change the stored rule (Outbox::set_rules, `outbox config set`) or open with OutboxOptions::with_policy_update(true)"
    )]
    PolicyConflict {
        /// Which rule.
        rule: String,
        /// What the file stores.
        stored: String,
        /// What the options give.
        given: String,
    },

    /// The file exists but is not an SQLite database (or is corrupt). It was left
    /// untouched; restore it from a backup or point the outbox at another path.
    #[error("{} is not an outbox database (not SQLite, or corrupt); it was left untouched", path.display())]
    NotADatabase {
        /// The offending file.
        path: PathBuf,
    },

    /// The file is an SQLite database but damaged (for example truncated). It was left
    /// untouched; restore it from a backup.
    #[error("{} is corrupt ({reason}); it was left untouched", path.display())]
    Corrupt {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// SQLite could not open the file or the `-wal`/`-shm` files WAL mode keeps next to
    /// it: check that the file and its directory exist and are writable.
    #[error("cannot open {}: {reason} (WAL mode needs to write the file and create -wal and -shm beside it)", path.display())]
    CannotOpen {
        /// The database file.
        path: PathBuf,
        /// SQLite's message.
        reason: String,
    },

    /// The database file does not exist and the options say not to create it.
    #[error("database {} does not exist", path.display())]
    DatabaseMissing {
        /// The path that was looked for.
        path: PathBuf,
    },

    /// Another connection held the write lock for longer than the busy timeout. Retry
    /// later, or raise [`OutboxOptions::with_busy_timeout`](crate::OutboxOptions::with_busy_timeout).
    #[error("database is busy: another connection held the lock beyond the busy timeout")]
    Busy,

    /// The disk (or the database's `max_page_count`) is full. The transaction was rolled
    /// back; free space and retry.
    #[error("database or disk is full; the write was rolled back")]
    DiskFull,

    /// The database file or its directory is read-only for this process.
    #[error("database is read-only for this process: {0}")]
    ReadOnly(String),

    /// A filesystem operation on the database path failed.
    #[error("i/o error on {}: {source}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// SQLite did not accept a pragma the outbox depends on (for example WAL mode on a
    /// filesystem that cannot share memory between processes).
    #[error("pragma {pragma} is {got:?} after setting it to {wanted:?}")]
    PragmaNotApplied {
        /// The pragma's name.
        pragma: &'static str,
        /// The value that was set.
        wanted: String,
        /// The value read back.
        got: String,
    },

    /// Bringing the schema up to date failed, and nothing of it was applied: usually a
    /// table of the application's in the same file that the migration meets (rename or
    /// move it), or a file changed by hand.
    #[error("schema migration to version {version} failed{}: {message}", if statement.is_empty() { String::new() } else { format!(" at `{statement}`") })]
    Migration {
        /// The version whose migration failed.
        version: i64,
        /// The statement that failed, as written in the migration (empty if unknown).
        statement: String,
        /// SQLite's message.
        message: String,
    },

    /// No read connection could be had in time (every reader busy, or the file could
    /// not be opened for reading). Retry later; more `readers` in the options help a
    /// process with many concurrent readers.
    #[error("no read connection: {message}")]
    Pool {
        /// What the pool said.
        message: String,
    },

    /// Any other SQLite error.
    #[error("sqlite error: {0}")]
    Sqlite(rusqlite::Error),

    /// The PostgreSQL server could not be reached, or the connection to it was lost
    /// (feature `postgres`). A transaction that was under way did not happen (when the
    /// connection was lost during its commit, the outbox asked the server afterwards
    /// and learnt that it was rolled back). Retry when the server is back.
    #[error("no connection to {target}: {message}")]
    Connection {
        /// The server and database (never the password).
        target: String,
        /// What the client said.
        message: String,
    },

    /// The connection to the PostgreSQL server was lost while it committed, and the
    /// server could not be asked, within the busy timeout, whether the transaction
    /// committed (feature `postgres`). The call may or may not have taken effect.
    /// Retrying is safe for every call of the outbox: an enqueue with a caller key
    /// returns the reply it made, an outcome already recorded is a
    /// [`StaleClaim`](Self::StaleClaim) that changes nothing, an operator action finds
    /// its work done. Chunks claimed by the lost commit are `sending` under tokens
    /// nobody holds: their lease settles them.
    #[error("the commit to {target} may or may not have happened: {message}")]
    CommitUnknown {
        /// The server and database (never the password).
        target: String,
        /// What the client said.
        message: String,
    },

    /// A statement on the application's sqlx connection failed (feature `sqlx`, see
    /// [`Outbox::enqueue_in_sqlx`](crate::Outbox::enqueue_in_sqlx)).
    #[cfg(feature = "sqlx")]
    #[error("sqlx error: {0}")]
    Sqlx(sqlx::Error),

    /// Any other PostgreSQL error (feature `postgres`).
    #[cfg(feature = "postgres")]
    #[error("postgres error: {}", server_message(.0))]
    Postgres(postgres::Error),

    /// What was asked does not apply to this store (a file's checkpoint on
    /// PostgreSQL, say). Nothing was changed.
    #[error("{what} is not supported on {store}")]
    Unsupported {
        /// The call or command.
        what: &'static str,
        /// The store of the outbox (`SQLite`, `PostgreSQL`).
        store: &'static str,
    },
}

impl Error {
    /// Whether the store refused a write for what it held (a value it cannot keep, a
    /// constraint), not for its own state (busy, full, out of reach), so the same write
    /// would fail again however long it waited.
    pub(crate) fn is_refusal(&self) -> bool {
        match self {
            Error::Sqlite(_) => true,
            #[cfg(feature = "postgres")]
            Error::Postgres(_) => true,
            _ => false,
        }
    }

    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            what,
            reason: reason.into(),
        }
    }
}

/// The server's own message of a PostgreSQL error (with its detail), else the error's.
#[cfg(feature = "postgres")]
pub(crate) fn server_message(err: &postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_owned(),
        },
        None => err.to_string(),
    }
}

//! The two stores behind [`Outbox`](crate::Outbox), and what is particular to each.
//!
//! One API, one set of guarantees and one test suite cover both; pick by where the
//! application runs:
//!
//! | | SQLite (default) | PostgreSQL (feature `postgres`) |
//! |---|---|---|
//! | open | [`Outbox::open`](crate::Outbox::open)`("replies.db", options)` | `Outbox::connect("postgres://…", options)` |
//! | for | one host: a bot, a CLI agent, an engine with its own SQLite file | several hosts or replicas sharing one database |
//! | writers | one at a time (SQLite has one writer); readers beside it | many, on different hosts |
//! | wake-ups across processes | within the poll interval (`PRAGMA data_version`) | at once (`LISTEN`/`NOTIFY`), polling while the listener is down |
//! | the application's own transaction | [`Outbox::enqueue_in`](crate::Outbox::enqueue_in) on its rusqlite connection | `postgres`: `enqueue_in_pg`, `enqueue_in_tokio_pg`, `enqueue_in_sqlx` |
//! | a lost answer to `COMMIT` | cannot happen (no network) | looked up on the server ([`Error::CommitUnknown`](crate::Error::CommitUnknown) when it cannot be) |

/// The SQLite store's settings and schema version, and the rusqlite it is built with.
pub mod sqlite {
    pub use crate::options::Synchronous;
    pub use crate::store::sqlite::connection::StorageSettings;
    pub use crate::store::sqlite::schema::SCHEMA_VERSION;
    /// The rusqlite this crate is built with: [`Outbox::enqueue_in`](crate::Outbox::enqueue_in)
    /// takes its `Connection`, so an application names the same version through this
    /// re-export.
    pub use rusqlite;
}

#[cfg(feature = "postgres")]
pub mod postgres;

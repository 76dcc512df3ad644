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

/// A PostgreSQL connection URL as a message may show it: a password, in the user part
/// or as a `password` parameter, replaced by `***`. Every message of this crate and
/// its tool that names a server shows it so.
///
/// ```
/// use chunked_outbox::backends::redact_url;
///
/// assert_eq!(redact_url("postgres://bot:s3cret@db/chat"), "postgres://bot:***@db/chat");
/// assert_eq!(
///     redact_url("postgresql:///chat?host=/run/postgresql&password=s3cret&sslmode=disable"),
///     "postgresql:///chat?host=/run/postgresql&password=***&sslmode=disable"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    // postgres://user:secret@host/… (the user part ends at the last '@' before the path)
    if let Some(start) = out.find("://").map(|i| i + 3) {
        let end = out[start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| start + i);
        if let Some(at) = out[start..end].rfind('@').map(|i| start + i)
            && let Some(colon) = out[start..at].find(':').map(|i| start + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    // …?password=secret&… (and any case of the key)
    let mut from = 0;
    while let Some(i) = out[from..].to_ascii_lowercase().find("password=") {
        let value = from + i + "password=".len();
        let preceded = out[..from + i].ends_with(['?', '&', ' ']) || from + i == 0;
        let end = out[value..]
            .find(['&', ' '])
            .map_or(out.len(), |j| value + j);
        if preceded {
            out.replace_range(value..end, "***");
            from = value + 3;
        } else {
            from = value;
        }
    }
    out
}

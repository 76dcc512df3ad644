//! Where an outbox is: an SQLite file, or a PostgreSQL database (`--db postgres://…`,
//! with the `postgres` feature).

use std::path::{Path, PathBuf};

use chunked_outbox::{Outbox, OutboxOptions};

use crate::CliResult;

/// An outbox's place, as `--db` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    File(PathBuf),
    /// A PostgreSQL connection URL (its `search_path` names the outbox's schema).
    Postgres(String),
}

/// The keywords a key-value connection string may begin with (libpq's, as the
/// PostgreSQL client reads them).
const KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "options",
    "application_name",
    "sslmode",
    "connect_timeout",
    "keepalives",
    "target_session_attrs",
    "load_balance_hosts",
    "channel_binding",
];

/// Whether `db` reads as a key-value connection string: its first word `keyword=…`.
fn is_key_value(db: &str) -> bool {
    db.split_whitespace()
        .next()
        .and_then(|word| word.split_once('='))
        .is_some_and(|(key, _)| KEYWORDS.contains(&key))
}

impl Target {
    /// `--db`'s value: a `postgres://` or `postgresql://` URL, or a key-value
    /// connection string (`host=a,b port=5432,5432 dbname=chat …`: its first word a
    /// libpq keyword with its value), else a file path.
    pub fn of(db: &Path) -> Target {
        match db.to_str() {
            Some(url)
                if url.starts_with("postgres://")
                    || url.starts_with("postgresql://")
                    || is_key_value(url) =>
            {
                Target::Postgres(url.to_owned())
            }
            _ => Target::File(db.to_owned()),
        }
    }

    /// For messages: the file, or the server without the password.
    pub fn describe(&self) -> String {
        match self {
            Target::File(path) => path.display().to_string(),
            Target::Postgres(url) => chunked_outbox::store::redact_url(url),
        }
    }

    /// Opens (creating, and upgrading, as `options` allow) the outbox here.
    pub fn open(&self, options: OutboxOptions) -> CliResult<Outbox> {
        Ok(match self {
            Target::File(path) => Outbox::open(path, options)?,
            Target::Postgres(url) => pg::connect(url, options)?,
        })
    }

    /// Opens the outbox here for reading only.
    pub fn open_read_only(&self, options: OutboxOptions) -> CliResult<Outbox> {
        Ok(match self {
            Target::File(path) => Outbox::open_read_only(path, options)?,
            Target::Postgres(url) => pg::connect_read_only(url, options)?,
        })
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;

    pub fn connect(url: &str, options: OutboxOptions) -> chunked_outbox::Result<Outbox> {
        Outbox::connect(url, options)
    }

    pub fn connect_read_only(url: &str, options: OutboxOptions) -> chunked_outbox::Result<Outbox> {
        Outbox::connect_read_only(url, options)
    }
}

/// What a build without the `postgres` feature says to a PostgreSQL `--db`.
#[cfg(not(feature = "postgres"))]
pub const NO_POSTGRES: &str = "this build has no PostgreSQL support: \
     build it with `--features postgres`";

#[cfg(not(feature = "postgres"))]
mod pg {
    use super::*;

    pub fn connect(_: &str, _: OutboxOptions) -> CliResult<Outbox> {
        Err(NO_POSTGRES.into())
    }

    pub fn connect_read_only(_: &str, _: OutboxOptions) -> CliResult<Outbox> {
        Err(NO_POSTGRES.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_value_connection_string_is_postgres_and_a_path_is_a_file() {
        for db in [
            "postgres://bot@db/chat",
            "postgresql:///chat?host=/run/a",
            "host=/run/a,/run/b port=5432,5432 dbname=chat",
            "dbname=chat",
        ] {
            assert_eq!(Target::of(Path::new(db)), Target::Postgres(db.to_owned()));
        }
        for db in ["outbox.db", "data/x=y.db", "hostname=1.db", "./host=a"] {
            assert_eq!(Target::of(Path::new(db)), Target::File(db.into()));
        }
    }
}

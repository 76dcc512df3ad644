//! Connections to the file: the checks made before SQLite touches it (header, size,
//! companions), the pragmas of the writer and of readers, and read-back of each.

use std::path::Path;

use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::options::OutboxOptions;

/// Prepared statements kept per connection.
const STATEMENT_CACHE: usize = 128;

/// Switches the file to WAL (persistent in the file) and reads it back. Done only after
/// the schema is in place, so a file whose migration failed keeps its journal mode. The
/// switch needs a moment alone with the file; while other connections open it (several
/// processes creating one file at once), it is retried for up to the busy timeout.
pub(crate) fn enable_wal(conn: &Connection, options: &OutboxOptions) -> Result<()> {
    let deadline = std::time::Instant::now() + options.busy_timeout;
    loop {
        match conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0)) {
            Ok(journal) => return expect_pragma("journal_mode", "wal", &journal),
            Err(e) => match Error::from(e) {
                Error::Busy if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                other => return Err(other),
            },
        }
    }
}

/// The page cache of each connection, in KiB (as `PRAGMA cache_size` takes it,
/// negative).
const CACHE_KIB: i64 = -16_384;

/// Sets the connection's own pragmas and reads each one back (the journal mode, which
/// lives in the file, is [`enable_wal`]'s).
///
/// A pragma that did not take (effectum once shipped a misspelled WAL pragma and
/// silently ran in rollback-journal mode) is an error, not a surprise in production.
pub(crate) fn configure(conn: &Connection, options: &OutboxOptions, in_memory: bool) -> Result<()> {
    // Every statement of the crate is prepared once per connection and kept; the
    // default cache of 16 is smaller than the set of statements the writer uses.
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    conn.busy_timeout(options.busy_timeout)?;
    if in_memory {
        let journal: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        expect_pragma("journal_mode", "memory", &journal)?;
    }
    conn.pragma_update(None, "synchronous", options.synchronous.pragma_value())?;
    let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
    expect_pragma(
        "synchronous",
        &options.synchronous.pragma_value().to_string(),
        &sync.to_string(),
    )?;
    // The writer walks several indexes per chunk; a page cache of 16 MiB (SQLite's
    // default is 2 MiB) keeps their upper levels in memory as history grows. Not
    // more: a commit after a b-tree balance that renumbered pages (most commits of a
    // busy writer) walks the cache's whole hash table, so a larger cache costs every
    // such commit time in proportion to its size. 32 MiB dispatched slower than 16,
    // with a backlog of 1k as with one of 1M.
    conn.pragma_update(None, "cache_size", CACHE_KIB)?;
    if !in_memory && options.checkpoint_every.is_some() {
        // The background thread does the regular checkpoints; SQLite's own, which runs
        // (with an fsync) inside whichever commit crosses the threshold, stays only as
        // the bound on the WAL under sustained writes.
        conn.pragma_update(
            None,
            "wal_autocheckpoint",
            StorageSettings::BACKGROUND_AUTOCHECKPOINT_PAGES,
        )?;
    }
    if let Some(bytes) = options.max_size {
        let page_size: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let pages = bytes / page_size.max(1) as u64;
        let wanted = i64::try_from(pages).unwrap_or(i64::MAX).max(1);
        // A pragma takes no bound parameters; `wanted` is a number computed here. SQLite
        // never sets it below the current page count; reading it back tells.
        let set: i64 = conn.query_row(&format!("PRAGMA max_page_count = {wanted}"), [], |r| {
            r.get(0)
        })?;
        let current: i64 = conn.query_row("PRAGMA page_count", [], |r| r.get(0))?;
        expect_pragma(
            "max_page_count",
            &wanted.max(current).to_string(),
            &set.to_string(),
        )?;
    }
    Ok(())
}

/// Checks a file's SQLite header before SQLite touches it: a file that is not a
/// database, or one cut short (the header names more pages than the file holds), is
/// refused with an error naming it, and left exactly as it is.
pub(crate) fn check_file(path: &Path) -> Result<()> {
    match read_header(path)? {
        Header::Fits => Ok(()),
        Header::Short { .. } => {
            // Another process may be writing the file right now (its commit writes the
            // new header before the pages that extend the file): a file cut short stays
            // so when looked at again, one being written does not.
            match read_header(path)? {
                Header::Short {
                    pages,
                    page_size,
                    len,
                } => Err(Error::Corrupt {
                    path: path.to_owned(),
                    reason: format!(
                        "truncated: the header names {pages} pages of {page_size} bytes, the file holds {len} bytes"
                    ),
                }),
                Header::Fits => Ok(()),
            }
        }
    }
}

/// What a file's header says of its size.
enum Header {
    /// New, at rest and whole, or in use (its size cannot be judged then).
    Fits,
    /// At rest and shorter than its header says.
    Short {
        pages: u64,
        page_size: u64,
        len: u64,
    },
}

fn read_header(path: &Path) -> Result<Header> {
    use std::io::Read;
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len == 0 {
        return Ok(Header::Fits); // new: SQLite writes the header on first use
    }
    let mut header = [0_u8; 100];
    if len < 100 || file.read_exact(&mut header).is_err() || &header[..16] != b"SQLite format 3\0" {
        return Err(Error::NotADatabase {
            path: path.to_owned(),
        });
    }
    let be32 = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let page_size = match u16::from_be_bytes([header[16], header[17]]) {
        1 => 65_536,
        n => u64::from(n),
    };
    let pages = u64::from(be32(28));
    // The in-header size is only meaningful when it was written by the same change as
    // the header's change counter (SQLite's own rule), and only for a file at rest: while
    // a WAL holds commits, a checkpoint in another connection may have written the new
    // header before the pages that extend the file, and while a rollback journal exists
    // a commit may be writing them.
    let at_rest = !has_sidecar(path, "-wal") && !has_sidecar(path, "-journal");
    let size_valid = be32(92) == be32(24) && pages > 0 && at_rest;
    Ok(if size_valid && pages * page_size > len {
        Header::Short {
            pages,
            page_size,
            len,
        }
    } else {
        Header::Fits
    })
}

/// Whether a non-empty `-wal` or `-journal` file sits beside the database (it is in
/// use, or a process using it crashed).
fn has_sidecar(path: &Path, suffix: &str) -> bool {
    let mut side = path.as_os_str().to_owned();
    side.push(suffix);
    std::fs::metadata(side).is_ok_and(|m| m.len() > 0)
}

/// The settings a connection actually runs with, read back from SQLite.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StorageSettings {
    /// `PRAGMA journal_mode`: `wal` for files, `memory` in memory.
    pub journal_mode: String,
    /// `PRAGMA synchronous`: 1 = NORMAL, 2 = FULL.
    pub synchronous: i64,
    /// `PRAGMA busy_timeout`, in milliseconds.
    pub busy_timeout_ms: i64,
    /// `PRAGMA query_only`: true for the pooled read connections.
    pub query_only: bool,
    /// `PRAGMA wal_autocheckpoint`: SQLite's own checkpoint threshold, in pages.
    pub wal_autocheckpoint: i64,
}

impl StorageSettings {
    /// SQLite's automatic checkpoint threshold, in pages, on a writer whose outbox runs
    /// background checkpoints (SQLite's default of 1000 otherwise): 40 MiB of WAL at
    /// the default page size. An application connection that writes to the same file
    /// may set the same `PRAGMA wal_autocheckpoint`.
    pub const BACKGROUND_AUTOCHECKPOINT_PAGES: i64 = 10_000;
}

pub(crate) fn read_settings(conn: &Connection) -> Result<StorageSettings> {
    let get = |pragma: &str| -> Result<rusqlite::types::Value> {
        Ok(conn.query_row(&format!("PRAGMA {pragma}"), [], |r| r.get(0))?)
    };
    let int = |pragma: &str| -> Result<i64> {
        match get(pragma)? {
            rusqlite::types::Value::Integer(n) => Ok(n),
            other => Err(Error::PragmaNotApplied {
                pragma: "read back",
                wanted: format!("an integer for {pragma}"),
                got: format!("{other:?}"),
            }),
        }
    };
    Ok(StorageSettings {
        journal_mode: conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?,
        synchronous: int("synchronous")?,
        busy_timeout_ms: int("busy_timeout")?,
        query_only: int("query_only")? == 1,
        wal_autocheckpoint: int("wal_autocheckpoint")?,
    })
}

/// Pragmas of a pooled read connection. The writer already verified the file's
/// journal mode; `query_only` guarantees a reader can never write.
pub(crate) fn configure_reader(conn: &Connection, options: &OutboxOptions) -> rusqlite::Result<()> {
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    conn.busy_timeout(options.busy_timeout)?;
    conn.pragma_update(None, "synchronous", options.synchronous.pragma_value())?;
    conn.pragma_update(None, "query_only", true)
}

fn expect_pragma(name: &'static str, wanted: &str, got: &str) -> Result<()> {
    if wanted.eq_ignore_ascii_case(got) {
        Ok(())
    } else {
        Err(Error::PragmaNotApplied {
            pragma: name,
            wanted: wanted.to_owned(),
            got: got.to_owned(),
        })
    }
}

/// Maps "not a database" and "corrupt" on first contact to errors that name the path.
pub(crate) fn name_path(err: Error, path: &Path) -> Error {
    match &err {
        Error::Sqlite(e) => match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::NotADatabase) => Error::NotADatabase {
                path: path.to_owned(),
            },
            Some(rusqlite::ErrorCode::DatabaseCorrupt) => Error::Corrupt {
                path: path.to_owned(),
                reason: e.to_string(),
            },
            Some(rusqlite::ErrorCode::CannotOpen) => Error::CannotOpen {
                path: path.to_owned(),
                reason: e.to_string(),
            },
            _ => err,
        },
        _ => err,
    }
}

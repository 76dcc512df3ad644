//! SQLite's errors as the outbox's: the failures a caller can act on get their own
//! variants.

use crate::error::Error;

impl From<rusqlite::Error> for Error {
    /// Maps the SQLite failures a caller can act on to their own variants.
    fn from(err: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode as C;
        match err.sqlite_error_code() {
            Some(C::DatabaseBusy | C::DatabaseLocked) => Error::Busy,
            Some(C::DiskFull) => Error::DiskFull,
            Some(C::ReadOnly) => Error::ReadOnly(err.to_string()),
            _ => Error::Sqlite(err),
        }
    }
}

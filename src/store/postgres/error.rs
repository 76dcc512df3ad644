//! PostgreSQL's errors as the outbox's: the failures a caller can act on get their own
//! variants.

use crate::error::{Error, server_message as message};

impl From<postgres::Error> for Error {
    /// Maps the PostgreSQL failures a caller can act on to their own variants.
    fn from(err: postgres::Error) -> Self {
        map_error(err)
    }
}

/// Maps the PostgreSQL failures a caller can act on to their own variants.
fn map_error(err: postgres::Error) -> Error {
    use postgres::error::SqlState;
    match err.code() {
        Some(code)
            if *code == SqlState::T_R_DEADLOCK_DETECTED
                || *code == SqlState::T_R_SERIALIZATION_FAILURE
                || *code == SqlState::LOCK_NOT_AVAILABLE
                || *code == SqlState::QUERY_CANCELED =>
        {
            Error::Busy
        }
        Some(code) if *code == SqlState::DISK_FULL => Error::DiskFull,
        Some(code) if *code == SqlState::READ_ONLY_SQL_TRANSACTION => {
            Error::ReadOnly(message(&err))
        }
        _ if connection_lost(&err) => Error::Connection {
            target: String::new(),
            message: message(&err),
        },
        _ => Error::Postgres(err),
    }
}

/// Whether the connection is gone: closed, failed at the socket, or ended by the
/// server (terminated, shut down, not accepting connections yet, idle too long inside
/// a transaction).
pub(super) fn connection_lost(err: &postgres::Error) -> bool {
    use postgres::error::SqlState;
    match err.code() {
        Some(code) => {
            code.code().starts_with("08")
                || *code == SqlState::ADMIN_SHUTDOWN
                || *code == SqlState::CRASH_SHUTDOWN
                || *code == SqlState::CANNOT_CONNECT_NOW
                // The server ended a session idle in a transaction (see `bounds`).
                || *code == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
        }
        None => err.is_closed() || is_io(err),
    }
}

/// Whether the error is the socket's (the server went away, the network failed).
fn is_io(err: &postgres::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if e.is::<std::io::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

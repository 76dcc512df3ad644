//! The SQLite store's settings and schema version, and the rusqlite it is built with.

// The file, its schema and migrations, its pragmas, its connections (`file`), and the
// SQL of every primitive of the seam, implemented on `tx::Tx`. SQLite has one writer:
// every write transaction is `BEGIN IMMEDIATE`, so the lock primitives of the seam are
// no-ops here (the writer's lock already covers every lane, channel, key and the
// rules).

pub use crate::options::Synchronous;
pub use connection::StorageSettings;
/// The rusqlite this crate is built with: [`Outbox::enqueue_in`](crate::Outbox::enqueue_in)
/// takes its `Connection`, so an application names the same version through this
/// re-export.
pub use rusqlite;
pub use schema::SCHEMA_VERSION;

pub(crate) mod checkpoint;
pub(crate) mod schema;
pub(crate) mod tx;

pub(crate) mod chunks;
pub(crate) mod claims;
pub(crate) mod connection;
pub(crate) mod dead;
pub(crate) mod deliveries;
mod error;
pub(crate) mod file;
pub(crate) mod finalize;
pub(crate) mod lanes;
pub(crate) mod operator;
pub(crate) mod processes;
pub(crate) mod reads;
pub(crate) mod retention;
pub(crate) mod rules;

/// A status column read as its type: the word `as_str` writes, or an error naming it.
macro_rules! status_from_sql {
    ($($status:ty),*) => {$(
        impl rusqlite::types::FromSql for $status {
            fn column_result(
                value: rusqlite::types::ValueRef<'_>,
            ) -> rusqlite::types::FromSqlResult<Self> {
                value.as_str()?.parse().map_err(|e: crate::error::Error| {
                    rusqlite::types::FromSqlError::Other(Box::new(e))
                })
            }
        }
    )*};
}
status_from_sql!(crate::status::ChunkStatus, crate::status::DeliveryStatus);

/// SQL condition: chunk row `c` belongs to delivery row `d` (a range of the chunk
/// table's primary key: a chunk's id is `delivery row * CHUNK_STRIDE + index`).
macro_rules! chunks_of_delivery {
    ($c:literal, $d:literal) => {
        concat!(
            $c,
            ".id BETWEEN ",
            $d,
            " * ",
            $crate::store::chunk_stride!(),
            " AND ",
            $d,
            " * ",
            $crate::store::chunk_stride!(),
            " + ",
            $crate::store::chunk_stride!(last index)
        )
    };
}
pub(crate) use chunks_of_delivery;

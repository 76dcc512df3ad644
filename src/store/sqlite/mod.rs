//! The SQLite store: the file, its schema and migrations, its pragmas, and the SQL of
//! every primitive of the seam ([`crate::store`]), implemented on [`Tx`].
//!
//! SQLite has one writer: every write transaction is `BEGIN IMMEDIATE`, so the lock
//! primitives of the seam are no-ops here (the writer's lock already covers every lane,
//! channel, key and the rules).

pub(crate) mod checkpoint;
pub(crate) mod schema;
pub(crate) mod tx;

pub(crate) mod chunks;
pub(crate) mod claims;
pub(crate) mod connection;
pub(crate) mod deliveries;
pub(crate) mod finalize;
pub(crate) mod lanes;
pub(crate) mod operator;
pub(crate) mod reads;
pub(crate) mod retention;
pub(crate) mod rules;

//! The statement an application's own transaction runs to stage a reply
//! (`outbound_enqueue`, see the migration `V2__staged_replies.sql`): its text, its
//! arguments as each client binds them, and its answer.

#[cfg(feature = "sqlx")]
use crate::error::Error;
use crate::error::Result;
use crate::reply::NewDelivery;
use crate::store::StoredContent;

/// The call of `outbound_enqueue` in the outbox's schema, `quoted_schema` (the
/// application's connection may have another `search_path`).
pub(crate) fn statement(quoted_schema: &str) -> String {
    format!(
        "SELECT uid, created, channel, chat_id, sender, body, metadata, status, chunks
         FROM {quoted_schema}.outbound_enqueue($1::text, $2::text, $3::text, $4::text,
             $5::text, $6::text[], $7::text, $8::bigint, $9::bigint, $10::bigint,
             $11::bigint)"
    )
}

/// The arguments of `outbound_enqueue`, in order.
pub(crate) struct Call<'a> {
    pub(crate) delivery: &'a NewDelivery,
    pub(crate) now: i64,
    pub(crate) uid_high: i64,
    pub(crate) uid_spare: i64,
}

impl Call<'_> {
    /// The arguments, as the `postgres` and `tokio-postgres` clients bind them.
    pub(crate) fn params(&self) -> [&(dyn postgres::types::ToSql + Sync); 11] {
        let d = self.delivery;
        [
            &d.channel,
            &d.chat_id,
            &d.sender,
            &d.idempotency_key,
            &d.text,
            &d.chunks,
            &d.metadata,
            &d.not_before,
            &self.now,
            &self.uid_high,
            &self.uid_spare,
        ]
    }
}

/// What `outbound_enqueue` returned.
pub(crate) struct Returned {
    pub(crate) uid: String,
    pub(crate) created: bool,
    /// The reply the key named, when none was made.
    pub(crate) found: Option<StoredContent>,
}

/// The function's columns: uid, created, then the content of a reply its key named.
pub(crate) type Parts = (
    String,
    bool,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<Vec<String>>,
);

/// The columns of a `postgres` or `tokio-postgres` row.
pub(crate) fn parts(row: &postgres::Row) -> Result<Parts> {
    Ok((
        row.try_get(0)?,
        row.try_get(1)?,
        row.try_get(2)?,
        row.try_get(3)?,
        row.try_get(4)?,
        row.try_get(5)?,
        row.try_get(6)?,
        row.try_get(7)?,
        row.try_get(8)?,
    ))
}

/// What the function returned.
pub(crate) fn returned(parts: Parts) -> Result<Returned> {
    let (uid, created, channel, chat_id, sender, text, metadata, status, chunks) = parts;
    let found = match (created, channel, chat_id, text, status) {
        (false, Some(channel), Some(chat_id), Some(text), Some(status)) => Some(StoredContent {
            channel,
            chat_id,
            sender,
            text,
            metadata,
            status: super::tx::status_of(&status)?,
            chunks: chunks.unwrap_or_default().into_iter().map(Some).collect(),
        }),
        _ => None,
    };
    Ok(Returned {
        uid,
        created,
        found,
    })
}

/// A serialization failure or deadlock is [`Error::Busy`], as on the crate's own
/// connections; a lost connection is [`Error::Connection`].
#[cfg(feature = "sqlx")]
pub(crate) fn sqlx_error(e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")) => {
            Error::Busy
        }
        sqlx::Error::Io(_) | sqlx::Error::PoolClosed => Error::Connection {
            target: String::new(),
            message: e.to_string(),
        },
        _ => Error::Sqlx(e),
    }
}

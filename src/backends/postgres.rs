//! Enqueue inside the application's own PostgreSQL transaction: the reply commits or
//! rolls back with the application's own writes (the transactional outbox).
//!
//! The application's transaction runs one statement of the crate, the function
//! `outbound_enqueue(...)` that the outbox's schema holds. It writes one row — the
//! reply, *staged*: its lane not yet decided — and takes no lock of the outbox but
//! that row's and its caller key's. So a lane busy with other replies never holds up
//! the application's commit, a rollback leaves nothing, and the notification that
//! wakes the dispatchers of every host is sent by the commit itself. The outbox's own
//! short transactions then make the staged reply a delivery of its lane (by the next
//! claim of any dispatcher, or [`Outbox::recover`]), in commit order within the lane,
//! keeping the uid the application was given.
//!
//! # Isolation levels
//!
//! - **READ COMMITTED** (PostgreSQL's default): a caller key another transaction is
//!   using waits for that transaction; if it commits, the call returns its reply
//!   (`created == false`, or [`Error::IdempotencyConflict`] for other content); if it
//!   rolls back, the call makes the reply.
//! - **REPEATABLE READ** and **SERIALIZABLE**: the same, except that a key taken by a
//!   transaction that committed after this one's snapshot was taken cannot be read
//!   here: the call fails with [`Error::Busy`] (the server's serialization failure,
//!   `40001`), and the application retries its transaction, as it must for any write
//!   at these levels. A key taken before the snapshot returns that reply.
//!
//! A reply staged and not yet started shows as `queued` (without chunks) to
//! [`Outbox::delivery`] and in health, and can be cancelled.
//!
//! Any other client can call the function itself with the same eleven arguments
//! (`SELECT * FROM outbound_enqueue(...)`, see the migration
//! `V2__staged_replies.sql`); the typed calls below also check the reply as
//! [`Outbox::enqueue`] does and compare the content of a reply found by its key.

use crate::enqueue::{Enqueued, NewDelivery, same_content};
use crate::error::{Error, Result};
use crate::ids::DeliveryId;
use crate::outbox::Outbox;
use crate::store::StoredContent;

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
struct Returned {
    uid: String,
    created: bool,
    /// The reply the key named, when none was made.
    found: Option<StoredContent>,
}

impl Outbox {
    /// The statement, qualified with the outbox's schema (the application's
    /// connection may have another `search_path`).
    fn enqueue_sql(&self) -> Result<String> {
        let quoted_schema = self.postgres_schema("enqueue_in_pg")?;
        Ok(format!(
            "SELECT uid, created, channel, chat_id, sender, body, metadata, status, chunks
             FROM {quoted_schema}.outbound_enqueue($1::text, $2::text, $3::text, $4::text,
                 $5::text, $6::text[], $7::text, $8::bigint, $9::bigint, $10::bigint,
                 $11::bigint)"
        ))
    }

    /// Checks `delivery` as an enqueue does, and draws its uid's random parts.
    fn call<'a>(&self, delivery: &'a NewDelivery) -> Result<Call<'a>> {
        delivery.validate()?;
        self.storable(delivery)?;
        let now = self.options().now_ms();
        let (uid_high, uid_spare) = DeliveryId::parts(now);
        Ok(Call {
            delivery,
            now,
            uid_high,
            uid_spare,
        })
    }

    /// The answer of an enqueue from what the function returned.
    fn enqueued(&self, delivery: &NewDelivery, returned: Returned) -> Result<Enqueued> {
        let id: DeliveryId = returned.uid.parse()?;
        if returned.created {
            crate::telemetry::enqueued(&delivery.channel);
            return Ok(Enqueued { id, created: true });
        }
        match returned.found {
            Some(found) if same_content(&found, delivery) => Ok(Enqueued { id, created: false }),
            _ => Err(Error::IdempotencyConflict {
                key: delivery.idempotency_key.clone().unwrap_or_default(),
                existing: id,
            }),
        }
    }

    /// Enqueues `delivery` inside the application's own transaction on the outbox's
    /// database, with the blocking [`postgres`] client: it is stored if and when that
    /// transaction commits, and the commit wakes the dispatchers of every process.
    /// See [the module](crate::backends::postgres) for what the transaction holds and how
    /// each isolation level behaves.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let url = "postgres://app@db/chat";
    /// let outbox = Outbox::connect(url, OutboxOptions::default())?;
    /// let mut client = postgres::Client::connect(url, postgres::NoTls)?;
    /// let mut tx = client.transaction()?;
    /// tx.execute("INSERT INTO answers (question, body) VALUES ($1, $2)", &[&9001_i64, &"42"])?;
    /// let reply = NewDelivery::single("telegram", "42", "42").with_idempotency_key("answer-9001");
    /// outbox.enqueue_in_pg(&mut tx, &reply)?;
    /// tx.commit()?; // the answer and its reply land together, or neither does
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Outbox::enqueue) for the reply itself (nothing is written then);
    /// [`Error::Unsupported`] on an SQLite outbox (use
    /// [`enqueue_in`](Outbox::enqueue_in)); [`Error::Busy`] for a serialization
    /// failure (retry the transaction); [`Error::Postgres`] if the statement fails in
    /// the application's transaction (the transaction is then aborted, as PostgreSQL
    /// aborts it for any failed statement).
    pub fn enqueue_in_pg(
        &self,
        client: &mut impl postgres::GenericClient,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        let sql = self.enqueue_sql()?;
        let call = self.call(delivery)?;
        let row = client.query_one(sql.as_str(), &call.params())?;
        self.enqueued(delivery, returned(parts(&row)?)?)
    }

    /// As [`enqueue_in_pg`](Self::enqueue_in_pg), with the application's
    /// [`tokio_postgres`] client or transaction (feature `tokio-postgres`).
    ///
    /// # Errors
    ///
    /// As [`enqueue_in_pg`](Self::enqueue_in_pg).
    #[cfg(feature = "tokio-postgres")]
    pub async fn enqueue_in_tokio_pg(
        &self,
        client: &impl tokio_postgres::GenericClient,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        let sql = self.enqueue_sql()?;
        let call = self.call(delivery)?;
        let row = client.query_one(sql.as_str(), &call.params()).await?;
        self.enqueued(delivery, returned(parts(&row)?)?)
    }

    /// As [`enqueue_in_pg`](Self::enqueue_in_pg), on the application's [`sqlx`]
    /// connection (feature `sqlx`); for a transaction, pass `&mut *tx`.
    ///
    /// # Errors
    ///
    /// As [`enqueue_in_pg`](Self::enqueue_in_pg), with [`Error::Sqlx`] for a failed
    /// statement.
    #[cfg(feature = "sqlx")]
    pub async fn enqueue_in_sqlx(
        &self,
        conn: &mut sqlx::PgConnection,
        delivery: &NewDelivery,
    ) -> Result<Enqueued> {
        let sql = self.enqueue_sql()?;
        let call = self.call(delivery)?;
        let d = call.delivery;
        let row: Parts = sqlx::query_as(&sql)
            .bind(&d.channel)
            .bind(&d.chat_id)
            .bind(&d.sender)
            .bind(&d.idempotency_key)
            .bind(&d.text)
            .bind(&d.chunks)
            .bind(&d.metadata)
            .bind(d.not_before)
            .bind(call.now)
            .bind(call.uid_high)
            .bind(call.uid_spare)
            .fetch_one(conn)
            .await
            .map_err(sqlx_error)?;
        self.enqueued(delivery, returned(row)?)
    }
}

/// The function's columns: uid, created, then the content of a reply its key named.
type Parts = (
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
fn parts(row: &postgres::Row) -> Result<Parts> {
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
fn returned(parts: Parts) -> Result<Returned> {
    let (uid, created, channel, chat_id, sender, text, metadata, status, chunks) = parts;
    let found = match (created, channel, chat_id, text, status) {
        (false, Some(channel), Some(chat_id), Some(text), Some(status)) => Some(StoredContent {
            channel,
            chat_id,
            sender,
            text,
            metadata,
            status: crate::store::postgres::status_of(&status)?,
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
fn sqlx_error(e: sqlx::Error) -> Error {
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

//! Exactly-once finalization of a delivery into `outbound_messages`.

use rusqlite::types::Value;
use rusqlite::{Connection, params};

use crate::ids::chunks_of_delivery;
use crate::policy::Stored;
use crate::tx::Tx;
use crate::{Error, Result, lane};

/// The named parameters an application's finalization statement may use (written
/// `:name`, `@name` or `$name`), each bound from the finalized delivery:
///
/// | parameter | value |
/// |---|---|
/// | `delivery_id` | the delivery's id (UUID text) |
/// | `channel`, `chat_id` | where it went |
/// | `sender` | the sender name given at enqueue, or NULL |
/// | `content` | the whole text |
/// | `chunk_count` | how many chunks it was sent as |
/// | `created_at`, `delivered_at` | enqueue and finalization time, ms since the epoch |
/// | `delivered_at_rfc3339` | finalization time as RFC 3339 text (UTC, milliseconds) |
/// | `platform_message_ids` | the platform's message id of each chunk, a JSON array in chunk order (`null` where the platform gave none) |
/// | `metadata` | the metadata given at enqueue, or NULL |
pub const FINALIZE_PARAMETERS: &[&str] = &[
    "delivery_id",
    "channel",
    "chat_id",
    "sender",
    "content",
    "chunk_count",
    "created_at",
    "delivered_at",
    "delivered_at_rfc3339",
    "platform_message_ids",
    "metadata",
];

/// The values of [`FINALIZE_PARAMETERS`] for delivery `?1` finalized at `?2`, in order.
const FINALIZE_VALUES_SQL: &str = concat!(
    "SELECT uid, channel, chat_id, sender, text, chunk_count, created_at, ?2,
            strftime('%Y-%m-%dT%H:%M:%fZ', ?2 / 1000.0, 'unixepoch'),
            (SELECT json_group_array(platform_message_id) FROM (
                 SELECT platform_message_id FROM outbound_delivery_chunks c WHERE ",
    chunks_of_delivery!("c", "?1"),
    " ORDER BY c.id)),
            metadata
     FROM outbound_deliveries WHERE id = ?1"
);

/// Which of [`FINALIZE_PARAMETERS`] a statement's parameter (`:name`, `@name`,
/// `$name`) names.
fn parameter_index(name: &str) -> Option<usize> {
    let name = name.get(1..)?;
    FINALIZE_PARAMETERS.iter().position(|p| *p == name)
}

/// Checks an application's finalization statement against the schema of the file:
/// one statement that writes, every parameter one of [`FINALIZE_PARAMETERS`] by name.
pub(crate) fn validate_statement(conn: &Connection, sql: &str) -> Result<()> {
    let invalid = |reason: String| Error::invalid("finalization statement", reason);
    let stmt = conn.prepare(sql).map_err(|e| match e {
        rusqlite::Error::MultipleStatement => {
            invalid("it holds more than one statement; give exactly one".into())
        }
        e => invalid(format!(
            "it does not prepare against this database: {}",
            crate::schema::sqlite_message(&e)
        )),
    })?;
    if stmt.readonly() {
        return Err(invalid(
            "it does not write anything; give an INSERT (or another statement that writes)".into(),
        ));
    }
    if stmt.column_count() > 0 {
        return Err(invalid(
            "it returns rows (RETURNING); give a statement that only writes".into(),
        ));
    }
    for i in 1..=stmt.parameter_count() {
        match stmt.parameter_name(i) {
            Some(name) if parameter_index(name).is_some() => {}
            Some(name) => {
                return Err(invalid(format!(
                    "parameter {name} is not one of :{}",
                    FINALIZE_PARAMETERS.join(", :")
                )));
            }
            None => {
                return Err(invalid(format!(
                    "parameter {i} has no name; values are bound by name (:{})",
                    FINALIZE_PARAMETERS.join(", :")
                )));
            }
        }
    }
    Ok(())
}

/// Runs the application's finalization statement for `delivery`, every parameter
/// bound (never interpolated) from the delivery.
fn run_statement(tx: &Tx<'_>, sql: &str, delivery: i64, now: i64) -> Result<()> {
    let values: Vec<Value> =
        tx.prepare_cached(FINALIZE_VALUES_SQL)?
            .query_row(params![delivery, now], |r| {
                (0..FINALIZE_PARAMETERS.len())
                    .map(|i| r.get::<_, Value>(i))
                    .collect()
            })?;
    // The application's text, not the crate's: through the connection's own cache.
    let mut stmt = Connection::prepare_cached(tx, sql)?;
    for i in 1..=stmt.parameter_count() {
        let name = stmt.parameter_name(i).unwrap_or_default();
        // Checked when it was set; a statement stored by hand may still be wrong.
        let at = parameter_index(name).ok_or_else(|| {
            Error::invalid(
                "finalization statement",
                format!("unknown parameter {name}"),
            )
        })?;
        stmt.raw_bind_parameter(i, &values[at])?;
    }
    stmt.raw_execute()?;
    Ok(())
}

/// The statement that copies delivery `?1` into the crate's history, delivered at
/// `?2`, with `$content` as the content.
macro_rules! history_sql {
    ($content:literal) => {
        concat!(
            "INSERT INTO outbound_messages
                 (delivery_id, channel, chat_id, sender, content, chunk_count, created_at, delivered_at)
             SELECT uid, channel, chat_id, sender, ",
            $content,
            ", chunk_count, created_at, ?2
             FROM outbound_deliveries WHERE id = ?1"
        )
    };
}

/// Copies delivery `?1` into the crate's history, delivered at `?2`.
pub(crate) const HISTORY_SQL: &str = history_sql!("text");

/// [`HISTORY_SQL`] with the first character of the text cut off: the planted fault
/// `wrong_finalizations`.
const HISTORY_SQL_CUT: &str = history_sql!("substr(text, 2)");

/// Writes a fully delivered delivery to `outbound_messages` — and runs the application's
/// finalization statement, if the file stores one — and marks it delivered, in the
/// caller's transaction (the one that recorded its last ack).
/// `outbound_messages.delivery_id` is UNIQUE and written first, so a second
/// finalization fails before it reaches the application's table, whatever that
/// table's own constraints.
///
/// When the application's statement refuses the reply (its table already holds the
/// id, a CHECK or trigger of its own refuses the row), that reply alone is set aside:
/// nothing of its finalization is written, it becomes `unfinalized` with the
/// statement's message, its lane moves on, and the caller's transaction goes on with
/// whatever else it records; the result is that message. Only errors of the database
/// itself (busy, full, I/O) fail the transaction.
pub(crate) fn finalize(
    tx: &Tx<'_>,
    rules: &Stored,
    delivery: i64,
    (channel, chat_id): (&str, &str),
    (created_at, now): (i64, i64),
    tally: &mut Tally,
) -> Result<Option<String>> {
    match &rules.finalize_sql {
        None => write_history(tx, delivery, now)?,
        Some(sql) => {
            tx.prepare_cached("SAVEPOINT chunked_outbox_finalize")?
                .execute([])?;
            let written = write_history(tx, delivery, now)
                .and_then(|()| run_statement(tx, sql, delivery, now));
            match written {
                Ok(()) => {
                    tx.prepare_cached("RELEASE chunked_outbox_finalize")?
                        .execute([])?;
                }
                // A trigger's RAISE(ROLLBACK) ended the whole transaction: nothing is
                // left to contain the error in.
                Err(e) if tx.is_autocommit() => return Err(e),
                Err(e) => {
                    tx.prepare_cached("ROLLBACK TO chunked_outbox_finalize")?
                        .execute([])?;
                    tx.prepare_cached("RELEASE chunked_outbox_finalize")?
                        .execute([])?;
                    let message = refusal(e)?;
                    set_unfinalized(tx, rules, delivery, (channel, chat_id), now, &message)?;
                    return Ok(Some(message));
                }
            }
        }
    }
    tx.prepare_cached(
        "UPDATE outbound_deliveries
         SET status = 'delivered', delivered_count = chunk_count, updated_at = ?2, finished_at = ?2,
             finalize_error = NULL
         WHERE id = ?1",
    )?
    .execute(params![delivery, now])?;
    tally.add(channel, now, (now - created_at).max(0));
    lane::advance(tx, &rules.policy, channel, chat_id, now)?;
    Ok(None)
}

/// Writes delivery `delivery`'s row into `outbound_messages`, whose UNIQUE key refuses a
/// second one.
fn write_history(tx: &Tx<'_>, delivery: i64, now: i64) -> Result<()> {
    if crate::sabotage::planted("missing_finalizations") {
        return Ok(());
    }
    let sql = if crate::sabotage::planted("wrong_finalizations") {
        HISTORY_SQL_CUT
    } else {
        HISTORY_SQL
    };
    let written = tx.prepare_cached(sql)?.execute(params![delivery, now])?;
    if written != 1 {
        return Err(Error::invalid(
            "delivery",
            format!("row {delivery} to finalize is not stored"),
        ));
    }
    Ok(())
}

/// The message of an error that the application's statement met with the application's
/// own schema (a constraint, a trigger, a missing table, a value of the wrong type), or
/// the error itself when the database failed (busy, full, I/O), which the whole
/// transaction must fail with.
fn refusal(e: Error) -> Result<String> {
    use rusqlite::ErrorCode as C;
    match e {
        Error::Sqlite(inner)
            if matches!(
                inner.sqlite_error_code(),
                Some(
                    C::ConstraintViolation
                        | C::TypeMismatch
                        | C::TooBig
                        | C::Unknown
                        | C::AuthorizationForStatementDenied
                )
            ) =>
        {
            Ok(crate::schema::sqlite_message(&inner))
        }
        Error::InvalidInput { what, reason } => Ok(format!("{what}: {reason}")),
        other => Err(other),
    }
}

/// Sets a fully delivered reply aside as `unfinalized` with the statement's message; its
/// lane moves on (every chunk reached the chat).
fn set_unfinalized(
    tx: &Tx<'_>,
    rules: &Stored,
    delivery: i64,
    (channel, chat_id): (&str, &str),
    now: i64,
    message: &str,
) -> Result<()> {
    tracing::warn!(
        delivery,
        error = message,
        "the application's finalization statement refused a reply; it stays unfinalized"
    );
    tx.prepare_cached(
        "UPDATE outbound_deliveries
         SET status = 'unfinalized', delivered_count = chunk_count, updated_at = ?2,
             finalize_error = ?3
         WHERE id = ?1",
    )?
    .execute(params![delivery, now, message])?;
    lane::advance(tx, &rules.policy, channel, chat_id, now)
}

/// The finalizations of one transaction, per channel, for `outbound_channel_stats`:
/// written once per channel when the transaction's work is done ([`Tally::write`])
/// rather than once per reply — a batch of 64 acks updates the row once.
#[derive(Default)]
pub(crate) struct Tally {
    /// Channel → (replies, latest finalization, latencies in ms).
    channels: Vec<(String, i64, Vec<i64>)>,
}

impl Tally {
    fn add(&mut self, channel: &str, now: i64, latency_ms: i64) {
        match self.channels.iter_mut().find(|(c, ..)| c == channel) {
            Some((_, at, latencies)) => {
                *at = (*at).max(now);
                latencies.push(latency_ms);
            }
            None => self
                .channels
                .push((channel.to_owned(), now, vec![latency_ms])),
        }
    }

    /// Adds the tally to the stored count and to the totals that only grow: finalized
    /// replies and their enqueue-to-finalization latency (buckets as in
    /// `health::LATENCY_BUCKETS`).
    pub(crate) fn write(self, tx: &Tx<'_>) -> Result<()> {
        for (channel, at, latencies) in self.channels {
            let le = |limit_ms: i64| latencies.iter().filter(|l| **l <= limit_ms).count() as i64;
            tx.prepare_cached(
                "INSERT INTO outbound_channel_stats
                     (channel, delivered, last_delivered_at, finalized_total, latency_count,
                      latency_sum_ms, latency_le_1s, latency_le_5s, latency_le_30s,
                      latency_le_120s, latency_le_600s, latency_le_3600s)
                 VALUES (?1, ?3, ?2, ?3, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                 ON CONFLICT (channel) DO UPDATE
                 SET delivered = delivered + ?3,
                     last_delivered_at = max(coalesce(last_delivered_at, ?2), ?2),
                     finalized_total = finalized_total + ?3,
                     latency_count = latency_count + ?3,
                     latency_sum_ms = latency_sum_ms + ?4,
                     latency_le_1s = latency_le_1s + ?5,
                     latency_le_5s = latency_le_5s + ?6,
                     latency_le_30s = latency_le_30s + ?7,
                     latency_le_120s = latency_le_120s + ?8,
                     latency_le_600s = latency_le_600s + ?9,
                     latency_le_3600s = latency_le_3600s + ?10",
            )?
            .execute(params![
                channel,
                at,
                latencies.len() as i64,
                latencies.iter().sum::<i64>(),
                le(1_000),
                le(5_000),
                le(30_000),
                le(120_000),
                le(600_000),
                le(3_600_000),
            ])?;
        }
        Ok(())
    }
}

/// Unfinished deliveries whose chunks are all delivered. A delivery without chunk rows
/// has none delivered: a cancelled one (its chunks removed) or a queued one (its chunk
/// is stored when it becomes active).
pub(crate) const SWEEP_SQL: &str = concat!(
    "SELECT d.id, d.channel, d.chat_id, d.created_at FROM outbound_deliveries d
     WHERE d.status <> 'delivered' AND NOT EXISTS (
         SELECT 1 FROM outbound_delivery_chunks c
         WHERE c.status <> 'delivered' AND ",
    chunks_of_delivery!("c", "d.id"),
    ") AND EXISTS (SELECT 1 FROM outbound_delivery_chunks c WHERE ",
    chunks_of_delivery!("c", "d.id"),
    ")"
);

/// Finalizes unfinished deliveries whose chunks are all delivered: what a crash in a
/// path that recorded chunk acks separately from finalization (an older outbox, a
/// manual repair) leaves behind, and `unfinalized` replies, whose statement refused
/// them before (one refused again stays so). Reads only unfinished deliveries, never
/// history. Returns how many it finalized.
pub(crate) fn sweep(tx: &Tx<'_>, rules: &Stored, now: i64) -> Result<u64> {
    type Done = (i64, String, String, i64);
    let done: Vec<Done> = tx
        .prepare_cached(SWEEP_SQL)?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut tally = Tally::default();
    let mut finalized = 0;
    for (delivery, channel, chat_id, created_at) in &done {
        let times = (*created_at, now);
        if finalize(tx, rules, *delivery, (channel, chat_id), times, &mut tally)?.is_none() {
            finalized += 1;
        }
    }
    tally.write(tx)?;
    Ok(finalized)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqlite(code: std::ffi::c_int, message: &str) -> Error {
        Error::Sqlite(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(code),
            Some(message.into()),
        ))
    }

    /// What the application's schema refuses sets the reply aside with SQLite's
    /// message; a failure of the database itself (I/O, corruption, an interrupt) fails
    /// the transaction, to be retried, rather than turning a sound reply unfinalized.
    #[test]
    fn only_the_applications_refusals_are_contained() {
        use rusqlite::ffi;
        for code in [
            ffi::SQLITE_CONSTRAINT,
            ffi::SQLITE_MISMATCH,
            ffi::SQLITE_TOOBIG,
            ffi::SQLITE_ERROR,
            ffi::SQLITE_AUTH,
        ] {
            assert_eq!(refusal(sqlite(code, "refused")).unwrap(), "refused");
        }
        assert!(
            refusal(Error::invalid(
                "finalization statement",
                "unknown parameter :x"
            ))
            .unwrap()
            .contains(":x")
        );
        for code in [
            ffi::SQLITE_IOERR,
            ffi::SQLITE_CORRUPT,
            ffi::SQLITE_INTERRUPT,
            ffi::SQLITE_NOMEM,
            ffi::SQLITE_CANTOPEN,
        ] {
            assert!(matches!(
                refusal(sqlite(code, "broken")),
                Err(Error::Sqlite(_))
            ));
        }
        assert!(matches!(refusal(Error::Busy), Err(Error::Busy)));
        assert!(matches!(refusal(Error::DiskFull), Err(Error::DiskFull)));
    }
}

//! Finalization on SQLite: the history row, the application's statement, the channel
//! counters.

use crate::store::sqlite_param;
use rusqlite::types::Value;
use rusqlite::{Connection, params};

use super::chunks_of_delivery;
use super::dead::Table;
use super::schema::sqlite_message;
use super::tx::Tx;
use crate::error::{Error, Result};
use crate::rules::{FINALIZE_PARAMETERS, parameter_index};
use crate::store::{ActivityRow, ChannelTally, DeliveryLane, FinalizeStore, StatementShape};

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

/// The statement that copies delivery `?1` into the crate's history, delivered at
/// `?2`, with `$content` as the content. `OR FAIL`: it copies at most one row, so a
/// failure leaves nothing of its own to undo (and fails the transaction, which undoes
/// the rest); without it SQLite would run this `INSERT ... SELECT` under a statement
/// journal, copying every page it changes, in every finalization.
macro_rules! history_sql {
    ($content:literal) => {
        concat!(
            "INSERT OR FAIL INTO outbound_messages
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

/// Unfinished deliveries whose chunks are all delivered. A delivery without chunk rows
/// has none delivered: a cancelled one (its chunks removed) or a queued one (its chunk
/// is stored when it becomes active).
pub(crate) const SWEEP_SQL: &str = concat!(
    "SELECT d.id, d.channel, d.chat_id, d.created_at FROM outbound_deliveries d
     WHERE d.status <> 'delivered' AND d.status <> 'failed' AND NOT EXISTS (
         SELECT 1 FROM outbound_delivery_chunks c
         WHERE c.status <> 'delivered' AND ",
    chunks_of_delivery!("c", "d.id"),
    ") AND EXISTS (SELECT 1 FROM outbound_delivery_chunks c WHERE ",
    chunks_of_delivery!("c", "d.id"),
    ")"
);

impl FinalizeStore for Tx<'_> {
    fn write_history(&self, delivery: i64, now: i64) -> Result<bool> {
        let sql = if crate::sabotage::planted("wrong_finalizations") {
            HISTORY_SQL_CUT
        } else {
            HISTORY_SQL
        };
        Ok(self.prepare_cached(sql)?.execute(params![delivery, now])? == 1)
    }

    fn describe_statement(&self, sql: &str) -> Result<std::result::Result<StatementShape, String>> {
        let stmt = match self.prepare(sql) {
            Ok(stmt) => stmt,
            Err(rusqlite::Error::MultipleStatement) => {
                return Ok(Err(
                    "it holds more than one statement; give exactly one".into()
                ));
            }
            Err(e) => {
                return Ok(Err(format!(
                    "it does not prepare against this database: {}",
                    sqlite_message(&e)
                )));
            }
        };
        Ok(Ok(StatementShape {
            read_only: stmt.readonly(),
            returns_rows: stmt.column_count() > 0,
            parameters: (1..=stmt.parameter_count())
                .map(|i| stmt.parameter_name(i).map(str::to_owned))
                .collect(),
        }))
    }

    fn run_statement(&self, sql: &str, delivery: i64, now: i64) -> Result<()> {
        let values: Vec<Value> =
            self.prepare_cached(FINALIZE_VALUES_SQL)?
                .query_row(params![delivery, now], |r| {
                    (0..FINALIZE_PARAMETERS.len())
                        .map(|i| r.get::<_, Value>(i))
                        .collect()
                })?;
        // The application's text, not the crate's: through the connection's own cache.
        let mut stmt = Connection::prepare_cached(self, sql)?;
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

    fn refusal(&self, error: Error) -> Result<String> {
        refusal(error)
    }

    fn mark_finalized(&self, delivery: i64, now: i64) -> Result<()> {
        self.debug_not_dead(Table::Deliveries, delivery)?;
        self.prepare_cached(crate::store::mark_finalized_sql!(sqlite_param))?
            .execute(params![delivery, now])?;
        Ok(())
    }

    fn mark_unfinalized(&self, delivery: i64, now: i64, message: &str) -> Result<()> {
        self.counting(delivery, || {
            self.prepare_cached(crate::store::mark_unfinalized_sql!(sqlite_param))?
                .execute(params![delivery, now, message])?;
            Ok(())
        })
    }

    fn add_channel_stats(&self, t: &ChannelTally<'_>) -> Result<()> {
        let le = &t.latency_le;
        self.prepare_cached(
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
            t.channel,
            t.latest,
            t.count,
            t.latency_sum_ms,
            le[0],
            le[1],
            le[2],
            le[3],
            le[4],
            le[5],
        ])?;
        Ok(())
    }

    fn add_activity(&self, m: &ActivityRow) -> Result<()> {
        self.prepare_cached(
            "INSERT INTO outbound_activity
                 (minute, delivered, failed, latency_sum_ms, latency_max_ms)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (minute) DO UPDATE
             SET delivered = delivered + ?2, failed = failed + ?3,
                 latency_sum_ms = latency_sum_ms + ?4,
                 latency_max_ms = max(latency_max_ms, ?5)",
        )?
        .execute(params![
            m.bucket,
            m.delivered,
            m.failed,
            m.latency_sum_ms,
            m.latency_max_ms
        ])?;
        Ok(())
    }

    fn finished_unfinalized(&self) -> Result<Vec<(DeliveryLane, i64)>> {
        let mut stmt = self.prepare_cached(SWEEP_SQL)?;
        let rows = stmt.query_map([], |r| {
            Ok((
                DeliveryLane {
                    id: r.get(0)?,
                    channel: r.get(1)?,
                    chat_id: r.get(2)?,
                },
                r.get(3)?,
            ))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn created_at(&self, delivery: i64) -> Result<i64> {
        Ok(self
            .prepare_cached("SELECT created_at FROM outbound_deliveries WHERE id = ?1")?
            .query_row([delivery], |r| r.get(0))?)
    }
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
            Ok(sqlite_message(&inner))
        }
        other => Err(other),
    }
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

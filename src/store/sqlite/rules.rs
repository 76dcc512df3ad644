//! The stored rules on SQLite (`outbound_policy`, `outbound_channels`), the lock
//! primitives (no-ops under the single writer), and [`StoreTx`] for [`Tx`].

use std::collections::HashMap;

use rusqlite::{OptionalExtension, params};

use super::schema;
use super::tx::Tx;
use crate::error::Result;
use crate::rules::{ChannelPolicy, FileColumns, FileRules, Rules, Stored};
use crate::store::{ChannelRow, DeliveryStore, LaneEntry, LaneRef, Locks, RuleStore, StoreTx};

/// Every write transaction is `BEGIN IMMEDIATE`: it holds the database's one write lock
/// from its first statement to its end, so it holds every lane, slot, key and the rules
/// already, and no other writer runs beside it.
impl Locks for Tx<'_> {
    fn lock_rules(&self, _exclusive: bool) -> Result<()> {
        Ok(())
    }

    fn lock_lanes(&self, _lanes: &mut [LaneRef<'_>]) -> Result<()> {
        Ok(())
    }

    fn try_lock_lane(&self, _lane: LaneRef<'_>) -> Result<bool> {
        Ok(true)
    }

    fn lock_key(&self, _channel: &str, _key: &str) -> Result<()> {
        Ok(())
    }

    fn lock_channel_slot(&self, row: ChannelRow) -> Result<Option<ChannelRow>> {
        Ok(Some(row))
    }
}

impl StoreTx for Tx<'_> {
    fn begin_nested(&self) -> Result<()> {
        self.prepare_cached("SAVEPOINT chunked_outbox_nested")?
            .execute([])?;
        Ok(())
    }

    fn end_nested(&self, keep: bool) -> Result<()> {
        if !keep {
            self.prepare_cached("ROLLBACK TO chunked_outbox_nested")?
                .execute([])?;
        }
        self.prepare_cached("RELEASE chunked_outbox_nested")?
            .execute([])?;
        Ok(())
    }

    fn in_transaction(&self) -> bool {
        !self.is_autocommit()
    }

    fn enter_lanes(
        &self,
        lanes: &[LaneRef<'_>],
        rows: usize,
    ) -> Result<(Vec<LaneEntry>, Vec<i64>)> {
        let sql = if crate::sabotage::planted("out_of_order") {
            super::lanes::ENTER_SQL_NEWEST_FIRST
        } else {
            super::lanes::ENTER_SQL
        };
        let mut stmt = self.prepare_cached(sql)?;
        let mut first = None;
        let mut entries = Vec::with_capacity(lanes.len());
        for lane in lanes {
            let (next, entry) =
                stmt.query_row(params![lane.channel, lane.chat_id, i64::MIN], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        LaneEntry {
                            // (SQLite has no staged replies.)
                            staged_before: false,
                            free_at: r.get(1)?,
                            head: super::lanes::head_row(r, 2)?,
                        },
                    ))
                })?;
            first.get_or_insert(next);
            entries.push(entry);
        }
        let first = match first {
            Some(first) => first,
            None => self.next_delivery_row()?,
        };
        Ok((entries, (first..).take(rows).collect()))
    }

    fn note_dead_letter(&self, delivery: i64, error: &str) {
        Tx::note_dead_letter(self, delivery, error);
    }

    fn take_dead_letters(&self) -> Vec<(i64, String)> {
        Tx::take_dead_letters(self)
    }

    #[cfg(test)]
    fn table_rows(&self) -> Result<Vec<String>> {
        const TABLES: &[&str] = &[
            "SELECT 'deliveries', * FROM outbound_deliveries",
            "SELECT 'chunks', * FROM outbound_delivery_chunks",
            "SELECT 'messages', row_number() OVER (ORDER BY id), delivery_id, channel, chat_id,
                    sender, content, chunk_count, created_at, delivered_at
             FROM outbound_messages",
            "SELECT 'stats', * FROM outbound_channel_stats",
            "SELECT 'policy', * FROM outbound_policy",
            "SELECT 'channels', * FROM outbound_channels",
            "SELECT 'lanes', * FROM outbound_lanes",
        ];
        let mut rows = Vec::new();
        for sql in TABLES {
            let mut statement = self.prepare(sql)?;
            let width = statement.column_count();
            let mut found = statement.query([])?;
            while let Some(row) = found.next()? {
                let values = (0..width)
                    .map(|i| Ok(format!("{:?}", row.get_ref(i)?)))
                    .collect::<Result<Vec<_>>>()?;
                rows.push(values.join(" "));
            }
        }
        rows.sort();
        Ok(rows)
    }
}

impl RuleStore for Tx<'_> {
    fn rules_version(&self) -> Result<i64> {
        // Read once per transaction, first: through the connection's own cache, so the
        // statement is not one more that the `Tx` keeps for the rest of the work. With
        // it, which builds the schema still accepts: a newer build's contract step
        // stops this one before it writes anything more.
        let (version, writable_from): (i64, i64) = rusqlite::Connection::prepare_cached(
            self,
            "SELECT version, writable_from FROM outbound_policy WHERE id = 1",
        )?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        if writable_from > schema::SCHEMA_VERSION {
            let found: i64 = self.query_row("PRAGMA user_version", [], |r| r.get(0))?;
            let migrated_by: String =
                self.query_row("SELECT migrated_by FROM outbound_meta", [], |r| r.get(0))?;
            return Err(schema::too_new(found, writable_from, &migrated_by));
        }
        Ok(version)
    }

    fn load_rules(&self) -> Result<Stored> {
        type Row = (
            i64,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<i64>,
            Option<i64>,
            Option<String>,
        );
        let (version, lane_order, lane_failure, retry, replay, lane_ms, channel_us, finalize_sql): Row =
            self.prepare_cached(
                "SELECT version, lane_order, lane_failure, retry, replay, lane_interval_ms,
                        channel_interval_us, finalize_sql
                 FROM outbound_policy WHERE id = 1",
            )?
            .query_row([], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                ))
            })?;
        let (mut rules, declared) = FileColumns {
            lane_order: lane_order.as_deref(),
            lane_failure: lane_failure.as_deref(),
            retry: retry.as_deref(),
            replay: replay.as_deref(),
            lane_ms,
            channel_us,
        }
        .policy()?;
        let mut channel_ids = HashMap::new();
        let mut stmt = self.prepare_cached(
            "SELECT id, name, replay, lane_interval_ms, channel_interval_us, retry
             FROM outbound_channels",
        )?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            let name: String = r.get(1)?;
            channel_ids.insert(name.clone(), r.get(0)?);
            if let Some(replay) = r.get::<_, Option<String>>(2)? {
                let retry = r.get::<_, Option<String>>(5)?;
                let rules_of = crate::rules::channel_from_columns(
                    &replay,
                    r.get(3)?,
                    r.get(4)?,
                    retry.as_deref(),
                )?;
                rules.channels.insert(name, rules_of);
            }
        }
        Ok(Stored {
            version,
            policy: rules,
            finalize_sql,
            declared,
            channel_ids,
        })
    }

    fn store_file_rules(&self, rules: &Rules, which: FileRules) -> Result<()> {
        let d = &rules.default_channel;
        self.prepare_cached(
            "UPDATE outbound_policy
             SET version = version + 1,
                 lane_order = CASE WHEN ?1 THEN ?2 ELSE lane_order END,
                 lane_failure = CASE WHEN ?3 THEN ?4 ELSE lane_failure END,
                 retry = CASE WHEN ?5 THEN ?6 ELSE retry END,
                 replay = CASE WHEN ?7 THEN ?8 ELSE replay END,
                 lane_interval_ms = CASE WHEN ?7 THEN ?9 ELSE lane_interval_ms END,
                 channel_interval_us = CASE WHEN ?7 THEN ?10 ELSE channel_interval_us END
             WHERE id = 1",
        )?
        .execute(params![
            which.lane_order,
            crate::rules::lane_order_str(rules.lane_order),
            which.lane_failure,
            crate::rules::lane_failure_str(rules.lane_failure),
            which.retry,
            crate::rules::retry_to_json(&rules.retry),
            which.default_channel,
            crate::rules::replay_str(d.replay),
            crate::rules::stored_ms(d.lane_interval),
            crate::rules::stored_us(d.channel_interval),
        ])?;
        Ok(())
    }

    fn store_channel_rules(&self, channel: &str, rules: Option<&ChannelPolicy>) -> Result<()> {
        self.prepare_cached(
            "INSERT INTO outbound_channels (name, replay, lane_interval_ms, channel_interval_us, retry)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (name) DO UPDATE SET replay = excluded.replay,
                 lane_interval_ms = excluded.lane_interval_ms,
                 channel_interval_us = excluded.channel_interval_us, retry = excluded.retry",
        )?
        .execute(params![
            channel,
            rules.map(|r| crate::rules::replay_str(r.replay)),
            rules.map(|r| crate::rules::stored_ms(r.lane_interval)),
            rules.map(|r| crate::rules::stored_us(r.channel_interval)),
            rules.and_then(|r| r.retry.as_ref()).map(crate::rules::retry_to_json),
        ])?;
        bump(self)
    }

    fn channel_number(&self, channel: &str) -> Result<i64> {
        let existing: Option<i64> = self
            .prepare_cached("SELECT id FROM outbound_channels WHERE name = ?1")?
            .query_row([channel], |r| r.get(0))
            .optional()?;
        if let Some(id) = existing {
            return Ok(id);
        }
        self.prepare_cached("INSERT INTO outbound_channels (name) VALUES (?1)")?
            .execute([channel])?;
        let id = self.last_insert_rowid();
        // Other handles learn the new channel's number at their next write.
        bump(self)?;
        Ok(id)
    }

    fn finalization_statement(&self) -> Result<Option<String>> {
        Ok(self
            .prepare_cached("SELECT finalize_sql FROM outbound_policy WHERE id = 1")?
            .query_row([], |r| r.get(0))?)
    }

    fn store_finalization_statement(&self, sql: Option<&str>) -> Result<()> {
        self.prepare_cached(
            "UPDATE outbound_policy SET version = version + 1, finalize_sql = ?1 WHERE id = 1",
        )?
        .execute([sql])?;
        Ok(())
    }

    fn writable_from(&self) -> Result<i64> {
        Ok(self
            .prepare_cached("SELECT writable_from FROM outbound_policy WHERE id = 1")?
            .query_row([], |r| r.get(0))?)
    }

    fn set_writable_from(&self, writable_from: i64, migrated_by: &str) -> Result<()> {
        self.prepare_cached("UPDATE outbound_policy SET writable_from = ?1 WHERE id = 1")?
            .execute([writable_from])?;
        self.prepare_cached("UPDATE outbound_meta SET migrated_by = ?1")?
            .execute([migrated_by])?;
        Ok(())
    }
}

fn bump(tx: &Tx<'_>) -> Result<()> {
    tx.prepare_cached("UPDATE outbound_policy SET version = version + 1 WHERE id = 1")?
        .execute([])?;
    Ok(())
}

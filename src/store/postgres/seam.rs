//! The primitives of the seam that are the transaction's own ([`StoreTx`]): nested
//! transactions, entering lanes, finalizing delivered replies in one statement, and the
//! dead letters the transaction made.

use std::time::Duration;

use super::pipeline::owned;
use super::tx::{PgTx, chunk_key};
use super::{deliveries, lanes};
use crate::error::{Error, Result};
use crate::store::{LaneEntry, LaneRef, StoreTx};

impl StoreTx for PgTx<'_> {
    fn begin_nested(&self) -> Result<()> {
        self.activity_mark.set(self.activity.borrow().len());
        self.batch("SAVEPOINT chunked_outbox_nested")
    }

    fn end_nested(&self, keep: bool) -> Result<()> {
        if keep {
            self.batch("RELEASE SAVEPOINT chunked_outbox_nested")
        } else {
            // The row locks taken since are released: a lane noted as held may not be.
            self.held_lanes.borrow_mut().clear();
            self.activity
                .borrow_mut()
                .truncate(self.activity_mark.get());
            self.batch(
                "ROLLBACK TO SAVEPOINT chunked_outbox_nested;
                 RELEASE SAVEPOINT chunked_outbox_nested",
            )
        }
    }

    fn in_transaction(&self) -> bool {
        // An error inside a transaction leaves it to be rolled back, never ended.
        self.open.get()
    }

    fn enter_lanes(
        &self,
        lanes: &[LaneRef<'_>],
        rows: usize,
    ) -> Result<(Vec<LaneEntry>, Vec<i64>)> {
        let sql = if crate::sabotage::planted("out_of_order") {
            lanes::ENTER_SQL_NEWEST_FIRST
        } else {
            lanes::ENTER_SQL
        };
        let channels: Vec<&str> = lanes.iter().map(|l| l.channel).collect();
        let chats: Vec<&str> = lanes.iter().map(|l| l.chat_id).collect();
        let mut drawn = Vec::new();
        let mut entries: Vec<Option<LaneEntry>> = lanes.iter().map(|_| None).collect();
        for r in self.query(sql, &[&channels, &chats, &(rows as i64)])? {
            if let Some(rows) = r.try_get::<_, Option<Vec<i64>>>(1)? {
                drawn = rows;
            }
            let entry = LaneEntry {
                staged_before: r.try_get(2)?,
                free_at: r.try_get(3)?,
                head: match r.try_get::<_, Option<bool>>(4)? {
                    Some(_) => Some(lanes::head_row(&r, 4)?),
                    None => None,
                },
            };
            let n: i64 = r.try_get(0)?;
            if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| entries.get_mut(i)) {
                *slot = Some(entry);
            }
        }
        let entries = entries
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::invalid("lanes", "a lane read no row"))?;
        if drawn.len() != rows {
            return Err(Error::invalid("rows", "the sequence drew too few rows"));
        }
        if crate::sabotage::planted("no_lane_locks") {
            // The window the lane's lock closes (its head read, the new head not yet
            // committed) held open as on a slow machine, so that the hammer meets the
            // planted race in every run rather than in some.
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok((entries, drawn))
    }

    fn finalize_delivered(
        &self,
        chunks: &[(i64, i64, Option<&str>)],
        tallies: &[crate::store::ChannelTally<'_>],
        now: i64,
    ) -> Result<usize> {
        if chunks.is_empty() && tallies.is_empty() {
            return Ok(0);
        }
        let (deliveries, indexes): (Vec<i64>, Vec<i64>) =
            chunks.iter().map(|(id, ..)| chunk_key(*id)).unzip();
        let ids: Vec<Option<String>> = chunks
            .iter()
            .map(|(.., id)| id.map(str::to_owned))
            .collect();
        let channels: Vec<String> = tallies.iter().map(|t| t.channel.to_owned()).collect();
        let column = |f: fn(&crate::store::ChannelTally<'_>) -> i64| {
            owned(tallies.iter().map(f).collect::<Vec<i64>>())
        };
        let bucket = |i: usize| {
            owned(
                tallies
                    .iter()
                    .map(|t| t.latency_le[i])
                    .collect::<Vec<i64>>(),
            )
        };
        // Kept back: the statement itself fails unless it copied every delivery (the
        // rules' check of its count), and the transaction with it.
        self.defer_checked(
            deliveries::FINALIZE_DELIVERED_SQL,
            vec![
                owned(deliveries),
                owned(indexes),
                owned(ids),
                owned(now),
                owned(channels),
                column(|t| t.latest),
                column(|t| t.count),
                column(|t| t.latency_sum_ms),
                bucket(0),
                bucket(1),
                bucket(2),
                bucket(3),
                bucket(4),
                bucket(5),
            ],
            Some(1),
            Some(|| Error::invalid("delivery", "a delivery to finalize is not stored")),
        )?;
        Ok(chunks.len())
    }

    fn note_dead_letter(&self, delivery: i64, error: &str) {
        self.dead_letters
            .borrow_mut()
            .push((delivery, error.to_owned()));
    }

    fn take_dead_letters(&self) -> Vec<(i64, String)> {
        std::mem::take(&mut self.dead_letters.borrow_mut())
    }

    #[cfg(test)]
    fn table_rows(&self) -> Result<Vec<String>> {
        const TABLES: &[&str] = &[
            "SELECT 'deliveries ' || t::text FROM outbound_deliveries t",
            "SELECT 'chunks ' || t::text FROM outbound_delivery_chunks t",
            // Its identity column counts on past an undone insert: its order stands in.
            "SELECT 'messages ' || row_number() OVER (ORDER BY id) || ' '
                    || (delivery_id, channel, chat_id, sender, content, chunk_count,
                        created_at, delivered_at)::text
             FROM outbound_messages",
            "SELECT 'stats ' || t::text FROM outbound_channel_stats t",
            "SELECT 'policy ' || t::text FROM outbound_policy t",
            "SELECT 'channels ' || t::text FROM outbound_channels t",
            "SELECT 'lanes ' || t::text FROM outbound_lanes t",
            "SELECT 'renumbered ' || t::text FROM outbound_renumbered t",
        ];
        let mut rows = Vec::new();
        for sql in TABLES {
            for r in self.query(sql, &[])? {
                rows.push(r.try_get(0)?);
            }
        }
        rows.sort();
        Ok(rows)
    }

    #[cfg(test)]
    fn stage(&self, d: &crate::reply::NewDelivery, now: i64) -> Result<Option<String>> {
        let call = crate::store::postgres::application::Call {
            delivery: d,
            now,
            uid_high: 0,
            uid_spare: 0,
        };
        let r = self.query_one(
            "SELECT uid FROM outbound_enqueue($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            &call.params(),
        )?;
        Ok(Some(r.try_get(0)?))
    }
}

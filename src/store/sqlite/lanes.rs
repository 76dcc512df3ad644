//! Lanes on SQLite: the head of a lane is one seek of the index of unfinished
//! deliveries; due times are computed in the statement that writes them.

use crate::store::sqlite_param;
use rusqlite::{OptionalExtension, params};

use super::dead::Table;
use super::tx::Tx;
use crate::error::Result;
use crate::ids::CHUNK_STRIDE;
use crate::store::{Activation, DeliveryLane, HeadRow, LaneRef, LaneStore, Waiting};

/// The due time of `LaneStore::lane_due_time` as an SQL expression of its parameters:
/// `earliest`, or the end of lane (`channel`, `chat`)'s pause or interval if later.
macro_rules! lane_due {
    ($earliest:literal, $channel:literal, $chat:literal) => {
        concat!(
            "coalesce((SELECT max(",
            $earliest,
            ", coalesce(paused_until, ",
            $earliest,
            "), coalesce(next_send_at, ",
            $earliest,
            ")) FROM outbound_lanes WHERE channel = ",
            $channel,
            " AND chat_id = ",
            $chat,
            "), ",
            $earliest,
            ")"
        )
    };
}

/// The lane head's statement, reading `$columns` of it, its queued deliveries in the
/// order `$order` of their ids.
macro_rules! head_sql {
    ($columns:expr, $order:literal) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM outbound_deliveries
             WHERE channel = ?1 AND chat_id = ?2 AND status >= 'partial' AND status <= 'queued'
               AND status <> 'delivered' AND status <> 'failed'
             ORDER BY status, ",
            $order,
            " LIMIT 1"
        )
    };
}

/// The columns of the head [`HEAD_SQL`] reads: whether it is queued, and for a queued
/// one what its activation needs.
macro_rules! head_columns {
    () => {
        "status = 'queued', id,
         CASE WHEN status = 'queued' THEN delivered_count END,
         CASE WHEN status = 'queued' THEN not_before END"
    };
}

/// The first of lane (`?1`, `?2`)'s deliveries that are active (`partial`, `pending`)
/// or `queued`, in that order, then oldest first: one seek on the index of unfinished
/// deliveries, whatever the length of the queue. Those three statuses are next to each
/// other in the index, and no other status the schema allows sorts between them
/// (`cancelled` < `delivered` < `failed` < `partial` < `pending` < `queued` <
/// `uncertain` < `unfinalized`), so an active delivery, if any, comes before every queued one. For a
/// queued one it also gives what activation needs from its row; SQLite reads the row
/// itself only then (a deferred seek), so a busy lane costs the index seek alone.
///
/// The lane position of a delivery is its row id: chosen as one past the largest under
/// the writer's lock (`DeliveryStore::next_delivery_row`), so in commit order.
pub(crate) const HEAD_SQL: &str = head_sql!(head_columns!(), "id");

/// [`HEAD_SQL`] with the newest queued reply first: the planted fault `out_of_order`.
const HEAD_SQL_NEWEST_FIRST: &str = head_sql!(head_columns!(), "id DESC");

/// Lane (`?1`, `?2`) as an enqueue enters it, in one statement: the next delivery row
/// (`DeliveryStore::next_delivery_row`), the end of the lane's pause or interval
/// (`LaneStore::lane_due_time` of `?3`, the earliest time there is), and its head as
/// [`HEAD_SQL`] reads it (NULLs for none). The head's id and whether it is queued come
/// from the index alone, as one number (`id * 2 + queued`); its row is read only for a
/// queued head, whose activation needs it. (Two lookups of that row, one per column,
/// cost a queued head a second seek; a `LEFT JOIN` on it would cost every enqueue a
/// cursor, 270 instructions more an enqueue under callgrind.)
macro_rules! enter_sql {
    ($order:literal) => {
        concat!(
            "SELECT (SELECT coalesce(max(id), 0) + 1 FROM outbound_deliveries), ",
            lane_due!("?3", "?1", "?2"),
            ", h % 2 = 1, h / 2,
             CASE WHEN h % 2 = 1 THEN (SELECT delivered_count FROM outbound_deliveries WHERE id = h / 2) END,
             CASE WHEN h % 2 = 1 THEN (SELECT not_before FROM outbound_deliveries WHERE id = h / 2) END
             FROM (SELECT (",
            head_sql!("id * 2 + (status = 'queued')", $order),
            ") AS h)"
        )
    };
}

/// [`enter_sql!`] as a lane is entered.
pub(crate) const ENTER_SQL: &str = enter_sql!("id");

/// [`ENTER_SQL`] with the newest queued reply first: the planted fault `out_of_order`.
pub(crate) const ENTER_SQL_NEWEST_FIRST: &str = enter_sql!("id DESC");

/// A head as [`HEAD_SQL`] reads it, from column `at` on: queued (with what its
/// activation needs) or active; `None` where the columns are NULL (no head).
pub(crate) fn head_row(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<Option<HeadRow>> {
    let Some(queued) = r.get::<_, Option<bool>>(at)? else {
        return Ok(None);
    };
    if !queued {
        return Ok(Some(HeadRow::Active));
    }
    let id = r.get(at + 1)?;
    Ok(Some(HeadRow::Queued(Waiting {
        id,
        position: id,
        head_index: r.get(at + 2)?,
        not_before: r.get(at + 3)?,
    })))
}

/// The oldest delivery holding lane (`?1`, `?2`): under `LaneFailurePolicy::Block`
/// (`?3`) an uncertain one or a dead letter nobody acknowledged; otherwise an
/// uncertain one whose platform was not asked yet.
pub(crate) const HELD_SQL: &str = crate::store::held_sql!(
    "?1",
    "?2",
    "?3",
    concat!(
        "c.id = d.id * ",
        crate::store::chunk_stride!(),
        " + d.delivered_count"
    )
);

/// Pushes the lane's due chunks back to `?3`. Only head chunks are ever due: chunk
/// `delivered_count` of an unfinished delivery, whose id is
/// `id * CHUNK_STRIDE + delivered_count`, so this is one key lookup per unfinished
/// delivery of the lane.
pub(crate) const PAUSE_DUE_SQL: &str = concat!(
    "UPDATE outbound_delivery_chunks SET due_at = ?3
     WHERE due_at < ?3 AND status IN ('pending', 'retry') AND id IN (
         SELECT id * ",
    crate::store::chunk_stride!(),
    " + delivered_count FROM outbound_deliveries
         WHERE channel = ?1 AND chat_id = ?2 AND status <> 'delivered' AND status <> 'failed')"
);

/// Queued deliveries, oldest first, with their lanes.
pub(crate) const QUEUED_ALL_SQL: &str = "SELECT id, channel, chat_id FROM outbound_deliveries
     WHERE status = 'queued' AND status <> 'delivered' AND status <> 'failed' ORDER BY id";

impl LaneStore for Tx<'_> {
    fn waiting(&self, delivery: i64) -> Result<Waiting> {
        Ok(self
            .prepare_cached(
                "SELECT delivered_count, not_before FROM outbound_deliveries WHERE id = ?1",
            )?
            .query_row([delivery], |r| {
                Ok(Waiting {
                    id: delivery,
                    position: delivery,
                    head_index: r.get(0)?,
                    not_before: r.get(1)?,
                })
            })?)
    }

    fn lane_head(&self, lane: LaneRef<'_>) -> Result<Option<HeadRow>> {
        let sql = if crate::sabotage::planted("out_of_order") {
            HEAD_SQL_NEWEST_FIRST
        } else {
            HEAD_SQL
        };
        Ok(self
            .prepare_cached(sql)?
            .query_row(params![lane.channel, lane.chat_id], |r| head_row(r, 0))
            .optional()?
            .flatten())
    }

    fn lane_held(&self, lane: LaneRef<'_>, block: bool) -> Result<Option<i64>> {
        Ok(self
            .prepare_cached(HELD_SQL)?
            .query_row(params![lane.channel, lane.chat_id, block], |r| r.get(0))?)
    }

    fn activate(&self, head: &Activation<'_>) -> Result<()> {
        let Activation {
            waiting,
            status,
            lane,
            earliest,
        } = head;
        self.debug_not_dead(Table::Deliveries, waiting.id)?;
        self.prepare_cached("UPDATE outbound_deliveries SET status = ?2 WHERE id = ?1")?
            .execute(params![waiting.id, status.as_str()])?;
        // The head chunk has a row, whose due time is set, except at the first
        // activation of a reply sent as one chunk of its whole text: that row is
        // stored now.
        self.prepare_cached(concat!(
            "INSERT INTO outbound_delivery_chunks (id, delivery_id, chunk_index, status, due_at, channel_id)
             VALUES (?1, ?5, ?6, 'pending', ",
            lane_due!("?2", "?3", "?4"),
            ", (SELECT id FROM outbound_channels WHERE name = ?3))
             ON CONFLICT (id) DO UPDATE SET due_at = excluded.due_at"
        ))?
        .execute(params![
            waiting.id * CHUNK_STRIDE + waiting.head_index,
            earliest,
            lane.channel,
            lane.chat_id,
            waiting.id,
            waiting.head_index
        ])?;
        Ok(())
    }

    fn make_due(&self, delivery: i64, index: i64, lane: LaneRef<'_>, earliest: i64) -> Result<()> {
        // The lane's due time and the write in one statement.
        self.prepare_cached(concat!(
            "UPDATE outbound_delivery_chunks SET due_at = ",
            lane_due!("?2", "?3", "?4"),
            " WHERE id = ?1"
        ))?
        .execute(params![
            delivery * CHUNK_STRIDE + index,
            earliest,
            lane.channel,
            lane.chat_id
        ])?;
        Ok(())
    }

    fn lane_due_time(&self, lane: LaneRef<'_>, earliest: i64) -> Result<i64> {
        Ok(self
            .prepare_cached(concat!("SELECT ", lane_due!("?3", "?1", "?2")))?
            .query_row(params![lane.channel, lane.chat_id, earliest], |r| r.get(0))?)
    }

    fn note_lane_send(&self, lane: LaneRef<'_>, next_at: i64) -> Result<()> {
        self.prepare_cached(
            "INSERT INTO outbound_lanes (channel, chat_id, next_send_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (channel, chat_id) DO UPDATE
             SET next_send_at = max(coalesce(next_send_at, ?3), ?3)",
        )?
        .execute(params![lane.channel, lane.chat_id, next_at])?;
        Ok(())
    }

    fn pause_lane(&self, lane: LaneRef<'_>, until: i64) -> Result<i64> {
        let paused_until: i64 = self
            .prepare_cached(
                "INSERT INTO outbound_lanes (channel, chat_id, paused_until) VALUES (?1, ?2, ?3)
                 ON CONFLICT (channel, chat_id) DO UPDATE
                 SET paused_until = max(coalesce(paused_until, ?3), ?3)
                 RETURNING paused_until",
            )?
            .query_row(params![lane.channel, lane.chat_id, until], |r| r.get(0))?;
        self.prepare_cached(PAUSE_DUE_SQL)?.execute(params![
            lane.channel,
            lane.chat_id,
            paused_until
        ])?;
        Ok(paused_until)
    }

    fn pause_channel(&self, channel: &str, until: i64) -> Result<()> {
        self.prepare_cached(
            "UPDATE outbound_channels
             SET paused_until = max(coalesce(paused_until, ?2), ?2) WHERE name = ?1",
        )?
        .execute(params![channel, until])?;
        Ok(())
    }

    fn set_queued(&self, delivery: i64) -> Result<()> {
        self.counting(delivery, || {
            self.prepare_cached(crate::store::set_queued_sql!(sqlite_param))?
                .execute([delivery])?;
            Ok(())
        })
    }

    fn queued_deliveries(&self) -> Result<Vec<DeliveryLane>> {
        let mut stmt = self.prepare_cached(QUEUED_ALL_SQL)?;
        let rows = stmt.query_map([], |r| {
            Ok(DeliveryLane {
                id: r.get(0)?,
                channel: r.get(1)?,
                chat_id: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}

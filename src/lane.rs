//! Lanes: which delivery of a chat may send next, and when.
//!
//! A chunk becomes claimable by getting a `due_at`. Only this module (and the outcome
//! code that moves a chunk's own `due_at`) hands one out, so the ordering rules live in
//! one place:
//!
//! * the head chunk of a delivery is the one at `chunk_index = delivered_count`; later
//!   chunks have no `due_at` until the one before them is delivered;
//! * with [`LaneOrder::Fifo`] a lane `(channel, chat_id)` has at most one active
//!   delivery (`pending`/`partial`); the others are `queued` and wait for
//!   [`advance`] to activate the oldest one;
//! * a lane paused by a rate limit hands out nothing due before the pause ends, nor
//!   anything before its channel's lane interval has passed since its last send
//!   started, whoever sent it (`outbound_lanes`).

use rusqlite::{OptionalExtension, params};

use crate::clock::duration_ms;
use crate::ids::CHUNK_STRIDE;
use crate::policy::Stored;
use crate::tx::Tx;
use crate::{LaneFailurePolicy, LaneOrder, Policy, Result};

/// Where a lane stands for scheduling purposes.
pub(crate) enum LaneHead {
    /// A delivery is active, or a failed/uncertain head blocks the lane.
    Busy,
    /// Nothing is active; this queued delivery should go next.
    Next(Waiting),
    /// Nothing active and nothing queued.
    Idle,
}

/// A delivery to make active: its row id, the index of its head chunk (chunks before
/// it were delivered before it was set aside), and the time it may start, if delayed.
pub(crate) struct Waiting {
    pub id: i64,
    head_index: i64,
    not_before: Option<i64>,
}

impl Waiting {
    /// Reads delivery `id` as [`activate`] needs it.
    pub(crate) fn load(tx: &Tx<'_>, id: i64) -> Result<Waiting> {
        Ok(tx
            .prepare_cached(
                "SELECT delivered_count, not_before FROM outbound_deliveries WHERE id = ?1",
            )?
            .query_row([id], |r| {
                Ok(Waiting {
                    id,
                    head_index: r.get(0)?,
                    not_before: r.get(1)?,
                })
            })?)
    }
}

/// The due time of [`due_time`] as an SQL expression of its parameters: `earliest`, or
/// the end of lane (`channel`, `chat`)'s pause or interval if later.
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

/// The lane head's statement, its queued deliveries in the order `$order` of their ids.
macro_rules! head_sql {
    ($order:literal) => {
        concat!(
            "SELECT status = 'queued', id,
                    CASE WHEN status = 'queued' THEN delivered_count END,
                    CASE WHEN status = 'queued' THEN not_before END
             FROM outbound_deliveries
             WHERE channel = ?1 AND chat_id = ?2 AND status >= 'partial' AND status <= 'queued'
               AND status <> 'delivered'
             ORDER BY status, ",
            $order,
            " LIMIT 1"
        )
    };
}

/// The first of lane (`?1`, `?2`)'s deliveries that are active (`partial`, `pending`)
/// or `queued`, in that order, then oldest first: one seek on the index of unfinished
/// deliveries, whatever the length of the queue. Those three statuses are next to each
/// other in the index, and no other status the schema allows sorts between them
/// (`cancelled` < `delivered` < `failed` < `partial` < `pending` < `queued` <
/// `uncertain` < `unfinalized`), so an active delivery, if any, comes before every queued one. For a
/// queued one it also gives what [`activate`] needs from its row; SQLite reads the row
/// itself only then (a deferred seek), so a busy lane costs the index seek alone.
pub(crate) const HEAD_SQL: &str = head_sql!("id");

/// [`HEAD_SQL`] with the newest queued reply first: the planted fault `out_of_order`.
const HEAD_SQL_NEWEST_FIRST: &str = head_sql!("id DESC");

/// The oldest delivery holding lane (`?1`, `?2`) under [`LaneFailurePolicy::Block`]:
/// an uncertain one, or a dead letter nobody acknowledged.
pub(crate) const HELD_SQL: &str = "SELECT min(id) FROM outbound_deliveries
     WHERE channel = ?1 AND chat_id = ?2 AND status <> 'delivered'
       AND (status = 'uncertain' OR (status = 'failed' AND acknowledged_at IS NULL))";

/// Decides who may send next in a lane, reading only its unfinished deliveries.
pub(crate) fn head(tx: &Tx<'_>, rules: &Policy, channel: &str, chat_id: &str) -> Result<LaneHead> {
    // `None`: nothing active or queued; `Some(None)`: a delivery is active.
    let sql = if crate::sabotage::planted("out_of_order") {
        HEAD_SQL_NEWEST_FIRST
    } else {
        HEAD_SQL
    };
    let first: Option<Option<Waiting>> = tx
        .prepare_cached(sql)?
        .query_row(params![channel, chat_id], |r| {
            let queued: bool = r.get(0)?;
            queued
                .then(|| {
                    Ok(Waiting {
                        id: r.get(1)?,
                        head_index: r.get(2)?,
                        not_before: r.get(3)?,
                    })
                })
                .transpose()
        })
        .optional()?;
    let next = match first {
        Some(None) => return Ok(LaneHead::Busy),
        Some(queued) => queued,
        None => None,
    };
    if rules.lane_failure == LaneFailurePolicy::Block {
        let held: Option<i64> = tx
            .prepare_cached(HELD_SQL)?
            .query_row(params![channel, chat_id], |r| r.get(0))?;
        if held.is_some_and(|h| next.as_ref().is_none_or(|n| h < n.id)) {
            return Ok(LaneHead::Busy);
        }
    }
    Ok(next.map_or(LaneHead::Idle, LaneHead::Next))
}

/// Activates the next queued delivery of a FIFO lane if the lane is free, making its
/// head chunk due no earlier than `earliest`. Does nothing for parallel lanes, whose
/// deliveries are active from the start.
pub(crate) fn advance(
    tx: &Tx<'_>,
    rules: &Policy,
    channel: &str,
    chat_id: &str,
    earliest: i64,
) -> Result<()> {
    if rules.lane_order == LaneOrder::Parallel {
        return Ok(());
    }
    if let LaneHead::Next(waiting) = head(tx, rules, channel, chat_id)? {
        activate(tx, &waiting, channel, chat_id, earliest)?;
    }
    Ok(())
}

/// Marks a delivery active and makes its head chunk due.
pub(crate) fn activate(
    tx: &Tx<'_>,
    waiting: &Waiting,
    channel: &str,
    chat_id: &str,
    earliest: i64,
) -> Result<()> {
    let &Waiting {
        id: delivery,
        head_index,
        not_before,
    } = waiting;
    tx.prepare_cached(
        "UPDATE outbound_deliveries SET status = CASE WHEN ?2 > 0 THEN 'partial' ELSE 'pending' END
         WHERE id = ?1",
    )?
    .execute(params![delivery, head_index])?;
    // A delayed reply starts no earlier than asked; once started, it goes on as usual.
    let earliest = match not_before {
        Some(at) if head_index == 0 => earliest.max(at),
        _ => earliest,
    };
    // The head chunk has a row, whose due time is set, except at the first activation
    // of a reply sent as one chunk of its whole text: that row is stored now (see
    // `enqueue::stored_at_activation`).
    tx.prepare_cached(concat!(
        "INSERT INTO outbound_delivery_chunks (id, delivery_id, chunk_index, status, due_at, channel_id)
         VALUES (?1, ?5, ?6, 'pending', ",
        lane_due!("?2", "?3", "?4"),
        ", (SELECT id FROM outbound_channels WHERE name = ?3))
         ON CONFLICT (id) DO UPDATE SET due_at = excluded.due_at"
    ))?
    .execute(params![
        delivery * CHUNK_STRIDE + head_index,
        earliest,
        channel,
        chat_id,
        delivery,
        head_index
    ])?;
    Ok(())
}

/// Gives chunk `index` of `delivery` a due time: `earliest`, or the end of the lane's
/// rate-limit pause if that is later.
pub(crate) fn make_due(
    tx: &Tx<'_>,
    delivery: i64,
    index: i64,
    channel: &str,
    chat_id: &str,
    earliest: i64,
) -> Result<()> {
    // `due_time` and the write in one statement.
    tx.prepare_cached(concat!(
        "UPDATE outbound_delivery_chunks SET due_at = ",
        lane_due!("?2", "?3", "?4"),
        " WHERE id = ?1"
    ))?
    .execute(params![
        delivery * CHUNK_STRIDE + index,
        earliest,
        channel,
        chat_id
    ])?;
    Ok(())
}

/// `earliest`, or later if the lane says so: the end of its rate-limit pause, or the
/// time its channel's lane interval allows the next send. Every due time handed to a
/// chunk (other than a claim's lease expiry) goes through here, so no send of a paused
/// or paced lane starts early.
pub(crate) fn due_time(tx: &Tx<'_>, channel: &str, chat_id: &str, earliest: i64) -> Result<i64> {
    Ok(tx
        .prepare_cached(concat!("SELECT ", lane_due!("?3", "?1", "?2")))?
        .query_row(params![channel, chat_id, earliest], |r| r.get(0))?)
}

/// Notes that a send of the lane starts `now`: under a lane interval, no other send of
/// the lane may start before `now + interval`, whichever process makes it. Nothing is
/// written for channels without one.
pub(crate) fn note_send(
    tx: &Tx<'_>,
    rules: &Stored,
    channel: &str,
    chat_id: &str,
    now: i64,
) -> Result<()> {
    let interval = duration_ms(rules.policy.channel(channel).lane_interval);
    if interval == 0 {
        return Ok(());
    }
    tx.prepare_cached(
        "INSERT INTO outbound_lanes (channel, chat_id, next_send_at) VALUES (?1, ?2, ?3)
         ON CONFLICT (channel, chat_id) DO UPDATE
         SET next_send_at = max(coalesce(next_send_at, ?3), ?3)",
    )?
    .execute(params![channel, chat_id, now.saturating_add(interval)])?;
    Ok(())
}

/// Pushes the lane's due chunks back to `?3`. Only head chunks are ever due: chunk
/// `delivered_count` of an unfinished delivery, whose id is
/// `id * CHUNK_STRIDE + delivered_count`, so this is one key lookup per unfinished
/// delivery of the lane.
pub(crate) const PAUSE_DUE_SQL: &str = "UPDATE outbound_delivery_chunks SET due_at = ?3
     WHERE due_at < ?3 AND status IN ('pending', 'retry') AND id IN (
         SELECT id * 16384 + delivered_count FROM outbound_deliveries
         WHERE channel = ?1 AND chat_id = ?2 AND status <> 'delivered')";

/// Pauses a lane until `until` (or longer, if it is paused longer already): records
/// the pause for chunks that become due later, and pushes back the chunks of the lane
/// that are already due — to the end of the pause as stored, not only to `until`.
/// Returns that end.
pub(crate) fn pause(tx: &Tx<'_>, channel: &str, chat_id: &str, until: i64) -> Result<i64> {
    let paused_until: i64 = tx
        .prepare_cached(
            "INSERT INTO outbound_lanes (channel, chat_id, paused_until) VALUES (?1, ?2, ?3)
             ON CONFLICT (channel, chat_id) DO UPDATE
             SET paused_until = max(coalesce(paused_until, ?3), ?3)
             RETURNING paused_until",
        )?
        .query_row(params![channel, chat_id, until], |r| r.get(0))?;
    tx.prepare_cached(PAUSE_DUE_SQL)?
        .execute(params![channel, chat_id, paused_until])?;
    Ok(paused_until)
}

/// Holds every send of `channel` until `until` (ms), whoever claims: the channel's
/// stored pause (`outbound_channels.paused_until`, which the claim reads before it
/// reads any chunk of the channel) moves to `until` unless it ends later already.
pub(crate) fn pause_channel(tx: &Tx<'_>, channel: &str, until: i64) -> Result<()> {
    tx.prepare_cached(
        "UPDATE outbound_channels
         SET paused_until = max(coalesce(paused_until, ?2), ?2) WHERE name = ?1",
    )?
    .execute(params![channel, until])?;
    Ok(())
}

/// Puts a delivery that was held aside (requeued, or resolved with chunks left) back
/// into its lane: active at once for parallel lanes; queued behind whatever is active
/// for FIFO lanes, and activated if the lane is free.
pub(crate) fn rejoin(
    tx: &Tx<'_>,
    rules: &Policy,
    delivery: i64,
    channel: &str,
    chat_id: &str,
    earliest: i64,
) -> Result<()> {
    if rules.lane_order == LaneOrder::Parallel {
        return activate(
            tx,
            &Waiting::load(tx, delivery)?,
            channel,
            chat_id,
            earliest,
        );
    }
    tx.prepare_cached(
        "UPDATE outbound_deliveries
         SET status = 'queued', finished_at = NULL, acknowledged_at = NULL WHERE id = ?1",
    )?
    .execute([delivery])?;
    advance(tx, rules, channel, chat_id, earliest)
}

/// The rows of `sql`, a query of `(delivery row id, channel, chat id)`.
pub(crate) fn deliveries_with_lanes(
    tx: &Tx<'_>,
    sql: &'static str,
) -> Result<Vec<(i64, String, String)>> {
    let mut stmt = tx.prepare_cached(sql)?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Queued deliveries, oldest first, with their lanes.
pub(crate) const QUEUED_ALL_SQL: &str = "SELECT id, channel, chat_id FROM outbound_deliveries
     WHERE status = 'queued' AND status <> 'delivered' ORDER BY id";

/// Moves stored rows with a change of the lane rules, so that no reply waits under a
/// rule that no longer holds: under `Parallel` every queued delivery starts; under FIFO
/// (with a changed failure policy) each lane with a queued delivery gets the head the
/// new rules give it.
pub(crate) fn follow_rule_change(
    tx: &Tx<'_>,
    before: &Policy,
    after: &Policy,
    now: i64,
) -> Result<()> {
    if before.lane_order == after.lane_order && before.lane_failure == after.lane_failure {
        return Ok(());
    }
    let queued = deliveries_with_lanes(tx, QUEUED_ALL_SQL)?;
    let mut lanes = std::collections::BTreeSet::new();
    for (delivery, channel, chat_id) in queued {
        if after.lane_order == LaneOrder::Parallel {
            activate(tx, &Waiting::load(tx, delivery)?, &channel, &chat_id, now)?;
        } else if lanes.insert((channel.clone(), chat_id.clone())) {
            advance(tx, after, &channel, &chat_id, now)?;
        }
    }
    Ok(())
}

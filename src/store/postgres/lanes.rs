//! Lanes on PostgreSQL. Every delivery status change happens under its lane's lock, so
//! the head of a lane read under that lock is the head as committed; each statement
//! sees what was committed before it began (READ COMMITTED).

use super::pipeline::owned;
use super::tx::PgTx;
use crate::error::Result;
use crate::rules::LaneHold;
use crate::store::pg_param;
use crate::store::{Activation, DeliveryLane, HeadRow, LaneRef, LaneStore, Waiting};

/// `LaneStore::lane_due_time` as an SQL expression of its parameters: `earliest`, or
/// the end of lane (`channel`, `chat`)'s pause or interval if later.
macro_rules! lane_due {
    ($earliest:literal, $channel:literal, $chat:literal) => {
        concat!(
            "coalesce((SELECT greatest(",
            $earliest,
            "::bigint, paused_until, next_send_at) FROM outbound_lanes WHERE channel = ",
            $channel,
            " AND chat_id = ",
            $chat,
            "), ",
            $earliest,
            "::bigint)"
        )
    };
}

/// The lane head: an active delivery if any, else the first queued one in lane order
/// (`$order` of ids): two seeks of the index of unfinished deliveries, the second only
/// when the first finds nothing.
macro_rules! head_sql {
    ($channel:literal, $chat:literal, $order:literal) => {
        concat!(
            "(SELECT false, id, 0::bigint, NULL::bigint FROM outbound_deliveries
              WHERE channel = ",
            $channel,
            " AND chat_id = ",
            $chat,
            "
                AND status IN ('pending', 'partial') AND status <> 'delivered'
                AND status <> 'failed' LIMIT 1)
             UNION ALL
             (SELECT true, id, delivered_count, not_before FROM outbound_deliveries
              WHERE channel = ",
            $channel,
            " AND chat_id = ",
            $chat,
            "
                AND status = 'queued' AND status <> 'delivered' AND status <> 'failed'
              ORDER BY ",
            $order,
            " LIMIT 1)
             LIMIT 1"
        )
    };
}

pub(crate) const HEAD_SQL: &str = head_sql!("$1", "$2", "id");

/// [`HEAD_SQL`] with the newest queued reply first: the planted fault `out_of_order`.
const HEAD_SQL_NEWEST_FIRST: &str = head_sql!("$1", "$2", "id DESC");

/// The head of each lane of `$1`, `$2` (with its place in the list; a lane with
/// nothing unfinished has no row).
macro_rules! heads_sql {
    ($order:literal) => {
        concat!(
            "SELECT u.n, h.* FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(ch, chat, n)
             CROSS JOIN LATERAL (",
            head_sql!("u.ch", "u.chat", $order),
            ") h"
        )
    };
}

pub(crate) const HEADS_SQL: &str = heads_sql!("id");
const HEADS_SQL_NEWEST_FIRST: &str = heads_sql!("id DESC");

/// Each lane of `$1`, `$2` as an enqueue into it needs it: whether replies are staged
/// in it, its head (NULLs if none), the end of its pause or interval; and `$3` row
/// numbers drawn from the sequence in one go (in the first lane's row only).
macro_rules! enter_sql {
    ($order:literal) => {
        concat!(
            "WITH r AS MATERIALIZED (
                 SELECT array_agg(nextval('outbound_deliveries_id_seq') ORDER BY g) AS rows
                 FROM generate_series(1, $3::bigint) AS g)
             SELECT u.n, CASE WHEN u.n = 1 THEN r.rows END,
                    EXISTS (SELECT 1 FROM outbound_deliveries
                            WHERE channel = u.ch AND chat_id = u.chat AND status = 'new'),
                    coalesce((SELECT greatest(paused_until, next_send_at) FROM outbound_lanes
                              WHERE channel = u.ch AND chat_id = u.chat),
                             -9223372036854775808),
                    h.*
             FROM r, unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(ch, chat, n)
             LEFT JOIN LATERAL (",
            head_sql!("u.ch", "u.chat", $order),
            ") h ON true"
        )
    };
}

pub(crate) const ENTER_SQL: &str = enter_sql!("id");
pub(crate) const ENTER_SQL_NEWEST_FIRST: &str = enter_sql!("id DESC");

/// Head row `r` of [`head_sql!`] from column `at` on.
pub(crate) fn head_row(r: &postgres::Row, at: usize) -> Result<HeadRow> {
    if !r.try_get::<_, bool>(at)? {
        return Ok(HeadRow::Active);
    }
    let id = r.try_get(at + 1)?;
    Ok(HeadRow::Queued(Waiting {
        id,
        position: id,
        head_index: r.try_get(at + 2)?,
        not_before: r.try_get(at + 3)?,
    }))
}

/// The head chunk `c` of delivery `d`, for [`held_sql!`](crate::store::held_sql).
macro_rules! head_chunk {
    () => {
        "c.delivery_id = d.id AND c.chunk_index = d.delivered_count"
    };
}

pub(crate) const HELD_SQL: &str = crate::store::held_sql!("$1", "$2", "$3::boolean", head_chunk!());

/// Pushes the lane's due head chunks back to `$3` (a chunk a claim holds is waited
/// for, and skipped if the claim made it `sending`).
pub(crate) const PAUSE_DUE_SQL: &str = "UPDATE outbound_delivery_chunks c SET due_at = $3
     FROM outbound_deliveries d
     WHERE d.channel = $1 AND d.chat_id = $2 AND d.status <> 'delivered'
       AND d.status <> 'failed' AND c.delivery_id = d.id AND c.chunk_index = d.delivered_count
       AND c.due_at < $3 AND c.status IN ('pending', 'retry')";

/// Gives each delivery `id` of CTE `u` status `status` with its chunk `head` due at
/// the lane's due time of `earliest` (lane `ch`, `chat`), storing the chunk's row if it
/// has none; `$u` is that CTE's definition.
macro_rules! activate_sql {
    ($u:expr) => {
        concat!(
            "WITH u AS (",
            $u,
            "),
             a AS (
                 UPDATE outbound_deliveries d SET status = u.status
                 FROM u WHERE d.id = u.id)
             INSERT INTO outbound_delivery_chunks
                 (delivery_id, chunk_index, status, due_at, channel_id)
             SELECT u.id, u.head, 'pending',
                    coalesce((SELECT greatest(u.earliest, l.paused_until, l.next_send_at)
                              FROM outbound_lanes l
                              WHERE l.channel = u.ch AND l.chat_id = u.chat), u.earliest),
                    (SELECT id FROM outbound_channels WHERE name = u.ch)
             FROM u
             ON CONFLICT (delivery_id, chunk_index) DO UPDATE SET due_at = excluded.due_at"
        )
    };
}

/// Gives each delivery `$1` status `$6` with its chunk `$2` due at the lane's due time
/// of `$3` (lane `$4`, `$5`), storing the chunk's row if it has none.
pub(crate) const ACTIVATE_MANY_SQL: &str = activate_sql!(
    "SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::text[],
                          $5::text[], $6::text[]) AS u(id, head, earliest, ch, chat, status)"
);

/// What the rules' `advance_lanes` (`src/lane.rs`) does to lanes `$1`, `$2` from
/// `$3` (`$4`: whether anything holds each lane, `$5`: whether everything does, under
/// `LaneFailurePolicy::Block`) in one statement: the head of each lane as
/// [`head_sql!`] reads it; a queued one, unless the lane is held (as [`HELD_SQL`]
/// reads it) before its position, activated as
/// [`ACTIVATE_MANY_SQL`] activates it — `partial` if chunks of it were delivered, else
/// `pending`, a delayed reply not before it asked.
macro_rules! advance_sql {
    ($order:literal) => {
        activate_sql!(concat!(
            "SELECT h.id, h.head_index AS head,
                    CASE WHEN h.head_index = 0 AND h.not_before IS NOT NULL
                         THEN greatest($3::bigint, h.not_before) ELSE $3::bigint END AS earliest,
                    l.ch, l.chat,
                    CASE WHEN h.head_index > 0 THEN 'partial' ELSE 'pending' END AS status
             FROM unnest($1::text[], $2::text[], $4::boolean[], $5::boolean[])
                  AS l(ch, chat, holds, block)
             CROSS JOIN LATERAL (",
            head_sql!("l.ch", "l.chat", $order),
            ") h(queued, id, head_index, not_before)
             WHERE h.queued
               AND NOT (l.holds AND coalesce((",
            crate::store::held_sql!("l.ch", "l.chat", "l.block", head_chunk!()),
            ") < h.id, false))"
        ))
    };
}

pub(crate) const ADVANCE_SQL: &str = advance_sql!("id");
/// [`ADVANCE_SQL`] with the newest queued reply first: the planted fault `out_of_order`.
const ADVANCE_SQL_NEWEST_FIRST: &str = advance_sql!("id DESC");

pub(crate) const QUEUED_ALL_SQL: &str = "SELECT id, channel, chat_id FROM outbound_deliveries
     WHERE status = 'queued' ORDER BY id";

impl LaneStore for PgTx<'_> {
    fn waiting(&self, delivery: i64) -> Result<Waiting> {
        let r = self.query_one(
            "SELECT delivered_count, not_before FROM outbound_deliveries WHERE id = $1",
            &[&delivery],
        )?;
        Ok(Waiting {
            id: delivery,
            position: delivery,
            head_index: r.try_get(0)?,
            not_before: r.try_get(1)?,
        })
    }

    fn lane_head(&self, lane: LaneRef<'_>) -> Result<Option<HeadRow>> {
        let sql = if crate::sabotage::planted("out_of_order") {
            HEAD_SQL_NEWEST_FIRST
        } else {
            HEAD_SQL
        };
        self.query_opt(sql, &[&lane.channel, &lane.chat_id])?
            .map(|r| head_row(&r, 0))
            .transpose()
    }

    fn lane_heads(&self, lanes: &[LaneRef<'_>]) -> Result<Vec<Option<HeadRow>>> {
        if lanes.len() < 2 {
            return lanes.iter().map(|lane| self.lane_head(*lane)).collect();
        }
        let sql = if crate::sabotage::planted("out_of_order") {
            HEADS_SQL_NEWEST_FIRST
        } else {
            HEADS_SQL
        };
        let channels: Vec<&str> = lanes.iter().map(|l| l.channel).collect();
        let chats: Vec<&str> = lanes.iter().map(|l| l.chat_id).collect();
        let mut heads: Vec<Option<HeadRow>> = lanes.iter().map(|_| None).collect();
        for r in self.query(sql, &[&channels, &chats])? {
            let n: i64 = r.try_get(0)?;
            if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| heads.get_mut(i)) {
                *slot = Some(head_row(&r, 1)?);
            }
        }
        Ok(heads)
    }

    fn lane_held(&self, lane: LaneRef<'_>, block: bool) -> Result<Option<i64>> {
        Ok(self
            .query_one(HELD_SQL, &[&lane.channel, &lane.chat_id, &block])?
            .try_get(0)?)
    }

    fn advance_lanes(
        &self,
        lanes: &[LaneRef<'_>],
        holds: &[LaneHold],
        earliest: i64,
    ) -> Result<bool> {
        if lanes.is_empty() {
            return Ok(true);
        }
        let sql = if crate::sabotage::planted("out_of_order") {
            ADVANCE_SQL_NEWEST_FIRST
        } else {
            ADVANCE_SQL
        };
        let channels: Vec<String> = lanes.iter().map(|l| l.channel.to_owned()).collect();
        let chats: Vec<String> = lanes.iter().map(|l| l.chat_id.to_owned()).collect();
        // Read and written where it stands among the transaction's statements: sent
        // with the next one, or the COMMIT.
        self.defer(
            sql,
            vec![
                owned(channels),
                owned(chats),
                owned(earliest),
                owned(
                    holds
                        .iter()
                        .map(|h| *h != LaneHold::Nothing)
                        .collect::<Vec<bool>>(),
                ),
                owned(
                    holds
                        .iter()
                        .map(|h| *h == LaneHold::Everything)
                        .collect::<Vec<bool>>(),
                ),
            ],
            None,
        )?;
        Ok(true)
    }

    fn activate(&self, head: &Activation<'_>) -> Result<()> {
        self.activate_many(std::slice::from_ref(head))
    }

    fn activate_many(&self, heads: &[Activation<'_>]) -> Result<()> {
        if heads.is_empty() {
            return Ok(());
        }
        self.made_due.set(true);
        let ids: Vec<i64> = heads.iter().map(|h| h.waiting.id).collect();
        let indexes: Vec<i64> = heads.iter().map(|h| h.waiting.head_index).collect();
        let earliest: Vec<i64> = heads.iter().map(|h| h.earliest).collect();
        let channels: Vec<String> = heads.iter().map(|h| h.lane.channel.to_owned()).collect();
        let chats: Vec<String> = heads.iter().map(|h| h.lane.chat_id.to_owned()).collect();
        let statuses: Vec<&'static str> = heads.iter().map(|h| h.status.as_str()).collect();
        // (Its answer unread: sent with the next statement, or the COMMIT.)
        self.defer(
            ACTIVATE_MANY_SQL,
            vec![
                owned(ids),
                owned(indexes),
                owned(earliest),
                owned(channels),
                owned(chats),
                owned(statuses),
            ],
            None,
        )
    }

    fn make_due(&self, delivery: i64, index: i64, lane: LaneRef<'_>, earliest: i64) -> Result<()> {
        self.defer(
            concat!(
                "UPDATE outbound_delivery_chunks SET due_at = ",
                lane_due!("$3", "$4", "$5"),
                " WHERE delivery_id = $1 AND chunk_index = $2"
            ),
            vec![
                owned(delivery),
                owned(index),
                owned(earliest),
                owned(lane.channel.to_owned()),
                owned(lane.chat_id.to_owned()),
            ],
            None,
        )
    }

    fn lane_due_time(&self, lane: LaneRef<'_>, earliest: i64) -> Result<i64> {
        Ok(self
            .query_one(
                concat!("SELECT ", lane_due!("$3", "$1", "$2")),
                &[&lane.channel, &lane.chat_id, &earliest],
            )?
            .try_get(0)?)
    }

    fn note_lane_send(&self, lane: LaneRef<'_>, next_at: i64) -> Result<()> {
        self.defer(
            "INSERT INTO outbound_lanes (channel, chat_id, next_send_at) VALUES ($1, $2, $3)
             ON CONFLICT (channel, chat_id) DO UPDATE
             SET next_send_at = greatest(outbound_lanes.next_send_at, excluded.next_send_at)",
            vec![
                owned(lane.channel.to_owned()),
                owned(lane.chat_id.to_owned()),
                owned(next_at),
            ],
            None,
        )
    }

    fn pause_lane(&self, lane: LaneRef<'_>, until: i64) -> Result<i64> {
        let paused_until: i64 = self
            .query_one(
                "INSERT INTO outbound_lanes (channel, chat_id, paused_until) VALUES ($1, $2, $3)
                 ON CONFLICT (channel, chat_id) DO UPDATE
                 SET paused_until = greatest(outbound_lanes.paused_until, excluded.paused_until)
                 RETURNING paused_until",
                &[&lane.channel, &lane.chat_id, &until],
            )?
            .try_get(0)?;
        self.execute(
            PAUSE_DUE_SQL,
            &[&lane.channel, &lane.chat_id, &paused_until],
        )?;
        Ok(paused_until)
    }

    fn pause_channel(&self, channel: &str, until: i64) -> Result<()> {
        self.execute(
            "UPDATE outbound_channels SET paused_until = greatest(paused_until, $2) WHERE name = $1",
            &[&channel, &until],
        )?;
        Ok(())
    }

    fn set_queued(&self, delivery: i64) -> Result<()> {
        self.execute(crate::store::set_queued_sql!(pg_param), &[&delivery])?;
        Ok(())
    }

    fn queued_deliveries(&self) -> Result<Vec<DeliveryLane>> {
        self.on_indexes(|| self.query(QUEUED_ALL_SQL, &[]))?
            .iter()
            .map(|r| {
                Ok(DeliveryLane {
                    id: r.try_get(0)?,
                    channel: r.try_get(1)?,
                    chat_id: r.try_get(2)?,
                })
            })
            .collect()
    }
}

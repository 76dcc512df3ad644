//! Chunk rows and claims on PostgreSQL. A chunk's key is (delivery row, index); its
//! public id is `delivery row * CHUNK_STRIDE + index`. Claims lock the chunks they read with
//! `SKIP LOCKED`: two claims never take one chunk, and neither waits for the other.

use crate::store::pg_param;
use postgres::Row;

use super::chunk_id;
use super::pipeline::owned;
use super::tx::{PgTx, chunk_key, chunk_status, count};
use crate::error::Result;
use crate::ids::DeliveryId;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{Candidate, ChannelRow, ChunkRef, ChunkStore, ClaimStore, Readable};

/// The query that loads a [`ChunkRef`], followed by a literal condition.
macro_rules! chunk_ref_where {
    ($condition:literal) => {
        concat!(
            "SELECT ",
            $crate::store::postgres::chunk_id!("c.delivery_id", "c.chunk_index"),
            ", c.delivery_id, c.chunk_index,
                    c.status, c.attempts, d.channel, d.chat_id, d.created_at, d.chunk_count
             FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id
             WHERE ",
            $condition
        )
    };
}
pub(crate) use chunk_ref_where;

/// A [`ChunkRef`] from a row of [`chunk_ref_where!`].
pub(crate) fn chunk_ref(r: &Row) -> Result<ChunkRef> {
    chunk_ref_at(r, 0)
}

/// [`chunk_ref`] from the columns from `at` on.
fn chunk_ref_at(r: &Row, at: usize) -> Result<ChunkRef> {
    Ok(ChunkRef {
        id: r.try_get(at)?,
        delivery: r.try_get(at + 1)?,
        index: r.try_get(at + 2)?,
        status: chunk_status(r, at + 3)?,
        attempts: count(r, at + 4)? as u32,
        channel: r.try_get(at + 5)?,
        chat_id: r.try_get(at + 6)?,
        created_at: r.try_get(at + 7)?,
        total: r.try_get(at + 8)?,
    })
}

/// The chunk a claim holds (`$3` its token), locked: `sending`, or after its lease ran
/// out `uncertain` or `retry`.
pub(crate) const CLAIMED_SQL: &str = chunk_ref_where!(
    "c.delivery_id = $1 AND c.chunk_index = $2 AND c.claim_token = $3
       AND c.status IN ('sending', 'uncertain', 'retry')
     FOR UPDATE OF c"
);

/// [`CLAIMED_SQL`] for each (`$1`, `$2`, `$3`), with its place in the list first.
pub(crate) const CLAIMED_MANY_SQL: &str = concat!(
    "SELECT u.n, ",
    chunk_id!("c.delivery_id", "c.chunk_index"),
    ", c.delivery_id, c.chunk_index, c.status, c.attempts, d.channel, d.chat_id, d.created_at,
        d.chunk_count
     FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) WITH ORDINALITY AS u(d, i, token, n)
          JOIN outbound_delivery_chunks c
            ON c.delivery_id = u.d AND c.chunk_index = u.i AND c.claim_token = u.token
          JOIN outbound_deliveries d ON d.id = c.delivery_id
     WHERE c.status IN ('sending', 'uncertain', 'retry')
     ORDER BY c.delivery_id, c.chunk_index
     FOR UPDATE OF c"
);

/// Chunk (`$1`, `$2`), the one chunk a queued reply has no row for yet included.
pub(crate) const LOAD_CHUNK_SQL: &str = concat!(
    "SELECT ",
    chunk_id!("d.id", "$2::bigint"),
    ", d.id, $2::bigint,
        coalesce(c.status, 'pending'), coalesce(c.attempts, 0), d.channel, d.chat_id,
        d.created_at, d.chunk_count
     FROM outbound_deliveries d
          LEFT JOIN outbound_delivery_chunks c ON c.delivery_id = d.id AND c.chunk_index = $2
     WHERE d.id = $1 AND (c.delivery_id IS NOT NULL OR (d.status = 'queued' AND $2::bigint = 0))"
);

/// A channel's due chunks (leases that ran out included), earliest first and in key
/// order at one time (as on SQLite), `$lock`ed.
macro_rules! claim_sql {
    ($lock:literal) => {
        claim_sql!("$1", "true", $lock)
    };
    ($channel:literal, $when:literal, $lock:literal) => {
        concat!(
            "SELECT ",
            $crate::store::postgres::chunk_id!("c.delivery_id", "c.chunk_index"),
            ", c.delivery_id, c.due_at, c.chunk_index,
                    c.status, c.attempts, d.chat_id, d.created_at, d.chunk_count, d.uid,
                    coalesce(c.text, d.text), d.metadata, c.claim_token IS NOT NULL,
                    c.resend_by
             FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id
             WHERE c.channel_id = ",
            $channel,
            " AND c.due_at IS NOT NULL AND c.due_at <= $2 AND ",
            $when,
            " ORDER BY c.due_at, c.delivery_id, c.chunk_index LIMIT $3 ",
            $lock
        )
    };
}

/// The claim's read: locked unless another claim holds the rows, which it skips.
pub(crate) const CLAIM_SQL: &str = claim_sql!("FOR UPDATE OF c SKIP LOCKED");

/// [`CLAIM_SQL`] without its row locks: the planted fault `no_claim_locks`.
const CLAIM_SQL_UNLOCKED: &str = claim_sql!("");

/// The channels named `$1` (every channel, for NULL) as [`channel_row`] reads them,
/// each with the claim's read of its due chunks (`$2` now, at most `$3`) if it has no
/// rate and no pause (NULLs when it has none); after them, whether each chunk's lane
/// row was locked here, `$lane_lock`ed unless another transaction holds it (the claim
/// tries those lanes next: see [`PgTx::held_lanes`](super::PgTx)), and the
/// transaction's id (which those row locks assign).
macro_rules! due_in_channels_sql {
    ($lock:literal, $lane_lock:literal) => {
        concat!(
            "SELECT ch.*, c.*, l.held, txid_current_if_assigned()
             FROM (SELECT ch.id, ch.name,
                          coalesce(ch.channel_interval_us, p.channel_interval_us, 0) AS interval_us,
                          ch.next_send_at_us, ch.paused_until
                   FROM outbound_channels ch, outbound_policy p
                   WHERE p.id = 1 AND ($1::text[] IS NULL OR ch.name = ANY ($1::text[]))) ch
             LEFT JOIN LATERAL (",
            claim_sql!(
                "ch.id",
                "ch.interval_us = 0 AND coalesce(ch.paused_until <= $2, true)",
                $lock
            ),
            ") c ON true
             LEFT JOIN LATERAL (SELECT true AS held FROM (
                 SELECT 1 FROM outbound_lanes
                 WHERE channel = ch.name AND chat_id = c.chat_id ",
            $lane_lock,
            ") locked) l ON true
             ORDER BY ch.id, c.due_at, c.delivery_id, c.chunk_index"
        )
    };
}

/// The column of [`DUE_IN_CHANNELS_SQL`] that says whether the chunk's lane was locked.
const DUE_LANE_HELD: usize = 5 + 14;

pub(crate) const DUE_IN_CHANNELS_SQL: &str = due_in_channels_sql!(
    "FOR UPDATE OF c SKIP LOCKED",
    "FOR NO KEY UPDATE SKIP LOCKED"
);
/// [`DUE_IN_CHANNELS_SQL`] without its chunk row locks: the planted fault
/// `no_claim_locks`.
const DUE_IN_CHANNELS_SQL_UNLOCKED: &str =
    due_in_channels_sql!("", "FOR NO KEY UPDATE SKIP LOCKED");
/// [`DUE_IN_CHANNELS_SQL`] locking no lane: the planted fault `no_lane_locks`.
const DUE_IN_CHANNELS_SQL_NO_LANES: &str =
    due_in_channels_sql!("FOR UPDATE OF c SKIP LOCKED", "AND false");

/// Chunks (`$1`, `$2`) `sending` under tokens `$3` until `$4`, first sent at `$5` if
/// never before: how many, and the transaction's id.
pub(crate) const MARK_SENDING_MANY_SQL: &str = "WITH m AS (
         UPDATE outbound_delivery_chunks c
         SET status = 'sending', attempts = c.attempts + 1, due_at = $4,
             claim_token = u.token, first_sent_at = coalesce(c.first_sent_at, $5)
         FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS u(d, i, token)
         WHERE c.delivery_id = u.d AND c.chunk_index = u.i
         RETURNING 1)
     SELECT count(*), txid_current_if_assigned() FROM m";

pub(crate) const NEXT_DUE_SQL: &str = "SELECT min(due_at) FROM outbound_delivery_chunks
     WHERE channel_id = $1 AND due_at IS NOT NULL";

pub(crate) const EXPIRED_SQL: &str = chunk_ref_where!(
    "c.channel_id = $1 AND c.due_at IS NOT NULL AND c.due_at <= $2 AND c.status = 'sending'"
);

/// A [`ChannelRow`] from id, name, interval, next send and pause columns.
pub(crate) fn channel_row(r: &Row) -> Result<ChannelRow> {
    Ok(ChannelRow {
        id: r.try_get(0)?,
        name: r.try_get(1)?,
        interval_us: r.try_get(2)?,
        next_send_at_us: r.try_get(3)?,
        paused_until: r.try_get(4)?,
    })
}

/// A [`Candidate`] of `channel` from the columns of [`claim_sql!`], from `at` on.
fn candidate(r: &Row, at: usize, channel: &ChannelRow) -> Result<Candidate> {
    let readable = || -> std::result::Result<Readable, String> {
        let err = |e: crate::error::Error| e.to_string();
        let get = |e: postgres::Error| e.to_string();
        let uid: String = r.try_get(at + 9).map_err(get)?;
        let uid: DeliveryId = uid
            .parse()
            .map_err(|_| format!("its delivery uid {uid:?} is not a UUID"))?;
        Ok(Readable {
            chunk: ChunkRef {
                id: r.try_get(at).map_err(get)?,
                delivery: r.try_get(at + 1).map_err(get)?,
                index: r.try_get(at + 3).map_err(get)?,
                status: chunk_status(r, at + 4).map_err(err)?,
                attempts: count(r, at + 5).map_err(err)? as u32,
                channel: channel.name.clone(),
                chat_id: r.try_get(at + 6).map_err(get)?,
                created_at: r.try_get(at + 7).map_err(get)?,
                total: r.try_get(at + 8).map_err(get)?,
            },
            suspect: r.try_get(at + 12).map_err(get)?,
            resend_by: r.try_get(at + 13).map_err(get)?,
            uid,
            text: r.try_get(at + 10).map_err(get)?,
            metadata: r.try_get(at + 11).map_err(get)?,
        })
    };
    Ok(Candidate {
        chunk: r.try_get(at)?,
        delivery: r.try_get(at + 1)?,
        channel_id: channel.id,
        due_at: r.try_get(at + 2)?,
        row: readable(),
    })
}

impl ChunkStore for PgTx<'_> {
    fn load_chunk(&self, id: i64) -> Result<Option<ChunkRef>> {
        let (delivery, index) = chunk_key(id);
        self.query_opt(LOAD_CHUNK_SQL, &[&delivery, &index])?
            .as_ref()
            .map(chunk_ref)
            .transpose()
    }

    fn claimed_chunk(&self, id: i64, token: i64) -> Result<Option<ChunkRef>> {
        let (delivery, index) = chunk_key(id);
        self.query_opt(CLAIMED_SQL, &[&delivery, &index, &token])?
            .as_ref()
            .map(chunk_ref)
            .transpose()
    }

    fn claimed_chunks(&self, claims: &[(i64, i64)]) -> Result<Vec<Option<ChunkRef>>> {
        if claims.len() < 2 {
            return claims
                .iter()
                .map(|(id, token)| self.claimed_chunk(*id, *token))
                .collect();
        }
        let (deliveries, indexes): (Vec<i64>, Vec<i64>) =
            claims.iter().map(|(id, _)| chunk_key(*id)).unzip();
        let tokens: Vec<i64> = claims.iter().map(|(_, token)| *token).collect();
        let mut chunks: Vec<Option<ChunkRef>> = claims.iter().map(|_| None).collect();
        for r in self.query(CLAIMED_MANY_SQL, &[&deliveries, &indexes, &tokens])? {
            let n: i64 = r.try_get(0)?;
            let chunk = chunk_ref_at(&r, 1)?;
            if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| chunks.get_mut(i)) {
                *slot = Some(chunk);
            }
        }
        Ok(chunks)
    }

    fn reschedule(
        &self,
        chunk: i64,
        status: ChunkStatus,
        attempts: u32,
        due: i64,
        error: Option<&str>,
    ) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = $3, attempts = $4, due_at = $5, claim_token = NULL,
                 last_error = coalesce($6, last_error)
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[
                &delivery,
                &index,
                &status.as_str(),
                &i64::from(attempts),
                &due,
                &error,
            ],
        )?;
        Ok(())
    }

    fn set_retry_unscheduled(&self, chunk: i64, attempts: u32, error: Option<&str>) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = 'retry', attempts = $3, due_at = NULL, claim_token = NULL,
                 last_error = coalesce($4, last_error)
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index, &i64::from(attempts), &error],
        )?;
        Ok(())
    }

    fn reset_budget(&self, chunk: i64) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = 'retry', attempts = 0, rate_limits = 0, due_at = NULL,
                 claim_token = NULL, sent_before = (sent_before OR attempts > 0), resend_by = NULL
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index],
        )?;
        Ok(())
    }

    fn count_rate_limit(&self, chunk: i64) -> Result<u32> {
        let (delivery, index) = chunk_key(chunk);
        let r = self.query_one(
            "UPDATE outbound_delivery_chunks SET rate_limits = rate_limits + 1
             WHERE delivery_id = $1 AND chunk_index = $2 RETURNING rate_limits",
            &[&delivery, &index],
        )?;
        Ok(count(&r, 0)? as u32)
    }

    fn mark_delivered(
        &self,
        chunk: i64,
        platform_message_id: Option<&str>,
        now: i64,
    ) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = 'delivered', due_at = NULL, claim_token = NULL,
                 platform_message_id = $3, delivered_at = $4
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index, &platform_message_id, &now],
        )?;
        Ok(())
    }

    fn count_delivered(
        &self,
        delivery: i64,
        now: i64,
        status: Option<DeliveryStatus>,
    ) -> Result<()> {
        self.execute(
            crate::store::count_delivered_sql!(pg_param),
            &[&delivery, &now, &status.map(DeliveryStatus::as_str)],
        )?;
        Ok(())
    }

    fn set_chunk_aside(
        &self,
        chunk: i64,
        status: ChunkStatus,
        error: &str,
        keep_token: bool,
    ) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = $3, due_at = NULL, last_error = $4,
                 claim_token = CASE WHEN $5 THEN claim_token END,
                 settlement = CASE WHEN $3 = 'uncertain' THEN NULL ELSE settlement END
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index, &status.as_str(), &error, &keep_token],
        )?;
        Ok(())
    }

    fn retry_keeping_token(&self, chunk: i64, due: i64) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks SET status = 'retry', due_at = $3
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index, &due],
        )?;
        Ok(())
    }

    fn set_delivery_aside(
        &self,
        delivery: i64,
        status: ChunkStatus,
        now: i64,
        finished: Option<i64>,
    ) -> Result<()> {
        self.execute(
            crate::store::set_delivery_aside_sql!(pg_param),
            &[&delivery, &status.as_str(), &now, &finished],
        )?;
        Ok(())
    }

    fn set_corrupt(
        &self,
        chunk: i64,
        delivery: i64,
        reason: &str,
        now: i64,
    ) -> Result<Option<(String, String)>> {
        let (of, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = 'failed', due_at = NULL, claim_token = NULL, last_error = $3
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&of, &index, &reason],
        )?;
        self.query_opt(
            "UPDATE outbound_deliveries
             SET status = 'failed', updated_at = $2, finished_at = $2, corrupt = $3
             WHERE id = $1 RETURNING channel, chat_id",
            &[&delivery, &now, &reason],
        )?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .transpose()
    }

    fn delivery_names(&self, delivery: i64) -> Result<Option<(String, String, String)>> {
        self.query_opt(
            "SELECT uid, channel, chat_id FROM outbound_deliveries WHERE id = $1",
            &[&delivery],
        )?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
        .transpose()
    }
}

impl ClaimStore for PgTx<'_> {
    fn channels(&self, name: Option<&str>) -> Result<Vec<ChannelRow>> {
        self.query(
            "SELECT ch.id, ch.name, coalesce(ch.channel_interval_us, p.channel_interval_us, 0),
                    ch.next_send_at_us, ch.paused_until
             FROM outbound_channels ch, outbound_policy p
             WHERE p.id = 1 AND ($1::text IS NULL OR ch.name = $1)
             ORDER BY ch.id",
            &[&name],
        )?
        .iter()
        .map(channel_row)
        .collect()
    }

    fn set_channel_slot(&self, id: i64, next_us: i64) -> Result<()> {
        // (Its answer unread: sent with the next statement, or the COMMIT.)
        self.defer(
            "UPDATE outbound_channels SET next_send_at_us = $2 WHERE id = $1",
            vec![owned(id), owned(next_us)],
            None,
        )
    }

    fn due_chunks(&self, row: &ChannelRow, now: i64, limit: usize) -> Result<Vec<Candidate>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let sql = if crate::sabotage::planted("no_claim_locks") {
            CLAIM_SQL_UNLOCKED
        } else {
            CLAIM_SQL
        };
        self.query(sql, &[&row.id, &now, &limit])?
            .iter()
            .map(|r| candidate(r, 0, row))
            .collect()
    }

    fn due_in_channels(
        &self,
        names: Option<&[&str]>,
        now: i64,
        limit: usize,
    ) -> Result<Vec<(ChannelRow, Option<Vec<Candidate>>)>> {
        let sql = if crate::sabotage::planted("no_claim_locks") {
            DUE_IN_CHANNELS_SQL_UNLOCKED
        } else if crate::sabotage::planted("no_lane_locks") {
            DUE_IN_CHANNELS_SQL_NO_LANES
        } else {
            DUE_IN_CHANNELS_SQL
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut channels: Vec<(ChannelRow, Option<Vec<Candidate>>)> = Vec::new();
        for r in self.query(sql, &[&names, &now, &limit])? {
            // The lanes of its chunks it locked, which the claim tries next.
            if r.try_get::<_, Option<bool>>(DUE_LANE_HELD)? == Some(true) {
                self.hold_lane(r.try_get(1)?, r.try_get(5 + 6)?);
                self.note_xid(&r, DUE_LANE_HELD + 1)?;
            }
            let row = channel_row(&r)?;
            if channels.last().is_none_or(|(last, _)| last.id != row.id) {
                // (The statement read its chunks under the same condition.)
                let read = row.unpaced_and_free(now);
                channels.push((row, read.then(Vec::new)));
            }
            let Some((row, Some(due))) = channels.last_mut() else {
                continue;
            };
            // A channel with nothing due has one row, of NULLs past its own columns.
            if r.try_get::<_, Option<i64>>(5)?.is_some() {
                due.push(candidate(&r, 5, row)?);
            }
        }
        if names.is_some() {
            // In the order the default gives them.
            channels.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        }
        Ok(channels)
    }

    fn next_due(&self, id: i64) -> Result<Option<i64>> {
        Ok(self.query_one(NEXT_DUE_SQL, &[&id])?.try_get(0)?)
    }

    fn mark_sending(&self, chunk: i64, now: i64, lease_until: i64, token: i64) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET status = 'sending', attempts = attempts + 1, due_at = $3, claim_token = $4,
                 first_sent_at = coalesce(first_sent_at, $5)
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index, &lease_until, &token, &now],
        )?;
        Ok(())
    }

    fn mark_sending_many(&self, chunks: &[(i64, i64)], now: i64, lease_until: i64) -> Result<()> {
        if chunks.is_empty() {
            return Ok(());
        }
        let (deliveries, indexes): (Vec<i64>, Vec<i64>) =
            chunks.iter().map(|(id, _)| chunk_key(*id)).unzip();
        let tokens: Vec<i64> = chunks.iter().map(|(_, token)| *token).collect();
        // Its answer (a count) unread: sent with the next statement, or the COMMIT.
        let values = vec![
            owned(deliveries),
            owned(indexes),
            owned(tokens),
            owned(lease_until),
            owned(now),
        ];
        self.defer(MARK_SENDING_MANY_SQL, values, Some(1))
    }

    fn set_due(&self, chunk: i64, due: i64) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.defer(
            "UPDATE outbound_delivery_chunks SET due_at = $3
             WHERE delivery_id = $1 AND chunk_index = $2",
            vec![owned(delivery), owned(index), owned(due)],
            None,
        )
    }

    fn renew_lease(&self, chunk: i64, token: i64, until: i64) -> Result<bool> {
        let (delivery, index) = chunk_key(chunk);
        Ok(self.execute(
            "UPDATE outbound_delivery_chunks SET due_at = $4
             WHERE delivery_id = $1 AND chunk_index = $2 AND claim_token = $3
               AND status = 'sending'",
            &[&delivery, &index, &token, &until],
        )? == 1)
    }

    fn expired_sending(&self, id: i64, until: i64) -> Result<Vec<ChunkRef>> {
        self.query(EXPIRED_SQL, &[&id, &until])?
            .iter()
            .map(chunk_ref)
            .collect()
    }
}

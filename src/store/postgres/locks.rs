//! The lock primitives of the seam: lane rows are locked (one writer per lane until the
//! transaction ends), caller keys and the rules with advisory locks of the transaction.

use super::chunks;
use super::pipeline::Params;
use super::pipeline::owned;
use super::tx::PgTx;
use crate::error::Result;
use crate::store::{ChannelRow, LaneRef, Locks};

/// The rules' lock, per schema: shared by every write, exclusive for a change of them
/// (schema V5's `outbound_lock_rules`, which `outbound_begin` takes too).
const LOCK_RULES_SHARED: &str = "SELECT outbound_lock_rules(false)";
const LOCK_RULES: &str = "SELECT outbound_lock_rules(true)";

/// A caller key of a channel (two enqueues with one key wait for each other).
const LOCK_KEY: &str = "SELECT pg_advisory_xact_lock(hashtextextended(
     current_schema() || '/key/' || length($1::text) || '/' || $1::text || $2::text, 0))";

/// Locks the lane rows of `$rows` (channel, chat), waiting for them, in the server's
/// order of lanes (so two transactions never wait for each other in a circle); creates
/// those missing. Writes no new row version when a row exists (the update's condition
/// is false: only the lock of the conflicting row is taken). Answers the transaction's
/// id (a row lock assigns one).
macro_rules! lock_lanes_sql {
    ($rows:literal) => {
        concat!(
            "WITH l AS (
                 INSERT INTO outbound_lanes (channel, chat_id) ",
            $rows,
            " ON CONFLICT (channel, chat_id) DO UPDATE
                 SET paused_until = outbound_lanes.paused_until WHERE false
                 RETURNING 1)
             SELECT txid_current_if_assigned() FROM (SELECT count(*) FROM l) locked"
        )
    };
}

const LOCK_LANE: &str = lock_lanes_sql!("VALUES ($1, $2)");
pub(crate) const LOCK_LANES: &str =
    lock_lanes_sql!("SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) ORDER BY 1, 2");

/// Locks a lane's row unless another transaction holds it; answers the transaction's
/// id (read once the row is locked, which assigns one), so that the writes after it can
/// ride with the `COMMIT`.
const TRY_LOCK_LANE: &str = "SELECT txid_current_if_assigned() FROM (
         SELECT 1 FROM outbound_lanes WHERE channel = $1 AND chat_id = $2
         FOR NO KEY UPDATE SKIP LOCKED) l";
/// The lanes of `$1`, `$2` no other transaction holds, locked, with the transaction's
/// id (as [`TRY_LOCK_LANE`]).
pub(crate) const TRY_LOCK_LANES: &str = "SELECT l.channel, l.chat_id, txid_current_if_assigned()
     FROM unnest($1::text[], $2::text[]) AS u(ch, chat)
     CROSS JOIN LATERAL (
         SELECT channel, chat_id FROM outbound_lanes WHERE channel = u.ch AND chat_id = u.chat
         FOR NO KEY UPDATE SKIP LOCKED) l";
const LANE_EXISTS: &str = "SELECT 1 FROM outbound_lanes WHERE channel = $1 AND chat_id = $2";
const CREATE_LANE: &str = "INSERT INTO outbound_lanes (channel, chat_id) VALUES ($1, $2)
     ON CONFLICT DO NOTHING";

/// A paced channel's row as it stands, locked unless another claim holds it.
const LOCK_CHANNEL_SLOT: &str = "SELECT ch.id, ch.name,
        coalesce(ch.channel_interval_us, p.channel_interval_us, 0), ch.next_send_at_us,
        ch.paused_until
     FROM outbound_channels ch, outbound_policy p WHERE p.id = 1 AND ch.id = $1
     FOR NO KEY UPDATE OF ch SKIP LOCKED";

/// Lane rows are locked (one writer per lane until the transaction ends), caller keys
/// and the rules with advisory locks of the transaction.
impl Locks for PgTx<'_> {
    fn lock_rules(&self, exclusive: bool) -> Result<()> {
        if self
            .rules_locked
            .get()
            .is_some_and(|held| held || !exclusive)
        {
            // Taken by `BEGIN`.
            return Ok(());
        }
        // (Sent with the next statement: nothing is read under it before then.)
        let sql = if exclusive {
            LOCK_RULES
        } else {
            LOCK_RULES_SHARED
        };
        self.defer(sql, Vec::new(), None)
    }

    fn lock_lanes(&self, lanes: &mut [LaneRef<'_>]) -> Result<()> {
        if crate::sabotage::planted("no_lane_locks") {
            return Ok(());
        }
        // Sent with the next statement, which the server runs once the locks are
        // granted; its row is the transaction's id.
        if let [lane] = lanes {
            let values = vec![
                owned(lane.channel.to_owned()),
                owned(lane.chat_id.to_owned()),
            ];
            return self.defer(LOCK_LANE, values, Some(0));
        }
        let channels: Vec<String> = lanes.iter().map(|l| l.channel.to_owned()).collect();
        let chats: Vec<String> = lanes.iter().map(|l| l.chat_id.to_owned()).collect();
        self.defer(LOCK_LANES, vec![owned(channels), owned(chats)], Some(0))
    }

    fn try_lock_lane(&self, lane: LaneRef<'_>) -> Result<bool> {
        if crate::sabotage::planted("no_lane_locks") || self.holds_lane(lane) {
            return Ok(true);
        }
        let params: Params<'_> = &[&lane.channel, &lane.chat_id];
        let locked = |tx: &Self| -> Result<bool> {
            let Some(row) = tx.query_opt(TRY_LOCK_LANE, params)? else {
                return Ok(false);
            };
            tx.note_xid(&row, 0)?;
            Ok(true)
        };
        if locked(self)? {
            return Ok(true);
        }
        if self.query_opt(LANE_EXISTS, params)?.is_some() {
            return Ok(false);
        }
        // Every enqueue stores its lane's row, and a purge removes only lanes with
        // nothing unfinished; a lane without its row is rare, and made here.
        self.execute(CREATE_LANE, params)?;
        locked(self)
    }

    fn try_lock_lanes(&self, lanes: &[LaneRef<'_>]) -> Result<Vec<bool>> {
        let unheld = lanes.iter().filter(|l| !self.holds_lane(**l)).count();
        if unheld < 2 || crate::sabotage::planted("no_lane_locks") {
            return lanes.iter().map(|lane| self.try_lock_lane(*lane)).collect();
        }
        let channels: Vec<&str> = lanes.iter().map(|l| l.channel).collect();
        let chats: Vec<&str> = lanes.iter().map(|l| l.chat_id).collect();
        let rows = self.query(TRY_LOCK_LANES, &[&channels, &chats])?;
        if let Some(row) = rows.first() {
            self.note_xid(row, 2)?;
        }
        let taken: std::collections::HashSet<(String, String)> = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<_>>()?;
        lanes
            .iter()
            .map(|lane| {
                if taken.contains(&(lane.channel.to_owned(), lane.chat_id.to_owned())) {
                    return Ok(true);
                }
                // Held by another transaction, or (rarely) without its row.
                self.try_lock_lane(*lane)
            })
            .collect()
    }

    fn lock_key(&self, channel: &str, key: &str) -> Result<()> {
        // (Sent with the next statement: the key's reply is read after it.)
        let values = vec![owned(channel.to_owned()), owned(key.to_owned())];
        self.defer(LOCK_KEY, values, None)
    }

    fn lock_channel_slot(&self, row: ChannelRow) -> Result<Option<ChannelRow>> {
        self.query_opt(LOCK_CHANNEL_SLOT, &[&row.id])?
            .as_ref()
            .map(chunks::channel_row)
            .transpose()
    }
}

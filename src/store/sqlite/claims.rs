//! Claims on SQLite: each channel's due chunks are a range of the claim index.

use rusqlite::params;
use rusqlite::types::ValueRef;

use super::chunks::{chunk_ref, chunk_ref_where};
use super::dead::Table;
use super::tx::Tx;
use crate::error::Result;
use crate::ids::DeliveryId;
use crate::store::{Candidate, ChannelRow, ChunkRef, ClaimStore, Readable};

/// The claim query for one channel: a range search on the claim index, in its order,
/// so its cost is what it returns, never another channel's backlog or any history.
/// `?1` is the channel, `?2` now. The caller stops reading at its limit: a bound
/// `LIMIT ?` would have SQLite compile the statement again each time it is bound (the
/// limit's value takes part in the plan), a full parse and plan in every claim.
pub(crate) const CLAIM_SQL: &str =
    "SELECT c.id, c.delivery_id, c.due_at, c.chunk_index, c.status, c.attempts,
            d.chat_id, d.created_at, d.chunk_count, d.uid, coalesce(c.text, d.text),
            d.metadata, c.claim_token IS NOT NULL, c.resend_by
     FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id
     WHERE c.channel_id = ?1 AND c.due_at IS NOT NULL AND c.due_at <= ?2
     ORDER BY c.due_at";

/// The earliest due time of one channel (`?1`): the first entry of its claim index.
pub(crate) const NEXT_DUE_SQL: &str = "SELECT min(due_at) FROM outbound_delivery_chunks
     WHERE channel_id = ?1 AND due_at IS NOT NULL";

/// `sending` chunks of one channel (`?1`) whose lease ends at or before `?2`: a range of
/// that channel's part of the claim index.
pub(crate) const EXPIRED_SQL: &str = chunk_ref_where!(
    "c.channel_id = ?1 AND c.due_at IS NOT NULL AND c.due_at <= ?2 AND c.status = 'sending'"
);

/// A row of [`CLAIM_SQL`], or why it cannot be read: its text may not be UTF-8, its uid
/// not a UUID (a file damaged or written by hand).
fn candidate(r: &rusqlite::Row<'_>, channel: &ChannelRow) -> rusqlite::Result<Candidate> {
    let readable = || -> std::result::Result<Readable, String> {
        let text = |i: usize| -> std::result::Result<String, String> {
            let value = r.get_ref(i).map_err(|e| e.to_string())?;
            match value {
                ValueRef::Text(bytes) => String::from_utf8(bytes.to_vec())
                    .map_err(|_| format!("column {i} is not UTF-8")),
                other => Err(format!("column {i} is {:?}, not text", other.data_type())),
            }
        };
        let uid = text(9)?;
        let uid: DeliveryId = uid
            .parse()
            .map_err(|_| format!("its delivery uid {uid:?} is not a UUID"))?;
        let chunk = ChunkRef {
            id: r.get(0).map_err(|e| e.to_string())?,
            delivery: r.get(1).map_err(|e| e.to_string())?,
            index: r.get(3).map_err(|e| e.to_string())?,
            status: r.get(4).map_err(|e| e.to_string())?,
            attempts: r.get(5).map_err(|e| e.to_string())?,
            channel: channel.name.clone(),
            chat_id: text(6)?,
            created_at: r.get(7).map_err(|e| e.to_string())?,
            total: r.get(8).map_err(|e| e.to_string())?,
        };
        let metadata = match r.get_ref(11).map_err(|e| e.to_string())? {
            ValueRef::Null => None,
            _ => Some(text(11)?),
        };
        Ok(Readable {
            suspect: r.get(12).map_err(|e| e.to_string())?,
            resend_by: r.get(13).map_err(|e| e.to_string())?,
            chunk,
            uid,
            text: text(10)?,
            metadata,
        })
    };
    Ok(Candidate {
        chunk: r.get(0)?,
        delivery: r.get(1)?,
        channel_id: channel.id,
        due_at: r.get(2)?,
        row: readable(),
    })
}

impl ClaimStore for Tx<'_> {
    fn channels(&self, name: Option<&str>) -> Result<Vec<ChannelRow>> {
        let mut stmt = self.prepare_cached(
            "SELECT ch.id, ch.name, coalesce(ch.channel_interval_us, p.channel_interval_us, 0),
                    ch.next_send_at_us, ch.paused_until
             FROM outbound_channels ch, outbound_policy p
             WHERE p.id = 1 AND (?1 IS NULL OR ch.name = ?1)",
        )?;
        let rows = stmt.query_map([name], |r| {
            Ok(ChannelRow {
                id: r.get(0)?,
                name: r.get(1)?,
                interval_us: r.get(2)?,
                next_send_at_us: r.get(3)?,
                paused_until: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn set_channel_slot(&self, id: i64, next_us: i64) -> Result<()> {
        self.prepare_cached("UPDATE outbound_channels SET next_send_at_us = ?2 WHERE id = ?1")?
            .execute(params![id, next_us])?;
        Ok(())
    }

    fn due_chunks(&self, row: &ChannelRow, now: i64, limit: usize) -> Result<Vec<Candidate>> {
        let mut stmt = self.prepare_cached(CLAIM_SQL)?;
        let rows = stmt.query_map(params![row.id, now], |r| candidate(r, row))?;
        Ok(rows.take(limit).collect::<rusqlite::Result<_>>()?)
    }

    fn next_due(&self, id: i64) -> Result<Option<i64>> {
        Ok(self
            .prepare_cached(NEXT_DUE_SQL)?
            .query_row([id], |r| r.get(0))?)
    }

    fn mark_sending(&self, chunk: i64, now: i64, lease_until: i64, token: i64) -> Result<()> {
        self.debug_not_dead(Table::Chunks, chunk)?;
        self.prepare_cached(
            "UPDATE outbound_delivery_chunks
             SET status = 'sending', attempts = attempts + 1, due_at = ?2,
                 claim_token = ?3, first_sent_at = coalesce(first_sent_at, ?4)
             WHERE id = ?1",
        )?
        .execute(params![chunk, lease_until, token, now])?;
        Ok(())
    }

    fn set_due(&self, chunk: i64, due: i64) -> Result<()> {
        self.prepare_cached("UPDATE outbound_delivery_chunks SET due_at = ?2 WHERE id = ?1")?
            .execute(params![chunk, due])?;
        Ok(())
    }

    fn renew_lease(&self, chunk: i64, token: i64, until: i64) -> Result<bool> {
        Ok(self
            .prepare_cached(
                "UPDATE outbound_delivery_chunks SET due_at = ?3
                 WHERE id = ?1 AND claim_token = ?2 AND status = 'sending'",
            )?
            .execute(params![chunk, token, until])?
            == 1)
    }

    fn expired_sending(&self, id: i64, until: i64) -> Result<Vec<ChunkRef>> {
        let mut stmt = self.prepare_cached(EXPIRED_SQL)?;
        let rows = stmt.query_map(params![id, until], chunk_ref)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}

#[cfg(test)]
mod tests {
    use crate::options::OutboxOptions;
    use crate::outbox::Outbox;
    use crate::reply::NewDelivery;

    /// Claims of any size take their rows from one compiled statement: nothing bound to
    /// it takes part in its plan, so SQLite never compiles it again. Each claim returns
    /// at most its limit, the earliest due first.
    #[test]
    fn claims_reuse_one_compiled_statement_and_stop_at_their_limit() {
        let ob = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        for chat in 0..10 {
            ob.enqueue(&NewDelivery::single("t", chat.to_string(), "x"))
                .unwrap();
        }
        let mut chats = Vec::new();
        for limit in [1, 3, 2, 64] {
            let claims = ob.claim(limit).unwrap();
            assert_eq!(claims.len(), limit.min(10 - chats.len()));
            chats.extend(claims.iter().map(|c| c.chat_id.parse::<i32>().unwrap()));
        }
        assert_eq!(chats, (0..10).collect::<Vec<_>>());
        let conn = ob.sqlite("test").unwrap().writer();
        let stmt = conn.prepare_cached(super::CLAIM_SQL).unwrap();
        assert_eq!(stmt.get_status(rusqlite::StatementStatus::RePrepare), 0);
        assert!(stmt.get_status(rusqlite::StatementStatus::Run) >= 4);
    }
}

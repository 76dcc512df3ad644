//! New deliveries on SQLite: caller keys, row numbers, the insert.

use rusqlite::{OptionalExtension, params};

use super::chunks::{chunks_supplied, supplied};
use super::tx::Tx;
use crate::error::Result;
use crate::ids::CHUNK_STRIDE;
use crate::store::{DeliveryStore, LaneRef, NewRow, Staged, StoredContent};

/// The delivery with caller key `?2` on channel `?1`.
pub(crate) const KEY_LOOKUP_SQL: &str =
    "SELECT id, uid FROM outbound_deliveries WHERE channel = ?1 AND idempotency_key = ?2";

impl DeliveryStore for Tx<'_> {
    fn find_by_key(&self, channel: &str, key: &str) -> Result<Option<(i64, String)>> {
        Ok(self
            .prepare_cached(KEY_LOOKUP_SQL)?
            .query_row([channel, key], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?)
    }

    fn stored_content(&self, delivery: i64) -> Result<StoredContent> {
        let mut content = self
            .prepare_cached(
                "SELECT channel, chat_id, sender, text, metadata, status
                 FROM outbound_deliveries WHERE id = ?1",
            )?
            .query_row([delivery], |r| {
                Ok(StoredContent {
                    channel: r.get(0)?,
                    chat_id: r.get(1)?,
                    sender: r.get(2)?,
                    text: r.get(3)?,
                    metadata: r.get(4)?,
                    status: r.get(5)?,
                    chunks: Vec::new(),
                })
            })?;
        let mut stmt = self.prepare_cached(concat!(
            "SELECT c.text FROM outbound_deliveries d",
            chunks_supplied!("?1"),
            "WHERE d.id = ?1 AND ",
            supplied!(seen),
            " ORDER BY c.id"
        ))?;
        content.chunks = stmt
            .query_map([delivery], |r| r.get::<_, Option<String>>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(content)
    }

    fn next_delivery_row(&self) -> Result<i64> {
        // Under the writer's lock: one past the largest row, which purge never removes.
        Ok(self
            .prepare_cached("SELECT coalesce(max(id), 0) + 1 FROM outbound_deliveries")?
            .query_row([], |r| r.get(0))?)
    }

    fn insert_delivery(&self, row: &NewRow<'_>) -> Result<bool> {
        let d = row.delivery;
        let stored = self
            .prepare_cached(
                "INSERT INTO outbound_deliveries
                 (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
                  created_at, updated_at, text, metadata, not_before)
             VALUES (?10, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8, ?9, ?11, ?12)
             ON CONFLICT (channel, idempotency_key) WHERE idempotency_key IS NOT NULL
             DO NOTHING",
            )?
            .execute(params![
                row.uid,
                d.channel,
                d.chat_id,
                d.sender,
                d.idempotency_key,
                if row.active { "pending" } else { "queued" },
                d.chunks.len() as i64,
                row.now,
                d.text,
                row.row,
                d.metadata,
                d.not_before,
            ])?;
        if stored == 0 {
            // Its caller key is taken. (Under the file's one writer the rules' check of
            // the key comes first; the answer is the store contract's all the same.)
            return Ok(false);
        }
        if !row.chunk_rows {
            return Ok(true);
        }
        let first_chunk = row.row * CHUNK_STRIDE;
        let mut chunk = self.prepare_cached(
            "INSERT INTO outbound_delivery_chunks
                 (id, delivery_id, chunk_index, status, due_at, text, channel_id)
             VALUES (?1, ?2, ?3, 'pending', ?4, ?5, ?6)",
        )?;
        for (index, text) in d.chunks.iter().enumerate() {
            // A chunk that is the whole text points at the delivery's copy (NULL).
            let text = (*text != d.text).then_some(text);
            let index = index as i64;
            let due = if index == 0 { row.head_due } else { None };
            chunk.execute(params![
                first_chunk + index,
                row.row,
                index,
                due,
                text,
                row.channel_id
            ])?;
        }
        Ok(true)
    }

    // One writer: the application's transaction on the file is the crate's, and
    // `enqueue_in` decides the lane there; nothing is ever staged.
    fn staged(&self, _limit: i64) -> Result<Vec<Staged>> {
        Ok(Vec::new())
    }

    fn staged_in_lane(&self, _lane: LaneRef<'_>) -> Result<Vec<Staged>> {
        Ok(Vec::new())
    }

    fn take_staged(&self, _row: i64) -> Result<bool> {
        Ok(false)
    }

    fn note_renumbered(&self, _old: i64, _new: i64) -> Result<()> {
        Ok(())
    }
}

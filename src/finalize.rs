//! Exactly-once finalization of a delivery into `outbound_messages`.

use rusqlite::{Connection, params};

use crate::ids::chunks_of_delivery;
use crate::policy::Stored;
use crate::{Result, lane};

/// Writes a fully delivered delivery to `outbound_messages` and marks it delivered, in the
/// caller's transaction (the one that recorded its last ack). `outbound_messages.delivery_id` is
/// UNIQUE, so a second finalization fails instead of writing a duplicate row.
pub(crate) fn finalize(
    tx: &Connection,
    rules: &Stored,
    delivery: i64,
    (channel, chat_id): (&str, &str),
    now: i64,
) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO outbound_messages
             (delivery_id, channel, chat_id, sender, content, chunk_count, created_at, delivered_at)
         SELECT uid, channel, chat_id, sender, text, chunk_count, created_at, ?2
         FROM outbound_deliveries WHERE id = ?1",
    )?
    .execute(params![delivery, now])?;
    tx.prepare_cached(
        "UPDATE outbound_deliveries
         SET status = 'delivered', delivered_count = chunk_count, updated_at = ?2, finished_at = ?2
         WHERE id = ?1",
    )?
    .execute(params![delivery, now])?;
    tx.prepare_cached(
        "INSERT INTO outbound_channel_stats (channel, delivered, last_delivered_at) VALUES (?1, 1, ?2)
         ON CONFLICT (channel) DO UPDATE
         SET delivered = delivered + 1, last_delivered_at = max(coalesce(last_delivered_at, ?2), ?2)",
    )?
    .execute(params![channel, now])?;
    lane::advance(tx, &rules.policy, channel, chat_id, now)
}

/// Unfinished deliveries whose chunks are all delivered.
pub(crate) const SWEEP_SQL: &str = concat!(
    "SELECT d.id, d.channel, d.chat_id FROM outbound_deliveries d
     WHERE d.status <> 'delivered' AND NOT EXISTS (
         SELECT 1 FROM outbound_delivery_chunks c
         WHERE c.status <> 'delivered' AND ",
    chunks_of_delivery!("c", "d.id"),
    ")"
);

/// Finalizes unfinished deliveries whose chunks are all delivered: what a crash in a
/// path that recorded chunk acks separately from finalization (an older outbox, a
/// manual repair) leaves behind. Reads only unfinished deliveries, never history.
pub(crate) fn sweep(tx: &Connection, rules: &Stored, now: i64) -> Result<u64> {
    let mut stmt = tx.prepare_cached(SWEEP_SQL)?;
    let done = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    for (delivery, channel, chat_id) in &done {
        finalize(tx, rules, *delivery, (channel, chat_id), now)?;
    }
    Ok(done.len() as u64)
}

//! Plain-text tables for the terminal.

use std::fmt::Write;

use chrono::{DateTime, SecondsFormat, Utc};
use chunked_outbox::{ChannelHealth, DeliveryView, Health};

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| t.to_rfc3339_opts(SecondsFormat::Secs, true),
    )
}

/// Left-aligned columns, widths from the content.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row.clone());
    }
    out
}

pub fn health(h: &Health) -> String {
    let header = [
        "channel",
        "deliveries",
        "delivered",
        "pending",
        "partial",
        "uncertain",
        "failed",
        "dead(unack)",
        "chunks:pending",
        "sending",
        "retry",
        "due",
        "expired",
        "oldest due",
    ];
    let row = |name: &str, c: &ChannelHealth| {
        vec![
            name.to_owned(),
            c.total_deliveries.to_string(),
            c.delivered_deliveries.to_string(),
            c.pending_deliveries.to_string(),
            c.partial_deliveries.to_string(),
            c.uncertain_deliveries.to_string(),
            c.failed_deliveries.to_string(),
            c.unacknowledged_dead_letters.to_string(),
            c.pending_chunks.to_string(),
            c.sending_chunks.to_string(),
            c.retry_chunks.to_string(),
            c.due_chunks.to_string(),
            c.expired_leases.to_string(),
            c.oldest_due_age_ms
                .map_or("-".to_owned(), |ms| format!("{:.1}s", ms as f64 / 1000.0)),
        ]
    };
    let mut rows: Vec<Vec<String>> = h.channels.iter().map(|(n, c)| row(n, c)).collect();
    rows.push(row("(all)", &h.totals));
    let mut out = table(&header, &rows);
    let _ = writeln!(
        out,
        "oldest unfinished: {}   last delivered: {}   at: {}",
        time(h.totals.oldest_unfinished_at),
        time(h.totals.last_delivered_at),
        time(Some(h.generated_at)),
    );
    out
}

pub fn list(deliveries: &[DeliveryView]) -> String {
    let rows: Vec<Vec<String>> = deliveries
        .iter()
        .map(|d| {
            vec![
                d.id.to_string(),
                d.channel.clone(),
                d.chat_id.clone(),
                d.status.to_string(),
                format!("{}/{}", d.delivered_count, d.chunk_count),
                time(Some(d.created_at)),
            ]
        })
        .collect();
    let mut out = table(
        &["delivery", "channel", "chat", "status", "chunks", "created"],
        &rows,
    );
    let _ = writeln!(
        out,
        "{} deliver{}",
        deliveries.len(),
        if deliveries.len() == 1 { "y" } else { "ies" }
    );
    out
}

pub fn show(d: &DeliveryView) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "delivery  {}", d.id);
    let _ = writeln!(out, "channel   {}   chat {}", d.channel, d.chat_id);
    let _ = writeln!(
        out,
        "status    {} ({}/{} chunks delivered)",
        d.status, d.delivered_count, d.chunk_count
    );
    let _ = writeln!(
        out,
        "created   {}   finished {}",
        time(Some(d.created_at)),
        time(d.finished_at)
    );
    if let Some(key) = &d.idempotency_key {
        let _ = writeln!(out, "caller key {key}");
    }
    let rows: Vec<Vec<String>> = d
        .chunks
        .iter()
        .map(|c| {
            vec![
                c.id.to_string(),
                c.index.to_string(),
                c.status.to_string(),
                c.attempts.to_string(),
                time(c.next_attempt_at.or(c.lease_until)),
                c.idempotency_key.clone(),
                c.last_error.clone().unwrap_or_else(|| "-".to_owned()),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "chunk",
            "index",
            "status",
            "attempts",
            "next attempt",
            "key",
            "last error",
        ],
        &rows,
    ));
    out
}

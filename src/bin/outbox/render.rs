//! Text for the terminal: tables that fit 100 columns (widths measured as a terminal
//! shows CJK and emoji), and every piece of stored text escaped so that a chat id, an
//! error or a message cannot drive the terminal.

use std::fmt::Write;

use chrono::{DateTime, SecondsFormat, Utc};
use chunked_outbox::monitoring::{ChannelHealth, DeliveryStatus, DeliveryView, Health};
use comfy_table::{ColumnConstraint, ContentArrangement, Table, presets};

/// The widest a table may be.
pub const WIDTH: u16 = 100;

/// `text` with control characters (terminal escapes among them) and the bidirectional
/// overrides that can disguise text written as `\u{..}` escapes.
pub fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let disguises = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || disguises {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| t.to_rfc3339_opts(SecondsFormat::Secs, true),
    )
}

/// Columns of free text, which may wrap; ids, keys, times and counts never do, so they
/// can be copied whole.
const WRAPS: &[&str] = &["channel", "chat", "last error", "error", "retry"];

/// A plain table (no borders) of at most [`WIDTH`] columns: long cells wrap, in the
/// columns of free text only ([`WRAPS`]).
pub fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_preset(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(WIDTH)
        .set_header(header.iter().copied());
    for row in rows {
        t.add_row(row);
    }
    for (i, name) in header.iter().enumerate() {
        if let Some(column) = t.column_mut(i) {
            // Flush left, two spaces between columns, none after the last.
            column.set_padding((0, if i + 1 < header.len() { 2 } else { 0 }));
            if !WRAPS.contains(name) {
                column.set_constraint(ColumnConstraint::ContentWidth);
            }
        }
    }
    let mut out = String::new();
    for line in t.lines() {
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

pub fn health(h: &Health) -> String {
    let mut names: Vec<(String, &ChannelHealth)> =
        h.channels.iter().map(|(n, c)| (clean(n), c)).collect();
    names.push(("(all)".into(), &h.totals));
    let deliveries = names
        .iter()
        .map(|(name, c)| {
            vec![
                name.clone(),
                c.total_deliveries.to_string(),
                c.delivered_deliveries.to_string(),
                c.pending_deliveries.to_string(),
                c.partial_deliveries.to_string(),
                c.uncertain_deliveries.to_string(),
                c.failed_deliveries.to_string(),
                c.unacknowledged_dead_letters.to_string(),
                c.corrupt_deliveries.to_string(),
            ]
        })
        .collect();
    let chunks = names
        .iter()
        .map(|(name, c)| {
            vec![
                name.clone(),
                c.pending_chunks.to_string(),
                c.sending_chunks.to_string(),
                c.retry_chunks.to_string(),
                c.uncertain_chunks.to_string(),
                c.due_chunks.to_string(),
                c.expired_leases.to_string(),
                c.oldest_due_age_ms
                    .map_or("-".to_owned(), |ms| format!("{:.1}s", ms as f64 / 1000.0)),
            ]
        })
        .collect();
    let mut out = String::from("deliveries\n");
    out.push_str(&table(
        &[
            "channel",
            "total",
            "delivered",
            "pending",
            "partial",
            "uncertain",
            "failed",
            "unacked",
            "corrupt",
        ],
        deliveries,
    ));
    out.push_str("chunks\n");
    out.push_str(&table(
        &[
            "channel",
            "pending",
            "sending",
            "retry",
            "uncertain",
            "due",
            "expired",
            "oldest due",
        ],
        chunks,
    ));
    let _ = writeln!(
        out,
        "oldest unfinished  {}   last delivered  {}",
        time(h.totals.oldest_unfinished_at),
        time(h.totals.last_delivered_at),
    );
    let _ = writeln!(
        out,
        "moving chunks      {}   awaiting a decision  {}   cancelled  {}   unfinalized  {}",
        h.totals.moving_chunks,
        h.totals.awaiting_decision,
        h.totals.cancelled_deliveries,
        h.totals.unfinalized_deliveries
    );
    let _ = writeln!(out, "snapshot at        {}", time(Some(h.generated_at)));
    let builds: Vec<String> = h
        .builds()
        .iter()
        .map(|(release, n)| format!("{} ({n})", clean(release)))
        .collect();
    if !builds.is_empty() {
        let _ = writeln!(out, "builds writing     {}", builds.join(", "));
    }
    if let Some(replica) = &h.replica {
        let lag = replica.replay_lag_ms.map_or("unknown".to_owned(), |ms| {
            format!("{:.1} s", ms as f64 / 1000.0)
        });
        let _ = writeln!(
            out,
            "read from a standby: its last replayed commit is {lag} old{}",
            if replica.replayed_all_received {
                ""
            } else {
                ", and it has WAL still to replay"
            }
        );
    }
    out
}

/// The processes writing an outbox, a line each: build, program, pid, host, when seen.
pub fn processes(processes: &[chunked_outbox::registry::Process], now: DateTime<Utc>) -> String {
    let mut out = String::new();
    for p in processes {
        let seen = (now - p.seen_at).num_seconds().max(0);
        let _ = writeln!(
            out,
            "  {}  {} pid {} on {}, seen {seen} s ago",
            clean(&p.release),
            clean(&p.program),
            p.pid,
            clean(&p.host)
        );
    }
    out
}

pub fn list(deliveries: &[DeliveryView]) -> String {
    let rows = deliveries
        .iter()
        .map(|d| {
            vec![
                d.id.to_string(),
                clean(&d.channel),
                clean(&d.chat_id),
                d.status.to_string(),
                format!("{}/{}", d.delivered_count, d.chunk_count),
                time(Some(d.created_at)),
            ]
        })
        .collect();
    let mut out = table(
        &["delivery", "channel", "chat", "status", "chunks", "created"],
        rows,
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
    let _ = writeln!(
        out,
        "channel   {}   chat {}",
        clean(&d.channel),
        clean(&d.chat_id)
    );
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
        let _ = writeln!(out, "caller key {}", clean(key));
    }
    if let Some(at) = d.not_before {
        let _ = writeln!(out, "not before {}", time(Some(at)));
    }
    if let Some(metadata) = &d.metadata {
        let _ = writeln!(out, "metadata  {}", clean(metadata));
    }
    if let Some(error) = &d.finalize_error {
        let _ = writeln!(
            out,
            "not finalized: the application's statement refused it: {}\n          (every chunk reached the chat; `outbox recover` finalizes it once the table takes it)",
            clean(error)
        );
    }
    if d.status == DeliveryStatus::Cancelled {
        let _ = writeln!(
            out,
            "cancelled before any of its chunks was sent; nothing of it reached the chat"
        );
        return out;
    }
    let rows = d
        .chunks
        .iter()
        .map(|c| {
            vec![
                (c.index + 1).to_string(),
                c.status.to_string(),
                c.attempts.to_string(),
                time(c.next_attempt_at.or(c.lease_until)),
                c.claimant.map_or("-".to_owned(), |c| c.to_string()),
                clean(c.last_error.as_deref().unwrap_or("-")),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "chunk",
            "status",
            "attempts",
            "next attempt / lease",
            "claimant",
            "last error",
        ],
        rows,
    ));
    for c in &d.chunks {
        if let Some(settlement) = &c.settlement {
            let _ = writeln!(out, "chunk {}: {}", c.index + 1, clean(settlement));
        }
    }
    let _ = writeln!(out, "a chunk's key is {}:<chunk>", d.id);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_text_cannot_drive_the_terminal() {
        assert_eq!(clean("ok \u{1b}[31mred"), "ok \\u{1b}[31mred");
        assert_eq!(clean("a\u{202e}b"), "a\\u{202e}b");
        assert_eq!(clean("日本語 🚀 é"), "日本語 🚀 é");
        assert_eq!(clean("line\nbreak"), "line\\u{a}break");
    }

    #[test]
    fn tables_fit_the_width_with_wide_characters() {
        let long = "日本語のチャット名".repeat(8);
        let rows = vec![vec![long.clone(), "🚀🚀🚀".into(), "x".repeat(80)]];
        let text = table(&["chat", "emoji", "error"], rows);
        for line in text.lines() {
            let width = unicode_width(line);
            assert!(width <= usize::from(WIDTH), "{width} columns: {line}");
        }
        assert!(text.contains("🚀🚀🚀"));

        let id = "01a2314a-10a7-7c1a-95a1-0d4e4d588cb8";
        let row = vec![vec![id.into(), long, "2026-01-01T00:00:00Z".into()]];
        let text = table(&["delivery", "chat", "created"], row);
        assert!(
            text.contains(id) && text.contains("2026-01-01T00:00:00Z"),
            "ids and times never wrap:\n{text}"
        );
    }

    /// Columns a terminal gives a line: two for wide (East Asian, emoji) characters.
    fn unicode_width(line: &str) -> usize {
        line.chars()
            .map(|c| match c as u32 {
                0x1100..=0x115f
                | 0x2e80..=0xa4cf
                | 0xac00..=0xd7a3
                | 0xf900..=0xfaff
                | 0xfe30..=0xfe4f
                | 0xff00..=0xff60
                | 0xffe0..=0xffe6
                | 0x1f300..=0x1faff => 2,
                _ => 1,
            })
            .sum()
    }
}

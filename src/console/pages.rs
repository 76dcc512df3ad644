//! The console's pages as markup: every value goes through maud, which escapes it.

use maud::{DOCTYPE, Markup, html};

use super::{BASE, Viewer};
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::health::{ChannelHealth, Health};
use crate::inspect::{Activity, ChunkView, DeliveryView};
use crate::rules::Rules;
use crate::status::{ChunkStatus, DeliveryStatus};

/// The style sheet (served at `/console/style.css`: the security policy allows no
/// inline style).
pub(super) const STYLE: &str = include_str!("style.css");

/// A chat whose lane holds queued replies, and what is ahead of them.
pub(crate) struct StuckChat {
    pub(crate) channel: String,
    pub(crate) chat_id: String,
    /// The lane's oldest unfinished reply that is not queued (with its parts).
    pub(crate) holder: Option<DeliveryView>,
    /// The replies waiting behind it, oldest first.
    pub(crate) queued: Vec<DeliveryView>,
}

/// The text of a notice after an action (`?done=…&n=…`); `None` for anything else.
pub(super) fn notice(done: &str, count: Option<&str>) -> Option<String> {
    let n: u64 = count.and_then(|n| n.parse().ok()).unwrap_or(1);
    let replies = if n == 1 { "reply" } else { "replies" };
    let parts = if n == 1 { "part" } else { "parts" };
    Some(match done {
        "requeued" => "Requeued: the reply goes out again.".into(),
        "resolved" => "Resolved as delivered: nothing was sent.".into(),
        "resent" => "Resent: the part goes out again under its key.".into(),
        "replayed" => format!("Resent {n} uncertain {parts}."),
        "requeued-all" => format!("Requeued {n} dead {replies}."),
        "dismissed" => format!("Dismissed {n} dead {replies}."),
        _ => return None,
    })
}

pub(super) fn layout(viewer: &Viewer, title: &str, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox" }
                link rel="stylesheet" href={ (BASE) "/style.css" };
            }
            body {
                nav {
                    a href=(BASE) { "Overview" }
                    a href={ (BASE) "/chats" } { "Chats" }
                    a href={ (BASE) "/uncertain" } { "Uncertain" }
                    a href={ (BASE) "/dead-letters" } { "Dead letters" }
                    a href={ (BASE) "/rules" } { "Rules" }
                    form method="get" action={ (BASE) "/deliveries" } {
                        label { "Reply id, caller key or chat " input type="search" name="id" required; }
                        button { "Show" }
                    }
                    @if let Some(csrf) = &viewer.csrf {
                        form.inline method="post" action={ (BASE) "/sign-out" } {
                            input type="hidden" name="csrf" value=(csrf);
                            button { "Sign out" }
                        }
                    } @else if viewer.actions_on {
                        a href={ (BASE) "/sign-in" } { "Sign in to act" }
                    }
                }
                @if let Some(notice) = &viewer.notice {
                    p.notice role="status" { (notice) }
                }
                h1 { (title) }
                (content)
            }
        }
    }
}

/// A page that only says something.
pub(super) fn message(viewer: &Viewer, title: &str, text: &str) -> Markup {
    layout(viewer, title, html! { p { (text) } })
}

/// A button that posts `fields` to the action `path`, with what it does beside it.
/// Shown only to a person who signed in.
fn action(
    viewer: &Viewer,
    path: &str,
    fields: &[(&str, &str)],
    button: &str,
    effect: Markup,
) -> Markup {
    action_asking(viewer, path, fields, None, button, effect)
}

/// [`action`] with a text field the person may fill in: `(name, label)`.
fn action_asking(
    viewer: &Viewer,
    path: &str,
    fields: &[(&str, &str)],
    asked: Option<(&str, &str)>,
    button: &str,
    effect: Markup,
) -> Markup {
    let Some(csrf) = &viewer.csrf else {
        return html! {};
    };
    html! {
        form.action method="post" action={ (BASE) "/actions/" (path) } {
            input type="hidden" name="csrf" value=(csrf);
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            @if let Some((name, label)) = asked {
                label { (label) " " input type="text" name=(name) size="14"; }
            }
            button { (button) }
            span.effect { (effect) }
        }
    }
}

/// A table's head of `names`.
fn columns(names: &[&str]) -> Markup {
    html! { thead { tr { @for name in names { th scope="col" { (name) } } } } }
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "–".into(),
        |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
    )
}

fn reply_link(view: &DeliveryView) -> Markup {
    html! { a href={ (BASE) "/deliveries/" (view.id) } { (view.id) } }
}

/// What the overview shows besides health: the rules (for each channel's pacing), the
/// channels paused as a whole, and the finished replies of the last hour and day.
pub(super) struct Overview {
    pub(super) health: Health,
    pub(super) rules: Rules,
    pub(super) pauses: BTreeMap<String, DateTime<Utc>>,
    pub(super) hour: Activity,
    pub(super) day: Activity,
}

pub(super) fn overview(viewer: &Viewer, o: &Overview) -> Markup {
    let row = |name: &str, c: &ChannelHealth, channel: bool| {
        html! {
            tr {
                th scope="row" { (name) }
                td { (c.due_chunks) }
                td { (c.moving_chunks) }
                td { (c.uncertain_chunks) }
                td { (c.unacknowledged_dead_letters) }
                td { (c.oldest_due_age_ms.map_or_else(|| "–".into(), duration)) }
                td { (c.finalized_total) }
                td { (time(c.last_delivered_at)) }
                td { @if channel { (pacing(&o.rules, name)) } }
                td { @if let Some(until) = o.pauses.get(name) { "until " (time(Some(*until))) } @else { "–" } }
            }
        }
    };
    layout(
        viewer,
        "Overview",
        html! {
            p {
                "Snapshot taken " (time(Some(o.health.generated_at))) ". "
                @let builds = o.health.builds();
                @if !builds.is_empty() {
                    "Builds writing: "
                    @for (i, (release, count)) in builds.iter().enumerate() {
                        @if i > 0 { ", " }
                        (release) " (" (count) ")"
                    }
                    "."
                }
            }
            table {
                (columns(&["channel", "due", "moving", "uncertain", "dead letters", "oldest due", "delivered", "last delivered", "pacing", "channel paused"]))
                tbody {
                    @for (name, channel) in &o.health.channels { (row(name, channel, true)) }
                    (row("all channels", &o.health.totals, false))
                }
            }
            h2 { "Replies finished" }
            p.legend {
                span.delivered { "■" } " delivered " span.failed { "■" } " failed for good; "
                span.mean { "■" } " mean and " span.max { "■" } " longest time from enqueue to delivery. "
                "From the stored rows: every host shows the same, and a restart loses nothing."
            }
            div.charts {
                (chart("The last hour, per minute", &o.hour))
                (chart("The last day, per half hour", &o.day))
            }
        },
    )
}

/// A channel's pacing as its rules set it.
fn pacing(rules: &Rules, channel: &str) -> String {
    let policy = rules.channel(channel);
    let mut parts = Vec::new();
    if !policy.lane_interval.is_zero() {
        parts.push(format!(
            "{} between sends to a chat",
            duration(policy.lane_interval.as_millis() as u64)
        ));
    }
    if !policy.channel_interval.is_zero() {
        let per_second = 1.0 / policy.channel_interval.as_secs_f64();
        parts.push(format!("at most {per_second:.4}/s on the channel").replace(".0000/", "/"));
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("; ")
    }
}

/// `ms` as a person reads it.
fn duration(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1e3),
        60_000..3_600_000 => format!("{:.1} min", ms as f64 / 6e4),
        _ => format!("{:.1} h", ms as f64 / 3.6e6),
    }
}

/// The two charts of one window: replies finished, and enqueue-to-delivery times.
fn chart(title: &str, activity: &Activity) -> Markup {
    let delivered: u64 = activity.buckets.iter().map(|b| b.delivered).sum();
    let failed: u64 = activity.buckets.iter().map(|b| b.failed).sum();
    let longest = activity
        .buckets
        .iter()
        .filter_map(|b| b.max_latency_ms)
        .max();
    let counts: Vec<(u64, u64)> = activity
        .buckets
        .iter()
        .map(|b| (b.delivered, b.failed))
        .collect();
    let times: Vec<(u64, u64)> = activity
        .buckets
        .iter()
        .map(|b| {
            let mean = b.mean_latency_ms.unwrap_or(0);
            (mean, b.max_latency_ms.unwrap_or(0).saturating_sub(mean))
        })
        .collect();
    let start = activity.since.format("%b %-d, %H:%M UTC").to_string();
    html! {
        figure {
            figcaption {
                strong { (title) } ": " (delivered) " delivered, " (failed) " failed"
                @if let Some(longest) = longest { "; the longest took " (duration(longest)) }
                "."
            }
            (bars(&counts, ("delivered", "failed"), &format!("{delivered} replies delivered and {failed} failed since {start}"), &start, |n| n.to_string()))
            (bars(&times, ("mean", "max"), &format!("time from enqueue to delivery since {start}"), &start, duration))
        }
    }
}

/// A bar chart of two stacked series, as inline SVG (no script, no style attribute: the
/// security policy allows neither), labelled with its largest value and its time span.
fn bars(
    values: &[(u64, u64)],
    (lower, upper): (&str, &str),
    label: &str,
    start: &str,
    unit: impl Fn(u64) -> String,
) -> Markup {
    const WIDTH: f64 = 480.0;
    const HEIGHT: f64 = 90.0;
    let top = values.iter().map(|(a, b)| a + b).max().unwrap_or(0).max(1);
    let step = WIDTH / values.len().max(1) as f64;
    let scale = |v: u64| v as f64 / top as f64 * HEIGHT;
    html! {
        svg.chart viewBox={ "0 0 " (WIDTH + 60.0) " " (HEIGHT + 18.0) } role="img" aria-label=(label) {
            line.axis x1="0" y1=(HEIGHT) x2=(WIDTH) y2=(HEIGHT) {}
            @for (n, (a, b)) in values.iter().enumerate() {
                @let x = n as f64 * step;
                @if *a > 0 {
                    rect class=(lower) x=(x) y=(HEIGHT - scale(*a)) width=(step * 0.85) height=(scale(*a)) {}
                }
                @if *b > 0 {
                    rect class=(upper) x=(x) y=(HEIGHT - scale(a + b)) width=(step * 0.85) height=(scale(*b)) {}
                }
            }
            text x=(WIDTH + 4.0) y="10" { (unit(top)) }
            text x=(WIDTH + 4.0) y=(HEIGHT) { "0" }
            text x="0" y=(HEIGHT + 14.0) { (start) }
            text x=(WIDTH) y=(HEIGHT + 14.0) text-anchor="end" { "now" }
        }
    }
}

/// Why a lane holds its queued replies, since when, and what frees it.
fn held_because(holder: Option<&DeliveryView>) -> (Markup, Markup) {
    let Some(holder) = holder else {
        return (
            html! { "Nothing unfinished is ahead of them: the next one starts when the lane next advances." },
            html! { code { "outbox recover" } " advances every lane now." },
        );
    };
    let part = holder
        .chunks
        .iter()
        .find(|c| c.status != ChunkStatus::Delivered);
    let number = part.map_or(0, |c| c.index + 1);
    let error = part
        .and_then(|c| c.last_error.as_deref())
        .unwrap_or("no error recorded");
    match holder.status {
        DeliveryStatus::Uncertain => (
            html! {
                "Part " (number) " of " (reply_link(holder)) " may or may not have reached the \
                 platform (" (error) "): the channel's replay policy holds it for a decision, \
                 and the lane failure policy " code { "block" } " the replies after it."
            },
            html! { "Resolve it as delivered, or resend it, on " (reply_link(holder)) "." },
        ),
        DeliveryStatus::Failed => (
            html! {
                "Reply " (reply_link(holder)) " failed for good (" (error) "), and the lane \
                 failure policy " code { "block" } " keeps the replies after it waiting."
            },
            html! { "Requeue or dismiss the dead letter." },
        ),
        DeliveryStatus::Unfinalized => (
            html! {
                "Every part of " (reply_link(holder)) " arrived, but the application's \
                 finalization statement refused its history row."
            },
            html! { "Fix the application's table, then " code { "outbox recover" } "." },
        ),
        _ => active_part(holder, part),
    }
}

/// Why an active reply's next part has not gone yet.
fn active_part(holder: &DeliveryView, part: Option<&ChunkView>) -> (Markup, Markup) {
    let Some(part) = part else {
        return (
            html! { "Reply " (reply_link(holder)) " is finishing." },
            html! { "Nothing: it goes on by itself." },
        );
    };
    let n = part.index + 1;
    match part.status {
        ChunkStatus::Sending => (
            html! {
                "Part " (n) " of " (reply_link(holder)) " was taken for sending, and its lease ran out at " (time(part.lease_until)) ": its dispatcher stopped or hangs."
            },
            html! { "Recovery: any running dispatcher's, or " code { "outbox recover" } "." },
        ),
        ChunkStatus::Retry => (
            html! {
                "Part " (n) " of " (reply_link(holder)) " failed (" (part.last_error.as_deref().unwrap_or("–"))
                ") and is retried at " (time(part.next_attempt_at)) "."
            },
            html! { "Time, or the platform coming back." },
        ),
        _ => (
            html! {
                "Part " (n) " of " (reply_link(holder)) " is due at " (time(part.next_attempt_at))
                " (the channel's pacing, a rate limit, or a delayed reply)."
            },
            html! { "A running dispatcher takes it when it is due." },
        ),
    }
}

pub(super) fn chats(viewer: &Viewer, chats: &[StuckChat]) -> Markup {
    layout(
        viewer,
        "Held chats",
        html! {
            p {
                "A chat's replies go out one at a time, in order. These chats have replies \
                 queued behind one that is not going out now, the longest wait first."
            }
            @if chats.is_empty() {
                p { "None: no chat has a reply held behind another." }
            } @else {
                table {
                    (columns(&["channel, chat", "waiting since", "queued", "why", "what frees it"]))
                    tbody {
                        @for chat in chats {
                            @let (why, frees) = held_because(chat.holder.as_ref());
                            tr {
                                td { (chat.channel) ", " (chat.chat_id) }
                                td { (time(chat.queued.first().map(|q| q.created_at))) }
                                td {
                                    (chat.queued.len())
                                    @for view in chat.queued.iter().take(3) { " " (reply_link(view)) }
                                }
                                td {
                                    (why)
                                    @if let Some(holder) = &chat.holder {
                                        " Since " (time(Some(holder.updated_at))) "."
                                    }
                                }
                                td { (frees) }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// What a list of uncertain replies or dead letters is narrowed to.
#[derive(Default)]
pub(super) struct Filter {
    /// Only this channel's.
    pub(super) channel: Option<String>,
    /// Only those whose last error contains this (ignoring case).
    pub(super) error: Option<String>,
}

/// The last error any part of a reply recorded.
pub(super) fn last_error(view: &DeliveryView) -> Option<&str> {
    view.chunks
        .iter()
        .rev()
        .find_map(|c| c.last_error.as_deref())
}

/// A table of replies: id, channel and chat, parts delivered, state or last error, and
/// when each was enqueued.
fn replies(views: &[DeliveryView], error_column: bool) -> Markup {
    html! {
        table {
            (columns(&["reply", "channel, chat", "parts delivered", if error_column { "last error" } else { "state" }, "enqueued", "seen"]))
            tbody {
                @for view in views {
                    tr {
                        td { (reply_link(view)) }
                        td { (view.channel) ", " (view.chat_id) }
                        td { (view.delivered_count) " of " (view.chunk_count) }
                        @if error_column {
                            td { (last_error(view).unwrap_or("–")) }
                        } @else {
                            td { (view.status.as_str()) }
                        }
                        td { (time(Some(view.created_at))) }
                        td { (if view.acknowledged_at.is_some() { "dismissed" } else { "–" }) }
                    }
                }
            }
        }
    }
}

/// The unfinished replies to chats of id `chat` (a search that found no reply by id or
/// caller key).
pub(super) fn chat(viewer: &Viewer, chat: &str, views: &[DeliveryView]) -> Markup {
    layout(
        viewer,
        &format!("Chat {chat}"),
        html! {
            p { "Its unfinished replies, newest first, on every channel. A delivered reply is found by its id or caller key." }
            (replies(views, false))
        },
    )
}

pub(super) fn waiting(
    viewer: &Viewer,
    status: DeliveryStatus,
    filter: &Filter,
    views: &[DeliveryView],
) -> Markup {
    let channel = filter.channel.as_deref();
    let uncertain = status == DeliveryStatus::Uncertain;
    let (title, back, what) = if uncertain {
        (
            "Uncertain replies",
            "/uncertain",
            html! {
                "A part of each may or may not have reached the platform; the channel's \
                 replay policy holds it for a decision (" code { "outbox resolve" } ")."
            },
        )
    } else {
        (
            "Dead letters",
            "/dead-letters",
            html! {
                "Replies that failed for good; " code { "outbox requeue" } " sends them again, "
                code { "outbox dismiss-dead-letters" } " marks them seen."
            },
        )
    };
    let back = format!("{BASE}{back}");
    let channel_field = channel.unwrap_or("");
    let scope = channel.map_or_else(|| "every channel".to_owned(), |c| format!("channel {c}"));
    layout(
        viewer,
        title,
        html! {
            p { (what) }
            form method="get" {
                label { "Channel " input type="search" name="channel" value=(channel_field); }
                label { "Error contains " input type="search" name="error" value=(filter.error.as_deref().unwrap_or("")); }
                button { "Filter" }
            }
            @if uncertain {
                @if let Some(channel) = channel {
                    (action(viewer, "replay", &[("channel", channel), ("back", &back)], &format!("Resend every uncertain part of {channel}"), html! {
                        "Sends each again under its key, up to 500 at once. Where the platform \
                         does not drop a repeat, a part that did arrive shows twice in its chat."
                    }))
                }
            } @else if filter.error.is_some() {
                @if viewer.csrf.is_some() {
                    p { "The buttons for all dead letters act on a whole channel, whatever their error: clear the error filter to see them. Each reply's page requeues that reply." }
                }
            } @else if !views.is_empty() {
                (action(viewer, "requeue-dead-letters", &[("channel", channel_field), ("back", &back)], &format!("Requeue the dead letters of {scope}"), html! {
                    "Sends each again with a fresh attempt budget; each rejoins its chat's lane."
                }))
                (action(viewer, "dismiss", &[("channel", channel_field), ("back", &back)], &format!("Dismiss the dead letters of {scope}"), html! {
                    "Sends nothing: marks them seen, so health stops counting them and a lane \
                     they hold (lane failure policy block) moves on. They stay listed and \
                     requeueable."
                }))
            }
            @if views.is_empty() {
                p { "None." }
            } @else {
                (replies(views, true))
            }
        },
    )
}

pub(super) fn story(viewer: &Viewer, view: &DeliveryView, with_text: bool) -> Markup {
    let back = format!("{BASE}/deliveries/{}", view.id);
    let id = view.id.to_string();
    let fields = [("delivery", id.as_str()), ("back", back.as_str())];
    layout(
        viewer,
        &format!("Reply {}", view.id),
        html! {
            dl {
                dt { "channel, chat" } dd { (view.channel) ", " (view.chat_id) }
                dt { "state" } dd.state { (view.status.as_str()) }
                dt { "parts delivered" } dd { (view.delivered_count) " of " (view.chunk_count) }
                dt { "caller key" } dd { (view.idempotency_key.as_deref().unwrap_or("–")) }
                dt { "enqueued" } dd { (time(Some(view.created_at))) }
                dt { "last change" } dd { (time(Some(view.updated_at))) }
                dt { "finished" } dd { (time(view.finished_at)) }
                @if let Some(error) = &view.finalize_error {
                    dt { "finalization refused" } dd { (error) }
                }
            }
            @match view.status {
                DeliveryStatus::Uncertain => {
                    (action_asking(viewer, "resolve", &fields, Some(("platform_id", "platform id (if known)")), "Resolve as delivered", html! {
                        "Sends nothing: records the part as delivered. Choose it when the chat \
                         shows the part; the reply's next part (or its history row) follows."
                    }))
                    (action(viewer, "resend", &fields, "Resend", html! {
                        "Sends the part again under the same key. Where the platform does not \
                         drop a repeat, a part that did arrive shows twice."
                    }))
                }
                DeliveryStatus::Failed => {
                    (action(viewer, "requeue", &fields, "Requeue", html! {
                        "Sends the failed part again with a fresh attempt budget; the reply \
                         rejoins its chat's lane behind what is ahead of it."
                    }))
                }
                _ => {}
            }
            @if with_text {
                h2 { "Text" }
                pre { (view.text) }
            } @else {
                p { a href={ (BASE) "/deliveries/" (view.id) "?text=1" } { "Show the reply's text" } }
            }
            h2 { "Parts" }
            table {
                (columns(&["part", "state", "attempts", "key", "last error", "next attempt", "delivered", "platform id"]))
                tbody {
                    @for chunk in &view.chunks {
                        tr {
                            td { (chunk.index + 1) }
                            td { (chunk.status.as_str()) }
                            td { (chunk.attempts) }
                            td { code { (chunk.idempotency_key) } }
                            td { (chunk.last_error.as_deref().unwrap_or("–")) }
                            td { (time(chunk.next_attempt_at)) }
                            td { (time(chunk.delivered_at)) }
                            td { (chunk.platform_message_id.as_deref().unwrap_or("–")) }
                        }
                    }
                }
            }
            @for chunk in view.chunks.iter().filter(|c| c.settlement.is_some()) {
                p.settlement {
                    "Part " (chunk.index + 1) ": "
                    (chunk.settlement.as_deref().unwrap_or_default())
                }
            }
        },
    )
}

pub(super) fn rules(viewer: &Viewer, rules: &Rules) -> Markup {
    layout(
        viewer,
        "Rules",
        html! {
            p {
                "As stored: every process on this outbox follows them. Read-only here; "
                code { "outbox config" } " changes them."
            }
            pre { (serde_json::to_string_pretty(rules).unwrap_or_default()) }
        },
    )
}

pub(super) fn sign_in(viewer: &Viewer, csrf: Option<&str>, failed: Option<&str>) -> Markup {
    layout(
        viewer,
        "Sign in",
        html! {
            @if let Some(csrf) = csrf {
                @if let Some(failed) = failed { p.notice role="alert" { (failed) } }
                p { "The token is the one " code { "outbox serve" } " was given (" code { "--console-token-file" } ")." }
                form method="post" action={ (BASE) "/sign-in" } {
                    input type="hidden" name="csrf" value=(csrf);
                    label { "Token " input type="password" name="token" autocomplete="current-password" required; }
                    button { "Sign in" }
                }
            } @else {
                p { "This console is read-only: it was started without an action token." }
            }
        },
    )
}

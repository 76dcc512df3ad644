//! An operator console: HTML pages over a live outbox, for the person on call (feature
//! `console`, part of `cli`; `outbox serve` mounts it under `/console`).
//!
//! This first part is read-only: the overview (what [`health`](crate::Outbox::health)
//! says, per channel), the replies that wait for a person (uncertain ones and dead
//! letters, newest first, filtered by channel), a reply's story (every part with its
//! state, attempts, keys, errors, times and platform ids; found by its id) and the
//! stored rules. Like [`Endpoint`](crate::monitoring::Endpoint) it answers a request
//! with a [`Response`], so any HTTP server can mount it; every answer is sent with
//! [`SECURITY_HEADERS`], every value is escaped (a reply whose text is `<script>`
//! renders as text), and a reply's text is shown only when asked for (`?text=1`).
//!
//! ```
//! use chunked_outbox::console::Console;
//! use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
//!
//! let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
//! outbox.enqueue(&NewDelivery::single("telegram", "42", "<b>hi</b>"))?;
//! let console = Console::new(outbox);
//! let page = console.respond("GET", "/console");
//! assert_eq!(page.status, 200);
//! assert!(page.body.contains("telegram"));
//! # Ok::<(), chunked_outbox::Error>(())
//! ```

use maud::{DOCTYPE, Markup, html};

use crate::health::{ChannelHealth, Health};
use crate::ids::DeliveryId;
use crate::inspect::{DeliveryView, ListFilter};
use crate::monitoring::Response;
use crate::outbox::Outbox;
use crate::status::DeliveryStatus;

/// Where the console's pages live; a server mounts every path under it.
pub const BASE: &str = "/console";

/// The headers every answer carries: no script runs, nothing is loaded from elsewhere,
/// no other site frames the pages, and no page's address leaves in a `Referer`.
pub const SECURITY_HEADERS: [(&str, &str); 4] = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
         frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
];

/// The console's style sheet (served at `/console/style.css`: the security policy
/// allows no inline style).
const STYLE: &str = include_str!("console/style.css");

/// The pages of the console, answered for one outbox.
#[derive(Clone)]
pub struct Console {
    outbox: Outbox,
    routes: std::sync::Arc<matchit::Router<Route>>,
}

/// The pages, by path.
#[derive(Clone, Copy)]
enum Route {
    Overview,
    Style,
    Delivery,
    Find,
    Waiting(DeliveryStatus),
    Rules,
}

const HTML: &str = "text/html; charset=utf-8";

/// The most replies a page of uncertain replies or dead letters lists (newest first).
const WAITING_LISTED: usize = 50;

impl Console {
    /// The console of `outbox`.
    pub fn new(outbox: Outbox) -> Self {
        let mut routes = matchit::Router::new();
        for (path, route) in [
            (BASE.to_owned(), Route::Overview),
            (format!("{BASE}/"), Route::Overview),
            (format!("{BASE}/style.css"), Route::Style),
            (format!("{BASE}/deliveries/{{id}}"), Route::Delivery),
            (format!("{BASE}/deliveries"), Route::Find),
            (
                format!("{BASE}/uncertain"),
                Route::Waiting(DeliveryStatus::Uncertain),
            ),
            (
                format!("{BASE}/dead-letters"),
                Route::Waiting(DeliveryStatus::Failed),
            ),
            (format!("{BASE}/rules"), Route::Rules),
        ] {
            // The paths are fixed and distinct.
            routes.insert(path, route).expect("distinct console routes");
        }
        Self {
            outbox,
            routes: std::sync::Arc::new(routes),
        }
    }

    /// The answer to `method` on `target` (a path with its query string). It blocks for
    /// one read transaction of the outbox.
    pub fn respond(&self, method: &str, target: &str) -> Response {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let Ok(found) = self.routes.at(path) else {
            return not_found("No such page.");
        };
        if method != "GET" && method != "HEAD" {
            return Response {
                status: 405,
                content_type: "text/plain; charset=utf-8",
                body: "the console is read-only: only GET\n".into(),
            };
        }
        match found.value {
            Route::Style => Response {
                status: 200,
                content_type: "text/css; charset=utf-8",
                body: STYLE.into(),
            },
            Route::Overview => match self.outbox.health() {
                Ok(health) => ok(overview(&health)),
                Err(e) => unreadable(&e),
            },
            Route::Delivery => self.delivery(found.params.get("id"), query),
            Route::Find => self.delivery(parameter(query, "id").as_deref(), query),
            &Route::Waiting(status) => {
                let mut filter = ListFilter::default().status(status).limit(WAITING_LISTED);
                let channel = parameter(query, "channel").filter(|c| !c.is_empty());
                if let Some(channel) = &channel {
                    filter = filter.channel(channel.clone());
                }
                // Listed without their parts; each one's story tells its last error.
                let views = self.outbox.list(&filter).and_then(|listed| {
                    listed
                        .into_iter()
                        .map(|view| Ok(self.outbox.delivery(view.id)?.unwrap_or(view)))
                        .collect::<crate::Result<Vec<_>>>()
                });
                match views {
                    Ok(views) => ok(waiting(status, channel.as_deref(), &views)),
                    Err(e) => unreadable(&e),
                }
            }
            Route::Rules => match self.outbox.rules() {
                Ok(rules) => ok(layout(
                    "Rules",
                    html! {
                        p {
                            "As stored: every process on this outbox follows them. Read-only \
                             here; " code { "outbox config" } " changes them."
                        }
                        pre { (serde_json::to_string_pretty(&rules).unwrap_or_default()) }
                    },
                )),
                Err(e) => unreadable(&e),
            },
        }
    }

    /// A reply's story, by its id as text.
    fn delivery(&self, id: Option<&str>, query: &str) -> Response {
        let Some(id) = id.and_then(|id| id.trim().parse::<DeliveryId>().ok()) else {
            return not_found("That is not a delivery id.");
        };
        match self.outbox.delivery(id) {
            Ok(Some(view)) => ok(story(&view, asked_for_text(query))),
            Ok(None) => not_found("No reply has that id (it may have been purged)."),
            Err(e) => unreadable(&e),
        }
    }
}

/// Whether the query asks for the reply's text (`text=1`).
fn asked_for_text(query: &str) -> bool {
    parameter(query, "text").as_deref() == Some("1")
}

/// The value of `name` in a query string, decoded.
fn parameter(query: &str, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

fn ok(body: Markup) -> Response {
    Response {
        status: 200,
        content_type: HTML,
        body: body.into_string(),
    }
}

fn not_found(why: &str) -> Response {
    Response {
        status: 404,
        content_type: HTML,
        body: layout("Not found", html! { p { (why) } }).into_string(),
    }
}

fn unreadable(e: &crate::Error) -> Response {
    Response {
        status: 503,
        content_type: HTML,
        body: layout(
            "Cannot read the outbox",
            html! { p { "The outbox cannot be read: " (e.to_string()) } },
        )
        .into_string(),
    }
}

fn layout(title: &str, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · outbox" }
                link rel="stylesheet" href={ (BASE) "/style.css" };
            }
            body {
                nav {
                    a href=(BASE) { "Overview" }
                    a href={ (BASE) "/uncertain" } { "Uncertain" }
                    a href={ (BASE) "/dead-letters" } { "Dead letters" }
                    a href={ (BASE) "/rules" } { "Rules" }
                    form method="get" action={ (BASE) "/deliveries" } {
                        label { "Reply id " input type="search" name="id" required; }
                        button { "Show" }
                    }
                }
                h1 { (title) }
                (content)
            }
        }
    }
}

/// A table's head of `names`.
fn columns(names: &[&str]) -> Markup {
    html! { thead { tr { @for name in names { th scope="col" { (name) } } } } }
}

fn time(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map_or_else(
        || "–".into(),
        |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
    )
}

fn overview(health: &Health) -> Markup {
    let row = |name: &str, c: &ChannelHealth| {
        html! {
            tr {
                th scope="row" { (name) }
                td { (c.due_chunks) }
                td { (c.moving_chunks) }
                td { (c.uncertain_chunks) }
                td { (c.unacknowledged_dead_letters) }
                td { (c.oldest_due_age_ms.map_or_else(|| "–".into(), |ms| format!("{} s", ms / 1000))) }
                td { (c.finalized_total) }
                td { (time(c.last_delivered_at)) }
            }
        }
    };
    layout(
        "Overview",
        html! {
            p { "Snapshot taken " (time(Some(health.generated_at))) "." }
            table {
                (columns(&["channel", "due", "moving", "uncertain", "dead letters", "oldest due", "delivered", "last delivered"]))
                tbody {
                    @for (name, channel) in &health.channels { (row(name, channel)) }
                    (row("all channels", &health.totals))
                }
            }
        },
    )
}

fn waiting(status: DeliveryStatus, channel: Option<&str>, views: &[DeliveryView]) -> Markup {
    let (title, what) = match status {
        DeliveryStatus::Uncertain => (
            "Uncertain replies",
            html! {
                "A part of each may or may not have reached the platform; the channel's \
                 replay policy holds it for a decision (" code { "outbox resolve" } ")."
            },
        ),
        _ => (
            "Dead letters",
            html! {
                "Replies that failed for good; " code { "outbox requeue" } " sends them again, "
                code { "outbox dismiss-dead-letters" } " acknowledges them."
            },
        ),
    };
    layout(
        title,
        html! {
            p { (what) }
            form method="get" {
                label { "Channel " input type="search" name="channel" value=(channel.unwrap_or("")); }
                button { "Filter" }
            }
            @if views.is_empty() {
                p { "None." }
            } @else {
                table {
                    (columns(&["reply", "channel, chat", "parts delivered", "last error", "enqueued"]))
                    tbody {
                        @for view in views {
                            tr {
                                td { a href={ (BASE) "/deliveries/" (view.id) } { (view.id) } }
                                td { (view.channel) ", " (view.chat_id) }
                                td { (view.delivered_count) " of " (view.chunk_count) }
                                td { (view.chunks.iter().rev().find_map(|c| c.last_error.as_deref()).unwrap_or("–")) }
                                td { (time(Some(view.created_at))) }
                            }
                        }
                    }
                }
            }
        },
    )
}

fn story(view: &DeliveryView, with_text: bool) -> Markup {
    layout(
        &format!("Reply {}", view.id),
        html! {
            dl {
                dt { "channel, chat" } dd { (view.channel) ", " (view.chat_id) }
                dt { "state" } dd { (view.status.as_str()) }
                dt { "parts delivered" } dd { (view.delivered_count) " of " (view.chunk_count) }
                dt { "caller key" } dd { (view.idempotency_key.as_deref().unwrap_or("–")) }
                dt { "enqueued" } dd { (time(Some(view.created_at))) }
                dt { "finished" } dd { (time(view.finished_at)) }
                @if let Some(error) = &view.finalize_error {
                    dt { "finalization refused" } dd { (error) }
                }
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
                            td { (chunk.index) }
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
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NewDelivery, OutboxOptions};

    fn console_with(text: &str) -> (Console, DeliveryId) {
        let outbox = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        let id = outbox
            .enqueue(&NewDelivery::single("<i>chan</i>", "42", text))
            .unwrap()
            .id;
        (Console::new(outbox), id)
    }

    #[test]
    fn every_value_is_escaped() {
        let (console, id) = console_with("<script>alert(1)</script>");
        let page = console.respond("GET", &format!("/console/deliveries/{id}?text=1"));
        assert_eq!(page.status, 200);
        assert!(!page.body.contains("<script>"), "{}", page.body);
        assert!(page.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        let overview = console.respond("GET", "/console");
        assert!(!overview.body.contains("<i>chan</i>"));
        assert!(overview.body.contains("&lt;i&gt;chan&lt;/i&gt;"));
    }

    #[test]
    fn the_text_is_shown_only_when_asked_for() {
        let (console, id) = console_with("a secret reply");
        let page = console.respond("GET", &format!("/console/deliveries/{id}"));
        assert_eq!(page.status, 200);
        assert!(!page.body.contains("a secret reply"));
        assert!(page.body.contains("Show the reply"));
        let asked = console.respond("GET", &format!("/console/deliveries/{id}?text=1"));
        assert!(asked.body.contains("a secret reply"));
    }

    #[test]
    fn unknown_pages_ids_and_methods_are_refused() {
        let (console, _) = console_with("x");
        assert_eq!(console.respond("GET", "/console/nowhere").status, 404);
        assert_eq!(
            console.respond("GET", "/console/deliveries/nope").status,
            404
        );
        let absent = "01890a5d-ac96-774b-bcce-b302099a8057";
        assert_eq!(
            console
                .respond("GET", &format!("/console/deliveries/{absent}"))
                .status,
            404
        );
        assert_eq!(console.respond("POST", "/console").status, 405);
        assert_eq!(console.respond("GET", "/console/style.css").status, 200);
    }

    #[test]
    fn dead_letters_and_uncertain_replies_are_listed_by_channel() {
        let outbox = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        for channel in ["telegram", "discord"] {
            outbox
                .enqueue(&NewDelivery::single(channel, "7", "x"))
                .unwrap();
            let claim = outbox.claim(1).unwrap().pop().unwrap();
            outbox
                .record_error_text(&claim, "Forbidden: bot was blocked by the user")
                .unwrap();
        }
        let console = Console::new(outbox);
        let all = console.respond("GET", "/console/dead-letters");
        assert_eq!(all.status, 200);
        assert_eq!(
            all.body.matches("bot was blocked").count(),
            2,
            "{}",
            all.body
        );
        let one = console.respond("GET", "/console/dead-letters?channel=discord");
        assert_eq!(
            one.body.matches("bot was blocked").count(),
            1,
            "{}",
            one.body
        );
        assert!(one.body.contains("discord, 7") && !one.body.contains("telegram, 7"));
        let uncertain = console.respond("GET", "/console/uncertain");
        assert!(uncertain.body.contains("None."), "{}", uncertain.body);
    }

    #[test]
    fn a_reply_is_found_by_its_id_and_the_rules_are_shown() {
        let (console, id) = console_with("x");
        let found = console.respond("GET", &format!("/console/deliveries?id=+{id}+"));
        assert_eq!(found.status, 200);
        assert!(found.body.contains(&id.to_string()));
        assert_eq!(
            console.respond("GET", "/console/deliveries?id=").status,
            404
        );
        let rules = console.respond("GET", "/console/rules");
        assert!(rules.body.contains("lane_order"), "{}", rules.body);
    }

    #[test]
    fn the_overview_counts_per_channel() {
        let (console, _) = console_with("x");
        let page = console.respond("GET", "/console/");
        assert_eq!(page.status, 200);
        // one due part on the channel and in the totals
        assert_eq!(page.body.matches("<td>1</td>").count(), 4, "{}", page.body);
    }
}

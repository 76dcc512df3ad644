//! An operator console: HTML pages over a live outbox, for the person on call (feature
//! `console`, part of `cli`; `outbox serve` mounts it under `/console`).
//!
//! This first part is read-only: the overview (what [`health`](crate::Outbox::health)
//! says, per channel) and a reply's story (every part with its state, attempts, keys,
//! errors, times and platform ids). Like [`Endpoint`](crate::monitoring::Endpoint) it
//! answers a request as a value, so any HTTP server can mount it; every answer carries
//! its security headers, every value is escaped (a reply whose text is `<script>`
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
use crate::inspect::DeliveryView;
use crate::outbox::Outbox;

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
}

/// A console's answer, for the server to send as it is, with [`SECURITY_HEADERS`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// 200; 404 for an unknown page or reply; 405 for a method other than `GET`; 503
    /// when the outbox cannot be read.
    pub status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

const HTML: &str = "text/html; charset=utf-8";

impl Console {
    /// The console of `outbox`.
    pub fn new(outbox: Outbox) -> Self {
        let mut routes = matchit::Router::new();
        for (path, route) in [
            (BASE.to_owned(), Route::Overview),
            (format!("{BASE}/"), Route::Overview),
            (format!("{BASE}/style.css"), Route::Style),
            (format!("{BASE}/deliveries/{{id}}"), Route::Delivery),
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
    pub fn respond(&self, method: &str, target: &str) -> Page {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let Ok(found) = self.routes.at(path) else {
            return not_found("No such page.");
        };
        if method != "GET" && method != "HEAD" {
            return Page {
                status: 405,
                content_type: "text/plain; charset=utf-8",
                body: "the console is read-only: only GET\n".into(),
            };
        }
        match found.value {
            Route::Style => Page {
                status: 200,
                content_type: "text/css; charset=utf-8",
                body: STYLE.into(),
            },
            Route::Overview => match self.outbox.health() {
                Ok(health) => ok(overview(&health)),
                Err(e) => unreadable(&e),
            },
            Route::Delivery => {
                let Some(id) = found
                    .params
                    .get("id")
                    .and_then(|id| id.parse::<DeliveryId>().ok())
                else {
                    return not_found("That is not a delivery id.");
                };
                match self.outbox.delivery(id) {
                    Ok(Some(view)) => ok(story(&view, asked_for_text(query))),
                    Ok(None) => not_found("No reply has that id (it may have been purged)."),
                    Err(e) => unreadable(&e),
                }
            }
        }
    }
}

/// Whether the query asks for the reply's text (`text=1`).
fn asked_for_text(query: &str) -> bool {
    query.split('&').any(|pair| pair == "text=1")
}

fn ok(body: Markup) -> Page {
    Page {
        status: 200,
        content_type: HTML,
        body: body.into_string(),
    }
}

fn not_found(why: &str) -> Page {
    Page {
        status: 404,
        content_type: HTML,
        body: layout("Not found", html! { p { (why) } }).into_string(),
    }
}

fn unreadable(e: &crate::Error) -> Page {
    Page {
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
                nav { a href=(BASE) { "Overview" } }
                h1 { (title) }
                (content)
            }
        }
    }
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
                thead {
                    tr {
                        th scope="col" { "channel" }
                        th scope="col" { "due" }
                        th scope="col" { "moving" }
                        th scope="col" { "uncertain" }
                        th scope="col" { "dead letters" }
                        th scope="col" { "oldest due" }
                        th scope="col" { "delivered" }
                        th scope="col" { "last delivered" }
                    }
                }
                tbody {
                    @for (name, channel) in &health.channels { (row(name, channel)) }
                    (row("all channels", &health.totals))
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
                thead {
                    tr {
                        th scope="col" { "part" }
                        th scope="col" { "state" }
                        th scope="col" { "attempts" }
                        th scope="col" { "key" }
                        th scope="col" { "last error" }
                        th scope="col" { "next attempt" }
                        th scope="col" { "delivered" }
                        th scope="col" { "platform id" }
                    }
                }
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
    fn the_overview_counts_per_channel() {
        let (console, _) = console_with("x");
        let page = console.respond("GET", "/console/");
        assert_eq!(page.status, 200);
        // one due part on the channel and in the totals
        assert_eq!(page.body.matches("<td>1</td>").count(), 4, "{}", page.body);
    }
}

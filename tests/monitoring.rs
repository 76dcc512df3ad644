//! The health verdict's thresholds, and the HTTP endpoint mounted in an application's
//! own axum server, read with a real HTTP client.

use std::sync::Arc;
use std::time::Duration;

use chunked_outbox::clock::ManualClock;
use chunked_outbox::monitoring::{Level, Thresholds};
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome, Result};

mod common;
use common::{TestDb, fresh_outbox, stores};

fn outbox_at(clock: &ManualClock) -> Outbox {
    let options = OutboxOptions::default()
        .with_clock(Arc::new(clock.clone()))
        .with_lease(Duration::from_secs(30));
    fresh_outbox(options)
}

fn level(outbox: &Outbox, thresholds: &Thresholds) -> (Level, Vec<String>) {
    let v = outbox.health().unwrap().verdict(thresholds);
    (v.level, v.reasons)
}

/// The endpoint as an application mounts it: an axum fallback route on its own
/// runtime, each answer read on the blocking pool.
#[cfg(feature = "tokio")]
fn serve(endpoint: chunked_outbox::monitoring::Endpoint) -> (tokio::runtime::Runtime, String) {
    use axum::http::{StatusCode, Uri, header::CONTENT_TYPE};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let endpoint = Arc::new(endpoint);
    let app = axum::Router::new().fallback(move |uri: Uri| {
        let endpoint = endpoint.clone();
        async move {
            let r = endpoint.respond_async(uri.path()).await;
            (
                StatusCode::from_u16(r.status).unwrap(),
                [(CONTENT_TYPE, r.content_type)],
                r.body,
            )
        }
    });
    runtime.spawn(async move { axum::serve(listener, app).await });
    (runtime, base)
}

stores! {
    /// A row set aside as unreadable (here its uid rewritten by hand) fails health
    /// whatever the dead-letter threshold.
    fn a_row_set_aside_as_corrupt_fails_whatever_the_dead_letter_threshold() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default());
        let outbox = &db.outbox;
        let id = outbox
            .enqueue(&NewDelivery::single("telegram", "42", "hello"))?
            .id;
        db.exec(&format!(
            "UPDATE outbound_deliveries SET uid = 'not-a-uuid' WHERE uid = '{id}'"
        ));
        assert!(outbox.claim(1)?.is_empty(), "the claim sets it aside");
        let one_dead_letter = Thresholds::default().with_fail_dead_letters(1);
        assert_eq!(
            level(outbox, &one_dead_letter),
            (Level::Fail, vec!["1 corrupt rows set aside".into()])
        );
        Ok(())
    }


    fn a_chunk_due_too_long_warns_only_past_the_threshold() -> Result<()> {
        let clock = ManualClock::new(1_767_225_600_000);
        let outbox = outbox_at(&clock);
        outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
        let five_minutes = Thresholds::default();
        assert_eq!(level(&outbox, &five_minutes), (Level::Ok, vec![]));

        clock.advance(Duration::from_secs(300));
        assert_eq!(level(&outbox, &five_minutes).0, Level::Ok, "at the limit");
        clock.advance(Duration::from_secs(1));
        assert_eq!(
            level(&outbox, &five_minutes),
            (Level::Warn, vec!["a chunk has been due for 5m 1s".into()])
        );
        let ten_minutes = Thresholds::default().with_warn_due_age(Duration::from_secs(600));
        assert_eq!(level(&outbox, &ten_minutes).0, Level::Ok);
        Ok(())
    }

    fn expired_leases_warn_and_uncertain_chunks_fail() -> Result<()> {
        let clock = ManualClock::new(1_767_225_600_000);
        let outbox = outbox_at(&clock);
        for chat in ["1", "2"] {
            outbox.enqueue(&NewDelivery::single("telegram", chat, "hello"))?;
        }
        let claims = outbox.claim(2)?;
        clock.advance(Duration::from_secs(31));
        let strict = Thresholds::default().with_warn_due_age(Duration::from_secs(3600));
        assert_eq!(
            level(&outbox, &strict),
            (Level::Warn, vec!["2 expired leases".into()])
        );
        let lenient = strict.clone().with_warn_expired_leases(2);
        assert_eq!(level(&outbox, &lenient).0, Level::Ok);

        for claim in &claims {
            let error = "socket closed after write".to_owned();
            outbox.record(claim, Outcome::Ambiguous { error })?;
        }
        assert_eq!(
            level(&outbox, &strict),
            (Level::Fail, vec!["2 uncertain chunks".into()])
        );
        let tolerant = strict.with_fail_uncertain(2);
        assert_eq!(level(&outbox, &tolerant).0, Level::Ok);
        Ok(())
    }

    fn the_worst_reason_decides_and_every_reason_is_named() -> Result<()> {
        let clock = ManualClock::new(1_767_225_600_000);
        let outbox = outbox_at(&clock);
        for chat in ["1", "2"] {
            outbox.enqueue(&NewDelivery::single("telegram", chat, "hello"))?;
        }
        let mut claims = outbox.claim(2)?;
        let dead = claims.pop().unwrap();
        let error = "403 Forbidden: bot was blocked by the user".to_owned();
        outbox.record(&dead, Outcome::Permanent { error })?;
        clock.advance(Duration::from_secs(31)); // the other lease runs out
        let verdict = outbox.health()?.verdict(&Thresholds::default());
        assert_eq!(verdict.level, Level::Fail);
        assert_eq!(
            verdict.to_string(),
            "fail: 1 unacknowledged dead letters; 1 expired leases"
        );
        Ok(())
    }
}

/// The endpoint in an application's axum server (feature `tokio`), on both stores.
#[cfg(feature = "tokio")]
mod endpoint {
    use super::*;
    use chunked_outbox::monitoring::Endpoint;
    use common::Place;

    stores! {
    fn the_endpoint_mounted_in_axum_answers_a_real_client() -> Result<()> {
            let place = Place::new();
            let outbox = place.open(OutboxOptions::default())?;
            outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
            outbox.enqueue(&NewDelivery::single("telegram", "43", "hello"))?;
            let (_runtime, base) = serve(Endpoint::new(outbox.clone(), Thresholds::default()));
            let client = reqwest::blocking::Client::new();
            let get = |path: &str| {
                let r = client.get(format!("{base}{path}")).send().unwrap();
                let kind = r.headers()["content-type"].to_str().unwrap().to_owned();
                (r.status().as_u16(), kind, r.text().unwrap())
            };

            let (status, kind, body) = get("/metrics");
            assert_eq!((status, kind.as_str()), (200, "text/plain; version=0.0.4"));
            assert!(
                body.contains("outbox_pending_chunks{channel=\"telegram\"} 2"),
                "{body}"
            );
            assert!(body.contains("outbox_file_finalized_total"), "{body}");
            assert!(body.contains("_bucket{"), "{body}");
            assert_eq!(get("/healthz").0, 200);
            let (status, kind, body) = get("/health.json");
            assert_eq!((status, kind.as_str()), (200, "application/json"));
            let json: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(json["pending_chunks"], 2);

            // A dead letter written by another process on the file turns /healthz to 503.
            let other = place.open(OutboxOptions::default())?;
            let claim = other.claim(1)?.pop().unwrap();
            let error = "400 Bad Request: chat not found".to_owned();
            other.record(&claim, Outcome::Permanent { error })?;
            let (status, _, body) = get("/healthz?probe=lb");
            assert_eq!(
                (status, body.as_str()),
                (503, "fail: 1 unacknowledged dead letters\n")
            );
            assert_eq!(get("/nothing-here").0, 404);
            Ok(())
        }
    }
}

/// The operator console in an application's own axum server (features `tokio` and
/// `console`): the application hands each request under `/console` to
/// `Console::respond` and sends back what it answers, headers included.
#[cfg(all(feature = "tokio", feature = "console"))]
mod console_mounted {
    use super::*;
    use std::net::SocketAddr;

    use axum::body::{Body, Bytes};
    use axum::extract::ConnectInfo;
    use axum::http::{HeaderMap, Method, Uri};
    use chunked_outbox::console::{Console, FORWARDING_HEADERS, Request};
    use chunked_outbox::monitoring::{DeliveryStatus, ListFilter};

    fn mount(console: Console) -> (tokio::runtime::Runtime, String) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let console = Arc::new(console);
        let page = move |ConnectInfo(peer): ConnectInfo<SocketAddr>,
                         method: Method,
                         uri: Uri,
                         headers: HeaderMap,
                         body: Bytes| {
            let console = console.clone();
            async move {
                // A page is a database read: off the runtime's workers.
                let answer = tokio::task::spawn_blocking(move || {
                    // Every header the console decides by: the Host (421 for a name
                    // not its own), the cookie, where a form came from, and whether a
                    // proxy forwarded it; and the peer's address: who can have sent it.
                    let value = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
                    let forwarded = FORWARDING_HEADERS.iter().find_map(|name| value(name));
                    let request = Request {
                        method: method.as_str(),
                        target: uri.path_and_query().map_or("/", |p| p.as_str()),
                        host: value("host"),
                        cookie: value("cookie"),
                        origin: value("origin"),
                        fetch_site: value("sec-fetch-site"),
                        peer: Some(peer.ip()),
                        owner: false,
                        forwarded,
                        https: false,
                        body: &body,
                    };
                    console.respond(&request)
                })
                .await
                .unwrap();
                let mut response = axum::http::Response::builder().status(answer.status);
                for (name, value) in answer.headers {
                    response = response.header(name, value);
                }
                response.body(Body::from(answer.body)).unwrap()
            }
        };
        let app = axum::Router::new()
            .route("/console", axum::routing::any(page.clone()))
            .route("/console/{*rest}", axum::routing::any(page));
        runtime.spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        (runtime, base)
    }

    stores! {
        fn the_console_mounted_in_axum_signs_in_and_acts() -> Result<()> {
            let db = TestDb::on_system_clock(OutboxOptions::default());
            let outbox = db.outbox.clone();
            let id = outbox
                .enqueue(&NewDelivery::single("telegram", "42", "hello"))?
                .id;
            let claim = outbox.claim(1)?.remove(0);
            outbox.record(&claim, Outcome::Permanent { error: "chat not found".into() })?;
            let client = reqwest::blocking::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap();
            // Without a token, a console over TCP shows nothing, even on loopback: every
            // account of the machine reaches the port.
            let (_open, open_base) = mount(Console::new(outbox.clone()));
            let open = client.get(format!("{open_base}/console/dead-letters")).send().unwrap();
            assert_eq!(open.status().as_u16(), 403);
            assert!(!open.text().unwrap().contains("chat not found"));
            let console = Console::new(outbox.clone()).with_actions("an-application-chosen-token")?;
            let (_runtime, base) = mount(console);
            // Nothing is read before the sign-in; a rebinding page's name is refused.
            let page = client.get(format!("{base}/console/dead-letters")).send().unwrap();
            assert_eq!(page.status().as_u16(), 303);
            assert!(page.headers()["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
            let rebound = client
                .get(format!("{base}/console/sign-in"))
                .header("host", "rebind.example")
                .send()
                .unwrap();
            assert_eq!(rebound.status().as_u16(), 421);

            let form = client.get(format!("{base}/console/sign-in")).send().unwrap().text().unwrap();
            let at = form.find("name=\"csrf\" value=\"").unwrap() + 19;
            let csrf = &form[at..at + 32];
            // Through a proxy over plain HTTP the token would cross a network in clear:
            // the sign-in is refused before the token is looked at.
            let proxied = client
                .post(format!("{base}/console/sign-in"))
                .header("x-forwarded-for", "203.0.113.9")
                .body(format!("csrf={csrf}&token=an-application-chosen-token"))
                .send()
                .unwrap();
            assert_eq!(proxied.status().as_u16(), 403);
            assert!(proxied.headers().get("set-cookie").is_none());
            assert!(proxied.text().unwrap().contains("in clear"));
            let signed = client
                .post(format!("{base}/console/sign-in"))
                .body(format!("csrf={csrf}&token=an-application-chosen-token"))
                .send()
                .unwrap();
            assert_eq!(signed.status().as_u16(), 303);
            let cookie = signed.headers()["set-cookie"].to_str().unwrap();
            let cookie = cookie.split(';').next().unwrap().to_owned();
            let page = client
                .get(format!("{base}/console/dead-letters"))
                .header("cookie", &cookie)
                .send()
                .unwrap()
                .text()
                .unwrap();
            assert!(page.contains("chat not found"));
            let at = page.find("name=\"csrf\" value=\"").unwrap() + 19;
            let csrf = &page[at..at + 32];
            let acted = client
                .post(format!("{base}/console/actions/requeue"))
                .header("cookie", &cookie)
                .body(format!("csrf={csrf}&delivery={id}"))
                .send()
                .unwrap();
            assert_eq!(acted.status().as_u16(), 303);
            let failed = outbox.list(&ListFilter::default().status(DeliveryStatus::Failed))?;
            assert!(failed.is_empty());
            assert_eq!(outbox.delivery(id)?.unwrap().status, DeliveryStatus::Pending);
            Ok(())
        }
    }
}

//! The adapter end to end: a slack-morphism client pointed at an emulated Slack Web API
//! on 127.0.0.1 that enforces Slack's documented behaviour for `chat.postMessage` —
//! text of at most 40,000 characters, `ratelimited` with a `Retry-After` header, unknown
//! and archived channels, bad and deactivated tokens, `internal_error`, a post that is
//! made but never answered — and every outcome recorded in a real outbox.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::platforms::slack::slack_morphism::SlackAdapter;
use chunked_outbox::{DeliveryId, NewDelivery, Outbox, OutboxOptions};
use common::emulator;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use slack_morphism::prelude::*;

const TOKEN: &str = "xoxb-good";

/// One post the emulator accepted.
#[derive(Debug, Clone)]
struct Posted {
    channel: String,
    body: Value,
}

/// The emulated Web API. Channels choose the behaviour: C404 does not exist, CARCH is
/// archived, C429 is rate limited (3 s), C500 fails inside Slack, C777 posts and answers
/// too late. The token `xoxb-inactive` belongs to a deactivated account.
struct SlackApi {
    url: String,
    posted: Arc<Mutex<Vec<Posted>>>,
}

impl SlackApi {
    fn start() -> SlackApi {
        let posted = Arc::new(Mutex::new(Vec::new()));
        let url = format!("{}/api", emulator::serve(posted.clone(), answer));
        SlackApi { url, posted }
    }

    fn adapter(&self, token: &str) -> SlackAdapter<SlackClientHyperConnector<HttpConnector>> {
        adapter_at(&self.url, token)
    }

    fn posted(&self) -> Vec<Posted> {
        self.posted.lock().unwrap().clone()
    }
}

fn adapter_at(url: &str, token: &str) -> SlackAdapter<SlackClientHyperConnector<HttpConnector>> {
    let connector =
        SlackClientHyperConnector::with_connector(HttpConnector::new()).with_slack_api_url(url);
    let client = Arc::new(SlackClient::new(connector));
    SlackAdapter::new(client, SlackApiToken::new(token.to_owned().into()))
        .with_timeout(Duration::from_millis(500))
}

fn answer(mut request: tiny_http::Request, log: &Mutex<Vec<Posted>>) {
    let body = emulator::json_body(&mut request);
    let url = request.url().to_owned();
    let token = emulator::header(&request, "Authorization")
        .map(|t| t.trim_start_matches("Bearer ").to_owned())
        .unwrap_or_default();
    let respond = |status: u16, body: Value, retry_after: Option<&str>| {
        let headers: &[(&str, &str)] = match retry_after {
            Some(wait) => &[("Retry-After", wait)],
            None => &[],
        };
        emulator::respond(request, status, &body.to_string(), headers);
    };
    let error = |code: &str| json!({"ok": false, "error": code});
    if !url.starts_with("/api/chat.postMessage") {
        return respond(404, error("unknown_method"), None);
    }
    let channel = body["channel"].as_str().unwrap_or_default().to_owned();
    let text = body["text"].as_str().unwrap_or_default().to_owned();
    match (token.as_str(), channel.as_str()) {
        ("xoxb-inactive", _) => return respond(200, error("account_inactive"), None),
        (t, _) if t != TOKEN => return respond(200, error("invalid_auth"), None),
        (_, "C404") => return respond(200, error("channel_not_found"), None),
        (_, "CARCH") => return respond(200, error("is_archived"), None),
        (_, "C429") => return respond(429, error("ratelimited"), Some("3")),
        (_, "C500") => return respond(200, error("internal_error"), None),
        _ if text.chars().count() > 40_000 => return respond(200, error("msg_too_long"), None),
        _ => {}
    }
    let ts = {
        let mut log = log.lock().unwrap();
        log.push(Posted {
            channel: channel.clone(),
            body: body.clone(),
        });
        format!("1700000000.{:06}", log.len())
    };
    if channel == "C777" {
        // Posted, but the answer comes after the client gave up.
        std::thread::sleep(Duration::from_secs(2));
    }
    respond(
        200,
        json!({"ok": true, "channel": channel, "ts": ts,
               "message": {"type": "message", "text": text, "ts": ts, "bot_id": "B1"}}),
        None,
    );
}

fn state(outbox: &Outbox, id: DeliveryId) -> (DeliveryStatus, ChunkStatus, u32, String) {
    let view = outbox.delivery(id).unwrap().unwrap();
    let c = &view.chunks[0];
    (
        view.status,
        c.status,
        c.attempts,
        c.last_error.clone().unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_answer_becomes_the_right_outcome() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let ids = emulator::hello_each(
        &outbox,
        "slack",
        &["C1", "C404", "CARCH", "C429", "C500", "C777"],
    );
    let too_long = outbox
        .enqueue(&NewDelivery::single("slack", "C2", "a".repeat(40_001)))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;

    let delivered = outbox.delivery(ids["C1"]).unwrap().unwrap();
    assert_eq!(delivered.status, DeliveryStatus::Delivered);
    assert_eq!(
        delivered.chunks[0].platform_message_id.as_deref(),
        Some("1700000000.000001")
    );

    for (id, code) in [
        (ids["C404"], "channel_not_found"),
        (ids["CARCH"], "is_archived"),
        (too_long, "msg_too_long"),
    ] {
        let (status, _, _, error) = state(&outbox, id);
        assert_eq!(status, DeliveryStatus::Failed, "{error}");
        assert!(error.contains(code), "{error}");
    }
    let (_, chunk, attempts, _) = state(&outbox, ids["C429"]);
    assert_eq!(
        (chunk, attempts),
        (ChunkStatus::Retry, 0),
        "paused, attempt given back"
    );
    let view = outbox.delivery(ids["C429"]).unwrap().unwrap();
    let wait = view.chunks[0].next_attempt_at.unwrap() - chrono::Utc::now();
    assert!(
        wait.num_milliseconds() > 1_500,
        "the Retry-After header's 3 s: {wait}"
    );

    // Slack failed inside, or never answered: it may have posted, so held.
    for channel in ["C500", "C777"] {
        assert_eq!(
            state(&outbox, ids[channel]).1,
            ChunkStatus::Uncertain,
            "{channel}"
        );
    }
    assert!(
        api.posted().iter().any(|p| p.channel == "C777"),
        "Slack has it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_problems_are_permanent_and_an_unreachable_api_is_transient() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    for (token, code) in [
        ("xoxb-wrong", "invalid_auth"),
        ("xoxb-inactive", "account_inactive"),
    ] {
        let id = outbox
            .enqueue(&NewDelivery::single("slack", "C1", "hi"))
            .unwrap()
            .id;
        emulator::send_due(&outbox, &api.adapter(token)).await;
        let (status, _, _, error) = state(&outbox, id);
        assert_eq!(status, DeliveryStatus::Failed);
        assert!(error.contains(code), "{error}");
    }

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/api", closed.local_addr().unwrap());
    drop(closed);
    let id = outbox
        .enqueue(&NewDelivery::single("slack", "C1", "again"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &adapter_at(&url, TOKEN)).await;
    let (_, chunk, attempts, error) = state(&outbox, id);
    assert_eq!((chunk, attempts), (ChunkStatus::Retry, 1), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chunk_goes_into_the_thread_from_the_metadata() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let adapter = api.adapter(TOKEN);
    let reply = NewDelivery::chunked("slack", "C1", "a b", ["a", "b"])
        .with_metadata(r#"{"thread_ts": "1503435956.000247"}"#);
    let id = outbox.enqueue(&reply).unwrap().id;
    emulator::send_due(&outbox, &adapter).await;
    emulator::send_due(&outbox, &adapter).await;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Delivered
    );
    let posted = api.posted();
    assert_eq!(posted.len(), 2);
    assert!(
        posted
            .iter()
            .all(|p| p.body["thread_ts"] == "1503435956.000247"),
        "{posted:?}"
    );
}

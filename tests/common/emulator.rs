//! An emulated platform HTTP API on 127.0.0.1, for the adapters' end-to-end tests.

use std::collections::HashMap;
use std::sync::Arc;

use chunked_outbox::{DeliveryId, NewDelivery, Outbox};

/// Enqueues `hello {chat}` to each of `chats` on `channel`, in one transaction (so a
/// dispatcher sees them all at once); the delivery id of each chat.
pub fn hello_each<'a>(
    outbox: &Outbox,
    channel: &str,
    chats: &[&'a str],
) -> HashMap<&'a str, DeliveryId> {
    let replies: Vec<NewDelivery> = chats
        .iter()
        .map(|chat| NewDelivery::single(channel, *chat, format!("hello {chat}")))
        .collect();
    let stored = outbox.enqueue_batch(&replies).unwrap();
    chats
        .iter()
        .copied()
        .zip(stored.iter().map(|e| e.id))
        .collect()
}

/// Starts a server on a free port of 127.0.0.1 that answers every request on its own
/// thread (so one answer held back does not hold the others) with `answer`, which
/// shares `state`. Returns `http://127.0.0.1:PORT`.
pub fn serve<S: Send + Sync + 'static>(
    state: Arc<S>,
    answer: fn(tiny_http::Request, &S),
) -> String {
    let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("bind 127.0.0.1"));
    let url = format!(
        "http://{}",
        server.server_addr().to_ip().expect("an IP address")
    );
    std::thread::spawn(move || {
        for request in server.incoming_requests() {
            let state = state.clone();
            std::thread::spawn(move || answer(request, &state));
        }
    });
    url
}

/// The request's body as JSON (`Null` if it is not JSON).
pub fn json_body(request: &mut tiny_http::Request) -> serde_json::Value {
    let mut raw = String::new();
    let _ = request.as_reader().read_to_string(&mut raw);
    serde_json::from_str(&raw).unwrap_or(serde_json::Value::Null)
}

/// A Bot API `sendMessage` for `token`: the request with its JSON body, chat id (as
/// text) and text. Any other request is answered 401, as Telegram answers a bad token,
/// and gives `None`.
pub fn telegram_send(
    mut request: tiny_http::Request,
    token: &str,
) -> Option<(tiny_http::Request, serde_json::Value, String, String)> {
    let body = json_body(&mut request);
    if !request
        .url()
        .eq_ignore_ascii_case(&format!("/bot{token}/sendMessage"))
    {
        let unauthorized =
            serde_json::json!({"ok": false, "error_code": 401, "description": "Unauthorized"});
        respond(request, 401, &unauthorized.to_string(), &[]);
        return None;
    }
    let chat = match &body["chat_id"] {
        serde_json::Value::Number(n) => n.to_string(),
        other => other.as_str().unwrap_or_default().to_owned(),
    };
    let text = body["text"].as_str().unwrap_or_default().to_owned();
    Some((request, body, chat, text))
}

/// The value of a request header, if present.
pub fn header(request: &tiny_http::Request, name: &'static str) -> Option<String> {
    request
        .headers()
        .iter()
        .find(|h| h.field.equiv(name))
        .map(|h| h.value.as_str().to_owned())
}

/// Answers with `status`, a JSON (or other) `body`, and extra `headers`.
pub fn respond(request: tiny_http::Request, status: u16, body: &str, headers: &[(&str, &str)]) {
    let mut response = tiny_http::Response::from_string(body)
        .with_status_code(status)
        .with_header(tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap());
    for (name, value) in headers {
        response = response.with_header(tiny_http::Header::from_bytes(*name, *value).unwrap());
    }
    let _ = request.respond(response);
}

/// Claims every due chunk, sends each through `adapter` and records its outcome;
/// returns how many it sent.
pub async fn send_due(
    outbox: &chunked_outbox::Outbox,
    adapter: &impl chunked_outbox::AsyncChannelAdapter,
) -> usize {
    let claims = outbox.claim(100).expect("claim");
    for claim in &claims {
        let outcome = adapter.send(claim).await;
        outbox.record(claim, outcome).expect("record");
    }
    claims.len()
}

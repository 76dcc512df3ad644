//! What the dispatcher logs: ids, outcomes and statuses at `info`, message text only at
//! `debug`.
//!
//! A file of its own, so this is the only test in its process: `tracing` caches per
//! call site whether anyone listens, and tests on other threads with no subscriber
//! could otherwise leave a span switched off while this one captures logs.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, Outcome, Result};
use common::*;

/// Fails the first attempt (so the retry path logs too), then delivers.
struct FlakyOnce;

impl ChannelAdapter for FlakyOnce {
    fn send(&self, claim: &Claim) -> Outcome {
        if claim.attempt == 1 {
            Outcome::Transient {
                error: "503".into(),
            }
        } else {
            Outcome::delivered(None)
        }
    }
}

/// A log sink for `tracing_subscriber` that keeps everything written to it.
#[derive(Clone, Default)]
struct LogSink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Rejects every send for good.
struct Gone;

impl ChannelAdapter for Gone {
    fn send(&self, _: &Claim) -> Outcome {
        Outcome::Permanent {
            error: "Forbidden: bot was blocked by the user".into(),
        }
    }
}

/// Enqueues `text`, dispatches it to the end in this thread (moving the manual clock
/// past the retry) with logs captured at `level`; the delivery id and the logs.
fn dispatch_logged(level: tracing::Level, text: &str) -> (chunked_outbox::DeliveryId, String) {
    dispatch_logged_to(FlakyOnce, level, text)
}

fn dispatch_logged_to(
    adapter: impl ChannelAdapter + 'static,
    level: tracing::Level,
    text: &str,
) -> (chunked_outbox::DeliveryId, String) {
    let db = TestDb::default();
    let id = enqueue(&db.outbox, "1", &[text]);
    let dispatcher = Dispatcher::builder(db.outbox.clone())
        .adapter("telegram", adapter)
        .build()
        .expect("build dispatcher");
    let sink = LogSink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        while view(&db.outbox, id).finished_at.is_none() {
            if dispatcher.run_once().expect("run_once") == 0 {
                db.advance(Duration::from_secs(1));
            }
        }
    });
    let logs = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (id, logs)
}

#[test]
fn message_text_is_logged_only_at_debug_level() -> Result<()> {
    let secret = "my bank PIN is 4711";
    let (id, info) = dispatch_logged(tracing::Level::INFO, secret);
    assert!(
        info.contains("reply finalized") && info.contains(&id.to_string()),
        "the finished reply is logged with its id: {info}"
    );
    assert!(
        !info.contains("transient") && !info.contains("recorded"),
        "one line per chunk is for debug level: {info}"
    );
    assert!(
        !info.contains(secret),
        "message text leaked at info level:\n{info}"
    );
    let (_, debug) = dispatch_logged(tracing::Level::DEBUG, secret);
    assert!(
        debug.contains(secret) && debug.contains("transient") && debug.contains("recorded"),
        "debug level shows each chunk and the text for troubleshooting: {debug}"
    );

    // A dead letter needs attention: it is a warning, naming the delivery and outcome.
    let (id, warnings) = dispatch_logged_to(Gone, tracing::Level::WARN, secret);
    assert!(
        warnings.contains("chunk needs attention")
            && warnings.contains(&id.to_string())
            && warnings.contains("outcome=\"permanent\""),
        "{warnings}"
    );
    Ok(())
}

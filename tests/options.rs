//! Options out of range are refused when the outbox is opened (or the dispatcher
//! built), with `InvalidInput` naming the option, before anything exists on disk: a
//! zero lease would hand one chunk to two claimers, zero attempts or an empty schedule
//! leave nothing to follow, and a NaN jitter would make every due time NaN.

mod common;

use std::time::Duration;

use chunked_outbox::rules::{Backoff, RetryPolicy};
use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, Error, Outbox, OutboxOptions, Outcome};

fn retry(change: impl FnOnce(&mut RetryPolicy)) -> OutboxOptions {
    let mut policy = RetryPolicy::default();
    change(&mut policy);
    OutboxOptions::default().with_retry(policy)
}

fn refused(options: OutboxOptions, what: &str, says: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    for result in [
        Outbox::open(&path, options.clone()).map(drop),
        Outbox::open_in_memory(options).map(drop),
    ] {
        match result {
            Err(e @ Error::InvalidInput { .. }) => {
                let text = e.to_string();
                assert!(text.contains(what) && text.contains(says), "{text}");
            }
            other => panic!("{what}: expected InvalidInput, got {other:?}"),
        }
    }
    assert!(!path.exists(), "{what}: nothing may be created");
}

#[test]
fn options_out_of_range_are_refused_before_anything_is_created() {
    refused(
        OutboxOptions::default().with_lease(Duration::ZERO),
        "lease",
        "1 ms",
    );
    refused(
        OutboxOptions::default().with_lease(Duration::from_micros(900)),
        "lease",
        "1 ms",
    );
    refused(
        retry(|r| r.max_attempts = 0),
        "retry policy",
        "max_attempts",
    );
    refused(
        retry(|r| r.backoff = Backoff::Schedule(Vec::new())),
        "retry policy",
        "empty",
    );
    refused(retry(|r| r.jitter = f64::NAN), "retry policy", "jitter");
    refused(retry(|r| r.jitter = 1.5), "retry policy", "jitter");
    refused(retry(|r| r.jitter = -0.1), "retry policy", "jitter");
    for factor in [f64::NAN, f64::INFINITY, 0.5] {
        refused(
            retry(|r| {
                r.backoff = Backoff::Exponential {
                    base: Duration::from_secs(1),
                    factor,
                    cap: Duration::from_secs(60),
                }
            }),
            "retry policy",
            "factor",
        );
    }
    refused(
        retry(|r| r.max_age = Some(Duration::ZERO)),
        "retry policy",
        "max_age",
    );
    refused(
        OutboxOptions::default().with_background_checkpoints(Some(Duration::ZERO)),
        "background checkpoints",
        "zero",
    );
}

#[test]
fn the_edges_of_each_range_are_accepted() {
    for options in [
        OutboxOptions::default().with_lease(Duration::from_millis(1)),
        retry(|r| r.max_attempts = 1),
        retry(|r| r.jitter = 0.0),
        retry(|r| r.jitter = 1.0),
        retry(|r| r.backoff = Backoff::Schedule(vec![Duration::ZERO])),
        retry(|r| {
            r.backoff = Backoff::Exponential {
                base: Duration::ZERO,
                factor: 1.0,
                cap: Duration::ZERO,
            }
        }),
        retry(|r| r.max_age = Some(Duration::from_millis(1))),
        OutboxOptions::default().with_background_checkpoints(None),
    ] {
        Outbox::open_in_memory(options).expect("accepted");
    }
}

struct Ok_;
impl ChannelAdapter for Ok_ {
    fn send(&self, _: &Claim) -> Outcome {
        Outcome::delivered(None)
    }
}

#[test]
fn dispatcher_settings_out_of_range_are_refused_at_build() {
    let outbox = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
    let builder = || Dispatcher::builder(outbox.clone()).adapter("t", Ok_);
    for (built, what) in [
        (builder().workers(0).build(), "workers"),
        (builder().batch_size(0).build(), "batch size"),
        (builder().batch_size(1025).build(), "batch size"),
        (
            builder().poll_interval(Duration::ZERO).build(),
            "poll interval",
        ),
        (
            builder().send_timeout(Some(Duration::ZERO)).build(),
            "send timeout",
        ),
        (Dispatcher::builder(outbox.clone()).build(), "adapters"),
    ] {
        match built {
            Err(e @ Error::InvalidInput { .. }) => assert!(e.to_string().contains(what), "{e}"),
            other => panic!("{what}: expected InvalidInput, got {other:?}"),
        }
    }
    builder()
        .batch_size(1024)
        .send_timeout(Some(Duration::from_millis(1)))
        .build()
        .unwrap();
}

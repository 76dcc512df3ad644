//! Ready adapters for the client libraries bot authors use, each behind a feature of
//! the same name so the core stays lean: they send through the application's existing
//! client and map that library's error types (never their `Display` text) to an
//! [`Outcome`](crate::Outcome). Each is tested end to end against an emulated platform
//! API on 127.0.0.1 that enforces the platform's documented limits.
//!
//! | feature | module | platform | client |
//! |---|---|---|---|
//! | `teloxide` | [`teloxide`] | Telegram Bot API | `teloxide_core::Bot` |
//! | `serenity` | [`serenity`] | Discord REST API | `serenity::http::Http` |
//! | `slack-morphism` | [`slack_morphism`] | Slack Web API | `slack_morphism::SlackClient` |

#[cfg(feature = "serenity")]
pub mod serenity;
#[cfg(feature = "slack-morphism")]
pub mod slack_morphism;
#[cfg(feature = "teloxide")]
pub mod teloxide;

/// The adapter's options in a claim's metadata (JSON; unknown fields are ignored), or
/// the defaults when the delivery has none.
fn options_from<T: serde::de::DeserializeOwned + Default>(
    claim: &crate::claim::Claim,
) -> Result<T, String> {
    match &claim.metadata {
        None => Ok(T::default()),
        Some(metadata) => serde_json::from_str(metadata)
            .map_err(|e| format!("metadata is not the adapter's JSON: {e}")),
    }
}

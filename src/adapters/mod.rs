//! The ready adapters' implementations; each is public through its platform's module
//! in [`platforms`](crate::platforms).

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

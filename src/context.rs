//! The context bound: the most tokens, prompt and generated together, that one sequence
//! may hold. It is the model's `max_position_embeddings`, or less when asked
//! (`--context`, [`crate::experts::SourceOptions::context`]). The command line, the
//! `engine::Engine` and the server all bound a sequence with these two
//! functions: a prompt that fills the context is refused with the numbers
//! ([`Error::ContextFull`]), and generation stops at the context with finish reason
//! `length` (`generate::generate`).

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// The context for `requested` tokens on the model `cfg`: `requested`, capped at the
/// model's `max_position_embeddings` when the config gives one (with a warning, since
/// positions past it are ones the model was not trained on).
pub fn limit(requested: usize, cfg: &ModelConfig) -> usize {
    match cfg.max_position_embeddings {
        Some(max) if requested > max => {
            tracing::warn!(
                requested,
                max_position_embeddings = max,
                "the context asked for is longer than the model's; using the model's"
            );
            max
        }
        _ => requested,
    }
}

/// How many new tokens a sequence holding `held` tokens may still take in a context of
/// `context` tokens. Errors: [`Error::ContextFull`] when there is no room for one.
pub fn room(held: usize, context: usize) -> Result<usize> {
    match context.checked_sub(held) {
        Some(room) if room > 0 => Ok(room),
        _ => Err(Error::ContextFull {
            prompt: held,
            context,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_what_the_context_leaves() {
        assert_eq!(room(0, 4096).unwrap(), 4096);
        assert_eq!(room(4095, 4096).unwrap(), 1);
        for held in [4096, 6003] {
            let e = room(held, 4096).unwrap_err();
            assert!(
                matches!(e, Error::ContextFull { prompt, context: 4096 } if prompt == held),
                "{e}"
            );
            assert!(e.to_string().contains(&held.to_string()), "{e}");
        }
    }
}

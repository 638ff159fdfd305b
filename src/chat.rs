//! Multi-turn chat that keeps the conversation's model state between turns: a new turn
//! feeds only the tokens after what the state has already seen, instead of re-reading
//! the whole conversation.
//!
//! Earlier replies are kept as the exact ids that were generated (as the reference system
//! splices them, reference-system.md B.5): a new turn renders the whole conversation
//! with the chat template, and only the text after what the state has seen (the
//! end-of-turn marker and the new message) is tokenized and run. When the rendering does
//! not extend the previous one (a template that rewrites history), the conversation is
//! tokenized and read again from the start.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::experts::ExpertSource;
use crate::generate::{generate, GenerateOptions, GenerateStats};
use crate::model::{Model, SequenceState};
use crate::tokenizer::{ChatTemplate, Message, StreamDecoder, Tokenizer};

/// One conversation with its model state.
pub struct Conversation<B: Backend> {
    pub messages: Vec<Message>,
    state: SequenceState<B>,
    /// The rendered text of the conversation so far (the template's output plus replies).
    text: String,
    /// Its ids: prompts as tokenized, replies as generated. The state has run all of
    /// them but possibly the last reply token (sampled, not yet run).
    history: Vec<u32>,
}

/// What one turn did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Turn {
    pub reply: String,
    /// The conversation's ids the reply was generated from.
    pub input_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// Prompt tokens taken from the kept state rather than re-read.
    pub reused_tokens: usize,
    /// Prompt tokens run through the model for this turn.
    pub prompt_tokens: usize,
    pub stats: GenerateStats,
}

impl<B: Backend> Conversation<B> {
    pub fn new(model: &Model<B>, backend: &B) -> Self {
        Conversation {
            messages: Vec::new(),
            state: model.new_state(backend),
            text: String::new(),
            history: Vec::new(),
        }
    }

    /// Adds the user's `text`, generates the reply (streamed to `on_text`) and keeps it.
    /// Errors: a template or forward-pass error; the conversation is unchanged by a turn
    /// that failed before generating.
    #[allow(clippy::too_many_arguments)]
    pub fn turn<E: ExpertSource>(
        &mut self,
        model: &Model<B>,
        backend: &B,
        experts: &E,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        text: &str,
        options: &GenerateOptions,
        mut on_text: impl FnMut(&str),
    ) -> Result<Turn> {
        let mut messages = self.messages.clone();
        messages.push(Message {
            role: "user".into(),
            content: text.into(),
        });
        let rendered = template.render(&messages)?;
        let (ids, reused) = match rendered.strip_prefix(self.text.as_str()) {
            Some(new_text)
                if !self.text.is_empty() && self.history.starts_with(&self.state.tokens) =>
            {
                let mut ids = self.history.clone();
                ids.extend(tokenizer.encode(new_text)?);
                (ids, self.state.tokens.len())
            }
            _ => {
                self.state = model.new_state(backend);
                (tokenizer.encode(&rendered)?, 0)
            }
        };
        let result = self.run_turn(
            model,
            backend,
            experts,
            tokenizer,
            options,
            &ids,
            reused,
            &mut on_text,
        );
        let (reply, output_ids, stats) = match result {
            Ok(r) => r,
            Err(e) => {
                // The state may be part-way through the turn: the next turn re-reads.
                self.state = model.new_state(backend);
                self.text.clear();
                self.history.clear();
                return Err(e);
            }
        };
        let prompt_tokens = ids.len() - reused;
        messages.push(Message {
            role: "assistant".into(),
            content: reply.clone(),
        });
        self.messages = messages;
        self.text = rendered + &reply;
        self.history = ids.clone();
        self.history.extend_from_slice(&output_ids);
        Ok(Turn {
            reply,
            input_ids: ids.clone(),
            output_ids,
            reused_tokens: reused,
            prompt_tokens,
            stats,
        })
    }

    /// Generates from `ids[reused..]` after the kept state.
    #[allow(clippy::too_many_arguments)]
    fn run_turn<E: ExpertSource>(
        &mut self,
        model: &Model<B>,
        backend: &B,
        experts: &E,
        tokenizer: &Tokenizer,
        options: &GenerateOptions,
        ids: &[u32],
        reused: usize,
        on_text: &mut impl FnMut(&str),
    ) -> Result<(String, Vec<u32>, GenerateStats)> {
        let prompt = &ids[reused..];
        if prompt.is_empty() {
            return Err(Error::InvalidInput(
                "the rendered conversation adds no tokens".into(),
            ));
        }
        let mut decoder = StreamDecoder::new();
        let mut reply = String::new();
        let (output_ids, stats) = generate(
            model,
            backend,
            experts,
            &mut self.state,
            prompt,
            options,
            |id| {
                let piece = decoder.push(tokenizer, id)?;
                on_text(&piece);
                reply.push_str(&piece);
                Ok(true)
            },
        )?;
        let tail = decoder.finish(tokenizer)?;
        on_text(&tail);
        reply.push_str(&tail);
        Ok((reply, output_ids, stats))
    }
}

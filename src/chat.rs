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
use crate::chat_template::{Chat, ChatTemplate, Message, Rendered};
use crate::error::{Error, Result};
use crate::experts::ExpertSource;
use crate::generate::{generate, GenerateOptions, GenerateStats};
use crate::model::{Model, SequenceState};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// One conversation with its model state.
pub struct Conversation<B: Backend> {
    /// The messages so far, with the template's variables (and tools).
    pub chat: Chat,
    /// How many of `chat.messages` the conversation started with (a system prompt):
    /// [`Conversation::reset`] goes back to them.
    start: usize,
    state: SequenceState<B>,
    /// The rendered conversation so far (the template's output plus replies).
    text: Rendered,
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
    /// A conversation starting from `chat` (usually no messages, or a system prompt, and
    /// the template's variables such as `enable_thinking`).
    pub fn new(model: &Model<B>, backend: &B, chat: Chat) -> Self {
        Conversation {
            start: chat.messages.len(),
            chat,
            state: model.new_state(backend),
            text: Rendered::default(),
            history: Vec::new(),
        }
    }

    /// Forgets the turns (keeping the messages the conversation started with) and the
    /// model state.
    pub fn reset(&mut self, model: &Model<B>, backend: &B) {
        self.chat.messages.truncate(self.start);
        self.state = model.new_state(backend);
        self.text = Rendered::default();
        self.history.clear();
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
        let mut chat = self.chat.clone();
        chat.messages.push(Message::new("user", text));
        let rendered = template.render(tokenizer, &chat)?;
        let (ids, reused) = match rendered.strip_prefix(&self.text) {
            Some(new_text)
                if !self.text.is_empty() && self.history.starts_with(&self.state.tokens) =>
            {
                let mut ids = self.history.clone();
                ids.extend(new_text.encode(tokenizer)?);
                (ids, self.state.tokens.len())
            }
            _ => {
                self.state = model.new_state(backend);
                (rendered.encode(tokenizer)?, 0)
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
                self.text = Rendered::default();
                self.history.clear();
                return Err(e);
            }
        };
        let prompt_tokens = ids.len() - reused;
        chat.messages.push(Message::new("assistant", &reply));
        self.chat = chat;
        self.text = rendered;
        self.text.push_data(tokenizer, &reply);
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

/// What the user typed at the chat prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatInput {
    /// A message (one line, or a `"""` block).
    Message(String),
    /// `/reset`: forget the turns.
    Reset,
    /// `/exit` (or `/bye`).
    Exit,
}

/// Reads the next input from `lines`: a line is a message; a line starting with `"""`
/// opens a block of lines that ends at a line ending with `"""` (as Ollama reads
/// multi-line input); `/reset` and `/exit` are commands; empty lines are skipped.
/// `more(true)` is called before each further line of a block, `more(false)` before a
/// new input (to show a prompt). `None` at the end of the input (a block cut short by
/// it is still a message).
pub fn read_input(
    lines: &mut impl std::io::BufRead,
    mut more: impl FnMut(bool),
) -> std::io::Result<Option<ChatInput>> {
    const FENCE: &str = "\"\"\"";
    let read = |lines: &mut dyn std::io::BufRead| -> std::io::Result<Option<String>> {
        let mut line = String::new();
        Ok((lines.read_line(&mut line)? > 0)
            .then(|| line.trim_end_matches(['\n', '\r']).to_string()))
    };
    loop {
        more(false);
        let Some(line) = read(lines)? else {
            return Ok(None);
        };
        let trimmed = line.trim();
        match trimmed {
            "" => continue,
            "/reset" | "/clear" => return Ok(Some(ChatInput::Reset)),
            "/exit" | "/bye" => return Ok(Some(ChatInput::Exit)),
            _ => {}
        }
        let Some(first) = line.trim_start().strip_prefix(FENCE) else {
            return Ok(Some(ChatInput::Message(line)));
        };
        if let Some(one) = first.strip_suffix(FENCE) {
            return Ok(Some(ChatInput::Message(one.to_string())));
        }
        let mut block = vec![first.to_string()];
        loop {
            more(true);
            let Some(line) = read(lines)? else { break };
            if let Some(last) = line.trim_end().strip_suffix(FENCE) {
                block.push(last.to_string());
                break;
            }
            block.push(line);
        }
        // The fences' own lines add no empty line at either end.
        if block.first().is_some_and(|l| l.is_empty()) {
            block.remove(0);
        }
        if block.last().is_some_and(|l| l.is_empty()) {
            block.pop();
        }
        return Ok(Some(ChatInput::Message(block.join("\n"))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_lines_blocks_and_commands() {
        let typed = "hello\n\n   \n\"\"\"\nfirst line\n\n  indented\n\"\"\"\n\"\"\"one\"\"\"\n\"\"\"starts here\nends here\"\"\"\n/reset\n /exit \n\"\"\"\ncut short";
        let mut input = std::io::Cursor::new(typed);
        let mut got = Vec::new();
        while let Some(i) = read_input(&mut input, |_| {}).unwrap() {
            got.push(i);
        }
        use ChatInput::*;
        assert_eq!(
            got,
            vec![
                Message("hello".into()),
                Message("first line\n\n  indented".into()),
                Message("one".into()),
                Message("starts here\nends here".into()),
                Reset,
                Exit,
                Message("cut short".into()),
            ]
        );
    }
}

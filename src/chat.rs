//! Multi-turn chat that reuses the conversation's model state between turns: a new turn
//! runs only the tokens after what the prompt cache holds, instead of re-reading the
//! whole conversation.
//!
//! Earlier replies are kept as the exact ids that were generated (as the reference system
//! splices them, reference-system.md B.5): a new turn renders the whole conversation
//! with the chat template, and only the text after what was rendered before (the
//! end-of-turn marker and the new message) is tokenized and appended to those ids. When
//! the rendering does not extend the previous one (a template that rewrites history), the
//! conversation is tokenized again from the start. Either way the turn continues from the
//! longest snapshot of the [`crate::prompt_cache::PromptCache`] that starts its ids: the
//! end of the last reply, or an earlier turn's prompt.

use crate::chat_template::{Chat, ChatImage, ChatTemplate, Message, Rendered};
use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// One conversation: its messages, and the ids its replies were generated from and as.
/// It builds each turn's prompt ([`Conversation::next`]); the caller generates the reply
/// (through a [`crate::prompt_cache::PromptCache`], which reuses the state of the ids
/// that start the prompt; the binary's `chat` does it through its engine) and keeps it
/// ([`Conversation::commit`]).
pub struct Conversation {
    /// The messages so far, with the template's variables (and tools).
    pub chat: Chat,
    /// How many of `chat.messages` the conversation started with (a system prompt):
    /// [`Conversation::reset`] goes back to them.
    start: usize,
    /// The rendered conversation so far (the template's output plus replies).
    text: Rendered,
    /// Its ids: prompts as tokenized, replies as generated.
    history: Vec<u32>,
}

/// A turn's prompt ([`Conversation::next`]), to generate the reply from and then keep
/// ([`Conversation::commit`]).
#[derive(Clone, Debug)]
pub struct NextTurn {
    /// The whole conversation's ids, the user's new message and the reply's opening
    /// included: earlier prompts as tokenized, earlier replies as generated.
    pub ids: Vec<u32>,
    /// The conversation with the new message.
    chat: Chat,
    /// Its rendering.
    rendered: Rendered,
}

impl NextTurn {
    /// The conversation's images, in the order of their placeholders in [`NextTurn::ids`].
    pub fn images(&self) -> impl Iterator<Item = &ChatImage> {
        self.chat.images()
    }
}

impl Conversation {
    /// A conversation starting from `chat` (usually no messages, or a system prompt, and
    /// the template's variables such as `enable_thinking`).
    pub fn new(chat: Chat) -> Self {
        Conversation {
            start: chat.messages.len(),
            chat,
            text: Rendered::default(),
            history: Vec::new(),
        }
    }

    /// Forgets the turns, keeping the messages the conversation started with (a prompt
    /// cache's snapshots stay: the next turn reuses the system prompt's).
    pub fn reset(&mut self) {
        self.chat.messages.truncate(self.start);
        self.text = Rendered::default();
        self.history.clear();
    }

    /// The prompt of the turn that adds the user's `text`, with `images` before it; the
    /// conversation is unchanged until [`Conversation::commit`]. Errors: a template or
    /// tokenizer error (a template that renders no images refuses them).
    pub fn next(
        &self,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        text: &str,
        images: Vec<ChatImage>,
    ) -> Result<NextTurn> {
        let mut chat = self.chat.clone();
        chat.messages.push(Message {
            images,
            ..Message::new("user", text)
        });
        let rendered = template.render(tokenizer, &chat)?;
        let ids = match rendered.strip_prefix(&self.text) {
            Some(new_text) if !self.text.is_empty() => {
                let mut ids = self.history.clone();
                ids.extend(new_text.encode(tokenizer)?);
                ids
            }
            _ => rendered.encode(tokenizer)?,
        };
        Ok(NextTurn {
            ids,
            chat,
            rendered,
        })
    }

    /// Keeps `turn` with its reply: `reply` as decoded, `output_ids` as generated from
    /// `turn.ids`.
    pub fn commit(
        &mut self,
        tokenizer: &Tokenizer,
        turn: NextTurn,
        reply: &str,
        output_ids: &[u32],
    ) {
        let NextTurn {
            ids,
            mut chat,
            rendered,
        } = turn;
        chat.messages.push(Message::new("assistant", reply));
        self.chat = chat;
        self.text = rendered;
        self.text.push_data(tokenizer, reply);
        self.history = ids;
        self.history.extend_from_slice(output_ids);
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
    /// `/help` (or `/?`): list the commands ([`COMMANDS`]).
    Help,
    /// A line whose first word is `/` and letters that name no command (kept as typed, to
    /// be refused rather than sent to the model).
    Unknown(String),
}

/// The chat prompt's commands and what each does, as `/help` lists them.
pub const COMMANDS: &[(&str, &str)] = &[
    ("/help, /?", "list these commands"),
    (
        "/reset, /clear",
        "forget the conversation (the system prompt stays)",
    ),
    (
        "/bye, /exit",
        "end the chat (as end of input, Ctrl-D, does)",
    ),
    (
        "\"\"\"",
        "starts a message of several lines; a line ending with \"\"\" ends it",
    ),
];

/// Reads the next input from `lines`: a line is a message; a line starting with `"""`
/// opens a block of lines that ends at a line ending with `"""` (as Ollama reads
/// multi-line input); the [`COMMANDS`] are commands, and a line whose first word is `/`
/// and letters (`/x`, `/x more`) is an unknown one; empty lines are skipped.
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
            "/help" | "/?" => return Ok(Some(ChatInput::Help)),
            _ => {}
        }
        // A path such as `/usr/bin` is a message; `/x` names a command.
        let word = trimmed.split_whitespace().next().unwrap_or_default();
        if word
            .strip_prefix('/')
            .is_some_and(|name| !name.is_empty() && name.chars().all(char::is_alphabetic))
        {
            return Ok(Some(ChatInput::Unknown(word.to_string())));
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
        let typed = "hello\n\n   \n\"\"\"\nfirst line\n\n  indented\n\"\"\"\n\"\"\"one\"\"\"\n\"\"\"starts here\nends here\"\"\"\n/reset\n/?\n/help\n/load x\n/usr/bin is a path\n /exit \n\"\"\"\ncut short";
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
                Help,
                Help,
                Unknown("/load".into()),
                Message("/usr/bin is a path".into()),
                Exit,
                Message("cut short".into()),
            ]
        );
    }
}

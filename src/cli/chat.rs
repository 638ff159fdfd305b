//! `slotstream chat`: a conversation in the terminal.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use clap::Args;

use slotstream::chat::{read_input, ChatInput, Conversation, COMMANDS};
use slotstream::chat_template::{Chat, Message};
use slotstream::engine::{CancelHandle, Generation, Input, Request};
use slotstream::pool::PoolStats;

use super::flags::{PromptCacheArgs, SamplingArgs, StreamArgs, TemplateArgs, TraceArgs};
use super::load::{engine_options, open, Loaded, Reply};

#[derive(Args)]
pub struct ChatArgs {
    /// Model directory (an MLX checkpoint), or ORG/NAME downloaded by `slotstream pull`.
    #[arg(short, long, value_parser = super::pull::model_path)]
    model: PathBuf,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = 512, value_parser = super::flags::at_least(1))]
    max_tokens: usize,
    #[command(flatten)]
    template: TemplateArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    prompt_cache: PromptCacheArgs,
    #[command(flatten)]
    trace: TraceArgs,
    /// An image for the conversation's first message, before its text (repeatable: in
    /// order; again after /reset): PNG, JPEG, WebP or a GIF's first frame, for a model with
    /// a vision tower.
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
}

pub fn chat(args: ChatArgs) -> Result<()> {
    use std::io::Write;
    let sampling = args.sampling.options()?;
    let mut start = Chat {
        kwargs: args.template.kwargs()?,
        ..Chat::default()
    };
    if let Some(system) = &args.system {
        start.messages.push(Message::new("system", system));
    }
    let images = super::load::read_images(&args.images)?;
    let options = engine_options(
        args.device.clone(),
        &args.stream,
        args.trace.trace.is_some(),
        |budget| {
            Ok((
                args.prompt_cache.options(budget)?,
                args.prompt_cache.share(budget)?,
            ))
        },
    )?;
    // Refused before the weights load: no tokenizer, no chat template.
    let prepared = open(&args.model, options)?;
    prepared.tokenizer()?;
    let no_template = || format!("{} has no chat template", args.model.display());
    prepared.template()?.with_context(no_template)?;
    let loaded = Loaded::load(prepared)?;
    let engine = &loaded.engine;
    let tokenizer = engine.tokenizer()?;
    let template = engine.template()?.with_context(no_template)?;
    let mut conversation = Conversation::new(start);
    // Whether the conversation's first message, which takes the images, is done.
    let mut started = false;
    // The pool's counters over the whole chat: the engine counts each turn apart.
    let mut session: Option<PoolStats> = None;
    let prompts = Prompts::start();
    eprintln!("type a message, or /help for the commands; Ctrl-C stops a reply");
    while let Some(input) = prompts.next()? {
        let text = match input {
            ChatInput::Exit => break,
            ChatInput::Reset => {
                conversation.reset();
                started = false;
                eprintln!("(conversation reset)");
                continue;
            }
            ChatInput::Help => {
                eprintln!("{}", commands());
                continue;
            }
            ChatInput::Unknown(word) => {
                eprintln!("unknown command {word}; the commands:\n{}", commands());
                continue;
            }
            ChatInput::Message(text) => text,
        };
        let first_images = if started { Vec::new() } else { images.clone() };
        let turn = conversation.next(tokenizer, template, &text, first_images);
        let reply = turn.map_err(anyhow::Error::from).and_then(|turn| {
            // The engine puts the images' tokens in.
            let images: Vec<_> = turn.images().map(|i| i.bytes.clone()).collect();
            let input = match images.is_empty() {
                true => Input::Ids(turn.ids.clone()),
                false => Input::IdsWithImages(turn.ids.clone(), images),
            };
            let generation = loaded.generate(Request {
                input,
                max_tokens: args.max_tokens,
                sampling: sampling.clone(),
                logprobs: None,
                constraint: None,
            });
            let _stoppable = prompts.replying(&generation);
            let reply = loaded.finish_generation(generation, turn.ids.len(), |t| {
                print!("{t}");
                let _ = std::io::stdout().flush();
            })?;
            Ok((turn, reply))
        });
        println!();
        let reply: Reply = match reply {
            // A reply stopped by Ctrl-C is kept as far as it came, as it was shown.
            Ok((turn, reply)) => {
                conversation.commit(tokenizer, turn, &reply.text, &reply.output_ids);
                started = true;
                if let Some(pool) = &reply.pool {
                    session.get_or_insert_with(PoolStats::default).add(pool);
                }
                reply
            }
            // The conversation is kept as it was before the message; the next turn goes on.
            Err(e) => {
                eprintln!("error: {e:#}");
                if matches!(
                    e.downcast_ref::<slotstream::Error>(),
                    Some(slotstream::Error::ContextFull { .. })
                ) {
                    eprintln!("{CONTEXT_FULL}");
                }
                continue;
            }
        };
        match reply.stats.finish_reason.as_str() {
            "stopped" => eprintln!("(reply stopped)"),
            // Short of --max-tokens: the context ran out.
            "length" if reply.stats.generated_tokens < args.max_tokens => {
                eprintln!("(the context is full) {CONTEXT_FULL}")
            }
            _ => {}
        }
        if args.stream.stats {
            eprintln!(
                "[{} new prompt tokens, {} reused; {} tokens at {:.1} tok/s]",
                reply.stats.prompt_tokens,
                reply.reused_tokens,
                reply.stats.generated_tokens,
                reply.stats.decode_tps
            );
        }
    }
    if args.stream.stats {
        eprintln!(
            "prompt cache: {}",
            serde_json::to_string(&engine.stats().prompt_cache)?
        );
    }
    // With no finished turn, the pool's counters as they stand.
    let stats = session.or_else(|| engine.pool_stats());
    loaded.finish_with(&args.trace, stats.filter(|_| args.stream.stats))
}

/// What a full context leaves the user to do.
const CONTEXT_FULL: &str = "/reset starts a new conversation (or give chat a larger --context)";

/// The chat's commands ([`COMMANDS`]), one a line.
fn commands() -> String {
    COMMANDS
        .iter()
        .map(|(name, what)| format!("  {name:<16} {what}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the main loop waits for: the next input, or Ctrl-C at the prompt.
enum Prompted {
    Input(std::io::Result<Option<ChatInput>>),
    Interrupt,
}

/// The chat's inputs, read on a thread of their own so that Ctrl-C at the prompt ends
/// the chat through the main loop (stats printed, snapshots saved) while a read is
/// blocked, and Ctrl-C during a reply stops only the reply ([`Prompts::replying`]).
struct Prompts {
    /// Asks the reader for the next input (it shows the prompt then, not while a reply
    /// streams).
    want: std::sync::mpsc::Sender<()>,
    events: std::sync::mpsc::Receiver<Prompted>,
    /// The reply being generated, which Ctrl-C cancels; `None` at the prompt.
    reply: Arc<Mutex<Option<CancelHandle>>>,
}

impl Prompts {
    fn start() -> Self {
        let (want, wanted) = std::sync::mpsc::channel::<()>();
        let (events, received) = std::sync::mpsc::channel();
        let reader = events.clone();
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin().lock();
            while wanted.recv().is_ok() {
                let input = read_input(&mut stdin, |more| {
                    eprint!("{}", if more { "... " } else { "> " });
                });
                let end = !matches!(input, Ok(Some(_)));
                if reader.send(Prompted::Input(input)).is_err() || end {
                    break;
                }
            }
        });
        let reply: Arc<Mutex<Option<CancelHandle>>> = Arc::default();
        let current = reply.clone();
        // A Ctrl-C during a reply takes its handle: a second one ends the chat once the
        // reply has stopped.
        let handler = ctrlc::set_handler(move || {
            match current.lock().unwrap_or_else(|e| e.into_inner()).take() {
                Some(reply) => reply.cancel(),
                None => {
                    let _ = events.send(Prompted::Interrupt);
                }
            }
        });
        if let Err(e) = handler {
            tracing::warn!(error = %e, "Ctrl-C will end the process, the conversation lost");
        }
        Prompts {
            want,
            events: received,
            reply,
        }
    }

    /// The next input; `None` at the end of the input or at Ctrl-C. Errors: stdin's.
    fn next(&self) -> Result<Option<ChatInput>> {
        // The reader has ended when the input has: the receive then sees it.
        let _ = self.want.send(());
        match self.events.recv() {
            Ok(Prompted::Input(input)) => Ok(input.context("reading the chat's input")?),
            Ok(Prompted::Interrupt) | Err(_) => {
                eprintln!();
                Ok(None)
            }
        }
    }

    /// Makes Ctrl-C cancel `generation` until the returned guard drops.
    fn replying(&self, generation: &Generation) -> Replying<'_> {
        *self.lock() = Some(generation.cancel_handle());
        Replying(self)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<CancelHandle>> {
        self.reply.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// While kept, Ctrl-C stops the reply ([`Prompts::replying`]).
struct Replying<'a>(&'a Prompts);

impl Drop for Replying<'_> {
    fn drop(&mut self) {
        *self.0.lock() = None;
    }
}

//! `slotstream chat`: a conversation in the terminal.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use slotstream::chat::{read_input, ChatInput, Conversation};
use slotstream::chat_template::{Chat, Message};
use slotstream::engine::{Input, Request};
use slotstream::pool::PoolStats;

use super::flags::{PromptCacheArgs, SamplingArgs, StreamArgs, TemplateArgs, TraceArgs};
use super::load::{engine_options, open, Loaded, Reply};

#[derive(Args)]
pub struct ChatArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512, value_parser = super::flags::at_least(1))]
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
    let options = engine_options(
        args.device.clone(),
        &args.stream,
        args.trace.trace.is_some(),
        |budget| args.prompt_cache.options(budget),
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
    // The pool's counters over the whole chat: the engine counts each turn apart.
    let mut session: Option<PoolStats> = None;
    let mut stdin = std::io::stdin().lock();
    eprintln!(
        "type a message (\"\"\" starts and ends one of several lines); /reset forgets the conversation, /exit or end of input ends it"
    );
    while let Some(input) = read_input(&mut stdin, |more| {
        eprint!("{}", if more { "... " } else { "> " });
    })? {
        let text = match input {
            ChatInput::Exit => break,
            ChatInput::Reset => {
                conversation.reset();
                eprintln!("(conversation reset)");
                continue;
            }
            ChatInput::Message(text) => text,
        };
        let turn = conversation.next(tokenizer, template, &text);
        let reply = turn.map_err(anyhow::Error::from).and_then(|turn| {
            let generation = loaded.generate(Request {
                input: Input::Ids(turn.ids.clone()),
                max_tokens: args.max_tokens,
                sampling: sampling.clone(),
            });
            let reply = loaded.finish_generation(generation, turn.ids.len(), |t| {
                print!("{t}");
                let _ = std::io::stdout().flush();
            })?;
            Ok((turn, reply))
        });
        println!();
        let reply: Reply = match reply {
            Ok((turn, reply)) => {
                conversation.commit(tokenizer, turn, &reply.text, &reply.output_ids);
                if let Some(pool) = &reply.pool {
                    session.get_or_insert_with(PoolStats::default).add(pool);
                }
                reply
            }
            // The conversation is kept as it was before the message; the next turn goes on.
            Err(e) => {
                eprintln!("error: {e:#}");
                continue;
            }
        };
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

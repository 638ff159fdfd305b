//! `slotstream chat`: a conversation in the terminal.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use slotstream::backend::gpu::GpuOptions;
use slotstream::backend::{open_compute, Backend, Compute};
use slotstream::chat_template::{Chat, ChatTemplate, Message};
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::OpenedSource;
use slotstream::generate::GenerateOptions;
use slotstream::tokenizer::Tokenizer;

use super::flags::{PromptCacheArgs, SamplingArgs, StreamArgs, TemplateArgs, TraceArgs};
use super::generate::generate_options;
use super::streamed::{finish_pool, load_streamed, Streamed};

#[derive(Args)]
pub struct ChatArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512)]
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
    let ckpt = Arc::new(Checkpoint::open(&args.model).context("opening the model")?);
    let tokenizer = Tokenizer::load(&args.model)?;
    let template = ChatTemplate::load(&args.model)?
        .with_context(|| format!("{} has no chat template", args.model.display()))?;
    let options = generate_options(
        &args.model,
        &ckpt,
        &tokenizer,
        args.max_tokens,
        &args.sampling,
    )?;
    match open_compute(args.device.as_deref(), &GpuOptions::from_env())? {
        Compute::Cpu(b) => chat_on(&b, &ckpt, &tokenizer, &template, &options, &args),
        Compute::Gpu(b) => chat_on(&*b, &ckpt, &tokenizer, &template, &options, &args),
    }
}

fn chat_on<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    options: &GenerateOptions,
    args: &ChatArgs,
) -> Result<()> {
    use slotstream::chat::{read_input, ChatInput};
    use std::io::Write;
    let cache_options = args.prompt_cache.options(args.stream.memory_budget)?;
    let Streamed {
        model,
        source,
        cache,
        _runtime,
    } = load_streamed(backend, ckpt, &args.stream, &args.trace, &cache_options)?;
    let OpenedSource { experts, pool, .. } = source;
    let mut start = Chat {
        kwargs: args.template.kwargs()?,
        ..Chat::default()
    };
    if let Some(system) = &args.system {
        start.messages.push(Message::new("system", system));
    }
    let mut conversation = slotstream::chat::Conversation::new(start, cache);
    let mut stdin = std::io::stdin().lock();
    let mut stdout = std::io::stdout();
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
        let turn = conversation.turn(
            &model,
            backend,
            &experts,
            tokenizer,
            template,
            &text,
            options,
            |t| {
                print!("{t}");
                let _ = stdout.flush();
            },
        );
        println!();
        let turn = match turn {
            Ok(turn) => turn,
            // The conversation is kept as it was before the message; the next turn goes on.
            Err(e) => {
                eprintln!("error: {e}");
                continue;
            }
        };
        if args.stream.stats {
            eprintln!(
                "[{} new prompt tokens, {} reused; {} tokens at {:.1} tok/s]",
                turn.prompt_tokens,
                turn.reused_tokens,
                turn.stats.generated_tokens,
                turn.stats.decode_tps
            );
        }
    }
    if args.stream.stats {
        eprintln!(
            "prompt cache: {}",
            serde_json::to_string(&conversation.cache.stats())?
        );
    }
    finish_pool(&pool, &args.trace, args.stream.stats)
}

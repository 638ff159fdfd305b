//! `slotstream generate`: text from a prompt, streamed to stdout.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;

use slotstream::chat_template::{Chat, Message};
use slotstream::constraint::Grammar;
use slotstream::engine::{Input, Request};
use slotstream::pool::PoolStats;

use super::flags::{
    IdList, PrefillArgs, PromptCacheArgs, SamplingArgs, StreamArgs, TemplateArgs, TraceArgs,
};
use super::load::{engine_options, open, Loaded};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory (an MLX checkpoint), or ORG/NAME downloaded by `slotstream pull`.
    #[arg(short, long, value_parser = super::pull::model_path)]
    pub model: PathBuf,
    /// Prompt text (the same as --prompt).
    #[arg(value_name = "PROMPT", conflicts_with_all = ["prompt", "prompt_file", "prompt_ids"])]
    pub text: Option<String>,
    /// Prompt text (wrapped in the model's chat template unless --raw).
    #[arg(short, long, conflicts_with_all = ["prompt_file", "prompt_ids"])]
    pub prompt: Option<String>,
    /// Read the prompt text from a file (`-`: standard input).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt_file: Option<PathBuf>,
    /// Prompt as comma-separated token ids (no template).
    #[arg(long)]
    pub prompt_ids: Option<IdList>,
    /// Use the prompt text as is, without the chat template (special-token texts in it
    /// count as those tokens).
    #[arg(long)]
    pub raw: bool,
    /// An image for the prompt, before its text (repeatable: in order): PNG, JPEG, WebP
    /// or a GIF's first frame, through the model's vision tower (loaded now; see
    /// `--vision`). Needs the chat template (not `--raw` or `--prompt-ids`).
    #[arg(long = "image", value_name = "PATH")]
    pub images: Vec<PathBuf>,
    #[command(flatten)]
    pub template: TemplateArgs,
    /// Stop after this many new tokens.
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = 256)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Constrain the output to this JSON schema (a file; llguidance; the reply is compact
    /// JSON, and with thinking on the constraint starts after `</think>`).
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<PathBuf>,
    /// Constrain the output to this Lark grammar (a file, in llguidance's Lark syntax).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    /// Print one JSON object (prompt ids, output ids, text, stats) instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Compute device: `cpu`, `gpu` (any GPU adapter), or part of an adapter's name.
    #[arg(long)]
    pub device: Option<String>,
    #[command(flatten)]
    pub stream: StreamArgs,
    /// Reuse across runs needs --prompt-cache-dir (without it nothing outlives the run).
    #[command(flatten)]
    pub prompt_cache: PromptCacheArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
    #[command(flatten)]
    pub prefill: PrefillArgs,
    /// Stream control characters (but newline and tab) as visible symbols: the demo's
    /// random text holds bytes such as BEL that a terminal would act on.
    #[arg(skip)]
    pub visible_controls: bool,
}

/// `piece` with its control characters other than newline and tab shown as Unicode's
/// control pictures (U+2400 + code for C0, U+2421 for DEL) or U+FFFD (C1).
fn visible_controls(piece: &str) -> std::borrow::Cow<'_, str> {
    let hidden = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !piece.chars().any(hidden) {
        return piece.into();
    }
    piece
        .chars()
        .map(|c| match c {
            c if !hidden(c) => c,
            '\u{0}'..='\u{1f}' => char::from_u32(0x2400 + c as u32).unwrap_or('\u{fffd}'),
            '\u{7f}' => '\u{2421}',
            _ => '\u{fffd}',
        })
        .collect::<String>()
        .into()
}

pub fn generate(args: GenerateArgs) -> Result<()> {
    let pool_json = args.stream.stats;
    run_generate(args, pool_json)
}

/// `generate` with `args`; with `--stats`, a summary on stderr; the pool's counters as
/// JSON after it when `pool_json`.
pub fn run_generate(args: GenerateArgs, pool_json: bool) -> Result<()> {
    use std::io::Write;
    let text = match (&args.text, &args.prompt, &args.prompt_file) {
        (Some(t), None, None) | (None, Some(t), None) => Some(t.clone()),
        (None, None, Some(f)) if f.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .context("reading the prompt from standard input")?;
            Some(text)
        }
        (None, None, Some(f)) => {
            Some(std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?)
        }
        (None, None, None) => None,
        _ => bail!("give the prompt once: as an argument, --prompt, --prompt-file or --prompt-ids"),
    };
    const TEMPLATE_VARIABLES: &str = "--think and --chat-template-kwargs set chat template variables: they need a prompt text, without --raw, and a model with a chat template";
    if args.template.is_set() && (text.is_none() || args.raw) {
        bail!(TEMPLATE_VARIABLES);
    }
    let kwargs = args.template.kwargs()?;
    let input = match (&args.prompt_ids, text) {
        (Some(ids), None) => Input::Ids(ids.0.clone()),
        (None, Some(text)) => Input::Text(text),
        _ => bail!("give a prompt: as an argument, --prompt, --prompt-file or --prompt-ids"),
    };
    let sampling = args.sampling.options()?;
    let grammar = match (&args.json_schema, &args.grammar) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let schema = serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", path.display()))?;
            Some((Grammar::JsonSchema(schema), "--json-schema"))
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Some((Grammar::Lark(text), "--grammar"))
        }
        (None, None) => None,
    };
    if let Some(path) = &args.trace.trace {
        slotstream::atomic_file::check_writable(path)
            .with_context(|| format!("output {}", path.display()))?;
    }
    let options = engine_options(
        args.device.clone(),
        &args.stream,
        args.trace.trace.is_some(),
        |budget| {
            let mut cache = args.prompt_cache.options(budget)?;
            if cache.dir.is_none() {
                // Nothing outlives the run: no snapshots to take.
                cache.memory = 0;
                return Ok((cache, None));
            }
            Ok((cache, args.prompt_cache.share(budget)?))
        },
    )?;
    // The prompt is checked before the weights load.
    let prepared = open(&args.model, options)?;
    // Read only where it is used: a malformed template does not fail --raw or ids.
    let template = match (&input, args.raw) {
        (Input::Text(_), false) => prepared.template()?.is_some(),
        _ if args.template.is_set() => prepared.template()?.is_some(),
        _ => false,
    };
    if args.template.is_set() && !template {
        bail!(TEMPLATE_VARIABLES);
    }
    let images = super::load::read_images(&args.images)?;
    // A text is wrapped in the chat template unless --raw (or the model has none).
    let input = match input {
        Input::Text(text) if !args.raw && template => Input::Chat(Chat {
            kwargs,
            ..Chat::new(vec![Message {
                images,
                ..Message::new("user", &text)
            }])
        }),
        _ if !images.is_empty() => {
            bail!("--image needs the chat template: a prompt text without --raw, and a model with a template")
        }
        input => input,
    };
    let (prompt, thinking_open) = match &input {
        Input::Chat(chat) => {
            let p = prepared.encode_chat(chat)?;
            (p.ids, p.thinking_open)
        }
        other => (prepared.encode(other)?, false),
    };
    // A grammar llguidance refuses fails the run before the weights load.
    let constraint = grammar
        .map(|(g, field)| prepared.constrain(&g, thinking_open, field))
        .transpose()?;
    let loaded = Loaded::load(prepared)?;
    let engine = &loaded.engine;
    loaded.announce_prefill(prompt.len(), args.prefill.max_prefill_wait)?;
    let generation = loaded.generate(Request {
        // The engine puts the images' tokens in.
        input: match &input {
            Input::Chat(chat) if chat.images().next().is_some() => Input::IdsWithImages(
                prompt.clone(),
                chat.images().map(|i| i.bytes.clone()).collect(),
            ),
            _ => Input::Ids(prompt.clone()),
        },
        max_tokens: args.max_tokens,
        sampling,
        logprobs: None,
        constraint,
    });
    // Ctrl-C stops after the current token, or between a long prompt's chunks; the
    // output so far and the stats still print. A second one ends the process.
    let interrupted = Arc::new(AtomicBool::new(false));
    let cancel = generation.cancel_handle();
    if let Err(e) = ctrlc::set_handler(move || {
        if interrupted.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        cancel.cancel();
    }) {
        tracing::warn!(error = %e, "Ctrl-C will end the process without stats");
    }
    let reply = loaded.finish_generation(generation, prompt.len(), |piece| {
        if !args.json {
            if args.visible_controls {
                print!("{}", visible_controls(piece));
            } else {
                print!("{piece}");
            }
            let _ = std::io::stdout().flush();
        }
    })?;
    if args.json {
        let out = serde_json::json!({
            "prompt_ids": prompt,
            "output_ids": reply.output_ids,
            "text": reply.text,
            "stats": reply.stats,
            "reused_tokens": reply.reused_tokens,
            "prompt_cache": engine.stats().prompt_cache,
            "pool": reply.pool,
            "plan": engine.plan(),
            "peak_rss_bytes": slotstream::plan::peak_rss(),
        });
        println!("{out}");
    } else {
        println!();
    }
    if args.stream.stats {
        eprint!(
            "{}",
            summary(&reply.stats, reply.reused_tokens, reply.pool.as_ref())
        );
    }
    loaded.finish(&args.trace, pool_json)
}

/// The run in words, for `--stats` and the demo: prefill and decode rates (with the prompt
/// tokens a snapshot spared, `reused`), peak RSS, and
/// with a pool its hit rate, everything read from the disk split by why it was read, and
/// the share of decode time spent waiting on reads.
fn summary(
    stats: &slotstream::generate::GenerateStats,
    reused: usize,
    pool: Option<&PoolStats>,
) -> String {
    use slotstream::plan::human;
    // With --max-tokens 0 nothing runs, not even the prefill.
    let prefill = if stats.prefill_seconds > 0.0 {
        format!(
            "prefill {} tokens at {:.1} tok/s ({reused} reused)",
            stats.prompt_tokens, stats.prefill_tps
        )
    } else {
        format!("prefill of {} tokens not run", stats.prompt_tokens)
    };
    let mut out = format!(
        "{prefill}, decode {} tokens at {:.1} tok/s ({}), peak RSS {}\n",
        stats.generated_tokens,
        stats.decode_tps,
        stats.finish_reason,
        slotstream::plan::peak_rss().map_or("unknown".into(), human)
    );
    if stats.drafted > 0 {
        out += &format!(
            "drafts: {} of {} accepted ({:.1}%) in {} verify passes\n",
            stats.accepted,
            stats.drafted,
            100.0 * stats.acceptance_rate(),
            stats.verify_passes
        );
    }
    if stats.mask_seconds > 0.0 {
        let per_token = |s: f64| 1e3 * s / stats.generated_tokens.max(1) as f64;
        out += &format!(
            "grammar masks: {:.2} ms a token, {:.2} ms of it not hidden behind the forward pass\n",
            per_token(stats.mask_seconds),
            per_token(stats.mask_wait_seconds),
        );
    }
    match pool {
        None => {}
        Some(p) if p.hits + p.misses == 0 => {
            out += &format!("pool: no expert lookups ({} slots)\n", p.slots);
        }
        Some(p) => {
            let wait_share = if stats.decode_seconds > 0.0 {
                p.decode_wait_seconds / stats.decode_seconds
            } else {
                0.0
            };
            let parts: Vec<String> = [
                ("misses", p.demand_bytes),
                ("lookahead", p.speculative_bytes),
                ("prefill sweeps", p.sweep_bytes),
                ("admitted after prefill", p.admitted_bytes),
                ("n-gram rows", p.range_bytes),
            ]
            .into_iter()
            .filter(|&(_, bytes)| bytes > 0)
            .map(|(what, bytes)| format!("{} {what}", human(bytes)))
            .collect();
            if p.sweep_wait_seconds > 0.0 {
                out += &format!(
                    "prefill sweeps: {:.2} s waiting on reads, {} records read ahead and not routed to\n",
                    p.sweep_wait_seconds, p.sweep_unused
                );
            }
            out += &format!(
                "pool: hit rate {:.3}, {} read from disk ({}), {} prefetches used, {} wasted, {:.0}% of decode time waiting on reads\n",
                p.hit_rate,
                human(p.bytes_read),
                parts.join(", "),
                p.prefetches_used,
                p.prefetches_wasted,
                100.0 * wait_share
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::visible_controls;

    #[test]
    fn control_characters_become_visible_and_the_rest_stays() {
        assert_eq!(visible_controls("plain\ttext\n"), "plain\ttext\n");
        assert_eq!(
            visible_controls("a\u{7}b\u{1b}[2J\u{7f}\u{85}"),
            "a\u{2407}b\u{241b}[2J\u{2421}\u{fffd}"
        );
    }
}

//! The `slotstream` command line: the subcommands and their dispatch. Each subcommand's
//! flags and work are in its module under `cli/`, the flag groups they share in
//! `cli/flags.rs`.

mod cli;

use clap::{Parser, Subcommand};

use cli::{
    bench, chat, demo, devices, generate, launch, pack, plan, pull, routing, score, serve, synth,
};

#[derive(Parser)]
#[command(
    name = "slotstream",
    version,
    about = "Run Mixture-of-Experts models larger than memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Teacher-forced log-likelihood and perplexity of a token sequence.
    Score(score::ScoreArgs),
    /// Write every expert record into one aligned file (one read per miss).
    Pack(pack::PackArgs),
    /// Replay a routing trace under CLOCK, LRU and Belady's optimal policy.
    Cachesim(routing::CachesimArgs),
    /// Generate decode steps straight from a synthetic routing model (no forward pass),
    /// replay them under CLOCK, LRU and Belady, and print the calibration figures against
    /// the published summaries of real traces.
    RoutingCalibration(routing::RoutingCalibrationArgs),
    /// List GPU adapters and their limits.
    Devices,
    /// Generate text from a prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Chat in the terminal, keeping the conversation's state between turns.
    Chat(chat::ChatArgs),
    /// Show how a memory budget splits: resident weights, context state, workspaces,
    /// staging and the slots that remain.
    Plan(plan::PlanArgs),
    /// Write a synthetic checkpoint in the exact MLX layout of a preset (random weights).
    Synth(synth::SynthArgs),
    /// Measure prefill and decode speed at several pool sizes, each beside its limit
    /// (copy bandwidth when all experts are resident, raw disk reads when streaming).
    Bench(bench::BenchArgs),
    /// Serve the OpenAI API (chat and text completions, streaming or not) over HTTP.
    Serve(serve::ServeArgs),
    /// Run a coding agent (Claude Code, Codex, opencode) against a slotstream server on
    /// this machine, starting one in the background when none runs on the port.
    Launch(launch::LaunchArgs),
    /// Stop a server that `launch` started.
    Stop(launch::StopArgs),
    /// The built-in demo: a synthetic model (made on first use) streamed through a pool
    /// that holds a third of its experts.
    Demo(demo::DemoArgs),
    /// Download a checkpoint from a Hugging Face hub ($HF_ENDPOINT) into a directory that
    /// `--model ORG/NAME` then finds.
    Pull(pull::PullArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "slotstream=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(args) => score::score(args),
        Command::Pack(args) => pack::pack(args),
        Command::Cachesim(args) => routing::cachesim(args),
        Command::RoutingCalibration(args) => routing::routing_calibration(args),
        Command::Devices => devices::devices(),
        Command::Generate(args) => generate::generate(args),
        Command::Chat(args) => chat::chat(args),
        Command::Plan(args) => plan::plan(args),
        Command::Synth(args) => synth::synth(args),
        Command::Demo(args) => demo::demo(args),
        Command::Serve(args) => serve::serve(args),
        Command::Launch(args) => launch::launch(args),
        Command::Stop(args) => launch::stop(args),
        Command::Bench(args) => bench::bench(args),
        Command::Pull(args) => pull::pull(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

//! The `slotstream` command line.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use slotstream::backend::cpu::CpuBackend;
use slotstream::backend::gpu::{list_adapters, GpuBackend, GpuOptions, Placement};
use slotstream::backend::Backend;
use slotstream::score::Score;
use slotstream::checkpoint::Checkpoint;
use slotstream::experts::MappedExperts;
use slotstream::model::Model;
use slotstream::cachesim;
use slotstream::io::IoMode;
use slotstream::pool::{PoolExperts, SlotPool, StreamOptions};
use slotstream::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(name = "slotstream", version, about = "Run Mixture-of-Experts models larger than memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Teacher-forced log-likelihood and perplexity of a token sequence.
    Score(ScoreArgs),
    /// Write every expert record into one aligned file (one read per miss).
    Pack(PackArgs),
    /// Replay a routing trace under CLOCK, LRU and Belady's optimal policy.
    Cachesim(CachesimArgs),
    /// List GPU adapters and their limits.
    Devices,
}

/// How routed experts are read: through a slot pool of `--pool-slots`, or (without it)
/// from the memory-mapped checkpoint.
#[derive(Args)]
struct StreamArgs {
    /// Stream experts through a pool of this many slots (records).
    #[arg(long)]
    pool_slots: Option<usize>,
    /// Demand reads in flight at once.
    #[arg(long, default_value_t = 32)]
    queue_depth: usize,
    /// direct (O_DIRECT / F_NOCACHE) or buffered reads.
    #[arg(long, default_value = "direct")]
    io: IoMode,
    /// Read the checkpoint shards even if a valid experts.pack is present.
    #[arg(long)]
    no_pack: bool,
    /// Write the pool's routing trace (token,layer,expert,outcome CSV) here.
    #[arg(long, requires = "pool_slots")]
    trace: Option<PathBuf>,
    /// Print the pool's statistics as JSON on stderr.
    #[arg(long, requires = "pool_slots")]
    stats: bool,
    /// Where a GPU reads the slots: `unified` (host memory imported, read in place) or
    /// `device` (device-local arenas, copied on a miss). Default: unified on integrated
    /// and CPU adapters that support it, device on discrete GPUs.
    #[arg(long, requires = "pool_slots")]
    placement: Option<Placement>,
}

#[derive(Args)]
struct PackArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Output directory (default: the model directory, where the engine looks for it).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct CachesimArgs {
    /// Trace CSV written with --trace.
    #[arg(long)]
    trace: PathBuf,
    /// Pool sizes to simulate, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    slots: Vec<usize>,
}

#[derive(Args)]
struct ScoreArgs {
    /// Model directory (config.json, safetensors shards, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids, e.g. `1,2,3`.
    #[arg(long, conflicts_with = "text")]
    ids: Option<IdList>,
    /// Text, tokenized with the model's tokenizer.json.
    #[arg(long)]
    text: Option<String>,
    /// Write all logits as a float32 .npy of shape [tokens, vocab].
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Compute device: `cpu`, or part of a GPU adapter's name (see `slotstream devices`).
    /// Default: the first GPU, else the CPU.
    #[arg(long)]
    device: Option<String>,
    #[command(flatten)]
    stream: StreamArgs,
}

/// Token ids given on the command line as `1,2,3`.
#[derive(Clone, Debug)]
struct IdList(Vec<u32>);

impl std::str::FromStr for IdList {
    type Err = String;

    /// Parses `1,2,3`, naming the first bad entry.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let ids = s
        .split(',')
        .map(str::trim)
        .enumerate()
        .map(|(i, part)| {
            part.parse::<u32>()
                .map_err(|_| format!("entry {} (`{part}`) is not a token id (a non-negative integer)", i + 1))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(IdList(ids))
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "slotstream=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(args) => score(args),
        Command::Pack(args) => pack(args),
        Command::Cachesim(args) => cachesim(args),
        Command::Devices => devices(),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn score(args: ScoreArgs) -> Result<()> {
    let ckpt = Arc::new(
        Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?,
    );
    let ids = match (&args.ids, &args.text) {
        (Some(ids), None) => ids.0.clone(),
        (None, Some(text)) => Tokenizer::load(&args.model)?.encode(text)?,
        _ => bail!("give exactly one of --ids or --text"),
    };
    let s = match open_backend(&args.device)? {
        Compute::Cpu(b) => score_on(&b, &ckpt, &ids, &args.stream)?,
        Compute::Gpu(b) => score_on(&b, &ckpt, &ids, &args.stream)?,
    };
    println!("tokens: {}", s.tokens);
    println!("mean_nll: {:.6}", s.mean_nll);
    println!("perplexity: {:.6}", s.perplexity);
    if let Some(path) = &args.logits_out {
        slotstream::score::write_npy(path, &s.logits, s.tokens, s.vocab)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("logits: {} [{}, {}] float32", path.display(), s.tokens, s.vocab);
    }
    Ok(())
}

/// The compute backend chosen by `--device`.
enum Compute {
    Cpu(CpuBackend),
    Gpu(GpuBackend),
}

/// `--device cpu` forces the CPU backend; a name picks the GPU adapter whose name
/// contains it; without the flag the first GPU is used, or the CPU with a notice.
fn open_backend(device: &Option<String>) -> Result<Compute> {
    match device.as_deref() {
        Some("cpu") => Ok(Compute::Cpu(CpuBackend)),
        Some(name) => Ok(Compute::Gpu(GpuBackend::new(&GpuOptions {
            adapter: Some(name.to_string()),
            poison_outputs: false,
        })?)),
        None => match GpuBackend::new(&GpuOptions::default()) {
            Ok(g) => Ok(Compute::Gpu(g)),
            Err(e) => {
                eprintln!("notice: {e}; using the CPU backend");
                Ok(Compute::Cpu(CpuBackend))
            }
        },
    }
}

fn score_on<B: Backend>(backend: &B, ckpt: &Arc<Checkpoint>, ids: &[u32], a: &StreamArgs) -> Result<Score> {
    tracing::info!(backend = %backend.name(), "scoring");
    let model = Model::load(ckpt, backend).context("loading weights")?;
    let index = Arc::new(model.experts.clone());
    let Some(slots) = a.pool_slots else {
        return Ok(slotstream::score::score(&model, backend, &MappedExperts::new(ckpt.clone(), index), ids)?);
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the I/O runtime")?;
    let mut options = StreamOptions::with_slots(slots);
    options.queue_depth = a.queue_depth;
    options.io = a.io;
    options.use_pack = !a.no_pack;
    let pool = SlotPool::open(ckpt, index, options, runtime.handle().clone())?;
    backend.attach_pool(&pool, a.placement)?;
    if a.trace.is_some() {
        pool.enable_trace();
    }
    let s = slotstream::score::score(&model, backend, &PoolExperts(pool.clone()), ids)?;
    if let Some(path) = &a.trace {
        cachesim::write_trace(path, &pool.take_trace())?;
    }
    if a.stats {
        eprintln!("{}", serde_json::to_string_pretty(&pool.stats())?);
    }
    Ok(s)
}

fn devices() -> Result<()> {
    let adapters = list_adapters();
    if adapters.is_empty() {
        println!("no GPU adapter found (on Linux without a GPU, install Mesa's lavapipe: mesa-vulkan-drivers)");
    }
    for a in adapters {
        println!("{} [{} {}] {}", a.name, a.backend, a.device_type, a.driver);
        println!(
            "  max buffer {} MiB, max storage binding {} MiB, workgroups/dim {}, invocations/workgroup {}, shared memory {} KiB",
            a.max_buffer_size >> 20,
            a.max_storage_buffer_binding_size >> 20,
            a.max_compute_workgroups_per_dimension,
            a.max_compute_invocations_per_workgroup,
            a.max_compute_workgroup_storage_size >> 10
        );
    }
    Ok(())
}

fn pack(args: PackArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?;
    let index = slotstream::checkpoint::ExpertIndex::build(&ckpt)?;
    let out = args.out.unwrap_or_else(|| args.model.clone());
    let m = slotstream::pack::pack(&ckpt, &index, &out, true).with_context(|| format!("packing into {}", out.display()))?;
    println!(
        "packed {} records of {} bytes ({} layers x {} experts) into {}",
        index.records(),
        m.record_bytes,
        m.moe_layers.len(),
        m.experts,
        out.join(slotstream::pack::PACK_FILE).display()
    );
    Ok(())
}

fn cachesim(args: CachesimArgs) -> Result<()> {
    let requests = cachesim::read_trace(&args.trace)?;
    let lookups: usize = requests.iter().map(|r| r.experts.len()).sum();
    println!("{} lookups in {} requests", lookups, requests.len());
    print!("{:>8}", "slots");
    for p in cachesim::Policy::ALL {
        print!(" {:>8}", p.name());
    }
    println!();
    for &slots in &args.slots {
        if slots == 0 {
            bail!("--slots: a pool needs at least one slot");
        }
        print!("{slots:>8}");
        for p in cachesim::Policy::ALL {
            print!(" {:>8.4}", cachesim::simulate(&requests, slots, p).hit_rate());
        }
        println!();
    }
    Ok(())
}

//! Where the forward pass gets routed-expert records from.
//!
//! The model asks an [`ExpertSource`] (the records contract, [`crate::records`]) for the
//! records of one layer's routed experts and holds them until that layer's expert compute
//! is done. [`MappedExperts`] copies them out of the memory-mapped checkpoint (every expert
//! effectively resident, as mlx-lm runs); the slot pool ([`PoolExperts`]) streams them
//! from disk into a bounded set of slots; [`open_source`] opens the one a run asks for.

use std::ops::Deref;
use std::sync::Arc;

use crate::backend::gpu::Placement;
use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, ExpertIndex};
use crate::error::{Error, Result};
use crate::io::{IoMode, RangeRead};
use crate::machine::{MemoryProbe, OsMemory};
use crate::plan::{AutoPlan, CacheTerm, Footprint, Plan, Target};
use crate::pool::{ElasticOptions, PoolExperts, SlotPool, StreamOptions, Watcher};
use crate::records::{ExpertSource, HeldRecord, LayerRecords, SlotTag};

/// Reads records straight from the memory-mapped checkpoint (page cache), with no pool.
pub struct MappedExperts {
    ckpt: Arc<Checkpoint>,
    index: Arc<ExpertIndex>,
}

impl MappedExperts {
    pub fn new(ckpt: Arc<Checkpoint>, index: Arc<ExpertIndex>) -> Self {
        MappedExperts { ckpt, index }
    }
}

impl ExpertSource for MappedExperts {
    type Record<'a> = Vec<u8>;

    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<Vec<u8>>> {
        experts
            .iter()
            .map(|&e| {
                let mut buf = vec![0u8; self.index.layout.record_bytes];
                self.index
                    .copy_record(&self.ckpt, layer, e as usize, &mut buf)?;
                Ok(buf)
            })
            .collect()
    }
}

/// Either expert source, chosen at run time (the CLI's `--pool-slots`).
pub enum AnyExperts {
    Mapped(MappedExperts),
    Pool(PoolExperts),
}

/// A record from [`AnyExperts`].
pub enum AnyRecord {
    Mapped(Vec<u8>),
    Pool(crate::pool::PoolRecord),
}

impl Deref for AnyRecord {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            AnyRecord::Mapped(v) => v,
            AnyRecord::Pool(r) => r,
        }
    }
}

impl HeldRecord for AnyRecord {
    fn slot(&self) -> Option<SlotTag> {
        match self {
            AnyRecord::Mapped(_) => None,
            AnyRecord::Pool(r) => HeldRecord::slot(r),
        }
    }
}

impl ExpertSource for AnyExperts {
    type Record<'a> = AnyRecord;

    fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<AnyRecord>> {
        Ok(match self {
            AnyExperts::Mapped(m) => m
                .fetch(layer, experts)?
                .into_iter()
                .map(AnyRecord::Mapped)
                .collect(),
            AnyExperts::Pool(p) => p
                .fetch(layer, experts)?
                .into_iter()
                .map(AnyRecord::Pool)
                .collect(),
        })
    }

    fn fetch_prefill(&self, layer: usize, experts: &[u32], uses: &[u32]) -> Result<Vec<AnyRecord>> {
        Ok(match self {
            AnyExperts::Mapped(m) => m
                .fetch(layer, experts)?
                .into_iter()
                .map(AnyRecord::Mapped)
                .collect(),
            AnyExperts::Pool(p) => p
                .fetch_prefill(layer, experts, uses)?
                .into_iter()
                .map(AnyRecord::Pool)
                .collect(),
        })
    }

    fn end_prefill(&self, admit: bool) {
        if let AnyExperts::Pool(p) = self {
            p.end_prefill(admit);
        }
    }

    fn begin_step(&self) {
        if let AnyExperts::Pool(p) = self {
            p.begin_step();
        }
    }

    fn lookahead(&self) -> bool {
        matches!(self, AnyExperts::Pool(p) if p.lookahead())
    }

    fn streams(&self) -> bool {
        matches!(self, AnyExperts::Pool(p) if p.streams())
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if let AnyExperts::Pool(p) = self {
            p.prefetch(layer, experts);
        }
    }

    fn resident_layer(&self, layer: usize) -> Option<Box<dyn LayerRecords + '_>> {
        match self {
            AnyExperts::Mapped(_) => None,
            AnyExperts::Pool(p) => p.resident_layer(layer),
        }
    }

    fn count_lookups(&self, layer: usize, experts: &[u32]) {
        if let AnyExperts::Pool(p) = self {
            p.count_lookups(layer, experts);
        }
    }

    fn read_ranges(&self, reads: Vec<RangeRead>) -> Result<Vec<Vec<u8>>> {
        match self {
            AnyExperts::Mapped(m) => m.read_ranges(reads),
            AnyExperts::Pool(p) => p.read_ranges(reads),
        }
    }
}

/// How many slots a pool gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSize {
    /// Exactly this many slots (records).
    Slots(usize),
    /// This many slots per MoE layer (shared by all layers).
    PerLayer(usize),
    /// What a memory budget of this many bytes leaves for the pool ([`Plan`]).
    Budget(u64),
    /// As the machine allows: every record resident (the mapped checkpoint) when the
    /// whole model fits the target, else the pool the target leaves ([`AutoPlan`]).
    Auto(Target),
}

/// Where routed experts come from: the options behind the CLI's streaming flags.
#[derive(Clone, Debug)]
pub struct SourceOptions {
    /// `None`: read records from the memory-mapped checkpoint (no pool).
    pub pool: Option<PoolSize>,
    /// Tokens of context a memory budget reserves state for.
    pub context: usize,
    /// When set, `engine::Engine::open` replaces `context` with the one chosen for a
    /// memory budget of this many bytes ([`crate::plan::ContextCost::auto_context`]).
    pub context_budget: Option<u64>,
    /// Demand reads in flight at once.
    pub queue_depth: usize,
    pub io: IoMode,
    /// Use a valid `experts.pack` when present.
    pub use_pack: bool,
    /// Run the lookahead routers and prefetch what they pick.
    pub lookahead: bool,
    /// Where a GPU reads the slots (`None`: by adapter type).
    pub placement: Option<Placement>,
    /// Record every lookup ([`SlotPool::take_trace`]).
    pub trace: bool,
    /// Bytes a memory budget sets aside for prompt-cache snapshots (the engine sets it
    /// from its `prompt_cache::PromptCacheOptions::memory`).
    pub prompt_cache: u64,
    /// When set, `prompt_cache` is this share (0 to 1) of the memory budget (the CLI's
    /// `--prompt-cache 10%`): a plan refused for its pool then advises a budget whose
    /// share leaves the pool its floor ([`crate::plan::smallest_budget`]).
    pub prompt_cache_share: Option<f64>,
    /// Directories with byte-identical copies of the checkpoint's files or its
    /// `experts.pack` (`--mirror`): a pool reads each record from the copy expected to
    /// finish first ([`SlotPool::open_mirrored`]).
    pub mirrors: Vec<std::path::PathBuf>,
    /// Resize a pool planned from the machine ([`PoolSize::Auto`]) as its memory comes and
    /// goes ([`crate::pool::Watcher`]); `None`: the pool keeps its plan's size.
    pub elastic: Option<Elastic>,
    /// A memory budget sets aside the vision tower's bytes, for when an image loads it
    /// ([`crate::plan::Footprint::vision`]); false when images are off.
    pub vision: bool,
    /// A memory budget counts the MTP draft head's weights and KV cache
    /// ([`crate::plan::Footprint::mtp`]): the engine sets it when it will load the head.
    pub mtp: bool,
}

/// The elastic pool's watcher: where it reads the machine's memory, and when it resizes.
#[derive(Clone)]
pub struct Elastic {
    pub probe: Arc<dyn MemoryProbe>,
    pub options: ElasticOptions,
}

impl Elastic {
    /// The OS's readings ([`OsMemory`]) with the options for a machine (or cgroup) of
    /// `ram` bytes ([`ElasticOptions::for_ram`]).
    pub fn os(ram: u64) -> Self {
        Elastic {
            probe: Arc::new(OsMemory),
            options: ElasticOptions::for_ram(ram),
        }
    }
}

impl std::fmt::Debug for Elastic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elastic")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Default for SourceOptions {
    /// No pool; 4096 tokens of context, queue depth 32, direct I/O, pack if valid,
    /// lookahead on, no prompt cache.
    fn default() -> Self {
        SourceOptions {
            pool: None,
            context: 4096,
            context_budget: None,
            queue_depth: 32,
            io: IoMode::Direct,
            use_pack: true,
            lookahead: true,
            placement: None,
            trace: false,
            prompt_cache: 0,
            prompt_cache_share: None,
            mirrors: Vec::new(),
            elastic: None,
            vision: true,
            mtp: false,
        }
    }
}

/// An expert source opened by [`open_source`].
pub struct OpenedSource {
    pub experts: AnyExperts,
    /// The pool behind `experts`, if any (for its statistics and trace).
    pub pool: Option<Arc<SlotPool>>,
    /// The memory plan that sized the pool, when it was sized by a budget.
    pub plan: Option<Plan>,
    /// The context the source was planned for: `options.context`, or less where an
    /// automatic one had to shrink to leave the pool its floor.
    pub context: usize,
}

/// Plans `target` for `ckpt` on `backend` ([`AutoPlan::choose`]; with an automatic
/// context, [`AutoPlan::choose_context`], which may lower it) and logs the plan and why.
fn auto_plan<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    index: &ExpertIndex,
    target: Target,
    options: &SourceOptions,
) -> Result<AutoPlan> {
    let chunk = crate::backend::prefill_chunk(backend, &ckpt.config, false);
    let mut fp =
        Footprint::new(ckpt, index, options.queue_depth, chunk).drafting(options.mtp, &ckpt.config);
    if !options.vision {
        fp.vision = 0;
    }
    let cache = options
        .prompt_cache_share
        .map_or(CacheTerm::Bytes(options.prompt_cache), CacheTerm::Share);
    let plan = match options.context_budget {
        Some(_) => AutoPlan::choose_context(&fp, target, options.context, cache)?,
        None => AutoPlan::choose(&fp, target, options.context, cache)?,
    };
    tracing::info!("memory plan: {}", plan.describe());
    Ok(plan)
}

/// Opens the expert source `options` ask for, attaching a pool to `backend` (whose GPU
/// may mirror or import it); the pool's reads run on `runtime`, and so does the elastic
/// pool's watcher of a pool planned from the machine (`options.elastic`; not where the
/// backend cannot release part of the pool's memory, which is logged).
/// Errors: a pool below its floor or a budget that leaves less (with every term), a
/// trace or placement asked for without a pool, a pool that cannot read its files.
pub fn open_source<B: Backend>(
    backend: &B,
    ckpt: &Arc<Checkpoint>,
    index: Arc<ExpertIndex>,
    options: &SourceOptions,
    runtime: tokio::runtime::Handle,
) -> Result<OpenedSource> {
    let mut plan = None;
    let mut context = options.context;
    // A budget is a fixed target: planned as the machine's are, but always streamed.
    let target = match options.pool {
        Some(PoolSize::Budget(bytes)) => Some(Target::fixed(bytes)),
        Some(PoolSize::Auto(target)) => Some(target),
        _ => None,
    };
    let slots = match (options.pool, target) {
        (_, Some(target)) => {
            let auto = auto_plan(backend, ckpt, &index, target, options)?;
            context = auto.context;
            plan = auto.streamed;
            match &plan {
                Some(p) => p.slots,
                None => return mapped(ckpt, index, options, context),
            }
        }
        (Some(PoolSize::Slots(n)), _) => n,
        (Some(PoolSize::PerLayer(n)), _) => n
            .checked_mul(index.moe_layers.len())
            .ok_or_else(|| Error::InvalidInput(format!("{n} experts per layer is too many")))?,
        _ => return mapped(ckpt, index, options, context),
    };
    let mut stream = StreamOptions::with_slots(slots);
    stream.queue_depth = options.queue_depth;
    stream.io = options.io;
    stream.use_pack = options.use_pack;
    let pool = SlotPool::open_mirrored(ckpt, index, stream, &options.mirrors, runtime.clone())?;
    backend.attach_pool(&pool.memory(), options.placement)?;
    pool.set_releasable(backend.pool_memory_releasable());
    if let (Some(PoolSize::Auto(_)), Some(elastic)) = (options.pool, &options.elastic) {
        if backend.pool_memory_releasable() {
            tracing::info!(
                low_water = elastic.options.low_water,
                high_water = elastic.options.high_water,
                "elastic pool: {} to {} slots as the machine's memory allows",
                pool.floor(),
                pool.slots()
            );
            Watcher::new(&pool, elastic.probe.clone(), elastic.options).spawn(&runtime);
        } else {
            tracing::info!(
                "elastic pool off: the GPU maps the pool's host memory itself, so its pages cannot be returned; the pool keeps its plan's {} slots",
                pool.slots()
            );
        }
    }
    if options.trace {
        pool.enable_trace();
    }
    let mut experts = PoolExperts::new(pool.clone());
    experts.lookahead = options.lookahead;
    Ok(OpenedSource {
        experts: AnyExperts::Pool(experts),
        pool: Some(pool),
        plan,
        context,
    })
}

/// The mapped checkpoint as the source (every record resident). Errors: a trace or a
/// slot placement asked for, which need a pool.
fn mapped(
    ckpt: &Arc<Checkpoint>,
    index: Arc<ExpertIndex>,
    options: &SourceOptions,
    context: usize,
) -> Result<OpenedSource> {
    if options.trace || options.placement.is_some() {
        return Err(Error::InvalidInput(
            "a routing trace and a slot placement need a pool (a slot count, experts per layer or a memory budget)"
                .into(),
        ));
    }
    if !options.mirrors.is_empty() {
        tracing::warn!("--mirror is not used: every record stays resident in the mapped checkpoint (the mirrors serve a pool's reads)");
    }
    Ok(OpenedSource {
        experts: AnyExperts::Mapped(MappedExperts::new(ckpt.clone(), index)),
        pool: None,
        plan: None,
        context,
    })
}

//! `slotstream cachesim` and `slotstream routing-calibration`: routing traces replayed
//! under cache policies, and the synthetic routing model's calibration figures.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use slotstream::tools::cachesim;
use slotstream::tools::plot::{Axes, Series};

#[derive(Args)]
pub struct CachesimArgs {
    /// Trace CSV written with --trace.
    #[arg(long)]
    trace: PathBuf,
    /// Pool sizes to simulate, comma-separated (each at least 1).
    #[arg(long, value_delimiter = ',', required = true, value_parser = clap::value_parser!(u64).range(1..))]
    slots: Vec<u64>,
    /// Also draw the hit rates against the slots, a line per policy, as an SVG chart here.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

#[derive(Args)]
pub struct RoutingCalibrationArgs {
    /// The preset whose geometry and default routing model to use.
    #[arg(long, default_value = "qwen3-next-80b-a3b", conflicts_with = "model")]
    preset: String,
    /// A model directory instead of a preset: its config.json's geometry and its
    /// synthetic_routing.json.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A routing model file to use instead of the preset's or model's.
    #[arg(long)]
    params: Option<PathBuf>,
    /// Replace the routing model's seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Decode steps to generate.
    #[arg(long, default_value_t = cachesim::TARGET_STEPS)]
    steps: usize,
    /// Also write the trace (token,layer,expert CSV) here, for `slotstream cachesim`.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn cachesim(args: CachesimArgs) -> Result<()> {
    let requests = cachesim::read_trace(&args.trace)?;
    let lookups: usize = requests.iter().map(|r| r.experts.len()).sum();
    println!("{} lookups in {} requests", lookups, requests.len());
    print!("{:>8}", "slots");
    for p in cachesim::Policy::ALL {
        print!(" {:>8}", p.name());
    }
    println!();
    let mut series: Vec<Series> = cachesim::Policy::ALL
        .iter()
        .map(|p| Series {
            name: p.name().to_string(),
            points: Vec::new(),
            dashed: false,
        })
        .collect();
    for &slots in &args.slots {
        let slots = usize::try_from(slots).unwrap_or(usize::MAX);
        print!("{slots:>8}");
        for (p, s) in cachesim::Policy::ALL.iter().zip(&mut series) {
            let rate = cachesim::simulate(&requests, slots, *p).hit_rate();
            print!(" {rate:>8.4}");
            s.points.push((slots as f64, rate));
        }
        println!();
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "hit rate against pool slots: {lookups} lookups in {} requests",
            requests.len()
        );
        let axes = Axes {
            title: &title,
            x: "slots",
            y: "hit rate",
            log2_x: true,
        };
        slotstream::tools::plot::lines(path, axes, &series)
            .with_context(|| format!("--plot {}", path.display()))?;
        eprintln!("chart written to {}", path.display());
    }
    Ok(())
}

pub fn routing_calibration(args: RoutingCalibrationArgs) -> Result<()> {
    use cachesim::{Figures, TARGETS};
    use slotstream::routing_model::{RoutingModel, RoutingParams, ROUTING_FILE};
    // Geometry from the model or preset; the routing model from --params, else the model
    // directory's file, else the calibrated defaults.
    let (layers, moe_layers, experts, top_k, own_file) = match &args.model {
        Some(dir) => {
            let cfg = slotstream::config::ModelConfig::load(dir)?;
            let file = dir.join(ROUTING_FILE);
            (
                cfg.num_hidden_layers,
                cfg.moe_layers(),
                cfg.num_experts,
                cfg.num_experts_per_tok,
                Some(file),
            )
        }
        None => {
            let p = slotstream::tools::synth::preset(&args.preset)?;
            (p.layers, (0..p.layers).collect(), p.experts, p.top_k, None)
        }
    };
    let mut params = match args.params.as_ref().or(own_file.as_ref()) {
        Some(path) => RoutingParams::load(path)?,
        None => RoutingParams::calibrated(),
    };
    if let Some(seed) = args.seed {
        params.seed = seed;
    }
    if args.steps == 0 || moe_layers.is_empty() {
        bail!("nothing to trace: --steps must be at least 1 and the model needs MoE layers");
    }
    let model = RoutingModel::new(params, layers, experts, top_k)?;
    let trace = model.trace(&moe_layers, args.steps)?;
    if let Some(path) = &args.trace {
        cachesim::write_requests(path, &trace)
            .with_context(|| format!("writing trace {}", path.display()))?;
    }
    let got = Figures::measure(&trace, moe_layers.len(), experts);
    let [clock, lru, belady] = Figures::pools(moe_layers.len(), experts);
    // The published targets are for 48 x 512, top-10, 220 steps; other runs have none.
    let at_target = moe_layers.len() == 48
        && experts == 512
        && top_k == 10
        && args.steps == cachesim::TARGET_STEPS;
    if args.json {
        let out = serde_json::json!({
            "params": model.params, "layers": moe_layers.len(), "experts": experts, "top_k": top_k,
            "steps": args.steps, "pools": {"clock": clock, "lru": lru, "belady": belady},
            "figures": got, "targets": at_target.then_some(TARGETS),
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} MoE layers x {experts} experts, top-{top_k}, {} steps, {} active experts a layer, seed {}",
        moe_layers.len(),
        args.steps,
        model.active_experts(),
        model.params.seed
    );
    let target = |v: f64| {
        if at_target {
            format!("{v:.3}")
        } else {
            "-".into()
        }
    };
    println!("{:<36} {:>10} {:>10}", "figure", "synthetic", "target");
    println!(
        "{:<36} {:>10} {:>10}",
        format!("records touched (of {})", got.records),
        got.touched,
        if at_target {
            TARGETS.touched.to_string()
        } else {
            "-".into()
        }
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        "touched share",
        got.touched_share(),
        target(TARGETS.touched_share())
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        "lookups served by the top 10%",
        got.top_decile_share,
        target(TARGETS.top_decile_share)
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        format!("CLOCK hit rate, {clock} slots"),
        got.clock,
        target(TARGETS.clock)
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        format!("LRU hit rate, {lru} slots"),
        got.lru,
        target(TARGETS.lru)
    );
    println!(
        "{:<36} {:>10.3} {:>10}",
        format!("Belady hit rate, {belady} slots"),
        got.belady,
        target(TARGETS.belady)
    );
    Ok(())
}

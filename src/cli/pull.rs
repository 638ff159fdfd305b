//! `slotstream pull`: downloads a checkpoint from a Hugging Face-compatible hub
//! ([`slotstream::tools::pull`]) into a plain directory that `--model ORG/NAME` then finds.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use slotstream::tools::pull::{dir_name, is_repo_id, Hub};

#[derive(Args)]
pub struct PullArgs {
    /// The hub repository, ORG/NAME (e.g. mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit).
    /// The hub is $HF_ENDPOINT (default https://huggingface.co); $HF_TOKEN is sent as a
    /// bearer token when set.
    repo: String,
    /// Branch, tag or commit to download.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Directory to download into (default: $XDG_CACHE_HOME/slotstream/models/ORG--NAME,
    /// where `--model ORG/NAME` finds it). A plain directory, not the hub's cache layout.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    jobs: u16,
}

/// Where `pull` puts ORG/NAME by default.
fn default_dir(repo: &str) -> PathBuf {
    super::cache_dir().join("models").join(dir_name(repo))
}

/// `--model`'s value: the path as given when it exists or is no ORG/NAME id, else the
/// directory `slotstream pull ORG/NAME` downloaded it to, when that has a config.json.
pub fn model_path(arg: &str) -> Result<PathBuf, std::convert::Infallible> {
    let path = PathBuf::from(arg);
    if path.exists() || !is_repo_id(arg) {
        return Ok(path);
    }
    let pulled = default_dir(arg);
    Ok(if pulled.join("config.json").is_file() {
        pulled
    } else {
        path
    })
}

pub fn pull(args: PullArgs) -> Result<()> {
    anyhow::ensure!(
        is_repo_id(&args.repo),
        "{:?} is not a hub repository id: expected ORG/NAME",
        args.repo
    );
    let dir = args.dir.unwrap_or_else(|| default_dir(&args.repo));
    let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
    let report = runtime.block_on(async {
        let hub = Hub::from_env()?;
        let files = hub
            .list(&args.repo, &args.revision)
            .await
            .context("listing the repository's files")?;
        anyhow::ensure!(
            !files.is_empty(),
            "{}@{} has no files",
            args.repo,
            args.revision
        );
        let bar = indicatif::ProgressBar::new(0).with_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let report = hub
            .pull(
                &args.repo,
                &args.revision,
                &files,
                &dir,
                args.jobs.into(),
                &bar,
            )
            .await;
        bar.finish_and_clear();
        report.with_context(|| format!("downloading {} into {}", args.repo, dir.display()))
    })?;
    eprintln!(
        "{}: {} files ({} already complete), {} bytes downloaded into {}",
        args.repo,
        report.files,
        report.skipped,
        report.downloaded,
        dir.display()
    );
    println!("{}", dir.display());
    Ok(())
}

//! Prompt reuse: snapshots of sequence states at prefix boundaries, so that a prompt that
//! repeats or extends an earlier one runs only its new tokens.
//!
//! The recurrent layers' state cannot be rewound, so reuse needs the state as it was at
//! the point where two prompts part. [`PromptCache::generate`] takes a [`Snapshot`]
//! ([`crate::model`]) of the sequence:
//! - every `every` tokens of a long prefill (at multiples of `every` from the sequence's
//!   start; a prefill chunk that spans one is cut there, so that the boundaries do not
//!   depend on the backend's chunk: 256 tokens on the CPU, up to 2,048 on a GPU, where
//!   rounding up would leave a 1,800-token shared prefix no snapshot within it);
//! - before the prompt's last token: the last token is run on its own, so that the same
//!   prompt again restores this snapshot and runs one token for its logits;
//! - after generating (the prompt and every reply token but the last, which was sampled
//!   and not run): a follow-up that sends the reply back (a chat's next turn) continues
//!   from it.
//!
//! A new prompt continues from the longest snapshot whose tokens are a prefix of it and
//! shorter than it (at least one token is always run, for the logits). The snapshots are
//! kept in a list scanned for that prefix (a radix tree would find it without comparing
//! each snapshot's tokens, but a scan costs microseconds per snapshot beside a forward
//! pass, and the list is bounded by memory); ties go to the most recently used.
//! Greedy output is the same as a cold run's: the snapshot holds exactly the state the
//! cold run had at that token.
//!
//! Memory: a snapshot's own bytes (conv and recurrent states, indexer keys, routing state,
//! token ids) plus, once per line of shared KV caches, the rows its snapshots keep, count
//! against [`PromptCacheOptions::memory`]; the least recently used snapshot goes first
//! when a new one would exceed it.
//!
//! Images ([`PromptCache::generate_with_images`]): every image's placeholders are the same
//! token, so a snapshot continues a prompt only where it holds the same images (by
//! [`ImageEmbedding::key`], a hash of their pixels) at the same places, and never from
//! inside an image. Snapshots with images stay in memory.
//!
//! Disk ([`PromptCacheOptions::dir`]): [`PromptCache::save`] writes the snapshots the
//! last requests made (with their KV rows), to be found again after a restart
//! (`disk.rs`). Nothing read back is trusted: a file is used only when its tokens are the
//! ones indexed, start the prompt and are fewer, and a restored state whose first logits
//! are not finite is dropped (from memory and disk) and the prompt run from the start.

mod disk;

use std::path::PathBuf;

use serde::Serialize;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::generate::{generate_with, GenerateOptions, GenerateStats, PrefillStops, Sampled};
use crate::model::{ImageEmbedding, ImageSpan, Model, SequenceState, Snapshot};
use crate::records::ExpertSource;

use disk::DiskCache;

/// How much to keep and where.
#[derive(Clone, Debug)]
pub struct PromptCacheOptions {
    /// Bytes of snapshots kept in memory (their own state and the KV rows they keep
    /// alive); 0 turns prompt reuse off.
    pub memory: u64,
    /// Tokens between snapshots of a long prefill (0: only at the end of prompts).
    pub every: usize,
    /// A directory where snapshots are written to be found after a restart.
    pub dir: Option<PathBuf>,
    /// Bytes the directory's snapshot files may take (every model's).
    pub disk: u64,
}

impl Default for PromptCacheOptions {
    /// 2 GiB in memory, a snapshot every 1,024 tokens, nothing on disk (16 GiB when a
    /// directory is given).
    fn default() -> Self {
        PromptCacheOptions {
            memory: 2 << 30,
            every: 1024,
            dir: None,
            disk: 16 << 30,
        }
    }
}

/// The cache's counters.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PromptCacheStats {
    /// Requests that continued from a snapshot.
    pub hits: u64,
    /// Requests that started from an empty state.
    pub misses: u64,
    /// Of the hits, those whose snapshot was read from disk.
    pub disk_hits: u64,
    /// Prompt tokens not run thanks to snapshots.
    pub reused_tokens: u64,
    /// Snapshots in memory now.
    pub snapshots: usize,
    /// Their bytes (their own state and the KV rows they keep alive).
    pub memory_bytes: u64,
    /// Snapshots dropped to stay within the memory bound.
    pub evictions: u64,
    /// This model's snapshot files in the directory.
    pub disk_snapshots: usize,
    /// Bytes of the directory's snapshot files (every model's).
    pub disk_bytes: u64,
    /// Files skipped: corrupt, truncated, of another format version or another model;
    /// and files deleted when used: changed since they were indexed, or holding a state
    /// whose first logits were not finite.
    pub disk_skipped: u64,
}

/// What [`PromptCache::generate`] did.
#[derive(Clone, Debug)]
pub struct Generated {
    pub output_ids: Vec<u32>,
    /// `stats.prompt_tokens` counts the prompt tokens that were run.
    pub stats: GenerateStats,
    /// Prompt tokens taken from a snapshot instead of being run.
    pub reused_tokens: usize,
}

/// Where a run starts: after `reused` tokens of a snapshot, read from disk or not.
#[derive(Clone, Copy, Debug)]
struct Reuse {
    reused: usize,
    disk: bool,
}

struct Entry<B: Backend> {
    snapshot: Snapshot<B>,
    /// [`Snapshot::own_bytes`].
    own: u64,
    /// When it was made or last continued from (the cache's clock).
    used: u64,
    /// Written to disk, or read from there.
    stored: bool,
}

/// Snapshots of one model's sequences on one backend, in memory and optionally on disk.
pub struct PromptCache<B: Backend> {
    memory: u64,
    /// Tokens between snapshots of a long prefill (0: none).
    every: usize,
    kv_bytes_per_token: u64,
    entries: Vec<Entry<B>>,
    clock: u64,
    disk: Option<DiskCache>,
    stats: PromptCacheStats,
}

impl<B: Backend> PromptCache<B> {
    /// A cache for `model` (loaded from `ckpt`) on `backend`; with a directory, the
    /// snapshot files already there are indexed (files of another model or format
    /// version, and damaged ones, are skipped with a warning; damaged ones are removed).
    /// Errors: a directory without memory to keep snapshots in, or one that cannot be
    /// created or read.
    pub fn open(
        ckpt: &Checkpoint,
        model: &Model<B>,
        backend: &B,
        options: &PromptCacheOptions,
    ) -> Result<Self> {
        let disk = match &options.dir {
            Some(_) if options.memory == 0 => {
                return Err(Error::InvalidInput(
                    "a prompt-cache directory needs prompt-cache memory (it is 0, off)".into(),
                ))
            }
            Some(dir) => Some(DiskCache::open(
                dir,
                disk::identity(ckpt, model, backend)?,
                options.disk,
            )?),
            None => None,
        };
        let mut cache = PromptCache {
            memory: options.memory,
            every: options.every,
            kv_bytes_per_token: model.kv_bytes_per_token(),
            entries: Vec::new(),
            clock: 0,
            disk,
            stats: PromptCacheStats::default(),
        };
        cache.count();
        Ok(cache)
    }

    /// Tokens between snapshots of a long prefill (0: none).
    pub fn every(&self) -> usize {
        self.every
    }

    /// The counters now.
    pub fn stats(&self) -> PromptCacheStats {
        self.stats.clone()
    }

    /// Runs `prompt` as [`crate::generate::generate`] does, from the longest snapshot
    /// whose tokens start it (leaving at least one token to run), taking snapshots as the
    /// module documentation says. With a directory, call [`PromptCache::save`] once the
    /// reply is out. A snapshot that cannot be taken costs only its reuse (a warning),
    /// never the request; so does one that cannot be used (a file changed since it was
    /// indexed, or a state whose first logits are not finite): it is dropped, its file
    /// deleted, with a warning, and the prompt runs from the start. Errors: as
    /// [`crate::generate::generate`]; the snapshots taken before a failure stay.
    pub fn generate<E: ExpertSource>(
        &mut self,
        model: &Model<B>,
        backend: &B,
        experts: &E,
        prompt: &[u32],
        options: &GenerateOptions,
        on_token: impl FnMut(&Sampled) -> Result<bool>,
    ) -> Result<Generated> {
        self.generate_with_images(model, backend, experts, prompt, &[], options, on_token)
    }

    /// [`PromptCache::generate`] of a prompt with `images` over its image placeholders
    /// ([`Model::place_images`]). Errors: as [`PromptCache::generate`], and placeholders
    /// that do not hold the images.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_with_images<E: ExpertSource>(
        &mut self,
        model: &Model<B>,
        backend: &B,
        experts: &E,
        prompt: &[u32],
        images: &[ImageEmbedding],
        options: &GenerateOptions,
        mut on_token: impl FnMut(&Sampled) -> Result<bool>,
    ) -> Result<Generated> {
        if prompt.is_empty() {
            return Err(Error::InvalidInput(
                "the prompt is empty (nothing to continue from)".into(),
            ));
        }
        let spans = model.image_spans(prompt, images)?;
        // The images the state has not run go in (a snapshot never ends inside one).
        let place = |state: &mut SequenceState<B>, from: Option<Reuse>| -> Result<()> {
            let reused = from.map_or(0, |s| s.reused);
            let run = spans.iter().take_while(|s| s.at < reused).count();
            model.place_images(state, &prompt[reused..], &images[run..])
        };
        let (mut state, mut from) = self.start(model, backend, prompt, &spans);
        place(&mut state, from)?;
        let run = loop {
            let run = self.run(
                model,
                backend,
                experts,
                prompt,
                options,
                state,
                from,
                &mut on_token,
            );
            let (Err(Error::BrokenSnapshot { .. }), Some(start)) = (&run, from) else {
                break run;
            };
            // Shown by the prefill's first step, before any token was emitted.
            tracing::warn!(
                tokens = start.reused,
                "prompt cache: a snapshot gave logits that are not finite; it is dropped and the prompt runs from the start"
            );
            self.drop_snapshot(backend, &prompt[..start.reused]);
            (state, from) = (model.new_state(backend), None);
            place(&mut state, from)?;
        };
        match from {
            Some(start) => {
                self.stats.hits += 1;
                self.stats.reused_tokens += start.reused as u64;
                self.stats.disk_hits += u64::from(start.disk);
            }
            None => self.stats.misses += 1,
        }
        let (output_ids, stats) = run?;
        Ok(Generated {
            output_ids,
            stats,
            reused_tokens: from.map_or(0, |s| s.reused),
        })
    }

    /// [`generate_with`] of `prompt` from `state` (which has run `from`'s tokens, or none),
    /// keeping the snapshots it stops for and the final state.
    #[allow(clippy::too_many_arguments)]
    fn run<E: ExpertSource>(
        &mut self,
        model: &Model<B>,
        backend: &B,
        experts: &E,
        prompt: &[u32],
        options: &GenerateOptions,
        mut state: SequenceState<B>,
        from: Option<Reuse>,
        on_token: impl FnMut(&Sampled) -> Result<bool>,
    ) -> Result<(Vec<u32>, GenerateStats)> {
        let reused = from.map_or(0, |s| s.reused);
        let at = self.stops(reused, prompt.len());
        let stops = PrefillStops {
            at: &at,
            on_stop: |state: &SequenceState<B>| {
                match state.snapshot(backend) {
                    Ok(s) => self.keep(backend, s),
                    Err(e) => tracing::warn!(error = %e, "prompt cache: no snapshot taken"),
                }
                Ok(())
            },
            restored: from.is_some(),
        };
        let generated = generate_with(
            model,
            backend,
            experts,
            &mut state,
            &prompt[reused..],
            options,
            stops,
            on_token,
        )?;
        if self.enabled() {
            match state.into_snapshot(backend) {
                Ok(s) => self.keep(backend, s),
                Err(e) => tracing::warn!(error = %e, "prompt cache: the final state is not kept"),
            }
        }
        Ok(generated)
    }

    fn enabled(&self) -> bool {
        self.memory > 0
    }

    /// The state to run `prompt` from and what it reuses (`None`: a fresh state). A
    /// snapshot is used only if its tokens start `prompt` and are fewer; a file that
    /// cannot be used is dropped from the index and deleted, with a warning.
    fn start(
        &mut self,
        model: &Model<B>,
        backend: &B,
        prompt: &[u32],
        spans: &[ImageSpan],
    ) -> (SequenceState<B>, Option<Reuse>) {
        if !self.enabled() {
            return (model.new_state(backend), None);
        }
        self.clock += 1;
        let fits = |tokens: &[u32]| tokens.len() < prompt.len() && prompt.starts_with(tokens);
        // The prompt's images a snapshot of `len` tokens must hold, unless one is cut.
        let same_images = |len: usize, held: Vec<ImageSpan>| {
            let within: Vec<ImageSpan> = spans.iter().filter(|s| s.at < len).copied().collect();
            within.iter().all(|s| s.at + s.tokens <= len) && held == within
        };
        // Snapshots on disk have no images: none may reach the prompt's first.
        let disk_prompt = &prompt[..spans.first().map_or(prompt.len(), |s| s.at + 1)];
        loop {
            let best = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| {
                    let tokens = e.snapshot.tokens();
                    fits(tokens) && same_images(tokens.len(), e.snapshot.image_spans())
                })
                .max_by_key(|(_, e)| (e.snapshot.tokens().len(), e.used))
                .map(|(i, e)| (i, e.snapshot.tokens().len()));
            let in_memory = best.map_or(0, |(_, len)| len);
            let on_disk = self
                .disk
                .as_ref()
                .and_then(|d| d.longest(disk_prompt, in_memory + 1));
            if let Some(file) = on_disk {
                let disk = self
                    .disk
                    .as_mut()
                    .expect("a file comes from the disk cache");
                let loaded = disk
                    .load(file)
                    .and_then(|image| model.snapshot_from_image(backend, image))
                    .and_then(|snapshot| Ok((snapshot.restore(backend)?, snapshot)))
                    .and_then(|(state, snapshot)| match fits(&state.tokens) {
                        true => Ok((state, snapshot)),
                        // The index's tokens fit and the file's are checked against them;
                        // this keeps the slice of the prompt after them in range whatever
                        // the file says.
                        false => Err(Error::InvalidInput(
                            "its tokens do not start the prompt".into(),
                        )),
                    });
                match loaded {
                    Ok((state, snapshot)) => {
                        let reused = state.tokens.len();
                        let own = snapshot.own_bytes(backend);
                        let used = self.clock;
                        self.insert(
                            backend,
                            Entry {
                                snapshot,
                                own,
                                used,
                                stored: true,
                            },
                        );
                        return (state, Some(Reuse { reused, disk: true }));
                    }
                    Err(e) => {
                        tracing::warn!(file = %disk.path(file).display(), error = %e, "prompt cache: a snapshot file that cannot be used is deleted");
                        disk.delete(file);
                        self.count();
                        continue;
                    }
                }
            }
            if let Some((i, len)) = best {
                let entry = &mut self.entries[i];
                entry.used = self.clock;
                match entry.snapshot.restore(backend) {
                    Ok(state) => {
                        return (
                            state,
                            Some(Reuse {
                                reused: len,
                                disk: false,
                            }),
                        );
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "prompt cache: a snapshot could not be restored")
                    }
                }
            }
            return (model.new_state(backend), None);
        }
    }

    /// Drops the snapshot of `tokens` from memory and its file from the directory.
    fn drop_snapshot(&mut self, backend: &B, tokens: &[u32]) {
        if let Some(i) = self
            .entries
            .iter()
            .position(|e| e.snapshot.tokens() == tokens)
        {
            self.remove(backend, i);
        }
        if let Some(disk) = &mut self.disk {
            if let Some(file) = disk.find(tokens) {
                disk.delete(file);
            }
        }
        self.count();
    }

    /// Where a prefill of `prompt_len` tokens from `reused` stops for snapshots, counted
    /// from `reused`: every multiple of `every` of the sequence, and before the last token.
    fn stops(&self, reused: usize, prompt_len: usize) -> Vec<usize> {
        if !self.enabled() {
            return Vec::new();
        }
        let last = prompt_len - 1;
        let mut at = Vec::new();
        if let Some(done) = reused.checked_div(self.every) {
            let mut p = (done + 1) * self.every;
            while p < last {
                at.push(p - reused);
                p += self.every;
            }
        }
        if last > reused {
            at.push(last - reused);
        }
        at
    }

    /// Keeps `snapshot` unless one of the same tokens is kept already (then that one
    /// counts as used).
    fn keep(&mut self, backend: &B, snapshot: Snapshot<B>) {
        self.clock += 1;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.snapshot.tokens() == snapshot.tokens())
        {
            e.used = self.clock;
            return;
        }
        let own = snapshot.own_bytes(backend);
        self.insert(
            backend,
            Entry {
                snapshot,
                own,
                used: self.clock,
                stored: false,
            },
        );
    }

    /// Adds `entry`, then drops the least recently used snapshots until the memory bound
    /// holds (`entry` too, if it alone exceeds it).
    fn insert(&mut self, backend: &B, entry: Entry<B>) {
        self.entries.push(entry);
        while self.memory_bytes() > self.memory {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            self.remove(backend, oldest);
            self.stats.evictions += 1;
        }
        self.count();
    }

    /// Drops entry `i`.
    fn remove(&mut self, backend: &B, i: usize) {
        let gone = self.entries.swap_remove(i);
        let (line, _) = gone.snapshot.line();
        drop(gone);
        // The line's rows past what its other snapshots keep are free now.
        if let Some(e) = self.entries.iter().find(|e| e.snapshot.line().0 == line) {
            e.snapshot.trim_line(backend);
        }
    }

    /// Bytes of the snapshots in memory: their own, and each line's kept KV rows once.
    fn memory_bytes(&self) -> u64 {
        let mut lines = std::collections::BTreeMap::new();
        let mut own = 0;
        for e in &self.entries {
            own += e.own;
            let (line, tip) = e.snapshot.line();
            lines.insert(line, tip as u64 * self.kv_bytes_per_token);
        }
        own + lines.values().sum::<u64>()
    }

    fn count(&mut self) {
        self.stats.snapshots = self.entries.len();
        self.stats.memory_bytes = self.memory_bytes();
        if let Some(d) = &self.disk {
            self.stats.disk_snapshots = d.files();
            self.stats.disk_bytes = d.folder_bytes();
            self.stats.disk_skipped = d.skipped();
        }
    }

    /// Writes the snapshots not yet on disk (those of the last requests) when the cache
    /// has a directory. A snapshot that cannot be written is left out with a warning.
    pub fn save(&mut self, model: &Model<B>, backend: &B) {
        let Some(disk) = &mut self.disk else {
            return;
        };
        for e in self.entries.iter_mut().filter(|e| !e.stored) {
            e.stored = true;
            if !e.snapshot.image_spans().is_empty() {
                continue; // kept in memory only
            }
            let written = model
                .snapshot_image(backend, &e.snapshot)
                .and_then(|image| disk.write(&image));
            if let Err(e) = written {
                tracing::warn!(error = %e, "prompt cache: a snapshot was not written to disk");
            }
        }
        self.count();
    }
}

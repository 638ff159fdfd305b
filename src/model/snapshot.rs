//! Snapshots of a sequence's whole state, for the prompt cache (`prompt_cache`).
//!
//! A snapshot holds a copy of every gated DeltaNet layer's conv and recurrent state (and
//! the PLE block's conv state), the QSA indexer's keys, the synthetic routing state and
//! the tokens run (which are also the n-gram history the PLE block hashes). It does not
//! copy the attention layers' KV caches: a cache only ever grows by appending, so the
//! snapshot shares it with the sequence and keeps its length. All snapshots of one
//! sequence share one set of caches (a *line*).
//!
//! A sequence restored from a snapshot appends at the snapshot's length. It takes the
//! line's caches over when nothing would see those appends: no live sequence writes to
//! them and no snapshot keeps more positions than this one (rows past it that no snapshot
//! keeps are dropped). Otherwise it diverges from the line, and gets a copy of the first
//! positions ([`Backend::kv_prefix`]), so the snapshots' prefixes stay as they were.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{IndexKeys, LayerState, Model, PlacedImage, SequenceState};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::routing_model::RoutingState;

/// One attention layer's KV cache, shared by a sequence and its snapshots.
pub(super) type SharedKv<B> = Arc<Mutex<<B as Backend>::KvCache>>;

/// The cache behind `kv` (a poisoned lock only means a panic elsewhere; the rows a
/// snapshot keeps were written before it).
pub(super) fn lock_kv<T>(kv: &Mutex<T>) -> MutexGuard<'_, T> {
    kv.lock().unwrap_or_else(|e| e.into_inner())
}

/// Who uses one line of KV caches: how many snapshots keep each length, and whether a
/// live sequence appends to them.
struct KvLine {
    /// Tells lines apart for the prompt cache's memory count.
    id: u64,
    uses: Mutex<LineUses>,
}

#[derive(Default)]
struct LineUses {
    /// Length -> snapshots keeping that many positions.
    kept: BTreeMap<usize, usize>,
    writing: bool,
}

impl KvLine {
    fn new() -> Arc<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Arc::new(KvLine {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            uses: Mutex::default(),
        })
    }

    fn uses(&self) -> MutexGuard<'_, LineUses> {
        self.uses.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A live sequence's hold on its line, released when the sequence is dropped or becomes a
/// snapshot.
pub(super) struct Writer(Arc<KvLine>);

impl Writer {
    /// A new line, written by a new sequence.
    pub(super) fn new_line() -> Self {
        let line = KvLine::new();
        line.uses().writing = true;
        Writer(line)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.0.uses().writing = false;
    }
}

/// A snapshot's hold on the first `len` positions of a line.
struct Keep {
    line: Arc<KvLine>,
    len: usize,
}

impl Keep {
    fn new(line: &Arc<KvLine>, len: usize) -> Self {
        *line.uses().kept.entry(len).or_default() += 1;
        Keep {
            line: line.clone(),
            len,
        }
    }
}

impl Drop for Keep {
    fn drop(&mut self) {
        let mut uses = self.line.uses();
        if let Some(n) = uses.kept.get_mut(&self.len) {
            *n -= 1;
            if *n == 0 {
                uses.kept.remove(&self.len);
            }
        }
    }
}

/// A sequence's state after its first `tokens().len()` tokens, to continue from later
/// ([`Snapshot::restore`]) any number of times. Made by [`SequenceState::snapshot`] or
/// [`SequenceState::into_snapshot`].
pub struct Snapshot<B: Backend> {
    tokens: Vec<u32>,
    /// The images among `tokens` (they give later tokens their positions).
    images: Vec<PlacedImage>,
    /// As in a [`SequenceState`]; the indexer keys have none pending and keep no
    /// selections.
    layers: Vec<LayerState<B>>,
    routing: Option<RoutingState>,
    keep: Keep,
}

impl<B: Backend> Snapshot<B> {
    /// The tokens the state has run.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The images among [`Snapshot::tokens`] (the last may reach beyond them).
    pub fn image_spans(&self) -> Vec<super::ImageSpan> {
        self.images.iter().map(PlacedImage::span).collect()
    }

    /// A sequence continuing from this snapshot (which stays as it is): the conv and
    /// recurrent states copied; the KV caches taken over in place or copied, as the
    /// module documentation explains. Errors: a lost device.
    pub fn restore(&self, backend: &B) -> Result<SequenceState<B>> {
        let len = self.tokens.len();
        let line = &self.keep.line;
        let writer = {
            let mut uses = line.uses();
            let tip = uses.kept.keys().next_back().copied().unwrap_or(0);
            if !uses.writing && tip <= len {
                uses.writing = true;
                Some(Writer(line.clone()))
            } else {
                None
            }
        };
        let in_place = writer.is_some();
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                copy_layer(backend, layer, |kv| {
                    if in_place {
                        backend.kv_truncate(&mut lock_kv(kv), len);
                        kv.clone()
                    } else {
                        Arc::new(Mutex::new(backend.kv_prefix(&lock_kv(kv), len)))
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(SequenceState {
            layers,
            tokens: self.tokens.clone(),
            images: self.images.clone(),
            routing: self.routing.clone(),
            broken: false,
            writer: writer.unwrap_or_else(Writer::new_line),
            mtp: None,
        })
    }

    /// Bytes this snapshot holds on its own: conv, recurrent and PLE conv states, indexer
    /// keys, routing state and token ids (f32 and u32 values, 4 bytes each). The KV rows
    /// it keeps are its line's ([`Snapshot::line`]).
    pub fn own_bytes(&self, backend: &B) -> u64 {
        let values: usize = self
            .layers
            .iter()
            .map(|layer| match layer {
                LayerState::DeltaNet {
                    conv,
                    recurrent,
                    ple_conv,
                } => [Some(conv), Some(recurrent), ple_conv.as_ref()]
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        let (r, c) = backend.shape(t);
                        r * c
                    })
                    .sum(),
                LayerState::Attention { index, .. } => {
                    index.as_ref().map_or(0, |k| k.raw.len() + k.pooled.len())
                }
            })
            .sum::<usize>()
            + self
                .routing
                .as_ref()
                .map_or(0, |r| r.contexts().iter().map(Vec::len).sum())
            + self.tokens.len();
        values as u64 * 4
    }

    /// The line of KV caches this snapshot shares: an id that tells lines apart, and the
    /// most positions any of its snapshots keeps now (what the line holds for them).
    pub fn line(&self) -> (u64, usize) {
        let line = &self.keep.line;
        let tip = line.uses().kept.keys().next_back().copied().unwrap_or(0);
        (line.id, tip)
    }
}

impl<B: Backend> Snapshot<B> {
    /// Drops the rows of this snapshot's line past what its snapshots keep (after one of
    /// them was dropped), unless a live sequence appends to them.
    pub fn trim_line(&self, backend: &B) {
        let uses = self.keep.line.uses();
        if uses.writing {
            return;
        }
        let tip = uses.kept.keys().next_back().copied().unwrap_or(0);
        for layer in &self.layers {
            if let LayerState::Attention { kv, .. } = layer {
                let mut kv = lock_kv(kv);
                if backend.kv_len(&kv) > tip {
                    backend.kv_truncate(&mut kv, tip);
                }
            }
        }
    }
}

/// `layer` with its conv and recurrent states copied (the live sequence goes on updating
/// its own), its KV cache as `kv` gives it, and its indexer keys read back.
fn copy_layer<B: Backend>(
    backend: &B,
    layer: &LayerState<B>,
    kv: impl FnOnce(&SharedKv<B>) -> SharedKv<B>,
) -> Result<LayerState<B>> {
    Ok(match layer {
        LayerState::DeltaNet {
            conv,
            recurrent,
            ple_conv,
        } => LayerState::DeltaNet {
            conv: copy(backend, conv),
            recurrent: copy(backend, recurrent),
            ple_conv: ple_conv.as_ref().map(|c| copy(backend, c)),
        },
        LayerState::Attention { kv: cache, index } => LayerState::Attention {
            kv: kv(cache),
            index: index
                .as_ref()
                .map(|k| settled_keys(backend, k))
                .transpose()?,
        },
    })
}

/// A copy of `t`.
fn copy<B: Backend>(backend: &B, t: &B::Tensor) -> B::Tensor {
    let (rows, _) = backend.shape(t);
    backend.rows(t, 0, rows)
}

/// The indexer keys of `keys` with the pending ones read back: all `[tokens, head_dim]`
/// raw keys on the host. Errors: a failed read-back.
fn settled_keys<B: Backend>(backend: &B, keys: &IndexKeys<B>) -> Result<IndexKeys<B>> {
    let mut raw = keys.raw.clone();
    let pending: Vec<&B::Tensor> = keys.pending.iter().collect();
    for values in backend.download_many(&pending)? {
        raw.extend(values);
    }
    Ok(IndexKeys {
        pending: Vec::new(),
        raw,
        pooled: keys.pooled.clone(),
        selections: None,
    })
}

/// The images of `images` that the first `len` tokens reach into (an image not yet run
/// is the caller's to place again).
fn run_images(images: &[PlacedImage], len: usize) -> Vec<PlacedImage> {
    images.iter().filter(|img| img.at < len).cloned().collect()
}

impl<B: Backend> SequenceState<B> {
    /// A snapshot of this state (which goes on as it is): the conv and recurrent states
    /// copied, the KV caches shared. Errors: a state left inconsistent by a failed
    /// forward pass, a failed read-back of the indexer's keys.
    pub fn snapshot(&self, backend: &B) -> Result<Snapshot<B>> {
        self.check_whole()?;
        let layers = self
            .layers
            .iter()
            .map(|layer| copy_layer(backend, layer, Arc::clone))
            .collect::<Result<_>>()?;
        Ok(Snapshot {
            tokens: self.tokens.clone(),
            images: run_images(&self.images, self.tokens.len()),
            layers,
            routing: self.routing.clone(),
            keep: Keep::new(&self.writer.0, self.tokens.len()),
        })
    }

    /// This state as a snapshot, without copying (the sequence ends here). Errors: as
    /// [`SequenceState::snapshot`].
    pub fn into_snapshot(self, backend: &B) -> Result<Snapshot<B>> {
        self.check_whole()?;
        let keep = Keep::new(&self.writer.0, self.tokens.len());
        let layers = self
            .layers
            .into_iter()
            .map(|layer| {
                Ok(match layer {
                    LayerState::Attention {
                        kv,
                        index: Some(keys),
                    } => LayerState::Attention {
                        kv,
                        index: Some(settled_keys(backend, &keys)?),
                    },
                    other => other,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Snapshot {
            images: run_images(&self.images, self.tokens.len()),
            tokens: self.tokens,
            layers,
            routing: self.routing,
            keep,
        })
    }

    fn check_whole(&self) -> Result<()> {
        if self.broken {
            return Err(Error::InvalidInput(
                "a state left inconsistent by a failed forward pass cannot be kept".into(),
            ));
        }
        Ok(())
    }
}

/// Where a sequence can be put back to after a verify pass ran draft tokens through it
/// ([`SequenceState::rewind_point`], [`SequenceState::rewind`]): copies of its gated
/// DeltaNet states, and its length, to which the KV caches are cut back.
pub struct RewindPoint<B: Backend> {
    len: usize,
    /// Per layer: a DeltaNet layer's conv and recurrent states.
    states: Vec<Option<(B::Tensor, B::Tensor)>>,
    routing: Option<RoutingState>,
}

impl<B: Backend> SequenceState<B> {
    /// The state as it is now, to come back to: copies the gated DeltaNet layers' conv and
    /// recurrent states (the KV caches only grow, so their length is enough). Errors: a
    /// state left inconsistent by a failed forward pass; Flash-Next's PLE conv states and
    /// QSA keys (not kept).
    pub fn rewind_point(&self, backend: &B) -> Result<RewindPoint<B>> {
        self.check_whole()?;
        let states = self
            .layers
            .iter()
            .map(|layer| match layer {
                LayerState::DeltaNet {
                    ple_conv: Some(_), ..
                }
                | LayerState::Attention { index: Some(_), .. } => Err(Error::InvalidInput(
                    "rewinding a Flash-Next sequence is not implemented".into(),
                )),
                LayerState::DeltaNet {
                    conv, recurrent, ..
                } => Ok(Some((copy(backend, conv), copy(backend, recurrent)))),
                LayerState::Attention { .. } => Ok(None),
            })
            .collect::<Result<_>>()?;
        Ok(RewindPoint {
            len: self.tokens.len(),
            states,
            routing: self.routing.clone(),
        })
    }

    /// Puts the state back to `point` (made from this sequence, which has only grown
    /// since): the DeltaNet states restored, the KV caches, tokens and the MTP head's
    /// pending rows cut back to its length. The KV rows cut were written after `point`,
    /// so no snapshot keeps them.
    pub fn rewind(&mut self, backend: &B, point: &RewindPoint<B>) {
        for (layer, saved) in self.layers.iter_mut().zip(&point.states) {
            match (layer, saved) {
                (
                    LayerState::DeltaNet {
                        conv, recurrent, ..
                    },
                    Some((c, r)),
                ) => {
                    *conv = copy(backend, c);
                    *recurrent = copy(backend, r);
                }
                (LayerState::Attention { kv, .. }, _) => {
                    backend.kv_truncate(&mut lock_kv(kv), point.len);
                }
                _ => {}
            }
        }
        self.tokens.truncate(point.len);
        self.images.retain(|img| img.at < point.len);
        self.routing.clone_from(&point.routing);
        if let Some(mtp) = &mut self.mtp {
            mtp.truncate(backend, point.len);
        }
        self.broken = false;
    }
}

/// A snapshot's values on the host, for writing to disk: the tokens, then every tensor in
/// a fixed order (per layer: a DeltaNet layer's conv, recurrent and PLE conv states; an
/// attention layer's keys and values `[tokens, kv_dim]` and its indexer's raw
/// `[tokens, head_dim]` and pooled `[blocks, head_dim]` keys; then the routing state's
/// context of each layer `[1, experts]`).
#[derive(Clone, Debug, PartialEq)]
pub struct StateImage {
    pub tokens: Vec<u32>,
    pub tensors: Vec<ImageTensor>,
}

/// One tensor of a [`StateImage`]: `[rows, cols]` f32 values, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageTensor {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<f32>,
}

impl<B: Backend> Model<B> {
    /// Bytes of KV cache one token takes over all attention layers (keys and values, f32).
    pub fn kv_bytes_per_token(&self) -> u64 {
        let cfg = &self.config;
        let attention = cfg
            .layer_kinds
            .iter()
            .filter(|k| **k == crate::config::LayerKind::FullAttention)
            .count();
        (attention * 2 * cfg.num_key_value_heads * cfg.head_dim * 4) as u64
    }

    /// `snapshot`'s values read back to the host (one wait on a GPU). Errors: a failed
    /// read-back.
    pub fn snapshot_image(&self, backend: &B, snapshot: &Snapshot<B>) -> Result<StateImage> {
        if !snapshot.images.is_empty() {
            return Err(Error::InvalidInput(
                "a snapshot of a sequence with images is not written to disk".into(),
            ));
        }
        let len = snapshot.tokens.len();
        let kv_dim = self.config.num_key_value_heads * self.config.head_dim;
        let index_dim = self.index_dim();
        let mut device: Vec<&B::Tensor> = Vec::new();
        for layer in &snapshot.layers {
            if let LayerState::DeltaNet {
                conv,
                recurrent,
                ple_conv,
            } = layer
            {
                device.extend(
                    [Some(conv), Some(recurrent), ple_conv.as_ref()]
                        .into_iter()
                        .flatten(),
                );
            }
        }
        let mut read = backend.download_many(&device)?.into_iter().zip(device);
        let mut tensors = Vec::new();
        let mut take = |tensors: &mut Vec<ImageTensor>| {
            let (values, t) = read.next().expect("one read per tensor");
            let (rows, cols) = backend.shape(t);
            tensors.push(ImageTensor { rows, cols, values });
        };
        for layer in &snapshot.layers {
            match layer {
                LayerState::DeltaNet { ple_conv, .. } => {
                    take(&mut tensors);
                    take(&mut tensors);
                    if ple_conv.is_some() {
                        take(&mut tensors);
                    }
                }
                LayerState::Attention { kv, index } => {
                    let (keys, values) = backend.kv_read(&lock_kv(kv), len)?;
                    for values in [keys, values] {
                        tensors.push(ImageTensor {
                            rows: len,
                            cols: kv_dim,
                            values,
                        });
                    }
                    if let Some(keys) = index {
                        for values in [keys.raw.clone(), keys.pooled.clone()] {
                            tensors.push(ImageTensor {
                                rows: values.len() / index_dim.max(1),
                                cols: index_dim,
                                values,
                            });
                        }
                    }
                }
            }
        }
        for context in snapshot.routing.iter().flat_map(|r| r.contexts()) {
            tensors.push(ImageTensor {
                rows: 1,
                cols: context.len(),
                values: context.clone(),
            });
        }
        Ok(StateImage {
            tokens: snapshot.tokens.clone(),
            tensors,
        })
    }

    /// The snapshot `image` describes, on `backend` (on a line of its own). Errors:
    /// [`Error::InvalidInput`] when the image does not fit this model: a tensor count or
    /// shape other than this model's state for that many tokens, or a token id beyond the
    /// vocabulary.
    pub fn snapshot_from_image(&self, backend: &B, image: StateImage) -> Result<Snapshot<B>> {
        let len = image.tokens.len();
        if let Some(bad) = image
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(Error::InvalidInput(format!(
                "snapshot: token id {bad} is beyond the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let kv_dim = self.config.num_key_value_heads * self.config.head_dim;
        let index_dim = self.index_dim();
        let most_blocks = self
            .config
            .flash_next
            .as_ref()
            .and_then(|f| f.indexer.as_ref())
            .map_or(0, |ix| len / ix.compress_ratio.max(1));
        let mut tensors = ImageReader {
            total: image.tensors.len(),
            tensors: image.tensors.into_iter().enumerate(),
        };
        let mut state = self.new_state(backend);
        let upload = |t: &mut B::Tensor, tensors: &mut ImageReader| -> Result<()> {
            let (rows, cols) = backend.shape(t);
            *t = backend.upload(&tensors.next(Ok(rows), cols)?, rows, cols);
            Ok(())
        };
        for layer in &mut state.layers {
            match layer {
                LayerState::DeltaNet {
                    conv,
                    recurrent,
                    ple_conv,
                } => {
                    upload(conv, &mut tensors)?;
                    upload(recurrent, &mut tensors)?;
                    if let Some(c) = ple_conv {
                        upload(c, &mut tensors)?;
                    }
                }
                LayerState::Attention { kv, index } => {
                    let keys = tensors.next(Ok(len), kv_dim)?;
                    let values = tensors.next(Ok(len), kv_dim)?;
                    *lock_kv(kv) = backend.kv_from(kv_dim, &keys, &values);
                    if let Some(k) = index {
                        k.raw = tensors.next(Ok(len), index_dim)?;
                        k.pooled = tensors.next(Err(most_blocks), index_dim)?;
                    }
                }
            }
        }
        for context in state.routing.iter_mut().flat_map(|r| r.contexts_mut()) {
            *context = tensors.next(Ok(1), context.len())?;
        }
        if tensors.tensors.next().is_some() {
            return Err(Error::InvalidInput(format!(
                "snapshot: {} tensors, this model has fewer",
                tensors.total
            )));
        }
        state.tokens = image.tokens;
        state.into_snapshot(backend)
    }

    /// Width of the QSA indexer's keys (0 without an indexer).
    fn index_dim(&self) -> usize {
        self.config
            .flash_next
            .as_ref()
            .and_then(|f| f.indexer.as_ref())
            .map_or(0, |ix| ix.head_dim)
    }
}

/// A [`StateImage`]'s tensors, taken in order and checked against the shapes expected.
struct ImageReader {
    total: usize,
    tensors: std::iter::Enumerate<std::vec::IntoIter<ImageTensor>>,
}

impl ImageReader {
    /// The next tensor's values: `[rows, cols]`, or with `Err(most)` any number of rows up
    /// to `most`. Errors: no tensor left, or another shape.
    fn next(&mut self, rows: std::result::Result<usize, usize>, cols: usize) -> Result<Vec<f32>> {
        let (i, t) = self.tensors.next().ok_or_else(|| {
            Error::InvalidInput(format!(
                "snapshot: {} tensors, this model has more",
                self.total
            ))
        })?;
        let rows_fit = match rows {
            Ok(r) => t.rows == r,
            Err(most) => t.rows <= most,
        };
        if !rows_fit || t.cols != cols || t.values.len() != t.rows * t.cols {
            let want = match rows {
                Ok(r) => format!("[{r}, {cols}]"),
                Err(most) => format!("[at most {most}, {cols}]"),
            };
            return Err(Error::InvalidInput(format!(
                "snapshot: tensor {i} is [{}, {}] with {} values, this model's is {want}",
                t.rows,
                t.cols,
                t.values.len()
            )));
        }
        Ok(t.values)
    }
}

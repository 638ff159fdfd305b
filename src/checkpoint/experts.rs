//! The expert record index: where each routed expert's bytes live in the checkpoint.
//!
//! MLX stores a layer's experts stacked (`mlp.switch_mlp.{gate,up,down}_proj` with a
//! leading expert axis), so expert `e` of one piece is the contiguous `e`-th slice of
//! that tensor. A *record* is one expert's nine pieces (gate/up/down x
//! weight/scales/biases); it is the unit the slot pool holds and the streaming reader reads.

use safetensors::Dtype;

use super::Checkpoint;
use crate::config::QuantSpec;
use crate::error::{Error, Result};

/// Pieces in one expert record.
pub const PIECES_PER_RECORD: usize = 9;

/// Alignment of direct reads, of records in a pack and of slots in the pool (bytes). 4096
/// covers the logical block size of every SSD in use and the page size of x86-64 Linux.
/// The pack's format bakes it in, so it lives with the record layout.
pub const ALIGN: usize = 4096;

/// Slot size for records of `record_bytes`: rounded up to [`ALIGN`] so every slot of the
/// pool, and every record of a pack, starts aligned for a direct read.
pub fn slot_stride(record_bytes: usize) -> usize {
    record_bytes.next_multiple_of(ALIGN)
}

/// Alignment of each piece inside a record, so that packed words and scales can be read
/// in place with natural alignment.
const PIECE_ALIGN: usize = 16;

/// The three projections of a SwiGLU expert: `down(silu(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projection {
    Gate,
    Up,
    Down,
}

impl Projection {
    pub const ALL: [Projection; 3] = [Projection::Gate, Projection::Up, Projection::Down];

    /// Position in [`Projection::ALL`] (and in [`RecordLayout::specs`]).
    pub fn index(self) -> usize {
        self as usize
    }

    fn module(self) -> &'static str {
        match self {
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }
}

/// The three tensors of a quantized projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceKind {
    Weight,
    Scales,
    Biases,
}

impl PieceKind {
    pub const ALL: [PieceKind; 3] = [PieceKind::Weight, PieceKind::Scales, PieceKind::Biases];

    fn suffix(self) -> &'static str {
        match self {
            PieceKind::Weight => "weight",
            PieceKind::Scales => "scales",
            PieceKind::Biases => "biases",
        }
    }
}

/// One piece of one expert in the checkpoint: `len` bytes at `offset` of shard `shard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceRange {
    pub shard: usize,
    pub offset: u64,
    pub len: u64,
}

/// How a record is laid out in a slot: pieces in the order gate.{w,s,b}, up.{w,s,b},
/// down.{w,s,b} (the reference system's `experts.bin` order, reference-system.md B.6),
/// each starting on a 16-byte boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordLayout {
    /// Byte offset of each piece within the record.
    pub offsets: [usize; PIECES_PER_RECORD],
    /// Byte length of each piece.
    pub lens: [usize; PIECES_PER_RECORD],
    /// Total record size in bytes, including alignment padding.
    pub record_bytes: usize,
    /// Quantization of gate, up and down (may differ in mixed-precision conversions).
    pub specs: [QuantSpec; 3],
    /// Dtype of every scales and biases piece.
    pub scale_dtype: Dtype,
    /// Model width (input of gate/up, output of down).
    pub hidden: usize,
    /// Expert intermediate width.
    pub intermediate: usize,
}

impl RecordLayout {
    /// Index of a piece in record order.
    pub fn piece(proj: Projection, kind: PieceKind) -> usize {
        3 * proj.index() + kind as usize
    }

    /// `(rows, cols)` of a projection: gate/up `[intermediate, hidden]`, down `[hidden, intermediate]`.
    pub fn shape(&self, proj: Projection) -> (usize, usize) {
        match proj {
            Projection::Down => (self.hidden, self.intermediate),
            _ => (self.intermediate, self.hidden),
        }
    }

    /// Bytes of `piece` within a record buffer.
    pub fn slice<'a>(&self, record: &'a [u8], piece: usize) -> &'a [u8] {
        &record[self.offsets[piece]..self.offsets[piece] + self.lens[piece]]
    }
}

/// For every MoE layer and expert, the nine byte ranges of its record in the checkpoint.
#[derive(Clone, Debug)]
pub struct ExpertIndex {
    pub layout: RecordLayout,
    pub num_experts: usize,
    /// Decoder-layer indices that have routed experts, in order.
    pub moe_layers: Vec<usize>,
    /// `ranges[(moe_position * num_experts + expert)]`.
    ranges: Vec<[PieceRange; PIECES_PER_RECORD]>,
}

impl ExpertIndex {
    /// Builds the index from the stacked `switch_mlp` tensors of every MoE layer.
    /// Errors: missing pieces, wrong shapes or dtypes, or layers that disagree on
    /// quantization or scale dtype (one record layout serves every layer).
    pub fn build(ckpt: &Checkpoint) -> Result<Self> {
        let cfg = &ckpt.config;
        let layers: Vec<(usize, String)> = (cfg.moe_layers().into_iter())
            .map(|l| (l, cfg.layer_name(l, "mlp.switch_mlp")))
            .collect();
        Self::build_layers(ckpt, &layers)
    }

    /// The index of one MoE block outside the decoder layers, whose stacked experts are
    /// `{module}.{gate,up,down}_proj` (an MTP head's `mtp.layers.0.mlp.switch_mlp`), as
    /// its layer 0. Errors: as [`ExpertIndex::build`].
    pub fn build_block(ckpt: &Checkpoint, module: &str) -> Result<Self> {
        Self::build_layers(ckpt, &[(0, module.to_string())])
    }

    /// The index of `layers`: each a layer index and the module holding its stacked
    /// experts.
    fn build_layers(ckpt: &Checkpoint, layers: &[(usize, String)]) -> Result<Self> {
        let cfg = &ckpt.config;
        let (e, d, i) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
        let moe_layers: Vec<usize> = layers.iter().map(|(l, _)| *l).collect();
        let mut layout: Option<RecordLayout> = None;
        let mut ranges = Vec::with_capacity(moe_layers.len() * e);
        for (_, switch_mlp) in layers {
            let mut lens = [0usize; PIECES_PER_RECORD];
            let mut specs = [QuantSpec {
                bits: 4,
                group_size: 64,
            }; 3];
            let mut scale_dtype = Dtype::BF16;
            let mut bases = [(0usize, 0u64); PIECES_PER_RECORD];
            for (p, proj) in Projection::ALL.into_iter().enumerate() {
                let module = format!("{switch_mlp}.{}", proj.module());
                let (rows, cols) = if proj == Projection::Down {
                    (d, i)
                } else {
                    (i, d)
                };
                // Always quantized: without `.scales` the global pair stands, and reading
                // the pieces below names the missing one.
                let spec = ckpt.quant_spec(&module, &[e], rows, cols)?;
                let spec = spec.or(cfg.quantization.default).ok_or_else(|| {
                    Error::bad_tensor(
                        &format!("{module}.weight"),
                        "routed experts must be quantized",
                    )
                })?;
                specs[p] = spec;
                let (_, (sd, _), _) = ckpt.quantized_parts(&module, spec, &[e], rows, cols)?;
                scale_dtype = sd;
                for kind in PieceKind::ALL {
                    let t = ckpt.tensor(&format!("{module}.{}", kind.suffix()))?;
                    let piece = RecordLayout::piece(proj, kind);
                    lens[piece] = (t.len / e as u64) as usize;
                    bases[piece] = (t.shard, t.offset);
                }
            }
            let mut offsets = [0usize; PIECES_PER_RECORD];
            let mut at = 0;
            for (k, len) in lens.iter().enumerate() {
                offsets[k] = at;
                at = (at + len).next_multiple_of(PIECE_ALIGN);
            }
            let this = RecordLayout {
                offsets,
                lens,
                record_bytes: at,
                specs,
                scale_dtype,
                hidden: d,
                intermediate: i,
            };
            match &layout {
                None => layout = Some(this),
                Some(first) if *first != this => {
                    return Err(Error::bad_tensor(
                        switch_mlp,
                        "quantization or dtype differs from the first MoE layer's",
                    ))
                }
                Some(_) => {}
            }
            for expert in 0..e {
                let mut r = [PieceRange {
                    shard: 0,
                    offset: 0,
                    len: 0,
                }; PIECES_PER_RECORD];
                for k in 0..PIECES_PER_RECORD {
                    r[k] = PieceRange {
                        shard: bases[k].0,
                        offset: bases[k].1 + (expert * lens[k]) as u64,
                        len: lens[k] as u64,
                    };
                }
                ranges.push(r);
            }
        }
        let layout = layout.ok_or_else(|| {
            Error::bad_tensor(&cfg.name("model.layers"), "the model has no MoE layer")
        })?;
        Ok(ExpertIndex {
            layout,
            num_experts: e,
            moe_layers,
            ranges,
        })
    }

    /// Position of decoder layer `layer` among the MoE layers.
    pub fn moe_position(&self, layer: usize) -> Option<usize> {
        self.moe_layers.iter().position(|&l| l == layer)
    }

    /// The nine ranges of `(layer, expert)`. Panics-free: `None` for a layer without
    /// experts or an expert out of range.
    pub fn ranges(&self, layer: usize, expert: usize) -> Option<&[PieceRange; PIECES_PER_RECORD]> {
        if expert >= self.num_experts {
            return None;
        }
        let pos = self.moe_position(layer)?;
        self.ranges.get(pos * self.num_experts + expert)
    }

    /// Number of records (MoE layers x experts).
    pub fn records(&self) -> usize {
        self.ranges.len()
    }

    /// Copies the record of `(layer, expert)` from the mapped checkpoint into `out`
    /// (`out.len() >= layout.record_bytes`), laid out by [`RecordLayout`].
    pub fn copy_record(
        &self,
        ckpt: &Checkpoint,
        layer: usize,
        expert: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let ranges = self.ranges(layer, expert).ok_or_else(|| {
            Error::InvalidInput(format!(
                "no expert record for layer {layer}, expert {expert}"
            ))
        })?;
        for (k, r) in ranges.iter().enumerate() {
            let shard = &ckpt.shards()[r.shard];
            let src = &shard.mmap[r.offset as usize..(r.offset + r.len) as usize];
            let at = self.layout.offsets[k];
            out[at..at + src.len()].copy_from_slice(src);
        }
        Ok(())
    }
}

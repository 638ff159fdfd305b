//! The tensors of a synthetic checkpoint as specs (name, dtype, shape, what fills them),
//! with the MLX quantization each module has in the released conversion; the bytes are
//! made only when the checkpoint is written.

use crate::config::Family;

use super::flash_next::hyper_connection;
use super::presets::Preset;

/// What a tensor holds.
#[derive(Clone, Debug)]
pub(super) enum Fill {
    /// Packed random `bits`-bit values of a `[.., out, in]` matrix.
    Packed,
    /// bf16 scales for a quantized matrix with `in` inputs: `1 / (in_std * sqrt(in))`.
    Scales { inputs: usize, bits: u32 },
    /// bf16 biases that centre the quantized values: `-scale * (2^bits - 1) / 2`.
    Biases { inputs: usize, bits: u32 },
    /// bf16 constant.
    Const(f32),
    /// bf16 uniform in `[-a, a]`.
    Uniform(f32),
    /// These int64 values, little endian.
    Int64(Vec<i64>),
}

pub(super) struct TensorSpec {
    pub(super) name: String,
    pub(super) dtype: &'static str,
    pub(super) shape: Vec<usize>,
    pub(super) fill: Fill,
}

impl TensorSpec {
    pub(super) fn bytes(&self) -> u64 {
        let n: usize = self.shape.iter().product();
        let size = match self.dtype {
            "I64" => 8,
            "U32" => 4,
            _ => 2,
        };
        (n * size) as u64
    }
}

pub(super) fn quantized(
    out: &mut Vec<TensorSpec>,
    module: &str,
    lead: &[usize],
    rows: usize,
    cols: usize,
    bits: u32,
    group: usize,
) {
    let shape = |last: usize| {
        let mut s = lead.to_vec();
        s.extend([rows, last]);
        s
    };
    out.push(TensorSpec {
        name: format!("{module}.weight"),
        dtype: "U32",
        shape: shape(cols * bits as usize / 32),
        fill: Fill::Packed,
    });
    out.push(TensorSpec {
        name: format!("{module}.scales"),
        dtype: "BF16",
        shape: shape(cols / group),
        fill: Fill::Scales { inputs: cols, bits },
    });
    out.push(TensorSpec {
        name: format!("{module}.biases"),
        dtype: "BF16",
        shape: shape(cols / group),
        fill: Fill::Biases { inputs: cols, bits },
    });
}

pub(super) fn vector(out: &mut Vec<TensorSpec>, name: String, shape: Vec<usize>, fill: Fill) {
    out.push(TensorSpec {
        name,
        dtype: "BF16",
        shape,
        fill,
    });
}

/// An unquantized bf16 `[rows, cols]` matrix whose rows have unit-scale dot products with
/// unit-scale inputs.
pub(super) fn dense(out: &mut Vec<TensorSpec>, name: String, rows: usize, cols: usize) {
    vector(
        out,
        name,
        vec![rows, cols],
        Fill::Uniform((3.0 / cols as f32).sqrt()),
    );
}

pub(super) fn int64(out: &mut Vec<TensorSpec>, name: String, values: Vec<i64>) {
    out.push(TensorSpec {
        name,
        dtype: "I64",
        shape: vec![values.len()],
        fill: Fill::Int64(values),
    });
}

impl Preset {
    pub(super) fn layer_tensors(&self, l: usize) -> Vec<TensorSpec> {
        if let Some(x) = &self.flash_next {
            return self.flash_next_layer_tensors(x, l);
        }
        let p = format!("{}model.layers.{l}", self.family.prefix());
        self.decoder_layer_tensors(&p, self.is_full_attention(l))
    }

    /// The tensors of a Qwen3-Next / Qwen3.5-MoE decoder layer under `p`: pre-norms, the
    /// mixer (full attention if `full_attention`, else gated DeltaNet), the MoE block.
    fn decoder_layer_tensors(&self, p: &str, full_attention: bool) -> Vec<TensorSpec> {
        let (d, g, e) = (self.hidden, self.group_size, self.experts);
        let mut t = Vec::new();
        vector(
            &mut t,
            format!("{p}.input_layernorm.weight"),
            vec![d],
            Fill::Const(1.0),
        );
        vector(
            &mut t,
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            Fill::Const(1.0),
        );
        if full_attention {
            let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
            quantized(
                &mut t,
                &format!("{p}.self_attn.q_proj"),
                &[],
                2 * h * hd,
                d,
                4,
                g,
            );
            quantized(
                &mut t,
                &format!("{p}.self_attn.k_proj"),
                &[],
                kv * hd,
                d,
                4,
                g,
            );
            quantized(
                &mut t,
                &format!("{p}.self_attn.v_proj"),
                &[],
                kv * hd,
                d,
                4,
                g,
            );
            quantized(
                &mut t,
                &format!("{p}.self_attn.o_proj"),
                &[],
                d,
                h * hd,
                4,
                g,
            );
            vector(
                &mut t,
                format!("{p}.self_attn.q_norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
            vector(
                &mut t,
                format!("{p}.self_attn.k_norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
        } else {
            let (nk, nv, hd) = (
                self.linear_key_heads,
                self.linear_value_heads,
                self.linear_head_dim,
            );
            let (kd, vd) = (nk * hd, nv * hd);
            match self.family {
                Family::Qwen3Next => {
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_qkvz"),
                        &[],
                        2 * kd + 2 * vd,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_ba"),
                        &[],
                        2 * nv,
                        d,
                        4,
                        g,
                    );
                }
                Family::Qwen35Moe | Family::Qwen4Exp => {
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_qkv"),
                        &[],
                        2 * kd + vd,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_z"),
                        &[],
                        vd,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_b"),
                        &[],
                        nv,
                        d,
                        4,
                        g,
                    );
                    quantized(
                        &mut t,
                        &format!("{p}.linear_attn.in_proj_a"),
                        &[],
                        nv,
                        d,
                        4,
                        g,
                    );
                }
            }
            vector(
                &mut t,
                format!("{p}.linear_attn.conv1d.weight"),
                vec![2 * kd + vd, 4, 1],
                Fill::Uniform(0.5),
            );
            vector(
                &mut t,
                format!("{p}.linear_attn.dt_bias"),
                vec![nv],
                Fill::Const(1.0),
            );
            vector(
                &mut t,
                format!("{p}.linear_attn.A_log"),
                vec![nv],
                Fill::Uniform(1.0),
            );
            vector(
                &mut t,
                format!("{p}.linear_attn.norm.weight"),
                vec![hd],
                Fill::Const(1.0),
            );
            quantized(
                &mut t,
                &format!("{p}.linear_attn.out_proj"),
                &[],
                d,
                vd,
                4,
                g,
            );
        }
        quantized(&mut t, &format!("{p}.mlp.gate"), &[], e, d, 8, 64);
        quantized(
            &mut t,
            &format!("{p}.mlp.shared_expert_gate"),
            &[],
            1,
            d,
            8,
            64,
        );
        self.expert_mlps(&mut t, p);
        t
    }

    /// The MTP head of a Qwen3-Next / Qwen3.5-MoE preset under its released names
    /// (`mtp.*`, without the text model's prefix; ../shared/spec/models.md §2.9) in the MLX
    /// layout: `fc` `[hidden, 2 hidden]`, the two pre-fc norms, one full-attention + MoE
    /// layer `mtp.layers.0` (stacked `switch_mlp` experts), `mtp.norm`; 4-bit, norms with
    /// the `1 + w` folded in. Empty for a preset without a head ([`Preset::mtp`]).
    pub(super) fn mtp_tensors(&self) -> Vec<TensorSpec> {
        if !self.mtp {
            return Vec::new();
        }
        let d = self.hidden;
        let mut t = self.decoder_layer_tensors("mtp.layers.0", true);
        quantized(&mut t, "mtp.fc", &[], d, 2 * d, 4, self.group_size);
        for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
            vector(
                &mut t,
                format!("mtp.{norm}.weight"),
                vec![d],
                Fill::Const(1.0),
            );
        }
        t
    }

    /// The 4-bit shared expert `mlp.shared_expert.*` and routed experts
    /// `mlp.switch_mlp.*` (`[experts, out, in]`) of layer prefix `p`.
    pub(super) fn expert_mlps(&self, t: &mut Vec<TensorSpec>, p: &str) {
        let (d, g, e, i) = (
            self.hidden,
            self.group_size,
            self.experts,
            self.intermediate,
        );
        for (m, rows, cols) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            quantized(
                t,
                &format!("{p}.mlp.shared_expert.{m}"),
                &[],
                rows,
                cols,
                4,
                g,
            );
        }
        for (m, rows, cols) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
            quantized(
                t,
                &format!("{p}.mlp.switch_mlp.{m}"),
                &[e],
                rows,
                cols,
                4,
                g,
            );
        }
    }

    pub(super) fn head_tensors(&self) -> Vec<TensorSpec> {
        let p = self.family.prefix();
        let mut t = Vec::new();
        quantized(
            &mut t,
            &format!("{p}model.embed_tokens"),
            &[],
            self.vocab,
            self.hidden,
            4,
            self.group_size,
        );
        quantized(
            &mut t,
            &format!("{p}lm_head"),
            &[],
            self.vocab,
            self.hidden,
            4,
            self.group_size,
        );
        match &self.flash_next {
            // No final norm: the hyper-connection mixer joins the streams (A.2).
            Some(x) => hyper_connection(
                &mut t,
                &format!("{p}model.hyper_connection_mixer"),
                x,
                self.hidden,
                self.group_size,
                false,
            ),
            None => vector(
                &mut t,
                format!("{p}model.norm.weight"),
                vec![self.hidden],
                Fill::Const(1.0),
            ),
        }
        t
    }

    /// The vision tower's tensors (none without one), as mlx-vlm stores them: bf16 under
    /// `vision_tower.`, the patch embedding's Conv3d weight channels-last
    /// (`[out, frames, rows, cols, channels]`), LayerNorms 1 and biases 0.
    pub(super) fn vision_tensors(&self) -> Vec<TensorSpec> {
        let Some(v) = &self.vision else {
            return Vec::new();
        };
        let mut t = Vec::new();
        let linear = |t: &mut Vec<TensorSpec>, module: String, rows: usize, cols: usize| {
            dense(t, format!("{module}.weight"), rows, cols);
            vector(t, format!("{module}.bias"), vec![rows], Fill::Const(0.0));
        };
        let norm = |t: &mut Vec<TensorSpec>, module: String, width: usize| {
            vector(t, format!("{module}.weight"), vec![width], Fill::Const(1.0));
            vector(t, format!("{module}.bias"), vec![width], Fill::Const(0.0));
        };
        let (d, p) = (v.hidden, "vision_tower");
        let patch_values = 3 * v.temporal_patch * v.patch * v.patch;
        vector(
            &mut t,
            format!("{p}.patch_embed.proj.weight"),
            vec![d, v.temporal_patch, v.patch, v.patch, 3],
            Fill::Uniform((3.0 / patch_values as f32).sqrt()),
        );
        vector(
            &mut t,
            format!("{p}.patch_embed.proj.bias"),
            vec![d],
            Fill::Const(0.0),
        );
        vector(
            &mut t,
            format!("{p}.pos_embed.weight"),
            vec![v.positions, d],
            Fill::Uniform(1.0),
        );
        for b in 0..v.depth {
            let m = format!("{p}.blocks.{b}");
            norm(&mut t, format!("{m}.norm1"), d);
            norm(&mut t, format!("{m}.norm2"), d);
            linear(&mut t, format!("{m}.attn.qkv"), 3 * d, d);
            linear(&mut t, format!("{m}.attn.proj"), d, d);
            linear(&mut t, format!("{m}.mlp.linear_fc1"), v.intermediate, d);
            linear(&mut t, format!("{m}.mlp.linear_fc2"), d, v.intermediate);
        }
        let merged = d * v.merge * v.merge;
        norm(&mut t, format!("{p}.merger.norm"), d);
        linear(&mut t, format!("{p}.merger.linear_fc1"), merged, merged);
        linear(
            &mut t,
            format!("{p}.merger.linear_fc2"),
            self.hidden,
            merged,
        );
        t
    }

    /// Bytes of all tensors of a `layers`-layer checkpoint (the vision tower's included).
    pub fn checkpoint_bytes(&self, layers: usize) -> u64 {
        let head = self.head_tensors().into_iter().chain(self.mtp_tensors());
        let mut n: u64 = head.map(|t| t.bytes()).sum();
        n += self
            .vision_tensors()
            .iter()
            .map(TensorSpec::bytes)
            .sum::<u64>();
        for l in 0..layers {
            n += self
                .layer_tensors(l)
                .iter()
                .map(TensorSpec::bytes)
                .sum::<u64>();
        }
        n
    }
}

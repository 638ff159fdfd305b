#!/usr/bin/env python3
"""A llama.cpp `qwen3next` GGUF of Qwen3-Next-80B-A3B shapes with random weights, the peer
of `slotstream synth --preset qwen3-next-80b-a3b --layers N` for tools/peer_cpu.sh.

The weights are stored as the synthetic MLX checkpoint stores them, byte for byte in size:
4-bit projections (MLX g64 with bf16 scale and bias is 4.5 bits a weight, llama.cpp's Q4_0
is 4.5 bits too), the router at 8 bits (MLX g64: 8.5 bits, Q8_0: 8.5), norms, conv, decay
and the shared-expert gate vector in f32. `tokenizer.ggml.model = none` lets llama-bench
run on a vocabulary size alone.

usage: make_gguf.py OUT.gguf LAYERS    (numpy, and llama.cpp's gguf-py on PYTHONPATH)
"""
import sys

import numpy as np
import gguf

# Qwen3-Next-80B-A3B (src/tools/synth/presets.rs QWEN3_NEXT_80B): hidden, vocabulary,
# routed experts, experts per token, expert and shared-expert width, attention heads, KV
# heads, head width, gated DeltaNet key heads, value heads, their head width, conv kernel.
HIDDEN, VOCAB, EXPERTS, TOP_K, EXPERT_FF, SHARED_FF = 2048, 151936, 512, 10, 512, 512
HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
KEY_HEADS, VALUE_HEADS, LINEAR_DIM, CONV = 16, 32, 128, 4
FULL_ATTENTION_INTERVAL = 4

Q4, Q8, F32 = "q4", "q8", "f32"


def tensors(layers):
    """(name, ggml shape with the contiguous axis first, storage) for every tensor."""
    key, value = KEY_HEADS * LINEAR_DIM, VALUE_HEADS * LINEAR_DIM
    out = [("token_embd.weight", [HIDDEN, VOCAB], Q4),
           ("output_norm.weight", [HIDDEN], F32),
           ("output.weight", [HIDDEN, VOCAB], Q4)]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", [HIDDEN], F32),
                (b + "post_attention_norm.weight", [HIDDEN], F32)]
        if (i + 1) % FULL_ATTENTION_INTERVAL == 0:
            out += [(b + "attn_q.weight", [HIDDEN, 2 * HEADS * HEAD_DIM], Q4),  # queries and gate
                    (b + "attn_k.weight", [HIDDEN, KV_HEADS * HEAD_DIM], Q4),
                    (b + "attn_v.weight", [HIDDEN, KV_HEADS * HEAD_DIM], Q4),
                    (b + "attn_output.weight", [HEADS * HEAD_DIM, HIDDEN], Q4),
                    (b + "attn_q_norm.weight", [HEAD_DIM], F32),
                    (b + "attn_k_norm.weight", [HEAD_DIM], F32)]
        else:
            out += [(b + "attn_qkv.weight", [HIDDEN, 2 * key + value], Q4),
                    (b + "attn_gate.weight", [HIDDEN, value], Q4),
                    (b + "ssm_ba.weight", [HIDDEN, 2 * VALUE_HEADS], Q4),
                    (b + "ssm_conv1d.weight", [CONV, 2 * key + value], F32),
                    (b + "ssm_dt.bias", [VALUE_HEADS], F32),
                    (b + "ssm_a", [VALUE_HEADS], F32),
                    (b + "ssm_norm.weight", [LINEAR_DIM], F32),
                    (b + "ssm_out.weight", [value, HIDDEN], Q4)]
        out += [(b + "ffn_gate_inp.weight", [HIDDEN, EXPERTS], Q8),
                (b + "ffn_gate_exps.weight", [HIDDEN, EXPERT_FF, EXPERTS], Q4),
                (b + "ffn_up_exps.weight", [HIDDEN, EXPERT_FF, EXPERTS], Q4),
                (b + "ffn_down_exps.weight", [EXPERT_FF, HIDDEN, EXPERTS], Q4),
                (b + "ffn_gate_inp_shexp.weight", [HIDDEN], F32),
                (b + "ffn_gate_shexp.weight", [HIDDEN, SHARED_FF], Q4),
                (b + "ffn_up_shexp.weight", [HIDDEN, SHARED_FF], Q4),
                (b + "ffn_down_shexp.weight", [SHARED_FF, HIDDEN], Q4)]
    return out


class Blocks:
    """Random valid quantized blocks of 32 weights (an f16 scale, then the quants), one
    pool per type sliced for every tensor: writing a layer costs no random generation."""

    def __init__(self, rng, largest):
        self.pools = {}
        for kind, quant_bytes in ((Q4, 16), (Q8, 32)):
            blocks = largest // 32
            pool = np.empty((blocks, 2 + quant_bytes), np.uint8)
            pool[:, 2:] = rng.integers(0, 256, (blocks, quant_bytes), np.uint8)
            # Q4_0 weights are (q - 8) d, Q8_0 ones q d with q in [-128, 127].
            scale = rng.uniform(0.004, 0.03, blocks) / (1 if kind == Q4 else 16)
            pool[:, :2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
            self.pools[kind] = pool.reshape(-1)

    def tensor(self, kind, ne):
        block_bytes = 18 if kind == Q4 else 34
        assert ne[0] % 32 == 0, ne
        shape = list(reversed(ne))
        shape[-1] = shape[-1] // 32 * block_bytes
        return self.pools[kind][: int(np.prod(shape))].reshape(shape)


def values(rng, name, ne):
    """f32 values a sane model would have: unit norms, negative decays, small conv taps."""
    n = int(np.prod(ne))
    if name.endswith("ssm_a"):
        v = -np.exp(rng.normal(0, 0.5, n))
    elif "conv1d" in name or "ssm_dt" in name or "shexp" in name:
        v = rng.normal(0, 0.2, n)
    else:
        v = np.ones(n)
    return v.astype(np.float32).reshape(list(reversed(ne)))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path, layers = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(19)
    table = tensors(layers)
    largest = max(int(np.prod(ne)) for _, ne, kind in table if kind != F32)
    blocks = Blocks(rng, largest)

    w = gguf.GGUFWriter(path, "qwen3next")
    w.add_block_count(layers)
    w.add_context_length(262144)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(5120)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(HEAD_DIM // 4)  # partial_rotary_factor 0.25
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_expert_shared_feed_forward_length(SHARED_FF)
    w.add_expert_weights_norm(True)
    w.add_ssm_conv_kernel(CONV)
    w.add_ssm_state_size(LINEAR_DIM)
    w.add_ssm_group_count(KEY_HEADS)
    w.add_ssm_time_step_rank(VALUE_HEADS)
    w.add_ssm_inner_size(LINEAR_DIM * VALUE_HEADS)
    w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("none")
    w.add_vocab_size(VOCAB)
    types = {Q4: gguf.GGMLQuantizationType.Q4_0, Q8: gguf.GGMLQuantizationType.Q8_0}
    for name, ne, kind in table:
        if kind == F32:
            w.add_tensor(name, values(rng, name, ne))
        else:
            w.add_tensor(name, blocks.tensor(kind, ne), raw_dtype=types[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {path}: {layers} layers, {len(table)} tensors")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Generate tiny Qwen3-Next / Qwen3.5-MoE test fixtures and their mlx-lm reference outputs.

What it makes
-------------
Three model directories, laid out exactly like an mlx-community checkpoint a user
would download, each with a reference ("oracle") computed by mlx-lm itself:

  <out>/qwen3-next-bf16/
      config.json, generation_config.json, model.safetensors,
      model.safetensors.index.json, tokenizer.json, tokenizer_config.json,
      reference.json, logits.npy
      -> parameters cast to bfloat16 before quantizing (scales/biases/norms are
         stored bf16), affine 4-bit, group_size 64; mlp.gate and
         shared_expert_gate 8-bit (mlx-lm's Qwen3-Next quant_predicate).
  <out>/qwen3-next-f32-sharded/
      same files, but float32 storage, group_size 32 (the 8-bit gates keep the
      predicate's group_size 64), weights split over several
      model-0000X-of-0000Y.safetensors shards + model.safetensors.index.json.
  <out>/qwen3_5-moe-bf16/
      a Qwen3.5-MoE (`model_type: qwen3_5_moe`) model: the text model's fields
      under `text_config` (RoPE from `rope_parameters` with an `mrope_section`,
      no `norm_topk_prob`: mlx-lm's default true), tensors under
      `language_model.`, split gated-DeltaNet projections (in_proj_qkv, in_proj_z,
      in_proj_b, in_proj_a), 3 value heads per key head, 1 KV head; bf16 (A_log
      kept f32 by the model's cast_predicate, as mlx_lm.convert does), 4-bit
      group_size 64, router and shared-expert gate 8-bit (the model's
      quant_predicate).

The models are mlx-lm's own `mlx_lm.models.qwen3_next.Model` and
`mlx_lm.models.qwen3_5_moe.Model` (4 layers: 0,1,2 gated DeltaNet, 3 full
attention; 16 experts, top-4, shared expert), with every
parameter filled with seeded random values.  It is quantized with
`mlx_lm.utils.quantize_model`, saved with `save_model` + `save_config`, then
reloaded from disk with `mlx_lm.utils.load_model`, cast to float32 arithmetic
(`model.set_dtype(mx.float32)`; the stored values are unchanged) and run to
produce reference.json:

  prompt_ids          prompt token ids (tokenizer-encoded text, no EOS inside)
  greedy_ids          32 new tokens, greedy argmax with a KV/Arrays cache
                      (prefill the prompt, then one token at a time; EOS does
                      NOT stop generation)
  scored_ids          prompt_ids + greedy_ids
  logits_file         logits.npy: float32 [len(scored_ids), vocab], little
                      endian, C order; one cache-less forward over scored_ids
  mean_nll/perplexity mean natural-log NLL of scored_ids[1:] from the
                      teacher-forced logits (float64 math), exp(mean_nll)
  min_greedy_margin   min over greedy steps of (top1 - top2) logit
  greedy_margins      the per-step margins
  text                the decoded prompt text
  seed                the seed the parameters were drawn with

A seed is rejected (and the next one tried) when the minimum greedy margin is
below --min-margin (default 2e-2, stricter than the 1e-3 floor) so that greedy
ids are never decided by rounding noise.

The tokenizer is a tiny byte-level BPE (Qwen2-style pre-tokenizer) trained with
HF `tokenizers` on the embedded corpus below, with special tokens
<|endoftext|>, <|im_start|>, <|im_end|> appended after the trained vocab.  The
same tokenizer.json is used by every fixture.

Everything is deterministic (numpy PCG64 seeds; BPE training on a fixed corpus).

How to run
----------
    pip install -r tools/requirements-oracle.txt      # Linux: CPU backend
    python tools/make_fixtures.py --out tests/fixtures
    python tools/make_fixtures.py --out tests/fixtures --only qwen3_5-moe-bf16
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

import mlx_lm
import mlx_lm.utils as mlx_utils
from mlx_lm.models import qwen3_5_moe, qwen3_next
from mlx_lm.generate import generate_step

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

MLX_VERSION = "0.32.4"
MLX_LM_VERSION = "0.32.2"
N_NEW_TOKENS = 32
VOCAB_SIZE = 512  # model vocab (multiple of 64); tokenizer vocab <= this
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2/Qwen3 pre-tokenizer split regex.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and "
    "the fox ran back into the forest before anyone could see where it went.",
    "Once upon a time there was a small village at the edge of a great river. "
    "Every morning the people of the village walked down to the water to fish, "
    "to wash their clothes, and to talk about the weather and the harvest.",
    "A mixture of experts model routes every token to a few experts out of many. "
    "The router computes a softmax over the experts, keeps the top four, and "
    "the outputs of the chosen experts are added together with their weights.",
    "Linear attention keeps a fixed size state instead of a growing key value "
    "cache. The gated delta rule decays the state and then writes the new value "
    "for the current key, so the memory of the model stays small and constant.",
    "In the beginning the engineers wrote tests, and the tests were red. Then "
    "they wrote the code, and the tests turned green, and they saw that it was good.",
    "Please answer the question in one short sentence. What is the capital of "
    "France? The capital of France is Paris. What is two plus two? It is four.",
    "She sells sea shells by the sea shore. Peter Piper picked a peck of pickled "
    "peppers. How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "Numbers like 1, 2, 3, 42, 2025 and 3.14159 appear in text, as do symbols "
    "such as #, $, %, & and (parentheses), [brackets] and {braces}.",
    "def main():\n    print(\"hello, world\")\n    return 0\n\nif __name__ == \"__main__\":\n    main()\n",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "こんにちは、世界。日本語のテキストも少し入れておきます。",
    "Emoji are bytes too: 🙂 😀 🚀 🦊 ❤️ 👍🏽 — and so are accents: café, naïve, résumé.",
]

PROMPT_TEXT = {
    "qwen3-next-bf16": (
        "Once upon a time there was a small village at the edge of a great river. "
        "The router computes a softmax over the experts, and the gated delta rule "
        "decays the state. 你好，世界！ The quick brown fox 🦊 jumps over the lazy dog, "
        "and the engineers wrote tests before the code."
    ),
    "qwen3-next-f32-sharded": "The capital of France is Paris. 🙂 What is two plus two?",
    "qwen3_5-moe-bf16": (
        "Linear attention keeps a fixed size state instead of a growing key value cache. "
        "Please answer the question in one short sentence: what is two plus two? "
        "こんにちは、世界。 Peter Piper picked a peck of pickled peppers 🚀 by the sea shore, "
        "and the numbers 3.14159 and 2025 appear in [brackets] too."
    ),
}
MIN_PROMPT_LEN = {"qwen3-next-bf16": 80, "qwen3-next-f32-sharded": 16, "qwen3_5-moe-bf16": 80}

FIXTURES = [
    # name, model family, storage dtype, group_size, force shards, base seed
    ("qwen3-next-bf16", "qwen3_next", mx.bfloat16, 64, False, 1234),
    ("qwen3-next-f32-sharded", "qwen3_next", mx.float32, 32, True, 5678),
    ("qwen3_5-moe-bf16", "qwen3_5_moe", mx.bfloat16, 64, False, 4321),
]
FAMILIES = {"qwen3_next": qwen3_next, "qwen3_5_moe": qwen3_5_moe}


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------
def build_tokenizer(model_vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=model_vocab - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    assert tok.get_vocab_size() <= model_vocab
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------
def base_config(tok: Tokenizer, torch_dtype: str) -> dict:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def qwen35_moe_config(tok: Tokenizer, torch_dtype: str) -> dict:
    """A Qwen3.5-MoE config shaped like the released ones (Qwen3.5-35B-A3B): the text
    model under `text_config`, RoPE in `rope_parameters`, no norm_topk_prob /
    decoder_sparse_step / mlp_only_layers (HF removed them from the class)."""
    text = {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "dtype": torch_dtype,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_value_head_dim": 32,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 64,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 128,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        # Dropped by save_config (mlx-lm keeps no vision tower).
        "vision_config": {"depth": 1, "hidden_size": 32, "model_type": "qwen3_5_moe", "out_hidden_size": 128},
    }


def init_value(name: str, shape, rng: np.random.Generator) -> np.ndarray:
    """Non-trivial random value for one (unquantized) parameter."""
    name = name.removeprefix("language_model.")  # Qwen3.5-MoE's text model

    def normal(std):
        return rng.standard_normal(shape) * std

    def fan_in_normal(gain=1.0):
        return normal(gain / math.sqrt(shape[-1]))

    if name == "model.embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return fan_in_normal(4.0)  # logits spread of several units
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)  # plain multiplier (gated RMSNorm)
    if name.endswith("norm.weight"):  # input/post_attention/final/q_norm/k_norm
        return 1.0 + normal(0.1)  # MLX stores these already shifted (+1)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 8.0, size=shape))
    if name.endswith("dt_bias"):
        return -1.5 + normal(0.5)
    if name.endswith("conv1d.weight"):  # [C, K, 1]
        return normal(0.5)
    if name.endswith("mlp.gate.weight"):
        return fan_in_normal(2.0)  # decisive routing
    if name.endswith(("self_attn.v_proj.weight", "self_attn.o_proj.weight")):
        return fan_in_normal(2.0)  # attention averages values; keep its output O(1)
    if name.endswith(".weight") and len(shape) >= 2:
        return fan_in_normal(1.0)
    raise ValueError(f"no init rule for {name} {shape}")


def build_model(family, config: dict, seed: int) -> nn.Module:
    mx.random.seed(seed)
    # A copy: qwen3_5's TextModelArgs renames `rope_type` in place.
    model = family.Model(family.ModelArgs.from_dict(copy.deepcopy(config)))
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        v = init_value(name, tuple(p.shape), rng).astype(np.float32)
        new.append((name, mx.array(v)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


def cast_floating(model: nn.Module, dtype) -> None:
    """What mlx_lm.convert does with --dtype: cast every floating parameter that the
    model's cast_predicate allows (qwen3_5 keeps A_log; qwen3_next has no predicate)."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_unflatten(
            [
                (k, v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )
    mx.eval(model.parameters())


def small_make_shards(max_bytes: int):
    """Same algorithm as mlx_lm.utils.make_shards, with a byte-sized limit."""

    def make_shards(weights: dict, max_file_size_gb: int = 0) -> list:
        shards, shard_size = [], 0
        for k, v in weights.items():
            if not shards or shard_size + v.nbytes > max_bytes:
                shards.append({})
                shard_size = 0
            shards[-1][k] = v
            shard_size += v.nbytes
        return shards

    return make_shards


def save_checkpoint(out: Path, model, config: dict, shard_bytes: int | None) -> None:
    orig = mlx_utils.make_shards
    if shard_bytes is not None:
        mlx_utils.make_shards = small_make_shards(shard_bytes)
    try:
        mlx_utils.save_model(out, model, donate_model=False)
    finally:
        mlx_utils.make_shards = orig
    mlx_utils.save_config(dict(config), out / "config.json")


# --------------------------------------------------------------------------
# Oracle
# --------------------------------------------------------------------------
def top2_margin(logits: np.ndarray) -> float:
    s = np.sort(logits.astype(np.float64))
    return float(s[-1] - s[-2])


def reference(out: Path, prompt_ids: list[int]) -> dict:
    model, _ = mlx_utils.load_model(out)
    model.set_dtype(mx.float32)  # f32 arithmetic; stored values unchanged

    # Greedy with cache.
    cache = model.make_cache()
    logits = model(mx.array([prompt_ids]), cache=cache)[0, -1]
    greedy, margins = [], []
    for _ in range(N_NEW_TOKENS):
        l = np.array(logits.astype(mx.float32))
        tok_id = int(np.argmax(l))
        greedy.append(tok_id)
        margins.append(top2_margin(l))
        logits = model(mx.array([[tok_id]]), cache=cache)[0, -1]
        mx.eval(logits)

    # Teacher-forced full forward, no cache.
    scored = prompt_ids + greedy
    full = np.array(model(mx.array([scored]))[0].astype(mx.float32))
    full = np.ascontiguousarray(full, dtype="<f4")
    lp = full[:-1].astype(np.float64)
    m = lp.max(axis=-1, keepdims=True)
    logz = (m + np.log(np.exp(lp - m).sum(axis=-1, keepdims=True)))[:, 0]
    tgt = np.array(scored[1:])
    nll = logz - lp[np.arange(len(tgt)), tgt]
    mean_nll = float(nll.mean())

    # Cross-checks.
    n_p = len(prompt_ids)
    tf_greedy = [int(i) for i in full[n_p - 1 : -1].argmax(axis=-1)]
    mlx_gen = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt_ids), model, max_tokens=N_NEW_TOKENS
        )
    ]
    cached_vs_full = float(
        np.abs(
            np.array(model(mx.array([prompt_ids]))[0, -1].astype(mx.float32))
            - full[n_p - 1]
        ).max()
    )
    return {
        "greedy_ids": greedy,
        "margins": margins,
        "scored_ids": scored,
        "logits": full,
        "mean_nll": mean_nll,
        "perplexity": math.exp(mean_nll),
        "tf_greedy_matches": tf_greedy == greedy,
        "mlx_generate_matches": mlx_gen == greedy,
        "mlx_generate_ids": mlx_gen,
        "prefix_logit_maxdiff": cached_vs_full,
    }


def make_fixture(root: Path, tok: Tokenizer, name, family, dtype, group_size, sharded, seed0, min_margin):
    out = root / name
    text = PROMPT_TEXT[name]
    prompt_ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(prompt_ids, skip_special_tokens=False) == text, "prompt must round-trip"
    eos_ids = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert not eos_ids & set(prompt_ids)
    assert len(prompt_ids) >= MIN_PROMPT_LEN[name], (name, len(prompt_ids))

    torch_dtype = "bfloat16" if dtype == mx.bfloat16 else "float32"
    for seed in range(seed0, seed0 + 100):
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        if family == "qwen3_5_moe":
            config = qwen35_moe_config(tok, torch_dtype)
        else:
            config = base_config(tok, torch_dtype)
        model = build_model(FAMILIES[family], config, seed)
        cast_floating(model, dtype)
        model, qconfig = mlx_utils.quantize_model(model, config, group_size, 4)
        shard_bytes = None
        if sharded:
            total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            shard_bytes = total // 4 + 1  # -> 4-5 shards
        save_checkpoint(out, model, qconfig, shard_bytes)
        del model

        tok.save(str(out / "tokenizer.json"))
        with open(out / "tokenizer_config.json", "w") as f:
            json.dump(tokenizer_config(tok), f, indent=2, ensure_ascii=False)
        with open(out / "generation_config.json", "w") as f:
            json.dump(
                {
                    "bos_token_id": tok.token_to_id("<|endoftext|>"),
                    "do_sample": True,
                    "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
                    "pad_token_id": tok.token_to_id("<|endoftext|>"),
                    "temperature": 0.7,
                    "top_k": 20,
                    "top_p": 0.8,
                },
                f,
                indent=2,
            )

        r = reference(out, prompt_ids)
        mm = min(r["margins"])
        print(
            f"[{name}] seed={seed} ppl={r['perplexity']:.4f} min_margin={mm:.4f} "
            f"tf_match={r['tf_greedy_matches']} mlx_generate_match={r['mlx_generate_matches']} "
            f"cache/no-cache maxdiff={r['prefix_logit_maxdiff']:.2e}"
        )
        if mm < min_margin or not r["tf_greedy_matches"] or not r["mlx_generate_matches"]:
            print(f"[{name}] seed {seed} rejected, trying the next one")
            continue
        np.save(out / "logits.npy", r["logits"])
        ref = {
            "generator": "tools/make_fixtures.py",
            "mlx": MLX_VERSION,
            "mlx_lm": MLX_LM_VERSION,
            "seed": seed,
            "prompt_ids": prompt_ids,
            "greedy_ids": r["greedy_ids"],
            "scored_ids": r["scored_ids"],
            "logits_file": "logits.npy",
            "logits_shape": list(r["logits"].shape),
            "logits_dtype": "float32",
            "mean_nll": r["mean_nll"],
            "perplexity": r["perplexity"],
            "min_greedy_margin": mm,
            "greedy_margins": r["margins"],
            "text": text,
            "greedy_text": tok.decode(r["greedy_ids"], skip_special_tokens=False),
        }
        with open(out / "reference.json", "w") as f:
            json.dump(ref, f, indent=2, ensure_ascii=False)
        print(f"[{name}] greedy_ids={r['greedy_ids']}")
        return
    raise RuntimeError(f"no acceptable seed for {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--min-margin", type=float, default=2e-2)
    ap.add_argument("--only", action="append", help="make only this fixture (repeatable)")
    args = ap.parse_args()

    assert mx.__version__ == MLX_VERSION, mx.__version__
    assert mlx_lm.__version__ == MLX_LM_VERSION, mlx_lm.__version__
    mx.set_default_device(mx.cpu)

    tok = build_tokenizer(VOCAB_SIZE)
    names = [f[0] for f in FIXTURES]
    for only in args.only or []:
        assert only in names, f"--only {only}: not one of {names}"
    for name, family, dtype, gs, sharded, seed in FIXTURES:
        if args.only and name not in args.only:
            continue
        make_fixture(args.out, tok, name, family, dtype, gs, sharded, seed, args.min_margin)


if __name__ == "__main__":
    main()

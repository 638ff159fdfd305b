#!/usr/bin/env python3
"""An MTP draft head for the Qwen3-Next and Qwen3.5-MoE fixtures, and its reference logits.

What it makes, in each fixture directory (made by make_fixtures.py, left as it is):

  mtp.safetensors   the head's tensors under their released names (`mtp.fc`,
                    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
                    `mtp.layers.0.*`, `mtp.norm`), in the MLX layout the reference
                    system's mtp.safetensors uses: stacked `switch_mlp` experts, norms
                    with the +1 folded in, 4-bit group 64 (router and shared-expert gate
                    8-bit, as mlx-lm's quant_predicate), scales in the fixture's dtype
  mtp_logits.npy    float32 [len(scored_ids) - 1, vocab]: the head's logits at every
                    position i of reference.json's scored_ids, given the token after it
                    (scored_ids[i + 1]) and the model's hidden state at i

The head is written from the spec (../shared/spec/models.md 2.9, vLLM's
`qwen3_next_mtp.py`), with mlx-lm's own decoder layer for its one layer
(`qwen3_next.Qwen3NextDecoderLayer` / `qwen3_5.DecoderLayer`, built as a
full-attention layer):

    e = rms_norm(embed(t_{i+1}); pre_fc_norm_embedding)
    g = rms_norm(h_i; pre_fc_norm_hidden)       h_i: the model's final-normed hidden state
    x = fc(concat(e, g))
    y = rms_norm(DecoderLayer(x, causal, own KV cache); mtp.norm)
    logits = lm_head(y)                          the model's own lm_head

Every value is run in float32 on the stored (quantized, reloaded) weights, as the other
fixtures' references are.

    .venv/bin/python tools/make_mtp_fixture.py --fixtures tests/fixtures
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import utils as mlx_utils
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

FIXTURES = {"qwen3-next-bf16": 101, "qwen3_5-moe-bf16": 202}


class MtpHead(nn.Module):
    """vLLM's Qwen3-Next MTP predictor with mlx-lm's decoder layer."""

    def __init__(self, args, layer_class):
        super().__init__()
        d = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        # A full-attention layer: the last index of the first attention interval.
        self.layers = [layer_class(args, args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def __call__(self, embedded, hidden, cache):
        e = self.pre_fc_norm_embedding(embedded)
        g = self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, g], axis=-1))
        mask = create_attention_mask(x, cache)
        x = self.layers[0](x, mask=mask, cache=cache)
        return self.norm(x)


def init_value(name: str, shape, rng: np.random.Generator) -> np.ndarray:
    def fan_in_normal(gain=1.0):
        return rng.standard_normal(shape) * gain / math.sqrt(shape[-1])

    if name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")):  # folded: 1 + w
        return 1.0 + rng.standard_normal(shape) * 0.1
    if name.endswith("mlp.gate.weight"):
        return fan_in_normal(2.0)
    if name.endswith(("self_attn.v_proj.weight", "self_attn.o_proj.weight")):
        return fan_in_normal(2.0)
    if name.endswith(".weight") and len(shape) >= 2:
        return fan_in_normal(1.0)
    raise ValueError(f"no init rule for {name} {shape}")


def text_parts(model, family):
    """(text args, decoder layer class, the text model, the lm_head)."""
    if family == "qwen3_5_moe":
        text = model.language_model
        return text.args, qwen3_5.DecoderLayer, text.model, text.lm_head
    return model.args, qwen3_next.Qwen3NextDecoderLayer, model.model, model.lm_head


def make(fixture: Path, seed: int) -> None:
    config = json.loads((fixture / "config.json").read_text())
    family = config["model_type"]
    model, _ = mlx_utils.load_model(fixture)
    model.set_dtype(mx.float32)
    args, layer_class, text_model, lm_head = text_parts(model, family)
    dtype = mx.bfloat16 if "bf16" in fixture.name else mx.float32

    head = MtpHead(copy.deepcopy(args), layer_class)
    rng = np.random.default_rng(seed)
    head.update(
        tree_unflatten(
            [
                (k, mx.array(init_value(k, tuple(v.shape), rng).astype(np.float32)).astype(dtype))
                for k, v in tree_flatten(head.parameters())
            ]
        )
    )

    def bits(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            return {"group_size": 64, "bits": 8}
        return {"group_size": 64, "bits": 4}

    nn.quantize(head, class_predicate=bits)
    weights = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(fixture / "mtp.safetensors"), weights, metadata={"format": "mlx"})

    # Reload the stored values and run in f32.
    stored = mx.load(str(fixture / "mtp.safetensors"))
    head.load_weights([(k.removeprefix("mtp."), v) for k, v in stored.items()])
    head.set_dtype(mx.float32)

    ids = json.loads((fixture / "reference.json").read_text())["scored_ids"]
    tokens = mx.array([ids])
    hidden = text_model(tokens)  # final-normed
    embedded = text_model.embed_tokens(mx.array([ids[1:]]))
    y = head(embedded, hidden[:, :-1], KVCache())
    logits = lm_head(y)[0].astype(mx.float32)
    mx.eval(logits)
    np.save(fixture / "mtp_logits.npy", np.array(logits))
    print(f"{fixture.name}: {len(weights)} tensors, logits {tuple(logits.shape)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", type=Path, default=Path("tests/fixtures"))
    a = ap.parse_args()
    for name, seed in FIXTURES.items():
        make(a.fixtures / name, seed)


if __name__ == "__main__":
    main()

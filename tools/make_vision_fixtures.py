#!/usr/bin/env python3
"""Generate the vision fixtures: the image processor's token counts and pixels, and a small
random Qwen3.5-MoE vision tower with its outputs, all from transformers 5.24.0.

What it makes, in <out>/qwen3_5-moe-vision/:

  config.json            the text fixture's (qwen3_5-moe-bf16) with a `vision_config`
                         for the small tower below
  model.safetensors      the text fixture's tensors plus the tower's, bf16, under the
                         names the MLX conversions use (`vision_tower.*`, the patch
                         embedding's Conv3d weight channels-last: `[out, t, h, w, c]`,
                         as mlx-vlm's `sanitize` stores it)
  model.safetensors.index.json, tokenizer files: copied from the text fixture
  processor_sizes.json   for random image sizes (height, width): the grid `[t, h, w]`
                         that `Qwen2VLImageProcessor` gives with the released settings
                         (patch 16, merge 2, temporal patch 2, mean = std = 0.5,
                         min 65,536 and max 2,359,296 pixels: at most 2,304 tokens), or
                         the error for an aspect ratio over 200
  vision_cases.json      the tower cases: each image (stored as a PNG beside it), the
                         processor settings it ran with, its grid, and where its
                         `pixel_values` and tower output are in vision_cases.safetensors
  vision_cases.safetensors  f32 `pixels.N` (the processor's pixel_values) and `tower.N`
                         (Qwen3_5MoeVisionModel's merged output, `pooler_output`), run in
                         f32 on the stored bf16 values
  image_prompt.json, image_logits.npy
                         a prompt with two images (cases 1 and 0: 10 tokens on a 2 x 5
                         grid, then 1) and text after each, its `input_ids`, the M-RoPE
                         positions `get_rope_index` gives it (3 rows: t, h, w) and
                         the next text position, and its teacher-forced logits
                         `[tokens, vocab]` f32 from transformers'
                         `Qwen3_5MoeForConditionalGeneration` run in f32 on the text
                         fixture's weights (dequantized from its MLX layout: norms
                         `w - 1`, the conv weight `[C, 1, K]`, the experts' gate and up
                         stacked) and the tower above

The placeholder ids live inside the small vocabulary: the last four BPE tokens (505-508)
become `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>` and `<|video_pad|>` (added
tokens of tokenizer.json; their merges removed), and config.json's `*_token_id` name them.

The tower: depth 2, hidden 64, 4 heads, MLP 128 (gelu_pytorch_tanh), patch 16, temporal
patch 2, merge 2, 64 position embeddings (an 8 x 8 grid, interpolated to each image),
output width = the text model's hidden size.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -r tools/requirements-vision.txt
    /tmp/venv/bin/python tools/make_vision_fixtures.py --out tests/fixtures
"""

import argparse
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file as load_t
from safetensors.torch import save_file
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

RELEASED = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 2304 * 32 * 32},
)


def processor(**over):
    kw = dict(RELEASED)
    kw.update(over)
    return Qwen2VLImageProcessor(**kw)


def sizes(rng):
    """Random sizes over several scales, plus edges: tiny, huge, ratios near 200."""
    out = [(1, 1), (32, 32), (256, 256), (255, 257), (16, 3200), (3200, 16), (20, 4001),
           (4000, 4000), (1536, 1536), (1535, 1537), (8000, 300), (48, 48), (7, 1400),
           (1, 200), (1, 201), (2048, 1152), (1080, 1920), (224, 224), (33, 97)]
    for _ in range(300):
        scale = rng.choice([64, 512, 2048, 6000])
        h, w = rng.randint(1, scale), rng.randint(1, scale)
        out.append((h, w))
    return out


def processor_sizes(out, rng):
    p = processor()
    cases = []
    for h, w in sizes(rng):
        img = Image.new("RGB", (w, h))
        try:
            grid = p(images=img, return_tensors="pt")["image_grid_thw"][0].tolist()
            cases.append({"height": h, "width": w, "grid": grid})
        except ValueError as e:
            cases.append({"height": h, "width": w, "error": str(e)})
    (out / "processor_sizes.json").write_text(json.dumps({"processor": RELEASED, "cases": cases}, indent=1))
    print(f"processor_sizes.json: {len(cases)} sizes")


def tower(out, text_dir, seed):
    torch.manual_seed(seed)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    vcfg = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, in_channels=3,
                patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                out_hidden_size=text_cfg["text_config"]["hidden_size"],
                num_position_embeddings=64, hidden_act="gelu_pytorch_tanh")
    model = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**vcfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name == "pos_embed.weight":
                p.copy_(0.5 * torch.randn_like(p))
            else:
                fan_in = p.shape[1] if p.ndim >= 2 else 16
                if p.ndim == 5:
                    fan_in = p[0].numel()
                p.copy_(torch.randn_like(p) / fan_in ** 0.5)
            # The stored values are bf16; the reference runs f32 on them.
            p.copy_(p.to(torch.bfloat16).float())

    cfg = dict(text_cfg)
    stored_vcfg = dict(vcfg, model_type="qwen3_5_moe_vision")
    cfg["vision_config"] = stored_vcfg
    cfg.update(PLACEHOLDERS_CONFIG)
    (out / "config.json").write_text(json.dumps(cfg, indent=4))

    tensors = dict(load_t(str(text_dir / "model.safetensors")))
    for name, p in model.state_dict().items():
        v = p.detach().to(torch.bfloat16)
        if name == "patch_embed.proj.weight":
            v = v.permute(0, 2, 3, 4, 1).contiguous()  # mlx-vlm's channels-last Conv3d
        tensors[f"vision_tower.{name}"] = v.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    index = json.loads((text_dir / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model.safetensors" for k in sorted(tensors)}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    for f in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(text_dir / f, out / f)
    write_tokenizer(text_dir / "tokenizer.json", out / "tokenizer.json")

    # The cases: (height, width) of the image, and the processor's pixel bounds.
    specs = [
        ("square, one token", (32, 32), dict(size={"shortest_edge": 1024, "longest_edge": 16384})),
        ("non-square", (64, 160), dict(size={"shortest_edge": 1024, "longest_edge": 16384})),
        ("at the pixel bound", (200, 180), dict(size={"shortest_edge": 1024, "longest_edge": 16384})),
        ("resized, non-square", (150, 77), dict(size={"shortest_edge": 1024, "longest_edge": 16384})),
    ]
    rng = np.random.default_rng(seed)
    cases, arrays = [], {}
    for i, (what, (h, w), over) in enumerate(specs):
        # A smooth picture plus noise: resampling is exercised on realistic content.
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([127 + 120 * np.sin(xx / 9.0 + c) * np.cos(yy / 13.0 - c) for c in range(3)], -1)
        img = np.clip(base + rng.normal(0, 6, size=base.shape), 0, 255).astype(np.uint8)
        png = f"image{i}.png"
        Image.fromarray(img).save(out / png)
        p = processor(**over)
        feats = p(images=Image.open(out / png), return_tensors="pt")
        pixels = feats["pixel_values"].float()
        grid = feats["image_grid_thw"]
        with torch.no_grad():
            merged = model(pixels, grid_thw=grid).pooler_output.float()
        arrays[f"pixels.{i}"] = pixels.contiguous()
        arrays[f"tower.{i}"] = merged.contiguous()
        proc = dict(RELEASED)
        proc.update(over)
        cases.append({"what": what, "image": png, "height": h, "width": w,
                      "processor": proc, "grid": grid[0].tolist(),
                      "pixels": f"pixels.{i}", "tower": f"tower.{i}"})
        print(f"case {i} {what}: {h}x{w} -> grid {grid[0].tolist()}, {merged.shape[0]} tokens")
    save_file(arrays, str(out / "vision_cases.safetensors"))
    (out / "vision_cases.json").write_text(json.dumps({"seed": seed, "cases": cases}, indent=1))
    return model, cfg, [(out / c["image"], c["processor"]) for c in cases]


# The placeholder tokens: the last four ids of the small vocabulary.
PLACEHOLDERS = {505: "<|vision_start|>", 506: "<|vision_end|>", 507: "<|image_pad|>", 508: "<|video_pad|>"}
PLACEHOLDERS_CONFIG = {"vision_start_token_id": 505, "vision_end_token_id": 506,
                       "image_token_id": 507, "video_token_id": 508}


def write_tokenizer(src, dst):
    """The text fixture's tokenizer with ids 505-508 turned into the placeholder tokens."""
    tok = json.loads(src.read_text())
    vocab = tok["model"]["vocab"]
    gone = {k for k, v in vocab.items() if v in PLACEHOLDERS}
    tok["model"]["vocab"] = {k: v for k, v in vocab.items() if k not in gone}
    merge = lambda m: "".join(m) if isinstance(m, list) else m.replace(" ", "")
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if merge(m) not in gone]
    for i, content in PLACEHOLDERS.items():
        tok["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    tok["added_tokens"].sort(key=lambda t: t["id"])
    dst.write_text(json.dumps(tok, ensure_ascii=False))


def dequantize(tensors, name, spec):
    """An MLX affine-quantized weight (`name.weight` packed in u32, `.scales`, `.biases`) in f32."""
    q = tensors[f"{name}.weight"].numpy().astype(np.uint64)
    scales = tensors[f"{name}.scales"].float().numpy()
    biases = tensors[f"{name}.biases"].float().numpy()
    bits, group = spec["bits"], spec["group_size"]
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint64) * bits)
    vals = ((q[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*q.shape[:-1], q.shape[-1] * per)
    vals = vals.astype(np.float32).reshape(*vals.shape[:-1], -1, group)
    w = vals * scales[..., None] + biases[..., None]
    return torch.from_numpy(w.reshape(*w.shape[:-2], -1).astype(np.float32))


def hf_text_weights(text_dir, cfg):
    """The text fixture's MLX tensors as transformers' qwen3_5_moe names them, in f32."""
    tensors = dict(load_t(str(text_dir / "model.safetensors")))
    quant = cfg["quantization"]
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".scales")})
    out = {}
    for k, v in tensors.items():
        if k.endswith((".scales", ".biases")) or k.rsplit(".", 1)[0] in names:
            continue
        out[k] = v.float()
    for n in names:
        spec = quant.get(n, {"bits": quant["bits"], "group_size": quant["group_size"]})
        out[n + ".weight"] = dequantize(tensors, n, spec)
    hf = {}
    for k, v in out.items():
        k2 = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        if k2.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                        "k_norm.weight")) or k2 == "model.language_model.norm.weight":
            v = v - 1.0  # mlx-lm stores `1 + w` where transformers adds the 1
        if k2.endswith("conv1d.weight"):
            v = v.permute(0, 2, 1)  # MLX [C, K, 1] -> torch [C, 1, K]
        hf[k2] = v
    for k in [k for k in hf if ".switch_mlp.gate_proj." in k]:
        prefix = k.split(".switch_mlp.")[0]
        gate = hf.pop(k)
        up = hf.pop(f"{prefix}.switch_mlp.up_proj.weight")
        hf[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        hf[f"{prefix}.experts.down_proj"] = hf.pop(f"{prefix}.switch_mlp.down_proj.weight")
    return hf


def image_logits(out, text_dir, tower_model, cfg, images):
    """Teacher-forced logits of a prompt with two images, from the whole transformers model."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration
    hf_cfg = Qwen3_5MoeConfig(text_config=cfg["text_config"], vision_config=cfg["vision_config"],
                              **PLACEHOLDERS_CONFIG)
    model = Qwen3_5MoeForConditionalGeneration(hf_cfg).float().eval()
    state = hf_text_weights(text_dir, cfg)
    for name, p in tower_model.state_dict().items():
        state[f"model.visual.{name}"] = p
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)

    # transformers on the text fixture's own prompt: within reach of mlx-lm's logits.
    ref = json.loads((text_dir / "reference.json").read_text())
    ids = torch.tensor([ref["scored_ids"]])
    with torch.no_grad():
        text_logits = model(input_ids=ids).logits[0].float().numpy()
    mlx = np.load(text_dir / "logits.npy")[: ids.shape[1]]
    print(f"text-only: transformers vs mlx-lm logits, max |diff| {np.abs(text_logits - mlx).max():.2e}")

    pixel_values, grids, pads = [], [], []
    for png, proc in images:
        feats = processor(**{k: v for k, v in proc.items() if k in ("size",)})(images=Image.open(png),
                                                                               return_tensors="pt")
        pixel_values.append(feats["pixel_values"].float())
        grids.append(feats["image_grid_thw"])
        pads.append(int(feats["image_grid_thw"][0].prod()) // 4)
    # text, image, text, image, text: ids from the fixture's vocabulary.
    s, e, pad = 505, 506, 507
    text = [[510, 474, 364, 411, 269], [336, 370, 457, 258], [274, 368, 278]]
    prompt = text[0] + [s] + [pad] * pads[0] + [e] + text[1] + [s] + [pad] * pads[1] + [e] + text[2]
    ids = torch.tensor([prompt])
    mm = (ids == pad).int()
    grid = torch.cat(grids)
    with torch.no_grad():
        positions, delta = model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid)
        logits = model(input_ids=ids, pixel_values=torch.cat(pixel_values), image_grid_thw=grid,
                       mm_token_type_ids=mm).logits[0].float().numpy()
    np.save(out / "image_logits.npy", logits.astype(np.float32))
    doc = {"images": [str(png.name) for png, _ in images], "grids": grid.tolist(),
           "input_ids": prompt, "positions": positions[:, 0].tolist(),
           "next_position": int(positions.max()) + 1, "rope_delta": int(delta[0, 0]),
           "logits_file": "image_logits.npy", "logits_shape": list(logits.shape)}
    (out / "image_prompt.json").write_text(json.dumps(doc, indent=1))
    print(f"image prompt: {len(prompt)} tokens, positions t {positions[0, 0].tolist()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--seed", type=int, default=39)
    args = ap.parse_args()
    out = args.out / "qwen3_5-moe-vision"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    processor_sizes(out, rng)
    text_dir = args.out / "qwen3_5-moe-bf16"
    model, cfg, images = tower(out, text_dir, args.seed)
    image_logits(out, text_dir, model, cfg, [images[1], images[0]])


if __name__ == "__main__":
    main()

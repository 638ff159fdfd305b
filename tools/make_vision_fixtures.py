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
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        cfg.setdefault(k, {"image_token_id": 248056, "video_token_id": 248057,
                           "vision_start_token_id": 248053, "vision_end_token_id": 248054}[k])
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
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text_dir / f, out / f)

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--seed", type=int, default=39)
    args = ap.parse_args()
    out = args.out / "qwen3_5-moe-vision"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    processor_sizes(out, rng)
    tower(out, args.out / "qwen3_5-moe-bf16", args.seed)


if __name__ == "__main__":
    main()

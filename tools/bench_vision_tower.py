#!/usr/bin/env python3
"""Time transformers 5.24.0's Qwen3_5MoeVisionModel at the released shape on the CPU, for
the comparison in BENCHMARKS.md ("Vision tower"): per image at 1, 256 and 2,304 tokens
(grids of 2 x 2, 32 x 32 and 96 x 96 patches), random weights, float32, torch's own
threads (one per core unless OMP_NUM_THREADS says otherwise), sdpa attention.

    /tmp/venv/bin/pip install -r tools/requirements-vision.txt
    /tmp/venv/bin/python tools/bench_vision_tower.py [--out-hidden 2048]
"""

import argparse
import time

import torch
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-hidden", type=int, default=2048)
    args = ap.parse_args()
    cfg = Qwen3_5MoeVisionConfig(out_hidden_size=args.out_hidden)
    cfg._attn_implementation = "sdpa"
    model = Qwen3_5MoeVisionModel(cfg).float().eval()
    values = 3 * 2 * 16 * 16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        model(torch.randn(4, values), grid_thw=torch.tensor([[1, 2, 2]]))  # warm-up
        for side, runs in [(2, 5), (32, 3), (96, 1)]:
            pixels = torch.rand(side * side, values) * 2 - 1
            grid = torch.tensor([[1, side, side]])
            start = time.perf_counter()
            for _ in range(runs):
                model(pixels, grid_thw=grid)
            per = (time.perf_counter() - start) / runs
            print(f"transformers: {side * side // 4} tokens ({side} x {side} patches): "
                  f"{per:.3f} s per image ({runs} runs)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""diffusers' own FluxTransformer2DModel, one forward timed, at FLUX.1-dev widths (3072 hidden,
24 heads of 128, joint 4096, pooled 768, guidance) with a chosen depth, on the CPU or a CUDA GPU:
the yardstick shardit-bench forward is compared with (scripts/gpu_check.sh on a GPU; bench/compare
on the CPU). Nothing of diffusers is patched: run it with a Python that has diffusers and torch.

  diffusers_flux_step.py [--device cuda|cpu] [--dtype bf16|fp32] [--double 19] [--single 38]
                         [--img 4096] [--txt 512] [--threads N] [--warmup 1] [--repeat 3]
                         [--gemm-probe] [--json FILE]

Weights are random (seeded), made directly on the device in the run's dtype. Prints one line and,
with --json, writes the step times, the matmul FLOPs (the formula of shardit-bench: every Linear
plus the two attention products) and the versions."""
import argparse
import json
import math
import re
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--double", type=int, default=19, help="double-stream blocks (FLUX.1-dev: 19)")
    p.add_argument("--single", type=int, default=38, help="single-stream blocks (FLUX.1-dev: 38)")
    p.add_argument("--img", type=int, default=4096, help="image tokens, a square (4096 = 1024x1024 px)")
    p.add_argument("--txt", type=int, default=512, help="text tokens")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gemm-probe", action="store_true",
                   help="also measure torch's own product rate in the run's dtype ([1536, 3072] x [3072, 3072], "
                        "best of 3, in this process): the yardstick of 'fraction of GEMM rate'")
    p.add_argument("--json", help="also write the result here")
    return p.parse_args()


def matmul_flops(double, single, image_tokens, text_tokens, width=3072):
    tokens = image_tokens + text_tokens
    linear = double * (2 * tokens * width * 3 * width + 2 * tokens * width * width + 2 * 2 * tokens * width * 4 * width)
    linear += single * (2 * tokens * width * 7 * width + 2 * tokens * 5 * width * width)
    attention = (double + single) * 2 * (2 * tokens * tokens * width)
    return linear + attention


def product_rate(dtype, device, wait):
    """GFLOP/s of torch's own matmul on a projection-shaped product, best of three after a warm-up."""
    x = torch.randn(1536, 3072, dtype=dtype, device=device)
    w = torch.randn(3072, 3072, dtype=dtype, device=device)
    x @ w
    wait()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x @ w
        wait()
        best = min(best, time.perf_counter() - start)
    return 2 * 1536 * 3072 * 3072 / best / 1e9


def torch_kernels(device):
    """What torch runs here: its CPU capability, oneDNN, the BLAS; or the GPU's SDPA back ends."""
    if device.type == "cuda":
        return {"flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
                "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn_sdp": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)()}
    blas = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available(), "blas": blas.group(1) if blas else "?", "threads": torch.get_num_threads()}


def main():
    a = parse_args()
    from diffusers import FluxTransformer2DModel
    import diffusers

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    side = math.isqrt(a.img)
    if side * side != a.img:
        raise SystemExit(f"--img {a.img} is not a square number of tokens")
    torch.manual_seed(0)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the run's dtype, on the device: no full-precision copy
    with device:
        model = FluxTransformer2DModel(num_layers=a.double, num_single_layers=a.single, guidance_embeds=True).eval()
    torch.set_default_dtype(previous_dtype)
    parameters = sum(p.numel() for p in model.parameters())

    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # [img, 3] position ids (0, row, column) and [txt, 3] zeros, as the pipeline makes them
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    inputs = dict(
        hidden_states=torch.randn(1, a.img, 64, dtype=dtype, device=device),
        encoder_hidden_states=torch.randn(1, a.txt, 4096, dtype=dtype, device=device),
        pooled_projections=torch.randn(1, 768, dtype=dtype, device=device),
        timestep=torch.tensor([0.5], device=device),
        guidance=torch.tensor([3.5], device=device),
        img_ids=ids.reshape(-1, 3).to(device),
        txt_ids=torch.zeros(a.txt, 3, device=device),
        return_dict=False,
    )

    times = []
    gemm_gflops = product_rate(dtype, device, wait) if a.gemm_probe else None
    with torch.no_grad():
        for _ in range(a.warmup):
            model(**inputs)
        wait()
        for _ in range(a.repeat):
            start = time.perf_counter()
            model(**inputs)
            wait()
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    flops = matmul_flops(a.double, a.single, a.img, a.txt)
    result = {
        "side": "diffusers",
        "diffusers": diffusers.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": a.dtype,
        "num_layers": a.double,
        "num_single_layers": a.single,
        "parameters": parameters,
        "image_tokens": a.img,
        "text_tokens": a.txt,
        "step_seconds": {"median": median, "min": times[0], "max": times[-1], "all": times},
        "matmul_gflop_per_step": flops / 1e9,
        "achieved_gflops": flops / median / 1e9,
        "attention": "torch.nn.functional.scaled_dot_product_attention (diffusers' default processor)",
        "kernels": torch_kernels(device),
        "gemm_gflops": gemm_gflops,
        "fraction_of_gemm_rate": flops / median / 1e9 / gemm_gflops if gemm_gflops else None,
    }
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    print(f"diffusers {diffusers.__version__} on torch {torch.__version__} ({result['device']}): "
          f"FluxTransformer2DModel {a.dtype} {a.double}+{a.single} blocks, {a.img}+{a.txt} tokens: "
          f"step median {median:.4f} s (min {times[0]:.4f}, max {times[-1]:.4f}), "
          f"{result['achieved_gflops']:.0f} GFLOP/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

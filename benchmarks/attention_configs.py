"""Sweep launch configs of the fused JVP kernel at fixed shapes, to choose its tuning candidates.

    PYTHONPATH=. python benchmarks/attention_configs.py --head-dims 64 128 --tokens 1024 4096
    PYTHONPATH=. python benchmarks/attention_configs.py --head-dims 64 72 128 --tokens 256 1024 4096 --candidates --loads pointers tma tma-host

Prints every config's GPU time (CUDA-graph replay) and TFLOP/s (the JVP forward counted as 3
forwards) as it is measured, then, per (head dim, tokens), the best eight. bf16, batch x heads = 64 (heads = 16).
`--loads pointers tma tma-host` times every config with each way of reading the tiles: pointer loads, or tensor
descriptors (Hopper's TMA, `FLM_ATTENTION_TMA`) that each program builds (`tma`) or the host builds per launch
(`tma-host`); the summary ranks them together.
"""

import argparse
import itertools

import torch
import triton

from flm.kernels.attention_fwd import _TMA_MODES, attention_fwd, launch_candidates, split_head_dim

LOADS = {"pointers": "0", "tma": "device", "tma-host": "host"}  # attention_fwd's tma=
BLOCKS = [(128, 128), (128, 64), (128, 32), (128, 16), (64, 64), (64, 32), (64, 128)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--blocks", nargs="+", default=[f"{m}x{n}" for m, n in BLOCKS], help="BLOCK_MxBLOCK_N")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument(
        "--candidates", action="store_true", help="the kernel's own candidates per head dim and load kind, not the grid above"
    )
    ap.add_argument("--loads", nargs="+", choices=list(LOADS), default=["pointers"], help="how the kernel reads tiles")
    args = ap.parse_args()
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    peak = 2 * 8192**3 / triton.testing.do_bench_cudagraph(lambda: a @ b, rep=50, return_mode="median") / 1e9
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16 matmul {peak:.0f} TFLOP/s"
    )
    for d, n in itertools.product(args.head_dims, args.tokens):
        b, h = 64 // 16, 16
        q, k, v, tq, tk, tv = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(6))
        flops = 3 * 4 * b * h * n * n * d
        results = []
        blocks = [tuple(int(x) for x in b.split("x")) for b in args.blocks]
        block_d, block_d_rem = split_head_dim(d)
        grid = [(bm, bn, w, s) for (bm, bn), w, s in itertools.product(blocks, args.warps, args.stages)]
        runs = [
            (tuple(c[:4]), loads)
            for loads in args.loads
            for c in (launch_candidates(block_d + block_d_rem, False, _TMA_MODES[LOADS[loads]]) if args.candidates else grid)
        ]
        for cfg, loads in runs:
            tma = LOADS[loads]
            fn = lambda: attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=d**-0.5, config=cfg, tma=tma)  # noqa: E731
            try:
                fn()
                ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
            except Exception as e:  # out of shared memory / registers for this config
                print(f"  D={d} N={n} {cfg} {loads}: {type(e).__name__}")
                continue
            results.append((ms, cfg, loads))
            print(f"  D={d} N={n} {cfg} {loads}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        print(f"\nD={d} tokens={n}, best first")
        for ms, cfg, loads in sorted(results)[:8]:
            print(
                f"  {cfg} {loads}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / peak:.2f} of the matmul peak)"
            )


if __name__ == "__main__":
    main()

"""adaLN's modulated layer norm and gated residual (flm.nn.modulate, flm.nn.gated_residual) on the fused kernels
(flm.kernels.adaln) against PyTorch's ops: GPU time per call of the forward, the forward + backward and the JVP forward
at DiT shapes, fp32 residual stream, bf16 modulation and branch output (what the DiT's blocks run under bf16 autocast).

GPU time is the sum of the kernels' device time in torch.profiler over `--iters` calls, so host time does not count.
"bytes" is the least a pass must move (each input read once, each output written once); GB/s divides it by the time.

    PYTHONPATH=. python benchmarks/adaln.py [--shapes 128x196x384 16x1024x768 4x1024x1152] [--iters 20]
"""

import argparse

import torch
import triton
from torch.autograd import forward_ad
from torch.profiler import ProfilerActivity, profile

from flm import nn as fnn
from flm.kernels import adaln


def kernel_us(fn, iters: int) -> float:
    """GPU time per call: every kernel's device time over `iters` calls, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters


def passes(b: int, n: int, d: int, device="cuda", low=torch.bfloat16):
    """Each pass at x (b, n, d) fp32, shift, scale and h in `low` precision (the matmul's dtype) with the modulation's
    output in it too, and the bytes each pass moves at bf16."""
    x = torch.randn(b, n, d, device=device)
    shift, scale = (0.1 * torch.randn(b, 1, d, device=device, dtype=low) for _ in range(2))
    gy = torch.randn(b, n, d, device=device, dtype=low)
    tx = torch.randn_like(x)
    ts, tc = torch.randn_like(shift), torch.randn_like(scale)
    leaves = [t.detach().requires_grad_() for t in (x, shift, scale)]
    big = b * n * d

    def fwd():
        return fnn.modulate(x, shift, scale, dtype=low)

    def fwd_bwd():
        return torch.autograd.grad(fnn.modulate(*leaves, dtype=low), leaves, gy)

    def jvp():
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(t, dt) for t, dt in zip((x, shift, scale), (tx, ts, tc))]
            return forward_ad.unpack_dual(fnn.modulate(*duals, dtype=low)).tangent

    h = torch.randn(b, n, d, device=device, dtype=low)
    th = torch.randn_like(h)
    gate_leaves = [t.detach().requires_grad_() for t in (x, scale, h)]
    gy32 = gy.float()

    def gate_fwd_bwd():
        return torch.autograd.grad(fnn.gated_residual(*gate_leaves), gate_leaves[1:], gy32)

    def gate_jvp():
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(t, dt) for t, dt in zip((x, scale, h), (tx, tc, th))]
            return forward_ad.unpack_dual(fnn.gated_residual(*duals)).tangent

    # modulate: fwd reads x, writes y (+ mean, rstd); its backward reads gy and x again and writes gx; jvp reads x, tx
    # and writes ty. gated residual (fp32 x and gy, bf16 h): fwd reads x, h and writes y; backward reads gy, h, writes
    # gh; jvp reads tx, h, th and writes ty
    return {
        "modulate fwd": (fwd, big * (4 + 2)),
        "modulate fwd + bwd": (fwd_bwd, big * (4 + 2 + 2 + 4 + 4)),
        "modulate jvp": (jvp, big * (4 + 4 + 2)),
        "gated residual fwd + bwd": (gate_fwd_bwd, big * (4 + 2 + 4 + 4 + 2 + 2)),
        "gated residual jvp": (gate_jvp, big * (4 + 2 + 2 + 4)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["128x196x384", "16x1024x768", "4x1024x1152"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--tiles", type=int, nargs="+", default=[adaln.TILE], help="elements a program holds in every pass (adaln.TILE, BWD_TILE)"
    )
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; GPU us per call\n")
    print("| x (batch x tokens x width) | pass | PyTorch ops us | tile | fused us | speed-up | fused GB/s |")
    print("|---|---|---|---|---|---|---|")
    tiles = adaln.TILE, adaln.BWD_TILE
    for shape in args.shapes:
        b, n, d = (int(v) for v in shape.split("x"))
        for name, (fn, nbytes) in passes(b, n, d).items():
            adaln.FORCE = False
            plain = kernel_us(fn, args.iters)
            adaln.FORCE = True
            for tile in args.tiles:
                adaln.TILE = adaln.BWD_TILE = tile
                fused = kernel_us(fn, args.iters)
                row = f"| {shape} | {name} | {plain:.1f} | {tile} | {fused:.1f} | {plain / fused:.2f}x | {nbytes / fused / 1e3:.0f} |"
                print(row, flush=True)
            adaln.FORCE = None
            adaln.TILE, adaln.BWD_TILE = tiles


if __name__ == "__main__":
    main()

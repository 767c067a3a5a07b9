"""Shared memory, registers and spills of the fused JVP forward per launch config, compiled for Hopper on any machine.

    PYTHONPATH=. python benchmarks/attention_ptxas.py --head-dims 64 72 128 --loads pointers tma

No GPU needed: Triton compiles the kernel for sm_90a (bf16, tangents on, no bias or mask, every stride and length marked
a multiple of 16 as a launch at those sizes marks them) and the ptxas bundled with Triton reports each config's
registers per thread and spill stores. With --configs omitted, each head dim's own launch candidates.
"""

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flm.kernels import attention_fwd as kernels

_POINTERS = {"Q", "K", "V", "TQ", "TK", "TV", "O", "TO", "LSE", "BIAS", "TBIAS", "KPM", "QR", "KR", "VR", "TQR", "TKR", "TVR"}
_INPUTS = ["Q", "K", "V", "TQ", "TK", "TV"]  # and their remainder's QR ... TVR: descriptors when the host builds them
LOADS = {name: tma for tma, name in enumerate(kernels.LOAD_NAMES)}
_BIAS_STRIDES = {"stride_bb", "stride_bh", "stride_bm", "stride_bn", "stride_tbb", "stride_tbh", "stride_tbm", "stride_tbn"}


def _ptxas() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def compile_report(d: int, config: tuple[int, int, int, int], tma: int) -> dict:
    """{'smem_kib', 'registers', 'spill_bytes'} of the forward at head dim d and this (BLOCK_M, BLOCK_N, warps, stages)."""
    fn = kernels._fwd_kernel
    names = fn.arg_names
    block_d, block_d_rem = kernels.split_head_dim(d)
    bm, bn, warps, stages = config
    constexprs = dict(
        HEAD_DIM=max(d, block_d),
        BLOCK_D=block_d,
        BLOCK_D_REM=block_d_rem,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_TANGENT=True,
        HAS_BIAS=False,
        HAS_BIAS_TANGENT=False,
        HAS_MASK=False,
        CAUSAL=False,
        PRECISION="tf32",
        TMA=tma,
    )
    signature = {}
    for n in names:
        if n in constexprs:
            signature[n] = "constexpr"
        elif tma == 2 and n.rstrip("R") in _INPUTS and (n in _INPUTS or block_d_rem):
            rows = bm if n.startswith(("Q", "TQ")) else bn
            signature[n] = f"tensordesc<bf16[1, 1, {rows}, {block_d_rem if n.endswith('R') else block_d}]>"
        elif n in _POINTERS:
            signature[n] = "*fp32" if n == "LSE" else "*bf16"
        else:
            signature[n] = "fp32" if n == "scale" else "i32"
    multiple_of_16 = [
        i for i, n in enumerate(names) if n in ("LQ", "LKV") or (n in _POINTERS and "tensordesc" not in signature[n])
    ]
    multiple_of_16 += [i for i, n in enumerate(names) if n.startswith("stride") and n not in _BIAS_STRIDES]
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in multiple_of_16},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True).stderr
    return dict(
        smem_kib=compiled.metadata.shared / 1024,
        registers=int(re.search(r"Used (\d+) registers", log).group(1)),
        spill_bytes=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72, 128])
    ap.add_argument("--configs", nargs="+", help="BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 128x64x8x3")
    ap.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_90a, bf16, tangents on\n")
    print(
        "| head dim | config (M, N, warps, stages) | "
        + " | ".join(f"{x}: smem KiB / registers / spill B" for x in args.loads)
        + " |"
    )
    print("|---|---|" + "---|" * len(args.loads))
    for d in args.head_dims:
        block_d, block_d_rem = kernels.split_head_dim(d)
        configs = (
            [tuple(int(x) for x in c.split("x")) for c in args.configs]
            if args.configs
            else kernels.candidates(block_d + block_d_rem, False)
        )
        for config in configs:
            cells = []
            for loads in args.loads:
                try:
                    r = compile_report(d, config, LOADS[loads])
                    cells.append(f"{r['smem_kib']:.0f} / {r['registers']} / {r['spill_bytes']}")
                except Exception as e:  # a config that does not compile is a row too
                    cells.append(type(e).__name__)
            print(f"| {d} | {config} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

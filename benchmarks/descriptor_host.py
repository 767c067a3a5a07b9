"""Host time of the fused forward's host-built tensor descriptors (Hopper's TMA), part by part (issue 16).

Per call of `attention_fwd` at 4096 tokens (bf16, batch x heads = 64, the 128 x 128 x 8 x 2 config): the whole launch
with host-built descriptors and with pointer loads, then the descriptors' own parts: flm building the TensorDescriptor
objects (`_with_descriptors`), Triton's launcher turning each into its kernel arguments (`make_tensordesc_arg`), and
within that the driver's encoding of each (`fill_tma_descriptor`). Medians of 7 rounds of 200 calls. Reads Triton 3.6's
launcher internals (the GPU image's Triton); another Triton may name them otherwise.

    PYTHONPATH=. python benchmarks/descriptor_host.py
"""

import functools

import torch
import triton
from triton.backends.nvidia import driver as nv

from benchmarks.attention import host_us as _host_us
from flm.kernels import attention_fwd as kernels

host_us = functools.partial(_host_us, calls=200, rounds=7)


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for d in (64, 72):
        q, k, v, tq, tk, tv = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(6))
        fwd = lambda tma: kernels.attention_fwd(  # noqa: E731
            q, k, v, tq, tk, tv, causal=False, scale=d**-0.5, config=(128, 128, 8, 2), tma=tma
        )
        fwd("host")
        block_d, block_d_rem = kernels.split_head_dim(d)
        args = [q, k, v, tq, tk, tv] + [q] * 12
        build = lambda: kernels._with_descriptors(args, 128, 128, block_d, block_d_rem)  # noqa: E731
        descs = [x for x in build() if isinstance(x, kernels.TensorDescriptor)]
        compiled = [e[0] for e in kernels._fwd_launch.compiled.values() if getattr(e[0].metadata, "tensordesc_meta", None)]
        meta = compiled[-1].metadata.tensordesc_meta
        expand = lambda: [nv.make_tensordesc_arg(x, meta[i % len(meta)]) for i, x in enumerate(descs)]  # noqa: E731
        m, a = meta[0], descs[0]
        utils = triton.runtime.driver.active.utils
        dtype = nv.TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]]
        fill = lambda: [  # noqa: E731
            utils.fill_tma_descriptor(
                a.base.data_ptr(), m["swizzle"], m["elem_size"], dtype, m["block_size"], a.shape, a.strides, 0
            )
            for _ in descs
        ]
        print(
            f"D={d}, {len(descs)} descriptors, host us per call: attention_fwd with host-built descriptors "
            f"{host_us(lambda: fwd('host')):.1f}, with pointer loads {host_us(lambda: fwd(False)):.1f}; "
            f"_with_descriptors {host_us(build):.1f}; make_tensordesc_arg x {len(descs)} {host_us(expand):.1f}; "
            f"fill_tma_descriptor x {len(descs)} {host_us(fill):.1f}"
        )


if __name__ == "__main__":
    main()

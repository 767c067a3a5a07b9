"""The fused forward reading its tiles through tensor descriptors (Hopper's TMA, `FLM_ATTENTION_TMA=1` or `host`) against
float64 math attention and against its pointer loads, in Triton's interpreter (fp32, fp16, block 16); bf16 at real sizes is
in test_tma_gpu.py. Both kinds: built by each program for its head (TMA 1), and 4-D ones the host builds per launch (TMA
2). Also where the descriptors are used: never with a bias or mask, nor on a misaligned input."""

import pytest
import torch

from flm.kernels import attention_fwd as kernels
from tests.attention.reference import jvp64, qkv_and_tangents, randn, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

# (B, H, Lq, Lkv, D, causal): ragged lengths (rows past the end read as 0 by the descriptor), a split head dim with a
# masked remainder (72 = 64 + 16, columns past 72 read as 0), an exact one (96), cross-attention, the causal diagonal
SHAPES = [
    (2, 3, 40, 40, 32, False),
    (1, 2, 37, 53, 72, False),
    (2, 1, 33, 33, 24, True),
    (1, 2, 19, 45, 96, False),
    (1, 1, 48, 48, 64, True),
]


@pytest.fixture
def launched(monkeypatch):
    """The TMA mode of every launch of the kernel (0 pointers, 1 device-built descriptors, 2 host-built)."""
    flags = []
    kernel = kernels._fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **meta):
                flags.append(meta["TMA"])
                return kernel[grid](*args, **meta)

            return run

    monkeypatch.setattr(kernels, "_fwd_kernel", Spy())
    return flags


MODES = {"device": 1, "host": 2}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"d{s[4]}-{s[2]}x{s[3]}" + ("-causal" if s[5] else "") for s in SHAPES])
def test_tma_loads_give_the_jvp_and_the_pointer_loads_outputs(shape, dtype, mode, launched):
    *dims, causal = shape
    q, k, v, tq, tk, tv = qkv_and_tangents(*dims, dtype)
    scale = dims[-1] ** -0.5
    o, to, lse = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=causal, scale=scale, tma=mode)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    assert rel_err(o, o_ref) < TOL[dtype] and rel_err(to, to_ref) < TOL[dtype]
    po, pto, plse = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=causal, scale=scale, tma=False)
    assert rel_err(o, po) < TOL[dtype] and rel_err(to, pto) < TOL[dtype]
    assert torch.allclose(lse, plse, rtol=1e-5, atol=1e-5)
    o_plain, none, _ = kernels.attention_fwd(q, k, v, causal=causal, scale=scale, tma=mode)  # no tangents
    assert none is None and rel_err(o_plain, o_ref) < TOL[dtype]
    assert launched == [MODES[mode], 0, MODES[mode]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [2, 1])
def test_tma_reads_the_dits_head_views_in_place(mode, b, launched):
    """q, k, v as the DiT makes them: (B, L, H, D) storage viewed as (B, H, L, D); batch 1 as well (a size-1 dim's
    stride need not be a multiple of 16 bytes, and the host's descriptor replaces it)."""
    g = torch.Generator().manual_seed(1)
    n, h, d = 29, 3, 72
    q, k, v, tq, tk, tv = (randn(b, n, h, d, generator=g).transpose(1, 2) for _ in range(6))
    o, to, _ = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=d**-0.5, tma=mode)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert rel_err(o, o_ref) < TOL[torch.float32] and rel_err(to, to_ref) < TOL[torch.float32]
    assert launched == [MODES[mode]]


def test_tma_is_not_used_with_a_bias_a_mask_or_a_misaligned_input(launched):
    q, k, v, tq, tk, tv = qkv_and_tangents(1, 2, 24, 24, 32, torch.float32)
    bias = torch.randn(1, 2, 24, 24)
    mask = torch.ones(1, 24, dtype=torch.bool)
    kernels.attention_fwd(q, k, v, causal=False, scale=0.2, bias=bias, tma=True)
    kernels.attention_fwd(q, k, v, causal=False, scale=0.2, key_padding_mask=mask, tma="host")
    shifted = torch.randn(1 * 2 * 24 * 32 + 1)[1:].view(1, 2, 24, 32)  # 4 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 != 0
    kernels.attention_fwd(shifted, k, v, causal=False, scale=0.2, tma=True)
    assert launched == [0, 0, 0]
    assert not kernels.tma_fits((shifted, k, v), False, False) and kernels.tma_fits((q, k, v), False, False)


def test_flm_attention_tma_decides_the_default(monkeypatch, launched):
    q, k, v, *_ = qkv_and_tangents(1, 1, 16, 16, 16, torch.float32)
    # auto (the default) times pointers against host-built descriptors on a GPU; the interpreter's fixed config reads
    # through the first, pointers
    for value, mode in (("1", 1), ("0", 0), ("", 0), ("auto", 0), ("on", 1), ("host", 2), ("device", 1)):
        monkeypatch.setenv("FLM_ATTENTION_TMA", value)
        kernels.attention_fwd(q, k, v, causal=False, scale=0.25)
        assert launched[-1] == mode
    monkeypatch.delenv("FLM_ATTENTION_TMA")
    assert kernels.tma_wanted() == (0, 2)
    monkeypatch.setenv("FLM_ATTENTION_TMA", "sometimes")
    with pytest.raises(ValueError, match="FLM_ATTENTION_TMA='sometimes': set auto"):
        kernels.attention_fwd(q, k, v, causal=False, scale=0.25)

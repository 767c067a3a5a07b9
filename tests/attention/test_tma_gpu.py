"""The fused forward's tensor-descriptor loads (Hopper's TMA, `FLM_ATTENTION_TMA=1` or `host`) at real sizes on a GPU of
compute capability 9 or more, both kinds (built by each program, or by the host per launch): bf16 and fp16 against
float64 math and against the pointer loads, every launch candidate, the DiT's head views, and a CUDA graph (the
device-built descriptors' scratch memory is allocated at each launch, the host-built ones are kernel arguments). Also
the default (auto): the tuner's choice between pointer loads and host-built descriptors.

Run on a CUDA machine: pytest -m gpu tests/attention/test_tma_gpu.py
"""

import pytest
import torch

from flm.kernels import attention_fwd as kernels
from tests.attention.reference import jvp64, qkv_and_tangents, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="TMA needs compute capability 9+"
    ),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}

SHAPES = [  # (B, H, Lq, Lkv, D, causal)
    (2, 4, 1024, 1024, 64, False),
    (2, 4, 1000, 517, 72, False),
    (1, 4, 2048, 2048, 128, True),
    (2, 2, 777, 777, 96, True),
    (8, 6, 196, 196, 64, False),
    (4, 2, 256, 256, 16, False),
]


MODES = ["device", "host"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"d{s[4]}-{s[2]}x{s[3]}" + ("-causal" if s[5] else "") for s in SHAPES])
def test_tma_forward_real_sizes(shape, dtype, mode):
    *dims, causal = shape
    q, k, v, tq, tk, tv = qkv_and_tangents(*dims, dtype, device="cuda")
    scale = dims[-1] ** -0.5
    o, to, lse = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=causal, scale=scale, tma=mode)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    assert rel_err(o, o_ref) < TOL[dtype] and rel_err(to, to_ref) < TOL[dtype]
    po, pto, plse = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=causal, scale=scale, tma=False)
    assert rel_err(o, po) < TOL[dtype] / 4 and rel_err(to, pto) < TOL[dtype] / 4
    assert torch.allclose(lse, plse, rtol=1e-3, atol=1e-3)
    o_plain, _, _ = kernels.attention_fwd(q, k, v, causal=causal, scale=scale, tma=mode)
    assert rel_err(o_plain, o_ref) < TOL[dtype]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 72, 96, 128])
def test_every_candidate_config_reads_through_tma(d, mode):
    block_d, block_d_rem = kernels.split_head_dim(d)
    q, k, v, tq, tk, tv = qkv_and_tangents(2, 2, 333, 333, d, torch.bfloat16, seed=3, device="cuda")
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    ran = 0
    for *config, _ in kernels.launch_candidates(block_d + block_d_rem, False, kernels._TMA_MODES[mode]):
        try:
            o, to, _ = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=d**-0.5, config=config, tma=mode)
        except kernels._UNFIT:
            continue
        ran += 1
        assert rel_err(o, o_ref) < TOL[torch.bfloat16], config
        assert rel_err(to, to_ref) < TOL[torch.bfloat16], config
    assert ran > 0


@pytest.mark.parametrize("mode", MODES)
def test_tma_reads_the_dits_head_views_and_replays_in_a_cuda_graph(mode):
    b, n, h, d = 16, 196, 6, 72
    g = torch.Generator(device="cuda").manual_seed(4)
    views = (torch.randn(b, n, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2) for _ in range(6))
    q, k, v, tq, tk, tv = views
    run = lambda: kernels.attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=d**-0.5, tma=mode)  # noqa: E731
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for x in (q, k, v, tq, tk, tv):
        x.copy_(torch.randn_like(x))
    graph.replay()
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert rel_err(captured[0], o_ref) < TOL[torch.bfloat16] and rel_err(captured[1], to_ref) < TOL[torch.bfloat16]
    assert not torch.equal(captured[0], eager[0])


@pytest.mark.parametrize("d", [64, 72, 128])
def test_the_tuner_times_pointers_against_host_built_descriptors(d, monkeypatch):
    """FLM_ATTENTION_TMA unset (auto) and the tuner on: the key records one of the pointer and host-descriptor
    candidates, and its outputs are the pointer loads'."""
    monkeypatch.delenv("FLM_ATTENTION_TMA", raising=False)
    monkeypatch.setenv("FLM_ATTENTION_AUTOTUNE", "1")
    monkeypatch.setattr(kernels, "_TUNED", {})
    q, k, v, tq, tk, tv = qkv_and_tangents(2, 4, 512, 512, d, torch.bfloat16, seed=6, device="cuda")
    o, to, lse = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=d**-0.5)
    (choice,) = kernels._TUNED.values()
    block_d, block_d_rem = kernels.split_head_dim(d)
    assert choice in kernels.launch_candidates(block_d + block_d_rem, False, (0, 2))
    po, pto, plse = kernels.attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=d**-0.5, tma=False)
    assert rel_err(o, po) < TOL[torch.bfloat16] and rel_err(to, pto) < TOL[torch.bfloat16]
    assert rel_err(lse, plse) < 1e-4

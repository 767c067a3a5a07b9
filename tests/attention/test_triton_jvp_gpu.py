"""The fused JVP attention at real sizes on a GPU: bf16/fp16, FA2 backward, a two-layer transformer.

Run on a CUDA machine: pytest -m gpu tests/attention
"""

import pytest
import torch
import torch.nn as nn
from torch.autograd import forward_ad

import flm.attention as fa
from flm.attention import triton_jvp
from tests.attention.reference import grads64, jvp64, rel_err

pytestmark = pytest.mark.gpu

# bf16 operands land between 1e-3 and 1e-2 against float64; fp16 about 8x tighter
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}

SHAPES = [  # (B, H, Lq, Lkv, D, causal)
    (2, 4, 1024, 1024, 64, False),
    (2, 4, 1000, 517, 72, False),
    (1, 4, 2048, 2048, 128, True),
    (2, 2, 777, 777, 96, True),
    (1, 2, 384, 640, 256, False),
    (4, 2, 256, 256, 16, False),
]


def _qkv(b, h, lq, lkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n: torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(lq), mk(lkv), mk(lkv), mk(lq), mk(lkv), mk(lkv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_jvp_forward_real_sizes(shape, dtype):
    *dims, causal = shape
    q, k, v, tq, tk, tv = _qkv(*dims, dtype)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=causal)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(to, to_ref) < TOL[dtype]


@pytest.mark.parametrize("impl", ["torch_fa2", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_paths_match_autograd_over_math(shape, dtype, impl):
    *dims, causal = shape
    q, k, v, *_ = _qkv(*dims, dtype, seed=1)
    scale = q.shape[-1] ** -0.5
    o, lse = torch.ops.flm.attention_fwd(q, k, v, causal, scale)
    do = torch.randn_like(o)
    grads = triton_jvp.BACKWARDS[impl](do, q, k, v, o, lse, causal, scale)
    for got, ref in zip(grads, grads64(q, k, v, do, causal=causal)):
        assert rel_err(got, ref) < TOL[dtype]


def test_default_backward_is_flashattention():
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert triton_jvp.backward_impl(q) in ("flash_attn", "torch_fa2")
    assert triton_jvp.backward_impl(q.float()) == "triton"


def test_fp32_end_to_end():
    q, k, v, tq, tk, tv = _qkv(2, 2, 300, 300, 64, torch.float32)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert rel_err(o, o_ref) < TOL[torch.float32] and rel_err(to, to_ref) < TOL[torch.float32]


class _Block(nn.Module):
    def __init__(self, dim, heads, backend):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):  # (B, N, C)
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = fa.attention(q, k, v, backend=self.backend)  # views of a fused qkv, not contiguous
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def _two_layer_grads(backend, mode, x, tx, state):
    torch.manual_seed(0)
    model = nn.Sequential(_Block(256, 4, backend), _Block(256, 4, backend)).cuda()
    model.load_state_dict(state)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if mode == "dual":
            with forward_ad.dual_level():
                out = forward_ad.unpack_dual(model(forward_ad.make_dual(x, tx)))
                u, dudt = out.primal, out.tangent
        else:
            u, dudt = torch.func.jvp(model, (x,), (tx,))
        loss = (u.float() - dudt.float().detach()).square().mean()  # MeanFlow-like: tangent stop-gradient
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_two_layer_transformer_gradients_dual_fused_vs_func_jvp_math():
    torch.manual_seed(0)
    state = nn.Sequential(_Block(256, 4, "math"), _Block(256, 4, "math")).cuda().state_dict()
    x, tx = torch.randn(4, 256, 256, device="cuda"), torch.randn(4, 256, 256, device="cuda")
    g_fused = _two_layer_grads("triton_jvp", "dual", x, tx, state)
    g_math = _two_layer_grads("math", "func", x, tx, state)
    g_math2 = _two_layer_grads("math", "dual", x, tx, state)
    assert torch.isfinite(g_fused).all()
    # bf16 autocast: the fused path must be as close to math as math is to itself in another mode
    assert rel_err(g_fused, g_math) < max(3 * rel_err(g_math2, g_math), 1e-2)


def test_compiled_step_with_inductor_has_no_graph_break():
    torch._dynamo.reset()
    q, k, v, *_ = _qkv(2, 4, 512, 512, 64, torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = lambda q, k, v: fa.attention(q @ w, k, v, backend="triton_jvp").float().square().sum()  # noqa: E731
    torch.compile(step, fullgraph=True)(q, k, v).backward()
    g, w.grad = w.grad.clone(), None
    step(q, k, v).backward()
    assert rel_err(g, w.grad) < 1e-2

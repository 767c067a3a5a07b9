"""The fused JVP attention at real sizes on a GPU: bf16/fp16, FA2 backward, a two-layer transformer,
head dims that are not a power of two, additive biases and key-padding masks (triton_jvp and sdpa).

Run on a CUDA machine: pytest -m gpu tests/attention
"""

import pytest
import torch
import torch.nn as nn
from torch.autograd import forward_ad

import flm.attention as fa
from flm.attention import triton_jvp
from tests.attention.reference import attention64, grads64, jvp64, rel_err

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


@pytest.mark.parametrize("impl", ["torch_fa2", "cudnn", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_paths_match_autograd_over_math(shape, dtype, impl):
    *dims, causal = shape
    if impl == "cudnn" and (problem := triton_jvp.cudnn_unsupported(torch.device("cuda"), dtype, dims[-1])):
        pytest.skip(f"cuDNN's attention backward {problem}")
    q, k, v, *_ = _qkv(*dims, dtype, seed=1)
    scale = q.shape[-1] ** -0.5
    o, lse = torch.ops.flm.attention_fwd(q, k, v, causal, scale)
    do = torch.randn_like(o)
    grads = triton_jvp.BACKWARDS[impl](do, q, k, v, o, lse, causal, scale)
    for got, ref in zip(grads, grads64(q, k, v, do, causal=causal)):
        assert rel_err(got, ref) < TOL[dtype]


# head dims that are not a power of two: a power-of-two chunk plus a remainder tile, read in place (up to 128;
# above, zero-padded to 256)
SPLIT_SHAPES = [  # (B, H, Lq, Lkv, D, causal)
    (4, 16, 256, 256, 72, False),  # DiT-XL/2's head dim at 256 tokens
    (2, 16, 1024, 1024, 72, False),
    (2, 8, 1024, 1024, 72, True),
    (2, 4, 1024, 1024, 80, False),
    (2, 4, 1024, 1024, 96, True),
    (2, 4, 512, 512, 40, False),
    (2, 4, 1024, 1024, 160, False),
    (1, 4, 512, 512, 192, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=[f"d{s[4]}-{s[2]}" + ("-causal" if s[5] else "") for s in SPLIT_SHAPES])
def test_split_head_dim_real_sizes(shape, dtype):
    *dims, causal = shape
    q, k, v, tq, tk, tv = _qkv(*dims, dtype)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=causal)
    o_plain = fa.attention(q, k, v, backend="triton_jvp", causal=causal)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    for x in (o, to, o_plain):  # above 128: views of the padded outputs
        assert x.shape == q.shape and (x.is_contiguous() or dims[-1] > 128) and torch.isfinite(x).all()
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(to, to_ref) < TOL[dtype]
    assert rel_err(o_plain, o_ref) < TOL[dtype]


def _extra_mib(fn):
    """What fn allocates beyond what is already allocated, at its peak (outputs included), in MiB."""
    fn()  # tune and compile first: the autotuner's benchmarks allocate too
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def test_split_head_dim_allocates_no_padded_copies():
    """At head dim 72 a call allocates its outputs and nothing else: 72/64 of head dim 64's memory
    (zero-padding to 128 allocated ~7x as much: six padded inputs and two padded outputs)."""
    mib = {}
    for d in (64, 72):
        q, k, v, tq, tk, tv = _qkv(4, 16, 1024, 1024, d, torch.bfloat16, seed=2)
        mib[d] = _extra_mib(lambda: fa.jvp_attention(q, k, v, tq, tk, tv))
    outputs = 2 * q.numel() * q.element_size() / 2**20 + 4 * 16 * 1024 * 4 / 2**20  # o, to (bf16), lse (fp32)
    assert mib[72] <= 1.05 * outputs + 1
    assert mib[72] <= 1.2 * mib[64]


def test_default_backward_is_fused():
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert triton_jvp.backward_impl(q) in ("cudnn", "flash_attn", "torch_fa2")  # test_cudnn_backward_gpu.py: which
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


def _two_layer_grads(backend, mode, x, tx, state, heads):
    torch.manual_seed(0)
    dim = x.shape[-1]
    model = nn.Sequential(_Block(dim, heads, backend), _Block(dim, heads, backend)).cuda()
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


@pytest.mark.parametrize("dim, heads", [(256, 4), (288, 4)], ids=["d64", "d72"])
def test_two_layer_transformer_gradients_dual_fused_vs_func_jvp_math(dim, heads):
    torch.manual_seed(0)
    state = nn.Sequential(_Block(dim, heads, "math"), _Block(dim, heads, "math")).cuda().state_dict()
    x, tx = torch.randn(4, 256, dim, device="cuda"), torch.randn(4, 256, dim, device="cuda")
    g_fused = _two_layer_grads("triton_jvp", "dual", x, tx, state, heads)
    g_math = _two_layer_grads("math", "func", x, tx, state, heads)
    g_math2 = _two_layer_grads("math", "dual", x, tx, state, heads)
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


def test_a_compiled_jvp_step_with_inductor_matches_eager():
    """trainer.compile's path: torch.func.jvp through the fused kernel, compiled by inductor, in bf16."""
    torch._dynamo.reset()
    q, k, v, tq, tk, tv = _qkv(2, 4, 512, 512, 64, torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(q, k, v):
        f = lambda q, k, v: fa.attention(q @ w, k, v, backend="triton_jvp")  # noqa: E731
        o, to = torch.func.jvp(f, (q, k, v), (tq, tk, tv))
        return (o.float().square().sum() + (o.float() * to.detach().float()).sum()) / o.numel()

    torch.compile(step)(q, k, v).backward()
    g, w.grad = w.grad.clone(), None
    step(q, k, v).backward()
    assert rel_err(g, w.grad) < 1e-2


# ---------------------------------------------------------------------------------------------
# Additive bias and key-padding masks (flm's Triton backward, not FlashAttention's, takes the gradient)
# ---------------------------------------------------------------------------------------------

BIAS_CASES = [  # (B, H, Lq, Lkv, D, bias shape, key-padding mask, causal)
    (2, 4, 256, 256, 64, (1, 1, 256, 256), False, False),
    (2, 4, 1024, 1024, 64, (2, 4, 1024, 1024), True, False),
    (2, 4, 1024, 1024, 64, (2, 1, 1024, 1024), True, True),
    (2, 4, 1000, 517, 72, (1, 4, 1000, 517), True, False),
    (2, 4, 256, 384, 128, (2, 1, 1, 384), True, False),  # one bias per key
    (2, 4, 333, 333, 64, None, True, False),  # a mask alone
    (2, 4, 1024, 1024, 96, (2, 1, 1024, 1024), True, True),  # a remainder chunk (96 = 64 + 32) with all three
]
BIAS_IDS = [
    "bias11-256",
    "biasBH+mask-1024",
    "biasB1+mask+causal-1024",
    "bias1H+mask-cross-d72",
    "key-bias-d128",
    "mask-only",
    "biasB1+mask+causal-d96",
]


def _bias_inputs(b, h, lq, lkv, d, bias_shape, masked, dtype, seed=0):
    """q, k, v, tangents, bias and its tangent (None without a shape), and a mask (True = attend) that pads
    the last third of batch 1's keys, ~10% of the others at random, and key 0 of batch 0."""
    q, k, v, tq, tk, tv = _qkv(b, h, lq, lkv, d, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    bias = tbias = mask = None
    if bias_shape is not None:
        bias, tbias = (torch.randn(*bias_shape, device="cuda", generator=g).to(dtype) for _ in range(2))
    if masked:
        mask = torch.rand(b, lkv, device="cuda", generator=g) > 0.1
        mask[0, 0] = False
        mask[1, 2 * lkv // 3 :] = False
    return q, k, v, tq, tk, tv, bias, tbias, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", BIAS_CASES, ids=BIAS_IDS)
def test_bias_jvp_forward_real_sizes(case, dtype):
    *dims, bias_shape, masked, causal = case
    q, k, v, tq, tk, tv, bias, tbias, mask = _bias_inputs(*dims, bias_shape, masked, dtype)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=causal, bias=bias, bias_tangent=tbias, key_padding_mask=mask)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal, bias=bias, tbias=tbias, key_padding_mask=mask)
    assert torch.isfinite(o).all() and torch.isfinite(to).all()
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(to, to_ref) < TOL[dtype]


@pytest.mark.parametrize("backend", ["triton_jvp", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", BIAS_CASES, ids=BIAS_IDS)
def test_bias_gradients_real_sizes(case, dtype, backend):
    *dims, bias_shape, masked, causal = case
    q, k, v, _, _, _, bias, _, mask = _bias_inputs(*dims, bias_shape, masked, dtype, seed=1)
    leaves = [x for x in (q, k, v, bias) if x is not None]
    for x in leaves:
        x.requires_grad_()
    o = fa.attention(q, k, v, backend=backend, causal=causal, bias=bias, key_padding_mask=mask)
    assert rel_err(o, attention64(q, k, v, causal=causal, bias=bias, key_padding_mask=mask)) < TOL[dtype]
    do = torch.randn_like(o)
    o.backward(do)
    for x, ref in zip(leaves, grads64(q, k, v, do, causal=causal, bias=bias, key_padding_mask=mask)):
        assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
        assert rel_err(x.grad, ref) < TOL[dtype]


def test_bias_rows_with_no_key_are_zero_on_gpu():
    """Batch 1 pads every key; causal row 0 of batch 0 has its only key padded."""
    q, k, v, tq, tk, tv, bias, tbias, mask = _bias_inputs(2, 4, 512, 512, 64, (1, 4, 512, 512), True, torch.bfloat16, seed=2)
    mask[1] = False
    q, k, v, bias = (x.requires_grad_() for x in (q, k, v, bias))
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=True, bias=bias, bias_tangent=tbias, key_padding_mask=mask)
    o.float().square().sum().backward()
    for x in (o, to):
        assert torch.equal(x[1], torch.zeros_like(x[1])) and torch.equal(x[0, :, 0], torch.zeros_like(x[0, :, 0]))
    for x in (q, k, v, bias):
        assert torch.isfinite(x.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


def test_fp32_bias_with_bf16_inputs():
    q, k, v, *_ = _qkv(2, 4, 300, 300, 64, torch.bfloat16, seed=3)
    bias = torch.randn(1, 4, 300, 300, device="cuda", requires_grad=True)
    o = fa.attention(q, k, v, backend="triton_jvp", bias=bias)
    do = torch.randn_like(o)
    o.backward(do)
    assert bias.grad.dtype == torch.float32
    assert rel_err(o, attention64(q, k, v, bias=bias)) < TOL[torch.bfloat16]
    assert rel_err(bias.grad, grads64(q, k, v, do, bias=bias)[3]) < TOL[torch.bfloat16]


def test_compiled_step_with_bias_and_mask_has_no_graph_break():
    torch._dynamo.reset()
    q, k, v, _, _, _, bias, _, mask = _bias_inputs(2, 4, 512, 512, 64, (1, 4, 512, 512), True, torch.bfloat16, seed=4)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias.requires_grad_()

    def step(q, k, v, bias, mask):
        return fa.attention(q @ w, k, v, backend="triton_jvp", bias=bias, key_padding_mask=mask).float().square().sum()

    torch.compile(step, fullgraph=True)(q, k, v, bias, mask).backward()
    g_w, g_bias = w.grad.clone(), bias.grad.clone()
    w.grad = bias.grad = None
    step(q, k, v, bias, mask).backward()
    assert rel_err(g_w, w.grad) < 1e-2 and rel_err(g_bias, bias.grad) < 1e-2


def test_direct_launches_give_tritons_own_launch_outputs(monkeypatch):
    """attention_fwd launches a compiled kernel directly once Triton has compiled it for such arguments
    (flm.kernels.launch): the first call of each case takes Triton's own launch, the second the direct one, and
    both give the same bits; inputs that Triton specialises differently (lengths not a multiple of 16, pointers off
    16-byte alignment) get their own compiled kernel and stay correct."""
    from flm.kernels import attention_fwd as kernels
    from flm.kernels.launch import DirectLaunch

    launcher = DirectLaunch(kernels._fwd_kernel)
    monkeypatch.setattr(kernels, "_fwd_launch", launcher)
    base = torch.randn(2 * 4 * 256 * 64 + 4, device="cuda").to(torch.bfloat16)
    first = {}
    for lq, offset in ((256, 0), (200, 0), (256, 4), (256, 0)):  # offset 4: 8-byte aligned pointers
        x = base[offset : offset + 2 * 4 * lq * 64].view(2, 4, lq, 64)
        t = x.flip(-1)
        own, direct = (
            kernels.attention_fwd(x, x, x, t, t, t, causal=False, scale=0.125, config=(64, 64, 4, 3)) for _ in range(2)
        )
        for a, b in zip(own, direct):
            assert torch.equal(a, b)
        first.setdefault((lq, offset), own)
        ref_o, ref_to = jvp64(x, x, x, t, t, t, causal=False, scale=0.125)
        assert rel_err(direct[0], ref_o) < TOL[torch.bfloat16] and rel_err(direct[1], ref_to) < TOL[torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(first[(256, 0)], own))  # the repeated case, direct both times
    assert len(launcher.compiled) == 3


# every launch configuration a head dim can get, tuned or not: (head dim, its tile width's candidates, biased)
_CONFIG_CASES = [(d, biased) for d in (64, 72, 96, 128, 192) for biased in (False, True)]


@pytest.mark.parametrize("case", _CONFIG_CASES, ids=[f"d{d}" + ("-bias+mask" if b else "") for d, b in _CONFIG_CASES])
def test_every_candidate_config_gives_the_jvp(case):
    """Each candidate the autotuner may pick (or FLM_ATTENTION_AUTOTUNE=0 takes first) computes o, its tangent and
    the log-sum-exp: the test suite itself runs untuned (tests/conftest.py), so this is where the other configs
    are checked. A config that does not fit this GPU is skipped, as the autotuner skips it."""
    from flm.kernels import attention_fwd as kernels

    d, biased = case
    block_d, block_d_rem = kernels.split_head_dim(d)
    q, k, v, tq, tk, tv, bias, tbias, mask = _bias_inputs(
        2, 2, 333, 333, d, (1, 2, 333, 333) if biased else None, biased, torch.bfloat16
    )
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=False, bias=bias, tbias=tbias, key_padding_mask=mask)
    lse_ref = torch.logsumexp(
        (q.double() @ k.double().transpose(-1, -2)) * d**-0.5
        + (0 if bias is None else bias.double())
        + (0 if mask is None else torch.where(mask[:, None, None, :], 0.0, float("-inf")).double()),
        dim=-1,
    )
    ran = 0
    for config in kernels.candidates(block_d + block_d_rem, biased):
        try:
            o, to, lse = kernels.attention_fwd(
                q,
                k,
                v,
                tq,
                tk,
                tv,
                causal=False,
                scale=d**-0.5,
                config=config,
                bias=bias,
                bias_tangent=tbias,
                key_padding_mask=mask,
            )
        except kernels._UNFIT:
            continue
        ran += 1
        assert rel_err(o, o_ref) < TOL[torch.bfloat16], config
        assert rel_err(to, to_ref) < TOL[torch.bfloat16], config
        assert rel_err(lse, lse_ref) < 1e-3, config
    assert ran > 0


def test_untuned_and_tuned_keys_pick_a_candidate(monkeypatch):
    """FLM_ATTENTION_AUTOTUNE=0 (the test suite's setting) records the first candidate that fits, untimed (pointer
    loads); with it unset the tuner records its choice among the candidates of every load kind FLM_ATTENTION_TMA allows.
    Both give the same outputs."""
    from flm.kernels import attention_fwd as kernels

    q, k, v, tq, tk, tv = _qkv(2, 4, 640, 640, 64, torch.bfloat16, seed=5)
    picks, outputs = [], []
    for tune in ("0", "1"):
        monkeypatch.setenv("FLM_ATTENTION_AUTOTUNE", tune)
        monkeypatch.setattr(kernels, "_TUNED", {})
        outputs.append(kernels.attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=0.125))
        assert len(kernels._TUNED) == 1
        picks.append(next(iter(kernels._TUNED.values())))
    assert picks[0] == (*kernels.candidates(64, False)[0], 0)
    assert picks[1] in kernels.launch_candidates(64, False, kernels.tma_wanted())
    for untuned, tuned in zip(*outputs):
        assert rel_err(untuned, tuned) < TOL[torch.bfloat16]

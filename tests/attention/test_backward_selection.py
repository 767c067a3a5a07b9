"""Which backward the fused attention takes (triton_jvp.backward_impl): $FLM_ATTN_BACKWARD, the chain on
the CPU and fp32, cuDNN's place on Hopper with its self-check and fallback. No GPU: a GPU is simulated
by an object with a CUDA device, and cuDNN's backward by a stand-in."""

import types
import warnings

import pytest
import torch

from flm.attention.layout import in_q_order
from flm.attention import attention, triton_jvp
from tests.attention.reference import grads64

CUDA = torch.device("cuda", 0)


def _like(device=CUDA, dtype=torch.bfloat16, head_dim=64):
    """What backward_impl reads of q: its device, dtype and shape."""
    return types.SimpleNamespace(device=device, dtype=dtype, shape=(2, 4, 128, head_dim))


@pytest.fixture(autouse=True)
def _no_remembered_choice(monkeypatch):
    """backward_impl remembers its choice per (device, dtype, head dim); each test starts without."""
    monkeypatch.setattr(triton_jvp, "_AUTO_IMPLS", {})


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU with cuDNN and no flash_attn package; no verdicts cached."""
    monkeypatch.delenv(triton_jvp.BACKWARD_ENV, raising=False)
    monkeypatch.setattr(triton_jvp, "_cudnn_op_available", lambda: True)
    monkeypatch.setattr(triton_jvp, "_cudnn_by_default", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(triton_jvp, "_flash_attn_backward", lambda: None)
    monkeypatch.setattr(triton_jvp, "_CUDNN_VERDICTS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return monkeypatch


def _math_backward(do, q, k, v, o, lse, causal, scale):
    """A correct backward (autograd over float64 math attention), in q's dtype."""
    return tuple(g.to(q.dtype) for g in grads64(q, k, v, do, causal=causal, scale=scale))


# ---------------------------------------------------------------------------------------------
# $FLM_ATTN_BACKWARD and the CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "auto"])
def test_auto_on_the_cpu_and_fp32_is_triton(monkeypatch, value):
    monkeypatch.setenv(triton_jvp.BACKWARD_ENV, value)
    for q in (torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 4, 64, dtype=torch.float16), _like(dtype=torch.float32)):
        assert triton_jvp.backward_impl(q) == "triton"


def test_unknown_value_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv(triton_jvp.BACKWARD_ENV, "cudnn9")
    with pytest.raises(ValueError, match=r"FLM_ATTN_BACKWARD='cudnn9'.*auto, flash_attn, torch_fa2, cudnn, triton"):
        triton_jvp.backward_impl(torch.zeros(1, 1, 4, 64))
    with pytest.raises(ValueError, match="cudnn9"):  # already at the forward, before any backward
        attention(torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16), backend="triton_jvp")


@pytest.mark.parametrize(
    "name, q, match",
    [
        ("cudnn", torch.zeros(1, 1, 4, 64, dtype=torch.float16), "needs a CUDA GPU"),
        ("cudnn", _like(dtype=torch.float32), "needs fp16 or bf16"),
        ("cudnn", _like(head_dim=256), "at most 128"),
        ("torch_fa2", torch.zeros(1, 1, 4, 64), "needs a CUDA GPU"),
        ("torch_fa2", _like(dtype=torch.float32), "needs fp16 or bf16"),
        ("flash_attn", _like(), "needs the flash_attn package"),
    ],
)
def test_forced_backward_that_cannot_run_says_why(hopper, name, q, match):
    hopper.setenv(triton_jvp.BACKWARD_ENV, name)
    with pytest.raises(ValueError, match=rf"FLM_ATTN_BACKWARD={name} cannot take .*{match}.*unset FLM_ATTN_BACKWARD"):
        triton_jvp.backward_impl(q)


def test_forced_backward_that_can_run_is_taken(hopper):
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: None)
    for name in ("triton", "torch_fa2", "cudnn"):
        hopper.setenv(triton_jvp.BACKWARD_ENV, name)
        assert triton_jvp.backward_impl(_like()) == name
    hopper.setenv(triton_jvp.BACKWARD_ENV, "triton")
    assert triton_jvp.backward_impl(torch.zeros(1, 1, 4, 64)) == "triton"


def test_forced_triton_runs_on_the_cpu(monkeypatch):
    monkeypatch.setenv(triton_jvp.BACKWARD_ENV, "triton")
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    attention(q, k, v, backend="triton_jvp").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cudnn_probe_is_false_without_cuda():
    assert triton_jvp.cudnn_unsupported(torch.device("cpu"), torch.bfloat16, 64) is not None


def test_cudnn_call_matches_the_installed_ops_schema():
    """torch_cudnn_bwd's arguments through the op's meta kernel: the installed torch's schema takes them."""
    meta = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = meta(2, 4, 128, 72), meta(2, 4, 100, 72), meta(2, 4, 100, 72)
    o = meta(2, 4, 128, 128)[..., :72]  # a padded head dim: a view, as flm's forward returns it
    lse = torch.empty(2, 4, 128, device="meta")
    grads = triton_jvp.torch_cudnn_bwd(meta(2, 4, 128, 72), q, k, v, o, lse, False, 0.1)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ---------------------------------------------------------------------------------------------
# Hopper (simulated): cuDNN first, after its self-check
# ---------------------------------------------------------------------------------------------


def test_hopper_prefers_cudnn_once_checked(hopper):
    calls = []
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: calls.append(key))
    for _ in range(3):
        assert triton_jvp.backward_impl(_like()) == "cudnn"
    assert triton_jvp.backward_impl(_like(dtype=torch.float16)) == "cudnn"
    assert calls == [(CUDA, torch.bfloat16, 64), (CUDA, torch.float16, 64)]  # once per (device, dtype, head dim)


def test_other_gpus_and_head_dims_keep_flashattention(hopper):
    hopper.setattr(triton_jvp, "_cudnn_by_default", lambda device, dtype, head_dim: False)  # an A100, say
    assert triton_jvp.backward_impl(_like()) == "torch_fa2"
    hopper.setattr(triton_jvp, "_flash_attn_backward", lambda: object())
    hopper.setattr(triton_jvp, "_AUTO_IMPLS", {})  # a process with flash_attn installed: nothing remembered
    assert triton_jvp.backward_impl(_like()) == "flash_attn"
    assert triton_jvp.backward_impl(_like(dtype=torch.float32)) == "triton"


def test_the_choice_is_remembered_once_settled_and_forgotten_on_a_refusal(hopper):
    checks = []
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: checks.append(key))
    hopper.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert triton_jvp.backward_impl(_like()) == "torch_fa2"  # undecided inside a capture: not remembered
    assert triton_jvp._AUTO_IMPLS == {}
    hopper.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert [triton_jvp.backward_impl(_like()) for _ in range(3)] == ["cudnn"] * 3
    assert len(checks) == 1
    assert triton_jvp._AUTO_IMPLS[(CUDA, torch.bfloat16, 64)] == "cudnn"
    hopper.setenv(triton_jvp.BACKWARD_ENV, "torch_fa2")  # forcing one still wins
    assert triton_jvp.backward_impl(_like()) == "torch_fa2"


def test_cudnn_by_default_needs_what_cudnn_takes(monkeypatch):
    monkeypatch.setattr(triton_jvp, "_cudnn_op_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    by_default = triton_jvp._cudnn_by_default.__wrapped__
    assert by_default(CUDA, torch.bfloat16, 128)
    assert not by_default(CUDA, torch.bfloat16, 256) and not by_default(CUDA, torch.float32, 64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not by_default(CUDA, torch.bfloat16, 128)


def test_failed_self_check_warns_once_and_falls_back(hopper):
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: "gave wrong gradients")
    with pytest.warns(UserWarning, match="cuDNN's attention backward is not used .*gave wrong gradients"):
        assert triton_jvp.backward_impl(_like()) == "torch_fa2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert triton_jvp.backward_impl(_like()) == "torch_fa2"
    hopper.setenv(triton_jvp.BACKWARD_ENV, "cudnn")  # forced, it is an error
    with pytest.raises(ValueError, match="the cudnn backward gave wrong gradients"):
        triton_jvp.backward_impl(_like())


def test_no_self_check_inside_a_cuda_graph_capture(hopper):
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: pytest.fail("self-check while capturing"))
    hopper.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert triton_jvp.backward_impl(_like()) == "torch_fa2"
    assert triton_jvp._CUDNN_VERDICTS == {}  # decided later, outside the capture


def test_no_self_check_while_torch_compile_traces(hopper):
    from torch._subclasses.fake_tensor import FakeTensorMode

    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: pytest.fail("self-check on fake tensors"))
    with FakeTensorMode():  # what a compiled step's backward is traced under
        assert triton_jvp.backward_impl(_like()) == "torch_fa2"
    assert triton_jvp._CUDNN_VERDICTS == {}


def test_check_available_settles_the_verdict_before_any_step(hopper):
    calls = []
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: calls.append(key))
    triton_jvp._settle_cudnn.cache_clear()
    for _ in range(2):
        triton_jvp.check_available(CUDA, torch.bfloat16, 64)
    assert calls == [(CUDA, torch.bfloat16, 64)]
    assert triton_jvp.backward_impl(_like()) == "cudnn"  # a traced backward then finds it
    triton_jvp._settle_cudnn.cache_clear()


def test_self_check_accepts_a_correct_backward_and_rejects_others(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setitem(triton_jvp.BACKWARDS, "cudnn", _math_backward)
    assert triton_jvp._cudnn_self_check(cpu, torch.float32, 64) is None

    def log2_statistics(do, q, k, v, o, lse, causal, scale):  # reads the natural-log lse as log2
        s = (q.float() @ k.float().transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        p = torch.exp2(s * 1.4426950408889634 - lse[..., None])
        dv = p.transpose(-2, -1) @ do.float()
        ds = p * (do.float() @ v.float().transpose(-2, -1) - (do.float() * o.float()).sum(-1, keepdim=True))
        return ds @ k.float() * scale, ds.transpose(-2, -1) @ q.float() * scale, dv

    monkeypatch.setitem(triton_jvp.BACKWARDS, "cudnn", log2_statistics)
    assert "differ from the fp32 reference" in triton_jvp._cudnn_self_check(cpu, torch.float32, 64)

    def refuses(*args):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.\nmore")

    monkeypatch.setitem(triton_jvp.BACKWARDS, "cudnn", refuses)
    assert triton_jvp._cudnn_self_check(cpu, torch.float32, 64) == "raised cuDNN Frontend error: No valid execution plans built."


def test_cudnn_that_raises_later_falls_back_for_good(hopper):
    """Passed its self-check, then refused a call: that call and later ones go to FlashAttention-2."""
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: None)
    for probe in ("fa2_unsupported", "cudnn_unsupported"):  # CPU tensors pose as CUDA ones
        hopper.setattr(triton_jvp, probe, lambda device, dtype, head_dim: None)
    hopper.setattr(triton_jvp, "_cudnn_by_default", lambda device, dtype, head_dim: True)
    calls = []

    def refuses(*args):
        calls.append("cudnn")
        raise RuntimeError("cuDNN refused")

    def fa2(*args):
        calls.append("torch_fa2")
        return _math_backward(*args)

    hopper.setitem(triton_jvp.BACKWARDS, "cudnn", refuses)
    hopper.setitem(triton_jvp.BACKWARDS, "torch_fa2", fa2)
    q, k, v, do = (torch.randn(1, 2, 16, 32) for _ in range(4))
    o, lse = torch.zeros_like(q), torch.zeros(1, 2, 16)
    with pytest.warns(UserWarning, match="raised cuDNN refused"):
        grads = triton_jvp._bwd_impl(do, q, k, v, o, lse, False, 32**-0.5)
    triton_jvp._bwd_impl(do, q, k, v, o, lse, False, 32**-0.5)
    assert calls == ["cudnn", "torch_fa2", "torch_fa2"]
    for got, ref in zip(grads, grads64(q, k, v, do)):
        torch.testing.assert_close(got.double(), ref)

    hopper.setenv(triton_jvp.BACKWARD_ENV, "cudnn")  # forced: its error reaches the caller
    triton_jvp._CUDNN_VERDICTS.clear()
    with pytest.raises(RuntimeError, match="cuDNN refused"):
        triton_jvp._bwd_impl(do, q, k, v, o, lse, False, 32**-0.5)


def test_gradients_keep_the_layout_of_strided_views(hopper):
    """The DiT's q, k, v are (B, H, L, D) views of one (B, L, 3, H, D) projection. cuDNN's backward takes dO as it comes
    and allocates the gradients dense in q's stride order ((B, L, H, D) storage): flm passes both through without a
    copy to contiguous and back (the fused path before the fifty-seventh day: five copies per call). A backward that
    returns contiguous gradients (FA2 here) has them laid out so too, the layout the op's fake implementation gives
    torch.compile."""
    hopper.setattr(triton_jvp, "_cudnn_self_check", lambda *key: None)
    for probe in ("fa2_unsupported", "cudnn_unsupported"):  # CPU tensors pose as CUDA ones
        hopper.setattr(triton_jvp, probe, lambda device, dtype, head_dim: None)
    seen = {}

    def cudnn(do, q, k, v, *rest):  # as PyTorch's cuDNN backward allocates dq, dk, dv: dense in q's, k's, v's order
        seen["do"], seen["grads"] = do, tuple(in_q_order(g, x) for g, x in zip(_math_backward(do, q, k, v, *rest), (q, k, v)))
        return seen["grads"]

    hopper.setitem(triton_jvp.BACKWARDS, "cudnn", cudnn)
    hopper.setitem(triton_jvp.BACKWARDS, "torch_fa2", lambda *args: tuple(g.contiguous() for g in _math_backward(*args)))
    q, k, v = torch.randn(1, 16, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) views, not dense
    do = torch.randn(1, 16, 2, 32).transpose(1, 2)  # the output projection's gradient, in q's order
    o, lse = torch.zeros_like(do), torch.zeros(1, 2, 16)
    ref = grads64(q, k, v, do)
    for impl in ("cudnn", "torch_fa2"):
        hopper.setattr(triton_jvp, "backward_impl", lambda q, impl=impl: impl)
        grads = triton_jvp._bwd_impl(do, q, k, v, o, lse, False, 32**-0.5)
        fake = triton_jvp._bwd_op(*(x.to("meta") for x in (do, q, k, v, o, lse)), False, 32**-0.5)  # the fake impl
        for got, want, f in zip(grads, ref, fake):
            assert got.transpose(1, 2).is_contiguous() and got.stride() == f.stride(), impl
            torch.testing.assert_close(got.double(), want)
    assert seen["do"] is do
    hopper.setattr(triton_jvp, "backward_impl", lambda q: "cudnn")
    assert all(g is h for g, h in zip(triton_jvp._bwd_impl(do, q, k, v, o, lse, False, 32**-0.5), seen["grads"]))

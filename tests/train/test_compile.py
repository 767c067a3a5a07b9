"""trainer.compile=true on a JVP objective: its whole loss, torch.func.jvp included, compiled (CPU inductor)."""

import json

import pytest
import torch

from .test_graphs import read_losses

COMPILED = ["objective=meanflow", "objective.jvp_mode=func", "objective.cfg_omega=1.0", "objective.tangent=sample"]
COMPILED += ["trainer.log_every=1"]


@pytest.mark.parametrize("attention", ["math", "triton_jvp"])  # the fused kernel in Triton's CPU interpreter
def test_a_compiled_meanflow_run_follows_the_eager_run(tmp_path, train_run, attention):
    import torch._inductor.config as inductor

    if attention == "triton_jvp" and torch.cuda.is_available():  # the interpreter runs only where CUDA is absent
        pytest.skip("the CPU-interpreter row; on a GPU the compiled fused kernel is test_a_students_loss_compiles_...")

    overrides = COMPILED + [f"attention={attention}"]
    train_run(tmp_path / "eager", overrides)
    with inductor.patch(fallback_random=True):  # eager's random numbers, to compare step by step
        train_run(tmp_path / "compiled", overrides + ["trainer.compile=true"])
    eager, compiled = (read_losses(tmp_path / name) for name in ("eager", "compiled"))
    assert len(eager) == len(compiled) == 4
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-6)
    first = json.loads(open(tmp_path / "compiled" / "metrics.jsonl").readline())
    assert first["grad_norm"] > 0  # the compiled loss has its gradient


@pytest.mark.parametrize("mode", ["dual", "two_pass"])
def test_compile_needs_the_func_jvp_mode(tmp_path, train_run, mode):
    with pytest.raises(ValueError, match=f"Dynamo traces torch.func.jvp.*jvp_mode={mode}.*pass objective.jvp_mode=func"):
        train_run(tmp_path, ["objective=meanflow", f"objective.jvp_mode={mode}", "attention=math", "trainer.compile=true"])
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_compile_of_a_jvp_objective_needs_math_or_the_fused_kernel(tmp_path, train_run, attention):
    overrides = ["objective=meanflow", "objective.jvp_mode=func", f"attention={attention}", "trainer.compile=true"]
    refusal = f"with math or triton_jvp attention only.*attention={attention}; pass attention=triton_jvp"
    with pytest.raises(ValueError, match=refusal):
        train_run(tmp_path, overrides)
    assert not (tmp_path / "checkpoints").exists()


def test_compile_mode_reaches_torch_compile(tmp_path, train_run, monkeypatch):
    modes = []
    real = torch.compile

    def spy(fn, **kwargs):
        modes.append(kwargs.get("mode"))
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    train_run(tmp_path, ["objective=flow_matching", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"])
    assert modes == ["reduce-overhead"]  # on the CPU inductor skips the CUDA graphs; the step marks still run


def test_an_unknown_compile_mode_is_refused():
    from flm.train import TrainerConfig

    with pytest.raises(ValueError, match="trainer.compile_mode must be one of default, reduce-overhead.*got 'fast'"):
        TrainerConfig(compile=True, compile_mode="fast")


@pytest.mark.parametrize("attention", ["math", "triton_jvp"])
@pytest.mark.parametrize("name, phase", [("scd", None), ("rcm", "model")])
def test_a_students_loss_compiles_as_one_graph(attention, name, phase):
    """sCD's teacher forward runs before the student's torch.func.jvp in one compiled loss. Reading forward AD's
    current level in that forward (the attention's dual check) made Dynamo fail the JVP (torch 2.14) and fall back
    to eager for the whole loss; fullgraph=True turns such a break into an error."""
    from flm.models import build_model
    from flm.objectives import build_objective

    def dit():
        return build_model("DiT-T/4", input_size=8, in_channels=1, num_classes=10, attention=attention, time_inputs=1)

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the fused kernel: Triton's interpreter on the CPU
    torch.manual_seed(0)
    model, teacher = dit().to(device), dit().to(device).requires_grad_(False)
    objective = build_objective(name, teacher="unused", jvp_mode="func").to(device)  # its logvar head's buffers
    networks = {"teacher": teacher} | ({"fake_score": dit().to(device)} if name == "rcm" else {})
    x, y = torch.randn(4, 1, 8, 8, device=device), torch.randint(0, 10, (4,), device=device)
    loss = torch.compile(objective.loss, fullgraph=True)
    out, _ = loss(model, x, y, step=torch.tensor(10**6), **({"phase": phase} if phase else {}), **networks)
    total = sum(out.values()) if isinstance(out, dict) else out
    assert torch.isfinite(total) and total.requires_grad


def test_a_bf16_step_compiles_as_one_graph():
    """The training loop runs each loss under autocast inside flm.nn.cast_cache. The cache's dict broke Dynamo's graph
    at every linear under bf16 (each layer its own frame, past the recompile limit: a compiled DiT-S/2 step ran 3x
    slower than its CUDA graph on an H100); compiled code now casts plainly."""
    import flm.nn as fnn
    from flm.models import build_model
    from flm.objectives import build_objective

    torch.manual_seed(0)
    model = build_model("DiT-T/4", input_size=8, in_channels=1, num_classes=10, attention="math")
    loss = torch.compile(build_objective("flow_matching").loss, fullgraph=True)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16), fnn.cast_cache():
        out, _ = loss(model, x, y, step=torch.tensor(0))
    out.backward()
    assert torch.isfinite(out) and sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None) > 0


@pytest.mark.parametrize("as_on_hopper", [False, True])
def test_a_dit_with_sdpa_compiles_as_one_graph_and_matches_eager(monkeypatch, as_on_hopper):
    """Where SDPA may run cuDNN the sdpa backend wraps its output in GradInQOrder (flm.attention.layout), an
    autograd.Function, after a device check: Dynamo must trace both into one graph, and the backward (dO laid out in
    q's order) must leave the gradients as eager's."""
    from flm.attention import sdpa
    from flm.models import build_model

    if as_on_hopper:
        monkeypatch.setattr(sdpa, "cudnn_may_run", lambda q: True)
    torch.manual_seed(0)
    model = build_model("DiT-T/4", input_size=8, in_channels=1, num_classes=10, attention="sdpa")
    x, t, y = torch.randn(4, 1, 8, 8), torch.rand(4), torch.randint(0, 10, (4,))

    def loss(x, t, y):
        return model(x, t, y=y).square().mean()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        model.zero_grad()
        fn(x, t, y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)

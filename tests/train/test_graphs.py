"""flm.train.graphs: a MeanFlow / sCM step replayed as a CUDA graph gives the eager step's gradients.

The CUDA tests are marked gpu; the input check runs anywhere.
"""

import pytest
import torch

from flm.objectives import build_objective
from flm.train.graphs import GraphedStep
from tests.models.tiny import tiny_dit


def test_cpu_inputs_are_refused_before_anything_is_captured():
    step = GraphedStep(lambda x: (x.sum(), {}), [])
    with pytest.raises(ValueError, match="CUDA-graph steps need CUDA inputs.*cuda_graph=false"):
        step(torch.zeros(2))


def _flat_grads(params):
    return torch.cat([p.grad.flatten().float() for p in params])


@pytest.mark.gpu
@pytest.mark.parametrize("objective_name, mode", [("meanflow", "dual"), ("meanflow", "two_pass"), ("scm", "dual")])
def test_graph_replay_matches_the_eager_step(objective_name, mode):
    objective = build_objective(objective_name, jvp_mode=mode).cuda()
    model = tiny_dit(attention="triton_jvp", time_inputs=objective.time_inputs, input_size=16, channels=4).cuda()
    params = list(model.parameters()) + list(objective.parameters())

    def loss_and_backward(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, metrics = objective.loss(model, x, y, step=10**6)
        loss.backward()
        return loss, metrics

    graphed = GraphedStep(loss_and_backward, params)
    g = torch.Generator("cuda").manual_seed(0)

    def batch():
        return torch.randn(8, 4, 16, 16, device="cuda", generator=g), torch.randint(0, 10, (8,), device="cuda", generator=g)

    graphed(*batch())  # captures (its warm-up calls draw from the global RNG too)
    for _ in range(2):
        x, y = batch()
        for p in params:
            p.grad = None
        torch.manual_seed(1)  # the same noise and times in both runs
        loss_eager, _ = loss_and_backward(x, y)
        eager = _flat_grads(params)
        for p in params:
            p.grad = None  # as optimizer.zero_grad() does; the replay re-attaches its gradient buffers
        torch.manual_seed(1)
        loss_graph, _ = graphed(x, y)
        graph = _flat_grads(params)
        assert torch.allclose(loss_graph.float(), loss_eager.float(), rtol=1e-3)
        assert ((graph - eager).norm() / eager.norm()).item() < 1e-3


@pytest.mark.gpu
def test_replays_draw_fresh_noise_and_refuse_another_shape():
    objective = build_objective("flow_matching").cuda()
    model = tiny_dit(attention="sdpa", input_size=16, channels=4).cuda()

    def loss_and_backward(x, y):
        loss, metrics = objective.loss(model, x, y)
        loss.backward()
        return loss, metrics

    graphed = GraphedStep(loss_and_backward, list(model.parameters()))
    x, y = torch.randn(4, 4, 16, 16, device="cuda"), torch.arange(4, device="cuda")
    first = graphed(x, y)[0].item()
    assert graphed(x, y)[0].item() != first  # new t and noise on every replay
    with pytest.raises(ValueError, match="captured for"):
        graphed(torch.randn(2, 4, 16, 16, device="cuda"), y[:2])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.device=cpu"], "needs a CUDA device"),
        (["trainer.device=cpu", "trainer.grad_accum=2"], "trainer.grad_accum=2"),
        (["trainer.device=cpu", "trainer.compile=true"], "trainer.compile=true"),
    ],
)
def test_the_loop_refuses_what_a_graph_cannot_capture(tmp_path, train_run, overrides, message):
    with pytest.raises(ValueError, match=f"trainer.cuda_graph=true cannot run here: .*{message}.*Set trainer.cuda_graph=false"):
        train_run(tmp_path, ["trainer.cuda_graph=true", *overrides])
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("objective", ["meanflow", "scm"])
def test_a_graphed_run_follows_the_eager_run(tmp_path, train_run, objective):
    # sCM: the step (its tangent warm-up over 2 steps) enters the graph as a tensor
    common = [
        f"objective={objective}",
        "attention=triton_jvp",
        "trainer.device=cuda",
        "trainer.max_steps=6",
        "trainer.log_every=1",
    ]
    if objective == "scm":
        common.append("objective.warmup_steps=2")
    train_run(tmp_path / "eager", common)
    train_run(tmp_path / "graph", common + ["trainer.cuda_graph=true"])
    eager, graph = (read_losses(tmp_path / name) for name in ("eager", "graph"))
    assert len(eager) == len(graph) == 6
    assert torch.allclose(torch.tensor(graph), torch.tensor(eager), rtol=2e-2, atol=1e-4), (eager, graph)


def read_losses(run_dir):
    import json

    key = "mse" if "mse" in open(run_dir / "metrics.jsonl").readline() else "loss"
    return [json.loads(line)[key] for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.gpu
def test_a_step_that_syncs_with_the_host_cannot_be_captured_and_says_so():
    w = torch.zeros(3, device="cuda", requires_grad=True)

    def syncs(x):
        loss = (w * x).sum()
        loss.backward()
        return loss, {"as_float": loss.item()}  # a host sync: not allowed while capturing

    with pytest.raises(RuntimeError, match="could not be captured as a CUDA graph.*trainer.cuda_graph=false"):
        GraphedStep(syncs, [w])(torch.ones(3, device="cuda"))
    # the process can still draw random numbers on the GPU (a failed capture leaves the generator capturing)
    assert torch.randn(4, device="cuda").isfinite().all()

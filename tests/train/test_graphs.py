"""flm.train.graphs: a MeanFlow / sCM step replayed as a CUDA graph gives the eager step's gradients, replays
accumulate them as eager backwards do, and a graphed DDP step (the model unwrapped, one flat all-reduce after
the replays) averages what DDP averages.

The CUDA tests are marked gpu; the input check, the gradient hand-over and the refusals run anywhere.
"""

import contextlib
import copy
import logging

import pytest
import torch
import torch.distributed as torch_dist

from flm import dist
from flm.log import read_metrics
from flm.objectives import build_objective
from flm.objectives.protocol import Network
from flm.train import loop, parallel
from flm.train.graphs import CaptureFailed, GraphedStep, take_grads
from flm.train.settings import TrainerConfig, check_cuda_graph, resolve_cuda_graph
from tests.models.tiny import tiny_dit


def test_cpu_inputs_are_refused_before_anything_is_captured():
    step = GraphedStep(lambda x: (x.sum(), {}), [])
    with pytest.raises(ValueError, match="CUDA-graph steps need CUDA inputs.*cuda_graph=false"):
        step(torch.zeros(2))


def test_a_replay_starts_from_what_grad_holds():
    """take_grads, before every replay: zeros where .grad is None (after zero_grad), the buffer as it is where
    .grad is the buffer (accumulating micro-batches), a copy where .grad is another tensor; parameters the graph
    gives no gradient keep theirs."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    buffers = [torch.full((3,), 7.0), torch.full((3,), 2.0), torch.full((3,), 7.0), None]
    params[1].grad, params[2].grad, params[3].grad = buffers[1], torch.full((3,), 5.0), torch.full((3,), 4.0)
    take_grads(params, buffers)
    assert all(p.grad is g for p, g in zip(params[:3], buffers[:3]))
    assert params[0].grad.tolist() == [0.0] * 3
    assert params[1].grad.tolist() == [2.0] * 3
    assert params[2].grad.tolist() == [5.0] * 3
    assert params[3].grad.tolist() == [4.0] * 3


def _flat_grads(params):
    return torch.cat([p.grad.flatten().float() for p in params])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "objective_name, mode, options",
    [
        ("meanflow", "dual", {}),
        ("meanflow", "two_pass", {}),
        ("scm", "dual", {}),
        # the MNIST student's options: split target, the samplers' intervals, the high-pass term (no host tensors)
        ("meanflow", "dual", {"split_above": 0.5, "one_step_frac": 0.125, "two_step_frac": 0.25, "hf_weight": 16.0}),
        ("meanflow", "dual", {"one_step_frac": 0.125, "hf_weight": 256.0, "hf_weight_one_step": 16.0}),
        # a teacher's velocity, and the perceptual term through its features (it diverged graphed on the H200)
        ("meanflow", "dual", {"teacher": "unused", "one_step_frac": 0.25, "perceptual_weight": 1.0}),
        # sCD at its samplers' times: the shares' times are filled in place (no host-to-device copy in the capture)
        (
            "scd",
            "dual",
            {
                "teacher": "unused",
                "one_step_frac": 0.125,
                "one_step_target": "consistency",
                "two_step_frac": 0.25,
                "mid_t": (1.2, 0.6),
            },
        ),
    ],
)
def test_graph_replay_matches_the_eager_step(objective_name, mode, options):
    objective = build_objective(objective_name, jvp_mode=mode, **options).cuda()
    model = tiny_dit(attention="triton_jvp", time_inputs=objective.time_inputs, input_size=16, channels=4).cuda()
    params = list(model.parameters()) + list(objective.parameters())
    teacher = {}
    if "teacher" in options:
        teacher["teacher"] = tiny_dit(attention="triton_jvp", input_size=16, channels=4, seed=3).cuda().requires_grad_(False)

    def loss_and_backward(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, metrics = objective.loss(model, x, y, step=10**6, **teacher)
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
        (["trainer.device=cpu", "trainer.compile=true"], "trainer.compile=true"),
    ],
)
def test_the_loop_refuses_what_a_graph_cannot_capture(tmp_path, train_run, overrides, message):
    with pytest.raises(ValueError, match=f"trainer.cuda_graph=true cannot run here: .*{message}.*Set trainer.cuda_graph=false"):
        train_run(tmp_path, ["trainer.cuda_graph=true", *overrides])
    assert not (tmp_path / "checkpoints").exists()


def test_auto_graphs_where_true_would_run_and_says_why_not_elsewhere():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # device objects only: nothing runs on them
    meanflow = build_objective("meanflow")
    auto = lambda **kw: TrainerConfig(cuda_graph="auto", **kw)  # noqa: E731
    assert resolve_cuda_graph(auto(), cuda, 1, meanflow) == (True, None)
    assert resolve_cuda_graph(auto(parallel="ddp", grad_accum=2), cuda, 8, meanflow) == (True, None)
    assert resolve_cuda_graph(auto(parallel="fsdp"), cuda, 1, meanflow) == (True, None)  # one process: nothing sharded
    for trainer, device, world, reason in [
        (auto(), cpu, 1, "needs a CUDA device, and this run is on cpu"),
        (auto(parallel="fsdp"), cuda, 2, "FSDP2 (2 processes"),
        (auto(compile=True), cuda, 1, "replaces torch.compile"),
    ]:
        graphed, why = resolve_cuda_graph(trainer, device, world, meanflow)
        assert not graphed and reason in why
    # true and false pass as they are; true's refusals stay check_cuda_graph's errors
    assert resolve_cuda_graph(TrainerConfig(cuda_graph=True), cpu, 1, meanflow) == (True, None)
    assert resolve_cuda_graph(TrainerConfig(cuda_graph=False), cuda, 1, meanflow) == (False, None)


class _Alternating:
    """An objective with a trainable network of its own (a fake score) and, unless `phase`, no phase(step)."""

    def __init__(self):
        self.networks = {"fake_score": Network(build=None, trainable=True), "teacher": Network(build=None)}


class _Phased(_Alternating):
    def phase(self, step):
        return "fake_score" if step % 2 else "model"


def test_auto_leaves_an_objective_that_alternates_without_phases_eager():
    cuda = torch.device("cuda", 0)
    graphed, why = resolve_cuda_graph(TrainerConfig(cuda_graph="auto"), cuda, 1, _Alternating())
    assert not graphed and "_Alternating alternates the networks it updates without a phase(step) method" in why
    assert resolve_cuda_graph(TrainerConfig(cuda_graph="auto"), cuda, 1, _Phased()) == (True, None)
    frozen_only = _Alternating()
    frozen_only.networks = {"teacher": Network(build=None)}  # a teacher alone: every step updates the model only
    assert resolve_cuda_graph(TrainerConfig(cuda_graph="auto"), cuda, 1, frozen_only) == (True, None)


def test_cuda_graph_takes_true_false_or_auto():
    with pytest.raises(ValueError, match="trainer.cuda_graph must be true, false or auto, got 'always'"):
        TrainerConfig(cuda_graph="always")


def test_auto_on_the_cpu_trains_eager_and_says_so(tmp_path, train_run, caplog):
    with caplog.at_level(logging.INFO, logger="flm"):
        train_run(tmp_path, ["trainer.cuda_graph=auto"])
    assert "trainer.cuda_graph=auto: eager steps, since it needs a CUDA device, and this run is on cpu" in caplog.text
    assert (tmp_path / "checkpoints" / "ckpt-00000004.pt").exists()


def test_fsdp2_is_refused_with_the_reason_and_ddp_with_accumulation_is_not():
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    fsdp = TrainerConfig(cuda_graph=True, parallel="fsdp", grad_accum=2)
    with pytest.raises(ValueError, match=r"FSDP2 \(2 processes.*cannot repeat.*Set trainer.cuda_graph=false$"):
        check_cuda_graph(fsdp, cuda, world=2)
    check_cuda_graph(fsdp, cuda, world=1)  # one process: nothing is sharded
    check_cuda_graph(TrainerConfig(cuda_graph=True, parallel="ddp", grad_accum=4), cuda, world=8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "objective, grad_accum, extra",
    [
        ("meanflow", 1, []),
        ("scm", 1, []),
        ("meanflow", 2, []),
        ("scm", 2, []),
        ("meanflow", 1, ["model.prediction=data"]),
        ("flow_matching", 1, ["model.prediction=data", "objective.loss_t_min=0.05"]),
        # MeanFlow's consistency curriculum: alpha from the step tensor, one graph per kind of step (phase)
        ("meanflow", 1, ["objective.alpha_steps=[1,4]", "objective.alpha_min=0.1", "objective.tangent=model"]),
        ("scm", 1, ["objective.alpha_steps=[1,4]", "objective.alpha_min=0.1"]),
        # the batch's posterior velocity: a float64 (B, B) matmul and a masked softmax inside the capture
        ("meanflow", 1, ["objective.velocity_estimate=batch"]),
        ("flow_matching", 1, ["objective.velocity_estimate=batch"]),
        # its bank of earlier batches: the step's block written in place inside the capture, micro-batch by micro-batch
        ("meanflow", 2, ["objective.velocity_estimate=batch", "objective.velocity_references=64"]),
    ],
)
def test_a_graphed_run_follows_the_eager_run(tmp_path, train_run, objective, grad_accum, extra):
    # sCM: the step (its tangent warm-up over 2 steps) enters the graph as a tensor; grad_accum=2: one replay per
    # micro-batch, each adding into the gradients
    common = [
        *extra,
        f"objective={objective}",
        "attention=triton_jvp",
        "trainer.device=cuda",
        "trainer.max_steps=6",
        "trainer.log_every=1",
        f"trainer.grad_accum={grad_accum}",
    ]
    if objective == "scm":
        common.append("objective.warmup_steps=2")
    assert_graphed_follows_eager(tmp_path, train_run, common, steps=6)


def assert_graphed_follows_eager(tmp_path, train_run, overrides, steps: int):
    """The losses of a run with trainer.cuda_graph=true against those of the same run eager (bf16 noise)."""
    train_run(tmp_path / "eager", [*overrides, "trainer.cuda_graph=false"])
    train_run(tmp_path / "graph", [*overrides, "trainer.cuda_graph=true"])
    eager, graph = (read_losses(tmp_path / name) for name in ("eager", "graph"))
    assert len(eager) == len(graph) == steps
    assert not any(read_graphed(tmp_path / "eager")) and all(read_graphed(tmp_path / "graph"))
    assert torch.allclose(torch.tensor(graph), torch.tensor(eager), rtol=2e-2, atol=1e-4), (eager, graph)


def read_losses(run_dir):
    import json

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    # a phase change (rCM's dmd_start) changes the logged keys: mse only where every step has one, else the sum of
    # the losses of the networks each step trained ("loss" the model's, "fake_score.loss", ...)
    if all("mse" in row for row in rows):
        return [row["mse"] for row in rows]
    return [sum(v for k, v in row.items() if k == "loss" or k.endswith(".loss")) for row in rows]


@pytest.mark.gpu
def test_a_step_that_syncs_with_the_host_cannot_be_captured_and_says_so():
    w = torch.zeros(3, device="cuda", requires_grad=True)

    def syncs(x):
        loss = (w * x).sum()
        loss.backward()
        return loss, {"as_float": loss.item()}  # a host sync: not allowed while capturing

    w.grad = torch.full_like(w, 7.0)
    rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    with pytest.raises(CaptureFailed, match="could not be captured as a CUDA graph.*trainer.cuda_graph=false"):
        GraphedStep(syncs, [w])(torch.ones(3, device="cuda"))
    # what an eager step would then find: .grad and both generators as before the warm-up (trainer.cuda_graph=auto
    # runs the step eagerly after this)
    assert torch.equal(w.grad, torch.full_like(w, 7.0))
    assert torch.equal(torch.get_rng_state(), rng[0]) and torch.equal(torch.cuda.get_rng_state(), rng[1])
    # the process can still draw random numbers on the GPU (a failed capture leaves the generator capturing)
    assert torch.randn(4, device="cuda").isfinite().all()


@pytest.mark.gpu
def test_on_a_gpu_auto_graphs_the_step_and_trains_eagerly_one_that_reads_the_host(tmp_path, train_run, monkeypatch, caplog):
    """trainer.cuda_graph=auto on a real capture: a step that can be captured replays a graph; one whose loss reads a
    value on the host fails its capture and then trains as the eager run does (the failed capture left .grad and the
    generators as they were: other noise would move a batch of 4's loss by far more than the tolerance)."""
    from flm.objectives.flow_matching import FlowMatching

    common = ["objective=flow_matching", "attention=triton_jvp", "trainer.device=cuda", "trainer.log_every=1"]
    train_run(tmp_path / "auto", [*common, "trainer.cuda_graph=auto"])
    assert all(read_graphed(tmp_path / "auto"))

    loss = FlowMatching.loss

    def reads_the_host(self, *args, **kwargs):
        out = loss(self, *args, **kwargs)
        float(out[0].detach())  # a host read, which a capture refuses
        return out

    monkeypatch.setattr(FlowMatching, "loss", reads_the_host)
    with caplog.at_level(logging.INFO, logger="flm"):
        train_run(tmp_path / "fallback", [*common, "trainer.cuda_graph=auto"])
    assert caplog.text.count("could not be captured as a CUDA graph") == 1
    assert not any(read_graphed(tmp_path / "fallback"))
    train_run(tmp_path / "eager", [*common, "trainer.cuda_graph=false"])
    fallback, eager = (torch.tensor(read_losses(tmp_path / name)) for name in ("fallback", "eager"))
    assert torch.allclose(fallback, eager, rtol=5e-3, atol=1e-6), (fallback, eager)
    with pytest.raises(CaptureFailed):
        train_run(tmp_path / "true", [*common, "trainer.cuda_graph=true"])


class _CannotCapture:
    """GraphedStep as it behaves for a step that cannot be captured."""

    def __init__(self, step_fn, params):
        pass

    def __call__(self, *inputs):
        raise CaptureFailed("operation not permitted when stream is capturing")


@pytest.mark.parametrize("setting", ["auto", "true"])
def test_auto_trains_eagerly_what_cannot_be_captured_and_true_stops(tmp_path, train_run, monkeypatch, caplog, setting):
    """The loop's side, on the CPU: auto resolved to a graph (as on a GPU) whose capture fails runs that kind of step
    eagerly, as the same run with cuda_graph=false does; true stops with the capture's error."""
    monkeypatch.setattr(loop, "resolve_cuda_graph", lambda trainer, *_: (trainer.cuda_graph is not False, None))
    monkeypatch.setattr(loop, "check_cuda_graph", lambda *_: None)
    monkeypatch.setattr(loop, "GraphedStep", _CannotCapture)
    run = [f"trainer.cuda_graph={setting}", "trainer.log_every=1"]
    if setting == "true":
        with pytest.raises(CaptureFailed, match="Set trainer.cuda_graph=false"):
            train_run(tmp_path / "graph", run)
        return
    with caplog.at_level(logging.INFO, logger="flm"):
        train_run(tmp_path / "graph", run)
    assert caplog.text.count("could not be captured as a CUDA graph (operation not permitted") == 1  # once per kind
    train_run(tmp_path / "eager", ["trainer.cuda_graph=false", "trainer.log_every=1"])
    assert read_losses(tmp_path / "graph") == read_losses(tmp_path / "eager")
    assert not any(read_graphed(tmp_path / "graph"))  # its step_ms are eager steps'


class _Replays:
    """GraphedStep as the loop sees a captured step: each call runs it (here eagerly, on the CPU)."""

    def __init__(self, step_fn, params):
        self.step_fn = step_fn

    def __call__(self, *inputs):
        return self.step_fn(*inputs)


def read_graphed(run_dir):
    return [record["cuda_graph"] for record in read_metrics(run_dir)]


def test_the_metrics_say_whether_the_logged_steps_replayed_a_cuda_graph(tmp_path, train_run, monkeypatch):
    monkeypatch.setattr(loop, "resolve_cuda_graph", lambda trainer, *_: (trainer.cuda_graph is not False, None))
    monkeypatch.setattr(loop, "check_cuda_graph", lambda *_: None)
    monkeypatch.setattr(loop, "GraphedStep", _Replays)
    train_run(tmp_path / "graph", ["trainer.cuda_graph=true", "trainer.log_every=1"])
    train_run(tmp_path / "eager", ["trainer.cuda_graph=false", "trainer.log_every=1"])
    assert read_graphed(tmp_path / "graph") == [True] * 4 and read_graphed(tmp_path / "eager") == [False] * 4


def _micro_step(objective, model, grad_accum: int):
    """The loop's loss_and_backward in fp32: each micro-batch's loss scaled by 1 / grad_accum."""

    def loss_and_backward(x, y):
        loss, metrics = objective.loss(model, x, y, step=10**6)
        (loss / grad_accum).backward()
        return loss, metrics

    return loss_and_backward


def _batches(n: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    return [
        (torch.randn(4, 4, 16, 16, device="cuda", generator=g), torch.randint(0, 10, (4,), device="cuda", generator=g))
        for _ in range(n)
    ]


def _accumulate(step_fn, batches, sync=lambda micro: contextlib.nullcontext()):
    """One optimizer step's micro-batches as the loop runs them: a seed per micro-batch, the losses kept."""
    losses = []
    for micro, (x, y) in enumerate(batches):
        torch.manual_seed(micro)  # the same noise and times in both runs
        with sync(micro):
            losses.append(step_fn(x, y)[0].detach().clone())  # a graph's output is overwritten by the next replay
    return torch.stack(losses)


@pytest.mark.gpu
@pytest.mark.parametrize("objective_name", ["flow_matching", "meanflow", "scm"])
def test_replays_accumulate_gradients_as_eager_backwards_do(objective_name):
    """fp32, equal inputs and noise: 3 micro-batches, one replay each, give the eager accumulated gradients; the
    next step (.grad set to None, as zero_grad does) starts from zero again."""
    objective = build_objective(objective_name).cuda()
    model = tiny_dit(attention="math", time_inputs=objective.time_inputs, input_size=16, channels=4).cuda()
    params = list(model.parameters()) + list(objective.parameters())
    eager_step = _micro_step(objective, model, grad_accum=3)
    graphed = GraphedStep(eager_step, params)
    for step in range(2):  # step 0 captures on its first micro-batch
        batches = _batches(3, seed=step)
        results = []
        for fn in (eager_step, graphed):
            for p in params:
                p.grad = None
            losses = _accumulate(fn, batches)
            results.append((losses, _flat_grads(params)))
        (loss_eager, eager), (loss_graph, graph) = results
        torch.testing.assert_close(loss_graph, loss_eager, rtol=1e-4, atol=1e-6)
        assert ((graph - eager).norm() / eager.norm()).item() < 1e-4


@pytest.fixture
def nccl_group_of_one(tmp_path):
    """A world-1 NCCL process group in this process, as torchrun's rank 0 would have."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = torch_dist.FileStore(str(tmp_path / "nccl_store"), 1)
    torch_dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.gpu
def test_a_graphed_step_then_one_flat_all_reduce_gives_ddps_gradients(nccl_group_of_one):
    """What a graphed DDP run does instead of DDP's hooks (flm.train.parallel.wrap): replays of the plain model's
    loss + backward, then flm.dist.all_mean_ over NCCL, against DDP eager with no_sync on the first micro-batch."""
    objective = build_objective("meanflow").cuda()
    model = tiny_dit(attention="math", time_inputs=objective.time_inputs, input_size=16, channels=4).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=[0])
    graphed = GraphedStep(_micro_step(objective, model, grad_accum=2), list(model.parameters()))
    no_sync = lambda micro: ddp.no_sync() if micro == 0 else contextlib.nullcontext()  # noqa: E731
    for step in range(2):
        batches = _batches(2, seed=step)
        for p in [*model.parameters(), *ddp.parameters()]:
            p.grad = None
        loss_ddp = _accumulate(_micro_step(objective, ddp, grad_accum=2), batches, sync=no_sync)
        loss_graph = _accumulate(graphed, batches)
        dist.all_mean_([p.grad for p in model.parameters()])
        torch.testing.assert_close(loss_graph, loss_ddp, rtol=1e-4, atol=1e-6)
        eager, graph = _flat_grads(list(ddp.module.parameters())), _flat_grads(list(model.parameters()))
        assert ((graph - eager).norm() / eager.norm()).item() < 1e-4


@pytest.mark.gpu
def test_a_graphed_ddp_run_follows_the_eager_ddp_run(tmp_path, train_run, nccl_group_of_one, monkeypatch):
    """The loop under DDP, on one GPU: the eager run wraps the model in DDP (all-reduce from its hooks, no_sync on the
    first micro-batch), the graphed run leaves it plain and averages the gradients in the optimizer. On one rank
    flm does not wrap at all, so here wrap() acts as it does on several."""
    on_many = lambda mode, *, cuda_graph: not (mode == "ddp" and cuda_graph)  # noqa: E731
    monkeypatch.setattr(parallel, "wrapper_syncs", on_many)
    monkeypatch.setattr(loop, "wrapper_syncs", on_many)
    common = [
        "attention=triton_jvp",
        "trainer.device=cuda",
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "trainer.grad_accum=2",
        "trainer.sync_check_every=1",
    ]
    assert_graphed_follows_eager(tmp_path, train_run, common, steps=4)

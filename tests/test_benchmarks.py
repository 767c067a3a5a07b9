"""The benchmarks' own logic that a wrong number would come from: quality.py's run specs and table,
train_step.py's distillation rows (on the CPU, Triton interpreted)."""

import json

import pytest
import torch

from flm.models import build_model

from .train.conftest import ROOT, load_entry


def load(name):
    return load_entry(f"benchmarks/{name}")


def test_overrides_split_outside_brackets():
    quality = load("quality")
    assert quality.split_overrides("optim.lr=1e-3,trainer.ema_decays=[0.99,0.999],a=b") == [
        "optim.lr=1e-3",
        "trainer.ema_decays=[0.99,0.999]",
        "a=b",
    ]
    assert quality.split_overrides("") == []
    # RUNS/ at the start of a value is the --work folder, as the docs' commands write a teacher
    assert quality.parse_spec("s:scd:950:objective.teacher=RUNS/fm5,a=RUNS,b=x/RUNS/y", "/w") == (
        "s",
        "scd",
        "950",
        ["objective.teacher=/w/fm5", "a=RUNS", "b=x/RUNS/y"],
    )


def test_weights_options():
    quality = load("quality")
    assert quality.weights_options("raw") == ["weights=raw"]
    assert quality.weights_options("ema") == ["weights=ema"]
    assert quality.weights_options("ema0.99") == ["weights=ema", "ema=0.99"]
    with pytest.raises(SystemExit, match="expected ema"):
        quality.weights_options("best")


def test_a_distilled_students_auto_budget_is_a_quarter_of_its_teachers():
    quality = load("quality")
    assert quality.budget_seconds("auto", "flow_matching", 200.0) == 200.0
    assert quality.budget_seconds("auto", "scd", 200.0) == 50.0
    assert quality.budget_seconds("auto", "meanflow_distill", 200.0) == 50.0
    assert quality.budget_seconds("80s", "scd", 200.0) == 80.0  # an explicit budget is the run's own choice


def entry(name, objective, fids):
    results = {f"fid_steps{k}": v for k, v in fids.items()}
    return {
        "name": name,
        "objective": objective,
        "train_steps": 10,
        "step_ms": 1.0,
        "gpu_s": 0.01,
        "overrides": [],
        "evals": {"ema0.99": {"results": results}},
    }


def test_report_divides_by_the_best_flow_matching_50_step_fid(tmp_path):
    quality = load("quality")
    results = {
        "a": entry("a", "flow_matching", {50: 10.0, 2: 30.0}),
        "b": entry("b", "flow_matching", {50: 8.0, 2: 20.0}),
        "c": {
            **entry("c", "scd", {1: 12.0, 2: 9.0}),
            "evals": None,
            "eval": {"results": {"fid_steps1": 12.0, "fid_steps2": 9.0, "digit_fd_steps1": 3.25, "faint_steps2": 0.0412}},
            "overrides": ["objective.teacher=/tmp/work/b/"],
            "gpu_s": 50.2,
        },
    }
    results["b"]["gpu_s"] = 200.4
    for r in results.values():
        r.update(device="CPU", torch="-", triton="-", command="-")
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    rows = [line for line in (tmp_path / "q.md").read_text().splitlines() if line.startswith("| c ")]
    assert [row.split("|")[-4].strip() for row in rows] == ["1.50", "1.12"]  # 12 / 8 and 9 / 8: against b, not a
    assert all(row.split("|")[-3].strip() == "-" for row in rows)  # no teacher's FID recorded with the run
    assert all(row.split("|")[-2].strip() == "-" for row in rows)  # no flow-map error measured
    assert [row.split("|")[-6].strip() for row in rows] == ["3.250", "-"]  # the digit FD where it was measured
    assert [row.split("|")[-5].strip() for row in rows] == ["-", "4.12 %"]  # the faint pixels' share, likewise
    assert all("| ema |" in row for row in rows)  # an old entry's single evaluation is the run's first EMA
    assert all(row.split("|")[6:8] == [" 50 ", " 251 "] for row in rows)  # its GPU s, and with its teacher b's
    listed = [line for line in (tmp_path / "q.md").read_text().splitlines() if line.startswith("- `")]
    assert listed == [f"- `{name}`: CPU, torch -, Triton -; `-`" for name in "abc"]
    results["c"]["note"] = "from the call's printed table"  # an entry added by hand says so
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    assert "- `c`: CPU, torch -, Triton -; `-` (from the call's printed table)" in (tmp_path / "q.md").read_text()
    results["c"]["device"] = "NVIDIA H100"  # another card: no flow-matching run of its own, so no ratio
    results["a"]["device"] = "NVIDIA H100"
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    rows = [line for line in (tmp_path / "q.md").read_text().splitlines() if line.startswith("| c ")]
    assert [row.split("|")[-4].strip() for row in rows] == ["1.20", "0.90"]  # against a, its card's only one
    del results["a"]
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    rows = [line for line in (tmp_path / "q.md").read_text().splitlines() if line.startswith("| c ")]
    assert [row.split("|")[-4].strip() for row in rows] == ["-", "-"]


def test_a_students_fid_is_divided_by_its_own_teachers_as_recorded_when_it_ran(tmp_path):
    quality = load("quality")
    results = {
        "t": entry("t", "flow_matching", {50: 4.0, 2: 20.0}),
        "s": {**entry("s", "scd", {1: 12.0, 2: 6.0}), "overrides": ["objective.teacher=/w/t"]},
    }
    assert quality.teacher_fid50(results["t"], results) is None  # not a distilled run
    assert quality.teacher_fid50({**results["s"], "overrides": ["objective.teacher=/w/gone"]}, results) is None
    results["s"]["teacher_fid50"] = quality.teacher_fid50(results["s"], results)
    results["t"] = entry("t", "flow_matching", {50: 3.0, 2: 20.0})  # a later teacher of the same name
    for r in results.values():
        r.update(device="CPU", torch="-", triton="-", command="-")
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    rows = [line for line in (tmp_path / "q.md").read_text().splitlines() if line.startswith("| s ")]
    assert [row.split("|")[-3].strip() for row in rows] == ["3.00", "1.50"]  # 12 / 4 and 6 / 4: the teacher it had
    results["s"]["teacher_gpu_s"] = 150.0  # the teacher's GPU s recorded with the student wins over a later namesake's
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    rows = [line for line in (tmp_path / "q.md").read_text().splitlines() if line.startswith("| s ")]
    assert all(row.split("|")[7].strip() == f"{results['s']['gpu_s'] + 150:.0f}" for row in rows)


def test_every_objective_has_its_samplers_and_every_student_its_flow_map_in_the_quality_benchmark():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    quality = load("quality")
    names = {path.stem for path in (ROOT / "configs" / "objective").glob("*.yaml")}
    assert set(quality.SAMPLER_STEPS) == names
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        objectives = {name: compose(config_name="train", overrides=[f"objective={name}"]).objective for name in names}
    students = {name for name, o in objectives.items() if OmegaConf.to_container(o).get("teacher") == "???"}  # mandatory
    assert set(quality.DISTILLED) == students  # the objectives that must be given a teacher


def test_a_teachers_gpu_seconds_are_read_up_to_the_checkpoint_it_is(tmp_path):
    quality = load("quality")
    run = tmp_path / "fm"
    (run / "checkpoints").mkdir(parents=True)
    windows = [(50, 100.0), (100, 10.0), (150, 20.0)]  # the first holds compilation: charged at the others' median, 15
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "step_ms": ms}) + "\n" for k, ms in windows))
    for step in (120, 150, 200):
        (run / "checkpoints" / f"ckpt-{step:08d}.pt").touch()
    teacher = lambda path: quality.teacher_seconds(["objective.dmd_start=2", f"objective.teacher={path}"])  # noqa: E731
    assert teacher(run / "checkpoints" / "ckpt-00000150.pt") == pytest.approx(0.75 + 0.5 + 1.0)
    assert teacher(run / "checkpoints" / "ckpt-00000120.pt") == pytest.approx(0.75 + 0.5 + 20 * 20 / 1000)  # within a window
    assert teacher(run / "checkpoints" / "ckpt-00000200.pt") is None  # past the last logged window
    assert teacher(run) is None  # a run folder is its latest checkpoint, here the one past the windows
    (run / "checkpoints" / "ckpt-00000200.pt").unlink()
    assert teacher(run) == pytest.approx(2.25)
    assert teacher(tmp_path / "gone") is None and quality.teacher_seconds(["trainer.seed=1"]) is None


def test_extra_sampler_steps_are_scored_and_reported_beside_the_objectives_own(tmp_path):
    quality = load("quality")
    assert quality.run_sampler_steps("meanflow", [50, 2, 50]) == [1, 2, 50]  # the own ones first, no repeats
    assert quality.run_sampler_steps("flow_matching", []) == [50, 2]
    results = {
        "fm": entry("fm", "flow_matching", {50: 4.0, 2: 20.0}),
        "mf": {**entry("mf", "meanflow", {1: 8.0, 2: 6.0, 50: 5.0}), "sampler_steps": [1, 2, 50]},
        "old": entry("old", "meanflow", {1: 9.0, 2: 7.0, 50: 1.0}),  # written before --extra-steps: its own steps only
    }
    for r in results.values():
        r.update(device="CPU", torch="-", triton="-", command="-")
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    lines = (tmp_path / "q.md").read_text().splitlines()
    steps = {name: [row.split("|")[9].strip() for row in lines if row.startswith(f"| {name} ")] for name in results}
    assert steps == {"fm": ["50", "2"], "mf": ["1", "2", "50"], "old": ["1", "2"]}
    mf50 = next(row for row in lines if row.startswith("| mf ") and row.split("|")[9].strip() == "50")
    assert mf50.split("|")[-4].strip() == "1.25"  # 5 / 4: a MeanFlow 50-step FID is not the baseline


def test_seeds_name_the_runs_and_the_report_averages_over_them(tmp_path):
    quality = load("quality")
    assert quality.seeded("s:scd:50s:optim.lr=1e-4,trainer.ema_decays=[0.9,0.99]", 2) == (
        "s_s2:scd:50s:optim.lr=1e-4,trainer.ema_decays=[0.9,0.99],trainer.seed=2"
    )
    assert quality.seeded("s:scd:950", 0) == "s_s0:scd:950:trainer.seed=0"
    results = {}
    for seed, (fid1, fme1) in enumerate([(20.0, 0.04), (26.0, 0.05), (23.0, 0.03)]):
        name = f"m_s{seed}"
        results[name] = {
            **entry(name, "meanflow_distill", {1: fid1, 2: 10.0}),
            "group": "m",
            "flow_map_error": {"1": fme1, "2": 0.01},
            "device": "CPU",
            "torch": "-",
            "triton": "-",
            "command": "-",
        }
    results["single"] = {
        **entry("single", "scd", {1: 30.0, 2: 12.0}),
        "device": "CPU",
        "torch": "-",
        "triton": "-",
        "command": "-",
    }
    quality.report(json.loads(json.dumps(results)), tmp_path / "q.md")
    text = (tmp_path / "q.md").read_text()
    assert "| m_s1 | meanflow_distill | - | 10 | 1.0 | 0 | - | ema0.99 | 1 | 26.00 | - | - | - | - | - | 0.05000 |" in text
    assert "| m | 3 | ema0.99 | 1 | 23.00 | 20.00-26.00 | 0.04000 (0.03000-0.05000) |" in text
    assert "| m | 3 | ema0.99 | 2 | 10.00 | 10.00-10.00 | 0.01000 (0.01000-0.01000) |" in text
    assert "| single | 1 |" not in text  # one run is no spread


def test_train_step_runs_the_distillation_rows(capsys):
    load("train_step").main(
        ["--tiny", "--objectives", "flow_matching,scd,rcm", "--backends", "math", "--modes", "dual", "--no-sdpa-baseline"]
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| DiT-T/2")]
    assert [row.split("|")[4].strip() for row in rows] == ["flow_matching", "scd", "rcm"]
    assert all(float(row.split("|")[7]) > 0 for row in rows)


def test_train_step_takes_objective_options(capsys):
    """NAME:KEY=VALUE rows build the objective with those options; a malformed option stops with its name."""
    train_step = load("train_step")
    assert train_step.split_objective("meanflow:jvp_subset=true;r_neq_t=0.5;tangent=model") == (
        "meanflow",
        {"jvp_subset": True, "r_neq_t": 0.5, "tangent": "model"},
    )
    train_step.main(
        ["--tiny", "--objectives", "meanflow:jvp_subset=true", "--backends", "math", "--modes", "dual", "--no-sdpa-baseline"]
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| DiT-T/2")]
    assert [row.split("|")[4].strip() for row in rows] == ["meanflow:jvp_subset=true"]
    with pytest.raises(SystemExit, match="'jvp_subset' of 'meanflow:jvp_subset' is not KEY=VALUE"):
        train_step.split_objective("meanflow:jvp_subset")


def test_train_step_interleaves_rounds(capsys):
    """--rounds 3: every row timed in three interleaved rounds; its ms / step (the median of the rounds' medians) lies in
    its ms range; --rounds 0 is refused."""
    train_step = load("train_step")
    train_step.main(
        [
            "--tiny",
            "--objectives",
            "flow_matching,meanflow",
            "--backends",
            "math",
            "--modes",
            "dual",
            "--no-sdpa-baseline",
            "--rounds",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert "3 interleaved rounds" in out and "| ms range |" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| DiT-T/2")]
    assert [row[4].strip() for row in rows] == ["flow_matching", "meanflow"]
    for row in rows:
        low, high = map(float, row[8].split("-"))
        assert low <= float(row[7]) <= high
    with pytest.raises(SystemExit):
        train_step.parse_args(["--rounds", "0"])


def test_train_step_counts_the_aten_ops_of_an_eager_step(capsys):
    """--count-ops: an eager row gets the aten ops one step dispatches (MeanFlow's dual pass more than flow matching's
    plain one); a graphed row, which replays one graph, gets none."""
    train_step = load("train_step")
    argv = ["--tiny", "--objectives", "flow_matching,meanflow", "--backends", "math", "--modes", "dual", "--count-ops"]
    train_step.main([*argv, "--no-sdpa-baseline"])
    out = capsys.readouterr().out
    assert "| aten ops (casts) |" in out
    rows = {
        row[4].strip(): row[-2].strip() for row in (line.split("|") for line in out.splitlines() if line.startswith("| DiT-T/2"))
    }
    (fm_ops, fm_casts), (mf_ops, _) = (
        map(int, rows[k].replace("(", "").replace(")", "").split()) for k in ("flow_matching", "meanflow")
    )
    assert mf_ops > fm_ops > 100 and fm_casts == 0  # fp32: no autocast, no casts


def test_kernel_census_counts_a_steps_kernels_as_on_a_gpu(capsys):
    """benchmarks/kernel_census.py: an sCD step's kernel-launching ops by op and line, the adaLN kernels interpreted
    (their tangents read in place: no copy from adaln.py) and the teacher frozen in bf16 (one cast per student weight
    alone); the switches it sets for the count are restored."""
    from flm.kernels import adaln
    from flm.kernels.attention_fwd import interpreted

    if not interpreted():
        pytest.skip("the census runs Triton's CPU interpreter (TRITON_INTERPRET=1)")
    census = load("kernel_census")
    census.main(["--objective", "scd", "--model", "DiT-T/2", "--lines", "200", "--casts", "each"])
    out = capsys.readouterr().out
    total = int(out.split("kernel-launching aten ops in one step: ")[1].split()[0])
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in out.splitlines() if ".py:" in line]
    lines = {(op, where): int(n) for op, where, n in rows}
    weights = sum(1 for _ in build_model("DiT-T/2", input_size=8, in_channels=1, num_classes=10).parameters()) - 1
    assert total > 100 and not any(op == "clone" and "adaln.py" in where for op, where in lines)
    assert sum(n for (op, where), n in lines.items() if op == "_to_copy" and "_cast" in where) >= weights
    assert sum(n for (op, where), n in lines.items() if op == "_to_copy" and "_cast" in where) < 2 * weights
    assert adaln.FORCE is None and census.train_step.frozen.__module__ == "flm.train.loop"
    census.main(["--objective", "scd", "--model", "DiT-T/2", "--lines", "200"])  # bulk: the loop's default
    out = capsys.readouterr().out
    in_bulk = int(out.split("kernel-launching aten ops in one step: ")[1].split()[0])
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in out.splitlines() if ".py:" in line]
    bulk_lines = {(op, where): int(n) for op, where, n in rows}
    # the student's weights and their gradients: two ops in all (trainer.bulk_casts) in place of one each
    assert sum(n for (op, _), n in bulk_lines.items() if op == "_foreach_copy_") == 2
    assert in_bulk == total - 2 * weights + 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--objective", "bogus"], "error: unknown objective 'bogus'"),
        (["--tokens", "15"], "error: tokens 15 is not a square number"),
        (["--backend", "bogus"], "error: unknown attention backend 'bogus'"),
    ],
)
def test_kernel_census_refuses_bad_options_in_one_line(argv, message):
    with pytest.raises(SystemExit) as exit_:
        load("kernel_census").main(argv)
    assert str(exit_.value).startswith(message)


def test_host_time_times_every_layer_and_step(capsys):
    load("host_time").main(["--depth", "2", "--calls", "5", "--steps", "2", "--repeats", "1", "--casts", "fp32,bulk"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    layers = {r[1].strip(): (float(r[2]), float(r[3])) for r in rows if r[2].strip().replace(".", "").isdigit()}
    assert set(layers) == {"linear", "layer_norm", "gelu_tanh", "gated residual", "attention (math)"}
    steps = {(r[1].strip(), r[3].strip()): float(r[4]) for r in rows if r[2].strip() == "math"}
    assert list(steps) == [(o, c) for o in ("flow_matching", "meanflow", "scm") for c in ("fp32", "bulk")]
    assert all(min(v) > 0 for v in layers.values()) and min(steps.values()) > 0
    with pytest.raises(SystemExit):
        load("host_time").main(["--casts", "bf16"])
    with pytest.raises(SystemExit, match="--device cuda"):
        load("host_time").main(["--backends", "triton_jvp"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU"):
            load("host_time").main(["--device", "cuda"])


def test_latent_run_times_prepare_and_train_on_the_cpu(tmp_path):
    pytest.importorskip("diffusers", reason="the latent pipeline needs the latent extra")
    result = load("latent_run").main(["--tiny", "--work", str(tmp_path), "--out", str(tmp_path / "result.md")])
    assert result["images"] == 16 and result["latent_shape"] == [4, 16, 16]
    assert result["prepare_s"] > 0 and result["step_ms"] > 0 and result["steps_per_s"] == pytest.approx(1000 / result["step_ms"])
    assert "| train.py | DiT-T/2, meanflow" in (tmp_path / "result.md").read_text()


def test_meanflow_errors_bins_the_intervals_and_shares_the_gradient():
    """Samples land in the bin of their t - r (the last bin closed); each bin's share is its part of the summed
    per-sample gradient norms 2 w ||err||, with MeanFlow's adaptive weight."""
    from flm.objectives import MeanFlow

    errors = load("meanflow_errors")
    objective = MeanFlow(adaptive_p=1.0, adaptive_c=1e-3)
    t = torch.tensor([0.5, 0.9, 1.0, 1.0])
    r = torch.tensor([0.48, 0.75, 0.2, 0.0])  # t - r: 0.02, 0.15, 0.8, 1.0
    err = torch.stack([torch.full((2, 2), e) for e in (0.1, 0.2, 1.0, 2.0)])
    rows = errors.interval_table(t, r, err, objective, edges=(0.0, 0.1, 0.7, 1.0))
    assert [row["n"] for row in rows] == [1, 1, 2]
    sq = torch.tensor([0.04, 0.16, 4.0, 16.0])
    grad = 2 * sq.sqrt() / (sq + 1e-3)
    expected = [grad[0], grad[1], grad[2] + grad[3]]
    for row, g in zip(rows, expected):
        assert row["grad_share"] == pytest.approx(float(g / grad.sum()), rel=1e-5)
    assert rows[2]["mse"] == pytest.approx((4.0 + 16.0) / 2 / 4, rel=1e-6)
    assert "| [0.7, 1] | 2 |" in errors.markdown(rows)
    assert "bf16" not in errors.markdown(rows)
    gap = torch.stack([torch.full((2, 2), g) for g in (0.01, 0.02, 0.1, 0.3)])
    rows = errors.interval_table(t, r, err, objective, edges=(0.0, 0.1, 0.7, 1.0), bf16_gap=gap)
    assert [row["bf16_gap"] for row in rows] == pytest.approx([1e-4, 4e-4, (0.01 + 0.09) / 2])
    assert errors.markdown(rows).splitlines()[-1].endswith("| 0.05 |")


def test_attention_backward_table_divides_by_torch_fa2():
    attention = load("attention")
    ms = lambda fa2, cudnn, fa2_first, cudnn_first: {  # noqa: E731
        "torch_fa2_ms": fa2,
        "cudnn_ms": cudnn,
        "torch_fa2_first_ms": fa2_first,
        "cudnn_first_ms": cudnn_first,
    }
    rows = [
        {"head_dim": 128, "tokens": 4096, "causal": False, **ms(4.0, 2.5, 9.0, 300.0)},
        {"head_dim": 64, "tokens": 256, "causal": True, **ms(1.0, None, 2.0, None)},  # cuDNN failed there
    ]
    lines = attention.backward_table(rows, ["torch_fa2", "cudnn"]).splitlines()
    assert lines[0] == (
        "| head dim | tokens | causal | torch_fa2 ms | cudnn ms | cudnn speed-up vs torch_fa2 | torch_fa2 first call ms "
        "| cudnn first call ms |"
    )
    assert lines[2] == "| 128 | 4096 | False | 4.000 | 2.500 | 1.60x | 9 | 300 |"
    assert lines[3] == "| 64 | 256 | True | 1.000 | failed | - | 2 | failed |"


def test_attention_train_table_rows_and_ratio():
    attention = load("attention")
    row = {"head_dim": 72, "tokens": 1024, "jvp_ms": 0.2, "jvp_bwd_ms": 0.3, "jvp_train_ms": 0.5, "sdpa_fwd_ms": 0.1}
    row |= {
        "sdpa_bwd_ms": 0.15,
        "sdpa_train_ms": 0.25,
        "train_ratio": 2.0,
        "jvp_train_host_us": 300.0,
        "sdpa_train_host_us": 120.0,
    }
    lines = attention.train_table([row]).splitlines()
    assert lines[0].startswith("| head dim | tokens | fused JVP fwd ms | fused bwd ms | fused JVP fwd + bwd ms |")
    assert lines[2] == "| 72 | 1024 | 0.200 | 0.300 | 0.500 | 0.100 | 0.150 | 0.250 | 2.00x | 300 | 120 | 2.50x |"
    assert lines[1].count("---") == lines[0].count("|") - 1


def test_attention_batch_heads_must_be_a_multiple_of_heads(capsys):
    attention = load("attention")
    for argv in (["--batch-heads", "100"], ["--batch-heads", "8"], ["--heads", "0"]):  # heads 16 by default
        with pytest.raises(SystemExit):
            attention.main(argv)
        assert "--batch-heads" in capsys.readouterr().err


def test_flow_map_error_against_exact_straight_flows():
    """Data at a point a: the teacher's exact velocity (z - a) / t makes every Euler solution land on a, so the
    teacher's few-step rows are 0; a student u = (z - a) / t + c lands at a - c t per jump, c^2 off at 1 step."""
    from flm.objectives import FlowMatching, MeanFlow
    from tests.objectives.toys import PointMassMeanFlow, PointMassVelocity

    fme = load("flow_map_error")
    a, c = 0.7, 0.3
    noise = torch.randn(8, 1, 2, 2)
    teacher = (PointMassVelocity(a), FlowMatching())
    rows = fme.flow_map_errors(
        (PointMassMeanFlow(a, offset=c), MeanFlow()), teacher, noise, None, steps=[1, 2], teacher_steps=20, batch_size=3
    )
    mse = {(row["model"], row["steps"]): row["mse"] for row in rows}
    assert mse["student", 1] == pytest.approx(c**2, rel=1e-5)
    assert mse["student", 2] > 0
    assert mse["teacher", 1] == pytest.approx(0, abs=1e-10) and mse["teacher", 2] == pytest.approx(0, abs=1e-10)


def test_dmd_precision_takes_dmds_gradient_from_both_scores():
    """Point-mass scores: x_real = a and x_fake = a - s c, so the gradient is -s c / mean|x_g - a| per sample, in either
    precision, and exactly 0 when the fake score is the teacher."""
    from flm.objectives import RCM
    from flm.objectives.paths import LinearPath
    from tests.objectives.toys import PointMassVelocity

    dmd_precision = load("dmd_precision")
    a, c = 0.7, 0.3
    x_g, s = torch.randn(4, 1, 2, 2), torch.tensor([0.1, 0.4, 0.6, 0.9])
    p = LinearPath().sample(x_g, torch.randn_like(x_g), s)
    teacher, objective = PointMassVelocity(a), RCM(teacher="unused")
    expected = (-s * c / (x_g - a).abs().flatten(1).mean(1)).view(-1, 1, 1, 1).expand_as(x_g)
    for autocast in (False, True):
        with torch.no_grad():
            g = dmd_precision.gradient(objective, teacher, PointMassVelocity(a, offset=c), p, x_g, None, autocast)
            torch.testing.assert_close(g, expected)
            assert dmd_precision.gradient(objective, teacher, teacher, p, x_g, None, autocast).abs().max() == 0


def test_dmd_precision_refuses_a_run_without_a_fake_score(monkeypatch):
    dmd_precision = load("dmd_precision")
    monkeypatch.setattr(dmd_precision, "open_generator", lambda ckpt: ({"model": {}}, "runs/scd/ckpt.pt"))
    with pytest.raises(SystemExit, match="runs/scd/ckpt.pt holds no fake score; pass an rCM or MeanFlow \\+ DMD run"):
        dmd_precision.main(["--ckpt", "runs/scd", "--device", "cpu"])


def test_fid_sanity_perturbations_damage_by_the_stated_amounts():
    """Clean first; the noise rows add noise of the stated std (clamped to [-1, 1]), the high-passed rows less; the
    blur leaves a flat image alone."""
    x = torch.zeros(64, 1, 16, 16)
    rows = dict(load("fid_sanity").perturbations(x))
    assert next(iter(rows)) == "clean" and rows["clean"] is x
    assert rows["+ noise, std 0.05"].std().item() == pytest.approx(0.05, rel=0.05)
    hp = rows["+ high-passed noise, std 0.05"].std().item()
    assert 0.02 < hp < 0.05  # the high-pass keeps most of white noise's power, not all of it
    torch.testing.assert_close(rows["3 x 3 binomial blur"], x)


def test_fid_sanity_faint_perturbations_raise_only_black_pixels_to_faint_levels():
    """Speckle at rate p raises about p of the black pixels to levels 5-15; the halo raises exactly the black pixels
    next to a stroke; nothing else moves."""
    from flm.metrics.images import to_levels
    from flm.metrics.pixels import faint_share_per_image

    x = torch.full((64, 1, 16, 16), -1.0)
    x[:, :, 6:10, 6:10] = 1.0  # a 4 x 4 stroke
    rows = dict(load("fid_sanity").faint_perturbations(x))
    assert next(iter(rows)) == "clean" and rows["clean"] is x
    black = to_levels(x) == 0
    for name, y in rows.items():
        levels = to_levels(y)
        assert torch.equal(levels[~black], to_levels(x)[~black]), name  # strokes untouched
        assert ((levels[black] == 0) | ((levels[black] >= 5) & (levels[black] <= 15))).all(), name
    speckled = faint_share_per_image(rows["faint speckle, 10 % of the black pixels"]).mean().item()
    assert speckled == pytest.approx(0.1 * black.float().mean().item(), rel=0.1)
    halo = faint_share_per_image(rows["faint halo, every black pixel next to a stroke"])
    assert torch.equal(halo, torch.full((64,), (36 - 16) / 256))  # the 6 x 6 ring around the 4 x 4 stroke


def test_quality_steady_step_ms_is_the_median_after_the_first_window(tmp_path):
    """The first window (compilation, capture) and a short slow last window do not set a run's step time."""
    ms = [108.0, 55.2, 55.0, 55.6, 58.6]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": 50 * (i + 1), "step_ms": m}) + "\n" for i, m in enumerate(ms))
    )
    assert load("quality").steady_step_ms(str(tmp_path)) == pytest.approx((55.2 + 55.6) / 2)


def test_quality_gpu_seconds_charge_each_window_at_its_own_step_time(tmp_path):
    """A run whose steps change cost (a curriculum's cheap steps, then JVP steps) is charged window by window; the first
    window (compilation, capture) at the median of the others."""
    rows = [(50, 300.0), (100, 40.0), (150, 40.0), (200, 40.0), (250, 70.0), (300, 70.0), (310, 75.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "step_ms": m}) + "\n" for k, m in rows))
    median = 55.0  # of 40, 40, 40, 70, 70, 75
    expected = 50 * median + 150 * 40.0 + 100 * 70.0 + 10 * 75.0
    assert load("quality").steady_gpu_seconds(str(tmp_path)) == pytest.approx(expected / 1000)


def test_quality_budgets_a_curriculums_cheap_steps_apart():
    """A time budget buys steps at the probed ms/step; with MeanFlow's consistency curriculum (or a DMD start) its first
    `end` steps at their own cost and the rest at the later kind's, read from the run's composed config: an override's
    objective.alpha_steps (objective.dmd_start) or the preset's own (mnist_rcm and mnist_rcm_gan start DMD at 400)."""
    quality = load("quality")
    change = quality.cost_change
    assert change("meanflow", ["model=DiT-S/4", "objective.alpha_steps=[700,2000]"]) == (2000, "objective.alpha_steps", "null")
    assert change("rcm", ["objective.teacher=x", "objective.dmd_start=600"]) == (600, "objective.dmd_start", "0")
    assert change("rcm", ["objective.teacher=x"]) == (400, "objective.dmd_start", "0")
    assert change("rcm_gan", []) == (400, "objective.dmd_start", "0")
    assert change("meanflow", ["objective.alpha_steps=null"]) is None and change("flow_matching", []) is None
    assert change("rcm", ["objective.dmd_start=0"]) is None and change("scd", []) is None
    assert quality.steps_for_budget(194, 70.0) == 2770  # 194 s / 70 ms
    assert quality.steps_for_budget(194, 50.0, end=2000, ms_after=70.0) == 2000 + 1340  # 100 s, then 94 s / 70 ms
    assert quality.steps_for_budget(50, 50.0, end=2000, ms_after=70.0) == 1000  # the budget ends inside the curriculum


@pytest.mark.gpu
def test_flow_map_error_samples_a_renoising_objective_on_cuda():
    # sCM's 2-step sampler re-noises from one CPU generator per image; CUDA ones failed on the H200
    from flm.models.dit import DiT
    from flm.objectives import build_objective

    flow_map_error = load("flow_map_error")
    model = DiT(input_size=8, in_channels=1, patch_size=2, hidden_size=64, depth=1, num_heads=2, num_classes=10).cuda()
    objective = build_objective("scm").cuda()
    noise, y = torch.randn(6, 1, 8, 8, device="cuda"), torch.arange(6, device="cuda")
    two = flow_map_error.sample(model, objective, noise, y, steps=2, batch_size=6)
    split = flow_map_error.sample(model, objective, noise, y, steps=2, batch_size=4)
    assert two.shape == noise.shape and two.device.type == "cuda"
    torch.testing.assert_close(two, split, atol=1e-4, rtol=1e-4)  # image k's re-noising depends on its own generator only


def test_faint_pixels_reads_grids_and_ranks_runs_against_their_fid(tmp_path, capsys):
    from flm.train.sampling import save_grid

    faint = load("faint_pixels")
    gen = torch.Generator().manual_seed(0)
    base = torch.full((20, 1, 28, 28), -1.0)
    base[:, :, 10:18, 10:18] = 1.0  # a white square on black: no faint pixels
    shares = {}
    for i, (name, std) in enumerate([("a", 0.0), ("b", 0.03), ("c", 0.06)]):
        images = (base + std * torch.randn(base.shape, generator=gen)).clamp(-1, 1)
        save_grid(images, str(tmp_path / f"{name}-ema0.99-eval-steps1.png"), nrow=10)
        (tmp_path / f"{name}-ema0.99-eval.json").write_text(json.dumps({"results": {"fid_steps1": 10.0 * (i + 1)}}))
        shares[name] = faint.faint_share(images)
    assert faint.grid_images(str(tmp_path / "c-ema0.99-eval-steps1.png")).shape == (20, 28, 28, 1)
    table = faint.rows([str(tmp_path)])
    assert [(r["name"], r["steps"], r["fid"]) for r in table] == [("a", 1, 10.0), ("b", 1, 20.0), ("c", 1, 30.0)]
    assert [r["faint"] for r in table] == pytest.approx([shares[n] for n in "abc"])  # the PNG holds the 8-bit samples
    assert shares["a"] == 0 < shares["b"] < shares["c"]
    assert faint.correlations([1, 2, 3, 4], [10, 30, 20, 40])[1] == pytest.approx(0.8)  # Spearman of ranks
    from PIL import Image

    Image.new("L", (50, 50)).save(tmp_path / "d-x-steps1.png")
    with pytest.raises(ValueError, match="not a grid of 28 x 28 images"):
        faint.grid_images(str(tmp_path / "d-x-steps1.png"))


def test_scm_bf16_gap_takes_the_tangent_of_the_loss_and_bins_by_time():
    """At the exact consistency function of a point mass g vanishes in both precisions (the JVP is wired as in the
    loss); away from it g is the sum of its two parts, and each sample lands in the bin of its t."""
    from flm.objectives import SCM
    from tests.objectives.toys import PointMassTrigFlow

    gap = load("scm_bf16_gap")
    x, cpu = torch.full((64, 1, 2, 2), 0.7), torch.device("cpu")
    found = gap.tangents(SCM(), PointMassTrigFlow(0.7), x, None, seed=0, device=cpu)
    assert found["fp32"][0].abs().max() < 1e-4 and found["bf16"][0].abs().max() < 1e-4
    found = gap.tangents(SCM(), PointMassTrigFlow(0.7, offset=0.3), x, None, seed=0, device=cpu)
    assert found["fp32"][0].abs().max() > 1e-2
    lines = gap.table(found, edges=(0.0, 0.8, 1.58))
    counts = [int(line.split("|")[2]) for line in lines[2:]]
    assert counts == [int((found["t"] < 0.8).sum()), int((found["t"] >= 0.8).sum())]


def test_scm_bf16_gap_takes_a_distilled_students_dx_dt_from_its_teacher():
    """For sCD the tangent's dx_t/dt is the teacher's: a teacher whose flow is the data's (the point mass itself) gives
    the data's tangent, one of another point mass another."""
    from flm.objectives import SCD
    from tests.objectives.toys import PointMassTrigFlow, PointMassVelocity

    gap = load("scm_bf16_gap")
    x, cpu, student = torch.full((64, 1, 2, 2), 0.7), torch.device("cpu"), PointMassTrigFlow(0.7, offset=0.3)
    plain = gap.tangents(SCD(teacher="unused"), student, x, None, seed=0, device=cpu)
    same = gap.tangents(SCD(teacher="unused"), student, x, None, seed=0, device=cpu, teacher=PointMassVelocity(0.7))
    other = gap.tangents(SCD(teacher="unused"), student, x, None, seed=0, device=cpu, teacher=PointMassVelocity(-0.5))
    torch.testing.assert_close(same["fp32"][1], plain["fp32"][1], rtol=2e-2, atol=2e-2)  # the teacher runs in bf16
    assert (other["fp32"][1] - plain["fp32"][1]).abs().max() > 0.1


def _run(folder, values, step0=1, metric="mse"):
    folder.mkdir()
    lines = [json.dumps({"step": step0 + i, "loss": 1.0, metric: v, "step_ms": 5.0}) for i, v in enumerate(values)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


def test_compare_runs_agrees_within_noise_and_flags_drift(tmp_path, capsys):
    compare_runs = load("compare_runs")
    g = torch.Generator().manual_seed(0)
    base = [1.0 / (1 + 0.1 * i) for i in range(40)]
    noisy = [v * (1 + 0.01 * float(torch.randn((), generator=g))) for v in base]
    ref, close = _run(tmp_path / "ref", base), _run(tmp_path / "close", noisy)
    assert compare_runs.main([close, ref]) == 0
    out = capsys.readouterr().out
    assert "mse of" in out and "40 common logged steps (1..40)" in out and "| agree |" in out
    far = _run(tmp_path / "far", [v * 1.5 for v in base])
    assert compare_runs.main([far, ref]) == 1
    assert "| DRIFT |" in capsys.readouterr().out
    assert compare_runs.main([far, ref, "--metric", "loss"]) == 0  # both logged loss 1.0 at every step
    shifted = _run(tmp_path / "shifted", base, step0=1000)
    with pytest.raises(SystemExit, match="no common step"):
        compare_runs.main([shifted, ref])
    with pytest.raises(SystemExit, match="no metrics.jsonl in"):
        compare_runs.main([str(tmp_path / "missing"), ref])
    with pytest.raises(SystemExit, match="logged no 'fid'"):
        compare_runs.main([close, ref, "--metric", "fid"])


def test_read_metrics_drops_a_last_line_cut_off_and_refuses_a_damaged_one(tmp_path):
    from flm.log import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="a line is not JSON"):
        read_metrics(str(tmp_path))


def test_velocity_variance_measures_both_estimates_against_the_exact_marginal_velocity(capsys):
    """On the shipped MNIST digits: eps - x0 is v* itself near the data, and near noise the batch's estimate is far
    closer to v* than eps - x0, and more references closer still."""
    load("velocity_variance").main(
        ["--dataset", "mnist_shipped", "--batch", "64", "--batches", "1", "--times", "0.2,0.95", "--references", "512"]
    )
    rows = {
        r[1].strip(): [float(c) for c in r[2:-1] if c.strip()]
        for r in (line.split("|") for line in capsys.readouterr().out.splitlines())
        if len(r) > 2 and r[1].strip().replace(".", "").isdigit()
    }
    cond, est, ratio, ess, banked, banked_ratio = rows["0.95"]
    assert cond > 0.1 and ratio < 0.5 and ess > 2 and banked_ratio < ratio
    cond, est, *_ = rows["0.2"]
    assert cond < 1e-6 and est < 1e-6


def test_fid_curve_tables_each_run_and_sampler_and_refuses_a_run_without_evaluations(tmp_path):
    fid_curve = load("fid_curve")
    for run, evals in {"a": {1000: 40.0, 2000: 20.0}, "b": {2000: 30.0}, "none": {}}.items():
        (tmp_path / run).mkdir()
        rows = [{"step": s, "loss": 1.0} for s in (500, 1000, 1500, 2000)]
        rows += [{"step": s, "fid_steps1": v, "fid_steps2": v / 2} for s, v in evals.items()]
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = {**fid_curve.series(str(tmp_path / "a"), "fid"), **fid_curve.series(str(tmp_path / "b"), "fid")}
    assert list(curves) == ["a 1 step", "a 2 steps", "b 1 step", "b 2 steps"]
    assert fid_curve.table(curves, "fid").splitlines()[2:] == ["| 1000 | 40 | 20 | - | - |", "| 2000 | 20 | 10 | 30 | 15 |"]
    with pytest.raises(SystemExit, match="logged no fid_steps<k>: train it with trainer.eval_every"):
        fid_curve.main([str(tmp_path / "a"), str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        fid_curve.main([str(tmp_path / "missing")])


def test_training_seconds_charge_compilation_and_evaluation_windows_at_the_median():
    """The first window (compilation) and a window that holds an in-loop evaluation (its step_ms counts the sampling)
    are charged at the median of the other windows; the rest at their own ms/step."""
    from flm.log import training_seconds

    windows = [(100, 900.0), (200, 50.0), (300, 70.0), (400, 400.0), (500, 60.0)]
    records = [{"step": k, "step_ms": m} for k, m in windows] + [{"step": 350, "fid_steps1": 9.0}]
    median = 60.0  # of 50, 70, 60: the windows (100, 200], (200, 300], (400, 500]
    expected = [100 * median, 100 * 50.0, 100 * 70.0, 100 * median, 100 * 60.0]
    got = training_seconds(records)
    assert [k for k, _ in got] == [100, 200, 300, 400, 500]
    assert [sec for _, sec in got] == pytest.approx([sum(expected[: i + 1]) / 1000 for i in range(5)])
    # an evaluation at a logged step runs after it: in the next window
    records[-1] = {"step": 300, "fid_steps1": 9.0}
    assert training_seconds(records)[-1][1] == pytest.approx((100 * 60 + 100 * 50 + 100 * 70 + 100 * 60 + 100 * 60) / 1000)
    with pytest.raises(ValueError, match="needs two"):
        training_seconds(records[:1])


def test_fid_curve_puts_each_point_at_its_runs_seconds_of_training(tmp_path):
    """--x gpu_s: a run of slow steps and one of fast steps, compared at equal time; linear within a window."""
    fid_curve = load("fid_curve")
    for run, ms in {"slow": 80.0, "fast": 20.0}.items():
        (tmp_path / run).mkdir()
        rows = [{"step": s, "step_ms": ms} for s in (100, 200, 300, 400)] + [{"step": 150, "fid_steps1": ms / 10}]
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    at = fid_curve.seconds_at(str(tmp_path / "slow"))
    assert at(150) == pytest.approx(12.0) and at(400) == pytest.approx(32.0)  # every window at 80 ms
    assert fid_curve.main([str(tmp_path / "slow"), str(tmp_path / "fast"), "--x", "gpu_s", "--out", str(tmp_path / "o")]) == 0
    report = (tmp_path / "o" / "fid_curve.md").read_text().splitlines()
    assert report[-2:] == ["| 3 | fast 1 step | 150 | 2 |", "| 12 | slow 1 step | 150 | 8 |"]
    assert "--x gpu_s" in report[0]


def test_parallel_runs_need_step_counts_and_no_teacher_of_the_same_call():
    quality = load("quality")
    fixed = ["fm:flow_matching:3500", "mf:meanflow:2710:objective.alpha_steps=[0,1355]"]
    quality.check_parallel(fixed, 2, "/w")
    quality.check_parallel(["mf:meanflow:194s", "fm:flow_matching:auto"], 1, "/w")  # one at a time: anything goes
    quality.check_parallel(["s:scd:1040:objective.teacher=/elsewhere/fm", *fixed], 3, "/w")  # a teacher trained before
    with pytest.raises(SystemExit, match="run mf has '194s'"):
        quality.check_parallel(["fm:flow_matching:3500", "mf:meanflow:194s"], 2, "/w")
    with pytest.raises(SystemExit, match="run fm has 'auto'"):
        quality.check_parallel(["fm:flow_matching:auto"], 2, "/w")
    with pytest.raises(SystemExit, match="run s's teacher /w/fm/ is trained in the same call"):
        quality.check_parallel(["fm:flow_matching:3500", "s:scd:1040:objective.teacher=/w/fm/"], 2, "/w")
    with pytest.raises(SystemExit, match="run s's teacher /w/fm is trained in the same call"):  # RUNS/ is /w
        quality.check_parallel(["fm:flow_matching:3500", "s:scd:1040:objective.teacher=RUNS/fm"], 2, "/w")
    with pytest.raises(SystemExit, match="--parallel 0"):
        quality.check_parallel(fixed, 0, "/w")


def test_parallel_runs_train_side_by_side_and_are_marked_in_the_table(tmp_path, monkeypatch):
    import threading

    quality = load("quality")
    together = threading.Barrier(2, timeout=30)  # breaks (and the test fails) unless two runs are in flight at once

    def run_objective(spec, args, group=None):
        name, objective, steps = spec.split(":")[:3]
        together.wait()
        fids = {1: 5.0, 2: 4.0} if objective == "meanflow" else {50: 3.0, 2: 9.0}
        return {
            **entry(name, objective, fids),
            "train_steps": int(steps),
            "parallel": args.parallel,
            "device": "CPU",
            "torch": "-",
            "triton": "-",
            "command": "-",
        }

    monkeypatch.setattr(quality, "run_objective", run_objective)
    argv = ["quality.py", "--data-root", "d", "--inception", "i", "--out", str(tmp_path), "--parallel", "2"]
    monkeypatch.setattr("sys.argv", [*argv, "--runs", "a:meanflow:100", "b:flow_matching:200"])
    quality.main()
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert sorted(saved) == ["a", "b"] and saved["a"]["train_steps"] == 100
    rows = [line for line in (tmp_path / "quality.md").read_text().splitlines() if line.startswith("| a ")]
    assert rows and all("| 1.0 (2 at once) | 0 (2 at once) |" in row for row in rows)


def test_ot_pairing_assignment_is_the_best_permutation_and_shortens_the_segments(capsys):
    """The assignment's cost against every permutation of a small matrix; on the shipped digits the OT pairing over the
    batch is shorter than within each class (a constrained assignment), which is shorter than the independent one."""
    import itertools

    import numpy as np

    ot = load("ot_pairing")
    cost = np.random.default_rng(0).random((5, 5))
    best = min(sum(cost[i, j] for i, j in enumerate(perm)) for perm in itertools.permutations(range(5)))
    assert ot.assigned_cost(cost) == pytest.approx(best)
    ot.main(["--dataset", "mnist_shipped", "--batches", "64", "--repeats", "1"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |"))
    independent, batch_ot, _, class_ot, _ = [float(c.strip().rstrip("%")) for c in row.split("|")[2:-1]]
    assert batch_ot < class_ot < independent


def test_profile_sorts_kernels_by_what_they_do():
    """--profile's summary: kernel names as an H100 profile of a DiT step prints them, each under its kind, per step."""
    train_step = load("train_step")
    names = {
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3": "attention",
        "_fwd_kernel": "attention",
        "triton_poi_fused_gelu_gelu_backward_view_10": "fused by inductor",
        "void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, ...)": "norm",
        "_ln_bwd": "norm",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda": (
            "copy and cast"
        ),
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t<float": "reduction",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl": "elementwise",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memset (Device)": "other",
    }
    assert {name: train_step.kernel_kind(name) for name in names} == names
    table = train_step.kernel_summary([("nvjet_a", 3000.0, 4), ("nvjet_b", 1000.0, 2), ("_fwd_kernel", 4000.0, 2)], steps=2)
    lines = table.splitlines()
    assert lines[2].startswith("| matmul | 2.00 | 50% | 3 | `nvjet_a` |")  # 4000 us over 2 steps, the larger kernel
    assert lines[3].startswith("| attention | 2.00 | 50% | 1 |")


def test_disc_probe_separates_what_differs_and_not_what_does_not():
    """disc_probe.py's linear probe: held-out accuracy near 1 for two distinct clouds, near chance for one cloud split
    in two at random."""
    probe = load("disc_probe").linear_probe
    g = torch.Generator().manual_seed(0)
    n = 400
    labels = torch.cat([torch.ones(n), torch.zeros(n)])
    order = torch.randperm(2 * n, generator=g)
    train, test = order[:560], order[560:]
    apart = torch.randn(2 * n, 8, generator=g) + 2.0 * labels[:, None]
    same = torch.randn(2 * n, 8, generator=g)
    assert probe(apart, labels, train, test) > 0.95
    assert 0.35 < probe(same, labels, train, test) < 0.65


def test_adaln_benchmark_runs_every_pass_both_ways(monkeypatch):
    """benchmarks/adaln.py's passes, on the kernels (Triton's CPU interpreter) and on PyTorch's ops, give the same
    outputs (fp16 in place of bf16, which the interpreter does not run)."""
    bench = load("adaln")
    from flm.kernels import adaln

    passes = bench.passes(2, 5, 24, device="cpu", low=torch.float16)
    assert set(passes) == {"modulate fwd", "modulate fwd + bwd", "modulate jvp", "gated residual fwd + bwd", "gated residual jvp"}
    for name, (fn, nbytes) in passes.items():
        monkeypatch.setattr(adaln, "FORCE", False)
        plain = fn()
        monkeypatch.setattr(adaln, "FORCE", True)
        fused = fn()
        plain, fused = (torch.cat([t.float().flatten() for t in (r if isinstance(r, tuple) else (r,))]) for r in (plain, fused))
        torch.testing.assert_close(fused, plain, atol=2e-2, rtol=2e-2, msg=name)
        assert nbytes > 0

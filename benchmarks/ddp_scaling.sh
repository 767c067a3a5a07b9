#!/usr/bin/env bash
# Data-parallel scaling of MeanFlow training on one machine, 1 GPU against NPROC GPUs at the same global batch:
#   (a) images/s, DiT-B/2 at 256 tokens: MNIST resized to 32 x 32 (data.resolution, as `python -m flm.ablate
#       ablate.tokens=256` does; flm has no synthetic dataset), DDP, WARMUP steps left out;
#   (b) loss curves on MNIST (28 x 28), DDP against 1 GPU with NPROC accumulation steps (the same micro-batches
#       and noise, so the curves differ by rounding only);
#   (c) FSDP2 on NPROC GPUs: FSDP_STEPS steps and a checkpoint, RESUME_STEPS more from it on NPROC GPUs, and the
#       same RESUME_STEPS from it on 1 GPU (NPROC accumulation steps).
# Then it prints a Markdown table (also written to OUT/table.md). About 6 minutes on 2 H200s.
#
#   PYTHONPATH=<folder with hydra> bash benchmarks/ddp_scaling.sh OUT
#   DEVICE=cpu MODEL=DiT-T/2 BATCH=8 WARMUP=2 SPEED_STEPS=4 CURVE_STEPS=4 FSDP_STEPS=4 RESUME_STEPS=2 \
#       bash benchmarks/ddp_scaling.sh /tmp/scaling          # the same steps on the CPU (gloo), in a minute
#
# Every run's folder (metrics.jsonl, train.log, samples/) and console log (<run>.log) go under OUT; the
# checkpoints of (a) and (b) are deleted after their run (DiT-B/2 with Adam and EMA: about 2 GB each).
set -euo pipefail

OUT=${1:?usage: bash benchmarks/ddp_scaling.sh OUT}
NPROC=${NPROC:-2}
DEVICE=${DEVICE:-cuda}                 # cuda (NCCL) | cpu (gloo)
MODEL=${MODEL:-DiT-B/2}
BATCH=${BATCH:-256}                    # global batch of every run
TOKENS=${TOKENS:-256}                  # (a): images resized to side = patch x sqrt(TOKENS)
ATTENTION=${ATTENTION:-auto}           # auto: triton_jvp for the JVP pass on the GPU
CUDA_GRAPH=${CUDA_GRAPH:-false}        # trainer.cuda_graph: false, every run eager, so that (c)'s FSDP2 (never graphed)
                                       # compares with (a) and (b); auto graphs the 1-GPU and DDP runs
WARMUP=${WARMUP:-20}                   # (a), (c): steps left out of images/s (Triton autotuning, allocator)
SPEED_STEPS=${SPEED_STEPS:-100}        # (a): steps timed after the warm-up (a multiple of WARMUP)
CURVE_STEPS=${CURVE_STEPS:-200}        # (b)
FSDP_STEPS=${FSDP_STEPS:-50}           # (c): steps before the checkpoint
RESUME_STEPS=${RESUME_STEPS:-20}       # (c): steps after it
DATA_ROOT=${DATA_ROOT:-data}           # MNIST in torchvision's layout: DATA_ROOT/MNIST/raw
PYTHON=${PYTHON:-python3}

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HYDRA_FULL_ERROR=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$DEVICE" = cpu ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
if (( SPEED_STEPS % WARMUP )); then echo "SPEED_STEPS=$SPEED_STEPS must be a multiple of WARMUP=$WARMUP" >&2; exit 2; fi
if (( BATCH % NPROC )); then echo "BATCH=$BATCH must be a multiple of NPROC=$NPROC" >&2; exit 2; fi
SIDE=$("$PYTHON" -c "import math; print(int('$MODEL'.rsplit('/', 1)[1]) * math.isqrt($TOKENS))")

COMMON=(model="$MODEL" attention="$ATTENTION" objective=meanflow data=mnist data.root="$DATA_ROOT" data.download=false
        trainer.device="$DEVICE" trainer.batch_size="$BATCH" trainer.sample_n=16 trainer.sample_every=0
        trainer.ckpt_every=0 trainer.cuda_graph="$CUDA_GRAPH")
RESIZED=(+data.resolution="$SIDE")

# train NAME RUN NPROCS OVERRIDES...: train.py into OUT/RUN (console to OUT/NAME.log), in one process or
# under torchrun with NPROCS processes
train() {
    local name=$1 run=$2 nproc=$3; shift 3
    local log=$OUT/$name.log launch=("$PYTHON")
    if (( nproc > 1 )); then launch=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc"); fi
    echo "== $name: $nproc process(es), $(date +%T)"
    if ! "${launch[@]}" train.py "${COMMON[@]}" run_dir="$OUT/$run" "$@" >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "run $name failed; its log: $log" >&2
        exit 1
    fi
}

SECONDS=0
# (a) throughput at TOKENS tokens, DDP
SPEED=(trainer.max_steps=$((WARMUP + SPEED_STEPS)) trainer.log_every="$WARMUP" "${RESIZED[@]}")
train speed-1 speed-1 1 "${SPEED[@]}"
train speed-$NPROC speed-$NPROC "$NPROC" "${SPEED[@]}"
# (b) loss curves, DDP against 1 GPU with the same micro-batches
CURVE=(trainer.max_steps="$CURVE_STEPS" trainer.log_every=1)
train curve-1 curve-1 1 "${CURVE[@]}" trainer.grad_accum="$NPROC"
train curve-$NPROC curve-$NPROC "$NPROC" "${CURVE[@]}"
rm -rf "$OUT"/speed-*/checkpoints "$OUT"/curve-*/checkpoints
# (c) FSDP2: save, resume on NPROC GPUs (same folder), resume the same checkpoint on 1 GPU
FSDP=(trainer.parallel=fsdp trainer.log_every=1 trainer.keep_last=0)
END=$((FSDP_STEPS + RESUME_STEPS))
SAVED="$OUT/fsdp-$NPROC/checkpoints/ckpt-$(printf %08d "$FSDP_STEPS").pt"
train fsdp-$NPROC fsdp-$NPROC "$NPROC" "${FSDP[@]}" trainer.max_steps="$FSDP_STEPS"
train fsdp-$NPROC-resumed fsdp-$NPROC "$NPROC" "${FSDP[@]}" trainer.max_steps="$END" trainer.resume=auto
train fsdp-resumed-on-1 fsdp-resumed-on-1 1 "${FSDP[@]}" trainer.max_steps="$END" trainer.resume="$SAVED" \
    trainer.grad_accum="$NPROC"
echo "== runs done in ${SECONDS}s"

"$PYTHON" - "$OUT" "$NPROC" "$MODEL" "$BATCH" "$TOKENS" "$SIDE" "$WARMUP" "$FSDP_STEPS" "$END" "$DEVICE" <<'EOF'
"""Reads the runs' metrics.jsonl (and the two final FSDP2-resume checkpoints) and prints the table."""
import json
import os
import sys

import torch

out, nproc, model, batch, tokens, side, warmup, fsdp_steps, end, device = sys.argv[1:]
nproc, batch, warmup, fsdp_steps, end = int(nproc), int(batch), int(warmup), int(fsdp_steps), int(end)


def records(run):
    """Logged steps of a run, in order; a resumed run's file has both parts (the last record of a step wins)."""
    by_step = {}
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def images_per_s(run, after, upto=None):
    """batch x steps / seconds over the logged windows after step `after` (each window: step_ms x its steps)."""
    prev, steps, seconds = 0, 0, 0.0
    for r in records(run):
        if r["step"] > after and (upto is None or r["step"] <= upto):
            n = r["step"] - prev
            steps, seconds = steps + n, seconds + r["step_ms"] * n / 1000
        prev = r["step"]
    return batch * steps / seconds


def curve(run, key="loss", first=1):
    return {r["step"]: float(r[key]) for r in records(run) if r["step"] >= first}


def max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) for s in a)


def mean(c):
    return sum(c.values()) / len(c)


def weights(run):
    path = os.path.join(out, run, "checkpoints", f"ckpt-{end:08d}.pt")
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


g = f"{nproc} GPUs" if device == "cuda" else f"{nproc} processes"
one = "1 GPU" if device == "cuda" else "1 process"
speed1, speedn = images_per_s("speed-1", warmup), images_per_s(f"speed-{nproc}", warmup)
rows = [
    f"## Data parallelism: {model}, MeanFlow, global batch {batch}, device {device}",
    "",
    f"| | {one} | {g} | {g} / {one} |",
    "|---|---|---|---|",
    f"| (a) images/s, {tokens} tokens (MNIST at {side}x{side}), DDP, after {warmup} warm-up steps "
    f"| {speed1:.0f} | {speedn:.0f} | {speedn / speed1:.2f} |",
    "",
    f"| (b) MNIST 28x28, DDP, {len(curve('curve-1'))} steps | {one}, {nproc} accum. steps | {g} | max abs diff over the steps |",
    "|---|---|---|---|",
]
for key in ("loss", "mse"):
    c1, cn = curve("curve-1", key), curve(f"curve-{nproc}", key)
    last = max(c1)
    rows.append(f"| final {key} (step {last}) | {c1[last]:.6f} | {cn[last]:.6f} | {max_diff(c1, cn):.2e} |")
    rows.append(f"| mean {key} | {mean(c1):.6f} | {mean(cn):.6f} | |")
fsdp, moved = f"fsdp-{nproc}", "fsdp-resumed-on-1"
w_fsdp, w_one = weights(fsdp), weights(moved)
w_diff = max((w_fsdp[k].float() - w_one[k].float()).abs().max().item() for k in w_fsdp)
w_scale = max(w_fsdp[k].float().abs().max().item() for k in w_fsdp)
rows += [
    "",
    f"| (c) FSDP2, MNIST 28x28: {fsdp_steps} steps on {g}, a checkpoint, then steps {fsdp_steps + 1}-{end} "
    f"| resumed on {g} (FSDP2) | resumed on {one}, {nproc} accum. steps | max abs diff |",
    "|---|---|---|---|",
]
for key in ("loss", "mse"):
    cf, co = curve(fsdp, key, fsdp_steps + 1), curve(moved, key, fsdp_steps + 1)
    rows.append(f"| {key} at step {end} | {cf[end]:.6f} | {co[end]:.6f} | {max_diff(cf, co):.2e} over the steps |")
rows += [
    f"| mse at step {fsdp_steps} (before the checkpoint) | {curve(fsdp, 'mse')[fsdp_steps]:.6f} | | |",
    f"| weights at step {end} | | | {w_diff:.2e} (largest weight {w_scale:.2f}) |",
    f"| images/s, steps {warmup + 1}-{fsdp_steps} of the first part | {images_per_s(fsdp, warmup, fsdp_steps):.0f} | | |",
    "",
    "loss: MeanFlow's adaptive-weighted loss, near 1 by design; mse: the plain squared error, the informative curve.",
    "Both are logged per step as means over all ranks and micro-batches.",
    f"Folders and logs: {out}",
]
table = "\n".join(rows)
print(table)
with open(os.path.join(out, "table.md"), "w") as f:
    f.write(table + "\n")
EOF

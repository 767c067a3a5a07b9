# The next device calls (docs/quality.md, "Next on the H200", item f), after tools/gpu/pack.sh:
#   LIMIT=SECONDS [SEEDS="0 1"] bash tools/gpu/next.sh   (carry [".gpu"]; LIMIT: the call's own limit, which decides what fits)
# Issue 14's protocol on an H200 with attention=auto students (train.py's default; 1.48x / 1.16x over four seeds on an
# H100, sixtieth day): the attention=auto teacher unless this warm machine already holds it, then the students of SEEDS
# while time is left, each alone on the GPU. One student fits from 450 s with the teacher (the teacher took 283 s of an
# H200 call, sixty-first day), two in 470 s without: chain `LIMIT=470 SEEDS="1 2" bash tools/gpu/next.sh` at once on the
# same machine (its idle release is 30 s). Seeds after the first skip their probes (below), ~58 s each.
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
snap() { tar -cf $OUT/qsnap.tar runs/qout $(ls -d runs/q/*/*.log runs/q/*/*.jsonl 2>/dev/null) 2>/dev/null; }
if [ ! -f runs/q/fmqa2/checkpoints/ckpt-00005180.pt ]; then
  q fmqa2 --attention auto --runs "fmqa2:flow_matching:5180:trainer.ckpt_every=4300,trainer.keep_last=0"; snap
fi
# a student's budget: a quarter of this teacher's GPU seconds on this GPU (215 s on an H100, 192 on an H200)
quarter=$(python -c "from benchmarks.quality import teacher_seconds as t; print(round(t(['objective.teacher=runs/q/fmqa2']) / 4))")
# the first student's two probes (~58 s of an H200 call, sixty-first day) set its step count; the later seeds on this
# machine train that many steps without probing: the same steps of the same config cost the same time, and the report
# gives each run's GPU seconds as measured
steps_of_first() { python -c "import json; r = json.load(open('runs/qout/quality.json'))
print(next((str(e['train_steps']) for n, e in sorted(r.items()) if n.startswith('rcmgqaa')), '${quarter}s'))" 2>/dev/null \
  || echo "${quarter}s"; }
for seed in ${SEEDS:-0 1}; do
  [ $(rest) -gt 200 ] || break
  steps=$(steps_of_first); echo "rcmgqaa$seed: $steps (a quarter of the teacher: ${quarter} s)"
  q rcmgqaa$seed --attention auto --weights ema0.99 ema0.995 \
    --runs "rcmgqaa$seed:rcm_gan:$steps:objective.teacher=RUNS/fmqa2,trainer.seed=$seed,trainer.ema_decays=[0.99,0.995]"; snap
done
pack; rm -f $OUT/qsnap.tar; echo "end $(left)"

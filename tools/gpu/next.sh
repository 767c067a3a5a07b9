# The next device call (docs/quality.md, "Next on the H200", item b), after tools/gpu/pack.sh:
#   LIMIT=SECONDS bash tools/gpu/next.sh   (carry [".gpu"]; LIMIT: the call's own limit, which decides what fits)
# The attention=auto teacher, then issue 14's seeds 3 and 0 from it while time is left, each alone on the GPU (the gpu
# tests it ran beside them until the fifty-sixth day all passed then, and cost that day's student 10-20 % of its steps).
# One student fits from 450 s. tools/gpu/tuner.sh (no carry) is item a.
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
snap() { tar -cf $OUT/qsnap.tar runs/qout $(ls -d runs/q/*/*.log runs/q/*/*.jsonl 2>/dev/null) 2>/dev/null; }
q fmqa2 --attention auto --runs "fmqa2:flow_matching:5180:trainer.ckpt_every=4300,trainer.keep_last=0"; snap
for seed in 3 0; do
  [ $(rest) -gt 140 ] || break
  q rcmgqats$seed --weights ema0.99 ema0.995 \
    --runs "rcmgqats$seed:rcm_gan:54s:objective.teacher=RUNS/fmqa2,trainer.seed=$seed,trainer.ema_decays=[0.99,0.995]"; snap
done
pack; rm -f $OUT/qsnap.tar; echo "end $(left)"

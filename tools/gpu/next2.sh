# The call after tools/gpu/next.sh on the same warm machine (its teacher runs/q/fmqa2 kept):
#   LIMIT=SECONDS bash tools/gpu/next2.sh   (carry [".gpu"])
# Issue 14's attention=auto students on seeds 2 and 3 (two fit in 470 s), each alone on the GPU.
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
snap() { tar -cf $OUT/qsnap.tar runs/qout $(ls -d runs/q/*/*.log runs/q/*/*.jsonl 2>/dev/null) 2>/dev/null; }
if [ -d runs/q/fmqa2 ]; then
  for seed in 2 3; do
    [ $(rest) -gt 200 ] || break
    q rcmgqaa$seed --attention auto --weights ema0.99 ema0.995 \
      --runs "rcmgqaa$seed:rcm_gan:54s:objective.teacher=RUNS/fmqa2,trainer.seed=$seed,trainer.ema_decays=[0.99,0.995]"; snap
  done
else
  echo "no teacher runs/q/fmqa2 on this machine: run next.sh first"
fi
pack; rm -f $OUT/qsnap.tar; echo "end $(left)"

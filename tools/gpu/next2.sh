# The call after tools/gpu/next.sh on the same warm machine (its teacher runs/q/fmqa2 kept):
#   LIMIT=SECONDS bash tools/gpu/next2.sh   (carry [".gpu"])
# The gpu tests outside the three attention files next.sh runs (and the cuDNN ones run on the fifty-fifth day), beside issue 14's students with attention=auto (the
# student's plain calls through SDPA, its dO now handed over in q's order by flm's sdpa backend) on seeds 0 and 2.
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
(
  timeout $(( $(rest) - 40 )) python -m pytest -q -m gpu tests --ignore=tests/attention/test_cudnn_backward_gpu.py \
    --ignore=tests/attention/test_triton_jvp_gpu.py --ignore=tests/attention/test_tma_gpu.py --tb=short > $OUT/q/gpu_rest.log 2>&1
  echo "rest gpu rc=$? $(left)" >> $OUT/q/gpu_rest.log
) &
if [ -d runs/q/fmqa2 ]; then
  for seed in 0 2; do
    [ $(rest) -gt 150 ] || break
    q rcmgqas$seed --attention auto --weights ema0.99 ema0.995 \
      --runs "rcmgqas$seed:rcm_gan:54s:objective.teacher=RUNS/fmqa2,trainer.seed=$seed,trainer.ema_decays=[0.99,0.995]"
  done
else
  echo "no teacher runs/q/fmqa2 on this machine: run next.sh first"
fi
wait; echo "tests done $(left)"; tail -n 15 $OUT/q/gpu_rest.log
pack; echo "end $(left)"

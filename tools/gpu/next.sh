# The next device call (docs/quality.md, "Next on the H200"), after tools/gpu/pack.sh:
#   LIMIT=SECONDS bash tools/gpu/next.sh   (carry [".gpu"]; LIMIT: the call's own limit, which decides what fits)
# Runs the attention gpu tests not yet run on main (test_triton_jvp_gpu.py, the TMA forward's, test_compile.py) beside the
# attention=auto teacher, then issue 14's seeds 2 and 3 from it while time is left. With LIMIT under 440 s: the tests
# alone. (The cuDNN probe and test_cudnn_backward_gpu.py passed on the fifty-fifth day: tools/gpu/cudnn_probe.py.)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
snap() { tar -cf $OUT/qsnap.tar runs/qout $(ls -d runs/q/*/*.log runs/q/*/*.jsonl 2>/dev/null) 2>/dev/null; }
(
  timeout $(( $(rest) - 30 )) python -m pytest -q -m gpu tests/attention/test_tma_gpu.py tests/attention/test_triton_jvp_gpu.py \
    tests/train/test_compile.py --tb=short > $OUT/q/gpu_main.log 2>&1; echo "main gpu rc=$? $(left)" >> $OUT/q/gpu_main.log
) &
if [ $LIMIT -ge 440 ]; then
  q fmqa2 --attention auto --runs "fmqa2:flow_matching:5180:trainer.ckpt_every=4300,trainer.keep_last=0"; snap
  for seed in 2 3; do
    [ $(rest) -gt 140 ] || break
    q rcmgqats$seed --weights ema0.99 ema0.995 \
      --runs "rcmgqats$seed:rcm_gan:54s:objective.teacher=RUNS/fmqa2,trainer.seed=$seed,trainer.ema_decays=[0.99,0.995]"; snap
  done
fi
wait; echo "tests done $(left)"; tail -n 8 $OUT/q/gpu_main.log
pack; rm -f $OUT/qsnap.tar; echo "end $(left)"

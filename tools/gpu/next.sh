# The next device call (docs/quality.md, "Next on the H200"), after tools/gpu/pack.sh:
#   LIMIT=SECONDS bash tools/gpu/next.sh   (carry [".gpu"]; LIMIT: the call's own limit, which decides what fits)
# Runs the TMA forward's candidates against the pointer loads (alone on the GPU), then the cuDNN probe, the cuDNN backward's gpu tests and then test_triton_jvp_gpu.py beside the attention=auto teacher,
# then issue 14's seeds 2 and 3 from it while time is left. With LIMIT under 440 s: the probe and the tests alone.
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
# first, alone on the GPU: the TMA forward's launch candidates against the pointer loads (docs/attention.md; ~100 s)
TRITON_CACHE_DIR=$(mktemp -d) timeout 110 python benchmarks/attention_configs.py --head-dims 64 72 128 --tokens 4096 1024 256 \
  --candidates --loads pointers tma > $OUT/q/tma_candidates.log 2>&1; echo "tma candidates rc=$? $(left)" >> $OUT/q/tma_candidates.log
snap() { tar -cf $OUT/qsnap.tar runs/qout $(ls -d runs/q/*/*.log runs/q/*/*.jsonl 2>/dev/null) 2>/dev/null; }
(
  timeout 150 python tools/gpu/cudnn_probe.py > $OUT/q/probe.log 2>&1; echo "probe rc=$? $(left)" >> $OUT/q/probe.log
  timeout 60 python -m pytest -q -m gpu tests/attention/test_cudnn_backward_gpu.py --tb=long > $OUT/q/cudnn_tests.log 2>&1
  echo "rc=$? $(left)" >> $OUT/q/cudnn_tests.log
  timeout 120 python -m pytest -q -m gpu tests/attention/test_tma_gpu.py --tb=short > $OUT/q/tma_tests.log 2>&1
  echo "rc=$? $(left)" >> $OUT/q/tma_tests.log
  timeout $(( $(rest) - 30 )) python -m pytest -q -m gpu tests/attention/test_triton_jvp_gpu.py tests/train/test_compile.py \
    --tb=short > $OUT/q/gpu_main.log 2>&1; echo "main gpu rc=$? $(left)" >> $OUT/q/gpu_main.log
) &
if [ $LIMIT -ge 440 ]; then
  q fmqa2 --attention auto --runs "fmqa2:flow_matching:5180:trainer.ckpt_every=4300,trainer.keep_last=0"; snap
  for seed in 2 3; do
    [ $(rest) -gt 140 ] || break
    q rcmgqats$seed --weights ema0.99 ema0.995 \
      --runs "rcmgqats$seed:rcm_gan:54s:objective.teacher=RUNS/fmqa2,trainer.seed=$seed,trainer.ema_decays=[0.99,0.995]"; snap
  done
fi
wait; echo "tests done $(left)"; grep -A3 "best first" $OUT/q/tma_candidates.log; tail -n 1 $OUT/q/tma_candidates.log
cat $OUT/q/probe.log; tail -n 5 $OUT/q/cudnn_tests.log $OUT/q/tma_tests.log $OUT/q/gpu_main.log
pack; rm -f $OUT/qsnap.tar; echo "end $(left)"

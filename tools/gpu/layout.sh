# The layout change on a GPU (docs/quality.md, fifty-seventh day, item e): the fused forwards write O in q's order and
# the backward copies neither dO nor the gradients. Two calls on one warm machine, both with carry [".gpu"] (hydra for
# tests/train and the ablation):
#   LIMIT=590 PART=tests bash tools/gpu/layout.sh   every gpu test: those outside test_tma_gpu.py / test_triton_jvp_gpu.py
#                                                   (~100 s), then those two files (~480 s) while time is left;
#                                                   K="not every_candidate" leaves out their slowest (every config)
#   LIMIT=590 PART=bench bash tools/gpu/layout.sh   issue 15's table through the tuner (~90 s), then steps.sh with the
#                                                   native node off and on (graphed rows should agree)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
export TRITON_CACHE_DIR=$(mktemp -d)
if [ "${PART:-tests}" = tests ]; then
  bash tools/gpu/tests.sh  # part 1: the gpu tests outside the two attention-kernel files
  for f in test_triton_jvp_gpu test_tma_gpu; do
    [ $(rest) -gt 40 ] || break
    timeout $(( $(rest) - 10 )) python -m pytest -q -m gpu tests/attention/$f.py --tb=short -p no:cacheprovider -rs \
      ${K:+-k "$K"} > $OUT/gputests_$f.log 2>&1
    echo "$f rc=$? $(left)"; tail -n 3 $OUT/gputests_$f.log; grep -E "^FAILED" $OUT/gputests_$f.log
  done
else
  # the tuner times in CUDA-graph replays since the fifty-seventh day: the 256-token rows should reach host-built speed
  timeout 150 python benchmarks/attention.py --head-dims 64 72 128 --tokens 256 1024 4096 --out $OUT > $OUT/attention_bench.log 2>&1
  echo "bench rc=$? $(left)"; grep -E "^\|" $OUT/attention_bench.log | head -30
  NODES="0 1" bash tools/gpu/steps.sh
fi

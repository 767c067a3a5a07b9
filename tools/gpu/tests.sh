# Every gpu test outside the two attention-kernel files (~105 s on an H100): flm.nn, the fused adaLN kernels, the DiT,
# the loop, CUDA graphs and the distillations; the log in $OUT/gputests.log.
#   LIMIT=SECONDS bash tools/gpu/tests.sh   (carry [".gpu"]: the tests' teacher runs train.py, which needs hydra)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; source tools/gpu/env.sh
timeout $(( $(rest) < 200 ? $(rest) : 200 )) python -m pytest -q -m gpu tests --ignore=tests/attention/test_tma_gpu.py \
  --ignore=tests/attention/test_triton_jvp_gpu.py --tb=short -p no:cacheprovider -rs > $OUT/gputests.log 2>&1
echo "gpu tests rc=$? $(left)"; tail -n 3 $OUT/gputests.log; grep -E "^FAILED" $OUT/gputests.log

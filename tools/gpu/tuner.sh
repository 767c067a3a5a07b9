# The fused forward's own tuner and FLM_ATTENTION_NATIVE_NODE on a GPU (docs/quality.md, "Next on the H200", item a;
# docs/attention.md, fifty-sixth day): their gpu tests, then issue 15's table through the tuner (pointer loads against
# host-built descriptors, chosen per shape) and issue 16's host-time table (the tuner's choice, the native node's rows
# and traces), alone on the GPU.
#   LIMIT=SECONDS bash tools/gpu/tuner.sh   (no carry needed)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; export PYTHONPATH=$PWD; source tools/gpu/base.sh
export TRITON_CACHE_DIR=$(mktemp -d)
timeout 150 python -m pytest -q -m gpu tests/attention/test_tma_gpu.py tests/attention/test_triton_jvp_gpu.py \
  -k "tuner or tuned" --tb=short > $OUT/tuner_tests.log 2>&1
echo "tuner tests rc=$? $(left)" | tee -a $OUT/tuner_tests.log; tail -n 5 $OUT/tuner_tests.log
timeout 150 python -m pytest -q -m gpu tests/attention/test_native_node_gpu.py --tb=short > $OUT/native_tests.log 2>&1
echo "native node tests rc=$? $(left)" | tee -a $OUT/native_tests.log; tail -n 5 $OUT/native_tests.log
timeout $(( $(rest) - 150 )) python benchmarks/attention.py --head-dims 64 72 128 --tokens 256 1024 4096 --out $OUT \
  > $OUT/attention_bench.log 2>&1
echo "bench rc=$? $(left)"; grep -E "^\|" $OUT/attention_bench.log | head -30
TRITON_CACHE_DIR=$(mktemp -d) timeout $(( $(rest) - 10 )) python benchmarks/attention_host.py --head-dims 64 72 128 \
  --tokens 4096 --trace $OUT/host_traces > $OUT/host.log 2>&1
echo "host rc=$? $(left)"; grep -E "^\| (fwd|fused|native|SDPA fwd \+|forward)" $OUT/host.log

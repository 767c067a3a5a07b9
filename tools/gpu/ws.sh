# Issue 15: Triton's warp specialization of the fused forward's key loop on Hopper. Its gpu test first (the same outputs
# as the plain loop), then the candidates with and without it, one process per head dim (a compiler crash ends only its
# own), each config timed in CUDA-graph replays.
#   LIMIT=SECONDS [DIMS="64 128 72"] bash tools/gpu/ws.sh   (no carry needed)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; export PYTHONPATH=$PWD; source tools/gpu/base.sh
export TRITON_CACHE_DIR=$(mktemp -d)
timeout 180 python -m pytest -q -m gpu tests/attention/test_tma_gpu.py -k warp_specialized --tb=short > $OUT/ws_tests.log 2>&1
echo "ws tests rc=$? $(left)"; tail -n 15 $OUT/ws_tests.log
for d in ${DIMS:-64 128 72}; do
  timeout $(( $(rest) - 10 )) python benchmarks/attention_configs.py --head-dims $d --tokens 4096 1024 256 --candidates \
    --loads tma-host tma --warp-specialize off on > $OUT/ws_d$d.log 2>&1
  echo "D=$d rc=$? $(left)"; grep -A8 "best first" $OUT/ws_d$d.log
done

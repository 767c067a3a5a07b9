# The tensor-descriptor (TMA) forward on a GPU, alone on it (timings): every launch candidate with pointer
# loads and with both kinds of descriptors (built by each program, or by the host) at issue 15's shapes; its gpu tests; then a wider
# grid with the descriptors alone (the registers it frees: at 128 x 64 x 8 warps
# ptxas gives 189-196 registers and no spill against 236-255 and spills for the pointer loads, sm_90a, Triton 3.8).
# Before all that, issue 16's host-time table at 4096 tokens with the native-node prototype rows.
#   LIMIT=SECONDS bash tools/gpu/tma.sh   (no carry needed)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; export PYTHONPATH=$PWD; source tools/gpu/base.sh
export TRITON_CACHE_DIR=$(mktemp -d)
( TRITON_CACHE_DIR=$(mktemp -d) timeout 200 python benchmarks/attention_ptxas.py > $OUT/tma_ptxas.md 2>&1 ) &  # Triton 3.6's registers
cfg() { timeout $(( $(rest) - 10 )) python benchmarks/attention_configs.py "$@"; echo "rc=$? $(left)"; }
# issue 16: the host time at 4096 tokens, with the prototype rows of a native cuDNN backward node (first: nothing else on the GPU)
timeout 150 python benchmarks/attention_host.py --head-dims 64 72 128 --tokens 4096 > $OUT/host_native.log 2>&1
echo "host rc=$? $(left)" | tee -a $OUT/host_native.log; grep -E "native|fused /|SDPA fwd \+ bwd|backward in use" $OUT/host_native.log
cfg --head-dims 64 72 128 --tokens 256 1024 4096 --candidates --loads pointers tma tma-host > $OUT/tma_candidates.log 2>&1
timeout $(( LIMIT / 3 )) python -m pytest -q -m gpu tests/attention/test_tma_gpu.py --tb=short > $OUT/tma_tests.log 2>&1
echo "tma tests rc=$? $(left)" | tee -a $OUT/tma_tests.log; tail -n 20 $OUT/tma_tests.log
cfg --head-dims 72 128 64 --tokens 4096 1024 256 --blocks 128x128 128x64 128x32 64x64 --warps 8 --stages 2 3 4 --loads tma-host tma \
  > $OUT/tma_grid.log 2>&1
cfg --head-dims 64 72 128 --tokens 256 1024 --blocks 64x64 64x32 --warps 4 --stages 2 3 --loads tma-host tma > $OUT/tma_grid4.log 2>&1
wait; cat $OUT/tma_ptxas.md
for f in $OUT/tma_candidates.log $OUT/tma_grid.log $OUT/tma_grid4.log; do echo "== $f"; grep -A4 "best first" $f; tail -n 1 $f; done

# The tensor-descriptor (TMA) forward on a GPU, alone on it (timings): its gpu tests, then every launch candidate with
# pointer loads and with TMA at issue 15's shapes. LIMIT=SECONDS bash tools/gpu/tma.sh (no carry needed)
set -u; cd "$(dirname "$0")/../.."; LIMIT=${LIMIT:-590}; export PYTHONPATH=$PWD T0=$(date +%s)
left() { echo "[t=$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 150 python -m pytest -q -m gpu tests/attention/test_tma_gpu.py --tb=short > $OUT/tma_tests.log 2>&1
echo "tma tests rc=$? $(left)" | tee -a $OUT/tma_tests.log; tail -n 20 $OUT/tma_tests.log
export TRITON_CACHE_DIR=$(mktemp -d)
timeout $(( LIMIT - $(date +%s) + T0 - 15 )) python benchmarks/attention_configs.py --head-dims 64 72 128 \
  --tokens 256 1024 4096 --candidates --loads pointers tma > $OUT/tma_configs.log 2>&1
echo "configs rc=$? $(left)" >> $OUT/tma_configs.log; grep -A4 "best first\|TFLOP/s$" $OUT/tma_configs.log | grep -v "^  D=" | head -80

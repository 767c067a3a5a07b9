#!/usr/bin/env bash
# Fills the ignored folder .gpu/ with what a quality run on the device machine needs and cannot fetch there (it has
# no network and no hydra): MNIST's four files gzipped, the FID Inception network in fp16 and xz-compressed, and the
# hydra-core / omegaconf / antlr4 wheels. About 50 MB; the device call's carry is [".gpu"], and the checkout plus the
# carry must stay under 64 MiB (move docs/quality out of the tree for the call).
#   bash tools/gpu/pack.sh DATA WHEELS   # DATA as fetch-data.sh writes it (MNIST/raw, fid/), WHEELS a folder of .whl
set -euo pipefail
data=${1:?usage: pack.sh DATA WHEELS}; wheels=${2:?usage: pack.sh DATA WHEELS}
cd "$(dirname "$0")/../.."
mkdir -p .gpu/mnist .gpu/whl
for f in "$data"/MNIST/raw/*-ubyte; do gzip -9c "$f" > ".gpu/mnist/$(basename "$f").gz"; done
cp "$wheels"/*.whl .gpu/whl/
inception=$(ls "$data"/fid/*.pt | head -n 1)
python - "$inception" <<'PY'
import sys, torch
torch.jit.save(torch.jit.load(sys.argv[1]).half(), ".gpu/inception-fp16.pt")  # FID moves ~0.1 % (docs/quality.md)
PY
xz -9f .gpu/inception-fp16.pt
du -sh .gpu

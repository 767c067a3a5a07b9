# Whether trainer.cuda_graph=auto can be the default: every gpu test outside the two attention-kernel files with the
# device's copy switched to auto (nothing here changes), the log in $OUT/gputests.log (tools/gpu/tests.sh). Among them
# tests/train/test_graphs.py's real capture under auto (graphed; a host read falling back to the eager run's losses).
#   LIMIT=SECONDS bash tools/gpu/auto.sh   (carry [".gpu"])
set -u; cd "$(dirname "$0")/../.."
sed -i 's/^cuda_graph: false  /cuda_graph: auto   /' configs/trainer/default.yaml
sed -i 's/cuda_graph: bool | str = False/cuda_graph: bool | str = "auto"/' flm/train/settings.py
grep -q '^cuda_graph: auto ' configs/trainer/default.yaml && grep -q 'cuda_graph: bool | str = "auto"' flm/train/settings.py \
  || { echo "auto.sh: the default is not where this script looks for it; switch it by hand"; exit 1; }
echo "trainer.cuda_graph defaults to auto in this copy"
bash tools/gpu/tests.sh

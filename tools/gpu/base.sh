# Sourced by the device scripts from the checkout's root: the call's clock and the device's name and versions.
#   left   seconds since the call started
#   rest   seconds left of LIMIT
export T0=${T0:-$(date +%s)}
left() { echo "[t=$(( $(date +%s) - T0 )) s]"; }
rest() { echo $(( ${LIMIT:?set LIMIT to the call limit} - ($(date +%s) - T0) )); }  # seconds left of the call
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"

#!/bin/bash
# A startup script for `tpurun create NAME --startup-script setup.sh`. Every worker runs it as root at
# every boot, and tpurun reports the node ready only when it has finished on all of them.
# It gives the examples what they import: torch with torch_xla (and libtpu, its `tpu` extra), Lightning
# and scikit-learn. A TPU VM base image has none of them. Later boots find them and download nothing.
set -euo pipefail
need=()
for module in torch_xla lightning sklearn; do
    python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" || need+=("$module")
done
if [ ${#need[@]} -eq 0 ]; then
    echo "the examples' packages are installed for $(command -v python3)"
else
    echo "installing for $(command -v python3): ${need[*]} missing"
    python3 -m pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0' lightning scikit-learn
fi

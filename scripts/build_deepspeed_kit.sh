#!/bin/bash
# Rebuild .dskit/: DeepSpeed and the small dependencies torch/accelerate/transformers do not bring,
# as wheels for the GPU test machine (Python 3.12, manylinux x86_64, torch already installed, no
# package index), plus install.sh to SOURCE there after .gpu/install.sh:
#     source .gpu/install.sh && source .dskit/install.sh
# DeepSpeed is built with DS_BUILD_OPS=0: pure Python, its C++/CUDA ops compiled on first use
# (JIT, with ninja) where they are needed at all; ZeRO 1-3 with a torch optimizer need none.
# Usage: bash scripts/build_deepspeed_kit.sh [DEEPSPEED_VERSION]   (from the repository root)
set -euo pipefail
version=${1:-0.19.8}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kit=$root/.dskit
rm -rf "$kit" && mkdir -p "$kit/wheels"
# DeepSpeed's own wheel, from its sdist, without ops (py3-none-any).
DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-cache-dir -w "$kit/wheels" "deepspeed==$version"
# Its dependencies that the GPU machine's Python lacks (numpy, packaging, psutil, pydantic, torch,
# tqdm and py-cpuinfo are there or in .gpu/; py-cpuinfo is pure Python and small, so it comes too).
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$kit/wheels" hjson py-cpuinfo msgpack ninja einops nvidia-ml-py
cat > "$kit/install.sh" <<'SH'
#!/bin/bash
# Source from the project root after .gpu/install.sh:
#     source .dskit/install.sh
# The wheels go into $FP8PLUG_SITE, a private folder made with mktemp -d when unset (never a fixed
# path under /tmp, where another user of a shared machine could plant modules first on PYTHONPATH).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export FP8PLUG_SITE=${FP8PLUG_SITE:-$(mktemp -d -t fp8plug-site.XXXXXX)} || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$FP8PLUG_SITE" "$here"/wheels/*.whl || return 1
case ":$PYTHONPATH:" in *:"$FP8PLUG_SITE":*) ;; *) export PYTHONPATH=$FP8PLUG_SITE${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PATH=$FP8PLUG_SITE/bin:$PATH   # ninja, for ops DeepSpeed compiles on first use
python3 -c "import deepspeed, torch; from deepspeed.accelerator import get_accelerator as g; print(f'dskit: deepspeed {deepspeed.__version__} on {g()._name}, torch {torch.__version__}')"
SH
ls -la "$kit/wheels"
du -sh "$kit"

#!/usr/bin/env bash
# The GPU check of issue 26 in one command: tests/gpu/run.sh OUTDIR [--from N] [--dry-run]
#
# On the GPU machine (Python 3.12, torch with CUDA and transformers installed; no registry): installs the
# wheels that `make gpu-bundle` put in .gpu/base/wheels and servelm itself (--no-deps) into a folder of their
# own, then runs tests/gpu/check.py, which writes OUTDIR/log.txt and OUTDIR/summary.json. Builds nothing that
# takes minutes (servelm's CPU kernels are never built on CUDA). Ends within 7.5 minutes. How to carry the
# bundle there: docs/gpu.md. `--dry-run` tries the script on this CPU machine with small sizes.
set -uo pipefail
out=${1:?usage: tests/gpu/run.sh OUTDIR [--from N] [--dry-run]}
shift
cd "$(dirname "$0")/../.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee "$out/log.txt") 2>&1
echo "servelm GPU check, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
py=${PYTHON:-python3}
site=${SERVELM_GPU_SITE:-/tmp/servelm-gpu-site}
case " $* " in *" --dry-run "*) dry=1 ;; *) dry=0 ;; esac
if [ $dry -eq 0 ]; then
    [ -d .gpu/base/wheels ] || { echo "no .gpu/base/wheels: run 'make gpu-bundle' and carry .gpu/base (docs/gpu.md)"; exit 2; }
    rm -rf "$site"
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu/base/wheels/*.whl || exit 2
    $py -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$site" . || exit 2
    export PYTHONPATH="$site"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$py -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"
timeout -k 10 430 $py tests/gpu/check.py --out "$out" "$@"
rc=$?
[ $rc -eq 124 ] && echo "the check ran past its 430 s and was stopped; summary.json holds the steps that ended"
exit $rc

# Source on a lent GPU machine (no registry there): install the carried wheels in .whl/
# (see docs/PERFORMANCE.md, "Reproducing the GPU figures"), build the C++ post stage in
# place, and export what the benchmarks need. Usage: . bench/gpu_env.sh
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q >/dev/null || return 1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

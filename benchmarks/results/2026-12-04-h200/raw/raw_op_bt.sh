# the C++ backtrace of the raw attention op's segfault on a misaligned k_cache
cd "$(dirname "$0")/../.."
python - <<'PY' > /tmp/raw_op.py
import re
src = open("tests/test_cuda_review.py").read()
print(re.search(r'RAW_OP_SCRIPT = """(.*?)"""', src, re.S).group(1))
PY
export PYTHONPATH=$(pwd):$(pwd)/tests
for bad in k_cache q; do
  echo "=== $bad: plain"; python /tmp/raw_op.py $bad; echo "rc=$?"
done
echo "=== cuda-gdb k_cache"
timeout 60 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt -ex "info registers rip" -ex "x/6i \$pc-12" --args python /tmp/raw_op.py k_cache 2>&1 | grep -v "^\[New Thread\|^\[Thread\|^\[Detaching\|Download" | tail -60

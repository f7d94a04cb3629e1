# second device call of 2026-12-04: diagnostics of the first call's GPU-suite failures, and the fixes' tests
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/python_api
t0=$SECONDS
( MAX_JOBS=16 GEMMA4_MTP_CUDA_ARCHS=90a timeout 70 python setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$? at $((SECONDS-t0))s" >> $OUT/build.log ) &
b=$!
( timeout 100 python build/diag/qrope_diag.py triton > $OUT/qrope_triton.log 2>&1; echo "rc=$?" >> $OUT/qrope_triton.log ) &
wait $b
tail -1 $OUT/build.log
( timeout 60 bash build/diag/raw_op_bt.sh > $OUT/raw_op_bt.log 2>&1 ) &
( timeout 60 python build/diag/qrope_diag.py cuda > $OUT/qrope_cuda.log 2>&1; echo "rc=$?" >> $OUT/qrope_cuda.log ) &
( timeout 75 python -m pytest -q -p no:cacheprovider -m gpu tests/test_torch_compile.py tests/test_fused_glue_triton.py -k "compile" > $OUT/compile_tests.log 2>&1; echo "rc=$?" >> $OUT/compile_tests.log ) &
( timeout 60 python -m gemma4_mtp generate --backend cuda --draft-tokens 4 --max-new-tokens 64 > $OUT/main_cuda.log 2>&1; echo "rc=$?" >> $OUT/main_cuda.log ) &
wait
echo "done at $((SECONDS-t0))s"
for f in $OUT/*.log; do echo "=== $f"; tail -c 1500 $f; done

# usage: tokens.sh YGGDRASIL_EXE OUTFILE — greedy texts of two shipped bundles, spec and plain
Y=$1; OUT=$2; : > $OUT
for b in $BUNDLES/bundle-after-smollm2 $BUNDLES/bundle-after-qwen; do
  for p in "def fibonacci(n):" "def is_prime(n):" "class Stack:" "def merge_sort(xs):"; do
    for mode in "" "--no-spec"; do
      echo "== $(basename $b) $mode $p" >> $OUT
      $Y generate --bundle $b --prompt "$p" --max-new-tokens 48 --no-stats $mode >> $OUT 2>/dev/null || echo "FAILED rc=$?" >> $OUT
    done
  done
done

#!/usr/bin/env bash
# The --nproc scaling table of issue 26 on a many-core machine, in one command: makes a real FSDP2
# sample checkpoint (fsdp_convert._sample under torch's launcher, cached in $WORK), warms the page
# cache, and runs scripts/bench.py --scaling (OUT on tmpfs, cp as the reference row), printing the
# table to stdout and, when $OUT is set, writing $OUT/scaling.md, scaling.json and scaling.log.
#
#   scripts/bench_scaling.sh                                        # ~6.4 GB sample, --nproc 1,2,4,8,16
#   DIM=512 LAYERS=4 VOCAB=4000 NPROCS=1,2 ROUNDS=1 scripts/bench_scaling.sh   # 0.2 GB: a quick check
#
# Needs only python3 with torch, typer, rich and safetensors (isal optional: zlib is the fallback);
# the package runs from this source tree (PYTHONPATH), not installed; no network. The sample's size
# is about 12 bytes (fp32 weights and two AdamW moments) x (LAYERS x 12 x DIM^2 + 2 x VOCAB x DIM):
# 6.4 GB at the defaults; on 16 cores the whole run (sample ~1 min, 2 rounds) stays within 6 minutes
# while consolidate moves >= 0.5 GB/s at --nproc 1. tmpfs must hold one output: /dev/shm, or (as
# root) a tmpfs mounted at $WORK/tmpfs when /dev/shm is too small.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/fsdp-convert-scaling}
DIM=${DIM:-2048} LAYERS=${LAYERS:-8} VOCAB=${VOCAB:-32000} RANKS=${RANKS:-4}
NPROCS=${NPROCS:-1,2,4,8,16} ROUNDS=${ROUNDS:-2}
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
# CPU only: on a GPU machine the sample's fully_shard would pick a CUDA mesh for its gloo group and fail
export CUDA_VISIBLE_DEVICES=""
start=$SECONDS
say() { echo "[bench_scaling $((SECONDS - start)) s] $*" >&2; }

sample=$WORK/sample-d$DIM-l$LAYERS-v$VOCAB-r$RANKS
ck=$sample/checkpoint
if [ ! -f "$ck/.metadata" ]; then
  rm -rf "$sample"
  mkdir -p "$WORK"
  say "writing the FSDP2 sample (dim $DIM, $LAYERS layers, vocab $VOCAB, $RANKS ranks) to $sample"
  OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc-per-node "$RANKS" \
    -m fsdp_convert._sample --out "$sample" --dim "$DIM" --n-layers "$LAYERS" --vocab-size "$VOCAB" --steps 1 --no-truth >&2
fi
data_bytes=$(stat -c %s "$ck"/*.distcp | awk '{s += $1} END {print s}')
say "sample: $ck, $data_bytes bytes in $(ls "$ck"/*.distcp | wc -l) data files"

tmpfs=${TMPFS:-/dev/shm}
free_bytes=$(df -B1 --output=avail "$tmpfs" 2>/dev/null | tail -1 || echo 0)
mounted=""
if [ "$free_bytes" -lt $((data_bytes + data_bytes / 10)) ]; then
  tmpfs=$WORK/tmpfs
  mkdir -p "$tmpfs"
  if ! mountpoint -q "$tmpfs"; then
    say "/dev/shm has $free_bytes bytes free; mounting a tmpfs at $tmpfs"
    mount -t tmpfs -o size=$((data_bytes * 2)) tmpfs "$tmpfs" || { echo "error: no tmpfs with room for $data_bytes bytes (set TMPFS=DIR)" >&2; exit 1; }
    mounted=$tmpfs
  fi
fi
cleanup() { if [ -n "$mounted" ]; then umount "$mounted" || true; fi; }
trap cleanup EXIT

out_dir=${OUT:-}
json=${out_dir:+$out_dir/scaling.json}
json=${json:-$WORK/scaling.json}
log=${out_dir:+$out_dir/scaling.log}
log=${log:-$WORK/scaling.log}
[ -n "$out_dir" ] && mkdir -p "$out_dir"
say "scaling table: --nproc $NPROCS, $ROUNDS rounds, OUT on $tmpfs (progress in $log)"
table=$($PYTHON "$repo/scripts/bench.py" --scaling "$NPROCS" --rounds "$ROUNDS" --checkpoint "$ck" --python "$PYTHON" \
  --tmpfs "$tmpfs" --cache "$WORK" --json-out "$json" 2> >(tee "$log" >&2))
echo "$table"
[ -n "$out_dir" ] && echo "$table" > "$out_dir/scaling.md"
say "done"

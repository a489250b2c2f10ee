#!/usr/bin/env bash
# Streamed HDF5 training data (issue 17): memory, start-up time and throughput of
# `meshtrain train` with data.source = "hdf5" against files of 10 MB to larger than the
# machine's memory, and beside them the disk's own sequential and random read rates. One JSON
# line per measurement on stdout ("part" says which), then summary lines ("summary": true)
# with the ratios the issue sets targets for; progress and the runs' output go to stderr
# and $SCRATCH.
#
#   [SCRATCH=/tmp/meshtrain-data-stream] bench/data_stream.sh [PARTS]
#       PARTS (default "size fashion big pattern gzip"):
#       size     model 128-256-10, batch 128, 20 steps at np 2 on files of 10 MB, 1 GB and
#                8 GB (/x float [N, 128]): peak RSS of each rank (/usr/bin/time) and the time
#                from launch to the first step's log line, from a cold page cache.
#                Targets: 1 GB and 8 GB within 64 MB of each other and 128 MB of 10 MB;
#                first step at most 2 s later than with 10 MB.
#       fashion  configs/fashion_mnist_dp.toml (784-512-512-10, batch 128, np 2), one epoch
#                from memory (data.source = fashion_mnist) and from the same data as HDF5,
#                alternated ROUNDS times: samples/s (log windows after the first) and
#                data_wait_s; the summary also says whether both sources gave the same losses.
#                Targets: median HDF5/memory >= 0.95, data wait < 5% of a step.
#       big      a file larger than memory (BIG_ROWS x 128 floats, 30 GB by default):
#                BIG_STEPS steps with shuffle = true and with shuffle = "blocks" from a cold
#                cache, beside the disk's sequential rate (dd, O_DIRECT) and its random
#                512-byte read rate (O_DIRECT preads of whole rows at 1, 2 and QD_MAX
#                threads). Each run reports what the kernel read from the disk
#                (disk_read_mib, readahead included) beside the bytes its rows need.
#       pattern  the rows and blocks read patterns replayed by one Python reader on the big
#                file, with the kernel's readahead, with POSIX_FADV_RANDOM and with
#                POSIX_FADV_WILLNEED on each block of a window: what advice would change.
#       gzip     a 1 GB file in chunks of 1024 rows with the shuffle and deflate filters
#                (random floats compress to about 80%):
#                GZIP_STEPS steps with shuffle = true, GZIP_BLOCKS_STEPS with "blocks" (a
#                window of 8 blocks is 64 steps: enough steps to cross many windows).
#
# data_wait_s is what metrics.jsonl logs: the slowest rank's mean wait per step for its
# batch (the others wait for it in the gradient all-reduce).
#
# Environment: SCRATCH (data files and run directories; outside the repository),
# MESHTRAIN (build/bin/meshtrain), WRITER (build/bin/write_hdf5_dataset, built when missing),
# MPIRUN (mpirun --oversubscribe --mca mpi_yield_when_idle 1), NP (2), ROUNDS (3),
# BIG_ROWS (58000000), BIG_STEPS (1000), GZIP_STEPS (40), GZIP_BLOCKS_STEPS (1000),
# QD_MAX (8), RUN_TIMEOUT (330 s per run), KEEP=1 keeps the data files (otherwise removed
# at exit; a later run with KEEP=1 reuses them). The page cache is dropped before each cold
# run when /proc/sys/vm/drop_caches is writable (root); the lines say "cold_cache": false
# otherwise. The machine should be otherwise idle: the fashion ratio is of wall times.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
parts=${1:-"size fashion big pattern gzip"}
scratch=${SCRATCH:-/tmp/meshtrain-data-stream}
meshtrain=${MESHTRAIN:-build/bin/meshtrain}
writer=${WRITER:-build/bin/write_hdf5_dataset}
mpirun=${MPIRUN:-mpirun --oversubscribe --mca mpi_yield_when_idle 1}
np=${NP:-2}
rounds=${ROUNDS:-3}
big_rows=${BIG_ROWS:-58000000}
big_steps=${BIG_STEPS:-1000}
gzip_steps=${GZIP_STEPS:-40}
gzip_blocks_steps=${GZIP_BLOCKS_STEPS:-1000}
qd_max=${QD_MAX:-8}
run_timeout=${RUN_TIMEOUT:-330}
mkdir -p "$scratch"
scratch=$(cd "$scratch" && pwd)
case $scratch/ in "$PWD"/*) echo "data_stream: SCRATCH must be outside the repository" >&2; exit 2 ;; esac
[[ -x $meshtrain ]] || { echo "data_stream: $meshtrain is not built" >&2; exit 2; }
if [[ ! -x $writer ]]; then
  cmake --build build --target write_hdf5_dataset >&2
fi
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$scratch"/*.h5 "$scratch"/runs' EXIT
log() { echo "data_stream: $*" >&2; }
# The block device under SCRATCH, whose read counters each run reports (disk_reads,
# disk_read_mib: what the kernel read, readahead included).
disk_name=$(basename "$(df --output=source "$scratch" | tail -n 1)")
export DATA_STREAM_DISK_STAT=/sys/class/block/$disk_name/stat

cold=false
drop_caches() {
  sync
  if { echo 3 > /proc/sys/vm/drop_caches; } 2> /dev/null; then cold=true; else cold=false; fi
}

# A file of ROWS x 128 floats (plus labels), written unless this run or a kept one wrote it.
declare -A written=()
make_file() {  # PATH ROWS [WRITER OPTIONS...]
  local path=$1 rows=$2
  shift 2
  if [[ -f $path && ( ${KEEP:-0} == 1 || -n ${written[$path]:-} ) ]]; then return; fi
  log "writing $path ($rows rows)"
  "$writer" synthetic "$path" --rows "$rows" --features 128 --classes 10 "$@" >&2
  written[$path]=1
}

cat > "$scratch/base.toml" <<'TOML'
[run]
name = "data_stream"
seed = 0
[mesh]
dp = -1
[partition]
preset = "dp"
min_sharding_size = 0
[model]
kind = "mlp"
sizes = [128, 256, 10]
loss = "cross_entropy"
[data]
source = "hdf5"
batch_size = 128
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = 20
log_every = 1
eval_every = 0
TOML

# Runs `meshtrain train` under mpirun with each rank wrapped in /usr/bin/time, and prints one
# JSON line: the fields of EXTRA (a JSON object), the seconds from launch to rank 0's set-up
# line and first step line, the wall time, each rank's peak RSS, and from metrics.jsonl the
# samples/s and data_wait_s of the log windows after the first SKIP ones.
cat > "$scratch/timed_run.py" <<'PY'
import json, os, subprocess, sys, time
extra, skip, outdir, timeout = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
cmd = sys.argv[5:]
os.makedirs(outdir, exist_ok=True)
rss_prefix = os.path.join(outdir, "maxrss_kb")
for f in os.listdir(outdir):
    if f.startswith("maxrss_kb."):
        os.remove(os.path.join(outdir, f))
env = dict(os.environ, DATA_STREAM_RSS=rss_prefix)
disk_stat = os.environ.get("DATA_STREAM_DISK_STAT", "")
def disk():  # (reads completed, 512-byte sectors read) of the scratch directory's disk
    if not os.path.exists(disk_stat):
        return None
    f = open(disk_stat).read().split()
    return int(f[0]), int(f[2])
disk_before = disk()
start = time.monotonic()
setup_s = first_step_s = None
with open(os.path.join(outdir, "stdout.log"), "w") as out:
    # timeout ends a run that would take too long; the windows it logged still count.
    p = subprocess.Popen(["timeout", "--kill-after=10", str(timeout)] + cmd, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    for line in p.stdout:
        now = time.monotonic() - start
        out.write("%.3f %s" % (now, line))
        if setup_s is None and line.startswith("meshtrain train"):
            setup_s = now
        if first_step_s is None and line.startswith("step "):
            first_step_s = now
    rc = p.wait()
wall = time.monotonic() - start
disk_after = disk()
rec = dict(extra)
if disk_before and disk_after:
    reads, sectors = disk_after[0] - disk_before[0], disk_after[1] - disk_before[1]
    rec["disk_reads"] = reads
    rec["disk_read_mib"] = round(sectors / 2048, 1)
rec.update({"rc": rc, "timed_out": rc in (124, 137), "setup_s": setup_s, "first_step_s": first_step_s, "wall_s": round(wall, 3)})
rss = []
for r in range(64):
    f = "%s.%d" % (rss_prefix, r)
    if not os.path.exists(f):
        break
    lines = [l for l in open(f).read().split() if l.isdigit()]
    rss.append(int(lines[-1]) / 1024 if lines else None)
rec["peak_rss_mib"] = rss
logs = []
metrics = os.path.join(outdir, "metrics.jsonl")
if os.path.exists(metrics):
    logs = [json.loads(l) for l in open(metrics) if '"event":"log"' in l.replace(" ", "")]
batch = extra.get("batch", 128)
prev, windows = 0, []
for e in logs:
    windows.append((e["step"] - prev, e["samples_per_s"], e["data_wait_s"]))
    prev = e["step"]
use = windows[skip:] if len(windows) > skip else windows
steps = sum(w[0] for w in use)
seconds = sum(w[0] * batch / w[1] for w in use if w[1] > 0)
rec["steps"] = prev
if logs:
    rec["last_loss"] = logs[-1]["loss"]
if steps and seconds:
    rec["samples_per_s"] = round(steps * batch / seconds, 1)
    rec["step_time_s"] = seconds / steps
    rec["data_wait_s"] = sum(w[0] * w[2] for w in use) / steps
    rec["data_wait_fraction"] = rec["data_wait_s"] / rec["step_time_s"]
    rec["windows_measured"] = len(use)
print(json.dumps(rec), flush=True)
if rc != 0:
    sys.stderr.write("data_stream: run failed (rc %s), see %s/stdout.log\n" % (rc, outdir))
PY

# One training run: NAME EXTRA_JSON SKIP CONFIG [--set ...]; prints timed_run.py's line.
train() {
  local name=$1 extra=$2 skip=$3 config=$4
  shift 4
  local outdir=$scratch/runs/$name
  rm -rf "$outdir"
  log "run $name"
  # shellcheck disable=SC2016
  python3 "$scratch/timed_run.py" "$extra" "$skip" "$outdir" "$run_timeout" \
    $mpirun -np "$np" -x DATA_STREAM_RSS bash -c '/usr/bin/time -f "%M" -o "$DATA_STREAM_RSS.${OMPI_COMM_WORLD_RANK:-0}" "$@"' \
    rank "$meshtrain" train "$config" --set run.output_dir="$outdir" "$@"
}

summary() {  # PART RESULTS_FILE: the summary line of a part
  python3 - "$1" "$2" "$np" <<'PY'
import json, statistics, sys
part, path = sys.argv[1], sys.argv[2]
rs = [json.loads(l) for l in open(path) if l.strip()]
out = {"summary": True, "part": part}
if part == "size":
    by = {r["file"]: r for r in rs}
    peak = {k: max(v["peak_rss_mib"]) for k, v in by.items() if v["peak_rss_mib"]}
    first = {k: v["first_step_s"] for k, v in by.items()}
    out["peak_rss_mib"] = peak
    out["first_step_s"] = first
    if all(k in peak for k in ("10MB", "1GB", "8GB")):
        out["rss_8GB_minus_1GB_mib"] = round(peak["8GB"] - peak["1GB"], 1)
        out["rss_1GB_minus_10MB_mib"] = round(peak["1GB"] - peak["10MB"], 1)
        out["rss_8GB_minus_10MB_mib"] = round(peak["8GB"] - peak["10MB"], 1)
        out["rss_target_met"] = (abs(peak["8GB"] - peak["1GB"]) <= 64 and
                                 max(peak["1GB"], peak["8GB"]) - peak["10MB"] <= 128)
    if all(first.get(k) is not None for k in ("10MB", "1GB", "8GB")):
        out["first_step_extra_s"] = {k: round(first[k] - first["10MB"], 3) for k in ("1GB", "8GB")}
        out["first_step_target_met"] = max(out["first_step_extra_s"].values()) <= 2.0
elif part == "fashion":
    rounds = {}
    for r in rs:
        rounds.setdefault(r["round"], {})[r["source"]] = r
    ratios = [d["hdf5"]["samples_per_s"] / d["memory"]["samples_per_s"]
              for d in rounds.values() if "hdf5" in d and "memory" in d
              and d["hdf5"].get("samples_per_s") and d["memory"].get("samples_per_s")]
    h = [r for r in rs if r["source"] == "hdf5" and "data_wait_fraction" in r]
    # The same floats in the same order: the losses must be equal.
    out["same_losses"] = all(d["hdf5"].get("last_loss") == d["memory"].get("last_loss")
                             for d in rounds.values() if "hdf5" in d and "memory" in d)
    out["ratios"] = [round(x, 3) for x in ratios]
    if ratios:
        out["median_ratio"] = round(statistics.median(ratios), 3)
        out["ratio_target_met"] = out["median_ratio"] >= 0.95
    if h:
        out["hdf5_data_wait_fraction_max"] = round(max(r["data_wait_fraction"] for r in h), 4)
        out["data_wait_target_met"] = out["hdf5_data_wait_fraction_max"] < 0.05
else:
    runs = {r["shuffle"]: r for r in rs if "shuffle" in r and "samples_per_s" in r}
    out["samples_per_s"] = {k: v["samples_per_s"] for k, v in runs.items()}
    out["data_wait_fraction"] = {k: round(v["data_wait_fraction"], 3) for k, v in runs.items()}
    out["peak_rss_mib"] = {k: max(v["peak_rss_mib"]) if v["peak_rss_mib"] else None
                           for k, v in runs.items()}
    if "blocks" in runs and "true" in runs:
        out["blocks_over_rows"] = round(runs["blocks"]["samples_per_s"] / runs["true"]["samples_per_s"], 2)
    out["disk_read_mib"] = {k: v.get("disk_read_mib") for k, v in runs.items()}
    out["needed_mib"] = {k: round(v["steps"] * v["batch"] * 516 / 2**20, 1) for k, v in runs.items()}
    seq = [r for r in rs if r.get("measure") == "sequential"]
    rnd = {r["threads"]: r["reads_per_s"] for r in rs if r.get("measure") == "random_512"}
    np_ = int(sys.argv[3])
    if np_ in rnd and "true" in runs:
        # shuffle = true: each rank's reader asks for a whole batch's rows at once
        # (POSIX_FADV_WILLNEED), so many reads are in flight: compare with the rate at the
        # most threads measured too.
        out["random_reads_per_s_at_np"] = rnd[np_]
        out["rows_over_random_reads_at_np"] = round(runs["true"]["samples_per_s"] / rnd[np_], 2)
        top = max(rnd)
        out["random_reads_per_s_at_%d_threads" % top] = rnd[top]
        out["rows_over_random_reads_at_%d_threads" % top] = round(
            runs["true"]["samples_per_s"] / rnd[top], 2)
    if seq and "blocks" in runs:
        out["sequential_rows_per_s"] = round(seq[0]["mb_per_s"] * 1e6 / 516, 0)
        out["blocks_over_sequential"] = round(runs["blocks"]["samples_per_s"] / out["sequential_rows_per_s"], 3)
print(json.dumps(out), flush=True)
PY
}

# Random O_DIRECT reads of whole 512-byte rows of /x (THREADS concurrent readers, SECONDS).
random_reads() {  # FILE OFFSET ROWS THREADS SECONDS
  python3 - "$@" <<'PY'
import json, mmap, os, random, sys, threading, time
path, offset, rows, threads, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
counts = [0] * threads
def reader(t):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    view = memoryview(buf)[:512]
    rng = random.Random(t)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(64):
            os.preadv(fd, [view], offset + 512 * rng.randrange(rows))
        n += 64
    counts[t] = n
    os.close(fd)
ts = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
start = time.monotonic()
for t in ts: t.start()
for t in ts: t.join()
wall = time.monotonic() - start
print(json.dumps({"measure": "random_512", "o_direct": True, "threads": threads,
                  "reads_per_s": round(sum(counts) / wall, 1),
                  "mean_latency_us": round(1e6 * wall * threads / max(1, sum(counts)), 1)}), flush=True)
PY
}

# The file offset of /x (contiguous), for the disk measurements.
x_offset() { h5dump -H -p -d /x "$1" | awk '/OFFSET/ {print $2; exit}'; }

disk_rates() {  # FILE ROWS PART: sequential and random read rates of FILE's disk
  local file=$1 rows=$2 part=$3 offset dd_out
  offset=$(x_offset "$file")
  drop_caches
  dd_out=$(dd if="$file" of=/dev/null bs=4M count=1024 iflag=direct 2>&1 | tail -n 1)
  python3 -c 'import json,sys
f=sys.argv[1].split(",")
b=int(f[0].split()[0]); s=float(f[2].split()[0])
print(json.dumps({"part": sys.argv[2], "measure": "sequential", "o_direct": True, "bytes": b,
                  "seconds": s, "mb_per_s": round(b / s / 1e6, 1)}))' "$dd_out" "$part"
  for threads in 1 2 "$qd_max"; do
    drop_caches
    random_reads "$file" "$offset" "$rows" "$threads" 10 |
      python3 -c 'import json,sys; d=json.load(sys.stdin); d["part"]=sys.argv[1]; print(json.dumps(d))' "$part"
  done
}

results=$scratch/results
mkdir -p "$results"

for part in $parts; do
  case $part in
  size)
    : > "$results/size.jsonl"
    for spec in 10MB:20000 1GB:2000000 8GB:16000000; do
      name=${spec%%:*} rows=${spec#*:}
      make_file "$scratch/size-$name.h5" "$rows"
    done
    for spec in 10MB:20000 1GB:2000000 8GB:16000000; do
      name=${spec%%:*} rows=${spec#*:}
      drop_caches
      train "size-$name" \
        "{\"part\": \"size\", \"file\": \"$name\", \"rows\": $rows, \"cold_cache\": $cold, \"batch\": 128}" \
        0 "$scratch/base.toml" --set data.path="$scratch/size-$name.h5" | tee -a "$results/size.jsonl"
    done
    summary size "$results/size.jsonl"
    ;;
  fashion)
    : > "$results/fashion.jsonl"
    if [[ ! -f $scratch/fashion-train.h5 || ${KEEP:-0} != 1 ]]; then
      "$writer" fashion-mnist "$scratch/fashion-train.h5" "$scratch/fashion-test.h5" >&2
    fi
    for round in $(seq "$rounds"); do
      for source in memory hdf5; do
        args=()
        if [[ $source == hdf5 ]]; then
          args=(--set data.source=hdf5 --set data.path="$scratch/fashion-train.h5"
                --set data.test_path="$scratch/fashion-test.h5")
        fi
        train "fashion-$source-$round" \
          "{\"part\": \"fashion\", \"source\": \"$source\", \"round\": $round, \"batch\": 128}" \
          1 configs/fashion_mnist_dp.toml --set train.epochs=1 --set train.log_every=50 \
          "${args[@]}" | tee -a "$results/fashion.jsonl"
      done
    done
    summary fashion "$results/fashion.jsonl"
    ;;
  big)
    : > "$results/big.jsonl"
    make_file "$scratch/big.h5" "$big_rows"
    disk_rates "$scratch/big.h5" "$big_rows" big | tee -a "$results/big.jsonl"
    for shuffle in true blocks; do
      value=$shuffle
      [[ $shuffle == blocks ]] && value='"blocks"'
      drop_caches
      train "big-$shuffle" \
        "{\"part\": \"big\", \"shuffle\": \"$shuffle\", \"rows\": $big_rows, \"file_bytes\": $(stat -c %s "$scratch/big.h5"), \"cold_cache\": $cold, \"batch\": 128}" \
        1 "$scratch/base.toml" --set data.path="$scratch/big.h5" --set data.shuffle="$value" \
        --set train.steps="$big_steps" --set train.log_every=50 | tee -a "$results/big.jsonl"
    done
    summary big "$results/big.jsonl"
    ;;
  pattern)
    # meshtrain's read patterns replayed by one Python reader (buffered preads of a 512-byte
    # row and its 4-byte label, as one rank's reader thread does) on the big file from a
    # cold cache: rows (shuffle = true) and blocks (8 blocks of 1024 rows, rows shuffled in
    # the window), with the kernel's default readahead, with POSIX_FADV_RANDOM, and
    # (blocks) with POSIX_FADV_WILLNEED on each block when its window starts.
    : > "$results/pattern.jsonl"
    make_file "$scratch/big.h5" "$big_rows"
    xoff=$(x_offset "$scratch/big.h5")
    yoff=$(h5dump -H -p -d /y "$scratch/big.h5" | awk '/OFFSET/ {print $2; exit}')
    for spec in rows:none rows:random blocks:none blocks:random blocks:willneed; do
      drop_caches
      python3 - "$scratch/big.h5" "$xoff" "$yoff" "$big_rows" "${spec%:*}" "${spec#*:}" 65536 \
        "$DATA_STREAM_DISK_STAT" "$cold" <<'PY' | tee -a "$results/pattern.jsonl"
import json, os, random, sys, time
path, xoff, yoff, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mode, advice, count, stat_path, cold = sys.argv[5], sys.argv[6], int(sys.argv[7]), sys.argv[8], sys.argv[9]
def disk():
    if not os.path.exists(stat_path):
        return (0, 0)
    f = open(stat_path).read().split()
    return int(f[0]), int(f[2])
fd = os.open(path, os.O_RDONLY)
if advice != "none":
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
rng = random.Random(1)
block, window = 1024, 8
before, start, done = disk(), time.monotonic(), 0
while done < count:
    if mode == "rows":
        order = [rng.randrange(rows) for _ in range(block * window)]
    else:
        blocks = [rng.randrange(rows // block) for _ in range(window)]
        if advice == "willneed":
            for b in blocks:
                os.posix_fadvise(fd, xoff + 512 * block * b, 512 * block, os.POSIX_FADV_WILLNEED)
                os.posix_fadvise(fd, yoff + 4 * block * b, 4 * block, os.POSIX_FADV_WILLNEED)
        order = [b * block + i for b in blocks for i in range(block)]
        rng.shuffle(order)
    for r in order[: count - done]:
        os.pread(fd, 512, xoff + 512 * r)
        os.pread(fd, 4, yoff + 4 * r)
    done += min(len(order), count - done)
seconds, after = time.monotonic() - start, disk()
print(json.dumps({"part": "pattern", "order": mode, "advice": advice, "rows": count,
                  "cold_cache": cold == "true", "rows_per_s": round(count / seconds, 0),
                  "disk_reads": after[0] - before[0],
                  "disk_read_mib": round((after[1] - before[1]) / 2048, 1),
                  "needed_mib": round(count * 516 / 2**20, 1)}), flush=True)
PY
    done
    ;;
  gzip)
    : > "$results/gzip.jsonl"
    make_file "$scratch/gzip-1GB.h5" 2000000 --chunk-rows 1024 --gzip 4 --shuffle-filter
    for shuffle in true blocks; do
      value=$shuffle steps=$gzip_steps
      [[ $shuffle == blocks ]] && value='"blocks"' steps=$gzip_blocks_steps
      drop_caches
      train "gzip-$shuffle" \
        "{\"part\": \"gzip\", \"shuffle\": \"$shuffle\", \"rows\": 2000000, \"file_bytes\": $(stat -c %s "$scratch/gzip-1GB.h5"), \"cold_cache\": $cold, \"batch\": 128}" \
        1 "$scratch/base.toml" --set data.path="$scratch/gzip-1GB.h5" --set data.shuffle="$value" \
        --set train.steps="$steps" --set train.log_every=10 | tee -a "$results/gzip.jsonl"
    done
    summary gzip "$results/gzip.jsonl"
    ;;
  *) echo "data_stream: unknown part '$part' (size fashion big pattern gzip)" >&2; exit 2 ;;
  esac
done

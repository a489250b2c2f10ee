#!/usr/bin/env bash
# Why residual blocks matter: Fashion-MNIST, a residual_mlp of DEPTH pre-norm RMSNorm blocks
# (width 256, hidden 256, activation ACT) against the plain mlp of DEPTH hidden layers of 256
# (sizes [784, 256 x DEPTH, 10], activation ACT), same optimizer (configs/fashion_mnist_dp.toml:
# adamw lr 1e-3, cosine to 1e-5, batch 128), same epochs, dp over NP ranks. One JSON line per
# model: final and best test accuracy (evaluated every epoch) and the wall time.
#
#   [MESHTRAIN=build/bin/meshtrain] bench/residual_vs_plain_accuracy.sh [EPOCHS] [NP] [DEPTH] [ACT]
#       defaults: 3 2 16 relu
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
epochs=${1:-3}
np=${2:-2}
depth=${3:-16}
act=${4:-relu}
meshtrain=${MESHTRAIN:-build/bin/meshtrain}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

sizes="784"
for ((i = 0; i < depth; i++)); do sizes+=", 256"; done
sizes+=", 10"

# The model section differs; everything else is configs/fashion_mnist_dp.toml's.
write_config() {  # NAME MODEL_TOML FILE
  cat > "$3" <<TOML
[run]
name = "$1"
seed = 0
output_dir = "$work/$1"
[mesh]
dp = -1
[partition]
preset = "dp"
min_sharding_size = 0
[model]
$2
init = "he_normal"
loss = "cross_entropy"
[data]
source = "fashion_mnist"
path = "/usr/share/datasets/fashion-mnist"
batch_size = 128
shuffle = true
[optimizer]
kind = "adamw"
lr = 1e-3
schedule = "cosine"
min_lr = 1e-5
betas = [0.9, 0.999]
eps = 1e-8
weight_decay = 0.0
clip_norm = 0.0
[train]
epochs = $epochs
log_every = 100
eval_every = 468
[checkpoint]
every_steps = 0
keep = 1
TOML
}

write_config residual "kind = \"residual_mlp\"
inputs = 784
outputs = 10
width = 256
hidden = 256
depth = $depth
norm = \"rmsnorm\"
activation = \"$act\"" "$work/residual.toml"
write_config plain "kind = \"mlp\"
sizes = [$sizes]
activation = \"$act\"" "$work/plain.toml"

for name in residual plain; do
  start=$(date +%s.%N)
  $mpirun -np "$np" "$meshtrain" train "$work/$name.toml" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; exit 1; }
  end=$(date +%s.%N)
  python3 - "$work/$name/metrics.jsonl" "$name" "$depth" "$act" "$epochs" "$np" "$start" "$end" <<'PY'
import json, sys
path, name, depth, act, epochs, np_, start, end = sys.argv[1:]
accs = []
for line in open(path):
    rec = json.loads(line)
    if "test_accuracy" in rec:
        accs.append(rec["test_accuracy"])
if not accs:
    sys.exit(f"{path}: no test_accuracy record")
print(json.dumps({"bench": "residual_vs_plain_accuracy", "model": name, "depth": int(depth),
                  "width": 256, "activation": act, "norm": "rmsnorm" if name == "residual" else "none",
                  "epochs": int(epochs), "np": int(np_), "mode": "dp",
                  "test_accuracy_per_epoch": accs, "final_test_accuracy": accs[-1],
                  "best_test_accuracy": max(accs), "wall_s": round(float(end) - float(start), 1)}),
      flush=True)
PY
done

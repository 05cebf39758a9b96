#!/usr/bin/env bash
# Installs servelab's core (bench, diagnose, compare, report, export, sim: no torch of its own)
# into the vLLM peer's venv, as a user would into the environment that serves their model, and
# proves that vLLM's torch and every other package already there kept their versions: the
# install runs under a constraints file of the venv's own `pip freeze`, so pip either adds only
# what is missing or fails, naming the conflict, before changing anything.
# With --bench it then starts vLLM's CPU server from that venv (benchmarks/peers/servers.py's
# command, on the default model exported as an HF directory) and benches it with the servelab
# installed beside it; prompt lengths come from vLLM's own /tokenize (the venv has no local
# tokenizer for the served name).
#
#   bash benchmarks/peers/install_servelab_into_vllm_env.sh [--bench] [VENV] [WHEEL]
#
# VENV: default .venv-peers/vllm (benchmarks/peers/install.sh). WHEEL: a built servelab wheel;
# default: this source tree (pip builds it). --bench needs the repository's .venv (`make
# install`: it exports the model to runs/vllm-env/smollm2-hf unless that exists) and takes a
# few minutes on 2 cores (vLLM's start-up).
set -euo pipefail
unset PYTHONPATH  # the venv must see the servelab it installed, never these sources
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bench=0
if [ "${1:-}" = --bench ]; then
	bench=1
	shift
fi
venv=${1:-$root/.venv-peers/vllm}
what=${2:-$root}
py=$venv/bin/python
[ -x "$py" ] || { echo "no venv at $venv: run benchmarks/peers/install.sh first" >&2; exit 2; }
log=$venv/servelab-install.log
torch_version() { "$py" -c "import torch; print(torch.__version__)"; }

if [ -d "$what" ]; then  # build the wheel first: the env's pins are for what gets installed
	wheels=$(mktemp -d)
	"$py" -m pip wheel -q --no-deps -w "$wheels" "$what" >"$log" 2>&1 || { tail -n 15 "$log"; exit 1; }
	what=$(ls "$wheels"/servelab-*.whl)
fi
before=$(torch_version)
# the venv's own versions as constraints (plain name==version lines: pip takes no URLs there)
freeze() { "$py" -m pip freeze --all | grep -E '^[A-Za-z0-9_.-]+==' | LC_ALL=C sort; }
freeze >"$venv/servelab-constraints.txt"
cp "$venv/servelab-constraints.txt" "$venv/pre-servelab-freeze.txt"
echo "== installing servelab core into $venv (torch $before stays)"
t0=$SECONDS
if ! "$py" -m pip install -q -c "$venv/servelab-constraints.txt" "$what" >>"$log" 2>&1; then
	grep -v "is ignored" "$log" | tail -n 15
	echo "servelab could not be installed beside this environment's pins (see $log)" >&2
	exit 1
fi
after=$(torch_version)
freeze >"$venv/post-servelab-freeze.txt"
changed=$(comm -23 "$venv/pre-servelab-freeze.txt" "$venv/post-servelab-freeze.txt" || true)
added=$(comm -13 "$venv/pre-servelab-freeze.txt" "$venv/post-servelab-freeze.txt" | tr '\n' ' ')
echo "installed servelab $("$venv/bin/servelab" --version) in $((SECONDS - t0)) s; added: $added"
[ "$before" = "$after" ] || { echo "torch changed: $before -> $after" >&2; exit 1; }
[ -z "$changed" ] || { echo "packages changed or removed: $changed" >&2; exit 1; }
echo "torch unchanged ($after); no package already there changed"
"$venv/bin/servelab" --version >/dev/null
"$py" -c "import vllm, servelab.bench.run; print('vllm', vllm.__version__, 'and servelab import side by side')"

[ "$bench" = 1 ] || exit 0
model=$root/runs/vllm-env/smollm2-hf
out=$root/runs/vllm-env/bench
[ -d "$model" ] || "$root/.venv/bin/servelab" export-hf --model smollm2-135m "$model"
port=$("$py" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
echo "== vLLM on 127.0.0.1:$port from $venv"
VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 "$py" -m vllm.entrypoints.openai.api_server \
	--model "$model" --served-model-name smollm2-135m --host 127.0.0.1 --port "$port" \
	--enforce-eager >"$root/runs/vllm-env/vllm.log" 2>&1 &
vllm_pid=$!
trap 'kill $vllm_pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
	"$py" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/v1/models', timeout=2)" 2>/dev/null && break
	kill -0 $vllm_pid 2>/dev/null || { tail -20 "$root/runs/vllm-env/vllm.log"; exit 1; }
	sleep 1
done
rm -rf "$out"
rc=0
"$venv/bin/servelab" bench --url "http://127.0.0.1:$port" --model smollm2-135m --workload chat \
	--requests 10 --concurrency 2 --out "$out" || rc=$?
echo "torch after the run: $(torch_version) (before: $before)"
# 3: the run is written, but the client fell behind (vLLM and the client share the cores)
[ "$rc" = 0 ] || [ "$rc" = 3 ]

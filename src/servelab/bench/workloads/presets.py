"""Built-in workload presets, sized for a small model on a 2-core CPU (inputs up to ~2k tokens).

Scale every token length with ``--length-scale`` for a bigger target. Each preset is a
plain spec dict, validated by ``workload.parse_workload`` like a user's file.
"""

from __future__ import annotations

from typing import Any

_CHAT: dict[str, Any] = {
    "name": "chat",
    "weight": 1,
    "input": {"dist": "lognormal", "mean": 220, "sigma": 0.7, "min": 16, "max": 1536},
    "output": {"dist": "lognormal", "mean": 96, "sigma": 0.6, "min": 8, "max": 384},
    "prefix": [{"name": "system", "count": 1, "tokens": 48, "reuse": 1.0}],
    "session": {
        "turns": {"dist": "uniform", "min": 1, "max": 3},
        "think_time": {"dist": "exponential", "mean": "1s", "max": "5s"},
    },
    "slo": {"ttft": "3s", "itl": "500ms"},
}

_RAG: dict[str, Any] = {
    "name": "rag",
    "weight": 1,
    "text": "question",
    "input": {"dist": "uniform", "min": 24, "max": 96},
    "output": {"dist": "uniform", "min": 16, "max": 64},
    "prefix": [
        {"name": "system", "count": 1, "tokens": 96, "reuse": 1.0},
        {
            "name": "document",
            "count": 8,
            "tokens": {"dist": "uniform", "min": 512, "max": 1536},
            "reuse": 0.8,
        },
    ],
    "slo": {"ttft": "6s", "itl": "500ms"},
}

_CODEGEN: dict[str, Any] = {
    "name": "codegen",
    "weight": 1,
    "text": "code",
    "input": {"dist": "uniform", "min": 128, "max": 512},
    "output": {"dist": "normal", "mean": 320, "std": 96, "min": 96, "max": 640},
    "slo": {"ttft": "4s", "tpot": "300ms"},
}

_AGENT: dict[str, Any] = {
    "name": "agent",
    "weight": 1,
    "input": {"dist": "normal", "mean": 256, "std": 64, "min": 64, "max": 512},
    "output": {"dist": "normal", "mean": 256, "std": 64, "min": 64, "max": 512},
    "prefix": [{"name": "tools", "count": 2, "tokens": 384, "reuse": 1.0}],
    "session": {
        "turns": {"dist": "uniform", "min": 2, "max": 4},
        "think_time": {"dist": "fixed", "value": "500ms"},
    },
    "slo": {"ttft": "5s", "tpot": "300ms"},
}

_BATCH: dict[str, Any] = {
    "name": "batch",
    "weight": 1,
    "input": {"dist": "uniform", "min": 256, "max": 1024},
    "output": {"dist": "uniform", "min": 64, "max": 256},
    "stream": False,
    "priority": 1,
    "slo": {"e2e": "120s"},
}

PRESETS: dict[str, dict[str, Any]] = {
    "chat": {
        "name": "chat",
        "description": "conversations: inputs and outputs both vary; short multi-turn sessions",
        "classes": [_CHAT],
    },
    "rag": {
        "name": "rag",
        "description": "long inputs from shared system prompts and documents, short answers",
        "classes": [_RAG],
    },
    "codegen": {
        "name": "codegen",
        "description": "moderate code inputs, long outputs",
        "classes": [_CODEGEN],
    },
    "agent": {
        "name": "agent",
        "description": "tool-using agent: shared tool prompt, multi-turn, long outputs",
        "classes": [_AGENT],
    },
    "batch": {
        "name": "batch",
        "description": "throughput-oriented offline jobs: no streaming, only an e2e SLO",
        "classes": [_BATCH],
    },
    "mixed": {
        "name": "mixed",
        "description": "a weighted blend: chat 50%, rag 30%, codegen 20%",
        "classes": [
            {**_CHAT, "weight": 5},
            {**_RAG, "weight": 3},
            {**_CODEGEN, "weight": 2},
        ],
    },
}

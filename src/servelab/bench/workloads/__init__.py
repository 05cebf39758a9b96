"""What is sent and when: the workload spec, presets, prompts, traces, arrivals, the plan.

``spec`` is the declarative workload (YAML or TOML); ``presets`` the built-in ones; ``corpus``
and ``prompts`` the text of exact token lengths; ``traces`` the public traces
(``traces_data/``); ``arrivals`` the open-loop send times; ``request_plan`` every request of a
run, planned up front from a seed. Datasets (ShareGPT, Hugging Face) are ``bench.datasets``.
"""

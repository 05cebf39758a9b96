"""The discrete-event loop and what it moves: clients, a network, a router, engine replicas.

``simulation`` is the loop; ``sim_requests`` turns a plan or a trace into its requests;
``history`` resends multi-turn history as text; ``links`` carries KV between prefill and
decode replicas; ``sampled_proposals`` gives drafts in only some steps, as real text does.
"""

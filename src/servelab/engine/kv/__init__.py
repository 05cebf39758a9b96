"""The paged KV cache's policy: blocks, block tables, reference counts and prefix caching.

``kv_cache_plain`` states the policy plainly; ``kv_cache`` is the same policy, fast (deferred
hashing, ``block_chain``'s chains and groups, ``cached_queue``'s LRU of cached blocks), and the
tests prove the two equal. No torch: the simulator runs it unchanged.
"""

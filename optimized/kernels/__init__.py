"""Triton kernels of the production path, each the fast twin of one ``reference/`` op, under the same name.

| module | op(s) | reference twin | docs/method.md |
|---|---|---|---|
| ``sampling`` | ``hash_uniform``, ``sample`` | ``reference/sampling.py`` | random-number contract |
| ``verify`` | ``rejection_sample``, ``greedy_verify``, ``advance_anchors`` | ``reference/verify.py`` | §4 |
| ``allocate`` | ``allocate_top_b`` (rank counting; torch sort fallback) | ``reference/scheduler.py`` | §5 |
| ``draft_head`` | ``sample_draft_block``, ``sample_block`` | ``DSparkDrafter.sample_block`` | §1 |
| ``attention`` | ``varlen_attention`` | naive attention | §1, §4 |
| ``layer_ops`` | ``rms_norm``, ``rope_append_kv``, ``silu_mul`` | their torch definitions (HF's rounding) | §1, §4 |
| ``linear`` | ``norm_linear``, ``linear`` (few-row projections) | torch layer ops + ``F.linear`` | §1, §4 |
| ``layout`` | ``verify_layout``, ``draft_load``, ``draft_store`` | their ``*_torch`` definitions | §4 |
| ``distill_loss`` | ``distill_rows`` (the training loss's per-row work) | ``distill_rows_torch`` | §2 |
| ``common`` | Triton building blocks: the contract's hash, the race | ``reference/sampling.py`` | random numbers |

Every op takes ``backend="auto" | "triton" | "torch"``; the torch fallback has the same signature. Import the
ops from their modules: this package imports nothing eagerly, so modules that keep Triton optional (attention)
stay importable without it.
"""

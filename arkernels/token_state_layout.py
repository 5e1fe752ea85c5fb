"""The token_state word: one int32 per (history row, vocabulary column), the token rules' history on the device.

Defined here once, as plain ints, for every reader: ``arkernels/triton/sampling.py`` wraps them in ``tl.constexpr``
for its kernels, ``arkernels/ops/sampling.py`` builds and updates the table (``token_state``,
``update_token_state``), ``arkernels/ops/sampling_cpu.py`` runs the CPU rules, ``arkernels/hf/sampler_hook.py`` marks
prompt tokens. The schema comment in ``csrc/torch_bindings.cpp`` and the ``token_state`` docstring state the same
bits in words (tests/test_sampling_penalties.py checks that they agree).

    bits 0-23  count of generated occurrences; saturates at COUNT_MAX (2**24 - 1: exact in fp32, so
               frequency * count is exact)
    bit 24     PROMPT_BIT: the token occurs in the row's prompt
    bit 25     BAN_BIT: banned (bad_words_ids of one token, suppress_tokens)
    bit 26     EOS_BIT: an EOS id, masked while the row has fewer than min_new_tokens new tokens
    bits 27-31 unused (0)
"""

COUNT_BITS = 24
COUNT_MASK = (1 << COUNT_BITS) - 1  # bits 0-23: the count of generated occurrences
COUNT_MAX = COUNT_MASK  # counts saturate here instead of spilling into the flag bits
PROMPT_BIT = 1 << COUNT_BITS  # bit 24
BAN_BIT = 1 << 25
EOS_BIT = 1 << 26
SEEN_MASK = COUNT_MASK | PROMPT_BIT  # generated or in the prompt: the repetition penalty applies

// window_attention's visibility rule, written once for host code (the CPU kernel), device code (both CUDA kernels)
// and the SIMT emulator. No dependencies beyond int_math.h.
//
// Key j is visible to the query at absolute position i of a sequence whose first real position is
// s = max(kv_start, 0) iff  first_key <= j <= i  (and j is inside the sequence and the block table), with
//   first_key = max(s, i - window + 1 if window > 0, s + (i - s) / chunk * chunk if chunk > 0):
// window W: the W keys up to and including i (transformers, vLLM, FlashAttention); chunk C (Llama 4's
// attention_chunk_size): only keys of i's chunk, chunks of C positions counted from the first real token, which is
// transformers' chunked mask with left padding: (j - pad) // C == (i - pad) // C.
#pragma once

#include "int_math.h"

namespace arkernels {

// I: int (prefill: positions are int32 by source) or int64_t (decode).
template <typename I>
AK_HOST_DEVICE inline I window_attention_first_key(I i, I kv_start, I window, I chunk) {
  const I s = kv_start > 0 ? kv_start : I(0);
  I lo = s;
  // FAULT(window_lo)
  if (window > 0 && i - window + 1 > lo) lo = i - window + 1;
  if (chunk > 0 && i > s) {  // i < s: nothing is visible anyway (lo = s > i)
    // FAULT(chunk_lo)
    const I c = s + (i - s) / chunk * chunk;
    if (c > lo) lo = c;
  }
  return lo;
}

}  // namespace arkernels

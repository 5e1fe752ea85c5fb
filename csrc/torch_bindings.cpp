// Table of contents: every arkernels op's schema, written once. CPU kernels live in csrc/<stem>_cpu.cpp,
// CUDA kernels in csrc/<stem>.cu (both register with TORCH_LIBRARY_IMPL); Triton ops register their
// CUDA (and CPU) implementations from arkernels/ops/<stem>.py; fakes for torch.compile live there too.
// `Tensor(a!)` marks what an op writes.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(arkernels, m) {
  // ---- paged_kv: paged KV cache, layout [num_blocks, block_size, num_kv_heads, head_dim] (vLLM/FlashInfer NHD) ----
  // key/value [num_tokens, num_kv_heads, head_dim] (strided ok) -> caches at slot_mapping[n <= num_tokens]
  // (int32|int64; slot = block * block_size + offset; slot < 0: padding, skipped; slot past the cache: never written).
  // fp8 caches (float8_e4m3fn; key/value fp32|fp16|bf16): k_scale, v_scale fp32 [1] on the cache's device, required
  // iff the cache is fp8 (vLLM's convention): stored = saturate_e4m3(key / k_scale) (RNE, clamped to +-448).
  m.def("paged_kv_append(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // block_table int32 [batch, max_blocks], seq_lens int32 [batch] -> (key, value) [batch, num_kv_heads, max_seq_len, head_dim],
  // zero past each sequence's length. Moves bytes: an fp8 cache gives fp8 rows (the Python wrapper dequantizes).
  m.def("paged_kv_gather(Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, SymInt max_seq_len) -> (Tensor, Tensor)");

  // ---- window_attention: causal (sliding-window) attention over the paged cache, GQA ----
  // query [batch, Hq, D] (decode: cu_seqlens_q None) or [total_q, Hq, D] with cu_seqlens_q int32 [batch + 1]
  // (sequence b's queries are its last q_len_b positions); caches [num_blocks, block_size, Hkv, D] (any strides,
  // last dim contiguous); kv_start int32 [batch]? (keys j < kv_start[b] are masked: left padding; None: 0);
  // window 0: full causal, W > 0: keys i-W < j <= i; softcap 0: off.
  // -> (out like query, lse fp32 [num_queries, Hq]); a query with no visible key gives zeros and lse -inf.
  // fp8 caches (float8_e4m3fn, query fp32|fp16|bf16): key = stored * k_scale, value = stored * v_scale, scales fp32 [1]
  // on the cache's device, required iff the cache is fp8.
  // sinks fp32 [Hq]? (gpt-oss attention sinks: one logit per query head, neither scaled nor softcapped, in every
  // query's softmax denominator, no value; lse includes it, FlashInfer's convention; a query with no visible key gets
  // zeros and lse = sinks[h]); chunk_size 0: off, C > 0: only keys of the query's chunk of C positions, counted from
  // max(kv_start[b], 0) (Llama 4 chunked attention, transformers' rule with left padding).
  m.def("window_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor? cu_seqlens_q, Tensor? kv_start, int max_q_len, int window, float scale, float softcap, "
        "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None, int chunk_size=0) -> (Tensor, Tensor)");

  // ---- sampling: temperature -> top-k -> top-p -> min-p -> draw, from logits, no full sort ----
  // Token rules, applied to the logits before temperature, in the same passes (all None: off):
  // logit_bias fp32 [N, vocab]? added first (-inf: banned); token_state int32 [N, vocab]? one word per (history row,
  // token): bits 0-23 the count of generated occurrences, bit 24 in the prompt, bit 25 banned, bit 26 an EOS id
  // (masked while the row has fewer than min_new_tokens new tokens); history int64 [batch, 3]: (the row's history
  // row, < 0 or >= N: no rules; new tokens so far; min_new_tokens), required with logit_bias or token_state;
  // penalties fp32 [batch, 3]?: (repetition, 1: off; frequency, presence, 0: off). Order: bias, repetition
  // (prompt + generated), frequency, presence (generated), bans and EOS masks.
  m.def("sampling_rules(Tensor logits, Tensor? token_state, Tensor? history, Tensor? penalties, Tensor? logit_bias) -> Tensor");
  // sampling_probs / sample: logits [batch, vocab] fp32|fp16|bf16 (rows may be strided); temperature fp32 [batch] (0: greedy),
  // top_k int32 [batch] (0: off), top_p fp32 [batch] (1: off), min_p fp32 [batch] (0: off)
  // -> filtered, renormalised fp32 probabilities [batch, vocab].
  m.def("sampling_probs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
        "Tensor? token_state=None, Tensor? history=None, Tensor? penalties=None, Tensor? logit_bias=None) -> Tensor");
  // seed, step int64 [batch]: each row's random stream is keyed on (seed, step, vocab column), never on the
  // row's index -> (ids int64 [batch] in [0, vocab), valid bool [batch]: False for a row with no finite logit).
  m.def("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seed, Tensor step, "
        "Tensor? token_state=None, Tensor? history=None, Tensor? penalties=None, Tensor? logit_bias=None) -> (Tensor, Tensor)");

  // ---- spec_sampling: speculative sampling (Leviathan et al. / Chen et al.), one chain of k drafts per row ----
  // target_logits [batch, k+1, vocab] fp32|fp16|bf16 (strided ok); draft_logits [batch, k, vocab]? (None: a one-hot
  // draft, q(draft_ids) = 1: prompt lookup); draft_ids int64 [batch, k] (the proposed tokens; outside [0, vocab):
  // never accepted); temperature .. step, token rules: as `sample`'s, applied at position j as after accepting
  // drafts 0..j-1 (their counts added, j more new tokens). Accept draft j iff u_j * q_j(t_j) < p_j(t_j); at the first
  // rejection draw from max(0, p_j - q_j), after k acceptances from p_k; temperature 0: accept iff t_j is the argmax.
  // -> (tokens int64 [batch, k+1]: accepted drafts then the drawn token, -1 after; accepted int64 [batch] in [0, k];
  // valid bool [batch]: False when the drawing position has no finite target logit, its token then 0).
  m.def("chain_speculative_sampling(Tensor target_logits, Tensor? draft_logits, Tensor draft_ids, Tensor temperature, "
        "Tensor top_k, Tensor top_p, Tensor min_p, Tensor seed, Tensor step, Tensor? token_state=None, "
        "Tensor? history=None, Tensor? penalties=None, Tensor? logit_bias=None) -> (Tensor, Tensor, Tensor)");

  // ---- int8_matmul: symmetric int8 quantization and matmul (F.linear convention: a @ b.T) ----
  // x [M, K] fp32|fp16|bf16 -> (x_int8 [M, K], scale fp32 [M]); per row (per token, or per output channel of a weight).
  m.def("quantize_rowwise(Tensor x) -> (Tensor, Tensor)");
  // a int8 [M, K], b int8 [N, K] -> int32 [M, N] exact without scales; with a_scale fp32 [M], b_scale fp32 [N],
  // bias [N]?: acc * a_scale[m] * b_scale[n] + bias in fp32, cast to out_dtype (default bf16).
  m.def("int8_matmul(Tensor a, Tensor b, Tensor? a_scale, Tensor? b_scale, Tensor? bias, ScalarType? out_dtype) -> Tensor");
  // x fp16|bf16 [M, K], w int8 [N, K] (plain) or [N, K / 16, 16] (packed: tile order, ops/int8_matmul_layout.py),
  // w_scale fp32 [N], bias [N]? -> [M, N] in x's dtype; weights dequantised in registers.
  m.def("w8a16_matmul(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor");
  // The hand-written decode GEMV (csrc/int8_matmul.cu): x [M, K] fp16|bf16 (fp32: CPU only; M <= 16 is its case,
  // larger M runs as 16-row slices), w int8 [N, K / 16, 4, 4] (the fragment layout: mma B-fragment order,
  // ops/int8_matmul_layout.py), w_scale fp32 [N], bias [N]? fp32|fp16|bf16 -> [M, N] in x's dtype; deterministic.
  m.def("w8a16_fragment_matmul(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor");
}

// `import arkernels._C` loads this library (and so registers the ops); the module itself is empty.
static struct PyModuleDef arkernels_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&arkernels_module); }

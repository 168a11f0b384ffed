// The one place where specops op schemas are defined. Implementations register per device:
// csrc/cpu/<op>.cpp (CPU), specops/kernels/<op>.py (Triton, CUDA), specops/ops/<family>.py (fake).
#include <Python.h>
#include <torch/library.h>

#include "cpu/isa.h"

namespace specops {
const char* int8_dot_isa_name();  // cpu/int8_linear.cpp
}

// specops._C is imported as a Python module only so that loading it runs the registrations below;
// it exposes nothing itself (ops are reached through torch.ops.specops).
namespace {
// specops._C.cpu_isa(): the instruction set the C++ kernels take ("avx512", "avx2" or "base"; cpu/isa.h).
PyObject* cpu_isa_name(PyObject*, PyObject*) { return PyUnicode_FromString(specops::isa_name(specops::cpu_isa())); }
// specops._C.int8_dot_isa(): the copy int8_linear takes ("avx512_vnni", "avx2" or "base"; cpu/int8_linear.cpp).
PyObject* int8_dot_isa(PyObject*, PyObject*) { return PyUnicode_FromString(specops::int8_dot_isa_name()); }
PyMethodDef methods[] = {{"cpu_isa", cpu_isa_name, METH_NOARGS, "the instruction set the C++ kernels take"},
                         {"int8_dot_isa", int8_dot_isa, METH_NOARGS, "the copy int8_linear takes"},
                         {nullptr, nullptr, 0, nullptr}};
}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(specops, m) {
  // Each op's fake (meta) implementation lives in its family's module of specops/ops/.
  m.set_python_module("specops.ops.sampling");
  // Chain speculative-sampling verification: accept drafts with min(1, p/q), then a recovered
  // token from norm(max(0, p - q)) or a bonus token from p; scheme "block" decides the accepted prefix
  // jointly (block verification). Returns (out_tokens, num_accepted).
  // offset is a SymInt so that torch.compile does not specialize (and recompile) on each step.
  // validate: check every value where that needs no host sync (CPU); accelerators check in Python.
  m.def(
      "chain_verify(Tensor target_logits, Tensor draft_tokens, Tensor? draft_probs, "
      "Tensor num_draft, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
      "SymInt offset, bool validate=True, str scheme=\"token\") -> (Tensor, Tensor)");
  // Recursive rejection sampling over a draft tree (RSD; SpecInfer's with replacement=True): children
  // tried in node order, residual target and (without replacement) renormalized draft after each
  // rejection, a token from the current target where no child is accepted. scheme "traversal" verifies
  // the tree from its leaves to the root instead (traversal verification).
  // Returns (out_tokens, out_nodes, num_accepted).
  m.def(
      "tree_verify(Tensor target_logits, Tensor tokens, Tensor parents, Tensor? draft_probs, Tensor num_nodes, "
      "bool replacement, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, SymInt offset, "
      "bool validate=True, str scheme=\"recursive\") -> (Tensor, Tensor, Tensor)");
  // Sampling without replacement: num_samples distinct tokens per row in draw order from the filtered
  // softmax, and that softmax (q). Returns (tokens [N, num_samples], probs [N, V]).
  m.def(
      "sample_without_replacement(Tensor logits, int num_samples, Tensor temperature, Tensor top_k, "
      "Tensor top_p, Tensor seed, SymInt offset, bool validate=True) -> (Tensor, Tensor)");
  // One level of Stochastic Beam Search (RSD-S): each live beam's children drawn without replacement
  // with truncated-Gumbel scores, the beam_width best over all beams kept.
  // Returns (parents [B, K], tokens [B, K], log_probs [B, K], scores [B, K], probs [B, W, V]).
  m.def(
      "stochastic_beam_step(Tensor logits, Tensor beam_log_probs, Tensor beam_scores, int beam_width, "
      "Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, SymInt offset, bool validate=True) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.set_python_module("specops.ops.ngram");
  // Context n-gram drafts: top k continuations of earlier matches of each row's last tokens.
  m.def(
      "ngram_match(Tensor tokens, Tensor lengths, int min_ngram, int max_ngram, int num_candidates, "
      "int width, bool validate=True) -> (Tensor, Tensor, Tensor)");
  // The n-gram memory's index: end positions of a token store sorted by the tokens before them, in levels laid
  // out in a buffer oldest first (their sizes). insert: new positions join as the newest level, merged with
  // the newest levels they outgrow, in place at the buffer's tail.
  m.def(
      "ngram_memory_insert(Tensor tokens, Tensor(a!) entries, int[] levels, Tensor positions, int depth, "
      "bool validate=True) -> ()");
  // lookup: each row's longest match in the memory and the top continuations among its occurrences.
  // Returns (candidates [B, k, width], counts [B, k], latest [B, k], match [B], occurrences [B]).
  m.def(
      "ngram_memory_lookup(Tensor tokens, Tensor entries, int[] levels, Tensor contexts, Tensor lengths, int depth, "
      "int min_match, int num_candidates, int width, int max_occurrences, bool validate=True) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.set_python_module("specops.ops.sampling");
  // Heterogeneous drafters (TLI): the drafter's distribution restricted to the tokens it shares with
  // the target, renormalized, in target ids, and a draft sampled from it.
  // Returns (probs [N, target_vocab], tokens in target ids, tokens in drafter ids).
  m.def(
      "vocab_project(Tensor draft_logits, Tensor target_ids, int target_vocab, Tensor temperature, "
      "Tensor top_k, Tensor top_p, Tensor seed, SymInt offset, bool validate=True) -> (Tensor, Tensor, Tensor)");
  m.set_python_module("specops.ops.ensemble");
  // The logits of an ensemble of models (speculative ensembles): mode 0 weighted, log sum_i w_i softmax(l_i);
  // mode 1 contrastive, (l_1 - max l_1) - mu (l_2 - max l_2) on the expert's tokens of probability at least
  // alpha times its largest (alpha 0: no cut). members [..., V] each; returns [..., V] float32.
  m.def("ensemble_logits(Tensor[] members, Tensor weights, int mode, float mu, float alpha, bool validate=True) "
        "-> Tensor");
  m.set_python_module("specops.ops.linear");
  // A linear layer over the few rows a decoding forward carries: input [M, K] @ weight[N, K]^T + bias,
  // the weight read once whatever M is (BLAS re-reads it per few rows when M is small).
  m.def("skinny_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  // skinny_linear with the weight stored in low precision (bfloat16; int8 with per-group scales; int4 packed two
  // per uint8 byte with per-group scales and minimums), de-quantized as it is read; float32 activations.
  m.def("quantized_linear(Tensor input, Tensor weight, Tensor? scales, Tensor? mins, Tensor? bias) -> Tensor");
  // int8 input [M, K] times int8 weight [N, K]^T with exact integer sums, each output scaled by its input row's
  // and its weight row's float32 scale (both operands quantized: the int8 screen of a greedy step's head).
  m.def("int8_linear(Tensor input, Tensor input_scales, Tensor weight, Tensor weight_scales) -> Tensor");
  // The decoder layers of a Llama-family model (RMSNorm pre-norm, rotary attention over a KV cache, SiLU-gated
  // MLP) for the few rows of a CPU decoding forward in one call. linears: per layer the q, k, v, o, gate, up
  // and down projections as (weight, scales, mins, bias), float32 or quantized_linear's formats; a slot
  // without a weight is fused into the one before. keys / values: each layer's cache [B, Hkv, past + n, D],
  // its last n slots room that the op fills with the new rows' keys and values. Returns the hidden rows.
  // Gemma-3 and Qwen3: qk_norms (per layer a q and a k norm over each head), 4 norms per layer (the
  // attention's and the MLP's outputs normed too), norm_offset (1: norms scale by 1 + w), activation
  // "gelu_tanh", and local_layers reading local_cos, local_sin and local_mask (sliding windows).
  m.def(
      "llama_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor? attn_mask, Tensor[] norms, Tensor?[] linears, "
      "Tensor(a!)[] keys, Tensor(b!)[] values, int heads, int kv_heads, float eps, float scale, "
      "Tensor[]? qk_norms=None, float norm_offset=0., str activation=\"silu\", int[] local_layers=[], "
      "Tensor? local_cos=None, Tensor? local_sin=None, Tensor? local_mask=None) -> Tensor");
  m.set_python_module("specops.ops.attention");
  // Attention of draft-tree nodes over a KV-cached prefix and the tree: node i sees the valid prefix
  // slots and the nodes set in its row of the bit-packed ancestor mask. window 0 and softcap 0 are off.
  m.def(
      "tree_attention(Tensor query, Tensor key, Tensor value, Tensor tree_mask, Tensor kv_mask, float scale, "
      "int window, float softcap, Tensor? sinks, bool validate=True) -> Tensor");
}

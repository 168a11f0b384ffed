// tree_attention on the CPU: attention of draft-tree nodes over a KV-cached prefix and the tree, under a
// bit-packed ancestor mask (RSD's tree attention, paper 003 Alg 5). Semantics: specops/reference.py.
//
// One task per (request, key/value head, split of the keys): the query rows of every head that shares
// the key/value head (grouped-query attention) form one [G*N, D] block, so each key and value is read
// once per task. Keys go by in tiles: scores = Q K^T and acc += P V are BLAS products (at::mm on float32
// tiles; bfloat16 / float16 inputs are converted tile by tile), and between them an online softmax in
// float32 (SIMD row passes, attention_simd.h) masks the tile: prefix slots that hold no token, slots
// before a row's sliding window (positions count tokens, so a window starts at a slot found by a search
// over the valid-slot counts), and in the tree tile the nodes that are not ancestors. Tiles that no
// row can see are skipped. With few (request, head) pairs the keys are split across threads and the
// partial softmaxes merged. Masked keys are replaced by -inf, never added to, and a tile whose hidden
// values are not all finite keeps them out of the product, so what a row does not see (a slot of a
// fresh torch.empty cache, a padding node) never enters it; a NaN or +inf score or sink a row does see
// poisons it (NaN output).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#define SPECOPS_ISA_HEADER "attention_simd.h"
#include "per_isa.h"
#undef SPECOPS_ISA_HEADER

namespace specops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kTile = 256;  // keys per tile

struct RowPasses {
  float (*prepare_row)(float*, int64_t, float, float, const float*, int64_t);
  float (*exp_row)(float*, int64_t, float);
  void (*scale_row)(float*, int64_t, float);
};

const RowPasses& passes() {
  static const RowPasses selected = [] {
    switch (cpu_isa()) {
#ifdef SPECOPS_X86_DISPATCH
      case Isa::avx512: return RowPasses{avx512::prepare_row, avx512::exp_row, avx512::scale_row};
      case Isa::avx2: return RowPasses{avx2::prepare_row, avx2::exp_row, avx2::scale_row};
#endif
      default: return RowPasses{base::prepare_row, base::exp_row, base::scale_row};
    }
  }();
  return selected;
}

// The mask's value checks (ops.py makes the same ones on accelerators).
void check_tree_mask(const int32_t* mask, int64_t batch, int64_t nodes, int64_t words) {
  const int spare = static_cast<int>(32 * words - nodes);
  const uint32_t high = spare ? ~((uint32_t{1} << (32 - spare)) - 1) : 0u;
  for (int64_t r = 0; r < batch * nodes; ++r) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(mask + r * words);
    TORCH_CHECK_VALUE(!(row[words - 1] & high), "tree_attention: tree_mask has a bit set at or past node N = ",
                      nodes);
    const int64_t i = r % nodes;
    TORCH_CHECK_VALUE((row[i >> 5] >> (i & 31)) & 1u,
                      "tree_attention: tree_mask has a node that does not see itself (its own bit is clear)");
  }
}

// Whether n floats are all finite (no NaN or inf): an exponent field that is not all ones.
bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

// Per request: the number of valid prefix slots before each slot (count[t], t in [0, prefix]) and each
// node's depth (popcount of its row, minus one).
struct Layout {
  std::vector<int64_t> count;  // [B, prefix + 1]
  std::vector<int64_t> depth;  // [B, N]
};

Layout layout(const bool* kv_mask, const int32_t* tree_mask, int64_t batch, int64_t prefix, int64_t nodes,
              int64_t words) {
  Layout out;
  out.count.resize(static_cast<size_t>(batch * (prefix + 1)));
  out.depth.resize(static_cast<size_t>(batch * nodes));
  for (int64_t b = 0; b < batch; ++b) {
    int64_t* count = out.count.data() + b * (prefix + 1);
    count[0] = 0;
    for (int64_t t = 0; t < prefix; ++t) count[t + 1] = count[t] + (kv_mask[b * prefix + t] ? 1 : 0);
    for (int64_t i = 0; i < nodes; ++i) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(tree_mask + (b * nodes + i) * words);
      int64_t bits = 0;
      for (int64_t w = 0; w < words; ++w) bits += std::popcount(row[w]);
      out.depth[static_cast<size_t>(b * nodes + i)] = bits - 1;
    }
  }
  return out;
}

// The first prefix slot node i may see under a window: positions count valid slots, so the first slot t
// with count[t] >= P + depth - window + 1 (count is non-decreasing: a binary search).
int64_t window_start(const int64_t* count, int64_t prefix, int64_t depth, int64_t window) {
  if (window <= 0) return 0;
  const int64_t need = count[prefix] + depth - window + 1;
  if (need <= 0) return 0;
  return std::lower_bound(count, count + prefix + 1, need) - count;
}

struct Problem {
  at::Tensor query, key, value;  // [B, Hq, N, D], [B, Hkv, S, D]
  const int32_t* tree_mask;
  const bool* kv_mask;
  const float* sinks;  // [Hq] or nullptr
  int64_t batch, heads, kv_heads, group, nodes, slots, prefix, dim, words, window;
  float scale, softcap;
  Layout rows;
};

// Partial softmax state of one task: per query row the running maximum, the sum and the accumulator.
struct Partial {
  float* max;  // [R]
  float* sum;  // [R]
  float* acc;  // [R, D]
};

// One task: request b, key/value head g, prefix slots [begin, end), and the tree (and the sinks, counted
// once per row) when `tree` is set. One function: the rows' running maximum, sum and output carry from the
// prefix's slots into the tree's, as in the Triton kernel.
void run_task(const Problem& p, int64_t b, int64_t g, int64_t begin, int64_t end, bool tree, Partial out) {
  const RowPasses& f = passes();
  const int64_t rows = p.group * p.nodes, dim = p.dim;
  const at::Tensor q = p.query[b].narrow(0, g * p.group, p.group).reshape({rows, dim}).to(at::kFloat);
  const at::Tensor keys = p.key[b][g], values = p.value[b][g];
  const bool convert = p.key.scalar_type() != at::kFloat;
  at::Tensor acc = at::from_blob(out.acc, {rows, dim}, q.options());
  acc.zero_();
  const int64_t* count = p.rows.count.data() + b * (p.prefix + 1);
  const int64_t* depth = p.rows.depth.data() + b * p.nodes;
  std::vector<int64_t> start(static_cast<size_t>(p.nodes));
  int64_t first = end, last_start = 0;
  for (int64_t i = 0; i < p.nodes; ++i) {
    start[i] = window_start(count, p.prefix, depth[i], p.window);
    first = std::min(first, std::max(start[i], begin));
    last_start = std::max(last_start, start[i]);
  }
  const bool sink = tree && p.sinks != nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    // A NaN or +inf sink leaves no softmax: the row starts poisoned (max NaN), as a NaN score does below.
    const float logit = sink ? p.sinks[g * p.group + r / p.nodes] : kNegInf;
    out.max[r] = logit < kInf ? logit : kNaN;
    out.sum[r] = sink ? 1.0f : 0.0f;  // the sink's own weight, exp(sink - max)
  }
  // Keys [first, stop) in tiles of kTile; a tile may hold the end of the prefix and the tree's nodes.
  const int64_t stop = tree ? p.slots : end;
  std::vector<float> shared(static_cast<size_t>(kTile)), own(static_cast<size_t>(kTile));
  std::vector<float> scores(static_cast<size_t>(rows * kTile));
  const int32_t* words = p.tree_mask + b * p.nodes * p.words;
  float* acc_data = acc.data_ptr<float>();
  // Whether row i sees column j of the tile at t0 (prefix columns before in_prefix, tree columns from
  // tree_from): what the masks below say, for the values' slow path.
  const auto sees = [&](int64_t i, int64_t t0, int64_t j, int64_t in_prefix, int64_t tree_from) {
    if (j < in_prefix) return p.kv_mask[b * p.prefix + t0 + j] && t0 + j >= start[i];
    if (j < tree_from) return false;
    const int64_t node = t0 + j - p.prefix;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(words + i * p.words);
    return ((bits[node >> 5] >> (node & 31)) & 1u) && (p.window <= 0 || depth[i] - depth[node] < p.window);
  };
  for (int64_t t0 = first; t0 < stop; t0 += kTile) {
    const int64_t width = std::min(kTile, stop - t0);
    const int64_t in_prefix = std::clamp<int64_t>(end - t0, 0, width);  // columns before the tree
    const int64_t tree_from = std::clamp<int64_t>(p.prefix - t0, 0, width);
    const bool has_tree = tree_from < width;
    if (!has_tree && count[t0 + in_prefix] == count[t0]) continue;  // no token in the tile
    // The prefix columns' mask, the same for every row (slots without a token).
    bool full = true;
    for (int64_t j = 0; j < in_prefix; ++j) {
      shared[j] = p.kv_mask[b * p.prefix + t0 + j] ? 0.0f : kNegInf;
      full = full && shared[j] == 0.0f;
    }
    for (int64_t j = in_prefix; j < tree_from; ++j) shared[j] = kNegInf;  // another split's prefix
    full = full && in_prefix == tree_from && !has_tree;
    at::Tensor k = keys.narrow(0, t0, width), v = values.narrow(0, t0, width);
    if (convert) {
      k = k.to(at::kFloat);
      v = v.to(at::kFloat);
    }
    at::Tensor s = at::from_blob(scores.data(), {rows, width}, q.options());
    at::mm_out(s, q, k.t());
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % p.nodes;
      float* row = scores.data() + r * width;
      if (std::isnan(out.max[r])) {  // poisoned: its output is NaN whatever follows
        std::fill(row, row + width, 0.0f);
        continue;
      }
      const float* bias = full ? nullptr : shared.data();
      if (has_tree) {  // this row's own mask over the nodes: its ancestors (within the window)
        std::copy(shared.begin(), shared.begin() + tree_from, own.begin());
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(words + i * p.words);
        for (int64_t j = tree_from; j < width; ++j) {
          const int64_t node = t0 + j - p.prefix;
          const bool seen = (bits[node >> 5] >> (node & 31)) & 1u;
          own[j] = seen && (p.window <= 0 || depth[i] - depth[node] < p.window) ? 0.0f : kNegInf;
        }
        bias = own.data();
      }
      const float m = f.prepare_row(row, width, p.scale, p.softcap, bias,
                                    std::min(in_prefix, std::max<int64_t>(0, start[i] - t0)));
      const float old = out.max[r];
      const float top = std::max(old, m);
      if (m == kNegInf || !(m < kInf)) {  // nothing visible in this tile, or a NaN / +inf score: poisoned
        if (m != kNegInf) out.max[r] = kNaN;
        std::fill(row, row + width, 0.0f);
        continue;
      }
      any = true;
      const float rescale = old == kNegInf ? 0.0f : std::exp(old - top);
      if (rescale != 1.0f) f.scale_row(acc_data + r * dim, dim, rescale);
      out.sum[r] = out.sum[r] * rescale + f.exp_row(row, width, top);
      out.max[r] = top;
    }
    if (!any) continue;
    // A column some row does not see may hold anything (an uninitialized slot, a padding node): where
    // such a tile's values are not all finite, the product takes them as 0 and the rows that see one
    // add it alone, so that p = 0 never multiplies a NaN or inf into a row that does not see it.
    const bool partial = !full || last_start > t0;
    if (!partial || all_finite(v.data_ptr<float>(), width * dim)) {
      acc.addmm_(s, v);
      continue;
    }
    const at::Tensor finite = v.isfinite();
    acc.addmm_(s, at::where(finite, v, at::zeros({}, v.options())));
    const at::Tensor bad_keys = finite.logical_not().any(1);
    const bool* bad = bad_keys.data_ptr<bool>();
    const float* vd = v.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      if (std::isnan(out.max[r])) continue;
      for (int64_t j = 0; j < width; ++j) {
        if (!bad[j] || !sees(r % p.nodes, t0, j, in_prefix, tree_from)) continue;
        const float w = scores[r * width + j];
        for (int64_t d = 0; d < dim; ++d) {
          if (!std::isfinite(vd[j * dim + d])) acc_data[r * dim + d] += w * vd[j * dim + d];
        }
      }
    }
  }
}

at::Tensor tree_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& tree_mask, const at::Tensor& kv_mask, double scale, int64_t window,
                              double softcap, const std::optional<at::Tensor>& sinks, bool validate) {
  TORCH_CHECK_VALUE(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "tree_attention: query, key and value must be 4-D");
  const int64_t batch = query.size(0), heads = query.size(1), nodes = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), slots = key.size(2);
  const int64_t words = (nodes + 31) / 32;
  TORCH_CHECK_VALUE(nodes >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && slots >= nodes,
              "tree_attention: need N >= 1, Hq a multiple of Hkv and S >= N");
  TORCH_CHECK_VALUE(key.sizes() == at::IntArrayRef({batch, kv_heads, slots, dim}) && value.sizes() == key.sizes(),
              "tree_attention: key and value must be [B, Hkv, S, D]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "tree_attention: query must be float32, bfloat16 or float16");
  TORCH_CHECK_TYPE(key.scalar_type() == dtype && value.scalar_type() == dtype,
                   "tree_attention: key and value must have query's dtype");
  TORCH_CHECK_VALUE(tree_mask.scalar_type() == at::kInt && tree_mask.sizes() == at::IntArrayRef({batch, nodes, words}),
              "tree_attention: tree_mask must be [B, N, ceil(N/32)] int32");
  TORCH_CHECK_VALUE(kv_mask.scalar_type() == at::kBool && kv_mask.sizes() == at::IntArrayRef({batch, slots - nodes}),
              "tree_attention: kv_mask must be [B, S - N] bool");
  TORCH_CHECK_VALUE(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                                      sinks->size(0) == heads),
              "tree_attention: sinks must be a float32 [Hq] tensor");
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(scale)) && scale > 0.0,
                    "tree_attention: scale must be finite and > 0, got ", scale);
  TORCH_CHECK_VALUE(window >= 0, "tree_attention: window must be >= 0 (0: no window), got ", window);
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(softcap)) && softcap >= 0.0,
                    "tree_attention: softcap must be finite and >= 0 (0: no soft-cap), got ", softcap);
  // An empty batch (or no query heads) has nothing to compute; the key splits below divide by B * Hkv.
  if (batch == 0 || heads == 0) return at::empty({batch, heads, nodes, dim}, query.options());
  const at::Tensor mask = tree_mask.contiguous(), valid = kv_mask.contiguous();
  const at::Tensor sink = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  if (validate) check_tree_mask(mask.data_ptr<int32_t>(), batch, nodes, words);

  Problem p{query.contiguous(), key.contiguous(), value.contiguous(), mask.data_ptr<int32_t>(),
            valid.data_ptr<bool>(), sink.defined() ? sink.data_ptr<float>() : nullptr,
            batch, heads, kv_heads, heads / kv_heads, nodes, slots, slots - nodes, dim, words, window,
            static_cast<float>(scale), static_cast<float>(softcap), {}};
  p.rows = layout(p.kv_mask, p.tree_mask, batch, p.prefix, nodes, words);

  // Split the prefix across tasks when (request, head) pairs alone would leave threads idle.
  const int64_t pairs = batch * kv_heads;
  const int64_t tiles = std::max<int64_t>(1, (p.prefix + kTile - 1) / kTile);
  const int64_t splits = std::min(tiles, std::max<int64_t>(1, (2 * at::get_num_threads() + pairs - 1) / pairs));
  const int64_t per_split = (tiles + splits - 1) / splits * kTile;
  const int64_t rows = p.group * nodes;
  auto f32 = query.options().dtype(at::kFloat);
  at::Tensor max = at::empty({pairs, splits, rows}, f32), sum = at::empty({pairs, splits, rows}, f32);
  at::Tensor acc = at::empty({pairs, splits, rows, dim}, f32);
  at::parallel_for(0, pairs * splits, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t pair = task / splits, split = task % splits;
      const int64_t begin = std::min(p.prefix, split * per_split);
      const int64_t end = std::min(p.prefix, begin + per_split);
      Partial part{max.data_ptr<float>() + task * rows, sum.data_ptr<float>() + task * rows,
                   acc.data_ptr<float>() + task * rows * dim};
      run_task(p, pair / kv_heads, pair % kv_heads, begin, end, split == splits - 1, part);
    }
  });

  // Merge the splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s; a row that saw nothing is 0,
  // a poisoned one (a NaN / +inf score or sink) NaN.
  at::Tensor out = at::empty({batch, heads, nodes, dim}, f32);
  float* out_data = out.data_ptr<float>();
  const float* max_data = max.data_ptr<float>();
  const float* sum_data = sum.data_ptr<float>();
  const float* acc_data = acc.data_ptr<float>();
  at::parallel_for(0, pairs * rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t index = lo; index < hi; ++index) {
      const int64_t pair = index / rows, r = index % rows;
      float top = kNegInf;
      bool poisoned = false;
      for (int64_t s = 0; s < splits; ++s) {
        const float m = max_data[(pair * splits + s) * rows + r];
        poisoned = poisoned || std::isnan(m);
        top = std::max(top, m);
      }
      float* dst = out_data + index * dim;  // pair-major rows are [B, Hkv, G, N] = [B, Hq, N] order
      std::fill(dst, dst + dim, poisoned ? kNaN : 0.0f);
      if (poisoned || top == kNegInf) continue;
      float total = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (pair * splits + s) * rows + r;
        const float m = max_data[at];
        if (m == kNegInf) continue;
        const float w = std::exp(m - top);
        total += w * sum_data[at];
        const float* src = acc_data + at * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] += w * src[d];
      }
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < dim; ++d) dst[d] *= inverse;
    }
  });
  return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(specops, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace specops

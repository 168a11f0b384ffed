// skinny_linear's products for another kernel of this library (llama_layers): several weights against the
// same few input rows in one pass over the threads, their outputs side by side in one buffer.
#pragma once

#include <cstdint>

namespace specops {

// `rows` weight rows of k floats each, dense, at `data`; `bias`: `rows` floats added to its outputs, or nullptr.
struct SkinnyWeight {
  const float* data;
  int64_t rows;
  const float* bias;
};

// out[r * ldo + c] = dot(x row r, row c of the weights in order) (+ that row's bias) for r < m, c < their total
// rows: weight i's outputs start at the column after weight i - 1's. x [m, k_dim] dense; ldo >= the total
// rows; 1 to 8 weights. Each output is the bits skinny_linear gives for that weight alone (the same dot
// product, whatever sits beside it, then its bias added in one rounding), so fusing a layer's q, k and v, or
// gate and up, into one call changes no result. The threads split the weights' panels of 16 rows as if the
// weights were one: one parallel region, the next panel prefetched across a weight's end, no concatenated
// copy of weights or outputs.
void skinny_products(const float* x, int64_t m, int64_t k_dim, const SkinnyWeight* weights, int64_t count,
                     float* out, int64_t ldo);

}  // namespace specops

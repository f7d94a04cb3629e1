// The non-GPU logic of the down projection's tensor-core path (fused_concat_down_proj.cuh), tested on
// the CPU by csrc/tests/test_topk.cpp: the work plan and the mma.m16n8k16 fragment mapping.
//
// The mma computes Y^T tiles: A = X (16 tokens x 16 k, the concat rows), B = W^T (16 k x 8 weight rows),
// D = 16 tokens x 8 weight rows, fp32. Each lane loads its operands straight from global memory with
// one 16-byte load per row and 32-wide k step, at k = 8 * (lane % 4): the 8 elements are used as the
// lane's k slots of two k16 mmas. That assigns physical k to the mma's logical k by a permutation, the
// same one for A and B, so the sum over k is unchanged (only its fp32 order differs), and no shared
// memory or ldmatrix is needed: the weight stream is plain coalesced 16-byte loads (a row's 64 bytes
// per 4 lanes), like a GEMV's, with the tensor cores doing the multiply-adds.
#pragma once

#include "gemma4_mtp/host_device.h"

namespace gemma4_mtp {

constexpr int kMmaStepK = 32;   // k per step: one 16-byte load per lane and row
constexpr int kMmaRowTiles = 4;  // n8 tiles per CTA: 32 weight rows
constexpr int kMmaRowsPerCta = 8 * kMmaRowTiles;
constexpr int kMmaWarps = 8;     // a CTA's warps split its k steps

// Physical k offset (within a step) of the 8 elements a lane loads.
G4_HD int mma_lane_k(int lane) { return 8 * (lane & 3); }

// A fragment register r (0..3) of the k16 half kb (0, 1): the token row (0..15) it holds and the index
// of its first element among the lane's 8 loaded ones (PTX: a0 row g, a1 row g + 8, a2 row g with the
// upper k pair, a3 row g + 8 with the upper k pair; g = lane / 4).
G4_HD int mma_a_row(int lane, int r) { return (lane >> 2) + ((r & 1) ? 8 : 0); }
G4_HD int mma_a_elem(int kb, int r) { return 4 * kb + ((r & 2) ? 2 : 0); }

// B fragment register r (0, 1) of half kb: weight row g of the n8 tile, elements 4 kb + 2 r, + 1.
G4_HD int mma_b_row(int lane) { return lane >> 2; }
G4_HD int mma_b_elem(int kb, int r) { return 4 * kb + 2 * r; }

// Accumulator c (0..3): token row and weight row within the 16 x 8 tile.
G4_HD int mma_c_token(int lane, int c) { return (lane >> 2) + (c >= 2 ? 8 : 0); }
G4_HD int mma_c_row(int lane, int c) { return 2 * (lane & 3) + (c & 1); }

struct DownProjPlan {
  int token_tiles_m16;  // m16 tiles of tokens per CTA (1..4): the kernel template
  int token_tiles;      // CTAs along the tokens
  int row_tiles;        // CTAs along the weight rows (32 each)
  int splits;           // CTAs along k; > 1: fp32 partials and a last-CTA reduction per tile
  int steps_per_split;  // 32-wide k steps per split
};

// Tiles of at most 64 tokens (4 m16 tiles), 32 weight rows; k split until the grid has about one CTA per
// SM (a CTA keeps 32-64 KB of loads in flight, ~200 registers per thread), never below one step per
// warp.
inline DownProjPlan plan_down_proj(int64_t T, int64_t Hb, int64_t Hd, int num_sms) {
  DownProjPlan p{};
  p.token_tiles_m16 = static_cast<int>(min64(4, max64(1, ceil_div(T, 16))));
  p.token_tiles = static_cast<int>(ceil_div(max64(T, 1), 16 * p.token_tiles_m16));
  p.row_tiles = static_cast<int>(ceil_div(max64(Hd, 1), kMmaRowsPerCta));
  const int64_t steps = ceil_div(2 * Hb, kMmaStepK);
  const int64_t tiles = static_cast<int64_t>(p.row_tiles) * p.token_tiles;
  const int64_t splits = max64(1, min64(num_sms / tiles, steps / kMmaWarps));
  p.steps_per_split = static_cast<int>(max64(1, ceil_div(steps, splits)));
  p.splits = static_cast<int>(max64(1, ceil_div(steps, p.steps_per_split)));
  return p;
}

// Counters a launch needs (one per output tile when the k range is split).
G4_HD int64_t down_proj_counters(const DownProjPlan& p) {
  return p.splits > 1 ? static_cast<int64_t>(p.row_tiles) * p.token_tiles : 0;
}

}  // namespace gemma4_mtp
